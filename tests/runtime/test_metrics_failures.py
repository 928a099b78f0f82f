"""The metrics logger, the NaN guard, communication-error handling and bad arguments,
without processes (pretrain_gpt.main is called in this process for the arguments:
they are refused before any process group exists)."""
from __future__ import annotations

import pytest

import _rt_plans as plans
import pretrain_gpt
from megatron.hpp.data.datasets import shipped_corpus
from eth.spec.model import get_model
from eth.spec.plan import PipelinePlan
from megatron.hpp.training.failures import (CommFailure, NanGuard, TrainingStopped, during, is_comm_error, short_reason,
                                   step_nonfinite)
from megatron.hpp.training.metrics import MetricsLogger, model_flops_per_sample
from megatron.hpp.training.loop import StepResult


def test_model_flops_match_megatrons_formula():
    """Megatron-LM's num_floating_point_operations for a GPT with a 4h MLP and full
    attention: 72 B s L h^2 (1 + s / (6h) + V / (12 h L)); op_shapes adds the element-wise
    ops (layernorms, softmax, GELU, dropouts, the loss), a fraction of a percent here."""
    spec = get_model("gpt3-13b")
    s, h, layers, v = spec.seq_len, spec.hidden, spec.num_layers, spec.vocab
    assert spec.ffn == 4 * h
    megatron = 72 * s * layers * h * h * (1 + s / (6 * h) + v / (12 * h * layers))
    ours = model_flops_per_sample(spec)
    assert megatron < ours < 1.01 * megatron


def _result(loss=2.0, norm=1.0, compute=(0.03, 0.05), elapsed=0.1, skipped=False, nonfinite=False,
            mem=(1e9, 2e9), scale=1.0):
    return StepResult(loss, norm, list(compute), elapsed, skipped, scale, nonfinite, list(mem))


class Writer:
    def __init__(self):
        self.scalars, self.closed = [], False

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def flush(self):
        pass

    def close(self):
        self.closed = True


def _logger(plan, interval=4, iters=8, **kw):
    lines, warnings = [], []
    log = MetricsLogger(plan, iters, interval, lambda it: 0.1 * (it + 1), out=lines.append,
                        warn=warnings.append, **kw)
    return log, lines, warnings


def test_logger_averages_an_interval():
    plan = plans.uneven_lbs_different_mbs()        # 2 pipelines, gbs 16, seq 32, 4 ranks
    writer = Writer()
    log, lines, warnings = _logger(plan, writer=writer, loss_scale=True)
    log.record(0, _result(loss=4.0, norm=2.0, elapsed=0.3, mem=(1e9, 3e9)))
    log.record(1, _result(loss=float("nan"), norm=float("nan"), nonfinite=True, elapsed=0.1))
    log.record(2, _result(loss=2.0, norm=float("inf"), skipped=True, elapsed=0.1, scale=2.0))
    assert lines == []                              # interval of 4 not reached
    log.record(3, _result(loss=2.0, norm=4.0, elapsed=0.1, compute=(0.05, 0.09), scale=0.5))
    (line,) = lines
    s = log.summarize([0, 1, 2, 3], [_result(loss=4.0, norm=2.0, elapsed=0.3, mem=(1e9, 3e9)),
                                     _result(loss=float("nan"), norm=float("nan"), nonfinite=True),
                                     _result(norm=float("inf"), skipped=True),
                                     _result(norm=4.0, compute=(0.05, 0.09))])
    assert s["loss"] == 3.0 and s["grad_norm"] == 3.0          # the two updating iterations only
    assert s["skipped"] == 1 and s["nonfinite"] == 1
    assert s["iteration_ms"] == pytest.approx(150.0)           # (0.3 + 3 x 0.1) / 4
    assert s["consumed_samples"] == 64 and s["lr"] == pytest.approx(0.4)
    assert s["samples_per_s"] == pytest.approx(16 / 0.15) and s["tokens_per_s"] == pytest.approx(16 * 32 / 0.15)
    assert s["compute_s"] == pytest.approx([0.035, 0.06]) and s["bubble_s"] == pytest.approx([0.115, 0.09])
    assert s["peak_mem_bytes"] == [1e9, 3e9]
    flops = model_flops_per_sample(plan.model) * 16
    assert s["tflops_per_device"] == pytest.approx(flops / 0.15 / 4 / 1e12)
    assert s["steady_ms"] == pytest.approx(100.0)              # the first iteration left out
    assert line.startswith("iteration 4/8 | consumed samples 64 | loss 3.000000 | grad norm 3.0000 | lr 0.4 |")
    assert "compute ms p0 35.0, p1 60.0 | bubble ms p0 115.0, p1 90.0" in line
    assert "peak mem 2.794 GiB (max RSS; p0 0.931, p1 2.794)" in line
    assert line.endswith("skipped 1 | nan 1 | loss scale 0.5") and warnings == []   # no predicted time
    steps = {step for _, _, step in writer.scalars}
    tags = {tag: value for tag, value, _ in writer.scalars}
    assert steps == {4} and tags["train/loss"] == 3.0 and tags["pipeline1/bubble_ms"] == pytest.approx(90.0)
    log.record(4, _result())
    log.close()                                     # the rest of the window is printed
    assert len(lines) == 2 and lines[1].startswith("iteration 5/8 ") and writer.closed


def test_logger_flush_and_last_iteration():
    plan = plans.uneven_lbs_different_mbs()
    log, lines, _ = _logger(plan, interval=10, iters=3)
    log.record(0, _result())
    log.record(1, _result(), flush=True)            # e.g. the run stops here
    log.record(2, _result())                        # the last iteration always logs
    assert [line.split(" |")[0] for line in lines] == ["iteration 2/3", "iteration 3/3"]
    log.close()
    assert len(lines) == 2
    quiet, none, _ = _logger(plan, enabled=False)
    quiet.record(3, _result())
    quiet.close()
    assert none == []


def test_stale_profile_warning_once_on_the_running_mean_beyond_20_percent():
    plan = plans.uneven_lbs_different_mbs()
    plan.predicted = {"iteration_ms": 100.0}
    log, lines, warnings = _logger(plan, interval=1, iters=20)
    log.record(0, _result(elapsed=10.0))           # the first (warm-up) iteration is not compared
    for it, elapsed in enumerate([0.119, 0.081, 0.5, 0.1], start=1):
        log.record(it, _result(elapsed=elapsed))   # a 5x iteration, but fewer than 5 to average
    assert warnings == [] and "time 119.0 ms (plan 100.0 ms)" in lines[1]
    log.record(5, _result(elapsed=0.1))            # mean of 5: 180 ms
    log.record(6, _result(elapsed=0.5))            # still off, but said once
    assert warnings == ["warning: measured iteration time 180.0 ms (mean of 5) is 1.80x the plan's predicted "
                        "100.0 ms (more than 20% off): profile may be stale: re-run tools/profile_ops.py on this "
                        f"host (--model {plan.model.name} --device-type A100 -o my_profiles/A100.json) and plan "
                        "again with --profiles my_profiles/"]
    noisy, _, quiet = _logger(plan, interval=1, iters=20)
    for it, elapsed in enumerate([1.0, 0.1, 0.1, 0.1, 0.1, 0.15, 0.1, 0.1]):
        noisy.record(it, _result(elapsed=elapsed))  # one 1.5x iteration in a 1.06x run: no warning
    assert quiet == []
    resumed, _, warned = _logger(plan, interval=1, iters=7)
    resumed.record(5, _result(elapsed=0.07))       # a resumed run's first iteration: warm-up
    assert warned == []
    resumed.record(6, _result(elapsed=0.07))       # its last: a short run compares what it has
    assert len(warned) == 1 and "0.70x" in warned[0]   # too fast is stale too


def test_nan_guard_counts_consecutive_bad_iterations():
    guard = NanGuard(3)
    bad, good = _result(loss=float("nan"), nonfinite=True), _result()
    fp16_overflow = _result(norm=float("inf"), skipped=True)   # the loss scaler's business
    assert [guard.update(i, r) for i, r in enumerate([bad, bad, good, bad, fp16_overflow, bad])] == [None] * 6
    assert guard.update(6, _result(loss=2.0, norm=float("inf"), nonfinite=True)) is None
    message = guard.update(7, bad)
    assert message.startswith("training diverged: loss nan in 3 consecutive iteration(s) (iterations 6-8; "
                              "--max-nan-iters 3)")
    assert NanGuard(1).update(4, _result(loss=1.0, norm=float("inf"), nonfinite=True)).startswith(
        "training diverged: grad norm inf in 1 consecutive iteration(s) (iteration 5;")


GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
              "[127.0.0.1]:30110: Connection reset by peer. This is typically caused by a remote worker "
              "hanging or bugs in the application. Check the logs of the remote worker before reporting "
              "an error. GLHF!")
GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                "waiting 6000ms for recv operation to complete")


def test_what_counts_as_nan():
    nan, inf = float("nan"), float("inf")
    assert step_nonfinite(nan, True, None, None) and step_nonfinite(inf, True, 1024.0, 1.0)
    assert not step_nonfinite(2.5, True, None, None)
    assert step_nonfinite(2.5, False, None, None)            # bf16/fp32: no scaler to blame
    assert not step_nonfinite(2.5, False, 1024.0, 1.0)       # fp16: the scaler backs off and skips
    assert step_nonfinite(2.5, False, 1.0, 1.0)              # ... but not below its minimum scale
    guard = NanGuard(2)
    scales = [8.0, 4.0, 2.0, 1.0, 1.0]                        # overflows that end at the minimum
    stops = [guard.update(i, _result(loss=2.5, norm=inf, nonfinite=step_nonfinite(2.5, False, s, 1.0)))
             for i, s in enumerate(scales)]
    assert stops[:4] == [None] * 4 and stops[4].startswith("training diverged: grad norm inf in 2 ")


def test_communication_errors_become_one_line():
    assert short_reason(RuntimeError(GLOO_RESET)) == "Read error [127.0.0.1]:30110: Connection reset by peer"
    assert short_reason(RuntimeError(GLOO_TIMEOUT)) == "Timed out waiting 6000ms for recv operation to complete"
    assert is_comm_error(RuntimeError(GLOO_RESET)) and is_comm_error(RuntimeError(GLOO_TIMEOUT))
    assert not is_comm_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"))
    assert not is_comm_error(ValueError("Connection reset"))  # only runtime errors of the backends
    with pytest.raises(CommFailure, match=r"^communication failed during iteration 7: Timed out waiting "
                                          r"6000ms .* -- another rank died or is stuck "
                                          r"\(--distributed-timeout-minutes 0.1\); every rank stops$"):
        with during("iteration 7", 0.1):
            raise RuntimeError(GLOO_TIMEOUT)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):   # a bug keeps its traceback
        with during("iteration 7", 0.1):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)")
    with pytest.raises(TrainingStopped):
        with during("iteration 7", 0.1):
            raise TrainingStopped("diverged")


@pytest.fixture
def one_rank_plan(tmp_path):
    plans.make(1, [PipelinePlan(4, 16, [plans.stage([0], 1, 1, (0, 4))])]).save(tmp_path / "one.json")
    return str(tmp_path / "one.json")


@pytest.mark.parametrize("extra, message", [
    (["--lr", "nan"], "--lr must be a finite positive number, got nan"),
    (["--lr", "inf"], "--lr must be a finite positive number, got inf"),
    (["--lr", "0"], "--lr must be a finite positive number, got 0.0"),
    (["--min-lr", "-0.0001"], "--min-lr must be between 0 and --lr 0.001, got -0.0001"),
    (["--lr", "1e-4", "--min-lr", "2e-4"], "--min-lr must be between 0 and --lr 0.0001, got 0.0002"),
    (["--weight-decay", "-0.1"], "--weight-decay must be a finite number >= 0, got -0.1"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number >= 0, got nan"),
    (["--max-nan-iters", "0"], "--max-nan-iters must be >= 1, got 0"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be a finite positive number"),
    (["--split", "0,1", "--data-path", "{corpus}"], "--split '0,1' gives the training set no share"),
    (["--split", "98,2"], "--split 98,2 without --data-path: synthetic data has no documents to split"),
    (["--data-cache-path", "{dir}"], "--data-cache-path {dir} without --data-path"),
    (["--verify-checkpoint"], "--verify-checkpoint checks the checkpoint --load reads: give --load DIR"),
    (["--save", "{dir}/notes.txt/ck"], "--save {dir}/notes.txt/ck cannot be written: {dir}/notes.txt is a file"),
    (["--data-path", "{corpus}", "--data-cache-path", "{dir}/notes.txt/c"],
     "--data-cache-path {dir}/notes.txt/c cannot be written: {dir}/notes.txt is a file"),
    (["--save-params", "{dir}"], "--save-params {dir} is a directory"),
    (["--nonsense"], "unrecognized arguments: --nonsense (python "),
    (["--load", "{dir}/nope"], "--load {dir}/nope does not exist (to start fresh and resume later, give the same"),
    (["--load", "{dir}"], "--load {dir} holds no checkpoint (no iter_*/manifest.json; it holds "),
    (["--data-path", "{dir}"], "--data-path {dir} is a directory; give the prefix of its .bin/.idx files"),
    (["--data-path", "{dir}/notes.txt"], "--data-path {dir}/notes.txt is a plain file; convert it first"),
    (["--data-path", "0.5", "{dir}/missing"], "--data-path {dir}/missing: {dir}/missing.bin and"),
])
def test_bad_arguments_one_line_exit_2(extra, message, one_rank_plan, tmp_path, monkeypatch, capsys):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "notes.txt").write_text("plain text\n")
    extra = [a.format(dir=tmp_path, corpus=shipped_corpus()) for a in extra]
    try:
        code = pretrain_gpt.main(["--hpp-plan", one_rank_plan, "--train-iters", "2", *extra])
    except SystemExit as exc:   # argparse's own errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message.format(dir=tmp_path) in err, err


def test_multi_rank_plan_without_torchrun_says_how_to_launch(tmp_path, monkeypatch, capsys):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    plans.two_pipelines_different_depth().save(tmp_path / "three.json")
    assert pretrain_gpt.main(["--hpp-plan", str(tmp_path / "three.json"), "--train-iters", "2"]) == 2
    assert capsys.readouterr().err == ("error: plan needs 3 ranks, WORLD_SIZE is not set (one process): launch "
                                       "it with torchrun --nproc-per-node 3 pretrain_gpt.py ...\n")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert pretrain_gpt.main(["--hpp-plan", str(tmp_path / "three.json"), "--train-iters", "2"]) == 2
    assert capsys.readouterr().err == "error: WORLD_SIZE 3 needs MASTER_ADDR and MASTER_PORT (torchrun sets them)\n"



def test_an_elastic_worker_stopped_by_another_ranks_signal_waits_for_its_own(monkeypatch):
    import os
    import signal
    import threading
    import time

    from megatron.hpp.training.failures import ExitSignal

    guard = ExitSignal()
    try:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        start = time.monotonic()
        guard.await_own(5.0)                       # not under an elastic agent: at once
        assert time.monotonic() - start < 0.5
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # plain torchrun: never restarts its workers
        monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
        start = time.monotonic()
        guard.await_own(5.0)                       # at once too (it waited 60 s on every rank)
        assert time.monotonic() - start < 0.5
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
        monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
        start = time.monotonic()
        guard.await_own(0.3)                       # no signal comes: until the timeout
        assert 0.3 <= time.monotonic() - start < 2.0 and not guard.received
        threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
        start = time.monotonic()
        guard.await_own(10.0)                      # the agent's own signal ends the wait
        assert guard.received and time.monotonic() - start < 5.0
        start = time.monotonic()
        guard.await_own(10.0)                      # received: at once
        assert time.monotonic() - start < 0.5
    finally:
        guard.restore()


def test_ctrl_c_is_caught_like_sigterm_and_a_second_one_interrupts():
    """--exit-signal-handler: Ctrl-C (SIGINT) is recorded as SIGTERM is (the run saves
    and stops after the iteration in progress); a second Ctrl-C raises
    KeyboardInterrupt at once; the handlers are put back afterwards."""
    import os
    import signal

    from megatron.hpp.training.failures import ExitSignal

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    guard = ExitSignal()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert guard.received and guard.name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is before[0]
    finally:
        guard.restore()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
