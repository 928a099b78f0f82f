#!/usr/bin/env python
"""Search time and predicted iteration time of the HPP planner (paper section 7.6).

GPT-3 13B on 910B2/910B4 (half each, 8 devices per node, inter-node 200 Gbit/s,
inter-type 100 Gbit/s) at 16..128 devices; the optimisation ablation (none, +cache,
+skip, +order, +DP) on 13B / 64 devices; GPT-3 175B on 1024 devices.  Analytic
(roofline) profiles.  Runs that hit their time limit are marked "(limit)": their
iteration time is the best plan found within the limit.

    python bench/search_scaling.py            # full (un-optimised runs limited to 300 s)
    python bench/search_scaling.py --quick    # smaller: limits of 20 s, no 128-device row
"""
from __future__ import annotations

import argparse
import sys
import time


def b2b4(devices: int):
    from eth.cluster import Cluster
    nodes = devices // 16
    return Cluster.from_dict({"name": f"b2b4-{devices}", "inter_node_gbps": 200, "inter_type_gbps": 100,
                              "nodes": [{"type": "910B2", "devices_per_node": 8, "count": nodes},
                                        {"type": "910B4", "devices_per_node": 8, "count": nodes}]})


def run(model_name: str, devices: int, gbs: int, limit: float, **switches) -> dict:
    from eth.errors import InfeasibleError
    from eth.model import get_model
    from eth.planner.options import SearchOptions
    from eth.planner.search import search
    from eth.profiles import ProfileDB
    model, cluster = get_model(model_name), b2b4(devices)
    db = ProfileDB()
    db.ensure(model, cluster.types.values())
    start = time.perf_counter()
    try:
        plan = search(model, cluster, db, SearchOptions(gbs=gbs, time_limit=limit, **switches))
    except InfeasibleError as exc:
        return {"time_s": time.perf_counter() - start, "iter_ms": float("nan"), "limited": True,
                "note": str(exc)[:60], "pipes": 0, "c": {}}
    s = plan.search
    return {"time_s": time.perf_counter() - start, "iter_ms": plan.predicted["iteration_ms"],
            "limited": s["time_limited"], "pipes": len(plan.pipelines), "c": s["candidates"], "note": ""}


def fmt_row(label, r, ref=None):
    lim = " (limit)" if r["limited"] else ""
    c = r["c"]
    cand = f"{c.get('evaluated', 0)}/{c.get('skipped', 0)}/{c.get('by_dp', 0)}" if c else "-"
    speed = f"{ref['time_s'] / r['time_s']:.1f}x" if ref else ""
    ratio = f"{r['iter_ms'] / ref['iter_ms']:.4f}" if ref else ""
    return (f"{label:<28} {r['time_s']:>8.2f}{lim:<8} {r['iter_ms']:>12.1f} {r['pipes']:>5} "
            f"{cand:>14} {speed:>8} {ratio:>9} {r['note']}")


HEADER = (f"{'case':<28} {'search s':>8}{'':<8} {'iter ms':>12} {'pipes':>5} "
          f"{'eval/skip/dp':>14} {'speedup':>8} {'iter/ref':>9}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="shorter limits, fewer sizes")
    p.add_argument("--limit", type=float, help="time limit (s) of un-optimised runs")
    p.add_argument("--gbs", type=int, default=1024)
    args = p.parse_args(argv)
    limit = args.limit or (20.0 if args.quick else 300.0)
    none = dict(cache=False, skip=False, order=False, dp=False)

    print(f"# HPP search scaling, GPT-3 13B on 910B2/910B4, gbs {args.gbs}, analytic profiles")
    print(f"# un-optimised runs are limited to {limit:.0f} s; ref = un-optimised run of the same size")
    print(HEADER)
    sizes = (16, 32, 64) if args.quick else (16, 32, 64, 128)
    for n in sizes:
        full = run("gpt3-13b", n, args.gbs, 0.0)
        if n <= 32:
            ref = run("gpt3-13b", n, args.gbs, limit, **none)
            print(fmt_row(f"13B {n} dev, none", ref, ref))
            print(fmt_row(f"13B {n} dev, all", full, ref))
        else:
            print(fmt_row(f"13B {n} dev, all", full))
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

    print("\n# GPT-3 175B on 1024 devices (all optimisations)")
    print(HEADER)
    print(fmt_row("175B 1024 dev, all", run("gpt3-175b", 1024, args.gbs, 0.0)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
