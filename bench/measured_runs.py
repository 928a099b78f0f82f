"""Predictions against published measurements of real GPU runs (Sailor, SOSP'25).

Sailor (github eth-easl/sailor) publishes, with each plan it trained, the measured
iteration time, peak memory and gradient-reduction time
(``sailor/Planner/simulations/validation/{clariden,mit}/**/plan_config_*.json``), and
the op profiles of those GPUs in Aceso's CSV format
(``sailor/Planner/baselines/Aceso/profiler/<GPU>/profiled-data-fp32/``) with its
measured network bandwidths (``sailor/providers/network_coeffs_all_homo.json``).  This
bench writes each run in our formats and scores it as a new user would:

* model: the run's shapes as it trained (bench/data/measured_runs.yaml: OPT-350M and
  GPT-Neo 2.7B, fp32, no dropout, Adam, ZeRO 0, no recompute);
* profiles: the run's GPU CSVs through ``tools/make_profiles.py --import-aceso``'s
  importer (``eth.profiles.aceso``), the vocabulary scaled to the run's;
* cluster: one node per dp replica (Sailor's plans give each replica a node), the
  devices' memory from Sailor's ``basic_cluster_config.json``, the links from its
  measured coefficients: ``inter_node_gbps`` one GPU's stream between nodes,
  ``nic_gbps`` what a node's GPUs get together, intra-node the 2-GPU figure;
* plan: one pipeline, Sailor's stages (its layer 0 is the embedding, its last the
  final norm and head), tp and dp per stage, mbs x dp samples per micro-batch.

and prints, per run, the measured seconds per iteration against the cost model's
prediction (``CostModel.evaluate``, its gradient-blocks objective) and the event simulator (``eth.report.simulate``), and the
measured peak bytes against the cost model's largest stage memory, with per-row errors
((predicted - real) / real x 100), their median and max.  A run our plans cannot
express (a stage whose dp replicas are of different GPU types) is listed with why::

    python bench/measured_runs.py --sailor SAILOR_CHECKOUT --set clariden [--json FILE]
    python bench/measured_runs.py --sailor SAILOR_CHECKOUT --set mit
    python bench/measured_runs.py --sailor SAILOR_CHECKOUT --update-results   # every set, both sources

The per-type fixed memory (``overhead_gb`` of the device catalog) is fitted on the
Clariden set only (``--fit-overhead``); the mit set is data nothing was fitted to.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from eth.cost.model import CostModel  # noqa: E402
from eth.errors import SpecError  # noqa: E402
from eth.profiles.aceso import import_aceso  # noqa: E402
from eth.profiles.db import DeviceProfile, ProfileDB  # noqa: E402
from eth.profiles.sailor import import_sailor  # noqa: E402
from eth.report.simulate import simulate  # noqa: E402
from eth.spec.cluster import Cluster  # noqa: E402
from eth.spec.model import ModelSpec  # noqa: E402
from eth.spec.plan import PipelinePlan, Plan, StagePlan  # noqa: E402
from eth.spec.precision import TrainSetup  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from run_context import add_output_args, commit, loadavg, output_path  # noqa: E402

DATA = ROOT / "bench" / "data" / "measured_runs.yaml"
VALIDATION = "sailor/Planner/simulations/validation"
PROFILES = "sailor/Planner/baselines/Aceso/profiler/{gpu}/profiled-data-fp32"
LAYER_PROFILES = "sailor/Planner/simulations/profiles_tmp.json"
SOURCES = ("sailor", "aceso")
NETWORK = "sailor/providers/network_coeffs_all_homo.json"
NETWORK_HET = "sailor/providers/multizone_bandwidths_het.json"
ZONE = "us-central1-a"
CLUSTER_CONFIG = "sailor/Planner/simulations/configs/basic_cluster_config.json"
GBIT_PER_BYTE = 8 / 1e9


@dataclass
class Row:
    name: str
    real_s: float
    real_mem_gb: float
    predicted_s: float | None = None
    simulated_s: float | None = None
    predicted_mem_gb: float | None = None
    why: str = ""

    def err(self, predicted, real):
        return None if predicted is None else (predicted - real) / real * 100

    def to_dict(self) -> dict:
        return {"name": self.name, "real_s": self.real_s, "predicted_s": self.predicted_s,
                "simulated_s": self.simulated_s, "time_err_pct": self.err(self.predicted_s, self.real_s),
                "simulated_err_pct": self.err(self.simulated_s, self.real_s),
                "real_mem_gb": self.real_mem_gb, "predicted_mem_gb": self.predicted_mem_gb,
                "memory_err_pct": self.err(self.predicted_mem_gb, self.real_mem_gb), "why": self.why or None}


def load_data(path: Path = DATA) -> dict:
    return yaml.safe_load(path.read_text())


def run_files(sailor: Path, which: str) -> list[Path]:
    folder = sailor / VALIDATION / which
    if not folder.is_dir():
        raise SpecError(f"--sailor {sailor}: no {VALIDATION}/{which} (a checkout of eth-easl/sailor?)")
    return sorted(folder.rglob("plan_config_*.json"))


def model_of(data: dict, path: Path, which: str) -> tuple[dict, ModelSpec]:
    """(the model's entry in bench/data, our spec of it) of a run file: the folder names
    the model on clariden, the set names its one model on mit."""
    name = data["sets"][which].get("model") or path.parent.parent.name
    entry = data["models"][name]
    return entry, ModelSpec.from_dict(entry["spec"], where=f"{DATA.name} models.{name}.spec")


def links(sailor: Path, gpu: str) -> dict:
    """Sailor's measured bandwidths of ``gpu`` nodes (Gbit/s): one GPU's stream between
    nodes, what all of a node's GPUs get together, and between two GPUs of a node."""
    coeffs = json.loads((sailor / NETWORK).read_text())
    inter, intra = coeffs["inter"][gpu], coeffs["intra"][gpu]
    most = max(inter, key=int)
    return {"inter": inter["1"][1] * GBIT_PER_BYTE, "nic": inter[most][1] * GBIT_PER_BYTE,
            "intra": intra["2"][1] * GBIT_PER_BYTE}


def cross_gbps(sailor: Path, gpus) -> float:
    """The slowest of Sailor's measured one-stream bandwidths between two different GPU
    types among ``gpus`` (Gbit/s; ``multizone_bandwidths_het.json``), inf with one type."""
    kinds = sorted(set(gpus))
    if len(kinds) < 2:
        return float("inf")
    zone = json.loads((sailor / NETWORK_HET).read_text())[ZONE]
    return min(zone[a]["1"][ZONE][b]["1"][1] * GBIT_PER_BYTE for a in kinds for b in kinds if a != b)


def profile(sailor: Path, source: str, gpu: str, device, entry: dict, model: ModelSpec) -> DeviceProfile:
    """The profile of ``gpu`` for ``model`` from ``source``: "aceso", the GPU's op CSVs
    (``tools/make_profiles.py --import-aceso``), or "sailor", the layer times Sailor
    measured in the framework the runs trained in (``--import-sailor``)."""
    absent = tuple(entry.get("absent", ()))
    if source == "aceso":
        return DeviceProfile(import_aceso(sailor / PROFILES.format(gpu=gpu), device.name, model,
                                          aceso_model=entry["aceso"], absent=absent))
    return DeviceProfile(import_sailor(sailor / LAYER_PROFILES, entry["aceso"], gpu, device, model,
                                       absent=absent))


def build(sailor: Path, data: dict, path: Path, which: str, profiles: dict,
          overhead: bool = True, source: str = "aceso") -> tuple[Plan, ProfileDB]:
    """The run of ``path`` as our plan (and the profile database it is scored with);
    SpecError when our plans cannot express it.  ``overhead`` False: the device types
    without the catalog's fixed memory (``overhead_gb``), to fit it; ``source``: the
    profiles' (:func:`profile`)."""
    run = json.loads(path.read_text())
    if len(run["pipeline_list"]) != 1:
        raise SpecError(f"{len(run['pipeline_list'])} pipelines")
    pipe = run["pipeline_list"][0]
    entry, model = model_of(data, path, which)
    held = sum(len(x) for x in pipe["layers_per_stage"])
    if held != model.num_layers + 2:
        raise SpecError(f"its stages hold {held} of Sailor's layers, {model.name} has {model.num_layers + 2} "
                        f"(embedding, {model.num_layers} layers, last): another model's plan")
    sizes = json.loads((sailor / CLUSTER_CONFIG).read_text())
    num, dps = pipe["num_stages"], set(pipe["dp"])
    if len(dps) > 1:
        raise SpecError(f"stages of dp {pipe['dp']}: DeepSpeed's mbs is per replica")
    dp = dps.pop()
    # each dp replica of a stage is a node of one GPU type with its tp ranks on it
    replicas = [[(rep[0][0][0], rep[1]) for rep in pipe["tmp_per_stage"][j]] for j in range(num)]
    if any(len(r) != dp for r in replicas) or len({tp for r in replicas for _, tp in r}) > 1:
        raise SpecError(f"replicas {replicas} do not all have one tp, dp {dp} per stage")
    tp = replicas[0][0][1]
    sizes_of = [len(pipe["layers_per_stage"][j]) - (j == 0) - (j == num - 1) for j in range(num)]
    bounds = [sum(sizes_of[:j]) for j in range(num + 1)]
    nodes = [gpu for j in range(num) for gpu, _ in replicas[j]]       # rank order: stage, replica
    ranks = [[list(range((j * dp + d) * tp, (j * dp + d + 1) * tp)) for d in range(dp)] for j in range(num)]
    kind = {gpu: data["devices"][gpu]["type"] for gpu in nodes}
    if all(len({gpu for gpu, _ in r}) == 1 for r in replicas):
        # one pipeline: stage j on its dp replicas, mbs x dp samples per micro-batch
        pipelines = [PipelinePlan(run["mbs"] * dp, run["gbs"], [
            StagePlan([r for rep in ranks[j] for r in rep], kind[replicas[j][0][0]], tp, dp,
                      (bounds[j], bounds[j + 1])) for j in range(num)])]
    else:
        # a stage whose replicas are of different types: with one dp for all stages,
        # replica d of every stage forms a pipeline of its own (DeepSpeed sends replica d's
        # activations to replica d of the next stage), its share gbs / dp
        pipelines = [PipelinePlan(run["mbs"], run["gbs"] // dp, [
            StagePlan(ranks[j][d], kind[replicas[j][d][0]], tp, 1, (bounds[j], bounds[j + 1]))
            for j in range(num)]) for d in range(dp)]
    if run["gbs"] % (run["mbs"] * dp):
        raise SpecError(f"gbs {run['gbs']} is not a multiple of mbs {run['mbs']} x dp {dp}")
    types, groups = {}, []
    for gpu in nodes:
        name, bw = kind[gpu], links(sailor, gpu)
        types[name] = {"base": name, "memory_gb": sizes[gpu]["mem_per_gpu"] / 1e9, "link_gbps": bw["intra"]}
        if not overhead:
            types[name]["overhead_gb"] = 0.0
        if groups and groups[-1]["type"] == name:
            groups[-1]["count"] += 1
        else:
            groups.append({"type": name, "devices_per_node": tp, "count": 1, "nic_gbps": bw["nic"]})
    inter = [links(sailor, gpu)["inter"] for gpu in set(nodes)]
    cluster = Cluster.from_dict({"name": path.stem, "inter_node_gbps": min(inter), "device_types": types,
                                 "nodes": groups, "inter_type_gbps": min(inter + [cross_gbps(sailor, nodes)])})
    plan = Plan(model, cluster, run["gbs"], pipelines, training=TrainSetup(**data["training"]))
    plan.validate()
    db = {}
    for gpu in set(nodes):
        name, key = data["devices"][gpu]["type"], (source, gpu, entry["aceso"], model)
        if key not in profiles:
            profiles[key] = profile(sailor, source, gpu, cluster.types[name], entry, model)
        db[name] = profiles[key]
    return plan, ProfileDB(db)


def score(sailor: Path, which: str, data: dict | None = None, overhead: bool = True,
          source: str = "sailor") -> list[Row]:
    """Every run of the set, written in our formats and scored (module docstring)."""
    data = data or load_data()
    rows, profiles = [], {}
    for path in run_files(sailor, which):
        run = json.loads(path.read_text())
        name = str(path.relative_to(sailor / VALIDATION).with_suffix(""))
        row = Row(name, run["real"], run["max_mem"] / 1e9)
        try:
            plan, db = build(sailor, data, path, which, profiles, overhead, source)
        except SpecError as exc:
            row.why = str(exc)
            rows.append(row)
            continue
        cm = CostModel(plan.model, plan.cluster, db, plan.training, p2p_blocking=data["p2p_blocking"])
        ev = cm.evaluate(plan)
        row.predicted_s = ev["iteration_ms"] / 1e3
        row.simulated_s = simulate(plan, cm).iteration_ms / 1e3
        row.predicted_mem_gb = max(c.memory_bytes for p in ev["pipelines"] for c in p["costs"]) / 1e9
        rows.append(row)
    return rows


def fit_overhead(rows: list[Row]) -> float:
    """The fixed memory per device that centres the rows' errors: the median of measured
    minus predicted peak (GB) over the rows scored without any (``score(overhead=False)``)."""
    gaps = [r.real_mem_gb - r.predicted_mem_gb for r in rows if not r.why]
    return statistics.median(gaps)


def summary(values) -> str:
    values = [abs(v) for v in values if v is not None]
    if not values:
        return "n/a"
    return f"|error| median {statistics.median(values):.1f} %, max {max(values):.1f} %"


def _pct(value) -> str:
    return "" if value is None else f"{value:+.1f}"


def report(rows: list[Row], which: str, source: str) -> str:
    """A markdown table of ``rows`` and their error summary."""
    lines = [f"### {which}, {source} profiles", "",
             "| run | real s | predicted s | err % | simulated s | err % | real GB | predicted GB | err % |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = r.to_dict()
        if r.why:
            lines.append(f"| {r.name} | {r.real_s:.3f} | not expressible: {r.why} | | | | {r.real_mem_gb:.2f} | | |")
            continue
        lines.append(f"| {r.name} | {r.real_s:.3f} | {r.predicted_s:.3f} | {_pct(d['time_err_pct'])} | "
                     f"{r.simulated_s:.3f} | {_pct(d['simulated_err_pct'])} | {r.real_mem_gb:.2f} | "
                     f"{r.predicted_mem_gb:.2f} | {_pct(d['memory_err_pct'])} |")
    ds = [r.to_dict() for r in rows]
    lines += ["", f"{sum(1 for r in rows if not r.why)} of {len(rows)} runs scored; "
                  f"time, predicted: {summary(d['time_err_pct'] for d in ds)}; "
                  f"time, simulator: {summary(d['simulated_err_pct'] for d in ds)}; "
                  f"peak memory: {summary(d['memory_err_pct'] for d in ds)}"]
    return "\n".join(lines)


def write_results(args, data: dict) -> None:
    """Every set of bench/data under both profile sources: measured_runs.md (the tables)
    and measured_runs.json (the rows) where ``--out`` / ``--update-results`` say."""
    md = output_path(args, "measured_runs.md")
    md.parent.mkdir(parents=True, exist_ok=True)
    parts = ["# Sailor's published runs against our predictions (bench/measured_runs.py)", "",
             "command: `python bench/measured_runs.py --sailor <eth-easl/sailor checkout> --update-results`  ",
             f"commit: {commit()}  ", f"load average: {loadavg()}  ",
             "fitted: GH200 `overhead_gb` on the clariden set (`--fit-overhead`); nothing on mit", ""]
    out = {"code": commit(), "sets": {}}
    for which in data["sets"]:
        for source in SOURCES:
            rows = score(args.sailor, which, data, source=source)
            parts += [report(rows, which, source), ""]
            out["sets"][f"{which}/{source}"] = [r.to_dict() for r in rows]
    md.write_text("\n".join(parts))
    md.with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {md} and {md.with_suffix('.json')}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sailor", type=Path, required=True, help="a checkout of github eth-easl/sailor")
    ap.add_argument("--set", default="clariden", dest="which",
                    help="the validation set: clariden (GH200 nodes; the one fitted to) or mit (RTX nodes)")
    ap.add_argument("--data", type=Path, default=DATA, help=f"the runs' facts (default: {DATA.relative_to(ROOT)})")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON")
    ap.add_argument("--profiles", choices=SOURCES, default="sailor",
                    help="sailor: Sailor's layer times measured in the runs' framework (default); aceso: the "
                         "GPUs' op CSVs in Aceso's format")
    add_output_args(ap, "measured_runs.md and .json (every set, both profile sources)")
    ap.add_argument("--fit-overhead", action="store_true",
                    help="score without the catalog's fixed memory per device and print the value that "
                         "centres the memory errors (fit it on the clariden set only)")
    args = ap.parse_args(argv)
    try:
        data = load_data(args.data)
        if args.which not in data["sets"]:
            raise SpecError(f"--set {args.which!r} is not one of {', '.join(data['sets'])} ({args.data.name})")
        if args.fit_overhead:
            rows = score(args.sailor, args.which, data, overhead=False, source=args.profiles)
            gaps = sorted(round(r.real_mem_gb - r.predicted_mem_gb, 2) for r in rows if not r.why)
            print(f"measured - predicted peak without a fixed overhead, GB: {gaps}")
            print(f"overhead_gb (median): {fit_overhead(rows):.2f}")
            return 0
        if args.out or args.update_results:
            write_results(args, data)
            return 0
        rows = score(args.sailor, args.which, data, source=args.profiles)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"code {commit()}, load average {loadavg()}")
    print(report(rows, args.which, args.profiles))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"set": args.which, "profiles": args.profiles, "code": commit(),
                                         "rows": [r.to_dict() for r in rows]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
