"""The planner plans for the training setup it is given and records it in the plan."""
from pathlib import Path

from _planner_data import A2R2, M6, make_cluster, profiles_for
from eth.cli.search_hpp import main as search_cli
from eth.cost.model import CostModel
from eth.spec.plan import load_plan
from eth.planner.options import SearchOptions
from eth.planner.search import search
from eth.spec.precision import TrainSetup


def test_zero_1_plans_use_the_memory_it_frees():
    cluster = make_cluster(A2R2, device_types={"A100": {"memory_gb": 5}, "RTX3090": {"memory_gb": 5}})
    db = profiles_for(M6, cluster)
    z0, z1 = TrainSetup("bf16", 0, "fp32"), TrainSetup("bf16", 1, "fp32")
    plan0 = search(M6, cluster, db, SearchOptions(gbs=16, setup=z0))
    plan1 = search(M6, cluster, db, SearchOptions(gbs=16, setup=z1))
    assert plan0.training == z0 and plan1.training == z1
    # sharding the optimizer state over a dp 2 stage's replicas makes room for it: faster,
    # and that plan does not fit when every rank keeps all its optimizer state
    assert plan1.predicted["iteration_ms"] < plan0.predicted["iteration_ms"] * 0.98
    assert any(s.dp > 1 for p in plan1.pipelines for s in p.stages)
    assert not CostModel(M6, cluster, db, z0).evaluate(plan1)["feasible"]
    assert CostModel(M6, cluster, db, z1).evaluate(plan1)["feasible"]


def test_cli_records_the_setup(tmp_path, capsys):
    out = tmp_path / "plan.json"
    demo = Path(__file__).resolve().parents[2] / "examples/clusters/cpu-demo.yaml"
    assert search_cli(["--model", "tiny", "--cluster", str(demo), "--gbs", "16",
                       "--precision", "fp32", "--zero-stage", "2", "--no-progress", "-o", str(out)]) == 0
    assert load_plan(out).training == TrainSetup("fp32", 2, "fp32")
    assert "[fp32, fp32 gradients, ZeRO 2]" in capsys.readouterr().out
