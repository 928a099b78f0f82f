"""Faithful Metis baseline (``metis``; Um et al., "Metis: Fast Automatic Distributed
Training on Heterogeneous GPUs", USENIX ATC'24).

What the published system does, as modelled here (same cost model and profiles as HPP):

* ONE pipeline over all devices, Lbs = Gbs: no data balancing between pipelines;
* no activation recompute anywhere;
* a stage may hold devices of several types; its micro-batch is then split over its dp
  replicas in proportion to their device speed (peak TFLOPS), one sample at a time to
  the replica that would finish it first; the stage's time is the largest of its device
  types' times on their shares, and it fits if every type fits;
* per stage, (dp, tp) is reached only by Metis's greedy halving walk from (N_j, 1)
  (Metis prefers data parallelism within a stage): (N_j, 1) -> (N_j / 2, 2) -> ... while
  the step lowers the stage's key (first: a micro-batch too small for the replicas; then:
  bytes over memory; then: its time for the whole batch, T_j x Gbs / Mbs, plus its own
  gradient All-Reduce, Eq. 6); the walk stops at the first step that does not;
* layers are split in proportion to each stage's speed (1 / time of one layer at its
  (dp, tp) and share), largest remainder, at least one layer per stage; a stage that
  overflows memory then gives single layers to the stage with the most room;
* Mbs: every power of two dividing Gbs.

Search (:func:`plan_metis`): device orders = the device types in every order (devices of
a type in cluster order); stage layouts = the ordered devices cut into S equal
contiguous stages (S | N; such stages may straddle two types) and the type-aligned
layouts (the devices of each type cut into equal stages), S <= min(layers,
``max_stages``).  For every layout and Mbs: split layers with every stage at (N_j, 1),
walk every stage, split again with the walked (dp, tp), walk again (from (N_j, 1));
score the result with Eq. 5 + Eq. 6 (AR over the stage's replicas,
:func:`eth.cost.sync.stage_allreduce_ms`, slowest link among them).

Plan format: a stage of :class:`eth.spec.plan.StagePlan` holds one device type, so a layout
with a mixed-type stage cannot be written as a plan.  Such candidates are scored with the
cost model's formulas directly (:meth:`MetisSearch.score`, the same Eq. 5 / Eq. 6 /
memory terms); the returned plan is the fastest single-type candidate (scored by
:meth:`eth.cost.model.CostModel.evaluate`), and when a mixed-type candidate is predicted faster
``plan.search["mixed_type_best"]`` records it (iteration_ms, Mbs, per stage devices by
type, tp, layers and per-type micro-batch shares); ``bench/paper_eval.py`` notes that
prediction next to Metis's row (no mixed-type layout won on the paper's clusters, whose
two types have equal device counts: only the one-stage layout mixes types there).  If only
mixed-type candidates fit, the planner raises InfeasibleError naming the best one.

Where it departs from the published system: Metis's own profiler and cost model are
replaced by ours; its device-group generation is reduced to the equal and type-aligned
layouts above over type-sorted devices; the speed weights are peak TFLOPS, not profiled
throughputs; its layer partitioning is the proportional split with the memory repair
above.  The strong version, with HPP's balancer, Mbs moves and recompute, is
:mod:`eth.planner.baselines.metis_strong` (``metis-strong``).
"""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, replace
from types import SimpleNamespace

from eth.cost.equations import StageCost, eq5_end_times
from eth.cost.model import CostModel
from eth.errors import InfeasibleError
from eth.spec.plan import PipelinePlan, Plan, StagePlan
from eth.planner.baselines.common import (Best, BaselineOptions, divisors, finish, powers_of_two,
                                          proportional_split, type_ranks)
from eth.planner.progress import Clock, progress_bar
from eth.planner.evaluate import Evaluator
from eth.cost.sync import stage_allreduce_ms


@dataclass(frozen=True)
class Candidate:
    """One Metis configuration: stages (ranks, by type), tp and layers per stage, Mbs."""

    stages: tuple[tuple[int, ...], ...]
    tps: tuple[int, ...]
    layers: tuple[int, ...]
    mbs: int
    iteration_ms: float
    feasible: bool


class MetisSearch:
    """The faithful Metis search on one model / cluster / profile database."""

    def __init__(self, model, cluster, profiles, gbs: int, options: BaselineOptions):
        self.model, self.cluster, self.gbs, self.opt = model, cluster, gbs, options
        self.cost = CostModel(model, cluster, profiles, options.setup)
        self.ev = Evaluator(self.cost)
        self._types = {d.rank: d.type for d in cluster.devices}
        self._memo: dict = {}

    # ------------------------------------------------------------------ layouts
    def layouts(self) -> list[tuple[tuple[int, ...], ...]]:
        """Equal contiguous and type-aligned stage layouts over every type order."""
        by_type = type_ranks(self.cluster)
        limit = min(self.model.num_layers, self.opt.max_stages)
        out = set()
        for perm in itertools.permutations(by_type):
            order = [r for t in perm for r in by_type[t]]
            n = len(order)
            for s in divisors(n):
                if s <= limit:
                    out.add(tuple(tuple(order[i * (n // s):(i + 1) * (n // s)]) for i in range(s)))
            for sizes in itertools.product(*[divisors(len(by_type[t])) for t in perm]):
                stages = [tuple(by_type[t][i:i + size]) for t, size in zip(perm, sizes)
                          for i in range(0, len(by_type[t]), size)]
                if len(stages) <= limit:
                    out.add(tuple(stages))
        return sorted(out, key=lambda lay: (len(lay), lay))

    def split_types(self, ranks) -> list[tuple[str, tuple[int, ...]]]:
        """(type, its ranks) of a stage, in the stage's order."""
        out: dict[str, list[int]] = {}
        for r in ranks:
            out.setdefault(self._types[r], []).append(r)
        return [(t, tuple(rs)) for t, rs in out.items()]

    def tps(self, ranks) -> list[int]:
        """tp degrees valid for every type of the stage (tp groups inside nodes)."""
        key = ("tps", ranks)
        if key not in self._memo:
            sets = [set(self.ev.valid_tps(t, len(rs), rs)) for t, rs in self.split_types(ranks)]
            self._memo[key] = sorted(set.intersection(*sets))
        return self._memo[key]

    # ------------------------------------------------------------------ shares
    def shares(self, ranks, tp: int, mbs: int) -> dict[str, int] | None:
        """Largest micro-batch share of a replica of each type of the stage (speed-
        proportional split of ``mbs`` over its replicas); None if a replica would get
        nothing, or a single-type stage's dp does not divide mbs (the plan format)."""
        groups = self.split_types(ranks)
        key = ("shares", tuple((t, len(rs)) for t, rs in groups), tp, mbs)
        if key in self._memo:
            return self._memo[key]
        reps = [(t, len(rs) // tp) for t, rs in groups]
        out = None
        if mbs >= sum(d for _, d in reps):
            if len(reps) == 1:
                out = {reps[0][0]: mbs // reps[0][1]} if mbs % reps[0][1] == 0 else None
            else:
                speed = {t: self.cluster.types[t].tflops for t, _ in reps}
                heap = [(1 / speed[t], t, i) for t, d in reps for i in range(d)]
                heapq.heapify(heap)
                load: dict[tuple[str, int], int] = {}
                for _ in range(mbs):
                    _, t, i = heapq.heappop(heap)
                    load[t, i] = load.get((t, i), 0) + 1
                    heapq.heappush(heap, ((load[t, i] + 1) / speed[t], t, i))
                if len(load) == sum(d for _, d in reps):
                    out = {t: max(v for (u, _), v in load.items() if u == t) for t, _ in reps}
        self._memo[key] = out
        return out

    # ------------------------------------------------------------------ stage cost
    def stage_cost(self, stages, j: int, tp: int, layers: tuple[int, int], mbs: int) -> StageCost | None:
        """Cost of stage j (max over its types of their share's time; memory of the
        fullest type); None if the micro-batch cannot be shared (see :meth:`shares`)."""
        ranks = stages[j]
        share = self.shares(ranks, tp, mbs)
        if share is None:
            return None
        s = len(stages)
        dp = len(ranks) // tp
        inflight = max(1, min(s - j, self.gbs // mbs))
        nxt = stages[j + 1] if j + 1 < s else None
        prev = stages[j - 1] if j > 0 else None
        costs = []
        for t, rs in self.split_types(ranks):
            links = self.cost.stage_links(t, tp, rs, nxt, prev)
            costs.append(self.cost.stage_cost_at(t, tp, dp, layers[1] - layers[0], layers[0] == 0,
                                                 layers[1] == self.model.num_layers, share[t] * dp, {},
                                                 inflight, links))
        if len(costs) == 1:
            return costs[0]
        worst = max(costs, key=lambda c: c.memory_bytes / c.capacity_bytes)
        return replace(worst, fwd_ms=max(c.fwd_ms for c in costs), bwd_ms=max(c.bwd_ms for c in costs),
                       comm_ms=max(c.comm_ms for c in costs))

    def own_allreduce_ms(self, ranks, tp: int, layers: tuple[int, int]) -> float:
        """Eq. 6 of the stage's gradients over its own dp replicas."""
        stage = SimpleNamespace(ranks=list(ranks), tp=tp, dp=len(ranks) // tp, layers=layers)
        return stage_allreduce_ms(self.cost, [SimpleNamespace(stages=[stage])])[0][0]

    def walk_key(self, stages, j: int, tp: int, layers, mbs: int) -> tuple:
        c = self.stage_cost(stages, j, tp, layers, mbs)
        if c is None:
            return (2, len(stages[j]) // tp)
        if not c.fits:
            return (1, c.memory_bytes - c.capacity_bytes)
        return (0, c.total_ms * (self.gbs // mbs) + self.own_allreduce_ms(stages[j], tp, layers))

    def walk(self, stages, j: int, layers, mbs: int) -> int:
        """Metis's greedy halving walk from (N_j, 1): the stage's tp."""
        valid = self.tps(stages[j])
        tp = 1
        key = self.walk_key(stages, j, tp, layers, mbs)
        while tp * 2 in valid:
            nxt = self.walk_key(stages, j, tp * 2, layers, mbs)
            if not nxt < key:
                break
            tp, key = tp * 2, nxt
        return tp

    # ------------------------------------------------------------------ layers
    def layer_ms(self, ranks, tp: int, mbs: int) -> float:
        """Time of one middle layer of a stage at its shares (max over its types)."""
        share = self.shares(ranks, tp, mbs)
        if share is None:
            return math.inf
        dp = len(ranks) // tp
        out = 0.0
        for t, rs in self.split_types(ranks):
            link = self.cost.stage_links(t, tp, rs)
            c = self.cost.stage_cost_at(t, tp, dp, 1, False, False, share[t] * dp, {}, 1, link)
            out = max(out, c.total_ms - c.send_fwd_ms - c.send_bwd_ms)
        return out

    def split(self, stages, tps, mbs: int) -> tuple[int, ...]:
        """Layers in proportion to stage speed, then single layers moved off stages that
        overflow memory to the stage with the most room that still fits with one more."""
        speed = [1 / self.layer_ms(r, tp, mbs) for r, tp in zip(stages, tps)]
        layers = proportional_split(self.model.num_layers, speed)
        for _ in range(self.model.num_layers * len(stages)):
            costs = self._costs(stages, tps, layers, mbs)
            over = [j for j, c in enumerate(costs) if c is not None and not c.fits and layers[j] > 1]
            if not over:
                break
            src = max(over, key=lambda j: costs[j].memory_bytes / costs[j].capacity_bytes)
            room = []
            for j, c in enumerate(costs):
                if j == src or c is None or not c.fits:
                    continue
                trial = list(layers)
                trial[src] -= 1
                trial[j] += 1
                t = self._costs(stages, tps, trial, mbs)[j]
                if t is not None and t.fits:
                    room.append((c.memory_bytes / c.capacity_bytes, j))
            if not room:
                break
            dst = min(room)[1]
            layers[src] -= 1
            layers[dst] += 1
        return tuple(layers)

    def _costs(self, stages, tps, layers, mbs) -> list[StageCost | None]:
        out, start = [], 0
        for j, (tp, n) in enumerate(zip(tps, layers)):
            out.append(self.stage_cost(stages, j, tp, (start, start + n), mbs))
            start += n
        return out

    @staticmethod
    def ranges(layers) -> list[tuple[int, int]]:
        out, start = [], 0
        for n in layers:
            out.append((start, start + n))
            start += n
        return out

    # ------------------------------------------------------------------ candidates
    def configure(self, stages, mbs: int) -> Candidate:
        """split -> walk -> split -> walk (see module docstring), then :meth:`score`."""
        tps = tuple(1 for _ in stages)
        layers = self.split(stages, tps, mbs)
        for round_ in range(2):
            rng = self.ranges(layers)
            tps = tuple(self.walk(stages, j, rng[j], mbs) for j in range(len(stages)))
            if round_ == 0:
                layers = self.split(stages, tps, mbs)
        ms, ok = self.score(stages, tps, layers, mbs)
        return Candidate(stages, tps, layers, mbs, ms, ok)

    def score(self, stages, tps, layers, mbs: int) -> tuple[float, bool]:
        """(Eq. 5 + Eq. 6 iteration ms, every stage fits) of a candidate, from the cost
        model's formulas (equal to CostModel.evaluate for single-type stages, ZeRO 0)."""
        costs = self._costs(stages, tps, layers, mbs)
        if any(c is None for c in costs):
            return math.inf, False
        pipe = SimpleNamespace(stages=[SimpleNamespace(ranks=list(r), tp=tp, dp=len(r) // tp, layers=rng)
                                       for r, tp, rng in zip(stages, tps, self.ranges(layers))])
        ar = stage_allreduce_ms(self.cost, [pipe])[0]
        ends = eq5_end_times(costs, self.gbs, mbs, ar)
        return max(ends), all(c.fits for c in costs)

    def mixed(self, stages) -> bool:
        return any(len(self.split_types(r)) > 1 for r in stages)

    def plan_of(self, cand: Candidate) -> Plan:
        out = []
        for r, tp, rng in zip(cand.stages, cand.tps, self.ranges(cand.layers)):
            out.append(StagePlan(list(r), self._types[r[0]], tp, len(r) // tp, rng, {}))
        return Plan(self.model, self.cluster, self.gbs, [PipelinePlan(cand.mbs, self.gbs, out)])

    def describe(self, cand: Candidate) -> dict:
        """A mixed-type candidate in plan-like terms (plan.search["mixed_type_best"])."""
        stages = []
        for r, tp, rng in zip(cand.stages, cand.tps, self.ranges(cand.layers)):
            stages.append({"devices": {t: len(rs) for t, rs in self.split_types(r)},
                           "ranks": [min(r), max(r)], "tp": tp, "layers": list(rng),
                           "micro": self.shares(r, tp, cand.mbs)})
        return {"iteration_ms": round(cand.iteration_ms, 4), "mbs": cand.mbs, "stages": stages}


def mbs_options(gbs: int, limit: int) -> list[int]:
    """Powers of two dividing gbs, at most ``limit``."""
    return [m for m in powers_of_two(min(gbs, limit)) if gbs % m == 0]


def plan_metis(model, cluster, profiles, gbs: int, options: BaselineOptions) -> Plan:
    clock = Clock(options.time_limit)
    ms = MetisSearch(model, cluster, profiles, gbs, options)
    layouts = ms.layouts()
    mbss = mbs_options(gbs, gbs)
    best, mixed, tried = Best(), None, 0
    bar = progress_bar(len(layouts), options.progress, "metis")
    try:
        for stages in layouts:
            bar.update(1)
            if clock.out():
                break
            is_mixed = ms.mixed(stages)
            for mbs in mbss:
                if clock.out():
                    break
                tried += 1
                cand = ms.configure(stages, mbs)
                if not cand.feasible:
                    continue
                if is_mixed:
                    if mixed is None or cand.iteration_ms < mixed.iteration_ms:
                        mixed = cand
                else:
                    best.offer(ms.cost, ms.plan_of(cand))
    finally:
        bar.close()
    extra = {"variant": "faithful", "candidates_configured": tried, "layouts": len(layouts)}
    if mixed is not None and mixed.iteration_ms < best.iteration_ms * (1 - 1e-9):
        if best.plan is None:
            raise InfeasibleError(
                f"metis: only mixed-type stage layouts fit for model {model.name} on "
                f"{cluster.world_size} devices (best predicted {mixed.iteration_ms:.1f} ms), and the "
                f"plan format holds one device type per stage")
        extra["mixed_type_best"] = ms.describe(mixed)
    why = (f"no layout of one pipeline over {cluster.world_size} devices ({len(layouts)} layouts x "
           f"{len(mbss)} mbs) fits in memory without recompute")
    return finish("metis", best, ms.cost, clock, options, why, **extra)
