"""Recompute frees what the cost model assumes (no process group: a fake tp group).

eth.cost.model frees, for a maximal run of consecutive recomputed ops of a layer, the saved
activations of the run's ops except the input of the run's first op.  The runtime
checkpoints each such run as ONE callable; these tests measure the unique storages a
layer's forward saves for backward (``saved_tensors_hooks``) with and without the run
recomputed and compare the difference with ``CostModel.recompute_savings`` over
``eth.spec.model.op_shapes`` (scaled from its 2-byte activations to fp32).
"""
from dataclasses import replace

import pytest
import torch

from eth.cost.model import CostModel
from eth.spec.model import ACT_BYTES, get_model, op_shapes
from megatron.hpp.compat import Backend, setup_rng
from megatron.hpp.models.gpt import Layer
from megatron.hpp.profiling.timing import fake_tp_group, initialised_default_group

MBS = 2
FP32 = 4


def _saved_bytes(layer, x) -> int:
    """Bytes of the unique non-parameter storages packed during layer(x)."""
    skip = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    storages = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip and st.nbytes() > 0:
            storages[st.data_ptr()] = max(storages.get(st.data_ptr(), 0), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    out.sum().backward()  # the graph is usable (and recompute runs) -- not part of the count
    return sum(storages.values())


def _layer(spec, tp, recompute):
    group = fake_tp_group(tp)
    tracker = setup_rng(Backend("gloo", torch.device("cpu")), 5, 5, 0)
    layer = Layer(spec, 0, group, tracker, frozenset(recompute))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return layer.train()


def _freed(spec, tp, run) -> int:
    x = torch.randn(spec.seq_len, MBS, spec.hidden, generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    with initialised_default_group():
        plain = _saved_bytes(_layer(spec, tp, ()), x)
        recomputed = _saved_bytes(_layer(spec, tp, run), x)
    return plain - recomputed


def _predicted(spec, tp, run) -> float:
    shapes = op_shapes(spec, MBS, tp)
    return CostModel.recompute_savings(shapes, {op: 1 for op in run}) * FP32 / ACT_BYTES


@pytest.mark.parametrize("tp", [1, 2])
def test_mlp_run_frees_exactly_what_the_cost_model_predicts(tp):
    spec = get_model("tiny")
    run = ("mlp-gemm-1", "gelu")
    predicted = _predicted(spec, tp, run)
    assert predicted == MBS * spec.seq_len * spec.ffn // tp * FP32 > 0  # the gelu input
    assert _freed(spec, tp, run) == predicted
    # dropout elsewhere in the layer does not change what this run frees
    assert _freed(replace(spec, dropout=0.1), tp, run) == predicted


@pytest.mark.parametrize("tp", [1, 2])
def test_attention_run_frees_the_cost_model_savings_up_to_the_mask(tp):
    """The run's input is the whole fused qkv output (op_shapes' score input), so what
    is freed is the attention probabilities (counted once: context reuses softmax's
    output when attn-dropout is the identity); the runtime additionally frees
    softmax's s x s bool causal mask, which op_shapes does not count (docs/RUNTIME.md)."""
    spec = get_model("tiny")
    run = ("score", "softmax", "attn-dropout", "context")
    s, att = spec.seq_len, MBS * spec.heads // tp * spec.seq_len ** 2
    assert _predicted(spec, tp, run) == att * FP32
    assert _freed(spec, tp, run) == att * FP32 + s * s  # the probabilities and the mask


def test_layer_index_decides_which_ops_form_a_run():
    """Layer k of a stage recomputes op iff recompute[op] > k; runs are found per layer."""
    from megatron.hpp.models.gpt import GPTStage

    spec = get_model("tiny")
    recompute = {"mlp-gemm-1": 2, "gelu": 1, "softmax": 1, "attn-dropout": 1}
    with initialised_default_group():
        tracker = setup_rng(Backend("gloo", torch.device("cpu")), 5, 5, 0)
        stage = GPTStage(spec, (0, 3), True, True, fake_tp_group(1), tracker, recompute)
    checkpointed = [[ops for ops, _, _ in layer.segments if len(ops) > 1 or ops[0] in layer.recompute]
                    for layer in stage.layers]
    assert checkpointed == [[("softmax", "attn-dropout"), ("mlp-gemm-1", "gelu")],
                            [("mlp-gemm-1",)], []]
