"""Validation loss during training (Megatron's ``--eval-interval`` / ``--eval-iters``).

Every ``eval_interval`` iterations, and once after the last one, each pipeline runs its
share of ``eval_iters`` validation global batches forward only: the same uneven local
batches, micro-batches and stage resharding as training, no dropout, no autograd, no
gradient hooks.  The loss is the mean per-sample loss over those batches, exactly what
one process would compute on the same samples with the same weights.

Which batches: evaluation number ``k`` (the one after iteration ``k * eval_interval``;
the final one is number ``train_iters // eval_interval``) reads validation global
batches ``[(k - 1) * eval_iters, k * eval_iters)``, as Megatron's validation iterator
advances from one evaluation to the next; the numbering depends only on the iteration,
so a resumed run reads the same batches as an uninterrupted one.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


def valid_batches_needed(train_iters: int, eval_interval: int | None, eval_iters: int) -> int:
    """Validation global batches a run of ``train_iters`` reads (0: no evaluation)."""
    if not eval_interval or eval_iters <= 0:
        return 0
    return (train_iters // eval_interval + 1) * eval_iters


def eval_due(done: int, train_iters: int, eval_interval: int | None, eval_iters: int) -> bool:
    """Whether to evaluate after ``done`` iterations."""
    if not eval_interval or eval_iters <= 0:
        return False
    return done % eval_interval == 0 or done == train_iters


def first_batch(done: int, eval_interval: int, eval_iters: int) -> int:
    """Index of the first validation global batch of the evaluation after ``done`` iterations."""
    return (math.ceil(done / eval_interval) - 1) * eval_iters


@torch.no_grad()
def forward_only(model, topo, comm, get_batch, loss_scale: float, clock) -> torch.Tensor:
    """All of this pipeline's micro-batches forward through this rank's stage (receive,
    compute, send); returns the summed scaled loss of this rank's samples (zero off the
    last stage)."""
    loss = torch.zeros((), dtype=torch.float64)
    for mb in range(topo.pipe.num_microbatches):
        inputs, labels = get_batch(mb)
        if not topo.is_first:
            inputs = comm.recv_forward(mb)
        out = clock.run(model, inputs, labels, loss_scale)
        if topo.is_last:
            loss += out.double().cpu()
        else:
            comm.send_forward(mb, out)
    comm.wait_sends()
    return loss


def evaluate(trainer, done: int) -> float:
    """Mean validation loss after ``done`` iterations (every rank gets the same value).
    The model is back in training mode afterwards."""
    from megatron.hpp.parallel.schedule import ComputeClock

    cfg, topo, plan = trainer.cfg, trainer.topo, trainer.plan
    first = first_batch(done, cfg.eval_interval, cfg.eval_iters)
    total = torch.zeros((), dtype=torch.float64)
    trainer.model.eval()
    try:
        for k in range(cfg.eval_iters):
            clock = ComputeClock(trainer.speed, cuda_events=not trainer.backend.is_cpu)
            loss = forward_only(trainer.model, topo, trainer.comm,
                                lambda mb, it=first + k: trainer.batch(trainer.valid_source, it, mb),
                                1.0 / plan.gbs, clock)
            if topo.tp_rank == 0:
                total += loss
    finally:
        trainer.model.train()
    summed = total.to(trainer.backend.device)
    dist.all_reduce(summed)   # sum over the last stages' tp-rank-0 replicas of every pipeline
    return float(summed) / cfg.eval_iters


def eval_line(done: int, loss: float, eval_iters: int) -> str:
    """Rank 0's log line (Megatron's numbers: lm loss and its perplexity)."""
    ppl = math.exp(min(loss, 20.0))
    return f"validation loss at iteration {done} | lm loss {loss:.6f} | lm loss PPL {ppl:.4f} | " \
           f"{eval_iters} global batch(es)"
