"""Phase 2: local batch allocation across pipelines (paper Eq. 2-5).

    min over {Lbs_i}   max_i max_j Te_i^j                                   (2)
    subject to         sum_i Lbs_i >= Gbs                                   (3)
                       Lbs_i mod Mbs_i = 0                                  (4)
    Te_i^j = sum_k Tf_i^k + max_k T_i^k (Lbs_i / Mbs_i - 1) + sum_{k>=j} Tb_i^k + AR_i^j   (5)

For fixed stage configurations Eq. 5 is linear in Lbs_i, so the pipeline's end time is
``max_j Te_i^j = A_i + B_i * Lbs_i / Mbs_i`` with ``B_i = max_k T_i^k`` and
``A_i = sum_k Tf_i^k - B_i + max_j (sum_{k>=j} Tb_i^k + AR_i^j)``
(:func:`pipeline_line`, equal to :func:`eth.cost.equations.eq5_end_times`).

Greedy (:func:`allocate`): every pipeline starts with one micro-batch (the paper
starts at 0; a pipeline with no samples would idle its devices and the plan format
requires Lbs > 0).  Repeatedly, the pipeline whose increment by Mbs_i gives the
smallest maximum end time over all pipelines -- since an increment only raises that
pipeline's end, this is the one with the smallest new end -- gets Mbs_i more samples,
until sum Lbs_i >= Gbs.

Exact sums: the runtime needs sum Lbs_i == Gbs.  When the greedy overshoots, the
allocation is replaced by the exact split with the smallest Eq. 2 value
(:func:`exact_allocation`): for a threshold T each pipeline may take at most
n_i(T) = max{c : A_i + B_i c <= T} micro-batches; T is feasible if Gbs = sum c_i Mbs_i
for some 1 <= c_i <= n_i(T) (bounded coin change, numpy); the smallest feasible T among
the candidate end times is found by bisection and the c_i are read back.  If no exact
split exists :func:`allocate` returns None, or with ``allow_overshoot`` the paper's
greedy result (sum >= Gbs).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np


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


def _greedy(lines, mbs, gbs: int) -> list[int]:
    """The paper's greedy (after one micro-batch each): until sum >= gbs, give Mbs_i more
    samples to the pipeline with the smallest new end time.

    Pipeline i's c-th micro-batch ends at A_i + B_i c, increasing in c (B_i >= 0), so the
    heap pops the merged sequence of all (A_i + B_i c, i), c = 2, 3, ..., in sorted order:
    the result is the shortest prefix of that sorted sequence whose samples reach gbs.
    It is computed that way with numpy (:func:`_greedy_heap` is the heap loop)."""
    lbs = list(mbs)
    total = sum(lbs)
    if total >= gbs:
        return lbs
    if any(b < 0 for _, b in lines):
        return _greedy_heap(lines, mbs, gbs)
    need = gbs - total
    vals, owner, step = [], [], []
    for i, ((a, b), m) in enumerate(zip(lines, mbs)):
        c = np.arange(2, 2 + -(-need // m), dtype=np.int64)
        vals.append(a + b * c)
        owner.append(np.full(c.size, i, dtype=np.int64))
        step.append(np.full(c.size, m, dtype=np.int64))
    vals, owner, step = np.concatenate(vals), np.concatenate(owner), np.concatenate(step)
    order = np.lexsort((owner, vals))
    reached = np.cumsum(step[order])
    taken = order[:int(np.searchsorted(reached, need)) + 1]
    for i, k in zip(*np.unique(owner[taken], return_counts=True)):
        lbs[int(i)] += int(k) * mbs[int(i)]
    return lbs


def _greedy_heap(lines, mbs, gbs: int) -> list[int]:
    """:func:`_greedy` as the paper's heap loop (one pop per micro-batch)."""
    lbs = list(mbs)
    heap = [(lines[i][0] + lines[i][1] * 2, i) for i in range(len(lines))]
    heapq.heapify(heap)
    total = sum(lbs)
    while total < gbs:
        _, i = heapq.heappop(heap)
        lbs[i] += mbs[i]
        total += mbs[i]
        a, b = lines[i]
        heapq.heappush(heap, (a + b * (lbs[i] // mbs[i] + 1), i))
    return lbs


def _bounded_reach(mbs, limits, gbs: int):
    """Layers reach[i][r]: r samples from pipelines < i with 1 <= c_k <= limits[k].

    One layer is a sliding-window OR over each residue class mod Mbs (cumulative sums).
    """
    size = gbs + 1
    reach = [np.zeros(size, dtype=bool)]
    reach[0][0] = True
    for m, n in zip(mbs, limits):
        rows = -(-size // m)
        grid = np.zeros(rows * m, dtype=np.int64)
        grid[:size] = reach[-1]
        cs = np.vstack([np.zeros((1, m), dtype=np.int64), np.cumsum(grid.reshape(rows, m), axis=0)])
        k = np.arange(rows)
        window = cs[k] - cs[np.maximum(k - n, 0)]          # rows k-n .. k-1, i.e. c = 1..n
        reach.append(window.reshape(-1)[:size] > 0)
    return reach


def _bisect(ends, feasible, lo: int, hi: int) -> int:
    """Smallest index in [lo, hi] whose end time is feasible (``ends[hi]`` is)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(ends[mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _first_feasible(ends, feasible, guess: float) -> int:
    """:func:`_bisect` over all of ``ends`` (feasibility is monotone in T; ``ends[-1]`` is
    feasible), started at the ``guess`` (the greedy's end time, usually at or next to the
    answer): if the guess is feasible, the answer is it unless the end below is feasible
    too (then bisect below); otherwise gallop upwards to a feasible end and bisect the
    last step.  The same index as plain bisection, in fewer tests."""
    n = len(ends)
    g = min(int(np.searchsorted(ends, guess)), n - 1)
    if feasible(ends[g]):
        if g == 0 or not feasible(ends[g - 1]):
            return g
        return _bisect(ends, feasible, 0, g - 1)
    bad, step = g, 1
    while True:
        k = min(bad + step, n - 1)
        if k == n - 1 or feasible(ends[k]):
            return _bisect(ends, feasible, bad + 1, k)
        bad, step = k, step * 2


def exact_allocation(lines, mbs, gbs: int, guess: float | None = None) -> tuple[int, ...] | None:
    """Lbs with sum == gbs minimising max_i (A_i + B_i Lbs_i / Mbs_i); None if impossible.

    ``guess``: an end time near the answer (any value: the search from it returns the same
    Lbs as plain bisection)."""
    P = len(lines)
    caps = [gbs // m for m in mbs]
    if any(c < 1 for c in caps):
        return None
    ends = np.unique(np.concatenate([a + b * np.arange(1, cap + 1, dtype=np.int64)
                                     for (a, b), cap in zip(lines, caps)])).tolist()

    def limits(t):
        out = []
        for (a, b), cap in zip(lines, caps):
            n = cap if b <= 0 else min(cap, int(math.floor((t - a) / b + 1e-9)))
            out.append(n)
        return out

    def feasible(t):
        lim = limits(t)
        return all(n >= 1 for n in lim) and _bounded_reach(mbs, lim, gbs)[-1][gbs]

    if not feasible(ends[-1]):
        return None
    lo = _first_feasible(ends, feasible, guess) if guess is not None else _bisect(ends, feasible, 0, len(ends) - 1)
    lim = limits(ends[lo])
    reach = _bounded_reach(mbs, lim, gbs)
    lbs, r = [0] * P, gbs
    for i in range(P - 1, -1, -1):
        for c in range(1, lim[i] + 1):
            k = c * mbs[i]
            if k <= r and reach[i][r - k]:
                lbs[i], r = k, r - k
                break
    return tuple(lbs)


def allocate(lines, mbs, gbs: int, allow_overshoot: bool = False) -> Allocation | None:
    """Eq. 2-4 for pipelines with end-time lines ``(A_i, B_i)`` and micro-batch sizes ``mbs``."""
    def end(lbs):
        return max(a + b * n / m for (a, b), n, m in zip(lines, lbs, mbs))

    lbs = _greedy(lines, mbs, gbs)
    if sum(lbs) == gbs:
        return Allocation(tuple(lbs), end(lbs), True)
    exact = exact_allocation(lines, mbs, gbs, end(lbs))
    if exact is not None:
        return Allocation(exact, end(exact), True)
    if allow_overshoot:
        return Allocation(tuple(lbs), end(lbs), False)
    return None


def _spread(bits: int, step: int, copies: int, full: int) -> int:
    """OR of ``bits << (k * step)`` for k = 0 .. copies-1 (binary doubling), masked to ``full``."""
    out, offset, block, span = 0, 0, bits, 1
    while copies:
        if copies & 1:
            out |= block << (offset * step)
            offset += span
        copies >>= 1
        if copies:
            block |= block << (span * step)
            block &= full
            span *= 2
    return out & full


def allocate_with_variants(options, gbs: int):
    """Exact Eq. 2-4 when each pipeline may also pick its Mbs among variants.

    ``options[i]`` lists ``(mbs, A, B)`` of pipeline i (same stages, different Mbs).
    With f_i(n) = min over variants v with Mbs_v | n of A_v + B_v n / Mbs_v, minimise
    max_i f_i(Lbs_i) subject to sum_i Lbs_i = Gbs: bisection over the candidate values T;
    T is feasible if Gbs is a sum of one element of each {n : f_i(n) <= T}.

    Reachable sums are bitsets (Python ints, bit r = "r samples reachable").  The set
    {n : f_i(n) <= T} is the union over variants v of the runs of consecutive multiples
    c * Mbs_v (c0 <= c <= c1) whose value A_v + B_v c is <= T (one run when B_v >= 0);
    adding a run to a bitset is a shift by c0 * Mbs_v and an OR of (c1 - c0 + 1) copies
    spaced Mbs_v apart, built by doubling in O(log gbs) big-integer operations.  One
    feasibility test is thus O(P * variants * log(gbs) * gbs / 64) word operations
    instead of P convolutions of length gbs.  Returns (lbs, variant index per pipeline,
    max end) or None.
    """
    n = np.arange(gbs + 1)
    tables, lines = [], []
    for opts in options:
        best = np.full(gbs + 1, np.inf)
        arg = np.full(gbs + 1, -1)
        per = []
        for k, (m, a, b) in enumerate(opts):
            idx = n[m::m]
            vals = a + b * idx / m
            val = np.full(gbs + 1, np.inf)
            val[idx] = vals
            better = val < best
            best[better] = val[better]
            arg[better] = k
            per.append((m, vals))
        tables.append((best, arg))
        lines.append(per)
    finite = [b[np.isfinite(b)] for b, _ in tables]
    if any(f.size == 0 for f in finite):
        return None
    values = np.unique(np.concatenate(finite))
    full = (1 << (gbs + 1)) - 1

    def layers(t):
        out = [1]
        for per in lines:
            reach, nxt = out[-1], 0
            for m, vals in per:
                ok = np.concatenate(([False], vals <= t, [False]))
                edges = np.flatnonzero(ok[1:] != ok[:-1])   # run starts / ends (c - 1)
                for c0, c1 in zip(edges[0::2], edges[1::2]):  # c = c0+1 .. c1
                    shifted = (reach << (int(c0 + 1) * m)) & full
                    if shifted:
                        nxt |= _spread(shifted, m, int(c1 - c0), full)
            out.append(nxt)
        return out

    if not (layers(values[-1])[-1] >> gbs) & 1:
        return None
    lo, hi = 0, len(values) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if (layers(values[mid])[-1] >> gbs) & 1:
            hi = mid
        else:
            lo = mid + 1
    t = values[lo]
    reach = layers(t)
    lbs, pick, r = [0] * len(tables), [0] * len(tables), gbs
    for i in range(len(tables) - 1, -1, -1):
        best, arg = tables[i]
        prev = np.unpackbits(np.frombuffer(reach[i].to_bytes((gbs + 8) // 8, "little"), dtype=np.uint8),
                             bitorder="little")[:gbs + 1].astype(bool)
        k = np.arange(r + 1)
        hit = np.flatnonzero((best[:r + 1] <= t) & prev[r - k])
        k0 = int(hit[0])
        lbs[i], pick[i], r = k0, int(arg[k0]), r - k0
    return tuple(lbs), tuple(pick), float(t)


def alloc_key(results, batch: bool = True) -> tuple:
    """All that an allocation of ``results`` reads: per pipeline its stage group, state,
    the ranks its evaluation was made on and (``batch``) the number of micro-batches of
    its evaluation's batch, capped at the stage count (the stage costs read the batch only
    through the in-flight micro-batches min(S - j, B / Mbs); Eq. 1's ms is not read)."""
    if not batch:
        return tuple((r.group.stages, r.state, r.ranks) for r in results)
    return tuple((r.group.stages, r.state, r.ranks,
                  min(len(r.state.stages), max(1, -(-r.batch // r.state.mbs)))) for r in results)


def shift_batches(lbs, mbs, score, current: float, rounds: int = 16) -> tuple[tuple[int, ...], float]:
    """Hill-climb an exact allocation on a whole-plan ``score`` (Lbs vector -> ms) that
    Eq. 5's lines do not describe (the gradient-timed objective couples the pipelines
    through the blocks they share): of the moves of lcm(Mbs_i, Mbs_j) samples from a
    pipeline i to another j, take the best while it lowers the score (at most ``rounds``
    moves).  Returns (Lbs, its score); sums and multiples of Mbs are kept."""
    lbs, best = tuple(lbs), current
    for _ in range(rounds):
        moves = []
        for i in range(len(lbs)):
            for j in range(len(lbs)):
                step = math.lcm(mbs[i], mbs[j])
                if i != j and lbs[i] - step >= mbs[i]:
                    trial = list(lbs)
                    trial[i] -= step
                    trial[j] += step
                    moves.append((score(tuple(trial)), tuple(trial)))
        if not moves or min(moves)[0] >= best * (1 - 1e-12):
            break
        best, lbs = min(moves)
    return lbs, best
