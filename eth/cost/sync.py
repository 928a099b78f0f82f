"""Gradient synchronisation and model-state cost of a plan, from the block structure of
the block-wise All-Reduce (paper section 4.3) and the training setup
(``eth.spec.precision.TrainSetup``).  Pure arithmetic over parameter counts: it does not
build the runtime's layout (``eth.layout.blocks``), so tests can hold the two against each
other.

Block structure.  A block (embedding, layer l, head) is held by R replicas (one per
dp replica of the stage holding it, in every pipeline); g = lcm of their tp degrees.
Sub-block c (0 <= c < g) is chunk c of every tp-partitioned parameter of the block,
plus, for c = 0, the parameters replicated inside a tp group; its participants are
tp rank c * tp / g of every replica (N = R ranks).  Sub-blocks with the same
participants form one buffer of B elements (:func:`block_groups`).

Per collective group (:func:`group_sync_bytes`):  ZeRO 0 all-reduces B x g bytes;
ZeRO 1/2 reduce-scatter the buffer padded to N ceil(B / N) elements in the gradient
dtype and all-gather it in the weight dtype.

Per rank (:func:`rank_state_bytes`), what the runtime allocates:

    weights    w x the rank's parameters (tp shards + replicated ones)
    gradients  ZeRO 0: g x B of each of its buffers; ZeRO 1: g x N ceil(B / N)
               (padded); ZeRO 2 after the step: g x ceil(B / N) (its shard); during the
               backward pass ZeRO 2 holds the full padded buffers like ZeRO 1
    optimizer  12 x the elements it steps (8 when fp32 weights are stepped in place,
               ``TrainSetup.optimizer_bytes``): B with ZeRO 0, its shard
               [i s, min((i + 1) s, B)) with s = ceil(B / N) with ZeRO 1/2

AR_i^j of a stage (:func:`stage_allreduce_ms`, Eq. 6 with Gra from the block
structure): tp rank 0 of a replica holds sub-block 0 of each block (the replicated
parameters) besides its tp share, so its gradient is (P_part / tp + P_repl) elements
per block, Eq. 6 with N = R, BW the slowest link among the block's holders, and
Gra = elements x ``TrainSetup.sync_bytes_per_element`` (g, or (g + w) / 2 for the
reduce-scatter + all-gather of ZeRO).
"""
from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from functools import lru_cache

from eth.layout.params import block_position, block_specs, stage_blocks
from eth.spec.plan import stage_holding


@lru_cache(maxsize=64)
def block_split(model, block: str) -> tuple[int, int]:
    """(tp-partitioned, tp-replicated) parameter elements of a block."""
    part = repl = 0
    for p in block_specs(model, block):
        if p.dim is None:
            repl += p.numel
        else:
            part += p.numel
    return part, repl


def _replicas(plan) -> dict[str, list[tuple[int, ...]]]:
    out: dict = {}
    held = stage_blocks(plan)
    for i, pipe in enumerate(plan.pipelines):
        for j, st in enumerate(pipe.stages):
            for key in held[i, j]:
                out.setdefault(key, []).extend(st.replica(d) for d in range(st.dp))
    return out


def block_groups(plan) -> dict[tuple[int, ...], int]:
    """Elements per participant set (every set, also single ranks) of the block-wise layout."""
    out: dict = {}
    for key, reps in sorted(_replicas(plan).items(), key=lambda kv: block_position(kv[0])):
        g = math.lcm(*(len(r) for r in reps))
        part, repl = block_split(plan.model, key)
        for c in range(g):
            ranks = tuple(sorted(r[c * len(r) // g] for r in reps))
            out[ranks] = out.get(ranks, 0) + part // g + (repl if c == 0 else 0)
    return out


def group_sync_bytes(plan, setup) -> dict[tuple[int, ...], int]:
    """Bytes of the collectives of each participant set of > 1 rank, one step."""
    out = {}
    for ranks, b in block_groups(plan).items():
        n = len(ranks)
        if n > 1:
            out[ranks] = (b * setup.grad_bytes if setup.zero_stage == 0
                          else n * -(-b // n) * (setup.grad_bytes + setup.weight_bytes))
    return out


def rank_state_bytes(plan, setup) -> dict[int, dict[str, int]]:
    """{rank: {"weights", "grads", "optimizer"}} bytes the runtime allocates (after a step)."""
    out = {}
    held = stage_blocks(plan)
    for i, pipe in enumerate(plan.pipelines):
        for j, st in enumerate(pipe.stages):
            keys = held[i, j]
            params = sum(part // st.tp + repl for part, repl in (block_split(plan.model, k) for k in keys))
            for r in st.ranks:
                out[r] = {"weights": params * setup.weight_bytes, "grads": 0, "optimizer": 0}
    for ranks, b in block_groups(plan).items():
        n, s = len(ranks), -(-b // len(ranks))
        for i, r in enumerate(ranks):
            if setup.zero_stage == 0:
                grads, stepped = b, b
            else:
                grads = s if setup.zero_stage == 2 else n * s
                stepped = max(min((i + 1) * s, b) - min(i * s, b), 0)
            out[r]["grads"] += grads * setup.grad_bytes
            out[r]["optimizer"] += stepped * setup.optimizer_bytes
    return out


def stage_allreduce_ms(cost, pipelines) -> list[list[float]]:
    """AR_i^j (ms) for every stage j of every pipeline i (see module docstring).

    The layers fall into segments between consecutive stage boundaries of all pipelines;
    each segment has one holder set (the stage of every pipeline holding it), whose
    replica count and slowest link are found once, and a stage sums, segment by segment,
    the segment's layer count times one layer's Eq. 6 at the stage's tp."""
    from eth.cost.equations import eq6_allreduce_ms

    if any(getattr(st, "ops", None) is not None for q in pipelines for st in q.stages):
        return _blockwise_allreduce_ms(cost, pipelines)
    model, per_elem = cost.model, cost.setup.sync_bytes_per_element()
    layer_part, layer_repl = block_split(model, "layer 0")
    bounds = sorted({b for q in pipelines for st in q.stages for b in st.layers})
    # the stage of pipeline q holding a layer: bisection on the stages' first layers
    starts = [[hs.layers[0] for hs in q.stages] for q in pipelines]
    segments = {}      # segment start -> (replicas N, slowest link) of its holders
    for a, b in zip(bounds, bounds[1:]):
        holders = [_holding(q, s, a) for q, s in zip(pipelines, starts)]
        segments[a] = (sum(hs.dp for hs in holders),
                       cost.cluster.link_gbps([r for hs in holders for r in hs.ranks]))
    per_layer = {}     # (segment start, tp) -> one layer's Eq. 6 ms
    edges = {}
    result = []
    for p in pipelines:
        row = []
        for st in p.stages:
            total, (start, end) = 0.0, st.layers
            k = bisect_right(bounds, start) - 1
            while start < end:
                span_end = bounds[k + 1]
                ms = per_layer.get((start, st.tp))
                if ms is None:
                    n, gbps = segments[start]
                    ms = per_layer[(start, st.tp)] = eq6_allreduce_ms(
                        (layer_part / st.tp + layer_repl) * per_elem, n, gbps)
                total += (span_end - start) * ms
                start, k = span_end, k + 1
            for edge in ("embedding", "head"):
                if (edge == "embedding" and st.layers[0] == 0) or (edge == "head" and end == model.num_layers):
                    ms = edges.get((edge, st.tp))
                    if ms is None:
                        holders = [q.stages[0] if edge == "embedding" else q.stages[-1] for q in pipelines]
                        part, repl = block_split(model, edge)
                        ms = edges[(edge, st.tp)] = eq6_allreduce_ms(
                            (part / st.tp + repl) * per_elem, sum(hs.dp for hs in holders),
                            cost.cluster.link_gbps([r for hs in holders for r in hs.ranks]))
                    total += ms
            row.append(total)
        result.append(row)
    return result


def _blockwise_allreduce_ms(cost, pipelines) -> list[list[float]]:
    """:func:`stage_allreduce_ms` block by block (:func:`eth.layout.params.stage_blocks`):
    for plans whose stages start or end inside a layer, whose layers are cut into parts."""
    from types import SimpleNamespace

    from eth.cost.equations import eq6_allreduce_ms

    held = stage_blocks(SimpleNamespace(model=cost.model, pipelines=pipelines))
    holders: dict[str, list] = {}
    for (i, j), keys in held.items():
        for key in keys:
            holders.setdefault(key, []).append(pipelines[i].stages[j])
    per_elem, result = cost.setup.sync_bytes_per_element(), []
    for i, p in enumerate(pipelines):
        row = []
        for j, st in enumerate(p.stages):
            total = 0.0
            for key in held[i, j]:
                part, repl = block_split(cost.model, key)
                hs = holders[key]
                total += eq6_allreduce_ms((part / st.tp + repl) * per_elem, sum(h.dp for h in hs),
                                          cost.cluster.link_gbps([r for h in hs for r in h.ranks]))
            row.append(total)
        result.append(row)
    return result


def _holding(q, starts, layer: int):
    """:func:`eth.spec.plan.stage_holding` (the stage itself) by bisection on ``starts``."""
    j = bisect_right(starts, layer) - 1
    if j >= 0:
        hs = q.stages[j]
        if hs.layers[0] <= layer < hs.layers[1]:
            return hs
    return q.stages[stage_holding(q, layer)]   # no such stage: its error


@dataclass(frozen=True)
class SyncBlock:
    """One fused gradient block: the stages (pipeline, stage) that hold it and, per holder,
    Eq. 6 for the holder's share (its tp rank 0: tp share + replicated parameters)."""

    holders: tuple[tuple[int, int], ...]
    holder_ms: tuple[float, ...]
    label: str = ""

    @property
    def duration_ms(self) -> float:
        """The block's All-Reduce alone: its lowest-tp holder, which carries the most of
        it, sets the pace (each of its sub-block collectives waits for that holder)."""
        return max(self.holder_ms, default=0.0)


def sync_blocks(cost, pipelines) -> list[SyncBlock]:
    """The gradient blocks of ``pipelines`` with their holders and Eq. 6 times.

    Parts: every layer segment between consecutive stage boundaries (of all pipelines
    together) is held by one stage per pipeline; the embedding (word + position) by
    every first stage, final layernorm + head by every last stage; a plan whose stages
    start or end inside a layer, block by block (:func:`eth.layout.params.stage_blocks`).
    Parts with the same holder set are fused into one block, which the runtime reduces
    with one collective per sub-block group (``eth.layout.blocks``).  A holder's time is
    Eq. 6 over N = the holders' summed dp degrees and the slowest link among all their
    ranks, the figures :func:`stage_allreduce_ms` sums per stage."""
    from types import SimpleNamespace

    from eth.cost.equations import eq6_allreduce_ms

    model, cluster = cost.model, cost.cluster
    parts: dict[tuple, list[tuple[str, tuple[int, int]]]] = {}
    if any(getattr(st, "ops", None) is not None for q in pipelines for st in q.stages):
        holding: dict[str, list] = {}
        for where, keys in stage_blocks(SimpleNamespace(model=model, pipelines=pipelines)).items():
            for key in keys:
                holding.setdefault(key, []).append(where)
        for key, holders in sorted(holding.items(), key=lambda kv: block_position(kv[0])):
            name = {"embedding": "emb", "head": "head"}.get(key, key.replace("layer ", "L"))
            parts.setdefault(tuple(holders), []).append((name, block_split(model, key)))
    else:
        cuts = sorted({b for q in pipelines for st in q.stages for b in st.layers})
        layer_part, layer_repl = block_split(model, "layer 0")
        for a, b in zip(cuts, cuts[1:]):
            holders = tuple((i, stage_holding(q, a)) for i, q in enumerate(pipelines))
            parts.setdefault(holders, []).append((f"L{a}-{b - 1}", ((b - a) * layer_part, (b - a) * layer_repl)))
        first = tuple((i, 0) for i in range(len(pipelines)))
        last = tuple((i, len(q.stages) - 1) for i, q in enumerate(pipelines))
        parts.setdefault(first, []).insert(0, ("emb", block_split(model, "embedding")))
        parts.setdefault(last, []).append(("head", block_split(model, "head")))
    per_elem, blocks = cost.grad_bytes, []
    for holders, items in parts.items():
        stages = [pipelines[i].stages[j] for i, j in holders]
        n = sum(s.dp for s in stages)
        gbps = cluster.link_gbps([r for s in stages for r in s.ranks])
        times = tuple(sum(eq6_allreduce_ms((part / s.tp + repl) * per_elem, n, gbps) for _, (part, repl) in items)
                      for s in stages)
        blocks.append(SyncBlock(holders, times, "+".join(name for name, _ in items)))
    return blocks
