"""The 1F1B schedule's point-to-point pattern, without processes.

Every rank of a 3-stage pipeline with resharding (dp 1 -> dp 2 -> dp 1) runs the real
``one_f_one_b`` and ``StageComm`` in this process; only ``StageComm._post`` (the one
call into torch.distributed) is replaced by a recorder whose sends complete only when
waited.  Checks:

* the batches two neighbours post to each other are complementary, one for one, in
  the same order (megatron's pairing: NCCL groups match on both sides);
* under rendezvous semantics (a batch finishes only once every op in it has its
  counterpart posted: NCCL's worst case) all ranks finish: no deadlock;
* at most one exchange's sends are in flight at any time (no send kept to the end).
"""
import torch

import _rt_plans as plans
from eth.spec.plan import PipelinePlan
from megatron.hpp.parallel.schedule import ComputeClock, StageComm, one_f_one_b
from megatron.hpp.parallel.topology import Layout, Topology

NUM_MB = 6


class _Work:
    def __init__(self):
        self.done = False

    def wait(self):
        self.done = True

    def is_completed(self):
        return self.done


def _plan():
    stages = [plans.stage([0], 1, 1, (0, 1)), plans.stage([1, 2], 1, 2, (1, 3)),
              plans.stage([3], 1, 1, (3, 4))]
    return plans.make(4, [PipelinePlan(2, 2 * NUM_MB, stages)], gbs=2 * NUM_MB)


class _Model(torch.nn.Module):
    """Stand-in stage: hidden = input * w (first stage: w broadcast to [s, b, h])."""

    def __init__(self, topo, shape):
        super().__init__()
        self.topo, self.shape = topo, shape
        self.w = torch.nn.Parameter(torch.ones(()))

    def forward(self, inputs, labels, scale):
        if self.topo.is_first:
            x = self.w * torch.ones(self.shape[0], inputs.shape[0], self.shape[1])
        else:
            x = inputs * self.w
        return (x.sum() * scale) if self.topo.is_last else x


def _run_rank(layout, rank, shape):
    topo = Topology(layout, rank, None, {})
    comm = StageComm(topo, shape, torch.float32, torch.device("cpu"))
    batches, in_flight = [], []

    def post(ops):
        batches.append([(kind, peer, tag) for kind, _, peer, tag in ops])
        works = []
        for kind, tensor, _, _ in ops:
            if kind == "recv":
                tensor.zero_()
            works.append(_Work())
        in_flight.append(len(comm.pending))
        return works

    comm._post = post
    local = topo.pipe.mbs // topo.stage.dp

    def get_batch(mb):
        return torch.zeros(local, shape[0], dtype=torch.long), torch.zeros(local, shape[0], dtype=torch.long)

    one_f_one_b(_Model(topo, shape), topo, comm, get_batch, 1.0, ComputeClock())
    assert not comm.pending
    return batches, comm.max_pending


def _records():
    plan = _plan()
    layout = Layout(plan, plan.world_size)
    shape = (plan.model.seq_len, plan.model.hidden)
    return layout, {r: _run_rank(layout, r, shape) for r in range(plan.world_size)}


def _toward(batches, peer):
    return [frozenset((kind, tag) for kind, p, tag in b if p == peer) for b in batches
            if any(p == peer for _, p, _ in b)]


def _flip(ops):
    return frozenset(("recv" if kind == "send" else "send", tag) for kind, tag in ops)


def test_neighbours_post_complementary_batches_in_order():
    layout, rec = _records()
    links = {(0, 1), (0, 2), (1, 3), (2, 3)}
    for a, b in links:
        mine, theirs = _toward(rec[a][0], b), _toward(rec[b][0], a)
        assert mine and mine == [_flip(x) for x in theirs], (a, b)
    # every message of every micro-batch crosses each link once in each direction
    assert sorted(t for b in _toward(rec[0][0], 1) for _, t in b) == list(range(2 * NUM_MB))
    # the middle stage pairs sends with receives in its steady state
    assert any({k for k, _, _ in b} == {"send", "recv"} for b in rec[1][0])


def test_no_deadlock_under_rendezvous_semantics():
    _, rec = _records()
    seqs = {r: batches for r, (batches, _) in rec.items()}
    pos = {r: 0 for r in seqs}
    while any(pos[r] < len(seqs[r]) for r in seqs):
        # a posted batch completes once the peers' posted batches hold every counterpart
        done = [r for r in seqs if pos[r] < len(seqs[r]) and all(
            pos[p] < len(seqs[p]) and (("recv" if k == "send" else "send"), r, t) in seqs[p][pos[p]]
            for k, p, t in seqs[r][pos[r]])]
        if not done:
            raise AssertionError(f"deadlock at batch positions {pos}: "
                                 f"{ {r: seqs[r][pos[r]] for r in seqs if pos[r] < len(seqs[r])} }")
        for r in done:
            pos[r] += 1


def test_sends_are_released_as_the_schedule_goes():
    _, rec = _records()
    # one exchange sends at most 2 slices (dp 1 -> dp 2); 6 micro-batches would keep
    # 6-12 sends alive if they were only waited at the end of the step
    for rank, (batches, max_pending) in rec.items():
        assert 1 <= max_pending <= 2, (rank, max_pending)


def test_compute_clock_cpu_path_stretches_by_speed():
    import time

    def busy(cpu_s):   # compute: spins until this thread has used cpu_s of CPU time
        t0 = time.thread_time()
        while time.thread_time() - t0 < cpu_s:
            pass

    clock = ComputeClock(emulate_speed=0.5, cpu_time=True)
    start = time.perf_counter()
    clock.run(busy, 0.03)
    # 0.03 s of CPU at speed 0.5 lasts >= 0.06 s, on the clock and on the wall
    assert clock.total_seconds() >= 0.06 - 1e-6 and time.perf_counter() - start >= 0.06 - 1e-3
    waiting = ComputeClock(emulate_speed=0.5, cpu_time=True)
    start = time.perf_counter()
    waiting.run(time.sleep, 0.02)   # waiting (e.g. for a tp peer) is not compute: not stretched
    assert 0.02 <= waiting.total_seconds() <= time.perf_counter() - start
