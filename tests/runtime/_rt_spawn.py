"""The one multi-process launcher of the runtime tests: N ranks of pretrain_gpt.py on gloo.

Each rank is a plain subprocess with RANK/WORLD_SIZE/MASTER_* set (cheaper than
torchrun), OMP_NUM_THREADS=1, a free port; every rank is killed on timeout so a
hang fails the test instead of blocking the suite.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass
class RankResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, args: list[str], timeout: float = 120.0,
           extra_env: dict | None = None, script: Path = REPO / "pretrain_gpt.py") -> list[RankResult]:
    """Run ``script args`` (default pretrain_gpt.py) as ``nproc`` ranks (``extra_env`` on
    every rank); returns every rank's result."""
    port = free_port()
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONWARNINGS="ignore", **(extra_env or {}))
        procs.append(subprocess.Popen([sys.executable, str(script), *args],
                                      cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout
    results = []
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1.0))
            results.append(RankResult(rank, proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.communicate()
        raise AssertionError(f"{nproc} ranks of {Path(script).name} {' '.join(args)} did not finish "
                             f"in {timeout:.0f} s")
    return results
