"""Megatron-LM style uniform baseline: one pipeline, identical stages.

Search space (every point is scored by :meth:`eth.cost.model.CostModel.evaluate`, Eq. 5 +
Eq. 6 + memory, and the fastest feasible one is kept -- an exhaustive search):

* stage size s = tp x dp divides every device type's count (a stage holds one type),
  pp = N / s stages, pp <= layers;
* tp: a power of two valid for every type (divides s, fits in a node, splits the model,
  profiled), dp = s / tp -- the same for every stage;
* layers: L split evenly, the remainder (L mod pp) one extra layer each to the first
  stages (Megatron's split);
* type order: the stages of each type are contiguous; every order of up to
  ``EVERY_ORDER_UP_TO`` (4) types is tried (1F1B memory differs between first and last
  stages); with more types (120 orders for five, 720 for six, each a full sweep of the
  rest) a descent over orders (:func:`plan_uniform`): from the orders a user would lay
  the ranks out in (:func:`rank_orders`: the cluster's order, and the types by device
  memory and by speed, each ascending and descending), the orders with two types
  swapped are swept, first those of every start, then those of the best order found,
  while that finds a faster one;
* mbs = dp x m for per-replica micro-batches m = 1, 2, 4, .. <= max_micro, mbs | gbs;
* recompute, the same for every stage and layer, the cheapest of
  none < selective (core attention: score, softmax, attn-dropout, context) < full
  (every layer op) that fits in memory.
"""
from __future__ import annotations

import itertools
import math

from eth.cost.model import CostModel
from eth.spec.plan import PipelinePlan, Plan, StagePlan
from eth.planner.baselines.common import (recompute_modes, Best, BaselineOptions, divisors, finish,
                                          powers_of_two, type_ranks)
from eth.planner.progress import Clock, progress_bar
from eth.planner.options import SEARCH_OBJECTIVE

def even_split(num_layers: int, pp: int) -> list[int]:
    """Megatron's split: L // pp layers each, the first L mod pp stages one more."""
    q, r = divmod(num_layers, pp)
    return [q + 1] * r + [q] * (pp - r)


def uniform_tps(model, cluster, profiles, size: int) -> list[int]:
    """tp degrees valid for a stage of ``size`` devices of every type of the cluster."""
    out = []
    per_node = min(g.devices_per_node for g in cluster.nodes)
    for tp in powers_of_two(size):
        if size % tp or tp > per_node or not model.splits(tp):
            continue
        if all(tp in profiles.get(t).tps(model) for t in cluster.types):
            out.append(tp)
    return out


EVERY_ORDER_UP_TO = 4
"""Clusters of at most this many device types: uniform sweeps every type order."""


def rank_orders(cluster) -> list[tuple[str, ...]]:
    """The starting type orders of uniform's descent: the cluster's order and the types
    sorted by memory and by TFLOP/s, ascending and descending (ties in the cluster's
    order), each once."""
    types = list(cluster.type_counts())
    specs = cluster.types
    orders = [tuple(types)]
    for key in (lambda t: specs[t].memory_gb, lambda t: specs[t].tflops):
        up = tuple(sorted(types, key=key))
        orders += [up, tuple(sorted(types, key=key, reverse=True))]
    return list(dict.fromkeys(orders))


def _swaps(order: tuple) -> list[tuple]:
    """The orders with two types of ``order`` exchanged."""
    out = []
    for a, b in itertools.combinations(range(len(order)), 2):
        o = list(order)
        o[a], o[b] = o[b], o[a]
        out.append(tuple(o))
    return out


def uniform_plan(model, cluster, order, size: int, tp: int, mbs: int, gbs: int, ops, ranks=None) -> Plan:
    """The uniform plan for one point of the space (see module docstring); ``ranks``:
    :func:`type_ranks` of ``cluster`` when the caller has it (a sweep builds thousands)."""
    ranks = ranks if ranks is not None else type_ranks(cluster)
    stages_of = [(t, i) for t in order for i in range(len(ranks[t]) // size)]
    split = even_split(model.num_layers, len(stages_of))
    stages, start = [], 0
    for (t, i), n in zip(stages_of, split):
        rec = {op: n for op in ops}
        stages.append(StagePlan(ranks[t][i * size:(i + 1) * size], t, tp, size // tp,
                                (start, start + n), rec))
        start += n
    return Plan(model, cluster, gbs, [PipelinePlan(mbs, gbs, stages)])


def _may_fit(cost: CostModel, pipeline: PipelinePlan) -> bool:
    """False when a stage of ``pipeline`` does not fit in memory, as
    :meth:`eth.cost.model.CostModel.evaluate` would find (it sums the same stage costs),
    checked stage by stage from the first (the most micro-batches in flight) before the
    plan is scored: nearly every point of the sweep overflows.  With ZeRO the plan's exact
    per-rank state decides, so True."""
    if cost.setup.zero_stage > 0:
        return True
    return all(c.fits for c in cost.stage_costs(pipeline))


def plan_uniform(model, cluster, profiles, gbs: int, options: BaselineOptions) -> Plan:
    clock = Clock(options.time_limit)
    cost = CostModel(model, cluster, profiles, options.setup, objective=SEARCH_OBJECTIVE)
    best = Best()
    counts = cluster.type_counts()
    g = math.gcd(*counts.values())
    N = cluster.world_size
    sizes = [s for s in divisors(g) if N // s <= model.num_layers]
    tps = {size: uniform_tps(model, cluster, profiles, size) for size in sizes}
    ranks = type_ranks(cluster)

    def sweep(order) -> float:
        """Every plan of one type order (offered to ``best``); its fastest time."""
        fastest = math.inf
        for size in sizes:
            for tp in tps[size]:
                dp, ar = size // tp, None    # Eq. 6 reads neither mbs nor recompute: once per tp
                for m in powers_of_two(options.max_micro):
                    if clock.out():
                        return fastest
                    mbs = dp * m
                    if gbs % mbs:
                        continue
                    for _, ops in recompute_modes(model):
                        plan = uniform_plan(model, cluster, order, size, tp, mbs, gbs, ops, ranks)
                        if not _may_fit(cost, plan.pipelines[0]):
                            continue        # a stage overflows: more recompute
                        if ar is None:
                            ar = cost.stage_allreduce_ms(plan.pipelines)
                        ms = best.offer(cost, plan, ar)
                        fastest = min(fastest, ms)
                        if ms < math.inf:
                            break   # more recompute only adds time
        return fastest

    types = list(counts)
    every = len(types) <= EVERY_ORDER_UP_TO
    starts = list(itertools.permutations(types)) if every else rank_orders(cluster)
    bar = progress_bar(len(starts), options.progress, "uniform")
    try:
        swept = {}
        for order in starts:
            bar.update(1)
            swept[order] = sweep(order)
        here = list(starts)                   # first the neighbours of every start
        while not every and here and not clock.out():   # descent: swap two types
            before = min(swept.values())
            near = [o for order in here for o in _swaps(order) if o not in swept]
            for order in dict.fromkeys(near):
                if clock.out():
                    break
                swept[order] = sweep(order)
            if not near or min(swept.values()) >= before:
                break
            here = [min(swept, key=swept.get)]
    finally:
        bar.close()
    why = (f"no stage size dividing the type counts {counts} with at most {model.num_layers} "
           f"stages, tp x dp, mbs | gbs {gbs} and recompute (none/selective/full) fits in memory")
    return finish("uniform", best, cost, clock, options, why)
