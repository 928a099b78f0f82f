"""The HPP train loop behind pretrain_gpt.py.

Order of work on every rank (all ranks read the same plan, so all fail alike):

1. load the plan and check it against WORLD_SIZE and the runtime's needs
   (sum(lbs) == gbs; a --data-path file that exists and holds one sample) -- pure
   Python, before any process group exists, so bad input ends every rank with one
   line on stderr and exit code 2 instead of a hang; rank 0 warns (one line) when
   LOCAL_WORLD_SIZE puts a tp group across nodes;
2. init the default group (nccl+cuda or gloo+cpu), build the topology (all groups);
3. build this rank's stage (in the plan's precision), the gradient reducer on the
   chosen layout (``eth.blocks``: block, device or tensor) and the ZeRO-sharded AdamW;
4. per iteration: 1F1B over the pipeline's micro-batches (loss scaled by 1/gbs, and
   by the loss scale in fp16), buffers reduced as layers finish their last backward,
   global-norm clipping, AdamW on the main-weight shards, weight write-back (all-gather
   with ZeRO 1/2); rank 0 logs loss, iteration time and each pipeline's compute time.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass

from eth.errors import SpecError
from eth.plan import load_plan


@dataclass(frozen=True)
class TrainConfig:
    plan: str
    """Path of the plan JSON."""
    train_iters: int
    """Number of optimizer steps."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float | None = None
    """Cosine-decay floor; None keeps the lr constant after warm-up."""
    warmup: int = 0
    """Linear warm-up iterations."""
    weight_decay: float = 0.01
    """AdamW weight decay (not applied to biases and norms)."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    seed: int = 1234
    """Seed of weights, data and dropout."""
    log_interval: int = 1
    """Log every this many iterations on rank 0."""
    data_path: str | None = None
    """Byte-level text file; None: synthetic data."""
    save_params: str | None = None
    """Write full parameters and losses here at the end (rank 0, atomic)."""
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

    def __post_init__(self):
        if self.train_iters <= 0:
            raise SpecError(f"--train-iters must be positive, got {self.train_iters}")
        if self.lr <= 0:
            raise SpecError(f"--lr must be positive, got {self.lr}")
        if self.warmup < 0 or self.log_interval <= 0 or self.clip_grad < 0:
            raise SpecError(f"--warmup {self.warmup}, --log-interval {self.log_interval}, "
                            f"--clip-grad {self.clip_grad}: need warmup >= 0, interval > 0, clip >= 0")
        from eth.blocks import STRATEGIES

        if self.grad_sync not in STRATEGIES:
            raise SpecError(f"--grad-sync {self.grad_sync!r} is not one of {', '.join(STRATEGIES)}")
        if not (math.isfinite(self.initial_loss_scale) and self.initial_loss_scale >= 1):
            raise SpecError(f"--initial-loss-scale must be a finite number >= 1, got {self.initial_loss_scale}")
        if self.bucket_numel < 0:
            raise SpecError(f"--ddp-bucket-size must be >= 0, got {self.bucket_numel}")

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
        return wanted

    def lr_at(self, iteration: int) -> float:
        """Learning rate of 0-based ``iteration``: linear warm-up, then cosine to min_lr."""
        if iteration < self.warmup:
            return self.lr * (iteration + 1) / self.warmup
        if self.min_lr is None:
            return self.lr
        span = max(self.train_iters - self.warmup, 1)
        progress = min((iteration - self.warmup) / span, 1.0)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    try:
        return int(value)
    except ValueError:
        raise SpecError(f"environment {name}={value!r} is not an integer") from None


def prepare(cfg: TrainConfig):
    """Step 1 (pure Python: no torch import, no process group): returns (plan, layout, rank)."""
    from megatron.hpp.topology import check_plan

    from eth.blocks import GradLayout

    plan = load_plan(cfg.plan)
    world, rank = _env_int("WORLD_SIZE", 1), _env_int("RANK", 0)
    layout = check_plan(plan, world)
    cfg.setup_for(plan)
    GradLayout(plan, cfg.grad_sync, cfg.bucket_numel)   # e.g. tp degrees block-wise cannot align
    if cfg.data_path is not None:
        if plan.model.vocab < 256:
            raise SpecError(f"--data-path needs a byte vocabulary: model vocab {plan.model.vocab} < 256")
        if not os.path.isfile(cfg.data_path):
            raise SpecError(f"data file {cfg.data_path} does not exist")
        size, need = os.path.getsize(cfg.data_path), plan.model.seq_len + 1
        if size < need:
            raise SpecError(f"data file {cfg.data_path} has {size} bytes, a sample needs {need}")
    return plan, layout, rank


@dataclass
class StepResult:
    loss: float
    """Mean per-sample loss of the global batch (all pipelines)."""
    grad_norm: float
    """Global gradient norm before clipping (inf/nan on an fp16 overflow)."""
    compute_s: list
    """Per pipeline: compute seconds of its slowest rank (emulation included)."""
    elapsed_s: float
    skipped: bool = False
    """fp16: the step found inf/nan gradients and was skipped (the loss scale backs off)."""
    loss_scale: float = 1.0


class Trainer:
    """Steps 2-3 in the constructor (default group, topology, stage, gradient reducer,
    sharded optimizer); step 4 in :meth:`step`.  Needs RANK/WORLD_SIZE/MASTER_* unless
    a default group exists."""

    def __init__(self, cfg: TrainConfig, layout, rank: int):
        from megatron.hpp import compat

        compat.quiet_megatron_warnings()
        import torch.distributed as dist

        from eth.blocks import GradLayout
        from megatron.hpp.data import ByteTextData, SyntheticData
        from megatron.hpp.grad_sync import GradReducer
        from megatron.hpp.model import GPTStage
        from megatron.hpp.optimizer import COMPUTE_DTYPES, ShardedAdamW, make_grad_scaler
        from megatron.hpp.schedule import StageComm
        from megatron.hpp.topology import build_topology, rng_seeds

        self.cfg, self.plan, spec = cfg, layout.plan, layout.plan.model
        self.setup = setup = cfg.setup_for(self.plan)
        self.grad_layout = GradLayout(self.plan, cfg.grad_sync, cfg.bucket_numel)
        self.backend = backend = compat.select_backend(_env_int("LOCAL_RANK", 0))
        if not dist.is_initialized():
            dist.init_process_group(backend.name, rank=rank, world_size=layout.world_size)
        self.topo = topo = build_topology(layout, rank, compat.device_name(backend),
                                          self.grad_layout.groups())
        stage = topo.stage
        stage_seed, _ = rng_seeds(layout, rank, cfg.seed)  # tracker: stage_seed + 2718 + tp rank
        tracker = compat.setup_rng(backend, stage_seed, stage_seed, topo.tp_rank)
        dtype = COMPUTE_DTYPES[setup.precision]
        self.model = GPTStage(spec, stage.layers, topo.is_first, topo.is_last, topo.tp_group, tracker,
                              stage.recompute, cfg.seed).to(device=backend.device, dtype=dtype)
        self.model.train()
        self.reducer = GradReducer(self.model, topo, self.grad_layout, setup, backend.device)
        self.optimizer = ShardedAdamW(self.model, topo, self.reducer, setup, cfg.lr, cfg.weight_decay,
                                      cfg.seed)
        self.scaler = make_grad_scaler(setup.precision, cfg.initial_loss_scale)
        self.source = (ByteTextData(cfg.data_path, spec.vocab, spec.seq_len, cfg.seed) if cfg.data_path
                       else SyntheticData(spec.vocab, spec.seq_len, cfg.seed))
        self.comm = StageComm(topo, (spec.seq_len, spec.hidden), dtype, backend.device)
        self.speed = self.plan.cluster.types[stage.device_type].emulate_speed if backend.is_cpu else 0.0
        self.emulated = backend.is_cpu and any(t.emulate_speed > 0 for t in self.plan.cluster.types.values())
        dist.barrier()  # start the first step together, so its logged time means something

    def _batch(self, iteration: int, mb: int):
        from megatron.hpp.data import batch, sample_range

        topo = self.topo
        start, end = sample_range(self.plan, topo.pipeline, mb, topo.stage.dp, topo.dp_rank)
        tokens = batch(self.source, iteration, start, end).to(self.backend.device)
        return tokens[:, :-1], tokens[:, 1:]

    def step(self, iteration: int) -> StepResult:
        import torch
        import torch.distributed as dist

        from megatron.hpp import compat
        from megatron.hpp.grad_sync import clip_coefficient, global_grad_norm
        from megatron.hpp.schedule import ComputeClock, one_f_one_b

        backend, topo, num_pipes = self.backend, self.topo, len(self.plan.pipelines)
        t0 = time.perf_counter()
        self.optimizer.set_lr(self.cfg.lr_at(iteration))
        self.reducer.start_step()
        scale = float(self.scaler.scale) if self.scaler is not None else 1.0
        clock = ComputeClock(self.speed, cuda_events=not backend.is_cpu)  # CUDA: events, no syncs
        loss = one_f_one_b(self.model, topo, self.comm, lambda mb: self._batch(iteration, mb),
                           scale / self.plan.gbs, clock, self.reducer.final_backward)
        self.reducer.finish()
        grad_norm = global_grad_norm(self.reducer, backend.device) / scale
        skipped = not math.isfinite(grad_norm) and self.scaler is not None
        if self.scaler is not None:
            self.scaler.update(skipped)
        if not skipped:
            self.optimizer.step(clip_coefficient(grad_norm, self.cfg.clip_grad) / scale)
        compat.synchronize(backend)
        stats = torch.zeros(1 + num_pipes, dtype=torch.float64, device=backend.device)
        if topo.tp_rank == 0:
            stats[0] = loss.item() / scale
        stats[1 + topo.pipeline] = clock.total_seconds()
        summed = stats.clone()
        dist.all_reduce(summed)                      # loss: sum over last-stage replicas
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # compute: slowest rank of each pipeline
        return StepResult(float(summed[0]), grad_norm, stats[1:].tolist(), time.perf_counter() - t0,
                          skipped, scale)

    def setup_line(self) -> str:
        """One line on what is trained how (rank 0 prints it before the first step)."""
        s, g = self.setup, self.grad_layout
        groups = sum(1 for b in g.buffers if len(b.ranks) > 1)
        return (f"training {self.plan.model.name} with {len(self.plan.pipelines)} pipeline(s) on "
                f"{self.plan.world_size} ranks ({self.backend.name}) | {s.precision} weights, {s.grad_reduce} "
                f"gradients, ZeRO {s.zero_stage} | {g.strategy}-wise gradient sync: {groups} "
                f"collective buffer(s) in {len(g.groups())} group(s)")

    def log_line(self, iteration: int, r: StepResult) -> str:
        per_pipe = ", ".join(f"p{i} {t * 1e3:.1f}" for i, t in enumerate(r.compute_s))
        extra = f" | loss scale {r.loss_scale:g}" if self.scaler is not None else ""
        extra += " | skipped (inf/nan gradients)" if r.skipped else ""
        return (f"iteration {iteration + 1}/{self.cfg.train_iters} | loss {r.loss:.6f} | grad norm "
                f"{r.grad_norm:.4f} | lr {self.cfg.lr_at(iteration):.3g} | time "
                f"{r.elapsed_s * 1e3:.1f} ms | compute ms {per_pipe}"
                + (" (emulated)" if self.emulated else "") + extra)


def train(cfg: TrainConfig, layout, rank: int) -> list[float]:
    """Steps 2-4; returns the per-iteration losses (on every rank)."""
    from megatron.hpp.grad_sync import gather_parameters

    trainer, losses = Trainer(cfg, layout, rank), []
    if rank == 0:
        print(trainer.setup_line(), flush=True)
    for it in range(cfg.train_iters):
        result = trainer.step(it)
        losses.append(result.loss)
        if rank == 0 and ((it + 1) % cfg.log_interval == 0 or it + 1 == cfg.train_iters):
            print(trainer.log_line(it, result), flush=True)
    if cfg.save_params:
        params = gather_parameters(trainer.model, trainer.topo)
        if rank == 0:
            _save(cfg.save_params, {"params": params, "losses": losses,
                                    "plan_hash": layout.plan.content_hash()})
    return losses


def _save(path, obj) -> None:
    import torch

    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def run(cfg: TrainConfig) -> int:
    """Check, train, tear down; returns the process exit code."""
    try:
        _, layout, rank = prepare(cfg)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    if rank == 0:
        from megatron.hpp.topology import tp_node_warning

        local = os.environ.get("LOCAL_WORLD_SIZE")
        note = tp_node_warning(layout, int(local) if local and local.isdigit() else None)
        if note:
            print(note, file=sys.stderr, flush=True)
    try:
        train(cfg, layout, rank)
    except SpecError as exc:
        print(f"error: rank {rank}: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
