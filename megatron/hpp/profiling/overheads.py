"""What the runtime costs beyond the profiled ops, measured by the profiler
(:func:`megatron.hpp.profiling.ops.measure_entries`; profile entry field ``overhead_ms``,
docs/FORMATS.md).

The runtime's own stage (:class:`megatron.hpp.models.gpt.GPTStage` with 1 and 2 layers, with
one op and with a whole layer recomputed, with the runtime's gradient-accumulation hooks;
:func:`build_stages`) is timed in the same rounds as the ops
(:func:`megatron.hpp.profiling.ops.time_in_sequence`), once more after the core idled
(:data:`WAKE_PAUSE_S`); :func:`stage_overheads` turns the rounds into per-layer,
per-stage-call, per-checkpoint and wake-up costs, :func:`time_optimizer` times the
step after the backward and :func:`time_step` the rest of the training step outside the
compute calls (end-of-step all-reduces, data).  The planner's cost model adds them (``eth.cost.model``).
"""
from __future__ import annotations

import statistics
import time

import torch

from eth.spec.model import ModelSpec
from megatron.hpp.profiling.timing import Clock, fake_tp_group


WAKE_PAUSE_S = 0.02
"""Idle time before the "wake" measurement: an emulated rank sleeps (1 / speed - 1) x its
compute after each call, 12-45 ms for the tiny model at speed 0.25-0.1; the extra CPU
time after an idle core grows with the pause up to about 15 ms and then stays
(bench/emulation_cycle.py)."""


class _GradSink:
    """The runtime's gradient accumulation (``grad_sync.GradReducer``): a hook per
    parameter adds its ``.grad`` into its place in one flat fp32 buffer and drops it."""

    def __init__(self, module):
        params = list(module.parameters())
        self.buf = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32,
                               device=params[0].device)
        self.hooks, offset = [], 0
        for p in params:
            view = self.buf[offset:offset + p.numel()].view(p.shape)
            self.hooks.append(p.register_post_accumulate_grad_hook(self._hook(view)))
            offset += p.numel()

    @staticmethod
    def _hook(view):
        def hook(param):
            view.add_(param.grad)
            param.grad = None
        return hook


def build_stages(spec: ModelSpec, tp: int, device: torch.device, dtype: torch.dtype, seed: int,
                 group=None) -> dict:
    """{name: GPTStage}: the runtime's stage (embedding, layers, head + loss) at one tp
    rank's shard shapes, with the runtime's gradient accumulation hooks: "s1" and "s2"
    (1 and 2 layers), "s1-rec" (1 layer recomputed whole: one checkpoint of all its
    ops) and "s1-rec1" (1 layer, its last op recomputed: a checkpoint of one op); ``group``:
    the tp process group (default a fake one of size ``tp``)."""
    from megatron.hpp.compat import Backend, setup_rng
    from megatron.hpp.models.gpt import GPTStage

    from eth.spec.model import layer_ops

    group = fake_tp_group(tp) if group is None else group
    ops = layer_ops(spec)
    shapes = {"s1": (1, {}), "s2": (2, {}), "s1-rec": (1, {op: 1 for op in ops}),
              "s1-rec1": (1, {ops[-1]: 1})}
    out = {}
    for name, (n, recompute) in shapes.items():
        tracker = setup_rng(Backend("nccl" if device.type == "cuda" else "gloo", device), seed, seed, 0)
        stage = GPTStage(spec, (0, n), True, True, group, tracker, recompute, seed=seed)
        stage.to(device=device, dtype=dtype).train()
        stage._sink = _GradSink(stage)
        out[name] = stage
    return out


def time_optimizer(stage, device: torch.device, repeats: int, warmup: int) -> float:
    """Median ms of the runtime's work after the backward for ``stage``'s parameters
    (``megatron.hpp.distributed.optimizer.ShardedAdamW`` with ZeRO 0 on one rank, and the
    training step around it): torch's AdamW over fp32 main weights as flat views, one per
    run of parameters with the same weight-decay rule, gradients from the flat
    accumulation buffer; the global gradient norm (``grad_sync.squared_norm``); the
    write-back of the weights; the buffer zeroed for the next step."""
    from megatron.hpp.distributed.grad_sync import squared_norm

    params = list(stage.parameters())
    buf = stage._sink.buf
    main = torch.cat([p.detach().reshape(-1).float() for p in params])
    runs, offset = [], 0   # [start, end, decay]
    for p in params:
        decay = p.dim() > 1
        if runs and runs[-1][2] == decay:
            runs[-1][1] = offset + p.numel()
        else:
            runs.append([offset, offset + p.numel(), decay])
        offset += p.numel()
    views = [(main[a:b], buf[a:b], d) for a, b, d in runs]
    groups = [{"params": [v for v, _, d in views if d], "weight_decay": 0.01},
              {"params": [v for v, _, d in views if not d], "weight_decay": 0.0}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    clock, times = Clock(device), []
    for i in range(warmup + repeats):
        clock.start()
        with torch.no_grad():
            squared_norm([buf], device)
            for view, grad, _ in views:
                view.grad = grad
            opt.step()
            for view, _, _ in views:
                view.grad = None
            offset = 0
            for p in params:
                p.data.copy_(main[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            buf.zero_()
        t = clock.stop()
        if i >= warmup:
            times.append(t)
    return statistics.median(times)


def time_step(spec: ModelSpec, mbs: int, device: torch.device, repeats: int, warmup: int,
              seed: int = 1234, pause: float = 0.0) -> list:
    """[ms per iteration, ms per sample] of the runtime's training step outside its
    compute calls and the optimizer (``megatron.hpp.training.loop.Trainer.step``), medians:

    * per sample: ``Trainer.batch`` of one micro-batch (``megatron.hpp.data.batches.batch`` of the
      synthetic source, to the device, inputs and labels sliced) / ``mbs``;
    * per iteration (CPU): the step's three small all-reduces on a gloo group of this one
      process (the gradient norm's; the loss / compute / memory statistics', a sum and a
      max) with the ``.item()`` / ``float()`` reads around them and the peak-memory
      query.  With more ranks a collective also waits for the slowest one: Eq. 5's max
      over stages holds that, not this term.  CUDA: 0 (the step runs nccl there; not
      measured).

    ``pause`` (s): the core idles that long before every timed repeat (the profiler gives
    ``WAKE_PAUSE_S`` on the CPU: the runtime's ranks run these right after an emulation
    sleep or a wait for their peers, and a cold core costs 3-5x the back-to-back time)."""
    import resource

    import torch.distributed as dist

    from megatron.hpp.data.batches import SyntheticData, batch

    source = SyntheticData(spec.vocab, spec.seq_len, seed)
    clock, data = Clock(device), []
    for i in range(warmup + repeats):
        if pause:
            time.sleep(pause)
        clock.start()
        tokens = batch(source, i, 0, mbs).to(device)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        t = clock.stop()
        if i >= warmup:
            data.append(t / mbs)
    del inputs, labels
    if device.type != "cpu":
        return [0.0, round(statistics.median(data), 6)]
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    wall, step = Clock(device, cpu_time=False), []
    max_opts = dist.AllreduceOptions()
    max_opts.reduceOp = dist.ReduceOp.MAX
    loss = torch.zeros((), dtype=torch.float64)
    for i in range(warmup + repeats):
        if pause:
            time.sleep(pause)
        wall.start()
        sq = torch.zeros(1, dtype=torch.float32)
        group.allreduce([sq]).wait()
        float(sq.sqrt())
        stats = torch.zeros(3, dtype=torch.float64)
        stats[0] = loss.item()
        stats[2] = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        summed = stats.clone()
        group.allreduce([summed]).wait()
        group.allreduce([stats], max_opts).wait()
        float(summed[0]), stats[1:].tolist()
        t = wall.stop()
        if i >= warmup:
            step.append(t)
    return [round(statistics.median(step), 6), round(statistics.median(data), 6)]


def stage_overheads(times: dict, spec: ModelSpec, wake: bool) -> dict:
    """The ``overhead_ms`` of a profile entry from :func:`time_in_sequence`'s rounds with
    the stages of :func:`build_stages` (keys "s1", "s2", "s1-wake"), as medians over the
    rounds of per-round differences (the host's drift cancels):

    * layer [fwd, bwd]: one more layer through the runtime (s2 - s1) minus the sum of the
      layer's op times of the same round (bwd: the ops' chained backward share);
    * stage [fwd, bwd]: the 1-layer stage minus that layer (s1 - layer) minus the
      embedding, final norm and head + loss ops: the stage call itself, the
      accumulation hooks of its embedding and head parameters, the loss scaling;
    * wake [fwd, bwd] (CPU only, else 0): the 1-layer stage's call after the core idled
      ``WAKE_PAUSE_S`` minus the same call without the pause;
    * checkpoint, checkpoint_op [fwd, bwd]: a recomputed run of k ops costs, beyond its ops'
      forward again in the backward, checkpoint + k x checkpoint_op (the checkpoint
      machinery: RNG states, saved-tensor hooks, the re-run's bookkeeping), from the
      1-layer stage with the whole layer (k = all) and with one op (k = 1) recomputed."""
    from eth.spec.model import layer_ops, post_ops, pre_ops

    st, sums = times["stages"], times["op_sums"]
    layer, extra = layer_ops(spec), pre_ops(spec) + post_ops(spec)
    rounds = len(sums["chained_bwd"])
    res = {"layer": [[], []], "stage": [[], []], "wake": [[], []], "checkpoint": [[], []],
           "checkpoint_op": [[], []]}
    rec = "s1-rec" in st
    for r in range(rounds):
        bwd_total = sum(v[r] for v in sums["bwd"].values())
        share = sums["chained_bwd"][r] / max(bwd_total, 1e-12)
        ops_f = [sum(sums["fwd"][o][r] for o in names) for names in (layer, extra)]
        ops_b = [share * sum(sums["bwd"][o][r] for o in names) for names in (layer, extra)]
        for k in (0, 1):
            ops_ms = (ops_f, ops_b)[k]
            lay = st["s2"][r][k] - st["s1"][r][k]
            res["layer"][k].append(lay - ops_ms[0])
            res["stage"][k].append(st["s1"][r][k] - lay - ops_ms[1])
            res["wake"][k].append(st["s1-wake"][r][k] - st["s1"][r][k] if wake else 0.0)
            if rec:   # the backward (k = 1) re-runs the recomputed ops' forwards
                full = st["s1-rec"][r][k] - st["s1"][r][k] - k * ops_f[0]
                one = st["s1-rec1"][r][k] - st["s1"][r][k] - k * sums["fwd"][layer[-1]][r]
                per_op = (full - one) / max(len(layer) - 1, 1)
                res["checkpoint_op"][k].append(per_op)
                res["checkpoint"][k].append(one - per_op)
    return {key: [round(statistics.median(v), 6) if v else 0.0 for v in pair] for key, pair in res.items()}
