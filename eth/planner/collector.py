"""The garbage collector during a search: paused.

A search builds its memos as it goes (stage costs, floors, ranks, phase-1 results:
hundreds of thousands of long-lived objects).  CPython's collector traverses the young
objects every few hundred allocations, each survivor again when it is promoted, and every
tracked object in each full collection (in a forked worker (:mod:`eth.planner.workers`)
a full collection also copies every page it touches): time spent finding no garbage,
because the search makes no reference cycles.  Its objects are freed by reference counting
when :func:`eth.planner.search.search` returns (the stop callable its results keep is a
function of its clock, :class:`eth.planner.ahead.Ahead` holds it weakly, the recursive
closures of :mod:`eth.planner.enumerate` let go of themselves,
:class:`eth.planner.workers.Forked` of its function;
``tests/planner/test_collector.py`` checks that none of the planner's objects is left
to the collector).  So :func:`paused` turns the collector off while a search runs and
back on (if it was on) when it returns or raises.  Only the CPU time changes;
``python bench/search_scaling.py --gc`` measures it.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager

PAUSE = True
"""False: :func:`paused` leaves the collector as it is (the benchmark's comparison)."""


@contextmanager
def paused():
    """Within the block the garbage collector is off; after it, as it was before."""
    was = gc.isenabled()
    if PAUSE:
        gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
