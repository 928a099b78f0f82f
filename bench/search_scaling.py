#!/usr/bin/env python
"""Search time and predicted iteration time of the HPP planner (paper section 7.6).

GPT-3 13B on 910B2/910B4 (half each, 8 devices per node, inter-node 200 Gbit/s,
inter-type 100 Gbit/s) at 16..128 devices; the optimisation ablation (none, +cache,
+skip, +order, +DP) on 13B / 64 devices; GPT-3 175B on 1024 devices.  Analytic
(roofline) profiles.  Runs that hit their time limit are marked "(limit)": their
iteration time is the best plan found within the limit.  "search s" is wall time,
"cpu s" the CPU time of this process (steadier when other processes share the CPUs);
"speedup" / "cpu spd" are ref / row of each.

Every size is also searched with ``SearchOptions.memo`` off (the planner-level memos
and the sorted greedy of issue 11, same plans) and without seeds; the rows print the
ratio of the search times measured in this run and whether the plans' iteration times
agree.  "phases" gives the seconds of each search phase (plan.search["phase_s"]:
seeds, warm starts, balance, allocation, refine, polish, enumeration = the rest of
the driver).  Small clusters whose brute force (``eth.planner.bruteforce``, the same
space) finishes are compared with it too.

    python bench/search_scaling.py            # full (un-optimised runs limited to 300 s)
    python bench/search_scaling.py --quick    # smaller: limits of 20 s, no 128-device row
    python bench/search_scaling.py --many-types [--before REV] [--rows 0,1] [--many-limit S] [--max-blocks N]
    python bench/search_scaling.py --curve [--many-limit S] [--png docs/planner_scaling.png]
    python bench/search_scaling.py --gc [--rows 0,1] [--repeat 3]

Many device types (``--many-types``, also the last section of a full run): the clusters
of :data:`MANY_TYPES` (examples/clusters/mixed3-96, mixed4-256, mixed4-1024 and
mixed6-4096.yaml: 3, 4 and 6 types, 96-4096 devices, 8 per node, analytic profiles), each searched in a child process with the default ``--jobs`` (the CPUs this
process may use), which reports its wall time and peak RSS (the largest of the search
process and its forked workers).  With ``--before REV`` each row is also searched by the
planner of commit REV (a temporary ``git worktree``) in the same run, limited to
``--before-limit`` seconds, and the row prints the ratios.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # the planner of this checkout, not an installed one


def b2b4(devices: int):
    from eth.spec.cluster import Cluster
    nodes = devices // 16
    return Cluster.from_dict({"name": f"b2b4-{devices}", "inter_node_gbps": 200, "inter_type_gbps": 100,
                              "nodes": [{"type": "910B2", "devices_per_node": 8, "count": nodes},
                                        {"type": "910B4", "devices_per_node": 8, "count": nodes}]})


def run(model_name: str, devices: int, gbs: int, limit: float, **switches) -> dict:
    from eth.errors import InfeasibleError
    from eth.spec.model import get_model
    from eth.planner.options import SearchOptions
    from eth.planner.search import search
    from eth.profiles.db import ProfileDB
    model, cluster = get_model(model_name), b2b4(devices)
    db = ProfileDB()
    db.ensure(model, cluster.types.values())
    start, cpu = time.perf_counter(), time.process_time()
    try:
        plan = search(model, cluster, db, SearchOptions(gbs=gbs, time_limit=limit, **switches))
    except InfeasibleError as exc:
        return {"time_s": time.perf_counter() - start, "iter_ms": float("nan"), "limited": True,
                "note": str(exc)[:60], "pipes": 0, "c": {}, "cpu_s": time.process_time() - cpu}
    s = plan.search
    return {"time_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu,
            "iter_ms": plan.predicted["iteration_ms"],
            "limited": s["time_limited"], "pipes": len(plan.pipelines), "c": s["candidates"], "note": "",
            "phases": s.get("phase_s", {}), "seed_won": s.get("seed_won")}


PHASES = ("seeds", "warm starts", "balance", "allocation", "refine", "polish", "dp", "enumeration")


def fmt_phases(r) -> str:
    ph = r.get("phases") or {}
    return "    phases s: " + ", ".join(f"{k} {ph[k]:.2f}" for k in PHASES if k in ph)


def tiny_cases():
    """Small clusters and a 4-layer model whose brute force finishes."""
    from eth.spec.cluster import Cluster
    from eth.spec.model import ModelSpec
    m4 = ModelSpec("m4", num_layers=4, hidden=1024, heads=8, seq_len=512, vocab=8192)
    for nodes, gbs in (([("A100", 2), ("RTX3090", 2)], 16), ([("A100", 1), ("V100", 2)], 8),
                       ([("A100", 2), ("RTX3090", 1), ("V100", 1)], 8)):
        cluster = Cluster.from_dict({"name": "tiny", "inter_node_gbps": 100,
                                     "nodes": [{"type": t, "devices_per_node": n} for t, n in nodes]})
        yield "+".join(f"{n}x{t}" for t, n in nodes) + f" gbs {gbs}", m4, cluster, gbs


def run_tiny(model, cluster, gbs, **switches):
    from eth.planner.options import SearchOptions
    from eth.planner.search import search
    from eth.profiles.db import ProfileDB
    db = ProfileDB()
    db.ensure(model, cluster.types.values())
    cpu = time.process_time()
    plan = search(model, cluster, db, SearchOptions(gbs=gbs, **switches))
    return time.process_time() - cpu, plan.predicted["iteration_ms"]


def brute(model, cluster, gbs):
    from eth.planner.bruteforce import brute_force
    from eth.profiles.db import ProfileDB
    db = ProfileDB()
    db.ensure(model, cluster.types.values())
    cpu = time.process_time()
    best, _ = brute_force(model, cluster, db, gbs)
    return time.process_time() - cpu, best


MANY_TYPES = [
    # label, examples/clusters/<name>.yaml, model, gbs, target search s, target peak GB
    ("3 types, 96 dev, 13B", "mixed3-96", "gpt3-13b", 1024, 2, None),
    ("4 types, 256 dev, 175B", "mixed4-256", "gpt3-175b", 2048, 5, 1.0),
    ("4 types, 1024 dev, 175B", "mixed4-1024", "gpt3-175b", 2048, 10, None),
    ("6 types, 4096 dev, 175B", "mixed6-4096", "gpt3-175b", 2048, 60, 2.0),
]


def many_types_child(problem: dict, limit: float, max_blocks: int | None = None) -> dict:
    """One search in this process (the planner on ``sys.path``) of ``problem``: "cluster"
    (an examples/clusters file stem, or {device type: devices}, 8 per node), "model", "gbs"."""
    import resource

    from eth.errors import InfeasibleError
    from eth.planner.options import SearchOptions
    from eth.planner.search import search
    from eth.profiles.db import ProfileDB
    from eth.spec.cluster import Cluster, load_cluster
    from eth.spec.model import get_model
    mix = problem["cluster"]
    if problem.get("gc_on"):          # CPython's collector during the search, as without collector.paused
        import eth.planner.collector
        eth.planner.collector.PAUSE = False
    if isinstance(mix, str):
        cluster = load_cluster(ROOT / "examples" / "clusters" / f"{mix}.yaml")
    else:
        cluster = Cluster.from_dict({"name": f"{len(mix)}-types", "inter_node_gbps": 200, "inter_type_gbps": 100,
                                     "nodes": [{"type": t, "devices_per_node": 8, "count": n // 8}
                                               for t, n in mix.items()]})
    model, db, gbs = get_model(problem["model"]), ProfileDB(), problem["gbs"]
    db.ensure(model, cluster.types.values())
    start, cpu = time.perf_counter(), time.process_time()
    try:
        extra = {} if max_blocks is None else {"max_blocks": max_blocks}
        plan = search(model, cluster, db, SearchOptions(gbs=gbs, time_limit=limit,
                                                        jobs=len(os.sched_getaffinity(0)), **extra))
        ms, limited = plan.predicted["iteration_ms"], bool(plan.search.get("time_limited"))
    except InfeasibleError:
        ms, limited = float("nan"), True
    wall = time.perf_counter() - start
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    peak = max(u.ru_maxrss for u in usage)
    return {"time_s": wall, "iter_ms": ms, "limited": limited, "rss_gb": peak / 2**20,
            "cpu_s": time.process_time() - cpu + usage[1].ru_utime + usage[1].ru_stime}


def many_types_run(problem: dict, root: Path, limit: float, max_blocks: int | None = None) -> dict:
    """:func:`many_types_child` in a fresh process with the planner of checkout ``root``."""
    import json
    extra = [] if max_blocks is None else ["--max-blocks", str(max_blocks)]
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(problem),
                          "--limit", str(limit), "--root", str(root), *extra], capture_output=True, text=True,
                         cwd=root)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"child {problem} ({root}) failed:\n{out.stderr[-2000:]}")
    return json.loads(lines[-1])


CURVE_TYPES = ("H100", "A100", "A100-40GB", "RTX3090", "V100", "L40S")
"""The scaling curve's device types, in the order they are added."""
CURVE_DEVICES = (32, 64, 128, 256)
"""Devices of the 4-type curve (equal per type)."""
CURVE_PER_TYPE = 16
"""Devices per type of the types curve."""


def scaling_curve(png: Path, limit: float, max_blocks: int | None = None) -> None:
    """Search time and peak RSS vs devices (4 types, CURVE_DEVICES) and vs device types
    (2..6 of CURVE_TYPES, CURVE_PER_TYPE each), GPT-3 13B, gbs 1024, each search in a child
    process limited to ``limit`` s; a table on stdout and the two curves in ``png``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    series = {"devices": [], "types": []}
    print(f"# scaling curve: GPT-3 13B, gbs 1024, default --jobs, limit {limit:g} s per search")
    print(f"{'case':<26} {'search s':>9} {'peak GB':>8} {'iter ms':>11}")
    problems = [("devices", n, {t: n // 4 for t in CURVE_TYPES[:4]}) for n in CURVE_DEVICES]
    problems += [("types", k, {t: CURVE_PER_TYPE for t in CURVE_TYPES[:k]}) for k in range(2, len(CURVE_TYPES) + 1)]
    for axis, x, mix in problems:
        r = many_types_run({"cluster": mix, "model": "gpt3-13b", "gbs": 1024}, ROOT, limit, max_blocks)
        series[axis].append((x, r))
        label = f"{len(mix)} types, {sum(mix.values())} dev"
        print(f"{label:<26} {r['time_s']:>9.1f}{' (limit)' if r['limited'] else ''} {r['rss_gb']:>8.2f} "
              f"{r['iter_ms']:>11.1f}")
        sys.stdout.flush()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, axis, xlabel in ((axes[0], "devices", "devices (4 types, equal shares)"),
                             (axes[1], "types", f"device types ({CURVE_PER_TYPE} devices each)")):
        xs = [x for x, _ in series[axis]]
        ax.plot(xs, [r["time_s"] for _, r in series[axis]], "o-", label="search time (s)")
        for x, r in series[axis]:
            if r["limited"]:
                ax.annotate("limit", (x, r["time_s"]), textcoords="offset points", xytext=(0, 6), ha="center")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("search wall time, s")
        ax.set_xticks(xs)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        twin = ax.twinx()
        twin.plot(xs, [r["rss_gb"] for _, r in series[axis]], "s--", color="tab:orange", label="peak RSS (GB)")
        twin.set_ylabel("peak RSS, GB")
        twin.set_ylim(bottom=0)
    fig.suptitle("HPP search, GPT-3 13B, gbs 1024 (bench/search_scaling.py --curve)")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    print(f"wrote {png}")


def many_types(before: str | None, before_limit: float, rows=None, limit: float = 0.0,
               max_blocks: int | None = None) -> None:
    import tempfile
    print(f"\n# many device types: search wall time and peak RSS per row (default --jobs), "
          f"{'side by side with commit ' + before if before else 'this checkout only'}")
    head = f"{'case':<26} {'search s':>9} {'peak GB':>8} {'iter ms':>11} {'target':>14}"
    if before:
        head += f" | {'before s':>9} {'peak GB':>8} {'iter ms':>11} {'speedup':>8} {'iter/before':>11}"
    print(head)
    with tempfile.TemporaryDirectory() as tmp:
        old = None
        if before:
            old = Path(tmp) / "before"
            subprocess.run(["git", "worktree", "add", "--detach", str(old), before], cwd=ROOT, check=True,
                           capture_output=True)
        try:
            for i, (label, mix, model, gbs, want_s, want_gb) in enumerate(MANY_TYPES):
                if rows is not None and i not in rows:
                    continue
                problem = {"cluster": mix, "model": model, "gbs": gbs}
                r = many_types_run(problem, ROOT, limit, max_blocks)
                target = f"<{want_s} s" + (f", <{want_gb} GB" if want_gb else "")
                row = (f"{label:<26} {r['time_s']:>9.1f}{' (limit)' if r['limited'] else ''} {r['rss_gb']:>8.2f} "
                       f"{r['iter_ms']:>11.1f} {target:>14}")
                if old is not None:
                    b = many_types_run(problem, old, before_limit)
                    lim = " (limit)" if b["limited"] else ""
                    row += (f" | {b['time_s']:>9.1f} {b['rss_gb']:>8.2f} {b['iter_ms']:>11.1f} "
                            f"{b['time_s'] / r['time_s']:>7.1f}x{lim} {r['iter_ms'] / b['iter_ms']:>11.4f}")
                print(row)
                sys.stdout.flush()
        finally:
            if old is not None:
                subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, capture_output=True)


def collector(rows=None, repeat: int = 3) -> None:
    """The many-type rows searched with CPython's garbage collector on during the search
    ("gc on", as without :func:`eth.planner.collector.paused`) and as the planner runs
    (paused), alternately, ``repeat`` times each: the medians of wall time, CPU time (the
    search process and its forked workers) and peak RSS, and whether every run found a
    plan of the same iteration time."""
    import statistics
    print("\n# garbage collector during the search: on (CPython's defaults) vs paused "
          f"(median of {repeat} alternating runs, default --jobs)")
    print(f"{'case':<26} {'gc on s':>9} {'cpu s':>6} {'peak GB':>8} | {'paused s':>8} {'cpu s':>6} "
          f"{'peak GB':>8} | {'wall x':>6} {'cpu x':>6} {'same plan':>9}")
    for i, (label, mix, model, gbs, _, _) in enumerate(MANY_TYPES):
        if rows is not None and i not in rows:
            continue
        runs: dict = {True: [], False: []}
        for _ in range(repeat):
            for on in (True, False):
                runs[on].append(many_types_run({"cluster": mix, "model": model, "gbs": gbs, "gc_on": on},
                                               ROOT, 0.0))
        med = {on: {k: statistics.median(r[k] for r in rs) for k in ("time_s", "cpu_s", "rss_gb")}
               for on, rs in runs.items()}
        same = len({r["iter_ms"] for rs in runs.values() for r in rs}) == 1
        f, y = med[True], med[False]
        print(f"{label:<26} {f['time_s']:>9.2f} {f['cpu_s']:>6.2f} {f['rss_gb']:>8.2f} | {y['time_s']:>8.2f} "
              f"{y['cpu_s']:>6.2f} {y['rss_gb']:>8.2f} | {f['time_s'] / y['time_s']:>6.2f} "
              f"{f['cpu_s'] / y['cpu_s']:>6.2f} {'yes' if same else 'NO':>9}")
        sys.stdout.flush()


def context() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False, cwd=ROOT).stdout.strip() or "?"
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "eth", "bench"], capture_output=True,
                               text=True, check=False, cwd=ROOT).stdout.strip()
    except OSError:
        commit, dirty = "?", ""
    load = " ".join(open("/proc/loadavg").read().split()[:3]) if os.path.exists("/proc/loadavg") else "?"
    import eth
    return (f"# command: python {' '.join(sys.argv)}  (eth from {Path(eth.__file__).parent})\n# commit {commit}{' (+ local changes)' if dirty else ''}, "
            f"load average {load}, {os.cpu_count()} CPUs")


def fmt_row(label, r, ref=None):
    lim = " (limit)" if r["limited"] else ""
    c = r["c"]
    cand = f"{c.get('evaluated', 0)}/{c.get('skipped', 0)}/{c.get('by_dp', 0)}" if c else "-"
    speed = f"{ref['time_s'] / r['time_s']:.1f}x" if ref else ""
    cpu_speed = f"{ref['cpu_s'] / r['cpu_s']:.1f}x" if ref else ""
    ratio = f"{r['iter_ms'] / ref['iter_ms']:.4f}" if ref else ""
    return (f"{label:<28} {r['time_s']:>8.2f}{lim:<8} {r['cpu_s']:>7.2f} {r['iter_ms']:>12.1f} {r['pipes']:>5} "
            f"{cand:>14} {speed:>8} {cpu_speed:>8} {ratio:>9} {r['note']}")


HEADER = (f"{'case':<28} {'search s':>8}{'':<8} {'cpu s':>7} {'iter ms':>12} {'pipes':>5} "
          f"{'eval/skip/dp':>14} {'speedup':>8} {'cpu spd':>8} {'iter/ref':>9}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="shorter limits, fewer sizes")
    p.add_argument("--limit", type=float, help="time limit (s) of un-optimised runs")
    p.add_argument("--gbs", type=int, default=1024)
    p.add_argument("--many-types", action="store_true", help="only the many-type rows")
    p.add_argument("--before", metavar="REV", help="also search the many-type rows with the planner of commit REV")
    p.add_argument("--before-limit", type=float, default=600.0, help="time limit (s) of the --before searches")
    p.add_argument("--rows", help="many-type rows to run, e.g. 0,1 (default: all)")
    p.add_argument("--many-limit", type=float, default=0.0,
                   help="time limit (s) of this checkout's many-type searches (default: none)")
    p.add_argument("--max-blocks", type=int, help="SearchOptions.max_blocks of this checkout's many-type searches "
                                                  "(default: the planner's)")
    p.add_argument("--curve", action="store_true",
                   help="only the scaling curve: search time vs devices (4 types) and vs types (16 devices "
                        "each), GPT-3 13B, gbs 1024, limited to --many-limit s (default 300); writes --png")
    p.add_argument("--png", default=str(ROOT / "docs" / "planner_scaling.png"), help="where --curve draws")
    p.add_argument("--gc", action="store_true",
                   help="only the many-type rows (--rows) with CPython's garbage collector on during the "
                        "search vs paused, alternately --repeat times each")
    p.add_argument("--repeat", type=int, default=3, help="runs of each variant with --gc")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat must be >= 1, got {args.repeat}")
    if args.child is not None:
        import json
        sys.path.insert(0, args.root)     # the planner of that checkout
        print(json.dumps(many_types_child(json.loads(args.child), args.limit or 0.0, args.max_blocks)))
        return 0
    if args.curve:
        print(context())
        scaling_curve(Path(args.png), args.many_limit or 300.0, args.max_blocks)
        return 0
    rows = None if not args.rows else {int(x) for x in args.rows.split(",")}
    if args.gc:
        print(context())
        collector(rows, args.repeat)
        return 0
    if args.many_types:
        print(context())
        many_types(args.before, args.before_limit, rows, args.many_limit, args.max_blocks)
        return 0
    limit = args.limit or (20.0 if args.quick else 300.0)
    none = dict(cache=False, skip=False, order=False, dp=False)

    print(context())
    print(f"# HPP search scaling, GPT-3 13B on 910B2/910B4, gbs {args.gbs}, analytic profiles")
    print(f"# un-optimised runs are limited to {limit:.0f} s; ref = un-optimised run of the same size")
    print("# 'memo off' = SearchOptions(memo=False): the search without the issue-11 planner memos (same plans)")
    print(HEADER)
    sizes = (16, 32, 64) if args.quick else (16, 32, 64, 128)
    for n in sizes:
        full = run("gpt3-13b", n, args.gbs, 0.0)
        slow = run("gpt3-13b", n, args.gbs, 0.0, memo=False)
        own = run("gpt3-13b", n, args.gbs, 0.0, seeds=False)
        if n <= 32:
            ref = run("gpt3-13b", n, args.gbs, limit, **none)
            print(fmt_row(f"13B {n} dev, none", ref, ref))
            print(fmt_row(f"13B {n} dev, all", full, ref))
        else:
            print(fmt_row(f"13B {n} dev, all", full))
        print(fmt_row(f"13B {n} dev, all, memo off", slow, full))
        print(fmt_row(f"13B {n} dev, all, no seeds", own, full))
        print(fmt_phases(full) + (f"; seed won: {full['seed_won']}" if full["seed_won"] else ""))
        sys.stdout.flush()

    print(f"\n# ablation, GPT-3 13B on 64 devices (cumulative switches; limit {limit:.0f} s each)")
    print(HEADER)
    steps = [("none", none),
             ("+cache", dict(none, cache=True)),
             ("+cache+skip", dict(none, cache=True, skip=True)),
             ("+cache+skip+order", dict(none, cache=True, skip=True, order=True)),
             ("+cache+skip+order+DP", {})]
    ref = None
    for label, sw in steps:
        r = run("gpt3-13b", 64, args.gbs, limit, **sw)
        ref = ref or r
        print(fmt_row(label, r, ref))
        sys.stdout.flush()

    print("\n# GPT-3 175B on 1024 devices (all optimisations; ref = the same with memo off)")
    print(HEADER)
    big = run("gpt3-175b", 1024, args.gbs, 0.0)
    big_slow = run("gpt3-175b", 1024, args.gbs, 0.0, memo=False)
    big_own = run("gpt3-175b", 1024, args.gbs, 0.0, seeds=False)
    print(fmt_row("175B 1024 dev, memo off", big_slow, big_slow))
    print(fmt_row("175B 1024 dev, all", big, big_slow))
    print(fmt_row("175B 1024 dev, all, no seeds", big_own, big_slow))
    print(fmt_phases(big) + (f"; seed won: {big['seed_won']}" if big["seed_won"] else ""))

    print("\n# small clusters, 4-layer model: search vs brute force of the same space (eth.planner.bruteforce)")
    print("# (CPU seconds of this process)")
    print(f"{'case':<36} {'search s':>9} {'memo off s':>10} {'brute s':>9} {'speedup':>8} "
          f"{'iter ms':>10} {'brute ms':>10} {'iter/brute':>10}")
    for label, model, cluster, gbs in tiny_cases():
        t_on, ms = run_tiny(model, cluster, gbs)
        t_off, ms_off = run_tiny(model, cluster, gbs, memo=False)
        t_bf, bf = brute(model, cluster, gbs)
        same = "" if ms == ms_off else f" (memo off: {ms_off:.3f} ms)"
        print(f"{label:<36} {t_on:>9.2f} {t_off:>10.2f} {t_bf:>9.2f} {t_bf / t_on:>7.1f}x "
              f"{ms:>10.3f} {bf:>10.3f} {ms / bf:>10.4f}{same}")
    many_types(args.before, args.before_limit, rows, args.many_limit, args.max_blocks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
