"""eth.planner.workers and SearchOptions.jobs: work spread over forked processes, the
same results in the same order, and the same plans as one process."""
import os
import time

import pytest

from _planner_data import make_cluster, profiles_for
from eth.errors import SpecError
from eth.planner.options import SearchOptions
from eth.planner.search import search
from eth.planner.workers import Forked, WorkerError, can_fork, parallel_map
from test_symmetric import M8, TIGHT

pytestmark = pytest.mark.skipif(not can_fork(), reason="no fork start method")


def _slow_pid(x):
    time.sleep(0.05)
    return x * x, os.getpid()


def test_parallel_map_keeps_the_order_and_uses_the_children():
    got = parallel_map(_slow_pid, range(10), jobs=3, portable=lambda r: (r[0], r[1], "sent"))
    assert [r[0] for r in got] == [x * x for x in range(10)]
    mine = [r for r in got if r[1] == os.getpid()]
    sent = [r for r in got if r[1] != os.getpid()]
    # every item done once; a child's results came through ``portable``, this process's not
    assert mine and sent and len(mine) + len(sent) == 10
    assert all(len(r) == 2 for r in mine) and all(r[2] == "sent" for r in sent)
    assert len({r[1] for r in sent}) == 2     # both children took items
    assert parallel_map(_slow_pid, range(3), jobs=1) == [(x * x, os.getpid()) for x in range(3)]
    assert os.getpid() not in {r[1] for r in parallel_map(_slow_pid, range(4), jobs=2, share=False)}


def test_a_childs_error_is_raised_and_a_dead_childs_work_redone():
    parent = os.getpid()

    def fails_in_child(x):
        time.sleep(0.05)
        if os.getpid() != parent:
            raise ValueError(f"item {x} failed")
        return x

    with pytest.raises(WorkerError, match=r"ValueError: item \d+ failed"):
        parallel_map(fails_in_child, range(6), jobs=2)

    def dies_in_child(x):
        time.sleep(0.05)
        if os.getpid() != parent:
            os._exit(1)      # killed without an answer
        return x, os.getpid()

    assert parallel_map(dies_in_child, range(6), jobs=2) == [(x, parent) for x in range(6)]
    assert Forked(lambda: os.getpid()).result() != parent
    slow = Forked(lambda: time.sleep(0.5))
    assert slow.running()
    slow.result()
    assert not slow.running() and not Forked(lambda: 1, enabled=False).running()
    assert Forked(lambda: os.getpid(), enabled=False).result() == parent


def test_jobs_give_the_same_plans(monkeypatch):
    """One process and three: the same plans, symmetric record and seed outcome.  The
    cluster is test_symmetric's whose symmetric phase wins with 3 pipelines (then again
    with every block size, the seeds and the polish).  The search's parallel_map (eth.planner.finish) leaves
    every item to the children, so what they send back is what the plan is made of."""
    import functools

    import eth.planner.finish as finish_module
    import eth.planner.symmetric as symmetric_module

    monkeypatch.setattr(finish_module, "parallel_map", functools.partial(parallel_map, share=False))
    here = []       # symmetric descents that descend_best had to do itself (none: done where evaluated)
    monkeypatch.setattr(symmetric_module, "descend", lambda *a: here.append(a) or finish_module.descend(*a))
    cluster = make_cluster([{"type": "A100", "devices_per_node": 6}, {"type": "V100", "devices_per_node": 6}],
                           **TIGHT)
    db = profiles_for(M8, cluster)
    won = []
    for extra in (dict(max_blocks_per_type=1, seeds=False), {}):
        plans = [search(M8, cluster, db, SearchOptions(gbs=24, jobs=jobs, **extra)) for jobs in (1, 3)]
        one, three = (p.to_dict() for p in plans)
        assert one["pipelines"] == three["pipelines"]
        assert plans[0].predicted["iteration_ms"] == plans[1].predicted["iteration_ms"]
        for key in ("symmetric", "seed_won", "seeds_ms"):
            assert one["search"].get(key) == three["search"].get(key), key
        assert three["search"]["options"]["jobs"] == 3
        won.append(one["search"]["symmetric"]["won"])
    assert won[0] == 3      # the symmetric phase's result was adopted (test_symmetric)
    assert here == []
    with pytest.raises(SpecError, match="jobs must be >= 1, got 0"):
        SearchOptions(gbs=8, jobs=0)


def test_phase_one_ahead_in_children_gives_the_same_search(monkeypatch):
    """Unseeded, jobs 3: the enumeration's phase 1 runs ahead in forked workers, and this
    process waits for them (every result read comes back with its lazy alternatives
    detached from the worker's evaluator, and the polish completes them here); the same
    plan, groups, patience stop and cost evaluations as one process, and the workers did
    the work."""
    import eth.planner.ahead as ahead_module
    from _planner_data import M6

    taken = _count_taken(monkeypatch, ahead_module)
    monkeypatch.setattr(ahead_module.Ahead, "share", False)
    three = make_cluster([{"type": t, "devices_per_node": 4} for t in ("A100", "V100", "RTX3090")])
    db = profiles_for(M6, three)
    one, many = (search(M6, three, db, SearchOptions(gbs=32, seeds=False, patience=4, jobs=jobs)) for jobs in (1, 3))
    assert len(taken) >= 8
    assert one.to_dict()["pipelines"] == many.to_dict()["pipelines"]
    for key in ("candidates", "cost_evaluations", "patience_stop", "symmetric"):
        assert one.search[key] == many.search[key], key


def test_dead_workers_leave_their_pipelines_to_the_search(monkeypatch):
    """Every phase-1 worker dies on the first pipeline it takes: the search optimises them
    itself and returns what one process does."""
    import eth.planner.ahead as ahead_module
    from _planner_data import M6

    parent, runs = os.getpid(), []
    optimise = ahead_module.Ahead.optimise

    def dies_in_a_worker(self, vec):
        if os.getpid() != parent:
            os._exit(3)
        return optimise(self, vec)
    monkeypatch.setattr(ahead_module.Ahead, "optimise", dies_in_a_worker)
    start = ahead_module._Run.__init__
    monkeypatch.setattr(ahead_module._Run, "__init__", lambda self, *a: runs.append(a[1]) or start(self, *a))
    monkeypatch.setattr(ahead_module.Ahead, "share", False)
    taken = _count_taken(monkeypatch, ahead_module)
    three = make_cluster([{"type": t, "devices_per_node": 4} for t in ("A100", "V100", "RTX3090")])
    db = profiles_for(M6, three)
    one, many = (search(M6, three, db, SearchOptions(gbs=32, seeds=False, patience=4, jobs=jobs)) for jobs in (1, 2))
    assert runs and taken == []
    assert one.to_dict()["pipelines"] == many.to_dict()["pipelines"]
    for key in ("candidates", "cost_evaluations", "patience_stop"):
        assert one.search[key] == many.search[key], key


def _count_taken(monkeypatch, ahead_module) -> list:
    """The block vectors whose phase 1 the enumeration reads from the work done ahead, as
    it reads them."""
    taken = []
    take = ahead_module.Ahead.take

    def counted(self, vec):
        kept = take(self, vec)
        if kept is not None:
            taken.append(vec)
        return kept
    monkeypatch.setattr(ahead_module.Ahead, "take", counted)
    return taken
