"""What crosses a stage boundary inside a layer: named tensors packed into one p2p buffer.

A boundary after layer op k carries the tensors of ``eth.spec.model.cut_tensors`` (the
layer input and what the ops up to k made that a later op reads), each laid out as the
runtime's layer makes it on a tp rank: replicated ones [s, b, h] whole, sharded ones cut
by heads (dim 1 of [b, heads, s, s]) or along the last dimension ([s, b, w / tp], within
each of SwiGLU's [gate, up] pieces).  The two stages may have different tp degrees, so
the buffer holds every tensor whole, in a layout that does not depend on tp:

    sender:   each sharded tensor all-gathered in its tp group (:class:`_GatherShards`),
              every tensor moved batch-first and flattened, all concatenated:
              [1, b, total] (the shape ``megatron.hpp.parallel.schedule.StageComm``
              slices by samples along dim 1 and sends from the tp root, as for [s, b, h])
    receiver: the buffer (broadcast in its tp group by StageComm) split back into the
              tensors and each rank's shard cut out (:class:`_ScatterShards`)

Backward runs the same way back through autograd: the receiver's scatter all-gathers the
shard gradients, so every tp rank of the receiving stage holds the whole buffer gradient
(replicated tensors' gradients are the same on every tp rank, as megatron's layers make
them), which its tp root sends; the sender's gather keeps its rank's chunk of it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from eth.spec.model import CutTensor, cut_tensors, layer_ops


class _GatherShards(torch.autograd.Function):
    """Forward: all-gather along ``dim`` over ``group``; backward: this rank's chunk (the
    incoming gradient is the same on every rank of the group)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        parts = [torch.empty_like(x) for _ in range(group.size())]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.group.size(), ctx.dim)[ctx.group.rank()].contiguous(), None, None


class _ScatterShards(torch.autograd.Function):
    """Forward: this rank's chunk along ``dim``; backward: the chunks' gradients
    all-gathered from the group (so every rank holds the whole gradient)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return x.chunk(group.size(), dim)[group.rank()].contiguous()

    @staticmethod
    def backward(ctx, grad):
        parts = [torch.empty_like(grad) for _ in range(ctx.group.size())]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=ctx.dim), None, None


def cut_after(spec, position: int) -> tuple[CutTensor, ...] | None:
    """The tensors crossing a boundary at op position ``position`` (op i of layer l at
    l * k + i), or None at a layer boundary (the [s, b, h] hidden state alone)."""
    ops = layer_ops(spec)
    k = position % len(ops)
    return None if k == 0 else cut_tensors(spec, ops[k - 1])


def buffer_shape(spec, position: int) -> tuple[int, int]:
    """(rows, per-sample width) of the p2p buffer at ``position``: (seq_len, hidden) at a
    layer boundary, (1, elements per sample of all the cut's tensors) inside a layer."""
    cut = cut_after(spec, position)
    return (spec.seq_len, spec.hidden) if cut is None else (1, sum(t.numel for t in cut))


def _shard_dims(t: CutTensor, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` viewed so that its tp chunks are contiguous along the returned dim."""
    if t.shard == "heads":
        return x, 1
    s, b, w = x.shape
    return x.view(s, b, t.pieces, w // t.pieces), 3


def pack(env: dict, cut: tuple[CutTensor, ...], tp_group) -> torch.Tensor:
    """The cut's tensors of ``env`` (this rank's shards) -> the [1, b, total] buffer."""
    flat = []
    for t in cut:
        x = env[t.name]
        if t.shard is not None and tp_group.size() > 1:
            view, dim = _shard_dims(t, x)
            full = _GatherShards.apply(view, dim, tp_group)
            x = full if t.shard == "heads" else full.reshape(x.shape[0], x.shape[1], -1)
        b = x.shape[0] if t.shard == "heads" else x.shape[1]
        flat.append(x.reshape(b, -1) if t.shard == "heads" else x.transpose(0, 1).reshape(b, -1))
    return torch.cat(flat, dim=1).unsqueeze(0)


def unpack(buf: torch.Tensor, cut: tuple[CutTensor, ...], spec, tp_group) -> dict:
    """The [1, b, total] buffer -> {name: this rank's shard} in the layer's layouts."""
    rows = buf.squeeze(0)
    b, s, env = rows.shape[0], spec.seq_len, {}
    for t, x in zip(cut, rows.split([t.numel for t in cut], dim=1)):
        if t.shard == "heads":
            full = x.reshape(b, spec.heads, s, s)
        else:
            full = x.reshape(b, s, t.numel // s).transpose(0, 1).contiguous()
        if t.shard is not None and tp_group.size() > 1:
            view, dim = _shard_dims(t, full)
            local = _ScatterShards.apply(view, dim, tp_group)
            full = local if t.shard == "heads" else local.reshape(s, b, -1)
        env[t.name] = full
    return env

