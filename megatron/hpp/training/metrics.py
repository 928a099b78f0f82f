"""Training metrics: one logger object on rank 0 (the shape of torchtitan's
``components/metrics.py``: the trainer hands it every step's result; it aggregates,
prints and, optionally, writes TensorBoard scalars).

Every ``--log-interval`` iterations (and at the last one) rank 0 prints one line of
averages over the iterations since the previous line:

    loss, grad norm     mean over the interval's iterations that updated the weights
                        (a skipped fp16 step or a NaN/Inf step is counted, not averaged)
    lr                  of the interval's last iteration
    time                mean iteration time (rank 0's wall clock; every step ends in
                        collectives over all ranks, so it is the slowest rank's too)
    samples/s tokens/s  gbs / time, gbs * seq_len / time
    TFLOP/s/device      model FLOPs of one iteration / time / world size.  Model FLOPs
                        are the planner's count (:func:`model_flops_per_sample`:
                        ``eth.spec.model.op_shapes``, forward + backward = 3x forward, every
                        op of every layer plus embedding, final layernorm and
                        head + loss, full s x s attention, recomputation not counted),
                        so the number is comparable with the plan's stage times
    consumed samples    (iteration + 1) x gbs  (+ the offset of a run resumed under another gbs)
    compute ms p<i>     pipeline i's forward/backward time on its slowest rank
                        (``schedule.ComputeClock``; emulation sleep included)
    bubble ms p<i>      iteration time - compute of pipeline i: everything else the
                        iteration spends on that pipeline's slowest rank -- pipeline
                        fill and drain, waiting for p2p neighbours, the gradient sync,
                        the optimizer step and waiting for slower pipelines
    peak mem            max over all ranks of each rank's peak since start (CUDA: max
                        allocated; CPU: max RSS of the process), and per pipeline
    skipped / nan       iterations of the interval skipped by the fp16 loss scaler /
                        with a NaN or Inf loss or gradient norm (see failures.py)
    plan                the plan's predicted iteration time (``plan.predicted
                        ["iteration_ms"]``) beside the measured one; the first time the
                        mean over the run's iterations so far (without its first, warm-up
                        iteration, also after a resume; at least 5 of them, or all of a
                        shorter run at its end) differs from it by more than 20%, rank 0
                        prints one warning line on stderr: one slow iteration on a busy
                        host does not warn, a profile of another host does

TensorBoard (``--tensorboard-dir``): ``torch.utils.tensorboard.SummaryWriter`` when the
``tensorboard`` package is installed, one scalar per number above at the interval's
last iteration; otherwise one note line and no writer.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

STALE_TOLERANCE = 0.2
"""|measured / predicted - 1| beyond this triggers the stale-profile warning."""
STALE_MIN_ITERATIONS = 5
"""Steady iterations averaged before the stale-profile warning may fire (fewer only at
the end of a shorter run)."""


def model_flops_per_sample(spec) -> float:
    """Forward + backward FLOPs of one sample through the whole model, as the planner
    counts them (``eth.spec.model.op_shapes`` at mbs 1, tp 1; backward = 2x forward)."""
    from eth.spec.model import layer_ops, op_shapes, post_ops, pre_ops

    ops = op_shapes(spec, 1, 1)
    total = lambda names: sum(ops[n].flops_fwd + ops[n].flops_bwd for n in names)  # noqa: E731
    return spec.num_layers * total(layer_ops(spec)) + total(pre_ops(spec)) + total(post_ops(spec))


def peak_memory_bytes(device) -> tuple[float, str]:
    """This process's peak memory since start and what it is: CUDA max allocated, or the
    CPU process's max resident set size."""
    if device.type == "cuda":
        import torch

        return float(torch.cuda.max_memory_allocated(device)), "CUDA max allocated"
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return float(rss if sys.platform == "darwin" else rss * 1024), "max RSS"


def _mean(values) -> float:
    return sum(values) / len(values) if values else float("nan")


def _columns(values, scale=1e3, fmt="{:.1f}") -> str:
    return ", ".join(f"p{i} " + fmt.format(v * scale) for i, v in enumerate(values))


@dataclass
class _Window:
    """The StepResults of the iterations since the last line."""

    iterations: list = field(default_factory=list)
    results: list = field(default_factory=list)

    def add(self, iteration, result) -> None:
        self.iterations.append(iteration)
        self.results.append(result)


def tensorboard_writer(log_dir: str | None, note=print):
    """A SummaryWriter for ``log_dir``, or None (no dir; or tensorboard missing: one note)."""
    if not log_dir:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        note(f"note: --tensorboard-dir {log_dir} ignored: the tensorboard package is not installed "
             f"(pip install tensorboard)")
        return None
    return SummaryWriter(log_dir=log_dir)


def _reprofile_hint(plan) -> str:
    """What to run on this host: the profile of each of the plan's device types (emulated
    CPU types share the ``cpu`` one) and a new plan from it."""
    types = sorted({"cpu" if t.emulate_speed > 0 else name for name, t in plan.cluster.types.items()})
    first = types[0]
    more = f" (and --device-type {', '.join(types[1:])} on those devices)" if len(types) > 1 else ""
    return (f" on this host (--model {plan.model.name} --device-type {first} -o my_profiles/{first}.json{more}) "
            f"and plan again with --profiles my_profiles/")


class MetricsLogger:
    """Aggregates :class:`~megatron.hpp.training.loop.StepResult` s over ``log_interval``
    iterations and prints (and writes) them on the rank where ``enabled``."""

    def __init__(self, plan, train_iters: int, log_interval: int, lr_at, *, enabled: bool = True,
                 emulated: bool = False, loss_scale: bool = False, memory_kind: str = "max RSS",
                 writer=None, out=None, warn=None, sample_offset: int = 0):
        self.sample_offset = sample_offset
        """Consumed samples - iteration x gbs (non-zero after a resume under another gbs)."""
        self.plan, self.train_iters, self.log_interval, self.lr_at = plan, train_iters, log_interval, lr_at
        self.enabled, self.emulated, self.loss_scale = enabled, emulated, loss_scale
        self.memory_kind, self.writer = memory_kind, writer
        self.out = out or (lambda line: print(line, flush=True))
        self.warn = warn or (lambda line: print(line, file=sys.stderr, flush=True))
        self.flops_per_iteration = model_flops_per_sample(plan.model) * plan.gbs
        self.predicted_ms = plan.predicted.get("iteration_ms")
        self.warned_stale = False
        self.steady_s: list[float] = []
        """Every iteration time of the run but its first (the stale-profile warning's mean)."""
        self.first_iteration = None
        """The run's first recorded iteration (0, or where a resumed run starts): warm-up."""
        self.window = _Window()
        self.lines: list[str] = []
        """Every line printed or warned (rank 0's log, for tests and tools)."""

    def record(self, iteration: int, result, flush: bool = False) -> None:
        """Add 0-based ``iteration``'s result; print at interval ends, the last iteration,
        or when ``flush`` (e.g. the run is about to stop)."""
        if not self.enabled:
            return
        if self.first_iteration is None:
            self.first_iteration = iteration
        elif math.isfinite(result.elapsed_s):
            self.steady_s.append(result.elapsed_s)
        self.window.add(iteration, result)
        if flush or (iteration + 1) % self.log_interval == 0 or iteration + 1 == self.train_iters:
            self._emit()

    def _emit(self) -> None:
        w, self.window = self.window, _Window()
        if not w.results:
            return
        stats = self.summarize(w.iterations, w.results)
        self._print(self._line(stats))
        stale = self._stale_warning(last=w.iterations[-1] + 1 == self.train_iters)
        if stale:
            self.lines.append(stale)
            self.warn(stale)
        if self.writer is not None:
            self._write(stats)

    def summarize(self, iterations, results) -> dict:
        """The interval's numbers (see the module docstring)."""
        plan, last = self.plan, iterations[-1]
        updated = [r for r in results if not r.skipped and not r.nonfinite]
        time_s = _mean([r.elapsed_s for r in results])
        pipes = len(results[0].compute_s)
        compute = [_mean([r.compute_s[p] for r in results]) for p in range(pipes)]
        mem = [max(r.peak_mem_bytes[p] for r in results) for p in range(pipes)]
        steady = [r.elapsed_s for i, r in zip(iterations, results) if i != self.first_iteration]
        return {
            "iteration": last + 1, "consumed_samples": self.sample_offset + (last + 1) * plan.gbs,
            "loss": _mean([r.loss for r in updated]), "grad_norm": _mean([r.grad_norm for r in updated]),
            "lr": self.lr_at(last), "iteration_ms": time_s * 1e3,
            "samples_per_s": plan.gbs / time_s, "tokens_per_s": plan.gbs * plan.model.seq_len / time_s,
            "tflops_per_device": self.flops_per_iteration / time_s / plan.world_size / 1e12,
            "compute_s": compute, "bubble_s": [time_s - c for c in compute],
            "peak_mem_bytes": mem, "skipped": sum(r.skipped for r in results),
            "nonfinite": sum(r.nonfinite for r in results), "loss_scale": results[-1].loss_scale,
            "steady_ms": _mean(steady) * 1e3 if steady else None,
        }

    def _line(self, s: dict) -> str:
        gib = max(s["peak_mem_bytes"]) / 2**30
        plan = f" (plan {self.predicted_ms:.1f} ms)" if self.predicted_ms else ""
        fp16 = f" | loss scale {s['loss_scale']:g}" if self.loss_scale else ""
        return (f"iteration {s['iteration']}/{self.train_iters} | consumed samples {s['consumed_samples']} | "
                f"loss {s['loss']:.6f} | grad norm {s['grad_norm']:.4f} | lr {s['lr']:.3g} | time "
                f"{s['iteration_ms']:.1f} ms{plan} | samples/s {s['samples_per_s']:.1f} | "
                f"tokens/s {s['tokens_per_s']:.0f} | TFLOP/s/device {s['tflops_per_device']:.4g} | "
                f"compute ms {_columns(s['compute_s'])} | bubble ms {_columns(s['bubble_s'])} | "
                f"peak mem {gib:.3f} GiB ({self.memory_kind}; {_columns(s['peak_mem_bytes'], 2**-30, '{:.3f}')}) | "
                f"skipped {s['skipped']} | nan {s['nonfinite']}{fp16}"
                + (" (emulated)" if self.emulated else ""))

    def _stale_warning(self, last: bool) -> str | None:
        predicted, count = self.predicted_ms, len(self.steady_s)
        if self.warned_stale or not predicted or not count or (count < STALE_MIN_ITERATIONS and not last):
            return None
        measured = _mean(self.steady_s) * 1e3
        ratio = measured / predicted
        if abs(ratio - 1) <= STALE_TOLERANCE:
            return None
        self.warned_stale = True
        return (f"warning: measured iteration time {measured:.1f} ms (mean of {count}) is {ratio:.2f}x the plan's "
                f"predicted {predicted:.1f} ms (more than {STALE_TOLERANCE:.0%} off): profile may be stale: "
                f"re-run tools/profile_ops.py{_reprofile_hint(self.plan)}")

    def _write(self, s: dict) -> None:
        step, w = s["iteration"], self.writer
        for key in ("loss", "grad_norm", "lr", "iteration_ms", "samples_per_s", "tokens_per_s",
                    "tflops_per_device", "consumed_samples", "skipped", "nonfinite", "loss_scale"):
            w.add_scalar(f"train/{key}", s[key], step)
        for p, (c, b, m) in enumerate(zip(s["compute_s"], s["bubble_s"], s["peak_mem_bytes"])):
            w.add_scalar(f"pipeline{p}/compute_ms", c * 1e3, step)
            w.add_scalar(f"pipeline{p}/bubble_ms", b * 1e3, step)
            w.add_scalar(f"pipeline{p}/peak_mem_bytes", m, step)
        if self.predicted_ms:
            w.add_scalar("train/predicted_iteration_ms", self.predicted_ms, step)
        w.flush()

    def _print(self, line: str) -> None:
        self.lines.append(line)
        self.out(line)

    def close(self) -> None:
        """Print what is left of the window and close the writer."""
        if self.enabled:
            self._emit()
        if self.writer is not None:
            self.writer.close()
            self.writer = None
