"""Gradient synchronisation across every replica of a parameter, AdamW, global norm.

A logical parameter (``model.ShardSpec``) is held by every pipeline, possibly at
different tp degrees and in stages with different layer ranges.  Method (a simple,
correct reference for the block-wise All-Reduce of the paper, section 4.3, which
will replace :meth:`GradSync.sync` behind the same interface):

1. every holder writes its gradient shard into a zero, full-size buffer at its tp
   slice (a tp-replicated parameter: tp rank 0 only, since all tp ranks hold the
   same gradient);
2. buffers of all parameters with the same holder set are concatenated and summed in
   one all-reduce over that hold group (topology ``hold`` groups);
3. each holder copies its tp slice back into ``.grad``.

Blocks held by a single tp group (one replica of one stage) are skipped
(:func:`needs_reduce`).

Losses are normalised by the global batch (see training), so the sum over pipelines
and dp replicas is the gradient of the whole global batch.

Ownership for counting each element once (norm, parameter gathering): pipeline 0,
dp rank 0, and for tp-replicated parameters tp rank 0.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron.hpp.model import all_specs


def _owns(topo, spec) -> bool:
    return topo.pipeline == 0 and topo.dp_rank == 0 and (spec.dim is not None or topo.tp_rank == 0)


def needs_reduce(layout, holders) -> bool:
    """False when the holders of a block are exactly one tp group (one replica of one
    stage, e.g. every block of a single pipeline of dp 1 stages): its tp ranks already
    hold complete gradients -- their own shards, and identical copies of tp-replicated
    parameters -- so there is nothing to reduce across replicas."""
    return tuple(sorted(holders)) not in {tuple(sorted(g.ranks)) for g in layout.groups if g.kind == "tp"}


class GradSync:
    """Fused per-hold-group gradient all-reduce for one stage model (see module docstring)."""

    def __init__(self, model, topo):
        self.topo = topo
        buckets: dict = {}
        for name, param in model.named_parameters():
            spec = model.shard_specs[name]
            ranks = topo.layout.holders[spec.block]
            buckets.setdefault(ranks, (topo.hold_groups[spec.block], []))[1].append((param, spec))
        self.buckets = [(ranks, group, entries) for ranks, (group, entries) in buckets.items()
                        if needs_reduce(topo.layout, ranks)]

    def sync(self) -> None:
        tp, tp_rank = self.topo.stage.tp, self.topo.tp_rank
        for _, group, entries in self.buckets:
            sizes = [math.prod(spec.full_shape) for _, spec in entries]
            param0 = entries[0][0]
            flat = torch.zeros(sum(sizes), dtype=param0.dtype, device=param0.device)
            views = [v.view(spec.full_shape) for v, (_, spec) in zip(flat.split(sizes), entries)]
            for view, (param, spec) in zip(views, entries):
                if param.grad is None or (spec.dim is None and tp_rank != 0):
                    continue
                spec.local(view, tp_rank, tp).copy_(param.grad)
            dist.all_reduce(flat, group=group)
            for view, (param, spec) in zip(views, entries):
                local = spec.local(view, tp_rank, tp)
                if param.grad is None:
                    param.grad = local.clone()
                else:
                    param.grad.copy_(local)


def global_grad_norm(model, topo) -> float:
    """L2 norm of the full gradient, every element counted once (all ranks call)."""
    sq = torch.zeros((), dtype=torch.float64, device=next(model.parameters()).device)
    for name, param in model.named_parameters():
        if param.grad is not None and _owns(topo, model.shard_specs[name]):
            sq += param.grad.detach().double().pow(2).sum()
    dist.all_reduce(sq)
    return float(sq.sqrt())


def clip_gradients(model, topo, max_norm: float) -> float:
    """Scale gradients so the global norm is at most max_norm (torch's clip_grad_norm_
    convention: factor max_norm / (norm + 1e-6)).  Returns the norm before clipping."""
    norm = global_grad_norm(model, topo)
    if max_norm > 0:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for param in model.parameters():
                if param.grad is not None:
                    param.grad.mul_(coef)
    return norm


def make_optimizer(model, lr: float, weight_decay: float, betas=(0.9, 0.95), eps=1e-8):
    """AdamW on the local shards; no weight decay for 1-D parameters (biases, norms)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (decay if len(model.shard_specs[name].full_shape) > 1 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps)


def gather_parameters(model, topo) -> dict | None:
    """Full parameters by logical name on rank 0 (None elsewhere); all ranks call."""
    local = {model.shard_specs[n].name: p for n, p in model.named_parameters()}
    device = next(model.parameters()).device
    out = {}
    for spec in all_specs(topo.plan.model):
        buf = torch.zeros(spec.full_shape, dtype=torch.float32, device=device)
        if spec.name in local and _owns(topo, spec):
            spec.local(buf, topo.tp_rank, topo.stage.tp).copy_(local[spec.name].detach())
        dist.reduce(buf, dst=0)
        if topo.rank == 0:
            out[spec.name] = buf.cpu()
    return out if topo.rank == 0 else None
