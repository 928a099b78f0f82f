"""LLaMA-family layers (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU, no
biases) and fused attention in the runtime, against a plain-torch LLaMA written here
independently of megatron-core and of megatron/hpp/models/llama.py:

* one stage holding the whole tiny-llama (fused and unfused attention, tp 1) gives the
  reference loss and gradients (fp32, 1e-5), and its parameters are the spec's count;
* a GPT with fused attention equals its 13-op form;
* recomputing any single op, or every op, of either op set changes neither the loss
  nor a gradient (bit for bit, with dropout 0.2 so that masks must be replayed);
* ONE launch of 5 gloo ranks trains six heterogeneous plans in turn and each equals
  the single-process reference (losses and final parameters to 1e-5, 3 AdamW steps,
  clipping active): (A) tp 2 and tp 1 pipelines holding the same layers (2 kv heads:
  one per tp 2 rank) plus a 2-stage pipeline, lbs 8 / 6 / 2 with mbs 4 / 3 / 1;
  (B) a 3-stage pipeline tp 1 -> dp 2 -> tp 2 with recompute on every stage (fused
  attention, rotary, swiglu, norms, GEMMs); (C) the unfused op set: a tp 2 stage with
  score / softmax / context recomputed and a dp 2 pipeline, lbs 10 / 6; (D) tp 4 > kv_heads
  2 (megatron-core's path: the qkv output all-gathered, one kv head per rank shared by
  two ranks), qkv recomputed, next to a tp 1 pipeline; (E) the Mistral-shaped and (F) the
  LLaMA-shaped HuggingFace config.json of examples/models/ (rope_theta and norm eps from
  the file), each under a heterogeneous plan;
* a tp that neither divides kv_heads nor is a multiple of it is refused by plan
  validation with the numbers;
* the profiler measures every LLaMA op's saved bytes as op_shapes counts them;
* torch SDPA equals the unfused ops; transformer-engine's kernel (CUDA + bf16 only)
  equals SDPA (skipped without CUDA and transformer_engine).

Run as a script it is the rank program of that launch (``python test_llama.py OUT PLAN...``).
"""
from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

ITERS, TOL, CLIP = 3, 1e-5, 0.5


def llama_loss(spec, p, tokens):
    """Mean over samples of the per-sample mean token loss of a LLaMA-style decoder."""
    import torch
    import torch.nn.functional as F

    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    b, s = inputs.shape
    a, kv, d = spec.heads, spec.kv_heads, spec.head_dim
    g = a // kv

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + spec.norm_eps) * w

    half = d // 2
    theta = spec.rope_theta ** (-torch.arange(half, dtype=torch.float64) * 2 / d)
    angle = torch.arange(s, dtype=torch.float64)[:, None] * theta[None, :]      # [s, d/2]
    cos, sin = angle.cos().float()[None, :, None, :], angle.sin().float()[None, :, None, :]

    def rope(x):   # [b, s, n, d]: rotate the pairs (i, i + d/2) by position * theta_i
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    x = p["embedding.word"][inputs]
    for layer in range(spec.num_layers):
        w = lambda n: p[f"layer {layer}.{n}"]  # noqa: E731
        y = rms(x, w("ln1.weight"))
        qkv = (y @ w("qkv.weight").T).view(b, s, kv, g + 2, d)
        q = rope(qkv[:, :, :, :g].reshape(b, s, a, d))
        k, v = rope(qkv[:, :, :, g]), qkv[:, :, :, g + 1]
        k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)   # query head i -> group i // g
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(mask, float("-inf")).softmax(-1)
        x = x + (att @ v).transpose(1, 2).reshape(b, s, a * d) @ w("dense.weight").T
        y = rms(x, w("ln2.weight"))
        x = x + (F.silu(y @ w("fc1.weight").T) * (y @ w("fc1_up.weight").T)) @ w("fc2.weight").T
    logits = rms(x, p["head.ln.weight"]) @ p["head.out.weight"].T
    token_loss = F.cross_entropy(logits.reshape(-1, spec.vocab), labels.reshape(-1), reduction="none")
    return token_loss.view(b, s).mean(1).mean()


def _spec(attention="fused", **kw):
    from eth.spec.model import get_model

    return replace(get_model("tiny-llama"), attention=attention, **kw)


# ------------------------------------------------------------------ plans (5 ranks, gbs 16)
def _plans():
    import _rt_plans as rp
    from eth.spec.model_source import load_model
    from eth.spec.plan import PipelinePlan, Plan

    st = rp.stage

    def make(spec, pipes):
        return Plan(model=spec, cluster=rp.cluster(5), gbs=16, pipelines=pipes)

    a = make(_spec(), [PipelinePlan(4, 8, [st([1, 0], 2, 1, (0, 4))]),
                       PipelinePlan(3, 6, [st([2], 1, 1, (0, 4))]),
                       PipelinePlan(1, 2, [st([3], 1, 1, (0, 1)), st([4], 1, 1, (1, 4))])])
    b = make(_spec(), [PipelinePlan(4, 16, [
        st([0], 1, 1, (0, 1), {"rotary": 1, "fused-attention": 1}),
        st([1, 2], 1, 2, (1, 3), {"1st-rmsnorm": 2, "qkv": 2, "rotary": 1, "swiglu": 2, "mlp-gemm-2": 1}),
        st([3, 4], 2, 1, (3, 4), {"fused-attention": 1, "attn-dense": 1, "mlp-gemm-1": 1,
                                  "post-mlp-dropout": 1})])])
    c = make(_spec("unfused"), [
        PipelinePlan(2, 10, [st([0], 1, 1, (0, 2)),
                             st([1, 2], 2, 1, (2, 4), {"score": 2, "softmax": 2, "context": 1, "rotary": 1})]),
        PipelinePlan(2, 6, [st([3, 4], 1, 2, (0, 4))])])
    d = make(_spec(), [PipelinePlan(4, 12, [st([0, 1, 2, 3], 4, 1, (0, 4), {"qkv": 2, "rotary": 1})]),
                       PipelinePlan(2, 4, [st([4], 1, 1, (0, 4))])])
    # HuggingFace config.json models (examples/models/): Mistral-shaped (2 kv heads, ffn 128,
    # rope_theta 1e6, rms eps 1e-6) and LLaMA-shaped, each under a heterogeneous plan
    mistral = replace(load_model(str(REPO / "examples/models/mistral-tiny/config.json")), attention="fused")
    llama = load_model(str(REPO / "examples/models/llama-tiny/config.json"))
    e = make(mistral, [PipelinePlan(2, 10, [st([0, 1], 2, 1, (0, 3), {"rotary": 2}), st([2], 1, 1, (3, 4))]),
                       PipelinePlan(2, 6, [st([3, 4], 1, 2, (0, 4))])])
    f = make(llama, [PipelinePlan(4, 12, [st([0], 1, 1, (0, 2)), st([1, 2], 2, 1, (2, 4), {"softmax": 2})]),
                     PipelinePlan(2, 4, [st([3, 4], 1, 2, (0, 4))])])
    return {"A": a, "B": b, "C": c, "D": d, "E": e, "F": f}


def _rank_main(out: Path, plan_paths: list[str]) -> int:
    """Train every plan in turn in this process group (fresh Trainer each)."""
    from _rt_variants import run_variant
    from megatron.hpp import compat

    compat.quiet_megatron_warnings()
    import torch.distributed as dist

    try:
        for path in plan_paths:
            run_variant(path, out, {"name": Path(path).stem, "train_iters": ITERS, "clip_grad": CLIP})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------ single process
try:
    import pytest
except ImportError:     # the rank program runs without pytest's fixtures
    pytest = None


if pytest is not None:
    @pytest.fixture(scope="module")
    def group():
        """A one-rank gloo group in this process (in-memory store, no port)."""
        import torch.distributed as dist

        from megatron.hpp.compat import quiet_megatron_warnings

        quiet_megatron_warnings()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        yield dist.new_group([0])
        dist.destroy_process_group()


def _stage(spec, group, recompute=None, seed=3):
    import torch

    from megatron.hpp.compat import Backend, setup_rng
    from megatron.hpp.models.gpt import GPTStage

    tracker = setup_rng(Backend("gloo", torch.device("cpu")), 5, 11, 0)
    return GPTStage(spec, (0, spec.num_layers), True, True, group, tracker, recompute, seed=seed)


def _loss_grads(spec, group, recompute=None):
    from megatron.hpp.data.batches import SyntheticData, batch

    stage = _stage(spec, group, recompute)
    stage.train()
    tokens = batch(SyntheticData(spec.vocab, spec.seq_len, 1), 0, 0, 4)
    loss = stage(tokens[:, :-1], tokens[:, 1:], 0.25)   # sum of 4 per-sample losses / 4
    loss.backward()
    return stage, tokens, loss, {n: p.grad.clone() for n, p in stage.named_parameters()}


def test_stage_equals_plain_torch_llama_and_counts_parameters(group):
    import torch

    from megatron.hpp.models.gpt import full_parameter

    for attention in ("fused", "unfused"):
        spec = _spec(attention)
        stage, tokens, loss, grads = _loss_grads(spec, group)
        assert sum(p.numel() for p in stage.parameters()) == spec.num_params() == 156224
        p = {sh.name: full_parameter(spec, sh, 3).requires_grad_(True) for sh in stage.shard_specs.values()}
        ref = llama_loss(spec, p, tokens)
        ref.backward()
        assert loss.item() == pytest.approx(ref.item(), abs=TOL)
        assert 5.0 < ref.item() < 6.0                       # ~ln(256): random weights, real work
        for local, sh in stage.shard_specs.items():
            assert torch.allclose(grads[local], p[sh.name].grad, atol=TOL, rtol=1e-4), (attention, local)
        assert not any(n.endswith("bias") for n in grads) and "pos" not in grads


def test_gpt_with_fused_attention_equals_its_unfused_op_set(group):
    """The fused option on a GPT (layernorm, learned positions, gelu, biases): same loss and
    gradients as the paper's 13 ops; its recompute is exact too."""
    import torch

    from eth.spec.model import get_model

    gpt = get_model("tiny")
    _, _, loss, grads = _loss_grads(gpt, group)
    for recompute in (None, {"fused-attention": 4, "qkv": 2}):
        _, _, loss_f, grads_f = _loss_grads(replace(gpt, attention="fused"), group, recompute)
        assert abs(loss_f.item() - loss.item()) < TOL
        assert all(torch.allclose(grads[n], grads_f[n], atol=TOL, rtol=1e-4) for n in grads)


def test_recompute_of_any_op_changes_neither_loss_nor_gradients(group):
    from eth.spec.model import layer_ops

    for attention in ("fused", "unfused"):
        spec = _spec(attention, dropout=0.2)     # masks (tracker and default RNG) must be replayed
        _, _, loss, grads = _loss_grads(spec, group)
        ops = layer_ops(spec)
        for recompute in [{op: 2} for op in ops] + [{op: 3 for op in ops}]:
            _, _, loss_r, grads_r = _loss_grads(spec, group, recompute)
            assert loss_r.item() == loss.item(), (attention, recompute)
            for name, grad in grads.items():
                assert grad.equal(grads_r[name]), (attention, recompute, name)


def test_tp_must_divide_kv_heads_or_be_a_multiple():
    import _rt_plans as rp

    from eth.errors import PlanError
    from eth.spec.plan import PipelinePlan, Plan

    spec = _spec(hidden=96, heads=12, kv_heads=4, vocab=240)     # tp 6: 4 % 6 and 6 % 4 (megatron-core's rule)
    plan = Plan(model=spec, cluster=rp.cluster(6), gbs=16,
                pipelines=[PipelinePlan(4, 16, [rp.stage(range(6), 6, 1, (0, 4))])])
    with pytest.raises(PlanError, match=r"stages\[0\]: tp 6 does not divide model.kv_heads 4 and is not a "
                                        r"multiple of it"):
        plan.validate()
    # 3 and 6: neither divides kv_heads 4 nor is a multiple; 12: does not divide the qkv width 160
    assert [spec.splits(t) for t in (1, 2, 3, 4, 6, 12)] == [True, True, False, True, False, False]


def test_measured_saved_bytes_of_llama_ops_are_op_shapes():
    """The profiler's measurement (storages each op packs for backward, fp32) of every
    tiny-llama layer op at tp 1, 2 and 4 (> kv_heads), fused and unfused attention,
    equals eth.spec.model.op_shapes scaled to 4-byte elements, except the fp32 statistics,
    which do not scale: rmsnorm's rstd and fused attention's log-sum-exp are b x s
    (x local heads) x 4 bytes in both.  Unfused, as for the GPT (test_profile_ops): score
    counts the whole qkv storage (with 2 query heads per key/value head no copy of q is
    kept), context nothing (v is a view of it, the probabilities are softmax's).  Fused
    with one local query head (tp 4) attn-dense's input is a view of the kernel's saved
    output: counted there, once."""
    from eth.spec.model import ACT_BYTES, layer_ops, op_shapes
    from megatron.hpp.profiling.ops import ProfileConfig, measure_entries

    E, b = 4, 2
    for attention in ("fused", "unfused"):
        spec = _spec(attention)
        s, heads = spec.seq_len, spec.heads
        for entry in measure_entries(ProfileConfig(spec, "cpu", (b,), (1, 2, 4), repeats=1, warmup=0)):
            tp, shapes, ops = entry["tp"], op_shapes(spec, b, entry["tp"]), entry["ops"]
            qkv_out = shapes["qkv"].output_bytes * E // ACT_BYTES      # q, k, v: score
            for op in layer_ops(spec):
                scaled = shapes[op].act_bytes * E // ACT_BYTES
                want = {"1st-rmsnorm": scaled - b * s * 4, "2nd-rmsnorm": scaled - b * s * 4,
                        "fused-attention": scaled - b * (heads // tp) * s * 4,
                        "score": qkv_out}.get(op, scaled)
                if attention == "fused" and op == "attn-dense" and heads // tp == 1:
                    # one local head: the context is a view of the kernel's output, which
                    # fused-attention keeps and counts (op_shapes counts it twice)
                    want = 0
                assert ops[op][3] == want, (attention, op, tp, ops[op][3], want)
            assert ops["rotary"][3] == 0
            if attention == "unfused":
                assert qkv_out == shapes["score"].act_bytes * E // ACT_BYTES and ops["context"][3] == 0


def _random_qkv(groups=2, group=3, hd=8, s=16, b=2):
    import torch

    gen = torch.Generator().manual_seed(0)
    return torch.randn(s, b, groups * (group + 2) * hd, generator=gen), (groups, group, hd)


def test_sdpa_fused_attention_equals_the_unfused_ops():
    """SDPA (CPU, fp32) equals score -> softmax -> context on the same grouped qkv; the
    transformer-engine kernel is never picked for CPU tensors."""
    import torch

    from megatron.hpp.models import llama

    qkv, shape = _random_qkv()
    fused = llama.fused_attention(qkv, *shape, 0.0, False)
    probs = llama.causal_softmax(llama.scores(qkv, *shape))
    assert torch.allclose(fused, llama.context(probs, qkv, *shape), atol=1e-6)
    assert not llama.te_available(qkv) and not llama.te_available(qkv.bfloat16())


def test_transformer_engine_attention_equals_sdpa_on_cuda():
    import torch

    from megatron.hpp.models import llama

    qkv, shape = _random_qkv()
    if not torch.cuda.is_available() or not llama.te_available(qkv.cuda().bfloat16()):
        pytest.skip("transformer-engine fused attention needs CUDA and transformer_engine")
    x = qkv.cuda().bfloat16()
    te_out = llama.fused_attention(x, *shape, 0.0, False)
    sdpa_out = llama.fused_attention(x, *shape, 0.0, False, use_te=False)
    assert torch.allclose(te_out.float(), sdpa_out.float(), atol=2e-2)


# ------------------------------------------------------------------ one launch, six plans
@pytest.mark.slow
def test_heterogeneous_plans_equal_single_process(tmp_path):
    import torch

    from _rt_reference import assert_same_params, train_reference
    from _rt_spawn import launch
    from eth.layout.params import all_specs
    from megatron.hpp.models.gpt import full_parameter

    plans = _plans()
    paths = []
    for name, plan in plans.items():
        plan.validate()
        plan.save(tmp_path / f"{name}.json")
        paths.append(str(tmp_path / f"{name}.json"))
    results = launch(5, [str(tmp_path), *paths], timeout=600, script=Path(__file__).resolve())
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exit {r.returncode}:\n{r.stderr[-3000:]}"
    refs = {}
    for name, plan in plans.items():
        spec = plan.model
        if spec not in refs:
            refs[spec] = train_reference(spec, 16, ITERS, clip=CLIP, forward=llama_loss)
        ref_losses, ref_params = refs[spec]
        saved = torch.load(tmp_path / f"{name}.pt")
        assert saved["losses"] == pytest.approx(ref_losses, abs=TOL), (name, saved["losses"], ref_losses)
        assert_same_params(saved["params"], ref_params, TOL, f"plan {name}")
    # the runs moved the weights, so equality is not trivial; fused == unfused mathematically
    spec = plans["A"].model
    moved = max((refs[spec][1][s.name] - full_parameter(spec, s, 1234)).abs().max().item()
                for s in all_specs(spec))
    assert moved > 1e-3
    assert refs[spec][0] == pytest.approx(refs[plans["C"].model][0], abs=TOL)
    # the config.json models are what their files say, and their runs differ from tiny-llama's
    assert (plans["E"].model.kv_heads, plans["E"].model.rope_theta, plans["E"].model.norm_eps) == (2, 1e6, 1e-6)
    assert refs[plans["E"].model][0] != pytest.approx(refs[spec][0], abs=1e-3)


if __name__ == "__main__":
    from megatron.hpp.rank_exit import exit_rank

    exit_rank(_rank_main(Path(sys.argv[1]), sys.argv[2:]))
