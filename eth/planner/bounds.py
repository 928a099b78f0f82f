"""Early skipping bounds (paper section 5.2) and search order (section 5.3).

Deterministic bound -- :func:`dominated`: pipeline P1 (devices D1) is bounded by a
cached pipeline P2 (devices D2, |D1| <= |D2|) when the bipartite graph with an edge
d1 -- d2 iff mem(d2) > mem(d1) and comp(d2) > comp(d1) has a matching that covers
D1.  Then throughput(P1) <= throughput(P2).  Devices of one type are identical (same
neighbours), so by Hall's theorem such a matching exists iff every set T of D1's types
has at least as many devices stronger than some type of T in D2 as it has devices in
D1 (a set of devices that takes part of a type's devices has the neighbours of the
whole type): 2^types - 1 sums instead of a matching over every device (networkx's
Hopcroft-Karp did that, 4% of the 13B / 64 search's CPU time).

Approximate bound -- :func:`approximate_bound`: the most similar cached pipeline with
the same number of devices (closest in log compute and log memory) gives its
throughput scaled by (compute of P1 / compute of P2) x (memory of P1 / memory of P2),
times alpha >= 1.  With no cached pipeline of that size there is no approximate bound
(scaling across sizes would mostly measure pipeline depth, not hardware).

A device group is skipped when sum over its pipelines of min(available bounds) is
below the best throughput found (Gbs / best iteration time).

Phase-1 floor -- :func:`stage_group_floor`: a lower bound of the Eq. 1 time of every
configuration of one stage group, by which phase 1 orders and prunes a pipeline's stage
groups (:func:`eth.planner.pipeline.optimise_pipeline`, ``SearchOptions.prune``).

Search order -- :func:`variance_cost`, Eq. 7-9, Com = device TFLOPS:

    V_inter = Var_i ( sum_j Com_i^j )                (7)
    V_intra = sum_i Var_j ( Com_i^j )                (8)
    Cost    = V_inter / Gbs + V_intra / L            (9)

groups are visited in ascending Cost within each pipeline count.
"""
from __future__ import annotations

import functools
import math

import numpy as np


def dominated(d1: dict[str, int], d2: dict[str, int], facts: dict[str, tuple[float, float]]) -> bool:
    """True if every device of ``d1`` matches a distinct strictly stronger, larger one of ``d2``.

    ``d1``/``d2`` map device type -> count; ``facts[type] = (tflops, memory)``.  Hall's
    condition over the types of ``d1`` (module docstring).
    """
    n1, n2 = sum(d1.values()), sum(d2.values())
    if n1 == 0:
        return True
    if n1 > n2:
        return False
    left = [(c, t) for t, c in sorted(d1.items()) if c]
    right = [(c, t) for t, c in sorted(d2.items()) if c]
    # bit k of stronger[i]: right type k beats left type i in both compute and memory
    stronger = []
    for _, t in left:
        ct, mt = facts[t]
        stronger.append(sum(1 << k for k, (_, u) in enumerate(right) if facts[u][1] > mt and facts[u][0] > ct))
    for mask in range(1, 1 << len(left)):
        need, nbrs = 0, 0
        for i, (c, _) in enumerate(left):
            if mask >> i & 1:
                need += c
                nbrs |= stronger[i]
        if need > sum(c for k, (c, _) in enumerate(right) if nbrs >> k & 1):
            return False
    return True


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


@functools.lru_cache(maxsize=None)
def _divisors(n: int) -> tuple[int, ...]:
    """The divisors of ``n`` in ascending order (trial division up to its square root)."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(low + [n // d for d in reversed(low) if d * d != n])


def stage_group_floor(ev, stages, ranks, batch: int) -> float:
    """A lower bound on ``ev.evaluate(state, batch, ranks).ms`` over every configuration
    ``state`` of the stage group ``stages`` ((type, devices), ...) on ``ranks``: every
    layer split, valid tp, Mbs dividing ``batch`` and recompute set.

    For one Mbs (a divisor of B, divisible by every stage's dp), Eq. 1 is
    (nmb - 1) x max_j T_j + sum_j T_j with nmb = B / Mbs, plus the pipeline's own
    All-Reduce term (>= 0).  T_j of l_j layers is at least
    :meth:`eth.cost.model.CostModel.stage_time_floors` at the stage's tp and micro = Mbs / dp_j
    (its terms without recompute plus the least recompute time that lets it fit in
    memory; inf if nothing fits); its minimum over the stage's valid tps whose dp divides
    Mbs, made non-decreasing in l_j, is g_j(l_j) (:func:`_stage_floor`).  Over the integer
    splits (l_j >= 1, sum = L), max_j g_j(l_j) is at least :func:`split_floors` and
    sum_j g_j(l_j) at least :func:`sum_floors`, so Eq. 1 is at least
    (nmb - 1) x split floor + sum floor; the bound is its minimum over Mbs.  inf when no
    Mbs admits a valid tp for every stage (or nothing fits)."""
    return stage_group_floors(ev, [(stages, ranks)], batch)[0]


FLOOR_CHUNK = 1 << 22
"""Floats of one (group x Mbs, stage, layers) array of :func:`stage_group_floors` at most
(32 MiB): thousands of stage groups of a pipeline of many types are done in chunks."""


def stage_group_floors(ev, groups, batch: int, pure_tp: bool = False) -> list[float]:
    """:func:`stage_group_floor` of each (stages, ranks) of ``groups``.  The groups with the
    same stage count are combined in (group x Mbs, stage, layers) arrays of at most
    ``FLOOR_CHUNK`` floats, so that phase 1's floors of a pipeline's stage groups take a
    few numpy calls per stage count instead of a dozen per group (the values are the same:
    every (group, Mbs) row is reduced alone).  Only the first L - S + 1 layer counts of a
    stage are read (each of S stages holds at least one layer), and only the (group, Mbs)
    rows where one layer fits on every stage (the others are inf in both floors).  A
    stage's row (:func:`_stage_row`) is found by its type, devices, position and the
    identities of its ranks objects (:func:`_placed_row`; the stage groups of a pipeline
    share their per-type placements, :func:`eth.planner.pipeline.stage_ranks`) in the
    evaluator's stacked rows of the batch (:class:`_Rows`), gathered by one index per chunk.
    ``pure_tp``: every stage's tp is its device count (dp 1; HexiScale's stages), when
    that is a valid tp of the type (:meth:`eth.planner.evaluate.Evaluator.valid_tps`
    without ranks), else the stage's floor is inf."""
    L = ev.model.num_layers
    out = [math.inf] * len(groups)
    placed = ev._floors.setdefault(("placed", batch, pure_tp), {})   # see _placed_row
    store = _store(ev, batch)
    by_count: dict = {}
    for i, (stages, ranks) in enumerate(groups):
        S, ids = len(stages), []
        for j, (t, n) in enumerate(stages):
            nxt, prv = ranks[j + 1] if j + 1 < S else None, ranks[j - 1] if j else None
            hit = placed.get((t, n, S - j, j == 0, id(ranks[j]), id(nxt), id(prv)))
            if hit is None or hit[0] is not ranks[j] or hit[1] is not nxt or hit[2] is not prv:
                hit = _placed_row(ev, placed, store, t, n, j, S, ranks[j], nxt, prv, batch, pure_tp)
            if hit[3] < 0:   # no tp's dp divides the batch: inf
                break
            ids.append(hit[3])
        else:
            by_count.setdefault(S, []).append((i, ids))
    if not by_count:
        return out
    rows, fits = store.rows, store.fits                   # (row, Mbs, layers); one layer fits at that Mbs
    fill = np.array([batch // m - 1 for m in _divisors(batch)], dtype=float)
    M = len(fill)
    for S, entries in by_count.items():
        W = L - S + 1
        step = max(1, FLOOR_CHUNK // (M * S * W))
        for lo in range(0, len(entries), step):
            part = entries[lo:lo + step]
            idx = np.array([ids for _, ids in part], dtype=np.intp)        # (group, stage)
            g, m = np.nonzero(fits[idx].all(axis=1))                       # live (group, Mbs)
            flat = rows[idx[g], m[:, None], :W]                            # (live row, stage, layers)
            # 0 x inf of one micro-batch is dropped by the where
            with np.errstate(invalid="ignore"):
                total = np.where(fill[m] > 0, fill[m] * _split_floors(flat, L), 0.0) + _sum_floors(flat, L)
            best = np.full((len(part), M), math.inf)
            best[g, m] = total
            for (i, _), b in zip(part, best.min(axis=1)):
                out[i] = float(b)
    return out


def floor_configuration(ev, stages, ranks, batch: int) -> tuple[int, tuple[tuple[int, int], ...]] | None:
    """(Mbs, ((tp, layers) of each stage)) of the configuration that the floor of the stage
    group ``stages`` on ``ranks`` (:func:`stage_group_floor`) describes, or None when it
    has none in the planner's space: the start of the balancer
    (:func:`eth.planner.balance.warm_start`).  A stage's floor at its layer count is close
    to its time, so this configuration is close to the floor; most of the gap between a
    group's floor and the time the balancer reached from a compute-proportional start
    was the balancer's layer split.

    Of the Mbs in ascending order of the floor at that Mbs: the split with the least
    largest stage floor (each stage takes the layer counts whose floor is at most the
    split floor, then the layers whose last increment is largest are given back until
    the counts sum to L), each stage at the tp of least floor for its layers; the first
    Mbs whose configuration is in the planner's space (Mbs = lcm of the dps x a power of
    two; every stage's floor finite at its layer count) is taken."""
    L = ev.model.num_layers
    S = len(stages)
    W = L - S + 1
    if W < 1:
        return None
    rows, tables = [], []
    for j, (t, n) in enumerate(stages):
        key = _stage_key(ev, t, n, j, S, ranks, batch)
        row = _stage_row(ev, key)
        if row is None:
            return None
        rows.append(row[:, :W])
        tables.append(_stage_table(ev, key))
    g = np.stack(rows, axis=1)                                    # (Mbs, stage, layers)
    live = np.nonzero(np.isfinite(g[:, :, 0]).all(axis=1))[0]
    if not len(live):
        return None
    mbss = _divisors(batch)
    fill = np.array([batch // mbss[m] - 1 for m in live], dtype=float)
    split = _split_floors(g[live], L)
    with np.errstate(invalid="ignore"):
        total = np.where(fill > 0, fill * split, 0.0) + _sum_floors(g[live], L)
    for k in np.argsort(total, kind="stable"):
        if not math.isfinite(total[k]):     # no split holds every layer at this or a later Mbs
            return None
        got = _configuration_at(ev, tables, g[live[k]], float(split[k]), mbss[live[k]], batch, L)
        if got is not None:
            return got
    return None


def _configuration_at(ev, tables, g, x: float, mbs: int, batch: int, L: int):
    """:func:`floor_configuration` at one Mbs: ``g`` the stages' floor rows (stage, layers),
    ``x`` their split floor; None when it is not in the planner's space."""
    S = len(g)
    layers = [max(1, int(np.searchsorted(g[j], x, side="right"))) for j in range(S)]
    while sum(layers) > L:      # give back the layer whose floor increment is largest
        j = max((j for j in range(S) if layers[j] > 1), key=lambda j: (g[j][layers[j] - 1] - g[j][layers[j] - 2], -j))
        layers[j] -= 1
    if sum(layers) != L:
        return None
    parts, dps = [], []
    for j, table in enumerate(tables):
        key = ("least tp", id(table), S - j, mbs, layers[j])     # the tables live in ev._floors
        hit = ev._floors.get(key)
        if hit is None:
            shapes, _, _, terms = table
            inflight = [max(1, min(S - j, batch // (dp * micro))) for _, dp, micro, _, _ in shapes]
            times = ev.cost.stage_time_floors_at(terms, inflight, np.array([float(layers[j])]))[:, 0]
            options = [(times[k], k) for k, (_, dp, micro, _, _) in enumerate(shapes)
                       if dp * micro == mbs and times[k] < math.inf]
            hit = ev._floors[key] = shapes[min(options)[1]][:2] if options else ()
        if not hit:
            return None
        parts.append((hit[0], layers[j]))
        dps.append(hit[1])
    base = math.lcm(*dps)
    if mbs % base or (mbs // base) & (mbs // base - 1):
        return None
    return mbs, tuple(parts)


def split_floor(rows, total: int) -> float:
    """min over integer splits (n_j >= 1, sum n_j = ``total``) of max_j rows[j][n_j - 1],
    for rows non-decreasing and of length >= total - len(rows) + 1 (numpy arrays): the
    larger of max_j rows[j][0] and the ``total``-th smallest value of all rows (the
    module's :func:`stage_group_floor`)."""
    return float(split_floors(np.stack([np.asarray(r, dtype=float)[:total - len(rows) + 1] for r in rows])[:, None],
                              total)[0])


def split_floors(rows, total: int):
    """:func:`split_floor` of ``rows[:, k]`` for each k of a (stages, k, >= total -
    stages + 1) array, at once."""
    return _split_floors(np.moveaxis(np.asarray(rows), 0, 1), total)


def _split_floors(rows, total: int):
    """:func:`split_floors` of a (k, stages, >= total - stages + 1) array."""
    K, S = rows.shape[:2]
    width = total - S + 1
    first = rows[:, :, 0].max(axis=1)
    values = np.ascontiguousarray(rows[:, :, :width]).reshape(K, S * width)
    return np.maximum(first, np.partition(values, total - 1, axis=1)[:, total - 1])


def sum_floors(rows, total: int):
    """A lower bound of min over integer splits (n_j >= 1, sum n_j = ``total``) of
    sum_j rows[j, k, n_j - 1], for each k of a (stages, k, >= total - stages + 1) array
    non-decreasing along its last axis: sum_j rows[j, k, 0] plus the total - stages
    smallest of all increments rows[j, k, n] - rows[j, k, n - 1] (n < total - stages + 1).
    A split's sum is its first values plus n_j - 1 increments of each row j, total -
    stages increments in all, each >= 0; exact when every row is convex."""
    return _sum_floors(np.moveaxis(np.asarray(rows), 0, 1), total)


def _sum_floors(rows, total: int):
    """:func:`sum_floors` of a (k, stages, >= total - stages + 1) array."""
    K, S = rows.shape[:2]
    extra = total - S
    head = rows[:, 0, 0].copy()
    for j in range(1, S):          # stage by stage, as a sum over the stage axis adds
        head += rows[:, j, 0]
    if extra == 0:
        return head
    part = rows[:, :, :extra + 1]
    with np.errstate(invalid="ignore"):           # inf - inf: no split reaches it
        steps = np.where(np.isinf(part[:, :, 1:]), math.inf, np.diff(part, axis=2))
    steps = steps.reshape(K, S * extra)
    return head + np.partition(steps, extra - 1, axis=1)[:, :extra].sum(axis=1)


def _placed_row(ev, placed: dict, store: "_Rows", t: str, n: int, j: int, S: int, ranks, nxt, prv, batch: int,
                pure_tp: bool) -> tuple:
    """(ranks, nxt, prv, the place in ``store`` of the :func:`_stage_row` of stage j of S of
    ``n`` devices of type ``t`` on ``ranks`` next to ``nxt`` / ``prv``, -1 when it is None),
    kept in ``placed`` (one dictionary per batch and ``pure_tp`` on the evaluator) by the
    type, devices, position and the identities of the three rank tuples, which the entry
    holds (an identity is only trusted while its object is the one held):
    :func:`stage_group_floors` meets the same stage on the same ranks objects in most of a
    pipeline's stage groups, and finds its row with one look-up instead of hashing its
    links."""
    row = _stage_row(ev, (t, n, j == 0, j == S - 1, S - j, batch) + _stage_links(ev, t, n, ranks, nxt, prv, pure_tp))
    hit = placed[(t, n, S - j, j == 0, id(ranks), id(nxt), id(prv))] = (ranks, nxt, prv,
                                                                        -1 if row is None else store.add(row))
    return hit


class _Rows:
    """The stage rows (:func:`_stage_row`) of one batch stacked as they are made, so that
    :func:`stage_group_floors` gathers from one array instead of stacking its rows on
    every call: ``rows[:count]`` (row, Mbs, layers) and ``fits`` (one layer fits at that
    Mbs); a row's place by its identity (the rows are kept in the evaluator's memo)."""

    def __init__(self, mbs: int, layers: int):
        self.rows = np.empty((256, mbs, layers))
        self.fits = np.empty((256, mbs), dtype=bool)
        self.count = 0
        self.place: dict = {}

    def add(self, row) -> int:
        k = self.place.get(id(row))
        if k is None:
            if self.count == len(self.rows):
                self.rows = np.concatenate([self.rows, np.empty_like(self.rows)])
                self.fits = np.concatenate([self.fits, np.empty_like(self.fits)])
            k = self.place[id(row)] = self.count
            self.rows[k] = row
            self.fits[k] = np.isfinite(row[:, 0])
            self.count += 1
        return k


def _store(ev, batch: int) -> _Rows:
    """The evaluator's :class:`_Rows` of ``batch``."""
    key = ("rows", batch)
    hit = ev._floors.get(key)
    if hit is None:
        hit = ev._floors[key] = _Rows(len(_divisors(batch)), ev.model.num_layers)
    return hit


def _stage_floor(ev, t: str, n: int, j: int, S: int, ranks, batch: int):
    """g_j (:func:`stage_group_floor`) of stage j of S on ``ranks``: a numpy array with
    one row per Mbs (the divisors of ``batch``, ascending; inf where no valid tp's dp
    divides it) and one column per layer count 1..L, memoised on the evaluator by all it
    reads (the stage's type, devices, first / last, stages after it, batch and its links
    for each valid tp); None when no tp's dp divides ``batch``."""
    return _stage_row(ev, _stage_key(ev, t, n, j, S, ranks, batch))


def _stage_key(ev, t: str, n: int, j: int, S: int, ranks, batch: int) -> tuple:
    """:func:`_stage_row`'s key of stage j of S of ``n`` devices of type ``t`` on the
    pipeline's ``ranks`` (every tp)."""
    nxt, prv = ranks[j + 1] if j + 1 < S else None, ranks[j - 1] if j > 0 else None
    return (t, n, j == 0, j == S - 1, S - j, batch) + _stage_links(ev, t, n, ranks[j], nxt, prv)


def _stage_links(ev, t: str, n: int, ranks, nxt, prv, pure_tp: bool = False) -> tuple:
    """(the valid tps of a stage of ``n`` devices of type ``t`` on ``ranks`` (``pure_tp``:
    n alone, if valid), their :meth:`eth.cost.model.CostModel.stage_links` towards the
    stages on ``nxt`` / ``prv``), memoised on the evaluator (not by the whole pipeline's
    ranks: thousands to hash)."""
    lkey = ("links", ranks, nxt, prv, pure_tp)
    hit = ev._floors.get(lkey)
    if hit is None:
        tps = ((n,) if n in ev.valid_tps(t, n) else ()) if pure_tp else ev.valid_tps(t, n, ranks)
        hit = ev._floors[lkey] = (tps, tuple(ev.cost.stage_links(t, tp, ranks, nxt, prv) for tp in tps))
    return hit


def _stage_table(ev, key: tuple) -> tuple:
    """(shapes (tp, dp, micro, links, 1) ordered by Mbs = dp x micro, the Mbs index of each
    run of equal Mbs, where each run starts, :meth:`eth.cost.model.CostModel.floor_table`
    of the shapes) of a stage by :func:`_stage_row`'s key: they do not depend on the
    stages after it, so one table serves every position, memoised on the evaluator."""
    t, n, first, last, _, batch, tps, links = key
    tkey = ("table", t, n, first, last, batch, tps, links)
    table = ev._floors.get(tkey)
    if table is None:
        mbss = _divisors(batch)
        shapes = sorted(((tp, n // tp, mbs // (n // tp), lk, 1) for tp, lk in zip(tps, links)
                         for mbs in mbss if batch % (n // tp) == 0 and mbs % (n // tp) == 0),
                        key=lambda s: s[1] * s[2])
        which = [mbss.index(dp * micro) for _, dp, micro, _, _ in shapes]
        starts = [k for k in range(len(which)) if k == 0 or which[k] != which[k - 1]]
        table = ev._floors[tkey] = (shapes, np.array([which[k] for k in starts]), np.array(starts, dtype=np.intp),
                                    ev.cost.floor_table(t, first, last, shapes) if shapes else None)
    return table


def _stage_row(ev, key: tuple):
    """:func:`_stage_floor` by its key (type, devices, first, last, stages from it on,
    batch, valid tps, their links), memoised on the evaluator."""
    hit = ev._floors.get(key)
    if hit is not None or key in ev._floors:
        return hit
    _, _, _, _, after, batch, _, _ = key
    cost = ev.cost
    shapes, used, starts, terms = _stage_table(ev, key)
    f = None
    if shapes:
        # the in-flight micro-batches of evaluate: min(S - j, B / Mbs), at least 1
        inflight = [max(1, min(after, batch // (dp * micro))) for _, dp, micro, _, _ in shapes]
        layers = np.arange(1, ev.model.num_layers + 1, dtype=float)
        times = cost.stage_time_floors_at(terms, inflight, layers)
        f = np.full((len(_divisors(batch)), len(layers)), math.inf)
        f[used] = np.minimum.reduceat(times, starts, axis=0)
        f = np.minimum.accumulate(f[:, ::-1], axis=1)[:, ::-1]   # non-decreasing in l: still a lower bound
    ev._floors[key] = f
    return f
