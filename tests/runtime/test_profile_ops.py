"""tools/profile_ops.py + megatron/hpp/profiling/ops.py and profile_file.py on the CPU: the
written profile loads and serves every profiled (mbs, tp); measured sizes against
eth.spec.model.op_shapes; the composed ops reproduce GPTStage; bad input; merging;
collectives on 2 gloo ranks.
No timing thresholds: times are only checked to be positive and finite.

Saved activations (fp32 here, E = 4 bytes; op_shapes uses 2-byte activations, so its
numbers are scaled by 4/2 where they are activation-sized).  Exact agreement:
qkv, attn-dense, mlp-gemm-1, mlp-gemm-2 (the GEMM input), gelu (its input), the dropouts
(nothing when dropout is 0), softmax (its output: the causal mask is a constant added),
score (the whole fused qkv output: q and k are views of it) and context (nothing: its v
is a view of score's storage and its probabilities are softmax's output; each storage is
counted once per micro-batch, in the first op that saves it).  Where the definitions
differ (asserted exactly too):
  layernorms   input (scaled) + mean/rstd, 2 x 4 bytes per token: the stats are fp32,
               so they are not scaled;
  embedding    the int64 token ids (not scaled) + at tp > 1 the bool out-of-shard mask;
  head+loss    GEMM input (scaled) + fp32 softmax of the logits + cross entropy's bool
               target mask and int64 targets (9 bytes per token, not in the formula).
With dropout > 0 on the CPU a dropout mask has the activation dtype (torch's CPU
dropout multiplies by a noise tensor); op_shapes assumes CUDA's 1-byte bool mask.
"""
import json
import math
import sys
from dataclasses import replace

import pytest

from _rt_spawn import REPO, launch
from eth.cli.common import run_main
from eth.spec.model import ACT_BYTES, ALL_OPS, get_model, op_shapes
from eth.profiles.db import ProfileDB, collective_ms, load_profile, save_profile

sys.path.insert(0, str(REPO / "tools"))
import profile_ops  # noqa: E402

TINY = get_model("tiny")
MBS, TPS, E = (1, 2, 4), (1, 2), 4
FAST = ["--repeats", "2", "--warmup", "1", "--no-progress"]


def run(argv):
    return run_main(profile_ops.main, argv)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    path = tmp_path_factory.mktemp("prof") / "sub" / "cpu.json"
    rc = run(["--model", "tiny", "--device-type", "cpu", "--mbs", "1,2,4", "--tp", "1,2",
              "-o", str(path), *FAST])
    assert rc == 0
    return path


def entries(path):
    return {(e["mbs"], e["tp"]): e["ops"] for e in load_profile(path).data["models"][0]["entries"]}


def test_file_loads_and_serves_every_entry(measured, capsys):
    prof = load_profile(measured)
    assert prof.source == "measured" and prof.device == "cpu"
    # one shard on a fake tp group: the cost model must add the tp all-reduces itself
    assert prof.data["tp_comm_included"] is False and not prof.tp_comm_included(TINY)
    prov = prof.data["provenance"]
    for key in ("device_name", "torch", "megatron_core", "dtype", "repeats", "date", "command"):
        assert prov[key], key
    assert prov["dtype"] == "fp32" and prov["repeats"] == 2 and "RESERVED_BYTES" in prov["reserved_bytes"]
    db = ProfileDB.load(measured)
    for mbs in MBS:
        for tp in TPS:
            ops, reserved = db.layer_costs("cpu", TINY, mbs, tp)
            assert set(ops) == set(ALL_OPS) and reserved == 1.0e9
            for op, c in ops.items():
                assert math.isfinite(c.fwd_ms) and c.fwd_ms > 0 and c.bwd_ms > 0, op
    assert sorted(entries(measured)) == sorted((m, t) for m in MBS for t in TPS)


def test_overheads_are_measured_and_their_arithmetic_is_per_round(measured):
    """Every measured entry carries overhead_ms (finite numbers); stage_overheads on
    hand-made rounds gives the per-round differences' medians."""
    from megatron.hpp.profiling.overheads import stage_overheads

    for e in load_profile(measured).data["models"][0]["entries"]:
        oh = e["overhead_ms"]
        assert set(oh) == {"layer", "stage", "wake", "checkpoint", "checkpoint_op", "optimizer", "step"}
        assert oh["step"][0] > 0 and oh["step"][1] > 0
        assert all(math.isfinite(v) for pair in oh.values() for v in pair)
    from eth.spec.model import all_ops, layer_ops

    names = all_ops(TINY)
    # round r: every op fwd 1 ms, bwd 2 ms (chained backward 0.5 x their sum: share 0.5);
    # the 1-layer stage fwd = ops + 3 + r, the 2-layer one adds a layer of ops + 0.5
    n_layer, n_extra = len(layer_ops(TINY)), len(names) - len(layer_ops(TINY))
    rounds = 3
    sums = {"fwd": {o: [1.0] * rounds for o in names}, "bwd": {o: [2.0] * rounds for o in names},
            "chained_bwd": [0.5 * 2.0 * len(names)] * rounds}
    s1 = [(len(names) + 3.0 + r, len(names) + 4.0) for r in range(rounds)]
    s2 = [(f + n_layer + 0.5, b + n_layer + 0.25) for f, b in s1]
    wake = [(f + 1.5, b + 0.5) for f, b in s1]
    # recomputing the whole layer: checkpoint 0.2 / 0.3 + 13 x 0.01 / 0.02, and the backward
    # re-runs the layer's forwards (1 ms each); one op: 0.2 / 0.3 + 0.01 / 0.02 + 1 ms
    rec = [(f + 0.2 + n_layer * 0.01, b + 0.3 + n_layer * (0.02 + 1.0)) for f, b in s1]
    rec1 = [(f + 0.21, b + 0.32 + 1.0) for f, b in s1]
    got = stage_overheads({"stages": {"s1": s1, "s2": s2, "s1-wake": wake, "s1-rec": rec, "s1-rec1": rec1},
                           "op_sums": sums}, TINY, True)
    assert got["checkpoint"] == [pytest.approx(0.2), pytest.approx(0.3)]
    assert got["checkpoint_op"] == [pytest.approx(0.01), pytest.approx(0.02)]
    assert got["layer"] == [0.5, 0.25]
    # stage: s1 - (layer ops + 0.5) - extra ops; fwd median over r of 3 + r - 0.5
    assert got["stage"] == [pytest.approx(3.5), pytest.approx(len(names) + 4.0 - (n_layer + 0.25) - n_extra)]
    assert got["wake"] == [1.5, 0.5]
    assert stage_overheads({"stages": {"s1": s1, "s2": s2}, "op_sums": sums}, TINY, False)["wake"] == [0, 0]


def test_no_overheads_flag_times_the_ops_only(tmp_path, capsys):
    path = tmp_path / "cpu.json"
    assert run(["--model", "tiny", "--device-type", "cpu", "--mbs", "2", "--tp", "1", "--no-overheads",
                "-o", str(path), *FAST]) == 0
    entry = load_profile(path).data["models"][0]["entries"][0]
    assert "overhead_ms" not in entry and set(entry["ops"]) == set(ALL_OPS)
    assert ProfileDB.load(path).overheads("cpu", TINY, 2, 1) == (0.0,) * 14


def test_weight_bytes_equal_the_formula_in_the_dtype(measured):
    for (mbs, tp), ops in entries(measured).items():
        shapes = op_shapes(TINY, mbs, tp)
        for op in ALL_OPS:
            assert ops[op][2] == shapes[op].weight_bytes * E // ACT_BYTES, (op, mbs, tp)


def expected_act(spec, mbs, tp, op):
    """Saved bytes the profiler must measure in fp32 (see the module docstring)."""
    s, b, h, v = spec.seq_len, mbs, spec.hidden, spec.vocab
    formula = op_shapes(spec, mbs, tp)[op].act_bytes
    scaled = formula * E // ACT_BYTES
    qkv_out = b * s * 3 * h // tp * E
    if op in ("qkv", "attn-dense", "mlp-gemm-1", "mlp-gemm-2", "gelu", "attn-dropout",
              "post-attn-dropout", "post-mlp-dropout"):
        return scaled
    if op in ("1st-layernorm", "2nd-layernorm", "final-layernorm"):
        return b * s * h * E + b * s * 8
    if op in ("softmax", "context"):   # context's probabilities are softmax's (dropout 0)
        return scaled
    if op == "score":
        return qkv_out
    if op == "embedding":
        return formula + (b * s if tp > 1 else 0)
    if op == "head+loss":
        return b * s * h * E + b * s * v // tp * 4 + b * s * 9
    raise AssertionError(op)


def test_saved_activation_bytes_against_op_shapes(measured):
    for (mbs, tp), ops in entries(measured).items():
        for op in ALL_OPS:
            assert ops[op][3] == expected_act(TINY, mbs, tp, op), (op, mbs, tp)
    for (mbs, tp), ops in entries(measured).items():
        shapes = op_shapes(TINY, mbs, tp)
        for op in ("qkv", "attn-dense", "mlp-gemm-1", "mlp-gemm-2", "gelu"):  # the formula, exactly
            assert ops[op][3] == shapes[op].act_bytes * E // ACT_BYTES
        # score counts the whole qkv output (q, k and v), context nothing: its v is a view
        # of that storage and its probabilities are softmax's output (attn-dropout is the
        # identity at dropout 0), counted there
        assert ops["score"][3] == shapes["score"].act_bytes * E // ACT_BYTES
        assert ops["context"][3] == shapes["context"].act_bytes == 0


def test_sizes_scale_linearly_with_mbs(measured):
    table = entries(measured)
    for tp in TPS:
        for op in ALL_OPS:
            a1, a2, a4 = (table[(m, tp)][op][3] for m in MBS)
            assert a2 == 2 * a1 and a4 == 4 * a1, (op, tp)
            i1, i4 = table[(1, tp)][op][4], table[(4, tp)][op][4]
            assert i4 == 4 * i1, (op, tp)
            w1, w4 = table[(1, tp)][op][2], table[(4, tp)][op][2]
            assert w1 == w4


def test_dropout_masks_are_measured():
    from megatron.hpp.profiling.ops import ProfileConfig, measure_entries

    spec = replace(TINY, dropout=0.1)
    cfg = ProfileConfig(spec, "cpu", (2,), (2,), "bf16", repeats=1, warmup=0)
    ops = measure_entries(cfg)[0]["ops"]
    shapes = op_shapes(spec, 2, 2)
    # CPU dropout keeps a noise tensor of the activation dtype (2 bytes), CUDA a bool mask.
    assert ops["attn-dropout"][3] == 2 * shapes["attn-dropout"].act_bytes > 0
    assert ops["post-mlp-dropout"][3] == 2 * shapes["post-mlp-dropout"].act_bytes > 0
    assert ops["qkv"][2] == shapes["qkv"].weight_bytes  # bf16 = the formula's 2 bytes
    assert ops["qkv"][3] == shapes["qkv"].act_bytes


def test_composed_ops_reproduce_the_stage():
    import torch

    from megatron.hpp.compat import Backend, setup_rng
    from megatron.hpp.models.gpt import GPTStage
    from megatron.hpp.profiling.ops import build_ops, op_inputs
    from megatron.hpp.profiling.timing import fake_tp_group, initialised_default_group

    cpu = torch.device("cpu")
    with initialised_default_group():
        ops, stage, layer = build_ops(TINY, 1, cpu, torch.float32, 7)
        env = op_inputs(TINY, ops, 2, cpu, 7)
        ref = GPTStage(TINY, (0, 1), True, True, fake_tp_group(1),
                       setup_rng(Backend("gloo", cpu), 7, 7, 0), seed=7)
        ref.layers[0].load_state_dict(layer.state_dict())
        with torch.no_grad():
            loss = ref(env["tokens"], env["labels"], 1.0)
    assert torch.equal(loss, env["loss"])


def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "p.json"
    blocker = tmp_path / "file"
    blocker.write_text("x")
    analytic = tmp_path / "analytic.json"
    from eth.spec.cluster import catalog
    from eth.profiles.db import analytic_profile

    save_profile(analytic_profile(catalog()["cpu"], [TINY], (1,), (1,)), analytic)
    cases = [(["--model", "nope", "-o", str(out)], "unknown model 'nope'"),
             (["--model", "tiny", "--tp", "3", "-o", str(out)], "tp 3 does not divide model.heads 4"),
             (["--model", "tiny", "--mbs", "0,2", "-o", str(out)], "expected positive integers"),
             (["--model", "tiny", "--mbs", "-1", "-o", str(out)], "expected positive integers"),
             (["--model", "tiny", "-o", str(blocker / "p.json")], "cannot be written"),
             (["--model", "tiny", "--collectives", "-o", str(out)], "WORLD_SIZE is 1"),
             (["--collectives-only", "-o", str(out)], "--collectives-only needs torchrun"),
             (["--mbs", "1", "-o", str(out)], "--model is required (unless --collectives-only)"),
             (["--model", "tiny", "-o", str(analytic)], "holds 'analytic' profiles")]
    for argv, message in cases:
        assert run([*argv, "--device-type", "cpu", *FAST]) == 2, argv
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (argv, lines)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["analytic.json", "file"]
    assert load_profile(analytic).source == "analytic"


def test_merge_keeps_other_shapes(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    base = ["--model", "tiny", "--device-type", "cpu", "--tp", "1", "-o", str(out), *FAST]
    assert run([*base, "--seq", "16", "--mbs", "1"]) == 0
    assert run([*base, "--mbs", "1,2"]) == 0
    data = json.loads(out.read_text())
    seqs = {m["shape"]["seq_len"]: [e["mbs"] for e in m["entries"]] for m in data["models"]}
    assert seqs == {16: [1], 32: [1, 2]}
    assert run([*base, "--mbs", "2"]) == 0  # same shape again: replaced, not appended
    data = json.loads(out.read_text())
    seqs = {m["shape"]["seq_len"]: [e["mbs"] for e in m["entries"]] for m in data["models"]}
    assert seqs == {16: [1], 32: [2]} and len(data["models"]) == 2
    db = ProfileDB.load(out)
    db.layer_costs("cpu", replace(TINY, seq_len=16), 1, 1)
    db.layer_costs("cpu", TINY, 2, 1)
    out_text = capsys.readouterr().out
    assert "head+loss" in out_text and "fwd/an" in out_text and f"wrote {out}" in out_text
    assert run(["--model", "tiny", "--device-type", "other", "--tp", "1", "--mbs", "1",
                "-o", str(out), *FAST]) == 2
    assert "holds device 'cpu', not 'other'" in capsys.readouterr().err


@pytest.mark.slow
def test_collectives_on_two_gloo_ranks(tmp_path):
    out = tmp_path / "cpu.json"
    args = ["--model", "tiny", "--device-type", "cpu", "--mbs", "1", "--tp", "1", "--collectives",
            "--collective-sizes", "1024,65536", "-o", str(out), *FAST]
    results = launch(2, args, script=REPO / "tools" / "profile_ops.py")
    for r in results:
        assert r.returncode == 0, r.stderr
    assert "wrote" in results[0].stdout and "wrote" not in results[1].stdout  # rank 0 writes
    prof = load_profile(out)
    colls = prof.data["collectives"]
    assert set(colls) == {"all_reduce", "all_gather", "reduce_scatter", "p2p"}
    for kind, table in colls.items():
        assert list(table) == ["2"]
        assert [row[0] for row in table["2"]] == [1024, 65536] and all(row[1] > 0 for row in table["2"])
    ms = collective_ms("all_reduce", 2, 1024, 1.0, prof)  # the table, not the 1 Gbit/s model
    assert ms == pytest.approx(colls["all_reduce"]["2"][0][1])
    assert prof.data["provenance"]["collectives"]["world_size"] == 2
    # --collectives-only: new tables (same group size: replaced), the op entries untouched
    results = launch(2, ["--device-type", "cpu", "--collectives-only", "--collective-sizes", "64", "-o", str(out),
                         *FAST], script=REPO / "tools" / "profile_ops.py")
    for r in results:
        assert r.returncode == 0, r.stderr
    assert "op entries kept" in results[0].stdout
    again = load_profile(out).data
    assert again["models"] == prof.data["models"]
    assert {kind: [row[0] for row in t["2"]] for kind, t in again["collectives"].items()} == \
        {kind: [64] for kind in colls}
    assert "--collectives-only" in again["provenance"]["collectives"]["command"]


def test_device_type_warning_on_cpu(tmp_path, capsys):
    import torch

    from megatron.hpp.profiling.ops import device_type_warning

    cpu = torch.device("cpu")
    assert device_type_warning("cpu", cpu) is None and device_type_warning("cpu-fast", cpu) is None
    assert "filed as A100" in device_type_warning("A100", cpu)
    if not torch.cuda.is_available():  # refused (nothing written) unless --force: then a warning
        argv = ["--model", "tiny", "--device-type", "A100", "--mbs", "1", "--tp", "1",
                "-o", str(tmp_path / "a.json"), *FAST]
        assert run(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "filed as A100" in err and "--force" in err
        assert not (tmp_path / "a.json").exists()
        assert run(argv + ["--force"]) == 0
        assert "warning: no CUDA device" in capsys.readouterr().err
        assert load_profile(tmp_path / "a.json").device == "A100"


@pytest.mark.slow
def test_real_tp_group_measures_with_the_collectives(measured):
    """--real-tp: tp 2 timed by 2 processes on a real gloo group (one launch: sizes, the
    flag, the cost model's use of it).  Sizes must equal the fake group's exactly (same
    shards); the model entry says tp_comm_included, so the cost model adds no tp
    collectives of its own for it, and does for the fake-group profile."""
    from eth.spec.cluster import Cluster
    from eth.cost.model import CostModel
    from eth.spec.precision import TrainSetup
    from eth.profiles.db import DeviceProfile
    from megatron.hpp.profiling import file as profile_file, ops as profiler

    cfg = profiler.ProfileConfig(TINY, "cpu", (1, 2), (2,), repeats=2, warmup=1, overheads=False, real_tp=True)
    got = profiler.measure_entries(cfg, torch_cpu())
    data = profile_file.profile_dict(cfg, got, {"command": "test"})
    assert data["tp_comm_included"] is False and data["models"][0]["tp_comm_included"] is True
    assert "real gloo group" in profile_file.provenance(cfg, torch_cpu(), "x")["op_modules"]
    fake = entries(measured)
    assert [(e["mbs"], e["tp"]) for e in got] == [(1, 2), (2, 2)]
    for e in got:
        for op, row in e["ops"].items():
            assert row[0] > 0 and row[1] > 0 and all(map(math.isfinite, row[:2])), op
            assert row[2:] == fake[(e["mbs"], 2)][op][2:], op   # weight, act, input, output bytes
    real_prof, fake_prof = DeviceProfile(data), load_profile(measured)
    assert real_prof.tp_comm_included(TINY) and not fake_prof.tp_comm_included(TINY)
    cluster = Cluster.from_dict({"name": "c", "inter_node_gbps": 10, "nodes": [{"type": "cpu", "devices_per_node": 2}]})
    comm = {}
    for name, prof in (("real", real_prof), ("fake", fake_prof)):
        cm = CostModel(TINY, cluster, ProfileDB({"cpu": prof}), TrainSetup("fp32", 0, "fp32"))
        comm[name] = cm.stage_cost("cpu", 2, 1, (0, TINY.num_layers), 2).comm_ms
    assert comm["real"] == 0.0 and comm["fake"] > 0


def torch_cpu():
    import torch

    return torch.device("cpu")
