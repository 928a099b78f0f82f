#!/usr/bin/env python
"""Paper evaluation (sections 7.2, 7.4, 7.5): HPP against its baselines in one cost model.

For the paper's Table 2 models and cluster scales (examples/clusters/<pair>-<n>.yaml
from examples/make_clusters.py; pairs b2b3, b2b4, b3b4, a100-3090) and for the
section 7.4 sweeps of GPT-3 13B on 910B2/910B4 (devices 16..128, global batch
4..4096, sequence length 32..8192), and for mixed fleets of 3, 4 and 6 device types
(examples/clusters/mixed3-48, mixed4-64, mixed6-48.yaml; GPT-3 1.3B and 13B, LLaMA-2 7B;
the many_types table), every strategy -- hpp (eth.planner.search, with its
seeds; which seed won, if one did, is the seed_won column), hpp-noseeds (the same search
without seeds), uniform, metis and hexiscale (as published), metis-strong and
hexiscale-strong (on HPP's balancer, Mbs search and recompute), typesplit
(eth.planner.baselines) -- plans the iteration
from the same profiles (the shipped analytic ones in profiles/, extended by
ProfileDB.ensure for other sequence lengths) and the same CostModel; each plan is then
played by the event simulator (eth.report.simulate).  Written to out/bench/ (--out DIR;
--update-results: over the tracked bench/results/):

    table2.csv, many_types.csv,
    sweep_devices.csv, sweep_gbs.csv, sweep_seq.csv               one row per (case, strategy)
    paper_eval.md                                                 tables built from the CSVs
    plans/*.json        every strategy's plan for GPT-3 13B on b2b4-64 and the paper's Table 3 plans
    sweep_devices.png, sweep_gbs.png, sweep_seq.png               one plot per sweep
    sensitivity.csv     GPT-3 13B on b2b4-64: every strategy under other training setups
                        (ZeRO 1/2, bf16 gradients), activation bytes x0.5 / x2, the slow
                        type's speed x0.5 / x1.5 (--only sensitivity)

Columns: pred_ms = the cost model's objective (CostModel.evaluate: gradient blocks, Eq. 6,
the optimizer step), sim_ms = simulated iteration, search_s = planner wall time,
ideal_ms = training FLOPs of the iteration / sum over devices of peak x
eth.profiles.db.GEMM_EFFICIENCY, where the FLOPs are the sum over all ops of
eth.spec.model.op_shapes (forward + backward = 3 x forward, no recompute) x gbs;
efficiency = ideal_ms / sim_ms.  A strategy that finds no plan that fits is
"infeasible" (the paper's OOM).

    python bench/paper_eval.py --quick              # subset, ~1-2 minutes -> out/bench/quick/
    python bench/paper_eval.py --quick --update-results   # the same, over bench/results/quick/
    python bench/paper_eval.py --time-limit 60      # everything (many minutes)
    python bench/paper_eval.py --only table2 --models gpt3-13b --pairs b2b4
    python bench/paper_eval.py --only sensitivity
    python bench/paper_eval.py --only many_types   # 3, 4 and 6 device types (not in --quick)
    python bench/paper_eval.py --only many_types --strategies hpp-noseeds --patience 0 --out DIR
                                                    # the same without the patience stop
    python bench/paper_eval.py --report-only        # rebuild md + PNG from the CSVs
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import MappingProxyType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from paper_eval_results import HPPS, STRATEGIES, SWEEPS, Row, read_csv, write_csv, write_report  # noqa: E402
from run_context import add_output_args, output_path  # noqa: E402
SWEEP_VALUES = MappingProxyType({"devices": (16, 32, 48, 64, 96, 128),
                                 "gbs": (4, 16, 64, 256, 1024, 4096),
                                 "seq": (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)})
QUICK_SWEEPS = MappingProxyType({"devices": (16, 32), "gbs": (4, 64, 1024), "seq": (512, 8192)})
SWEEP_BASE = MappingProxyType({"devices": 64, "gbs": 1024, "seq": 2048})
MANY_TYPE_MIXES = ("mixed3-48", "mixed4-64", "mixed6-48")
"""examples/make_clusters.py MIXES of the many-type table: 3, 4 and 6 device types."""
MANY_TYPE_MODELS = ("gpt3-1.3b", "gpt3-13b", "llama2-7b")


# Paper appendix A, Table 3 (GPT-3 13B on 4x8 910B2 + 4x8 910B4, gbs 1024): the plans the
# paper reports for each system.  Per pipeline (mbs, lbs, stages); per stage (device
# type, devices, tp, layers, {recomputed op: layers}); dp = devices / tp.  They are
# re-evaluated in this repository's cost model and simulator (section "table3").
TABLE3_PLANS = MappingProxyType({
    "metis": [(4, 1024, [("910B2", 8, 2, 5, {}), ("910B2", 8, 2, 6, {}), ("910B2", 8, 4, 7, {}),
                         ("910B2", 8, 2, 6, {}), ("910B4", 8, 8, 3, {}), ("910B4", 8, 8, 4, {}),
                         ("910B4", 8, 4, 4, {}), ("910B4", 8, 4, 5, {})])],
    "hexiscale": [(4, 512, [("910B4", 4, 4, 3, {}), ("910B4", 4, 4, 3, {}), ("910B4", 4, 4, 3, {}),
                            ("910B4", 4, 4, 4, {}), ("910B2", 4, 4, 5, {}), ("910B2", 4, 4, 7, {}),
                            ("910B2", 4, 4, 7, {}), ("910B2", 4, 4, 8, {})])] * 2,
    "hpp": [(4, 344, [("910B4", 4, 4, 4, {"qkv": 4, "score": 4, "softmax": 4, "attn-dropout": 4}),
                      ("910B4", 4, 4, 4, {"softmax": 4, "attn-dropout": 4}),
                      ("910B4", 4, 4, 5, {"softmax": 4, "attn-dropout": 4}),
                      ("910B4", 4, 2, 5, {}), ("910B4", 4, 2, 5, {}), ("910B4", 4, 2, 5, {}),
                      ("910B4", 4, 1, 6, {}), ("910B4", 4, 1, 6, {})]),
            (8, 680, [("910B2", 8, 8, 8, {"softmax": 6, "attn-dropout": 6}),
                      ("910B2", 8, 8, 9, {"softmax": 4, "attn-dropout": 4}),
                      ("910B2", 8, 4, 11, {}), ("910B2", 8, 4, 12, {})])],
})


def table3_plan(strategy: str, model, cluster, setup):
    """The paper's Table 3 plan of ``strategy`` on ``cluster`` (ranks in cluster order per type),
    trained as ``setup`` (the plan file records the setup its prediction assumed)."""
    from eth.spec.plan import PipelinePlan, Plan, StagePlan
    free: dict[str, list[int]] = {}
    for d in cluster.devices:
        free.setdefault(d.type, []).append(d.rank)
    pipes = []
    for mbs, lbs, stages in TABLE3_PLANS[strategy]:
        out, start = [], 0
        for t, n, tp, layers, rec in stages:
            ranks, free[t] = free[t][:n], free[t][n:]
            out.append(StagePlan(ranks, t, tp, n // tp, (start, start + layers), dict(rec)))
            start += layers
        pipes.append(PipelinePlan(mbs, lbs, out))
    return Plan(model, cluster, 1024, pipes, training=setup).validate()


@dataclass(frozen=True)
class Variant:
    """One variation of the sensitivity problem: a training setup, activation bytes and the
    slow type's speed (op times / speed and its catalogue TFLOPS x speed)."""

    name: str
    zero_stage: int = 0
    grad_reduce: str = "fp32"
    act_scale: float = 1.0
    """Every op's saved activation and input bytes x this, on every device type."""
    slow_speed: float = 1.0
    """The slower device type (lower TFLOPS) runs this many times as fast."""

    @property
    def setup(self):
        from eth.spec.precision import TrainSetup
        return TrainSetup("bf16", self.zero_stage, self.grad_reduce)

    def apply(self, model, cluster, db):
        """(cluster, profiles) of this variant; the inputs are not changed."""
        from eth.spec.cluster import Cluster
        from eth.profiles.db import SHAPE_DEFAULTS, SHAPE_FIELDS, DeviceProfile, ProfileDB, shape_key
        if self.act_scale == 1.0 and self.slow_speed == 1.0:
            return cluster, db
        slow = min(cluster.types, key=lambda t: cluster.types[t].tflops)
        if self.slow_speed != 1.0:
            data = cluster.to_dict()
            data.setdefault("device_types", {}).setdefault(slow, {})["tflops"] = (
                cluster.types[slow].tflops * self.slow_speed)
            cluster = Cluster.from_dict(data)
        out = ProfileDB(dict(db.profiles))
        for t in cluster.types:
            base = db.get(t).data
            speed = self.slow_speed if t == slow else 1.0
            models = []
            for m in base["models"]:
                if tuple(m["shape"].get(f, SHAPE_DEFAULTS.get(f)) for f in SHAPE_FIELDS) != shape_key(model):
                    continue
                entries = [dict(e, ops={op: [v[0] / speed, v[1] / speed, v[2], v[3] * self.act_scale,
                                             v[4] * self.act_scale, v[5]] for op, v in e["ops"].items()})
                           for e in m["entries"]]
                models.append(dict(m, entries=entries))
            out.add(DeviceProfile(dict(base, models=models), where=f"{t} ({self.name})"))
        return cluster, out


SENSITIVITY = (
    Variant("default (bf16, fp32 grads, ZeRO 0)"),
    Variant("ZeRO 1", zero_stage=1),
    Variant("ZeRO 2", zero_stage=2),
    Variant("bf16 gradients", grad_reduce="bf16"),
    Variant("activations x0.5", act_scale=0.5),
    Variant("activations x2", act_scale=2.0),
    Variant("910B4 speed x0.5", slow_speed=0.5),
    Variant("910B4 speed x1.5", slow_speed=1.5),
)
"""The sensitivity table's variations of GPT-3 13B on b2b4-64 (gbs 1024, seq 2048).  GEMM
efficiency is not varied: eth/profiles/gemm_efficiency.py has a fitted size-dependent curve only
for the CPU; 910B2/910B4 keep one constant factor, and scaling it scales both types alike
(= x speed on both)."""
SENSITIVITY_CASE = ("gpt3-13b", "b2b4", 64, 1024, 2048)

TABLE3_CASE = ("gpt3-13b", "b2b4", 64, 1024, 2048)
"""(model, pair, devices, gbs, seq) of the paper's Table 3; our plans for it are saved too."""


def run_table3(mc, cache: ProfileCache, save_dir: Path | None = None) -> list[Row]:
    """Rows for the paper's Table 3 plans: status "infeasible" = over memory in our model."""
    from eth.cost.model import CostModel
    from eth.spec.model import get_model
    from eth.report.simulate import simulate
    case = Case("table3", "gpt3-13b", "b2b4", 64, 1024, 2048)
    model, cluster = get_model(case.model), cluster_for(case, mc)
    cost = CostModel(model, cluster, cache.for_problem(model, cluster))
    rows = []
    for strategy in TABLE3_PLANS:
        plan = table3_plan(strategy, model, cluster, cost.setup)
        ev = cost.evaluate(plan)
        if save_dir is not None:
            cost.annotate(plan)
            plan.search = {"strategy": f"paper Table 3 {strategy}"}
            save_dir.mkdir(parents=True, exist_ok=True)
            plan.save(save_dir / f"paper-table3-{strategy}.json")
        worst = max(c.memory_bytes / c.capacity_bytes for p in ev["pipelines"] for c in p["costs"])
        sim = simulate(plan, cost).iteration_ms
        ideal = ideal_ms(model, cluster, case.gbs)
        rows.append(Row(**asdict(case), strategy=strategy, status="ok" if ev["feasible"] else "infeasible",
                        pred_ms=ev["iteration_ms"], sim_ms=sim, search_s=0.0, pipelines=len(plan.pipelines),
                        stages="+".join(str(len(p.stages)) for p in plan.pipelines), ideal_ms=ideal,
                        efficiency=ideal / sim,
                        note=f"paper Table 3 plan; peak memory {worst:.2f} x capacity in our model"))
    return rows


@dataclass(frozen=True)
class Case:
    """One planning problem."""

    table: str
    """"table2" or "sweep_<name>"."""
    model: str
    pair: str
    devices: int
    gbs: int
    seq: int


class ProfileCache:
    """The shipped profiles, loaded once per process; missing shapes added analytically."""

    def __init__(self, path: Path):
        from eth.profiles.db import ProfileDB
        self.db = ProfileDB.load(path)
        self.added: set[str] = set()

    def for_problem(self, model, cluster):
        for name in self.db.ensure(model, cluster.types.values()):
            self.added.add(f"{name}/{model.name}/seq{model.seq_len}")
        return self.db


def make_clusters_module():
    """examples/make_clusters.py (PAIRS, SCALES, cluster()): the Table 2 scales' one source."""
    spec = importlib.util.spec_from_file_location("make_clusters", ROOT / "examples" / "make_clusters.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cluster_for(case: Case, mc):
    from eth.spec.cluster import Cluster, load_cluster
    path = ROOT / "examples" / "clusters" / f"{case.pair}-{case.devices}.yaml"
    if path.exists():
        return load_cluster(path)
    per_node = 8
    nodes = case.devices // (2 * per_node)
    return Cluster.from_dict(mc.cluster(case.pair, nodes, per_node))


def ideal_ms(model, cluster, gbs: int) -> float:
    """Training FLOPs of one iteration / aggregate analytic GEMM throughput (see module doc)."""
    from eth.spec.model import layer_ops, op_shapes, post_ops, pre_ops
    from eth.profiles.db import GEMM_EFFICIENCY
    ops = op_shapes(model, 1, 1)
    per_sample = sum(ops[o].flops_fwd + ops[o].flops_bwd for o in layer_ops(model)) * model.num_layers
    per_sample += sum(ops[o].flops_fwd + ops[o].flops_bwd for o in pre_ops(model) + post_ops(model))
    rate = sum(cluster.type_of(d.rank).tflops for d in cluster.devices) * 1e12 * GEMM_EFFICIENCY
    return per_sample * gbs / rate * 1e3


def run_case(case: Case, mc, cache: ProfileCache, time_limit: float, strategies,
             save_dir: Path | None = None, variant=None, patience: int | None = None) -> list[Row]:
    """Every strategy on one problem; ``variant`` (a :class:`Variant`) changes the training
    setup, the profiles or the cluster (the sensitivity table); ``patience``: the HPP
    searches' ``SearchOptions.patience`` (None: its default)."""
    from eth.cost.model import CostModel
    from eth.errors import InfeasibleError, SpecError
    from eth.spec.model import get_model
    from eth.planner.baselines import BaselineOptions, plan_baseline
    from eth.planner.options import SearchOptions
    from eth.planner.search import search
    from eth.spec.precision import TrainSetup
    from eth.report.simulate import simulate

    model = get_model(case.model, seq_len=case.seq)
    cluster = cluster_for(case, mc)
    db = cache.for_problem(model, cluster)
    setup = TrainSetup()
    if variant is not None:
        cluster, db = variant.apply(model, cluster, db)
        setup = variant.setup
    cost = CostModel(model, cluster, db, setup)
    ideal = ideal_ms(model, cluster, case.gbs)
    rows = []
    for strategy in strategies:
        row = Row(**asdict(case), strategy=strategy, ideal_ms=ideal,
                  variant=variant.name if variant is not None else "")
        start = time.perf_counter()
        try:
            if strategy in HPPS:
                extra = {"patience": patience} if patience is not None else {}
                plan = search(model, cluster, db, SearchOptions(gbs=case.gbs, time_limit=time_limit, setup=setup,
                                                                seeds=strategy == "hpp", **extra))
            else:
                plan = plan_baseline(strategy, model, cluster, db, case.gbs,
                                     BaselineOptions(time_limit=time_limit, setup=setup))
        except InfeasibleError as exc:
            row.status, row.note = "infeasible", str(exc)[:160]
        except SpecError as exc:
            row.status, row.note = "error", str(exc)[:160]
        row.search_s = time.perf_counter() - start
        if row.status == "ok":
            row.pred_ms = plan.predicted["iteration_ms"]
            row.time_limited = bool(plan.search.get("time_limited"))
            row.pipelines = len(plan.pipelines)
            row.stages = "+".join(str(len(p.stages)) for p in plan.pipelines)
            row.sim_ms = simulate(plan, cost).iteration_ms
            row.efficiency = ideal / row.sim_ms
            if strategy == "hpp":
                row.seed_won = plan.search.get("seed_won") or "none"
            mixed = plan.search.get("mixed_type_best")
            if mixed:
                row.note = (f"a mixed-type stage layout is predicted {mixed['iteration_ms'] / 1e3:.2f} s; "
                            f"times are of the best single-type plan")
            if save_dir is not None:
                save_dir.mkdir(parents=True, exist_ok=True)
                plan.save(save_dir / f"{case.model}-{case.pair}-{case.devices}-{strategy}.json")
        rows.append(row)
    return rows


def cases_for(args, mc) -> dict[str, list[Case]]:
    out: dict[str, list[Case]] = {}
    if args.only in (None, "table2"):
        models = args.models or (["gpt3-350m", "gpt3-1.3b"] if args.quick else list(mc.SCALES))
        pairs = args.pairs or (["b2b4", "a100-3090"] if args.quick else list(mc.PAIRS))
        out["table2"] = [Case("table2", m, p, 2 * mc.SCALES[m][0] * mc.SCALES[m][1], args.gbs, 2048)
                         for m in models for p in pairs]
    if args.only == "many_types" or (args.only is None and not args.quick):
        models = args.models or (["gpt3-1.3b"] if args.quick else list(MANY_TYPE_MODELS))
        mixes = [m for m in (args.pairs or MANY_TYPE_MIXES) if m in mc.MIXES]
        out["many_types"] = [Case("many_types", m, mix.split("-")[0], sum(mc.MIXES[mix].values()), args.gbs, 2048)
                             for m in models for mix in mixes]
    if args.only in (None, "sweeps"):
        for sweep in SWEEPS:
            values = (QUICK_SWEEPS if args.quick else SWEEP_VALUES)[sweep]
            base = dict(SWEEP_BASE)
            if args.quick:
                base["devices"] = 16
            cases = []
            for v in values:
                spec = dict(base, **{sweep: v})
                cases.append(Case(f"sweep_{sweep}", "gpt3-13b", "b2b4", spec["devices"], spec["gbs"],
                                  spec["seq"]))
            out[f"sweep_{sweep}"] = cases
    return out


# ------------------------------------------------------------------------------ main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a subset (about a minute on an idle machine)")
    p.add_argument("--only", choices=("table2", "table3", "sweeps", "sensitivity", "many_types"), help="run only this part")
    p.add_argument("--models", nargs="+", help="Table 2 models (default: all, quick: 350m, 1.3b)")
    p.add_argument("--pairs", nargs="+", help="device pairs (default: all, quick: b2b4, a100-3090); "
                   "for many_types the mixes (default: " + ", ".join(MANY_TYPE_MIXES) + ")")
    p.add_argument("--sweeps", nargs="+", choices=SWEEPS, help="which sweeps (default: all)")
    p.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    p.add_argument("--gbs", type=int, default=1024, help="global batch of the Table 2 runs")
    p.add_argument("--time-limit", type=float, help="seconds per search, 0 = none (default 60, quick: 10)")
    p.add_argument("--patience", type=int, help="SearchOptions.patience of the hpp searches (default: the "
                   "planner's; 0 = every device group); with --out elsewhere, not to mix it into the results")
    add_output_args(p, "the tables, plans and report (quick: .../quick)")
    p.add_argument("--report-only", action="store_true", help="rebuild md + PNG from existing CSVs")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.patience is not None and args.patience < 0:
        print(f"paper_eval: --patience must be >= 0 (0: every device group), got {args.patience}", file=sys.stderr)
        return 2
    if args.time_limit is None:
        args.time_limit = 10.0 if args.quick else 60.0
    sys.path.insert(0, str(ROOT))
    out = output_path(args, "quick" if args.quick else "")
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python bench/paper_eval.py"] + list(argv if argv is not None else sys.argv[1:]))
    if not args.report_only:
        from tqdm import tqdm
        mc = make_clusters_module()
        cache = ProfileCache(ROOT / "profiles")
        groups = cases_for(args, mc)
        if args.sweeps:
            groups = {k: v for k, v in groups.items() if not k.startswith("sweep_")
                      or k.removeprefix("sweep_") in args.sweeps}
        if args.only in (None, "table3"):
            write_csv(out / "table3.csv", run_table3(mc, cache, out / "plans"))
        if args.only in (None, "sensitivity") and not args.quick:
            case = Case("sensitivity", *SENSITIVITY_CASE)
            rows = []
            for v in tqdm(SENSITIVITY, file=sys.stderr, unit="variant", desc="sensitivity"):
                rows += run_case(case, mc, cache, args.time_limit, args.strategies, variant=v,
                                 patience=args.patience)
            path = out / "sensitivity.csv"
            if path.exists() and set(args.strategies) != set(STRATEGIES):     # merge partial re-runs
                keep = {(r.variant, r.strategy) for r in rows}
                rows = [r for r in read_csv(path) if (r.variant, r.strategy) not in keep] + rows
            write_csv(path, rows)
        total = sum(len(v) for v in groups.values())
        bar = tqdm(total=total, file=sys.stderr, unit="case", dynamic_ncols=True)
        done: dict[tuple, list[Row]] = {}     # the sweeps share their base point (and Table 2's)
        try:
            for table, cases in groups.items():
                rows = []
                for case in cases:
                    bar.set_description(f"{case.model} {case.pair}-{case.devices} gbs{case.gbs} seq{case.seq}")
                    key = (case.model, case.pair, case.devices, case.gbs, case.seq)
                    if key not in done:
                        done[key] = run_case(case, mc, cache, args.time_limit, args.strategies,
                                             out / "plans" if key == TABLE3_CASE else None,
                                             patience=args.patience)
                    rows += [replace(r, table=table) for r in done[key]]
                    bar.update(1)
                path = out / f"{table}.csv"
                if path.exists() and (args.models or args.pairs or set(args.strategies) != set(STRATEGIES)):
                    # merge partial re-runs
                    keep = {(r.model, r.pair, r.devices, r.gbs, r.seq, r.strategy) for r in rows}
                    rows = [r for r in read_csv(path)
                            if (r.model, r.pair, r.devices, r.gbs, r.seq, r.strategy) not in keep] + rows
                write_csv(path, rows)
        finally:
            bar.close()
        wrote = ((["table3"] if args.only in (None, "table3") else [])
                 + (["sensitivity"] if args.only in (None, "sensitivity") and not args.quick else [])
                 + list(groups))
        line = (f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC  {command}  # time limit "
                f"{args.time_limit:g} s; wrote {', '.join(wrote)}.csv")
        if cache.added:
            line += "; analytic profiles generated: " + ", ".join(sorted(cache.added))
        with (out / "runs.txt").open("a") as fh:
            fh.write(line + "\n")
    write_report(out)
    print((out / "paper_eval.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
