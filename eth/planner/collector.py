"""The garbage collector during a search: young generations only.

A search builds its memos as it goes (stage costs, floors, ranks, phase-1 results:
hundreds of thousands of long-lived objects), and CPython's collector traverses every
tracked object in each full (generation 2) collection, which it starts whenever the
long-lived objects have grown by a quarter: ever longer traversals as the memos grow,
and in a forked worker (:mod:`eth.planner.workers`) a full collection also copies every
page it touches.  The search creates little cyclic garbage (its peak RSS is the same
with the collector off), so :func:`young_only` keeps the collections of generations 0
and 1 and defers the full ones until the search returns (the thresholds are then as
before).  Only the CPU time and when garbage is freed change;
``python bench/search_scaling.py --gc`` measures both.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager

NO_FULL = 1 << 30
"""Generation-1 collections before a full one while :func:`young_only` holds: never, in
effect."""


@contextmanager
def young_only():
    """Within the block, CPython collects generations 0 and 1 only (module docstring)."""
    before = gc.get_threshold()
    gc.set_threshold(before[0], before[1], NO_FULL)
    try:
        yield
    finally:
        gc.set_threshold(*before)
