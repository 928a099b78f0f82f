"""eth.planner.collector: no full garbage collections during a search, the collector's
thresholds as before once it returns (also when it raises)."""
import gc

import pytest

from _planner_data import M4, make_cluster, profiles_for
from eth.errors import InfeasibleError
from eth.planner import collector
from eth.planner.options import SearchOptions
from eth.planner.search import HPPSearch, search
from eth.spec.model import get_model


def _collections(work) -> list[int]:
    """The generations collected while ``work()`` runs."""
    seen = []

    def record(phase, info):
        if phase == "stop":
            seen.append(info["generation"])
    gc.collect()
    gc.callbacks.append(record)
    try:
        work()
    finally:
        gc.callbacks.remove(record)
    return seen


def _grow():
    """What a search does to its memos: many long-lived containers."""
    return [[i] for i in range(300_000)]


def test_young_only_defers_full_collections_and_restores_the_thresholds():
    before = gc.get_threshold()
    assert 2 in _collections(_grow)            # CPython's default: full collections

    def young():
        with collector.young_only():
            assert gc.get_threshold() == (before[0], before[1], collector.NO_FULL)
            _grow()
    seen = _collections(young)
    assert seen and 2 not in seen                           # young ones only
    assert gc.get_threshold() == before
    with pytest.raises(ValueError):
        with collector.young_only():
            raise ValueError("inside")
    assert gc.get_threshold() == before


def test_a_search_runs_under_young_only(monkeypatch):
    during = []
    run = HPPSearch.run
    monkeypatch.setattr(HPPSearch, "run", lambda self: (during.append(gc.get_threshold()), run(self))[1])
    before = gc.get_threshold()
    cluster = make_cluster([{"type": "A100", "devices_per_node": 4, "count": 1},
                            {"type": "V100", "devices_per_node": 4, "count": 1}])
    plan = search(M4, cluster, profiles_for(M4, cluster), SearchOptions(gbs=64, jobs=1))
    assert plan.predicted["iteration_ms"] > 0
    assert during == [(before[0], before[1], collector.NO_FULL)]
    assert gc.get_threshold() == before
    tiny = make_cluster([{"type": "V100", "devices_per_node": 1, "count": 1}])
    big = get_model("gpt3-175b")
    with pytest.raises(InfeasibleError):
        search(big, tiny, profiles_for(big, tiny), SearchOptions(gbs=8))
    assert gc.get_threshold() == before
