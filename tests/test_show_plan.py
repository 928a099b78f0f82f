"""tools/show_plan.py and the text/PNG views behind it (eth/report/tables.py, eth/report/gantt.py)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from eth.cli.common import run_main
from eth.spec.cluster import Cluster
from eth.cost.model import CostModel
from eth.spec.model import get_model
from eth.spec.plan import PipelinePlan, Plan, StagePlan, load_plan
from eth.profiles.db import ProfileDB, analytic_profile, save_profile
from eth.report.tables import format_plan_table, format_ranks, format_recompute, format_sim_summary
from eth.report.simulate import simulate

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "show_plan.py"


@pytest.fixture(scope="module")
def show_plan():
    spec = importlib.util.spec_from_file_location("show_plan_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_plan() -> Plan:
    cluster = Cluster.from_dict({"name": "a100-3090-4", "inter_node_gbps": 200, "inter_type_gbps": 100,
                                 "nodes": [{"type": "A100", "devices_per_node": 2},
                                           {"type": "RTX3090", "devices_per_node": 2}]})
    model = get_model("tiny")
    p0 = PipelinePlan(4, 24, [StagePlan([0], "A100", 1, 1, (0, 1)),
                              StagePlan([1], "A100", 1, 1, (1, 4), {"softmax": 3, "attn-dropout": 2, "qkv": 1})])
    p1 = PipelinePlan(2, 8, [StagePlan([2, 3], "RTX3090", 1, 2, (0, 4))])
    return Plan(model, cluster, 32, [p0, p1]).validate()


def test_format_helpers():
    assert format_ranks([0, 1, 2, 3, 6, 8, 9]) == "0-3,6,8-9"
    assert format_ranks([5]) == "5"
    assert format_recompute({"attn-dropout": 4, "softmax": 4, "qkv": 0}) == "4 AS, 4 AD"
    assert format_recompute({}) == "None"


def test_plan_table_rows_without_and_with_predictions():
    plan = make_plan()
    text = format_plan_table(plan)
    lines = text.splitlines()
    assert "Pipe-0  Mbs=4  Lbs=24  (6 micro-batches)" in lines
    assert "Pipe-1  Mbs=2  Lbs=8  (4 micro-batches)" in lines
    row = next(line.split() for line in lines if "A100x1" in line and "1-3" in line)
    # stage, ranks, device, TP/DP, #L, layers, recompute (3 words with commas), fwd, bwd, mem
    assert row[:6] == ["1", "1", "A100x1", "1/1", "3", "1-3"]
    assert " ".join(row[6:12]) == "1 Qkv, 3 AS, 2 AD" and row[12:] == ["-", "-", "-"]
    assert any(line.split()[:5] == ["0", "2-3", "RTX3090x2", "1/2", "4"] for line in lines)

    db = ProfileDB()
    db.ensure(plan.model, plan.cluster.types.values())
    CostModel(plan.model, plan.cluster, db).annotate(plan)
    text = format_plan_table(plan)
    pred = plan.pipelines[1].stages[0].predicted
    row = next(line.split() for line in text.splitlines() if "RTX3090x2" in line)
    assert row[-3:] == [f"{pred['fwd_ms']:.2f}", f"{pred['bwd_ms']:.2f}", f"{pred['memory_gb']:.2f}"]
    assert f"{plan.predicted['iteration_ms']:.2f} ms" in text


def test_sim_summary_lists_every_stage():
    plan = make_plan()
    result = simulate(plan)
    text = format_sim_summary(plan, result)
    assert f"{result.iteration_ms:.2f} ms" in text.splitlines()[0]
    rows = [line.split() for line in text.splitlines()[2:-1]]
    assert [(r[0], r[1], r[2]) for r in rows] == [("0", "0", "0"), ("0", "1", "1"), ("1", "0", "2-3")]
    s = result.stages[1][0]
    assert rows[2][4] == f"{s.compute_ms:.2f}" and rows[2][8] == f"{s.idle_ms:.2f}"


def test_show_plan_prints_table_and_writes_png(show_plan, tmp_path, capsys):
    plan = make_plan()
    plan.save(tmp_path / "plan.json")
    for device in plan.cluster.types.values():
        save_profile(analytic_profile(device, [plan.model]), tmp_path / "prof" / f"{device.name}.json")
    out = tmp_path / "gantt" / "plan.png"
    rc = run_main(show_plan.main, [str(tmp_path / "plan.json"), "--png", str(out),
                                   "--profiles", str(tmp_path / "prof")])
    text = capsys.readouterr().out
    assert rc == 0
    assert "Pipe-0  Mbs=4  Lbs=24" in text and "RTX3090x2" in text and "3 AS" in text
    assert "analytic roofline profiles generated" not in text
    expect = simulate(plan, profiles=ProfileDB.load(tmp_path / "prof"))
    assert f"{expect.iteration_ms:.2f} ms" in text
    assert "computed now by the cost model" in text        # the saved plan had no predictions
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_show_plan_bad_input_exits_2(show_plan, tmp_path, capsys):
    assert run_main(show_plan.main, [str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = make_plan().to_dict()
    bad["pipelines"][0]["lbs"] = 23                         # not a multiple of mbs 4
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    assert run_main(show_plan.main, [str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "lbs 23" in err and "\n" not in err


def test_show_plan_script_on_a_broken_file(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('{"version": 1, "pipelines": [')
    proc = subprocess.run([sys.executable, str(TOOL), str(broken)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == "" and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("error: ") and "not valid JSON" in proc.stderr
    image = tmp_path / "plan.png"                    # a picture given as the plan
    image.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    proc = subprocess.run([sys.executable, str(TOOL), str(image)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr == f"error: plan file {image} is not text (byte 0 is 0x89: " \
                                                   "an image or a binary file?)\n"


def test_show_plan_into_a_reader_that_stops_reading(tmp_path):
    """``show_plan PLAN | head -1``: the first line, no BrokenPipeError, exit 0."""
    plan = tmp_path / "p.json"
    make_plan().save(plan)
    proc = subprocess.run(f"{sys.executable} {TOOL} {plan} | head -c 10; exit ${{PIPESTATUS[0]}}", shell=True,
                          executable="/bin/bash", capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "Plan: mode" and proc.stderr == "", proc.stderr[-2000:]


def _scaled_profile(device, model, factor):
    """An analytic profile whose op times are ``factor`` x the roofline, marked measured."""
    data = analytic_profile(device, [model])
    data["source"] = "measured"
    for m in data["models"]:
        m.pop("source", None)
        for e in m["entries"]:
            e["ops"] = {op: [v[0] * factor, v[1] * factor, *v[2:]] for op, v in e["ops"].items()}
    return data


def test_show_plan_uses_the_profiles_the_plan_names(show_plan, tmp_path, capsys):
    plan = make_plan()
    for device in plan.cluster.types.values():
        save_profile(_scaled_profile(device, plan.model, 3.0), tmp_path / "prof" / f"{device.name}.json")
    plan.search["profiles"] = {"A100": "measured", "RTX3090": "measured"}
    plan.search["profiles_path"] = str(tmp_path / "prof")
    measured = ProfileDB.load(tmp_path / "prof")
    CostModel(plan.model, plan.cluster, measured).annotate(plan)
    plan.save(tmp_path / "plan.json")
    expect = simulate(plan, profiles=measured).iteration_ms
    assert expect > 1.5 * simulate(plan, profiles=ProfileDB.load(ROOT / "profiles")).iteration_ms

    assert run_main(show_plan.main, [str(tmp_path / "plan.json")]) == 0
    text = capsys.readouterr().out
    assert f"(profiles: {tmp_path / 'prof'}, the ones the plan was searched with)" in text
    assert f"{expect:.2f} ms" in text and "note: the plan was searched with" not in text

    # the recorded folder is gone: one line naming it, exit 2 (no silent switch to other profiles)
    (tmp_path / "prof" / "A100.json").rename(tmp_path / "A100.json")
    (tmp_path / "prof" / "RTX3090.json").unlink()
    (tmp_path / "prof").rmdir()
    assert run_main(show_plan.main, [str(tmp_path / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert f"profiles {tmp_path / 'prof'} (plan.search), which do not exist here: pass --profiles" in err
    # other kinds of profiles given: scored with them, and one line says so
    assert run_main(show_plan.main, [str(tmp_path / "plan.json"), "--profiles", str(ROOT / "profiles")]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    analytic_ms = simulate(plan, profiles=ProfileDB.load(ROOT / "profiles")).iteration_ms
    change = 100 * (analytic_ms / plan.predicted["iteration_ms"] - 1)
    assert len(lines) == 1 and lines[0].startswith(
        f"note: the plan was searched with A100: measured, RTX3090: measured from {tmp_path / 'prof'}, "
        f"not found; scored here with A100: analytic, RTX3090: analytic ({ROOT / 'profiles'}")
    assert lines[0].endswith(f"vs the plan's predicted {plan.predicted['iteration_ms']:.2f} ms ({change:+.1f}%)")
    assert change < -20

    # --profiles with the same kinds: no note
    save_profile(_scaled_profile(plan.cluster.types["RTX3090"], plan.model, 3.0), tmp_path / "RTX3090.json")
    (tmp_path / "p2").mkdir()
    for name in ("A100.json", "RTX3090.json"):
        (tmp_path / name).rename(tmp_path / "p2" / name)
    assert run_main(show_plan.main, [str(tmp_path / "plan.json"), "--profiles", str(tmp_path / "p2")]) == 0
    assert "note:" not in capsys.readouterr().out


def test_search_records_the_profiles_path(tmp_path, capsys):
    from eth.cli.search_hpp import main as search_cli
    from eth.spec.plan import load_plan
    prof = tmp_path / "prof"
    save_profile(_scaled_profile(Cluster.from_dict({"inter_node_gbps": 1, "nodes": [
        {"type": "cpu", "devices_per_node": 1}]}).types["cpu"], get_model("tiny"), 2.0), prof / "cpu.json")
    out = tmp_path / "plan.json"
    assert search_cli(["--model", "tiny", "--cluster", str(ROOT / "examples/clusters/cpu-demo.yaml"),
                       "--gbs", "16", "--profiles", str(prof), "--no-progress", "-o", str(out)]) == 0
    search = load_plan(out).search
    assert search["profiles_path"] == str(prof.resolve()) and "profiles_checkout_path" not in search
    # inside the checkout: the relative path only (no path of this machine in the plan)
    assert search_cli(["--model", "tiny", "--cluster", str(ROOT / "examples/clusters/cpu-demo.yaml"), "--gbs", "16",
                       "--profiles", str(ROOT / "profiles/measured/cpu.json"), "--precision", "fp32", "--no-progress",
                       "-o", str(out)]) == 0
    search = load_plan(out).search
    assert search["profiles_checkout_path"] == "profiles/measured/cpu.json" and "profiles_path" not in search


def test_a_plan_made_in_another_clone_finds_its_profiles_here(tmp_path, capsys):
    """Profiles inside the checkout are recorded relative to it (profiles_checkout_path),
    which resolves in this clone even where an absolute profiles_path does not."""
    from eth.cli import show_plan as cli

    plan = load_plan(ROOT / "examples/plans/cpu-demo.json")
    assert plan.search["profiles_checkout_path"] == "profiles/measured/cpu.json"
    plan.search["profiles_path"] = str(tmp_path / "elsewhere" / "profiles" / "measured" / "cpu.json")
    plan.save(tmp_path / "plan.json")
    assert run_main(cli.main, [str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert f"(profiles: {ROOT / 'profiles/measured/cpu.json'}, the ones the plan was searched with)" in out
    assert "note:" not in out
    del plan.search["profiles_checkout_path"]
    plan.save(tmp_path / "plan.json")
    assert run_main(cli.main, [str(tmp_path / "plan.json")]) == 2
    assert "which do not exist here: pass --profiles PATH" in capsys.readouterr().err
