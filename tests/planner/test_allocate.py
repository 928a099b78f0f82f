import math
import random
from dataclasses import fields

import pytest

from eth.cost.equations import StageCost, eq5_end_times
from eth.planner.allocate import allocate, exact_allocation, pipeline_line
from eth.planner.bruteforce import lbs_vectors


def stage_cost(fwd, bwd):
    zero = {f.name: 0 for f in fields(StageCost)}
    return StageCost(**(zero | {"fwd_ms": fwd, "bwd_ms": bwd, "inflight": 1, "capacity_bytes": 1}))


def brute(lines, mbs, gbs):
    best = None
    for lbs in lbs_vectors(mbs, gbs):
        end = max(a + b * n / m for (a, b), n, m in zip(lines, lbs, mbs))
        if best is None or end < best:
            best = end
    return best


def random_lines(rng, p):
    return [(rng.uniform(0, 50), rng.uniform(1, 20)) for _ in range(p)]


def test_pipeline_line_equals_eq5():
    rng = random.Random(0)
    for _ in range(20):
        costs = [stage_cost(rng.uniform(1, 9), rng.uniform(1, 9)) for _ in range(rng.randint(1, 5))]
        ar = [rng.uniform(0, 5) for _ in costs]
        mbs, lbs = rng.choice([1, 2, 4]), 0
        a, b = pipeline_line(costs, mbs, ar)
        for k in (1, 3, 8):
            lbs = k * mbs
            assert math.isclose(a + b * lbs / mbs, max(eq5_end_times(costs, lbs, mbs, ar)))


def test_greedy_is_optimal_with_unit_micro_batches():
    rng = random.Random(1)
    for _ in range(50):
        p = rng.randint(1, 4)
        lines, mbs, gbs = random_lines(rng, p), [1] * p, rng.randint(p, 12)
        got = allocate(lines, mbs, gbs)
        assert sum(got.lbs) == gbs and got.exact
        assert math.isclose(got.end_ms, brute(lines, mbs, gbs))


def test_greedy_vs_brute_force_with_mixed_micro_batches():
    rng = random.Random(2)
    checked = 0
    for _ in range(200):
        p = rng.randint(1, 3)
        lines = random_lines(rng, p)
        mbs = [rng.choice([1, 2, 4]) for _ in range(p)]
        gbs = rng.randint(4, 16)
        got = allocate(lines, mbs, gbs)
        best = brute(lines, mbs, gbs)
        if best is None:
            assert got is None  # no exact split exists
            continue
        checked += 1
        assert got is not None and sum(got.lbs) == gbs
        assert all(n % m == 0 and n >= m for n, m in zip(got.lbs, mbs))
        # greedy is within one micro-batch of the slowest pipeline of the optimum
        assert got.end_ms <= best + max(b for _, b in lines) + 1e-9
    assert checked > 100


def test_unreachable_gbs_and_overshoot():
    lines = [(1.0, 2.0), (1.0, 3.0)]
    assert allocate(lines, [2, 4], 7) is None          # odd gbs from even mbs
    assert allocate(lines, [4, 4], 6) is None          # below one micro-batch each
    got = allocate(lines, [2, 4], 7, allow_overshoot=True)
    assert sum(got.lbs) >= 7 and not got.exact


@pytest.mark.parametrize("gbs", [8, 9, 10])
def test_exact_sum_is_found_when_some_combination_allows_it(gbs):
    lines = [(0.0, 1.0), (0.0, 1.0)]
    got = allocate(lines, [3, 2], gbs)
    assert got is not None and sum(got.lbs) == gbs


def test_exact_allocation_is_optimal():
    rng = random.Random(4)
    for _ in range(150):
        p = rng.randint(1, 3)
        lines = random_lines(rng, p)
        mbs = [rng.choice([1, 2, 3, 4]) for _ in range(p)]
        gbs = rng.randint(3, 18)
        best = brute(lines, mbs, gbs)
        got = exact_allocation(lines, mbs, gbs)
        if best is None:
            assert got is None
        else:
            assert sum(got) == gbs and all(n % m == 0 and n >= m for n, m in zip(got, mbs))
            end = max(a + b * n / m for (a, b), n, m in zip(lines, got, mbs))
            assert math.isclose(end, best)


def test_allocation_with_mbs_variants_is_optimal():
    import itertools

    from eth.planner.allocate import allocate_with_variants
    rng = random.Random(5)
    for _ in range(120):
        p, gbs = rng.randint(1, 3), rng.randint(3, 14)
        opts = [[(m, rng.uniform(0, 10), rng.uniform(1, 5) * m ** 0.7) for m in rng.sample([1, 2, 3, 4], 2)]
                for _ in range(p)]

        def f(i, n):
            vals = [a + b * n / m for m, a, b in opts[i] if n % m == 0]
            return min(vals) if vals else math.inf

        best = min((max(f(i, n) for i, n in enumerate(lbs))
                    for lbs in itertools.product(range(1, gbs + 1), repeat=p) if sum(lbs) == gbs),
                   default=math.inf)
        got = allocate_with_variants(opts, gbs)
        if best == math.inf:
            assert got is None
            continue
        lbs, pick, end = got
        assert sum(lbs) == gbs and math.isclose(end, best)
        assert all(n % opts[i][k][0] == 0 for i, (n, k) in enumerate(zip(lbs, pick)))


def _variants_by_convolution(options, gbs):
    """The former allocate_with_variants (subset sums by np.convolve, quadratic in gbs):
    the brute-force reference of the bitset version."""
    import numpy as np
    n = np.arange(gbs + 1)
    tables = []
    for opts in options:
        best = np.full(gbs + 1, np.inf)
        arg = np.full(gbs + 1, -1)
        for k, (m, a, b) in enumerate(opts):
            idx = n[m::m]
            val = np.full(gbs + 1, np.inf)
            val[idx] = a + b * idx / m
            better = val < best
            best[better] = val[better]
            arg[better] = k
        tables.append((best, arg))
    finite = [b[np.isfinite(b)] for b, _ in tables]
    if any(f.size == 0 for f in finite):
        return None
    values = np.unique(np.concatenate(finite))

    def layers(t):
        out = [np.zeros(gbs + 1, dtype=bool)]
        out[0][0] = True
        for best, _ in tables:
            conv = np.convolve(out[-1].astype(np.int64), (best <= t).astype(np.int64))[:gbs + 1]
            out.append(conv > 0)
        return out

    if not layers(values[-1])[-1][gbs]:
        return None
    lo, hi = 0, len(values) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if layers(values[mid])[-1][gbs]:
            hi = mid
        else:
            lo = mid + 1
    t = values[lo]
    reach = layers(t)
    lbs, pick, r = [0] * len(tables), [0] * len(tables), gbs
    for i in range(len(tables) - 1, -1, -1):
        best, arg = tables[i]
        for k in np.nonzero(best[:r + 1] <= t)[0]:
            if reach[i][r - k]:
                lbs[i], pick[i], r = int(k), int(arg[k]), r - int(k)
                break
    return tuple(lbs), tuple(pick), float(t)


def test_variant_allocation_equals_the_convolution_reference():
    from eth.planner.allocate import allocate_with_variants
    rng = random.Random(11)
    kinds = {"none": 0, "found": 0}
    for case in range(300):
        p = rng.randint(1, 6)
        gbs = rng.choice([rng.randint(1, 40), rng.randint(40, 400)])
        opts = []
        for _ in range(p):
            sizes = rng.sample([1, 2, 3, 4, 6, 8, 16, 32, 48], rng.randint(1, 4))
            # integer-valued lines make ties (equal end times) common; a few negative slopes
            # give runs that are suffixes instead of prefixes
            if case % 3 == 0:
                opts.append([(m, float(rng.randint(0, 5)), float(rng.randint(-1, 4))) for m in sizes])
            else:
                opts.append([(m, rng.uniform(0, 50), rng.uniform(0.1, 10) * m ** 0.8) for m in sizes])
        ref = _variants_by_convolution(opts, gbs)
        got = allocate_with_variants(opts, gbs)
        assert got == ref, (opts, gbs)
        kinds["none" if ref is None else "found"] += 1
    assert kinds["none"] > 10 and kinds["found"] > 100  # both outcomes were exercised


def test_variant_allocation_handles_large_batches():
    from eth.planner.allocate import allocate_with_variants
    rng = random.Random(3)
    opts = [[(m, rng.uniform(0, 50), rng.uniform(1, 5) * m ** 0.8) for m in (4, 8, 16)] for _ in range(8)]
    lbs, pick, end = allocate_with_variants(opts, 8192)
    assert sum(lbs) == 8192
    assert all(n % opts[i][k][0] == 0 and n > 0 for i, (n, k) in enumerate(zip(lbs, pick)))
    assert math.isclose(end, max(opts[i][k][1] + opts[i][k][2] * n / opts[i][k][0]
                                 for i, (n, k) in enumerate(zip(lbs, pick))))


def test_sorted_greedy_equals_the_heap_loop():
    """_greedy takes the shortest prefix of the sorted (A_i + B_i c, i) sequence; the
    paper's heap loop (_greedy_heap) pops exactly that sequence.  Ties (equal end
    times, B = 0) included."""
    from eth.planner.allocate import _greedy, _greedy_heap
    rng = random.Random(5)
    for _ in range(3000):
        P = rng.randint(1, 6)
        mbs = [rng.choice([1, 2, 3, 4, 8]) for _ in range(P)]
        gbs = rng.randint(1, 200)
        lines = [(rng.choice([0.0, 1.0, 2.5, rng.random() * 10]), rng.choice([0.0, 0.5, 1.0, 1 / 3, rng.random() * 3]))
                 for _ in range(P)]
        assert _greedy(lines, mbs, gbs) == _greedy_heap(lines, mbs, gbs), (lines, mbs, gbs)


def test_exact_allocation_from_a_guess_equals_plain_bisection():
    """exact_allocation started at any guess (allocate passes the greedy's end time)
    returns what the plain bisection over all candidate end times returns."""
    rng = random.Random(7)
    for _ in range(1500):
        P = rng.randint(1, 5)
        mbs = [rng.choice([1, 2, 3, 4, 8]) for _ in range(P)]
        gbs = rng.randint(1, 120)
        lines = [(rng.choice([0.0, 1.0, rng.random() * 10]), rng.choice([0.5, 1.0, 1 / 3, rng.random() * 3]))
                 for _ in range(P)]
        ref = exact_allocation(lines, mbs, gbs)
        for guess in (0.0, 1e9, rng.random() * 50, lines[0][0] + lines[0][1] * 3):
            assert exact_allocation(lines, mbs, gbs, guess) == ref, (lines, mbs, gbs, guess)
