"""The end of the HPP search (:class:`eth.planner.search.HPPSearch`): the symmetric phase
and the polish of the best device groups, spread over forked processes with ``jobs`` > 1
and adopted in one order, so that every ``jobs`` value returns the same plan."""
from __future__ import annotations

from dataclasses import dataclass, replace

from eth.planner.polish import Candidate, lightest, polish
from eth.planner.symmetric import adopt, descend, descend_best, evaluate_count, may_descend, symmetric_counts
from eth.planner.workers import parallel_map


def finish(search) -> dict:
    """The symmetric phase, then the polish of the best groups (``polish_top``), each
    adopted in that order where it is faster.  The symmetric groups (one per pipeline
    count, :func:`eth.planner.symmetric.evaluate_count`) and the polished groups read
    nothing the others change but the caches and the best so far, so with ``jobs`` > 1
    they run spread over forked processes (:func:`eth.planner.workers.parallel_map`),
    each symmetric group with its descent when the descent may be chosen whatever the
    other groups score (:func:`eth.planner.symmetric.may_descend`); the choice of the
    symmetric groups to descend (:func:`eth.planner.symmetric.descend_best`) follows in
    this process, and all is adopted here in one order: the same plan.  The pieces start
    largest first (devices per pipeline), so that the processes end close together.
    The polished groups and the best plan are left in ``search.finalists``
    (:mod:`eth.planner.finalists`).  Returns the symmetric record for ``plan.search``."""
    counts = symmetric_counts(search) if search.opt.symmetric and not search.out_of_time() else []
    work = [("symmetric", k, per) for k, per in counts] + [("polish", c) for c in search.top]
    evaluations = search.ev.evaluations

    def run(item):
        if search.out_of_time():   # a group left unpolished still gets the least recompute
            return Finished(item[1] if item[0] == "polish" else None, 0)
        before = search.ev.evaluations
        if item[0] == "symmetric":
            with search.phases("symmetric", sticky=True):
                got = Tried(evaluate_count(search, item[1], item[2]))
                if may_descend(search, got.candidate):
                    got.descended = descend(search, item[1], item[2], got.candidate)
        else:
            with search.phases("polish", sticky=True):
                got = polish(search, item[1], search.opt.polish_budget)
        return Finished(got, search.ev.evaluations - before)

    # the largest pieces first (devices per pipeline), so that the last to start are small
    order = sorted(range(len(work)), key=lambda i: -_devices_per_pipeline(search, work[i]))
    done = [None] * len(work)
    for i, d in zip(order, parallel_map(run, [work[i] for i in order], search.opt.jobs,
                                        portable=Finished.portable)):
        done[i] = d
    search.ev.evaluations = evaluations + sum(d.evaluations for d in done)
    symmetric = {}
    if counts:
        tried = [(item[1], item[2], d.value.candidate, d.value.descended) for item, d in zip(work, done)
                 if item[0] == "symmetric" and d.value is not None]
        with search.phases("symmetric"):
            symmetric = adopt(search, *descend_best(search, tried))
    for item, d in zip(work, done):
        if item[0] == "polish":
            better = lightest(search, d.value)
            search.finalists.append(better)
            if better.iteration_ms < search.best.iteration_ms * (1 - 1e-9):
                search.best = better
    search.finalists.append(search.best)
    return symmetric


def _devices_per_pipeline(search, item) -> int:
    """The devices of the largest pipeline of a piece of :func:`finish`: a symmetric
    group's (the world over the pipeline count) or a polished group's."""
    if item[0] == "symmetric":
        return search.cluster.world_size // item[1]
    return max(sum(st.tp * st.dp for st in p.stages) for p in item[1].plan.pipelines)


@dataclass
class Tried:
    """One symmetric pipeline count's candidate (None: no feasible plan), as evaluated,
    and its descent where done beside (:func:`eth.planner.symmetric.descend`)."""

    candidate: Candidate | None
    descended: Candidate | None = None


@dataclass
class Finished:
    """One piece of :func:`finish` and the cost evaluations it took."""

    value: object
    evaluations: int

    @staticmethod
    def portable(done: "Finished") -> "Finished":
        """What a worker process sends back: a polished candidate's plan and time (its
        per-pipeline results hold the worker's evaluator; what follows reads neither);
        a symmetric candidate also with its results, without their alternatives (the
        symmetric descent in this process moves their states), its descent as a plan."""
        v = done.value
        if isinstance(v, Candidate):
            v = _plan_only(v)
        elif isinstance(v, Tried) and v.candidate is not None:
            c = v.candidate
            v = Tried(Candidate(c.plan, c.iteration_ms, [replace(r, ready=(), pending=None) for r in c.results]),
                      _plan_only(v.descended) if v.descended is not None else None)
        return Finished(v, done.evaluations)


def _plan_only(cand: Candidate) -> Candidate:
    return Candidate(cand.plan, cand.iteration_ms, [])
