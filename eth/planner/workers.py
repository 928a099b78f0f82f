"""Work of one search spread over forked processes (``SearchOptions.jobs``).

The search is pure Python and single-threaded; on a machine with more than one core some
of its parts are independent of the rest and run in forked copies of this process, which
inherit every memo the search has built so far and send back only their results
(pickled).  Nothing here changes a result: each worker computes exactly what this
process would have computed, and the caller combines the results in the order it would
have produced them (tests/planner/test_workers.py compares plans of ``jobs`` 1 and 2).

* :class:`Forked`: one call in one child while this process goes on (the seed planners
  beside the group enumeration);
* :func:`parallel_map`: a function over a list, the items handed out one at a time from a
  counter in shared memory to this process and ``jobs - 1`` children (the polish of the
  best groups and the symmetric phase at the end of the search, eth.planner.finish).

Where the fork start method is missing (Windows) or ``jobs`` is 1, everything runs in
this process.  A child that dies without an answer (killed, out of memory) is not fatal:
its work is redone here.
"""
from __future__ import annotations

import multiprocessing
import traceback
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def can_fork() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


class WorkerError(RuntimeError):
    """An exception raised in a worker (its traceback text is the message)."""


class Forked:
    """``fn()`` run in a forked child (``enabled`` and fork available) or, on
    :meth:`result`, in this process; :meth:`result` returns its value or re-raises."""

    def __init__(self, fn: Callable[[], R], enabled: bool = True):
        self._fn, self._proc, self._recv = fn, None, None
        if enabled and can_fork():
            ctx = multiprocessing.get_context("fork")
            self._recv, send = ctx.Pipe(duplex=False)
            self._proc = ctx.Process(target=_answer, args=(fn, send), daemon=True)
            self._proc.start()
            send.close()

    def running(self) -> bool:
        """True while the child works (it has not sent its answer, nor died)."""
        return self._proc is not None and self._proc.is_alive() and not self._recv.poll()

    def result(self) -> R:
        fn, self._fn = self._fn, None     # let go of what fn holds (often fn's own owner: a cycle)
        if self._proc is None:
            return fn()
        try:
            ok, value = self._recv.recv()
        except EOFError:                  # the child died without an answer: redo it here
            ok, value = True, fn()
        finally:
            self._recv.close()
            self._proc.join()
        if not ok:
            raise WorkerError(value)
        return value


def _answer(fn, send) -> None:
    try:
        send.send((True, fn()))
    except BaseException:   # noqa: BLE001 - reported to the parent, which raises it
        send.send((False, traceback.format_exc()))
    finally:
        send.close()


def parallel_map(fn: Callable[[T], R], items: Sequence[T], jobs: int,
                 portable: Callable[[R], R] = lambda r: r, share: bool = True) -> list[R]:
    """``[fn(x) for x in items]`` over this process and up to ``jobs - 1`` forked ones.

    Items are taken in order from a shared counter, so a slow item does not hold up the
    others.  A child's results pass through ``portable`` before they are pickled (to drop
    what cannot or need not travel); this process's own results are kept as they are.
    ``share=False``: this process only waits for the ``jobs - 1`` children (the tests use
    it to have every item done by a child)."""
    items = list(items)
    workers = min(jobs - 1, len(items)) if not share else min(jobs, len(items)) - 1
    if workers <= 0 or not can_fork():
        return [fn(x) for x in items]
    ctx = multiprocessing.get_context("fork")
    counter = ctx.Value("i", 0)

    def take() -> int:
        with counter.get_lock():
            i = counter.value
            counter.value = i + 1
        return i

    def run(keep) -> dict[int, R]:
        done = {}
        while (i := take()) < len(items):
            done[i] = keep(fn(items[i]))
        return done

    children = [Forked(lambda: run(portable)) for _ in range(workers)]
    done = run(lambda r: r) if share else {}
    for child in children:
        done.update(child.result())
    missing = [i for i in range(len(items)) if i not in done]   # taken by a child that died
    for i in missing:
        done[i] = fn(items[i])
    return [done[i] for i in range(len(items))]
