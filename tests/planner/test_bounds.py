import itertools
import math
import random

import numpy as np

from eth.planner.bounds import approximate_bound, dominated, variance_cost
from eth.planner.dynprog import split_dp

FACTS = {"A": (300.0, 80.0), "B": (280.0, 32.0), "C": (80.0, 24.0), "D": (300.0, 24.0), "E": (100.0, 90.0)}


def brute_dominated(d1, d2):
    left = [t for t, c in d1.items() for _ in range(c)]
    right = [t for t, c in d2.items() for _ in range(c)]
    if len(left) > len(right):
        return False
    for perm in itertools.permutations(right, len(left)):
        if all(FACTS[r][0] > FACTS[l][0] and FACTS[r][1] > FACTS[l][1] for l, r in zip(left, perm)):
            return True
    return False


def test_bipartite_bound_matches_brute_force_on_random_sets():
    rng = random.Random(1)
    types = list(FACTS)
    agree = positives = 0
    for _ in range(300):
        d1 = {t: rng.randint(0, 2) for t in rng.sample(types, 2)}
        d2 = {t: rng.randint(0, 3) for t in rng.sample(types, 3)}
        expect = brute_dominated(d1, d2)
        assert dominated(d1, d2, FACTS) == expect, (d1, d2)
        agree += 1
        positives += expect
    assert 0 < positives < agree  # both outcomes were exercised


def test_bipartite_bound_scales_with_gcd():
    assert dominated({"C": 64}, {"A": 32, "B": 32}, FACTS)
    assert dominated({"C": 64, "B": 64}, {"A": 64, "B": 64}, FACTS)  # C -> B, B -> A
    assert not dominated({"C": 64, "A": 2}, {"A": 64, "B": 64}, FACTS)  # nothing beats A


def test_approximate_bound_uses_same_size_pipelines_and_alpha():
    cached = [({"A": 2}, 10.0), ({"A": 4}, 30.0)]
    got = approximate_bound({"B": 2}, cached, FACTS, alpha=1.5)
    assert math.isclose(got, 10.0 * (280 / 300) * (32 / 80) * 1.5)
    assert approximate_bound({"B": 3}, cached, FACTS, 1.5) == math.inf


def test_variance_cost_is_eq9():
    groups = [{"A": 2, "C": 1}, {"B": 1}]
    tflops = {t: f[0] for t, f in FACTS.items()}
    p1, p2 = [300, 300, 80], [280]
    inter = np.var([sum(p1), sum(p2)])
    intra = np.var(p1) + np.var(p2)
    assert math.isclose(variance_cost(groups, tflops, gbs=64, num_layers=8), inter / 64 + intra / 8)


def test_split_dp_matches_brute_force_over_contiguous_splits():
    rng = random.Random(3)
    for _ in range(20):
        order = [rng.randint(0, 1) for _ in range(rng.randint(3, 7))]
        table = {}

        def tp(vec):
            if vec not in table:
                table[vec] = 0.0 if rng.random() < 0.15 else rng.uniform(1, 10) * sum(vec)
            return table[vec]

        got = split_dp(order, 2, len(order), tp)
        n = len(order)
        for p in range(1, n + 1):
            best = -math.inf
            for cuts in itertools.combinations(range(1, n), p - 1):
                b = (0,) + cuts + (n,)
                vals = [tp(tuple(order[i:k].count(t) for t in range(2))) for i, k in zip(b, b[1:])]
                if all(v > 0 for v in vals):
                    best = max(best, sum(vals))
            if best == -math.inf:
                assert p not in got
            else:
                assert math.isclose(got[p][0], best)
