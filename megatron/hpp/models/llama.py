"""LLaMA-family layer pieces and fused attention for :mod:`megatron.hpp.models.gpt`'s layers.

Everything here acts on one tp rank's share of a layer, in Megatron's [seq, batch, ...]
layout, and is pure torch (the tp layers themselves are megatron-core's):

* :func:`norm` -- ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` (weight only) for a spec;
* grouped-query attention over the fused qkv output, whose columns are ordered by
  key/value group: for each group its ``g = heads / kv_heads`` query heads, its key head
  and its value head (megatron-core's layout; multi-head attention is g = 1).  tp rank
  t holds the contiguous groups [t * kv/tp, (t + 1) * kv/tp) when tp divides kv_heads.
  With tp a multiple of kv_heads (megatron-core 0.16.1 allows it; other tp are refused,
  ``eth.spec.model.ModelSpec.check_tp``) a contiguous slice cuts through a group: as
  megatron-core does, :func:`gather_group` all-gathers the qkv GEMM's output over the
  tp group and keeps the rank's group (its key and value head, shared by tp / kv_heads
  ranks) and its own heads / tp query heads.  :func:`split_qkv` cuts the tensor,
  :func:`scores` and :func:`context` are the unfused attention (query heads of a group
  share their key / value; backward keeps views of qkv, no copy of q, k or v),
  :func:`fused_attention` the one-kernel form;
* rotary position embeddings (:func:`rope_tables`, :func:`rotate_qk`): the "rotate
  half" form (GPT-NeoX / megatron-core's default, not interleaved), base the spec's
  ``rope_theta`` (10000 by default);
* :class:`SwiGLU`: silu(gate) * up, keeping only its input for backward (recomputing
  the sigmoid, as megatron-core's fused bias-swiglu does), so its saved bytes are
  those of ``eth.spec.model.op_shapes``.

Fused attention is torch ``scaled_dot_product_attention`` (causal; on CPU and CUDA),
or transformer-engine's ``DotProductAttention`` when transformer_engine is importable
and the tensors are fp16/bf16 on CUDA (:func:`te_available`); neither keeps an s x s
tensor for backward -- except torch's SDPA on CPU with dropout > 0, which falls back to
its math kernel and keeps the s x s probabilities and dropout mask (a measured CPU
profile records those bytes; ``eth.spec.model.op_shapes`` counts the fused kernels).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F



def norm(spec, eps: float) -> torch.nn.Module:
    """The spec's norm over the hidden size (fp32 parameters; ones / zeros are set later)."""
    if spec.norm == "rmsnorm":
        return RMSNorm(spec.hidden, eps)
    return torch.nn.LayerNorm(spec.hidden, eps=eps)


class _RMSNormFn(torch.autograd.Function):
    """x * rsqrt(mean(x^2) + eps) * w, saving x and the fp32 rstd per token only (as the
    fused kernels of apex / transformer-engine do; torch's composite RMSNorm keeps more)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x.float() * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        g = grad.float()
        gw = (g * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        gx = g * weight.float()
        gx = rstd * (gx - xhat * (gx * xhat).mean(-1, keepdim=True))
        return gx.to(x.dtype), gw, None


class RMSNorm(torch.nn.Module):
    """Root-mean-square norm with a weight (no bias, no mean subtraction)."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        return _RMSNormFn.apply(x, self.weight, self.eps)


# ------------------------------------------------------------------ rotary embeddings
@functools.lru_cache(maxsize=16)
def _tables(seq: int, head_dim: int, base: float, device: str, dtype: torch.dtype):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)          # [s, hd]
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def rope_tables(seq: int, head_dim: int, device, dtype, base: float = 10000.0):
    """(cos, sin) of shape [seq, head_dim] for rotary base ``base`` (the spec's rope_theta),
    computed in fp64 and cached."""
    return _tables(seq, head_dim, float(base), str(device), dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class _RotateQK(torch.autograd.Function):
    """x cos + rotate_half(x) sin on the q and k heads; linear in x, so backward keeps no
    activation (only references to the shared cos / sin tables)."""

    @staticmethod
    def forward(ctx, qkv, group, cos, sin):
        s, b, _ = qkv.shape
        x = qkv.view(s, b, -1, group + 2, cos.shape[-1])
        ctx.group, ctx.cos, ctx.sin = group, cos, sin
        out = x.clone()
        qk = x[:, :, :, :group + 1]
        out[:, :, :, :group + 1] = qk * cos + _rotate_half(qk) * sin
        return out.view(s, b, -1)

    @staticmethod
    def backward(ctx, grad):
        s, b, _ = grad.shape
        cos, sin, group = ctx.cos, ctx.sin, ctx.group
        g = grad.reshape(s, b, -1, group + 2, cos.shape[-1])
        out = g.clone()
        gq = g[:, :, :, :group + 1]
        u1, u2 = (gq * sin).chunk(2, dim=-1)
        out[:, :, :, :group + 1] = gq * cos + torch.cat([u2, -u1], dim=-1)   # the transposed rotation
        return out.view(s, b, -1), None, None, None


def rotate_qk(qkv, groups: int, group: int, head_dim: int, base: float = 10000.0):
    """qkv [s, b, groups * (group + 2) * hd] -> the same with q and k rotated (v as is)."""
    s = qkv.shape[0]
    cos, sin = rope_tables(s, head_dim, qkv.device, qkv.dtype, base)
    return _RotateQK.apply(qkv, group, cos.view(s, 1, 1, 1, head_dim), sin.view(s, 1, 1, 1, head_dim))


# ------------------------------------------------------------------ attention
class _AllGatherLastDim(torch.autograd.Function):
    """Forward: all-gather along the last dimension over ``group``; backward: the sum over
    the group of the gradient's chunk of this rank (reduce-scatter; gloo has none, so an
    all-reduce and the rank's chunk there)."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        ctx.group = group
        parts = [torch.zeros_like(x) for _ in range(group.size())]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        group = ctx.group
        n, rank = group.size(), group.rank()
        try:
            backend = dist.get_backend(group)
        except Exception:   # a fake group (profiling): no real collective either way
            backend = "gloo"
        if backend != "gloo":
            chunks = [c.contiguous() for c in grad.chunk(n, dim=-1)]
            out = torch.empty_like(chunks[rank])
            dist.reduce_scatter(out, chunks, group=group)
            return out, None
        grad = grad.contiguous()
        dist.all_reduce(grad, group=group)
        return grad.chunk(n, dim=-1)[rank].contiguous(), None


def gather_group(qkv, tp_group, kv_heads: int, group: int, head_dim: int):
    """tp > kv_heads: this rank's qkv GEMM output [s, b, qkv_width / tp] -> its group's
    [s, b, (group * kv_heads / tp + 2) * hd]: own query heads, the group's key, value."""
    tp, rank = tp_group.size(), tp_group.rank()
    replicas = tp // kv_heads
    full = _AllGatherLastDim.apply(qkv, tp_group)                 # [s, b, kv * (g + 2) * hd]
    s, b, _ = full.shape
    x = full.view(s, b, kv_heads, group + 2, head_dim)[:, :, rank // replicas]
    own = group // replicas
    j = rank % replicas
    return torch.cat([x[:, :, j * own:(j + 1) * own], x[:, :, group:]], dim=2).reshape(s, b, -1)


def split_qkv(qkv, groups: int, group: int, head_dim: int):
    """qkv [s, b, groups * (group + 2) * hd] -> q [b, groups, group, s, hd], k and v
    [b, groups, s, hd] (views; q a view too)."""
    s, b, _ = qkv.shape
    x = qkv.view(s, b, groups, group + 2, head_dim)
    q = x[:, :, :, :group].permute(1, 2, 3, 0, 4)
    k = x[:, :, :, group].permute(1, 2, 0, 3)
    v = x[:, :, :, group + 1].permute(1, 2, 0, 3)
    return q, k, v


def scores(qkv, groups: int, group: int, head_dim: int):
    """Q K^T / sqrt(hd): [b, groups * group, s, s] (query heads in group order).

    One GEMM per query head of a group, each on views of ``qkv``: backward then keeps
    only the qkv storage (as ``eth.spec.model.op_shapes`` counts it).  A single GEMM over the
    group's g query heads would need q reshaped to [b, groups, g * s, hd], which is not
    a view of the qkv layout for g > 1: autograd would keep that copy of q as well."""
    q, k, _ = split_qkv(qkv, groups, group, head_dim)                   # q [b, groups, g, s, hd]
    b, _, _, s, _ = q.shape
    k_t, scale = k.transpose(-1, -2), 1.0 / math.sqrt(head_dim)
    parts = [torch.matmul(q_j, k_t) * scale for q_j in q.unbind(2)]     # views: no copy saved
    out = parts[0] if group == 1 else torch.stack(parts, dim=2)         # [b, groups, g, s, s]
    return out.reshape(b, groups * group, s, s)


@functools.lru_cache(maxsize=8)
def _causal_bias(s: int, device, dtype) -> torch.Tensor:
    """[s, s]: 0 on and below the diagonal, -inf above (one per shape, shared by the layers)."""
    return torch.full((s, s), float("-inf"), device=device, dtype=dtype).triu(1)


def causal_softmax(scores_):
    """Softmax over the last dimension with the future masked out.  The mask is added
    (x + 0 = x, x + -inf = -inf: the same values as masked_fill) as a constant, so
    autograd keeps only softmax's output, as ``eth.spec.model.op_shapes`` counts it
    (masked_fill would keep an s x s bool mask per layer)."""
    s = scores_.shape[-1]
    return torch.softmax(scores_ + _causal_bias(s, scores_.device, scores_.dtype), dim=-1)


def context(probs, qkv, groups: int, group: int, head_dim: int):
    """probs [b, heads, s, s] x v -> [s, b, heads * hd] (heads in group order)."""
    _, _, v = split_qkv(qkv, groups, group, head_dim)
    b, _, s, _ = probs.shape
    ctx = torch.matmul(probs.reshape(b, groups, group * s, s), v)     # [b, n, g * s, hd]
    return ctx.view(b, groups, group, s, head_dim).permute(3, 0, 1, 2, 4).reshape(s, b, -1)


def te_available(tensor) -> bool:
    """transformer-engine's fused attention applies: importable, CUDA, fp16 / bf16."""
    if tensor.device.type != "cuda" or tensor.dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:   # not installed, or built for another CUDA / torch
        return False
    return True


@functools.lru_cache(maxsize=8)
def _te_module(heads: int, groups: int, head_dim: int, dropout: float):
    from transformer_engine.pytorch import DotProductAttention

    return DotProductAttention(heads, head_dim, num_gqa_groups=groups, attention_dropout=dropout,
                               attn_mask_type="causal", qkv_format="sbhd")


def fused_attention(qkv, groups: int, group: int, head_dim: int, dropout: float, training: bool,
                    use_te: bool = True):
    """softmax(Q K^T / sqrt(hd), causal) V -> [s, b, heads * hd] without an s x s tensor kept.

    Dropout on the probabilities (``training`` and ``dropout`` > 0) draws from the
    current RNG state; the caller forks megatron's tracker around it."""
    p = dropout if training else 0.0
    if use_te and te_available(qkv):
        s, b, _ = qkv.shape
        x = qkv.view(s, b, groups, group + 2, head_dim)
        q = x[:, :, :, :group].reshape(s, b, groups * group, head_dim)
        k, v = x[:, :, :, group].contiguous(), x[:, :, :, group + 1].contiguous()
        attn = _te_module(groups * group, groups, head_dim, p).to(qkv.device)
        attn.train(training)
        return attn(q.contiguous(), k, v).reshape(s, b, -1)
    q, k, v = split_qkv(qkv, groups, group, head_dim)
    b, n, g, s, d = q.shape
    # contiguous copies of q, k and v: the kernel keeps them (its input's size) and the qkv
    # tensor itself is freed, as eth.spec.model.op_shapes counts
    out = F.scaled_dot_product_attention(q.reshape(b, n * g, s, d).contiguous(), k.contiguous(),
                                         v.contiguous(), dropout_p=p, is_causal=True,
                                         enable_gqa=g > 1)                   # [b, heads, s, hd]
    return out.permute(2, 0, 1, 3).reshape(s, b, n * g * d)


# ------------------------------------------------------------------ SwiGLU
class SwiGLU(torch.autograd.Function):
    """silu(gate) * up, saving only (gate, up) and recomputing the sigmoid in backward."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        silu = gate * sig
        return grad * up * sig * (1 + gate * (1 - sig)), grad * silu


def swiglu(f1):
    """f1 = [gate, up] along the last dimension -> silu(gate) * up."""
    gate, up = f1.chunk(2, dim=-1)
    return SwiGLU.apply(gate, up)
