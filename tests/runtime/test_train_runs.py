"""pretrain_gpt.py end to end, several checks per launch:

* ``--data-path`` (the shipped corpus) on a 4-rank plan with uneven lbs and a dp 2
  stage trains exactly the samples of megatron-core's GPTDataset: losses and final
  parameters equal a single-process reference fed by the same dataset, and so does the
  validation loss (``--eval-interval``) on the validation split; the same run's
  rank-0 log carries every interval field, and the plan's (far too small) predicted
  iteration time gives one stale-profile warning;
* one process without torchrun (no RANK/WORLD_SIZE/MASTER_*) on a 1-rank plan starts,
  and ``--lr 1e30`` makes the loss NaN: the run stops after --max-nan-iters
  consecutive NaN iterations with one error line and exit 1, the last log line shows
  them;
* a killed rank ends every other rank with exit 1 and one line; a stopped (stuck) rank
  ends its peer when --distributed-timeout-minutes runs out.
"""
from __future__ import annotations

import importlib
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

import _rt_plans as plans
import _rt_reference
from _rt_spawn import REPO, launch, rendezvous
from eth.spec.plan import PipelinePlan
from megatron.hpp.data.batches import SyntheticData, batch
from megatron.hpp.data.datasets import DataConfig, build_sources, shipped_corpus

pytestmark = pytest.mark.slow   # gloo launches: `make test-fast` leaves them out

ITERS = 3
TOL = 1e-5
FIELDS = ("consumed samples", "loss", "grad norm", "lr", "time", "samples/s", "tokens/s",
          "TFLOP/s/device", "compute ms p0", "bubble ms p0", "peak mem", "skipped", "nan")


def _field(line: str, name: str) -> str:
    return re.search(rf"\| {re.escape(name)} ([^|]+?)(?: \||$)", line).group(1)


def test_corpus_run_matches_reference_and_logs(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    plan = plans.uneven_lbs_different_mbs()      # lbs 10 / 6, mbs 5 / 2, a dp 2 stage
    plan.predicted = {"iteration_ms": 0.001}     # nothing runs that fast: a stale profile
    plan.save(tmp_path / "plan.json")
    out = tmp_path / "params.pt"
    results = launch(plan.world_size, ["--hpp-plan", str(tmp_path / "plan.json"), "--train-iters", str(ITERS),
                                       "--log-interval", "2", "--data-path", shipped_corpus(),
                                       "--save-params", str(out), "--tensorboard-dir", str(tmp_path / "tb"),
                                       "--eval-interval", "2", "--eval-iters", "2"],
                     extra_env={"XDG_CACHE_HOME": str(tmp_path / "xdg")})
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exit {r.returncode}:\n{r.stderr[-3000:]}"
    # the reference reads the same dataset (built here without a process group)
    sources = build_sources(DataConfig((shipped_corpus(),), plan.model.seq_len, plan.model.vocab, 1234),
                            plan.gbs, ITERS, valid_iters=4, progress=False)
    source = sources.train
    monkeypatch.setattr(_rt_reference, "SyntheticData", lambda vocab, seq_len, seed: source)
    ref_losses, ref_params = _rt_reference.train_reference(plan.model, plan.gbs, ITERS)
    saved = torch.load(out)
    assert saved["losses"] == pytest.approx(ref_losses, abs=TOL), (saved["losses"], ref_losses)
    _rt_reference.assert_same_params(saved["params"], ref_params, TOL)
    # validation after iterations 2 and 3 (the last): valid batches 0-1 and 2-3, each equal
    # to the reference's forward loss on those batches with its weights at that iteration
    # (evaluation.first_batch: reading the next interval's batches would fail here)
    assert sorted(saved["valid"]) == [2, 3]
    _, params_at_2 = _rt_reference.train_reference(plan.model, plan.gbs, 2)
    with torch.no_grad():
        ref_valid, ref_valid_2 = (sum(_rt_reference.forward_loss(plan.model, params, batch(sources.valid, it, 0,
                                                                                          plan.gbs))
                                      for it in its).item() / 2
                                  for params, its in ((ref_params, (2, 3)), (params_at_2, (0, 1))))
    assert saved["valid"][3] == pytest.approx(ref_valid, abs=TOL)
    assert saved["valid"][2] == pytest.approx(ref_valid_2, abs=TOL)
    valid_lines = [line for line in results[0].stdout.splitlines() if line.startswith("validation")]
    assert [line.split(" |")[0] for line in valid_lines] == ["validation loss at iteration 2",
                                                             "validation loss at iteration 3"]
    assert float(_field(valid_lines[1], "lm loss")) == pytest.approx(ref_valid, abs=1e-5)
    # text, not the synthetic arithmetic sequences (which would give other losses)
    assert not batch(source, 0, 0, plan.gbs).equal(batch(SyntheticData(256, 32, 1234), 0, 0, plan.gbs))

    log = [line for line in results[0].stdout.splitlines() if line.startswith("iteration")]
    assert [line.split(" |")[0] for line in log] == ["iteration 2/3", "iteration 3/3"]
    for line in log:
        for name in FIELDS:
            assert f"| {name} " in line, (name, line)
        assert "compute ms p0 " in line and ", p1 " in _field(line, "compute ms")  # two pipelines
    first, last = log
    assert _field(first, "consumed samples") == "32" and _field(last, "consumed samples") == "48"
    # interval averages: iteration 3's line is iteration 3 alone
    assert float(_field(last, "loss")) == pytest.approx(ref_losses[2], abs=1e-4)
    assert float(_field(first, "loss")) == pytest.approx(sum(ref_losses[:2]) / 2, abs=1e-4)
    time_ms = float(_field(last, "time").split()[0])
    bubble = [float(x.split()[1]) for x in _field(last, "bubble ms").split(", ")]
    compute = [float(x.split()[1]) for x in _field(last, "compute ms").split(", ")]
    assert all(b == pytest.approx(time_ms - c, abs=0.11) for b, c in zip(bubble, compute))
    samples_per_s = float(_field(last, "samples/s"))
    assert samples_per_s == pytest.approx(plan.gbs / (time_ms / 1e3), rel=0.01)
    assert "(plan 0.0 ms)" in last and float(_field(last, "skipped")) == 0 and _field(last, "nan") == "0"
    stale = [line for line in results[0].stderr.splitlines() if "profile may be stale" in line]
    assert len(stale) == 1 and "re-run tools/profile_ops.py" in stale[0], results[0].stderr
    assert not any("profile may be stale" in r.stderr or "iteration" in r.stdout for r in results[1:])
    try:
        importlib.import_module("torch.utils.tensorboard")
    except ImportError:
        notes = [line for line in results[0].stderr.splitlines() if "tensorboard" in line]
        assert notes == [f"note: --tensorboard-dir {tmp_path / 'tb'} ignored: the tensorboard package is "
                         f"not installed (pip install tensorboard)"]
    else:
        assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())


def _bare_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "TORCHELASTIC_USE_AGENT_STORE")}
    return dict(env, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra)


def one_rank_plan():
    return plans.make(1, [PipelinePlan(4, 16, [plans.stage([0], 1, 1, (0, 4))])])


def test_one_process_without_torchrun_and_nan_stops(tmp_path):
    one_rank_plan().save(tmp_path / "one.json")
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", "--hpp-plan", str(tmp_path / "one.json"),
                           "--train-iters", "20", "--lr", "1e30", "--log-interval", "10",
                           "--data-path", shipped_corpus()],
                          cwd=REPO, env=_bare_env(XDG_CACHE_HOME=str(tmp_path / "xdg")),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    # iteration 1 is finite (its update makes the weights ~1e30); 2, 3, 4 are NaN
    assert errors == ["error: training diverged: loss nan, grad norm nan in 3 consecutive iteration(s) "
                      "(iterations 2-4; --max-nan-iters 3); the weights were not updated by them; "
                      "lower --lr, raise --warmup or check the data"], proc.stderr
    log = [line for line in proc.stdout.splitlines() if line.startswith("iteration")]
    assert len(log) == 1 and log[0].startswith("iteration 4/20 |"), proc.stdout   # flushed at the stop
    assert _field(log[0], "nan") == "3" and _field(log[0], "skipped") == "0"
    assert float(_field(log[0], "loss")) > 0     # the mean over the one finite iteration


def _start(nproc: int, args: list, meet: dict) -> list:
    return [subprocess.Popen([sys.executable, "pretrain_gpt.py", *args], cwd=REPO,
                             env=dict(_bare_env(), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), **meet),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(nproc)]


def _after_iteration(proc, n: int) -> None:
    """Read rank 0's log until iteration ``n`` was logged (the ranks are past start-up)."""
    while True:
        line = proc.stdout.readline()
        assert line, f"rank 0 ended before iteration {n}: {proc.stderr.read()[-2000:]}"
        if line.startswith(f"iteration {n}/"):
            return


@pytest.mark.parametrize("how", ["killed", "stuck"])
def test_dead_or_stuck_rank_ends_every_rank(how, tmp_path):
    """killed: rank 2 of a 3-rank plan (two pipelines) is killed; stuck: rank 1 of a
    2-stage pipeline is stopped (SIGSTOP), so only the 0.1-minute timeout can end rank 0."""
    if how == "killed":
        plan, victim = plans.two_pipelines_different_depth(), 2
    else:
        plan, victim = plans.make(2, [PipelinePlan(4, 16, [plans.stage([0], 1, 1, (0, 2)),
                                                           plans.stage([1], 1, 1, (2, 4))])]), 1
    plan.save(tmp_path / "plan.json")
    args = ["--hpp-plan", str(tmp_path / "plan.json"), "--train-iters", "100000",
            "--distributed-timeout-minutes", "0.1"]
    with rendezvous() as meet:
        procs = _start(plan.world_size, args, meet)
        try:
            _after_iteration(procs[0], 2)
            procs[victim].send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
            ends = [p.communicate(timeout=120) for r, p in enumerate(procs) if r != victim]
        finally:
            for p in procs:
                p.kill()
                p.communicate()
    survivors = [r for r in range(plan.world_size) if r != victim]
    for rank, (out, err), proc in zip(survivors, ends, [procs[r] for r in survivors]):
        assert proc.returncode == 1, (rank, proc.returncode, err[-2000:])
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1, err[-2000:]
        assert re.fullmatch(rf"error: rank {rank}: communication failed during iteration \d+: .+ -- another "
                            rf"rank died or is stuck \(--distributed-timeout-minutes 0\.1\); every rank "
                            rf"stops", lines[0]), lines[0]
    if how == "stuck":   # gloo names the timeout it was given: 0.1 min
        assert "Timed out waiting 6000ms" in lines[0], lines[0]
