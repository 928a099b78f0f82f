"""Aceso profile import (eth/profiles/aceso.py) on small CSVs written in Aceso's own format."""
from dataclasses import replace

import pytest

from eth.profiles.aceso import import_aceso, read_op_csv
from eth.cli.make_profiles import main as make_profiles
from eth.spec.cluster import Cluster
from eth.cost.model import CostModel
from eth.errors import ProfileError
from eth.spec.model import ALL_OPS, get_model, layer_ops, op_shapes
from eth.profiles.db import DeviceProfile, ProfileDB, analytic_profile, load_profile

from _foundation_data import ACESO_NAMES as NAMES

MB = 2 ** 20
GPT13 = get_model("gpt3-1.3b")
HEADER = "op_name,forward-compute,backward-compute,input_size,output_size,weights,activations,fwd_reserved,bwd_reserved\n"


def write_ops(folder, prefix="gpt_1_3B", mbs=1, tp=1, model=GPT13, us=1500.0, overrides=None, weights=None):
    """One Aceso op CSV: times in us, sizes in MB with 3 decimals (as Aceso writes them).
    Sizes follow ``model``'s shapes; ``overrides`` = {op: (input, output, activations) MB},
    ``weights`` = {op: MB}."""
    shapes = op_shapes(model, mbs, tp)
    rows = []
    for op in ALL_OPS:
        s = shapes[op]
        inp, out, act = (overrides or {}).get(op, (s.input_bytes / MB, s.output_bytes / MB, s.output_bytes / MB))
        w = (weights or {}).get(op, s.weight_bytes / MB)
        rows.append(f"{NAMES[op]},{us:.3f},{2 * us:.3f},{inp:.3f},{out:.3f},{w:.3f},"
                    f"{act:.3f},5.000,6.000")
    (folder / f"{prefix}_mbs{mbs}_tp{tp}_algo0.csv").write_text(HEADER + "\n".join(rows) + "\n")


def write_prim(folder, name, rows):
    (folder / name).write_text("data_size(MB),time(ms)\n" + "".join(f"{a},{b}\n" for a, b in rows))


def test_times_are_microseconds_and_bytes_come_from_shapes(tmp_path):
    """Times are Aceso's microseconds; every byte field is the tensor-level model's (the
    CSVs' columns, however they are, only give the cross-check ratio)."""
    overrides = {"1st-layernorm": (8.0, 8.0, 8.25),   # output 8 MB + 0.25 MB statistics it keeps
                 "qkv": (8.0, 24.0, 24.0),            # keeps its 8 MB input, not its output
                 "softmax": (128.0, 128.0, 128.0),    # keeps its own output
                 "attn-dropout": (128.0, 128.0, 192.0)}  # output (kept by context) + its 64 MB mask
    write_ops(tmp_path, mbs=1, us=1500.0, overrides=overrides)
    write_ops(tmp_path, mbs=2, us=2500.0)
    data = import_aceso(tmp_path, "A100", GPT13)
    assert data["tp_comm_included"] is True and data["models"][0]["tp_comm_included"] is True
    ops, reserved = DeviceProfile(data).layer_costs(GPT13, 1, 1)
    assert ops["qkv"].fwd_ms == 1.5 and ops["qkv"].bwd_ms == 3.0          # 1500 us, 3000 us
    assert DeviceProfile(data).layer_costs(GPT13, 2, 1)[0]["gelu"].fwd_ms == 2.5
    for mbs in (1, 2):
        ops = DeviceProfile(data).layer_costs(GPT13, mbs, 1)[0]
        for op, sh in op_shapes(GPT13, mbs, 1).items():      # 2-byte CSVs: 2-byte shapes
            assert (ops[op].weight_bytes, ops[op].act_bytes, ops[op].input_bytes, ops[op].output_bytes) == \
                (sh.weight_bytes, sh.act_bytes, sh.input_bytes, sh.output_bytes), op
    # the CSVs' bytes moved to their keepers (read_op_csv) over the model's layer bytes, least and most
    ratios = []
    for mbs in (1, 2):
        moved = read_op_csv(tmp_path / f"gpt_1_3B_mbs{mbs}_tp1_algo0.csv", MB)[0]
        ratios.append(sum(moved[op][3] for op in layer_ops(GPT13))
                      / sum(op_shapes(GPT13, mbs, 1)[op].act_bytes for op in layer_ops(GPT13)))
    assert data["provenance"]["act_imported_over_model"] == [round(min(ratios), 4), round(max(ratios), 4)]
    assert ratios[0] != ratios[1]
    assert data["provenance"]["csv_vocab"] == [GPT13.vocab]
    assert reserved == 6 * MB


def test_sailor_file_names_fp32_sizes_and_a_pattern_option(tmp_path):
    """Sailor's CSVs (``OPT-350_mbs1_tp1_algo0.csv``) fit the default pattern; other names
    are read through ``pattern``; fp32 CSVs give 4-byte shapes."""
    opt = get_model("gpt3-350m", vocab=50688, dropout=0.0)
    fp32 = {op: s.weight_bytes * 2 / MB for op, s in op_shapes(opt, 1, 1).items()}
    write_ops(tmp_path, prefix="OPT-350", model=opt, weights=fp32)
    data = import_aceso(tmp_path, "GH200", opt)
    assert data["provenance"]["aceso_model"] == "OPT-350" and data["provenance"]["dtype_bytes"] == 4
    ops = DeviceProfile(data).layer_costs(opt, 1, 1)[0]
    assert ops["softmax"].act_bytes == op_shapes(opt, 1, 1, elem_bytes=4)["softmax"].act_bytes
    assert ops["qkv"].weight_bytes == op_shapes(opt, 1, 1, elem_bytes=4)["qkv"].weight_bytes
    (tmp_path / "OPT-350_mbs1_tp1_algo0.csv").rename(tmp_path / "prof-OPT-350-b1-t1.csv")
    with pytest.raises(ProfileError, match=r"no files named \{model\}_mbs\{mbs\}_tp\{tp\}_algo\{algo\}.csv "
                                           r"\(algo 0\); name the files' pattern with --aceso-pattern"):
        import_aceso(tmp_path, "GH200", opt)
    data = import_aceso(tmp_path, "GH200", opt, pattern="prof-{model}-b{mbs}-t{tp}.csv")
    assert [(e["mbs"], e["tp"]) for e in data["models"][0]["entries"]] == [(1, 1)]
    with pytest.raises(ProfileError, match=r"must hold \{model\}, \{mbs\} and \{tp\} once each"):
        import_aceso(tmp_path, "GH200", opt, pattern="prof-{model}-b{mbs}.csv")


def test_vocabulary_is_scaled_not_refused_and_dropout_ops_not_run_keep_no_time(tmp_path):
    """CSVs of another vocabulary: the head's times and the embedding's backward scale
    by model / CSV vocabulary; a model without (attention) dropout runs no dropout ops."""
    write_ops(tmp_path, us=1000.0)
    base = DeviceProfile(import_aceso(tmp_path, "A100", GPT13)).layer_costs(GPT13, 1, 1)[0]
    small = replace(GPT13, vocab=25152)                      # half of 50304
    data = import_aceso(tmp_path, "A100", small)
    ops = DeviceProfile(data).layer_costs(small, 1, 1)[0]
    assert data["provenance"]["csv_vocab"] == [50304] and data["provenance"]["model_vocab"] == 25152
    assert (ops["head+loss"].fwd_ms, ops["head+loss"].bwd_ms) == (0.5, 1.0)
    assert (ops["embedding"].fwd_ms, ops["embedding"].bwd_ms) == (1.0, 1.0)
    assert ops["head+loss"].weight_bytes == op_shapes(small, 1, 1)["head+loss"].weight_bytes
    assert ops["qkv"].fwd_ms == base["qkv"].fwd_ms == 1.0
    # no dropout at all: the three dropout ops keep no time and no mask
    none = replace(GPT13, dropout=0.0)
    ops = DeviceProfile(import_aceso(tmp_path, "A100", none)).layer_costs(none, 1, 1)[0]
    assert [ops[op].fwd_ms + ops[op].bwd_ms for op in ("attn-dropout", "post-attn-dropout", "post-mlp-dropout")] \
        == [0.0, 0.0, 0.0]
    assert ops["attn-dropout"].act_bytes == 0 and ops["gelu"].fwd_ms == 1.0
    # hidden dropout without attention dropout (GPT-Neo in Megatron-DeepSpeed): attn-dropout
    # keeps no time, context keeps no second copy of the probabilities
    neo = replace(GPT13, attention_dropout=0.0)
    ops = DeviceProfile(import_aceso(tmp_path, "A100", neo)).layer_costs(neo, 1, 1)[0]
    assert ops["attn-dropout"].fwd_ms == 0.0 and ops["post-attn-dropout"].fwd_ms == 1.0
    assert ops["context"].act_bytes == 0 < base["context"].act_bytes
    # an op the model does not have (GPT-Neo's pipeline has no head): no time, no bytes
    data = import_aceso(tmp_path, "A100", GPT13, absent=("head+loss",))
    head = DeviceProfile(data).layer_costs(GPT13, 1, 1)[0]["head+loss"]
    assert (head.fwd_ms, head.bwd_ms, head.weight_bytes, head.act_bytes) == (0, 0, 0, 0)
    with pytest.raises(ProfileError, match=r"absent op\(s\) \['lm-head'\] are not ops of the CSVs"):
        import_aceso(tmp_path, "A100", GPT13, absent=("lm-head",))


def test_imported_times_give_a_plausible_stage_and_no_extra_tp_comm(tmp_path):
    write_ops(tmp_path, tp=1, us=1000.0)
    write_ops(tmp_path, tp=2, us=600.0)
    cluster = Cluster.from_dict({"name": "a100x2", "inter_node_gbps": 200, "nodes": [{"type": "A100", "devices_per_node": 2}]})
    cm = CostModel(GPT13, cluster, ProfileDB({"A100": DeviceProfile(import_aceso(tmp_path, "A100", GPT13))}))
    two = cm.stage_cost("A100", 2, 1, (0, 24), 1, num_stages=1, ranks=[0, 1])
    # 24 layers x 13 ops x 0.6 ms + embedding, final-layernorm, head (ms, not s)
    assert two.fwd_ms == pytest.approx((24 * 13 + 3) * 0.6) and two.comm_ms == 0.0
    analytic = CostModel(GPT13, cluster, ProfileDB({"A100": DeviceProfile(
        analytic_profile(cluster.types["A100"], [GPT13], (1,), (1, 2)))}))
    assert analytic.stage_cost("A100", 2, 1, (0, 24), 1, num_stages=1, ranks=[0, 1]).comm_ms > 0


def test_model_filter_skips_other_models_csvs(tmp_path):
    write_ops(tmp_path, prefix="gpt_1_3B", mbs=1)
    write_ops(tmp_path, prefix="gpt_1_3B", mbs=4)
    write_ops(tmp_path, prefix="gpt_2_6B", mbs=1, model=get_model("gpt3-2.6b"))
    (tmp_path / "resnet_500M_mbs1_tp1_algo0.csv").write_text(HEADER + "conv1,1,1,1,1,1,1,1,1\n")
    with pytest.raises(ProfileError, match=r"holds op CSVs of 3 Aceso models \(gpt_1_3B, gpt_2_6B, "
                                           r"resnet_500M\); choose one with --aceso-model"):
        import_aceso(tmp_path, "A100", GPT13)
    data = import_aceso(tmp_path, "A100", GPT13, aceso_model="gpt_1_3B")
    assert sorted(e["mbs"] for e in data["models"][0]["entries"]) == [1, 4]
    assert data["provenance"]["aceso_model"] == "gpt_1_3B"
    with pytest.raises(ProfileError, match=r"no op CSVs of Aceso model 'gpt_6_7B' \(algo 0\); it holds: "
                                           r"gpt_1_3B, gpt_2_6B, resnet_500M"):
        import_aceso(tmp_path, "A100", GPT13, aceso_model="gpt_6_7B")


def test_shape_mismatch_is_refused_naming_the_numbers(tmp_path):
    write_ops(tmp_path)
    with pytest.raises(ProfileError, match=r"gpt_1_3B_mbs1_tp1_algo0.csv: qkv weights 24.012 MB, but model "
                                           r"gpt3-2.6b \(hidden 2560, .*\) at tp 1 in 2-byte elements gives "
                                           r"37.500 MB; describe the CSVs' model with --model and --hidden-size"):
        import_aceso(tmp_path, "A100", get_model("gpt3-2.6b"))
    # the vocabulary is the head's; the embedding then fixes seq_len
    with pytest.raises(ProfileError, match=r"embedding weights 204.500 MB, but model gpt3-1.3b \(.*seq 4096; "
                                           r"the CSV's vocab 50304\) at tp 1 in 2-byte elements gives 212.500 MB; "
                                           r".* --seq-length"):
        import_aceso(tmp_path, "A100", replace(GPT13, seq_len=4096))
    # the softmax's activations (heads) only warn: Aceso's own CSVs hold 3x that column
    data = import_aceso(tmp_path, "A100", replace(GPT13, heads=32, kv_heads=32))
    (warning,) = data["provenance"]["warnings"]
    assert warning.startswith("gpt_1_3B_mbs1_tp1_algo0.csv: softmax activations 128.000 MB, model gpt3-1.3b "
                              "(heads 32, seq 2048) at mbs 1, tp 1 gives 256.000 MB")
    assert import_aceso(tmp_path, "A100", GPT13)["provenance"]["warnings"] == []


def test_weights_as_aceso_writes_them(tmp_path):
    """Aceso's weights column holds the GEMM weights without biases, in the CSV's precision
    (Sailor's published A100 CSVs: qkv 37.5 MB = 2560 x 7680 x 2 bytes at tp 1)."""
    h, f, v, s = GPT13.hidden, GPT13.ffn, GPT13.vocab, GPT13.seq_len
    for size, folder in ((2, tmp_path / "fp16"), (4, tmp_path / "fp32")):
        folder.mkdir()
        for tp in (1, 2):
            write_ops(folder, tp=tp, weights={"qkv": size * h * 3 * h / tp / MB, "mlp-gemm-1": size * h * f / tp / MB,
                                              "embedding": size * (v / tp + s) * h / MB,
                                              "head+loss": size * v / tp * h / MB})
        assert import_aceso(folder, "A100", GPT13)["provenance"]["dtype_bytes"] == size
    with pytest.raises(ProfileError, match="mlp-gemm-1 weights .* --ffn-hidden-size"):
        import_aceso(tmp_path / "fp16", "A100", replace(GPT13, ffn=4 * h + 64))


def test_collective_tables_are_imported(tmp_path):
    write_ops(tmp_path)
    write_prim(tmp_path, "prim_gpt_1_3B_all_reduce_2gpus.csv",
               [(0, 0.01), (4, 0.25), (1, 0.1), (16, 1000000000.0)])   # size 0 and placeholder skipped
    write_prim(tmp_path, "prim_gpt_1_3B_all_gather_4gpus.csv", [(1, 0.2)])
    write_prim(tmp_path, "prim_gpt_1_3B_all_to_all_2gpus.csv", [(1, 0.3)])
    write_prim(tmp_path, "prim_gpt_2_6B_all_reduce_4gpus.csv", [(1, 0.4)])
    data = import_aceso(tmp_path, "A100", GPT13)
    assert data["collectives"] == {"all_reduce": {"2": [[1 * MB, 0.1], [4 * MB, 0.25]]},
                                   "all_gather": {"4": [[4 * MB, 0.2]]}}   # gathered size: 4 ranks x 1 MB
    prof = DeviceProfile(data)
    assert prof.collective_table("all_reduce", 4) is None


def test_cli_import_and_one_line_errors(tmp_path, capsys):
    src = tmp_path / "aceso"
    src.mkdir()
    write_ops(src, prefix="gpt_1_3B")
    write_ops(src, prefix="gpt_2_6B", model=get_model("gpt3-2.6b"))
    out = tmp_path / "A100.json"
    base = ["--import-aceso", str(src), "--device", "A100", "-o", str(out)]
    assert make_profiles(base + ["--model", "gpt3-1.3b"]) == 2
    assert "choose one with --aceso-model" in capsys.readouterr().err
    assert make_profiles(base + ["--model", "gpt3-1.3b", "--aceso-model", "gpt_2_6B"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "qkv weights 37.515 MB, but model gpt3-1.3b (hidden 2048," in err
    assert not out.exists()
    assert make_profiles(base + ["--model", "gpt3-1.3b", "--aceso-model", "gpt_1_3B"]) == 0
    assert "imported 1 (mbs, tp) entries of gpt_1_3B for A100" in capsys.readouterr().out
    assert load_profile(out).tp_comm_included(GPT13)
    assert make_profiles(["--aceso-model", "gpt_1_3B"]) == 2


def test_intra_node_p2p_bandwidths_become_the_p2p_table(tmp_path):
    write_ops(tmp_path)
    # two runs appended (sizes MB, bandwidths GB/s); the last one counts
    (tmp_path / "p2p_intra_node.csv").write_text("1,2,4\n1.00,1.00,1.00\n1,2,4\n10.00,20.00,40.00\n")
    (tmp_path / "p2p_inter_node.csv").write_text("1,2\n5.00,5.00\n")
    data = import_aceso(tmp_path, "A100", GPT13)
    # 1 MB at 10 GB/s (GB = 1024 MB): 1/1024/10 s = 0.09765625 ms; 2 MB at 20 and 4 MB at 40: the same
    assert data["collectives"]["p2p"] == {"2": [[1 * MB, 0.09765625], [2 * MB, 0.09765625],
                                                [4 * MB, 0.09765625]]}
    assert set(data["collectives"]) == {"p2p"}                       # inter-node: cluster link
    (tmp_path / "p2p_intra_node.csv").write_text("1,2,4\n10.00,0,40.00\n")
    with pytest.raises(ProfileError, match=r"p2p_intra_node.csv: sizes and bandwidths must be positive, "
                                           r"got 2.0 MB at 0.0 GB/s"):
        import_aceso(tmp_path, "A100", GPT13)
    (tmp_path / "p2p_intra_node.csv").write_text("1,2,4\n")
    with pytest.raises(ProfileError, match=r"expected pairs of rows .* got 1 rows"):
        import_aceso(tmp_path, "A100", GPT13)


def test_cli_describes_acesos_own_model_with_megatron_flags(tmp_path, capsys):
    """Aceso's GPT-3 1.3B (32 heads, vocabulary 51200) is not our preset: Megatron's flags on
    --model describe it; a model of another vocabulary takes the CSVs scaled to it."""
    aceso13 = replace(GPT13, heads=32, kv_heads=32, vocab=51200)
    src = tmp_path / "aceso"
    src.mkdir()
    write_ops(src, model=aceso13)
    out = tmp_path / "A100.json"
    base = ["--import-aceso", str(src), "--device", "A100", "-o", str(out), "--model", "gpt3-1.3b"]
    assert make_profiles(base + ["--num-attention-heads", "32", "--vocab-size", "51200"]) == 0
    shape = load_profile(out).data["models"][0]["shape"]
    assert (shape["heads"], shape["kv_heads"], shape["vocab"]) == (32, 32, 51200)
    out.unlink()
    assert make_profiles(base + ["--num-attention-heads", "32", "--aceso-absent", "head+loss"]) == 0
    data = load_profile(out).data
    assert data["provenance"]["csv_vocab"] == [51200] and data["models"][0]["shape"]["vocab"] == 50304
    assert data["models"][0]["entries"][0]["ops"]["head+loss"] == [0.0] * 6
    assert make_profiles(base + ["--aceso-absent", "head"]) == 2
    assert "absent op(s) ['head'] are not ops of the CSVs" in capsys.readouterr().err


def test_a_relu_model_takes_the_csvs_mlp_activation_row(tmp_path):
    write_ops(tmp_path, us=1000.0)
    opt = replace(GPT13, activation="relu", dropout=0.0)
    ops = DeviceProfile(import_aceso(tmp_path, "A100", opt)).layer_costs(opt, 1, 1)[0]
    assert "gelu" not in ops and ops["relu"].fwd_ms == 1.0
    assert ops["relu"].act_bytes == op_shapes(opt, 1, 1)["relu"].act_bytes and ops["mlp-gemm-2"].act_bytes == 0
