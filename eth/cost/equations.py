"""The paper's pipeline-time equations over per-stage costs (section 4.2.3).

Eq. 1, pipeline time for the stage search (batch B = Gbs or Lbs) -- :func:`eq1_pipeline_ms`:

    sum_j T_j + max_j T_j * (B / Mbs - 1)

Eq. 5, end time of stage j of pipeline i for batch allocation -- :func:`eq5_end_times`:

    Te_i^j = sum_k Tf_i^k + max_k T_i^k * (Lbs_i / Mbs_i - 1) + sum_{k>=j} Tb_i^k + AR_i^j

Eq. 6, All-Reduce of a gradient block -- :func:`eq6_allreduce_ms`:

    AR = 2 * Gra * (N - 1) / (N * BW)

:class:`StageCost` is what they read: one stage's forward and backward time per
micro-batch and its memory, as :class:`eth.cost.model.CostModel` predicts it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageCost:
    """Per-micro-batch times (ms) and per-device memory (bytes) of one stage."""

    fwd_ms: float
    bwd_ms: float
    recompute_ms: float
    """Part of bwd_ms spent re-running forward ops."""
    comm_ms: float
    """Part of fwd_ms + bwd_ms spent in TP collectives and stage-boundary p2p."""
    params: float
    """Parameters held by one device."""
    act_bytes: float
    """Saved activations of one micro-batch on one device, after recompute."""
    inflight: int
    memory_bytes: float
    capacity_bytes: float
    send_fwd_ms: float = 0.0
    """Part of fwd_ms spent sending the activation to the next stage (and, when
    transfers block both ends, receiving the input from the previous one)."""
    send_bwd_ms: float = 0.0
    """Part of bwd_ms spent sending the input gradient to the previous stage (and, when
    transfers block both ends, receiving the output gradient from the next one)."""

    @property
    def total_ms(self) -> float:
        return self.fwd_ms + self.bwd_ms

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.capacity_bytes


def eq1_pipeline_ms(costs, batch: int, mbs: int) -> float:
    """Eq. 1: sum_j T_j + max_j T_j * (batch / mbs - 1)."""
    totals = [c.total_ms for c in costs]
    return sum(totals) + max(totals) * (batch / mbs - 1)


def eq5_end_times(costs, lbs: int, mbs: int, ar_ms=None) -> list[float]:
    """Eq. 5: end time Te^j of every stage j of one pipeline with ``lbs`` samples."""
    if lbs <= 0:
        return [0.0] * len(costs)
    ar_ms = ar_ms or [0.0] * len(costs)
    head = sum(c.fwd_ms for c in costs) + max(c.total_ms for c in costs) * (lbs / mbs - 1)
    ends, tail = [], 0.0
    for j in range(len(costs) - 1, -1, -1):
        tail += costs[j].bwd_ms
        ends.append(head + tail + ar_ms[j])
    return ends[::-1]


STEP_ALLREDUCES = 3
"""All-reduces over every rank in each training step after the backward
(``megatron.hpp.training.loop.Trainer.step``): the gradient norm's, and the statistics' sum
and max."""


def eq6_allreduce_ms(grad_bytes: float, n: int, gbps: float) -> float:
    """Eq. 6: 2 * Gra * (N - 1) / (N * BW), BW in Gbit/s, result in ms."""
    if n <= 1 or grad_bytes <= 0:
        return 0.0
    bytes_per_ms = gbps * 1e9 / 8 / 1e3
    return 2 * grad_bytes * (n - 1) / (n * bytes_per_ms)
