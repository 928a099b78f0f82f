"""The polish's allocation floor (polish.allocation_floor) and its pruned steepest-descent
step (polish._Scan): the floor is below every trial's allocated time and is the relaxed
allocation of the planned pipelines' lines, and the scan picks the same best trial and
the same best few as allocating every trial (the same plans: test_prune.py's search
with and without ``prune`` covers the whole search)."""
import math

import pytest

from eth.planner.allocate import pipeline_line
from eth.planner.options import SearchOptions
from eth.planner.polish import FREE_MBS_CHOICES, _Scan, _trials, allocation_floor
from eth.planner.search import HPPSearch

from _planner_data import M4, M6, make_cluster, profiles_for

NODES = [{"type": "A100", "devices_per_node": 2}, {"type": "RTX3090", "devices_per_node": 2},
         {"type": "V100", "devices_per_node": 2}]


def _searched(model, memory, gbs) -> HPPSearch:
    types = {"A100": {"memory_gb": memory[0]}, "RTX3090": {"memory_gb": memory[1]}, "V100": {"memory_gb": memory[2]}}
    cluster = make_cluster(NODES, device_types=types)
    s = HPPSearch(model, cluster, profiles_for(model, cluster), SearchOptions(gbs=gbs, seeds=False))
    s.run()
    return s


def _relaxed(lines, gbs):
    """min over real x_i >= 1 with sum Mbs_i x_i = gbs of max_i (A_i + B_i x_i), by bisection."""
    def need(t):
        return sum(m * max(1.0, (t - a) / b) for a, b, m in lines)
    lo, hi = max(a + b for a, b, _ in lines), max(a + b * gbs for a, b, _ in lines)
    if need(lo) >= gbs:
        return lo
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if need(mid) < gbs else (lo, mid)
    return hi


def _allocations(floors, times, start_ms, keep) -> int:
    """How many trials the scan must allocate, by its definition: in trial order those
    whose floor is below the best time so far; then the skipped ones by ascending floor
    while fewer than ``keep`` times are known or the next floor is not above the
    ``keep``-th least time known (the work the floor saves, counted)."""
    best, known, skipped = start_ms, [], []
    for k, (floor, ms) in enumerate(zip(floors, times)):
        if floor >= best * (1 - 1e-9):
            skipped.append((floor, k))
            continue
        known.append(ms)
        if ms < best * (1 - 1e-9):
            best = ms
    count = len(known)
    known = sorted(x for x in known if x < math.inf)
    for floor, k in sorted(skipped):
        if len(known) >= keep and floor > known[keep - 1]:
            break
        count += 1
        if times[k] < math.inf:
            known = sorted(known + [times[k]])
    return count


@pytest.mark.parametrize("model, memory, gbs", [(M4, (80, 24, 32), 16), (M6, (6, 3, 4), 8), (M6, (80, 24, 32), 64)])
def test_floor_bounds_every_trial_and_the_scan_picks_as_allocating_all(model, memory, gbs):
    s = _searched(model, memory, gbs)
    allocated = skipped = 0
    for cand in s.top:
        trials = list(_trials(s, cand))
        got = [s.allocate(t) for t in trials]
        times = [g[1] if g is not None else math.inf for g in got]
        floors = []
        for t, ms in zip(trials, times):
            floor = allocation_floor(s, t)
            floors.append(floor)
            assert floor <= ms * (1 + 1e-12), (floor, ms)
            plan = s.build_plan(t, [r.state.mbs for r in t])
            lines = [pipeline_line(s.cost.pipeline_costs(p), p.mbs, None) + (p.mbs,) for p in plan.pipelines]
            assert floor == pytest.approx(_relaxed(lines, gbs), rel=1e-9)
            allocated += ms < math.inf
            skipped += floor >= cand.iteration_ms * (1 - 1e-9)
        best = None       # the steepest-descent step over every trial, allocated
        for t, ms in zip(trials, times):
            if ms < (best[1] if best else cand.iteration_ms) * (1 - 1e-9):
                best = (t, ms)
        order = sorted(range(len(trials)), key=lambda k: (times[k], k))
        for keep in (1, FREE_MBS_CHOICES, 5):
            scan = _Scan(s, cand, lambda: False)
            for t in trials:
                scan.add(t)
            assert (scan.best is None) == (best is None)
            if best is not None:
                assert scan.best.results is best[0] and scan.best.iteration_ms == best[1]
            top = scan.top(keep)
            assert len(top) == min(keep, len(trials))
            assert all(a is trials[k] for a, k in zip(top, order)), keep
            assert len(scan.scored) == _allocations(floors, times, cand.iteration_ms, keep), keep
    assert allocated > 0 and skipped > 0   # the floor skipped some trials
