"""Stage boundaries moved inside layers after the search (``--op-boundaries``)."""
import pytest

from _planner_data import M4, make_cluster, profiles_for
from eth.cost.model import CostModel
from eth.planner.op_boundaries import refine_boundaries, respan
from eth.spec.model import layer_ops
from eth.spec.plan import PipelinePlan, Plan, StagePlan
from eth.spec.precision import TrainSetup


@pytest.mark.parametrize("types", [("A100", "RTX3090"), ("RTX3090", "A100"), ("A100", "V100")])
def test_the_boundary_reaches_the_brute_force_optimum(types):
    """Two stages of one pipeline, every whole-layer start and with recompute: the refined
    boundary is as fast as the best of all 4 x k - 1 op positions, evaluated one by one."""
    cluster = make_cluster([{"type": t, "devices_per_node": 1} for t in types])
    cost = CostModel(M4, cluster, profiles_for(M4, cluster), TrainSetup())
    k = len(layer_ops(M4))
    gains = []
    for split in (1, 2, 3):
        for recompute in ({}, {"softmax": 1, "gelu": 1}):
            first = StagePlan([0], types[0], 1, 1, (0, split), dict(recompute))
            second = StagePlan([1], types[1], 1, 1, (split, 4), dict(recompute))
            plan = Plan(M4, cluster, 32, [PipelinePlan(2, 32, [first, second])], training=TrainSetup())
            refined, record = refine_boundaries(plan, cost, 32)
            got = cost.evaluate(refined)["iteration_ms"]
            every = [cost.evaluate(Plan(M4, cluster, 32, [PipelinePlan(2, 32, [respan(first, M4, 0, p),
                                                                                 respan(second, M4, p, 4 * k)])],
                                        training=TrainSetup()))["iteration_ms"] for p in range(1, 4 * k)]
            assert got <= min(every) * (1 + 1e-9), (split, recompute, got, min(every))
            assert got <= record["before_ms"] + 1e-4                 # the record is rounded to 1e-4 ms
            assert not record["kept"] or got < record["before_ms"]
            gains.append(record["before_ms"] / got)
    assert max(gains) > 1.05   # some start is far from the best boundary


def test_respan_caps_recompute_to_the_layers_that_run_the_op():
    stage = StagePlan([0], "A100", 1, 1, (0, 2), {"qkv": 2, "gelu": 2})
    k = len(layer_ops(M4))
    moved = respan(stage, M4, 0, k + 2)            # layer 0 and layer 1 through qkv
    assert moved.layers == (0, 2) and moved.ops == ("1st-layernorm", "qkv")
    assert moved.recompute == {"qkv": 2, "gelu": 1}
    assert respan(stage, M4, k, 2 * k).ops is None


def test_search_with_op_boundaries_on_the_cpu_demo(tmp_path):
    """The CPU demo cluster with its measured profile: the refined plan is predicted faster
    than the whole-layer one, records the refinement, saves as version 2 and loads back;
    without the option the plan holds whole layers."""
    import json
    from pathlib import Path

    from eth.planner.job import plan_job
    from eth.planner.options import SearchOptions
    from eth.spec.cluster import load_cluster
    from eth.spec.model import get_model
    from eth.spec.plan import load_plan

    root = Path(__file__).resolve().parents[2]
    cluster = load_cluster(root / "examples/clusters/cpu-demo.yaml")
    profiles = root / "profiles/measured/cpu.json"
    setup = TrainSetup("fp32", 1)
    whole = plan_job(get_model("tiny"), cluster, str(profiles), SearchOptions(gbs=16, setup=setup))
    cut = plan_job(get_model("tiny"), cluster, str(profiles), SearchOptions(gbs=16, setup=setup, op_boundaries=True))
    assert not whole.cuts_layers and "op_boundaries" not in whole.search
    record = cut.search["op_boundaries"]
    assert cut.cuts_layers and record["kept"] and record["moves"] >= 1
    assert record["before_ms"] == pytest.approx(whole.predicted["iteration_ms"], rel=1e-6)
    assert cut.predicted["iteration_ms"] == pytest.approx(record["after_ms"], rel=1e-6)
    assert cut.predicted["iteration_ms"] < 0.9 * whole.predicted["iteration_ms"]
    cut.save(tmp_path / "plan.json")
    assert json.loads((tmp_path / "plan.json").read_text())["version"] == 2
    assert load_plan(tmp_path / "plan.json").to_dict() == cut.to_dict()


def test_three_stages_come_within_one_percent_of_every_partition():
    """Three stages of one pipeline over a 2-layer model (26 ops), started from a skewed
    whole-layer split: the refined plan is within 1% of the best of all 300 partitions
    of the ops into three stages, each with its recompute fitted as the refinement fits it."""
    from dataclasses import replace

    from eth.planner.evaluate import Evaluator
    from eth.planner.op_boundaries import fit_recompute

    m = replace(M4, name="m2", num_layers=2)
    cluster = make_cluster([{"type": "A100", "devices_per_node": 1}, {"type": "RTX3090", "devices_per_node": 2}])
    cost = CostModel(m, cluster, profiles_for(m, cluster), TrainSetup())
    k = len(layer_ops(m))
    base = [StagePlan([0], "A100", 1, 1, (0, 1)), StagePlan([1], "RTX3090", 1, 1, (1, 2)),
            StagePlan([2], "RTX3090", 1, 1, (1, 2))]
    order = Evaluator(cost).recompute_order

    def plan_of(a, b):
        stages = [respan(base[0], m, 0, a), respan(base[1], m, a, b), respan(base[2], m, b, 2 * k)]
        for j in range(3):
            fitted = fit_recompute(cost, order, PipelinePlan(4, 64, stages), j)
            if fitted is None:
                return None
            stages[j] = fitted
        return Plan(m, cluster, 64, [PipelinePlan(4, 64, stages)], training=TrainSetup())

    every = [cost.evaluate(p)["iteration_ms"] for a in range(1, 2 * k - 1) for b in range(a + 1, 2 * k)
             if (p := plan_of(a, b)) is not None]
    assert len(every) == 300
    start = plan_of(k - 3, k - 1)
    refined, record = refine_boundaries(start, cost, 64)
    got = cost.evaluate(refined)["iteration_ms"]
    assert record["kept"] and got <= min(every) * 1.01, (got, min(every), record)
