"""Cost-model predictions against runs of the runtime on this machine (issue 10 item 5).

    OMP_NUM_THREADS=1 python bench/predictor_accuracy.py            # ~4 min on 2 cores

1. Profiles the CPU with ``tools/profile_ops.py`` (tiny model, fp32, mbs 1,2,4,8,16,
   tp 1,2 with ``--real-tp``: tp 2 timed by 2 processes on a real gloo group, as the
   runtime runs it, collectives included; thread CPU time, so other processes on the
   machine do not inflate it)
   unless ``--profile FILE`` names a measured profile to use; then adds gloo collective
   tables over 2..(largest configuration's world) ranks (``--collectives-only`` under
   torchrun): the cost model reads the end-of-step all-reduces' latency and the p2p from
   them (the summary also gives the error without them, as before).
2. Builds the configurations of :data:`CONFIGS` (tiny GPT, fp32, gbs 16; homogeneous
   and heterogeneous through ``emulate_speed``, 1-3 pipelines, tp and dp stages, with
   and without recompute; and the README main job's plan), predicts each with ``eth.cost.model.CostModel`` from that profile
   (emulated types: the ``cpu`` profile / speed, ``eth.profiles.db.emulated_profile``), and
   runs it under torchrun on gloo (one launch per configuration, this file's
   ``--worker`` mode: ``megatron.hpp.training.loop.Trainer``, synthetic data).
   Right before and right after each run it profiles the plan's (mbs, tp) again
   (``--repeats 20``; ``--no-adjacent`` skips it) and predicts from the mean of the two
   too: the host's speed drifts by tens of percent within minutes, and a profile taken
   first and runs taken later show that drift as a one-sided error.  The host drift
   (adjacent / start op times, before / after) is printed next to the raw and the
   adjacent errors.  ``--runs N`` launches each configuration N times in a row
   (between the same two adjacent profiles) and keeps the medians: the table's "run
   spread" column, (max - min) / median over the launches, is how far the same run moves
   from one launch to the next on this host, the floor under any error it can show.
3. Prints and writes (``predictor_accuracy.md`` and ``.json`` under out/bench/, or
   bench/results/ with ``--update-results``, with the
   command, the commit and the load average before and after every run) predicted vs
   measured:

   * iteration time: the cost model's objective (``plan.predicted["iteration_ms"]``,
     gradient blocks) vs the median wall time
     of the steady iterations (after ``--warmup`` iterations);
   * compute per pipeline: sum over its micro-batches of the slowest stage's forward +
     backward (op times + recompute + overheads, without the cost model's own tp
     collectives and p2p; with ``--real-tp`` profiles the tp collectives' CPU time is in
     the op times, as it is in the runtime's thread CPU time) vs the runtime's
     ``compute ms`` (``schedule.ComputeClock``: thread CPU time / emulate_speed, max over
     the pipeline's ranks), median over steady iterations;
   * memory per rank: the cost model's model states + in-flight activations (its
     ``reserved_bytes``, a fixed allowance for the framework, left out) vs the peak of
     the bytes the process's tensors hold, measured with ``torch.profiler``
     (``profile_memory``: every CPU allocation and free from before the model is built
     to the end of the second iteration; frees on gloo's threads counted too,
     :func:`frees_on_all_threads`);
   * where each rank's step went (:class:`StepPhases`, medians): the 1F1B schedule, the
     gradient reducer's last collectives, the global norm, the optimizer step and the
     rest, next to the optimizer step and the rest of the step that the cost model adds
     to that rank's Eq. 5 end time;
   * the composition alone (``predictor_composition``): the iteration the cost model's
     objective, the event simulator and the paper's Eq. 5 predict when each stage's
     compute is what its slowest rank measured in the run
     (the schedule's ComputeClock per rank), its error, and measured / predicted compute
     per stage: what the model gets wrong with the op times right, apart from the op
     times' own error (the host's drift, bench/profile_repeatability.py).

The emulated device types run at ``emulate_speed`` <= 0.25 so that all ranks' compute
together needs at most about one core of the two, and sleeps (not contention) set the
pace; the time errors are still only as good as the machine is quiet, which is why
every figure carries the load average it was taken under.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from predictor_composition import COMPOSITION_HEADER, composition_rows, iteration_from_compute  # noqa: E402
from predictor_profiles import (  # noqa: E402
    _env, _without_collectives, _without_overheads, concurrency_line, copy_collectives, host_drift, mean_prediction,
    plan_shapes, profile_collectives, profile_cpu)
from run_context import commit, loadavg, output_path, portable_args  # noqa: E402

GBS = 16
SPEED_A, SPEED_B = 0.25, 0.1   # emulated "fast" and "slow" CPU device types (2.5 : 1)
ADJ_REPEATS = 20   # rounds of the quick re-profile right before each run


def _cluster(groups, name):
    """groups: [(type, ranks)] -> cluster dict, one node per group."""
    from eth.spec.cluster import Cluster

    return Cluster.from_dict({
        "name": name, "inter_node_gbps": 10,
        "device_types": {"cpu-a": {"base": "cpu", "emulate_speed": SPEED_A},
                         "cpu-b": {"base": "cpu", "emulate_speed": SPEED_B}},
        "nodes": [{"type": t, "devices_per_node": n} for t, n in groups]})


def _plan(name, groups, pipelines, zero_stage=0):
    """pipelines: [(mbs, lbs, [(ranks, type, tp, dp, (l0, l1), recompute)])]."""
    from eth.spec.model import get_model
    from eth.spec.plan import PipelinePlan, Plan, StagePlan
    from eth.spec.precision import TrainSetup

    pipes = [PipelinePlan(mbs, lbs, [StagePlan(list(r), t, tp, dp, tuple(layers), dict(rec))
                                     for r, t, tp, dp, layers, rec in stages])
             for mbs, lbs, stages in pipelines]
    return Plan(model=get_model("tiny"), cluster=_cluster(groups, name), gbs=GBS, pipelines=pipes,
                training=TrainSetup("fp32", zero_stage, "fp32"))


FULL = {op: 4 for op in ("1st-layernorm", "qkv", "score", "softmax", "attn-dropout", "context",
                         "attn-dense", "post-attn-dropout", "2nd-layernorm", "mlp-gemm-1", "gelu",
                         "mlp-gemm-2", "post-mlp-dropout")}
ATTN = {"score": 2, "softmax": 2, "attn-dropout": 2, "context": 2}

CONFIGS = {
    # name: (description, plan builder)
    "1st": ("1 pipeline, 1 stage (tp 1, dp 1), cpu-a", lambda: _plan(
        "1st", [("cpu-a", 1)], [(4, 16, [([0], "cpu-a", 1, 1, (0, 4), {})])])),
    "pp2-rec": ("1 pipeline, 2 stages 3+1 layers, recompute (attention, 2 layers) in stage 0, cpu-a", lambda: _plan(
        "pp2", [("cpu-a", 2)], [(2, 16, [([0], "cpu-a", 1, 1, (0, 3), ATTN), ([1], "cpu-a", 1, 1, (3, 4), {})])])),
    "tp2": ("1 pipeline, 1 stage tp 2, cpu-a", lambda: _plan(
        "tp2", [("cpu-a", 2)], [(4, 16, [([0, 1], "cpu-a", 2, 1, (0, 4), {})])])),
    "dp2-full": ("1 pipeline, 1 stage dp 2, full recompute, ZeRO 1, cpu-a", lambda: _plan(
        "dp2", [("cpu-a", 2)], [(8, 16, [([0, 1], "cpu-a", 1, 2, (0, 4), FULL)])], zero_stage=1)),
    "het-2pipes": ("2 pipelines: cpu-a (lbs 12); cpu-b (lbs 4)", lambda: _plan(
        "het2", [("cpu-a", 1), ("cpu-b", 1)],
        [(4, 12, [([0], "cpu-a", 1, 1, (0, 4), {})]), (4, 4, [([1], "cpu-b", 1, 1, (0, 4), {})])])),
    "het-pp": ("1 pipeline: cpu-a stage (3 layers) -> cpu-b stage (1 layer)", lambda: _plan(
        "hetpp", [("cpu-a", 1), ("cpu-b", 1)],
        [(2, 16, [([0], "cpu-a", 1, 1, (0, 3), {}), ([1], "cpu-b", 1, 1, (3, 4), {})])])),
    "het-3pipes": ("3 pipelines: cpu-a tp 2 (lbs 8); cpu-a (lbs 6); cpu-b 2 stages (lbs 2, recompute)", lambda: _plan(
        "het3", [("cpu-a", 3), ("cpu-b", 2)],
        [(4, 8, [([0, 1], "cpu-a", 2, 1, (0, 4), {})]),
         (2, 6, [([2], "cpu-a", 1, 1, (0, 4), {})]),
         (1, 2, [([3], "cpu-b", 1, 1, (0, 2), {"gelu": 2}), ([4], "cpu-b", 1, 1, (2, 4), {})])])),
    # 6 processes, 3 unequal pipelines whose stage boundaries differ (layers 1, 3, 2): every
    # gradient block is held by stages of different pipelines that finish at different times
    "het-3pipes-6": ("3 pipelines, boundaries at layers 1 / 3 / 2: cpu-a 1+3 layers (lbs 8); cpu-a 3 -> cpu-b 1 "
                     "(lbs 6); cpu-b 2+2 (lbs 2)", lambda: _plan(
        "het3x6", [("cpu-a", 3), ("cpu-b", 3)],
        [(2, 8, [([0], "cpu-a", 1, 1, (0, 1), {}), ([1], "cpu-a", 1, 1, (1, 4), {})]),
         (2, 6, [([2], "cpu-a", 1, 1, (0, 3), {}), ([3], "cpu-b", 1, 1, (3, 4), {})]),
         (1, 2, [([4], "cpu-b", 1, 1, (0, 2), {}), ([5], "cpu-b", 1, 1, (2, 4), {})])])),
    # 6 processes, a tp 2 pipeline beside tp 1 stages: the tp 1 holders carry twice its share
    "het-3pipes-6tp": ("3 pipelines: cpu-a tp 2 (lbs 10); cpu-a 3 -> cpu-b 1 (lbs 4); cpu-b 1+3 (lbs 2)", lambda: _plan(
        "het3x6tp", [("cpu-a", 3), ("cpu-b", 3)],
        [(2, 10, [([0, 1], "cpu-a", 2, 1, (0, 4), {})]),
         (2, 4, [([2], "cpu-a", 1, 1, (0, 3), {}), ([3], "cpu-b", 1, 1, (3, 4), {})]),
         (1, 2, [([4], "cpu-b", 1, 1, (0, 1), {}), ([5], "cpu-b", 1, 1, (1, 4), {})])])),
    "demo": ("the README main job's plan (examples/plans/cpu-demo.json: cpu-fast 0.25, cpu-slow 0.064, ZeRO 1)",
             lambda: _demo_plan()),
}


def _demo_plan():
    from eth.spec.plan import load_plan

    return load_plan(ROOT / "examples" / "plans" / "cpu-demo.json")


# ----------------------------------------------------------------------------------
# Predictions.

def predict(plan, db) -> dict:
    """Iteration ms (the objective), per-pipeline compute ms, per-rank memory bytes (without
    reserved) and, per rank, the optimizer step and the rest of the step the cost model adds
    after Eq. 5 (``CostModel.optimizer_ms``, ``step_ms``)."""
    from eth.cost.model import CostModel

    db.ensure(plan.model, plan.cluster.types.values())
    cm = CostModel(plan.model, plan.cluster, db, plan.training)
    ev = cm.annotate(plan)
    compute, memory, after = [], {}, {}
    for p, pp in zip(plan.pipelines, ev["pipelines"]):
        m = p.lbs // p.mbs
        compute.append(m * max(c.fwd_ms + c.bwd_ms - c.comm_ms for c in pp["costs"]))
        for st, c in zip(p.stages, pp["costs"]):
            _, reserved = db.layer_costs(st.device_type, plan.model, p.mbs // st.dp, st.tp)
            for r in st.ranks:
                memory[r] = c.memory_bytes - reserved
                after[r] = (cm.optimizer_ms(p.mbs, st), cm.step_ms(p, st, plan.world_size))
    return {"iteration_ms": ev["iteration_ms"], "compute_ms": compute,
            "memory_bytes": [memory[r] for r in sorted(memory)],
            "optimizer_ms": [after[r][0] for r in sorted(after)], "step_ms": [after[r][1] for r in sorted(after)]}


# ----------------------------------------------------------------------------------
# The worker (one process per rank under torchrun).

@contextlib.contextmanager
def frees_on_all_threads():
    """Count every thread's frees in the profiler's "Total Allocated" counter.

    torch.profiler updates that counter only for allocations and frees made on a
    profiled thread, but gloo frees a tensor on its worker thread when its collective
    holds the last reference (the forward all-reduce of a row-parallel GEMM's output,
    the backward all-reduce of a column-parallel GEMM's input gradient, ...): those
    bytes then stay in the counter and the measured peak drifted up by 0.1-1.2 MiB per
    rank, with the timing, in tp and dp runs.  c10's flag ``caffe2_report_cpu_memory_usage``
    makes its CPU allocation reporter keep the counter on every thread (c10/core/CPUAllocator.cpp,
    ``ProfiledCPUMemoryReporter``); torch has no Python API for it, so it is set through
    ctypes, and left as it was afterwards (it costs a lock per allocation)."""
    import ctypes
    import glob

    import torch

    libs = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.*"))
    try:
        flag = ctypes.c_bool.in_dll(ctypes.CDLL(libs[0]), "FLAGS_caffe2_report_cpu_memory_usage")
    except (IndexError, OSError, ValueError):
        print("warning: c10's FLAGS_caffe2_report_cpu_memory_usage not found: frees on gloo's "
              "threads are not counted and the measured peak may be high", file=sys.stderr)
        yield
        return
    before = flag.value
    flag.value = True
    try:
        yield
    finally:
        flag.value = before


def _peak_tensor_bytes(prof) -> float:
    """Largest 'Total Allocated' of the profiler's CPU memory events: the bytes held by
    tensors allocated since the profiler started, at their peak."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    mem = sorted((e for e in events if e.get("name") == "[memory]"
                  and e.get("args", {}).get("Device Type", 0) == 0), key=lambda e: e["ts"])
    if not mem:
        return 0.0
    # the counter runs over the process's profiled allocations: start from its value
    # before this session's first allocation
    base = mem[0]["args"]["Total Allocated"] - mem[0]["args"]["Bytes"]
    return float(max(e["args"]["Total Allocated"] for e in mem) - base)


PHASES = ("schedule", "grad sync finish", "grad norm", "optimizer")
"""The parts of ``Trainer.step`` :class:`StepPhases` times: the 1F1B schedule (compute,
p2p and the waits for the neighbouring stages), the gradient reducer's last collectives,
the global gradient norm (an all-reduce over every rank) and the optimizer step (ZeRO's
weight write-back included); the rest of the step is the remainder ("rest")."""


class StepPhases:
    """Wall time of each of :data:`PHASES` per step on this rank, by wrapping the
    functions ``Trainer.step`` calls (no change to the runtime)."""

    def __init__(self):
        self.seconds = {name: [] for name in PHASES}
        self.compute = []
        """This rank's compute seconds of each step (the schedule's ComputeClock)."""

    def wrap(self, owner, attr: str, name: str, after=None):
        """Time ``owner.attr`` under phase ``name``; ``after(args)`` runs after each call."""
        fn = getattr(owner, attr)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[name].append(time.perf_counter() - t)
                if after is not None:
                    after(a)

        setattr(owner, attr, timed)

    def install(self, trainer):
        from megatron.hpp.distributed import grad_sync
        from megatron.hpp.parallel import schedule

        # Trainer.step imports them at call time; one_f_one_b's 6th argument is its ComputeClock
        self.wrap(schedule, "one_f_one_b", "schedule", after=lambda a: self.compute.append(a[5].total_seconds()))
        self.wrap(grad_sync, "global_grad_norm", "grad norm")
        self.wrap(trainer.reducer, "finish", "grad sync finish")
        self.wrap(trainer.optimizer, "step", "optimizer")

    def medians_ms(self, first: int, steps_s: list) -> dict:
        """Median ms of each phase over the steps from index ``first`` on, of the rest and
        (when recorded) of this rank's compute ("compute")."""
        out = {n: statistics.median(v[first:]) * 1e3 if v[first:] else 0.0 for n, v in self.seconds.items()}
        rest = [t - sum(v[i] for v in self.seconds.values() if i < len(v))
                for i, t in enumerate(steps_s) if i >= first]
        out["rest"] = statistics.median(rest) * 1e3
        if self.compute[first:]:
            out["compute"] = statistics.median(self.compute[first:]) * 1e3
        return out


def worker(args) -> int:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from megatron.hpp.training.loop import Trainer, TrainConfig, prepare

    total = args.warmup + args.iters
    cfg = TrainConfig(plan=args.worker, train_iters=total, log_interval=total)
    plan, layout, rank = prepare(cfg)
    with frees_on_all_threads(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer = Trainer(cfg, layout, rank)
        phases = StepPhases()
        phases.install(trainer)
        results = [trainer.step(i) for i in range(2)]   # the peak: optimizer state exists from step 1
    peak = _peak_tensor_bytes(prof)
    del prof
    results += [trainer.step(i) for i in range(2, total)]
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    phases_ms = [None] * dist.get_world_size()
    dist.all_gather_object(phases_ms, phases.medians_ms(args.warmup, [r.elapsed_s for r in results]))
    if rank == 0:
        steady = results[args.warmup:]
        out = {"iteration_ms": statistics.median(r.elapsed_s for r in steady) * 1e3,
               "iteration_ms_all": [r.elapsed_s * 1e3 for r in results],
               "compute_ms": [statistics.median(r.compute_s[p] for r in steady) * 1e3
                              for p in range(len(plan.pipelines))],
               "memory_bytes": peaks, "phases_ms": phases_ms, "torch_threads": torch.get_num_threads()}
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------------
# The driver.

def run_config(plan_path: Path, world: int, out: Path, warmup: int, iters: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           str(Path(__file__).resolve()), "--worker", str(plan_path), "--out", str(out),
           "--warmup", str(warmup), "--iters", str(iters)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{plan_path.name}: torchrun exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def combine_runs(runs: list[dict]) -> dict:
    """One configuration run ``len(runs)`` times in a row: the median of each measured
    figure over the runs (iteration, each pipeline's compute, each rank's memory), the
    runs themselves, and their spread, (max - min) / median, of the iteration and of each
    pipeline's compute: how much the same run moves from one launch to the next here."""
    med = statistics.median

    def spread(vals):
        return (max(vals) - min(vals)) / med(vals)

    pipes, ranks = range(len(runs[0]["compute_ms"])), range(len(runs[0]["memory_bytes"]))
    return {"iteration_ms": med(r["iteration_ms"] for r in runs),
            "compute_ms": [med(r["compute_ms"][p] for r in runs) for p in pipes],
            "memory_bytes": [med(r["memory_bytes"][i] for r in runs) for i in ranks],
            "phases_ms": [{k: med(r["phases_ms"][i][k] for r in runs) for k in runs[0]["phases_ms"][i]}
                          for i in ranks] if "phases_ms" in runs[0] else None,
            "spread": {"iteration": spread([r["iteration_ms"] for r in runs]),
                       "compute": [spread([r["compute_ms"][p] for r in runs]) for p in pipes]},
            "runs": runs}


def _err(pred, meas) -> str:
    return f"{(pred / meas - 1) * 100:+.1f}%" if meas else "n/a"


def rows_for(name, desc, pred, meas, load, adj=None, drift=None) -> list[str]:
    """One table row: raw errors against the profile measured at the start; with ``adj``
    (the prediction from a profile measured right before the run) its errors follow in
    brackets, and ``drift`` (host speed change, :func:`host_drift`) gets a column; so does
    the run-to-run spread when ``meas`` combines several runs (:func:`combine_runs`)."""
    mib = 2 ** -20

    def adj_err(key, i=None):
        if adj is None:
            return ""
        p = adj[key] if i is None else adj[key][i]
        m = meas[key] if i is None else meas[key][i]
        return f" [adj. {p:.1f}: {_err(p, m)}]"

    comp = "; ".join(f"p{i} {p:.1f} / {m:.1f} ({_err(p, m)}){adj_err('compute_ms', i)}"
                     for i, (p, m) in enumerate(zip(pred["compute_ms"], meas["compute_ms"])))
    mem = "; ".join(f"r{r} {p * mib:.2f} / {m * mib:.2f} ({_err(p, m)})"
                    for r, (p, m) in enumerate(zip(pred["memory_bytes"], meas["memory_bytes"])))
    drift_col = f" {drift[0]:.2f} / {drift[1]:.2f} |" if drift is not None else " - |"
    sp = meas.get("spread")
    if sp and len(meas["runs"]) > 1:
        drift_col += (f" {sp['iteration']:.0%}; " + ", ".join(f"p{i} {c:.0%}" for i, c in enumerate(sp["compute"]))
                      + " |")
    else:
        drift_col += " - |"
    return [f"| {name} | {desc} | {pred['iteration_ms']:.1f} / {meas['iteration_ms']:.1f} "
            f"({_err(pred['iteration_ms'], meas['iteration_ms'])}){adj_err('iteration_ms')} | {comp} |"
            f"{drift_col} {mem} | {load} |"]


def phase_rows(name, pred, meas) -> list[str]:
    """Per rank, where its step went (medians, ms): :data:`PHASES` and the rest, measured,
    next to what the cost model adds after Eq. 5 for that rank (optimizer; the rest of the
    step, which the grad norm and the remainder measure)."""
    if not meas.get("phases_ms"):
        return []
    rows = []
    for r, ph in enumerate(meas["phases_ms"]):
        cells = " | ".join(f"{ph[k]:.1f}" for k in PHASES)
        rows.append(f"| {name} | r{r} | {cells} | {ph['rest']:.1f} | {pred['optimizer_ms'][r]:.1f} | "
                    f"{pred['step_ms'][r]:.1f} |")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", help="measured cpu profile to use (default: measure one now)")
    ap.add_argument("--only", help="comma-separated configuration names")
    ap.add_argument("--warmup", type=int, default=3, help="iterations before the timed ones")
    ap.add_argument("--iters", type=int, default=10, help="timed iterations (median kept)")
    ap.add_argument("--runs", type=int, default=1,
                    help="launches of each configuration, one after another (medians kept; the "
                         "table shows their spread)")
    ap.add_argument("--out-dir", help="where predictor_accuracy.md/.json go (default: out/bench/)")
    ap.add_argument("--update-results", action="store_true",
                    help="write over bench/results/predictor_accuracy.md/.json instead of out/bench/")
    ap.add_argument("--no-adjacent", action="store_true",
                    help="skip the quick re-profile right before each run (the adjacent errors and drift)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.warmup < 2 or args.iters < 1 or args.runs < 1:
        print(f"error: --warmup must be >= 2 (memory is measured over the first 2 iterations), "
              f"--iters >= 1 and --runs >= 1, got {args.warmup}, {args.iters}, {args.runs}", file=sys.stderr)
        return 2
    from eth.profiles.db import ProfileDB

    names = list(CONFIGS) if not args.only else [n.strip() for n in args.only.split(",")]
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        print(f"error: unknown configuration(s) {bad}; known: {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    command = "OMP_NUM_THREADS=1 python bench/predictor_accuracy.py " + shlex.join(portable_args(argv or sys.argv[1:]))
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.profile:
            profile, prof_cmd = Path(args.profile), f"(given: {args.profile})"
        else:
            profile = tmp / "cpu.json"
            load0 = loadavg()
            prof_cmd = profile_cpu(profile) + f"   # load {load0} -> {loadavg()}"
            world = max(CONFIGS[n][1]().world_size for n in names)
            if world >= 2:
                load0 = loadavg()
                prof_cmd += f"; then {profile_collectives(profile, world)}   # load {load0} -> {loadavg()}"
            print(f"profiled: {prof_cmd}", flush=True)
        conc = fake_cmd = None
        conc_line = "concurrency: not measured (--profile given)"
        if not args.profile:
            conc_line, conc, fake_cmd = concurrency_line(profile, tmp)
            print(conc_line, flush=True)

        rows, records, phase_table, composition_table = [], [], [], []
        for name in names:
            desc, build = CONFIGS[name]
            plan = build()
            db = ProfileDB.load(profile)
            pred = predict(plan, db)
            bare = predict(build(), _without_overheads(profile))
            no_coll = predict(build(), _without_collectives(profile))
            plan_path = tmp / f"{name}.json"
            plan.save(plan_path)
            adj = drift = adj_cmd = None
            if not args.no_adjacent:
                before, after = tmp / f"cpu-{name}-before.json", tmp / f"cpu-{name}-after.json"
                mbs_list, tp_list = plan_shapes(plan)
                adj_cmd = profile_cpu(before, mbs_list, tp_list, ADJ_REPEATS)
                copy_collectives(profile, before)
            load_before = loadavg()
            meas = combine_runs([run_config(plan_path, plan.world_size, tmp / f"{name}.out.json", args.warmup,
                                            args.iters) for _ in range(args.runs)])
            load = f"{load_before} -> {loadavg()}"
            if not args.no_adjacent:
                profile_cpu(after, mbs_list, tp_list, ADJ_REPEATS)
                copy_collectives(profile, after)
                adj = mean_prediction(predict(build(), ProfileDB.load(before)),
                                      predict(build(), ProfileDB.load(after)))
                drift = (host_drift(profile, before), host_drift(profile, after))
            rows += rows_for(name, desc, pred, meas, load, adj, drift)
            phase_table += phase_rows(name, pred, meas)
            composed = iteration_from_compute(build(), db, [ph["compute"] for ph in meas["phases_ms"]])
            composition_table += composition_rows(name, pred, meas, composed)
            records.append({"name": name, "description": desc, "predicted": pred, "measured": meas,
                            "predicted_without_overheads": bare, "predicted_without_collectives": no_coll,
                            "predicted_adjacent": adj, "adjacent_profile": adj_cmd, "host_drift": drift,
                            "predicted_from_run_compute": composed, "loadavg": load})
            print(rows[-1], flush=True)
    header = ["| config | what | iteration ms pred / meas (err) [adj.] | compute ms per pipeline pred / meas "
              "(err) [adj.] | drift | run spread | tensor MiB per rank pred / meas (err) | loadavg before -> after |",
              "|---|---|---|---|---|---|---|---|"]
    errs_t = [r["predicted"]["iteration_ms"] / r["measured"]["iteration_ms"] - 1 for r in records]
    errs_c = [p / m - 1 for r in records for p, m in zip(r["predicted"]["compute_ms"], r["measured"]["compute_ms"])]
    errs_m = [p / m - 1 for r in records
              for p, m in zip(r["predicted"]["memory_bytes"], r["measured"]["memory_bytes"])]
    summary = (f"error range: iteration {min(errs_t):+.1%} .. {max(errs_t):+.1%}, compute per pipeline "
               f"{min(errs_c):+.1%} .. {max(errs_c):+.1%}, memory per rank {min(errs_m):+.1%} .. {max(errs_m):+.1%}"
               f" (err = predicted / measured - 1; profile measured at the start)")
    bare_t = [r["predicted_without_overheads"]["iteration_ms"] / r["measured"]["iteration_ms"] - 1 for r in records]
    bare_c = [p / m - 1 for r in records
              for p, m in zip(r["predicted_without_overheads"]["compute_ms"], r["measured"]["compute_ms"])]
    summary += (f"\nwithout the profile's overhead_ms (ops only, as before): iteration {min(bare_t):+.1%} .. "
                f"{max(bare_t):+.1%}, compute per pipeline {min(bare_c):+.1%} .. {max(bare_c):+.1%}")
    if any(r["predicted_without_collectives"] != r["predicted"] for r in records):
        nc_t = [r["predicted_without_collectives"]["iteration_ms"] / r["measured"]["iteration_ms"] - 1
                for r in records]
        summary += (f"\nwithout the measured collective tables (step all-reduces and p2p as before): iteration "
                    f"{min(nc_t):+.1%} .. {max(nc_t):+.1%}")
    for key, label in (("iteration_ms", "objective"), ("simulated_ms", "simulator"), ("eq5_ms", "Eq. 5")):
        comp_t = [r["predicted_from_run_compute"][key] / r["measured"]["iteration_ms"] - 1 for r in records]
        summary += (f"\nfrom the run's own compute per stage (the composition alone, predictor_composition.py), "
                    f"{label}: iteration {min(comp_t):+.1%} .. {max(comp_t):+.1%}, within 5% on "
                    f"{sum(abs(e) <= 0.05 for e in comp_t)} of {len(comp_t)}")
    if not args.no_adjacent:
        adj_t = [r["predicted_adjacent"]["iteration_ms"] / r["measured"]["iteration_ms"] - 1 for r in records]
        adj_c = [p / m - 1 for r in records
                 for p, m in zip(r["predicted_adjacent"]["compute_ms"], r["measured"]["compute_ms"])]
        drifts = [d for r in records for d in r["host_drift"]]
        summary += (f"\nadjacent-profile error range: iteration {min(adj_t):+.1%} .. {max(adj_t):+.1%}, "
                    f"compute per pipeline {min(adj_c):+.1%} .. {max(adj_c):+.1%}; host drift "
                    f"{min(drifts):.2f} .. {max(drifts):.2f}")
    if args.runs > 1:
        sp_t = [r["measured"]["spread"]["iteration"] for r in records]
        sp_c = [c for r in records for c in r["measured"]["spread"]["compute"]]
        summary += (f"\nrun-to-run spread over {args.runs} launches of each configuration ((max - min) / median): "
                    f"iteration {min(sp_t):.0%} .. {max(sp_t):.0%}, compute per pipeline {min(sp_c):.0%} .. "
                    f"{max(sp_c):.0%}")
    text = "\n".join([
        "# Predicted vs measured on this machine (bench/predictor_accuracy.py)", "",
        f"command: `{command}`  ", f"commit: {commit()}  ",
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(start))}, {time.time() - start:.0f} s, "
        f"{os.cpu_count()} CPUs  ", f"profile: `{prof_cmd}`  ",
        f"emulated types: cpu-a emulate_speed {SPEED_A}, cpu-b {SPEED_B}; tiny GPT, fp32, gbs {GBS}, "
        f"{args.warmup} warm-up + {args.iters} timed iterations (medians)"
        + (f", {args.runs} launches of each configuration in a row (medians of theirs)" if args.runs > 1 else "")
        + "  ",
        "adjacent profiles: " + ("none (--no-adjacent)" if args.no_adjacent else
                                 f"right before and right after every run, the plan's (mbs, tp) only, "
                                 f"--repeats {ADJ_REPEATS}"), "",
        *header, *rows, "", summary, "", conc_line, "",
        "Where each rank's step went (measured medians, ms; `StepPhases`: schedule = the 1F1B "
        "schedule with its compute, p2p and waits; grad sync finish = the reducer's last collectives; "
        "grad norm = the global norm's all-reduce; optimizer with ZeRO's write-back; rest = the "
        "remainder of Trainer.step) next to what the cost model adds after that rank's gradient sync:", "",
        "| config | rank | " + " | ".join(PHASES) + " | rest | pred. optimizer | pred. rest of step |",
        "|---|---|" + "---|" * (len(PHASES) + 3), *phase_table, "",
        "The cost model's composition alone: the same prediction with each stage's compute set to "
        "what its slowest rank measured in the run (`predictor_composition.iteration_from_compute`; "
        "the last column is measured / predicted compute of each stage, the op times' error):", "",
        *COMPOSITION_HEADER, *composition_table, "",
        "Predicted: `eth.cost.model.CostModel` from the profile (its objective's iteration; per pipeline the "
        "slowest stage's forward + backward x micro-batches, without tp collectives and p2p, "
        "with the profile's measured runtime overheads (per layer, per stage call, per "
        "checkpoint, for emulated types the wake-up after each emulation sleep; in the "
        "iteration also the optimizer step and the rest of the step: end-of-step "
        "all-reduces, data); "
        "per rank model states + activations, reserved bytes left out).  [adj. X: e] is the "
        "mean of the same prediction from two profiles of the plan's (mbs, tp) measured right "
        "before and right after the run, and its error; drift = those profiles' op times / the "
        "start profile's, before / after (> 1: the host was slower than at the start; before "
        "and after apart: it changed during the run).  Run spread (with --runs N > 1): (max - "
        "min) / median of the measured iteration and of each pipeline's compute over the N "
        "launches of the configuration; the measured figures are their medians.  The raw errors "
        "are against the start "
        "profile, as a planner would use it.  Measured: median wall "
        "time of the timed iterations; the runtime's compute per pipeline (thread CPU time / "
        "emulate_speed, slowest rank); peak tensor bytes (torch.profiler, first 2 iterations).  "
        "The emulated types need about one core for all ranks together: "
        "with the load average above the core count, ranks wait for a core longer than the "
        "emulation sleeps and measured times grow with the load (see the load column).", ""])
    out_dir = Path(args.out_dir) if args.out_dir else output_path(argparse.Namespace(
        update_results=args.update_results), "")
    out_dir.mkdir(parents=True, exist_ok=True)
    from eth.fileio import atomic_write_text

    atomic_write_text(out_dir / "predictor_accuracy.md", text)
    atomic_write_text(out_dir / "predictor_accuracy.json", json.dumps(
        {"command": command, "commit": commit(), "profile": prof_cmd, "concurrency": conc,
         "concurrency_profile": fake_cmd, "configs": records}, indent=1) + "\n")
    print(summary)
    print(f"wrote {out_dir / 'predictor_accuracy.md'} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
