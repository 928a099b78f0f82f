"""The fleet choice against every device: samples/s, cost and search time side by side.

For each case (cluster, model, global batch) the planner runs twice in this process, one
after the other: on every device (``--use-all``) and with the fleet choice
(``--objective``, default throughput; eth/planner/fleet.py).  Printed per case: the
devices the choice uses of those available, samples/s of both and their ratio (>= 1:
leaving devices out never loses), USD/h where the cluster has prices, and the search times
with their ratio (the target on mixed4-256: at most 3).  Writes
bench/results/fleet_choice.json (with ``--update-results``; else out/bench/) and
fleet_choice.md; with ``--update-results`` also the table of docs/EVALUATION.md ("Which
devices to use").

    python bench/fleet_choice.py                       # every case (about 3 minutes on 2 cores)
    python bench/fleet_choice.py --only mixed4-256 --repeat 3
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.run_context import ROOT, add_output_args, commit, loadavg, write_results  # noqa: E402

CLUSTERS = ROOT / "examples" / "clusters"
SLOW_ZONE = {"inter_zone_gbps": 1}
"""fleet-2zones with a 1 Gbit/s link between its zones (instead of 10)."""

CASES = {
    # name: (cluster file, cluster changes, model, gbs, objective)
    "mixed4-256": ("mixed4-256.yaml", {}, "gpt3-175b", 2048, "throughput"),
    "mixed3-96": ("mixed3-96.yaml", {}, "gpt3-13b", 1024, "throughput"),
    "b2b4-64": ("b2b4-64.yaml", {}, "gpt3-13b", 1024, "throughput"),
    "a100-3090-64": ("a100-3090-64.yaml", {}, "gpt3-1.3b", 512, "throughput"),
    "fleet-2zones": ("fleet-2zones.yaml", {}, "gpt3-1.3b", 512, "throughput"),
    "fleet-2zones slow link": ("fleet-2zones.yaml", SLOW_ZONE, "gpt3-1.3b", 512, "throughput"),
    "fleet-2zones cost": ("fleet-2zones.yaml", {}, "gpt3-1.3b", 512, "cost"),
}


def run_case(name: str, jobs: int, repeat: int, folder: Path) -> dict:
    import yaml

    from eth.planner.fleet import FleetOptions
    from eth.planner.job import plan_job
    from eth.planner.options import SearchOptions
    from eth.spec.cluster import load_cluster
    from eth.spec.model import get_model

    file, changes, model_name, gbs, objective = CASES[name]
    path = CLUSTERS / file
    if changes:
        data = yaml.safe_load(path.read_text()) | changes
        path = folder / f"{Path(file).stem}-changed.yaml"
        path.write_text(yaml.safe_dump(data))
    cluster, model = load_cluster(path), get_model(model_name)
    options = SearchOptions(gbs=gbs, jobs=jobs, progress=False)
    profiles = str(ROOT / "profiles")
    times: dict = {"all": [], "fleet": []}
    for _ in range(repeat):   # alternating, so that a change of load hits both alike
        for key, fleet in (("all", None), ("fleet", FleetOptions(objective))):
            start = time.perf_counter()
            plan = plan_job(model, cluster, profiles, options, fleet=fleet)
            times[key].append(time.perf_counter() - start)
            if key == "all":
                every = plan
            else:
                chosen = plan
    used = chosen.search["fleet"]["used"]
    available = chosen.search["fleet"]["available"]
    row = {"case": name, "cluster": file, "changes": changes, "model": model_name, "gbs": gbs,
           "objective": objective, "available": available, "used": used,
           "all_samples_per_s": every.predicted["samples_per_s"],
           "fleet_samples_per_s": chosen.predicted["samples_per_s"],
           "throughput_ratio": chosen.predicted["samples_per_s"] / every.predicted["samples_per_s"],
           "all_s": statistics.median(times["all"]), "fleet_s": statistics.median(times["fleet"]),
           "searched": chosen.search["fleet"]["searched"], "candidates": chosen.search["fleet"]["candidates"]}
    row["time_ratio"] = row["fleet_s"] / row["all_s"]
    if "cost_per_hour" in chosen.predicted:
        row |= {"all_cost_per_hour": every.predicted["cost_per_hour"],
                "fleet_cost_per_hour": chosen.predicted["cost_per_hour"],
                "all_usd_per_1000": every.predicted["usd_per_sample"] * 1e3,
                "fleet_usd_per_1000": chosen.predicted["usd_per_sample"] * 1e3}
    return row


def markdown(rows: list[dict], header: str) -> str:
    def devices(d):
        return ", ".join(f"{n} {k}" for k, n in d.items() if n)

    lines = [header, "",
             "| case | model, gbs | objective | devices used (of available) | samples/s all, chosen (ratio) "
             "| USD per 1000 samples all, chosen | search s all, chosen (ratio) | fleets searched |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        money = (f"{r['all_usd_per_1000']:.4f}, {r['fleet_usd_per_1000']:.4f}" if "all_usd_per_1000" in r else "")
        lines.append(f"| {r['case']} | {r['model']}, {r['gbs']} | {r['objective']} | {devices(r['used'])} "
                     f"({sum(r['available'].values())}) | {r['all_samples_per_s']:.2f}, {r['fleet_samples_per_s']:.2f} "
                     f"({r['throughput_ratio']:.3f}) | {money} | {r['all_s']:.1f}, {r['fleet_s']:.1f} "
                     f"({r['time_ratio']:.2f}) | {r['searched']} of {r['candidates']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=sorted(CASES), help="these cases (default: all)")
    ap.add_argument("--jobs", type=int, default=1, help="processes per search (default 1: timings comparable)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each search; the median time is reported")
    add_output_args(ap, "fleet_choice.json and fleet_choice.md")
    args = ap.parse_args(argv)
    names = args.only or list(CASES)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            row = run_case(name, args.jobs, args.repeat, Path(tmp))
            rows.append(row)
            print(markdown([row], "").strip().splitlines()[-1], flush=True)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    command = "python bench/fleet_choice.py " + " ".join(sys.argv[1:] if argv is None else argv)
    header = (f"    {when}  {command.strip()}  # commit {commit()}, load {loadavg()}, jobs {args.jobs}, "
              f"median of {args.repeat}")
    write_results(args, "fleet_choice", rows, header, markdown,
                  "(`python bench/fleet_choice.py --update-results`; the run's date, commit and load: "
                  "bench/results/fleet_choice.md)", whole=args.only is None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
