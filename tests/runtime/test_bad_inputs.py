"""Bad input a user meets, each ending in one line and exit code 2 before any work.

* The tools (in process, as their console scripts run them): an output path that cannot
  be written (``search_hpp -o``, ``preprocess_data --output-prefix``, ``profile_ops -o``,
  ``show_plan --png``) is refused before the search, the tokenizing or the measuring;
  ``show_plan --png out.jpg`` is refused instead of writing PNG bytes into a .jpg; a
  cluster with ``emulate_speed: 0`` is refused by name.
* ``pretrain_gpt.py`` through torchrun, as a user starts it (2 workers), one bad input
  from each phase of the checks (argparse, the plan and paths, the checkpoint): a
  mistyped flag, an unwritable ``--save``, a ``--load`` folder whose only checkpoint is
  damaged: each prints ``error: ...`` once (rank 0), as the first line of the output and
  before torchrun's report, and torchrun reports exit code 2 for every worker.  The
  other bad inputs of each phase are test_metrics_failures.py's, in process.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import _rt_plans as plans
from _rt_spawn import REPO
from eth.spec.plan import PipelinePlan

NO_PROC = not Path("/proc/self").is_dir()
CPU_PROFILES = str(REPO / "profiles" / "measured" / "cpu.json")
CLUSTER = str(REPO / "examples" / "clusters" / "cpu-demo.yaml")


def _one_error(capsys, code: int) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), (code, err)
    return err[0]


@pytest.mark.skipif(NO_PROC, reason="needs /proc (a folder no one can create files in)")
def test_tools_refuse_unwritable_outputs_before_working(tmp_path, capsys):
    from eth.cli import search_hpp, show_plan
    from megatron.hpp.cli import preprocess_data, profile_ops

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    plan = ["--model", "tiny", "--cluster", CLUSTER, "--profiles", CPU_PROFILES, "--precision", "fp32",
            "--gbs", "16", "--jobs", "1"]
    line = _one_error(capsys, search_hpp.main([*plan, "-o", "/proc/nope/plan.json"]))
    assert "-o /proc/nope/plan.json cannot be written: cannot create anything in /proc" in line
    assert capsys.readouterr().out == ""          # no search ran
    line = _one_error(capsys, search_hpp.main([*plan, "-o", str(blocker / "plan.json")]))
    assert f"{blocker} is a file, not a folder" in line
    text = REPO / "megatron" / "hpp" / "corpus" / "alice-in-wonderland.txt"
    line = _one_error(capsys, preprocess_data.main(["--input", str(text), "--output-prefix", "/proc/nope/x",
                                                    "--no-progress"]))
    assert line.startswith("error: --output-prefix /proc/nope/x.bin cannot be written")
    line = _one_error(capsys, profile_ops.main(["--model", "tiny", "--device-type", "cpu", "--mbs", "1",
                                                "--tp", "1", "-o", "/proc/nope/cpu.json", "--no-progress"]))
    assert "-o /proc/nope/cpu.json cannot be written" in line
    # a micro-batch no memory holds: one line naming it, nothing written (a torch traceback before)
    line = _one_error(capsys, profile_ops.main(["--model", "tiny", "--device-type", "cpu", "--mbs", "1000000000",
                                                "--tp", "1", "--repeats", "1", "-o", str(tmp_path / "huge.json"),
                                                "--no-progress"]))
    assert line.startswith("error: --mbs 1000000000 --tp 1: the ops do not fit in cpu memory (")
    assert line.endswith("give smaller --mbs") and not (tmp_path / "huge.json").exists()

    assert search_hpp.main([*plan, "-o", str(tmp_path / "plan.json")]) == 0
    capsys.readouterr()
    line = _one_error(capsys, show_plan.main([str(tmp_path / "plan.json"), "--png", str(tmp_path / "out.jpg")]))
    assert "the chart is a PNG image; give a file name ending in .png" in line and not (tmp_path / "out.jpg").exists()
    line = _one_error(capsys, show_plan.main([str(tmp_path / "plan.json"), "--png", "/proc/nope/g.png"]))
    assert "--png /proc/nope/g.png cannot be written" in line

    cluster = Path(CLUSTER).read_text().replace("emulate_speed: 0.25", "emulate_speed: 0")
    assert "emulate_speed: 0\n" in cluster or "emulate_speed: 0}" in cluster
    (tmp_path / "c0.yaml").write_text(cluster)
    line = _one_error(capsys, search_hpp.main([*plan[:2], "--cluster", str(tmp_path / "c0.yaml"), *plan[4:],
                                               "-o", str(tmp_path / "p0.json")]))
    assert "device_types.cpu-fast.emulate_speed is 0; an emulated type runs at a fraction of one core" in line


def _torchrun(args, cwd) -> tuple[int, list[str]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(REPO / "pretrain_gpt.py"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)
    return proc.returncode, (proc.stdout + proc.stderr).splitlines()


@pytest.mark.slow
@pytest.mark.skipif(NO_PROC, reason="needs /proc (a folder no one can create files in)")
def test_pretrain_bad_input_under_torchrun_is_one_line_and_exit_2_on_every_rank(tmp_path):
    plan = plans.make(2, [PipelinePlan(4, 8, [plans.stage([0], 1, 1, (0, 4))]),
                          PipelinePlan(4, 8, [plans.stage([1], 1, 1, (0, 4))])])
    plan.save(tmp_path / "p.json")
    broken = tmp_path / "broken" / "iter_0000004"
    broken.mkdir(parents=True)
    (broken / "common.json").write_text("{")
    (tmp_path / "broken" / "latest").write_text("iter_0000004\n")
    run = ["--hpp-plan", "p.json", "--train-iters", "2"]
    cases = [
        (["--save", "/proc/nope/ck"], "--save /proc/nope/ck cannot be written: cannot create anything in /proc"),
        (["--exit-signal-handlr"], "unrecognized arguments: --exit-signal-handlr (python pretrain_gpt.py --help"),
        (["--load", "broken"], "--load broken: no intact checkpoint: iter_0000004 is damaged (no manifest.json"),
    ]
    for extra, words in cases:
        code, lines = _torchrun([*run, *extra], tmp_path)
        ours = [line for line in lines if line.startswith("error")]
        assert code != 0 and len(ours) == 1 and words in ours[0], (extra, lines[:5])
        assert lines[0] == ours[0], (extra, lines[:5])         # before torchrun's report
        codes = re.findall(r"^\s+exitcode\s*:\s*(-?\d+)", "\n".join(lines), re.M)
        assert sorted(codes) == ["2", "2"], (extra, codes)
    # hpp-run (tools/run.py): the rank's one line and nothing else, exit 2
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "run.py"), "--standalone", "--nproc-per-node", "2",
                           str(REPO / "pretrain_gpt.py"), *run, "--save", "/proc/nope/ck"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout[-2000:]
    assert proc.stderr.splitlines() == ["error: --save /proc/nope/ck cannot be written: cannot create anything in "
                                        "/proc (No such file or directory)"], proc.stderr[-3000:]
