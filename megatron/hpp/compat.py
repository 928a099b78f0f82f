"""Backend/device selection and the small CPU shim megatron-core needs.

With CUDA: NCCL, one device per local rank, megatron-core's own CUDA RNG tracker.
Without CUDA: gloo on CPU, and three shims, each as narrow as the runtime's code path
allows (the model builds its layers with ``use_cpu_initialization=True`` and never
asks megatron-core for ``torch.cuda.current_device()``):

* :class:`CpuRNGStatesTracker` replaces megatron-core's CUDA RNG tracker (used by the
  tp-local attention dropout) with one that keeps CPU generator states;
* :func:`tp_group_globals` sets ``parallel_state``'s tp group for the duration of one
  call, for the few megatron-core functions that read it from the globals
  (``vocab_parallel_cross_entropy``) instead of taking a group argument;
* :func:`synchronize` is a no-op on CPU;
* :func:`reduce_scatter` is torch's ``reduce_scatter_single`` where it exists (torch
  2.13 deprecates ``reduce_scatter_tensor``, with a warning on every rank), else
  ``reduce_scatter_tensor`` (the same arguments);
* :func:`quiet_megatron_warnings` imports megatron-core once, quietly and, without CUDA,
  with ``torch.compile`` as the identity: megatron-core decorates its fusion kernels
  (bias-GeLU, bias-SwiGLU, ...) with ``torch.compile`` at import, which imports dynamo
  and inductor, 2.7 s of CPU time in every rank's start-up on the CPU this runs on; the
  runtime calls none of those kernels, and on CPU they would run uncompiled anyway
  until their first call.

``parallel_state.initialize_model_parallel`` is never called: its uniform grid cannot
express HPP.  The bench (bench/runtime_overhead.py) adds what megatron's GPTModel needs
on CPU there, not here.
"""
from __future__ import annotations

import contextlib
import os
import sys
import warnings
from dataclasses import dataclass

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"  # megatron.core.tensor_parallel.random's tracker name


@dataclass(frozen=True)
class Backend:
    name: str
    """torch.distributed backend: "nccl" or "gloo"."""
    device: torch.device
    """Device of this rank's tensors."""

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"


def reduce_scatter(output, input, group=None, async_op=False):
    """Sum ``input`` over ``group`` and leave this rank's part in ``output`` (module docstring)."""
    import torch.distributed as dist

    op = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return op(output, input, group=group, async_op=async_op)


def select_backend(local_rank: int = 0) -> Backend:
    """NCCL + cuda:local_rank when CUDA is available, else gloo + cpu."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return Backend("nccl", torch.device("cuda", torch.cuda.current_device()))
    return Backend("gloo", torch.device("cpu"))


def device_name(backend: Backend) -> str | None:
    """The accelerator's product name (CUDA only), for the loose plan check."""
    return torch.cuda.get_device_name(backend.device) if not backend.is_cpu else None


def quiet_megatron_warnings() -> None:
    """Hide megatron-core's import-time notices about optional TE/Apex kernels, and import
    it (without CUDA: its fusion kernels left uncompiled; see the module docstring)."""
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if "megatron.core" in sys.modules or torch.cuda.is_available():
        return
    compile_ = torch.compile
    torch.compile = _uncompiled
    try:
        import megatron.core.tensor_parallel  # noqa: F401
    finally:
        torch.compile = compile_


def _uncompiled(model=None, **options):
    """``torch.compile``'s signature, returning the function itself (as decorator too)."""
    return model if model is not None else (lambda fn: fn)


def synchronize(backend: Backend) -> None:
    if not backend.is_cpu:
        torch.cuda.synchronize(backend.device)


class CpuRNGStatesTracker:
    """megatron-core's RNG tracker interface (add/fork/get_states/set_states) on CPU states."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.states_, self.seeds_ = {}, set()
        self._is_initialized = False

    def is_initialized(self):
        return self._is_initialized

    def get_states(self):
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = {k: v.clone() for k, v in states.items()}

    def add(self, name, seed):
        if seed in self.seeds_:
            raise ValueError(f"rng seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name=MODEL_PARALLEL_RNG):
        if name not in self.states_:
            raise ValueError(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def setup_rng(backend: Backend, seed: int, replica_seed: int, tp_rank: int):
    """Seed the default generator (same on the tp ranks of one dp replica) and install a
    fresh model-parallel tracker (different per tp rank), megatron's seed convention."""
    from megatron.core.tensor_parallel import random as mrandom

    torch.manual_seed(replica_seed)
    if backend.is_cpu:
        mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    else:
        torch.cuda.manual_seed(replica_seed)
        mrandom.initialize_rng_tracker(force_reset=True)
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.add(MODEL_PARALLEL_RNG, seed + 2718 + tp_rank)
    return tracker


@contextlib.contextmanager
def tp_group_globals(tp_group):
    """Point parallel_state's tp group at ``tp_group`` for one call, then restore it."""
    from megatron.core import parallel_state as ps

    saved = ps._TENSOR_MODEL_PARALLEL_GROUP
    ps._TENSOR_MODEL_PARALLEL_GROUP = tp_group
    try:
        yield
    finally:
        ps._TENSOR_MODEL_PARALLEL_GROUP = saved


def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True
    return torch.device(device).type == "cuda"


@contextlib.contextmanager
def cuda_calls_on_cpu():
    """Redirect hard-coded CUDA calls of megatron-core to the CPU; inactive with CUDA.

    Covers ``device="cuda"`` / ``device=torch.cuda.current_device()`` tensor
    factories, ``Tensor.cuda()``, ``torch.cuda.current_device`` and
    ``torch.cuda.synchronize``.  The HPP runtime's own code path does not need it;
    megatron's GPTModel + schedule (bench/runtime_overhead.py) does.
    """
    if torch.cuda.is_available():
        yield
        return
    saved = []

    def patch(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def on_cpu(factory):
        def wrapper(*args, **kwargs):
            if _is_cuda_device(kwargs.get("device")):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)
        return wrapper

    for name in ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint"):
        patch(torch, name, on_cpu(getattr(torch, name)))
    patch(torch.cuda, "current_device", lambda: "cpu")
    patch(torch.cuda, "synchronize", lambda *a, **k: None)
    patch(torch.Tensor, "cuda", lambda self, *a, **k: self)
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
