"""Group-level steps after phase 2: finer micro-batches, free-Mbs allocation, polishing.

Phases 1 and 3 optimise each pipeline alone (Eq. 1 plus its own All-Reduce).  Three
couplings are invisible there and are handled on the whole device group, scored by the
allocation (Eq. 2-5) and :meth:`eth.cost.model.CostModel.evaluate` (Eq. 5 + Eq. 6):

* :func:`finer_microbatches` -- Lbs_i must be a multiple of Mbs_i, so the large Mbs that a
  lone pipeline prefers can leave the allocation coarse; halve one pipeline's Mbs (or
  all at once) while the re-allocated Eq. 2 improves.
* :func:`variant_allocation` -- exact Eq. 2-4 in which each pipeline's Mbs is free among
  halvings/doublings of its own (:func:`eth.planner.allocate.allocate_with_variants`);
  used when the phase-1 Mbs admit no exact split, and at the end.
* :func:`polish` -- for the best few groups: steepest descent over single moves of one
  pipeline (Mbs x2 / 2; tp x2 / 2 of one stage, also together with Mbs / 2, or of every
  stage at once; one layer between adjacent stages) and over group moves (one or every
  pipeline's stage order reversed), each scored by the whole group's re-allocated Eq. 2,
  because the block-wise All-Reduce (Eq. 6) of a layer depends on the dp degrees and
  links of *every* pipeline's stage holding it -- where no move improves, the best few
  are also scored with free Mbs; then each pipeline's best stage device groups of phase 1
  (its result and alternatives at Gbs) are re-balanced for its own Lbs (phase 3) and
  tried in the group context; finally the best
  group's recompute is cut to the least that fits (:func:`lighter_recompute`).
  With ``prune`` a move is allocated only where a lower bound of the group's time
  (:func:`allocation_floor`: the pipelines' Eq. 5 lines without All-Reduce, relaxed
  allocation) is below the best so far or the move may rank among those also scored with
  free Mbs (:class:`_Scan`): the same steps, fewer allocations.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace

from eth.spec.model import layer_ops
from eth.spec.plan import Plan
from eth.planner.allocate import alloc_key, allocate_with_variants, pipeline_line
from eth.planner.balance import joint_moves
from eth.planner.enumerate import StageGroup, plan_tp_in_nodes
from eth.planner.evaluate import pipe_state
from eth.planner.pipeline import PipelineResult, stage_ranks


@dataclass
class Candidate:
    """A fully allocated device group: plan, predicted iteration time, per-pipeline configs."""

    plan: Plan
    iteration_ms: float
    results: list[PipelineResult]


def _halved(search, r: PipelineResult, lbs: int) -> PipelineResult | None:
    half = r.state.mbs // 2
    if r.state.mbs % 2 or any(half % st.dp for st in r.state.stages):
        return None
    state = replace(r.state, mbs=half)
    e = search.ev.evaluate(state, lbs, r.ranks)
    return PipelineResult(r.vec, lbs, r.group, state, e, r.ranks) if e.feasible else None


def finer_microbatches(search, cand: Candidate) -> Candidate:
    """Halve Mbs (of one pipeline, or of all at once) while re-allocation lowers Eq. 2
    (and the search's time limit is not reached)."""
    while not search.out_of_time():
        halved = [_halved(search, r, p.lbs) for r, p in zip(cand.results, cand.plan.pipelines)]
        moves = [[i] for i, h in enumerate(halved) if h is not None]
        if len(moves) > 1:
            moves.append([m[0] for m in moves])
        best = None
        for move in moves:
            trial = list(cand.results)
            for i in move:
                trial[i] = halved[i]
            got = search.allocate(trial)
            if got is not None and got[1] < (best or cand).iteration_ms * (1 - 1e-9):
                best = Candidate(got[0], got[1], trial)
        if best is None:
            return cand
        cand = best
    return cand


def variant_allocation(search, results: list[PipelineResult]) -> Candidate | None:
    """Exact Eq. 2-4 with each pipeline's Mbs free among halvings/doublings of its own.

    With ``memo`` (:class:`eth.planner.options.SearchOptions`) the answer is kept per
    :func:`eth.planner.allocate.alloc_key` of ``results`` without their batches (it
    re-evaluates every state at Gbs and reads neither Lbs nor evaluation; 52 of 95 calls on GPT-3 13B / 64
    devices repeat one: the polish's re-plan offers the same groups again)."""
    if not search.opt.memo:
        return _variant_allocation(search, results)
    key = alloc_key(results, batch=False)   # the variants are evaluated at Gbs afresh
    if key not in search.variants:
        search.variants[key] = _variant_allocation(search, results)
    return search.variants[key]


def _variant_allocation(search, results: list[PipelineResult]) -> Candidate | None:
    gbs = search.opt.gbs
    ar = search.allreduce_ms(results, search.build_plan(results, [r.state.mbs for r in results]))
    options, variants = [], []
    for r, a in zip(results, ar):
        base = math.lcm(*[st.dp for st in r.state.stages])
        sizes, m = set(), r.state.mbs
        while m >= base and m % base == 0:
            sizes.add(m)
            if m % 2:
                break
            m //= 2
        sizes |= {r.state.mbs * 2, r.state.mbs * 4}
        opts, vs = [], []
        for m in sorted(x for x in sizes if x <= gbs):
            state = replace(r.state, mbs=m)
            e = search.ev.evaluate(state, gbs, r.ranks)
            if e.feasible:
                opts.append((m,) + pipeline_line(e.costs, m, search.ev.tails(state, e.costs, a)))
                vs.append(PipelineResult(r.vec, gbs, r.group, state, e, r.ranks))
        options.append(opts)
        variants.append(vs)
    got = allocate_with_variants(options, gbs)
    if got is None:
        return None
    lbs, pick, _ = got
    chosen = [vs[k] for vs, k in zip(variants, pick)]
    plan = search.build_plan(chosen, list(lbs))
    if not plan_tp_in_nodes(plan):
        return None
    ev = search.cost.evaluate(plan)
    if not ev["feasible"]:
        return None
    return Candidate(plan, ev["iteration_ms"], chosen)


def pipeline_moves(ev, r: PipelineResult):
    """Single changes of one pipeline: Mbs x2 / 2, one stage's tp/dp exchange (with the
    Mbs it needs, or also with Mbs / 2; tp groups kept inside a node), every stage's tp
    x2 / 2 at once (with Mbs / 2 resp. the Mbs the new dps need: a smaller Mbs needs
    every stage's dp to shrink, which single exchanges cannot reach one step at a time)
    and one layer moved between neighbours."""
    stages = list(r.state.stages)
    mbs = r.state.mbs
    yield pipe_state(r.state.stages, mbs * 2)
    if mbs % 2 == 0 and all((mbs // 2) % st.dp == 0 for st in stages):
        yield pipe_state(r.state.stages, mbs // 2)
    for j, st in enumerate(stages):
        for tp in (st.tp * 2, st.tp // 2):
            if tp in ev.valid_tps(st.device_type, st.ndev, r.ranks[j]):
                new = list(stages)
                new[j] = st.with_tp(tp)
                yield pipe_state(tuple(new), math.lcm(mbs, st.ndev // tp))
                if tp > st.tp and mbs % 2 == 0 and all((mbs // 2) % s.dp == 0 for s in new):
                    yield pipe_state(tuple(new), mbs // 2)
        if j + 1 < len(stages):
            for src, dst in ((j, j + 1), (j + 1, j)):
                if stages[src].layers > 1:
                    new = list(stages)
                    new[src] = stages[src].with_layers(stages[src].layers - 1)
                    new[dst] = stages[dst].with_layers(stages[dst].layers + 1)
                    yield pipe_state(tuple(new), mbs)
    if len(stages) > 1:
        for up in (True, False):
            new = [st.with_tp(st.tp * 2 if up else st.tp // 2) for st in stages]
            if all(s.tp in ev.valid_tps(s.device_type, s.ndev, rk) for s, rk in zip(new, r.ranks)):
                base = math.lcm(*[s.dp for s in new])
                for m in sorted({mbs // 2 if up else mbs, base}):
                    if m >= 1 and m % base == 0:
                        yield pipe_state(tuple(new), m)


def reversed_pipeline(search, r: PipelineResult, lbs: int) -> PipelineResult | None:
    """``r`` with its stage order reversed (each stage keeps its devices, tp and layer
    count), evaluated for ``lbs``; None for one stage or when it does not fit."""
    if len(r.state.stages) < 2:
        return None
    group = StageGroup(tuple(reversed(r.group.stages)))
    state = replace(r.state, stages=tuple(reversed(r.state.stages)))
    ranks = stage_ranks(search.ev, search.blocks, group)
    e = search.ev.evaluate(state, lbs, ranks)
    return PipelineResult(r.vec, lbs, group, state, e, ranks) if e.feasible else None


def group_moves(search, cand: Candidate):
    """(pipeline indices, their new results) of the moves of the whole group: one
    pipeline's stage order reversed, and every pipeline's at once.  Reversing every
    pipeline keeps the layers whose gradient All-Reduce (Eq. 6) spans one device type on
    one type, while the first and last stages (embedding, head, the exposed All-Reduce of
    the first stage) change places, which single-pipeline moves cannot reach without
    splitting those layers' holders across types on the way."""
    flipped = [reversed_pipeline(search, r, p.lbs) for r, p in zip(cand.results, cand.plan.pipelines)]
    moves = [((i,), (f,)) for i, f in enumerate(flipped) if f is not None]
    if len(moves) > 1:
        yield from moves
        yield tuple(i for (i,), _ in moves), tuple(f for _, (f,) in moves)
    else:
        yield from moves


FREE_MBS_CHOICES = 3
"""Re-plan choices of one pipeline (the best by their plain allocation) that are also
scored with the free-Mbs exact allocation."""


def allocation_floor(search, trial) -> float:
    """A lower bound of ``search.allocate(trial)``'s iteration time (Eq. 5 + Eq. 6 of the
    allocated plan; inf where it fails): each pipeline's end-time line A_i + B_i x_i in its
    micro-batch count x_i (Eq. 5, :func:`eth.planner.allocate.pipeline_line`) on the stage
    costs of the ranks the plan gives it, without its All-Reduce (AR >= 0, as are the
    optimizer and step terms that :meth:`eth.cost.model.CostModel.evaluate` adds), minimised
    over real x_i >= 1 with sum_i Mbs_i x_i = Gbs (the allocation's are whole and sum to
    Gbs): max(max_i (A_i + B_i), T) with T solving sum_i Mbs_i (T - A_i) / B_i = Gbs.
    The lines are memoised per pipeline (its ranks, state and recompute): no plan, no
    All-Reduce, no allocation."""
    layout = _layout(search, trial)
    memo = search.floor_lines
    lines = []
    for r, ranks in zip(trial, layout):
        key = (ranks, r.state, r.evaluation.recompute)
        line = memo.get(key)
        if line is None:
            line = memo[key] = _floor_line(search.cost, r, ranks)
        lines.append(line)
    if any(b <= 0 for _, b, _ in lines):
        return 0.0
    least = max(a + b for a, b, _ in lines)
    even = (search.opt.gbs + sum(m * a / b for a, b, m in lines)) / sum(m / b for a, b, m in lines)
    return max(least, even)


def _layout(search, trial) -> tuple:
    """The ranks of every stage of every pipeline that ``search.build_plan(trial)`` uses
    (:meth:`eth.planner.search.HPPSearch.ranks`), as tuples."""
    key = tuple(r.group.stages for r in trial)
    hit = search.layouts.get(key)
    if hit is None:
        ranks = search.ranks(trial)       # memoised there with ``memo``
        hit = search.layouts.get(key) or tuple(tuple(tuple(s) for s in p) for p in ranks)
    return hit


def _floor_line(cost, r: PipelineResult, ranks) -> tuple[float, float, int]:
    """(A, B, Mbs) of ``r`` on ``ranks`` without All-Reduce: the stage costs that
    :meth:`eth.cost.model.CostModel.pipeline_costs` gives the planned pipeline (its times do not
    depend on the in-flight micro-batches)."""
    stages, mbs = r.state.stages, r.state.mbs
    n = len(stages)
    costs = [cost.stage_cost(st.device_type, st.tp, st.dp, rng, mbs, dict(rec), j, n, 1, ranks[j],
                             ranks[j + 1] if j + 1 < n else None, ranks[j - 1] if j > 0 else None)
             for j, (st, rng, rec) in enumerate(zip(stages, r.state.layer_ranges(), r.evaluation.recompute))]
    return pipeline_line(costs, mbs, None) + (mbs,)


class _Scan:
    """Trials (the group's pipeline results after one move each) scored by the group's
    allocation in turn, as a steepest-descent step: :attr:`best` is the first trial
    whose allocated time is the least below ``cand``'s (None if none) and :meth:`top` the
    ``keep`` least (failed allocations last, ties in trial order).  A trial whose
    :func:`allocation_floor` is not below the best time so far cannot change
    :attr:`best` and is only allocated if :meth:`top` needs it (floors in ascending
    order while one does not exceed the ``keep``-th least time known): the same best and
    top as allocating every trial."""

    def __init__(self, search, cand: Candidate, out):
        self.search, self.cand, self.out = search, cand, out
        self.best: Candidate | None = None
        self.scored, self.skipped, self.count = [], [], 0

    def add(self, trial) -> None:
        k, self.count = self.count, self.count + 1
        if self.search.opt.prune:
            floor = allocation_floor(self.search, trial)
            if floor >= (self.best or self.cand).iteration_ms * (1 - 1e-9):
                self.skipped.append((floor, k, trial))
                return
        self._score(k, trial)

    def _score(self, k: int, trial) -> None:
        got = self.search.allocate(trial)
        self.scored.append((got[1] if got is not None else math.inf, k, trial))
        if got is not None and got[1] < (self.best or self.cand).iteration_ms * (1 - 1e-9):
            self.best = Candidate(got[0], got[1], trial)

    def top(self, keep: int) -> list:
        self.skipped.sort(key=lambda x: (x[0], x[1]))
        known = sorted(x[0] for x in self.scored if x[0] < math.inf)   # allocated times so far
        while self.skipped and not self.out():
            if len(known) >= keep and self.skipped[0][0] > known[keep - 1]:
                break
            _, k, trial = self.skipped.pop(0)
            self._score(k, trial)
            if self.scored[-1][0] < math.inf:
                bisect.insort(known, self.scored[-1][0])
        self.scored.sort(key=lambda x: (x[0], x[1]))
        return [trial for _, _, trial in self.scored[:keep]]


def _replan(search, cand: Candidate, out) -> Candidate:
    """Each pipeline in turn: its phase-1 result and alternatives (the best
    1 + :data:`eth.planner.pipeline.MAX_ALTERNATIVES` stage groups at Gbs, cached) re-balanced for its own Lbs
    (phase 3, :meth:`eth.planner.search.HPPSearch.phase3`), best first, then the
    alternatives of its current result, each tried in the group context.  (A fresh phase 1
    at B = Lbs over all its stage groups found the same plans on the seeded suite of
    tests/planner/test_search_core.py, the sweeps, the sensitivity variants, GPT-3 13B /
    175B and 27 of the 28 Table 2 rows of bench/paper_eval.py -- LLaMA-2 70B on B3/B4 it
    found 16620.6 ms, this re-plan 16630.2 ms, hexiscale-strong's plan -- for about a fifth
    more cost evaluations of the whole search.)  Every choice gets the group's
    allocation at the pipelines' Mbs; the :data:`FREE_MBS_CHOICES` best of them (failed
    allocations last) also the free-Mbs exact allocation (:func:`variant_allocation`:
    every pipeline's Mbs among halvings/doublings of its own), because a changed pipeline
    often pays only once the other pipelines' Mbs move with it."""
    for i, p in enumerate(list(cand.plan.pipelines)):
        if out():
            return cand
        r = search.phase1(cand.results[i].vec)
        if r is None or not r.feasible:
            continue
        # a state whose Mbs exceeds Lbs stays as it was (evaluated at Gbs): ranked last
        replanned = sorted((x for x in (search.phase3(y, p.lbs) for y in (r, *r.alternatives)) if x.feasible),
                           key=lambda x: (x.batch != p.lbs, x.evaluation.key))
        choices = [*replanned, *cand.results[i].alternatives]
        scan = _Scan(search, cand, out)
        for choice in choices:
            if out():
                break
            trial = list(cand.results)
            trial[i] = choice
            scan.add(trial)
        top = scan.top(FREE_MBS_CHOICES)
        best = scan.best
        for trial in top:   # their joint tp moves too
            if out():
                break
            for state in joint_moves(search.ev, trial[i].state, p.lbs, trial[i].ranks):
                e = search.ev.evaluate(state, p.lbs, trial[i].ranks)
                if e.feasible:
                    moved = list(trial)
                    moved[i] = PipelineResult(trial[i].vec, p.lbs, trial[i].group, state, e, trial[i].ranks)
                    best = better_trial(search, moved, best, cand)
        for trial in top:
            if out():
                break
            alt = variant_allocation(search, trial)
            if alt is not None and alt.iteration_ms < (best or cand).iteration_ms * (1 - 1e-9):
                best = alt
        cand = best or cand
    return cand


def better_trial(search, trial, best: Candidate | None, cand: Candidate) -> Candidate | None:
    """``trial`` (the group's pipeline results) allocated, if that beats ``best`` (or
    ``cand`` while there is no best yet); else ``best``: one step of a steepest descent.
    A trial whose :func:`allocation_floor` is not below that time is not allocated."""
    bar = (best or cand).iteration_ms * (1 - 1e-9)
    if search.opt.prune and allocation_floor(search, trial) >= bar:
        return best
    got = search.allocate(trial)
    if got is not None and got[1] < bar:
        return Candidate(got[0], got[1], trial)
    return best


def _trials(search, cand: Candidate):
    """The group's pipeline results after each move: :func:`pipeline_moves` of every
    pipeline (evaluated for its Lbs; those that do not fit left out), then
    :func:`group_moves`."""
    for i, (r, p) in enumerate(zip(cand.results, cand.plan.pipelines)):
        for state in pipeline_moves(search.ev, r):
            e = search.ev.evaluate(state, p.lbs, r.ranks)
            if e.feasible:
                trial = list(cand.results)
                trial[i] = PipelineResult(r.vec, p.lbs, r.group, state, e, r.ranks)
                yield trial
    for idx, new in group_moves(search, cand):
        trial = list(cand.results)
        for i, n in zip(idx, new):
            trial[i] = n
        yield trial


def _descend(search, cand: Candidate, budget: int, out) -> Candidate:
    """Steepest descent over :func:`pipeline_moves` and :func:`group_moves` on the whole
    group's Eq. 2 (``budget`` moves in all).  A round with no improving move scores its
    :data:`FREE_MBS_CHOICES` best moves (by the plain allocation; failed ones last) also
    with the free-Mbs exact allocation (:func:`variant_allocation`): a move often pays
    only once the other pipelines' Mbs change with it (e.g. one pipeline's tp x2 with
    Mbs / 2 and another's Mbs / 2, so that the Lbs split gets finer)."""
    spent = 0
    while spent < budget and not out():
        scan = _Scan(search, cand, out)
        for trial in _trials(search, cand):
            if spent >= budget or out():
                break
            spent += 1
            scan.add(trial)
        best = scan.best
        if best is None:
            for trial in scan.top(FREE_MBS_CHOICES):
                if out():
                    break
                alt = variant_allocation(search, trial)
                if alt is not None and alt.iteration_ms < (best or cand).iteration_ms * (1 - 1e-9):
                    best = alt
        if best is None:
            break
        cand = best
    return cand


def least_recompute(cost, plan, i: int, j: int) -> dict[str, int]:
    """Stage j of pipeline i of ``plan`` with less recompute that still fits: each op's
    layer count (costliest op first) lowered to the smallest that fits with the others
    fixed (bisection), in passes until none falls.  The evaluator's rule
    (:meth:`eth.planner.evaluate.Evaluator.fit_stage`) adds ops in one order and its
    runs (:mod:`eth.planner.recompute_runs`) are fixed; an op it added before the ones
    that made the stage fit (e.g. the layer norm and QKV ahead of the attention core) may
    free too little to be worth its time.  Eq. 5 grows with every stage's backward time
    and nothing else of the plan reads a stage's recompute, so a cheaper fitting set never
    makes the plan slower.  Each contiguous run of the layer's ops recomputed in its
    fewest fitting layers (:func:`least_run`) is a candidate too, since a run keeps only
    its input (e.g. QKV through the attention context in one layer where the op rule
    spreads the attention core over two): the cheapest fitting set is returned."""
    p = plan.pipelines[i]
    st, S = p.stages[j], len(p.stages)
    nxt = p.stages[j + 1].ranks if j + 1 < S else None
    prv = p.stages[j - 1].ranks if j > 0 else None
    nmb = max(1, p.lbs // p.mbs)

    def fits(rec):
        return cost.stage_cost(st.device_type, st.tp, st.dp, st.layers, p.mbs, rec, j, S, nmb,
                               st.ranks, nxt, prv).fits

    rec = dict(st.recompute)
    if not rec or not fits(rec):
        return rec

    def recompute_ms(r):
        return cost.stage_cost(st.device_type, st.tp, st.dp, st.layers, p.mbs, r, j, S, nmb, st.ranks, nxt,
                               prv).recompute_ms

    per_op = per_op_ms(cost, plan.model, st, p.mbs)
    rec = cut_counts(fits, rec, per_op)
    ms, run = least_run(fits, recompute_ms, layer_ops(plan.model), st.layers[1] - st.layers[0], per_op,
                        (recompute_ms(rec), rec))
    if run is rec:
        return rec
    run = cut_counts(fits, run, per_op)
    return run if recompute_ms(run) < recompute_ms(rec) else rec


def cut_counts(fits, rec: dict[str, int], per_op: dict[str, float]) -> dict[str, int]:
    """``rec`` (which fits) with each op's layer count, costliest op first, bisected down
    to the smallest that fits with the others fixed, in passes until none falls."""
    rec = dict(rec)
    changed = True
    while changed:
        changed = False
        for op in sorted(rec, key=lambda o: (-per_op.get(o, 0.0), o)):
            lo, hi = -1, rec[op]          # hi fits; find the smallest count that fits
            while hi - lo > 1:
                mid = (lo + hi) // 2
                trial = {o: n for o, n in rec.items() if o != op}
                if mid:
                    trial[op] = mid
                if fits(trial):
                    hi = mid
                else:
                    lo = mid
            if hi < rec[op]:
                changed = True
                if hi:
                    rec[op] = hi
                else:
                    del rec[op]
    return rec


def per_op_ms(cost, model, st, mbs: int) -> dict[str, float]:
    """One layer's recompute ms of each layer op of stage ``st`` at ``mbs``."""
    ops = cost.profiles.layer_costs(st.device_type, model, mbs // st.dp, st.tp)[0]
    return {op: ops[op].fwd_ms for op in layer_ops(model)}


def least_run(fits, recompute_ms, ops, layers: int, ms: dict[str, float], best: tuple[float, dict]):
    """(recompute ms, set): ``best`` or, if cheaper, a contiguous run of ``ops``
    recomputed in the fewest of the stage's ``layers`` that fit.  A run in k layers costs
    about k times its one-layer ms (``ms``), so a run is skipped unless it fits in the most
    layers that could still beat the best so far (one check per run, bisection only for
    those)."""
    runs = sorted(((sum(ms[o] for o in ops[a:b]), ops[a:b]) for a in range(len(ops))
                   for b in range(a + 1, len(ops) + 1)), key=lambda r: r[0])
    for run_ms, run in runs:
        if run_ms <= 0:
            continue
        most = min(layers, math.ceil(best[0] / run_ms) - 1)
        if most < 1 or not fits({op: most for op in run}):
            continue
        lo, hi = 0, most                 # hi fits; the smallest count that fits
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits({op: mid for op in run}):
                hi = mid
            else:
                lo = mid
        cand = {op: hi for op in run}
        got = recompute_ms(cand)
        if got < best[0] * (1 - 1e-12):
            best = (got, cand)
    return best


def lighter_recompute(search, cand: Candidate) -> Candidate:
    """``cand`` with every stage's recompute cut by :func:`least_recompute` (same stages,
    Mbs and Lbs), if that makes it faster.  Only the plan changes (its ``results`` keep
    the evaluator's recompute), so it is the polish's last step."""
    plan = cand.plan
    new = [[least_recompute(search.cost, plan, i, j) for j in range(len(p.stages))]
           for i, p in enumerate(plan.pipelines)]
    if all(rec == st.recompute for p, recs in zip(plan.pipelines, new) for st, rec in zip(p.stages, recs)):
        return cand
    pipes = [replace(p, stages=[replace(st, recompute=rec) for st, rec in zip(p.stages, recs)], predicted={})
             for p, recs in zip(plan.pipelines, new)]
    trial = Plan(plan.model, plan.cluster, plan.gbs, pipes)
    ev = search.cost.evaluate(trial)
    if ev["feasible"] and ev["iteration_ms"] < cand.iteration_ms * (1 - 1e-12):
        return Candidate(trial, ev["iteration_ms"], cand.results)
    return cand


POLISH_ROUNDS = 2
"""Rounds of descent + re-planning + free-Mbs allocation while the group improves."""
SECOND_ROUND_GAIN = 0.01
"""The polish runs again only when its round made the group at least this much faster
(the seeded suite of test_search_core.py: the same plans as with any gain, 5-7% less CPU
on GPT-3 13B / 64 devices)."""


def polish(search, cand: Candidate, budget: int) -> Candidate:
    """Steepest descent on the whole group's Eq. 2 (:func:`_descend`), then re-plan each
    pipeline for its Lbs (all stage groups, scored with free Mbs), then free-Mbs
    allocation; repeated (at most :data:`POLISH_ROUNDS` times) while a round makes the
    group at least :data:`SECOND_ROUND_GAIN` faster.  The descent comes first: a re-plan
    that is better at once can lead away from a group the moves reach (on the seeded suite
    of tests/planner/test_search_core.py the other order left 3 of 154 cases 3-8% above
    the optimum).  The search then gives the group the least recompute that fits if it is
    no slower than its best so far (:func:`lightest`).  Every step first checks the
    search's time limit; once it is reached the best candidate so far is returned.  Reads
    nothing the search changes as it goes but its caches, so the polishes of several groups
    may run in separate processes (:mod:`eth.planner.workers`)."""
    out = search.out_of_time
    for _ in range(POLISH_ROUNDS):
        start = cand.iteration_ms
        cand = _descend(search, cand, budget, out)
        cand = _replan(search, cand, out)
        if out():
            return cand
        final = variant_allocation(search, cand.results)
        if final is not None and final.iteration_ms < cand.iteration_ms:
            cand = final
        if cand.iteration_ms >= start * (1 - SECOND_ROUND_GAIN):
            break
    return cand


def lightest(search, cand: Candidate) -> Candidate:
    """The polish's last step, taken in the order the groups are polished: a group no
    slower than the search's best so far gets the least recompute that fits
    (:func:`lighter_recompute`; its plan only)."""
    if not search.out_of_time() and (search.best is None or
                                      cand.iteration_ms <= search.best.iteration_ms * (1 + 1e-9)):
        cand = lighter_recompute(search, cand)
    return cand
