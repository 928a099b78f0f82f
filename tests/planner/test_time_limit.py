"""The search's time limit: lazy group counting, deadline checks in phase 1 and polish."""
import time

import pytest

from eth.errors import InfeasibleError
from eth.spec.model import get_model
from eth.planner.enumerate import TimeUp, count_groups, device_groups
from eth.planner.options import SearchOptions
from eth.planner.polish import polish
from eth.planner.progress import Clock
from eth.planner.search import HPPSearch, search

from _planner_data import M4, A2R2, make_cluster, profiles_for


class _CpuTime:
    """Stands in for the ``time`` module of eth.planner.progress: the search's clock reads
    this process's CPU time, so what it can do before its limit does not depend on what
    else the machine runs (the search runs in this process: ``jobs`` 1)."""

    perf_counter = staticmethod(time.process_time)


@pytest.mark.parametrize("types", [("A100", "H100", "RTX3090"), ("A100", "H100", "RTX3090", "V100")])
def test_time_limited_search_on_many_types_stops_near_the_limit(types, monkeypatch):
    # 8 one-device nodes per type: blocks of one device, so the group space is huge
    # (counting it up front used to take ~30 s before the first group was evaluated)
    import eth.planner.progress
    cluster = make_cluster([{"type": t, "devices_per_node": 1, "count": 8} for t in types])
    model = get_model("gpt3-1.3b")
    db = profiles_for(model, cluster)
    # a limit in CPU seconds far below the unlimited search's CPU time (1.6-3.2 s for three
    # types on this 2-core machine, patience and seeds off), so no host finishes early;
    # and a load on the machine cannot eat the limit before the search has started
    monkeypatch.setattr(eth.planner.progress, "time", _CpuTime)
    limit = 0.4
    cpu0 = time.process_time()
    try:
        # patience off: with it the 3-type search ends (unlimited) early; seeds off: a
        # seed's plan returned after the search found none has no search statistics
        plan = search(model, cluster, db, SearchOptions(gbs=512, time_limit=limit, patience=0, seeds=False,
                                                        jobs=1))
    except InfeasibleError as exc:  # allowed, but it must say why
        assert "time limit" in str(exc)
        plan = None
    cpu = time.process_time() - cpu0
    assert cpu < limit + 3, f"search used {cpu:.1f} s of CPU with a {limit} s limit"
    if plan is not None:
        assert plan.search["time_limited"] is True
        assert sum(p.lbs for p in plan.pipelines) == 512
        assert plan.predicted["iteration_ms"] > 0
        c = plan.search["candidates"]
        assert c["groups_total"] == c["evaluated"] + c["skipped"] + c["not_visited"]
        assert c["evaluated"] + c["by_dp"] >= 1


def test_counting_saturates_above_the_limit_and_polls_stop():
    for total in [(4, 4), (3, 2, 2)]:
        for parts in range(1, sum(total) + 1):
            exact = count_groups(total, parts)
            assert exact == len(list(device_groups(total, parts)))
            for limit in (0, 3, 50):
                assert count_groups(total, parts, limit=limit) == min(exact, limit + 1)
    with pytest.raises(TimeUp):
        count_groups((8, 8, 8), 3, stop=lambda: True)
    # polled every 256 steps: the generation ends long before the 4000+ groups
    assert len(list(device_groups((8, 8, 8), 3, stop=lambda: True))) < 300
    assert count_groups((8, 8, 8), 3, limit=4000) == 4001


def test_polish_returns_at_once_after_the_deadline():
    cluster = make_cluster(A2R2)
    db = profiles_for(M4, cluster)
    s = HPPSearch(M4, cluster, db, SearchOptions(gbs=16))
    s.run()
    best = s.best
    before = s.ev.evaluations
    s.clock = Clock(1e-9, start=0.0)  # the deadline has passed
    assert polish(s, best, 100) is best
    assert s.ev.evaluations == before
    assert s.stats.time_limited


def test_time_limit_before_anything_is_a_clear_error():
    cluster = make_cluster(A2R2)
    db = profiles_for(M4, cluster)
    with pytest.raises(InfeasibleError, match="time limit .* reached before any device group"):
        search(M4, cluster, db, SearchOptions(gbs=16, time_limit=1e-9, seeds=False))


def test_one_clock_and_progress_bar_for_search_and_baselines():
    import math

    from eth.planner import progress, search as search_module
    from eth.planner.baselines import typesplit
    assert typesplit.Clock is progress.Clock and typesplit.progress_bar is progress.progress_bar
    assert search_module.Clock is progress.Clock and search_module.progress_bar is progress.progress_bar
    free = Clock(0)
    assert not free.out() and free.deadline == math.inf and not free.hit
    late = Clock(0.5, start=time.perf_counter() - 1.0)
    assert late.out() and late.hit and late.deadline < time.perf_counter()
    bar = progress.progress_bar(3, False)
    bar.update(3)
    bar.close()
