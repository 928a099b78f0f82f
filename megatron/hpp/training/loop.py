"""The HPP train loop behind pretrain_gpt.py.

Order of work on every rank (all ranks read the same plan, so all fail alike; with
``--hpp-cluster`` the default group comes first and the plan is made for the ranks
present, ``startup_plan.py``, before step 1):

1. check the flags (``TrainConfig``), load the plan and check it against WORLD_SIZE
   and the runtime's needs (sum(lbs) == gbs; with --data-path every dataset prefix,
   its token type and split: ``datasets.check_data``) -- pure Python, before any
   process group exists, so bad input ends every rank with one line on stderr and
   exit code 2 instead of a hang; rank 0 warns (one line) when LOCAL_WORLD_SIZE puts
   a tp group across nodes;
2. init the default group (nccl+cuda or gloo+cpu, timeout --distributed-timeout-minutes;
   a one-rank run without torchrun gets an in-process store, no port), build the
   topology (all groups);
3. build this rank's stage (in the plan's precision), the gradient reducer on the
   chosen layout (``eth.layout.blocks``: block, device or tensor) and the ZeRO-sharded AdamW;
   the data source (synthetic, or the indexed datasets of --data-path: rank 0 builds
   megatron-core's index cache first, with a progress bar);
4. per iteration: 1F1B over the pipeline's micro-batches (loss scaled by 1/gbs, and
   by the loss scale in fp16), buffers reduced as layers finish their last backward,
   global-norm clipping, AdamW on the main-weight shards (skipped when the gradient
   norm is not finite), weight write-back (all-gather with ZeRO 1/2); the
   ``metrics.MetricsLogger`` prints interval averages on rank 0 and the
   ``failures.NanGuard`` stops a run that keeps producing NaN/Inf (exit 1).
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field

from eth.errors import SpecError
from eth.spec.plan import load_plan
from megatron.hpp.data.datasets import DEFAULT_SPLIT, check_data, parse_split
from megatron.hpp.parallel.launch import env_int, init_default_group


@dataclass(frozen=True)
class TrainConfig:
    plan: str | None
    """Path of the plan JSON; None with ``startup``."""
    train_iters: int
    """Number of optimizer steps."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float | None = None
    """Cosine-decay floor; None keeps the lr constant after warm-up."""
    plan_flags: dict = field(default_factory=dict)
    """Megatron's flags for what the plan decides, as given ({argparse dest: value};
    ``eth.spec.plan_flags``): checked against the plan."""
    warmup: int = 0
    """Linear warm-up iterations."""
    weight_decay: float = 0.01
    """AdamW weight decay (not applied to biases and norms)."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    seed: int = 1234
    """Seed of weights, data and dropout."""
    log_interval: int = 1
    """Log every this many iterations on rank 0 (averages over the interval)."""
    data_path: tuple | None = None
    """Megatron's ``--data-path`` tokens: indexed-dataset prefixes (PREFIX ... or
    W PREFIX W PREFIX ..., ``megatron/hpp/data/datasets.py``); None: synthetic data."""
    split: str = DEFAULT_SPLIT
    """Train/valid/test shares of every prefix's documents (``--split``)."""
    data_cache_path: str | None = None
    """Index cache folder (``--data-cache-path``); None: ``datasets.default_cache_path()``."""
    max_nan_iters: int = 3
    """Stop (exit 1) after this many consecutive iterations with a NaN/Inf loss or
    gradient norm (fp16 overflows the loss scaler skips do not count)."""
    distributed_timeout_minutes: float = 10.0
    """Timeout of every collective and p2p transfer (Megatron's name and default)."""
    tensorboard_dir: str | None = None
    """Also write the logged numbers as TensorBoard scalars here (if tensorboard is installed)."""
    save_params: str | None = None
    """Write full parameters and losses here at the end (rank 0, atomic)."""
    save: str | None = None
    """Checkpoint folder to write (``megatron.hpp.training.checkpoint``): every ``save_interval``
    iterations and at the end."""
    save_interval: int | None = None
    """Iterations between checkpoints (None: only at the end)."""
    load: str | None = None
    """Checkpoint folder to resume from (its latest complete checkpoint; none there:
    start from scratch).  Any plan of the same model shape can resume it."""
    exit_interval: int | None = None
    """Stop after an iteration divisible by this (after saving), as Megatron's flag."""
    grad_sync: str = "block"
    """Gradient synchronisation: block (paper 4.3), device (padded) or tensor (per tensor)."""
    bucket_numel: int = 40_000_000
    """Largest gradient bucket in elements (one collective each, launched during the
    backward pass); 0 = one bucket per fused buffer.  Megatron DDP's default size."""
    precision: str | None = None
    """fp32, bf16 or fp16; None = the plan's (``plan.training``)."""
    zero_stage: int | None = None
    """0, 1 or 2; None = the plan's."""
    grad_reduce: str | None = None
    """Gradient accumulation/reduction dtype fp32 or bf16; None = the plan's."""
    initial_loss_scale: float = 2.0 ** 16
    """fp16: the dynamic loss scale to start from (halved after 2 overflowing steps in a
    row, each of them skipped; doubled after 1000 clean steps)."""
    eval_interval: int | None = None
    """Validation loss every this many iterations and after the last (``evaluation.py``);
    None: no evaluation."""
    eval_iters: int = 10
    """Validation global batches per evaluation."""
    verify_checkpoint: bool = False
    """Compare every file of the checkpoint to load with its checksum (``checkpoint.verify``),
    not only the sizes and the small files."""
    exit_signal_handler: bool = False
    """On SIGTERM, finish the iteration, save (with ``save``) and exit 0 (``failures.ExitSignal``)."""
    startup: object = None
    """A ``startup_plan.PlanRequest``: plan at start-up for the ranks present instead of
    reading ``plan`` (``pretrain_gpt.py --hpp-cluster``)."""

    def __post_init__(self):
        if self.train_iters <= 0:
            raise SpecError(f"--train-iters must be positive, got {self.train_iters}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise SpecError(f"--lr must be a finite positive number, got {self.lr}")
        if self.min_lr is not None and not (math.isfinite(self.min_lr) and 0 <= self.min_lr <= self.lr):
            raise SpecError(f"--min-lr must be between 0 and --lr {self.lr:g}, got {self.min_lr}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise SpecError(f"--weight-decay must be a finite number >= 0, got {self.weight_decay}")
        if not math.isfinite(self.clip_grad):
            raise SpecError(f"--clip-grad must be finite, got {self.clip_grad}")
        if self.max_nan_iters < 1:
            raise SpecError(f"--max-nan-iters must be >= 1, got {self.max_nan_iters}")
        if not (math.isfinite(self.distributed_timeout_minutes) and self.distributed_timeout_minutes > 0):
            raise SpecError(f"--distributed-timeout-minutes must be a finite positive number, got "
                            f"{self.distributed_timeout_minutes}")
        if isinstance(self.data_path, str):
            object.__setattr__(self, "data_path", (self.data_path,))
        elif self.data_path is not None:
            object.__setattr__(self, "data_path", tuple(str(t) for t in self.data_path))
        parse_split(self.split)
        if self.warmup < 0 or self.log_interval <= 0 or self.clip_grad < 0:
            raise SpecError(f"--warmup {self.warmup}, --log-interval {self.log_interval}, "
                            f"--clip-grad {self.clip_grad}: need warmup >= 0, interval > 0, clip >= 0")
        from eth.layout.blocks import STRATEGIES

        if self.grad_sync not in STRATEGIES:
            raise SpecError(f"--grad-sync {self.grad_sync!r} is not one of {', '.join(STRATEGIES)}")
        if not (math.isfinite(self.initial_loss_scale) and self.initial_loss_scale >= 1):
            raise SpecError(f"--initial-loss-scale must be a finite number >= 1, got {self.initial_loss_scale}")
        if self.bucket_numel < 0:
            raise SpecError(f"--ddp-bucket-size must be >= 0, got {self.bucket_numel}")
        for name in ("save_interval", "exit_interval", "eval_interval"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise SpecError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if self.eval_iters <= 0 and self.eval_interval is not None:
            raise SpecError(f"--eval-iters must be positive with --eval-interval, got {self.eval_iters}")
        if self.verify_checkpoint and self.load is None:
            raise SpecError("--verify-checkpoint checks the checkpoint --load reads: give --load DIR")
        if self.save_interval is not None and self.save is None:
            raise SpecError(f"--save-interval {self.save_interval} needs --save DIR")

    def setup_for(self, plan):
        """The plan's TrainSetup; a flag that contradicts it is a SpecError."""
        wanted = plan.training
        for name, flag in (("precision", "--bf16/--fp16/--fp32"), ("zero_stage", "--zero-stage"),
                           ("grad_reduce", "--grad-reduce-in-bf16")):
            given = getattr(self, name)
            if given is not None and given != getattr(wanted, name):
                raise SpecError(f"{flag} asks for {name} {given!r} but the plan was made for "
                                f"{getattr(wanted, name)!r} (plan.training {wanted.to_dict()}); "
                                f"re-plan with tools/search_hpp.py or drop the flag")
        if not wanted.fp32_master:
            raise SpecError(f"plan.training.fp32_master is false (fp32 weights stepped in place, as DeepSpeed's "
                            f"fp32 Adam does), but this runtime keeps fp32 main weights: re-plan without it "
                            f"(plan.training {wanted.to_dict()})")
        return wanted

    def data_config(self, plan):
        """The plan's ``datasets.DataConfig`` (None: synthetic data); checks the flags only."""
        if self.data_path is None:
            return None
        from megatron.hpp.data.datasets import DataConfig

        return DataConfig(self.data_path, plan.model.seq_len, plan.model.vocab, self.seed, self.split,
                          self.data_cache_path)

    def lr_at(self, iteration: int) -> float:
        """Learning rate of 0-based ``iteration``: linear warm-up, then cosine to min_lr."""
        if iteration < self.warmup:
            return self.lr * (iteration + 1) / self.warmup
        if self.min_lr is None:
            return self.lr
        span = max(self.train_iters - self.warmup, 1)
        progress = min((iteration - self.warmup) / span, 1.0)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))


def prepare(cfg: TrainConfig, plan=None):
    """Step 1 (no process group; torch is imported only to read a --load checkpoint's
    metadata): returns (plan, layout, rank).  ``plan``: the plan made at start-up
    (``startup_plan``), else ``cfg.plan`` is read."""
    from eth.layout.blocks import GradLayout
    from eth.spec.plan_flags import check_plan_flags
    from megatron.hpp.parallel.topology import check_plan

    if plan is None:
        plan = load_plan(cfg.plan)
    check_plan_flags(plan, cfg.plan_flags)
    world, rank = env_int("WORLD_SIZE", 1), env_int("RANK", 0)
    if "WORLD_SIZE" not in os.environ and plan.world_size != 1:
        raise SpecError(f"plan needs {plan.world_size} ranks, WORLD_SIZE is not set (one process): "
                        f"launch it with torchrun --nproc-per-node {plan.world_size} pretrain_gpt.py ...")
    layout = check_plan(plan, world)
    if world > 1 and not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        raise SpecError(f"WORLD_SIZE {world} needs MASTER_ADDR and MASTER_PORT (torchrun sets them)")
    cfg.setup_for(plan)
    GradLayout(plan, cfg.grad_sync, cfg.bucket_numel)   # e.g. tp degrees block-wise cannot align
    data = cfg.data_config(plan)
    if data is not None:
        check_data(data)   # a directory, a plain text file, missing/short files, token width
    if cfg.load is not None:
        from megatron.hpp.training.checkpoint import check_load

        common = check_load(cfg.load, plan.model, cfg.save)   # another model: SpecError
        if common is not None and not cfg.verify_checkpoint:   # (verified: train() checks)
            check_iterations_left(cfg, common["iteration"])
    check_outputs(cfg)
    return plan, layout, rank


def check_outputs(cfg: TrainConfig) -> None:
    """Every folder and file the run will write can be written (SpecError naming the flag),
    before any work, not at the first save (pretrain_gpt checks it before planning too)."""
    from eth.cli.common import check_output_dir, check_output_file

    for flag, folder in (("--save", cfg.save), ("--tensorboard-dir", cfg.tensorboard_dir),
                         ("--data-cache-path", cfg.data_cache_path)):
        if folder is not None:
            check_output_dir(folder, flag)
    if cfg.save_params is not None:
        check_output_file(cfg.save_params, "--save-params")


def emulation_line(plan) -> str:
    """Each device type's speed on a CPU run: a fraction of a core, or a whole core where the
    plan leaves ``emulate_speed`` at 0 (not emulated: its ranks run at full speed)."""
    used = {st.device_type for p in plan.pipelines for st in p.stages}
    return "emulated: " + ", ".join(
        f"{name} {t.emulate_speed:g} of a core" if t.emulate_speed > 0 else f"{name} not emulated (full core)"
        for name, t in sorted(plan.cluster.types.items()) if name in used)


def check_iterations_left(cfg: TrainConfig, iteration: int) -> None:
    if iteration >= cfg.train_iters:
        raise SpecError(f"--load {cfg.load} is at iteration {iteration}, --train-iters is {cfg.train_iters}: "
                        f"nothing to train")


@dataclass
class StepResult:
    loss: float
    """Mean per-sample loss of the global batch (all pipelines)."""
    grad_norm: float
    """Global gradient norm before clipping (inf/nan on an fp16 overflow)."""
    compute_s: list
    """Per pipeline: compute seconds of its slowest rank (emulation included)."""
    elapsed_s: float
    """Wall time of the step on this rank."""
    skipped: bool = False
    """fp16: the step found inf/nan gradients and was skipped (the loss scale backs off)."""
    loss_scale: float = 1.0
    nonfinite: bool = False
    """The loss, or (without a loss scaler) the gradient norm, is NaN/Inf: the weights were
    not updated and ``failures.NanGuard`` counts it."""
    peak_mem_bytes: list = None
    """Per pipeline: the largest peak memory of its ranks since start (CUDA max allocated,
    CPU max RSS)."""


class Trainer:
    """Steps 2-3 in the constructor (default group, topology, stage, gradient reducer,
    sharded optimizer); step 4 in :meth:`step`.  Needs RANK/WORLD_SIZE/MASTER_* unless
    a default group exists."""

    def __init__(self, cfg: TrainConfig, layout, rank: int):
        from megatron.hpp import compat

        compat.quiet_megatron_warnings()
        import torch.distributed as dist

        from eth.layout.blocks import GradLayout
        from megatron.hpp.training.metrics import peak_memory_bytes
        from megatron.hpp.distributed.grad_sync import GradReducer
        from megatron.hpp.models.boundary import buffer_shape
        from megatron.hpp.models.gpt import GPTStage
        from megatron.hpp.distributed.optimizer import COMPUTE_DTYPES, ShardedAdamW, make_grad_scaler
        from megatron.hpp.parallel.schedule import StageComm
        from megatron.hpp.parallel.topology import build_topology, rng_seeds

        self.cfg, self.plan, spec = cfg, layout.plan, layout.plan.model
        self.setup = setup = cfg.setup_for(self.plan)
        self.grad_layout = GradLayout(self.plan, cfg.grad_sync, cfg.bucket_numel)
        self.backend = backend = compat.select_backend(env_int("LOCAL_RANK", 0))
        if not dist.is_initialized():
            init_default_group(backend.name, rank, layout.world_size, cfg.distributed_timeout_minutes)
        from megatron.hpp.parallel.launch import check_launch

        check_launch(self.plan.cluster)   # hosts in the cluster's node-major order, or SpecError
        self.topo = topo = build_topology(layout, rank, compat.device_name(backend),
                                          self.grad_layout.groups())
        stage = topo.stage
        stage_seed, _ = rng_seeds(layout, rank, cfg.seed)  # tracker: stage_seed + 2718 + tp rank
        tracker = compat.setup_rng(backend, stage_seed, stage_seed, topo.tp_rank)
        dtype = COMPUTE_DTYPES[setup.precision]
        self.model = GPTStage(spec, stage.layers, topo.is_first, topo.is_last, topo.tp_group, tracker,
                              stage.recompute, cfg.seed, stage.ops).to(device=backend.device, dtype=dtype)
        self.model.train()
        self.reducer = GradReducer(self.model, topo, self.grad_layout, setup, backend.device)
        self.optimizer = ShardedAdamW(self.model, topo, self.reducer, setup, cfg.lr, cfg.weight_decay,
                                      cfg.seed)
        self.scaler = make_grad_scaler(setup.precision, cfg.initial_loss_scale)
        self.source = self.valid_source = None   # attach_data, once the start is known
        self.peak_memory = lambda: peak_memory_bytes(backend.device)
        span = stage.span(spec)
        self.comm = StageComm(topo, buffer_shape(spec, span[0]), dtype, backend.device,
                              out_shape=buffer_shape(spec, span[1]))
        self.speed = self.plan.cluster.types[stage.device_type].emulate_speed if backend.is_cpu else 0.0
        self.emulated = backend.is_cpu and any(t.emulate_speed > 0 for t in self.plan.cluster.types.values())
        dist.barrier()  # start the first step together, so its logged time means something

    def attach_data(self, start: int = 0, consumed: int = 0, built: int | None = None) -> str | None:
        """The data sources of a run that starts after ``start`` iterations that consumed
        ``consumed`` training samples (a resumed run: the checkpoint's count, whatever
        global batch it had).  ``built``: the training samples the index was built for
        (a checkpoint's record): the index is built for at least as many, so that it
        orders the samples as before.  Collective with --data-path (rank 0 builds the
        index cache, the others wait).  Returns a note for rank 0 to print, or None."""
        from megatron.hpp.data.batches import SyntheticData
        from megatron.hpp.training.evaluation import valid_batches_needed

        cfg, spec, gbs = self.cfg, self.plan.model, self.plan.gbs
        data = cfg.data_config(self.plan)
        if data is None:   # synthetic: validation sequences from another seed
            self.source = SyntheticData(spec.vocab, spec.seq_len, cfg.seed)
            self.valid_source = SyntheticData(spec.vocab, spec.seq_len, cfg.seed + 1)
            return None
        from megatron.hpp.data.datasets import build_sources

        offset = consumed - start * gbs   # 0 unless the global batch changed on resume
        needed = offset + cfg.train_iters * gbs
        valid_iters = valid_batches_needed(cfg.train_iters, cfg.eval_interval, cfg.eval_iters)
        sources = build_sources(data, gbs, cfg.train_iters, valid_iters, progress=self.topo.rank == 0,
                                train_samples=max(needed, built or 0), offset=offset)
        self.source, self.valid_source = sources.train, sources.valid
        self.train_samples_built = max(needed, built or 0)
        if valid_iters and self.valid_source is None:
            raise SpecError(f"--eval-interval {cfg.eval_interval}: --split {cfg.split} leaves no "
                            f"validation documents (give the second share a weight, e.g. 98,2,0)")
        if built is not None and needed > built:
            return (f"note: this run needs {needed} training samples, the checkpoint's run built its index for "
                    f"{built}: the larger index shuffles differently, so the samples from sample {consumed} on "
                    f"are not the ones an uninterrupted run would have read")
        return None

    def batch(self, source, iteration: int, mb: int):
        """(inputs, labels) of this rank's dp slice of micro-batch ``mb`` of global batch
        ``iteration`` of ``source``."""
        from megatron.hpp.data.batches import batch, sample_range

        topo = self.topo
        start, end = sample_range(self.plan, topo.pipeline, mb, topo.stage.dp, topo.dp_rank)
        tokens = batch(source, iteration, start, end).to(self.backend.device)
        return tokens[:, :-1], tokens[:, 1:]

    def step(self, iteration: int) -> StepResult:
        import torch
        import torch.distributed as dist

        from megatron.hpp import compat
        from megatron.hpp.training.failures import step_nonfinite
        from megatron.hpp.distributed.grad_sync import clip_coefficient, global_grad_norm
        from megatron.hpp.parallel.schedule import ComputeClock, one_f_one_b

        backend, topo, num_pipes = self.backend, self.topo, len(self.plan.pipelines)
        if self.source is None:
            self.attach_data()   # a run from scratch (benches, tests); train() attaches after loading
        t0 = time.perf_counter()
        self.optimizer.set_lr(self.cfg.lr_at(iteration))
        self.reducer.start_step()
        scale = float(self.scaler.scale) if self.scaler is not None else 1.0
        clock = ComputeClock(self.speed, cuda_events=not backend.is_cpu)  # CUDA: events, no syncs
        loss = one_f_one_b(self.model, topo, self.comm, lambda mb: self.batch(self.source, iteration, mb),
                           scale / self.plan.gbs, clock, self.reducer.final_backward)
        self.reducer.finish()
        grad_norm = global_grad_norm(self.reducer, backend.device) / scale
        finite = math.isfinite(grad_norm)
        skipped = not finite and self.scaler is not None
        if self.scaler is not None:
            self.scaler.update(skipped)
        if finite:   # a NaN/Inf gradient never reaches the weights (fp16: the scaler's skip)
            self.optimizer.step(clip_coefficient(grad_norm, self.cfg.clip_grad) / scale)
        compat.synchronize(backend)
        stats = torch.zeros(1 + 2 * num_pipes, dtype=torch.float64, device=backend.device)
        if topo.tp_rank == 0:
            stats[0] = loss.item() / scale
        stats[1 + topo.pipeline] = clock.total_seconds()
        stats[1 + num_pipes + topo.pipeline] = self.peak_memory()[0]
        summed = stats.clone()
        dist.all_reduce(summed)                      # loss: sum over last-stage replicas
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # compute, memory: largest rank of each pipeline
        loss_value = float(summed[0])
        min_scale = float(self.scaler.min_scale) if self.scaler is not None else None
        nonfinite = step_nonfinite(loss_value, finite, scale if self.scaler is not None else None, min_scale)
        return StepResult(loss_value, grad_norm, stats[1:1 + num_pipes].tolist(), time.perf_counter() - t0,
                          skipped, scale, nonfinite, stats[1 + num_pipes:].tolist())

    def setup_line(self) -> str:
        """One line on what is trained how (rank 0 prints it before the first step)."""
        s, g = self.setup, self.grad_layout
        groups = sum(1 for b in g.buffers if len(b.ranks) > 1)
        return (f"training {self.plan.model.name} with {len(self.plan.pipelines)} pipeline(s) on "
                f"{self.plan.world_size} ranks ({self.backend.name}) | {s.precision} weights, {s.grad_reduce} "
                f"gradients, ZeRO {s.zero_stage} | {g.strategy}-wise gradient sync: {groups} "
                f"collective buffer(s) in {len(g.groups())} group(s) | data: {self.data_line()}"
                + (f" | {emulation_line(self.plan)}" if self.emulated else ""))

    def data_line(self) -> str:
        if self.cfg.data_path is None:
            return "synthetic sequences (no --data-path)"
        return (f"{' '.join(self.cfg.data_path)} (split {self.cfg.split}, {len(self.source)} training "
                f"samples of {self.plan.model.seq_len + 1} tokens)")

    def metrics_logger(self, rank: int, sample_offset: int = 0):
        """The run's :class:`~megatron.hpp.training.metrics.MetricsLogger` (prints on rank 0 only)."""
        from megatron.hpp.training.metrics import MetricsLogger, tensorboard_writer

        cfg, enabled = self.cfg, rank == 0
        writer = tensorboard_writer(cfg.tensorboard_dir, note=lambda line: print(line, file=sys.stderr,
                                                                                 flush=True)) if enabled else None
        return MetricsLogger(self.plan, cfg.train_iters, cfg.log_interval, cfg.lr_at, enabled=enabled,
                             emulated=self.emulated, loss_scale=self.scaler is not None,
                             memory_kind=self.peak_memory()[1], writer=writer, sample_offset=sample_offset)


def train(cfg: TrainConfig, layout, rank: int) -> list[float]:
    """Steps 2-4; returns the per-iteration losses (on every rank).  Raises
    ``failures.TrainingStopped`` (NaN/Inf) and ``failures.CommFailure`` (a rank died or
    is stuck)."""
    from megatron.hpp.training import checkpoint
    from megatron.hpp.training.evaluation import eval_due, eval_line, evaluate
    from megatron.hpp.training.failures import ExitSignal, NanGuard, TrainingStopped, during
    from megatron.hpp.distributed.grad_sync import gather_parameters

    timeout = cfg.distributed_timeout_minutes
    signals = ExitSignal() if cfg.exit_signal_handler else None   # before the slow start-up
    with during("start-up", timeout):
        trainer = Trainer(cfg, layout, rank)
    start = consumed = 0
    built, notes = None, []
    if cfg.load is not None:
        found = checkpoint.find(cfg.load)
        if cfg.verify_checkpoint and found.path is not None:
            with during("checkpoint verification", timeout):
                found = checkpoint.verify(found)
            if found.path is None:
                raise SpecError(f"--load {cfg.load} --verify-checkpoint: no intact checkpoint: "
                                + "; ".join(f"{p.name}: {why}" for p, why in found.damaged))
        notes += found.lines()
        if found.path is not None:
            check_iterations_left(cfg, checkpoint.check_common(found.path, trainer.plan.model)["iteration"])
            with during("checkpoint loading", timeout):
                common = checkpoint.load(found.path, trainer)
            start, consumed = common["iteration"], common["consumed_samples"]
            built = (common.get("data") or {}).get("train_samples_built")
            notes.append(f"resumed from {found.path} at iteration {start} ({consumed} samples consumed)")
            notes += checkpoint.setup_changes(common, trainer)
        else:
            notes.append(f"no checkpoint yet in {cfg.load} (the --save folder): starting from iteration 0")
    with during("data start-up", timeout):
        note = trainer.attach_data(start, consumed, built)
    saved = start
    logger = trainer.metrics_logger(rank, sample_offset=consumed - start * layout.plan.gbs)
    guard, losses, valid = NanGuard(cfg.max_nan_iters), [], {}
    if rank == 0:
        print(trainer.setup_line(), flush=True)
        for line in notes + ([note] if note else []):
            print(line, flush=True)

    def save(done: int) -> None:
        samples = consumed + (done - start) * layout.plan.gbs
        with during("checkpoint saving", timeout):
            path = checkpoint.save(cfg.save, trainer, done, samples)
        if rank == 0:
            print(f"saved {path}", flush=True)

    try:
        done = start
        for it in range(start, cfg.train_iters):
            with during(f"iteration {it + 1}", timeout):
                result = trainer.step(it)
            losses.append(result.loss)
            stop = guard.update(it, result)
            logger.record(it, result, flush=stop is not None)
            if stop:
                raise TrainingStopped(stop)
            done = it + 1
            if cfg.startup is not None and cfg.save and rank == 0:
                from megatron.hpp.training.startup_plan import record_progress

                record_progress(cfg.save, done)   # the next start counts the iterations lost
            if eval_due(done, cfg.train_iters, cfg.eval_interval, cfg.eval_iters):
                with during(f"evaluation after iteration {done}", timeout):
                    valid[done] = evaluate(trainer, done)
                if rank == 0:
                    print(eval_line(done, valid[done], cfg.eval_iters), flush=True)
            if cfg.save and cfg.save_interval and done % cfg.save_interval == 0:
                save(done)
                saved = done
            if cfg.exit_interval and done % cfg.exit_interval == 0:
                break
            if signals is not None:
                with during(f"iteration {done}", timeout):
                    stop_now = signals.any_rank(trainer.backend.device)
                if stop_now:
                    if cfg.save and saved != done:
                        save(done)
                        saved = done
                    if rank == 0:
                        print(f"{signals.name} received: stopped after iteration {done}"
                              + (f", checkpoint in {cfg.save}" if cfg.save else " (no --save: nothing kept)"),
                              flush=True)
                    signals.await_own()   # elastic agents stop each worker themselves
                    break
        if cfg.save and saved != done:
            save(done)
    finally:
        logger.close()
    if cfg.save_params:
        with during("--save-params", timeout):
            params = gather_parameters(trainer.model, trainer.topo)
        if rank == 0:
            _save(cfg.save_params, {"params": params, "losses": losses, "valid": valid,
                                    "plan_hash": layout.plan.content_hash()})
    return losses


def _save(path, obj) -> None:
    import torch

    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def run(cfg: TrainConfig) -> int:
    """Check, train, tear down; returns the process exit code (failures.py: 0 done,
    1 stopped, 2 bad input).  After a communication failure the process ends here
    (``os._exit(1)``): tearing down a group whose collective failed can abort or hang."""
    from megatron.hpp.training.failures import CommFailure, TrainingStopped, checking_input, report_error

    try:
        with checking_input():
            plan = None
            if cfg.startup is not None:
                from megatron.hpp.training.startup_plan import plan_at_startup

                plan, trains = plan_at_startup(cfg.startup, cfg.save, cfg.distributed_timeout_minutes)
                if not trains:   # the fleet choice leaves this rank out (rank 0 said which)
                    return 0
            _, layout, rank = prepare(cfg, plan)
    except SpecError as exc:
        report_error(str(exc))   # every rank finds it, one prints it
        return 2
    if rank == 0:
        from megatron.hpp.parallel.topology import tp_node_warning

        local = os.environ.get("LOCAL_WORLD_SIZE")
        note = tp_node_warning(layout, int(local) if local and local.isdigit() else None)
        if note:
            print(note, file=sys.stderr, flush=True)
    code = 0
    try:
        train(cfg, layout, rank)
    except SpecError as exc:   # data too short, checkpoint contents: found alike on every rank
        report_error(str(exc))
        code = 2
    except TrainingStopped as exc:
        report_error(str(exc))   # every rank stops at the same iteration (the loss and norm are global)
        code = 1
    except CommFailure as exc:
        report_error(f"rank {rank}: {exc}", every_rank=True)
        from megatron.hpp.rank_exit import exit_rank

        exit_rank(1)    # no teardown, no finally
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return code
