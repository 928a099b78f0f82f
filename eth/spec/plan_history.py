"""Plans made at start-up (``pretrain_gpt.py --hpp-cluster``), kept beside the checkpoints
in the ``--save`` folder: the file names, reading the history and showing it
(``tools/show_plan.py --history DIR``).  The runtime writes them
(megatron/hpp/training/startup_plan.py)."""
from __future__ import annotations

import json
from pathlib import Path

from eth.errors import SpecError

PLAN_FILE = "hpp-plan.json"
"""The plan of the latest start."""
PLANS_DIR = "hpp-plans"
"""Every plan made at start-up, one file per (membership, request)."""
PROGRESS_FILE = "hpp-progress.json"
"""{"iteration": the last iteration a run planned at start-up completed}, rewritten by
rank 0 after every iteration: at the next start, the iterations lost are this minus
the iteration of the checkpoint resumed."""
HISTORY_FILE = "hpp-plans.jsonl"
"""One JSON line per start: time, membership ([host, device type, ranks] per node),
predicted iteration ms, whether a stored plan was reused, the plan's file, the
checkpoint iteration it resumes from and the iterations lost since it (None: unknown)."""


def read_history(folder) -> list[dict]:
    """The lines of :data:`HISTORY_FILE` in ``folder`` (none when it has none)."""
    path = Path(folder) / HISTORY_FILE
    if not path.exists():
        return []
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise SpecError(f"{path} line {n} is not JSON: {exc.msg}") from None
    return out


def describe_membership(nodes) -> str:
    """``2xcpu-fast on vm, 1xcpu-slow on vm`` of a membership."""
    return ", ".join(f"{n}x{t} on {h}" for h, t, n in nodes)


def format_history(folder) -> str:
    """One line per start in ``folder``: time, predicted ms, searched or reused, the
    membership and what changed since the previous start."""
    lines = read_history(folder)
    if not lines:
        raise SpecError(f"{Path(folder) / HISTORY_FILE} does not exist or is empty: no run planned at start-up "
                        f"(pretrain_gpt.py --hpp-cluster ... --save {folder}) has started there")
    out = [f"{'start':<4} {'time (UTC)':<20} {'ranks':>5} {'predicted ms':>12} {'plan':<9} {'resumes':>7} "
           f"{'lost':>5} membership"]
    previous = None
    for k, line in enumerate(lines):
        nodes = line["membership"]
        ranks = sum(n for _, _, n in nodes)
        change = ""
        if previous is not None and previous != nodes:
            change = "  [" + "; ".join(_changes(previous, nodes)) + "]"
        resumes, lost = line.get("resumes_at"), line.get("lost")
        out.append(f"{k:<4} {line['time']:<20} {ranks:>5} {line['predicted_ms']:>12.1f} "
                   f"{'reused' if line['reused'] else 'searched':<9} {'-' if resumes is None else resumes:>7} "
                   f"{'-' if lost is None else lost:>5} {describe_membership(nodes)}{change}")
        previous = nodes
    return "\n".join(out)


def _changes(before, after) -> list[str]:
    """What left, joined or changed its rank count between two memberships."""
    was = {(h, t): n for h, t, n in before}
    now = {(h, t): n for h, t, n in after}
    out = []
    gone = [f"{h} ({t})" for h, t in was if (h, t) not in now]
    new = [f"{h} ({t})" for h, t in now if (h, t) not in was]
    resized = [f"{h} ({t}) {was[h, t]} -> {now[h, t]} ranks" for h, t in now if (h, t) in was and was[h, t] != now[h, t]]
    if gone:
        out.append("left: " + ", ".join(gone))
    if new:
        out.append("joined: " + ", ".join(new))
    if resized:
        out.append(", ".join(resized))
    return out or ["same nodes, another rank order"]
