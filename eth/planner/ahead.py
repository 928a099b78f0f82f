"""Phase 1 ahead of the enumeration, over forked processes.

With ``SearchOptions.jobs`` > 1 (the fork start method) and the cache on, the processes
the seed planners do not hold (they run in one process beside the search until they are
done) optimise pipelines ahead of the enumeration, when there are at least two.

Phase 1 of a pipeline (:meth:`eth.planner.search.HPPSearch.phase1` at B = Gbs) depends on
its block vector alone, and it is nearly all of the enumeration's time.  Before the
enumeration evaluates a device group whose pipelines phase 1 has not seen, :meth:`Ahead.fill`
optimises the pipelines of that group and of the next ones (:data:`PER_JOB` per process)
with :func:`eth.planner.workers.parallel_map`.  The results are kept aside: a pipeline
enters the search's cache, its skipping bounds and its statistics only when the
enumeration asks for it (:meth:`Ahead.take`), in the order one process would have asked,
so every ``jobs`` value visits, skips and stops at the same groups and returns the same
plan; what the patience stop or skipping leaves unread is dropped.

A result sent back by a child keeps its lazy alternatives without the child's evaluator
(the stage groups balanced there and the floors of the rest,
:func:`eth.planner.pipeline.reattach`): when first read they are completed here, the same
ones, with their own cost evaluations counted here.  A result that a child cut at the
time limit is dropped (this process, then out of time too, computes its own).
"""
from __future__ import annotations

from dataclasses import dataclass

from eth.planner.pipeline import PipelineResult, reattach
from eth.planner.workers import can_fork, parallel_map

PER_JOB = 4
"""Pipelines optimised per process in one round of :meth:`Ahead.fill`."""


@dataclass
class Kept:
    """One pipeline's phase 1 done ahead: its result, the cost evaluations it took, and
    whether the time limit cut it."""

    result: PipelineResult | None
    evaluations: int
    cut: bool


class Ahead:
    """Phase-1 results of the next groups' pipelines, computed ahead (module docstring)."""

    def __init__(self, search):
        self.search = search
        self.kept: dict = {}          # block vector -> Kept
        self.beside = None            # the seed planners' process (eth.planner.workers.Forked)
        self.on = search.opt.jobs > 1 and search.opt.cache and can_fork()

    @property
    def jobs(self) -> int:
        """Processes for the next round: ``jobs``, less the one the seed planners hold
        while they run beside the search."""
        busy = self.beside is not None and self.beside.running()
        return self.search.opt.jobs - (1 if busy else 0)

    def fill(self, upcoming) -> None:
        """Before the enumeration evaluates the first group of ``upcoming`` (it and the groups
        after it): if phase 1 has not seen one of its pipelines, optimise the unseen
        pipelines of it and the next groups, up to :data:`PER_JOB` per process, in parallel."""
        s = self.search
        jobs = self.jobs
        if not self.on or jobs < 2:
            return
        vecs: list = []
        for k, g in enumerate(upcoming):
            if k == 0 and all(self._known(v) for v in g):
                return
            vecs += [v for v in g if not self._known(v) and v not in vecs]
            if len(vecs) >= PER_JOB * jobs:
                break
        if not vecs:
            return
        before = s.ev.evaluations
        done = parallel_map(self._one, vecs, jobs)
        s.ev.evaluations = before       # counted when taken
        self.kept.update(zip(vecs, done))

    def _known(self, vec) -> bool:
        return vec in self.kept or self.search.seen(vec)

    def _one(self, vec) -> Kept:
        s = self.search
        before = s.ev.evaluations
        result = s.optimise(vec, s.opt.gbs)
        return Kept(result, s.ev.evaluations - before, s.clock.hit)

    def take(self, vec) -> Kept | None:
        """The result done ahead for ``vec`` (then forgotten here), ready to be read as
        if computed now; None if there is none or the time limit cut it."""
        kept = self.kept.pop(vec, None)
        if kept is None or kept.cut:
            return None
        s = self.search
        reattach(kept.result, s.ev, s.out_of_time, s.phases)
        return kept
