"""bench/convergence.py without training: it reads the runtime's real log lines, turns bad
arguments into one line + exit 2, and builds the one-rank reference cluster."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_convergence", REPO / "bench/convergence.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _step(loss, ms):
    return SimpleNamespace(loss=loss, grad_norm=1.5, compute_s=[0.1, 0.2], elapsed_s=ms / 1e3,
                           skipped=False, loss_scale=1.0, nonfinite=False, peak_mem_bytes=[2**30, 2**30])


def _log(interval, losses, times_ms, valid=None, start=0, total=None):
    """Rank 0's stdout as pretrain_gpt.py prints it: the metrics logger's lines (and the
    evaluation's), with other lines around them."""
    from eth.spec.plan import load_plan
    from megatron.hpp.training.evaluation import eval_line
    from megatron.hpp.training.metrics import MetricsLogger

    plan = load_plan(REPO / "examples/plans/cpu-demo.json")
    lines = ["training tiny with 2 pipeline(s) on 4 ranks (gloo) | ..."]
    log = MetricsLogger(plan, total or len(losses), interval, lambda it: 1e-3, out=lines.append,
                        warn=lines.append, emulated=True)
    for it, (loss, ms) in enumerate(zip(losses, times_ms), start):
        log.record(it, _step(loss, ms))
    log.close()
    if valid is not None:
        lines.append(eval_line(start + len(losses), valid, 4))
    lines.append("saved /tmp/x/iter_0000003")
    return lines


def test_parse_log_reads_the_metrics_logger_lines(bench):
    losses, times = [6.25, 5.5, 5.125], [800.0, 750.5, 700.5]
    got, got_ms, valid = bench.parse_log(_log(1, losses, times, valid=4.875), expect=3)
    assert got == losses and got_ms == times and valid == {3: 4.875}
    lines = _log(1, losses, times)
    with pytest.raises(ValueError, match="2 metric lines, expected 3"):
        bench.parse_log([x for x in lines if not x.startswith("iteration 3/")], expect=3)  # stopped early
    with pytest.raises(ValueError, match="iteration 1/3 after 0"):
        bench.parse_log(lines, expect=4)                       # another run's log
    # a run resumed after iteration 250 of 300 that stops after 251 (--exit-interval 251)
    lines = _log(1, [2.0371], [650.0], start=250, total=300)
    assert bench.parse_log(lines, expect=300, first=251, stop=251)[0] == [2.0371]
    with pytest.raises(ValueError, match="iteration 251/300 after 0"):
        bench.parse_log(lines, expect=300)
    # averages over two iterations are not per-iteration losses
    with pytest.raises(ValueError, match="iteration 2/3 after 0"):
        bench.parse_log(_log(2, losses, times), expect=3)


def test_compare_window_means_and_relative_differences(bench):
    results = {"hpp": {"losses": [9.0, 2.0, 4.0], "valid": 3.03},
               "uniform": {"losses": [1.0, 2.2, 4.4], "valid": None},
               "one-rank": {"losses": [5.0, 2.0, 4.0], "valid": 3.0}}
    cmp = bench.compare(results, 2)
    assert cmp["means"] == {"hpp": 3.0, "uniform": pytest.approx(3.3), "one-rank": 3.0}
    assert list(cmp["pairs"]) == [("hpp", "uniform"), ("hpp", "one-rank"), ("uniform", "one-rank")]
    assert cmp["pairs"][("hpp", "uniform")]["rel"] == pytest.approx(3.0 / 3.3 - 1)
    assert cmp["pairs"][("uniform", "one-rank")]["max_iter_rel"] == pytest.approx(0.1)
    assert cmp["pairs"][("hpp", "one-rank")]["rel"] == 0.0
    assert cmp["pairs"][("hpp", "one-rank")]["valid_rel"] == pytest.approx(0.01)
    assert cmp["pairs"][("hpp", "uniform")]["valid_rel"] is None
    assert bench.steady_ms([900.0, 100.0, math.nan, 300.0]) == 200.0


@pytest.mark.parametrize("argv, words", [
    (["--iters", "300", "--window", "301"], "--window 301 is larger than --iters 300"),
    (["--runs", "hpp,megatron"], "unknown run 'megatron'"),
    (["--gbs", "0"], "--gbs must be a positive integer, got 0"),
    (["--eval-iters", "-1"], "--eval-iters must be 0 or more"),
    (["--iters", "300", "--same-weights", "300"], "--same-weights 300 must be in [0, --iters 300)"),
    (["--iters", "x"], "argument --iters: invalid int value: 'x'"),
    (["--model", "small", "--set", "depth=4"], "unknown model field 'depth'"),
    (["--model", "small", "--set", "hidden"], "expected FIELD=VALUE"),
    (["--model", "small", "--set", "hidden=100"], "model.hidden 100 is not divisible by model.heads 8"),
    (["--model", "nope"], "unknown model 'nope'"),
    (["--model", "small", "--cluster", "missing.yaml"], "--cluster missing.yaml: no such file"),
    (["--model", "small", "--data-path", "nowhere/english"], "no nowhere/english.bin"),
])
def test_bad_arguments_one_line_exit_2(bench, capsys, tmp_path, argv, words):
    assert bench.main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_one_rank_cluster_keeps_the_first_type_without_emulation(bench, tmp_path):
    from eth.spec.cluster import load_cluster

    demo = load_cluster(REPO / "examples/clusters/cpu-demo.yaml")
    bench.one_rank_cluster(REPO / "examples/clusters/cpu-demo.yaml", tmp_path / "one.yaml")
    one = load_cluster(tmp_path / "one.yaml")
    first = demo.type_of(0)
    assert one.world_size == 1 and one.type_of(0).name == first.name
    assert one.type_of(0).emulate_speed == 0.0
    assert one.type_of(0).tflops == first.tflops and one.type_of(0).mem_bw_gbs == first.mem_bw_gbs
