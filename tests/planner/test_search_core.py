"""The HPP search against the exhaustive optimum of the cost model (_exhaustive.py).

``search()`` returns the best of the HPP search, the seeded baselines and the polish, and
``eth.planner.bruteforce`` shares the search's enumeration, recompute rule and cost
evaluator, so neither shows what the search core itself loses.  Here the core runs with
seeds and polish off (and, separately, on) and is compared with a reference that shares
none of the planner's code: it scores every plan of a small cluster with the cost model
alone and proves its answer optimal (lower bound == best).

The suite: ``SUITE_DRAWS`` seeded draws of 1-3 device types with 1-3 devices each (one
node per type, at most 5 devices), models of 2-4 layers, gbs 4-24, links of 25-400
Gbit/s, device memory cut to 2-4 GB in 30% of the draws.  Cases without a plan, or where
a stage of 3+ layers would need recompute that could beat the best (the reference then
cannot prove its optimum), are left out; at least ``MIN_CASES`` remain with a proven optimum of the planner's
space (issue 11 item 3), and ``MIN_CASES`` - 10 of the full space.

Gaps (search / optimum - 1) measured over the suite (151 cases with a proven optimum of
the planner's space; the full-space figures are over the cases whose planner space has a
plan), by ``python bench/noseeds_widening.py --suite --no-table --variants --worst``:

    search                        vs planner-space optimum                   vs full-space optimum
                                  median  mean   p95    max    at opt.  >1%   median  p95    max
    core (seeds off, polish off)  0       2.43%  9.8%   86.1%  78%      29    1.8%    30.0%  664%
    core + polish (seeds off)     0       0.03%  0      1.95%  98%      2     0       24.9%  323%
    search() (seeds + polish)     0       0.03%  0      1.95%  98%      2     0       24.9%  323%

(151 cases.)  Every plan is scored by the paper's Eq. 5 (``objective="eq5"``, which the
reference's decomposition needs, and ``simulate_finalists=False``: the best by it is
returned) with the optimizer step after each stage's All-Reduce (analytic profiles: a
fused AdamW streamed through device memory).  That step is a large part of the
iteration of these 2-4-layer models at 1-2 micro-batches, and phase 1 ranks a pipeline's
stage groups at batch Gbs: three cases miss the optimum, the worst by 1.95%.

(Before issue 11 item 3's polish changes -- the descent before the re-plan, pipelines'
stage orders reversed as group moves, every stage's tp x2 / 2 as one move, the best
non-improving moves scored with free Mbs, the best group's recompute cut to the least
that fits -- core + polish and search() had mean 0.21%, p95 0.14%, max 13.3%, 95% at
the optimum, 6 cases above 1%: #35 13.3%, #226 8.1%, #112 3.5%, #49 3.0%, #210 2.2%,
#228 1.7%.  On a held-out draw of the same kind, ``--seed 2``, 157 cases: core + polish
before mean 0.48%, p95 2.65%, max 16.0%, 11 above 1%; after 0 / 0 / 0, all at the
optimum.)

(With the backward's transient memory in the cost model -- ``CostModel.backward_bytes``,
``remat_bytes`` -- one case fewer has a proven optimum; before it: 155 and 148 cases.
Before issue 11's earlier polish changes -- re-planned choices scored with free Mbs, a
second round; the second warm start -- core + polish had 20 of 155 cases above 1%, p95
3.4%.)

The planner-space optimum is the optimum over the planner's own space (stages of one type
contiguous and equally sized, mbs = lcm(dp) x 2^k); the full space also has unequal stage
sizes, interleaved types and any mbs, which is where the rest of the gap comes from.  With
``HPPSearch._consider`` planted to never replace its first candidate the core's gap to
the planner-space optimum rose to mean 10.0% and max 152% (the gap tests of "core" fail).
"""
import functools
import os
import random
import statistics

import numpy as np
import pytest

from eth.cost.model import CostModel
from eth.errors import InfeasibleError
from eth.spec.model import LAYER_OPS, ModelSpec
from eth.spec.plan import PipelinePlan, Plan, StagePlan
from eth.planner.bruteforce import brute_force
from eth.planner.evaluate import Evaluator, StageState
from eth.planner.options import SearchOptions
from eth.planner.polish import least_recompute
from eth.planner.search import search
from eth.planner.workers import parallel_map

from _exhaustive import (Exhaustive, count_vectors, optimum, planner_stages, recompute_front, remat_of_vectors,
                         savings_per_layer, stage_sequences, vector_partitions)
from _planner_data import A2R2, M4, make_cluster, profiles_for

M2 = ModelSpec("m2", num_layers=2, hidden=1024, heads=8, seq_len=1024, vocab=1024)
M3 = ModelSpec("m3", num_layers=3, hidden=2048, heads=16, seq_len=512, vocab=4096)
SUITE_SEED, SUITE_DRAWS, MIN_CASES = 1, 240, 150
SEARCHES = {"core": dict(seeds=False, polish_top=0), "core + polish": dict(seeds=False), "search()": {}}


# ---------------------------------------------------------------- the reference itself
def test_reference_enumerates_what_is_counted_by_hand():
    # {A, A, R, R} into pipelines: 1 + 4 + 3 + 1 multisets
    assert [len(list(vector_partitions((2, 2), p))) for p in (1, 2, 3, 4)] == [1, 4, 3, 1]
    # stages of 2 A + 2 R: per type [2] or [1, 1]; interleavings 2 + 3 + 3 + 6 = 14
    seqs = list(stage_sequences(("A", "R"), (2, 2), 4))
    assert len(seqs) == len(set(seqs)) == 14
    # the planner's: types contiguous, equal sizes: 2 orders x 2 x 2
    assert sum(planner_stages(s, {"A": 2, "R": 2}) for s in seqs) == 8
    assert not planner_stages((("A", 1), ("R", 2), ("A", 1)), {"A": 2, "R": 2})


def test_reference_on_one_device_is_the_best_mbs():
    """One device: one stage, tp 1, Lbs = gbs; the optimum is the best mbs dividing gbs."""
    cluster = make_cluster([{"type": "A100", "devices_per_node": 1}])
    db = profiles_for(M2, cluster)
    cost = CostModel(M2, cluster, db, objective="eq5")
    by_hand = min(cost.evaluate(Plan(M2, cluster, 12, [PipelinePlan(m, 12, [StagePlan([0], "A100", 1, 1, (0, 2))])]))
                  ["iteration_ms"] for m in (1, 2, 3, 4, 6, 12))
    got = optimum(M2, cluster, db, 12)
    assert got["full"].ms == pytest.approx(by_hand, rel=1e-12) and got["full"].proven
    assert got["planner"].ms >= got["full"].ms


def test_reference_recompute_is_the_cheapest_that_fits():
    """A 2-layer stage that needs recompute: the reference's choice costs the least
    recompute ms of all 3^13 count vectors that free enough, and no more than the
    planner's rule (Evaluator.fit_stage)."""
    cluster = make_cluster([{"type": "RTX3090", "devices_per_node": 1}], device_types={"RTX3090": {"memory_gb": 2}})
    db = profiles_for(M2, cluster)
    ref = Exhaustive(M2, cluster, db, 8)
    pipe = ref.pipeline((("RTX3090", 1, 1, 2),), {"RTX3090": [0]})
    kind, got, rec = ref.stage(pipe, (("RTX3090", 1, 1, 2),), 0, 4, 2, solve=True)
    assert kind == "exact" and got.fits and rec
    ops, _ = db.layer_costs("RTX3090", M2, 4, 1)
    sav1 = savings_per_layer(ref.cost, ops)
    for m in range(0, len(sav1), 97):   # the vectorised savings are the cost model's
        assert sav1[m] == pytest.approx(ref.cost.recompute_savings(
            ops, {op: 1 for b, op in enumerate(LAYER_OPS) if m >> b & 1}), rel=1e-12, abs=1e-6)
    c0 = ref.cost.stage_cost("RTX3090", 1, 1, (0, 2), 4, None, 0, 1, 2)
    need = c0.act_bytes - (c0.capacity_bytes - (c0.memory_bytes - c0.inflight * c0.act_bytes)) / c0.inflight
    counts, masks = count_vectors(2)
    weights = np.array([ref.cost.stage_cost("RTX3090", 1, 1, (0, 2), 4, {op: 1}, 0, 1, 2).recompute_ms
                        for op in LAYER_OPS])
    all_ms = counts @ weights
    all_saved = sum(sav1[m] for m in masks) - remat_of_vectors(ref.cost, ops, 2) / c0.inflight
    assert got.recompute_ms == pytest.approx(all_ms[all_saved >= need].min(), rel=1e-9)
    assert len(recompute_front(ref.cost, ops, tuple(weights), 2)[0]) < 200   # the front is small
    heuristic, _, over = Evaluator(ref.cost).fit_stage(StageState("RTX3090", 1, 1, 2), (0, 2), 4, 0, 1, 2, [0], None)
    assert over == 0 and got.recompute_ms <= heuristic.recompute_ms * (1 + 1e-9)


@pytest.mark.parametrize("nodes, gbs", [(A2R2, 16), ([{"type": "A100", "devices_per_node": 2},
                                                      {"type": "RTX3090", "devices_per_node": 1},
                                                      {"type": "V100", "devices_per_node": 1}], 8)])
def test_reference_is_no_worse_than_the_planners_brute_force(nodes, gbs):
    """bruteforce.py covers the planner's space with the planner's recompute rule: the
    reference's planner-space optimum can only be lower or equal."""
    cluster = make_cluster(nodes)
    db = profiles_for(M4, cluster)
    got = optimum(M4, cluster, db, gbs)
    bf, _ = brute_force(M4, cluster, db, gbs, objective="eq5")
    assert got["planner"].proven and got["full"].proven
    assert got["full"].ms <= got["planner"].ms <= bf * (1 + 1e-9)


@pytest.mark.parametrize("dev, gb, mbs", [("RTX3090", 2, 4), ("RTX3090", 3, 12), ("910B4", 2, 4)])
def test_least_recompute_fits_is_locally_least_and_no_costlier(dev, gb, mbs):
    """The polish's recompute cut (polish.least_recompute) from recomputing every op in
    every layer of a 2-layer stage (on the 910B4 the cheapest set is QKV through the
    attention context recomputed in one layer, a run the op-by-op cut cannot reach): the
    set fits, no op's count can fall by one and still fit, it costs no more than the evaluator's own choice (fit_stage) nor than any
    contiguous run of the layer's ops recomputed in 1 or 2 layers that fits (brute force),
    and no less than the reference's exact cheapest choice (all 3^13 count vectors)."""
    cluster = make_cluster([{"type": dev, "devices_per_node": 1}], device_types={dev: {"memory_gb": gb}})
    db = profiles_for(M2, cluster)
    cost = CostModel(M2, cluster, db)
    every = {op: 2 for op in LAYER_OPS}
    plan = Plan(M2, cluster, 2 * mbs, [PipelinePlan(mbs, 2 * mbs, [StagePlan([0], dev, 1, 1, (0, 2), every)])])

    def stage(rec):
        return cost.stage_cost(dev, 1, 1, (0, 2), mbs, rec, 0, 1, 2, [0], None, None)

    assert not stage({}).fits and stage(every).fits    # the case needs recompute
    got = least_recompute(cost, plan, 0, 0)
    assert stage(got).fits and set(got) <= set(LAYER_OPS) and all(1 <= n <= 2 for n in got.values())
    for op, n in got.items():
        lower = {o: (k - 1 if o == op else k) for o, k in got.items()}
        assert not stage({o: k for o, k in lower.items() if k}).fits, op
    heuristic, _, over = Evaluator(cost).fit_stage(StageState(dev, 1, 1, 2), (0, 2), mbs, 0, 1, 2, [0], None)
    ref = Exhaustive(M2, cluster, db, 2 * mbs)
    pipe = ref.pipeline(((dev, 1, 1, 2),), {dev: [0]})
    kind, exact, _ = ref.stage(pipe, ((dev, 1, 1, 2),), 0, mbs, 2, solve=True)
    assert over == 0 and kind == "exact"
    assert exact.recompute_ms * (1 - 1e-9) <= stage(got).recompute_ms <= heuristic.recompute_ms * (1 + 1e-9)
    runs = [LAYER_OPS[a:b] for a in range(len(LAYER_OPS)) for b in range(a + 1, len(LAYER_OPS) + 1)]
    fitting = [stage({op: k for op in run}) for run in runs for k in (1, 2) if stage({op: k for op in run}).fits]
    assert fitting and stage(got).recompute_ms <= min(c.recompute_ms for c in fitting) * (1 + 1e-9)


# ---------------------------------------------------------------- the suite
def suite():
    """(name, model, cluster, gbs) of the seeded draws (see the module docstring)."""
    rng = random.Random(SUITE_SEED)
    for i in range(SUITE_DRAWS):
        types = rng.sample(["A100", "RTX3090", "V100", "910B4"], rng.randint(1, 3))
        nodes = [{"type": t, "devices_per_node": rng.randint(1, 3)} for t in types]
        if sum(n["devices_per_node"] for n in nodes) > 5:
            continue
        model, gbs = rng.choice([M2, M3, M4]), rng.choice([4, 6, 8, 12, 16, 24])
        memory = {t: {"memory_gb": rng.choice([2, 3, 4])} for t in types} if rng.random() < 0.3 else None
        bw = rng.choice([25, 100, 400])
        cluster = make_cluster(nodes, inter_node_gbps=bw, **({"device_types": memory} if memory else {}))
        devices = "+".join(f"{n['devices_per_node']}x{n['type']}" for n in nodes)
        name = f"#{i} {devices} {model.name} gbs {gbs}{' (memory cut)' if memory else ''}"
        yield name, model, cluster, gbs


def case_row(case, searches=None) -> dict:
    """One suite case's two optima and every search's (``searches``, default
    :data:`SEARCHES`) iteration ms (inf: no plan)."""
    name, model, cluster, gbs = case
    db = profiles_for(model, cluster)
    cost = CostModel(model, cluster, db, objective="eq5")     # the reference's objective
    row = {"name": name, **optimum(model, cluster, db, gbs)}
    for label, opts in (searches or SEARCHES).items():
        try:
            row[label] = cost.evaluate(search(model, cluster, db, SearchOptions(gbs=gbs, objective="eq5", simulate_finalists=False, **opts)))["iteration_ms"]
        except InfeasibleError:
            row[label] = float("inf")
    return row


@functools.lru_cache(maxsize=None)
def results():
    """Per suite case, :func:`case_row`, over the CPUs this process may use (the planner's
    own forked workers: each case is independent and deterministic)."""
    return parallel_map(case_row, list(suite()), len(os.sched_getaffinity(0)))


def gaps(label: str, space: str) -> list[float]:
    """search / optimum - 1 over the cases whose optimum in ``space`` is proven."""
    return [r[label] / r[space].ms - 1 for r in results() if r[space].plan is not None and r[space].proven]


@pytest.mark.slow
def test_no_search_beats_the_optimum_and_each_stage_only_helps():
    for r in results():
        full = r["full"]
        for label in SEARCHES:
            assert r[label] >= full.lower_bound * (1 - 1e-9), (r["name"], label, r[label], full.lower_bound)
            if r["planner"].proven:
                assert r[label] >= r["planner"].ms * (1 - 1e-9), (r["name"], label)
        assert r["planner"].ms >= full.ms * (1 - 1e-9) or not full.proven, r["name"]
        # polish only replaces the best by a faster plan; search() adds faster seeds
        assert r["search()"] <= r["core + polish"] * (1 + 1e-9) and r["core + polish"] <= r["core"] * (1 + 1e-9)
        assert (r["core"] == float("inf")) == (r["planner"].plan is None) or not r["planner"].proven, r["name"]
    assert len(gaps("core", "planner")) >= MIN_CASES and len(gaps("core", "full")) >= MIN_CASES - 10


def percentile(values, q: float) -> float:
    return sorted(values)[int(q * len(values))]


@pytest.mark.parametrize("label, mean, p95, worst, at_optimum", [
    ("core", 0.03, 0.12, 0.90, 0.65),             # measured 2.4%, 9.8%, 86.1%, 0.78
    # measured 0.03%, 0, 1.95%, 148 of 151 at the optimum (module docstring)
    ("core + polish", 0.001, 1e-9, 0.04, 0.96),
    ("search()", 0.001, 1e-9, 0.04, 0.96),
])
@pytest.mark.slow
def test_gap_to_the_optimum_of_the_planners_space(label, mean, p95, worst, at_optimum):
    g = gaps(label, "planner")
    share = sum(x <= 1e-9 for x in g) / len(g)
    summary = (f"{label}: median {statistics.median(g):.4f} mean {statistics.mean(g):.4f} "
               f"p95 {percentile(g, 0.95):.4f} max {max(g):.4f} at the optimum {share:.2f} of {len(g)}")
    assert statistics.mean(g) <= mean and percentile(g, 0.95) <= p95 and max(g) <= worst, summary
    assert share >= at_optimum, summary


@pytest.mark.parametrize("label, p95, worst", [
    ("core", 0.33, 9.0),                   # measured 28.5%, 653%
    ("search()", 0.27, 4.5),               # measured 25.9%, 307%
])
@pytest.mark.slow
def test_gap_to_the_optimum_of_the_full_space(label, p95, worst):
    """The planner's space restrictions (equal stage sizes per type, contiguous types,
    power-of-two mbs multiples) cost this much on the suite (over the cases whose planner
    space has a plan: where it has none, the gap is infinite by construction)."""
    g = [r[label] / r["full"].ms - 1 for r in results()
         if r["full"].plan is not None and r["full"].proven and r["planner"].plan is not None]
    summary = (f"{label}: median {statistics.median(g):.4f} p95 {percentile(g, 0.95):.4f} "
               f"max {max(g):.4f} of {len(g)}")
    assert percentile(g, 0.95) <= p95 and max(g) <= worst, summary


# ---------------------------------------------------------------- four device types
FOUR_TYPES_SEED, FOUR_TYPES_DRAWS = 7, 24


def four_type_suite():
    """Seeded draws of four device types of one device each (one type has two in 4 of 5
    draws), models of 3-4 layers, gbs 4-24, memory cut in 30%: every pipeline of all four
    types has 24 type orders, of which the search balances ``type_orders`` (6)."""
    rng = random.Random(FOUR_TYPES_SEED)
    types = ["A100", "RTX3090", "V100", "910B4"]
    for i in range(FOUR_TYPES_DRAWS):
        extra = rng.choice([None] + types)
        nodes = [{"type": t, "devices_per_node": 2 if t == extra else 1} for t in types]
        model, gbs = rng.choice([M3, M4]), rng.choice([4, 6, 8, 12, 16, 24])
        memory = {t: {"memory_gb": rng.choice([2, 3, 4])} for t in types} if rng.random() < 0.3 else None
        cluster = make_cluster(nodes, inter_node_gbps=rng.choice([25, 100, 400]),
                               **({"device_types": memory} if memory else {}))
        yield f"#{i} 2x{extra} {model.name} gbs {gbs}{' (memory cut)' if memory else ''}", model, cluster, gbs


FOUR_TYPE_SEARCHES = {"search()": {}, "every order": dict(type_orders=0)}


@functools.lru_cache(maxsize=None)
def four_type_results():
    row = functools.partial(case_row, searches=FOUR_TYPE_SEARCHES)
    return parallel_map(row, list(four_type_suite()), len(os.sched_getaffinity(0)))


@pytest.mark.slow
def test_four_types_six_type_orders_lose_nothing_and_stay_near_the_optimum():
    """Measured (24 draws, 21 with a proven optimum): search() = every order on every case;
    gap to the planner-space optimum mean 0.19%, max 1.9%, 18 of 21 at the optimum (#2,
    #3, #17 miss it by 1.9%, 1.5%, 0.6% with every order as well: the core's balance)."""
    rows = [r for r in four_type_results() if r["planner"].plan is not None and r["planner"].proven]
    assert len(rows) >= 18
    for r in rows:
        assert r["search()"] <= r["every order"] * (1 + 1e-9), r["name"]
        assert r["search()"] >= r["planner"].ms * (1 - 1e-9), r["name"]
    g = [r["search()"] / r["planner"].ms - 1 for r in rows]
    summary = f"mean {statistics.mean(g):.4f} max {max(g):.4f} at the optimum {sum(x <= 1e-9 for x in g)} of {len(g)}"
    assert statistics.mean(g) <= 0.01 and max(g) <= 0.05, summary
