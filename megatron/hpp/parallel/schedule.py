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

Point-to-point follows megatron-core's ``p2p_communication``: every exchange is one
``torch.distributed.batch_isend_irecv`` call, and the steady state pairs a send with
the receive the neighbour posts at the same time (send_forward + recv_backward,
send_backward + recv_forward), so NCCL sees matching groups on both sides and the
schedule cannot deadlock; tags are (micro-batch, direction) so gloo matches messages
exactly.  Receives are waited at once.  Sends stay in flight while this rank
computes, but only until its next exchange (completed ones are dropped earlier), so
at most one exchange's sent tensors are alive besides the S - j in-flight
micro-batches 1F1B keeps for backward.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron.hpp.data.batches import overlaps

FORWARD, BACKWARD = 0, 1


@dataclass
class ComputeClock:
    """Times compute and, when emulating (CPU, speed > 0), stretches it by 1/speed.

    CPU: the compute of a call is the *CPU time* of the calling thread
    (``time.thread_time``) when torch runs single-threaded (``OMP_NUM_THREADS=1``, as
    every CPU run here does), else its wall time.  CPU time is what the call costs on a
    dedicated core: it does not grow when other processes share the cores (several
    ranks on a 2-core machine), and a tp all-reduce that waits inside a forward costs
    none (it is communication, not compute).  Emulating a device of ``emulate_speed`` s,
    a call whose compute is c lasts c / s: the clock sleeps until that much wall time has
    passed since the call started (no sleep when contention already made the call take
    longer; then the wall time is what it cost).  Without emulation (speed 0) a call
    counts its wall time.  The same convention as the CPU
    profiler (``megatron.hpp.profiling.ops``: op times are thread CPU time when single-threaded),
    so that a measured profile predicts these numbers on a loaded machine too.
    CUDA (``cuda_events``): a pair of CUDA events around every call, read once by
    :meth:`total_seconds` after the step, so timing never synchronises the device between ops."""

    emulate_speed: float = 0.0
    seconds: float = 0.0
    """Compute time of this step so far (CPU: including the emulation sleep)."""
    cuda_events: bool = False
    cpu_time: bool | None = None
    """CPU: measure compute as thread CPU time (None: when torch uses one thread)."""
    _events: list = field(default_factory=list, repr=False)

    def __post_init__(self):
        if self.cpu_time is None:
            self.cpu_time = not self.cuda_events and torch.get_num_threads() == 1

    def run(self, fn, *args):
        if self.cuda_events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args)
            end.record()
            self._events.append((start, end))
            return out
        t0, c0 = time.perf_counter(), time.thread_time()
        out = fn(*args)
        wall = time.perf_counter() - t0
        if self.emulate_speed > 0:
            target = ((time.thread_time() - c0) if self.cpu_time else wall) / self.emulate_speed
            if target > wall:
                time.sleep(target - wall)
            wall = max(target, wall)
        self.seconds += wall
        return out

    def total_seconds(self) -> float:
        """Compute seconds so far (CUDA: waits for the last recorded event)."""
        if self._events:
            self._events[-1][1].synchronize()
            self.seconds += sum(a.elapsed_time(b) for a, b in self._events) / 1e3
            self._events.clear()
        return self.seconds


@dataclass
class StageComm:
    """Point-to-point traffic of one rank with the neighbouring stages of its pipeline.

    The four megatron-style exchanges (:meth:`recv_forward`, :meth:`send_forward`,
    :meth:`send_forward_recv_backward`, :meth:`send_backward_recv_forward`, ...) each
    post their sends and receives as ONE batch (:meth:`_post`)."""

    topo: object
    shape: tuple
    """(rows, per-sample width) of what this rank receives forward: (seq_len, hidden), or
    (1, elements) of the boundary buffer when the stage starts inside a layer
    (``megatron.hpp.models.boundary.buffer_shape``)."""
    dtype: torch.dtype
    device: torch.device
    pending: list = field(default_factory=list)
    """(work, tensors) of sends not yet known to be complete (at most one exchange)."""
    max_pending: int = 0
    """Largest number of sends in flight at once (diagnostics and tests)."""
    out_shape: tuple | None = None
    """The same for the gradients it receives backward (what it sends forward); None:
    ``shape``."""

    def _tag(self, mb: int, direction: int) -> int:
        return 2 * mb + direction

    def _local(self, dp: int) -> int:
        return self.topo.pipe.mbs // dp

    # ---------------------------------------------------------------- op lists
    def _route(self, direction: int, sending: bool):
        """(overlap pairs, peer stage, is this rank the pairs' source side)."""
        topo, mbs = self.topo, self.topo.pipe.mbs
        if (direction == FORWARD) == sending:   # talk to the next stage
            nxt = topo.next_stage
            return overlaps(mbs, topo.stage.dp, nxt.dp), nxt, True
        prev = topo.prev_stage
        return overlaps(mbs, prev.dp, topo.stage.dp), prev, False

    def _send_ops(self, mb: int, direction: int, tensor: torch.Tensor) -> list:
        """(kind, tensor, peer rank, tag) of this rank's slices of ``tensor`` (tp root only)."""
        topo = self.topo
        if topo.tp_rank != 0:
            return []
        pairs, peer_stage, mine_is_src = self._route(direction, True)
        base, ops = topo.dp_rank * self._local(topo.stage.dp), []
        for src, dst, lo, hi in pairs:
            mine, peer = (src, dst) if mine_is_src else (dst, src)
            if mine == topo.dp_rank:
                part = tensor[:, lo - base:hi - base].contiguous()
                ops.append(("send", part, peer_stage.rank(0, peer), self._tag(mb, direction)))
        return ops

    def _recv_ops(self, mb: int, direction: int):
        """(ops, buffer, [(part, offset)]): receives of this rank's slices (tp root only)."""
        topo = self.topo
        seq, hidden = self.shape if direction == FORWARD or self.out_shape is None else self.out_shape
        buf = torch.empty(seq, self._local(topo.stage.dp), hidden, dtype=self.dtype, device=self.device)
        ops, parts = [], []
        if topo.tp_rank == 0:
            pairs, peer_stage, mine_is_src = self._route(direction, False)
            base = topo.dp_rank * self._local(topo.stage.dp)
            for src, dst, lo, hi in pairs:
                mine, peer = (src, dst) if mine_is_src else (dst, src)
                if mine != topo.dp_rank:
                    continue
                if len(pairs) == 1 or (lo - base == 0 and hi - lo == buf.shape[1]):
                    part = buf          # the whole slice comes from one peer: receive in place
                else:
                    part = torch.empty(seq, hi - lo, hidden, dtype=self.dtype, device=self.device)
                ops.append(("recv", part, peer_stage.rank(0, peer), self._tag(mb, direction)))
                parts.append((part, lo - base))
        return ops, buf, parts

    # ---------------------------------------------------------------- posting
    def _post(self, ops: list) -> list:
        """Start ``ops`` as one batch_isend_irecv; returns one work per op, or one for all
        (NCCL coalesces a batch into a single work)."""
        p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, peer, tag=tag)
               for kind, tensor, peer, tag in ops]
        return dist.batch_isend_irecv(p2p)

    def _drop_completed(self) -> None:
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]

    def _exchange(self, send=None, recv=None):
        """One batch: ``send`` = (mb, direction, tensor), ``recv`` = (mb, direction).
        Returns the received tensor (broadcast in the tp group) or None."""
        self.wait_sends()   # the previous exchange's sends: bounded memory, no reordering
        ops = self._send_ops(*send) if send is not None else []
        n_send = len(ops)
        buf = parts = None
        if recv is not None:
            recv_ops, buf, parts = self._recv_ops(*recv)
            ops += recv_ops
        if ops:
            works = self._post(ops)
            if len(works) == len(ops):   # one work per op (gloo): keep the sends in flight
                for work in works[n_send:]:
                    work.wait()
                self.pending = [(w, op[1]) for w, op in zip(works[:n_send], ops[:n_send])]
            else:                        # one work for the batch (NCCL): wait it
                for work in works:
                    work.wait()
            self.max_pending = max(self.max_pending, len(self.pending))
            self._drop_completed()
        if recv is None:
            return None
        for part, offset in parts:
            if part is not buf:
                buf[:, offset:offset + part.shape[1]].copy_(part)
        if self.topo.stage.tp > 1:
            dist.broadcast(buf, src=self.topo.tp_root, group=self.topo.tp_group)
        return buf

    # ---------------------------------------------------------------- exchanges
    def recv_forward(self, mb: int) -> torch.Tensor:
        return self._exchange(recv=(mb, FORWARD))

    def send_forward(self, mb: int, out: torch.Tensor) -> None:
        self._exchange(send=(mb, FORWARD, out))

    def recv_backward(self, mb: int) -> torch.Tensor:
        return self._exchange(recv=(mb, BACKWARD))

    def send_backward(self, mb: int, grad: torch.Tensor) -> None:
        self._exchange(send=(mb, BACKWARD, grad))

    def send_forward_recv_backward(self, mb: int, out: torch.Tensor, mb_back: int) -> torch.Tensor:
        return self._exchange(send=(mb, FORWARD, out), recv=(mb_back, BACKWARD))

    def send_backward_recv_forward(self, mb: int, grad: torch.Tensor, mb_next: int) -> torch.Tensor:
        return self._exchange(send=(mb, BACKWARD, grad), recv=(mb_next, FORWARD))

    def wait_sends(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def one_f_one_b(model, topo, comm: StageComm, get_batch, loss_scale: float,
                clock: ComputeClock, last_backward=None) -> torch.Tensor:
    """Run one training step's forward and backward passes of this rank's stage.

    ``get_batch(mb)`` returns (inputs, labels) of this rank's dp slice of micro-batch
    mb (inputs used on the first stage, labels on the last).  Returns the summed scaled
    loss of this rank's samples (zero off the last stage); gradients accumulate in
    the parameters' ``.grad`` (or wherever their hooks put them).  ``last_backward()``,
    if given, is called just before the last micro-batch's backward, so that gradient
    reduction can start as layers finish it.  Communication order is megatron-core's
    ``forward_backward_pipelining_without_interleaving``.
    """
    num_mb, num_stages, j = topo.pipe.num_microbatches, topo.num_stages, topo.stage_index
    first, last = topo.is_first, topo.is_last
    warmup = min(num_stages - j - 1, num_mb)
    steady = num_mb - warmup
    in_flight: deque = deque()
    loss = torch.zeros((), dtype=torch.float64)

    def forward(mb, received):
        nonlocal loss
        inputs, labels = get_batch(mb)
        if not first:
            inputs = received.requires_grad_(True)
        out = clock.run(model, inputs, labels, loss_scale)
        if last:
            loss += out.detach().double().cpu()
        in_flight.append((mb, inputs, out))
        return out

    def backward(grad):
        """Backward of the oldest in-flight micro-batch; returns (mb, input grad)."""
        mb, inputs, out = in_flight.popleft()
        if mb == num_mb - 1 and last_backward is not None:
            last_backward()
        clock.run(torch.autograd.backward, out, grad)
        return mb, (None if first else inputs.grad)

    for mb in range(warmup):
        out = forward(mb, None if first else comm.recv_forward(mb))
        if not last:
            comm.send_forward(mb, out.detach())
        del out
    received = comm.recv_forward(warmup) if steady > 0 and not first else None
    for i in range(steady):
        mb = warmup + i
        out = forward(mb, received)
        received = None
        back_mb = in_flight[0][0]
        grad = None if last else comm.send_forward_recv_backward(mb, out.detach(), back_mb)
        del out
        back_mb, input_grad = backward(grad)
        if i == steady - 1:
            if not first:
                comm.send_backward(back_mb, input_grad)
        elif first:
            received = None
        else:
            received = comm.send_backward_recv_forward(back_mb, input_grad, mb + 1)
    while in_flight:
        grad = None if last else comm.recv_backward(in_flight[0][0])
        back_mb, input_grad = backward(grad)
        if not first:
            comm.send_backward(back_mb, input_grad)
    comm.wait_sends()
    return loss
