"""The one multi-process launcher of the runtime tests: N ranks of pretrain_gpt.py on gloo.

Each rank is a plain subprocess with RANK/WORLD_SIZE/MASTER_* set (cheaper than
torchrun) and OMP_NUM_THREADS=1; every rank is killed at the deadline so a hang fails
the test instead of blocking the suite.

Ports: the launching process hosts the rendezvous store itself, on a port the OS picks
while binding it (:func:`rendezvous_store`, port 0), and keeps it bound until the ranks
are done; the ranks join it as clients (``TORCHELASTIC_USE_AGENT_STORE=True``: torch's
``env://`` rendezvous then connects instead of binding, as under torchrun's agent).
No port is released and re-bound, so concurrent launches cannot take each other's port.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

LAUNCH_TIMEOUT_S = 300.0
"""Deadline of one launch.  The 7-rank plan takes 26 s on an idle 2-core machine and
57 s with the cores busy; the deadline only has to catch hangs."""


@dataclass
class RankResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str


def free_port() -> int:
    """A port that was free a moment ago.  Racy (another process may take it before it is
    bound again): multi-process launches use :func:`rendezvous` instead."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous_store():
    """A TCPStore server on 127.0.0.1 at a port the OS chooses as it binds (port 0)."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


@contextmanager
def rendezvous():
    """Environment for ranks that meet through ``env://``: the store lives (bound) in this
    process until the block ends."""
    store = rendezvous_store()
    try:
        yield {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
               "TORCHELASTIC_USE_AGENT_STORE": "True"}
    finally:
        del store


def launch(nproc: int, args: list[str], timeout: float = LAUNCH_TIMEOUT_S,
           extra_env: dict | None = None, script: Path = REPO / "pretrain_gpt.py") -> list[RankResult]:
    """Run ``script args`` (pretrain_gpt.py by default) as ``nproc`` ranks (``extra_env``
    on every rank) with a deadline of ``timeout`` seconds; returns every rank's result."""
    with rendezvous() as meet:
        procs = []
        for rank in range(nproc):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                       OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **meet, **(extra_env or {}))
            procs.append(subprocess.Popen([sys.executable, str(script), *args], cwd=REPO, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
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
            raise AssertionError(f"{nproc} ranks of {script.name} {' '.join(args)} did not finish "
                                 f"in {timeout:.0f} s") from None
    return results
