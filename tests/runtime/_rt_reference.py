"""Single-process dense GPT written with plain torch ops: the ground truth the HPP
runtime must reproduce (same weights by logical name, same global batches, same
AdamW and clipping), independent of megatron-core and of the runtime's op code."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatron.hpp.data.batches import SyntheticData, batch
from eth.layout.params import all_specs
from megatron.hpp.models.gpt import LN_EPS, full_parameter


def forward_loss(spec, p, tokens):
    """Mean over samples of the per-sample mean token cross entropy."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    b, s = inputs.shape
    h, a, hd = spec.hidden, spec.heads, spec.head_dim
    x = p["embedding.word"][inputs] + p["embedding.pos"][:s]
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    for layer in range(spec.num_layers):
        w = lambda n: p[f"layer {layer}.{n}"]  # noqa: E731
        y = F.layer_norm(x, (h,), w("ln1.weight"), w("ln1.bias"), LN_EPS)
        qkv = (y @ w("qkv.weight").T + w("qkv.bias")).view(b, s, a, 3, hd)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        att = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(mask, float("-inf")).softmax(-1)
        ctx = (att @ v).transpose(1, 2).reshape(b, s, h)
        x = x + ctx @ w("dense.weight").T + w("dense.bias")
        y = F.layer_norm(x, (h,), w("ln2.weight"), w("ln2.bias"), LN_EPS)
        x = x + F.gelu(y @ w("fc1.weight").T + w("fc1.bias")) @ w("fc2.weight").T + w("fc2.bias")
    x = F.layer_norm(x, (h,), p["head.ln.weight"], p["head.ln.bias"], LN_EPS)
    logits = x @ p["head.out.weight"].T
    token_loss = F.cross_entropy(logits.reshape(-1, spec.vocab), labels.reshape(-1), reduction="none")
    return token_loss.view(b, s).mean(1).mean()


def reference_lr(it, lr, min_lr, warmup, iters):
    """Megatron's schedule, written out here independently of TrainConfig.lr_at: linear
    warm-up to ``lr`` over ``warmup`` steps, then half a cosine period down to ``min_lr``
    at step ``iters`` (constant ``lr`` when ``min_lr`` is None)."""
    if it < warmup:
        return lr * (it + 1) / warmup
    if min_lr is None:
        return lr
    done = min((it - warmup) / max(iters - warmup, 1), 1.0)
    return min_lr + (lr - min_lr) * (math.cos(math.pi * done) + 1) / 2


def train_reference(spec, gbs, iters, seed=1234, lr=1e-3, weight_decay=0.01, clip=1.0,
                    min_lr=None, warmup=0, forward=None):
    """Returns (losses, full parameters) after ``iters`` AdamW steps on whole global batches
    (``forward``: the model's loss function, :func:`forward_loss` by default)."""
    specs = all_specs(spec)
    p = {sp.name: full_parameter(spec, sp, seed).requires_grad_(True) for sp in specs}
    groups = [{"params": [p[s.name] for s in specs if len(s.full_shape) > 1], "weight_decay": weight_decay},
              {"params": [p[s.name] for s in specs if len(s.full_shape) == 1], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)
    data, losses = SyntheticData(spec.vocab, spec.seq_len, seed), []
    for it in range(iters):
        for group in opt.param_groups:
            group["lr"] = reference_lr(it, lr, min_lr, warmup, iters)
        opt.zero_grad(set_to_none=True)
        loss = (forward or forward_loss)(spec, p, batch(data, it, 0, gbs))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(p.values()), clip)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in p.items()}


def assert_same_params(got: dict, ref: dict, tol: float = 1e-5, what: str = "") -> None:
    """Every parameter of ``got`` within ``tol`` of ``ref``, but for at most two elements
    within 3 x ``tol``. AdamW divides by sqrt(v) + eps, so an element whose gradient
    nearly cancels turns fp32 rounding of a differently ordered sum (tp shards, other
    micro-batch splits) into a larger step: one element of the tiny model's fc2 weights
    ends 1.1-1.3e-5 off after 3 iterations on some hosts. A wrong gradient, update or
    parameter moves many elements, or one by far more."""
    assert set(got) == set(ref), (what, sorted(set(got) ^ set(ref)))
    diffs = torch.cat([(got[k] - ref[k]).abs().flatten() for k in ref])
    worst, over = diffs.max().item(), int((diffs >= tol).sum())
    assert worst < 3 * tol and over <= 2, (
        f"{what + ': ' if what else ''}largest parameter difference {worst:.3g}, {over} element(s) >= {tol}")
