"""Early skipping bounds (paper section 5.2) and search order (section 5.3).

Deterministic bound -- :func:`dominated`: pipeline P1 (devices D1) is bounded by a
cached pipeline P2 (devices D2, |D1| <= |D2|) when the bipartite graph with an edge
d1 -- d2 iff mem(d2) > mem(d1) and comp(d2) > comp(d1) has a matching that covers
D1 (maximum matching by Hopcroft-Karp, networkx).  Then throughput(P1) <=
throughput(P2).  Devices of one type are identical, so both sides are divided by the
gcd of all type counts first (Hall's condition is invariant under that scaling).

Approximate bound -- :func:`approximate_bound`: the most similar cached pipeline with
the same number of devices (closest in log compute and log memory) gives its
throughput scaled by (compute of P1 / compute of P2) x (memory of P1 / memory of P2),
times alpha >= 1.  With no cached pipeline of that size there is no approximate bound
(scaling across sizes would mostly measure pipeline depth, not hardware).

A device group is skipped when sum over its pipelines of min(available bounds) is
below the best throughput found (Gbs / best iteration time).

Search order -- :func:`variance_cost`, Eq. 7-9, Com = device TFLOPS:

    V_inter = Var_i ( sum_j Com_i^j )                (7)
    V_intra = sum_i Var_j ( Com_i^j )                (8)
    Cost    = V_inter / Gbs + V_intra / L            (9)

groups are visited in ascending Cost within each pipeline count.
"""
from __future__ import annotations

import math
from functools import reduce

import networkx as nx
import numpy as np
from networkx.algorithms import bipartite


def dominated(d1: dict[str, int], d2: dict[str, int], facts: dict[str, tuple[float, float]]) -> bool:
    """True if every device of ``d1`` matches a distinct strictly stronger, larger one of ``d2``.

    ``d1``/``d2`` map device type -> count; ``facts[type] = (tflops, memory)``.
    """
    n1, n2 = sum(d1.values()), sum(d2.values())
    if n1 == 0:
        return True
    if n1 > n2:
        return False
    g = reduce(math.gcd, [c for c in list(d1.values()) + list(d2.values()) if c])
    g1 = {t: c // g for t, c in d1.items() if c}
    g2 = {t: c // g for t, c in d2.items() if c}
    graph = nx.Graph()
    left = [("a", t, k) for t, c in sorted(g1.items()) for k in range(c)]
    right = [("b", t, k) for t, c in sorted(g2.items()) for k in range(c)]
    graph.add_nodes_from(left, bipartite=0)
    graph.add_nodes_from(right, bipartite=1)
    for u in left:
        cu, mu = facts[u[1]]
        for v in right:
            cv, mv = facts[v[1]]
            if mv > mu and cv > cu:
                graph.add_edge(u, v)
    matching = bipartite.hopcroft_karp_matching(graph, top_nodes=left)
    return sum(1 for u in left if u in matching) == len(left)


def approximate_bound(devices: dict[str, int], cached: list[tuple[dict[str, int], float]],
                      facts: dict[str, tuple[float, float]], alpha: float) -> float:
    """alpha x throughput of the most similar cached pipeline, scaled by compute and memory."""
    comp = sum(facts[t][0] * c for t, c in devices.items())
    mem = sum(facts[t][1] * c for t, c in devices.items())
    size = sum(devices.values())
    best = None
    for other, tp in cached:
        if sum(other.values()) != size:
            continue
        oc = sum(facts[t][0] * c for t, c in other.items())
        om = sum(facts[t][1] * c for t, c in other.items())
        if oc <= 0 or om <= 0:
            continue
        distance = abs(math.log(comp / oc)) + abs(math.log(mem / om))
        estimate = tp * (comp / oc) * (mem / om) * alpha
        if best is None or distance < best[0]:
            best = (distance, estimate)
    return math.inf if best is None else best[1]


def variance_cost(group_devices: list[dict[str, int]], tflops: dict[str, float], gbs: int,
                  num_layers: int) -> float:
    """Eq. 9 cost of a device group given each pipeline's type -> count."""
    sums, intra = [], 0.0
    for devs in group_devices:
        values = np.repeat([tflops[t] for t in devs], [devs[t] for t in devs]).astype(float)
        sums.append(float(values.sum()))
        intra += float(values.var()) if values.size else 0.0
    inter = float(np.var(sums))
    return inter / gbs + intra / num_layers
