"""Event-driven simulator of one HPP training iteration (an independent check of Eq. 5).

The cost model predicts a plan's time with closed forms (Eq. 1, Eq. 5 + Eq. 6).  This
module instead *plays* the iteration: every forward, backward, recompute, p2p transfer,
gradient All-Reduce and optimizer step is an event with a start and an end, and an
event starts only when what it depends on has finished.  The result is an iteration
time, per-stage busy/idle times and a timeline (:class:`Event` list) for a Gantt chart.

Event model (docs/SIMULATOR.md has the longer version):

* Resources.  Each stage (all its tp x dp devices in lockstep) has one *compute
  stream* that runs one compute event at a time, and one *comm stream* used after the
  pipeline phase by the gradient All-Reduces.  Each pipeline boundary j -> j+1 has two
  *links* (activations forward, gradients backward) that carry one transfer at a time,
  FIFO.  Transfers do not occupy the compute stream (asynchronous isend/irecv).
* 1F1B order per stage (:func:`one_f_one_b_order`): stage j of S with M = lbs / mbs
  micro-batches runs w = min(S - j, M) warm-up forwards, then alternates one backward
  and one forward until all M forwards ran, then the remaining (cool-down) backwards.
* Dependencies.  F(0, m) is ready at t = 0.  F(j, m) needs F(j-1, m) finished and its
  activation transfer arrived.  B(S-1, m) needs F(S-1, m).  B(j, m) needs B(j+1, m)
  finished and its gradient transfer arrived.  A stage takes its next op in 1F1B order
  as soon as the op is ready and the stream is free (no reordering).  A backward of a
  stage with recomputation is drawn as a recompute event followed by the rest of the
  backward; together they last the cost model's backward compute time.
* All-Reduce.  Gradients are reduced per *block* (``eth.cost.sync.sync_blocks``): a
  maximal set of parameters held by the same set of stages (one stage per pipeline),
  i.e. the layer segments cut by every pipeline's stage boundaries, with the embedding
  and head added to the first/last stages' blocks and blocks with the same holder set
  fused (paper section 4.3).  As the runtime does (one asynchronous collective per
  holder set, ``megatron.hpp.distributed.grad_sync``), a block's reduction starts when
  ALL its holders finished their last backward, whatever other blocks are in flight,
  and reductions run concurrently, sharing each stage's link: a block at full speed
  takes its lowest-tp holder's Eq. 6 time and uses the fraction holder time / that of
  every holder's link; the links' capacity is shared max-min fairly among the blocks in
  flight (progressive filling, recomputed whenever a block starts or ends;
  :mod:`eth.cost.reduction`, which also gives this iteration without the timeline).
* Optimizer step.  After a stage's last block is reduced: the cost model's step
  (:meth:`eth.cost.model.CostModel.step_after_sync_ms`: the measured "optimizer" and
  "step" overheads, or AdamW streamed through device memory).

Durations come from :class:`eth.cost.model.CostModel` (:func:`plan_timings`): the stage's
``fwd_ms``/``bwd_ms`` minus the p2p send the cost model folded into them become the
compute events (TP collectives stay inside compute: they block the compute stream);
the sends become transfer events.  Nothing here uses the closed form of Eq. 5.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from eth.cost.equations import StageCost
from eth.cost.model import CostModel
from eth.cost.reduction import reduce_blocks
from eth.cost.sync import SyncBlock
from eth.profiles.db import ProfileDB

KINDS = ("forward", "backward", "recompute", "comm", "allreduce", "optimizer")
COMPUTE_KINDS = ("forward", "recompute", "backward")


@dataclass(frozen=True)
class SimOptions:
    """Knobs of the parts of the iteration the cost model does not describe."""

    optimizer: bool = True
    """Simulate the optimizer step at all."""


@dataclass(frozen=True)
class StageTiming:
    """Per-micro-batch durations (ms) of one stage, as the simulator consumes them."""

    fwd_ms: float
    """Forward compute (incl. TP collectives), without the send to the next stage."""
    bwd_ms: float
    """Backward compute incl. recompute, without the send to the previous stage."""
    recompute_ms: float = 0.0
    """Part of bwd_ms spent re-running forward ops."""
    send_fwd_ms: float = 0.0
    """Transfer of the output activation to the next stage (ignored on the last stage)."""
    send_bwd_ms: float = 0.0
    """Transfer of the input gradient to the previous stage (ignored on the first stage)."""
    optimizer_ms: float = 0.0
    """Optimizer step and the rest of the training step after the stage's gradients
    are reduced (once per iteration)."""

    def __post_init__(self):
        for name in ("fwd_ms", "bwd_ms", "recompute_ms", "send_fwd_ms", "send_bwd_ms", "optimizer_ms"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"StageTiming.{name} must be >= 0, got {getattr(self, name)}")
        if self.recompute_ms > self.bwd_ms + 1e-12:
            raise ValueError(f"recompute_ms {self.recompute_ms} exceeds bwd_ms {self.bwd_ms}")

    @classmethod
    def from_cost(cls, cost: StageCost, **extra) -> "StageTiming":
        """A timing whose compute is the whole of ``cost`` (no separate transfers)."""
        return cls(cost.fwd_ms, cost.bwd_ms, cost.recompute_ms, **extra)


@dataclass(frozen=True)
class PipelineTiming:
    num_microbatches: int
    """M = lbs / mbs."""
    stages: tuple[StageTiming, ...]

    def __post_init__(self):
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if not self.stages:
            raise ValueError("a pipeline needs at least one stage")


@dataclass(frozen=True)
class Event:
    """One interval of the timeline."""

    pipeline: int
    stage: int
    """For "comm": the sending stage."""
    kind: str
    """One of KINDS."""
    microbatch: int | None
    start_ms: float
    end_ms: float
    peer: int | None = None
    """For "comm": the receiving stage of the same pipeline."""
    label: str = ""
    """For "allreduce": the block (e.g. "emb+L0-5")."""

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass(frozen=True)
class StageStats:
    """Where the time of one stage's devices went."""

    pipeline: int
    stage: int
    ranks: tuple[int, ...]
    compute_ms: float
    """Forward + recompute + backward events."""
    allreduce_ms: float
    """What the stage's link carries of the gradient reduction: its share's Eq. 6 time
    summed over its blocks (in flight, a block may take longer: shared links, late partners)."""
    optimizer_ms: float
    last_backward_ms: float
    """End of the stage's last backward."""
    end_ms: float
    """End of the stage's optimizer step (or last All-Reduce / backward)."""
    iteration_ms: float

    @property
    def busy_ms(self) -> float:
        return self.compute_ms + self.allreduce_ms + self.optimizer_ms

    @property
    def idle_ms(self) -> float:
        """Everything else in the iteration (pipeline bubbles and waiting for others)."""
        return self.iteration_ms - self.busy_ms

    @property
    def bubble_ms(self) -> float:
        """Idle time inside the 1F1B phase (before the stage's last backward)."""
        return self.last_backward_ms - self.compute_ms


@dataclass
class SimResult:
    iteration_ms: float
    stages: list[list[StageStats]]
    """stages[i][j]: pipeline i, stage j."""
    events: list[Event] = field(repr=False)

    @property
    def pipeline_ms(self) -> list[float]:
        """End of the last backward of each pipeline (before All-Reduce)."""
        return [max(s.last_backward_ms for s in row) for row in self.stages]

    def device_busy_ms(self) -> dict[int, float]:
        """Busy time of every global rank (each rank of a stage is busy as its stage)."""
        return {r: s.busy_ms for row in self.stages for s in row for r in s.ranks}

    def stage_events(self, pipeline: int, stage: int, kinds=KINDS) -> list[Event]:
        return [e for e in self.events
                if e.pipeline == pipeline and e.stage == stage and e.kind in kinds]


# ---------------------------------------------------------------------- schedule
def one_f_one_b_order(stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
    """The op sequence ("F"/"B", micro-batch) of ``stage`` (0-based) under 1F1B."""
    m = num_microbatches
    warm = min(num_stages - stage, m)
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("B", i), ("F", warm + i)]
    order += [("B", i) for i in range(m - warm, m)]
    return order


def simulate_timings(pipelines: Sequence[PipelineTiming], blocks: Sequence[SyncBlock] = (),
                     ranks: Sequence[Sequence[tuple[int, ...]]] | None = None) -> SimResult:
    """Simulate pipelines given per-stage timings and gradient blocks.

    ``ranks[i][j]`` (optional) are the global ranks of stage j of pipeline i, used only
    to report per-device busy time.
    """
    for b in blocks:
        if len(b.holder_ms) != len(b.holders):
            raise ValueError(f"all-reduce block {b.label!r}: {len(b.holders)} holders, {len(b.holder_ms)} times")
        for p, j in b.holders:
            if not (0 <= p < len(pipelines) and 0 <= j < len(pipelines[p].stages)):
                raise ValueError(f"all-reduce block {b.label!r} names stage ({p}, {j}) which does not exist")
    events: list[Event] = []
    last_bwd = _run_pipelines(pipelines, events)
    reduced = _reduce_blocks(blocks, last_bwd, events)
    ar_ms = {key: 0.0 for key in last_bwd}
    for b in blocks:
        for h, ms in zip(b.holders, b.holder_ms):
            ar_ms[h] += ms

    # optimizer step after each stage's last All-Reduce
    stage_end = {}
    for (p, j), t in reduced.items():
        opt = pipelines[p].stages[j].optimizer_ms
        if opt > 0:
            events.append(Event(p, j, "optimizer", None, t, t + opt))
        stage_end[(p, j)] = t + opt
    iteration = max(stage_end.values())

    stats = []
    for p, pipe in enumerate(pipelines):
        row = []
        for j, st in enumerate(pipe.stages):
            row.append(StageStats(
                p, j, tuple(ranks[p][j]) if ranks else (),
                compute_ms=pipe.num_microbatches * (st.fwd_ms + st.bwd_ms),
                allreduce_ms=ar_ms[(p, j)], optimizer_ms=st.optimizer_ms,
                last_backward_ms=last_bwd[(p, j)], end_ms=stage_end[(p, j)], iteration_ms=iteration))
        stats.append(row)
    events.sort(key=lambda e: (e.start_ms, e.pipeline, e.stage, KINDS.index(e.kind)))
    return SimResult(iteration, stats, events)


def _reduce_blocks(blocks: Sequence[SyncBlock], last_bwd: dict, events: list[Event]) -> dict:
    """Play the gradient reduction (:func:`eth.cost.reduction.reduce_blocks`); append one
    "allreduce" event per block and holder; return (pipeline, stage) -> when its last
    block is reduced."""
    done, start, finish = reduce_blocks(blocks, last_bwd)
    for b, s, f in zip(blocks, start, finish):
        if b.duration_ms > 0:
            for p, j in b.holders:
                events.append(Event(p, j, "allreduce", None, s, f, label=b.label))
    return done


def _run_pipelines(pipelines: Sequence[PipelineTiming], events: list[Event]) -> dict[tuple[int, int], float]:
    """Play the 1F1B phase of every pipeline; append events; return last-backward ends.

    A priority queue holds future happenings ``(time, seq, what, pipeline, stage, op, mb)``:
    "done" (a compute op finished on a stage) and "arrive" (an op's input reached a
    stage).  Both mark something ready and then let the stage start its next op if
    that op's input is there and the stream is idle.  Times only grow, so an op
    starts at the moment the later of "stream free" and "input arrived" is processed.
    """
    orders = {(p, j): one_f_one_b_order(j, len(pipe.stages), pipe.num_microbatches)
              for p, pipe in enumerate(pipelines) for j in range(len(pipe.stages))}
    position = {key: 0 for key in orders}       # index of the stage's next op
    busy = {key: False for key in orders}        # compute stream occupied
    arrived: dict[tuple, float] = {}             # (p, j, op, mb) -> time the input arrived
    link_free: dict[tuple, float] = {}           # (p, j, direction) -> link idle from
    last_bwd = {key: 0.0 for key in orders}
    queue: list[tuple] = []
    seq = 0

    def push(time, what, p, j, op, mb):
        nonlocal seq
        heapq.heappush(queue, (time, seq, what, p, j, op, mb))
        seq += 1

    def try_start(p, j, now):
        key = (p, j)
        if busy[key] or position[key] == len(orders[key]):
            return
        op, mb = orders[key][position[key]]
        if (p, j, op, mb) not in arrived:
            return
        st = pipelines[p].stages[j]
        if op == "F":
            events.append(Event(p, j, "forward", mb, now, now + st.fwd_ms))
            end = now + st.fwd_ms
        else:
            if st.recompute_ms > 0:
                events.append(Event(p, j, "recompute", mb, now, now + st.recompute_ms))
            events.append(Event(p, j, "backward", mb, now + st.recompute_ms, now + st.bwd_ms))
            end = now + st.bwd_ms
        busy[key] = True
        position[key] += 1
        push(end, "done", p, j, op, mb)

    def send(p, j, to, op, mb, duration, now):
        """Transfer op's input to stage ``to`` over the (j, direction) link."""
        link = (p, min(j, to), op)
        start = max(now, link_free.get(link, 0.0))
        end = start + duration
        link_free[link] = end
        if duration > 0:
            events.append(Event(p, j, "comm", mb, start, end, peer=to))
        push(end, "arrive", p, to, op, mb)

    for p, pipe in enumerate(pipelines):
        for mb in range(pipe.num_microbatches):
            arrived[(p, 0, "F", mb)] = 0.0
    for key in orders:
        try_start(*key, 0.0)

    while queue:
        now, _, what, p, j, op, mb = heapq.heappop(queue)
        if what == "arrive":
            arrived[(p, j, op, mb)] = now
            try_start(p, j, now)
            continue
        busy[(p, j)] = False
        num_stages = len(pipelines[p].stages)
        st = pipelines[p].stages[j]
        if op == "F" and j + 1 < num_stages:
            send(p, j, j + 1, "F", mb, st.send_fwd_ms, now)
        elif op == "F":
            arrived[(p, j, "B", mb)] = now      # the last stage turns around at once
        elif j > 0:
            send(p, j, j - 1, "B", mb, st.send_bwd_ms, now)
        if op == "B":
            last_bwd[(p, j)] = max(last_bwd[(p, j)], now)
        try_start(p, j, now)

    stuck = [key for key in orders if position[key] != len(orders[key])]
    if stuck:  # cannot happen for 1F1B orders; guards the scheduler itself
        raise RuntimeError(f"1F1B simulation stalled on stages {stuck}")
    return last_bwd


# ---------------------------------------------------------------------- from a plan
def plan_timings(plan, cost_model: CostModel, options: SimOptions = SimOptions()
                 ) -> tuple[list[PipelineTiming], list[SyncBlock]]:
    """Stage timings and gradient blocks of ``plan`` from the cost model."""
    pipelines = []
    world = plan.world_size
    for p in plan.pipelines:
        costs = cost_model.pipeline_costs(p)
        stages = []
        for st, c in zip(p.stages, costs):
            opt = cost_model.step_after_sync_ms(p, st, c, world) if options.optimizer else 0.0
            # the cost model folds the boundary sends into fwd/bwd; the simulator runs
            # them as separate transfer events, unless they block both ends
            # (CostModel.p2p_blocking): then sender and receiver compute streams hold them
            sends = (0.0, 0.0) if cost_model.p2p_blocking else (c.send_fwd_ms, c.send_bwd_ms)
            stages.append(StageTiming(fwd_ms=c.fwd_ms - sends[0], bwd_ms=c.bwd_ms - sends[1],
                                      recompute_ms=c.recompute_ms, send_fwd_ms=sends[0],
                                      send_bwd_ms=sends[1], optimizer_ms=opt))
        pipelines.append(PipelineTiming(p.num_microbatches, tuple(stages)))
    return pipelines, cost_model.sync_blocks(plan.pipelines)


def simulate(plan, cost_model: CostModel | None = None, profiles: ProfileDB | None = None,
             options: SimOptions = SimOptions()) -> SimResult:
    """Simulate one iteration of ``plan``.

    Without ``cost_model`` one is built from ``profiles`` (a ProfileDB; analytic
    entries are added for device types that lack the plan's model).
    """
    if cost_model is None:
        profiles = profiles if profiles is not None else ProfileDB()
        profiles.ensure(plan.model, plan.cluster.types.values())
        cost_model = CostModel(plan.model, plan.cluster, profiles, plan.training)
    pipelines, blocks = plan_timings(plan, cost_model, options)
    ranks = [[tuple(s.ranks) for s in p.stages] for p in plan.pipelines]
    return simulate_timings(pipelines, blocks, ranks)
