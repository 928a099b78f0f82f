"""Plans of the HPP search, to compare two checkouts: same plans, and the CPU time.

Prints, per case, the predicted iteration time, the cost evaluations, a digest of the
plan's pipelines and the CPU / wall seconds; ``suite`` prints one digest over every search
of the seeded suite of tests/planner/test_search_core.py (its three search variants per
case; no optimum is computed).  Run it with each checkout first on the path, e.g.

    PYTHONPATH=<checkout> python bench/search_plans.py suite 13b:64:1024 175b:1024:1024

A case is ``<gpt3 size>:<devices>:<gbs>`` on bench/search_scaling.py's b2b4 clusters,
unseeded; a trailing ``s`` on the gbs runs with seeds (``13b:64:1024s``).  ``--prune-off``
first runs each case with ``SearchOptions(prune=False)`` (phase 1 without its floor
pruning, the search before issue 11's fifth pass) and prints the CPU ratio off / on, side
by side in one run:

    python bench/search_plans.py --prune-off 13b:64:1024 175b:1024:1024

``--jobs 1,2`` runs every case (and the suite) once per ``SearchOptions.jobs`` value, in
turn, and prints each case's wall-time ratio of the first value to each other one (the
plans must not differ; "cpu" is this process's alone, the workers' is not counted):

    python bench/search_plans.py --jobs 1,2 13b:64:1024 13b:64:1024s 175b:1024:1024
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests" / "planner")]

from eth.cost.model import CostModel  # noqa: E402
from eth.errors import InfeasibleError  # noqa: E402
from eth.spec.model import get_model  # noqa: E402
from eth.planner.options import SearchOptions  # noqa: E402
from eth.planner.search import search  # noqa: E402
from eth.profiles.db import ProfileDB  # noqa: E402


def digest(plan) -> str:
    text = json.dumps(plan.to_dict()["pipelines"], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def suite_digest(jobs: int = 1) -> str:
    import test_search_core as core
    from _planner_data import profiles_for
    h, n, t, w = hashlib.sha256(), 0, time.process_time(), time.perf_counter()
    for name, model, cluster, gbs in core.suite():
        db = profiles_for(model, cluster)
        cost = CostModel(model, cluster, db)
        for label, opts in core.SEARCHES.items():
            try:
                plan = search(model, cluster, db, SearchOptions(gbs=gbs, jobs=jobs, **opts))
                row = (cost.evaluate(plan)["iteration_ms"], digest(plan))
            except InfeasibleError:
                row = ("inf",)
            h.update(repr((name, label, row)).encode())
            n += 1
    return (f"suite: {n} searches, digest {h.hexdigest()[:16]}, cpu {time.process_time() - t:.2f} s, "
            f"wall {time.perf_counter() - w:.2f} s" + (f" (jobs {jobs})" if jobs != 1 else ""))


def main(argv=None) -> int:
    from search_scaling import b2b4
    import eth
    args = sys.argv[1:] if argv is None else list(argv)
    both = "--prune-off" in args
    args = [a for a in args if a != "--prune-off"]
    jobs = [1]
    if "--jobs" in args:
        at = args.index("--jobs")
        jobs = [int(j) for j in args[at + 1].split(",")]
        del args[at:at + 2]
    runs = [(False, jobs[0])] if both else []
    runs += [(True, j) for j in jobs]
    print(f"# eth from {Path(eth.__file__).parent}")
    for case in args:
        if case == "suite":
            for j in jobs:
                print(suite_digest(j), flush=True)
            continue
        size, devices, gbs = case.split(":")
        seeds = gbs.endswith("s")
        model, cluster = get_model("gpt3-" + size), b2b4(int(devices))
        cpu, wall = {}, {}
        for prune, j in runs:
            db = ProfileDB()     # a fresh one per run: its caches are not shared
            db.ensure(model, cluster.types.values())
            t, w = time.process_time(), time.perf_counter()
            plan = search(model, cluster, db, SearchOptions(gbs=int(gbs.rstrip("s")), time_limit=300, seeds=seeds,
                                                            progress=False, prune=prune, jobs=j))
            cpu[prune, j], wall[prune, j] = time.process_time() - t, time.perf_counter() - w
            label = case + ("" if prune else " off") + (f" j{j}" if len(jobs) > 1 else "")
            print(f"{label:15s} iter {plan.predicted['iteration_ms']:.4f} ms  evaluations "
                  f"{plan.search.get('cost_evaluations')}  plan {digest(plan)}  cpu {cpu[prune, j]:.2f} s  "
                  f"wall {wall[prune, j]:.2f} s  (polish {plan.search['phase_s'].get('polish', 0):.2f} s)",
                  flush=True)
        if both:
            print(f"{case:15s} cpu prune off / on {cpu[False, jobs[0]] / cpu[True, jobs[0]]:.2f}x", flush=True)
        for j in jobs[1:]:
            print(f"{case:15s} wall jobs {jobs[0]} / jobs {j} {wall[True, jobs[0]] / wall[True, j]:.2f}x",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
