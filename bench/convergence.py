#!/usr/bin/env python
"""Convergence: HPP vs Megatron-uniform vs one rank on real text (paper appendix B, Fig. 14).

    python bench/convergence.py --model tiny-llama --set hidden=256 --set heads=8 \
        --set kv_heads=2 --set ffn=512 --set seq_len=64      # 2.4M parameters, 300 iterations
    python bench/convergence.py --model small --iters 20 --window 5   # a short look (GPT)

Three runs of the same model, global batch, data order (the sample contract of
docs/DATA.md: global batch t is samples t*gbs .. t*gbs+gbs-1 whatever the plan),
seed and optimizer settings, on the shipped English corpus by default:

    hpp       the HPP plan (``eth.planner.search``, strategy hpp) of the heterogeneous
              cluster (default examples/clusters/cpu-demo.yaml: its ``emulate_speed``
              makes the slow ranks really slower)
    uniform   the Megatron-uniform plan (strategy uniform) on the same ranks
    one-rank  a one-rank plan on one device of the cluster's first node type

Plans are searched in this process with the planner's own API (what tools/search_hpp.py
runs; the model is a preset with ``--set FIELD=VALUE`` overrides of its ModelSpec,
which search_hpp.py has no flag for); training is ``pretrain_gpt.py`` itself, under
``torchrun --standalone`` for several ranks and plain ``python`` for one rank, with
``--log-interval 1``: the per-iteration losses are read from rank 0's metric lines
(``megatron/hpp/training/metrics.py``: ``iteration i/N | ... | loss X | ...``).

Prints the mean training loss of each run over the last ``--window`` iterations, the
validation loss after the last iteration (``--eval-iters`` global batches of the
validation split, pretrain_gpt.py's ``--eval-interval``; no batch-to-batch noise) and the
relative differences (the paper reports ETH and the baselines within about 0.1%), and
writes, under ``--out`` (default out/bench/; bench/results/ with ``--update-results``): ``convergence.csv`` (iteration, loss of
each run), ``convergence.png`` (the three curves; the last ``--window`` iterations zoomed;
the per-iteration relative difference to the one-rank run), ``convergence.md`` (command,
machine load, commit, model, plans, numbers).  Bad
arguments: one ``error:`` line, exit 2; a failed training run: its last lines, exit 1.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convergence_report import (RUNS, compare, format_same, format_summary, plot,  # noqa: E402
                                steady_ms, write_csv, write_md)  # noqa: F401 (steady_ms: re-exported)
from run_context import add_output_args, loadavg, output_path, portable_args  # noqa: E402

LOSS_LINE = re.compile(r"^iteration (\d+)/(\d+) \| .*?\| loss (\S+) \|")
TIME_FIELD = re.compile(r"\| time ([0-9.]+) ms")
VALID_LINE = re.compile(r"^validation loss at iteration (\d+) \| lm loss (\S+) \|")


class BenchError(Exception):
    """Bad input to the bench (one line, exit 2)."""


# ---------------------------------------------------------------- arguments
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the usage too)
        raise BenchError(message)


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="tiny-llama",
                   help="model: a preset, a model YAML file or a HuggingFace config.json")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a ModelSpec field of the preset (repeatable), e.g. hidden=192")
    p.add_argument("--cluster", default=str(REPO / "examples/clusters/cpu-demo.yaml"),
                   help="heterogeneous cluster YAML of the hpp and uniform runs")
    p.add_argument("--profiles", default=None,
                   help="profile JSON file or folder for the searches (search_hpp.py --profiles); "
                        "default: analytic profiles of the cluster's device types")
    p.add_argument("--gbs", type=int, default=16, help="global batch size of all three runs")
    p.add_argument("--iters", type=int, default=300, help="training iterations of each run")
    p.add_argument("--window", type=int, default=50,
                   help="final window: mean loss over the last this many iterations (and the zoom)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"),
                   help="training precision recorded in the plans")
    p.add_argument("--seed", type=int, default=1234, help="training seed (weights, data order)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=1e-4, help="cosine decay floor")
    p.add_argument("--warmup", type=int, default=20, help="linear warm-up iterations")
    p.add_argument("--same-weights", type=int, default=None, metavar="K",
                   help="the first run also saves a checkpoint after iteration K; every plan then resumes "
                        "from it for iteration K+1, whose losses show whether the plans compute the same "
                        "loss on the same weights and batch (default: the window's start, --iters - "
                        "--window; 0: no check)")
    p.add_argument("--eval-iters", type=int, default=10,
                   help="validation global batches evaluated after the last iteration (0: none)")
    p.add_argument("--data-path", nargs="+", default=[str(REPO / "megatron/hpp/corpus/english")],
                   metavar="PREFIX", help="pretrain_gpt.py --data-path")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    add_output_args(p, "convergence.{csv,png,md}")
    p.add_argument("--workdir", default=None,
                   help="keep the plans and training logs here (default: a temporary folder)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per training run")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    for name in args.runs:
        if name not in RUNS:
            raise BenchError(f"--runs: unknown run {name!r}; runs: {', '.join(RUNS)}")
    if not args.runs:
        raise BenchError("--runs: no run named")
    if args.eval_iters < 0:
        raise BenchError(f"--eval-iters must be 0 or more, got {args.eval_iters}")
    for flag in ("gbs", "iters", "window"):
        if getattr(args, flag) < 1:
            raise BenchError(f"--{flag} must be a positive integer, got {getattr(args, flag)}")
    if args.window > args.iters:
        raise BenchError(f"--window {args.window} is larger than --iters {args.iters}")
    if args.same_weights is None:
        args.same_weights = args.iters - args.window
    if not 0 <= args.same_weights < args.iters:
        raise BenchError(f"--same-weights {args.same_weights} must be in [0, --iters {args.iters})")
    if args.warmup < 0 or args.warmup >= args.iters:
        raise BenchError(f"--warmup {args.warmup} must be in [0, --iters {args.iters})")
    if not (args.lr > 0 and 0 <= args.min_lr <= args.lr):
        raise BenchError(f"need 0 <= --min-lr {args.min_lr} <= --lr {args.lr} and --lr > 0")
    weights = [p for p in args.data_path if _is_weight(p)]
    for prefix in args.data_path:
        if not _is_weight(prefix) and not Path(f"{prefix}.bin").is_file():
            raise BenchError(f"--data-path {prefix}: no {prefix}.bin (see docs/DATA.md)")
    if not Path(args.cluster).is_file():
        raise BenchError(f"--cluster {args.cluster}: no such file")
    if args.profiles and not Path(args.profiles).exists():
        raise BenchError(f"--profiles {args.profiles}: no such file or folder")
    # pretrain_gpt.py runs in the repository root: absolute paths
    args.data_path = [p if p in weights else str(Path(p).resolve()) for p in args.data_path]
    return args


def _is_weight(text: str) -> bool:
    """A blend weight of ``--data-path W PREFIX ...`` (a number), not a prefix."""
    try:
        float(text)
        return True
    except ValueError:
        return False


def parse_sets(sets) -> dict:
    """``["hidden=192", "swiglu=true"]`` -> ``{"hidden": 192, "swiglu": True}`` (YAML scalars)."""
    import yaml
    from dataclasses import fields

    from eth.spec.model import ModelSpec

    known = {f.name for f in fields(ModelSpec)} - {"name"}
    out = {}
    for item in sets:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise BenchError(f"--set {item!r}: expected FIELD=VALUE")
        if key not in known:
            raise BenchError(f"--set {item!r}: unknown model field {key!r}; fields: {', '.join(sorted(known))}")
        try:
            out[key] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise BenchError(f"--set {item!r}: value {value!r} is not a number, true/false or a word") from None
    return out


def build_model(name: str, sets):
    """The model (a preset, a model YAML file or a HuggingFace config.json) with the
    overrides (validated by ModelSpec itself)."""
    from dataclasses import replace

    from eth.errors import SpecError
    from eth.spec.model_source import load_model

    overrides = parse_sets(sets)
    try:
        return replace(load_model(name), **overrides)
    except SpecError as exc:
        raise BenchError(str(exc)) from None
    except TypeError as exc:  # a value of the wrong kind that ModelSpec cannot compare
        raise BenchError(f"--set: {exc}") from None


# ---------------------------------------------------------------- plans
def one_rank_cluster(cluster, path: Path) -> None:
    """A cluster YAML of one device of ``cluster``'s first node type (its own figures, no
    emulated slow-down: the reference run)."""
    import yaml

    from eth.fileio import atomic_write_text

    data = yaml.safe_load(Path(cluster).read_text())
    first = data["nodes"][0]["type"]
    types = {first: dict(data.get("device_types", {}).get(first, {"base": first}))}
    types[first].pop("emulate_speed", None)
    atomic_write_text(path, yaml.safe_dump({
        "version": 1, "name": f"one-{first}", "inter_node_gbps": data.get("inter_node_gbps", 10),
        "device_types": types, "nodes": [{"type": first, "devices_per_node": 1, "count": 1}]},
        sort_keys=False))


def make_plan(model, cluster_path, gbs: int, strategy: str, precision: str, out: Path, profiles=None):
    """Search a plan (tools/search_hpp.py's steps: the profiles, analytic ones for the
    device types they lack, ``eth.planner.search.search``) and save it to ``out``."""
    from eth.spec.cluster import load_cluster
    from eth.errors import SpecError
    from eth.planner.options import SearchOptions
    from eth.planner.search import search
    from eth.spec.precision import TrainSetup
    from eth.profiles.db import ProfileDB

    try:
        cluster = load_cluster(cluster_path)
        db = ProfileDB.load(profiles) if profiles else ProfileDB()
        added = db.ensure(model, cluster.types.values())
        plan = search(model, cluster, db, SearchOptions(gbs=gbs, strategy=strategy, progress=False,
                                                        setup=TrainSetup(precision, 0, "fp32")))
    except SpecError as exc:  # InfeasibleError included
        raise BenchError(f"{strategy} plan on {Path(cluster_path).name}: {exc}") from None
    plan.search["profiles"] = {t: "analytic (generated for this search)" if t in added else db.get(t).source
                               for t in sorted(cluster.types)}
    plan.save(out)
    return plan


# ---------------------------------------------------------------- training
def parse_log(lines, expect: int | None = None, first: int = 1,
              stop: int | None = None) -> tuple[list[float], list[float], dict]:
    """Per-iteration losses, iteration times (ms) and validation losses by iteration from
    rank 0's ``--log-interval 1`` metric lines; other lines are ignored.  The lines must be
    iterations ``first``, ``first + 1``, ... in order; with ``expect`` (the run's
    --train-iters) they must be those of an ``expect``-iteration run, up to ``stop``
    (default ``expect``)."""
    losses, times, valid = [], [], {}
    for line in lines:
        v = VALID_LINE.match(line)
        if v:
            valid[int(v.group(1))] = float(v.group(2))
        m = LOSS_LINE.match(line)
        if not m:
            continue
        it, total, loss = int(m.group(1)), int(m.group(2)), float(m.group(3))
        if it != first + len(losses) or (expect is not None and total != expect):
            raise ValueError(f"metric line for iteration {it}/{total} after {len(losses)} iteration(s): "
                             f"not a --log-interval 1 log of one run")
        losses.append(loss)
        t = TIME_FIELD.search(line)
        times.append(float(t.group(1)) if t else math.nan)
    if expect is not None and len(losses) != (stop or expect) - first + 1:
        raise ValueError(f"{len(losses)} metric lines, expected {(stop or expect) - first + 1}")
    return losses, times, valid


def train_command(plan_path: Path, world: int, args, extra=()) -> list[str]:
    train = [str(REPO / "pretrain_gpt.py"), "--hpp-plan", str(plan_path), "--train-iters", str(args.iters),
             "--log-interval", "1", "--seed", str(args.seed), "--lr", repr(args.lr),
             "--min-lr", repr(args.min_lr), "--warmup", str(args.warmup),
             "--data-path", *args.data_path]
    train += list(extra)
    if world == 1:
        return [sys.executable, *train]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
            *train]


def train(name: str, plan_path: Path, world: int, args, workdir: Path, extra=(), first: int = 1,
          stop: int | None = None, label: str | None = None) -> dict:
    """Run one training (iterations ``first``..``stop`` of an ``--iters`` run; ``extra``:
    more pretrain_gpt.py flags); returns its losses, iteration times, the validation loss
    after ``--iters`` (when evaluated) and wall seconds."""
    from tqdm import tqdm

    label, stop = label or name, stop or args.iters
    cmd = train_command(plan_path, world, args, extra)
    log_path, err_path = workdir / f"{label}.log", workdir / f"{label}.stderr"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    start = time.monotonic()
    lines = []
    bar = tqdm(total=stop - first + 1, desc=f"{label:8s} ({world} rank{'s' if world > 1 else ''})", unit="it",
               disable=args.no_progress, file=sys.stderr, dynamic_ncols=True, mininterval=1.0)
    with open(log_path, "w") as log, open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            for line in proc.stdout:
                log.write(line)
                lines.append(line.rstrip("\n"))
                m = LOSS_LINE.match(line)
                if m:
                    bar.update(1)
                    bar.set_postfix(loss=m.group(3), refresh=False)
                if time.monotonic() - start > args.timeout:
                    raise TimeoutError
            code = proc.wait(timeout=max(1.0, args.timeout - (time.monotonic() - start)))
        except (TimeoutError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
            code = None
        finally:
            bar.close()
    wall = time.monotonic() - start
    if code != 0:
        tail = (err_path.read_text().strip().splitlines() or ["(no stderr)"])[-8:]
        what = f"timed out after {args.timeout:.0f} s" if code is None else f"exit code {code}"
        print(f"error: {label} training run failed ({what}): {shlex.join(cmd)}\n  " + "\n  ".join(tail),
              file=sys.stderr)
        raise SystemExit(1)
    losses, times, valid = parse_log(lines, expect=args.iters, first=first, stop=stop)
    if "--eval-interval" in extra and args.iters not in valid:
        print(f"error: {name}: no validation loss line at iteration {args.iters} in {log_path}", file=sys.stderr)
        raise SystemExit(1)
    return {"losses": losses, "times_ms": times, "valid": valid.get(args.iters), "wall_s": wall,
            "command": shlex.join(cmd)}


def same_weights(results: dict, worlds: dict, args, workdir: Path, ckpt: Path) -> dict:
    """Resume every run's plan from the first run's checkpoint after iteration K for one
    iteration; returns K, the first run's name and each plan's loss of iteration K+1."""
    import shutil

    k, source = args.same_weights, next(iter(results))
    saved = ckpt / f"iter_{k:07d}"
    if not (saved / "common.json").is_file():
        print(f"error: {source} run left no checkpoint {saved}", file=sys.stderr)
        raise SystemExit(1)
    load = workdir / f"from-{source}-{k}"   # a folder whose latest checkpoint is iteration k
    shutil.rmtree(load, ignore_errors=True)
    shutil.copytree(saved, load / saved.name)
    (load / "latest").write_text(saved.name)
    losses = {}
    for name in results:
        r = train(name, workdir / f"{name}.json", worlds[name], args, workdir,
                  ["--load", str(load), "--exit-interval", str(k + 1)], first=k + 1, stop=k + 1,
                  label=f"{name}@{k}")
        losses[name] = r["losses"][0]
    return {"k": k, "source": source, "losses": losses,
            "own": results[source]["losses"][k]}  # the source run's own iteration k+1


# ---------------------------------------------------------------- main
def _main(argv) -> int:
    args = parse_args(argv)
    model = build_model(args.model, args.sets)
    cluster = Path(args.cluster)
    out = output_path(args, "")
    out.mkdir(parents=True, exist_ok=True)
    if not os.access(out, os.W_OK):
        raise BenchError(f"--out {out}: not a writable folder")

    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="hpp-convergence-")
    workdir = Path(args.workdir or tmp.name)
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        plans, worlds = {}, {}
        for name in args.runs:
            if name == "one-rank":
                one_rank_cluster(cluster, workdir / "one-rank.yaml")
                plan = make_plan(model, workdir / "one-rank.yaml", args.gbs, "hpp", args.precision,
                                 workdir / "one-rank.json", args.profiles)
            else:
                plan = make_plan(model, cluster, args.gbs, name, args.precision, workdir / f"{name}.json",
                                 args.profiles)
            plans[name], worlds[name] = plan, plan.world_size
            print(f"{name} plan: " + "; ".join(
                f"pipeline {i}: {len(p.stages)} stage(s), mbs {p.mbs}, lbs {p.lbs}, ranks {sorted(p.ranks)}"
                for i, p in enumerate(plan.pipelines)), flush=True)
        print(f"model {model.name}: {model.num_params():,} parameters; {args.iters} iterations of gbs "
              f"{args.gbs} x seq {model.seq_len}, {args.precision}; load average {loadavg()}", flush=True)
        load_before = loadavg()
        results, k, ckpt = {}, args.same_weights, workdir / "checkpoints"
        for name in args.runs:
            extra = ["--eval-interval", str(args.iters), "--eval-iters", str(args.eval_iters)] \
                if args.eval_iters else []
            if k and name == args.runs[0]:
                extra += ["--save", str(ckpt), "--save-interval", str(k)]
            results[name] = train(name, workdir / f"{name}.json", worlds[name], args, workdir, extra)
            results[name]["world"] = worlds[name]
        same = same_weights(results, worlds, args, workdir, ckpt) if k else None
        load_after = loadavg()
        cmp = compare(results, args.window)
        print(format_summary(results, cmp, args))
        if same:
            print(format_same(same, args))
        write_csv(out / "convergence.csv", results)
        plot(out / "convergence.png", results, model, args)
        write_md(out / "convergence.md", results, cmp, same, model, plans, args,
                 portable_args(sys.argv[1:] if argv is None else argv), load_before, load_after)
        print(f"wrote {out / 'convergence.csv'}, {out / 'convergence.png'}, {out / 'convergence.md'}")
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0


def main(argv=None) -> int:
    try:
        return _main(argv)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
