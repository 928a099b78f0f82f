"""Baseline planners (uniform, metis-strong, hexiscale-strong, typesplit) against brute
force over their own restricted spaces, every baseline against the HPP search, and on
infeasible inputs.  The faithful metis / hexiscale: test_baselines_faithful.py."""
import itertools
import math

import pytest

from eth.cost.model import CostModel
from eth.errors import InfeasibleError, PlanError, ProfileError, SpecError
from eth.spec.model import LAYER_OPS, ModelSpec, get_model
from eth.spec.plan import PipelinePlan, Plan, StagePlan
from eth.planner.baselines import BASELINES, plan_baseline
from eth.planner.baselines.common import RECOMPUTE_MODES, BaselineOptions, StageRecomputeEvaluator
from eth.planner.bruteforce import compositions, lbs_vectors, pipeline_configs
from eth.planner.enumerate import Blocks, assign_ranks, make_blocks, stage_groups
from eth.planner.evaluate import Evaluator, PipeState, StageState
from eth.planner.options import SearchOptions
from eth.planner.search import search

from _planner_data import A2R2, M4, M6, make_cluster, profiles_for

A4R4 = [{"type": "A100", "devices_per_node": 4}, {"type": "RTX3090", "devices_per_node": 4}]
# 18 bytes of model state per parameter (bf16 weights, fp32 gradients, fp32 Adam)
SMALL_MEM = {"A100": {"memory_gb": 3 * 18 / 16}, "RTX3090": {"memory_gb": 2 * 18 / 16}}
CASES = {
    "2A+2R gbs16": (M4, A2R2, {}, 16),
    "2A+2R gbs12": (M4, A2R2, {}, 12),
    "4A+4R gbs4": (M4, A4R4, {}, 4),
    "small memory (tp + recompute)": (M6, A2R2, SMALL_MEM, 16),
    "one type, 4A": (M4, [{"type": "A100", "devices_per_node": 4}], {}, 16),
    "2x(1A+1R) nodes": (M4, [{"type": "A100", "devices_per_node": 1, "count": 2},
                             {"type": "RTX3090", "devices_per_node": 1, "count": 2}], {}, 16),
}
MODES = tuple(ops for _, ops in RECOMPUTE_MODES)


def setup(name):
    model, nodes, types, gbs = CASES[name]
    cluster = make_cluster(nodes, device_types=types) if types else make_cluster(nodes)
    return model, cluster, profiles_for(model, cluster), gbs


def score(cost, plan):
    """Iteration ms of a plan, inf if it is invalid or does not fit."""
    try:
        plan.validate()
        out = cost.evaluate(plan)
    except (PlanError, ProfileError, SpecError):
        return math.inf
    return out["iteration_ms"] if out["feasible"] else math.inf


def per_type_ranks(cluster):
    out = {}
    for d in cluster.devices:
        out.setdefault(d.type, []).append(d.rank)
    return out


# ---------------------------------------------------------------- brute forces
def brute_uniform(model, cluster, db, gbs):
    """Every stage size, tp, type order, mbs = dp x 2^k and uniform recompute mode."""
    cost, ranks, N, L = CostModel(model, cluster, db, objective="eq5"), per_type_ranks(cluster), cluster.world_size, model.num_layers
    per_node = min(g.devices_per_node for g in cluster.nodes)
    best = math.inf
    for s in range(1, N + 1):
        if any(len(r) % s for r in ranks.values()) or N // s > L:
            continue
        pp = N // s
        split = [L // pp + (1 if i < L % pp else 0) for i in range(pp)]
        for tp in range(1, min(s, per_node) + 1):
            if s % tp:
                continue
            for order in itertools.permutations(ranks):
                for mbs, ops in itertools.product(range(1, gbs + 1), MODES):
                    dp = s // tp
                    if mbs % dp or (mbs // dp) & (mbs // dp - 1):
                        continue                # per-replica micro-batch: a power of two
                    stages, start = [], 0
                    chunks = [(t, ranks[t][i:i + s]) for t in order for i in range(0, len(ranks[t]), s)]
                    for (t, rk), n in zip(chunks, split):
                        stages.append(StagePlan(rk, t, tp, s // tp, (start, start + n), {op: n for op in ops}))
                        start += n
                    best = min(best, score(cost, Plan(model, cluster, gbs, [PipelinePlan(mbs, gbs, stages)])))
    return best


def brute_metis(model, cluster, db, gbs):
    """One pipeline: every stage group, layer split, tp per stage and mbs (bruteforce.py),
    per-stage coarse recompute (none / selective / full)."""
    cost, blocks = CostModel(model, cluster, db, objective="eq5"), make_blocks(cluster, 8)
    ev = StageRecomputeEvaluator(cost)
    best = math.inf
    for g, state, rec in pipeline_configs(ev, blocks, blocks.count, gbs, 16):
        rk = assign_ranks(blocks, [list(g.stages)])[0]
        stages = [StagePlan(r, st.device_type, st.tp, st.dp, rng, dict(rc))
                  for st, rng, rc, r in zip(state.stages, state.layer_ranges(), rec, rk)]
        best = min(best, score(cost, Plan(model, cluster, gbs, [PipelinePlan(state.mbs, gbs, stages)])))
    return best


def brute_hexiscale(model, cluster, db, gbs):
    """k identical pipelines, tp = stage size, every layer split and power-of-two mbs | Lbs,
    per-stage coarse recompute (none / selective / full)."""
    cost = CostModel(model, cluster, db, objective="eq5")
    ev = StageRecomputeEvaluator(cost)
    unit = make_blocks(cluster, 10 ** 6)
    best = math.inf
    for k in range(1, min(unit.count) + 1):
        if any(c % k for c in unit.count) or gbs % k:
            continue
        per, lbs = tuple(c // k for c in unit.count), gbs // k
        blocks = Blocks(unit.types, per, (k,) * len(per), unit.ranks)
        for g in stage_groups(unit.types, per, model.num_layers, 16):
            if not all(n in ev.valid_tps(t, n) for t, n in g.stages):
                continue                        # tp = stage size must fit in a node
            ranks = assign_ranks(blocks, [list(g.stages)] * k)
            for split in compositions(model.num_layers, g.num_stages):
                for mbs in (m for m in range(1, lbs + 1) if lbs % m == 0 and m & (m - 1) == 0):
                    state = PipeState(tuple(StageState(t, n, n, l) for (t, n), l in zip(g.stages, split)), mbs)
                    e = ev.evaluate(state, lbs, ranks[0])
                    if not e.feasible:
                        continue
                    pipes = [PipelinePlan(mbs, lbs, [StagePlan(r, st.device_type, st.tp, 1, rng, dict(rc))
                                                     for st, rng, rc, r in zip(state.stages, state.layer_ranges(),
                                                                               e.recompute, rk)])
                             for rk in ranks]
                    best = min(best, score(cost, Plan(model, cluster, gbs, pipes)))
    return best


def brute_typesplit(model, cluster, db, gbs):
    """Homogeneous pipelines (every partition of each type), every config and Lbs vector."""
    cost, ev, blocks = CostModel(model, cluster, db, objective="eq5"), Evaluator(CostModel(model, cluster, db, objective="eq5")), make_blocks(cluster, 8)
    nt = len(blocks.types)

    def parts(n, largest):
        if n == 0:
            yield ()
        for f in range(min(n, largest), 0, -1):
            for rest in parts(n - f, f):
                yield (f,) + rest

    configs, best = {}, math.inf
    for combo in itertools.product(*[list(parts(c, c)) for c in blocks.count]):
        vecs = [tuple(n if t == i else 0 for t in range(nt)) for i, p in enumerate(combo) for n in p]
        for v in vecs:
            if v not in configs:
                configs[v] = list(pipeline_configs(ev, blocks, v, gbs, 16))
        for choice in itertools.product(*[configs[v] for v in vecs]):
            ranks = assign_ranks(blocks, [list(g.stages) for g, _, _ in choice])
            for lbs in lbs_vectors([s.mbs for _, s, _ in choice], gbs):
                pipes = [PipelinePlan(s.mbs, n, [StagePlan(r, st.device_type, st.tp, st.dp, rng, dict(rc))
                                                for st, rng, rc, r in zip(s.stages, s.layer_ranges(), rec, rk)])
                         for (_, s, rec), rk, n in zip(choice, ranks, lbs)]
                best = min(best, score(cost, Plan(model, cluster, gbs, pipes)))
    return best


BRUTE = {"uniform": brute_uniform, "metis-strong": brute_metis, "hexiscale-strong": brute_hexiscale,
         "typesplit": brute_typesplit}
# memory-starved case: a single type cannot hold the model (typesplit), no uniform
# tp/dp + recompute mode fits, and nothing fits without recompute (faithful metis); every
# other (strategy, case) has a feasible plan
INFEASIBLE = {("uniform", "small memory (tp + recompute)"), ("typesplit", "small memory (tp + recompute)"),
              ("metis", "small memory (tp + recompute)")}
TOLERANCE = {"uniform": 1e-9, "metis-strong": 0.02, "hexiscale-strong": 0.02, "typesplit": 0.02}


# ---------------------------------------------------------------- restrictions
def check_restriction(strategy, plan):
    pipes = plan.pipelines
    if strategy == "uniform":
        assert len(pipes) == 1
        st = pipes[0].stages
        assert len({(s.tp, s.dp) for s in st}) == 1
        n = [s.num_layers for s in st]
        assert max(n) - min(n) <= 1 and n == sorted(n, reverse=True)
        assert len({tuple(sorted(s.recompute.items(), key=str)) and frozenset(s.recompute) for s in st}) == 1
    elif strategy == "metis-strong":
        assert len(pipes) == 1 and pipes[0].lbs == plan.gbs
    if strategy in ("metis-strong", "hexiscale-strong"):   # coarse recompute: a mode, in all layers
        for s in (s for p in pipes for s in p.stages):
            assert set(s.recompute.values()) <= {s.num_layers}
            assert tuple(op for op in LAYER_OPS if op in s.recompute) in MODES
    if strategy == "hexiscale-strong":
        layout = {tuple((s.device_type, len(s.ranks), s.layers) for s in p.stages) for p in pipes}
        assert len(layout) == 1
        assert len({(p.lbs, p.mbs) for p in pipes}) == 1 and pipes[0].lbs * len(pipes) == plan.gbs
        assert all(s.dp == 1 for p in pipes for s in p.stages)
    elif strategy == "typesplit":
        assert all(len({s.device_type for s in p.stages}) == 1 for p in pipes)
    assert sum(p.lbs for p in pipes) == plan.gbs


# Known gaps (strict xfail: the test fails once one is fixed): none.  With the constant
# GEMM efficiency, TypeSplit on 4 A100 + 4 RTX3090 at gbs 4 stopped at one tp-4 stage per
# type, 2.8% slower than the optimum of its space (two 2-stage tp-2 pipelines, Lbs 3 / 1):
# leaving it needs every stage of both pipelines changed at once.  With the fitted A100 /
# RTX3090 curves (narrow tp-4 GEMMs slower) it starts elsewhere and reaches the optimum;
# the weakness itself is not fixed.
KNOWN_GAPS: set = set()
PAIRS = [pytest.param(s, n, marks=pytest.mark.xfail(strict=True, reason="local optimum, see KNOWN_GAPS"))
         if (s, n) in KNOWN_GAPS else (s, n) for n in CASES for s in BRUTE]


@pytest.mark.parametrize("strategy, name", PAIRS)
def test_baseline_valid_restricted_and_near_brute_force(strategy, name):
    """Each baseline's search against brute force over its space, both by the paper's
    Eq. 5 (``objective="eq5"``), what its balancer and allocation are built on."""
    model, cluster, db, gbs = setup(name)
    if (strategy, name) in INFEASIBLE:
        assert BRUTE[strategy](model, cluster, db, gbs) == math.inf   # nothing in its space fits
        with pytest.raises(InfeasibleError, match=strategy) as err:
            plan_baseline(strategy, model, cluster, db, gbs)
        if strategy == "typesplit":     # says which type cannot hold the model alone (the A100s can)
            assert str(err.value).endswith("all the devices of RTX3090 (2 devices, 4.5 GB) hold less than the "
                                           "6.1 GB of weights, gradients and optimizer states of m6")
        return
    plan = plan_baseline(strategy, model, cluster, db, gbs, BaselineOptions(objective="eq5"))
    plan.validate()
    check_restriction(strategy, plan)
    assert plan.search["strategy"] == strategy and plan.search["time_s"] >= 0
    assert plan.predicted["feasible"] and all(st.predicted for p in plan.pipelines for st in p.stages)
    got = CostModel(model, cluster, db, objective="eq5").evaluate(plan)["iteration_ms"]
    assert got == pytest.approx(plan.predicted["iteration_ms"], abs=1e-3)
    ref = BRUTE[strategy](model, cluster, db, gbs)
    assert got <= ref * (1 + TOLERANCE[strategy]), (strategy, got, ref)


M2 = ModelSpec("m2", num_layers=2, hidden=1024, heads=8, seq_len=1024, vocab=1024)
SLOWER = {
    # name: (model, nodes, device types, gbs, baselines without a plan, measured numbers)
}
"""Small cases (from the seeded suite of test_search_core.py) on which the HPP search
without seeds is slower than a baseline, with the numbers measured (none known)."""
SMALL = {
    # once slower: unseeded HPP 7.02 ms against typesplit's 6.82 ms (a 2-stage pipeline at
    # mbs 1, Lbs 5, next to a 1-stage one, Lbs 3); the polish's free-Mbs re-plan reaches it
    "3 A100, 2 layers, gbs 8": (
        M2, [{"type": "A100", "devices_per_node": 3}], {}, 8,
        ("uniform", "metis", "metis-strong", "hexiscale", "hexiscale-strong"), ""),
    # once slower: unseeded HPP 26.25 ms (mbs 4), uniform/metis/hexiscale 25.58 ms: mbs 8
    # with the attention core (score, softmax, attn-dropout, context) recomputed as one
    # run, which the per-op order missed; reached by the whole-run recompute
    # (eth/planner/recompute_runs.py) and, since the memory model counts the run the
    # backward re-materialises, by the per-op order as well
    "1 A100 of 3 GB, gbs 16": (
        M4, [{"type": "A100", "devices_per_node": 1}], {"A100": {"memory_gb": 3}}, 16, (), ""),
    # once slower: unseeded HPP 12.22 ms (mbs 2, no recompute), metis 11.96 ms: mbs 4 with
    # the attention core recomputed on the 910B4 stage; reached as above
    "1 V100 of 4 GB + 2 910B4 of 2 GB, gbs 8": (
        M4, [{"type": "V100", "devices_per_node": 1}, {"type": "910B4", "devices_per_node": 2}],
        {"V100": {"memory_gb": 4}, "910B4": {"memory_gb": 2}}, 8, (), ""),
}
"""Small cases from the same suite on which the HPP search without seeds was slower
than a baseline before, and is not any more."""


SLOWER_CASES = {
    "small memory (tp + recompute)":
        "unseeded HPP 187.07 ms, metis-strong 186.41 ms (+0.35%), same stages (A100 tp 2 layers 0-3, "
        "RTX3090 tp 2 layers 4-5, mbs 1): metis-strong's plan recomputes every op of the A100 stage "
        "and only the attention core of the RTX3090 one, HPP's 9 and 7 ops (since the cost model "
        "counts the recomputed run the backward holds again)"}
"""CASES on which the HPP search without seeds is slower than a baseline, with the numbers."""


@pytest.mark.parametrize("name", [*(pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=SLOWER_CASES[n]))
                                    if n in SLOWER_CASES else n for n in CASES), *SMALL,
                                  *(pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=v[-1]))
                                    for n, v in SLOWER.items())])
def test_hpp_never_slower_than_a_baseline(name):
    """The HPP search alone (seeds off: with them it returns the baselines' own plans when
    those are faster, so this would hold by construction), by the paper's Eq. 5, what
    both rank candidates by (``SEARCH_OBJECTIVE``; the finalists' re-scoring is off)."""
    if name in CASES:
        model, cluster, db, gbs = setup(name)
        infeasible = {s for s, n in INFEASIBLE if n == name}
    else:
        model, nodes, types, gbs, infeasible, _ = SMALL.get(name) or SLOWER[name]
        cluster = make_cluster(nodes, device_types=types, inter_node_gbps=400)
        db = profiles_for(model, cluster)
    eq5 = dict(objective="eq5")
    hpp = search(model, cluster, db, SearchOptions(gbs=gbs, seeds=False, simulate_finalists=False, **eq5))
    hpp = hpp.predicted["iteration_ms"]
    for strategy in BASELINES:
        if strategy in infeasible:
            continue
        base = plan_baseline(strategy, model, cluster, db, gbs, BaselineOptions(**eq5)).predicted["iteration_ms"]
        assert hpp <= base * (1 + 1e-9), (strategy, hpp, base)


def test_uniform_uses_recompute_when_memory_is_short():
    model, cluster, db, gbs = setup("small memory (tp + recompute)")
    cluster = make_cluster(A2R2, device_types={"A100": {"memory_gb": 4}, "RTX3090": {"memory_gb": 4}})
    plan = plan_baseline("uniform", model, cluster, profiles_for(model, cluster), gbs)
    assert all(s.recompute for s in plan.pipelines[0].stages)


def test_options_from_search_options_and_time_limit_recorded():
    model, cluster, db, gbs = setup("2A+2R gbs16")
    plan = plan_baseline("metis", model, cluster, db, gbs, SearchOptions(gbs=gbs, max_stages=2))
    assert plan.search["options"]["max_stages"] == 2 and len(plan.pipelines[0].stages) <= 2
    assert plan.search["time_limited"] is False


def test_model_too_big_is_infeasible_for_every_baseline():
    model = get_model("gpt3-13b")
    cluster = make_cluster([{"type": "RTX3090", "devices_per_node": 2}])
    db = profiles_for(model, cluster)
    for strategy in BASELINES:
        with pytest.raises(InfeasibleError, match=strategy):
            plan_baseline(strategy, model, cluster, db, 8)


def test_hexiscale_infeasible_when_pure_tp_stages_outnumber_layers():
    # one device per node: tp <= 1, so every device is a stage; 4 stages > 2 layers
    model = ModelSpec("m2", num_layers=2, hidden=1024, heads=8, seq_len=512, vocab=8192)
    cluster = make_cluster([{"type": "A100", "devices_per_node": 1, "count": 3},
                            {"type": "RTX3090", "devices_per_node": 1}])
    db = profiles_for(model, cluster)
    for hexiscale in ("hexiscale", "hexiscale-strong"):
        with pytest.raises(InfeasibleError, match=f"{hexiscale}: .*identical pipelines"):
            plan_baseline(hexiscale, model, cluster, db, 12)
    with pytest.raises(InfeasibleError, match="uniform"):
        plan_baseline("uniform", model, cluster, db, 12)   # 4 stages of 1 > 2 layers
    # metis-strong: [3 A100 at dp 3][1 RTX3090] with mbs 3 | 12 (faithful Metis: power-of-two mbs)
    assert len(plan_baseline("metis-strong", model, cluster, db, 12).pipelines[0].stages) == 2


def test_unknown_strategy_and_bad_gbs():
    model, cluster, db, _ = setup("2A+2R gbs16")
    with pytest.raises(SpecError, match="unknown baseline"):
        plan_baseline("megatron", model, cluster, db, 8)
    with pytest.raises(SpecError, match="gbs"):
        plan_baseline("metis", model, cluster, db, 0)


MANY_TYPES = {
    "3 types": ([{"type": t, "devices_per_node": 4} for t in ("A100", "RTX3090", "V100")], get_model("gpt3-1.3b"), 64),
    "4 types": ([{"type": t, "devices_per_node": 2} for t in ("H100", "A100", "RTX3090", "V100")],
                get_model("gpt3-1.3b"), 32),
}


@pytest.mark.parametrize("name", sorted(MANY_TYPES))
def test_strong_baselines_prune_by_floors_to_the_same_plan(name):
    """metis-strong and hexiscale-strong leave the stage groups whose floor exceeds the best
    plan found: the same plan as balancing every group, with fewer cost evaluations."""
    nodes, model, gbs = MANY_TYPES[name]
    cluster = make_cluster(nodes)
    db = profiles_for(model, cluster)
    for strategy in ("metis-strong", "hexiscale-strong"):
        pruned, every = (plan_baseline(strategy, model, cluster, db, gbs, BaselineOptions(prune=p))
                         for p in (True, False))
        assert pruned.predicted["iteration_ms"] == every.predicted["iteration_ms"], strategy
        assert pruned.search["cost_evaluations"] < every.search["cost_evaluations"], strategy
        default = plan_baseline(strategy, model, cluster, db, gbs)      # pruning is the default
        assert default.search["cost_evaluations"] == pruned.search["cost_evaluations"], strategy


@pytest.mark.parametrize("types, model, gbs", [
    (5, M6, 64), (6, M6, 64), (5, get_model("gpt3-1.3b"), 128)])
def test_uniform_order_descent_on_five_and_six_types_finds_the_best_order(types, model, gbs, monkeypatch):
    """Beyond four types uniform sweeps its start orders, their two-type swaps and then
    those of the best order while one is faster; on these clusters it ends where sweeping
    all 120 / 720 orders does (on 1.3B the starts are 22% slower than the best order,
    one swap from the second-best start: a descent from the best start alone stopped there)."""
    from eth.planner.baselines import uniform

    cluster = make_cluster([{"type": t, "devices_per_node": 2}
                            for t in ("H100", "A100", "A100-40GB", "RTX3090", "V100", "L40S")[:types]])
    db = profiles_for(model, cluster)
    eq5 = BaselineOptions(objective="eq5")          # what it ranks orders by
    descent = plan_baseline("uniform", model, cluster, db, gbs, eq5)
    monkeypatch.setattr(uniform, "EVERY_ORDER_UP_TO", 6)
    every = plan_baseline("uniform", model, cluster, db, gbs, eq5)
    assert descent.predicted["iteration_ms"] == every.predicted["iteration_ms"]


@pytest.mark.parametrize("strategy", BASELINES)
def test_every_baseline_plans_under_each_zero_stage(strategy):
    """Under ZeRO 1 and 2 (model states sharded over dp: less memory) each baseline finds a
    plan that fits, records the setup and is scored as the cost model scores it under
    that setup; the exhaustive one (uniform) is no slower than its ZeRO-0 plan re-scored
    under the sharded setup, which also fits there."""
    from eth.spec.precision import TrainSetup

    model, cluster, db, gbs = setup("2A+2R gbs16")
    plans = {}
    for zero in (0, 1, 2):
        opt = BaselineOptions(setup=TrainSetup("bf16", zero), objective="eq5")
        plan = plans[zero] = plan_baseline(strategy, model, cluster, db, gbs, opt)
        assert plan.training.zero_stage == zero and plan.predicted["feasible"], (strategy, zero)
        got = CostModel(model, cluster, db, TrainSetup("bf16", zero), objective="eq5").evaluate(plan)
        assert got["feasible"] and got["iteration_ms"] == pytest.approx(plan.predicted["iteration_ms"], abs=1e-3)
    if strategy == "uniform":
        for zero in (1, 2):
            cost = CostModel(model, cluster, db, TrainSetup("bf16", zero), objective="eq5")
            again = cost.evaluate(Plan(model, cluster, gbs, plans[0].pipelines, training=TrainSetup("bf16", zero)))
            assert again["feasible"] and plans[zero].predicted["iteration_ms"] <= again["iteration_ms"] + 1e-3


def test_hexiscale_strong_own_allreduce_is_the_cost_models_for_the_plan_it_picks():
    """hexiscale-strong balances layers by its own Eq. 6 per stage (k copies, dp 1): on a
    slow link, where it decides, it is the cost model's block-wise All-Reduce of the
    plan it returns, stage by stage."""
    from eth.planner.baselines.hexiscale_strong import own_allreduce_ms

    model = get_model("gpt3-1.3b")
    cluster = make_cluster([{"type": "A100", "devices_per_node": 8}, {"type": "RTX3090", "devices_per_node": 8}],
                           inter_node_gbps=5)
    db = profiles_for(model, cluster)
    plan = plan_baseline("hexiscale-strong", model, cluster, db, 64, BaselineOptions(objective="eq5"))
    cost = CostModel(model, cluster, db, plan.training, objective="eq5")
    k, ar = len(plan.pipelines), cost.stage_allreduce_ms(plan.pipelines)
    assert k > 1 and min(ar[0]) > 10          # several copies, a transfer that matters
    for j, st in enumerate(plan.pipelines[0].stages):
        gbps = cluster.link_gbps([p.stages[j].ranks[0] for p in plan.pipelines])
        assert own_allreduce_ms(model, cost.grad_bytes, st.tp, st.layers, k, gbps) == pytest.approx(ar[0][j], rel=1e-9)
