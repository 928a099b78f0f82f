"""Shared pieces of the baseline planners: options, time limit, plan building.

Every baseline scores candidates with the same :class:`eth.cost.model.CostModel` as the HPP
search (Eq. 5 + Eq. 6 and the per-device memory check) and emits the same
:class:`eth.spec.plan.Plan`, annotated by :meth:`CostModel.annotate`, validated, with
``plan.search = {"strategy", "time_s", "candidates", "time_limited", ...}``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from eth.cost.model import CostModel
from eth.errors import InfeasibleError, SpecError
from eth.spec.model import LAYER_OPS, UNFUSED_ATTENTION_OPS, layer_ops
from eth.spec.plan import PipelinePlan, Plan, StagePlan
from eth.spec.precision import TrainSetup
from eth.planner.bounds import stage_group_floors
from eth.planner.evaluate import Evaluator, PipeState, StageState
from eth.planner.options import check_time_limit
from eth.planner.progress import Clock

BASELINES = ("uniform", "metis", "metis-strong", "hexiscale", "hexiscale-strong", "typesplit")
"""Baseline strategies implemented by :func:`eth.planner.baselines.plan_baseline`:
``metis`` / ``hexiscale`` are the faithful versions of those systems, ``*-strong`` the
versions that reuse HPP's balancer, Mbs search and recompute choices."""


RECOMPUTE_MODES = (
    ("none", ()),
    ("selective", ("score", "softmax", "attn-dropout", "context")),
    ("full", LAYER_OPS),
)
"""Megatron-LM's recompute granularities, cheapest first: none, selective (core
attention), full (every layer op); each applies to all layers of a stage.  For a GPT
with unfused attention; any model: :func:`recompute_modes`."""


def recompute_modes(model) -> tuple:
    """:data:`RECOMPUTE_MODES` of ``model``'s op set (``eth.spec.model.layer_ops``): selective is
    its core attention (the unfused four ops, or fused-attention), full every layer op."""
    ops = layer_ops(model)
    core = tuple(op for op in ops if op in UNFUSED_ATTENTION_OPS + ("fused-attention",))
    return (("none", ()), ("selective", core), ("full", ops))


@dataclass(frozen=True)
class BaselineOptions:
    """Knobs shared by the baseline planners (a subset of SearchOptions' names)."""

    time_limit: float = 0.0
    """Wall-clock limit in seconds (0 = none); the best plan found so far is returned and
    plan.search["time_limited"] is true."""
    max_stages: int = 16
    """Largest number of stages of one pipeline (uniform: also bounded by the layers)."""
    max_blocks_per_type: int = 8
    """Granularity of the HPP enumeration reused by metis and typesplit (see
    eth.planner.enumerate.make_blocks)."""
    balance_budget: int = 150
    """Cost evaluations of the HPP stage balancer per stage device group (metis,
    typesplit), scaled by the adaptive rule of section 6."""
    type_orders: int = 6
    """metis-strong / hexiscale-strong: a pipeline of more device types than have this
    many orders gets the stage groups of that many most promising type orders only
    (:func:`eth.planner.pipeline.promising_orders`, as the HPP search); 0 = every order."""
    prune: bool = True
    """metis-strong / hexiscale-strong: leave the stage groups whose floor exceeds the best
    plan found (the same plan, fewer balanced groups; see their modules)."""
    max_micro: int = 64
    """uniform / hexiscale-strong: largest per-replica micro-batch (mbs / dp) tried (metis
    tries every power of two dividing gbs)."""
    fixed_mbs: int = 4
    """hexiscale (faithful): its one fixed micro-batch size (4, as in the paper's Table 3
    HexiScale plan); lowered to the largest power of two dividing Lbs when Lbs is smaller
    or not a multiple of it."""
    recompute: str = "stage"
    """metis-strong / hexiscale-strong: "stage" = per stage the cheapest of RECOMPUTE_MODES that fits
    (Megatron granularity, what those systems offer); "op" = the HPP rule (op-level
    recompute per stage, eth.planner.evaluate.Evaluator.fit_stage), for ablations.
    uniform always uses one mode for all stages; typesplit always uses the HPP rule;
    metis never recomputes; hexiscale recomputes every op of every layer or nothing."""
    progress: bool = False
    """Show a tqdm progress bar on stderr."""
    setup: TrainSetup = TrainSetup()
    """Precision, ZeRO stage and gradient dtype to plan for (see SearchOptions.setup)."""
    objective: str = "blocks"
    """What the plan is annotated by (see SearchOptions.objective); the baselines choose by
    ``eth.planner.options.SEARCH_OBJECTIVE``."""

    def __post_init__(self):
        if self.objective not in ("blocks", "eq5"):
            raise SpecError(f"objective must be one of blocks, eq5, got {self.objective!r}")
        if self.recompute not in ("stage", "op"):
            raise SpecError(f"recompute must be 'stage' or 'op', got {self.recompute!r}")
        check_time_limit(self.time_limit)
        for name in ("max_stages", "max_blocks_per_type", "balance_budget", "max_micro", "fixed_mbs"):
            if getattr(self, name) < 1:
                raise SpecError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_any(cls, options) -> "BaselineOptions":
        """From None, a BaselineOptions, or any object with some of these field names
        (e.g. eth.planner.options.SearchOptions)."""
        if options is None:
            return cls()
        if isinstance(options, cls):
            return options
        names = cls.__dataclass_fields__
        return cls(**{n: getattr(options, n) for n in names if hasattr(options, n)})


class StageRecomputeEvaluator(Evaluator):
    """An :class:`Evaluator` whose recompute choice is coarse: per stage, the cheapest of
    :data:`RECOMPUTE_MODES` that fits, applied to all the stage's layers (instead of the
    HPP rule's op-level choice).  The stage balancer works unchanged on top of it."""

    def fit_stage(self, st: StageState, layers: tuple[int, int], mbs: int, j: int, num_stages: int,
                  nmb: int, ranks, next_ranks, prev_ranks=None, links=None):
        # ``links`` (the caller's CostModel.stage_links) is not needed: stage_cost derives them
        key = ("stage-recompute", st, layers, mbs, j, num_stages, nmb,
               tuple(ranks) if ranks else None, tuple(next_ranks[:1]) if next_ranks else None,
               tuple(prev_ranks[:1]) if prev_ranks else None)
        hit = self._fit.get(key)
        if hit is None:
            n = layers[1] - layers[0]
            for _, ops in recompute_modes(self.model):
                rec = {op: n for op in ops}
                c = self.cost.stage_cost(st.device_type, st.tp, st.dp, layers, mbs, rec, j, num_stages,
                                         nmb, ranks, next_ranks, prev_ranks)
                if c.fits:
                    break
            hit = self._fit[key] = (c, tuple(sorted(rec.items())),
                                    max(c.memory_bytes - c.capacity_bytes, 0.0))
        return hit


def make_evaluator(cost: CostModel, options: "BaselineOptions") -> Evaluator:
    """The evaluator of ``options.recompute`` ("stage": coarse, "op": the HPP rule)."""
    return StageRecomputeEvaluator(cost) if options.recompute == "stage" else Evaluator(cost)


@dataclass
class Best:
    """Best feasible plan seen so far (by the cost model's iteration time)."""

    plan: Plan | None = None
    iteration_ms: float = math.inf
    evaluated: int = 0
    """Candidate plans scored with CostModel.evaluate."""

    def offer(self, cost: CostModel, plan: Plan, ar=None) -> float:
        """Score ``plan`` (``ar``: its :meth:`eth.cost.model.CostModel.stage_allreduce_ms`
        when the caller has it); keep it if feasible and faster.  Returns its time (inf if
        infeasible)."""
        self.evaluated += 1
        out = cost.evaluate(plan, ar)
        if not out["feasible"]:
            return math.inf
        if out["iteration_ms"] < self.iteration_ms * (1 - 1e-12):
            self.plan, self.iteration_ms = plan, out["iteration_ms"]
        return out["iteration_ms"]


def floor_order(ev: Evaluator, items, stage_ranks, batch: int, prune: bool, pure_tp: bool = False):
    """``items`` (one per stage group; ``stage_ranks[i]`` = (stages, ranks) of item i) as
    (floor, item) in ascending order of :func:`eth.planner.bounds.stage_group_floors`
    (``pure_tp``: of stages whose tp is their device count; ties in the given order);
    with ``prune`` off every floor is 0 (the given order).  A caller stops at the first
    floor above its best iteration time: no later group can give a faster plan."""
    floors = stage_group_floors(ev, stage_ranks, batch, pure_tp) if prune else [0.0] * len(items)
    order = sorted(range(len(items)), key=lambda i: (floors[i], i))
    return [(floors[i], items[i]) for i in order]


def type_ranks(cluster) -> dict[str, list[int]]:
    """Global ranks of every device type, cluster order (types in order of appearance)."""
    out: dict[str, list[int]] = {}
    for d in cluster.devices:
        out.setdefault(d.type, []).append(d.rank)
    return out


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def powers_of_two(limit: int) -> list[int]:
    out, m = [], 1
    while m <= limit:
        out.append(m)
        m *= 2
    return out


def pipeline_plan(state: PipeState, recompute, ranks, lbs: int) -> PipelinePlan:
    """PipelinePlan of ``state`` with recompute pairs per stage and concrete ranks."""
    stages = [StagePlan(list(r), st.device_type, st.tp, st.dp, rng, dict(rec))
              for st, rng, rec, r in zip(state.stages, state.layer_ranges(), recompute, ranks)]
    return PipelinePlan(state.mbs, lbs, stages)


def finish(strategy: str, best: Best, cost: CostModel, clock: Clock, options: BaselineOptions,
           why: str, **extra) -> Plan:
    """Annotate, record search metadata, validate; InfeasibleError if nothing was found."""
    if best.plan is None:
        limited = " (time limit reached)" if clock.hit else ""
        raise InfeasibleError(f"{strategy}: no feasible plan for model {cost.model.name} on "
                              f"{cost.cluster.world_size} devices{limited}: {why}")
    plan = best.plan
    # chosen by SEARCH_OBJECTIVE, annotated by the objective asked for
    replace(cost, objective=options.objective).annotate(plan)
    plan.search = {"strategy": strategy, "time_s": round(clock.elapsed(), 3),
                   "options": asdict(options), "candidates": {"evaluated": best.evaluated},
                   "time_limited": clock.hit, **extra}
    return plan.validate()


def proportional_split(total: int, weights) -> list[int]:
    """``total`` items split in proportion to ``weights`` (largest remainder), each part
    at least 1 (needs total >= len(weights)); a weight of 0 gets 1."""
    n = len(weights)
    if total < n:
        raise SpecError(f"cannot split {total} layers into {n} parts of at least 1")
    wsum = sum(weights)
    ideal = [total * w / wsum if wsum > 0 else total / n for w in weights]
    parts = [max(1, math.floor(x)) for x in ideal]
    while sum(parts) < total:
        j = max(range(n), key=lambda i: (ideal[i] - parts[i], -i))
        parts[j] += 1
    while sum(parts) > total:
        j = min((i for i in range(n) if parts[i] > 1), key=lambda i: (ideal[i] - parts[i], i))
        parts[j] -= 1
    return parts
