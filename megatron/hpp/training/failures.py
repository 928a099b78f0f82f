"""How a training run ends when something goes wrong (docs/RUNTIME.md, "Failures").

Exit codes of ``pretrain_gpt.py`` (``training.run``):

    0   trained every iteration
    1   the run was stopped: :class:`TrainingStopped` (NaN/Inf loss or gradient norm in
        ``--max-nan-iters`` consecutive iterations) or :class:`CommFailure` (a collective
        or p2p transfer failed or timed out: a rank died, or is stuck for longer than
        ``--distributed-timeout-minutes``)
    2   bad input (a ``SpecError``: plan, flags, data), found before any process group

*NaN/Inf.*  ``StepResult.nonfinite`` marks an iteration whose loss or gradient norm is
not finite, other than an fp16 overflow that the dynamic loss scaler handles
(``StepResult.skipped``: the gradients overflowed but the loss is finite) -- unless the
scale is already at its minimum, where backing off cannot help and the overflow is the
model's (:func:`step_nonfinite`); otherwise such a run would skip every step forever.  Such an
iteration never updates the weights (the trainer skips the optimizer step).  Every rank
sees the same global loss and norm, so every rank's :class:`NanGuard` stops at the same
iteration, without a collective; rank 0 prints the message.

*Signals.*  With ``--exit-signal-handler`` (Megatron's flag) :class:`ExitSignal` catches
SIGTERM (what torchrun, Slurm and Kubernetes send before killing, torchrun 30 s before);
at the end of the iteration in progress every rank learns of it through one small
all-reduce, the run saves a checkpoint (with ``--save``) and ends with exit code 0.

*Communication.*  ``--distributed-timeout-minutes`` (Megatron's name, default 10, a float)
is the process group's timeout: a collective or p2p receive waiting longer raises.  A
killed rank is usually noticed at once (its sockets close).  :func:`during` turns such
an error into :class:`CommFailure` naming the phase (start-up, iteration N); every rank
that sees one prints one line and exits 1 without tearing down the process group
(destroying a group after a failed collective can abort or hang).
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import sys

# Text of errors raised by gloo / NCCL / the store when a peer is gone or late.
_COMM_MARKERS = ("gloo", "nccl", "timed out", "timeout", "connection reset", "connection closed",
                 "connection refused", "broken pipe", "socket", "processgroup", "store")


@contextlib.contextmanager
def checking_input():
    """While every rank checks the same input (flags, plan, paths; no process group yet),
    under torchrun: a SIGTERM means torchrun is ending the workers because one of them
    exited, which at this point is a bad-input exit; this rank exits 2 as well."""
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        yield
        return
    import signal

    previous = _sigterm_exits_2()
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _sigterm_exits_2():
    """From now on the launcher's SIGTERM ends this rank with exit code 2 (bad input);
    returns the handler it replaced."""
    import signal

    return signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(2))


SILENT_RANK_WAIT_S = 3.0
"""How long a rank that does not print a bad-input error lets rank 0 print it first."""


def report_error(line: str, every_rank: bool = False) -> None:
    """``error: <line>`` on stderr, from rank 0 only (``RANK``; unset: a single process)
    unless ``every_rank``: bad input is found alike on every rank, and under torchrun
    one copy of the line is what the user needs to see above torchrun's own report.

    torchrun ends every rank (SIGTERM) as soon as one exits non-zero, so a silent rank
    that finished first would cut rank 0 off before it prints: a silent rank under a
    launcher waits up to ``SILENT_RANK_WAIT_S`` seconds and takes the launcher's SIGTERM
    as the end of that wait, exiting 2 as rank 0 does."""
    rank = os.environ.get("RANK", "0")
    if every_rank or not rank.isdigit() or int(rank) == 0:
        print(f"error: {line}", file=sys.stderr, flush=True)
    elif os.environ.get("TORCHELASTIC_RUN_ID"):
        import time

        _sigterm_exits_2()
        time.sleep(SILENT_RANK_WAIT_S)


class TrainingStopped(RuntimeError):
    """The run cannot usefully continue (NaN/Inf for too long); exit 1."""


class CommFailure(RuntimeError):
    """A collective or p2p transfer failed or timed out; exit 1 without teardown."""


def is_comm_error(exc: BaseException) -> bool:
    """Whether ``exc`` came from the communication layer (a peer died or is late)."""
    try:
        import torch.distributed as dist

        if isinstance(exc, dist.DistError):
            return True
    except (ImportError, AttributeError):
        pass
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in _COMM_MARKERS)


def short_reason(exc: BaseException, limit: int = 240) -> str:
    """One line of a backend error: first line, without the C++ source location prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", text)
    text = text.split(" This is typically caused by")[0].rstrip(". ")
    return text if len(text) <= limit else text[:limit - 3] + "..."


@contextlib.contextmanager
def during(phase: str, timeout_minutes: float):
    """Re-raise a communication error inside the block as :class:`CommFailure`."""
    try:
        yield
    except (TrainingStopped, CommFailure):
        raise
    except Exception as exc:  # noqa: BLE001 -- only communication errors are converted
        if not is_comm_error(exc):
            raise
        raise CommFailure(f"communication failed during {phase}: {short_reason(exc)} -- another rank "
                          f"died or is stuck (--distributed-timeout-minutes {timeout_minutes:g}); "
                          f"every rank stops") from exc


def restartable() -> bool:
    """Whether this worker runs under a torchrun agent that may restart it for a
    membership change (``--max-restarts`` > 0: TORCHELASTIC_MAX_RESTARTS); plain torchrun
    also sets TORCHELASTIC_RUN_ID (to "none" or a uuid) but never restarts."""
    try:
        return bool(os.environ.get("TORCHELASTIC_RUN_ID")) and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS",
                                                                                  "0")) > 0
    except ValueError:
        return False


class ExitSignal:
    """Records SIGTERM and SIGINT (Ctrl-C) instead of dying of them
    (``--exit-signal-handler``): the run saves and stops after the iteration in progress.
    A second Ctrl-C interrupts at once (KeyboardInterrupt), as without the flag."""

    def __init__(self, signums=None):
        import signal

        self.signums = tuple(signums) if signums is not None else (signal.SIGTERM, signal.SIGINT)
        self.signum = self.signums[0]
        """The signal received (the first one watched until then)."""
        self.received = False
        self.previous = {s: signal.signal(s, self._handle) for s in self.signums}

    def _handle(self, signum, frame) -> None:
        import signal

        if self.received and signum == signal.SIGINT:   # Ctrl-C again: stop waiting for the iteration
            self.restore()
            raise KeyboardInterrupt
        self.received, self.signum = True, signum

    def restore(self) -> None:
        """Put back the handlers this replaced."""
        import signal

        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def any_rank(self, device) -> bool:
        """Whether any rank has received the signal (a collective: every rank calls it)."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(self.received)], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def await_own(self, timeout_s: float = None) -> None:
        """Under torchrun's elastic agent, a rank stopped by another rank's signal waits
        (at most ``timeout_s``, default :data:`ELASTIC_STOP_WAIT_S`) for its own: an agent
        that restarts its workers for a node joining signals each of its workers itself,
        and a worker that ended with exit code 0 before its agent did so would read to
        that agent as the end of the job (it closes the rendezvous, and the joining node
        never gets in).  Elsewhere (:func:`restartable`), and once this rank has the
        signal, it returns at once."""
        import time

        if self.received or not restartable():
            return
        end = time.monotonic() + (ELASTIC_STOP_WAIT_S if timeout_s is None else timeout_s)
        while not self.received and time.monotonic() < end:
            time.sleep(0.05)

    @property
    def name(self) -> str:
        import signal

        return signal.Signals(self.signum).name


ELASTIC_STOP_WAIT_S = 60.0
"""How long :meth:`ExitSignal.await_own` waits for the agent's own signal."""


def step_nonfinite(loss: float, grads_finite: bool, loss_scale: float | None,
                   min_scale: float | None) -> bool:
    """Whether an iteration counts as NaN/Inf for :class:`NanGuard`: a non-finite loss,
    or non-finite gradients that no loss scaler handles (``loss_scale`` None: bf16/fp32)
    or that overflowed at the scaler's minimum scale."""
    if not math.isfinite(loss):
        return True
    if grads_finite:
        return False
    return loss_scale is None or loss_scale <= min_scale


class NanGuard:
    """Counts consecutive iterations with a non-finite loss or gradient norm."""

    def __init__(self, max_nan_iters: int):
        if max_nan_iters < 1:
            raise ValueError(f"max_nan_iters must be >= 1, got {max_nan_iters}")
        self.max_nan_iters = max_nan_iters
        self.streak: list[int] = []
        """0-based iterations of the current run of bad ones."""

    def update(self, iteration: int, result) -> str | None:
        """Record ``iteration``; the stop message when the run must end, else None."""
        if not result.nonfinite:
            self.streak = []
            return None
        self.streak.append(iteration)
        if len(self.streak) < self.max_nan_iters:
            return None
        what = ", ".join(f"{name} {value}" for name, value in (("loss", result.loss),
                                                              ("grad norm", result.grad_norm))
                         if not math.isfinite(value)) or "non-finite values"
        first, last = self.streak[0] + 1, iteration + 1
        span = f"iteration {first}" if first == last else f"iterations {first}-{last}"
        return (f"training diverged: {what} in {len(self.streak)} consecutive iteration(s) "
                f"({span}; --max-nan-iters {self.max_nan_iters}); the weights were not updated by "
                f"them; lower --lr, raise --warmup or check the data")
