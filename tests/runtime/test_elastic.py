"""Elastic run (docs/RUNTIME.md, "Elastic runs"): the CPU demo cluster as four torchrun
agents of one process each (examples/slurm/elastic-node.sh once per "node", c10d
rendezvous on localhost, --nnodes 3:4 --max-restarts 2), planning at start-up
(--hpp-cluster) and resuming from the --save folder.  One agent is killed (-9) mid-run: the three survivors re-rendezvous,
re-plan (another plan, recorded), resume from the last checkpoint; then the fourth
agent starts again: the agents stop their workers (SIGTERM: --exit-signal-handler saves),
and four ranks go on under the first plan, used again.  The losses and parameters of
the last part equal a single-process run of the same iterations."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eth.spec.model import get_model
from eth.spec.plan_history import HISTORY_FILE, PROGRESS_FILE, format_history

from _rt_reference import train_reference
from _rt_spawn import REPO, free_port

TYPES = ["cpu-fast", "cpu-fast", "cpu-slow", "cpu-slow"]
ITERS = 80
DEADLINE_S = 420.0


def _agent(i: int, port: int, tmp_path):
    """Agent i: examples/slurm/elastic-node.sh as srun would start it on node i."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", HPP_HOST=f"node-{i}",
               HPP_DEVICE_TYPE=TYPES[i], FLEET=str(REPO / "examples" / "clusters" / "cpu-demo.yaml"),
               SAVE=str(tmp_path / "ckpt"), RDZV_ENDPOINT=f"127.0.0.1:{port}", NNODES="3:4", MAX_RESTARTS="2",
               RUN_ID="hpp-elastic-test", RDZV_CONF="last_call_timeout=2,join_timeout=120", MONITOR_INTERVAL="0.5",
               PYTHON=sys.executable)
    log = open(tmp_path / f"agent{i}-{time.monotonic_ns()}.log", "w")
    cmd = ["bash", str(REPO / "examples" / "slurm" / "elastic-node.sh"), "--model", "tiny",
           "--global-batch-size", "16", "--fp32", "--hpp-profiles", str(REPO / "profiles" / "measured" / "cpu.json"),
           "--train-iters", str(ITERS), "--save-interval", "5", "--distributed-timeout-minutes", "1",
           "--save-params", str(tmp_path / "params.pt")]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (torchrun starts each worker in its own session)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _wait(what, test, start):
    while not test():
        if time.monotonic() - start > DEADLINE_S:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _latest(tmp_path) -> int:
    path = tmp_path / "ckpt" / "latest"
    return int(path.read_text().strip().split("_")[-1]) if path.exists() else -1


def _history(tmp_path) -> list[dict]:
    path = tmp_path / "ckpt" / HISTORY_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


LAUNCHER_FAILURE = re.compile(r"torch\.distributed\.DistStoreError|RendezvousConnectionError|"
                              r"c10d.*(Broken pipe|Connection reset by peer)")
"""A rendezvous store connection torchrun's agents lost (seen at load ~16 on 2 cores): the
launcher's, not the code's; the test runs once more on it, and only on it."""


def _run(tmp_path):
    """Start four agents, kill one after the first checkpoints, start it again; the
    agents, their logs and the iteration the killed rank had reached."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    port, start = free_port(), time.monotonic()
    agents = {0: _agent(0, port, tmp_path)}
    time.sleep(1.0)                      # agent 0 hosts the rendezvous store: it must outlive the others
    agents.update({i: _agent(i, port, tmp_path) for i in (1, 2, 3)})
    try:
        _wait("the first checkpoints", lambda: _latest(tmp_path) >= 10, start)
        for pid in [agents[3].pid, *_children(agents[3].pid)]:   # the agent and its worker, no goodbye
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)                   # the survivors cannot pass the iteration in progress
        killed_at = json.loads((tmp_path / "ckpt" / PROGRESS_FILE).read_text())["iteration"]
        agents[3].wait()
        _wait("training on three ranks", lambda: len(_history(tmp_path)) >= 2 and _latest(tmp_path) >= 20, start)
        agents[3] = _agent(3, port, tmp_path)            # the node is back
        for i, a in agents.items():
            a.wait(timeout=max(1.0, DEADLINE_S - (time.monotonic() - start)))
    finally:
        for a in agents.values():
            if a.poll() is None:
                for pid in [a.pid, *_children(a.pid)]:
                    os.kill(pid, signal.SIGKILL)
    logs = "\n".join(p.read_text() for p in sorted(tmp_path.glob("agent*.log")))
    return agents, logs, killed_at


@pytest.mark.slow
def test_agents_die_and_rejoin_and_the_run_replans_resumes_and_matches_one_process(tmp_path):
    agents, logs, killed_at = _run(tmp_path / "try1")
    if any(a.returncode != 0 for a in agents.values()) and LAUNCHER_FAILURE.search(logs):
        agents, logs, killed_at = _run(tmp_path / "try2")
    tmp_path = tmp_path / ("try2" if (tmp_path / "try2").exists() else "try1")
    assert all(a.returncode == 0 for a in agents.values()), logs[-6000:]
    nodes = [[f"node-{i}", TYPES[i], 1] for i in range(4)]
    lines = _history(tmp_path)
    # the rendezvous admits nodes in any order: the sets, not the rank orders
    assert [sorted(line["membership"]) for line in lines] == [nodes, nodes[:3], nodes], lines
    assert [line["reused"] for line in lines] == [False, False, True]
    assert lines[0]["plan"] == lines[2]["plan"] != lines[1]["plan"]
    assert lines[1]["predicted_ms"] != lines[0]["predicted_ms"]     # another plan for three ranks
    shown = format_history(tmp_path / "ckpt").splitlines()
    assert shown[2].endswith("[left: node-3 (cpu-slow)]") and shown[3].endswith("[joined: node-3 (cpu-slow)]")
    said = [line for line in logs.splitlines() if line.startswith("plan at start-up")]
    assert len(said) == 3 and "(the last start had " in said[1], said
    assert all(f"on node-{i}" in said[1].split("(the last start had ", 1)[1] for i in range(4)), said
    assert "the stored plan for this membership" in said[2]
    resumed = [int(m) for m in re.findall(r"resumed from \S+ at iteration (\d+)", logs)]
    assert len(resumed) == 2 and 10 <= resumed[0] < resumed[1] < ITERS, resumed
    assert [line["resumes_at"] for line in lines] == [None, *resumed]
    assert lines[1]["lost"] == killed_at - resumed[0] and lines[2]["lost"] == 0, (lines, killed_at)
    assert f"; {lines[1]['lost']} iteration(s) since the last checkpoint lost" in said[1]
    assert re.search(rf"SIGTERM received: stopped after iteration {resumed[1]}, checkpoint in", logs)
    got = torch.load(tmp_path / "params.pt")
    ref_losses, ref_params = train_reference(get_model("tiny"), 16, ITERS)
    assert got["losses"] == pytest.approx(ref_losses[resumed[1]:], abs=1e-5)
    worst = max((got["params"][k] - ref_params[k]).abs().max().item() for k in ref_params)
    # 80 AdamW steps in fp32 under three plans (the 8-step resume tests hold 1e-5): 1.6e-5 measured
    assert worst < 3e-5, f"largest parameter difference {worst:.3g}"
