"""Uneven local-batch slicing of each global batch, and the two data sources.

Global batch t has gbs samples, each [seq_len + 1] tokens (inputs = [:-1], labels =
[1:]), deterministic given (seed, t, sample index), so any rank can build exactly the
samples it needs.  Slicing (plan conventions):

    pipeline i          samples [sum(lbs[:i]), sum(lbs[:i+1]))
    micro-batch m       mbs consecutive samples of the pipeline's slice
    stage dp rank d     mbs/dp consecutive samples of the micro-batch

Sources (anything with ``sample(iteration, index)``): :class:`SyntheticData`
(arithmetic token sequences mod vocab, so the loss visibly falls) and
``datasets.GPTSource`` (megatron-core indexed datasets, ``--data-path``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eth.errors import SpecError
from eth.spec.plan import Plan


def _generator(seed: int, iteration: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(((seed * 1_000_003 + iteration) * 1_000_033 + index) % 2**63)


@dataclass(frozen=True)
class SyntheticData:
    """Sample = (a + k * step) mod vocab for k = 0..seq_len, random a and step in [1, 7]."""

    vocab: int
    seq_len: int
    seed: int

    def sample(self, iteration: int, index: int) -> torch.Tensor:
        gen = _generator(self.seed, iteration, index)
        start = int(torch.randint(self.vocab, (1,), generator=gen))
        step = int(torch.randint(1, 8, (1,), generator=gen))
        return (start + step * torch.arange(self.seq_len + 1)) % self.vocab


def batch(source, iteration: int, start: int, end: int) -> torch.Tensor:
    """Samples [start, end) of global batch ``iteration``: int64 [end - start, seq_len + 1]."""
    return torch.stack([source.sample(iteration, i) for i in range(start, end)])


def pipeline_offset(plan: Plan, pipeline: int) -> int:
    return sum(p.lbs for p in plan.pipelines[:pipeline])


def sample_range(plan: Plan, pipeline: int, microbatch: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """Global sample indices [start, end) of one stage dp replica for one micro-batch."""
    pipe = plan.pipelines[pipeline]
    if not 0 <= microbatch < pipe.num_microbatches:
        raise IndexError(f"micro-batch {microbatch} outside 0..{pipe.num_microbatches - 1}")
    if pipe.mbs % dp:
        raise SpecError(f"pipeline {pipeline} mbs {pipe.mbs} is not divisible by dp {dp}")
    size = pipe.mbs // dp
    start = pipeline_offset(plan, pipeline) + microbatch * pipe.mbs + dp_rank * size
    return start, start + size


def overlaps(mbs: int, dp_from: int, dp_to: int) -> list[tuple[int, int, int, int]]:
    """Resharding between stages: (src dp rank, dst dp rank, start, end) for every
    non-empty overlap of their sample slices within one micro-batch (offsets in mbs)."""
    a, b = mbs // dp_from, mbs // dp_to
    out = []
    for s in range(dp_from):
        for d in range(dp_to):
            lo, hi = max(s * a, d * b), min((s + 1) * a, (d + 1) * b)
            if lo < hi:
                out.append((s, d, lo, hi))
    return out
