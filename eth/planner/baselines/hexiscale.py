"""Faithful HexiScale baseline (``hexiscale``; Yan et al., "HexiScale: Accommodating
Large Language Model Training over Heterogeneous Environment", 2024).

What the published system does, as modelled here (in the same cost model, profiles and
plan format as HPP):

* k IDENTICAL pipelines (same device-type composition and stage layout); the global
  batch is split evenly, Lbs = Gbs / k (k divides every type count and Gbs);
* every stage is pure tensor parallel: tp = its devices, dp = 1 (stage sizes must be
  valid tp degrees: power of two, inside a node, splitting the model);
* layers are split in proportion to each stage's memory (devices x device memory,
  largest remainder, at least one layer per stage) -- not by time;
* at most N // 5 pipelines (N = devices of the cluster; HexiScale's main.py), taken here
  as k <= max(1, N // 5) so that a cluster of fewer than 10 devices still plans with k = 1
  (:func:`pipeline_cap`);
* one fixed micro-batch size (``BaselineOptions.fixed_mbs``, default 4, the value of the
  paper's Table 3 HexiScale plan), lowered to the largest power of two dividing Lbs when
  Lbs is not a multiple of it;
* full recompute always (HexiScale's cost model always includes it): every op of every
  layer of every stage is recomputed.

Search (:func:`plan_hexiscale`): every k up to the cap and every stage device group of one
pipeline (:func:`eth.planner.enumerate.stage_groups`: device types in any order, the
devices of a type cut into equal stages) gives exactly one plan under the rules above;
each is scored by :meth:`eth.cost.model.CostModel.evaluate` (Eq. 5 + Eq. 6, per-device
memory) and the fastest feasible one wins.  When none fits, the InfeasibleError's reason
names the ks tried and, if the cap left some out, the cap, N and the ks it left out.

Where it departs from the published system: HexiScale's own search (a graph partition of
the devices followed by a genetic search over the pipeline layout) and its own cost model
are replaced by the enumeration above and by our cost model; its device groups are the
type-contiguous ones of :func:`stage_groups`; the fixed micro-batch size is ours (the
paper does not state one we could use beyond Table 3).  The strong version, which
balances layers by time, searches Mbs and recomputes per stage, is
:mod:`eth.planner.baselines.hexiscale_strong` (``hexiscale-strong``).
"""
from __future__ import annotations

import math

from eth.cost.model import CostModel
from eth.spec.model import layer_ops
from eth.spec.plan import PipelinePlan, Plan, StagePlan
from eth.planner.baselines.common import Best, BaselineOptions, divisors, finish, proportional_split
from eth.planner.progress import Clock, progress_bar
from eth.planner.enumerate import Blocks, assign_ranks, make_blocks, stage_groups
from eth.planner.evaluate import Evaluator
from eth.planner.options import SEARCH_OBJECTIVE


def fixed_micro(fixed: int, lbs: int) -> int:
    """The fixed micro-batch size, lowered to the largest power of two <= it dividing lbs."""
    m = 1
    while m * 2 <= fixed and lbs % (m * 2) == 0:
        m *= 2
    return m


def pipeline_counts(cluster, unit, need: float, gbs: int):
    """HexiScale's pipeline counts: (ks, fits, too_small) where ks are the k dividing every
    type count of ``unit`` (make_blocks, one device per block) and ``gbs``; fits the
    (k, devices per type of one pipeline) whose memory holds ``need`` bytes of model
    states; too_small the other ks."""
    ks = [k for k in divisors(math.gcd(*unit.count)) if gbs % k == 0]
    fits, too_small = [], []
    for k in ks:
        per = tuple(c // k for c in unit.count)
        mem = sum(n * cluster.types[t].memory_bytes for t, n in zip(unit.types, per))
        (fits.append((k, per)) if mem >= need else too_small.append(k))
    return ks, fits, too_small


def pipeline_cap(cluster) -> int:
    """HexiScale's largest pipeline count: N // 5 over the cluster's N devices (its
    main.py), at least 1."""
    return max(1, cluster.world_size // 5)


def tp_stage_groups(unit, per, model, ev, options, clock, orders=None):
    """The stage device groups of one pipeline (``per`` devices of each type of ``unit``;
    of the type ``orders`` only, if given) whose every stage is a valid tp degree
    (HexiScale's dp = 1), until the clock runs out."""
    for g in stage_groups(unit.types, per, model.num_layers, options.max_stages, orders):
        if clock.out():
            return
        if all(n in ev.valid_tps(t, n) for t, n in g.stages):
            yield g


def no_plan_reason(ks, unit, gbs: int, need: float, too_small, rules: str) -> str:
    """The one-line reason neither HexiScale version found a plan."""
    why = (f"tried stage groups over k in {ks} identical pipelines (k must divide the type counts "
           f"{dict(zip(unit.types, unit.count))} and gbs {gbs}){rules}; none fits in memory with dp = 1 "
           f"per stage (tp <= devices per node)")
    if too_small:
        why += (f"; for k in {too_small} one pipeline's devices hold less than the model's "
                f"{need / 1e9:.1f} GB of weights, gradients and optimizer states")
    return why


def memory_split(cluster, stages, num_layers: int) -> list[int]:
    """Layers per stage in proportion to the stage's memory (devices x device memory)."""
    return proportional_split(num_layers, [n * cluster.types[t].memory_bytes for t, n in stages])


def hexiscale_plan(model, cluster, blocks: Blocks, stages, k: int, gbs: int, mbs: int, ops) -> Plan:
    """The k-pipeline plan of one stage group with memory-proportional layers."""
    split = memory_split(cluster, stages, model.num_layers)
    ranks = assign_ranks(blocks, [list(stages)] * k)
    lbs = gbs // k
    pipes = []
    for rk in ranks:
        out, start = [], 0
        for (t, n), r, nl in zip(stages, rk, split):
            out.append(StagePlan(list(r), t, n, 1, (start, start + nl), {op: nl for op in ops}))
            start += nl
        pipes.append(PipelinePlan(mbs, lbs, out))
    return Plan(model, cluster, gbs, pipes)


def plan_hexiscale(model, cluster, profiles, gbs: int, options: BaselineOptions) -> Plan:
    clock = Clock(options.time_limit)
    cost = CostModel(model, cluster, profiles, options.setup, objective=SEARCH_OBJECTIVE)
    ev = Evaluator(cost)
    unit = make_blocks(cluster, cluster.world_size)      # one device per block: types, ranks
    need = model.num_params() * cost.bytes_per_param
    ks, fits, too_small = pipeline_counts(cluster, unit, need, gbs)
    cap = pipeline_cap(cluster)
    capped = [k for k, _ in fits if k > cap]
    fits = [(k, per) for k, per in fits if k <= cap]
    ops = layer_ops(model)                               # full recompute, always
    best = Best()
    tried = 0
    bar = progress_bar(len(fits), options.progress, "hexiscale")
    try:
        for k, per in fits:
            bar.update(1)
            lbs = gbs // k
            mbs = fixed_micro(options.fixed_mbs, lbs)
            blocks = Blocks(unit.types, per, (k,) * len(per), unit.ranks)
            for g in tp_stage_groups(unit, per, model, ev, options, clock):
                tried += 1
                best.offer(cost, hexiscale_plan(model, cluster, blocks, g.stages, k, gbs, mbs, ops))
    finally:
        bar.close()
    why = no_plan_reason([k for k in ks if k <= cap], unit, gbs, need, [k for k in too_small if k <= cap],
                         f" ({tried} stage groups) with memory-proportional layers, fixed mbs "
                         f"{options.fixed_mbs} and full recompute")
    if capped:
        why += (f"; k is capped at max(1, N // 5) = {cap} for N = {cluster.world_size} devices "
                f"(HexiScale's main.py), which leaves out k in {capped}")
    return finish("hexiscale", best, cost, clock, options, why, variant="faithful",
                  stage_groups=tried, max_pipelines=cap)
