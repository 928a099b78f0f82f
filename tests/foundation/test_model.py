"""Model spec: hand-counted op shapes of a tiny GPT, presets, validation."""
import pytest

from eth.errors import SpecError
from eth.model import ALL_OPS, LAYER_OPS, PRESETS, ModelSpec, get_model, op_shapes, tp_allreduces

TINY = ModelSpec("t", num_layers=4, hidden=8, heads=2, ffn=32, seq_len=4, vocab=16, dropout=0.0)


def test_op_shapes_hand_count_tp1():
    ops = op_shapes(TINY, mbs=1, tp=1)
    assert tuple(ops) == ALL_OPS and len(LAYER_OPS) == 13
    # b=1 s=4 h=8 a=2 f=32 E=2: one hidden activation = 64 bytes; attention = 2*4*4 elements
    assert ops["qkv"].flops_fwd == 2 * 4 * 8 * 24 and ops["qkv"].flops_bwd == 2 * 2 * 4 * 8 * 24
    assert ops["qkv"].weight_bytes == (8 * 24 + 24) * 2
    assert ops["score"].flops_fwd == 2 * 4 * 4 * 8
    assert ops["score"].act_bytes == 4 * 16 * 2           # q and k
    assert ops["softmax"].act_bytes == 32 * 2             # its output
    assert ops["attn-dropout"].act_bytes == 0             # dropout off: no mask
    assert ops["context"].act_bytes == 64                 # v (probs are softmax's: no dropout)
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
    assert a1["context"].act_bytes == 32 * 2 + 64          # dropout output + v
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
