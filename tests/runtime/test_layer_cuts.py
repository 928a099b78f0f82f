"""Stages that start and end inside layers compute what the whole model computes.

One process, tp 1: the tiny GPT and LLaMA cut into three stages at two op boundaries
(every op of layer 1 as the first cut, a later op of layer 2 as the second), with
recompute runs that end at a boundary and start after one, chained through the
boundary buffers of ``megatron.hpp.models.boundary``: the loss and every parameter's
gradient equal the one-stage model's.  The launch in test_runtime_equivalence.py trains
such a plan with different tp degrees on the two sides of each boundary."""
import pytest
import torch

from eth.spec.model import get_model, layer_ops
from megatron.hpp.compat import Backend, setup_rng
from megatron.hpp.models.boundary import buffer_shape, cut_after
from megatron.hpp.models.gpt import GPTStage
from megatron.hpp.profiling.timing import fake_tp_group, initialised_default_group


def _tracker():
    return setup_rng(Backend("gloo", torch.device("cpu")), 5, 5, 0)


def _after(ops, layer, k):
    """(layer, first op) of the stage after a cut behind op k of ``layer``."""
    return (layer, ops[k + 1]) if k + 1 < len(ops) else (layer + 1, ops[0])


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
def test_three_stages_cut_inside_layers_match_one_stage(name):
    spec = get_model(name)
    ops = layer_ops(spec)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab, (2, spec.seq_len), generator=gen)
    labels = torch.randint(0, spec.vocab, (2, spec.seq_len), generator=gen)
    with initialised_default_group():
        group = fake_tp_group(1)
        ref = GPTStage(spec, (0, 4), True, True, group, _tracker(), {}).train()
        loss = ref(tokens, labels)
        loss.backward()
        want = {ref.shard_specs[n].name: p.grad for n, p in ref.named_parameters()}
        for c1 in range(len(ops)):
            c2 = (c1 + 5) % len(ops)
            (l1, f1), (l2, f2) = _after(ops, 1, c1), _after(ops, 2, c2)
            recompute = {ops[(c1 + 1) % len(ops)]: 1, ops[c2]: 1, ops[c1]: 1}
            a = GPTStage(spec, (0, 2), True, False, group, _tracker(), {ops[c1]: 1}, ops=(ops[0], ops[c1]))
            b = GPTStage(spec, (l1, 3), False, False, group, _tracker(), recompute, ops=(f1, ops[c2]))
            c = GPTStage(spec, (l2, 4), False, True, group, _tracker(), {f2: 1}, ops=(f2, ops[-1]))
            out_a = a.train()(tokens)
            rows, width = buffer_shape(spec, len(ops) + c1 + 1)
            assert out_a.shape == (rows, 2, width) and (rows == 1) == (c1 + 1 < len(ops))
            in_b = out_a.detach().requires_grad_(True)
            out_b = b.train()(in_b)
            in_c = out_b.detach().requires_grad_(True)
            got_loss = c.train()(in_c, labels)
            got_loss.backward()
            out_b.backward(in_c.grad)
            out_a.backward(in_b.grad)
            assert got_loss.item() == pytest.approx(loss.item(), abs=1e-6), (ops[c1], ops[c2])
            got = {}
            for stage in (a, b, c):
                for n, p in stage.named_parameters():
                    got[stage.shard_specs[n].name] = got.get(stage.shard_specs[n].name, 0) + p.grad
            assert set(got) == set(want)
            worst = max((got[k] - want[k]).abs().max().item() for k in want)
            assert worst < 1e-6, (ops[c1], ops[c2], worst)
    # a layer boundary carries the hidden state, a cut inside a layer the named tensors
    assert cut_after(spec, 2 * len(ops)) is None
    assert buffer_shape(spec, 2 * len(ops)) == (spec.seq_len, spec.hidden)
