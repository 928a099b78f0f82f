"""Our fleet choice against Sailor's planner on Sailor's own scenarios, in our cost model.

Sailor (SOSP'25, github eth-easl/sailor) plans resources and parallelism together.  Its
artifact runs its planner on GPU traces (``ae_scripts/planner/run_*.sh`` over
``sailor/Planner/simulations/configs/gpu_trace_*.csv``: OPT-350, gbs 1024, fp32, A100-40
and V100-16 nodes of 4 GPUs in GCP zones) and writes, per trace row, the plan it chose,
its planner's estimate, its simulator's figures and the search time
(``SAILOR_OPT-350.json`` in the scenario's results folder).  Per row this script

* builds our cluster from the row: a node group of 4 GPUs per (type, zone), Sailor's
  simulator prices (``constants.py`` ``GPU_PRICES``), the bandwidths of Sailor's measured
  coefficients (``providers/multizone_bandwidths_het.json`` at 100 MB, 4-GPU nodes)
  between nodes, types and zones, and the egress prices of
  ``providers/gcp/communication_cost.json``; OPT-350 as ``bench/data/measured_runs.yaml``
  has it, on Sailor's layer profiles (``tools/make_profiles.py --import-sailor``), fp32
  with DeepSpeed's blocking transfers;
* runs our fleet choice with the scenario's objective (throughput; or cost with Sailor's
  minimum of 0.2 iterations/s as samples/s; Sailor's budget per iteration is checked
  on the plan, our constraint being per hour);
* writes Sailor's plan in our format where it can be (stages of one GPU type and tp, one
  dp for all stages; Sailor rounds the batch up to whole micro-batches, so does its plan
  here) and scores it in our model.

Printed per row: iterations/s and USD per iteration of Sailor's plan in our model and by
Sailor's own simulator, of ours in our model, and both search times.  The JSON keeps our
plans in Sailor's format where it can hold them (one pipeline, one dp for all stages:
:func:`sailor_format`), which ``bench/sailor_simulate.py`` scores with Sailor's simulator.

    python bench/sailor_fleet.py --sailor CHECKOUT --results het=DIR/fig8b geo=DIR/fig10 \\
        cost=DIR/fig11 budget=DIR/fig12 homogeneous=DIR/fig8a [--update-results]
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.measured_runs import load_data, profile  # noqa: E402
from bench.run_context import add_output_args, commit, loadavg, write_results  # noqa: E402
from eth.cost.model import CostModel  # noqa: E402
from eth.cost.price import plan_rates  # noqa: E402
from eth.errors import InfeasibleError, SpecError  # noqa: E402
from eth.planner.fleet import FleetOptions, choose_fleet  # noqa: E402
from eth.planner.options import SearchOptions  # noqa: E402
from eth.profiles.db import ProfileDB  # noqa: E402
from eth.spec.cluster import Cluster, catalog  # noqa: E402
from eth.spec.model import ModelSpec  # noqa: E402
from eth.spec.plan import PipelinePlan, Plan, StagePlan  # noqa: E402
from eth.spec.precision import TrainSetup  # noqa: E402

GBS = 1024
GPUS_PER_NODE = 4
MESSAGE_MB = 100
DEVICES = {"A100-40": ("A100-40GB", "A100-40GB"), "V100-16": ("V100-16GB", "V100")}
"""Sailor's GPU -> (our device type, its catalog base); memory from Sailor's cluster config."""
SCENARIOS = {
    # name: (objective, min iterations/s, max USD per iteration)
    "homogeneous": ("throughput", 0.0, 0.0),
    "het": ("throughput", 0.0, 0.0),
    "geo": ("throughput", 0.0, 0.0),
    "cost": ("cost", 0.2, 0.0),
    "budget": ("throughput", 0.0, 1.2),
}
NETWORK = "sailor/providers/multizone_bandwidths_het.json"
EGRESS = "sailor/providers/gcp/communication_cost.json"
PRICES = "sailor/Planner/simulations/constants.py"
SIZES = "sailor/Planner/simulations/configs/basic_cluster_config.json"


class Sailor:
    """The facts this comparison reads from a checkout of Sailor."""

    def __init__(self, checkout: Path):
        self.root = checkout
        self.coeffs = json.loads((checkout / NETWORK).read_text())
        self.egress = json.loads((checkout / EGRESS).read_text())
        self.sizes = json.loads((checkout / SIZES).read_text())
        tree = ast.parse((checkout / PRICES).read_text())
        self.prices = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                           and getattr(n.targets[0], "id", "") == "GPU_PRICES")

    def gbps(self, z1: str, g1: str, z2: str, g2: str) -> float:
        """Sailor's measured bandwidth between two 4-GPU nodes at MESSAGE_MB, Gbit/s."""
        (a, b, c), _ = self.coeffs[z1][g1][str(GPUS_PER_NODE)][z2][g2][str(GPUS_PER_NODE)]
        x = math.log2(MESSAGE_MB)
        return (a * x * x + b * x + c) * 8

    def price(self, gpu: str) -> float:
        return max(self.prices[gpu].values())   # the same in every zone Sailor lists


def cluster_of(sailor: Sailor, gpus: dict) -> Cluster:
    """Our cluster of a trace row {"<gpu>_<zone>": count}."""
    nodes, types = [], {}
    for key, n in gpus.items():
        gpu, zone = key.split("_")
        name, base = DEVICES[gpu]
        types[name] = {"base": base, "memory_gb": sailor.sizes[gpu]["mem_per_gpu"] / 1e9,
                       "price_per_hour": sailor.price(gpu)}
        nodes.append({"type": name, "devices_per_node": GPUS_PER_NODE, "count": n // GPUS_PER_NODE, "zone": zone})
    keys = [k.split("_") for k in gpus]
    zones = sorted({z for _, z in keys})
    first = {z: next(g for g, zz in keys if zz == z) for z in zones}
    z0, g0 = keys[0][1], keys[0][0]
    inter = sailor.gbps(z0, g0, z0, g0)
    cross = min([inter] + [sailor.gbps(z0, a, z0, b) for a, _ in keys for b, _ in keys if a != b])
    links = [{"zones": [a, b], "gbps": sailor.gbps(a, first[a], b, first[b]), "egress_usd_per_gb": sailor.egress[a][b]}
             for i, a in enumerate(zones) for b in zones[i + 1:]]
    return Cluster.from_dict({"name": "sailor-row", "inter_node_gbps": inter, "inter_type_gbps": cross,
                              "device_types": types, "nodes": nodes, "zone_links": links})


def sailor_plan(row: dict, cluster: Cluster, model: ModelSpec, setup: TrainSetup) -> Plan:
    """Sailor's chosen plan of ``row`` in our format on the nodes it uses (SpecError where it
    cannot be written)."""
    pipes = row["plan"]["pipelines"]
    if len(pipes) != 1:
        raise SpecError(f"{len(pipes)} pipelines")
    pipe, mbs = pipes[0], row["plan"]["mbs"]
    stages = []
    for j, reps in enumerate(pipe["tmp_stages"]):
        kinds = {(r[0][0][0], r[1]) for r in reps}
        if len(kinds) > 1:
            raise SpecError(f"stage {j} mixes {sorted(kinds)} (replicas of other types or tp)")
        stages.append((reps[0][0][0][0], reps[0][1], [r[0][0][2] for r in reps]))
    if len({len(z) for _, _, z in stages}) > 1:
        raise SpecError(f"stages of dp {[len(z) for _, _, z in stages]}")
    need: dict = {}
    for gpu, tp, zones in stages:
        for z in zones:
            need[DEVICES[gpu][0], z] = need.get((DEVICES[gpu][0], z), 0) + tp
    counts = []
    for g in cluster.nodes:
        devices = need.pop((g.type, g.zone), 0)
        if devices > g.count * g.devices_per_node:
            raise SpecError(f"it uses {devices} {g.type} in {g.zone}, the row has {g.count * g.devices_per_node}")
        counts.append(-(-devices // g.devices_per_node))
    sub = cluster.subset(counts)
    free: dict = {}
    for d in sub.devices:
        free.setdefault((d.type, sub.zone_of(d.rank)), []).append(d.rank)
    layers, start, out = [len(s) for s in pipe["layers_per_stage"]], 0, []
    for j, ((gpu, tp, zones), n) in enumerate(zip(stages, layers)):
        held = n - (j == 0) - (j == len(stages) - 1)   # Sailor's first and last layers: embedding, head
        ranks = [r for z in zones for r in [free[DEVICES[gpu][0], z].pop(0) for _ in range(tp)]]
        out.append(StagePlan(ranks, DEVICES[gpu][0], tp, len(zones), (start, start + held)))
        start += held
    micro = mbs * len(stages[0][2])
    gbs = -(-GBS // micro) * micro   # Sailor runs ceil(gbs / (mbs x dp)) micro-batches
    plan = Plan(model, sub, gbs, [PipelinePlan(micro, gbs, out)], training=setup).validate()
    return plan


def sailor_format(plan: Plan) -> dict:
    """``plan`` as Sailor's planner writes a plan (``pipeline_list`` of one pipeline,
    ``tmp_per_stage`` [[[gpu, tp, zone]], tp] per dp replica, layer 0 the embedding and
    L + 1 the last layer; ``mbs`` per replica), for Sailor's simulator; SpecError where
    its format cannot hold it (Sailor runs one mbs and micro-batch count for all)."""
    if len(plan.pipelines) != 1:
        raise SpecError(f"{len(plan.pipelines)} pipelines (Sailor's simulator runs one mbs and batch share for all)")
    pipe = plan.pipelines[0]
    if len({s.dp for s in pipe.stages}) != 1 or any(s.ops for s in pipe.stages):
        raise SpecError("stages of different dp or cut inside layers")
    names = {ours: gpu for gpu, (ours, _) in DEVICES.items()}
    last = plan.model.num_layers + 1
    stages, layers = [], []
    for j, st in enumerate(pipe.stages):
        reps = [st.replica(d) for d in range(st.dp)]
        stages.append([[[[names[st.device_type], st.tp, plan.cluster.zone_of(r[0])]], st.tp] for r in reps])
        layers.append(([0] if j == 0 else []) + list(range(st.layers[0] + 1, st.layers[1] + 1))
                      + ([last] if j == len(pipe.stages) - 1 else []))
    used: dict = {}
    for d in plan.cluster.devices:
        used[names[d.type]] = used.get(names[d.type], 0) + 1
    return {"pipeline_list": [{"num_stages": len(stages), "layers_per_stage": layers, "tmp_per_stage": stages,
                               "dp": [pipe.stages[0].dp] * len(stages)}],
            "mbs": pipe.mbs // pipe.stages[0].dp, "used_gpus": used}


def run_row(name: str, index: int, row: dict, sailor: Sailor, model, setup, db, jobs: int) -> dict:
    objective, min_its, max_usd = SCENARIOS[name]
    cluster = cluster_of(sailor, row["num_gpus"])
    out = {"scenario": name, "row": index, "available": row["num_gpus"],
           "sailor": {"gpus": row["used_gpus_plan"], "sim_it_s": row["throughput"],
                      "sim_usd_per_it": row["cost_per_iteration"], "planner_it_s": row["estimated_throughput"],
                      "planner_usd_per_it": row["estimated_cost"][0], "search_s": row["search_time"]}}
    try:
        theirs = sailor_plan(row, cluster, model, setup)
        CostModel(model, theirs.cluster, db, setup, p2p_blocking=True).annotate(theirs)
        rates = plan_rates(theirs)
        out["sailor"] |= {"ours_it_s": 1e3 / theirs.predicted["iteration_ms"],
                          "ours_usd_per_it": rates["cost_per_hour"] * theirs.predicted["iteration_ms"] / 3.6e6}
    except SpecError as exc:
        out["sailor"]["not_written"] = str(exc)
    start = time.perf_counter()
    options = SearchOptions(gbs=GBS, setup=setup, jobs=jobs, progress=False)
    try:
        plan, _ = choose_fleet(model, cluster, db, options, FleetOptions(objective, min_throughput=min_its * GBS))
    except InfeasibleError as exc:
        out["ours"] = {"error": str(exc)}
        return out
    rates = plan_rates(plan)
    out["ours"] = {"gpus": {k: v for k, v in plan.search["fleet"]["used"].items() if v},
                   "it_s": 1e3 / plan.predicted["iteration_ms"],
                   "usd_per_it": rates["cost_per_hour"] * plan.predicted["iteration_ms"] / 3.6e6,
                   "search_s": time.perf_counter() - start, "pipelines": len(plan.pipelines)}
    try:
        out["ours"]["sailor_plan"] = sailor_format(plan)
    except SpecError as exc:
        out["ours"]["sailor_plan_not_written"] = str(exc)
    if max_usd:
        out["ours"]["within_budget"] = out["ours"]["usd_per_it"] <= max_usd
    return out


def markdown(rows: list[dict], header: str) -> str:
    def gpus(d):
        return ", ".join(f"{n} {k}" for k, n in d.items() if n)

    def num(d, key, fmt=".3f"):
        return format(d[key], fmt) if key in d else "-"

    lines = [header, "",
             "| scenario, row | Sailor's GPUs | ours | it/s: Sailor's plan (ours / Sailor's sim), ours "
             "| USD/it: Sailor's plan (ours / Sailor's sim), ours | search s: Sailor, ours |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        s, o = r["sailor"], r["ours"]
        if "error" in o:
            lines.append(f"| {r['scenario']} {r['row']} | {gpus(s['gpus'])} | {o['error']} | | | |")
            continue
        note = f" (not written: {s['not_written']})" if "not_written" in s else ""
        lines.append(f"| {r['scenario']} {r['row']} | {gpus(s['gpus'])}{note} | {gpus(o['gpus'])} | "
                     f"{num(s, 'ours_it_s')} / {s['sim_it_s']:.3f}, **{o['it_s']:.3f}** | "
                     f"{num(s, 'ours_usd_per_it', '.4f')} / {s['sim_usd_per_it']:.4f}, **{o['usd_per_it']:.4f}** | "
                     f"{s['search_s']:.2f}, {o['search_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sailor", required=True, type=Path, help="a checkout of eth-easl/sailor")
    ap.add_argument("--results", nargs="+", required=True, metavar="SCENARIO=DIR",
                    help=f"Sailor's results folder (holding SAILOR_OPT-350.json) per scenario: {', '.join(SCENARIOS)}")
    ap.add_argument("--jobs", type=int, default=1)
    add_output_args(ap, "sailor_fleet.json and sailor_fleet.md")
    args = ap.parse_args(argv)
    data = load_data()
    entry = data["models"]["OPT-350"]
    model = ModelSpec.from_dict(entry["spec"])
    setup = TrainSetup(**data["training"])
    sailor = Sailor(args.sailor)
    db = ProfileDB({name: profile(args.sailor, "sailor", gpu,
                                  replace(catalog()[base], name=name,
                                          memory_gb=sailor.sizes[gpu]["mem_per_gpu"] / 1e9), entry, model)
                    for gpu, (name, base) in DEVICES.items()})
    rows = []
    for item in args.results:
        name, _, folder = item.partition("=")
        if name not in SCENARIOS:
            raise SystemExit(f"--results {item}: the scenario is one of {', '.join(SCENARIOS)}")
        found = json.loads((Path(folder) / "SAILOR_OPT-350.json").read_text())
        for index, row in enumerate(found):
            rows.append(run_row(name, index, row, sailor, model, setup, db, args.jobs))
            print(markdown(rows[-1:], "").strip().splitlines()[-1], flush=True)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    header = (f"    {when}  python bench/sailor_fleet.py --sailor CHECKOUT --results ...  # commit {commit()}, "
              f"load {loadavg()}, jobs {args.jobs}")
    write_results(args, "sailor_fleet", rows, header, markdown,
                  "(`python bench/sailor_fleet.py --sailor CHECKOUT --results ...`; the run's date, commit and "
                  "load: bench/results/sailor_fleet.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
