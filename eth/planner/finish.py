"""The end of the HPP search (:class:`eth.planner.search.HPPSearch`): the symmetric phase
and the polish of the best device groups, spread over forked processes with ``jobs`` > 1
and adopted in one order, so that every ``jobs`` value returns the same plan."""
from __future__ import annotations

from dataclasses import dataclass

from eth.planner.polish import Candidate, lightest, polish
from eth.planner.symmetric import adopt, symmetric_phase
from eth.planner.workers import parallel_map


def finish(search) -> dict:
    """The symmetric phase, then the polish of the best groups (``polish_top``), each
    adopted in that order where it is faster.  They read nothing the others change
    but the caches and (the symmetric phase, the polish's last step) the best so far,
    so with ``jobs`` > 1 they run spread over forked processes
    (:func:`eth.planner.workers.parallel_map`) and are adopted here in the same order:
    the same plan.  Returns the symmetric record for ``plan.search``."""
    work = ([None] if search.opt.symmetric and not search.out_of_time() else []) + list(search.top)
    evaluations = search.ev.evaluations

    def run(item):
        if search.out_of_time():
            return Finished(item, 0)
        before = search.ev.evaluations
        if item is None:
            with search.phases("symmetric", sticky=True):
                got = symmetric_phase(search)
        else:
            with search.phases("polish", sticky=True):
                got = polish(search, item, search.opt.polish_budget)
        return Finished(got, search.ev.evaluations - before)

    done = parallel_map(run, work, search.opt.jobs, portable=Finished.portable)
    search.ev.evaluations = evaluations + sum(d.evaluations for d in done)
    symmetric = {}
    for item, d in zip(work, done):
        if item is None:
            symmetric = adopt(search, *d.value) if d.value is not None else {}
            continue
        better = lightest(search, d.value)
        if better.iteration_ms < search.best.iteration_ms * (1 - 1e-9):
            search.best = better
    return symmetric


@dataclass
class Finished:
    """One piece of :func:`finish` and the cost evaluations it took."""

    value: object
    evaluations: int

    @staticmethod
    def portable(done: "Finished") -> "Finished":
        """What a worker process sends back: its candidates' plans and times (their
        per-pipeline results hold the worker's evaluator; what follows reads neither)."""
        v = done.value
        if isinstance(v, Candidate):
            v = _plan_only(v)
        elif isinstance(v, tuple):      # the symmetric phase: (record, [(k, candidate)])
            v = (v[0], [(k, _plan_only(c)) for k, c in v[1]])
        return Finished(v, done.evaluations)


def _plan_only(cand: Candidate) -> Candidate:
    return Candidate(cand.plan, cand.iteration_ms, [])
