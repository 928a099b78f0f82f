"""Strong HexiScale-style baseline (``hexiscale-strong``): k IDENTICAL pipelines, DP = 1 per stage.

This is a *strong* version of HexiScale: it keeps HexiScale's restrictions (identical
pipelines, pure-tp stages, even batch split) but balances layers by time with a steepest
descent, searches Mbs and chooses recompute per stage, which the real system does not.
The faithful version is :mod:`eth.planner.baselines.hexiscale` (``hexiscale``).  Plans
made before the two were split record ``"strategy": "hexiscale"`` and no ``"variant"``:
they came from this planner.

HexiScale searches several pipelines but (paper section 2.2 and appendix A) all of them
are identical -- the same device-type composition and the same stage layout -- every
stage is pure tensor parallel (tp = its devices, dp = 1) and the stages are balanced by
their layer counts only; the global batch is split evenly (Lbs = Gbs / k).

Search (:func:`plan_hexiscale_strong`): for every k that divides every type count and Gbs,
each pipeline gets count_t / k devices of each type; for every stage device group of
that pipeline (:func:`eth.planner.enumerate.stage_groups`; with 4 or more device types
those of the ``type_orders`` most promising type orders, as the HPP search) whose stage
sizes are valid tp degrees, :func:`balance_layers` minimises the pipeline's Eq. 5 end time

    max_j Te^j = sum_k Tf^k + max_k T^k (Lbs/Mbs - 1) + max_j (sum_{k>=j} Tb^k + AR^j),
    AR^j = Eq. 6 over the k copies of stage j (N = k, the slowest link among them),

over the layer counts l_j (sum = L, >= 1) and Mbs (a power of two dividing Lbs, Mbs / 1
<= max_micro) by steepest descent from a compute-proportional split: move one layer
from one of the two bottleneck stages (memory overflow first, else largest T_j) to any
other stage, or double / halve Mbs.  Recompute: per stage the cheapest of none /
selective / full that fits (``BaselineOptions.recompute = "stage"``, default), or the
HPP op-level rule ("op").  Each result becomes the k-pipeline
plan scored by :meth:`eth.cost.model.CostModel.evaluate`; the fastest feasible plan wins.
With ``prune`` the stage groups of every k are balanced in one ascending order of their
floor (:func:`eth.planner.bounds.stage_group_floors` on the first pipeline's ranks, every
stage at tp = its devices: a lower bound of its Eq. 1 time over every layer split, Mbs and
recompute, so of the Eq. 5 time and the iteration time of any plan of the group), and the
rest are left once a floor exceeds the best iteration time found: the same best plan.
"""
from __future__ import annotations

import math

from eth.cost.equations import eq5_end_times, eq6_allreduce_ms
from eth.cost.model import CostModel
from eth.spec.plan import Plan
from eth.planner.balance import resplit
from eth.planner.baselines.common import (Best, BaselineOptions, finish, floor_order, make_evaluator, pipeline_plan,
                                          powers_of_two)
from eth.planner.progress import Clock, progress_bar
from eth.planner.baselines.hexiscale import no_plan_reason, pipeline_counts, tp_stage_groups
from eth.planner.enumerate import Blocks, assign_ranks, make_blocks
from eth.planner.evaluate import Evaluation, Evaluator, PipeState, StageState, pipe_state
from eth.planner.pipeline import promising_orders
from eth.planner.options import SEARCH_OBJECTIVE


def own_allreduce_ms(model, grad_bytes: float, tp: int, layers: tuple[int, int], k: int, gbps: float) -> float:
    """This planner's own AR^j: Eq. 6 over the k copies of a stage holding ``layers`` (the
    embedding with layer 0, the head with the last) at ``tp``, its gradients of
    ``grad_bytes`` per parameter, on a link of ``gbps``: what the cost model's
    block-wise All-Reduce gives for k identical dp-1 pipelines, at a fraction of its cost."""
    a, b = layers
    params = (b - a) * model.params_per_layer()
    if a == 0:
        params += model.embedding_params()
    if b == model.num_layers:
        params += model.head_params()
    return eq6_allreduce_ms(params / tp * grad_bytes, k, gbps)


def _score(ev: Evaluator, state: PipeState, lbs: int, rep, links, k: int, ar_memo: dict) -> tuple[tuple, Evaluation]:
    """((overflow, Eq. 5 end time of the pipeline), evaluation); ``ar_memo`` keeps each
    stage's :func:`own_allreduce_ms` by its position, tp and layers (one stage group's
    links and k)."""
    e = ev.evaluate(state, lbs, rep)
    if not e.feasible:
        return (e.overflow, math.inf), e
    ar = []
    for j, (st, (a, b)) in enumerate(zip(state.stages, state.layer_ranges())):
        key = (j, st.tp, a == 0, b == ev.model.num_layers, b - a)
        ms = ar_memo.get(key)
        if ms is None:
            ms = ar_memo[key] = own_allreduce_ms(ev.model, ev.cost.grad_bytes, st.tp, (a, b), k, links[j])
        ar.append(ms)
    return (0.0, max(eq5_end_times(e.costs, lbs, state.mbs, ar))), e


def balance_layers(ev: Evaluator, stages: tuple[StageState, ...], lbs: int, rep, links, k: int,
                   mbs_options: list[int], clock: Clock) -> tuple[PipeState, Evaluation, float] | None:
    """Layer balancing + Mbs for one stage group (see module docstring); None if infeasible."""
    memo: dict = {}
    ar_memo: dict = {}

    def cost(s):
        if s not in memo:
            memo[s] = _score(ev, s, lbs, rep, links, k, ar_memo)
        return memo[s]

    starts = sorted({mbs_options[0], mbs_options[min(2, len(mbs_options) - 1)]})
    best = None
    for mbs in starts:
        state = resplit(ev, PipeState(stages, mbs))
        key, e = cost(state)
        while not clock.out():
            order = sorted(range(len(state.stages)),
                           key=lambda j: (-(e.costs[j].memory_bytes > e.costs[j].capacity_bytes),
                                          -e.costs[j].total_ms, j))
            cands = []
            for a in order[:2]:
                if state.stages[a].layers > 1:
                    for b in range(len(state.stages)):
                        if b != a:
                            new = list(state.stages)
                            new[a] = new[a].with_layers(new[a].layers - 1)
                            new[b] = new[b].with_layers(new[b].layers + 1)
                            cands.append(pipe_state(tuple(new), state.mbs))
            i = mbs_options.index(state.mbs)
            for nb in (i - 1, i + 1):
                if 0 <= nb < len(mbs_options):
                    cands.append(pipe_state(state.stages, mbs_options[nb]))
            scored = [(cost(c), c) for c in cands]
            if not scored:
                break
            (nkey, ne), nstate = min(scored, key=lambda x: x[0][0])
            if nkey >= key or (nkey[0] == key[0] and nkey[1] >= key[1] * (1 - 1e-9)):
                break
            state, key, e = nstate, nkey, ne
        if key[0] == 0 and (best is None or key[1] < best[2]):
            best = (state, e, key[1])
    return best


def plan_hexiscale_strong(model, cluster, profiles, gbs: int, options: BaselineOptions) -> Plan:
    clock = Clock(options.time_limit)
    cost = CostModel(model, cluster, profiles, options.setup, objective=SEARCH_OBJECTIVE)
    ev = make_evaluator(cost, options)
    unit = make_blocks(cluster, cluster.world_size)      # one device per block: types, ranks
    need = model.num_params() * cost.bytes_per_param
    ks, fits, too_small = pipeline_counts(cluster, unit, need, gbs)
    best = Best()
    tried = 0
    # every pipeline count's stage groups, balanced in one ascending order of their floors
    # (a better plan found early leaves more groups unbalanced; the same best plan)
    work = []
    bar = progress_bar(len(fits), options.progress, "hexiscale-strong")
    try:
        for n, (k, per) in enumerate(fits):
            bar.update(1)
            if clock.out():
                continue
            lbs = gbs // k
            blocks = Blocks(unit.types, per, (k,) * len(per), unit.ranks)
            orders = promising_orders(ev, blocks, (1,) * len(per), lbs, options.max_stages, options.type_orders)
            groups = []
            for g in tp_stage_groups(unit, per, model, ev, options, clock, orders):
                ranks = assign_ranks(blocks, [list(g.stages)] * k)
                groups.append((g, ranks, tuple(tuple(r) for r in ranks[0])))
            ordered = floor_order(ev, groups, [(g.stages, rep) for g, _, rep in groups], lbs, options.prune,
                                  pure_tp=True)
            work += [(floor, n, i, k, item) for i, (floor, item) in enumerate(ordered)]
        work.sort(key=lambda w: w[:3])
        for floor, _, _, k, (g, ranks, rep) in work:
            if floor > best.iteration_ms * (1 + 1e-9) or clock.out():
                break           # no plan of this or a later group can be faster
            tried += 1
            lbs = gbs // k
            mbs_options = [m for m in powers_of_two(min(lbs, options.max_micro)) if lbs % m == 0]
            links = [cluster.link_gbps([r for p in ranks for r in p[j]]) for j in range(g.num_stages)]
            stages = tuple(StageState(t, d, d, 1) for t, d in g.stages)
            got = balance_layers(ev, stages, lbs, rep, links, k, mbs_options, clock)
            if got is None:
                continue
            state, e, _ = got
            pipes = [pipeline_plan(state, e.recompute, rk, lbs) for rk in ranks]
            best.offer(cost, Plan(model, cluster, gbs, pipes))
    finally:
        bar.close()
    why = no_plan_reason(ks, unit, gbs, need, too_small, f" ({tried} stage groups)")
    return finish("hexiscale-strong", best, cost, clock, options, why, cost_evaluations=ev.evaluations,
                  variant="strong")
