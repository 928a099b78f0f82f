"""Strong Metis-style baseline (``metis-strong``): ONE pipeline over all devices, HPP machinery.

This is a *strong* version of Metis: it keeps Metis's restriction (one pipeline, Lbs =
Gbs, no data balancing) but gets HPP's stage balancer, Mbs search and recompute, which
the real system lacks.  The faithful version is :mod:`eth.planner.baselines.metis`
(``metis``).  Plans made before the two were split record ``"strategy": "metis"`` and
no ``"variant"``: they came from this planner.

Metis balances the stages of a single pipeline with per-stage tp/dp and uneven layer
counts; it cannot balance with data (one pipeline, Lbs = Gbs).  This is exactly the
HPP phase-1 problem for the pipeline that holds every device (Eq. 1 with B = Gbs):

    min over {stage device group, tp_j, dp_j, l_j, ro_j, Mbs}
        sum_j T_j + max_j T_j (Gbs / Mbs - 1)      (+ the stages' own All-Reduce)

so it reuses the HPP machinery restricted to that pipeline: every stage device group
of the whole cluster (:func:`eth.planner.enumerate.stage_groups`; with 4 or more device
types those of the ``type_orders`` most promising type orders, as the HPP search), the warm start
(:func:`eth.planner.balance.warm_start`) and the Aceso-style stage balancer
(:func:`eth.planner.balance.balance`: layer moves, tp <-> dp, mbs) with the adaptive
budgets of section 6.  Recompute: by default per stage the cheapest of none / selective /
full that fits (``BaselineOptions.recompute = "stage"``, Megatron granularity; op-level
stage-specific recompute is one of ETH's own contributions, section 4.2.3); "op" gives
Metis the HPP rule.  Each balanced group becomes a plan scored by
:meth:`eth.cost.model.CostModel.evaluate` (Eq. 5 + Eq. 6); the fastest feasible one wins.
With ``prune`` the groups are balanced in ascending order of their floor
(:func:`eth.planner.bounds.stage_group_floors`, a lower bound of the pipeline's Eq. 1 time
over every configuration, so of its iteration time) and the rest are left once a floor
exceeds the best iteration time found: the same best plan.
"""
from __future__ import annotations

from eth.cost.model import CostModel
from eth.spec.plan import Plan
from eth.planner.balance import balance, warm_start
from eth.planner.baselines.common import Best, BaselineOptions, finish, floor_order, make_evaluator, pipeline_plan
from eth.planner.progress import Clock, progress_bar
from eth.planner.enumerate import make_blocks, stage_groups
from eth.planner.pipeline import adaptive_budgets, promising_orders, stage_ranks
from eth.planner.options import SEARCH_OBJECTIVE


def plan_metis_strong(model, cluster, profiles, gbs: int, options: BaselineOptions) -> Plan:
    clock = Clock(options.time_limit)
    cost = CostModel(model, cluster, profiles, options.setup, objective=SEARCH_OBJECTIVE)
    ev = make_evaluator(cost, options)
    blocks = make_blocks(cluster, options.max_blocks_per_type)
    vec = blocks.count
    orders = promising_orders(ev, blocks, vec, gbs, options.max_stages, options.type_orders)
    groups = stage_groups(blocks.types, blocks.devices(vec), model.num_layers, options.max_stages, orders)
    budgets = adaptive_budgets(cluster, groups, options.balance_budget) if groups else []
    best = Best()
    bar = progress_bar(len(groups), options.progress, "metis-strong")
    ranks_of = [stage_ranks(ev, blocks, g) for g in groups]
    try:
        for floor, (g, ranks, budget) in floor_order(ev, list(zip(groups, ranks_of, budgets)),
                                                     [(g.stages, r) for g, r in zip(groups, ranks_of)], gbs,
                                                     options.prune):
            bar.update(1)
            if clock.out() or floor > best.iteration_ms * (1 + 1e-9):
                break           # no plan of this or a later group can be faster
            init = warm_start(ev, g.stages, gbs, ranks)
            if init is None:
                continue
            state, e, _ = balance(ev, init[0], gbs, ranks, budget, init[1])
            if not e.feasible:
                continue
            best.offer(cost, Plan(model, cluster, gbs, [pipeline_plan(state, e.recompute, ranks, gbs)]))
    finally:
        bar.close()
    why = (f"none of {len(groups)} stage device groups of the single pipeline fits in memory "
           f"with an mbs that divides gbs {gbs}")
    return finish("metis-strong", best, cost, clock, options, why, stage_groups=len(groups),
                  cost_evaluations=ev.evaluations, variant="strong")
