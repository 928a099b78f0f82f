"""bench/measured_runs.py on a small tree laid out as Sailor's repository: its plans written
in our formats (one pipeline; a pipeline per replica when a stage mixes GPU types; another
model's plan refused), the errors it reports, the fixed memory it fits."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from eth.spec.model import ALL_OPS, ModelSpec, op_shapes

from _foundation_data import ACESO_NAMES

REPO = Path(__file__).resolve().parents[2]
MB = 2 ** 20
HEADER = ("op_name,forward-compute,backward-compute,input_size,output_size,weights,activations,"
          "fwd_reserved,bwd_reserved\n")
SMALL = ModelSpec("opt-small", num_layers=4, hidden=64, heads=4, seq_len=32, vocab=256, dropout=0.0)


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("measured_runs", REPO / "bench/measured_runs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module            # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _csvs(folder: Path, us: float):
    """fp32 op CSVs of SMALL (as Sailor's, named {model}_mbs{m}_tp{t}_algo0.csv), every op
    ``us`` microseconds forward and twice that backward at mbs 1."""
    folder.mkdir(parents=True)
    for mbs in (1, 2):
        for tp in (1, 2):
            shapes = op_shapes(SMALL, mbs, tp, elem_bytes=4)
            rows = [f"{ACESO_NAMES[op]},{us * mbs:.3f},{2 * us * mbs:.3f},{s.input_bytes / MB:.6f},"
                    f"{s.output_bytes / MB:.6f},{s.weight_bytes / MB:.6f},{s.output_bytes / MB:.6f},0,0"
                    for op, s in shapes.items()]
            (folder / f"OPT-S_mbs{mbs}_tp{tp}_algo0.csv").write_text(HEADER + "\n".join(rows) + "\n")


def _run(stages, mbs, gbs, real, mem, gpus_per_stage):
    return {"pipeline_list": [{"num_stages": len(stages), "layers_per_stage": stages,
                               "tmp_per_stage": [[[[[g, 2, "z"]], 2] for g in gpus] for gpus in gpus_per_stage],
                               "dp": [len(g) for g in gpus_per_stage]}],
            "mbs": mbs, "gbs": gbs, "real": real, "red_grads": 0.0, "max_mem": mem, "N": 0}


@pytest.fixture()
def sailor(tmp_path):
    root = tmp_path / "sailor"
    for gpu, us in (("FAST", 100.0), ("SLOW", 300.0)):
        _csvs(root / f"sailor/Planner/baselines/Aceso/profiler/{gpu}/profiled-data-fp32", us)
    net = root / "sailor/providers"
    net.mkdir(parents=True)
    coeffs = {"inter": {g: {"1": [[0, 0, 1], 1e9], "2": [[0, 0, 2], 2e9]} for g in ("FAST", "SLOW")},
              "intra": {g: {"2": [[0, 0, 10], 1e10]} for g in ("FAST", "SLOW")}}
    (net / "network_coeffs_all_homo.json").write_text(json.dumps(coeffs))
    zone = "us-central1-a"
    het = {zone: {a: {"1": {zone: {b: {"1": [[0, 0, 0.5], 5e8]} for b in ("FAST", "SLOW")}}} for a in ("FAST", "SLOW")}}
    (net / "multizone_bandwidths_het.json").write_text(json.dumps(het))
    cfg = root / "sailor/Planner/simulations/configs"
    cfg.mkdir(parents=True)
    (cfg / "basic_cluster_config.json").write_text(json.dumps(
        {"FAST": {"gpus_per_node": 2, "mem_per_gpu": 40e9}, "SLOW": {"gpus_per_node": 2, "mem_per_gpu": 20e9}}))
    runs = root / "sailor/Planner/simulations/validation/lab"
    layers = [[0, 1, 2], [3, 4, 5]]                   # embedding + 2 layers, 2 layers + last
    for name, run in {"same/p1": _run(layers, 2, 16, 1.0, 5e9, [["FAST", "FAST"], ["FAST", "FAST"]]),
                      "mixed/p2": _run(layers, 2, 16, 1.0, 5e9, [["FAST", "SLOW"], ["SLOW", "FAST"]]),
                      "other/p3": _run([[0, 1], [2, 3]], 2, 16, 1.0, 5e9, [["FAST"], ["FAST"]])}.items():
        (runs / name).parent.mkdir(parents=True, exist_ok=True)
        (runs / f"{name}.json").with_name(f"plan_config_{Path(name).name}.json").write_text(json.dumps(run))
    return root


def _data(**extra):
    return {"training": {"precision": "fp32", "zero_stage": 0, "grad_reduce": "fp32", "fp32_master": False},
            "p2p_blocking": True, "sets": {"lab": {"model": "S"}},
            "models": {"S": {"aceso": "OPT-S", "spec": SMALL.to_dict()}},
            "devices": {"FAST": {"type": "A100"}, "SLOW": {"type": "V100"}}, **extra}


def test_runs_are_written_in_our_formats(bench, sailor):
    data, profiles = _data(), {}
    files = {p.stem: p for p in bench.run_files(sailor, "lab")}
    plan, db = bench.build(sailor, data, files["plan_config_p1"], "lab", profiles)
    (pipe,) = plan.pipelines
    assert (pipe.mbs, pipe.lbs) == (4, 16)                         # mbs 2 per replica x dp 2
    assert [(s.ranks, s.tp, s.dp, s.layers, s.device_type) for s in pipe.stages] == \
        [([0, 1, 2, 3], 2, 2, (0, 2), "A100"), ([4, 5, 6, 7], 2, 2, (2, 4), "A100")]
    assert plan.training.fp32_master is False and plan.cluster.world_size == 8
    assert plan.cluster.inter_node_gbps == pytest.approx(8.0)       # 1e9 bytes/s
    assert plan.cluster.nodes[0].nic_gbps == pytest.approx(16.0)   # what two streams get
    assert plan.cluster.types["A100"].memory_gb == 40
    # a stage of two GPU types: replica d of every stage is pipeline d
    plan, db = bench.build(sailor, data, files["plan_config_p2"], "lab", profiles)
    assert [[(s.ranks, s.device_type, s.dp) for s in p.stages] for p in plan.pipelines] == \
        [[([0, 1], "A100", 1), ([4, 5], "V100", 1)], [([2, 3], "V100", 1), ([6, 7], "A100", 1)]]
    assert [(p.mbs, p.lbs) for p in plan.pipelines] == [(2, 8), (2, 8)]
    assert plan.cluster.inter_type_gbps == pytest.approx(4.0)     # the slowest cross-type stream
    assert set(db.profiles) == {"A100", "V100"}


def test_rows_errors_and_the_fitted_overhead(bench, sailor, tmp_path):
    rows = {r.name.split("/")[-1]: r for r in bench.score(sailor, "lab", _data(), source="aceso")}
    assert "another model's plan" in rows["plan_config_p3"].why and rows["plan_config_p3"].predicted_s is None
    same, mixed = rows["plan_config_p1"], rows["plan_config_p2"]
    assert same.to_dict()["time_err_pct"] == pytest.approx((same.predicted_s - 1.0) * 100)
    assert mixed.predicted_s > same.predicted_s                    # the slow type's replicas set the pace
    assert same.simulated_s == pytest.approx(same.predicted_s, rel=0.05)
    bare = {r.name: r for r in bench.score(sailor, "lab", _data(), overhead=False, source="aceso")}
    assert bench.fit_overhead(list(bare.values())) == pytest.approx(
        sorted([5.0 - bare[n].predicted_mem_gb for n in bare if not bare[n].why])[0] / 2
        + sorted([5.0 - bare[n].predicted_mem_gb for n in bare if not bare[n].why])[1] / 2)
    out = tmp_path / "rows.json"
    (sailor / "bench-data.yaml").write_text(json.dumps(_data()))
    assert bench.main(["--sailor", str(sailor), "--set", "lab", "--json", str(out), "--profiles", "aceso",
                       "--data", str(sailor / "bench-data.yaml")]) == 0
    written = json.loads(out.read_text())
    assert [r["name"] for r in written["rows"]] == sorted(r.name for r in rows.values())
    assert set(written["rows"][0]) >= {"name", "real_s", "predicted_s", "simulated_s", "time_err_pct",
                                       "real_mem_gb", "predicted_mem_gb", "memory_err_pct"}
    assert bench.main(["--sailor", str(tmp_path / "nowhere"), "--set", "lab",
                       "--data", str(sailor / "bench-data.yaml")]) == 2


def test_the_shipped_run_facts_describe_the_two_models(bench):
    data = bench.load_data()
    assert set(data["models"]) == {"OPT-350", "GPT-NEO"} and set(data["sets"]) == {"clariden", "mit"}
    for entry in data["models"].values():
        spec = ModelSpec.from_dict(entry["spec"])
        assert spec.vocab == 50688 and set(entry.get("absent", ())) <= set(ALL_OPS)
