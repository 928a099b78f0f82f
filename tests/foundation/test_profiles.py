"""Profile DB: round trip, look-up and interpolation rules, analytic generator (Aceso import: test_aceso.py)."""
import json

import pytest

from _foundation_data import TINY, flat_profile
from eth.spec.cluster import catalog
from eth.errors import ProfileError
from eth.spec.model import get_model, op_shapes
from eth.profiles.db import (COLLECTIVE_ALPHA_MS, GEMM_EFFICIENCY, KERNEL_OVERHEAD_MS, MEMORY_EFFICIENCY,
                          DeviceProfile, ProfileDB, analytic_profile, collective_ms,
                          load_profile, save_profile)


def test_round_trip_and_exact_lookup(tmp_path):
    save_profile(flat_profile(), tmp_path / "cpu.json")
    db = ProfileDB.load(tmp_path)
    ops, reserved = db.layer_costs("cpu", TINY, 2, 1)
    assert ops["qkv"].fwd_ms == 2.0 and ops["qkv"].bwd_ms == 4.0 and reserved == 1000.0
    assert ops["qkv"].act_bytes == op_shapes(TINY, 2, 1)["qkv"].act_bytes


def test_interpolation_and_extrapolation_rules():
    prof = DeviceProfile(flat_profile(mbs=(1, 2, 4)))
    assert prof.layer_costs(TINY, 3, 1)[0]["qkv"].fwd_ms == pytest.approx(3.0)      # between 2 and 4
    assert prof.layer_costs(TINY, 8, 1)[0]["gelu"].bwd_ms == pytest.approx(16.0)    # through 2 and 4
    half = prof.layer_costs(TINY, 0.5, 1)[0]["score"]                                # below: proportional
    assert half.fwd_ms == pytest.approx(0.5)
    assert half.act_bytes == pytest.approx(op_shapes(TINY, 1, 1)["score"].act_bytes / 2)
    w = prof.layer_costs(TINY, 3, 1)[0]["qkv"].weight_bytes
    assert w == op_shapes(TINY, 1, 1)["qkv"].weight_bytes                              # weights fixed
    noisy = flat_profile(mbs=(1, 2))
    for e in noisy["models"][0]["entries"]:
        e["reserved_bytes"] = 100.0 * e["mbs"]
        if e["mbs"] == 2:
            e["ops"]["qkv"][0] = 0.9                                                  # slower at mbs 1
    prof2 = DeviceProfile(noisy)
    ops, reserved = prof2.layer_costs(TINY, 4, 1)
    assert ops["qkv"].fwd_ms == 0.9 and reserved == 400.0        # never below the largest row
    assert prof2.layer_costs(TINY, 1.5, 1)[1] == 150.0           # reserved interpolated
    one = DeviceProfile(flat_profile(mbs=(2,)))
    assert one.layer_costs(TINY, 6, 1)[0]["qkv"].fwd_ms == pytest.approx(6.0)


def test_missing_entries_are_clear_errors():
    db = ProfileDB({"cpu": DeviceProfile(flat_profile(tp=(1,)))})
    with pytest.raises(ProfileError, match=r"has no tp 2; profiled tp: \[1\]"):
        db.layer_costs("cpu", TINY, 1, 2)
    with pytest.raises(ProfileError, match="no profile for device type 'A100'; loaded: cpu"):
        db.layer_costs("A100", TINY, 1, 1)
    with pytest.raises(ProfileError, match="has no entry for model gpt3-13b"):
        db.layer_costs("cpu", get_model("gpt3-13b"), 1, 1)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("device"), r"\.device is missing"),
    (lambda d: d.update(version=9), "version is 9"),
    (lambda d: d["models"][0]["entries"][0]["ops"].pop("qkv"), r"ops\['qkv'\] must be a list of 6"),
    (lambda d: d["models"][0]["entries"][0]["ops"]["gelu"].__setitem__(0, -1.0), "negative"),
    (lambda d: d["models"][0]["entries"][0].update(mbs=0), "mbs and tp must be positive"),
    (lambda d: d["models"][0]["shape"].pop("vocab"), r"shape must give"),
    (lambda d: d["models"][0]["shape"].update(hidden="64"), r"shape must hold numbers"),
    (lambda d: d["models"][0]["entries"][0]["ops"]["qkv"].__setitem__(1, float("nan")), "negative or non-numeric"),
    (lambda d: d["models"][0]["entries"][0].update(reserved_bytes=-5e9), "reserved_bytes must be a number >= 0"),
    (lambda d: d["models"][0]["entries"][0].update(reserved_bytes="big"), "reserved_bytes must be a number >= 0"),
    (lambda d: d["models"][0]["entries"][0].update(ops=[]), r"entries\[0\] must be an object with an ops object"),
    (lambda d: d.update(provenance={"dtype_bytes": "two"}), "dtype_bytes must be a positive number, got 'two'"),
    (lambda d: d.update(collectives={"all_reduce": {"4": [[0, 1.0]]}}), r"collectives.all_reduce\['4'\] must map"),
    (lambda d: d.update(collectives={"broadcast": {}}), "collectives.broadcast: kind must be one of"),
])
def test_validation_names_the_field(mutate, message, tmp_path):
    data = flat_profile()
    mutate(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=message):
        load_profile(path)
    with pytest.raises(ProfileError, match=message):
        save_profile(data, tmp_path / "q.json")
    assert not (tmp_path / "q.json").exists()


def test_analytic_roofline_numbers():
    b2 = catalog()["910B2"]      # a type without a fitted GEMM curve (eth/data/gemm_efficiency.yaml)
    data = analytic_profile(b2, [TINY], mbs=(1,), tp=(1,))
    assert data["source"] == "analytic" and data["provenance"]["gemm_efficiency"] == GEMM_EFFICIENCY
    prof = DeviceProfile(data)
    ops, _ = prof.layer_costs(TINY, 1, 1)
    shapes = op_shapes(TINY, 1, 1)
    gemm = shapes["qkv"].flops_fwd / (376e12 * GEMM_EFFICIENCY) * 1e3 + KERNEL_OVERHEAD_MS
    mem = shapes["softmax"].traffic_bytes / (1600e9 * MEMORY_EFFICIENCY) * 1e3 + KERNEL_OVERHEAD_MS
    assert ops["qkv"].fwd_ms == pytest.approx(gemm)
    assert ops["softmax"].fwd_ms == pytest.approx(mem)
    assert ops["softmax"].bwd_ms == pytest.approx(2 * (mem - KERNEL_OVERHEAD_MS) + KERNEL_OVERHEAD_MS)


def test_make_profiles_gemm_efficiency_fitted_opts_into_the_unapplied_curves(tmp_path, capsys):
    from eth.cli.make_profiles import main
    from eth.profiles.gemm_efficiency import GemmEfficiency, efficiency_for, gemm_dims

    a100, tiny = catalog()["A100"], get_model("tiny")
    fitted = efficiency_for("A100", include_unapplied=True)
    assert fitted.d0 > 0                                  # A100 has a fitted entry (eth/data/gemm_efficiency.yaml)
    for mode in ("applied", "fitted"):
        assert main(["--devices", "A100", "--models", "tiny", "--mbs", "2", "--tp", "1",
                     "--gemm-efficiency", mode, "-o", str(tmp_path / mode)]) == 0
    capsys.readouterr()
    default = json.loads((tmp_path / "applied/A100.json").read_text())
    opted = json.loads((tmp_path / "fitted/A100.json").read_text())
    flops = op_shapes(tiny, 2, 1)["qkv"].flops_fwd
    qkv = opted["models"][0]["entries"][0]["ops"]["qkv"][0]
    assert qkv == pytest.approx(fitted.ms(gemm_dims(tiny, 2, 1)["qkv"], flops, a100.tflops), abs=1e-6)
    record = opted["provenance"]["gemm_efficiency"]
    assert (record["peak_eff"], record["d0"], record["overhead_ms"]) == (fitted.peak_eff, fitted.d0, fitted.overhead_ms)
    assert record.get("applied", True) == (efficiency_for("A100") == fitted)
    # the default: the applied curve only (the constant 60 % while the GPU entry says applied: false)
    if efficiency_for("A100") == GemmEfficiency():
        assert default["provenance"]["gemm_efficiency"] == GEMM_EFFICIENCY
        assert default["models"][0]["entries"][0]["ops"]["qkv"][0] == pytest.approx(
            flops / (a100.tflops * 1e9 * GEMM_EFFICIENCY) + KERNEL_OVERHEAD_MS, abs=1e-6)
    else:
        assert default == opted
    assert main(["--import-aceso", str(tmp_path), "--device", "A100", "--model", "tiny",
                 "--gemm-efficiency", "fitted", "-o", str(tmp_path / "x.json")]) == 2
    assert "--gemm-efficiency applies to analytic profiles" in capsys.readouterr().err


def test_shipped_profiles_cover_every_catalog_device_and_preset():
    from pathlib import Path
    db = ProfileDB.load(Path(__file__).resolve().parents[2] / "profiles")
    assert set(db.profiles) == set(catalog())
    for name, prof in db.profiles.items():
        assert prof.source == "analytic"
        assert prof.tps(get_model("gpt3-13b")) == [1, 2, 4, 8]
    # the faster device is faster on the same op
    h100 = db.layer_costs("H100", get_model("gpt3-13b"), 4, 2)[0]["qkv"].fwd_ms
    v100 = db.layer_costs("V100", get_model("gpt3-13b"), 4, 2)[0]["qkv"].fwd_ms
    assert v100 > 5 * h100


def test_ensure_adds_missing_models_only():
    db = ProfileDB({"cpu": DeviceProfile(flat_profile())})
    small = get_model("small")
    assert db.ensure(small, [catalog()["cpu"], catalog()["A100"]]) == ["cpu", "A100"]
    assert db.layer_costs("cpu", TINY, 1, 1)[0]["qkv"].fwd_ms == 1.0      # old model kept
    assert db.layer_costs("cpu", small, 1, 1)[0]["qkv"].fwd_ms > 0
    assert db.ensure(small, [catalog()["cpu"]]) == []


def test_collective_alpha_beta():
    # 8 Gbit/s = 1e6 bytes per ms
    assert collective_ms("all_reduce", 4, 1e6, 8) == pytest.approx(2 * 3 / 4 + 6 * COLLECTIVE_ALPHA_MS)
    assert collective_ms("all_gather", 4, 1e6, 8) == pytest.approx(3 / 4 + 3 * COLLECTIVE_ALPHA_MS)
    assert collective_ms("p2p", 2, 2e6, 8) == pytest.approx(2 + COLLECTIVE_ALPHA_MS)
    assert collective_ms("all_reduce", 1, 1e6, 8) == 0.0
    data = flat_profile()
    data["collectives"] = {"all_reduce": {"4": [[1000, 1.0], [3000, 2.0]]}}
    prof = DeviceProfile(data)
    assert collective_ms("all_reduce", 4, 2000, 8, prof) == pytest.approx(1.5)
    assert collective_ms("all_reduce", 4, 5000, 8, prof) == pytest.approx(3.0)
    assert collective_ms("all_reduce", 2, 1e6, 8, prof) == pytest.approx(1 + 2 * COLLECTIVE_ALPHA_MS)


def test_emulated_cpu_types_scale_the_cpu_profile():
    from dataclasses import replace

    base = flat_profile()
    base["provenance"] = {"dtype_bytes": 4}
    db = ProfileDB({"cpu": DeviceProfile(base)})
    cpu = catalog()["cpu"]
    slow, plain = replace(cpu, name="cpu-slow", emulate_speed=0.25), replace(cpu, name="cpu-2")
    # the emulated type is derived from the cpu profile (not analytic); the plain one is analytic
    assert db.ensure(TINY, [slow, plain]) == ["cpu-2"]
    derived, orig = db.layer_costs("cpu-slow", TINY, 2, 2)[0], db.layer_costs("cpu", TINY, 2, 2)[0]
    for op in orig:
        assert derived[op].fwd_ms == pytest.approx(orig[op].fwd_ms / 0.25)
        assert derived[op].bwd_ms == pytest.approx(orig[op].bwd_ms / 0.25)
        assert derived[op].act_bytes == orig[op].act_bytes and derived[op].weight_bytes == orig[op].weight_bytes
    prof = db.get("cpu-slow")
    assert prof.source == "test" and prof.dtype_bytes == 4 and "0.25" in prof.data["provenance"]["derived_from"]
    # a model the cpu profile lacks: the emulated type falls back to analytic entries
    assert db.ensure(get_model("small"), [replace(cpu, name="cpu-b", emulate_speed=0.5)]) == ["cpu-b"]


def _with_overheads(mbs=(1, 2)):
    """flat_profile with overhead_ms: layer [0.1, 0.2] x mbs, stage [1, 2], wake [0.5, 0.25],
    checkpoint [0.03, 0.07], checkpoint_op [0.001, 0.002], optimizer [0.5, 1.5], step [0.7, 0.05]."""
    data = flat_profile(mbs=mbs)
    for e in data["models"][0]["entries"]:
        m = e["mbs"]
        e["overhead_ms"] = {"layer": [0.1 * m, 0.2 * m], "stage": [1.0, 2.0], "wake": [0.5, 0.25],
                            "checkpoint": [0.03, 0.07], "checkpoint_op": [0.001, 0.002],
                            "optimizer": [0.5, 1.5], "step": [0.7, 0.05]}
    return data


def test_overheads_field_defaults_to_zero_and_interpolates():
    assert DeviceProfile(flat_profile()).overheads(TINY, 2, 1) == (0.0,) * 14   # old profiles: none
    prof = DeviceProfile(_with_overheads(mbs=(1, 2, 4)))
    rest = (0.5, 0.25, 0.03, 0.07, 0.001, 0.002, 0.5, 1.5, 0.7, 0.05)
    assert prof.overheads(TINY, 2, 1) == (0.2, 0.4, 1.0, 2.0) + rest
    assert prof.overheads(TINY, 3, 2) == pytest.approx((0.3, 0.6, 1.0, 2.0) + rest)  # between 2 and 4
    assert prof.overheads(TINY, 8, 1) == prof.overheads(TINY, 4, 1)      # outside: the nearest size
    assert prof.overheads(TINY, 0.5, 1) == prof.overheads(TINY, 1, 1)


@pytest.mark.parametrize("value, message", [
    ([1, 2], "overhead_ms must be an object"),
    ({"layer": [1, 2], "other": [0, 0]}, "overhead_ms must be an object"),
    ({"layer": [1]}, "overhead_ms.layer must be [fwd_ms, bwd_ms]"),
    ({"stage": [1, "x"]}, "overhead_ms.stage must be [fwd_ms, bwd_ms]"),
])
def test_bad_overheads_name_the_field(value, message):
    data = flat_profile()
    data["models"][0]["entries"][1]["overhead_ms"] = value
    with pytest.raises(ProfileError, match=r"models\[0\]\.entries\[1\]\." + message.replace("[", r"\["
                                                                                          ).replace("]", r"\]")):
        DeviceProfile(data)


def test_cost_model_adds_overheads_per_layer_and_stage_and_emulation_wakes():
    from dataclasses import replace

    from eth.spec.cluster import Cluster
    from eth.cost.model import CostModel

    cpu = catalog()["cpu"]
    cluster = Cluster.from_dict({"name": "t", "inter_node_gbps": 10, "device_types": {"cpu-e": {"base": "cpu", "emulate_speed": 0.5}},
                                 "nodes": [{"type": "cpu", "devices_per_node": 1},
                                           {"type": "cpu-e", "devices_per_node": 1}]})
    plain = CostModel(TINY, cluster, ProfileDB({"cpu": DeviceProfile(flat_profile())}))
    timed = CostModel(TINY, cluster, ProfileDB({"cpu": DeviceProfile(_with_overheads())}))
    for cm in (plain, timed):
        cm.profiles.ensure(TINY, [replace(cpu, name="cpu-e", emulate_speed=0.5)])
    for first, last in ((True, True), (False, False)):
        a = plain.stage_cost_at("cpu", 1, 1, 3, first, last, 2, {}, 1, (10.0, 10.0, 10.0))
        b = timed.stage_cost_at("cpu", 1, 1, 3, first, last, 2, {}, 1, (10.0, 10.0, 10.0))
        assert b.fwd_ms - a.fwd_ms == pytest.approx(3 * 0.2 + 1.0)    # 3 layers + one stage call
        assert b.bwd_ms - a.bwd_ms == pytest.approx(3 * 0.4 + 2.0)
        # the emulated type: everything / speed, and the wake-up after each sleep per call
        a = plain.stage_cost_at("cpu-e", 1, 1, 3, first, last, 2, {}, 1, (10.0, 10.0, 10.0))
        b = timed.stage_cost_at("cpu-e", 1, 1, 3, first, last, 2, {}, 1, (10.0, 10.0, 10.0))
        assert b.fwd_ms - a.fwd_ms == pytest.approx((3 * 0.2 + 1.0 + 0.5) / 0.5)
        assert b.bwd_ms - a.bwd_ms == pytest.approx((3 * 0.4 + 2.0 + 0.25) / 0.5)
    # recompute: softmax + attn-dropout + context (one run of 3) in 2 layers, gelu in 3 (runs of 1):
    # 5 checkpoints holding 9 ops
    rec = {"softmax": 2, "attn-dropout": 2, "context": 2, "gelu": 3}
    a = plain.stage_cost_at("cpu", 1, 1, 3, False, False, 2, rec, 1, (10.0, 10.0, 10.0))
    b = timed.stage_cost_at("cpu", 1, 1, 3, False, False, 2, rec, 1, (10.0, 10.0, 10.0))
    assert b.fwd_ms - a.fwd_ms == pytest.approx(3 * 0.2 + 1.0 + 5 * 0.03 + 9 * 0.001)
    assert b.bwd_ms - a.bwd_ms == pytest.approx(3 * 0.4 + 2.0 + 5 * 0.07 + 9 * 0.002)


def test_optimizer_step_is_added_per_stage_and_not_stretched_by_emulation():
    from dataclasses import replace

    from eth.spec.cluster import Cluster
    from eth.cost.model import CostModel
    from eth.spec.plan import StagePlan
    from eth.spec.precision import TrainSetup

    cpu = catalog()["cpu"]
    cluster = Cluster.from_dict({"name": "t", "inter_node_gbps": 10,
                                 "device_types": {"cpu-e": {"base": "cpu", "emulate_speed": 0.5}},
                                 "nodes": [{"type": "cpu", "devices_per_node": 2},
                                           {"type": "cpu-e", "devices_per_node": 1}]})
    db = ProfileDB({"cpu": DeviceProfile(_with_overheads())})
    db.ensure(TINY, [replace(cpu, name="cpu-e", emulate_speed=0.5)])
    three = StagePlan([0], "cpu", 1, 1, (0, 3), {})
    assert CostModel(TINY, cluster, db).optimizer_ms(2, three) == pytest.approx(3 * 0.5 + 1.5)
    assert CostModel(TINY, cluster, db).optimizer_ms(2, replace(three, device_type="cpu-e")) == \
        pytest.approx(3 * 0.5 + 1.5)                                    # the runtime steps at host speed
    zero1 = CostModel(TINY, cluster, db, TrainSetup("fp32", 1, "fp32"))
    assert zero1.optimizer_ms(2, StagePlan([0, 1], "cpu", 1, 2, (0, 3), {})) == pytest.approx((3 * 0.5 + 1.5) / 2)
    assert CostModel(TINY, cluster, ProfileDB({"cpu": DeviceProfile(flat_profile())})).optimizer_ms(2, three) == 0


def _step_plan():
    """(cpu type, cluster, fp32 setup, plan) of the step-overhead tests: a dp 2 cpu stage
    (ranks 0-1) then an emulated cpu-e stage at speed 0.5 (rank 2), gbs 8, mbs 2."""
    from eth.spec.cluster import Cluster
    from eth.spec.plan import PipelinePlan, Plan, StagePlan
    from eth.spec.precision import TrainSetup

    cluster = Cluster.from_dict({"name": "t", "inter_node_gbps": 10,
                                 "device_types": {"cpu-e": {"base": "cpu", "emulate_speed": 0.5}},
                                 "nodes": [{"type": "cpu", "devices_per_node": 2},
                                           {"type": "cpu-e", "devices_per_node": 1}]})
    setup = TrainSetup("fp32", 0, "fp32")
    plan = Plan(model=TINY, cluster=cluster, gbs=8, training=setup, pipelines=[
        PipelinePlan(2, 8, [StagePlan([0, 1], "cpu", 1, 2, (0, 2), {}), StagePlan([2], "cpu-e", 1, 1, (2, 4), {})])])
    return catalog()["cpu"], cluster, setup, plan


def test_step_overhead_is_added_once_per_stage_end_and_not_stretched_by_emulation():
    """overhead_ms "step" [per iteration, per sample]: Eq. 5 adds it once to every stage's
    end time (with the optimizer step), per sample of the rank's Lbs / dp share; an
    emulated type pays it at host speed; without the field nothing changes."""
    from dataclasses import replace

    from eth.cost.equations import eq5_end_times
    from eth.cost.model import CostModel

    cpu, cluster, setup, plan = _step_plan()
    for data, step in ((_with_overheads(), (0.7, 0.05)), (flat_profile(mbs=(1, 2)), (0.0, 0.0))):
        db = ProfileDB({"cpu": DeviceProfile(data)})
        db.ensure(TINY, [replace(cpu, name="cpu-e", emulate_speed=0.5)])
        cm = CostModel(TINY, cluster, db, setup, objective="eq5")
        pipe = plan.pipelines[0]
        assert [cm.step_ms(pipe, s) for s in pipe.stages] == pytest.approx(
            [step[0] + 8 / 2 * step[1], step[0] + 8 * step[1]])
        ev = cm.evaluate(plan)
        costs = cm.pipeline_costs(pipe)
        ends = eq5_end_times(costs, pipe.lbs, pipe.mbs, ev["pipelines"][0]["ar_ms"])
        want = [e + cm.optimizer_ms(2, s, c.params) + cm.step_ms(pipe, s) for e, s, c in zip(ends, pipe.stages, costs)]
        assert ev["pipelines"][0]["end_ms"] == pytest.approx(want)
        assert ev["iteration_ms"] == pytest.approx(max(want))
    # only there: the stage costs (fwd, bwd, Eq. 1) are those of the same profile without it
    no_step = _with_overheads()
    for e in no_step["models"][0]["entries"]:
        del e["overhead_ms"]["step"]
    got = {}
    for name, data in (("with", _with_overheads()), ("without", no_step)):
        db = ProfileDB({"cpu": DeviceProfile(data)})
        db.ensure(TINY, [replace(cpu, name="cpu-e", emulate_speed=0.5)])
        cm = CostModel(TINY, cluster, db, setup)
        got[name] = ([(c.fwd_ms, c.bwd_ms) for c in cm.pipeline_costs(plan.pipelines[0])],
                     cm.evaluate(plan)["pipelines"][0]["end_ms"])
    assert got["with"][0] == got["without"][0]
    assert [a - b for a, b in zip(got["with"][1], got["without"][1])] == pytest.approx(
        [0.7 + 8 / 2 * 0.05, 0.7 + 8 * 0.05])


def test_step_allreduces_pay_the_measured_latency_over_the_plans_world():
    """With a measured all-reduce table at the plan's world size, each stage's rest of
    the step adds STEP_ALLREDUCES x the table's small-message time (an emulated type at
    host speed too); a table for another size, or none, adds nothing."""
    from dataclasses import replace

    from eth.cost.equations import STEP_ALLREDUCES
    from eth.cost.model import CostModel

    cpu, cluster, setup, plan = _step_plan()
    ends = {}
    for name, tables in (("none", None), ("world 3", {"3": [[4096, 9.0], [64, 2.5]]}),
                         ("world 2 only", {"2": [[64, 1.0]]})):
        data = _with_overheads()
        if tables:
            data["collectives"] = {"all_reduce": tables}
        db = ProfileDB({"cpu": DeviceProfile(data)})
        db.ensure(TINY, [replace(cpu, name="cpu-e", emulate_speed=0.5)])
        cm = CostModel(TINY, cluster, db, setup)
        ends[name] = cm.evaluate(plan)["pipelines"][0]["end_ms"]
        if name == "world 3":
            stage = plan.pipelines[0].stages[1]
            assert cm.step_ms(plan.pipelines[0], stage, 3) - cm.step_ms(plan.pipelines[0], stage) == \
                pytest.approx(STEP_ALLREDUCES * 2.5)       # the smallest message's time, not 4096 B's
    assert STEP_ALLREDUCES == 3
    assert [a - b for a, b in zip(ends["world 3"], ends["none"])] == pytest.approx([7.5, 7.5])
    assert ends["world 2 only"] == pytest.approx(ends["none"])
