"""Progress bar and wall-clock deadline shared by the HPP search and the baseline planners."""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field


@dataclass
class Clock:
    """Deadline of one search; ``out()`` records that the limit was hit (0 = no limit)."""

    limit: float
    start: float = field(default_factory=time.perf_counter)
    hit: bool = False

    @property
    def deadline(self) -> float:
        """Absolute time.perf_counter() value of the deadline (inf without a limit)."""
        return self.start + self.limit if self.limit else math.inf

    def out(self) -> bool:
        if not self.hit and self.limit and time.perf_counter() - self.start > self.limit:
            self.hit = True
        return self.hit

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def restart(self) -> None:
        """Count from now, the limit not yet hit."""
        self.start, self.hit = time.perf_counter(), False


def progress_bar(total: int | None, enabled: bool, desc: str | None = None, unit: str = "it"):
    """Progress on stderr: a tqdm bar when stderr is a terminal; when it is a file or a
    pipe (a log), one :class:`LogLine` at the end instead of carriage-return redraws;
    nothing when ``enabled`` is false."""
    if enabled and not sys.stderr.isatty():
        return LogLine(total, desc, unit)
    from tqdm import tqdm
    return tqdm(total=total, disable=not enabled, file=sys.stderr, desc=desc, unit=unit, leave=False,
                dynamic_ncols=True)


class LogLine:
    """The part of tqdm's interface the planners use (``total``, ``n``, ``update``,
    ``refresh``, ``close``); ``close`` writes one line, e.g. ``metis: 12/12 layout in 3.4 s``."""

    def __init__(self, total: int | None, desc: str | None, unit: str):
        self.total, self.n, self.desc, self.unit = total, 0, desc or "search", unit
        self.start, self.closed = time.perf_counter(), False

    def update(self, n: int = 1) -> None:
        self.n += n

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            done = f"{self.n}/{self.total}" if self.total else str(self.n)
            print(f"{self.desc}: {done} {self.unit} in {time.perf_counter() - self.start:.1f} s",
                  file=sys.stderr, flush=True)


class PhaseTimer:
    """Exclusive wall time per search phase (seconds), for ``plan.search["phase_s"]``.

    ``with timer("balance"):`` charges the time inside the block to "balance" and pauses
    the enclosing phase; inside a phase opened with ``sticky=True`` (the polish) nested
    phases are not split off, so that phase's figure is its whole cost.  Time outside
    every block is the caller's business (the search charges it to "enumeration")."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._stack: list[list] = []   # [name, start, sticky]

    def __call__(self, name: str, sticky: bool = False):
        return _Phase(self, name, sticky)

    def _enter(self, name: str, sticky: bool) -> bool:
        now = time.perf_counter()
        if self._stack and self._stack[-1][2]:
            return False
        if self._stack:
            top = self._stack[-1]
            self.seconds[top[0]] = self.seconds.get(top[0], 0.0) + now - top[1]
        self._stack.append([name, now, sticky])
        return True

    def _exit(self) -> None:
        now = time.perf_counter()
        name, start, _ = self._stack.pop()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - start
        if self._stack:
            self._stack[-1][1] = now

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in sorted(self.seconds.items())}


class _Phase:
    __slots__ = ("timer", "name", "sticky", "opened")

    def __init__(self, timer: PhaseTimer, name: str, sticky: bool):
        self.timer, self.name, self.sticky, self.opened = timer, name, sticky, False

    def __enter__(self):
        self.opened = self.timer._enter(self.name, self.sticky)
        return self

    def __exit__(self, *exc):
        if self.opened:
            self.timer._exit()
        return False
