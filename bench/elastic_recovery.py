#!/usr/bin/env python
"""Time from a rank's death to the first iteration under the new plan, by phase.

The CPU demo cluster as four torchrun agents of one process each on this machine
(examples/slurm/elastic-node.sh with its defaults, c10d rendezvous on localhost,
--nnodes 3:4), planning at start-up and checkpointing every 5 iterations; once rank 0
has recorded iteration 12 (``--kill-at``), one agent and its worker are killed with -9.
Every line the agents print is time-stamped as it arrives, and the recovery is split
into:

    detection        kill -> the first survivor's "communication failed" line
    restart          -> rank 0's "plan at start-up" line, less the search time: the agents
                     notice the failed workers (--monitor-interval), meet in a new
                     rendezvous round (last_call_timeout once MIN nodes are in), start
                     the workers (Python, torch and megatron-core imports), default group
    planning         the search at start-up (plan.search["time_s"] of the new plan)
    build + load     "plan at start-up" -> "resumed from ...": topology, stage, optimizer,
                     checkpoint read
    first iteration  "resumed from" -> the first iteration logged under the new plan

    python bench/elastic_recovery.py [--runs 3] [--iters 40]

Each run also prints the iterations lost (the re-plan's record in hpp-plans.jsonl: the
last iteration completed before the kill minus the checkpoint resumed).  Times are wall clock on a shared 2-core machine.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TYPES = ["cpu-fast", "cpu-fast", "cpu-slow", "cpu-slow"]
PHASES = ("detection", "restart", "planning", "build + load", "first iteration")


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(i: int, port: int, folder: Path, iters: int, lines: list):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", HPP_HOST=f"node-{i}", HPP_DEVICE_TYPE=TYPES[i],
               FLEET=str(ROOT / "examples" / "clusters" / "cpu-demo.yaml"), SAVE=str(folder / "ckpt"),
               RDZV_ENDPOINT=f"127.0.0.1:{port}", NNODES="3:4", MAX_RESTARTS="2", RUN_ID=f"bench-{port}",
               PYTHON=sys.executable)
    proc = subprocess.Popen(["bash", str(ROOT / "examples" / "slurm" / "elastic-node.sh"), "--model", "tiny",
                             "--global-batch-size", "16", "--fp32", "--hpp-profiles",
                             str(ROOT / "profiles" / "measured" / "cpu.json"), "--train-iters", str(iters),
                             "--save-interval", "5", "--distributed-timeout-minutes", "1"],
                            cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)

    def read():
        for line in proc.stdout:
            lines.append((time.monotonic(), i, line.rstrip("\n")))
    threading.Thread(target=read, daemon=True).start()
    return proc


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _first(lines, after: float, pattern: str):
    for t, _, line in list(lines):
        if t >= after and re.search(pattern, line):
            return t, line
    return None


def _reached(progress: Path) -> int:
    try:
        return json.loads(progress.read_text())["iteration"]
    except (OSError, ValueError, KeyError):
        return -1


def one_run(iters: int, kill_at: int, timeout: float = 300.0) -> dict:
    with tempfile.TemporaryDirectory(prefix="elastic-") as tmp:
        folder, port, lines = Path(tmp), _free_port(), []
        agents = [_start(0, port, folder, iters, lines)]
        time.sleep(1.0)
        agents += [_start(i, port, folder, iters, lines) for i in (1, 2, 3)]
        progress = folder / "ckpt" / "hpp-progress.json"
        start = time.monotonic()
        try:
            while _reached(progress) < kill_at:
                if time.monotonic() - start > timeout:
                    raise RuntimeError(f"iteration {kill_at} not reached in time")
                time.sleep(0.02)
            killed = time.monotonic()
            for pid in [agents[3].pid, *_children(agents[3].pid)]:
                os.kill(pid, signal.SIGKILL)
            for a in agents[:3]:
                a.wait(timeout=timeout)
        finally:
            for a in agents:
                if a.poll() is None:
                    for pid in [a.pid, *_children(a.pid)]:
                        os.kill(pid, signal.SIGKILL)
        history = [json.loads(x) for x in (folder / "ckpt" / "hpp-plans.jsonl").read_text().splitlines()]
        plan = json.loads((folder / "ckpt" / history[-1]["plan"]).read_text())
        detected, _ = _first(lines, killed, r"communication failed")
        planned, said = _first(lines, killed, r"^plan at start-up")
        loaded, _ = _first(lines, killed, r"^resumed from")
        first, _ = _first(lines, loaded, r"^iteration \d+/")
        search_s = 0.0 if history[-1]["reused"] else plan["search"]["time_s"]
        return {"detection": detected - killed, "restart": planned - detected - search_s,
                "planning": search_s, "build + load": loaded - planned, "first iteration": first - loaded,
                "total": first - killed, "lost": history[-1]["lost"], "said": said,
                "plans_ms": [h["predicted_ms"] for h in history]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--iters", type=int, default=40, help="--train-iters of each run")
    p.add_argument("--kill-at", type=int, default=12,
                   help="kill once rank 0 has recorded this iteration (checkpoints every 5)")
    args = p.parse_args(argv)
    load = " ".join(open("/proc/loadavg").read().split()[:3]) if os.path.exists("/proc/loadavg") else "?"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    print(f"# python bench/elastic_recovery.py {' '.join(argv if argv is not None else sys.argv[1:])}  "
          f"(commit {commit or '?'}, load average {load}, {os.cpu_count()} CPUs)")
    print(f"{'run':<5}" + "".join(f"{h:>17}" for h in PHASES) + f"{'total s':>10}{'lost it':>9}  plans (ms)")
    runs = []
    for k in range(args.runs):
        r = one_run(args.iters, args.kill_at)
        runs.append(r)
        print(f"{k:<5}" + "".join(f"{r[h]:>17.2f}" for h in PHASES) + f"{r['total']:>10.2f}{r['lost']:>9}  "
              + " -> ".join(f"{m:.1f}" for m in r["plans_ms"]))
        sys.stdout.flush()
    print(f"rank 0 at the last re-plan: {runs[-1]['said']}")
    if len(runs) > 1:
        print(f"{'median':<5}" + "".join(f"{statistics.median(r[h] for r in runs):>17.2f}" for h in PHASES)
              + f"{statistics.median(r['total'] for r in runs):>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
