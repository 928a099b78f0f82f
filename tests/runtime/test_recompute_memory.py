"""What the runtime keeps for backward is what the cost model predicts (no process group:
a fake tp group).

``eth.cost.activations.LayerKeep`` predicts the bytes a layer keeps for backward under a
recompute set: the own bytes of the ops not recomputed plus every named tensor
(``eth.spec.model.layer_dataflow``) that such an op keeps or that a checkpointed run
reads from outside, each tensor once.  Here the runtime's ``Layer`` / ``GPTStage``
run one micro-batch forward under ``saved_tensors_hooks`` and the storages of the
packed tensors still alive when the forward returns are summed (a tensor packed and
freed again, e.g. the inputs of a checkpoint none of whose ops keeps anything, does
not count), against ``op_shapes`` at fp32 with CPU dropout masks (4 bytes per element:
torch's CPU dropout keeps its scaled mask in the activation dtype).
"""
import itertools
import weakref
from dataclasses import replace

import pytest
import torch

from eth.cost.activations import LayerKeep
from eth.cost.model import CostModel
from eth.profiles.db import ProfileDB
from eth.spec.cluster import Cluster
from eth.spec.model import get_model, layer_dataflow, layer_ops, op_shapes, post_ops, pre_ops
from megatron.hpp.compat import Backend, setup_rng
from megatron.hpp.models.gpt import GPTStage, Layer
from megatron.hpp.profiling.timing import fake_tp_group, initialised_default_group

MBS = 2
FP32 = 4
SPECS = {"gpt": get_model("tiny"), "gpt-dropout": replace(get_model("tiny"), dropout=0.1),
         "llama": get_model("tiny-llama"), "llama-unfused": replace(get_model("tiny-llama"), attention="unfused"),
         # OPT's relu keeps its output (mlp-gemm-2's input); GPT-Neo as Megatron-DeepSpeed runs
         # it: hidden dropout without attention dropout
         "opt-relu": replace(get_model("tiny"), activation="relu"),
         "neo-dropout": replace(get_model("tiny"), dropout=0.1, attention_dropout=0.0)}


def _kept_bytes(fn, params) -> int:
    """Bytes of the unique non-parameter storages that fn() packed for backward and that
    are still alive after it returns (then the graph is run backward: it is usable)."""
    refs = []

    def pack(t):
        refs.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    skip = {p.untyped_storage().data_ptr() for p in params}
    storages = {}
    for ref in refs:
        t = ref()
        if t is not None and t.untyped_storage().data_ptr() not in skip and t.untyped_storage().nbytes():
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    out.sum().backward()
    return sum(storages.values())


def _tracker():
    return setup_rng(Backend("gloo", torch.device("cpu")), 5, 5, 0)


def _layer(spec, tp, recompute):
    layer = Layer(spec, 0, fake_tp_group(tp), _tracker(), frozenset(recompute))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return layer.train()


def _shapes(spec, tp):
    return op_shapes(spec, MBS, tp, FP32, FP32)


def _runs(spec):
    """Every contiguous run of the layer's ops (each op alone, those starting at the
    first op, the whole layer), and no recompute."""
    order = layer_ops(spec)
    return [()] + [order[i:j] for i, j in itertools.combinations(range(len(order) + 1), 2)]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_contiguous_run_keeps_what_the_cost_model_predicts(name, tp):
    spec = SPECS[name]
    keep = LayerKeep(layer_dataflow(spec), _shapes(spec, tp))
    x = torch.randn(spec.seq_len, MBS, spec.hidden, generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    worst = 0.0
    with initialised_default_group():
        for run in _runs(spec):
            layer = _layer(spec, tp, run)
            got = _kept_bytes(lambda: layer(x), list(layer.parameters()))
            want = keep.kept(set(run))
            assert got == pytest.approx(want, rel=0.02), (run, got, want)
            worst = max(worst, abs(got - want) / want)
    assert worst == 0.0   # exact on CPU at fp32: every tensor of the dataflow, nothing else


def test_a_run_after_the_op_that_keeps_its_input_frees_all_it_keeps():
    """attn-dropout + context recomputed after softmax: the run's input (the attention
    probabilities) is softmax's output, which softmax keeps anyway, so the run frees the
    dropout mask and the dropped-out probabilities whole (the count before LayerKeep kept
    the input again and freed only the mask and v's share)."""
    spec = SPECS["gpt-dropout"]
    shapes = _shapes(spec, 1)
    keep = LayerKeep(layer_dataflow(spec), shapes)
    att = MBS * spec.heads * spec.seq_len ** 2 * FP32
    assert keep.freed({"attn-dropout", "context"}) == 2 * att       # mask + dropped-out probs
    assert keep.freed({"softmax", "attn-dropout", "context"}) == 2 * att
    assert keep.freed({"score", "softmax", "attn-dropout", "context"}) == 3 * att   # scores' input: qkv
    # a residual add without dropout keeps nothing: recomputed alone it keeps nothing either
    llama = SPECS["llama"]
    assert LayerKeep(layer_dataflow(llama), _shapes(llama, 1)).freed({"post-mlp-dropout"}) == 0
    # with dropout it frees its mask (on CPU 4 bytes per element, as large as the mlp
    # output) and the checkpoint keeps the mlp output instead: nothing gained
    assert keep.freed({"post-mlp-dropout"}) == 0
    assert keep.freed({"post-attn-dropout"}) == 0


@pytest.mark.parametrize("name", ["gpt", "gpt-dropout", "llama"])
def test_freed_of_every_set_vectorised_equals_one_set_at_a_time(name):
    spec = SPECS[name]
    keep = LayerKeep(layer_dataflow(spec), _shapes(spec, 2))
    members, freed = keep.freed_all()
    for m in range(len(freed)):
        ops = {op for op, on in zip(keep.order, members[m]) if on}
        assert freed[m] == pytest.approx(keep.freed(ops), abs=1e-6), sorted(ops)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", ["gpt-dropout", "llama"])
def test_a_stage_keeps_what_the_cost_model_predicts(name, tp):
    """Two-layer stages (middle, first, last, both) with recompute in the first layer, in
    both layers with a run that ends the stage (the last layer's last ops), and every op
    of both layers: the runtime's bytes against the cost model's (its stage recompute
    count rule, ``CostModel.recompute_savings``), the embedding and head ops included:
    within 2% (the vocab-parallel embedding and loss keep a few token-sized masks beyond
    op_shapes: under 0.3%), a middle stage exactly."""
    spec = SPECS[name]
    cost = CostModel(spec, Cluster.from_dict({"inter_node_gbps": 10, "nodes": [{"type": "cpu", "devices_per_node": 1}]}), ProfileDB())
    shapes = _shapes(spec, tp)
    keep = cost.layer_keep(shapes)
    last_ops = layer_ops(spec)[-2:]
    cases = [{}, {op: 1 for op in layer_ops(spec)[:5]}, {op: 2 for op in last_ops},
             {op: 2 for op in layer_ops(spec)}, {"post-mlp-dropout": 2}]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab, (MBS, spec.seq_len), generator=gen)
    labels = torch.randint(0, spec.vocab, (MBS, spec.seq_len), generator=gen)
    hidden = torch.randn(spec.seq_len, MBS, spec.hidden, generator=gen, requires_grad=True)
    with initialised_default_group():
        for (first, last), recompute in itertools.product(itertools.product([False, True], repeat=2), cases):
            stage = GPTStage(spec, (0, 2), first, last, fake_tp_group(tp), _tracker(), recompute).train()
            got = _kept_bytes(lambda: stage(tokens if first else hidden, labels if last else None),
                              list(stage.parameters()))
            boundary = (pre_ops(spec) if first else ()) + (post_ops(spec) if last else ())
            want = (2 * keep.total - cost.recompute_savings(shapes, recompute)
                    + sum(shapes[op].act_bytes for op in boundary))
            assert got == pytest.approx(want, rel=0.02), (first, last, recompute, got, want)
            if not (first or last):   # layers only: exact
                assert got == want, recompute


def test_layer_index_decides_which_ops_form_a_run():
    """Layer k of a stage recomputes op iff recompute[op] > k; runs are found per layer."""
    spec = get_model("tiny")
    recompute = {"mlp-gemm-1": 2, "gelu": 1, "softmax": 1, "attn-dropout": 1}
    with initialised_default_group():
        stage = GPTStage(spec, (0, 3), True, True, fake_tp_group(1), _tracker(), recompute)
    checkpointed = [[ops for ops, _, _ in layer.segments if len(ops) > 1 or ops[0] in layer.recompute]
                    for layer in stage.layers]
    assert checkpointed == [[("softmax", "attn-dropout"), ("mlp-gemm-1", "gelu")],
                            [("mlp-gemm-1",)], []]


@pytest.mark.parametrize("name", ["gpt-dropout", "llama"])
def test_a_stage_cut_inside_layers_keeps_what_its_parts_predict(name):
    """Middle stages that start and/or end inside a layer (``ops``), with and without
    recompute next to the boundary: the runtime's saved bytes equal, to the byte, the sum
    over the stage's layers of ``LayerKeep`` of the part of each layer it holds (the
    tensors read from before the part kept like the layer input).  The received boundary
    buffer itself is not saved by autograd (the ops keep their own contiguous copies); the
    schedule holds it per micro-batch in flight, which ``CostModel.cut_stage_shape`` adds."""
    from eth.spec.plan import StagePlan
    from megatron.hpp.models.boundary import buffer_shape

    spec = SPECS[name]
    names = layer_ops(spec)
    shapes = _shapes(spec, 1)
    cases = [((names[3], names[-1]), (0, 2), {}), ((names[0], names[3]), (0, 2), {}),
             ((names[3], names[9]), (0, 2), {}), ((names[2], names[-1]), (0, 2), {names[2]: 1, names[3]: 1}),
             ((names[0], names[4]), (0, 2), {names[3]: 2, names[4]: 1}), ((names[6], names[-1]), (0, 1), {})]
    gen = torch.Generator().manual_seed(0)
    with initialised_default_group():
        for ops, layers, recompute in cases:
            plan = StagePlan([], "cpu", 1, 1, layers, recompute, ops=ops)
            stage = GPTStage(spec, layers, False, False, fake_tp_group(1), _tracker(), recompute, ops=ops).train()
            rows, width = buffer_shape(spec, plan.span(spec)[0])
            inputs = torch.randn(rows, MBS, width, generator=gen, requires_grad=True)
            got = _kept_bytes(lambda: stage(inputs), list(stage.parameters()))
            want = 0.0
            for layer in range(*layers):
                held = plan.held_ops(spec, layer)
                redo = {op for op in recompute if layer in plan.recompute_layers(spec, op)}
                want += LayerKeep(layer_dataflow(spec), shapes, None if held == names else held).kept(redo)
            assert got == want, (ops, layers, recompute, got, want)
