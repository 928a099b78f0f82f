"""The HPP search: pipeline device groups x three-phase hierarchical balance.

For every pipeline count p = 1..N (N = blocks, <= Gbs) and every device group with p
pipelines (:func:`eth.planner.enumerate.device_groups`, ascending Eq. 9 cost with
``order``), :meth:`HPPSearch.evaluate_group` runs the three phases of section 4.2.3:

1. stage configurations with Lbs = Gbs (Eq. 1) for every pipeline
   (:func:`eth.planner.pipeline.optimise_pipeline`; cached by block vector with ``cache``);
2. greedy local batch allocation (Eq. 2-5, :func:`eth.planner.allocate.allocate`) with
   AR_i^j from :meth:`eth.cost.model.CostModel.stage_allreduce_ms` (Eq. 6) on concrete ranks;
   if the phase-1 Mbs admit no exact split, the exact allocation with free Mbs
   (:func:`eth.planner.polish.variant_allocation`) is used instead; then Mbs are halved
   while re-allocation lowers Eq. 2 (:func:`eth.planner.polish.finer_microbatches`:
   coarse Mbs make the Lbs split too coarse);
3. for groups within ``refine_margin`` of the best: re-balance every pipeline with its
   Lbs (Eq. 1 with Lbs, :func:`eth.planner.pipeline.refine_pipeline`), re-allocate
   (its Mbs may have changed), and keep the refined plan only if it is predicted faster;
4. after the search, the ``polish_top`` best groups are polished on the true objective
   (:func:`eth.planner.polish.polish`: tp/dp and layer moves scored by Eq. 5 + Eq. 6
   of the whole group, then an exact allocation with free Mbs).

Every candidate plan is scored by :meth:`eth.cost.model.CostModel.evaluate` (Eq. 5 + Eq. 6,
memory check); the best feasible plan with sum Lbs == Gbs wins.

Section 5 optimisations (each switchable): ``cache`` (5.1), ``skip`` (5.2,
:mod:`eth.planner.bounds`), ``order`` (5.3, Eq. 7-9) and ``dp`` (5.4, Eq. 10,
:mod:`eth.planner.dynprog`): when the skip rate over the last ``dp_window`` groups
falls below ``dp_skip_threshold``, or a pipeline count has more than
``dp_group_limit`` groups, the remaining groups of that and all larger pipeline counts
are replaced by the DP partitions of several device orderings.  Device groups are counted
one pipeline count at a time, saturating above ``dp_group_limit`` when DP is on.

``time_limit``: one :class:`eth.planner.progress.Clock` is polled while counting and
generating groups, between groups, inside phases 1 and 3 (between stage groups and
balancer rounds) and at every polish step; the best plan found so far is returned.
"""
from __future__ import annotations

import functools
import itertools
import math
import random
from collections import deque
from dataclasses import dataclass, field, replace

from eth.spec.cluster import Cluster
from eth.cost.model import CostModel
from eth.errors import InfeasibleError
from eth.spec.model import ModelSpec
from eth.spec.plan import PipelinePlan, Plan, StagePlan
from eth.planner.ahead import Ahead
from eth.planner.allocate import Allocation, alloc_key, allocate, pipeline_line
from eth.planner.bounds import approximate_bound, dominated, variance_cost
from eth.planner.collector import paused
from eth.planner.dynprog import split_dp
from eth.planner.finalists import SHIFTED, choose, shifted_lbs
from eth.cost.reduction import simulated_iteration_ms
from eth.planner.enumerate import (TimeUp, assign_ranks, count_groups, device_groups, make_blocks,
                                   pipeline_can_hold, plan_tp_in_nodes)
from eth.planner.evaluate import Evaluator
from eth.planner.finish import finish
from eth.planner.infeasible import infeasible_message, type_too_small
from eth.planner.options import SEARCH_OBJECTIVE, SearchOptions
from eth.planner.pipeline import PipelineResult, optimise_pipeline, refine_pipeline
from eth.planner.polish import Candidate, finer_microbatches, variant_allocation
from eth.planner.progress import Clock, PhaseTimer, progress_bar
from eth.planner.recompute_runs import RunEvaluator
from eth.planner.seeds import Seeds
from eth.profiles.db import ProfileDB


@dataclass
class SearchStats:
    """Counters recorded in plan.search."""

    groups_total: int = 0
    """Device groups of the pipeline counts that were counted (1..counted_pipelines)."""
    counted_pipelines: int = 0
    """Pipeline counts 1..this were counted exactly.  Counting is lazy: it stops once a
    pipeline count has more than dp_group_limit groups (DP takes over), after DP took
    over, and at the time limit."""
    groups_evaluated: int = 0
    """Enumerated groups that were fully evaluated."""
    groups_skipped: int = 0
    """Enumerated groups dropped by early skipping."""
    groups_by_dp: int = 0
    """Groups produced and evaluated by DP (they may repeat enumerated ones)."""
    groups_not_visited: int = 0
    """Counted groups never enumerated (handled by DP or cut by the time limit)."""
    cache_hits: int = 0
    pipelines_optimised: int = 0
    refinements: int = 0
    cost_evaluations: int = 0
    dp_triggered_at: int = 0
    """Pipeline count at which DP took over (0 = never)."""
    time_limited: bool = False
    patience_stop: int = 0
    """Evaluated device groups (enumerated and DP) when ``patience`` stopped the
    enumeration (0 = it did not)."""
    patience_at: int = 0
    """Pipeline count whose groups the patience stop left partly unvisited (0: none)."""
    reasons: dict = field(default_factory=dict)
    """Why evaluated groups produced no plan: reason -> count."""


def _time_up(clock: Clock, stats: SearchStats) -> bool:
    """True once ``clock``'s limit is reached (and recorded in ``stats``).  The stop
    callable the pipeline results in a search's caches keep is this function bound to the
    search's clock and statistics: the bound method :meth:`HPPSearch.out_of_time` there
    would close a reference cycle through the search, which would then outlive
    :func:`search` until a full garbage collection (:mod:`eth.planner.collector`)."""
    if clock.out():
        stats.time_limited = True
    return clock.hit


class HPPSearch:
    """One search over one model/cluster/profile database."""

    def __init__(self, model: ModelSpec, cluster: Cluster, profiles: ProfileDB, options: SearchOptions):
        self.model, self.cluster, self.opt = model, cluster, options
        self.cost = CostModel(model, cluster, profiles, options.setup, objective=SEARCH_OBJECTIVE)
        self.final = CostModel(model, cluster, profiles, options.setup, objective=options.objective)
        self.finalists: list[Candidate] = []
        self.ev = (RunEvaluator if options.recompute_runs else Evaluator)(self.cost, options.memo)
        self.layouts: dict = {}
        self._ar: dict = {}
        self._blocks: dict = {}
        self._allocs: dict = {}     # memo of _allocate_group (with ``memo``)
        self.variants: dict = {}    # memo of polish.variant_allocation (with ``memo``)
        self.floor_lines: dict = {}  # memo of polish.allocation_floor's pipeline lines
        self.blocks = make_blocks(cluster, options.max_blocks_per_type, options.max_blocks)
        self.facts = {t: (d.tflops, d.memory_gb) for t, d in cluster.types.items()}
        self.stats = SearchStats()
        self._cache: dict = {}
        self._known: dict = {}      # vec -> phase-1 throughput (what skipping may use)
        self._bound_memo: dict = {}
        self._hold: dict = {}
        self.best: Candidate | None = None
        self.clock = Clock(options.time_limit)
        self._window: deque = deque(maxlen=options.dp_window)
        self._dp_done = False
        self._stale = 0            # groups in a row that did not improve the best (patience)
        self.top: list[Candidate] = []
        self.phases = PhaseTimer()
        self.ahead = Ahead(self)
        self.stop = functools.partial(_time_up, self.clock, self.stats)   # what results keep (run() restarts this clock)

    # ------------------------------------------------------------------ helpers
    def _devices(self, vec) -> dict[str, int]:
        return {t: d for t, d in zip(self.blocks.types, self.blocks.devices(vec)) if d}

    def can_hold(self, vec) -> bool:
        if vec not in self._hold:
            self._hold[vec] = pipeline_can_hold(self.cluster, self.blocks, vec, self.model,
                                                self.cost.bytes_per_param)
        return self._hold[vec]

    def out_of_time(self) -> bool:
        """True once the time limit is reached (and recorded in the statistics)."""
        return _time_up(self.clock, self.stats)

    @property
    def best_throughput(self) -> float:
        return self.opt.gbs / self.best.iteration_ms if self.best else 0.0

    # ------------------------------------------------------------------ phase 1 / 3
    def phase1(self, vec, batch: int | None = None) -> PipelineResult | None:
        """Phase 1 (Eq. 1 with B = Gbs, or ``batch``) for one pipeline, through the cache."""
        batch = batch or self.opt.gbs
        key = (vec, batch)
        if self.opt.cache and key in self._cache:
            self.stats.cache_hits += 1
            return self._cache[key]
        self.stats.pipelines_optimised += 1
        kept = self.ahead.take(vec) if batch == self.opt.gbs else None
        if kept is not None:        # done ahead, in this or a forked process
            result = kept.result
            self.ev.evaluations += kept.evaluations
        else:
            result = self.optimise(vec, batch)
        if self.opt.cache and not self.clock.hit:  # a result cut by the time limit is not cached
            self._cache[key] = result
        if batch == self.opt.gbs and not self.clock.hit:  # a cut result is no bound
            self._known[vec] = result.throughput if result is not None else 0.0
        return result

    def seen(self, vec) -> bool:
        """True if phase 1 at B = Gbs of ``vec`` is in the cache."""
        return (vec, self.opt.gbs) in self._cache

    def optimise(self, vec, batch: int) -> PipelineResult | None:
        """:func:`eth.planner.pipeline.optimise_pipeline` with the search's options.  Pruned
        at every batch: the callers with another batch (the polish, the symmetric phase)
        read at most the MAX_ALTERNATIVES next groups, which pruning completes."""
        with self.phases("balance"):
            return optimise_pipeline(self.ev, self.blocks, vec, batch, self.opt.balance_budget,
                                     self.opt.stage_groups_topk, self.opt.max_stages, self.stop,
                                     self.phases, self.opt.prune, self.opt.type_orders)

    def phase3(self, result: PipelineResult, lbs: int) -> PipelineResult:
        key = (result.vec, lbs, result.state)
        if self.opt.cache and key in self._cache:
            self.stats.cache_hits += 1
            return self._cache[key]
        self.stats.refinements += 1
        with self.phases("refine"):
            refined = refine_pipeline(self.ev, result, lbs, self.opt.balance_budget, self.stop)
        if self.opt.cache and not self.clock.hit:
            self._cache[key] = refined
        return refined

    # ------------------------------------------------------------------ bounds
    def upper_bound(self, vec) -> float:
        """Throughput upper bound of one pipeline (section 5.2); inf if nothing is known."""
        if vec in self._known:
            return self._known[vec]
        key = (vec, len(self._known))
        if key in self._bound_memo:
            return self._bound_memo[key]
        devs = self._devices(vec)
        bounds = [tp for other, tp in self._known.items()
                  if dominated(devs, self._devices(other), self.facts)]
        bound = min(bounds) if bounds else math.inf
        cached = [(self._devices(o), tp) for o, tp in self._known.items() if tp > 0]
        bound = min(bound, approximate_bound(devs, cached, self.facts, self.opt.alpha))
        self._bound_memo[key] = bound
        return bound

    # ------------------------------------------------------------------ one group
    def ranks(self, results) -> list[list[list[int]]]:
        """:func:`assign_ranks` of the results' stage groups (memoised with ``memo``)."""
        if not self.opt.memo:
            return assign_ranks(self.blocks, [list(r.group.stages) for r in results])
        key = tuple(r.group.stages for r in results)
        hit = self.layouts.get(key)
        if hit is None:
            hit = self.layouts[key] = tuple(tuple(tuple(s) for s in p) for p in
                                             assign_ranks(self.blocks, [list(g) for g in key]))
        return [[list(s) for s in p] for p in hit]

    def allreduce_ms(self, results, plan) -> list[list[float]]:
        """AR_i^j of ``plan`` (built from ``results``): memoised with ``memo`` by the stage
        groups, tps and layer counts, all that Eq. 6 reads (not Mbs, Lbs or recompute)."""
        if not self.opt.memo:
            return self.cost.stage_allreduce_ms(plan.pipelines)
        key = tuple((r.group.stages, r.state.stages) for r in results)   # stage states: tp, layers
        hit = self._ar.get(key)
        if hit is None:
            hit = self._ar[key] = self.cost.stage_allreduce_ms(plan.pipelines)
        return [list(row) for row in hit]

    def sync_blocks(self, results, plan) -> list:
        """:meth:`eth.cost.model.CostModel.sync_blocks` of ``plan`` (built from ``results``),
        memoised like :meth:`allreduce_ms` (the blocks read the same fields)."""
        if not self.opt.memo:
            return self.cost.sync_blocks(plan.pipelines)
        key = tuple((r.group.stages, r.state.stages) for r in results)
        hit = self._blocks.get(key)
        if hit is None:
            hit = self._blocks[key] = self.cost.sync_blocks(plan.pipelines)
        return hit

    def build_plan(self, results: list[PipelineResult], lbs) -> Plan:
        ranks = self.ranks(results)
        pipelines = []
        for r, rk, n in zip(results, ranks, lbs):
            stages = []
            for st, rng, rec, sr in zip(r.state.stages, r.state.layer_ranges(),
                                        r.evaluation.recompute, rk):
                stages.append(StagePlan(sr, st.device_type, st.tp, st.dp, rng, dict(rec)))
            pipelines.append(PipelinePlan(r.state.mbs, n, stages))
        return Plan(self.model, self.cluster, self.opt.gbs, pipelines)

    def allocate(self, results) -> tuple[Plan, float] | None:
        with self.phases("allocation"):
            if not self.opt.memo:
                return self._allocate_group(results)
            # the same pipelines again (the polish re-plans and descends through many
            # repeats: 295 of 1250 allocations of GPT-3 13B / 64 devices): the same answer
            key = alloc_key(results)
            hit = self._allocs.get(key)
            if hit is None:
                before = dict(self.stats.reasons)
                got = self._allocate_group(results)
                why = [k for k, v in self.stats.reasons.items() if v != before.get(k, 0)]
                hit = self._allocs[key] = (got, why)
            else:
                for why in hit[1]:
                    self._reason(why)
            return hit[0]

    def _allocate_group(self, results) -> tuple[Plan, float] | None:
        plan = self.build_plan(results, [r.state.mbs for r in results])
        if not plan_tp_in_nodes(plan):
            # the group's layout (assign_ranks) left no node-local place for a tp group
            self._reason("a tp group would cross nodes")
            return None
        ar = self.allreduce_ms(results, plan)
        lines = [pipeline_line(r.evaluation.costs, r.state.mbs, self.ev.tails(r.state, r.evaluation.costs, a))
                 for r, a in zip(results, ar)]
        alloc: Allocation | None = allocate(lines, [r.state.mbs for r in results], self.opt.gbs,
                                            self.opt.allow_overshoot)
        if alloc is None:
            self._reason("no Lbs split with sum == gbs")
            return None
        for p, n in zip(plan.pipelines, alloc.lbs):
            p.lbs = n
        blocks = self.sync_blocks(results, plan) if self.cost.objective == "blocks" else None
        ev = self.cost.evaluate(plan, ar, blocks)   # same pipelines and stages: only Lbs changed
        if not ev["feasible"]:
            self._reason("memory after allocation")
            return None
        return plan, ev["iteration_ms"]

    def _reason(self, why: str) -> None:
        self.stats.reasons[why] = self.stats.reasons.get(why, 0) + 1

    def evaluate_group(self, vecs) -> Candidate | None:
        """Three-phase balance of one device group; updates the best plan."""
        if len(vecs) > self.opt.gbs:
            self._reason("more pipelines than gbs")
            return None
        results = []
        for v in vecs:
            r = self.phase1(v)
            if r is None and self.clock.hit:
                self._reason("time limit")
                return None
            if r is None:
                self._reason("no pipeline configuration whose mbs divides gbs")
                return None
            if not r.feasible:
                self._reason("a pipeline does not fit in memory")
                return None
            results.append(r)
        got = self.allocate(results)
        if got is None:
            # the phase-1 Mbs admit no exact split (e.g. sum of Mbs > Gbs): free the Mbs
            with self.phases("allocation"):
                cand = variant_allocation(self, results)
            if cand is None:
                return None
        else:
            cand = Candidate(got[0], got[1], results)
        with self.phases("allocation"):
            cand = finer_microbatches(self, cand)
        results = cand.results
        if not self.out_of_time() and (
                self.best is None or cand.iteration_ms <= self.best.iteration_ms * (1 + self.opt.refine_margin)):
            for _ in range(2):
                lbs = [p.lbs for p in cand.plan.pipelines]
                refined = [self.phase3(r, n) for r, n in zip(cand.results, lbs)]
                if any(not r.feasible for r in refined):
                    break
                again = self.allocate(refined)
                if again is None or again[1] >= cand.iteration_ms * (1 - 1e-9):
                    break
                cand = Candidate(again[0], again[1], refined)
                if [r.state.mbs for r in refined] == [r.state.mbs for r in results]:
                    break
                results = refined
            with self.phases("allocation"):
                cand = finer_microbatches(self, cand)
        self._consider(cand)
        return cand

    def _consider(self, cand: Candidate) -> None:
        if self.best is None or cand.iteration_ms < self.best.iteration_ms * (1 - 1e-12):
            self.best = cand
        if self.opt.polish_top:
            key = tuple(r.vec for r in cand.results)
            top = [c for c in self.top if tuple(r.vec for r in c.results) != key or
                   c.iteration_ms <= cand.iteration_ms]
            if all(tuple(r.vec for r in c.results) != key for c in top):
                top.append(cand)
            top.sort(key=lambda c: c.iteration_ms)
            self.top = top[:self.opt.polish_top]

    # ------------------------------------------------------------------ driver
    def run(self) -> Plan:
        opt = self.opt
        self.clock.restart()
        total = self.blocks.count
        max_p = min(self.blocks.total, opt.gbs, opt.max_pipelines or self.blocks.total)
        limit = opt.dp_group_limit if opt.dp else None
        if not self.can_hold(total):
            raise InfeasibleError(infeasible_message(self))
        small = type_too_small(self)
        if small:
            raise InfeasibleError(small)
        bar = progress_bar(0, opt.progress, "hpp", unit="group")
        root = self.phases("enumeration")
        root.__enter__()
        try:
            for p in range(1, max_p + 1):
                if self.out_of_time():
                    break
                # counted lazily, saturating above dp_group_limit, polling the clock
                try:
                    n = count_groups(total, p, self.can_hold, limit=limit, stop=self.stop)
                except TimeUp:
                    break
                if limit is not None and n > limit:
                    # too many groups: DP (Eq. 10) covers this and all larger pipeline counts
                    self._mark_dp(p)
                    with self.phases("dp"):
                        self._run_dp(p)
                    break
                self.stats.groups_total += n
                self.stats.counted_pipelines = p
                bar.total += n
                bar.refresh()
                visited, dp_now = 0, False
                groups = list(self._ordered_groups(p))
                for i, vecs in enumerate(groups):
                    if self.out_of_time() or self._patience_out():
                        break
                    visited += 1
                    bar.update(1)
                    self._visit(vecs, itertools.islice(groups, i, None))
                    if opt.dp and self._skip_rate_low():
                        self._mark_dp(p)
                        with self.phases("dp"):
                            self._run_dp(p)
                        dp_now = True
                        break
                self.stats.groups_not_visited += n - visited
                if dp_now:
                    break
                if self._patience_out():
                    self.stats.patience_at = p if visited < n else p + 1
                    break
            self.ahead.close()
            symmetric = finish(self)
        finally:
            self.ahead.close()
            bar.close()
            root.__exit__()
        self.stats.cost_evaluations = self.ev.evaluations
        if self.best is None:
            raise InfeasibleError(infeasible_message(self))
        with self.phases("finalists"):
            plan, finalists = self.final_choice()
        boundaries = None
        if opt.op_boundaries:
            from eth.planner.op_boundaries import refine_search

            with self.phases("op_boundaries"):
                refined, boundaries = refine_search(self, plan)
            # refined by the search's objective, kept where the final one agrees
            before = boundaries["before_ms"] = plan.predicted["iteration_ms"]
            if refined is not plan:
                self.final.annotate(refined)
                boundaries["after_ms"] = refined.predicted["iteration_ms"]
                boundaries["kept"] = refined.predicted["iteration_ms"] < before
                if boundaries["kept"]:
                    plan = refined
                    if opt.simulate_finalists:
                        plan.predicted["simulated_ms"] = round(simulated_iteration_ms(plan, self.final), 4)
            else:
                boundaries["after_ms"] = before
        plan.search = {
            "strategy": opt.strategy, "time_s": round(self.clock.elapsed(), 3),
            "seed": opt.seed, "options": opt.switches(),
            "blocks": {t: {"devices_per_block": b, "blocks": k}
                       for t, b, k in zip(self.blocks.types, self.blocks.block, self.blocks.count)},
            "candidates": {"groups_total": self.stats.groups_total,
                           "counted_pipelines": self.stats.counted_pipelines,
                           "max_pipelines": max_p,
                           "evaluated": self.stats.groups_evaluated,
                           "skipped": self.stats.groups_skipped,
                           "by_dp": self.stats.groups_by_dp,
                           "not_visited": self.stats.groups_not_visited},
            "cache_hits": self.stats.cache_hits,
            "pipelines_optimised": self.stats.pipelines_optimised,
            "refinements": self.stats.refinements,
            "cost_evaluations": self.stats.cost_evaluations,
            "dp_triggered_at_pipelines": self.stats.dp_triggered_at,
            "time_limited": self.stats.time_limited,
            "patience_stop": self.stats.patience_stop,
            "phase_s": self.phases.rounded(),
        }
        if opt.symmetric:
            plan.search["symmetric"] = symmetric
        plan.search["finalists"] = finalists
        if boundaries is not None:
            plan.search["op_boundaries"] = boundaries
        return plan.validate()

    def final_choice(self) -> tuple[Plan, dict]:
        """The plan to return among :attr:`finalists` (distinct plans, annotated by the
        final objective, :attr:`final`; the :data:`eth.planner.finalists.SHIFTED` best of
        them with their Lbs shifted under it, :func:`eth.planner.finalists.shifted_lbs`)
        and, where simulated, with ``simulated_ms``; and the record of that choice
        (:func:`eth.planner.finalists.choose`)."""
        plans, seen = [], set()
        for cand in self.finalists or [self.best]:
            key = cand.plan.content_hash()
            if key not in seen:
                seen.add(key)
                self.final.annotate(cand.plan)
                plans.append(cand.plan)
        plans.sort(key=lambda p: p.predicted["iteration_ms"])
        for k, plan in enumerate(plans[:SHIFTED]):
            shifted = shifted_lbs(self.final, plan)
            if shifted is not plan:
                self.final.annotate(shifted)
                plans[k] = shifted
        i, record = choose(self.final, plans, self.opt.simulate_finalists)
        plans[i].predicted["simulated_ms"] = record["simulated_ms"][i]
        return plans[i], record

    def _mark_dp(self, p: int) -> None:
        if not self.stats.dp_triggered_at:
            self.stats.dp_triggered_at = p

    def _ordered_groups(self, p):
        groups = device_groups(self.blocks.count, p, self.can_hold, stop=self.stop)
        if not self.opt.order:
            return groups
        tflops = {t: d.tflops for t, d in self.cluster.types.items()}
        keyed = []
        for i, g in enumerate(groups):
            if i % 256 == 0 and self.out_of_time():
                break
            keyed.append((variance_cost([self._devices(v) for v in g], tflops, self.opt.gbs,
                                        self.model.num_layers), i, g))
        keyed.sort(key=lambda x: (x[0], x[1]))
        return (g for _, _, g in keyed)

    def _visit(self, vecs, upcoming=()) -> None:
        """Skip or evaluate one enumerated group; ``upcoming``: it and the groups after it,
        whose pipelines phase 1 may optimise ahead (:class:`eth.planner.ahead.Ahead`)."""
        if self.opt.skip and self.best is not None:
            bound = sum(self.upper_bound(v) for v in vecs)
            if bound < self.best_throughput * (1 - 1e-9):
                self.stats.groups_skipped += 1
                self._window.append(1)
                return
        self.ahead.fill(upcoming)
        self._window.append(0)
        self.stats.groups_evaluated += 1
        self._patient(vecs)

    def _patient(self, vecs) -> None:
        """:meth:`evaluate_group`, counting the groups in a row (after the first pipeline
        count) that do not make the best plan ``patience_gain`` faster."""
        before = self.best.iteration_ms if self.best is not None else math.inf
        self.evaluate_group(vecs)
        if len(vecs) > 1:
            now = self.best.iteration_ms if self.best is not None else math.inf
            self._stale = 0 if now < before * (1 - self.opt.patience_gain) else self._stale + 1

    def _patience_out(self) -> bool:
        """True once ``patience`` groups in a row did not improve the best plan, on a
        cluster of three or more device types (recorded in the statistics)."""
        opt = self.opt
        if not opt.patience or len(self.blocks.types) < 3 or self._stale < opt.patience:
            return False
        if not self.stats.patience_stop:
            self.stats.patience_stop = self.stats.groups_evaluated + self.stats.groups_by_dp
        return True

    def _skip_rate_low(self) -> bool:
        w = self._window
        return len(w) == w.maxlen and sum(w) / len(w) < self.opt.dp_skip_threshold

    def _orderings(self) -> list[list[int]]:
        types = range(len(self.blocks.types))
        strong = sorted(types, key=lambda t: (-self.facts[self.blocks.types[t]][0], t))
        major = [t for t in strong for _ in range(self.blocks.count[t])]
        left = {t: self.blocks.count[t] for t in types}
        interleaved = []
        while any(left.values()):
            for t in strong:
                if left[t]:
                    interleaved.append(t)
                    left[t] -= 1
        orders = [major, list(reversed(major)), interleaved]
        rng = random.Random(self.opt.seed)
        for _ in range(self.opt.dp_orderings):
            shuffled = list(major)
            rng.shuffle(shuffled)
            orders.append(shuffled)
        unique = []
        for o in orders:
            if o not in unique:
                unique.append(o)
        return unique

    def _run_dp(self, p: int) -> None:
        """Eq. 10 partitions for every remaining pipeline count, evaluated once each."""
        if self._dp_done:
            return
        self._dp_done = True
        max_p = min(self.blocks.total, self.opt.gbs, self.opt.max_pipelines or self.blocks.total)

        def throughput(vec):
            if not self.can_hold(vec) or self.out_of_time():
                return 0.0
            r = self.phase1(vec)
            return r.throughput if r is not None else 0.0

        seen = set()
        for order in self._orderings():
            if self.out_of_time() or self._patience_out():
                break
            for q, (_, vecs) in sorted(split_dp(order, len(self.blocks.types), max_p, throughput).items()):
                if q < p or vecs in seen or self.out_of_time() or self._patience_out():
                    continue
                seen.add(vecs)
                self.stats.groups_by_dp += 1
                self._patient(vecs)


def search(model: ModelSpec, cluster: Cluster, profiles: ProfileDB, options: SearchOptions) -> Plan:
    """Run the configured strategy and return a validated, annotated plan.

    For "hpp" with ``options.seeds``, the structured planners of :data:`eth.planner.seeds.SEED_STRATEGIES`
    seed the search and the fastest plan by Eq. 5 is returned (:class:`eth.planner.seeds.Seeds`:
    with ``options.jobs`` > 1 beside the search, which then has the whole time limit;
    otherwise first, and the search gets what is left).  The garbage collector is paused
    until it returns (:func:`eth.planner.collector.paused`).
    """
    with paused():
        return _search(model, cluster, profiles, options)


def _search(model: ModelSpec, cluster: Cluster, profiles: ProfileDB, options: SearchOptions) -> Plan:
    if options.strategy != "hpp":
        from eth.planner.baselines import plan_baseline
        return plan_baseline(options.strategy, model, cluster, profiles, options.gbs, options)
    clock = Clock(options.time_limit)
    seeds = Seeds(model, cluster, profiles, options, clock)
    left = (max(options.time_limit - clock.elapsed(), 1e-9) if options.time_limit and seeds.plans
            else options.time_limit)
    try:
        hpp = HPPSearch(model, cluster, profiles, replace(options, time_limit=left))
        hpp.ahead.beside = seeds.beside     # the seeds' process: one fewer for phase 1 ahead while it runs
        plan, error = hpp.run(), None
    except InfeasibleError as exc:
        plan, error = None, exc
    seeds.join()
    plan = seeds.best_of(plan, error, CostModel(model, cluster, profiles, options.setup, objective=options.objective))
    plan.search["options"] = options.switches()
    plan.search["time_s"] = round(clock.elapsed(), 3)
    plan.search["phase_s"] = dict(plan.search.get("phase_s") or {}, seeds=round(seeds.seconds, 3))
    plan.training = options.setup
    return plan
