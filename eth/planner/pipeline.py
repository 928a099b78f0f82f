"""Phase 1 / phase 3 for one pipeline: best stage device group and configuration.

:func:`optimise_pipeline` (phase 1, batch = Gbs) enumerates the pipeline's stage device
groups (:func:`eth.planner.enumerate.stage_groups`), warm-starts each
(:func:`eth.planner.balance.warm_start`), gives every warm start (or only the
``stage_groups_topk`` best ones) the balancer with an adaptive budget, and returns the best.
:func:`refine_pipeline` (phase 3) re-balances the chosen configuration for the
pipeline's local batch (Eq. 1 with Lbs instead of Gbs).

Adaptive balance time allocation (paper section 6) -- :func:`adaptive_budgets`:

    Vmem_g  = Var_j(devices_j * memory(type_j))      over the stages j of group g
    Vcomp_g = Var_j(devices_j * tflops(type_j))
    nm_g = Vmem_g / mean(Vmem over peers),  nc_g = Vcomp_g / mean(Vcomp over peers)
           (peers: groups with the same stage count; 1 when all peers are 0)
    budget_g = clip(base / (nm_g * nc_g), base / 4, 4 * base)

Higher variance -> a worse expected result -> less time.  Budgets count cost
evaluations (not seconds), so the search stays deterministic.
"""
from __future__ import annotations

import bisect
import itertools
import math
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import numpy as np

from eth.planner.balance import balance, warm_start
from eth.planner.bounds import stage_group_floors
from eth.planner.enumerate import Blocks, StageGroup, assign_ranks, pipeline_ranks, scale_groups, stage_groups
from eth.planner.evaluate import Evaluation, Evaluator, PipeState


MAX_ALTERNATIVES = 8


@dataclass(frozen=True)
class PipelineResult:
    """Best configuration found for one pipeline device multiset and batch."""

    vec: tuple[int, ...]
    """Block vector of the pipeline (see eth.planner.enumerate.Blocks)."""
    batch: int
    """Batch the configuration was optimised for (Gbs or the pipeline's Lbs)."""
    group: StageGroup
    state: PipeState
    evaluation: Evaluation
    ranks: tuple[tuple[int, ...], ...]
    """Representative ranks used while balancing (the final plan re-assigns ranks)."""
    ready: tuple = ()
    """:attr:`alternatives` once known."""
    pending: object = field(default=None, compare=False, repr=False)
    """A call that returns :attr:`alternatives` (the stage groups that phase 1 skipped by
    their floor and that may rank among them are balanced then), or None."""

    @property
    def alternatives(self) -> tuple:
        """Balanced results of the pipeline's other stage groups (best first, at most
        ``MAX_ALTERNATIVES``), tried by :func:`eth.planner.polish.polish` in the group
        context; computed on first use when phase 1 pruned stage groups."""
        if self.pending is not None:
            object.__setattr__(self, "ready", self.pending())
            object.__setattr__(self, "pending", None)
        return self.ready

    @property
    def feasible(self) -> bool:
        return self.evaluation.feasible

    @property
    def throughput(self) -> float:
        """Samples per ms at ``batch`` (Eq. 1); 0 when infeasible."""
        return self.batch / self.evaluation.ms if self.feasible else 0.0


def adaptive_budgets(cluster, groups: list[StageGroup], base: int) -> list[int]:
    """Section 6 budget of each stage group (see module docstring)."""
    peers: dict = {}   # stage count -> indices, in order (one pass, not one per group)
    for i, g in enumerate(groups):
        peers.setdefault(g.num_stages, []).append(i)
    vm, vc = [0.0] * len(groups), [0.0] * len(groups)
    facts = {t: (d.memory_gb, d.tflops) for t, d in cluster.types.items()}
    for ks in peers.values():    # the variances of one stage count's groups in one numpy call each
        rows = np.array([[(n * facts[t][0], n * facts[t][1]) for t, n in groups[k].stages] for k in ks])
        for k, m, c in zip(ks, np.var(rows[:, :, 0], axis=1).tolist(), np.var(rows[:, :, 1], axis=1).tolist()):
            vm[k], vc[k] = m, c
    means = {n: (_mean([vm[k] for k in ks]), _mean([vc[k] for k in ks])) for n, ks in peers.items()}
    budgets = []
    for i, g in enumerate(groups):
        mm, mc = means[g.num_stages]
        nm = _normalise(vm[i], mm)
        nc = _normalise(vc[i], mc)
        factor = min(4.0, max(0.25, 1.0 / max(nm * nc, 1e-9)))
        budgets.append(max(1, int(round(base * factor))))
    return budgets


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _normalise(value: float, mean: float) -> float:
    if mean <= 0:
        return 1.0
    return max(value / mean, 0.25)


def stage_ranks(ev: Evaluator, blocks: Blocks, g: StageGroup) -> tuple[tuple[int, ...], ...]:
    """Representative ranks of stage group ``g`` (:func:`assign_ranks` of ``g`` alone).
    With the evaluator's ``memo`` one tuple per stage group is kept and returned again:
    the evaluator memoises stage costs per ranks object, so a stage group warm-started
    and balanced again (phase 1 for another batch: the polish re-plans each pipeline for
    its Lbs) finds its stage costs instead of re-fitting them."""
    if not ev.memo:
        return tuple(tuple(r) for r in assign_ranks(blocks, [list(g.stages)])[0])
    key = (blocks, g.stages)
    hit = ev.ranks_memo.get(key)
    if hit is None:
        hit = ev.ranks_memo[key] = pipeline_ranks(blocks, g.stages, ev.ranks_memo)
    return hit


def _restricts(types: int, keep: int) -> bool:
    """Whether a pipeline of ``types`` device types has more type orders than ``keep``
    (> 0): :func:`promising_orders` then chooses some."""
    return bool(keep) and math.factorial(types) > keep


def promising_orders(ev: Evaluator, blocks: Blocks, vec, batch: int, max_stages: int,
                     keep: int) -> list[tuple] | None:
    """None (every order) when ``keep`` is 0 or the pipeline ``vec``'s device types have
    at most ``keep`` orders; else ``keep`` type orders ranked by the lowest floor
    (:func:`eth.planner.bounds.stage_group_floors`) of their sampled stage groups
    (:func:`eth.planner.enumerate.scale_groups`: one stage per type, then about twice as
    many, ...), in the order of :func:`itertools.permutations`: which type holds the
    first stage (the embedding and the most micro-batches in flight) and which the last
    decides memory and recompute, and the samples see both at a cost linear in the
    orders.  The best order of each (first type, last type) pair is kept before a second
    order of any pair: the sampled floors of orders that share both ends often tie (on
    LLaMA-2 7B over H100 / A100 / A100-40GB / RTX3090 the 6 best all ended on H100, within
    0.2%, and the winning plan's order was 10th)."""
    devices = {t: d for t, d in zip(blocks.types, blocks.devices(vec)) if d}
    if not _restricts(len(devices), keep):
        return None
    orders = list(itertools.permutations(devices))
    samples = [(k, g) for k, order in enumerate(orders)
               for g in scale_groups(order, devices, ev.model.num_layers, max_stages)]
    floors = stage_group_floors(ev, [(g.stages, stage_ranks(ev, blocks, g)) for _, g in samples], batch)
    best = [math.inf] * len(orders)
    for (k, _), f in zip(samples, floors):
        best[k] = min(best[k], f)
    ranked = sorted(range(len(orders)), key=lambda k: (best[k], k))
    chosen, ends = [], set()
    for k in ranked:              # the best order of each (first type, last type) first
        if len(chosen) < keep and (orders[k][0], orders[k][-1]) not in ends:
            chosen.append(k)
            ends.add((orders[k][0], orders[k][-1]))
    chosen += [k for k in ranked if k not in chosen][:keep - len(chosen)]
    return [orders[k] for k in sorted(chosen)]


def optimise_pipeline(ev: Evaluator, blocks: Blocks, vec, batch: int, base_budget: int,
                      topk: int, max_stages: int, stop=None, phases=None, prune: bool = True,
                      type_orders: int = 0) -> PipelineResult | None:
    """Phase 1 for the pipeline with block vector ``vec``; None if nothing can be built.

    ``stop()`` (optional; the search's time limit) is polled between stage groups and
    inside the balancer: once it returns true, the remaining stage groups are neither
    warm-started nor balanced and the best configuration so far is returned (a warm
    start that did not get the balancer counts too).

    ``prune`` (without ``topk``): stage groups are warm-started and balanced in ascending
    order of their floor (:func:`eth.planner.bounds.stage_group_floor`, a lower bound of
    every configuration's Eq. 1 time), and a group whose floor exceeds the best balanced
    time so far is not balanced: the same best configuration.  The alternatives (the next
    ``MAX_ALTERNATIVES`` groups) are completed when first read (:class:`_Groups`): the
    groups whose floor does not exceed the ninth best time are balanced then.  Both rank
    results as without pruning (by balanced key, then warm-start key, then group order),
    so the result and its alternatives are the same.

    ``type_orders`` (> 0): a pipeline with more orders of its device types than this
    gets the stage groups of the ``type_orders`` most promising orders only
    (:func:`promising_orders`); 0 = every order."""
    halted = stop if stop is not None else (lambda: False)
    # stage groups and budgets depend on the devices only (phase 1 runs again for each
    # Lbs the polish re-plans): kept on the evaluator; the choice of type orders reads
    # the batch too
    restrict = _restricts(sum(1 for d in vec if d), type_orders)
    gkey = ("groups", blocks.types, blocks.devices(vec), max_stages, base_budget) + \
        ((type_orders, batch) if restrict else ())
    hit = ev.ranks_memo.get(gkey)
    if hit is None:
        orders = promising_orders(ev, blocks, vec, batch, max_stages, type_orders)
        groups = stage_groups(blocks.types, blocks.devices(vec), ev.model.num_layers, max_stages, orders)
        hit = ev.ranks_memo[gkey] = (groups, adaptive_budgets(ev.cost.cluster, groups, base_budget) if groups else [])
    groups, budgets = hit
    if not groups:
        return None
    if prune and not topk:
        work = _Groups(ev, blocks, tuple(vec), batch, groups, budgets, stop, phases)
        work.run(1)
        return work.result()
    starts = []
    with (phases("warm starts") if phases is not None else nullcontext()):
        for g, budget in zip(groups, budgets):
            if starts and halted():
                break
            ranks = stage_ranks(ev, blocks, g)
            init = warm_start(ev, g.stages, batch, ranks)
            if init is not None:
                starts.append((init[1].key, len(starts), g, ranks, init, budget))
    if not starts:
        return None
    starts.sort(key=lambda x: (x[0], x[1]))
    chosen = starts[:topk] if topk else starts
    done = []
    for i, (_, _, g, ranks, (state, e), budget) in enumerate(chosen):
        if done and halted():
            # out of time: the remaining warm starts compete unbalanced
            done += [(e0.key, k, PipelineResult(tuple(vec), batch, g0, s0, e0, r0))
                     for k, (_, _, g0, r0, (s0, e0), _) in enumerate(chosen) if k >= i]
            break
        state, e, _ = balance(ev, state, batch, ranks, budget, e, stop)
        done.append((e.key, i, PipelineResult(tuple(vec), batch, g, state, e, ranks)))
    done.sort(key=lambda x: (x[0], x[1]))
    others = tuple(r for _, _, r in done[1:MAX_ALTERNATIVES + 1] if r.feasible)
    return replace(done[0][2], ready=others)


class _Groups:
    """Phase 1 with floor pruning (:func:`optimise_pipeline`'s ``prune``).  Called, it
    returns the alternatives (the :attr:`PipelineResult.pending` of its result).  It pickles
    without the evaluator and the search's callbacks (:meth:`__getstate__`): a result sent
    from a forked process keeps the stage groups balanced so far and the floors of the
    rest, and :func:`reattach` lets the alternatives go on from there in the receiver."""

    def __init__(self, ev, blocks, vec, batch, groups, budgets, stop, phases):
        self.vec, self.batch = vec, batch
        self.attach(ev, stop, phases)
        ranks = [stage_ranks(ev, blocks, g) for g in groups]
        floors = stage_group_floors(ev, [(g.stages, r) for g, r in zip(groups, ranks)], batch)
        self.todo = [(f, i, g, r, budget) for i, (f, g, r, budget) in enumerate(zip(floors, groups, ranks, budgets))]
        self.todo.sort(key=lambda x: (x[0], x[1]))
        self.todo.reverse()          # popped from the end: lowest floor first
        self.done = []               # (balanced key, warm-start key, group index, result)
        self.feasible = []           # balanced Eq. 1 times of feasible results, ascending
        self.cut = False             # the time limit stopped it: no more groups

    def run(self, keep: int) -> None:
        """Balance groups in floor order while a floor does not exceed the ``keep``-th
        best feasible time so far (every group while fewer are known)."""
        ev, batch = self.ev, self.batch
        while self.todo and not self.cut:
            floor = self.todo[-1][0]
            if len(self.feasible) >= keep and floor * (1 - 1e-9) > self.feasible[keep - 1]:
                return
            if self.done and self.halted():
                self.cut = True
                return
            _, i, g, ranks, budget = self.todo.pop()
            with (self.phases("warm starts") if self.phases is not None else nullcontext()):
                init = warm_start(ev, g.stages, batch, ranks)
            if init is None:
                continue
            state, e = init
            start = e.key
            if not self.done or not self.halted():
                state, e, _ = balance(ev, state, batch, ranks, budget, e, self.stop)
            else:
                self.cut = True      # out of time: this warm start competes unbalanced
            self.done.append((e.key, start, i, PipelineResult(self.vec, batch, g, state, e, ranks)))
            if e.feasible:
                bisect.insort(self.feasible, e.ms)

    def result(self) -> PipelineResult | None:
        if not self.done:
            return None
        self.done.sort(key=lambda x: x[:3])
        return replace(self.done[0][3], pending=self)

    def __call__(self) -> tuple:
        self.run(1 + MAX_ALTERNATIVES)
        self.done.sort(key=lambda x: x[:3])
        return tuple(r for *_, r in self.done[1:MAX_ALTERNATIVES + 1] if r.feasible)

    def __getstate__(self) -> dict:
        return dict(self.__dict__, ev=None, halted=None, stop=None, phases=None)

    def attach(self, ev: Evaluator, stop=None, phases=None) -> None:
        self.ev, self.stop, self.phases = ev, stop, phases
        self.halted = stop if stop is not None else (lambda: False)


def reattach(result: PipelineResult | None, ev: Evaluator, stop=None, phases=None) -> None:
    """Make ``result``, as received from another process, complete its alternatives with
    ``ev`` and this process's ``stop`` and ``phases`` (the stage groups that phase 1
    balanced there are not balanced again)."""
    if result is not None and isinstance(result.pending, _Groups):
        result.pending.attach(ev, stop, phases)


def refine_pipeline(ev: Evaluator, result: PipelineResult, lbs: int, budget: int,
                    stop=None) -> PipelineResult:
    """Phase 3: re-balance ``result``'s configuration for its local batch ``lbs``."""
    start = result.state
    if start.mbs > lbs:
        return result
    state, e, _ = balance(ev, start, lbs, result.ranks, budget, stop=stop)
    return PipelineResult(result.vec, lbs, result.group, state, e, result.ranks)
