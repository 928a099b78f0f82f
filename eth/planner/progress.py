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


def progress_bar(total: int | None, enabled: bool, desc: str | None = None, unit: str = "it"):
    """A tqdm bar on stderr (a no-op object when ``enabled`` is false)."""
    from tqdm import tqdm
    return tqdm(total=total, disable=not enabled, file=sys.stderr, desc=desc, unit=unit, leave=False,
                dynamic_ncols=True)
