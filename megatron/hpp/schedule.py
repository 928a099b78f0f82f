"""Per-pipeline 1F1B with stage-boundary resharding, and CPU speed emulation.

Every pipeline runs its own number of micro-batches M = lbs / mbs; pipelines never
talk to each other during the schedule (they meet in grad_sync).  Stage j of S runs
min(S - j - 1, M) warm-up forwards, then alternates one forward / one backward, then
drains the remaining backwards (megatron-core's non-interleaved order; written here
because megatron's schedule assumes one uniform tp/dp grid and one micro-batch count).

Resharding between stages of different (tp, dp): a micro-batch's mbs samples are
split contiguously over a stage's dp replicas; the tp ranks of one replica hold the
same activations.  Tp rank 0 of each sending replica sends every overlapping sample
slice to tp rank 0 of each receiving replica (``data.overlaps``), which concatenates
them and broadcasts inside its tp group.  Gradients travel the same way backwards.
Sends are non-blocking (isend, waited at the end of the step), receives blocking, so
the 1F1B order cannot deadlock; tags are (micro-batch, direction) so gloo matches
messages exactly.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron.hpp.data import overlaps

FORWARD, BACKWARD = 0, 1


@dataclass
class ComputeClock:
    """Times compute and, when emulating (CPU, speed > 0), stretches it by 1/speed."""

    emulate_speed: float = 0.0
    seconds: float = 0.0
    """Compute time of this step so far, including the emulation sleep."""
    synchronize: object = None
    """Called before reading the clock (CUDA: wait for the kernels); None on CPU."""

    def run(self, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        if self.synchronize is not None:
            self.synchronize()
        dt = time.perf_counter() - t0
        if self.emulate_speed > 0 and self.emulate_speed != 1.0:
            extra = dt * (1.0 / self.emulate_speed - 1.0)
            if extra > 0:
                time.sleep(extra)
            dt += max(extra, 0.0)
        self.seconds += dt
        return out


@dataclass
class StageComm:
    """Point-to-point traffic of one rank with the neighbouring stages of its pipeline."""

    topo: object
    shape: tuple
    """(seq_len, hidden) of the activations."""
    dtype: torch.dtype
    device: torch.device
    pending: list = field(default_factory=list)

    def _tag(self, mb: int, direction: int) -> int:
        return 2 * mb + direction

    def _local(self, dp: int) -> int:
        return self.topo.pipe.mbs // dp

    def _gather(self, mb, direction, pairs, peer_stage, mine_is_dst) -> torch.Tensor:
        """Receive the overlapping slices (tp root), then broadcast in the tp group."""
        topo, seq, hidden = self.topo, *self.shape
        buf = torch.empty(seq, self._local(topo.stage.dp), hidden, dtype=self.dtype, device=self.device)
        if topo.tp_rank == 0:
            base = topo.dp_rank * self._local(topo.stage.dp)
            works = []
            for src, dst, lo, hi in pairs:
                peer, mine = (src, dst) if mine_is_dst else (dst, src)
                if mine != topo.dp_rank:
                    continue
                part = torch.empty(seq, hi - lo, hidden, dtype=self.dtype, device=self.device)
                works.append((dist.irecv(part, peer_stage.rank(0, peer), tag=self._tag(mb, direction)),
                              part, lo - base))
            for work, part, offset in works:
                work.wait()
                buf[:, offset:offset + part.shape[1]].copy_(part)
        if topo.stage.tp > 1:
            dist.broadcast(buf, src=topo.tp_root, group=topo.tp_group)
        return buf

    def _scatter(self, mb, direction, tensor, pairs, peer_stage, mine_is_src) -> None:
        topo = self.topo
        if topo.tp_rank != 0:
            return
        base = topo.dp_rank * self._local(topo.stage.dp)
        for src, dst, lo, hi in pairs:
            mine, peer = (src, dst) if mine_is_src else (dst, src)
            if mine != topo.dp_rank:
                continue
            part = tensor[:, lo - base:hi - base].contiguous()
            self.pending.append((dist.isend(part, peer_stage.rank(0, peer),
                                            tag=self._tag(mb, direction)), part))

    def recv_forward(self, mb: int) -> torch.Tensor:
        prev, mbs = self.topo.prev_stage, self.topo.pipe.mbs
        return self._gather(mb, FORWARD, overlaps(mbs, prev.dp, self.topo.stage.dp), prev, True)

    def send_forward(self, mb: int, out: torch.Tensor) -> None:
        nxt, mbs = self.topo.next_stage, self.topo.pipe.mbs
        self._scatter(mb, FORWARD, out, overlaps(mbs, self.topo.stage.dp, nxt.dp), nxt, True)

    def recv_backward(self, mb: int) -> torch.Tensor:
        nxt, mbs = self.topo.next_stage, self.topo.pipe.mbs
        return self._gather(mb, BACKWARD, overlaps(mbs, self.topo.stage.dp, nxt.dp), nxt, False)

    def send_backward(self, mb: int, grad: torch.Tensor) -> None:
        prev, mbs = self.topo.prev_stage, self.topo.pipe.mbs
        self._scatter(mb, BACKWARD, grad, overlaps(mbs, prev.dp, self.topo.stage.dp), prev, False)

    def wait_sends(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def one_f_one_b(model, topo, comm: StageComm, get_batch, loss_scale: float,
                clock: ComputeClock) -> torch.Tensor:
    """Run one training step's forward and backward passes of this rank's stage.

    ``get_batch(mb)`` returns (inputs, labels) of this rank's dp slice of micro-batch
    mb (inputs used on the first stage, labels on the last).  Returns the summed scaled
    loss of this rank's samples (zero off the last stage); gradients accumulate in
    the parameters' ``.grad``.
    """
    num_mb, num_stages, j = topo.pipe.num_microbatches, topo.num_stages, topo.stage_index
    warmup = min(num_stages - j - 1, num_mb)
    in_flight: deque = deque()
    loss = torch.zeros((), dtype=torch.float64)

    def forward(mb):
        nonlocal loss
        inputs, labels = get_batch(mb)
        if not topo.is_first:
            inputs = comm.recv_forward(mb).requires_grad_(True)
        out = clock.run(model, inputs, labels, loss_scale)
        if topo.is_last:
            loss += out.detach().double().cpu()
        else:
            comm.send_forward(mb, out.detach())
        in_flight.append((mb, inputs, out))

    def backward():
        mb, inputs, out = in_flight.popleft()
        grad = None if topo.is_last else comm.recv_backward(mb)
        clock.run(torch.autograd.backward, out, grad)
        if not topo.is_first:
            comm.send_backward(mb, inputs.grad)

    for mb in range(warmup):
        forward(mb)
    for i in range(num_mb - warmup):
        forward(warmup + i)
        backward()
    while in_flight:
        backward()
    comm.wait_sends()
    return loss
