"""Typed configuration of the HPP search (the CLI is a thin layer over this)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from eth.errors import SpecError
from eth.spec.precision import TrainSetup

SEARCH_OBJECTIVE = "eq5"
"""What the HPP search and the baselines rank candidates by inside
(``eth.cost.model.CostModel.objective``): the paper's Eq. 5, for which the lines the batch
allocation balances and the floors that prune are exact.  Their answers are scored by
``SearchOptions.objective`` (``eth.planner.finalists``)."""

STRATEGIES = ("hpp", "uniform", "metis", "metis-strong", "hexiscale", "hexiscale-strong", "typesplit")
"""Search strategies known to :func:`eth.planner.search.search`: hpp and the baselines of
eth.planner.baselines (Megatron uniform, Metis and HexiScale as published and their
``-strong`` versions on HPP's machinery, TypeSplit-HPP)."""


MAX_GBS = 1 << 16
"""The largest global batch the planners take (65536 samples): the batch allocation is
linear in the micro-batch count (GPT 'tiny' on 4 ranks: 2.9 s at 65536, 24 s at 2^20)."""


def check_gbs(gbs) -> None:
    """One line naming ``gbs`` unless it is a positive integer of at most :data:`MAX_GBS`."""
    if not isinstance(gbs, int) or isinstance(gbs, bool) or gbs <= 0:
        raise SpecError(f"gbs must be a positive integer, got {gbs!r}")
    if gbs > MAX_GBS:
        raise SpecError(f"gbs {gbs} is above {MAX_GBS}, the largest global batch the planner takes "
                        f"(its batch allocation grows with the number of micro-batches)")


def check_time_limit(seconds) -> None:
    """One line naming ``seconds`` unless it is a finite number >= 0 (0: no limit; NaN fails)."""
    if not 0 <= seconds < math.inf:
        raise SpecError(f"time_limit must be a number of seconds >= 0 (0: none), got {seconds}")


@dataclass(frozen=True)
class SearchOptions:
    """Knobs of the HPP planner.  Every optimisation of paper section 5 has a switch."""

    gbs: int
    """Global batch size (samples per iteration)."""
    strategy: str = "hpp"
    """Search strategy: "hpp", or a baseline of eth.planner.baselines (uniform, metis,
    metis-strong, hexiscale, hexiscale-strong, typesplit) in the same cost model."""
    cache: bool = True
    """Section 5.1: reuse a pipeline's optimised configuration keyed by its device
    multiset (and batch) across device groups."""
    skip: bool = True
    """Section 5.2: skip a device group whose summed pipeline throughput upper bounds
    (deterministic bipartite bound, approximate bound x alpha) is below the best found."""
    order: bool = True
    """Section 5.3: visit device groups in ascending Eq. 9 cost within each pipeline count."""
    dp: bool = True
    """Section 5.4: switch to dynamic programming over device splits (Eq. 10) when early
    skipping becomes ineffective or a pipeline count has too many device groups."""
    alpha: float = 1.5
    """Fault-tolerance factor (>= 1) of the approximate throughput bound."""
    time_limit: float = 0.0
    """Wall-clock limit of the search in seconds (0 = none).  When it is hit the best plan
    found so far is returned and plan.search["time_limited"] is true."""
    seed: int = 0
    """Seeds the random device orderings tried by the dynamic programming (the rest of the
    search is deterministic)."""
    max_blocks_per_type: int = 8
    """Enumeration granularity: the devices of each type are cut into at most this many
    equal blocks (powers of two preferred); pipelines are multisets of blocks."""
    max_blocks: int = 16
    """Enumeration granularity over all types: with T device types each type is cut into
    at most max(2, max_blocks // T) blocks too (16: 8 per type for 2 types, 5 for 3, 4
    for 4, 2 for 6); 0 = ``max_blocks_per_type`` alone."""
    max_stages: int = 16
    """Largest number of stages of one pipeline."""
    max_pipelines: int = 0
    """Largest number of pipelines (0 = no limit besides the block count)."""
    balance_budget: int = 150
    """Base number of cost evaluations the stage balancer may spend on one stage device
    group; scaled per group by the adaptive rule of section 6 (x0.25 .. x4)."""
    stage_groups_topk: int = 0
    """If > 0, only this many stage device groups of a pipeline (those with the best
    warm-started configuration) get the balancer; 0 = all of them (default: measured 1%
    better plans on 64-128 devices for ~50% more search time than 6)."""
    type_orders: int = 6
    """A pipeline of more device types than have this many orders (4 and more by default:
    4! = 24) balances the stage groups of its ``type_orders`` most promising type orders
    only (:func:`eth.planner.pipeline.promising_orders`); 0 = every order.  Pipelines of
    up to 3 types see every order either way."""
    refine_margin: float = 0.10
    """Phase 3 (refinement with Lbs) runs for device groups whose phase-2 iteration time
    is within this fraction of the best found so far."""
    seeds: bool = True
    """Also plan with the cheap structured planners (metis-strong, hexiscale-strong,
    Megatron uniform; eth.planner.baselines), whose plans lie in HPP's configuration
    space, and return the fastest plan by Eq. 5 (plan.search["seed_won"] names a winning
    seed).  The enumeration restricts stage sizes and layouts, so the search itself does
    not always reach those plans."""
    recompute_runs: bool = True
    """A stage that needs recompute is fitted three ways -- the op order below, the
    attention core as one run and whole layers, each in the fewest layers that fit -- and
    the fastest is kept (:class:`eth.planner.recompute_runs.RunEvaluator`); off = the op
    order only."""
    symmetric: bool = True
    """After the enumeration, also evaluate the symmetric device groups -- k identical
    pipelines of count_t / k devices of each type, for every k > 1 dividing every type's
    device count -- that the block enumeration or DP did not reach
    (:mod:`eth.planner.symmetric`; plan.search["symmetric"])."""
    polish_top: int = 8
    """At the end, the allocation of this many best device groups is re-solved exactly with
    each pipeline's Mbs free among its halvings/doublings (0 = off)."""
    polish_budget: int = 100
    """Group evaluations the final polish may spend on each of the ``polish_top`` groups."""
    patience: int = 32
    """With three or more device types, the enumeration (and DP) stops once this many
    device groups in a row, after the one-pipeline group, have not made the best plan
    more than ``patience_gain`` faster; the symmetric phase and the polish still run
    (plan.search["patience_stop"]).  Pipelines of several types are seldom dominated and
    the approximate bound compares only equal device counts, so section 5.2's skipping
    rarely cuts anything there, and the later groups mostly confirm the plan.  A
    heuristic stop, not a bound (docs/PLANNER.md "Patience").  0 = off (every group, as
    with two types)."""
    patience_gain: float = 0.001
    """Relative improvement of the best plan that resets the ``patience`` count."""
    dp_window: int = 64
    """Device groups in the sliding window that measures the skip rate."""
    dp_skip_threshold: float = 0.5
    """Skip rate in the last window below which the search switches to DP (Eq. 10)."""
    dp_group_limit: int = 4000
    """Pipeline counts with more device groups than this are searched by DP only."""
    dp_orderings: int = 2
    """Random device orderings tried by DP in addition to the canonical ones."""
    memo: bool = True
    """Planner-level memoisation (speed only, the same plans): per-stage evaluation
    results per ranks layout, layer re-splits, rank layouts (one ranks tuple per stage
    group), whole group allocations and free-Mbs allocations of device groups
    (:class:`eth.planner.evaluate.Evaluator`, :class:`eth.planner.search.HPPSearch`,
    :func:`eth.planner.polish.variant_allocation`).
    Off = the search before these memos (bench/search_scaling.py compares both)."""
    prune: bool = True
    """Phase 1 balances a pipeline's stage groups in ascending order of a lower bound of
    their Eq. 1 time and skips those whose bound exceeds the best time found (the
    alternatives the polish reads are completed when read); and the polish allocates a
    move only if a lower bound of its group's time (:func:`eth.planner.polish.allocation_floor`,
    no All-Reduce) is below the best so far, or it may rank among the few that are also
    scored with free Mbs: the same plans, fewer evaluations and allocations
    (:func:`eth.planner.pipeline.optimise_pipeline`, :class:`eth.planner.polish._Scan`)."""
    op_boundaries: bool = False
    """After the search, move stage boundaries inside layers, op by op, where that makes
    the plan faster (:mod:`eth.planner.op_boundaries`; a plan with such a boundary is
    version 2; plan.search["op_boundaries"])."""
    allow_overshoot: bool = False
    """Accept sum(Lbs) > Gbs (paper constraint Eq. 3) when no exact split exists; by
    default only exact splits are emitted because the runtime requires equality."""
    progress: bool = False
    """Show a tqdm progress bar on stderr."""
    jobs: int = 1
    """Processes the search may use at once, this one included.  With more than one (and
    the fork start method: Linux, macOS) the seed planners run in a forked process during
    the group enumeration, the processes they leave optimise the enumeration's pipelines
    ahead (:mod:`eth.planner.ahead`), and the symmetric phase and the polish of the best
    groups are spread over ``jobs`` processes (:mod:`eth.planner.workers`).  The plan is the same for
    every value; only the wall time and the search statistics differ."""
    setup: TrainSetup = TrainSetup()
    """Precision, ZeRO stage and gradient dtype to plan for (memory, Eq. 6); recorded in
    the plan (``plan.training``) and used by the runtime."""
    objective: str = "blocks"
    """What the search minimises (``eth.cost.model.CostModel.objective``): "blocks" (each
    gradient block reduced once its slowest holder in any pipeline is done, as the
    runtime does) or "eq5" (the paper's Eq. 5: a stage's own All-Reduce after its own
    backward)."""
    simulate_finalists: bool = True
    """Re-score the search's finalists within ``eth.planner.finalists.FINALIST_MARGIN`` of
    the best by the event simulator and return the fastest simulated
    (:mod:`eth.planner.finalists`); off: the best by the objective."""

    def __post_init__(self):
        check_gbs(self.gbs)
        if self.strategy not in STRATEGIES:
            raise SpecError(f"strategy {self.strategy!r} is unknown; known: {', '.join(STRATEGIES)}")
        if not 1 <= self.alpha < math.inf:       # NaN fails both
            raise SpecError(f"alpha must be a number >= 1, got {self.alpha}")
        check_time_limit(self.time_limit)
        if self.stage_groups_topk < 0 or self.polish_top < 0:
            raise SpecError(f"stage_groups_topk and polish_top must be >= 0, got "
                            f"{self.stage_groups_topk}, {self.polish_top}")
        if self.patience_gain < 0:
            raise SpecError(f"patience_gain must be >= 0, got {self.patience_gain}")
        if self.objective not in ("blocks", "eq5"):
            raise SpecError(f"objective must be one of blocks, eq5, got {self.objective!r}")
        for name in ("type_orders", "max_blocks", "patience"):
            if getattr(self, name) < 0:
                raise SpecError(f"{name} must be >= 0 (0: off), got {getattr(self, name)}")
        for name in ("max_blocks_per_type", "max_stages", "balance_budget", "dp_window", "jobs"):
            if getattr(self, name) < 1:
                raise SpecError(f"{name} must be >= 1, got {getattr(self, name)}")

    def switches(self) -> dict:
        """The options recorded in plan.search."""
        return asdict(self)
