"""Cost model: stage latency, device memory and pipeline time (paper section 4.2.3).

Stage time (one micro-batch of ``mbs`` samples; each of the stage's ``dp`` replicas
processes mbs/dp of them on ``tp`` ranks) -- :meth:`CostModel.stage_cost`:

    Tf_j = sum over ops of fwd(op, mbs/dp, tp)           profiled op times
         + TP all-reduces (forward)                        collective_ms, tp group link
                                                           (measured tables inside a node);
                                                           none when the profile's op times
                                                           include them (tp_comm_included)
         + p2p send of the output activation to the next stage (not last stage)
         + runtime overheads: layers x layer + stage, + per checkpointed run of k
           recomputed ops checkpoint + k x checkpoint_op (measured profiles' overhead_ms,
           forward and backward alike; CPU-emulated types add the "wake" cost)
    Tb_j = sum over ops of bwd(op, mbs/dp, tp)
         + recompute: fwd(op) for every recomputed op and layer
         + TP all-reduces (backward, and re-done forward ones of recomputed ops)
         + p2p send of the input gradient to the previous stage (not first stage)
    T_j  = Tf_j + Tb_j

Memory per device (:meth:`CostModel.stage_cost`, ``memory_bytes``):

    weights, grads, optimizer states = params on the device (profiled weight bytes /
        the profile's dtype_bytes, 2 unless stated) x the training setup's bytes per
        parameter (``eth.spec.precision.TrainSetup``: w + g + 12, 18 in bf16 with fp32
        gradients; with ZeRO 1/2 w + g + 12 / N, where the stage search uses N = the
        stage's dp, a lower bound of a block's participants, and :meth:`evaluate` of a
        whole plan the exact per-rank bytes of ``eth.cost.sync.rank_state_bytes``)
    + the larger of two peaks that do not overlap in time:
      activations: in-flight micro-batches under 1F1B (stage j of S, 0-based, holds
        min(S - j, micro-batches) of them) x saved bytes per micro-batch, where a
        contiguous run of recomputed ops in a layer frees its saved activations but
        keeps the run's inputs (the checkpoint), each tensor counted once
        (``eth.cost.activations``),
        + the backward's transient bytes of the one micro-batch being backpropagated
        (:meth:`CostModel.backward_bytes`, :meth:`CostModel.remat_bytes`): the
        gradients of one op's output, input and weights less the saved activations
        already freed, and the largest recomputed run re-materialised
        (bench/predictor_accuracy.py measures them: without them the measured peak of
        a one-layer stage was 12% and of a fully recomputed one 11% above the model's)
      the optimizer step (activations freed): with ZeRO 1/2 the all-gather of the
        updated weights into a full buffer, params x w bytes
        (:meth:`CostModel.peak_extra`; bench/predictor_accuracy.py measures both)
    + reserved bytes (framework context and workspace, from the profile)

Pipeline time, Eq. 1 (stage search, batch B = Gbs or Lbs) -- :func:`eth.cost.equations.eq1_pipeline_ms`:

    sum_j T_j + max_j T_j * (B / Mbs - 1)

End time of stage j of pipeline i, Eq. 5 (batch allocation) -- :func:`eth.cost.equations.eq5_end_times`:

    Te_i^j = sum_k Tf_i^k + max_k T_i^k * (Lbs_i / Mbs_i - 1) + sum_{k>=j} Tb_i^k + AR_i^j

All-Reduce of a gradient block, Eq. 6 -- :func:`eth.cost.equations.eq6_allreduce_ms`:

    AR = 2 * Gra * (N - 1) / (N * BW)

AR_i^j for a stage (:meth:`CostModel.stage_allreduce_ms`, ``eth.cost.sync``) sums
Eq. 6 over the stage's blocks with the block-wise All-Reduce's structure: the block's
elements on the stage's tp rank 0 (tp-partitioned params / tp + the tp-replicated
ones, which sub-block 0 carries) in the setup's bytes per element (fp32 or bf16
gradients; ZeRO's reduce-scatter + all-gather), reduced over N = sum over pipelines
of the dp degree of the stage that holds the block (one participant per replica),
over the slowest link among its holders.  Iteration time of a plan
(:meth:`CostModel.evaluate`) is max over pipelines and stages of the stage's end time
+ its optimizer step (:meth:`CostModel.optimizer_ms`: measured profiles' "optimizer"
overhead, else the step streamed through device memory) and the rest of the training
step outside the compute calls (:meth:`CostModel.step_ms`: end-of-step all-reduces, data;
measured profiles only; with the profile's measured all-reduce table at the plan's world
size, the latency of the step's all-reduces over every rank too).  The end time is
:func:`eth.cost.equations.synced_end_times` (``objective="blocks"``, the default: each
block reduced once its slowest holder in any pipeline is done, for as long as its
lowest-tp holder needs, one block after another on a stage's link; a stage's backward
ends as 1F1B plays it, :func:`eth.cost.equations.one_f_one_b_end_times`, with the
boundary sends on their links) or the paper's Eq. 5 (``objective="eq5"``: Te_i^j with
the stage's own AR_i^j).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from eth.cost.activations import LayerKeep
from eth.cost.equations import (STEP_ALLREDUCES, StageCost, eq1_pipeline_ms, eq5_end_times, one_f_one_b_end_times,
                                synced_end_times)
from eth.cost.cut import CutStages
from eth.cost.floors import StageFloors
from eth.errors import SpecError
from eth.spec.cluster import Cluster
from eth.spec.model import (ACT_BYTES, KNOWN_LAYER_OPS, ModelSpec, layer_dataflow, layer_ops, post_ops,
                            pre_ops, recompute_runs, tp_allgathers, tp_allreduces)
from eth.spec.precision import TrainSetup
from eth.profiles.db import ProfileDB, collective_ms



_LAYER_OP_SET = frozenset(KNOWN_LAYER_OPS)


OBJECTIVES = MappingProxyType({
    "blocks": "gradient blocks",   # eth.cost.equations.synced_end_times
    "eq5": "Eq. 5",                # the paper's: each stage's own All-Reduce after its backward
})
"""What :meth:`CostModel.evaluate` computes end times by (:attr:`CostModel.objective`),
with the name tables print."""


@dataclass
class CostModel(StageFloors, CutStages):
    """Predicts stage/pipeline/plan times and memory from a profile database."""

    model: ModelSpec
    cluster: Cluster
    profiles: ProfileDB
    setup: TrainSetup = field(default_factory=TrainSetup)
    """Precision, ZeRO stage and gradient dtype planned for (bf16, ZeRO 0, fp32 grads)."""
    p2p_blocking: bool = False
    """False (the paper's Eq. 1, the planner's default): a stage-boundary transfer is
    charged to the sending stage only; True: sends and receives block both ends
    (DeepSpeed's pipeline engine, bench/measured_runs.py), so the
    receiving stage's time holds the transfer as well: Tf_j + recv of its input
    (j > 0), Tb_j + recv of its output gradient (j < S - 1)."""
    objective: str = "blocks"
    """How a stage's end time counts the gradient All-Reduce: "blocks" (default) by
    :func:`eth.cost.equations.synced_end_times`, "eq5" by the paper's Eq. 5 (the stage's
    own AR_i^j after its own backward)."""
    optimizer_passes: float = 1.0
    """Without a measured "optimizer" overhead: how many times the optimizer step streams
    its bytes through device memory (1: a fused AdamW, Megatron's default, reads each
    gradient, main weight and moment once and writes the main weight, moments and model
    weight once; unfused steps take ~3)."""
    _cache: dict = field(default_factory=dict, repr=False)
    _links: dict = field(default_factory=dict, repr=False)
    """Slowest link (Gbit/s) of a rank tuple: tp groups and p2p pairs, memoised."""
    _keeps: dict = field(default_factory=dict, repr=False)
    """:meth:`layer_keep` by the identity of its op-cost dictionary (id -> (ops, keep))."""

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise SpecError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if not self.optimizer_passes >= 0:
            raise SpecError(f"optimizer_passes must be >= 0, got {self.optimizer_passes}")

    @property
    def bytes_per_param(self) -> float:
        """Model-state bytes per parameter that every placement needs at least (capacity
        bounds of the search): w + g + 12 with ZeRO 0, w + g with ZeRO 1/2 (optimizer
        state shrinks with the participant count)."""
        return self.setup.state_bytes_per_param(math.inf)

    @property
    def grad_bytes(self) -> float:
        """Eq. 6 bytes per gradient element (``TrainSetup.sync_bytes_per_element``)."""
        return self.setup.sync_bytes_per_element()

    # ------------------------------------------------------------------ stages
    def stage_cost(self, device_type: str, tp: int, dp: int, layers: tuple[int, int], mbs: int,
                   recompute: dict[str, int] | None = None, stage_index: int = 0,
                   num_stages: int = 1, num_microbatches: int | None = None,
                   ranks=None, next_ranks=None, prev_ranks=None, ops=None) -> StageCost:
        """Cost of one stage; see the module docstring for the formulas.  ``ops``: the
        stage starts or ends inside a layer (``eth.spec.plan.StagePlan.ops``):
        :meth:`cut_stage_shape`."""
        if mbs % dp:
            raise SpecError(f"mbs {mbs} is not divisible by dp {dp}")
        recompute = {op: n for op, n in (recompute or {}).items() if n > 0}
        start, end = layers
        inflight = num_stages - stage_index
        if num_microbatches is not None:
            inflight = max(1, min(inflight, num_microbatches))
        links = self.stage_links(device_type, tp, ranks, next_ranks, prev_ranks)
        if ops is not None:
            key = ("cut", device_type, tp, dp, mbs, tuple(layers), tuple(ops), tuple(recompute.items()),
                   inflight) + links
            hit = self._cache.get(key)
            if hit is None:
                shape = self.cut_stage_shape(device_type, tp, mbs // dp, layers, ops, recompute, links)
                hit = self._cache[key] = self._stage_from_shape(shape, device_type, dp, inflight)
            return hit
        return self.stage_cost_at(device_type, tp, dp, end - start, start == 0, end == self.model.num_layers,
                                  mbs, recompute, inflight, links)

    def stage_links(self, device_type: str, tp: int, ranks=None, next_ranks=None,
                    prev_ranks=None) -> tuple[float, float, float]:
        """(tp group, p2p to the next stage, p2p to the previous stage) links of a stage, Gbit/s."""
        return (self._link(device_type, ranks, tp), self._p2p_link(device_type, ranks, next_ranks),
                self._p2p_link(device_type, ranks, prev_ranks))

    def stage_cost_at(self, device_type: str, tp: int, dp: int, nl: int, first: bool, last: bool,
                      mbs: int, recompute: dict[str, int], inflight: int,
                      links: tuple[float, float, float]) -> StageCost:
        """:meth:`stage_cost` of ``nl`` layers (holding the embedding when ``first``, the head
        when ``last``) with ``inflight`` micro-batches in flight and the :meth:`stage_links`
        ``links``; ``recompute`` holds counts > 0 only.  Memoised: a stage's cost depends on
        its position only through ``inflight`` and on its ranks only through ``links``."""
        rec_items = tuple(recompute.items())
        key = (device_type, tp, dp, nl, first, last, mbs, rec_items, inflight) + links
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if mbs % dp:
            raise SpecError(f"mbs {mbs} is not divisible by dp {dp}")
        # times, activations and parameters depend on the shape only, not on the
        # stage's position (in-flight micro-batches) nor its dp (optimizer shards)
        skey = ("shape", device_type, tp, mbs // dp, nl, first, last, rec_items) + links
        shape = self._cache.get(skey)
        if shape is None:
            shape = self._cache[skey] = self._stage_shape(device_type, tp, mbs // dp, nl, first, last,
                                                          recompute, links)
        cost = self._stage_from_shape(shape, device_type, dp, inflight)
        self._cache[key] = cost
        return cost

    def _stage_from_shape(self, shape: tuple, device_type: str, dp: int, inflight: int) -> StageCost:
        """The StageCost of a :meth:`_stage_shape` tuple at ``dp`` and ``inflight``."""
        fwd, bwd, recompute_ms, comm, params, act, reserved, send_f, send_b, transient = shape
        memory = (params * self.setup.state_bytes_per_param(dp)
                  + self.peak_extra(params, inflight * max(act, 0.0) + transient) + reserved
                  + self.cluster.types[device_type].overhead_bytes)
        capacity = self.cluster.types[device_type].memory_bytes
        # StageCost(...) without the frozen dataclass's __init__ (11 object.__setattr__ calls)
        cost = object.__new__(StageCost)
        cost.__dict__.update(fwd_ms=fwd, bwd_ms=bwd, recompute_ms=recompute_ms, comm_ms=comm, params=params,
                             act_bytes=max(act, 0.0), inflight=inflight, memory_bytes=memory,
                             capacity_bytes=capacity, send_fwd_ms=send_f, send_bwd_ms=send_b)
        return cost

    def _stage_shape(self, device_type: str, tp: int, micro: int, nl: int, first: bool, last: bool,
                     recompute: dict[str, int], links: tuple[float, float, float]) -> tuple:
        """(fwd, bwd, recompute, comm ms, params, act bytes, reserved bytes, send fwd / bwd ms,
        backward transient bytes) of ``nl`` layers at ``micro`` samples per replica;
        ``links`` = (tp group, next, previous).  The terms that do not depend on ``nl`` and
        ``recompute`` come from :meth:`_shape_parts` (memoised); the sums run in the same
        order as if computed here, so the floats are the same."""
        pkey = ("parts", device_type, tp, micro, first, last) + links
        parts = self._cache.get(pkey)
        if parts is None:
            parts = self._cache[pkey] = self._shape_parts(device_type, tp, micro, first, last, links)
        ops, reserved, dtype_bytes, sf, sb, sw, sa, extra, tp_parts, ag, send_f, send_b, oh, backward = parts
        fwd = nl * sf
        bwd = nl * sb
        weights = nl * sw
        act = nl * sa
        recompute_ms = sum(ops[op].fwd_ms * n for op, n in recompute.items())
        if recompute:
            rkey = ("saved", device_type, micro, tp, tuple(recompute.items()))
            saved = self._cache.get(rkey)
            if saved is None:
                saved = self._cache[rkey] = self.recompute_savings(ops, recompute)
            act -= saved
        for f, b, w, a in extra:
            fwd += f
            bwd += b
            weights += w
            act += a
        # the runtime's cost beyond the ops, per layer and per stage call (measured profiles'
        # overhead_ms; zeros for analytic and imported ones)
        fwd += nl * oh[0] + oh[2]
        bwd += nl * oh[1] + oh[3]
        if recompute and any(oh[6:10]):   # per checkpoint: a + k x b for a run of k ops
            ckey = ("runs", device_type, micro, tp, tuple(recompute.items()))
            counts = self._cache.get(ckey)
            if counts is None:
                counts = self._cache[ckey] = self._recompute_run_counts(ops, recompute)
            runs, run_ops = counts
            fwd += runs * oh[6] + run_ops * oh[8]
            bwd += runs * oh[7] + run_ops * oh[9]

        comm = 0.0
        if tp_parts is not None:   # tp > 1 and the op times do not hold the TP collectives
            for per_layer, f_sum, b_sum in tp_parts:
                count = nl if per_layer else 1
                comm_f = count * f_sum
                comm_b = count * b_sum
                fwd += comm_f
                bwd += comm_b
                comm += comm_f + comm_b
            # tp > kv_heads: the qkv output is all-gathered (backward: reduce-scattered)
            if ag is not None:
                comm_f = nl * ag[0]
                comm_b = nl * ag[1]
                fwd += comm_f
                bwd += comm_b
                comm += comm_f + comm_b
                if recompute.get("qkv", 0):   # recomputing qkv repeats its all-gather
                    redo_ag = recompute["qkv"] * comm_f / nl
                    recompute_ms += redo_ag
                    comm += redo_ag
            # recomputing a row-parallel GEMM repeats its forward all-reduce
            redo = recompute.get("attn-dense", 0) + recompute.get("mlp-gemm-2", 0)
            if redo:
                prof = self.profiles.get(device_type)
                link = links[0]
                scale = prof.dtype_bytes / ACT_BYTES
                per = collective_ms("all_reduce", tp, tp_allreduces(self.model, micro, "layer")[0][0] * scale,
                                    link, self._measured(prof, device_type, link))
                recompute_ms += redo * per
                comm += redo * per
        bwd += recompute_ms
        fwd += send_f
        bwd += send_b
        comm += send_f + send_b
        remat = 0.0
        if recompute:   # reads the layer ops (by device type, micro, tp) only, not the links
            mkey = ("remat", device_type, micro, tp, nl, tuple(recompute.items()))
            remat = self._cache.get(mkey)
            if remat is None:
                remat = self._cache[mkey] = self.remat_bytes(ops, recompute, nl)
        transient = backward + remat
        return fwd, bwd, recompute_ms, comm, weights / dtype_bytes, act, reserved, send_f, send_b, transient

    def _shape_parts(self, device_type: str, tp: int, micro: int, first: bool, last: bool,
                     links: tuple[float, float, float]) -> tuple:
        """The terms of :meth:`_stage_shape` that do not depend on the layer count nor the
        recompute set: (ops, reserved, dtype bytes, per-layer fwd / bwd / weight / act sums,
        the boundary ops' (fwd, bwd, weight, act), the TP all-reduces' (per layer?, fwd sum,
        bwd sum) per part or None, the all-gathers' per-layer (fwd, bwd) sums or None,
        send fwd / bwd ms, the profile's overheads, the backward's transient bytes
        :meth:`backward_bytes`)."""
        prof = self.profiles.get(device_type)
        scale = prof.dtype_bytes / ACT_BYTES   # activations travel in the profiled dtype
        ops, reserved = self.profiles.layer_costs(device_type, self.model, micro, tp)
        in_layer = [ops[op] for op in layer_ops(self.model)]
        sf = sum(c.fwd_ms for c in in_layer)
        sb = sum(c.bwd_ms for c in in_layer)
        sw = sum(c.weight_bytes for c in in_layer)
        sa = sum(c.act_bytes for c in in_layer)
        extra = tuple((ops[op].fwd_ms, ops[op].bwd_ms, ops[op].weight_bytes, ops[op].act_bytes)
                      for op in (pre_ops(self.model) if first else ()) + (post_ops(self.model) if last else ()))
        tp_parts = ag = None
        if tp > 1 and not prof.tp_comm_included(self.model):  # else the op times hold them
            link = links[0]
            table = self._measured(prof, device_type, link)
            tp_parts = []
            for part in ["layer"] + (["pre"] if first else []) + (["post"] if last else []):
                f_sizes, b_sizes = tp_allreduces(self.model, micro, part)
                tp_parts.append((part == "layer",
                                 sum(collective_ms("all_reduce", tp, b * scale, link, table) for b in f_sizes),
                                 sum(collective_ms("all_reduce", tp, b * scale, link, table) for b in b_sizes)))
            tp_parts = tuple(tp_parts)
            ag_f, ag_b = tp_allgathers(self.model, micro, tp)
            if ag_f:
                ag = (sum(collective_ms("all_gather", tp, b * scale, link, table) for b in ag_f),
                      sum(collective_ms("reduce_scatter", tp, b * scale, link, table) for b in ag_b))
        boundary = micro * self.model.seq_len * self.model.hidden * ACT_BYTES * scale
        send_f = send_b = 0.0
        if not last:
            link = links[1]
            send_f = collective_ms("p2p", 2, boundary, link, self._measured(prof, device_type, link))
        if not first:
            link = links[2]
            send_b = collective_ms("p2p", 2, boundary, link, self._measured(prof, device_type, link))
        if self.p2p_blocking:   # the receives: the input from j - 1, the output gradient from j + 1
            send_f, send_b = (send_f + (send_b if not first else 0.0), send_b + (send_f if not last else 0.0))
        oh = self.profiles.overheads(device_type, self.model, micro, tp)
        return (ops, reserved, prof.dtype_bytes, sf, sb, sw, sa, extra, tp_parts, ag, send_f, send_b, oh,
                self.backward_bytes(ops, last))

    def optimizer_ms(self, mbs: int, stage, params: float = 0.0) -> float:
        """The step after the backward on one rank of ``stage`` (measured profiles'
        overhead_ms "optimizer": layers x per layer + per stage; ZeRO 1/2 step 1/dp of it),
        added to the stage's end time.  Without that field: ``params`` (the rank's, the
        stage cost's ``params``; ZeRO 1/2: 1/dp of them, its shard) x the bytes a fused
        AdamW streams per parameter, gradient g + optimizer state o read and written +
        model weight w written (read too when fp32 weights are stepped in place): g + 2 o
        + w (30 for bf16, 28 for fp32 in place), x :attr:`optimizer_passes` / the
        device's memory bandwidth."""
        if not self.profiles.get(stage.device_type).has_overheads:
            key = ("optimizer", stage.device_type, stage.dp)
            per_param = self._cache.get(key)
            if per_param is None:
                su = self.setup
                streamed = su.grad_bytes + 2 * su.optimizer_bytes + su.weight_bytes * (1 if su.fp32_master else 2)
                shard = stage.dp if su.zero_stage > 0 else 1
                bw = self.cluster.types[stage.device_type].mem_bw_gbs * 1e6      # bytes per ms
                per_param = self._cache[key] = streamed / shard * self.optimizer_passes / bw
            return params * per_param
        oh = self.profiles.overheads(stage.device_type, self.model, mbs // stage.dp, stage.tp)
        ms = (stage.layers[1] - stage.layers[0]) * oh[10] + oh[11]
        return ms / stage.dp if self.setup.zero_stage > 0 else ms

    def step_ms(self, pipeline, stage, world: int = 1) -> float:
        """The training step on one rank of ``stage`` outside its compute calls and the
        optimizer (measured profiles' overhead_ms "step": per iteration, the gradient-norm
        and statistics all-reduces as one process runs them; per sample of the rank's share
        of the pipeline's batch, Lbs / dp, the data fetch), added to the stage's Eq. 5 end
        time; 0 without the field.  Over ``world`` > 1 ranks those all-reduces also pay the
        latency of a collective over every rank: :data:`STEP_ALLREDUCES` x
        :meth:`world_allreduce_ms`."""
        profile = self.profiles.get(stage.device_type)
        if not profile.has_overheads:
            return 0.0
        oh = self.profiles.overheads(stage.device_type, self.model, pipeline.mbs // stage.dp, stage.tp)
        return oh[12] + pipeline.lbs / stage.dp * oh[13] + STEP_ALLREDUCES * self.world_allreduce_ms(profile, world)

    @staticmethod
    def world_allreduce_ms(profile, world: int) -> float:
        """One small all-reduce over ``world`` ranks from the profile's measured table at
        that size (its smallest message: the step's are a few floats, latency-bound); 0
        without such a table (the one-process time in "step" stands, as before)."""
        table = profile.collective_table("all_reduce", world) if world > 1 else None
        return table[0][1] if table else 0.0

    def peak_extra(self, params: float, activations: float) -> float:
        """Bytes above the model states at the device's peak: the activation peak, or the
        optimizer step's (ZeRO 1/2: the updated weights all-gathered into a full buffer
        of params x w bytes), whichever is larger -- the step runs after the backward has
        freed the activations."""
        gather = params * self.setup.weight_bytes if self.setup.zero_stage > 0 else 0.0
        return max(activations, gather)

    @staticmethod
    def _recompute_run_counts(ops, recompute: dict[str, int]) -> tuple[int, int]:
        """(checkpointed runs, ops in them) summed over the stage's layers (the runtime
        runs each run of recomputed ops under one checkpoint)."""
        order = tuple(op for op in ops if op in _LAYER_OP_SET)
        runs = run_ops = prev = 0
        for n in sorted(set(recompute.values())):
            here = recompute_runs({op for op, k in recompute.items() if k >= n}, order)
            runs += (n - prev) * len(here)
            run_ops += (n - prev) * sum(len(r) for r in here)
            prev = n
        return runs, run_ops

    def layer_keep(self, ops) -> LayerKeep:
        """The :class:`eth.cost.activations.LayerKeep` of ``ops`` (a profile's op costs of
        this model), memoised by the layer ops' costs, and first by the dictionary itself
        (the profiles keep one per shape: hashing a dozen op-cost dataclasses on every
        recompute fit cost a tenth of the fits)."""
        mine = self._keeps.get(id(ops))
        if mine is not None and mine[0] is ops:
            return mine[1]
        key = ("keep",) + tuple(ops[op] for op in layer_ops(self.model))
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = LayerKeep(layer_dataflow(self.model), ops)
        self._keeps[id(ops)] = (ops, hit)
        return hit

    def _part_keep(self, ops, held) -> LayerKeep:
        """:meth:`layer_keep` of the ops ``held`` of a layer (a stage cut inside it)."""
        key = ("keep", tuple(held)) + tuple(ops[op] for op in layer_ops(self.model))
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = LayerKeep(layer_dataflow(self.model), ops, held)
        return hit

    def recompute_savings(self, ops, recompute: dict[str, int]) -> float:
        """Activation bytes freed by recomputation, summed over the stage's layers: layers
        [prev, n) recompute exactly the ops whose count exceeds prev, and a layer that
        recomputes the set R frees :meth:`eth.cost.activations.LayerKeep.freed` (R): each
        maximal run of R frees what its ops keep but keeps the run's inputs, each tensor
        counted once (a run whose input another op keeps anyway costs nothing to keep).
        A recomputed fused-attention thus frees its output, log-sum-exp and q, k, v
        copies and keeps the qkv output (its input)."""
        if not recompute:
            return 0.0
        keep = self.layer_keep(ops)
        saved, prev = 0.0, 0
        for n in sorted(set(recompute.values())):
            saved += (n - prev) * keep.freed({op for op, k in recompute.items() if k >= n})
            prev = n
        return saved

    def backward_bytes(self, ops, last: bool) -> float:
        """Transient bytes of the backward of one micro-batch above its saved activations.

        While an op's backward runs, the gradient of its output, the gradient of its
        input it produces and the gradient of its weights (before the accumulation hook
        adds it to the gradient buffer) are alive: input + output + weight bytes.  The
        saved activations of the ops backpropagated before it are freed by then, so the
        op adds max(input + output + weight - freed, 0); the largest of these is reached
        in the first layer backpropagated (later layers have freed more), so the scan
        covers the head ops (last stage) and one layer, in backward order.  Activation
        memory analyses (Korthikanti et al. 2022, "Reducing Activation Recomputation in
        Large Transformer Models") count the saved activations only, at their peak when
        all in-flight micro-batches are held; this term is what that count leaves out.
        The head's logits gradient (vocab-sized) needs no room of its own: megatron-core's
        vocab-parallel cross entropy makes it in place in its saved softmax."""
        order = (post_ops(self.model)[::-1] if last else ()) + layer_ops(self.model)[::-1]
        peak, freed = 0.0, 0.0
        for op in order:
            c = ops[op]
            peak = max(peak, c.input_bytes + c.output_bytes + c.weight_bytes - freed)
            freed += c.act_bytes
        return peak

    def remat_bytes(self, ops, recompute: dict[str, int], nl: int) -> float:
        """Bytes a recomputed run holds again in the backward of one micro-batch, above
        the stage's activation peak: each run is one checkpoint that the backward re-runs
        when it reaches it (``torch.utils.checkpoint``, as Megatron's activation
        recomputation), one layer at a time, holding what the run's ops keep and the
        layer does not keep anyway (:meth:`eth.cost.activations.LayerKeep.rematerialised`)
        until the run's backward is done.  Layer l of the ``nl`` is reached after layers
        l+1.. of the micro-batch have freed their saved activations (after recompute), so
        it adds max(its largest run - those, 0); the largest over the layers.  Layers
        l < n recompute {op: count >= n} (the deepest of each count level is the one
        reached first).  The head ops' activations are not counted as freed: their
        gradients are still alive when the last layer's backward starts."""
        levels = sorted({n for n in recompute.values() if n > 0}, reverse=True)
        if not levels:
            return 0.0
        keep = self.layer_keep(ops)
        # saved activations of the layers behind the deepest layer of each level
        behind = (nl - levels[0]) * keep.total if levels[0] < nl else 0.0
        most, upper, kept = 0.0, levels[0], keep.total
        for n in levels:
            behind += (upper - n) * kept   # layers [n, upper) recompute the level above's
            here = {op for op, k in recompute.items() if k >= n}
            again = [keep.rematerialised(run, here) for run in recompute_runs(here, keep.order)]
            most = max(most, max(again, default=0.0) - behind)
            upper, kept = n, keep.kept(here)
        return most

    def _measured(self, prof, device_type, link):
        """The profile, whose measured collective tables (taken inside one node) apply only
        to collectives over the intra-node link; None (alpha-beta model) otherwise."""
        intra = self.cluster.intra_node_gbps or self.cluster.types[device_type].link_gbps
        return prof if link == intra else None

    def _link(self, device_type, ranks, tp):
        if ranks is None or tp <= 1:
            return self.cluster.intra_node_gbps or self.cluster.types[device_type].link_gbps
        group = tuple(ranks)[:tp]
        gbps = self._links.get(group)
        if gbps is None:
            gbps = self._links[group] = self.cluster.link_gbps(group)
        return gbps

    def _p2p_link(self, device_type, ranks, peer_ranks):
        if ranks is None or not peer_ranks:
            return self.cluster.intra_node_gbps or self.cluster.types[device_type].link_gbps
        pair = (ranks[0], peer_ranks[0])
        gbps = self._links.get(pair)
        if gbps is None:
            gbps = self._links[pair] = self.cluster.link_gbps(pair)
        return gbps

    def pipeline_costs(self, pipeline, num_microbatches: int | None = None) -> list[StageCost]:
        """StageCost of every stage of a pipeline (a PipelinePlan or alike)."""
        return list(self.stage_costs(pipeline, num_microbatches))

    def stage_costs(self, pipeline, num_microbatches: int | None = None):
        """:meth:`pipeline_costs` one stage at a time, from the first (a caller may stop
        at the first stage that does not fit)."""
        stages = pipeline.stages
        n_mb = num_microbatches if num_microbatches is not None else max(pipeline.lbs // pipeline.mbs, 1)
        for j, s in enumerate(stages):
            yield self.stage_cost(s.device_type, s.tp, s.dp, tuple(s.layers), pipeline.mbs, s.recompute,
                                  j, len(stages), n_mb, s.ranks,
                                  stages[j + 1].ranks if j + 1 < len(stages) else None,
                                  stages[j - 1].ranks if j > 0 else None, getattr(s, "ops", None))

    # ------------------------------------------------------------------ all-reduce
    def stage_allreduce_ms(self, pipelines) -> list[list[float]]:
        """AR_i^j (ms) for every stage j of every pipeline i (``eth.cost.sync``)."""
        from eth.cost.sync import stage_allreduce_ms

        return stage_allreduce_ms(self, pipelines)

    # ------------------------------------------------------------------ plans
    def sync_blocks(self, pipelines) -> list:
        """The plan's gradient blocks, holders and Eq. 6 times (``eth.cost.sync``)."""
        from eth.cost.sync import sync_blocks

        return sync_blocks(self, pipelines)

    def evaluate(self, plan, ar=None, blocks=None) -> dict:
        """Predicted times and memory of a whole plan (end times by :attr:`objective`);
        ``ar`` and ``blocks``: the plan's :meth:`stage_allreduce_ms` and :meth:`sync_blocks`
        when the caller has them (they do not depend on Lbs or Mbs)."""
        ar = ar if ar is not None else self.stage_allreduce_ms(plan.pipelines)
        world = sum(len(s.ranks) for p in plan.pipelines for s in p.stages)
        pipes, sync = [], []
        for i, p in enumerate(plan.pipelines):
            costs = self.pipeline_costs(p)
            if self.objective == "eq5":
                ends = self.stage_end_ms(p, costs, ar[i], world)
            else:
                ends = self.backward_end_ms(costs, p.lbs, p.mbs)   # E_h: the last backward's end
                sync.append(i)
            pipes.append({"costs": costs, "end_ms": ends, "ar_ms": ar[i],
                          "pipeline_ms": max(ends) if ends else 0.0})
        if sync:
            blocks = blocks if blocks is not None else self.sync_blocks(plan.pipelines)
            done = synced_end_times({(i, j): e for i in sync for j, e in enumerate(pipes[i]["end_ms"])}, blocks)
            for i in sync:
                p, pp = plan.pipelines[i], pipes[i]
                pp["end_ms"] = [done[i, j] + self.step_after_sync_ms(p, s, c, world)
                                for j, (s, c) in enumerate(zip(p.stages, pp["costs"]))]
                pp["pipeline_ms"] = max(pp["end_ms"]) if pp["end_ms"] else 0.0
        if self.setup.zero_stage > 0 and hasattr(plan, "model"):
            self._exact_state_memory(plan, pipes)
        iteration = max(pp["pipeline_ms"] for pp in pipes)
        feasible = all(c.fits for pp in pipes for c in pp["costs"])
        return {"iteration_ms": iteration, "feasible": feasible, "pipelines": pipes}

    def backward_end_ms(self, costs, lbs: int, mbs: int) -> list[float]:
        """When each stage of a pipeline with stage costs ``costs`` ends its last backward
        under 1F1B, sends on their links unless :attr:`p2p_blocking`
        (:func:`eth.cost.equations.one_f_one_b_end_times`), memoised by the stages' times
        and the micro-batch count."""
        key = ("1f1b", tuple((c.fwd_ms, c.bwd_ms, c.send_fwd_ms, c.send_bwd_ms) for c in costs),
               lbs // mbs if lbs > 0 else 0)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = one_f_one_b_end_times(costs, lbs, mbs, not self.p2p_blocking)
        return list(hit)

    def stage_end_ms(self, pipeline, costs, ar_ms, world: int) -> list[float]:
        """When each stage of ``pipeline`` ends its step: Eq. 5's end time from the stage
        costs ``costs`` and AR_i^j ``ar_ms``, plus the stage's optimizer step and the rest
        of the step over ``world`` ranks."""
        ends = eq5_end_times(costs, pipeline.lbs, pipeline.mbs, ar_ms)
        return [e + self.step_after_sync_ms(pipeline, s, c, world) for e, s, c in zip(ends, pipeline.stages, costs)]

    def step_after_sync_ms(self, pipeline, stage, cost: StageCost, world: int) -> float:
        """What a rank of ``stage`` runs after its gradients are reduced: the optimizer
        step (:meth:`optimizer_ms`) and the rest of the training step (:meth:`step_ms`)."""
        return self.optimizer_ms(pipeline.mbs, stage, cost.params) + self.step_ms(pipeline, stage, world)

    def _exact_state_memory(self, plan, pipes) -> None:
        """ZeRO: replace each stage's model-state estimate (N = its dp) by the largest
        per-rank bytes of the plan's exact block structure (``rank_state_bytes`` with
        the full gradient buffers of the backward pass)."""
        from eth.cost.sync import rank_state_bytes

        peak = self.setup if self.setup.zero_stage == 1 else replace(self.setup, zero_stage=1)
        state = rank_state_bytes(plan, peak)
        for p, pp in zip(plan.pipelines, pipes):
            for j, (st, c) in enumerate(zip(p.stages, pp["costs"])):
                estimate = c.params * self.setup.state_bytes_per_param(st.dp)
                exact = max(sum(state[r].values()) for r in st.ranks)
                pp["costs"][j] = replace(c, memory_bytes=c.memory_bytes - estimate + exact)

    def annotate(self, plan) -> dict:
        """Fill plan/pipeline/stage ``predicted`` fields from :meth:`evaluate`."""
        ev = self.evaluate(plan)
        for p, pp in zip(plan.pipelines, ev["pipelines"]):
            p.predicted = {"pipeline_ms": round(pp["pipeline_ms"], 4),
                           "eq1_ms": round(eq1_pipeline_ms(pp["costs"], p.lbs, p.mbs), 4)}
            for st, c, end, arm in zip(p.stages, pp["costs"], pp["end_ms"], pp["ar_ms"]):
                st.predicted = {"fwd_ms": round(c.fwd_ms, 4), "bwd_ms": round(c.bwd_ms, 4),
                                "recompute_ms": round(c.recompute_ms, 4),
                                "allreduce_ms": round(arm, 4), "end_ms": round(end, 4),
                                "memory_gb": round(c.memory_bytes / 1e9, 4),
                                "capacity_gb": round(c.capacity_bytes / 1e9, 4)}
        plan.predicted = {"iteration_ms": round(ev["iteration_ms"], 4), "feasible": ev["feasible"],
                          "objective": self.objective}
        return ev
