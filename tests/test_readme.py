"""README "Using it": every command names a script that exists and flags it accepts, and
the training command starts as many processes as its plan has ranks (the old README
trained a 64-rank plan on 4 processes).  The commands themselves were run by hand; the
slow ones (search, training) are covered by their own tests."""
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Using it", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    cmds, cur = [], ""
    for line in block.splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        cur = f"{cur} {s.rstrip(chr(92)).strip()}".strip()
        if not s.endswith("\\"):
            cmds.append(shlex.split(cur))
            cur = ""
    return cmds


def split_env(cmd) -> tuple[dict, list[str]]:
    """The leading ``NAME=value`` assignments of a command and the command after them."""
    env = {}
    while cmd and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", cmd[0]):
        name, value = cmd[0].split("=", 1)
        env[name] = value
        cmd = cmd[1:]
    return env, cmd


LAUNCHERS = ("torchrun", "hpp-run")
"""torch's launcher, and ours (megatron/hpp/cli/run.py: its arguments, failures in one line)."""


def _flags(cmd):
    return [a.split("=")[0] for a in cmd if a.startswith("-") and not re.fullmatch(r"-\d.*", a)]


def _help(cmd) -> str:
    if cmd[0] in LAUNCHERS:
        cmd = ["python", *cmd[cmd.index("pretrain_gpt.py"):]]
    argv = [sys.executable, *cmd[1:3]] if cmd[1] == "-m" else [sys.executable, cmd[1]]
    proc = subprocess.run(argv + ["--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (cmd, proc.stderr[-1000:])
    return proc.stdout


@pytest.fixture(scope="module")
def commands():
    cmds = readme_commands()
    assert cmds[0] == [".", ".venv/bin/activate"] and len(cmds) >= 9
    return cmds[1:]


def test_every_command_exists_and_takes_its_flags(commands):
    for cmd in commands:
        _, cmd = split_env(cmd)
        assert cmd[0] in ("python", *LAUNCHERS), cmd
        if cmd[0] == "python" and cmd[1] != "-m":
            assert (ROOT / cmd[1]).is_file(), cmd
        usage = _help(cmd)
        for flag in _flags(cmd[cmd.index("pretrain_gpt.py"):] if cmd[0] in LAUNCHERS else cmd[2:]):
            assert flag in usage, (flag, cmd)


def test_training_command_matches_its_plan(commands):
    from eth.spec.cluster import load_cluster

    runs = [split_env(c) for c in commands if split_env(c)[1][0] in LAUNCHERS]
    assert runs
    for env, train in runs:
        nproc = int(train[train.index("--nproc-per-node") + 1])
        if "--hpp-cluster" in train:      # planned at start-up: one device type per process given
            fleet = load_cluster(ROOT / train[train.index("--hpp-cluster") + 1])
            types = env["HPP_DEVICE_TYPE"].split(",")
            assert len(types) == nproc and set(types) <= set(fleet.types), (types, train)
            continue
        plan = train[train.index("--hpp-plan") + 1]
        (search,) = [c for c in commands if "search_hpp.py" in c[1] and c[c.index("-o") + 1] == plan]
        cluster = load_cluster(ROOT / search[search.index("--cluster") + 1])
        assert cluster.world_size == nproc
    for cmd in commands:  # every file a command reads is shipped or written by an earlier one
        for flag in ("--cluster", "--profiles", "--input", "--hpp-cluster", "--hpp-profiles"):
            if flag in cmd:
                assert (ROOT / cmd[cmd.index(flag) + 1]).exists(), (flag, cmd)
