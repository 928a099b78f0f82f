"""Exhaustive reference planner: the optimum of the cost model on a small cluster.

It shares nothing with :mod:`eth.planner` (no blocks, stage-group rules, balancer,
recompute heuristic or Lbs allocation): it imports only the cost model
(:class:`eth.cost.model.CostModel`, :func:`eth.cost.equations.eq5_end_times`) and the plan dataclasses,
so its answer is the best plan of the space below by Eq. 5 + Eq. 6 (the cost model's
``objective="eq5"``, with the optimizer step after each stage's All-Reduce) and the
memory model.

The space: every plan the runtime can run on the cluster.

* every partition of the devices into pipelines (a multiset of per-type device counts);
* every ordered sequence of one-type stages of a pipeline, of any sizes, the types in
  any order and interleaved (A, R, A is allowed), at most one stage per layer;
* every layer split (each stage holds at least one layer);
* every tp of a stage that divides its size, splits the model and is profiled (dp =
  size / tp);
* every mbs that is a multiple of all the pipeline's dp (<= gbs), every Lbs that is a
  multiple of its mbs, with sum Lbs = gbs;
* every recompute choice: recompute[op] in 0..layers of the stage, for the 13 layer ops.

The planner's own space is a subset (:func:`planner_stages`: the stages of one type
contiguous and equally sized; mbs = lcm(dp) x 2^k); :func:`optimum` returns the optimum
of both, so a search's gap splits into what its heuristics lose and what its space
restrictions lose.  The cost model is used with its default training setup (ZeRO 0: a
stage's memory is what ``stage_cost`` says; checked by scoring the best plan with
``CostModel.evaluate``).

It is searched with three reductions, each exact:

(a) Ranks.  The cluster must hold each device type in one node (checked).  The cost
    model reads ranks only through ``Cluster.link_gbps``, whose value depends on the
    nodes and types the ranks span, i.e. here on the types alone.  So any two plans
    with the same stages (type, size, tp, layers, recompute), mbs and Lbs cost the
    same, whichever ranks of a type they use; one rank layout per structure suffices,
    and pipelines with the same device counts are interchangeable.
(b) Batches.  Given the stage structures of all pipelines, AR_i^j (Eq. 6) is fixed (it
    does not depend on mbs, Lbs or recompute) and
    pipeline i's time max_j Te_i^j (Eq. 5) depends only on its own mbs, Lbs and
    recompute.  So f_i(Lbs) = min over mbs and recompute, and the iteration time of the
    structure is min over Lbs vectors (sum = gbs) of max_i f_i(Lbs_i), by a DP over
    pipelines.
(c) Recompute.  Eq. 5 is non-decreasing in every stage's bwd_ms, and recompute changes
    only the stage's bwd_ms (by recompute_ms, linear in the counts) and its memory.  So
    the best choice of each stage is, independently, the cheapest one that fits.  It is
    found exactly for stages of up to ``EXACT_RECOMPUTE_LAYERS`` layers (all count
    vectors, scored with the cost model's own savings of a layer's recompute set: the
    first n layers recompute {op: count > n}, less the run the backward holds again,
    ``CostModel.remat_bytes``); a longer stage that does not fit without
    recompute contributes its no-recompute time as a lower bound instead.  Choices are
    visited by that bound, so recompute is solved only where it could win.
    :attr:`Optimum.lower_bound` is the smallest time any plan of the space can have;
    when it equals :attr:`Optimum.ms` the optimum is proven.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from eth.cost.equations import eq5_end_times
from eth.cost.model import CostModel
from eth.spec.model import LAYER_OPS, recompute_runs
from eth.spec.plan import PipelinePlan, Plan, StagePlan

EXACT_RECOMPUTE_LAYERS = 2
"""Stages with at most this many layers get the exact recompute choice (3^13 count
vectors at 2 layers; 4^13 at 3 would be too slow)."""


@dataclass
class Optimum:
    ms: float
    """Best iteration time found (inf if no plan fits)."""
    plan: Plan | None
    lower_bound: float
    """No plan of the space is faster than this (== ms when every stage that needed
    recompute was solved exactly or could not have won)."""
    structures: int = 0
    """Joint stage structures scored."""

    @property
    def proven(self) -> bool:
        return self.lower_bound >= self.ms * (1 - 1e-9)


def compositions(n: int, k: int):
    """Ordered splits of n into k positive parts."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0,) + cuts + (n,)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def vector_partitions(total: tuple[int, ...], parts: int, upper=None):
    """Multisets of ``parts`` non-zero vectors summing to ``total`` (non-increasing order)."""
    upper = upper or total
    if parts == 1:
        if any(total) and total <= upper:
            yield (total,)
        return
    for v in itertools.product(*[range(t, -1, -1) for t in total]):
        if any(v) and v <= upper:
            rest = tuple(a - b for a, b in zip(total, v))
            if sum(rest) >= parts - 1:
                for tail in vector_partitions(rest, parts - 1, v):
                    yield (v,) + tail


def stage_sequences(types, counts, max_stages: int):
    """Ordered ((type, devices), ...) stages using exactly ``counts`` devices of each type."""
    if not any(counts):
        yield ()
        return
    if max_stages == 0:
        return
    for k, (t, c) in enumerate(zip(types, counts)):
        for n in range(1, c + 1):
            rest = counts[:k] + (c - n,) + counts[k + 1:]
            for tail in stage_sequences(types, rest, max_stages - 1):
                yield ((t, n),) + tail


def planner_stages(seq, counts: dict) -> bool:
    """The planner's stage rule (docs/PLANNER.md, written here from the text): the stages
    of one type are contiguous and equally sized, the size a power of two dividing the
    pipeline's count of that type, or that whole count."""
    runs = [t for k, (t, _) in enumerate(seq) if k == 0 or seq[k - 1][0] != t]
    if len(runs) != len(set(runs)):
        return False
    for t in runs:
        sizes = {n for tt, n in seq if tt == t}
        if len(sizes) != 1:
            return False
        n = sizes.pop()
        if n != counts[t] and (n & (n - 1) or counts[t] % n):
            return False
    return True


_SAVINGS: dict = {}
_RUNS: dict = {}
_REMAT: dict = {}
_FRONTS: dict = {}
_COUNTS: dict = {}
"""Shared by all runs (keyed by the op costs themselves): recompute tables per layer."""


def savings_per_layer(cost: CostModel, ops) -> np.ndarray:
    """sav1[mask]: bytes one layer frees recomputing the ops of bit ``mask`` (bit b =
    LAYER_OPS[b]): every maximal run of recomputed ops frees what its ops keep but keeps
    its inputs, each tensor once (``eth.cost.activations.LayerKeep.freed_all``, the
    vectorised count, checked here against CostModel.recompute_savings, one set at a
    time, on sampled masks)."""
    key = tuple(ops[op] for op in LAYER_OPS)
    if key not in _SAVINGS:
        members, total = cost.layer_keep(ops).freed_all()
        masks = np.arange(1 << len(LAYER_OPS))
        assert (members @ (1 << np.arange(len(LAYER_OPS))) == masks).all()
        rng = np.random.default_rng(len(_SAVINGS))
        for m in [0, len(masks) - 1, *rng.integers(0, len(masks), 64)]:
            want = cost.recompute_savings(ops, {op: 1 for b, op in enumerate(LAYER_OPS) if m >> b & 1})
            assert abs(total[m] - want) <= 1e-6 * max(1.0, abs(want)), (m, total[m], want)
        _SAVINGS[key] = total
    return _SAVINGS[key]


def longest_run_per_layer(cost: CostModel, ops) -> np.ndarray:
    """run1[mask]: the largest bytes one recomputed run of bit ``mask`` holds again when
    the backward re-runs it (``LayerKeep.rematerialised``, what ``CostModel.remat_bytes``
    takes the largest of)."""
    key = tuple(ops[op] for op in LAYER_OPS)
    if key not in _RUNS:
        keep = cost.layer_keep(ops)
        best = np.zeros(1 << len(LAYER_OPS))
        for m in range(1, len(best)):
            here = {op for b, op in enumerate(LAYER_OPS) if m >> b & 1}
            best[m] = max(keep.rematerialised(run, here) for run in recompute_runs(here, LAYER_OPS))
        _RUNS[key] = best
    return _RUNS[key]


def remat_of_vectors(cost: CostModel, ops, layers: int) -> np.ndarray:
    """Per count vector of :func:`count_vectors`: the bytes the backward holds again
    (``CostModel.remat_bytes``, vectorised and checked against it on sampled vectors):
    layer l's longest run less the activations layers l+1.. of the micro-batch freed."""
    key = (tuple(ops[op] for op in LAYER_OPS), layers)
    if key not in _REMAT:
        sav1, run1 = savings_per_layer(cost, ops), longest_run_per_layer(cost, ops)
        counts, masks = count_vectors(layers)
        full = cost.layer_keep(ops).total
        remat, behind = np.zeros(len(counts)), np.zeros(len(counts))
        for m in masks[::-1]:
            remat = np.maximum(remat, run1[m] - behind)
            behind += full - sav1[m]
        rng = np.random.default_rng(len(_REMAT))
        for i in [0, len(counts) - 1, *rng.integers(0, len(counts), 64)]:
            want = cost.remat_bytes(ops, {op: int(k) for op, k in zip(LAYER_OPS, counts[i]) if k}, layers)
            assert abs(remat[i] - want) <= 1e-6 * max(1.0, abs(want)), (counts[i], remat[i], want)
        _REMAT[key] = remat
    return _REMAT[key]


def count_vectors(layers: int):
    """(every recompute count vector in 0..layers per op, the bit mask of the ops that
    layer l recomputes for every l): layer l recomputes {op: count > l}."""
    if layers not in _COUNTS:
        n, base = len(LAYER_OPS), layers + 1
        digit = np.arange(base, dtype=np.int8)
        counts = np.stack([np.tile(np.repeat(digit, base ** b), base ** (n - 1 - b)) for b in range(n)], axis=1)
        bits = 1 << np.arange(n)
        _COUNTS[layers] = (counts, [(counts > layer).astype(np.int64) @ bits for layer in range(layers)])
    return _COUNTS[layers]


def recompute_front(cost: CostModel, ops, weights: tuple, layers: int, inflight: int = 1):
    """The Pareto front of the count vectors (recompute[op] in 0..layers): (vectors, their
    recompute ms, the bytes they free per in-flight micro-batch), by increasing ms and
    strictly increasing bytes.  ms is linear in the counts (``weights`` ms per op and
    layer); layer l recomputes {op: count > l} and frees sav1 of that set; the stage's
    memory falls by ``inflight`` x the freed bytes less what the backward holds again
    (:func:`remat_of_vectors`), so a vector frees sum of sav1 - remat / inflight."""
    key = (tuple(ops[op] for op in LAYER_OPS), weights, layers, inflight)
    if key not in _FRONTS:
        sav1 = savings_per_layer(cost, ops)
        counts, masks = count_vectors(layers)
        per_layer_ms = (np.arange(len(sav1))[:, None] >> np.arange(len(LAYER_OPS)) & 1) @ np.array(weights)
        ms = sum(per_layer_ms[m] for m in masks)
        saved = sum(sav1[m] for m in masks) - remat_of_vectors(cost, ops, layers) / inflight
        # drop vectors that a strictly cheaper one (a lower ms bin) frees as much as
        # (exact: they never answer "cheapest that frees enough"), then sort the rest
        bins = (ms * (4095 / max(ms.max(), 1e-30))).astype(np.int64)
        most = np.full(4097, -np.inf)
        np.maximum.at(most, bins + 1, saved)
        keep = np.flatnonzero(saved > np.maximum.accumulate(most)[bins])
        order = keep[np.argsort(ms[keep], kind="stable")]
        best = np.maximum.accumulate(saved[order])
        new = np.flatnonzero(np.diff(best, prepend=-np.inf) > 0)     # a new largest saving
        _FRONTS[key] = (counts[order[new]], ms[order[new]], best[new])
    return _FRONTS[key]


@dataclass
class _Best:
    """Best plan and lower bound of one space while the structures are scored."""

    ms: float = math.inf
    plan: Plan | None = None
    lower_bound: float = math.inf

    def result(self, structures: int) -> Optimum:
        return Optimum(self.ms, self.plan, self.lower_bound, structures)


class Exhaustive:
    """One exhaustive search (see the module docstring)."""

    def __init__(self, model, cluster, profiles, gbs: int):
        self.model, self.cluster, self.gbs = model, cluster, gbs
        self.cost = CostModel(model, cluster, profiles, objective="eq5")
        self.world = cluster.world_size
        self.types = tuple(dict.fromkeys(d.type for d in cluster.devices))
        self.ranks = {t: [d.rank for d in cluster.devices if d.type == t] for t in self.types}
        for t in self.types:
            nodes = {cluster.devices[r].node for r in self.ranks[t]}
            if len(nodes) != 1:
                raise ValueError(f"the reference needs each device type in one node; {t} spans nodes {sorted(nodes)}")
        self.tps = {t: [x for x in profiles.get(t).tps(model) if model.splits(x)] for t in self.types}
        self._stage: dict = {}
        self.structures = 0

    # ------------------------------------------------------------------ structures
    def structures_of(self, vec):
        """[(structure, in the planner's space)] of a pipeline with device counts ``vec``;
        a structure is ((type, devices, tp, layers), ...) per stage."""
        L = self.model.num_layers
        out = []
        for seq in stage_sequences(self.types, vec, L):
            planner = planner_stages(seq, dict(zip(self.types, vec)))
            options = [[x for x in self.tps[t] if n % x == 0] for t, n in seq]
            for split in compositions(L, len(seq)):
                for tps in itertools.product(*options):
                    out.append((tuple((t, n, x, nl) for (t, n), x, nl in zip(seq, tps, split)), planner))
        return out

    def pipeline(self, structure, pool) -> PipelinePlan:
        """A PipelinePlan (mbs, Lbs unset) taking each stage's ranks from ``pool``."""
        pool = {t: list(r) for t, r in pool.items()}
        stages, start = [], 0
        for t, n, tp, nl in structure:
            ranks, pool[t] = pool[t][:n], pool[t][n:]
            stages.append(StagePlan(ranks, t, tp, n // tp, (start, start + nl), {}))
            start += nl
        return PipelinePlan(1, 1, stages)

    # ------------------------------------------------------------------ one stage
    def stage(self, p: PipelinePlan, structure, j: int, mbs: int, nmb: int, solve: bool = False):
        """None if no recompute choice fits; ("exact", StageCost, recompute) if the stage
        fits without recompute, or, with ``solve`` and at most EXACT_RECOMPUTE_LAYERS
        layers, with its cheapest fitting recompute; else ("bound", no-recompute
        StageCost, None), a lower bound of its time.  By (a), memoised without ranks."""
        S = len(p.stages)
        key = (structure, j, mbs, min(nmb, S - j), solve)
        if key in self._stage:
            return self._stage[key]
        st = p.stages[j]
        nxt = p.stages[j + 1].ranks if j + 1 < S else None
        prv = p.stages[j - 1].ranks if j > 0 else None

        def cost(rec):
            return self.cost.stage_cost(st.device_type, st.tp, st.dp, st.layers, mbs, rec, j, S, nmb,
                                        st.ranks, nxt, prv)

        c0 = cost(None)
        nl = st.num_layers
        if c0.fits:
            out = ("exact", c0, {})
        else:
            ops, _ = self.cost.profiles.layer_costs(st.device_type, self.model, mbs // st.dp, st.tp)
            room = c0.capacity_bytes - (c0.memory_bytes - c0.inflight * c0.act_bytes)
            need = c0.act_bytes - room / c0.inflight   # bytes recompute must free
            if room < 0 or need > nl * savings_per_layer(self.cost, ops).max():
                out = None
            elif not solve or nl > EXACT_RECOMPUTE_LAYERS:
                out = ("bound", c0, None)
            else:
                weights = tuple(cost({op: 1}).recompute_ms for op in LAYER_OPS)
                counts, ms, saved = recompute_front(self.cost, ops, weights, nl, c0.inflight)
                out = None
                for i in range(int(np.searchsorted(saved, need * (1 - 1e-12))), len(ms)):
                    rec = {op: int(k) for op, k in zip(LAYER_OPS, counts[i]) if k}
                    c = cost(rec)
                    if c.fits:      # the cheapest vector that frees enough (float margin: the next)
                        assert abs(c.recompute_ms - ms[i]) <= 1e-9 * max(1.0, ms[i]), (rec, c.recompute_ms, ms[i])
                        out = ("exact", c, rec)
                        break
        self._stage[key] = out
        return out

    # ------------------------------------------------------------------ one structure
    def pipeline_tables(self, p: PipelinePlan, structure, ar_row):
        """Per space (full, planner's mbs rule): ({Lbs: (ms, mbs, recompute per stage)}
        over exactly solved choices, {Lbs: lower-bound ms}) of one pipeline.  Choices are
        visited by their no-recompute time (a lower bound); recompute is solved only for
        those whose bound beats the best exact time of their Lbs."""
        S, step = len(p.stages), math.lcm(*[st.dp for st in p.stages])
        tables = {"full": ({}, {}), "planner": ({}, {})}
        choices = []
        for mbs in range(step, self.gbs + 1, step):
            spaces = ("full", "planner") if not (mbs // step) & (mbs // step - 1) else ("full",)
            for nmb in range(1, self.gbs // mbs + 1):
                got = [self.stage(p, structure, j, mbs, nmb) for j in range(S)]
                if all(g is not None for g in got):
                    choices.append((self.pipeline_ms(p, got, mbs * nmb, mbs, ar_row), mbs, nmb, spaces, got))
        choices.sort(key=lambda c: c[0])
        for ms, mbs, nmb, spaces, got in choices:
            lbs = mbs * nmb
            if any(g[0] != "exact" for g in got) and any(
                    ms < tables[space][0].get(lbs, (math.inf,))[0] for space in spaces):
                got = [g if g[0] == "exact" else self.stage(p, structure, j, mbs, nmb, solve=True)
                       for j, g in enumerate(got)]
                if any(g is None for g in got):
                    continue
                ms = self.pipeline_ms(p, got, lbs, mbs, ar_row)
            for space in spaces:
                exact, bound = tables[space]
                bound[lbs] = min(bound.get(lbs, math.inf), ms)
                if all(g[0] == "exact" for g in got) and ms < exact.get(lbs, (math.inf,))[0]:
                    exact[lbs] = (ms, mbs, [g[2] for g in got])
        return tables

    def pipeline_ms(self, p: PipelinePlan, got, lbs: int, mbs: int, ar_row) -> float:
        """max_j of Eq. 5 + the stage's step after its All-Reduce (a constant per stage
        for the analytic profiles here: it is added to AR_i^j)."""
        at = PipelinePlan(mbs, lbs, p.stages)
        after = [a + self.cost.step_after_sync_ms(at, st, g[1], self.world)
                 for a, st, g in zip(ar_row, p.stages, got)]
        return max(eq5_end_times([g[1] for g in got], lbs, mbs, after))

    @staticmethod
    def min_max(tables, gbs):
        """min over Lbs vectors (sum = gbs, one Lbs per table) of max_i table_i[Lbs_i]:
        (value, Lbs vector)."""
        best = {0: (0.0, ())}     # samples given to the pipelines so far -> (max so far, Lbs)
        for table in tables:
            nxt: dict = {}
            for used, (worst, lbs) in best.items():
                for n, v in table.items():
                    if used + n <= gbs:
                        cand = (max(worst, v), lbs + (n,))
                        if cand[0] < nxt.get(used + n, (math.inf,))[0]:
                            nxt[used + n] = cand
            best = nxt
        return best.get(gbs, (math.inf, None))

    # ------------------------------------------------------------------ driver
    def run(self) -> dict[str, Optimum]:
        """{"full": optimum of the space, "planner": optimum of the planner's subset}."""
        total = tuple(len(self.ranks[t]) for t in self.types)
        best = {"full": _Best(), "planner": _Best()}
        structs: dict = {}
        for P in range(1, min(sum(total), self.gbs) + 1):
            for group in vector_partitions(total, P):
                pools, used = [], {t: 0 for t in self.types}
                for v in group:
                    pools.append({t: self.ranks[t][used[t]:used[t] + n] for t, n in zip(self.types, v)})
                    for t, n in zip(self.types, v):
                        used[t] += n
                options = [structs.setdefault(v, self.structures_of(v)) for v in group]
                for combo in itertools.product(*[range(len(o)) for o in options]):
                    # (a): pipelines with equal device counts are interchangeable
                    if any(group[i] == group[i + 1] and combo[i] > combo[i + 1] for i in range(P - 1)):
                        continue
                    self.structures += 1
                    chosen = [options[i][k] for i, k in enumerate(combo)]
                    pipes = [self.pipeline(s, pool) for (s, _), pool in zip(chosen, pools)]
                    ar = self.cost.stage_allreduce_ms(pipes)
                    tables = [self.pipeline_tables(p, s, a) for p, (s, _), a in zip(pipes, chosen, ar)]
                    spaces = ("full", "planner") if all(ok for _, ok in chosen) else ("full",)
                    for space in spaces:
                        b = best[space]
                        exacts = [t[space][0] for t in tables]
                        lb, _ = self.min_max([t[space][1] for t in tables], self.gbs)
                        b.lower_bound = min(b.lower_bound, lb)
                        ms, lbs = self.min_max([{n: e[0] for n, e in ex.items()} for ex in exacts], self.gbs)
                        if ms < b.ms:
                            b.ms, b.plan = ms, self._plan(pipes, exacts, lbs)
        for b in best.values():
            if b.plan is not None:
                got = self.cost.evaluate(b.plan)
                assert got["feasible"] and abs(got["iteration_ms"] - b.ms) <= 1e-9 * b.ms, (got["iteration_ms"], b.ms)
        return {space: b.result(self.structures) for space, b in best.items()}

    def _plan(self, pipes, exacts, lbs) -> Plan:
        out = []
        for p, ex, n in zip(pipes, exacts, lbs):
            _, mbs, recs = ex[n]
            stages = [StagePlan(list(st.ranks), st.device_type, st.tp, st.dp, st.layers, dict(rec))
                      for st, rec in zip(p.stages, recs)]
            out.append(PipelinePlan(mbs, n, stages))
        return Plan(self.model, self.cluster, self.gbs, out).validate()


def optimum(model, cluster, profiles, gbs: int) -> dict[str, Optimum]:
    """{"full": best plan of the space (module docstring) and a proven lower bound,
    "planner": the same over the planner's subset (:func:`planner_stages`, mbs =
    lcm(dp) x 2^k)}."""
    return Exhaustive(model, cluster, profiles, gbs).run()
