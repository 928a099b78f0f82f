"""Model spec: hand-counted op shapes of a tiny GPT, presets, validation."""
import pytest

from eth.errors import SpecError
from eth.spec.model import (ALL_OPS, LAYER_OPS, PRESETS, ModelSpec, get_model, op_shapes, tp_allgathers,
                       tp_allreduces)

TINY = ModelSpec("t", num_layers=4, hidden=8, heads=2, ffn=32, seq_len=4, vocab=16, dropout=0.0)


def test_op_shapes_hand_count_tp1():
    ops = op_shapes(TINY, mbs=1, tp=1)
    assert tuple(ops) == ALL_OPS and len(LAYER_OPS) == 13
    # b=1 s=4 h=8 a=2 f=32 E=2: one hidden activation = 64 bytes; attention = 2*4*4 elements
    assert ops["qkv"].flops_fwd == 2 * 4 * 8 * 24 and ops["qkv"].flops_bwd == 2 * 2 * 4 * 8 * 24
    assert ops["qkv"].weight_bytes == (8 * 24 + 24) * 2
    assert ops["score"].flops_fwd == 2 * 4 * 4 * 8
    assert ops["score"].act_bytes == 4 * 24 * 2           # q, k: views of the whole qkv output
    assert ops["softmax"].act_bytes == 32 * 2             # its output
    assert ops["attn-dropout"].act_bytes == 0             # dropout off: no mask
    assert ops["context"].act_bytes == 0                  # v is score's qkv, probs softmax's
    assert ops["score"].input_bytes == 4 * 24 * 2         # the whole fused qkv output
    assert ops["attn-dense"].weight_bytes == (64 + 8) * 2
    assert ops["1st-layernorm"].act_bytes == 64 + 4 * 8   # input + fp32 mean/rstd
    assert ops["gelu"].act_bytes == 4 * 32 * 2
    assert ops["mlp-gemm-2"].weight_bytes == (32 * 8 + 8) * 2
    assert ops["embedding"].weight_bytes == (16 * 8 + 4 * 8) * 2
    assert ops["head+loss"].act_bytes == 64 + 4 * 16 * 4  # input + fp32 logits
    layer_weights = sum(ops[o].weight_bytes for o in LAYER_OPS)
    assert layer_weights == 2 * TINY.params_per_layer() == 2 * 872
    assert sum(ops[o].act_bytes for o in LAYER_OPS) == 1152


def test_tp_shards_gemms_not_layernorms():
    one, two = op_shapes(TINY, 1, 1), op_shapes(TINY, 1, 2)
    assert two["qkv"].weight_bytes * 2 == one["qkv"].weight_bytes
    assert two["mlp-gemm-1"].flops_fwd * 2 == one["mlp-gemm-1"].flops_fwd
    assert two["1st-layernorm"].weight_bytes == one["1st-layernorm"].weight_bytes
    assert two["softmax"].act_bytes * 2 == one["softmax"].act_bytes
    # row-parallel bias is replicated: h*h/2 + h
    assert two["attn-dense"].weight_bytes == (64 // 2 + 8) * 2


def test_activations_scale_with_mbs_and_dropout_masks():
    drop = ModelSpec("d", 2, 8, 2, ffn=32, seq_len=4, vocab=16, dropout=0.1)
    a1, a3 = op_shapes(drop, 1, 1), op_shapes(drop, 3, 1)
    assert a1["attn-dropout"].act_bytes == 32 and a3["attn-dropout"].act_bytes == 96
    assert a1["context"].act_bytes == 32 * 2               # dropout output (v: score's qkv)
    assert a1["post-mlp-dropout"].act_bytes == 32
    tok = 2 * 4 * 8 * 2
    assert tp_allreduces(drop, 2, "layer") == ((tok, tok), (tok, tok))
    assert tp_allreduces(drop, 2, "post") == ((2 * 4 * 4,) * 3, (tok,))


def test_presets_match_table2_and_param_counts():
    expect = {"gpt3-350m": (24, 1024), "gpt3-1.3b": (24, 2048), "gpt3-2.6b": (32, 2560),
              "gpt3-6.7b": (32, 4096), "gpt3-13b": (40, 5120), "llama2-70b": (80, 8192),
              "gpt3-175b": (96, 12288)}
    for name, (layers, hidden) in expect.items():
        m = PRESETS[name]
        assert (m.num_layers, m.hidden, m.seq_len) == (layers, hidden, 2048)
    assert 12.9e9 < get_model("gpt3-13b").num_params() < 13.3e9
    assert 174e9 < get_model("gpt3-175b").num_params() < 176e9
    assert 68e9 < get_model("llama2-70b").num_params() < 70e9
    assert get_model("gpt3-13b", seq_len=4096).seq_len == 4096


@pytest.mark.parametrize("kwargs, message", [
    (dict(hidden=10, heads=3), "hidden 10 is not divisible by model.heads 3"),
    (dict(num_layers=0), "num_layers must be a positive integer"),
    (dict(dropout=1.5), "dropout"),
    (dict(dropout=None), "dropout must be in"),
    (dict(swiglu="yes"), "swiglu must be true or false"),
    (dict(heads=2, kv_heads=3, hidden=12), "heads 2 is not divisible by model.kv_heads 3"),
])
def test_model_validation(kwargs, message):
    base = dict(name="x", num_layers=2, hidden=8, heads=2)
    with pytest.raises(SpecError, match=message):
        ModelSpec(**(base | kwargs))


def test_tp_must_divide():
    with pytest.raises(SpecError, match="tp 4 does not divide model.heads 2"):
        op_shapes(TINY, 1, 4)
    with pytest.raises(SpecError, match="unknown model 'gpt5'"):
        get_model("gpt5")
    with pytest.raises(SpecError, match="unknown field"):
        ModelSpec.from_dict({"name": "x", "num_layers": 1, "hidden": 8, "heads": 2, "layerz": 3})


# ------------------------------------------------------------------ LLaMA layers, fused attention
LLAMA = ModelSpec("l", num_layers=2, hidden=8, heads=4, kv_heads=2, ffn=12, seq_len=4, vocab=16, dropout=0.0,
                  swiglu=True, norm="rmsnorm", position="rope", bias=False, attention="fused")


def test_op_sets_follow_the_spec():
    from dataclasses import replace

    from eth.spec.model import all_ops, layer_ops

    assert all_ops(TINY) == ALL_OPS and layer_ops(TINY) == LAYER_OPS
    assert layer_ops(LLAMA) == ("1st-rmsnorm", "qkv", "rotary", "fused-attention", "attn-dense",
                                "post-attn-dropout", "2nd-rmsnorm", "mlp-gemm-1", "swiglu", "mlp-gemm-2",
                                "post-mlp-dropout")
    assert all_ops(LLAMA)[-2:] == ("final-rmsnorm", "head+loss")
    unfused = layer_ops(replace(LLAMA, attention="unfused"))
    assert unfused[3:7] == ("score", "softmax", "attn-dropout", "context") and len(unfused) == 14
    assert layer_ops(replace(TINY, attention="fused"))[2:4] == ("fused-attention", "attn-dense")
    assert tuple(op_shapes(LLAMA, 1, 1)) == all_ops(LLAMA)


def test_llama_op_shapes_hand_count():
    # b=1 s=4 h=8 a=4 kv=2 (head dim 2, k/v width 4, qkv width 16) f=12 (gate+up 24) E=2
    ops = op_shapes(LLAMA, mbs=1, tp=1)
    assert ops["qkv"].flops_fwd == 2 * 4 * 8 * 16 and ops["qkv"].weight_bytes == 8 * 16 * 2   # no bias
    assert ops["rotary"].flops_fwd == 3 * 4 * (8 + 4) and ops["rotary"].act_bytes == 0
    assert ops["rotary"].input_bytes == ops["rotary"].output_bytes == 4 * 16 * 2
    fa = ops["fused-attention"]
    assert fa.flops_fwd == 4 * 4 * 4 * 8 + 5 * 4 * 4 * 4 and fa.flops_bwd == 2.5 * fa.flops_fwd
    assert fa.act_bytes == 4 * 16 * 2 + 4 * 8 * 2 + 4 * 4 * 4       # q, k, v + output + fp32 lse
    assert fa.input_bytes == 4 * 16 * 2 and fa.output_bytes == 4 * 8 * 2 and fa.weight_bytes == 0
    assert ops["1st-rmsnorm"].weight_bytes == 8 * 2 and ops["1st-rmsnorm"].act_bytes == 64 + 4 * 4
    assert ops["mlp-gemm-1"].flops_fwd == 2 * 4 * 8 * 24 and ops["mlp-gemm-1"].weight_bytes == 8 * 24 * 2
    assert ops["swiglu"].act_bytes == 4 * 24 * 2 and ops["swiglu"].output_bytes == 4 * 12 * 2
    assert ops["attn-dense"].weight_bytes == 8 * 8 * 2 and ops["mlp-gemm-2"].weight_bytes == 12 * 8 * 2
    assert ops["embedding"].weight_bytes == 16 * 8 * 2                # no position table
    assert ops["final-rmsnorm"].weight_bytes == 16 and ops["head+loss"].weight_bytes == 16 * 8 * 2
    # parameters: 2 norms 16 + qkv 128 + dense 64 + gate/up 192 + down 96 = 496 per layer
    assert sum(ops[o].weight_bytes for o in ("1st-rmsnorm", "qkv", "attn-dense", "2nd-rmsnorm",
                                             "mlp-gemm-1", "mlp-gemm-2")) == 2 * LLAMA.params_per_layer()
    assert LLAMA.params_per_layer() == 496 and LLAMA.num_params() == 2 * 496 + 16 * 8 + 8 + 16 * 8
    # tp 2: one kv group per rank, GEMMs and attention halved, norms replicated
    two = op_shapes(LLAMA, 1, 2)
    assert two["qkv"].weight_bytes * 2 == ops["qkv"].weight_bytes
    assert two["fused-attention"].act_bytes * 2 == fa.act_bytes
    assert two["1st-rmsnorm"].weight_bytes == ops["1st-rmsnorm"].weight_bytes
    # tp 4 > kv_heads 2 (megatron-core): the qkv GEMM is split 4 ways, its output gathered,
    # and each rank keeps its query head and its group's key and value head
    four = op_shapes(LLAMA, 1, 4)
    assert four["qkv"].weight_bytes == 8 * 16 // 4 * 2 and four["qkv"].flops_fwd == 2 * 4 * 8 * 16 // 4
    assert four["qkv"].output_bytes == 4 * (2 + 2 + 2) * 2 == four["fused-attention"].input_bytes
    assert tp_allgathers(LLAMA, 1, 4) == ((4 * 16 * 2,), (4 * 16 * 2,))
    assert tp_allgathers(LLAMA, 1, 2) == ((), ()) and LLAMA.splits(4) and not LLAMA.splits(3)


def test_fused_attention_keeps_no_s_by_s_tensor():
    from dataclasses import replace

    def attention_act(spec, s):
        ops = op_shapes(replace(spec, seq_len=s), 1, 1)
        return sum(ops[o].act_bytes for o in ("fused-attention", "score", "softmax", "attn-dropout", "context")
                   if o in ops)

    unfused = replace(LLAMA, attention="unfused")
    assert attention_act(LLAMA, 64) == 16 * attention_act(LLAMA, 4)          # linear in s
    # unfused: q, k (score) + probs s x s (softmax) + v (context) -> grows with s^2
    assert attention_act(unfused, 64) == 64 * (8 + 4) * 2 + 4 * 64 * 64 * 2 + 64 * 4 * 2
    assert attention_act(unfused, 64) > 8 * attention_act(LLAMA, 64)


def test_recompute_rule_for_fused_attention_and_rotary():
    from eth.cost.activations import LayerKeep
    from eth.spec.model import layer_dataflow, recompute_runs
    from eth.spec.model import layer_ops

    ops = op_shapes(LLAMA, 1, 1)
    keep = LayerKeep(layer_dataflow(LLAMA), ops)
    fa = ops["fused-attention"]
    # recomputing fused-attention frees its output, lse and q, k, v copies, keeps the qkv
    # output (its input)
    assert keep.freed({"fused-attention"}) == fa.act_bytes - fa.input_bytes == 128
    # with rotary in the run the checkpoint keeps rotary's input instead (same size)
    assert keep.freed({"rotary", "fused-attention"}) == 128
    # rotary alone keeps nothing, so its checkpoint keeps nothing: no change
    assert keep.freed({"rotary"}) == 0
    # swiglu + mlp-gemm-2 keep mlp-gemm-1's output (swiglu's input) and free g
    assert keep.freed({"swiglu", "mlp-gemm-2"}) == ops["mlp-gemm-2"].act_bytes == 4 * 12 * 2
    assert recompute_runs({"rotary", "fused-attention", "swiglu"}, layer_ops(LLAMA)) == \
        [["rotary", "fused-attention"], ["swiglu"]]


def test_llama2_presets_published_shapes_and_counts():
    shapes = {"llama2-7b": (32, 4096, 32, 32, 11008), "llama2-13b": (40, 5120, 40, 40, 13824),
              "llama2-70b": (80, 8192, 64, 8, 28672)}
    for name, shape in shapes.items():
        m = get_model(name)
        assert (m.num_layers, m.hidden, m.heads, m.kv_heads, m.ffn) == shape
        assert (m.vocab, m.norm, m.position, m.bias, m.swiglu, m.attention) == \
            (32000, "rmsnorm", "rope", False, True, "unfused")
    # the released checkpoints' parameter counts
    assert [get_model(n).num_params() for n in shapes] == [6738415616, 13015864320, 68976648192]
    tiny = get_model("tiny-llama")
    assert (tiny.num_layers, tiny.hidden, tiny.heads, tiny.kv_heads, tiny.seq_len, tiny.vocab, tiny.attention) == \
        (4, 64, 4, 2, 32, 256, "fused")


def test_legacy_specs_load_as_gpt_and_keep_their_hash(tmp_path):
    import json

    from eth.spec.plan import load_plan

    legacy = {"name": "x", "num_layers": 2, "hidden": 8, "heads": 2, "ffn": 32, "seq_len": 4, "vocab": 16,
              "kv_heads": 2, "swiglu": False, "dropout": 0.0}
    spec = ModelSpec.from_dict(legacy)
    assert (spec.norm, spec.position, spec.bias, spec.attention) == ("layernorm", "learned", True, "unfused")
    assert spec.to_dict(compact=True) == legacy and spec.to_dict()["attention"] == "unfused"
    assert ModelSpec.from_dict(LLAMA.to_dict()) == LLAMA
    assert LLAMA.to_dict(compact=True)["attention"] == "fused"
    # a plan written before the fields existed: same hash now
    data = json.loads(open("examples/plans/cpu-demo.json").read())
    assert load_plan("examples/plans/cpu-demo.json").content_hash() == data["hash"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(norm="batchnorm"), r"model.norm must be one of \['layernorm', 'rmsnorm'\], got 'batchnorm'"),
    (dict(attention="flash"), r"model.attention must be one of \['unfused', 'fused'\]"),
    (dict(position="alibi"), r"model.position must be one of"),
    (dict(bias="no"), "model.bias must be true or false"),
    (dict(position="rope", hidden=6, heads=2), "rope needs an even head dimension, got hidden 6 / heads 2 = 3"),
])
def test_layer_option_validation(kwargs, message):
    with pytest.raises(SpecError, match=message):
        ModelSpec(**(dict(name="x", num_layers=2, hidden=8, heads=2) | kwargs))


def test_profiles_and_plans_use_the_specs_op_set():
    from dataclasses import replace

    from eth.spec.cluster import Cluster, catalog
    from eth.errors import PlanError, ProfileError
    from eth.spec.model import all_ops
    from eth.spec.plan import PipelinePlan, Plan, StagePlan
    from eth.profiles.db import DeviceProfile, analytic_profile

    a100 = catalog()["A100"]
    data = analytic_profile(a100, [LLAMA, replace(LLAMA, attention="unfused")], (1, 2), (1, 2))
    prof = DeviceProfile(data)
    assert set(prof.layer_costs(LLAMA, 2, 2)[0]) == set(all_ops(LLAMA))
    assert "softmax" in prof.layer_costs(replace(LLAMA, attention="unfused"), 1, 1)[0]
    del data["models"][0]["entries"][0]["ops"]["rotary"]
    with pytest.raises(ProfileError, match=r"ops\['rotary'\] must be a list"):
        DeviceProfile(data)
    # a profile written before the layer options: GPT shape; a swiglu entry's "gelu" row is its swiglu op
    old = analytic_profile(a100, [replace(TINY, swiglu=True)], (1,), (1,))
    for m in old["models"]:
        for f in ("norm", "position", "bias", "attention"):
            del m["shape"][f]
        for e in m["entries"]:
            e["ops"]["gelu"] = e["ops"].pop("swiglu")
    got = DeviceProfile(old).layer_costs(replace(TINY, swiglu=True), 1, 1)[0]
    assert got["swiglu"].fwd_ms > 0 and "gelu" not in got

    cluster = Cluster.from_dict({"name": "c", "inter_node_gbps": 100, "nodes": [{"type": "A100", "devices_per_node": 1}]})
    plan = Plan(model=LLAMA, cluster=cluster, gbs=2,
                pipelines=[PipelinePlan(1, 2, [StagePlan([0], "A100", 1, 1, (0, 2), {"softmax": 1})])])
    with pytest.raises(PlanError, match="recompute names unknown op 'softmax'; model l's layer ops: 1st-rmsnorm"):
        plan.validate()
    plan.pipelines[0].stages[0].recompute = {"fused-attention": 2, "rotary": 1}
    assert plan.validate() is plan


def test_cost_model_counts_the_qkv_all_gather_when_tp_exceeds_kv_heads():
    """tp 4 > kv_heads 2: per layer one all-gather of the whole qkv output forward, one
    reduce-scatter backward, and the all-gather again when qkv is recomputed; tp 4 with
    4 kv heads (tp divides them) has neither."""
    from dataclasses import replace

    from _foundation_data import flat_profile
    from eth.spec.cluster import Cluster
    from eth.cost.model import CostModel
    from eth.profiles.db import DeviceProfile, ProfileDB, collective_ms

    cluster = Cluster.from_dict({"name": "c", "inter_node_gbps": 10,
                                 "nodes": [{"type": "cpu", "devices_per_node": 4}]})

    def stage(spec, recompute=None):
        db = ProfileDB({"cpu": DeviceProfile(flat_profile(model=spec, mbs=(1,), tp=(4,)))})
        model = CostModel(spec, cluster, db)
        cost = model.stage_cost("cpu", tp=4, dp=1, layers=(0, 2), mbs=1, recompute=recompute)
        return cost, model.stage_links("cpu", 4)[0]

    (gqa, link), (mha, _) = stage(LLAMA), stage(replace(LLAMA, kv_heads=4))
    full = 1 * 4 * 16 * 2                     # b s (h + 2 kv hd) E: the gathered qkv output
    ag, rs = collective_ms("all_gather", 4, full, link), collective_ms("reduce_scatter", 4, full, link)
    assert ag > 0 and rs > 0
    assert gqa.comm_ms - mha.comm_ms == pytest.approx(2 * (ag + rs))      # 2 layers
    assert gqa.fwd_ms - mha.fwd_ms == pytest.approx(2 * ag)
    assert gqa.bwd_ms - mha.bwd_ms == pytest.approx(2 * rs)
    again, _ = stage(LLAMA, {"qkv": 1})
    assert again.recompute_ms - gqa.recompute_ms == pytest.approx(1.0 + ag)   # qkv's 1 ms + its gather
