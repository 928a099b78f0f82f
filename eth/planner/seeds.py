"""The seed planners of the HPP search: the strong baselines, whose plans lie in HPP's
space, run beside the search (``SearchOptions.jobs`` > 1, a forked process) or before it,
and the fastest plan of all by Eq. 5 is the search's answer
(:func:`eth.planner.search.search`)."""
from __future__ import annotations

from dataclasses import replace

from eth.errors import InfeasibleError
from eth.spec.plan import Plan
from eth.planner.finalists import choose
from eth.planner.progress import Clock
from eth.planner.workers import Forked, can_fork

SEED_STRATEGIES = ("metis-strong", "uniform", "hexiscale-strong")
"""The planners whose plans seed the HPP search (the strong baselines: their plans lie in
HPP's space; the faithful Metis may use mixed-type stages, which the plan format lacks),
in the order they run (the slowest last: beside the search it may use what the others
left of the time limit)."""


class Seeds:
    """The seed planners of one search (none without ``options.seeds``).  With
    ``options.jobs`` > 1 they start at once in a forked process (:attr:`beside`) and run one
    after another, each with what is left of the time limit (``clock``), so a seed scores
    what its strategy scores alone whenever the seeds before it leave it the time it
    needs; otherwise they run here, first, each with at most a sixth of the limit."""

    def __init__(self, model, cluster, profiles, options, clock: Clock):
        self.model, self.cluster, self.profiles, self.options, self.clock = model, cluster, profiles, options, clock
        on = options.seeds and options.jobs > 1 and can_fork()
        self.beside = Forked(lambda: self._plans(True)) if on else None
        self.plans, self.seconds = self._plans(False) if self.beside is None else ({}, 0.0)

    def _plans(self, beside: bool) -> tuple[dict[str, Plan], float]:
        from eth.planner.baselines import plan_baseline
        opt, start, plans = self.options, Clock(0), {}
        for name in SEED_STRATEGIES if opt.seeds else ():
            if opt.time_limit and beside:
                limit = max(opt.time_limit - self.clock.elapsed(), 1e-9)
            else:
                limit = opt.time_limit / 6
            try:
                plans[name] = plan_baseline(name, self.model, self.cluster, self.profiles, opt.gbs,
                                            replace(opt, time_limit=limit, progress=False))
            except InfeasibleError:
                continue
        return plans, start.elapsed()

    def join(self) -> None:
        """Wait for the seeds beside the search (their plans are then in :attr:`plans`)."""
        if self.beside is not None:
            self.plans, self.seconds = self.beside.result()

    def best_of(self, plan: Plan | None, error: InfeasibleError | None, cost) -> Plan:
        """The search's ``plan`` (None: it raised ``error``), or the fastest seed's plan
        where that is faster (``seed_won``; the search's record kept), with every seed's
        time (``seeds_ms``); ``error`` again when there is neither.  Faster: as the search's
        finalists are chosen (:func:`eth.planner.finalists.choose` with ``cost``, the final
        objective; the seeds' simulated times in ``seeds_simulated_ms``)."""
        if plan is None and not self.plans:
            raise error
        why = str(error) if error is not None else ""
        if self.plans:
            names = list(self.plans)
            plans = ([] if plan is None else [plan]) + [self.plans[n] for n in names]
            i, record = choose(cost, plans, self.options.simulate_finalists)
            sims = record["simulated_ms"][len(plans) - len(names):]
            if plans[i] is not plan:
                name, seed = names[i - (len(plans) - len(names))], plans[i]
                seed.predicted["simulated_ms"] = record["simulated_ms"][i]
                base = plan.search if plan is not None else {
                    "strategy": "hpp", "search_error": why, "time_limited": "time limit" in why}
                seed.search = dict(base, seed_won=name, seed_search=seed.search)
                plan = seed
            plan.search["seeds_ms"] = {k: round(v.predicted["iteration_ms"], 4) for k, v in self.plans.items()}
            if self.options.simulate_finalists:
                plan.search["seeds_simulated_ms"] = dict(zip(names, sims))
        return plan
