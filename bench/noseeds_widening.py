#!/usr/bin/env python
"""HPP's own search (no seeds) with and without its two widenings, side by side (issue 11 item 2).

The widenings (eth/planner/symmetric.py, eth/planner/recompute_runs.py; switches
``SearchOptions.symmetric`` and ``recompute_runs``) let the unseeded search reach plans
of HexiScale's shape -- k identical pipelines beyond the block enumeration, stages that
recompute whole layers or the attention core as one run.  For each case this prints the
unseeded search's predicted iteration (Eq. 5 + Eq. 6, ms), its wall time and the
symmetric phase's seconds with both off, the symmetric phase only, and both on (the
default), next to the best of the HexiScale-strong / Metis-strong / TypeSplit baselines
(``--baselines`` to change), all in one process on the same profiles as
bench/paper_eval.py.  Cases: the Table 2 rows where the unseeded search trailed a baseline
before the widenings, and GPT-3 13B on b2b4-64 (the search-speed case of issue 11 item 1).

``--suite`` adds the seeded small-cluster suite of tests/planner/test_search_core.py:
the gap of the unseeded search (with polish) to the proven optimum of the planner's
space, per switch setting (median, mean, p95, max, cases above 1%), and to the full
space's; ``--variants`` runs the test's own searches instead (core, core + polish,
search()), ``--worst`` lists the cases more than 1% above the optimum with both plans.

    python bench/noseeds_widening.py              # ~2-3 minutes on an idle 2-core machine
    python bench/noseeds_widening.py --suite      # + ~1.5 minutes
    python bench/noseeds_widening.py --suite --no-table --variants --worst
        # the test's three searches (core, core + polish, search()); the cases above 1%
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

CASES = (("llama2-70b", "b2b3", 512), ("llama2-70b", "a100-3090", 512), ("gpt3-175b", "b2b4", 1024),
         ("gpt3-175b", "a100-3090", 1024), ("gpt3-13b", "b2b4", 64))
SETTINGS = (("neither", dict(symmetric=False, recompute_runs=False)),
            ("symmetric", dict(symmetric=True, recompute_runs=False)),
            ("both", dict(symmetric=True, recompute_runs=True)))


def context() -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False, cwd=ROOT).stdout.strip() or "?"
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "eth", "bench"], capture_output=True,
                           text=True, check=False, cwd=ROOT).stdout.strip()
    load = " ".join(open("/proc/loadavg").read().split()[:3]) if os.path.exists("/proc/loadavg") else "?"
    import eth
    return (f"# command: python {' '.join(sys.argv)}  (eth from {Path(eth.__file__).parent})\n"
            f"# commit {commit}{' (+ local changes)' if dirty else ''}, load average {load}, {os.cpu_count()} CPUs")


def table_cases(baselines, time_limit: float):
    import paper_eval as pe
    from eth.errors import InfeasibleError
    from eth.spec.model import get_model
    from eth.planner.baselines import plan_baseline
    from eth.planner.baselines.common import BaselineOptions
    from eth.planner.options import SearchOptions
    from eth.planner.search import search

    mc = pe.make_clusters_module()
    cache = pe.ProfileCache(ROOT / "profiles")
    head = (f"{'case':<24} {'setting':<10} {'ms':>10} {'search s':>9} {'sym s':>6} {'pipes':>5} "
            f"{'vs best baseline':>17}  best baseline")
    print(head)
    for model_name, pair, n in CASES:
        case = pe.Case("table2", model_name, pair, n, 1024, 2048)
        model = get_model(model_name, seq_len=case.seq)
        cluster = pe.cluster_for(case, mc)
        db = cache.for_problem(model, cluster)
        best = (None, float("inf"))
        for b in baselines:
            try:
                ms = plan_baseline(b, model, cluster, db, case.gbs,
                                   BaselineOptions(time_limit=time_limit)).predicted["iteration_ms"]
            except InfeasibleError:
                continue
            if ms < best[1]:
                best = (b, ms)
        for label, switches in SETTINGS:
            start = time.perf_counter()
            plan = search(model, cluster, db, SearchOptions(gbs=case.gbs, seeds=False, time_limit=time_limit,
                                                            **switches))
            wall = time.perf_counter() - start
            ms = plan.predicted["iteration_ms"]
            sym = plan.search.get("phase_s", {}).get("symmetric", 0.0)
            print(f"{model_name + ' ' + pair + '-' + str(n):<24} {label:<10} {ms:>10.1f} {wall:>9.2f} {sym:>6.2f} "
                  f"{len(plan.pipelines):>5} {ms / best[1] - 1:>+16.2%}  {best[0]} {best[1]:.1f}"
                  f"{' (time limit)' if plan.search.get('time_limited') else ''}")
            sys.stdout.flush()


def describe(plan) -> list[str]:
    """One line per pipeline: Mbs, Lbs and its stages (type x devices, tp, dp, layers,
    recomputed op-layers)."""
    return [f"    mbs {p.mbs} lbs {p.lbs}: " + " | ".join(
        f"{st.device_type} x{len(st.ranks)} tp{st.tp} dp{st.dp} L{st.layers[0]}-{st.layers[1]} "
        f"rec {sum(st.recompute.values())}" for st in p.stages) for p in plan.pipelines]


def suite(variants: bool, worst: bool, seed: int | None):
    sys.path.insert(0, str(ROOT / "tests" / "planner"))
    import test_search_core as core
    if seed is not None:
        core.SUITE_SEED = seed      # a held-out draw of the same kind of cases
    if not variants:
        core.SEARCHES = {label: dict(seeds=False, **switches) for label, switches in SETTINGS}
    start = time.process_time()
    core.results()
    print(f"\n# tests/planner/test_search_core.py suite (seed {core.SUITE_SEED}): search / optimum of the planner's space - 1 "
          f"({time.process_time() - start:.0f} CPU s); full space: over the cases whose planner space has a plan")
    print(f"{'setting':<14} {'cases':>5} {'median':>8} {'mean':>8} {'p95':>8} {'max':>8} {'>1%':>4} {'at opt':>6}"
          f"   full: {'median':>8} {'p95':>8} {'max':>8}")
    for label in core.SEARCHES:
        g = core.gaps(label, "planner")
        f = [r[label] / r["full"].ms - 1 for r in core.results()
             if r["full"].plan is not None and r["full"].proven and r["planner"].plan is not None]
        print(f"{label:<14} {len(g):>5} {statistics.median(g):>8.2%} {statistics.mean(g):>8.2%} "
              f"{core.percentile(g, 0.95):>8.2%} {max(g):>8.2%} {sum(x > 0.01 for x in g):>4} "
              f"{sum(x <= 1e-9 for x in g) / len(g):>6.2f}         {statistics.median(f):>8.2%} "
              f"{core.percentile(f, 0.95):>8.2%} {max(f):>8.2%}")
    if worst:
        from eth.planner.options import SearchOptions
        from eth.planner.search import search
        from _planner_data import profiles_for
        label = list(core.SEARCHES)[-1]
        cases = {name: (model, cluster, gbs) for name, model, cluster, gbs in core.suite()}
        rows = [r for r in core.results() if r["planner"].plan is not None and r["planner"].proven
                and r[label] > r["planner"].ms * 1.01]
        print(f"\n# cases more than 1% above the planner-space optimum ({label}): {len(rows)}")
        for r in rows:
            model, cluster, gbs = cases[r["name"]]
            plan = search(model, cluster, profiles_for(model, cluster), SearchOptions(gbs=gbs, **core.SEARCHES[label]))
            print(f"{r['name']}: {r[label]:.3f} ms vs optimum {r['planner'].ms:.3f} ms "
                  f"({r[label] / r['planner'].ms - 1:+.2%})\n  search:")
            print("\n".join(describe(plan)) + "\n  optimum:\n" + "\n".join(describe(r["planner"].plan)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baselines", nargs="+", default=["hexiscale-strong", "metis-strong", "typesplit"])
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds per search (as paper_eval)")
    p.add_argument("--suite", action="store_true", help="also the small-cluster suite of test_search_core")
    p.add_argument("--no-table", action="store_true", help="only the suite")
    p.add_argument("--variants", action="store_true",
                   help="the suite with the test's searches (core, core + polish, search()) instead of the switches")
    p.add_argument("--seed", type=int, help="draw the suite with this seed instead of the test's (held out)")
    p.add_argument("--worst", action="store_true",
                   help="list the suite's cases more than 1%% above the optimum, with both plans")
    args = p.parse_args(argv)
    print(context())
    if not args.no_table:
        table_cases(args.baselines, args.time_limit)
    if args.suite:
        suite(args.variants, args.worst, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
