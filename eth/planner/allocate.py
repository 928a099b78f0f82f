"""Phase 2: local batch allocation across pipelines (paper Eq. 2-5).

    min over {Lbs_i}   max_i max_j Te_i^j                                   (2)
    subject to         sum_i Lbs_i >= Gbs                                   (3)
                       Lbs_i mod Mbs_i = 0                                  (4)
    Te_i^j = sum_k Tf_i^k + max_k T_i^k (Lbs_i / Mbs_i - 1) + sum_{k>=j} Tb_i^k + AR_i^j   (5)

For fixed stage configurations Eq. 5 is linear in Lbs_i, so the pipeline's end time is
``max_j Te_i^j = A_i + B_i * Lbs_i / Mbs_i`` with ``B_i = max_k T_i^k`` and
``A_i = sum_k Tf_i^k - B_i + max_j (sum_{k>=j} Tb_i^k + AR_i^j)``
(:func:`pipeline_line`, equal to :func:`eth.cost.eq5_end_times`).

Greedy (:func:`allocate`): every pipeline starts with one micro-batch (the paper
starts at 0; a pipeline with no samples would idle its devices and the plan format
requires Lbs > 0).  Repeatedly, the pipeline whose increment by Mbs_i gives the
smallest maximum end time over all pipelines -- since an increment only raises that
pipeline's end, this is the one with the smallest new end -- gets Mbs_i more samples,
until sum Lbs_i >= Gbs.

Exact sums: the runtime needs sum Lbs_i == Gbs.  The allocator therefore only
considers increments after which the remaining samples can still be written as a
non-negative combination of the pipelines' Mbs (a coin-change table over 0..Gbs), so
the greedy ends exactly on Gbs whenever any combination allows it.  If none does, it
returns None, or with ``allow_overshoot`` falls back to the paper's rule (stop at the
first sum >= Gbs).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Allocation:
    lbs: tuple[int, ...]
    end_ms: float
    """max_i max_j Te_i^j (Eq. 2) at this allocation."""
    exact: bool
    """sum(lbs) == gbs."""


def pipeline_line(costs, mbs: int, ar_ms) -> tuple[float, float]:
    """(A, B) with max_j Te^j = A + B * Lbs / Mbs (Eq. 5)."""
    b = max(c.total_ms for c in costs)
    head = sum(c.fwd_ms for c in costs) - b
    tail, worst = 0.0, 0.0
    for j in range(len(costs) - 1, -1, -1):
        tail += costs[j].bwd_ms
        worst = max(worst, tail + (ar_ms[j] if ar_ms else 0.0))
    return head + worst, b


def reachable_table(values, total: int) -> list[bool]:
    """reach[r]: r is a non-negative integer combination of ``values``."""
    reach = [False] * (total + 1)
    reach[0] = True
    for v in sorted(set(values)):
        for r in range(v, total + 1):
            if reach[r - v]:
                reach[r] = True
    return reach


def allocate(lines, mbs, gbs: int, allow_overshoot: bool = False) -> Allocation | None:
    """Greedy Eq. 2-4 for pipelines with end-time lines ``(A_i, B_i)`` and ``mbs[i]``."""
    P = len(lines)
    lbs = list(mbs)
    rest = gbs - sum(lbs)
    if rest < 0:
        if not allow_overshoot:
            return None
        rest = 0

    def end(i, n):
        a, b = lines[i]
        return a + b * n / mbs[i]

    exact = True
    reach = reachable_table(mbs, max(rest, 0))
    if rest > 0 and not reach[rest]:
        if not allow_overshoot:
            return None
        exact = False
    while rest > 0:
        best, best_end = -1, 0.0
        for i in range(P):
            if exact and (mbs[i] > rest or not reach[rest - mbs[i]]):
                continue
            e = end(i, lbs[i] + mbs[i])
            if best < 0 or e < best_end:
                best, best_end = i, e
        lbs[best] += mbs[best]
        rest -= mbs[best]
    final = max(end(i, lbs[i]) for i in range(P))
    return Allocation(tuple(lbs), final, sum(lbs) == gbs)
