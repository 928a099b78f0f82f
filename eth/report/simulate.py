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
* All-Reduce.  Gradients are reduced per *block*: a maximal set of parameters held by
  the same set of stages (one stage per pipeline), i.e. the layer segments cut by every
  pipeline's stage boundaries, with the embedding and head added to the first/last
  stages' blocks and blocks with the same holder set fused (paper section 4.3).  A
  block's All-Reduce starts when ALL its holders finished their last backward and their
  comm streams are free (blocks are list-scheduled in order of that readiness); it lasts
  max over holders of Eq. 6 for the holder's shard (params / tp, so the lowest-tp holder,
  which takes part in tp_max / tp partitioned blocks, sets the pace).
* Optimizer step.  After a stage's last All-Reduce: memory-bound AdamW over the
  device's shard, ``params x bytes_per_param x optimizer_passes / memory bandwidth``
  (:class:`SimOptions`; the training setup's bytes per parameter of weights, grads and
  Adam states, touched ~3 times: read, update, write back).  The global grad-norm reduction is not modelled.

Durations come from :class:`eth.cost.model.CostModel` (:func:`plan_timings`): the stage's
``fwd_ms``/``bwd_ms`` minus the p2p send the cost model folded into them become the
compute events (TP collectives stay inside compute: they block the compute stream);
the sends become transfer events.  Nothing here uses the closed form of Eq. 5.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from eth.cost.equations import StageCost, eq6_allreduce_ms
from eth.cost.model import CostModel
from eth.layout.params import block_position, stage_blocks
from eth.spec.plan import stage_holding
from eth.profiles.db import ProfileDB

KINDS = ("forward", "backward", "recompute", "comm", "allreduce", "optimizer")
COMPUTE_KINDS = ("forward", "recompute", "backward")


@dataclass(frozen=True)
class SimOptions:
    """Knobs of the parts of the iteration the cost model does not describe."""

    optimizer_passes: float = 3.0
    """How many times the optimizer step streams the device's bytes_per_param x params
    through memory (read states + grads, write states + weights; ~3 for unfused AdamW)."""
    optimizer: bool = True
    """Simulate the optimizer step at all."""

    def __post_init__(self):
        if self.optimizer_passes < 0:
            raise ValueError(f"optimizer_passes must be >= 0, got {self.optimizer_passes}")


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
    """Optimizer step after the stage's gradients are reduced (once per iteration)."""

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
class AllReduceBlock:
    """One fused gradient block and the stages (pipeline, stage) that hold it."""

    holders: tuple[tuple[int, int], ...]
    duration_ms: float
    label: str = ""


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


def simulate_timings(pipelines: Sequence[PipelineTiming], blocks: Sequence[AllReduceBlock] = (),
                     ranks: Sequence[Sequence[tuple[int, ...]]] | None = None) -> SimResult:
    """Simulate pipelines given per-stage timings and All-Reduce blocks.

    ``ranks[i][j]`` (optional) are the global ranks of stage j of pipeline i, used only
    to report per-device busy time.
    """
    for b in blocks:
        for p, j in b.holders:
            if not (0 <= p < len(pipelines) and 0 <= j < len(pipelines[p].stages)):
                raise ValueError(f"all-reduce block {b.label!r} names stage ({p}, {j}) which does not exist")
    events: list[Event] = []
    last_bwd = _run_pipelines(pipelines, events)

    # gradient All-Reduce: list scheduling of blocks on the holders' comm streams
    comm_free = dict(last_bwd)                  # (pipeline, stage) -> comm stream free from
    ar_ms = {key: 0.0 for key in last_bwd}
    ready = sorted(range(len(blocks)), key=lambda k: (max(last_bwd[h] for h in blocks[k].holders), k))
    for k in ready:
        block = blocks[k]
        if block.duration_ms <= 0:
            continue
        start = max(comm_free[h] for h in block.holders)
        end = start + block.duration_ms
        for p, j in block.holders:
            events.append(Event(p, j, "allreduce", None, start, end, label=block.label))
            comm_free[(p, j)] = end
            ar_ms[(p, j)] += block.duration_ms

    # optimizer step after each stage's last All-Reduce
    stage_end = {}
    for (p, j), t in comm_free.items():
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
                 ) -> tuple[list[PipelineTiming], list[AllReduceBlock]]:
    """Stage timings and All-Reduce blocks of ``plan`` from the cost model."""
    pipelines = []
    for p in plan.pipelines:
        costs = cost_model.pipeline_costs(p)
        stages = []
        for st, c in zip(p.stages, costs):
            opt = 0.0
            if options.optimizer:
                bw = cost_model.cluster.types[st.device_type].mem_bw_gbs * 1e9 / 1e3  # bytes per ms
                opt = c.params * cost_model.bytes_per_param * options.optimizer_passes / bw
            # the cost model folds the boundary sends into fwd/bwd; the simulator runs
            # them as separate transfer events, unless they block both ends
            # (CostModel.p2p_blocking): then sender and receiver compute streams hold them
            sends = (0.0, 0.0) if cost_model.p2p_blocking else (c.send_fwd_ms, c.send_bwd_ms)
            stages.append(StageTiming(fwd_ms=c.fwd_ms - sends[0], bwd_ms=c.bwd_ms - sends[1],
                                      recompute_ms=c.recompute_ms, send_fwd_ms=sends[0],
                                      send_bwd_ms=sends[1], optimizer_ms=opt))
        pipelines.append(PipelineTiming(p.num_microbatches, tuple(stages)))
    return pipelines, allreduce_blocks(plan, cost_model)


def allreduce_blocks(plan, cost_model: CostModel) -> list[AllReduceBlock]:
    """Fused gradient blocks of ``plan`` with their holders and Eq. 6 durations.

    Parts: every layer segment between consecutive stage boundaries (of all pipelines
    together) is held by one stage per pipeline; the embedding (word + position) by
    every first stage, final layernorm + head by every last stage.  Parts with the same
    holder set are fused into one block.  A holder with tensor parallelism ``tp`` keeps
    its tp share of each part's tp-partitioned parameters and (tp rank 0) all its
    tp-replicated ones (the block-wise layout, ``eth.cost.sync``); its time in the
    block is Eq. 6 over N = sum of the
    holders' dp degrees and the slowest link among all holder ranks, the same figures
    as CostModel.stage_allreduce_ms; the block lasts the longest holder time.
    """
    from eth.cost.sync import block_split

    model, cluster = cost_model.model, cost_model.cluster
    pipes = plan.pipelines
    parts: dict[tuple, list[tuple[str, tuple[int, int]]]] = {}
    if plan.cuts_layers:   # layers cut inside: block by block (eth.layout.params.stage_blocks)
        holding: dict[str, list] = {}
        for where, keys in stage_blocks(plan).items():
            for key in keys:
                holding.setdefault(key, []).append(where)
        for key, holders in sorted(holding.items(), key=lambda kv: block_position(kv[0])):
            name = {"embedding": "emb", "head": "head"}.get(key, key.replace("layer ", "L"))
            parts.setdefault(tuple(holders), []).append((name, block_split(model, key)))
    else:
        cuts = sorted({b for p in pipes for s in p.stages for b in s.layers})
        layer_part, layer_repl = block_split(model, "layer 0")
        for a, b in zip(cuts, cuts[1:]):
            holders = tuple((i, stage_holding(p, a)) for i, p in enumerate(pipes))
            parts.setdefault(holders, []).append((f"L{a}-{b - 1}", ((b - a) * layer_part, (b - a) * layer_repl)))
        first = tuple((i, 0) for i in range(len(pipes)))
        last = tuple((i, len(p.stages) - 1) for i, p in enumerate(pipes))
        parts.setdefault(first, []).insert(0, ("emb", block_split(model, "embedding")))
        parts.setdefault(last, []).append(("head", block_split(model, "head")))

    blocks = []
    for holders, items in parts.items():
        stages = [pipes[i].stages[j] for i, j in holders]
        n = sum(s.dp for s in stages)
        gbps = cluster.link_gbps([r for s in stages for r in s.ranks])
        # tp rank 0 of a holder carries its tp share plus the tp-replicated parameters
        duration = max(sum(eq6_allreduce_ms((part / s.tp + repl) * cost_model.grad_bytes, n, gbps)
                           for _, (part, repl) in items) for s in stages)
        blocks.append(AllReduceBlock(holders, duration, "+".join(name for name, _ in items)))
    return blocks


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
