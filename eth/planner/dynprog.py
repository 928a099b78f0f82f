"""Dynamic programming over device splits (paper section 5.4, Eq. 10).

For a fixed ordering of the cluster's blocks b_1..b_n (see eth.planner.enumerate):

    Tp(R_1^n) = Tp(pipe_1^n)
    Tp(R_p^n) = max_{i in [p-1, n-1]}  Tp(R_{p-1}^i) + Tp(pipe_{i+1}^n)        (10)

where pipe_{i+1}^n is one pipeline made of blocks i+1..n and Tp its phase-1 throughput
(samples/ms at Gbs; 0 = infeasible, which makes the split invalid).  The table
``f[p][n]`` (best summed throughput of the first n blocks in p pipelines) and its
argmax ``arg[p][n]`` are filled in O(P n^2) look-ups by :func:`split_dp`; the best
partition for every p is read back.  The search runs it on several orderings (type
major, round-robin interleaved, and seeded random shuffles) and then balances and
refines each DP partition like any other device group.
"""
from __future__ import annotations

import math


def split_dp(order: list[int], num_types: int, max_pipelines: int, throughput) -> dict[int, tuple]:
    """Best partition of ``order`` (block type indices) into p contiguous pipelines.

    ``throughput(vec)`` gives Tp of a pipeline with block vector ``vec``.  Returns
    {p: (summed throughput, (vec, ...))} for each p that has a valid split.
    """
    n = len(order)
    prefix = [[0] * num_types]
    for t in order:
        row = list(prefix[-1])
        row[t] += 1
        prefix.append(row)

    def seg(i, k):  # blocks i+1..k (1-based), i.e. order[i:k]
        return tuple(b - a for a, b in zip(prefix[i], prefix[k]))

    memo: dict = {}

    def tp(vec):
        if vec not in memo:
            memo[vec] = throughput(vec)
        return memo[vec]

    neg = -math.inf
    # f[p][k]: best throughput of the first k blocks in p pipelines
    f = [[neg] * (n + 1) for _ in range(max_pipelines + 1)]
    arg = [[-1] * (n + 1) for _ in range(max_pipelines + 1)]
    f[0][0] = 0.0
    for p in range(1, max_pipelines + 1):
        for k in range(p, n + 1):
            for i in range(p - 1, k):
                if f[p - 1][i] == neg:
                    continue
                value = tp(seg(i, k))
                if value <= 0:
                    continue
                total = f[p - 1][i] + value
                if total > f[p][k]:
                    f[p][k], arg[p][k] = total, i
    result = {}
    for p in range(1, max_pipelines + 1):
        if f[p][n] == neg:
            continue
        parts, k = [], n
        for q in range(p, 0, -1):
            i = arg[q][k]
            parts.append(seg(i, k))
            k = i
        result[p] = (f[p][n], tuple(sorted(parts, reverse=True)))
    return result
