"""Symmetric device groups: k identical pipelines beyond the block enumeration.

The enumeration (:mod:`eth.planner.enumerate`) cuts each type's devices into at most
``max_blocks_per_type`` blocks, so on 512-1024 devices a pipeline holds at least one
block (32-128 devices) of a type, and DP (Eq. 10) takes over after a few pipeline counts.
Many identical mixed pipelines -- e.g. 16 pipelines of 16 910B2 + 16 910B3 on 512
devices, HexiScale's shape -- are then out of reach although they lie in HPP's space.

:func:`evaluate_count` (one per pipeline count) and :func:`descend_best` add them, after the
enumeration and beside the final polish (:func:`eth.planner.finish.finish` runs them).
For every pipeline count k > 1 that divides every type's device count (and k <= Gbs,
``max_pipelines``), the *symmetric group* is k copies of one pipeline with count_t / k
devices of each type.  It is evaluated on its own block granularity (one block = one
pipeline's devices of a type, so the pipeline is the block vector (1, ..., 1)) by a
sibling :class:`eth.planner.search.HPPSearch` that shares the search's cost model,
evaluator, clock, phase timer and statistics (:func:`_evaluate`):

1. the normal three phases (:meth:`HPPSearch.evaluate_group`): phase 1 plans the
   pipeline once for B = Gbs and the cache reuses it for all k copies, phase 2 allocates
   the Lbs, phase 3 refines;
2. phase 1 for B = Gbs / k (when k divides Gbs: Eq. 1's bubble is then that of the
   micro-batches the pipeline really runs), and each of its stage groups' configurations
   copied k times and allocated (:func:`_copies`), then finer Mbs;
3. for the ``polish_top`` best groups within ``refine_margin`` of the best plan so far:
   a steepest descent that applies one move to every pipeline at once (:func:`_descend`;
   :func:`eth.planner.polish.pipeline_moves` and :func:`layer_moves`, which moves a layer
   between any two stages: the group's Eq. 5 charges each stage's All-Reduce after its
   backward tail, which the balancer's Eq. 1 does not see), scored by the whole group's
   allocation, then the exact allocation with free Mbs
   (:func:`eth.planner.polish.variant_allocation`).

A pipeline count is left out when the enumeration already visited that symmetric group in
the search's own blocks (k divides every block count, k was counted before DP took over
and before the patience stop cut a pipeline count short, no time limit), and k = 1 (the
one-pipeline group is the enumeration's first).  The best
candidate replaces the search's best only if it is predicted faster, so the phase can only
improve the plan; ``plan.search["symmetric"]`` records the counts tried, each one's
predicted ms and the count that won (0: none).
"""
from __future__ import annotations

import math

from eth.planner.enumerate import Blocks, make_blocks
from eth.planner.evaluate import pipe_state
from eth.planner.pipeline import PipelineResult
from eth.planner.polish import (Candidate, better_trial, finer_microbatches, lightest,
                                pipeline_moves, variant_allocation)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def symmetric_counts(search) -> list[tuple[int, tuple[int, ...]]]:
    """(k, devices per type of one pipeline) of every symmetric group the phase evaluates
    (see the module docstring for which k are left out), ascending k."""
    unit = make_blocks(search.cluster, search.cluster.world_size)   # one device per block
    opt, stats = search.opt, search.stats
    limit = min(opt.gbs, opt.max_pipelines or opt.gbs)
    out = []
    for k in divisors(math.gcd(*unit.count)):
        if k == 1 or k > limit:
            continue
        in_blocks = all(c % k == 0 for c in search.blocks.count)
        visited = (k <= stats.counted_pipelines and not stats.time_limited
                   and (not stats.dp_triggered_at or k < stats.dp_triggered_at)
                   and (not stats.patience_at or k < stats.patience_at))
        if in_blocks and visited:
            continue
        out.append((k, tuple(c // k for c in unit.count)))
    return out


def _sibling(search, blocks: Blocks):
    """An HPPSearch (``search``'s class) over ``blocks`` sharing ``search``'s cost model,
    evaluator, clock, phase timer, statistics, stop callable and any attribute set after
    construction; its caches are keyed by block vectors, so they are its own."""
    child = type(search)(search.model, search.cluster, search.cost.profiles, search.opt)
    for name, value in vars(search).items():    # what a subclass set outside __init__
        if name not in vars(child):
            setattr(child, name, value)
    child.cost, child.ev = search.cost, search.ev
    child.clock, child.phases, child.stats = search.clock, search.phases, search.stats
    child.stop = search.stop    # the time check of that clock and those statistics
    child.blocks = blocks
    return child


def _copies(search, results, k: int) -> Candidate | None:
    """The group of k copies of each of ``results`` (one pipeline's configurations) at the
    phase-2 allocation; the fastest, or None."""
    best = None
    for r in results:
        if search.out_of_time():
            break
        got = search.allocate([r] * k)
        if got is not None and (best is None or got[1] < best.iteration_ms * (1 - 1e-9)):
            best = Candidate(got[0], got[1], [r] * k)
    return best


def _evaluate(child, vec, k: int, best_ms: float = math.inf) -> Candidate | None:
    """The symmetric group of k copies of ``vec`` in ``child``'s blocks: the normal three
    phases (phase 1 for Gbs), and every stage group's configuration planned for the
    even share Gbs / k (phase 1 with B = Lbs, where Eq. 1's bubble is that of the real
    micro-batch count) copied k times; the fastest after finer Mbs, offered to ``child``.

    The alternatives of the share's phase 1 are copied only when its best configuration
    is faster than ``best_ms`` (the search's best plan): every alternative's Eq. 1 at
    Gbs / k with its own All-Reduce is at least that configuration's, and k copies run
    at least one of them on Gbs / k samples or more, so none could be faster."""
    found = [c for c in [child.evaluate_group((vec,) * k)] if c is not None]
    gbs = child.opt.gbs
    if gbs % k == 0 and not child.out_of_time():
        r = child.phase1(vec, batch=gbs // k)
        if r is not None and r.feasible:
            others = r.alternatives if r.evaluation.ms < best_ms else ()
            cand = _copies(child, [r, *others], k)
            if cand is not None:
                found.append(finer_microbatches(child, cand))
    if not found:
        return None
    best = min(found, key=lambda c: c.iteration_ms)
    child._consider(best)
    return best


def layer_moves(r: PipelineResult):
    """One layer from any stage to any stage that is not its neighbour (the neighbour
    moves are :func:`eth.planner.polish.pipeline_moves`'): the group's Eq. 5 also weighs
    each stage's All-Reduce after its backward tail (AR^j of the first stages waits for
    the longest tail), which a single neighbour move across equal stages cannot lower."""
    stages = r.state.stages
    for a in range(len(stages)):
        if stages[a].layers > 1:
            for b in range(len(stages)):
                if abs(b - a) > 1:
                    new = list(stages)
                    new[a] = stages[a].with_layers(stages[a].layers - 1)
                    new[b] = stages[b].with_layers(stages[b].layers + 1)
                    yield pipe_state(tuple(new), r.state.mbs)


def _descend(search, cand: Candidate, budget: int) -> Candidate:
    """Steepest descent over :func:`eth.planner.polish.pipeline_moves` applied to every
    pipeline at once (the group stays symmetric), scored by the group's allocation;
    for groups of identical pipelines, whose one-pipeline moves gain little alone."""
    spent = 0
    while spent < budget and not search.out_of_time():
        first, lbs = cand.results[0], cand.plan.pipelines[0].lbs
        if any(r.state != first.state or r.group != first.group for r in cand.results):
            return cand
        best = None
        for state in [*pipeline_moves(search.ev, first), *layer_moves(first)]:
            if spent >= budget or search.out_of_time():
                break
            e = search.ev.evaluate(state, lbs, first.ranks)
            if not e.feasible:
                continue
            spent += 1
            trial = [PipelineResult(first.vec, lbs, first.group, state, e, first.ranks)] * len(cand.results)
            best = better_trial(search, trial, best, cand)
        if best is None:
            break
        cand = best
    return cand


DESCENT_BUDGET = 4
"""The symmetric descent may spend this many times ``polish_budget`` group evaluations
on each polished symmetric group.  The general polish (:func:`eth.planner.polish.polish`)
is not run on these groups: its moves change one pipeline of k identical ones, which
rarely pays, and its re-plans cost much on 512-1024 devices."""


def _blocks(search, k: int, per) -> Blocks:
    unit = make_blocks(search.cluster, search.cluster.world_size)
    return Blocks(unit.types, per, (k,) * len(per), unit.ranks, unit.nodes)


def evaluate_count(search, k: int, per) -> Candidate | None:
    """The symmetric group of k pipelines of ``per`` devices per type (:func:`_evaluate`
    in a sibling search), or None.  Reads nothing the search changes but its caches and
    its best so far (so it may run in a forked process, :mod:`eth.planner.workers`)."""
    child = _sibling(search, _blocks(search, k, per))
    vec = (1,) * len(per)
    best_ms = search.best.iteration_ms if search.best is not None else math.inf
    return _evaluate(child, vec, k, best_ms) if child.can_hold(vec) else None


def may_descend(search, cand: Candidate | None) -> bool:
    """Whether :func:`descend_best` may descend ``cand`` whatever the other counts' candidates
    are: it is within ``refine_margin`` of the search's best plan (the bar that
    :func:`descend_best` lowers to its best candidate's time when that is faster).  The
    finish descends such a candidate as soon as it is evaluated (:func:`descend`), beside
    the other counts and the polish, and :func:`descend_best` reads the result."""
    if cand is None or search.out_of_time():
        return False
    return search.best is None or cand.iteration_ms <= search.best.iteration_ms * (1 + search.opt.refine_margin)


def descend(search, k: int, per, cand: Candidate) -> Candidate:
    """The symmetric descent (:func:`_descend`) of the group of k pipelines of ``per``
    devices per type, then its free-Mbs allocation: the faster of that and ``cand``."""
    child = _sibling(search, _blocks(search, k, per))
    better = _descend(child, cand, DESCENT_BUDGET * search.opt.polish_budget)
    final = None if search.out_of_time() else variant_allocation(child, better.results)
    if final is not None and final.iteration_ms < better.iteration_ms:
        better = final
    return better if better.iteration_ms < cand.iteration_ms else cand


def descend_best(search, tried) -> tuple[dict, list[tuple[int, Candidate]]]:
    """The symmetric descent of the ``polish_top`` best of ``tried`` ((k, devices per
    type, :func:`evaluate_count`'s candidate, its :func:`descend` result or None when not
    done yet), ascending k) within ``refine_margin`` of the best plan so far: the record
    for ``plan.search["symmetric"]`` (the pipeline counts tried, the predicted ms of each
    after the descent where descended, null: no feasible plan) and the (k, candidate)
    found, for :func:`adopt`."""
    record = {"pipelines": [k for k, _, _, _ in tried],
              "ms": {str(k): round(c.iteration_ms, 4) if c is not None else None for k, _, c, _ in tried}}
    found = sorted(((k, per, c, d) for k, per, c, d in tried if c is not None), key=lambda x: x[2].iteration_ms)
    bar = min([search.best.iteration_ms] if search.best is not None else [], default=math.inf)
    if found:
        bar = min(bar, found[0][2].iteration_ms) * (1 + search.opt.refine_margin)
    out = [(k, cand) for k, _, cand, _ in found]
    for i, (k, per, cand, done) in enumerate(found):
        if i >= search.opt.polish_top or cand.iteration_ms > bar or search.out_of_time():
            break
        better = done if done is not None else descend(search, k, per, cand)
        if better.iteration_ms < cand.iteration_ms:
            out[i] = (k, better)
            record["ms"][str(k)] = round(better.iteration_ms, 4)
    return record, out


def adopt(search, record: dict, found: list[tuple[int, Candidate]]) -> dict:
    """Make a symmetric group the search's best where it is faster, with the least
    recompute that fits (:func:`eth.planner.polish.lightest`, as a polished group gets);
    ``record`` with "won", the count whose plan became the best (0: none)."""
    record = dict(record, won=0)
    for k, cand in found:
        if search.best is None or cand.iteration_ms < search.best.iteration_ms * (1 - 1e-9):
            search.best = lightest(search, cand)
            record["won"] = k
    return record
