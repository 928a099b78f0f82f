"""examples/slurm: node.sh started once per "node" (two on this machine, as srun would on
two hosts) trains the CPU demo plan over a static torchrun rendezvous; the launch
helper's host/rank arithmetic and its one-line errors."""
import json
import os
import re
import subprocess
import sys

import pytest

from _rt_spawn import REPO, free_port
from eth.spec.plan import load_plan
from megatron.hpp.parallel.launch import main as launch_main

PLAN = "examples/plans/cpu-demo.json"


def _two_nodes(tmp_path, port: int):
    env = dict(os.environ, PLAN=PLAN, HPP_HOSTS="nodeA,nodeB", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), PYTHON=sys.executable, OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    procs = [subprocess.Popen(["bash", str(REPO / "examples" / "slurm" / "node.sh"), "--train-iters", "2"],
                              env=dict(env, HPP_HOST=host), cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for host in ("nodeB", "nodeA")]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return procs, outs


@pytest.mark.slow
def test_node_sh_trains_a_plan_over_two_nodes(tmp_path):
    # torchrun's static rendezvous binds MASTER_PORT itself, so the port cannot be held for
    # it; when another process took the port in between, try again on a new one.
    for _ in range(3):
        procs, outs = _two_nodes(tmp_path, free_port())
        if not any("address already in use" in err.lower() for _, err in outs):
            break
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    log = outs[1][0]  # node 0 holds rank 0, which logs
    pipes = len(load_plan(REPO / PLAN).pipelines)
    assert f"with {pipes} pipeline(s) on 4 ranks" in log
    assert re.search(r"^iteration 2/2 \|.* loss \d", log, re.M), log


def test_sbatch_script_parses():
    proc = subprocess.run(["bash", "-n", str(REPO / "examples" / "slurm" / "hpp.sbatch")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_launch_helper(capsys):
    assert launch_main(["order", "--plan", str(REPO / PLAN), "--hosts", "a,b"]) == 0
    assert capsys.readouterr().out == ("a: node 0, cpu-fast x 2, ranks 0-1\n"
                                       "b: node 1, cpu-slow x 2, ranks 2-3\n")
    assert launch_main(["node", "--plan", str(REPO / PLAN), "--hosts", "a.cluster,b.cluster",
                        "--host", "b"]) == 0
    assert capsys.readouterr().out == ("HPP_LEFT_OUT=0 NNODES=2 NODE_RANK=1 NPROC_PER_NODE=2 WORLD_SIZE=4 "
                                       "MASTER_HOST=a.cluster\n")
    assert launch_main(["node", "--plan", str(REPO / PLAN), "--hosts", "a,b", "--host", "c"]) == 2
    assert capsys.readouterr().err == "error: host c is not in --hosts a,b\n"
    assert launch_main(["order", "--plan", str(REPO / PLAN), "--hosts", "a,b,c"]) == 2
    assert capsys.readouterr().err.startswith("error: --hosts names 3 hosts, the plan's cluster has 2 nodes")
    assert launch_main(["order", "--plan", str(REPO / PLAN), "--hosts", "a,a"]) == 2
    assert "names a host twice" in capsys.readouterr().err


def test_launch_helper_starts_only_the_nodes_a_fleet_uses(tmp_path, capsys):
    # the demo plan as if chosen from a cluster file of 1 cpu-fast node and 3 cpu-slow
    # nodes (of which it uses 1): hosts a | b, c, d; c and d are left out
    data = json.loads((REPO / PLAN).read_text())
    data["search"]["fleet"] = {"groups": [{"type": "cpu-fast", "zone": "", "devices_per_node": 2, "available": 1,
                                           "used": 1},
                                          {"type": "cpu-slow", "zone": "", "devices_per_node": 2, "available": 3,
                                           "used": 1}]}
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(data))
    assert launch_main(["order", "--plan", str(plan), "--hosts", "a,b,c,d"]) == 0
    assert capsys.readouterr().out == ("a: node 0, cpu-fast x 2, ranks 0-1\n"
                                       "b: node 1, cpu-slow x 2, ranks 2-3\n"
                                       "c: not in the plan (its fleet leaves the node out)\n"
                                       "d: not in the plan (its fleet leaves the node out)\n")
    assert launch_main(["node", "--plan", str(plan), "--hosts", "a,b,c,d", "--host", "d"]) == 0
    assert capsys.readouterr().out.startswith("HPP_LEFT_OUT=1 ")
    # node.sh on a host left out: a line and exit 0, no torchrun
    env = dict(os.environ, PLAN=str(plan), HPP_HOSTS="a,b,c,d", HPP_HOST="c", PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(REPO / "examples" / "slurm" / "node.sh")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "c: not in the plan (its fleet leaves this node out)\n", proc.stderr
    # as many hosts as the plan's own nodes: as before
    assert launch_main(["order", "--plan", str(plan), "--hosts", "a,b"]) == 0
    assert "c:" not in capsys.readouterr().out
