"""Exhaustive reference search over the planner's space (small inputs only, for tests).

Same space as :mod:`eth.planner.search`: device groups and stage device groups from
:mod:`eth.planner.enumerate`, every layer split (compositions of L into S parts), every
valid tp per stage (dp = devices / tp), every mbs of the form lcm(dp_j) * 2^k <= Gbs,
recompute derived by the same rule (:meth:`eth.planner.evaluate.Evaluator.fit_stage`),
and every local batch vector (Lbs_i multiple of Mbs_i, Lbs_i >= Mbs_i, sum = Gbs).
Each combination is scored by :meth:`eth.cost.model.CostModel.evaluate` with ``objective``
(the gradient-timed end times by default, or the paper's Eq. 5 + Eq. 6).
"""
from __future__ import annotations

import itertools
import math

from eth.cost.model import CostModel
from eth.spec.plan import PipelinePlan, Plan, StagePlan
from eth.planner.enumerate import (assign_ranks, device_groups, make_blocks, pipeline_can_hold,
                                   plan_tp_in_nodes, stage_groups)
from eth.planner.evaluate import Evaluator, PipeState, StageState


def compositions(n: int, k: int):
    """Ordered splits of n into k positive parts."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0,) + cuts + (n,)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def lbs_vectors(mbs, gbs: int):
    """All (Lbs_i) with Lbs_i = c_i * Mbs_i, c_i >= 1, sum = gbs."""
    def rec(i, rest):
        if i == len(mbs):
            if rest == 0:
                yield ()
            return
        for c in range(1, rest // mbs[i] + 1):
            for tail in rec(i + 1, rest - c * mbs[i]):
                yield (c * mbs[i],) + tail
    yield from rec(0, gbs)


def pipeline_configs(ev: Evaluator, blocks, vec, gbs: int, max_stages: int):
    """Every (stage group stages, PipeState, recompute, representative ranks) of one pipeline."""
    L = ev.model.num_layers
    for g in stage_groups(blocks.types, blocks.devices(vec), L, max_stages):
        ranks = assign_ranks(blocks, [list(g.stages)])[0]
        tps = [ev.valid_tps(t, n, r) for (t, n), r in zip(g.stages, ranks)]
        if not all(tps):
            continue
        for split in compositions(L, g.num_stages):
            for tp in itertools.product(*tps):
                base = math.lcm(*[n // x for (_, n), x in zip(g.stages, tp)])
                mbs = base
                while mbs <= gbs:
                    state = PipeState(tuple(StageState(t, n, x, l) for (t, n), x, l
                                            in zip(g.stages, tp, split)), mbs)
                    e = ev.evaluate(state, gbs, ranks)
                    if e.feasible:
                        yield g, state, e.recompute
                    mbs *= 2


def brute_force(model, cluster, profiles, gbs: int, max_stages: int = 16,
                max_blocks_per_type: int = 8, limit: int = 2_000_000,
                objective: str = "blocks") -> tuple[float, Plan | None]:
    """(best iteration ms, plan) over the whole space; raises if it exceeds ``limit`` combinations."""
    cost = CostModel(model, cluster, profiles, objective=objective)
    ev = Evaluator(cost)
    blocks = make_blocks(cluster, max_blocks_per_type)
    best = (math.inf, None)
    configs: dict = {}
    work = 0
    for p in range(1, min(blocks.total, gbs) + 1):
        ok = lambda v: pipeline_can_hold(cluster, blocks, v, model, cost.bytes_per_param)  # noqa: E731
        for vecs in device_groups(blocks.count, p, ok):
            per = []
            for v in vecs:
                if v not in configs:
                    configs[v] = list(pipeline_configs(ev, blocks, v, gbs, max_stages))
                per.append(configs[v])
            for combo in itertools.product(*per):
                ranks = assign_ranks(blocks, [list(g.stages) for g, _, _ in combo])
                pipes = []
                for (g, state, rec), rk in zip(combo, ranks):
                    stages = [StagePlan(r, st.device_type, st.tp, st.dp, rng, dict(rc))
                              for st, rng, rc, r in zip(state.stages, state.layer_ranges(), rec, rk)]
                    pipes.append(PipelinePlan(state.mbs, state.mbs, stages))
                plan = Plan(model, cluster, gbs, pipes)
                if not plan_tp_in_nodes(plan):  # the planner's rule: tp groups stay in a node
                    continue
                for lbs in lbs_vectors([s.mbs for _, s, _ in combo], gbs):
                    work += 1
                    if work > limit:
                        raise ValueError(f"brute force exceeds {limit} combinations")
                    for pp, n in zip(plan.pipelines, lbs):
                        pp.lbs = n
                    out = cost.evaluate(plan)
                    if out["feasible"] and out["iteration_ms"] < best[0]:
                        best = (out["iteration_ms"], Plan.from_dict(plan.to_dict()))
    return best
