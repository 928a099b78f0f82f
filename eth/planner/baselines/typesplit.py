"""TypeSplit-HPP baseline (paper section 7.5): homogeneous pipelines, HPP balancing.

The devices are split BY TYPE: every pipeline holds devices of a single type (one or
more pipelines per type).  Each pipeline is optimised alone with the HPP stage
optimiser (phase 1, :func:`eth.planner.pipeline.optimise_pipeline`, Eq. 1 with
B = Gbs), the local batches are balanced with the HPP allocation (phase 2,
:func:`eth.planner.allocate.allocate`, Eq. 2-5 with Eq. 6 on concrete ranks), and the
best ``REFINE_TOP`` splits are refined with their Lbs (phase 3,
:func:`eth.planner.pipeline.refine_pipeline`), re-allocated and polished as a group
(:func:`polish_group`, like the HPP search's final polish: the cross-pipeline
All-Reduce of Eq. 6 couples the pipelines' tp and layer splits).  If the phase-1 Mbs
admit no exact split of Gbs, the Mbs are freed (:func:`_allocate`).

Search space: for every type, every integer partition of its blocks (the HPP
enumeration's granularity, :func:`eth.planner.enumerate.make_blocks`) into pipelines;
the product over types.  This is the subset of the HPP device groups in which every
pipeline is homogeneous, so HPP's space contains it; what TypeSplit gives up is mixing
types inside one pipeline (a slow type's pipeline cannot borrow a fast device).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import replace

from eth.cost.model import CostModel
from eth.spec.plan import PipelinePlan, Plan, StagePlan
from eth.planner.allocate import allocate, allocate_with_variants, pipeline_line
from eth.planner.balance import joint_moves
from eth.planner.baselines.common import Best, BaselineOptions, finish
from eth.planner.progress import Clock, progress_bar
from eth.planner.enumerate import assign_ranks, make_blocks, pipeline_can_hold
from eth.planner.evaluate import Evaluator
from eth.planner.pipeline import PipelineResult, optimise_pipeline, refine_pipeline
from eth.planner.polish import pipeline_moves
from eth.planner.options import SEARCH_OBJECTIVE

REFINE_TOP = 4
"""Type splits (best after phase 2) that get phase 3 and the group polish."""
JOINT_LIMIT = 256
"""Re-planned configurations are tried jointly (every combination over the pipelines)
when there are at most this many combinations, else one pipeline at a time."""
POLISH_BUDGET = 80
"""Group evaluations of :func:`polish_group` per refined type split."""


def integer_partitions(n: int, largest: int | None = None):
    """Partitions of n as non-increasing tuples, largest parts first."""
    largest = n if largest is None else largest
    if n == 0:
        yield ()
        return
    for first in range(min(n, largest), 0, -1):
        for rest in integer_partitions(n - first, first):
            yield (first,) + rest


def _build(model, cluster, blocks, gbs, results: list[PipelineResult], lbs) -> Plan:
    ranks = assign_ranks(blocks, [list(r.group.stages) for r in results])
    pipes = []
    for r, rk, n in zip(results, ranks, lbs):
        stages = [StagePlan(list(sr), st.device_type, st.tp, st.dp, rng, dict(rec))
                  for st, rng, rec, sr in zip(r.state.stages, r.state.layer_ranges(),
                                              r.evaluation.recompute, rk)]
        pipes.append(PipelinePlan(r.state.mbs, n, stages))
    return Plan(model, cluster, gbs, pipes)


def _allocate(cost, ev, model, cluster, blocks, gbs, results, free_mbs=False):
    """Phase 2 for fixed stage configurations: (plan, results) or None.

    If the phase-1 Mbs admit no exact split (e.g. their sum exceeds Gbs), each pipeline's
    Mbs is freed among the halvings (down to lcm of its dp degrees) and doublings of its
    own, and the exact allocation is solved jointly
    (:func:`eth.planner.allocate.allocate_with_variants`), as the HPP search does.
    """
    plan = _build(model, cluster, blocks, gbs, results, [r.state.mbs for r in results])
    ar = cost.stage_allreduce_ms(plan.pipelines)
    lines = [pipeline_line(r.evaluation.costs, r.state.mbs, a) for r, a in zip(results, ar)]
    alloc = allocate(lines, [r.state.mbs for r in results], gbs)
    if alloc is not None and not free_mbs:
        for p, n in zip(plan.pipelines, alloc.lbs):
            p.lbs = n
        return plan, results
    options, variants = [], []
    for r, a in zip(results, ar):
        base = math.lcm(*[st.dp for st in r.state.stages])
        sizes = {r.state.mbs * 2, r.state.mbs * 4}
        m = r.state.mbs
        while m >= base and m % base == 0:
            sizes.add(m)
            if m % 2:
                break
            m //= 2
        opts, vs = [], []
        for m in sorted(x for x in sizes if x <= gbs and x % base == 0):
            state = replace(r.state, mbs=m)
            e = ev.evaluate(state, gbs, r.ranks)
            if e.feasible:
                opts.append((m,) + pipeline_line(e.costs, m, a))
                vs.append(replace(r, state=state, evaluation=e))
        options.append(opts)
        variants.append(vs)
    got = allocate_with_variants(options, gbs)
    if got is None or (alloc is not None and alloc.end_ms <= got[2]):
        if alloc is None:
            return None
        for p, n in zip(plan.pipelines, alloc.lbs):
            p.lbs = n
        return plan, results
    lbs, pick, _ = got
    chosen = [vs[k] for vs, k in zip(variants, pick)]
    return _build(model, cluster, blocks, gbs, chosen, list(lbs)), chosen


def _descend(cost, ev, model, cluster, blocks, gbs, results, lbs, ms, best, budget, clock):
    """Steepest descent over :func:`eth.planner.polish.pipeline_moves` of any one pipeline
    (group-scored)."""
    spent = 0
    while spent < budget and not clock.out():
        move = None
        for i, r in enumerate(results):
            for state in pipeline_moves(ev, r):
                e = ev.evaluate(state, lbs[i], r.ranks)
                if not e.feasible or spent >= budget:
                    continue
                spent += 1
                trial = list(results)
                trial[i] = replace(r, state=state, evaluation=e, batch=lbs[i])
                got = _allocate(cost, ev, model, cluster, blocks, gbs, trial)
                if got is None:
                    continue
                new = best.offer(cost, got[0])
                if new < (move[0] if move else ms) * (1 - 1e-9):
                    move = (new, got[1], [p.lbs for p in got[0].pipelines])
        if move is None:
            break
        ms, results, lbs = move
    return results, lbs, ms


JOINT_REPLANS = 2
"""Re-planned configurations of a pipeline whose joint tp moves are also tried."""


def _joint(ev, results: list[PipelineResult], lbs: int) -> list[PipelineResult]:
    """Each of ``results`` with every feasible :func:`eth.planner.balance.joint_moves`
    (tp x2 or /2 on all its stages at once): the cross-type All-Reduce favours tps that a
    pipeline balanced alone does not pick (2 A100 + 2 RTX3090, gbs 12, with the fitted GEMM
    curves: one tp-2 A100 stage at Mbs 8 instead of two tp-1 stages, 8% faster)."""
    out = []
    for r in results:
        for state in joint_moves(ev, r.state, lbs, r.ranks):
            e = ev.evaluate(state, lbs, r.ranks)
            if e.feasible:
                out.append(replace(r, state=state, evaluation=e, batch=lbs))
    return out


def polish_group(cost, ev, model, cluster, blocks, gbs, results, lbs, ms, best, budget, clock,
                 optimised):
    """Group-level polish of one type split, every change scored by the whole split's
    re-allocated Eq. 2-5 (the cross-pipeline All-Reduce of Eq. 6 depends on the tp and
    layer split of every pipeline, which the per-pipeline phases cannot see):
    steepest descent over :func:`eth.planner.polish.pipeline_moves`; then each pipeline's best configuration of every
    stage device group for its own Lbs (phase 1 with B = Lbs) tried in place; then the
    descent again.  ``best`` keeps the fastest plan seen along the way."""
    args = (cost, ev, model, cluster, blocks, gbs)
    results, lbs, ms = _descend(*args, results, lbs, ms, best, budget // 2, clock)
    choices = []
    for r, n in zip(results, lbs):
        opt = optimised(r.vec, n)
        replans = [opt, *getattr(opt, "alternatives", ())] if opt is not None else []
        choices.append([r] + replans + _joint(ev, replans[:JOINT_REPLANS], n))
    if math.prod(len(c) for c in choices) <= JOINT_LIMIT:
        trials = itertools.product(*choices)          # jointly: the All-Reduce couples them
    else:
        trials = (tuple(results[:i]) + (c,) + tuple(results[i + 1:])
                  for i, cs in enumerate(choices) for c in cs[1:])
    for trial in trials:
        if clock.out():
            break
        got = _allocate(*args, list(trial), free_mbs=True)
        if got is not None:
            new = best.offer(cost, got[0])
            if new < ms * (1 - 1e-9):
                ms, results, lbs = new, got[1], [p.lbs for p in got[0].pipelines]
    return _descend(*args, results, lbs, ms, best, budget // 2, clock)


def plan_typesplit(model, cluster, profiles, gbs: int, options: BaselineOptions) -> Plan:
    clock = Clock(options.time_limit)
    cost = CostModel(model, cluster, profiles, options.setup, objective=SEARCH_OBJECTIVE)
    ev = Evaluator(cost)
    blocks = make_blocks(cluster, options.max_blocks_per_type)
    nt = len(blocks.types)

    def vec_of(i, n):
        return tuple(n if t == i else 0 for t in range(nt))

    per_type = []
    for i in range(nt):
        parts = [p for p in integer_partitions(blocks.count[i])
                 if all(pipeline_can_hold(cluster, blocks, vec_of(i, n), model, cost.bytes_per_param)
                        for n in p)]
        per_type.append(parts)
    combos = sorted(itertools.product(*per_type), key=lambda c: (sum(map(len, c)), c))
    phase1: dict = {}

    def optimised(vec, batch=gbs):
        if (vec, batch) not in phase1:
            phase1[vec, batch] = optimise_pipeline(ev, blocks, vec, batch, options.balance_budget, 0,
                                                   options.max_stages)
        return phase1[vec, batch]

    best = Best()
    ranked = []
    bar = progress_bar(len(combos), options.progress, "typesplit")
    try:
        for combo in combos:
            bar.update(1)
            if clock.out():
                break
            vecs = [vec_of(i, n) for i, parts in enumerate(combo) for n in parts]
            if len(vecs) > gbs:
                continue
            results = [optimised(v) for v in vecs]
            if any(r is None or not r.feasible for r in results):
                continue
            got = _allocate(cost, ev, model, cluster, blocks, gbs, results)
            if got is not None:
                plan, results = got
                ms = best.offer(cost, plan)
                ranked.append((ms, len(ranked), results, [p.lbs for p in plan.pipelines]))
        ranked.sort(key=lambda x: (x[0], x[1]))
        for ms, _, results, lbs in ranked[:REFINE_TOP]:
            for _ in range(2):          # phase 3: re-balance with Lbs, re-allocate
                if clock.out():
                    break
                refined = [refine_pipeline(ev, r, n, options.balance_budget) for r, n in zip(results, lbs)]
                if any(not r.feasible for r in refined):
                    break
                got = _allocate(cost, ev, model, cluster, blocks, gbs, refined)
                if got is None:
                    break
                plan, refined = got
                new = best.offer(cost, plan)
                if new >= ms * (1 - 1e-9):
                    break
                ms, results, lbs = new, refined, [p.lbs for p in plan.pipelines]
            polish_group(cost, ev, model, cluster, blocks, gbs, results, lbs, ms, best, POLISH_BUDGET, clock,
                         optimised)
    finally:
        bar.close()
    need = model.num_params() * cost.bytes_per_param
    small = [f"{t} ({n} devices, {n * cluster.types[t].memory_bytes / 1e9:.1f} GB)"
             for i, (t, n) in enumerate(zip(blocks.types, blocks.devices(blocks.count))) if not per_type[i]]
    if small:
        why = (f"every pipeline holds one device type, and all the devices of {', '.join(small)} hold less than "
               f"the {need / 1e9:.1f} GB of weights, gradients and optimizer states of {model.name}")
    else:
        why = (f"no split of the devices into homogeneous pipelines ({len(combos)} tried) fits in "
               f"memory with local batches that are multiples of their mbs summing to gbs {gbs}")
    return finish("typesplit", best, cost, clock, options, why, type_splits=len(combos),
                  pipelines_optimised=len(phase1), cost_evaluations=ev.evaluations)
