"""Megatron-LM style uniform baseline: one pipeline, identical stages.

Search space (every point is scored by :meth:`eth.cost.model.CostModel.evaluate`, Eq. 5 +
Eq. 6 + memory, and the fastest feasible one is kept -- an exhaustive search):

* stage size s = tp x dp divides every device type's count (a stage holds one type),
  pp = N / s stages, pp <= layers;
* tp: a power of two valid for every type (divides s, fits in a node, splits the model,
  profiled), dp = s / tp -- the same for every stage;
* layers: L split evenly, the remainder (L mod pp) one extra layer each to the first
  stages (Megatron's split);
* type order: the stages of each type are contiguous; every order of the types is
  tried (1F1B memory differs between first and last stages);
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


def uniform_plan(model, cluster, order, size: int, tp: int, mbs: int, gbs: int, ops) -> Plan:
    """The uniform plan for one point of the space (see module docstring)."""
    ranks = type_ranks(cluster)
    counts = cluster.type_counts()
    stages_of = [(t, i) for t in order for i in range(counts[t] // size)]
    split = even_split(model.num_layers, len(stages_of))
    stages, start = [], 0
    for (t, i), n in zip(stages_of, split):
        rec = {op: n for op in ops}
        stages.append(StagePlan(ranks[t][i * size:(i + 1) * size], t, tp, size // tp,
                                (start, start + n), rec))
        start += n
    return Plan(model, cluster, gbs, [PipelinePlan(mbs, gbs, stages)])


def plan_uniform(model, cluster, profiles, gbs: int, options: BaselineOptions) -> Plan:
    clock = Clock(options.time_limit)
    cost = CostModel(model, cluster, profiles, options.setup)
    best = Best()
    counts = cluster.type_counts()
    g = math.gcd(*counts.values())
    N = cluster.world_size
    sizes = [s for s in divisors(g) if N // s <= model.num_layers]
    orders = list(itertools.permutations(list(counts)))
    bar = progress_bar(len(sizes), options.progress, "uniform")
    try:
        for size in sizes:
            bar.update(1)
            for tp, order in itertools.product(uniform_tps(model, cluster, profiles, size), orders):
                dp = size // tp
                for m in powers_of_two(options.max_micro):
                    if clock.out():
                        break
                    mbs = dp * m
                    if gbs % mbs:
                        continue
                    for _, ops in recompute_modes(model):
                        plan = uniform_plan(model, cluster, order, size, tp, mbs, gbs, ops)
                        if best.offer(cost, plan) < math.inf:
                            break   # more recompute only adds time
    finally:
        bar.close()
    why = (f"no stage size dividing the type counts {counts} with at most {model.num_layers} "
           f"stages, tp x dp, mbs | gbs {gbs} and recompute (none/selective/full) fits in memory")
    return finish("uniform", best, cost, clock, options, why)
