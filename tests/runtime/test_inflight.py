"""Micro-batches in flight under 1F1B: what the schedule keeps against what memory assumes.

The cost model (eth/cost/model.py, memory of a stage) charges stage j of a pipeline with S
stages and M micro-batches for min(S - j, M) micro-batches of saved activations.  Here
every rank of a plan runs the real ``one_f_one_b`` and ``StageComm`` in this process
(only ``StageComm._post``, the one call into torch.distributed, completes at once), and
``torch.autograd.graph.saved_tensors_hooks`` tags every tensor autograd saves with the
micro-batch being computed; a tag's count drops when autograd frees the tensor after
that micro-batch's backward.  The peak number of micro-batches with saved tensors
alive is compared with min(S - j, M) written out by hand and with
``CostModel.pipeline_costs(...)[j].inflight``, for plans with more micro-batches than
stages and fewer (a warm-up of S - j micro-batches instead of S - j - 1 keeps one more
alive whenever M > S - j).
"""
import weakref

import pytest
import torch

import _rt_plans as plans
from eth.cost.model import CostModel
from eth.spec.plan import PipelinePlan
from eth.profiles.db import ProfileDB
from megatron.hpp.parallel.schedule import ComputeClock, StageComm, one_f_one_b
from megatron.hpp.parallel.topology import Layout, Topology
from test_schedule_p2p import _Model


class _Done:
    """A p2p work that has completed."""

    def wait(self):
        pass

    def is_completed(self):
        return True


class _Saved:
    """What autograd keeps for one saved tensor (so that its release can be seen)."""

    def __init__(self, tensor):
        self.tensor = tensor


class _Alive:
    """Counts, per micro-batch, the tensors autograd holds for backward."""

    def __init__(self):
        self.current = None
        self.count: dict[int, int] = {}
        self.peak = 0

    def pack(self, tensor):
        mb = self.current
        self.count[mb] = self.count.get(mb, 0) + 1
        self.peak = max(self.peak, sum(1 for n in self.count.values() if n > 0))
        saved = _Saved(tensor)
        weakref.finalize(saved, self._freed, mb)
        return saved

    @staticmethod
    def unpack(saved):
        return saved.tensor

    def _freed(self, mb):
        self.count[mb] -= 1


def peak_in_flight(layout, rank, shape) -> int:
    """Largest number of micro-batches whose saved activations are alive at once on
    ``rank`` during one 1F1B step."""
    topo = Topology(layout, rank, None, {})
    comm = StageComm(topo, shape, torch.float32, torch.device("cpu"))

    def post(ops):
        for kind, tensor, _, _ in ops:
            if kind == "recv":
                tensor.zero_()
        return [_Done() for _ in ops]

    comm._post = post
    alive = _Alive()
    local = topo.pipe.mbs // topo.stage.dp

    def get_batch(mb):
        alive.current = mb      # the forward that follows computes micro-batch mb
        return torch.zeros(local, shape[0], dtype=torch.long), torch.zeros(local, shape[0], dtype=torch.long)

    with torch.autograd.graph.saved_tensors_hooks(alive.pack, alive.unpack):
        # the p2p test's stand-in stage: autograd saves each micro-batch's input until its backward
        one_f_one_b(_Model(topo, shape), topo, comm, get_batch, 1.0, ComputeClock())
    assert all(n == 0 for n in alive.count.values()), alive.count   # everything freed at the end
    return alive.peak


def _one(n_stages, mbs, num_mb, dp_middle=1):
    """One pipeline of ``n_stages`` one-layer stages (tiny has 4 layers); with
    ``dp_middle`` > 1 stage 1 has that many dp replicas (resharding on both sides)."""
    stages, rank = [], 0
    for j in range(n_stages):
        dp = dp_middle if j == 1 else 1
        layers = (j, j + 1) if j < n_stages - 1 else (j, 4)
        stages.append(plans.stage(range(rank, rank + dp), 1, dp, layers))
        rank += dp
    return plans.make(rank, [PipelinePlan(mbs, mbs * num_mb, stages)], gbs=mbs * num_mb)


def _two():
    """Pipeline 0: 3 stages (dp 1 -> dp 2 -> dp 1), 5 micro-batches; pipeline 1: 2
    stages, 1 micro-batch."""
    p0 = [plans.stage([0], 1, 1, (0, 1)), plans.stage([1, 2], 1, 2, (1, 3)), plans.stage([3], 1, 1, (3, 4))]
    p1 = [plans.stage([4], 1, 1, (0, 2)), plans.stage([5], 1, 1, (2, 4))]
    return plans.make(6, [PipelinePlan(2, 10, p0), PipelinePlan(2, 2, p1)], gbs=12)


# expected per pipeline and stage, written out as min(S - j, M)
CASES = {
    "S=4, M=6 (more micro-batches than stages)": (_one(4, 1, 6), [[4, 3, 2, 1]]),
    "S=4, M=4": (_one(4, 1, 4), [[4, 3, 2, 1]]),
    "S=4, M=2 (fewer micro-batches than stages)": (_one(4, 1, 2), [[2, 2, 2, 1]]),
    "S=3, M=1": (_one(3, 2, 1), [[1, 1, 1]]),
    "S=3 with a dp 2 stage, M=5; S=2, M=1": (_two(), [[3, 2, 1], [1, 1]]),
    "S=3 with a dp 2 stage, M=2": (_one(3, 2, 2, dp_middle=2), [[2, 2, 1]]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_peak_in_flight_micro_batches_match_the_memory_model(name):
    plan, expected = CASES[name]
    layout = Layout(plan, plan.world_size)
    shape = (plan.model.seq_len, plan.model.hidden)
    db = ProfileDB()
    db.ensure(plan.model, plan.cluster.types.values())
    cost = CostModel(plan.model, plan.cluster, db)
    for i, (pipe, want) in enumerate(zip(plan.pipelines, expected)):
        assert [c.inflight for c in cost.pipeline_costs(pipe)] == want, (i, "cost model")
        for j, st in enumerate(pipe.stages):
            got = [peak_in_flight(layout, r, shape) for r in st.ranks]
            assert got == [want[j]] * len(st.ranks), (f"pipeline {i} stage {j} of {len(pipe.stages)}, "
                                                       f"{pipe.num_microbatches} micro-batches", got, want[j])
