"""Measured op profiles: every op of ``eth.spec.model.all_ops(spec)`` timed and sized on this device.

:func:`measure_entries` runs, for each (mbs, tp) and op, the *runtime's own* op code;
:mod:`megatron.hpp.profiling.file` wraps the entries into a profile in the format of
``eth.profiles.db`` ("source": "measured") and merges it into an existing measured file.
What is measured and how:

* Op modules.  The layer ops (the 13 of a GPT; with RMSNorm, rotary embeddings,
  grouped-query attention, SwiGLU or fused attention those of ``eth.spec.model.layer_ops``)
  are the methods of :class:`megatron.hpp.models.gpt.Layer` (its ``OPS``: same boundaries,
  inputs and outputs as in training); ``embedding`` is ``GPTStage.embed``; the final
  norm (``final-layernorm`` / ``final-rmsnorm``) is ``GPTStage.ln``; ``head+loss`` is the rest of
  ``GPTStage.head_loss`` (output layer + ``vocab_parallel_cross_entropy`` + per-sample
  mean, written out in :func:`_head_loss`; ``tests/runtime/test_profile_ops.py`` checks
  that the composed ops reproduce ``GPTStage.forward``).  For tp > 1 the modules are
  built at one tp rank's shard shapes by handing them a *fake* tp process group of size
  tp (torch's ``FakeProcessGroup``, rank 0): megatron-core then allocates the rank-0
  shards and every tp collective is a no-op, so the numbers are the compute of one
  shard; the cost model adds tp collectives itself (``eth.spec.model.tp_allreduces``).
  With ``real_tp`` (CPU, ``--real-tp``) tp > 1 is measured by tp processes on a real
  gloo group instead (:func:`_real_tp_entries`), the collectives inside the op times, and
  the profile's model entry says ``"tp_comm_included": true``.
* Inputs.  One forward of embedding -> layer -> final layernorm on a random
  micro-batch ([seq, mbs, hidden] activations) gives every op realistic inputs; each
  measurement feeds the op fresh leaf copies (float inputs require grad).
* fwd_ms / bwd_ms: median over ``repeats`` rounds after ``warmup`` rounds; a round runs
  every op's forward once in model order, then every backward in reverse order
  (:func:`time_in_sequence`: caches as a training step leaves them); the backward is
  ``torch.autograd.backward(output, random grad)`` (grads of inputs and parameters),
  then every op's bwd is scaled so that they sum to the median time of ONE backward
  through the chained ops (embedding -> layer -> head + loss, as in a step),
  parameter grads reset to None before each run.  CUDA: CUDA events; CPU: the thread's
  CPU time (``time.thread_time``) when torch runs one thread, else ``time.perf_counter``.
* overhead_ms (``overheads``, default on): in the same rounds, the runtime's own
  ``GPTStage`` (1 and 2 layers, one and all ops of a layer recomputed, with the
  runtime's gradient-accumulation hooks) forward + backward, and on the CPU the 1-layer
  stage again after the core idled (``profile_overheads.WAKE_PAUSE_S``); what they cost beyond the ops
  (per layer, per stage call, per checkpoint, the wake-up) is
  :func:`megatron.hpp.profiling.overheads.stage_overheads`,
  the step after the backward ``profile_overheads.time_optimizer``, the rest of the
  training step (end-of-step all-reduces, data) ``profile_overheads.time_step``
  (docs/FORMATS.md).
* weight_bytes: bytes of the parameters (this tp rank's shard) that receive a gradient
  in the op's backward.
* act_bytes: measured with ``torch.autograd.graph.saved_tensors_hooks``: the sum over
  the *unique storages* (by data pointer) of every tensor packed for backward during
  the op's forward, each counted with its whole storage size.  Counted: the op's own
  inputs when autograd saves them (e.g. a GEMM's input), outputs it saves (softmax),
  masks, indices and statistics (layernorm mean/rstd: fp32 on CUDA, the activation
  dtype on CPU; cross-entropy target mask and indices), temporaries such as the causal mask.  Not counted: parameters
  (they are weight_bytes), and an input whose storage an earlier op of the micro-batch
  already saved (it is held once, so it is counted once, in the first op that saves
  it: the ops' sum is the memory a layer keeps).  A view shares its base's storage:
  score saves q and k, views of the fused qkv output, so score counts the whole qkv
  output and context (which saves v, another view of it) only the attention probs
  after dropout (none at dropout 0: then they are softmax's output, which softmax
  keeps and counts).
* input_bytes / output_bytes: ``numel * element_size`` of the op's tensor arguments
  (token ids and labels included) and of its output.
* reserved_bytes: CPU: ``eth.profiles.db.RESERVED_BYTES`` (an analytic default; the CPU
  allocator keeps no statistics).  CUDA: memory the CUDA context and libraries hold
  outside PyTorch's allocator (``mem_get_info`` used - ``memory_reserved``) plus the
  largest allocator workspace of any op (``max_memory_reserved`` during its forward +
  backward, after ``empty_cache``, minus ``memory_allocated`` before it: the op's
  transient working set, its own saved activations and gradients included).

Collective tables (``--collectives``) are measured by ``megatron.hpp.profiling.collectives``.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import os
import platform
import statistics
import time
from dataclasses import dataclass

import torch

from eth.errors import SpecError
from eth.spec.model import ModelSpec, all_ops, post_ops
from eth.profiles.db import OP_FIELDS, RESERVED_BYTES
from megatron.hpp.profiling.timing import Clock, fake_tp_group, initialised_default_group

DTYPES = ("fp32", "bf16", "fp16")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def torch_dtype(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


@dataclass(frozen=True)
class ProfileConfig:
    """What to measure (validated on construction)."""

    model: ModelSpec
    """Model shape (any the runtime builds: GPT or LLaMA layers, unfused or fused attention)."""
    device_type: str
    """Catalog / cluster device type name the profile is filed under."""
    mbs: tuple
    """Micro-batch sizes to measure."""
    tp: tuple
    """Tensor-parallel degrees (one shard is measured)."""
    dtype: str = "fp32"
    """Parameter and activation dtype: fp32, bf16 or fp16."""
    repeats: int = 10
    """Timed runs per op and pass (the median is kept)."""
    warmup: int = 3
    """Untimed runs before the timed ones."""
    seed: int = 1234
    overheads: bool = True
    """Also time the runtime's stage (1 and 2 layers) in every round and record what it
    costs beyond its ops (entry field ``overhead_ms``, :mod:`megatron.hpp.profiling.overheads`)."""
    real_tp: bool = False
    """CPU: time tp > 1 on a real gloo tp group of tp processes (:func:`_real_tp_entries`),
    as the runtime runs a tp stage, so that the op times include the tp collectives (the
    profile then says ``tp_comm_included``); False: one process, a fake group, the shard's
    compute only."""

    def __post_init__(self):
        object.__setattr__(self, "mbs", tuple(self.mbs))
        object.__setattr__(self, "tp", tuple(self.tp))
        if not self.device_type or not self.device_type.strip():
            raise SpecError("--device-type must be a non-empty name")
        if not self.mbs or any(not isinstance(m, int) or m <= 0 for m in self.mbs):
            raise SpecError(f"mbs must be positive integers, got {list(self.mbs)}")
        if not self.tp or any(not isinstance(t, int) or t <= 0 for t in self.tp):
            raise SpecError(f"tp must be positive integers, got {list(self.tp)}")
        for t in self.tp:
            self.model.check_tp(t)
        if self.dtype not in DTYPES:
            raise SpecError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.repeats < 1 or self.warmup < 0:
            raise SpecError(f"repeats must be >= 1 and warmup >= 0, got {self.repeats}, {self.warmup}")
        if self.real_tp and torch.cuda.is_available():
            raise SpecError("--real-tp runs the tp ranks as gloo processes on the CPU; on GPUs "
                            "it is not implemented (profile with the fake tp group)")


# ----------------------------------------------------------------------------------
# Devices, clocks, names.

def local_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor()
    if not name:
        with contextlib.suppress(OSError):
            for line in open("/proc/cpuinfo"):
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    return f"{name or platform.machine()} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def device_type_warning(device_type: str, device: torch.device) -> str | None:
    """A warning when the measured device does not look like ``device_type``."""
    norm = lambda s: s.lower().replace("-", "").replace(" ", "").replace("_", "")  # noqa: E731
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        family = device_type.split("-")[0] or device_type  # "A100-40GB" -> "A100"
        if norm(family) not in norm(name):
            return f"--device-type {device_type} does not look like this device ({name})"
    elif not norm(device_type).startswith("cpu"):
        return f"no CUDA device: measuring the CPU, but the profile is filed as {device_type}"
    return None


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


# ----------------------------------------------------------------------------------
# The runtime's modules at one tp rank's shard shapes.

def _head_loss(stage, y, labels):
    """``GPTStage.head_loss`` after its final layernorm (loss_scale 1)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron.hpp.compat import tp_group_globals

    logits = stage.out(y)[0]
    with tp_group_globals(stage.tp_group):
        losses = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous())
    return losses.mean(dim=0).sum()


@dataclass
class _Op:
    name: str
    fn: object
    inputs: tuple
    output: str
    params: list


def build_ops(spec: ModelSpec, tp: int, device: torch.device, dtype: torch.dtype, seed: int, group=None):
    """(ops in ``all_ops(spec)`` order, stage, layer): the runtime's modules for one rank of ``tp``
    (``group``: the tp process group; default a fake one of size ``tp``).

    Needs an initialised torch.distributed (see :func:`megatron.hpp.profiling.timing.initialised_default_group`).
    """
    from megatron.hpp.compat import Backend, setup_rng
    from megatron.hpp.models.gpt import INIT_STD, GPTStage, Layer

    group = fake_tp_group(tp) if group is None else group
    tracker = setup_rng(Backend("nccl" if device.type == "cuda" else "gloo", device), seed, seed, 0)
    layer = Layer(spec, 0, group, tracker, frozenset())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # megatron leaves the weights uninitialised (values only matter for NaNs)
        for name, p in layer.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, INIT_STD, generator=gen)
            else:
                p.fill_(1.0 if name.startswith("ln") and name.endswith("weight") else 0.0)
    stage = GPTStage(spec, (0, 0), True, True, group, tracker, seed=seed)
    layer.to(device=device, dtype=dtype).train()
    stage.to(device=device, dtype=dtype).train()
    lp = list(layer.parameters())
    ops = [_Op("embedding", stage.embed, ("tokens",), "x", list(stage.parameters()))]
    ops += [_Op(n, getattr(layer, m), ins, out, lp) for n, m, ins, out in layer.OPS]
    ops += [_Op(post_ops(spec)[0], stage.ln, ("out",), "y", list(stage.parameters())),
            _Op("head+loss", lambda y, labels: _head_loss(stage, y, labels), ("y", "labels"), "loss",
                list(stage.parameters()))]
    assert tuple(o.name for o in ops) == all_ops(spec)
    return ops, stage, layer


@torch.no_grad()
def op_inputs(spec: ModelSpec, ops, mbs: int, device: torch.device, seed: int) -> dict:
    """Every named tensor of one micro-batch's forward (tokens [b, s], hidden [s, b, h])."""
    gen = torch.Generator().manual_seed(seed + mbs)
    tokens = torch.randint(0, spec.vocab, (mbs, spec.seq_len + 1), generator=gen).to(device)
    env = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    for op in ops:
        env[op.output] = op.fn(*[env[i] for i in op.inputs])
    return env


def _fresh(env: dict, names) -> list:
    return [env[n].detach().clone().requires_grad_(env[n].is_floating_point()) for n in names]


# ----------------------------------------------------------------------------------
# Measuring one op.

def saved_activation_bytes(fn, args, params, held=()) -> tuple[float, set, torch.Tensor, bool]:
    """(bytes of the unique non-parameter storages saved for backward, indices of the
    args whose storage was saved, output, whether the output's storage was saved) of
    fn(*args).  Storages of the args listed in ``held`` (already counted by an earlier
    op) are not counted again."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    skip |= {args[i].untyped_storage().data_ptr() for i in held}
    arg_of = {a.untyped_storage().data_ptr(): i for i, a in enumerate(args)}
    storages: dict[int, int] = {}
    saved_args: set[int] = set()

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip and st.nbytes() > 0:
            storages[st.data_ptr()] = max(storages.get(st.data_ptr(), 0), st.nbytes())
            if st.data_ptr() in arg_of:
                saved_args.add(arg_of[st.data_ptr()])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return float(sum(storages.values())), saved_args, out, out.untyped_storage().data_ptr() in storages


def measure_sizes(op: _Op, env: dict, device: torch.device, held: set | None = None) -> dict:
    """{field: value} for the byte fields of OP_FIELDS plus "workspace_bytes" (CUDA) of one
    op, from one forward + backward (its times come from :func:`time_in_sequence`).

    ``held``: names of the micro-batch's tensors whose storage an earlier op already
    saved (not counted again; updated with the inputs this op saves)."""
    cuda = device.type == "cuda"
    held = set() if held is None else held
    for p in op.params:
        p.grad = None
    args = _fresh(env, op.inputs)
    before = torch.cuda.memory_allocated(device) if cuda else 0
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    act, saved, out, saved_out = saved_activation_bytes(
        op.fn, args, op.params, [i for i, n in enumerate(op.inputs) if n in held])
    held.update(op.inputs[i] for i in saved)
    if saved_out:   # softmax keeps its probabilities, which context reads (dropout 0: as they are)
        held.add(op.output)
    torch.autograd.backward(out, torch.randn_like(out) if out.dim() else torch.ones_like(out))
    weight = float(sum(_nbytes(p) for p in op.params if p.grad is not None))
    workspace = float(torch.cuda.max_memory_reserved(device) - before) if cuda else 0.0
    in_bytes, out_bytes = float(sum(_nbytes(a) for a in args)), float(_nbytes(out))
    for p in op.params:
        p.grad = None
    return {"weight_bytes": weight, "act_bytes": act, "input_bytes": in_bytes, "output_bytes": out_bytes,
            "workspace_bytes": workspace}


def _fb_seconds(clock, fwd_fn, pause: float = 0.0) -> tuple[float, float]:
    """(forward, backward) ms of ``fwd_fn()`` (returns a scalar loss) and its backward;
    ``pause`` seconds of sleep before each of the two (the core idles, as an emulated
    rank's does after every compute call)."""
    if pause:
        time.sleep(pause)
    clock.start()
    out = fwd_fn()
    f = clock.stop()
    if pause:
        time.sleep(pause)
    clock.start()
    torch.autograd.backward(out)
    return f, clock.stop()


def time_in_sequence(ops, env: dict, device: torch.device, repeats: int, warmup: int,
                     stages: dict | None = None) -> dict:
    """{op name: (fwd_ms, bwd_ms)}: medians over ``repeats`` rounds (after ``warmup``) in
    which every op runs forward once, in model order, then backward once each, in
    reverse order -- as in a training step, where an op finds the caches as the previous
    op left them.  Timing one op many times in a row instead keeps its weights and inputs
    hot and made the tiny model's layer ops about 2x faster on a CPU than the same ops
    inside a stage's forward (bench/predictor_accuracy.py).

    ``stages`` (optional): {name: (forward fn returning a scalar loss, pause seconds)},
    timed forward + backward in every round right after the ops (so that the host's drift
    affects both alike); their per-round (fwd_ms, bwd_ms) are returned under
    ``result["stages"][name]`` with the per-round op sums under ``result["op_sums"]``."""
    clock = Clock(device)
    fwd = {op.name: [] for op in ops}
    bwd = {op.name: [] for op in ops}
    stage_ms = {name: [] for name in stages or {}}
    grads = {}
    chained = []

    def chain():
        run = {n: env[n] for n in ("tokens", "labels")}
        for op in ops:
            run[op.output] = op.fn(*[run[n] for n in op.inputs])
        return run[ops[-1].output]

    for i in range(warmup + repeats):
        done = []
        for op in ops:
            for p in op.params:
                p.grad = None
            args = _fresh(env, op.inputs)
            clock.start()
            out = op.fn(*args)
            f = clock.stop()
            done.append((op, args, out))
            if i >= warmup:
                fwd[op.name].append(f)
        for op, args, out in reversed(done):
            grad = grads.get(op.name)
            if grad is None:
                grad = grads[op.name] = torch.randn_like(out) if out.dim() else torch.ones_like(out)
            clock.start()
            torch.autograd.backward(out, grad)
            b = clock.stop()
            if i >= warmup:
                bwd[op.name].append(b)
        del done
        # One backward over the chained ops (embedding -> layer -> head + loss, as in a
        # step) costs less than the ops' backwards called one by one (engine start per
        # call, input gradients accumulated into leaf copies): every op's bwd is scaled
        # by the ratio below.
        for op in ops:
            for p in op.params:
                p.grad = None
        b = _fb_seconds(clock, chain)[1]
        if i >= warmup:
            chained.append(b)
        for name, (fn, pause) in (stages or {}).items():
            ms = _fb_seconds(clock, fn, pause)
            if i >= warmup:
                stage_ms[name].append(ms)
    for op in ops:
        for p in op.params:
            p.grad = None
    bwd_ms = {name: statistics.median(v) for name, v in bwd.items()}
    scale = statistics.median(chained) / max(sum(bwd_ms.values()), 1e-12)
    result = {name: (statistics.median(fwd[name]), bwd_ms[name] * scale) for name in fwd}
    if stages:
        result["stages"] = stage_ms
        result["op_sums"] = {"fwd": fwd, "chained_bwd": chained, "bwd": bwd}
    return result


def _context_bytes(device: torch.device) -> float:
    free, total = torch.cuda.mem_get_info(device)
    return float(max(total - free - torch.cuda.memory_reserved(device), 0))


# ----------------------------------------------------------------------------------
# The (mbs, tp, op) grid.

def measure_entries(cfg: ProfileConfig, device: torch.device | None = None, progress=None) -> list[dict]:
    """Profile entries ({"mbs", "tp", "reserved_bytes", "ops"}) for every (mbs, tp).

    ``progress`` (optional) is called once per measured op with (mbs, tp, op name)
    (with ``cfg.real_tp``, for tp > 1 once per op after the tp processes are done).
    """
    from megatron.hpp.compat import quiet_megatron_warnings

    quiet_megatron_warnings()
    device = device or local_device()
    entries = []
    with initialised_default_group():
        for tp in cfg.tp:
            if cfg.real_tp and tp > 1:
                entries += _real_tp_entries(cfg, tp)
                if progress is not None:
                    for mbs in cfg.mbs:
                        for name in all_ops(cfg.model):
                            progress(mbs, tp, name)
            else:
                entries += _entries_for_tp(cfg, tp, device, fake_tp_group(tp), progress)
    return entries


def _entries_for_tp(cfg: ProfileConfig, tp: int, device: torch.device, group, progress=None) -> list[dict]:
    """:func:`measure_entries` for one tp degree, the modules on the tp process group ``group``."""
    from megatron.hpp.profiling.overheads import (WAKE_PAUSE_S, build_stages, stage_overheads, time_optimizer,
                                                time_step)

    dtype = torch_dtype(cfg.dtype)
    entries = []
    ops = build_ops(cfg.model, tp, device, dtype, cfg.seed, group)[0]   # holds the stage and layer
    runtime = build_stages(cfg.model, tp, device, dtype, cfg.seed, group) if cfg.overheads else None
    for mbs in cfg.mbs:
        env = op_inputs(cfg.model, ops, mbs, device, cfg.seed)
        rows, workspace, held = {}, 0.0, set()
        stages = None
        if runtime is not None:
            def call(n, tokens=env["tokens"], labels=env["labels"]):
                return lambda: runtime[n](tokens, labels, 1.0)
            stages = {n: (call(n), 0.0) for n in runtime}
            if device.type == "cpu":
                stages["s1-wake"] = (call("s1"), WAKE_PAUSE_S)
        times = time_in_sequence(ops, env, device, cfg.repeats, cfg.warmup, stages)
        for op in ops:
            m = measure_sizes(op, env, device, held)
            m["fwd_ms"], m["bwd_ms"] = times[op.name]
            rows[op.name] = [m[f] for f in OP_FIELDS]
            workspace = max(workspace, m["workspace_bytes"])
            if progress is not None:
                progress(mbs, tp, op.name)
        entry = {"mbs": mbs, "tp": tp, "reserved_bytes": RESERVED_BYTES, "ops": rows}
        if stages:
            entry["overhead_ms"] = stage_overheads(times, cfg.model, device.type == "cpu")
            step = [time_optimizer(runtime[n], device, cfg.repeats, cfg.warmup) for n in ("s1", "s2")]
            # [ms per layer, ms per stage]
            entry["overhead_ms"]["optimizer"] = [round(step[1] - step[0], 6),
                                                 round(2 * step[0] - step[1], 6)]
            # CPU: after an idle pause, as the runtime's ranks run it (after an emulation sleep
            # or a wait for their peers)
            entry["overhead_ms"]["step"] = time_step(cfg.model, mbs, device, cfg.repeats, cfg.warmup, cfg.seed,
                                                     WAKE_PAUSE_S if device.type == "cpu" else 0.0)
        if device.type == "cuda":
            context = _context_bytes(device)
            entry["reserved_bytes"] = context + workspace
            entry["reserved_detail"] = {"context_bytes": context, "workspace_bytes": workspace}
        entries.append(entry)
        del env
    if device.type == "cuda":   # free the modules and return their cached blocks
        ops = runtime = None
        torch.cuda.empty_cache()
    return entries


REAL_TP_TIMEOUT_S = 600
"""A tp process that waits this long in a collective (its peer died) gives up."""


def _real_tp_entries(cfg: ProfileConfig, tp: int) -> list[dict]:
    """The entries of tp degree ``tp`` measured by ``tp`` processes on the CPU that form a
    real gloo process group, each running :func:`_entries_for_tp` on its shard at the same
    time as the others (as the runtime's tp ranks do, one core each when there are enough):
    the forward all-reduces of the row-parallel GEMMs, the backward ones of the
    column-parallel GEMMs, the embedding's and the cross-entropy's are then inside the
    op times, with their CPU cost and the wake-up after each wait.  Rank 0's entries
    are returned (the ranks run the same code and shapes)."""
    import json
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="hpp-real-tp-") as tmp:
        mp.start_processes(_real_tp_worker, args=(cfg, tp, tmp), nprocs=tp, start_method="spawn", join=True)
        with open(os.path.join(tmp, "entries.json")) as f:
            return json.load(f)


def _real_tp_worker(rank: int, cfg: ProfileConfig, tp: int, tmp: str) -> None:
    """One tp rank of :func:`_real_tp_entries` (a spawned process)."""
    import json

    import torch.distributed as dist

    from megatron.hpp.compat import quiet_megatron_warnings

    quiet_megatron_warnings()
    store = dist.FileStore(os.path.join(tmp, "store"), tp)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=tp,
                            timeout=_dt.timedelta(seconds=REAL_TP_TIMEOUT_S))
    try:
        entries = _entries_for_tp(cfg, tp, torch.device("cpu"), dist.group.WORLD)
        if rank == 0:
            path = os.path.join(tmp, "entries.json")
            with open(path + ".part", "w") as f:
                json.dump(entries, f)
            os.replace(path + ".part", path)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    from megatron.hpp.rank_exit import exit_rank

    exit_rank(0)    # not back into multiprocessing's interpreter exit (rank_exit.py says why)
