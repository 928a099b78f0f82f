"""The one multi-process launcher of the runtime tests: N ranks of pretrain_gpt.py on gloo.

The ranks are forked from one template process that has imported torch and
megatron-core (``_rt_ranks.py``), with RANK/WORLD_SIZE/MASTER_* set and
OMP_NUM_THREADS=1; the template and every rank are killed at the deadline, so a hang
fails the test instead of blocking the suite.

Ports: the launching process hosts the rendezvous store itself, on a port the OS picks
while binding it (:func:`rendezvous_store`, port 0), and keeps it bound until the ranks
are done; the ranks join it as clients (``TORCHELASTIC_USE_AGENT_STORE=True``: torch's
``env://`` rendezvous then connects instead of binding, as under torchrun's agent).
No port is released and re-bound, so concurrent launches cannot take each other's port.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
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
           extra_env: dict | None = None, script: Path = REPO / "pretrain_gpt.py",
           preload: bool = True) -> list[RankResult]:
    """Run ``script args`` (pretrain_gpt.py by default) as ``nproc`` ranks (``extra_env``
    on every rank) with a deadline of ``timeout`` seconds; returns every rank's result.
    The ranks are forked from one process that has imported torch and megatron-core
    (``_rt_ranks.py``), so they do not each pay for the imports; ``preload=False`` for
    ranks that end before they would import them (bad input)."""
    with rendezvous() as meet, tempfile.TemporaryDirectory(prefix="ranks-") as out:
        env = dict(os.environ, WORLD_SIZE=str(nproc), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                   HPP_TEST_PRELOAD="1" if preload else "0", **meet, **(extra_env or {}))
        proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("_rt_ranks.py")), str(nproc), out,
                                 str(script), *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            template, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)   # the template and every rank it forked
            proc.communicate()
            raise AssertionError(f"{nproc} ranks of {script.name} {' '.join(args)} did not finish "
                                 f"in {timeout:.0f} s") from None
        codes = Path(out) / "codes.json"
        if proc.returncode != 0 or not codes.is_file():
            raise AssertionError(f"the rank template failed (exit {proc.returncode}):\n{template[-3000:]}")
        code = {int(r): c for r, c in json.loads(codes.read_text()).items()}
        return [RankResult(r, code[r], (Path(out) / f"rank{r}.out").read_text(),
                           (Path(out) / f"rank{r}.err").read_text()) for r in range(nproc)]
