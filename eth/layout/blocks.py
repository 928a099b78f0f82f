"""Gradient layout of a plan: which ranks reduce which piece of which parameter, fused
into which buffer at what offset.  Pure Python; the runtime's reducer and sharded
optimizer (``megatron.hpp.distributed.grad_sync``, ``megatron.hpp.distributed.optimizer``) allocate and
communicate exactly what this describes, and tests check it without processes.

A *replica* of a block (``embedding``, ``layer l``, ``head``: ``eth.layout.params``) is one dp
replica of the stage that holds the block in one pipeline: its tp ranks in tp order
(``StagePlan.replica``).  Every replica holds the whole block between its tp ranks,
so the gradient of the global batch is the sum over replicas.  A :class:`Piece` is
chunk ``c`` of ``chunks`` equal chunks of a parameter along its tp dimension (the
whole parameter when ``chunks`` is 1 or it is replicated inside a tp group).  A
:class:`Buffer` is one collective: its participants (ascending, = rank order in the
process group) lay out the same pieces at the same offsets; each participant adds the
part of each piece it holds and reads back the reduced values.

Strategies (paper section 4.3 and its two comparison methods):

* ``block``: per block, g = lcm of the replicas' tp degrees (tp_max when they are
  powers of two).  Partitioning: chunk c of every tp-partitioned parameter of the
  block forms sub-block (block, c), held in every replica by tp rank c * tp / g, so a
  rank of tp < g holds g / tp sub-blocks of each block.  Parameters replicated inside
  a tp group (layernorms, row-parallel biases, position embedding) join sub-block 0,
  i.e. only tp rank 0 of each replica adds them: each element counted once.  Fusion:
  sub-blocks with the same participants are concatenated in model order; a fused
  buffer is cut at sub-block boundaries into buckets of at most ``bucket_numel``
  elements (0: never cut), each one collective, launched as soon as its layers'
  last backward is done.
* ``tensor``: the same pieces, one collective per piece (no fusion).
* ``device``: per holder set (every rank of every replica of a block), the full
  parameters of all blocks with that holder set, each rank writing its tp part at its
  place and zeros elsewhere (tp-replicated parameters: tp rank 0 only) -- the padded
  method; all holders participate and read their own parts back.  A block held by a
  single replica has nothing to reduce; its tp ranks keep their shares as in ``block``.

Parameters replicated inside a tp group that no buffer gives to tp ranks other than 0
(:meth:`GradLayout.tp_broadcast`) are stepped by tp rank 0 and broadcast in the tp
group after the optimizer step.

ZeRO (:meth:`Buffer.shard`): participant i of N owns elements
[i s, min((i + 1) s, numel)) with s = ceil(numel / N); collectives run on the buffer
padded to N s elements.  Every element of every parameter lies in exactly one buffer,
so the shards partition the model (each element stepped and counted once).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from eth.errors import PlanError
from eth.layout.params import ShardSpec, block_position, block_specs, stage_blocks
from eth.spec.plan import Plan

STRATEGIES = ("block", "device", "tensor")


@dataclass(frozen=True)
class Piece:
    """``full.chunk(chunks, spec.dim)[chunk]`` of a logical parameter (whole if replicated)."""

    spec: ShardSpec
    chunk: int = 0
    chunks: int = 1

    @property
    def shape(self) -> tuple:
        if self.spec.dim is None or self.chunks == 1:
            return self.spec.full_shape
        shape = list(self.spec.full_shape)
        shape[self.spec.dim] //= self.chunks
        return tuple(shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Region:
    """Where a rank's local parameter meets a piece: ``length`` rows along ``dim`` from
    ``piece_start`` in the piece and from ``local_start`` in the local shard (dim None:
    the whole piece is the whole local parameter)."""

    dim: int | None
    piece_start: int = 0
    local_start: int = 0
    length: int = 0


@dataclass(frozen=True)
class Buffer:
    """One collective: participants, pieces and their offsets (identical on every participant)."""

    name: str
    ranks: tuple[int, ...]
    pieces: tuple[Piece, ...]
    blocks: tuple[str, ...]
    """Blocks the pieces belong to (the buffer is final when all their backwards are)."""
    offsets: tuple[int, ...] = field(init=False)
    numel: int = field(init=False)

    def __post_init__(self):
        offsets, total = [], 0
        for p in self.pieces:
            offsets.append(total)
            total += p.numel
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "numel", total)

    @property
    def position(self) -> int:
        """Lowest model position among its blocks: buffers are launched in descending order."""
        return min(block_position(b) for b in self.blocks)

    @property
    def shard_size(self) -> int:
        return -(-self.numel // len(self.ranks))

    @property
    def padded_numel(self) -> int:
        return self.shard_size * len(self.ranks)

    def shard(self, rank: int) -> tuple[int, int]:
        """ZeRO shard [lo, hi) of participant ``rank`` (may be empty at the end)."""
        i, s = self.ranks.index(rank), self.shard_size
        return min(i * s, self.numel), min((i + 1) * s, self.numel)


@dataclass(frozen=True)
class RankInfo:
    tp: int
    tp_rank: int
    blocks: tuple[str, ...]
    replica: tuple[int, ...]
    """The rank's tp group (its dp replica of its stage), in tp-rank order."""


class GradLayout:
    """The gradient buffers of a plan under one strategy (see module docstring)."""

    def __init__(self, plan: Plan, strategy: str = "block", bucket_numel: int = 0):
        if strategy not in STRATEGIES:
            raise PlanError(f"grad sync {strategy!r} is not one of {', '.join(STRATEGIES)}")
        self.plan, self.strategy, self.bucket_numel = plan, strategy, bucket_numel
        self.info: dict[int, RankInfo] = {}
        replicas: dict[str, list[tuple[int, ...]]] = {}
        held = stage_blocks(plan)
        for i, pipe in enumerate(plan.pipelines):
            for j, st in enumerate(pipe.stages):
                keys = held[i, j]
                for d in range(st.dp):
                    rep = st.replica(d)
                    for t, r in enumerate(rep):
                        self.info[r] = RankInfo(st.tp, t, keys, rep)
                    for key in keys:
                        replicas.setdefault(key, []).append(rep)
        order = sorted(replicas, key=block_position)
        self.replicas = {k: replicas[k] for k in order}
        build = {"block": self._block, "tensor": self._tensor, "device": self._device}[strategy]
        self.buffers: tuple[Buffer, ...] = tuple(build())
        self._by_rank: dict[int, list[Buffer]] = {}
        for buf in self.buffers:
            for r in buf.ranks:
                self._by_rank.setdefault(r, []).append(buf)

    # ------------------------------------------------------------------ strategies
    def _sub_blocks(self, only_single: bool = False):
        """(participants, block, pieces) of every sub-block, in model order (only those
        of blocks held by a single replica with ``only_single``)."""
        spec = self.plan.model
        for key, reps in self.replicas.items():
            if only_single and len(reps) > 1:
                continue
            g = math.lcm(*(len(rep) for rep in reps))
            params = block_specs(spec, key)
            for p in params:
                if p.dim is not None and p.full_shape[p.dim] % g:
                    raise PlanError(f"{key}: {p.name} has {p.full_shape[p.dim]} rows along its tp "
                                    f"dimension, not divisible by lcm {g} of the tp degrees "
                                    f"{sorted({len(r) for r in reps})} holding it; use --grad-sync device")
            for c in range(g):
                ranks = tuple(sorted(rep[c * len(rep) // g] for rep in reps))
                pieces = tuple(Piece(p, c, g) for p in params if p.dim is not None)
                if c == 0:
                    pieces += tuple(Piece(p) for p in params if p.dim is None)
                yield ranks, key, pieces

    def _block(self):
        fused: dict[tuple, list] = {}
        for ranks, key, pieces in self._sub_blocks():
            fused.setdefault(ranks, []).append((key, pieces))
        return self._bucketed("block", fused)

    def _tensor(self):
        for ranks, key, pieces in self._sub_blocks():
            for p in pieces:
                yield Buffer(f"tensor {p.spec.name} [{p.chunk}/{p.chunks}]", ranks, (p,), (key,))

    def _device(self):
        fused: dict[tuple, list] = {}
        for key, reps in self.replicas.items():
            if len(reps) > 1:
                ranks = tuple(sorted(r for rep in reps for r in rep))
                fused.setdefault(ranks, []).append((key, tuple(Piece(p) for p in block_specs(self.plan.model, key))))
        # a block of one replica has nothing to reduce: each tp rank alone with its share
        for ranks, key, pieces in self._sub_blocks(only_single=True):
            fused.setdefault(ranks, []).append((key, pieces))
        return self._bucketed("device", fused)

    def _bucketed(self, kind, fused):
        """Cut each fused list of (block, pieces) into buckets at block boundaries."""
        for ranks, items in fused.items():
            bucket, size, n = [], 0, 0
            for key, pieces in items:
                numel = sum(p.numel for p in pieces)
                if bucket and self.bucket_numel and size + numel > self.bucket_numel:
                    yield self._make(kind, ranks, bucket, n)
                    bucket, size, n = [], 0, n + 1
                bucket.append((key, pieces))
                size += numel
            yield self._make(kind, ranks, bucket, n)

    @staticmethod
    def _make(kind, ranks, bucket, n) -> Buffer:
        blocks = tuple(dict.fromkeys(key for key, _ in bucket))
        span = blocks[0] if len(blocks) == 1 else f"{blocks[0]} .. {blocks[-1]}"
        return Buffer(f"{kind} {span} ranks {_short(ranks)} #{n}", ranks,
                      tuple(p for _, pieces in bucket for p in pieces), blocks)

    # ------------------------------------------------------------------ per rank
    def buffers_of(self, rank: int) -> list[Buffer]:
        """Buffers ``rank`` participates in, in launch order (descending model position)."""
        mine = self._by_rank.get(rank, [])
        return sorted(mine, key=lambda b: -b.position)

    def region(self, rank: int, piece: Piece) -> Region | None:
        """The part of ``piece`` that ``rank`` holds, or None."""
        info = self.info[rank]
        if piece.spec.block not in info.blocks:
            return None
        dim = piece.spec.dim
        if dim is None:
            return Region(None)
        g = math.lcm(piece.chunks, info.tp)
        cell = piece.spec.full_shape[dim] // g
        p_lo, r_lo = piece.chunk * g // piece.chunks, info.tp_rank * g // info.tp
        lo = max(p_lo, r_lo)
        hi = min((piece.chunk + 1) * g // piece.chunks, (info.tp_rank + 1) * g // info.tp)
        if lo >= hi:
            return None
        return Region(dim, (lo - p_lo) * cell, (lo - r_lo) * cell, (hi - lo) * cell)

    def contributes(self, rank: int, piece: Piece) -> bool:
        """``rank`` adds its gradient of (part of) ``piece``: it holds it, and for a
        tp-replicated parameter it is tp rank 0 of its replica."""
        return self.region(rank, piece) is not None and (piece.spec.dim is not None
                                                           or self.info[rank].tp_rank == 0)

    def tp_broadcast(self, rank: int) -> list[str]:
        """tp-replicated parameters of ``rank``'s blocks that only tp rank 0 of its
        replica steps (no buffer of the other tp ranks holds them): after the optimizer
        step tp rank 0 broadcasts them in the tp group.  The same list on every tp rank."""
        info = self.info[rank]
        if info.tp == 1:
            return []
        held = {p.spec.name for b in self._by_rank.get(info.replica[1], []) for p in b.pieces}
        return [p.name for key in info.blocks for p in block_specs(self.plan.model, key)
                if p.dim is None and p.name not in held]

    def groups(self) -> list[tuple[int, ...]]:
        """Distinct participant sets of more than one rank, in a fixed order (every
        rank creates the process groups in this order)."""
        return list(dict.fromkeys(b.ranks for b in self.buffers if len(b.ranks) > 1))


def _short(ranks) -> str:
    ranks = list(ranks)
    if len(ranks) > 4:
        return f"{ranks[0]},{ranks[1]}..{ranks[-1]} ({len(ranks)})"
    return ",".join(map(str, ranks))
