"""The search's last choice: its finalists scored by the final objective and the best of
them re-scored by the event simulator.

The search ranks device groups by lines of Eq. 5 (:mod:`eth.planner.allocate`), which
see each pipeline alone.  Its finalists (the polished groups, the symmetric phase's
best, the best so far, and the seed planners' plans) are scored again on the whole plan
by the objective the user asked for (``SearchOptions.objective``; "blocks": gradient
blocks reduced once their slowest holder in any pipeline is done; the :data:`SHIFTED`
best with their Lbs shifted between pipelines by :func:`shifted_lbs` where that helps),
and those within
:data:`FINALIST_MARGIN` of the best by it are simulated
(:func:`eth.cost.reduction.simulated_iteration_ms`: the simulator's iteration, its
concurrent collectives sharing the links): the fastest simulated plan wins
(``SearchOptions.simulate_finalists``)."""
from __future__ import annotations

import math
import time
from dataclasses import replace

from eth.spec.plan import Plan
from eth.planner.allocate import shift_batches
from eth.cost.reduction import simulated_iteration_ms

FINALIST_MARGIN = 0.02
"""Finalists within this fraction of the best by the objective are simulated (the
objective and the simulator agree within about this on the paper's plans)."""


SHIFTED = 3
"""The finalists (best first by the objective) whose Lbs :func:`shifted_lbs` shifts."""
SAME_MS = 1e-4
"""Simulated times this close (ms; stored times are rounded to 1e-4) are equal: the
better objective wins."""


def shifted_lbs(cost, plan: Plan) -> Plan:
    """``plan`` with its Lbs hill-climbed on the whole plan's time by ``cost`` where that is
    faster (:func:`eth.planner.allocate.shift_batches`): under the "blocks" objective
    pipelines wait for each other's gradient blocks, which the per-pipeline lines the
    allocation balances do not see.  Stages, Mbs and recompute are kept."""
    if cost.objective != "blocks" or len(plan.pipelines) < 2:
        return plan
    ar, blocks = cost.stage_allreduce_ms(plan.pipelines), cost.sync_blocks(plan.pipelines)
    trial = Plan(plan.model, plan.cluster, plan.gbs, [replace(p, predicted={}) for p in plan.pipelines])

    def score(lbs):
        for p, n in zip(trial.pipelines, lbs):
            p.lbs = n
        got = cost.evaluate(trial, ar, blocks)
        return got["iteration_ms"] if got["feasible"] else math.inf

    start = tuple(p.lbs for p in plan.pipelines)
    now = score(start)
    lbs, ms = shift_batches(start, [p.mbs for p in plan.pipelines], score, now)
    if ms >= now * (1 - 1e-12):
        return plan
    score(lbs)
    return trial


def choose(cost, plans: list[Plan], simulate_them: bool = True) -> tuple[int, dict]:
    """The index of the plan to return among ``plans`` (each annotated by ``cost``, which
    carries the final objective) and a record for ``plan.search["finalists"]``: how many
    were scored, how many simulated, their objective and simulated times and the seconds
    it took.  A plan's ``predicted["simulated_ms"]``, where set, is taken as simulated.
    Without ``simulate_them`` the best by the objective wins."""
    start = time.perf_counter()
    scores = [p.predicted["iteration_ms"] if p.predicted.get("feasible", True) else math.inf for p in plans]
    best = min(range(len(plans)), key=lambda i: scores[i])
    simulated: list[float | None] = [None] * len(plans)
    if simulate_them and math.isfinite(scores[best]):
        bar = scores[best] * (1 + FINALIST_MARGIN)
        for i, p in enumerate(plans):
            if p.predicted.get("simulated_ms") is not None:
                simulated[i] = p.predicted["simulated_ms"]
            elif scores[i] <= bar:
                simulated[i] = simulated_iteration_ms(p, cost)
        fastest = min(s for s in simulated if s is not None)
        # equal within the rounding of a stored simulated_ms: the better objective, then the first
        best = min((i for i in range(len(plans)) if simulated[i] is not None and
                    simulated[i] <= fastest + SAME_MS), key=lambda i: (scores[i], i))
    record = {"scored": len(plans), "simulated": sum(s is not None for s in simulated),
              "objective_ms": [round(s, 4) for s in scores],
              "simulated_ms": [None if s is None else round(s, 4) for s in simulated],
              "chosen": best, "seconds": round(time.perf_counter() - start, 3)}
    return best, record
