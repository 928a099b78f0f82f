"""Plan -> rank layout and every process group: one immutable topology object per rank.

Two layers:

* :class:`Layout` is symbolic (pure Python, no torch): for every global rank its
  pipeline, stage, tp rank and dp rank, and the ordered list of every group the
  runtime needs.  It is identical on all ranks, so every rank can create every group
  in the same order (a ``torch.distributed.new_group`` requirement).  The dry run
  builds it for plans of any size on one machine.
* :class:`Topology` is this rank's view: its slot in the layout plus the
  ``ProcessGroup`` handles of the groups it belongs to.  It is built once, after the
  plan was checked against WORLD_SIZE, and passed explicitly to every builder.

Groups (created in this order, duplicates by rank set created once):

* ``tp``: per stage and dp replica, the tp ranks ``ranks[d*tp:(d+1)*tp]``, tp rank t
  being the t-th smallest (``StagePlan.replica``: torch orders a group by rank);
* ``hold``: per parameter block (``embedding``, ``layer {l}``, ``head``: final
  layernorm + output layer), every rank of every pipeline that holds the block; the
  gradient all-reduce of :mod:`megatron.hpp.distributed.grad_sync` runs in it.

Stage-to-stage traffic uses point-to-point calls on the default group; the loss and
time reductions use the world group.

Dry run::

    python -m megatron.hpp.parallel.topology --plan plan.json --dry-run [--fake-rank R] [--grad-sync block]

prints the layout and the gradient layout's collective buffers and groups; with
``--fake-rank`` it also creates every group a run creates through torch's fake
backend as rank R (no processes, no network).
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from dataclasses import dataclass, field

from eth.errors import PlanError, SpecError
from eth.layout.params import stage_blocks
from eth.spec.plan import Plan, StagePlan, load_plan


@dataclass(frozen=True)
class RankSlot:
    """Where one global rank sits in the plan."""

    rank: int
    pipeline: int
    stage: int
    tp_rank: int
    dp_rank: int


@dataclass(frozen=True)
class GroupSpec:
    """A process group to create: kind ("tp" or "hold"), a readable name, its ranks."""

    kind: str
    name: str
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """Symbolic rank layout of a plan (see module docstring); validated on construction."""

    plan: Plan
    world_size: int
    slots: tuple[RankSlot, ...] = field(init=False)
    groups: tuple[GroupSpec, ...] = field(init=False)
    holders: dict = field(init=False)
    """Block key -> tuple of the ranks (all pipelines) holding it."""

    def __post_init__(self):
        plan = self.plan
        if plan.world_size != self.world_size:
            raise PlanError(f"plan needs {plan.world_size} ranks, WORLD_SIZE is {self.world_size}")
        total = sum(p.lbs for p in plan.pipelines)
        if total != plan.gbs:
            raise PlanError(f"sum of pipeline lbs is {total} but gbs is {plan.gbs}; the runtime "
                            f"requires equality (lbs: {[p.lbs for p in plan.pipelines]})")
        slots: list = [None] * self.world_size
        tp_groups, holders = [], {}
        held = stage_blocks(plan)
        for i, pipe in enumerate(plan.pipelines):
            for j, stage in enumerate(pipe.stages):
                for d in range(stage.dp):
                    ranks = stage.replica(d)
                    tp_groups.append(GroupSpec("tp", f"tp p{i} s{j} d{d}", ranks))
                    for t, r in enumerate(ranks):
                        slots[r] = RankSlot(r, i, j, t, d)
                for key in held[i, j]:
                    holders.setdefault(key, []).extend(stage.ranks)
        missing = [r for r, s in enumerate(slots) if s is None]
        if missing:
            raise PlanError(f"plan leaves ranks {missing[:8]} of WORLD_SIZE {self.world_size} unused")
        holders = {k: tuple(sorted(v)) for k, v in holders.items()}
        groups, seen = [], set()
        for g in tp_groups + [GroupSpec("hold", f"hold {k}", v) for k, v in holders.items()]:
            if g.ranks not in seen:
                seen.add(g.ranks)
                groups.append(g)
        object.__setattr__(self, "slots", tuple(slots))
        object.__setattr__(self, "groups", tuple(groups))
        object.__setattr__(self, "holders", holders)

    def stage_of(self, rank: int) -> StagePlan:
        slot = self.slots[rank]
        return self.plan.pipelines[slot.pipeline].stages[slot.stage]

    def describe(self) -> str:
        """Human-readable layout: pipelines, stages, group counts."""
        plan, lines = self.plan, []
        lines.append(f"plan: model {plan.model.name} ({plan.model.num_layers} layers), "
                     f"world {self.world_size}, gbs {plan.gbs}, {len(plan.pipelines)} pipelines")
        for i, p in enumerate(plan.pipelines):
            lines.append(f"pipeline {i}: mbs {p.mbs} lbs {p.lbs} micro-batches {p.num_microbatches} "
                         f"stages {len(p.stages)}")
            for j, s in enumerate(p.stages):
                lines.append(f"  stage {j}: {s.device_type} ranks {_ranges(s.ranks)} tp {s.tp} "
                             f"dp {s.dp} layers [{s.layers[0]}, {s.layers[1]})"
                             + (f" recompute {s.recompute}" if s.recompute else ""))
        kinds = {}
        for g in self.groups:
            kinds[g.kind] = kinds.get(g.kind, 0) + 1
        lines.append("groups: " + ", ".join(f"{n} {k}" for k, n in kinds.items())
                     + f" ({len(self.groups)} in all)")
        blocks: dict = {}
        for key, ranks in self.holders.items():
            blocks.setdefault(ranks, []).append(key)
        for ranks, keys in blocks.items():
            lines.append(f"  hold group of {len(ranks)} ranks: {', '.join(keys)}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Topology:
    """This rank's place in the plan and the process groups it uses."""

    layout: Layout
    rank: int
    tp_group: object
    """ProcessGroup of this rank's tp ranks (same stage, same dp replica)."""
    hold_groups: dict
    """Block key -> ProcessGroup of all ranks holding that block."""
    groups: dict = field(default_factory=dict)
    """Sorted rank tuple -> ProcessGroup, for every group this rank belongs to (tp, hold
    and the gradient layout's participant sets)."""
    pg_collection: object = None
    """megatron.core ProcessGroupCollection (tp) for megatron-core APIs that take one."""

    @property
    def plan(self) -> Plan:
        return self.layout.plan

    @property
    def slot(self) -> RankSlot:
        return self.layout.slots[self.rank]

    @property
    def pipeline(self) -> int:
        return self.slot.pipeline

    @property
    def stage_index(self) -> int:
        return self.slot.stage

    @property
    def tp_rank(self) -> int:
        return self.slot.tp_rank

    @property
    def dp_rank(self) -> int:
        return self.slot.dp_rank

    @property
    def stage(self) -> StagePlan:
        return self.layout.stage_of(self.rank)

    @property
    def pipe(self):
        return self.plan.pipelines[self.pipeline]

    @property
    def num_stages(self) -> int:
        return len(self.pipe.stages)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def prev_stage(self) -> StagePlan | None:
        return None if self.is_first else self.pipe.stages[self.stage_index - 1]

    @property
    def next_stage(self) -> StagePlan | None:
        return None if self.is_last else self.pipe.stages[self.stage_index + 1]

    @property
    def tp_root(self) -> int:
        """Global rank of tp rank 0 of this rank's dp replica."""
        return self.stage.rank(0, self.dp_rank)


def rng_seeds(layout: Layout, rank: int, seed: int) -> tuple[int, int]:
    """(default generator seed, model-parallel tracker seed) of ``rank``.

    Megatron's convention extended to several pipelines: megatron seeds the default
    generator with seed + 100 * pipeline-stage rank and the tracker with that + 2718 +
    tp rank.  Here the stage number is the (pipeline, stage) pair's position among all
    stages of the plan (pipeline 0 first; for one pipeline it is the stage index, i.e.
    megatron's seeds).  The default generator (embedding and residual dropouts on
    tp-replicated activations) is thus identical on the tp ranks of a replica, which
    must share those masks, and the tracker (attention dropout on a tp rank's own
    heads) differs per tp rank.  Like megatron without ``data_parallel_random_init``,
    the seeds do not depend on the dp replica (replicas see different samples)."""
    slot = layout.slots[rank]
    stage_uid = sum(len(p.stages) for p in layout.plan.pipelines[:slot.pipeline]) + slot.stage
    base = seed + 100 * stage_uid
    return base, base + 2718 + slot.tp_rank


def tp_node_warning(layout: Layout, local_world_size: int | None) -> str | None:
    """One line when, with ``local_world_size`` ranks per node (torchrun places ranks
    contiguously), some stage's tp group spans several nodes; None otherwise."""
    if not local_world_size or local_world_size <= 0:
        return None
    crossing = [g for g in layout.groups if g.kind == "tp"
                and len({r // local_world_size for r in g.ranks}) > 1]
    if not crossing:
        return None
    g, cluster = crossing[0], layout.plan.cluster
    planned = {cluster.devices[r].node for r in g.ranks} if cluster.world_size >= layout.world_size else set()
    per_node = sorted({n.devices_per_node for n in cluster.nodes})
    return (f"warning: LOCAL_WORLD_SIZE {local_world_size} puts {len(crossing)} tp group(s) across "
            f"nodes, e.g. {g.name} (ranks {_ranges(g.ranks)}); the plan's cluster has "
            f"{'/'.join(map(str, per_node))} devices per node"
            + (" and keeps that group on one node" if len(planned) == 1 else "")
            + ": tp collectives will cross the inter-node link")


def check_plan(plan: Plan, world_size: int) -> Layout:
    """Build the layout or raise PlanError naming the numbers (before any group exists)."""
    return Layout(plan, world_size)


def build_topology(layout: Layout, rank: int, device_name: str | None = None,
                   extra_groups=()) -> Topology:
    """Create every group of ``layout``, then ``extra_groups`` (sorted rank tuples, e.g.
    ``eth.layout.blocks.GradLayout.groups()``), on all ranks in the same order, and return
    rank's view.  A rank set is created once whatever lists it.

    Needs an initialised default process group.  ``device_name`` (CUDA only) is
    compared loosely with the stage's device type; a mismatch is only a warning.
    """
    import torch.distributed as dist

    stage = layout.stage_of(rank)
    if device_name is not None:
        wanted = stage.device_type.lower().replace("-", "").replace(" ", "")
        have = device_name.lower().replace("-", "").replace(" ", "")
        if wanted not in have:
            warnings.warn(f"rank {rank}: plan stage expects a {stage.device_type}, "
                          f"this device is a {device_name}")
    handles, created = {}, set()
    for ranks in [tuple(sorted(g.ranks)) for g in layout.groups] + [tuple(r) for r in extra_groups]:
        if ranks in created:
            continue
        created.add(ranks)
        pg = dist.new_group(list(ranks))
        if rank in ranks:
            handles[ranks] = pg
    slot = layout.slots[rank]
    tp_group = handles[stage.replica(slot.dp_rank)]
    keys = stage_blocks(layout.plan)[slot.pipeline, slot.stage]
    hold = {k: handles[layout.holders[k]] for k in keys}
    from megatron.core.process_groups_config import ProcessGroupCollection

    return Topology(layout, rank, tp_group, hold, handles, ProcessGroupCollection(tp=tp_group))


def _ranges(ranks) -> str:
    ranks = list(ranks)
    if ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}..{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    return str(ranks)


def fake_build(layout: Layout, rank: int, extra_groups=()) -> Topology:
    """Create every group (and ``extra_groups``) through torch's fake backend as ``rank``
    (dry run only)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron.hpp.compat import quiet_megatron_warnings

    quiet_megatron_warnings()

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    try:
        return build_topology(layout, rank, extra_groups=extra_groups)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Check a plan and print its rank layout "
                                     "without starting processes.")
    parser.add_argument("--plan", required=True, help="plan JSON")
    parser.add_argument("--dry-run", action="store_true", help="build the layout only (default)")
    parser.add_argument("--world-size", type=int, default=None,
                        help="WORLD_SIZE to check against (default: the plan's)")
    parser.add_argument("--fake-rank", type=int, default=None,
                        help="also create every process group as this rank on torch's fake backend")
    parser.add_argument("--grad-sync", default="block", choices=("block", "device", "tensor"),
                        help="gradient layout whose groups the run creates (pretrain_gpt.py --grad-sync)")
    parser.add_argument("--ddp-bucket-size", type=int, default=40_000_000,
                        help="as pretrain_gpt.py: gradient bucket size in elements, 0 = unbucketed")
    args = parser.parse_args(argv)
    from eth.layout.blocks import GradLayout

    try:
        if args.world_size is not None and args.world_size < 1:
            raise SpecError(f"--world-size must be >= 1 (default: the plan's), got {args.world_size}")
        if args.ddp_bucket_size < 0:
            raise SpecError(f"--ddp-bucket-size must be >= 0 (0: unbucketed), got {args.ddp_bucket_size}")
        plan = load_plan(args.plan)
        layout = check_plan(plan, plan.world_size if args.world_size is None else args.world_size)
        grads = GradLayout(plan, args.grad_sync, args.ddp_bucket_size)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(layout.describe())
    reduced = [b for b in grads.buffers if len(b.ranks) > 1]
    per_rank = max((len([b for b in grads.buffers_of(r) if len(b.ranks) > 1]) for r in range(plan.world_size)),
                   default=0)
    print(f"gradient sync ({args.grad_sync}-wise, {plan.training.precision}, ZeRO {plan.training.zero_stage}): "
          f"{len(reduced)} collective buffers in {len(grads.groups())} participant groups, "
          f"at most {per_rank} per rank")
    if args.fake_rank is not None:
        if not 0 <= args.fake_rank < layout.world_size:
            print(f"error: --fake-rank {args.fake_rank} is outside 0..{layout.world_size - 1}",
                  file=sys.stderr)
            return 2
        t0 = time.perf_counter()
        topo = fake_build(layout, args.fake_rank, grads.groups())
        created = len({tuple(sorted(g.ranks)) for g in layout.groups} | set(grads.groups()))
        print(f"fake backend: rank {topo.rank} = pipeline {topo.pipeline} stage {topo.stage_index} "
              f"tp {topo.tp_rank} dp {topo.dp_rank}; created {created} groups "
              f"(this rank is in {len(topo.groups)}) in {time.perf_counter() - t0:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
