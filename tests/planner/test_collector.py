"""eth.planner.collector: the garbage collector paused while a search runs and as before
once it returns (also when it raises); a search leaves none of its objects to the
collector (they are freed by reference counting), so pausing it loses nothing."""
import gc

import pytest

from _planner_data import M4, make_cluster, profiles_for
from eth.errors import InfeasibleError
from eth.planner import collector
from eth.planner.options import SearchOptions
from eth.planner.search import HPPSearch, search
from eth.spec.model import get_model


def test_paused_turns_the_collector_off_and_back_as_it_was():
    assert gc.isenabled()
    with collector.paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError):
        with collector.paused():
            raise ValueError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector.paused():
            pass
        assert not gc.isenabled()             # the caller had it off: it stays off
    finally:
        gc.enable()


def test_a_search_runs_with_the_collector_paused(monkeypatch):
    during = []
    run = HPPSearch.run
    monkeypatch.setattr(HPPSearch, "run", lambda self: (during.append(gc.isenabled()), run(self))[1])
    cluster = make_cluster([{"type": "A100", "devices_per_node": 4, "count": 1},
                            {"type": "V100", "devices_per_node": 4, "count": 1}])
    plan = search(M4, cluster, profiles_for(M4, cluster), SearchOptions(gbs=64, jobs=1))
    assert plan.predicted["iteration_ms"] > 0
    assert during == [False] and gc.isenabled()
    tiny = make_cluster([{"type": "V100", "devices_per_node": 1, "count": 1}])
    big = get_model("gpt3-175b")
    with pytest.raises(InfeasibleError):
        search(big, tiny, profiles_for(big, tiny), SearchOptions(gbs=8))
    assert gc.isenabled()


def _left_to_the_collector(work) -> dict[str, int]:
    """The planner's objects (classes of ``eth``) that are unreachable only through
    reference cycles once ``work()`` has returned: type name -> count."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        work()
        gc.collect()
        left: dict[str, int] = {}
        for o in gc.garbage:
            if type(o).__module__.startswith("eth."):
                left[type(o).__name__] = left.get(type(o).__name__, 0) + 1
        return left
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


@pytest.mark.parametrize("jobs", [1, 3])
def test_a_search_leaves_nothing_to_the_collector(jobs):
    """Seeded, three types: the seeds, phase 1 (ahead in workers with jobs 3), the
    enumeration with its time checks, the symmetric siblings and the polish."""
    three = make_cluster([{"type": t, "devices_per_node": 4} for t in ("A100", "V100", "RTX3090")])
    db = profiles_for(M4, three)
    plans = []
    left = _left_to_the_collector(lambda: plans.append(search(M4, three, db, SearchOptions(gbs=32, jobs=jobs))))
    assert plans[0].search["candidates"]["evaluated"] > 10 and plans[0].search["symmetric"]["pipelines"]
    assert left == {}
