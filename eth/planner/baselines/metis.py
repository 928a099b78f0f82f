"""Faithful Metis baseline (``metis``; Um et al., "Metis: Fast Automatic Distributed
Training on Heterogeneous GPUs", USENIX ATC'24).

What the published system does, as modelled here (same cost model and profiles as HPP):

* ONE pipeline over all devices, Lbs = Gbs: no data balancing between pipelines;
* no activation recompute anywhere;
* a stage may hold devices of several types; its micro-batch is then split over its dp
  replicas in proportion to their device speed (peak TFLOPS), one sample at a time to
  the replica that would finish it first; the stage's time is the largest of its device
  types' times on their shares;
* Metis's memory check sums over a stage's devices: a stage fits if its bytes (each
  type's per-device bytes on its share x that type's devices) are at most the sum of its
  devices' memories (:meth:`MetisSearch.stage_cost`).  For a single-type stage this is the
  per-device check; a mixed-type stage may pass it while one of its types overflows.
  Every decision below uses this check;
* tp rises only under memory pressure (:meth:`MetisSearch.raise_tp`): every stage starts
  at (dp, tp) = (N_j, 1); while some stage does not fit, the stage with the least free
  memory (summed capacity - summed bytes) among those that can still double tp goes to
  (dp / 2, tp x 2); a stage whose micro-batch cannot be shared over its replicas counts as
  the least free.  It stops when every stage fits or none of those that do not can
  change; tp is never raised to lower time;
* layers are split in proportion to each stage's speed (1 / time of one layer at its
  (dp, tp) and share), largest remainder, at least one layer per stage; a stage that
  overflows memory then gives single layers to the stage with the most room;
* Mbs: every power of two dividing Gbs.

Search (:func:`plan_metis`): device orders = the device types in every order (devices of
a type in cluster order); stage layouts = the ordered devices cut into S equal
contiguous stages (S | N; such stages may straddle two types) and the type-aligned
layouts (the devices of each type cut into equal stages), S <= min(layers,
``max_stages``).  For every layout and Mbs: split layers with every stage at (N_j, 1),
raise tp, split again with the raised (dp, tp), raise tp again (from (N_j, 1)); a
candidate every stage of which fits Metis's check is timed by Eq. 5 + Eq. 6 (AR over the
stage's replicas, :func:`eth.cost.sync.stage_allreduce_ms`, slowest link among them):
single-type candidates by :meth:`eth.cost.model.CostModel.evaluate` of their plan,
mixed-type ones by the same formulas (:meth:`MetisSearch.score`).  Metis's choice is the
fastest of them (a mixed-type one only if faster than every single-type one by more than
1e-9 relative).

Outcome: Metis's choice is then checked by our cost model's per-device memory (as every
plan is; :meth:`MetisSearch.overflow`), and so is the plan returned when that differs.  If
a device type of a stage overflows, the planner raises InfeasibleError naming the stage,
the type, the bytes per device and the capacity: Metis would run its choice and run out
of memory (the paper's "OOM"); there is no fall-back to a slower candidate.  Plan format:
a stage of :class:`eth.spec.plan.StagePlan` holds one device type, so when Metis's choice
has a mixed-type stage (and fits per device) the returned plan is the fastest
single-type candidate and ``plan.search["mixed_type_best"]`` records the choice
(iteration_ms, Mbs, per stage devices by type, tp, layers and per-type micro-batch
shares); ``bench/paper_eval.py`` notes that prediction next to Metis's row (no mixed-type
layout won on the paper's clusters, whose two types have equal device counts: only the
one-stage layout mixes types there).  If no single-type candidate fits Metis's check
then, the planner raises InfeasibleError naming the mixed one; if no candidate fits,
InfeasibleError says so.

Where it departs from the published system: Metis's own profiler and cost model are
replaced by ours; its device-group generation is reduced to the equal and type-aligned
layouts above over type-sorted devices; the speed weights are peak TFLOPS, not profiled
throughputs; its layer partitioning is the proportional split with the memory repair
above; the tp rule and the layer split alternate twice (split, raise, split, raise)
instead of re-partitioning the layers after every (dp, tp) step, and a step goes only to a
stage that does not fit (the stages' memory does not depend on one another here).  The
strong version, with HPP's balancer, Mbs moves and recompute, is
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
from eth.planner.options import SEARCH_OBJECTIVE
from eth.cost.sync import stage_allreduce_ms


@dataclass(frozen=True)
class Candidate:
    """One Metis configuration: stages (ranks, by type), tp and layers per stage, Mbs;
    ``feasible``: every stage fits Metis's (summed) memory check."""

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
        self.cost = CostModel(model, cluster, profiles, options.setup, objective=SEARCH_OBJECTIVE)
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
        key = ("types", ranks)
        if key not in self._memo:
            out: dict[str, list[int]] = {}
            for r in ranks:
                out.setdefault(self._types[r], []).append(r)
            self._memo[key] = [(t, tuple(rs)) for t, rs in out.items()]
        return self._memo[key]

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
    def type_costs(self, stages, j: int, tp: int, layers: tuple[int, int],
                   mbs: int) -> list[tuple[str, int, StageCost]] | None:
        """(type, its devices, per-device StageCost on its micro-batch share) of every
        device type of stage j; None if the micro-batch cannot be shared (see :meth:`shares`)."""
        ranks = stages[j]
        share = self.shares(ranks, tp, mbs)
        if share is None:
            return None
        s = len(stages)
        dp = len(ranks) // tp
        inflight = max(1, min(s - j, self.gbs // mbs))
        nxt = stages[j + 1] if j + 1 < s else None
        prev = stages[j - 1] if j > 0 else None
        out = []
        for t, rs in self.split_types(ranks):
            links = self.cost.stage_links(t, tp, rs, nxt, prev)
            out.append((t, len(rs), self.cost.stage_cost_at(t, tp, dp, layers[1] - layers[0], layers[0] == 0,
                                                            layers[1] == self.model.num_layers, share[t] * dp,
                                                            {}, inflight, links)))
        return out

    def stage_cost(self, stages, j: int, tp: int, layers: tuple[int, int], mbs: int) -> StageCost | None:
        """Stage j as Metis sees it: times of the slowest type on its share (max over its
        types), ``memory_bytes`` / ``capacity_bytes`` SUMMED over the stage's devices
        (per-device bytes of each type x its devices; device memories), so ``fits`` is
        Metis's memory check; None if the micro-batch cannot be shared (see :meth:`shares`)."""
        parts = self.type_costs(stages, j, tp, layers, mbs)
        if parts is None:
            return None
        costs = [c for _, _, c in parts]
        worst = max(costs, key=lambda c: c.memory_bytes / c.capacity_bytes)
        return replace(worst, fwd_ms=max(c.fwd_ms for c in costs), bwd_ms=max(c.bwd_ms for c in costs),
                       comm_ms=max(c.comm_ms for c in costs),
                       memory_bytes=sum(n * c.memory_bytes for _, n, c in parts),
                       capacity_bytes=sum(n * c.capacity_bytes for _, n, c in parts))

    def free_bytes(self, stages, j: int, tp: int, layers: tuple[int, int], mbs: int) -> float:
        """Free memory of stage j in Metis's check (summed capacity - summed bytes; < 0: it
        does not fit); -inf if the micro-batch cannot be shared over its replicas."""
        c = self.stage_cost(stages, j, tp, layers, mbs)
        return -math.inf if c is None else c.capacity_bytes - c.memory_bytes

    def raise_tp(self, stages, layers, mbs: int, trace: list | None = None) -> tuple[int, ...]:
        """Metis's tp rule: every stage starts at (N_j, 1); while some stage does not fit
        (:meth:`free_bytes` < 0), the one with the least free memory among those that can
        still double tp gets (dp / 2, tp x 2); it stops when every stage fits or none of
        those that do not can change.  ``trace`` (a list) receives the index of every
        stage raised, in order."""
        rng = self.ranges(layers)
        tps = [1] * len(stages)
        free = [self.free_bytes(stages, j, 1, rng[j], mbs) for j in range(len(stages))]
        while True:
            short = [(free[j], j) for j in range(len(stages))
                     if free[j] < 0 and tps[j] * 2 in self.tps(stages[j])]
            if not short:
                return tuple(tps)
            j = min(short)[1]
            tps[j] *= 2
            free[j] = self.free_bytes(stages, j, tps[j], rng[j], mbs)
            if trace is not None:
                trace.append(j)

    def overflow(self, cand: "Candidate") -> tuple[int, str, float, float] | None:
        """Our per-device memory check of a candidate: (stage, device type, bytes per device,
        capacity) of the first device type over its memory, None if every device fits.
        Single-type stages: :meth:`CostModel.evaluate` of the plan (as for every plan);
        mixed-type stages: each type's per-device cost on its share."""
        if not self.mixed(cand.stages):
            costs = self.cost.evaluate(self.plan_of(cand))["pipelines"][0]["costs"]
            parts = [[(self._types[r[0]], len(r), c)] for r, c in zip(cand.stages, costs)]
        else:
            parts = [self.type_costs(cand.stages, j, tp, rng, cand.mbs)
                     for j, (tp, rng) in enumerate(zip(cand.tps, self.ranges(cand.layers)))]
        for j, stage in enumerate(parts):
            for t, _, c in stage:
                if not c.fits:
                    return j, t, c.memory_bytes, c.capacity_bytes
        return None

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
        overflow memory to the stage with the most room that still fits with one more
        (memory: Metis's check, :meth:`stage_cost`)."""
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
        """split -> raise_tp -> split -> raise_tp (see module docstring), then :meth:`score`."""
        layers = self.split(stages, tuple(1 for _ in stages), mbs)
        tps = self.raise_tp(stages, layers, mbs)
        layers = self.split(stages, tps, mbs)
        tps = self.raise_tp(stages, layers, mbs)
        ms, ok = self.score(stages, tps, layers, mbs)
        return Candidate(stages, tps, layers, mbs, ms, ok)

    def score(self, stages, tps, layers, mbs: int) -> tuple[float, bool]:
        """(Eq. 5 + Eq. 6 iteration ms, every stage fits in Metis's check) of a candidate,
        from the cost model's formulas (for single-type stages, ZeRO 0 and profiles without
        measured step overheads equal to CostModel.evaluate)."""
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
    best, single, mixed, tried = Best(), None, None, 0
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
                if not cand.feasible:             # Metis's own (summed) memory check
                    continue
                if is_mixed:
                    if mixed is None or cand.iteration_ms < mixed.iteration_ms:
                        mixed = cand
                    continue
                best.evaluated += 1
                t = ms.cost.evaluate(ms.plan_of(cand))["iteration_ms"]
                if t < best.iteration_ms * (1 - 1e-12):
                    single, best.iteration_ms = cand, t
    finally:
        bar.close()
    extra = {"variant": "faithful", "candidates_configured": tried, "layouts": len(layouts)}
    choice = single
    if mixed is not None and mixed.iteration_ms < best.iteration_ms * (1 - 1e-9):
        choice = mixed
    # our per-device check of Metis's choice, and of the plan returned when that differs
    checks = [("Metis's choice", choice)]
    if single is not choice:
        checks.append(("its fastest single-type layout (the plan returned)", single))
    for what, cand in checks:
        over = ms.overflow(cand) if cand is not None else None
        if over is not None:
            j, t, need, cap = over
            raise InfeasibleError(
                f"metis: out of memory for model {model.name} on {cluster.world_size} devices: {what} "
                f"({len(cand.stages)} stages, mbs {cand.mbs}) fits Metis's check (memory summed over a "
                f"stage's devices) but stage {j} needs {need / 1e9:.2f} GB per {t} device, capacity "
                f"{cap / 1e9:.2f} GB")
    if choice is not None and choice is mixed:
        if single is None:
            raise InfeasibleError(
                f"metis: only mixed-type stage layouts fit for model {model.name} on "
                f"{cluster.world_size} devices (best predicted {mixed.iteration_ms:.1f} ms), and the "
                f"plan format holds one device type per stage")
        extra["mixed_type_best"] = ms.describe(mixed)
    if single is not None:
        best.plan = ms.plan_of(single)
    why = (f"no layout of one pipeline over {cluster.world_size} devices ({len(layouts)} layouts x "
           f"{len(mbss)} mbs) fits in memory without recompute (Metis's check: memory summed over "
           f"each stage's devices)")
    return finish("metis", best, ms.cost, clock, options, why, **extra)
