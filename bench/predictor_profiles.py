"""The profiling side of bench/predictor_accuracy.py: the start profile, the gloo
collective tables, the adjacent re-profiles around each run and what is read from them
(host drift, the concurrency ratios), and the profile variants the bench predicts from
for comparison (without overheads, without collective tables).  Every profile is taken
by ``tools/profile_ops.py`` in a subprocess, one process per rank, as a user takes it."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from run_context import loadavg

ROOT = Path(__file__).resolve().parents[1]


def profile_cpu(path: Path, mbs="1,2,4,8,16", tp="1,2", repeats=20, real_tp=True) -> str:
    cmd = [sys.executable, str(ROOT / "tools" / "profile_ops.py"), "--model", "tiny", "--device-type", "cpu",
           "--mbs", mbs, "--tp", tp, "--repeats", str(repeats)] + (["--real-tp"] if real_tp else []) + [
           "--no-progress", "-o", str(path)]
    subprocess.run(cmd, check=True, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL)
    return shlex.join(["python", "tools/profile_ops.py"] + cmd[2:-1] + [f"<tmp>/{path.name}"])


COLLECTIVE_SIZES = "64,1024,16384,65536,262144"
"""Message sizes (bytes) of the collective tables: the step's few-float all-reduces and the
stage-boundary activations (16-64 KiB) of the tiny GPT."""


def profile_collectives(path: Path, world: int, repeats=20) -> str:
    """Adds measured gloo collective tables over 2..``world`` ranks to the profile at
    ``path`` (``tools/profile_ops.py --collectives-only`` under torchrun)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           str(ROOT / "tools" / "profile_ops.py"), "--device-type", "cpu", "--collectives-only",
           "--collective-sizes", COLLECTIVE_SIZES, "--repeats", str(repeats), "-o", str(path)]
    subprocess.run(cmd, check=True, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return shlex.join(["torchrun", "--standalone", "--nproc-per-node", str(world), "tools/profile_ops.py"]
                      + cmd[7:-1] + [f"<tmp>/{path.name}"])


def copy_collectives(src: Path, dst: Path) -> None:
    """The collective tables of profile ``src`` into profile ``dst`` (the adjacent op
    profiles get the start profile's: they re-measure the ops only)."""
    from eth.profiles.db import save_profile

    tables = json.loads(src.read_text()).get("collectives")
    if tables:
        save_profile(dict(json.loads(dst.read_text()), collectives=tables), dst)


def _without_collectives(path: Path):
    """The profile at ``path`` without its measured collective tables (the cost model's
    alpha-beta collectives and one-process step time, as before they were measured)."""
    from eth.profiles.db import load_profile

    data = dict(load_profile(path).data)
    data.pop("collectives", None)
    return _db(data)


def plan_shapes(plan) -> tuple[str, str]:
    """(mbs list, tp list) of the (samples per replica, tp) the plan's stages run at."""
    micro = sorted({p.mbs // st.dp for p in plan.pipelines for st in p.stages})
    tps = sorted({st.tp for p in plan.pipelines for st in p.stages})
    return ",".join(map(str, micro)), ",".join(map(str, tps))


def _without_overheads(path: Path):
    """The profile at ``path`` without its entries' ``overhead_ms`` (the cost model as it
    was before the profiler measured the runtime's overheads)."""
    from eth.profiles.db import load_profile

    data = json.loads(json.dumps(load_profile(path).data))
    for m in data["models"]:
        for e in m["entries"]:
            e.pop("overhead_ms", None)
    return _db(data)


def _db(data: dict):
    """A ProfileDB of the one profile ``data``."""
    from eth.profiles.db import DeviceProfile, ProfileDB

    return ProfileDB({data["device"]: DeviceProfile(data)})


def host_drift(start: Path, adjacent: Path) -> float:
    """Host speed change between the two cpu profiles: the adjacent profile's op times
    (fwd + bwd, summed over the ops of every (mbs, tp) entry it has) / the start profile's
    at the same entries (> 1: the host computes more slowly now)."""
    from eth.spec.model import get_model
    from eth.profiles.db import ProfileDB

    model = get_model("tiny")
    a, b = ProfileDB.load(start).get("cpu"), ProfileDB.load(adjacent).get("cpu")
    num = den = 0.0
    for e in next(m for m in b.data["models"] if m["name"] == "tiny")["entries"]:
        ops_b, _ = b.layer_costs(model, e["mbs"], e["tp"])
        ops_a, _ = a.layer_costs(model, e["mbs"], e["tp"])
        num += sum(c.fwd_ms + c.bwd_ms for c in ops_b.values())
        den += sum(c.fwd_ms + c.bwd_ms for c in ops_a.values())
    return num / den


def mean_prediction(a: dict, b: dict) -> dict:
    """The mean of two :func:`predict` results (from the profiles taken right before and
    right after a run: the host's drift during the run is then half in each)."""
    return {"iteration_ms": (a["iteration_ms"] + b["iteration_ms"]) / 2,
            "compute_ms": [(x + y) / 2 for x, y in zip(a["compute_ms"], b["compute_ms"])],
            "memory_bytes": [(x + y) / 2 for x, y in zip(a["memory_bytes"], b["memory_bytes"])]}


LOCAL_OPS = ("1st-layernorm", "softmax", "2nd-layernorm", "gelu")
"""tp 2 ops without any tp collective in their forward or backward (no sequence parallelism)."""
COMM_OPS = ("embedding", "qkv", "attn-dense", "mlp-gemm-1", "mlp-gemm-2", "head+loss")
"""tp 2 ops with a tp collective in their forward or backward."""


def concurrency_ratios(real: Path, fake: Path, mbs: int) -> dict:
    """Op times (fwd + bwd) at (mbs, tp 2) of a ``--real-tp`` profile (2 processes
    computing at once, one per core, on a real gloo group) / a fake-group profile (one
    process): over :data:`LOCAL_OPS` the slowdown of compute when the other core computes
    too (no communication in them), over :data:`COMM_OPS` that and the tp collectives."""
    from eth.spec.model import get_model
    from eth.profiles.db import ProfileDB

    model = get_model("tiny")
    r, f = (ProfileDB.load(p).get("cpu").layer_costs(model, mbs, 2)[0] for p in (real, fake))
    def ratio(ops):
        return sum(r[o].fwd_ms + r[o].bwd_ms for o in ops) / sum(f[o].fwd_ms + f[o].bwd_ms for o in ops)

    return {"local_ops": ratio(LOCAL_OPS), "comm_ops": ratio(COMM_OPS)}


def concurrency_line(profile: Path, tmp: Path) -> tuple:
    """(line, ratios, command): the start profile's tp 2 shard (``--real-tp``) against the
    same shard profiled in one process on a fake group right after it."""
    load = loadavg()
    fake = tmp / "cpu-fake-tp.json"
    cmd = profile_cpu(fake, "4", "2", real_tp=False) + f"   # load {load} -> {loadavg()}"
    conc = concurrency_ratios(profile, fake, 4)
    line = (f"concurrency (mbs 4, tp 2): real-group / one-process op times: ops without tp collectives "
            f"({', '.join(LOCAL_OPS)}) {conc['local_ops']:.2f}, ops with them ({', '.join(COMM_OPS)}) "
            f"{conc['comm_ops']:.2f}; one-process profile: `{cmd}`")
    return line, conc, cmd


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env
