"""Phase 1 ahead of the enumeration, in forked worker processes.

With ``SearchOptions.jobs`` > 1 (the fork start method) and the cache on, the processes
the seed planners do not hold (they run in one process beside the search until they are
done) optimise pipelines ahead of the enumeration.

Phase 1 of a pipeline (:meth:`eth.planner.search.HPPSearch.phase1` at B = Gbs) depends on
its block vector alone, and it is nearly all of the enumeration's time.  Before the
enumeration evaluates a device group, :meth:`Ahead.fill` hands the pipelines that phase 1
has not seen, of that group and the next ones (:data:`LIST` at most), in the order the
enumeration will ask for them, to a :class:`_Run`: ``jobs - 1`` forked workers, started
once for the whole list, take them one at a time from a claim table in shared memory
and send each result back as soon as it is done.  When the enumeration asks for a
pipeline (:meth:`Ahead.take`) that no worker has claimed, this process claims and
optimises it itself; one a worker holds, it waits for.  So neither side waits for a
round of the other, and a worker runs ahead of the enumeration by as much as it is
faster.  The results are kept aside: a pipeline enters the search's cache, its skipping
bounds and its statistics only when the enumeration asks for it, in the order one
process would have asked, so every ``jobs`` value visits, skips and stops at the same
groups and returns the same plan; what the patience stop or skipping leaves unread is
dropped, and :meth:`Ahead.close` stops the workers when the enumeration ends.

A result sent back by a worker keeps its lazy alternatives without the worker's
evaluator (the stage groups balanced there and the floors of the rest,
:func:`eth.planner.pipeline.reattach`): when first read they are completed here, the same
ones, with their own cost evaluations counted here.  A result that a worker cut at the
time limit is dropped (this process, then out of time too, computes its own), and so is
the work of a worker that dies: this process optimises those pipelines itself.
"""
from __future__ import annotations

import itertools
import multiprocessing
import queue as queues
import time
import weakref
from dataclasses import dataclass

from eth.planner.pipeline import PipelineResult, reattach
from eth.planner.workers import can_fork

LIST = 256
"""Pipelines handed to the workers at most at once (the rest of the pipeline count's
groups, in enumeration order, is read no further)."""

WINDOW = 16
"""A worker claims a pipeline at most this many places (per worker) after the last one
the enumeration asked for, so that what the patience stop or skipping leaves unread, and
the memory results kept aside hold, stay small."""

FREE, THEIRS, OURS = 0, 1, 2
"""Claim table states: nobody's yet, a worker's, this process's."""


@dataclass
class Kept:
    """One pipeline's phase 1 done ahead: its result, the cost evaluations it took, and
    whether the time limit cut it."""

    result: PipelineResult | None
    evaluations: int
    cut: bool


class Ahead:
    """Phase-1 results of the next groups' pipelines, computed ahead (module docstring)."""

    share = True
    """This process optimises a pipeline no worker has claimed when the enumeration
    reaches it, and the next free ones while a worker still works on the one it needs
    (False: it waits for the workers; the tests use it to have every result come from one)."""

    def __init__(self, search):
        self.search = weakref.proxy(search)   # no cycle: the search holds this
        self.kept: dict = {}          # block vector -> Kept, received and not yet read
        self.beside = None            # the seed planners' process (eth.planner.workers.Forked)
        self.on = search.opt.jobs > 1 and search.opt.cache and can_fork()
        self._runs: list[_Run] = []   # the newest last: only it may have free pipelines

    @property
    def workers(self) -> int:
        """Worker processes for now: ``jobs - 1``, less the one the seed planners hold
        while they run beside the search."""
        busy = self.beside is not None and self.beside.running()
        return self.search.opt.jobs - 1 - (1 if busy else 0)

    def fill(self, upcoming) -> None:
        """Before the enumeration evaluates the first group of ``upcoming`` (it and the
        groups after it): take in what the workers sent; unless the newest run's list
        holds that group's unseen pipelines, hand the workers a new list (up to
        :data:`LIST` unseen pipelines of these groups; the older list's free pipelines
        are left: the enumeration has passed them)."""
        if not self.on:
            return
        self._reap()
        groups = iter(upcoming)
        first = next(groups, None)
        if first is None:
            return
        run = self._runs[-1] if self._runs else None
        if run is not None and run.free():
            if all(v in run.index or self._known(v) for v in first):
                run.grow(self.workers)
                return
            run.retire()
        workers = self.workers
        if workers < 1:
            return
        vecs: list = []
        listed = set()
        for g in itertools.chain([first], groups):
            for v in g:
                if v not in listed and not self._known(v):
                    vecs.append(v)
                listed.add(v)
            if len(vecs) >= LIST:
                break
        if vecs:
            self._runs.append(_Run(self, vecs[:LIST], workers))

    def _reap(self) -> None:
        """Take in what the workers sent; let go of the runs that are over."""
        for run in self._runs:
            run.receive(self.kept)
        over = [r for r in self._runs if not r.working() and (r is not self._runs[-1] or not r.free())]
        for run in over:
            run.close(self.kept)
        self._runs = [r for r in self._runs if r not in over]

    def _known(self, vec) -> bool:
        """Phase 1 has seen ``vec``, its result is kept aside, or a worker is at it."""
        return (vec in self.kept or self.search.seen(vec)
                or any(r.theirs(vec) for r in self._runs))

    def optimise(self, vec) -> Kept:
        """Phase 1 of ``vec`` at B = Gbs as a :class:`Kept` (what a worker sends)."""
        s = self.search
        before = s.ev.evaluations
        result = s.optimise(vec, s.opt.gbs)
        return Kept(result, s.ev.evaluations - before, s.clock.hit)

    def take(self, vec) -> Kept | None:
        """The result done ahead for ``vec`` (then forgotten here), ready to be read as
        if computed now; None if there is none (this process then optimises it: a
        pipeline no worker claimed yet is claimed for it) or the time limit cut it."""
        kept = self.kept.pop(vec, None)
        if kept is None:
            run = next((r for r in reversed(self._runs) if vec in r.index), None)
            kept = run.wait_for(vec, self.kept) if run is not None else None
        if kept is None or kept.cut:
            return None
        s = self.search
        reattach(kept.result, s.ev, s.stop, s.phases)
        return kept

    def close(self) -> None:
        """Stop the workers (the enumeration is over): what they have not sent is dropped."""
        for run in self._runs:
            run.stop()
        self._runs = []


class _Run:
    """Workers over one list of pipelines (the module docstring)."""

    def __init__(self, ahead: Ahead, vecs: list, workers: int):
        self.ahead, self.vecs = ahead, vecs
        self.index = {v: i for i, v in enumerate(vecs)}
        self.ctx = multiprocessing.get_context("fork")
        self.claims = self.ctx.Array("b", len(vecs))
        self.asked = self.ctx.Value("i", -1, lock=False)   # the last position the enumeration asked for
        self.results = self.ctx.Queue()
        self.procs: list = []
        self.grow(workers)

    def grow(self, workers: int) -> None:
        """Start workers until ``workers`` are at work on the list (while some of it is free)."""
        while sum(p.is_alive() for p in self.procs) < workers and self.free():
            proc = self.ctx.Process(target=_work, daemon=True,
                                    args=(self.ahead, self.vecs, self.claims, self.asked, WINDOW * workers,
                                          self.results))
            proc.start()
            self.procs.append(proc)

    def free(self) -> bool:
        """True while some pipeline of the list is nobody's yet."""
        with self.claims.get_lock():
            return FREE in self.claims[:]

    def theirs(self, vec) -> bool:
        """True if a worker claimed ``vec`` (its result is on the way, unless received)."""
        i = self.index.get(vec)
        return i is not None and self.claims[i] == THEIRS

    def retire(self) -> None:
        """The enumeration has passed this list: no worker takes a pipeline of it any more."""
        with self.claims.get_lock():
            for i in range(len(self.vecs)):
                if self.claims[i] == FREE:
                    self.claims[i] = OURS

    def working(self) -> bool:
        """True while a worker is alive (it may still send a result)."""
        return any(p.is_alive() for p in self.procs)

    def receive(self, into: dict, block_for=None) -> None:
        """Move the results sent so far into ``into``; with ``block_for`` (a block
        vector), wait until that one is in too, or no worker can send it any more."""
        while True:
            try:
                item = self.results.get(block=block_for is not None, timeout=0.05)
            except queues.Empty:
                if block_for is None or not self.working():
                    if block_for is not None:
                        self.receive(into)     # a worker that exited flushed its last ones
                    return
                continue
            i, kept = item
            into[self.vecs[i]] = kept
            if block_for is not None and self.vecs[i] == block_for:
                return

    def wait_for(self, vec, into: dict) -> Kept | None:
        """``vec``'s result when a worker holds it; None when it is not on the list or no
        worker claimed it (then this process claims it).  While a worker still works on
        it, this process optimises the next free pipelines of the list (kept aside as
        the workers' are) rather than wait."""
        i = self.index.get(vec)
        if i is None:
            return None
        self.asked.value = max(self.asked.value, i)
        share = self.ahead.share
        while True:
            with self.claims.get_lock():
                mine = self.claims[i] == OURS or (share and self.claims[i] == FREE)
                if mine:
                    self.claims[i] = OURS
            if mine:
                return None
            self.receive(into)
            if vec in into:
                return into.pop(vec)
            j = self._claim_next(i) if share else None
            if j is None:
                self.receive(into, block_for=vec)
                return into.pop(vec, None)
            s = self.ahead.search
            before = s.ev.evaluations
            into[self.vecs[j]] = self.ahead.optimise(self.vecs[j])
            s.ev.evaluations = before       # counted when taken

    def _claim_next(self, after: int) -> int | None:
        """Claim the first free pipeline of the list after position ``after`` for this process."""
        with self.claims.get_lock():
            for j in range(after + 1, len(self.vecs)):
                if self.claims[j] == FREE:
                    self.claims[j] = OURS
                    return j
        return None

    def close(self, into: dict) -> None:
        """The workers are done: take in their last results and reap them."""
        self.receive(into)
        for p in self.procs:
            p.join()
        self.results.close()

    def stop(self) -> None:
        """Stop at once: no more claims, the workers ended, what they did not send dropped."""
        self.retire()
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join()
        self.results.cancel_join_thread()
        self.results.close()


def _work(ahead: Ahead, vecs: list, claims, asked, window: int, results) -> None:
    """A worker: claim the next free pipeline of ``vecs`` (once the enumeration has asked
    for one at most ``window`` places before it), optimise it, send it, again.  An error
    ends the worker quietly: the search optimises what it claimed itself (and raises the
    error there, if it is one)."""
    try:
        for i, vec in enumerate(vecs):
            while i > asked.value + window:
                time.sleep(0.002)
            with claims.get_lock():
                if claims[i] != FREE:
                    continue
                claims[i] = THEIRS
            results.put((i, ahead.optimise(vec)))
    except Exception:   # noqa: BLE001 - the claimed pipelines are redone by the search
        return
