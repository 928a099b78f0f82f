"""Layout-independent checkpoints on torch.distributed.checkpoint (DCP), resumable under
another plan (other pipelines, tp degrees, layer splits, ZeRO stage, world size).

What is stored, by logical parameter name and full shape (``eth.layout.params``):

* ``main/<name>``, ``exp_avg/<name>``, ``exp_avg_sq/<name>``: the fp32 main weights and
  AdamW moments (``megatron.hpp.distributed.optimizer``).  The model's weights are not stored: they
  are the main weights in the compute dtype and are written back on load.
* ``common.json`` (rank 0): iteration, consumed samples, AdamW step count, fp16 loss
  scaler state, the model spec (a checkpoint of another shape is refused), the
  training setup and the plan's hash; ``rng/rank<r>.pt``: each rank's RNG states,
  restored only when resuming under the same plan (under another plan the ranks' roles
  differ; the run's dropout masks then differ from an uninterrupted run's).

Each rank writes the elements whose ZeRO shard it owns in every gradient buffer it
participates in (``Buffer.shard``; with ZeRO 0 as well): the shards partition the
model, so every element is written exactly once.  A flat shard range of a piece
(chunk c of a parameter along its tp dimension) is written as at most three boxes of
the full parameter (a partial row, whole rows, a partial row).  DCP keeps their
offsets in its metadata, and on load each rank asks for the boxes of the elements it
now steps; DCP reads them from whichever saved boxes overlap them (resharding).  The
save and load planners (:class:`_BoxSavePlanner`, :class:`_BoxLoadPlanner`) are
DCP's default planners with the state dict replaced by these boxes.

Atomicity: DCP writes into ``<dir>/iter_NNNNNNN.tmp``; after every rank is done, rank 0
renames it to ``iter_NNNNNNN`` and then replaces ``<dir>/latest`` (temp file +
rename).  A save killed half-way leaves a ``.tmp`` folder that is never read, and
``latest`` still names the previous complete checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import fields
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (LoadPlan, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from eth.errors import SpecError
from eth.fileio import atomic_write_text

SHAPE_FIELDS = ("num_layers", "hidden", "heads", "ffn", "seq_len", "vocab", "kv_heads", "swiglu",
                "norm", "position", "bias", "norm_eps", "rope_theta")
"""The model fields a checkpoint must share with the plan that resumes it: its parameters'
shapes and what the layers compute (not the name, the attention op set or dropout)."""


def _piece_boxes(piece, lo: int, hi: int):
    """Boxes (global offsets, sizes, flat start, flat end) of elements [lo, hi) of a
    piece, flattened row-major, within the full parameter."""
    shape = piece.shape
    base = [0] * len(shape)
    if piece.spec.dim is not None and piece.chunks > 1:
        base[piece.spec.dim] = piece.chunk * shape[piece.spec.dim]
    if len(shape) == 1:
        return [((base[0] + lo,), (hi - lo,), lo, hi)]
    cols = shape[1]
    boxes, pos = [], lo
    while pos < hi:
        row, col = divmod(pos, cols)
        if col or hi - pos < cols:      # a partial row
            end = min(hi, (row + 1) * cols)
            boxes.append(((base[0] + row, base[1] + col), (1, end - pos), pos, end))
        else:                           # whole rows
            rows = (hi - pos) // cols
            end = pos + rows * cols
            boxes.append(((base[0] + row, base[1]), (rows, cols), pos, end))
        pos = end
    return boxes


def _boxes(reducer, ranges, starts, flats):
    """{(fqn, offsets): (box view, full shape)} over elements ``ranges[i] = (lo, hi)`` of
    every bucket i, for each kind of ``flats`` (kind -> per-bucket flat tensor holding
    buffer elements from ``starts[i]`` on)."""
    out = {}
    for i, b in enumerate(reducer.buckets):
        lo, hi = ranges[i]
        for piece, offset in zip(b.buf.pieces, b.buf.offsets):
            a, z = max(lo, offset), min(hi, offset + piece.numel)
            if a >= z:
                continue
            for off, size, s, e in _piece_boxes(piece, a - offset, z - offset):
                first = offset + s - starts[i]
                for kind, per_bucket in flats.items():
                    view = per_bucket[i][first:first + e - s].view(size)
                    out[(f"{kind}/{piece.spec.name}", tuple(off))] = (view, piece.spec.full_shape)
    return out


def _state_tensors(optimizer, copy_moments: bool):
    """(starts, {kind: per-bucket flat tensor}) of the main weights (the optimizer's own
    tensors) and the AdamW moments (flat copies of its per-view state, or zeros)."""
    starts = [lo for lo, _ in optimizer.mains]
    flats = {"main": [main for _, main in optimizer.mains], "exp_avg": [], "exp_avg_sq": []}
    for i, (lo, main) in enumerate(optimizer.mains):
        for kind in ("exp_avg", "exp_avg_sq"):
            flat = torch.zeros_like(main)
            if copy_moments:
                for j, s, e, view in optimizer.views:
                    if j == i and view in optimizer.optimizer.state:
                        flat[s - lo:e - lo].copy_(optimizer.optimizer.state[view][kind])
            flats[kind].append(flat)
    return starts, flats


class _BoxSavePlanner(DefaultSavePlanner):
    def __init__(self, boxes):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes = boxes

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(
                               chunk=ChunkStorageMetadata(offsets=torch.Size(off), sizes=view.shape),
                               properties=TensorProperties(dtype=view.dtype), size=torch.Size(full)))
                 for (fqn, off), (view, full) in self.boxes.items()]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item):
        return self.boxes[(write_item.index.fqn, tuple(write_item.index.offset))][0]


class _BoxLoadPlanner(DefaultLoadPlanner):
    def __init__(self, boxes):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes = boxes

    def create_local_plan(self) -> LoadPlan:
        items = []
        for (fqn, off), (view, _) in self.boxes.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if md is None:
                raise SpecError(f"checkpoint has no {fqn}")
            chunk = ChunkStorageMetadata(offsets=torch.Size(off), sizes=view.shape)
            items += create_read_items_for_chunk_list(fqn, md, [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index):
        return self.boxes[(index.fqn, tuple(index.offset))][0]


def _iter_dir(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}"


def latest(root) -> Path | None:
    """The last complete checkpoint under ``root`` (None if there is none): the one
    ``latest`` names, or, if that file is missing or names a folder that is gone (a save
    of the same iteration killed between replacing the folder and the marker), the
    highest-numbered complete ``iter_*`` folder."""
    root, marker = Path(root), Path(root) / "latest"
    if marker.is_file():
        path = root / marker.read_text().strip()
        if (path / "common.json").is_file():
            return path
    done = sorted(p for p in root.glob("iter_*") if p.suffix != ".tmp" and (p / "common.json").is_file())
    return done[-1] if done else None


def check_load_path(load, save=None) -> None:
    """SpecError unless ``--load`` names a folder with a checkpoint of ours, or is the
    ``--save`` folder (the auto-resume idiom: nothing there yet starts fresh)."""
    path = Path(load)
    if save is not None and path.resolve() == Path(save).resolve():
        if path.exists() and not path.is_dir():
            raise SpecError(f"--load/--save {load} is a file, not a folder")
        return
    if not path.exists():
        raise SpecError(f"--load {load} does not exist (to start fresh and resume later, give the same "
                        f"folder to --save and --load)")
    if not path.is_dir():
        raise SpecError(f"--load {load} is a file, not a checkpoint folder")
    if latest(path) is None:
        names = sorted(p.name for p in path.iterdir())
        found = (f"{len(names)} entries: {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}"
                 if names else "nothing")
        raise SpecError(f"--load {load} holds no checkpoint (no iter_*/common.json; it holds {found})")


def check_loadable(root, model) -> dict | None:
    """Pure check before any process group: the common state of the latest checkpoint
    under ``root`` (None if there is none); SpecError if its model has another shape."""
    path = latest(root)
    if path is None:
        return None
    common = json.loads((path / "common.json").read_text())
    saved = {f.name: f.default for f in fields(model) if f.name in SHAPE_FIELDS} | common["model"]
    diff = [f"{k} {saved.get(k)} != {getattr(model, k)}" for k in SHAPE_FIELDS if saved.get(k) != getattr(model, k)]
    if diff:
        raise SpecError(f"checkpoint {path} is of another model shape than plan.model {model.name} "
                        f"(checkpoint: {common['model'].get('name')}): " + ", ".join(diff))
    return common


def save(root, trainer, iteration: int, consumed_samples: int) -> Path:
    """Write a checkpoint of ``trainer`` after ``iteration`` steps (all ranks call)."""
    root, rank = Path(root), dist.get_rank()
    final = _iter_dir(root, iteration)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)      # left by a save that was killed
        tmp.mkdir(parents=True)
    dist.barrier()
    reducer, optimizer = trainer.reducer, trainer.optimizer
    starts, flats = _state_tensors(optimizer, copy_moments=True)
    ranges = [b.step_range for b in reducer.buckets]   # the ZeRO shards: each element once
    boxes = _boxes(reducer, ranges, starts, flats)
    dcp.save({}, storage_writer=dcp.FileSystemWriter(str(tmp)), planner=_BoxSavePlanner(boxes))
    torch.save(_rng_state(), tmp / f"rng.rank{rank}.pt")
    step = torch.tensor(float(_adam_step(optimizer)))
    dist.all_reduce(step, op=dist.ReduceOp.MAX)   # a rank with an empty shard has no state
    if rank == 0:
        step = int(step)
        scaler = trainer.scaler
        common = {"iteration": iteration, "consumed_samples": consumed_samples, "adam_step": step,
                  "model": trainer.plan.model.to_dict(), "training": trainer.setup.to_dict(),
                  "plan_hash": trainer.plan.content_hash(), "world_size": trainer.plan.world_size,
                  "loss_scaler": None if scaler is None else
                  {"scale": float(scaler.scale), "growth_tracker": scaler._growth_tracker,
                   "hysteresis_tracker": scaler._hysteresis_tracker}}
        (tmp / "common.json").write_text(json.dumps(common, indent=1))
    dist.barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_text(root / "latest", final.name + "\n")
    dist.barrier()
    return final


def load(root, trainer) -> dict:
    """Load the latest checkpoint under ``root`` into ``trainer`` (all ranks call); returns
    its common state."""
    path = latest(root)
    if path is None:
        raise SpecError(f"--load {root}: no complete checkpoint (no 'latest' file naming one)")
    common = json.loads((path / "common.json").read_text())
    reducer, optimizer = trainer.reducer, trainer.optimizer
    starts, flats = _state_tensors(optimizer, copy_moments=False)
    ranges = [(lo, lo + main.numel()) for lo, main in optimizer.mains]   # what this rank steps
    boxes = _boxes(reducer, ranges, starts, flats)
    dcp.load({}, storage_reader=dcp.FileSystemReader(str(path)), planner=_BoxLoadPlanner(boxes))
    if common["adam_step"] > 0:
        step = torch.tensor(float(common["adam_step"]))
        for i, s, e, view in optimizer.views:
            lo = starts[i]
            optimizer.optimizer.state[view] = {"step": step.clone(),
                                               "exp_avg": flats["exp_avg"][i][s - lo:e - lo],
                                               "exp_avg_sq": flats["exp_avg_sq"][i][s - lo:e - lo]}
    optimizer.write_back()
    if common.get("loss_scaler") and trainer.scaler is not None:
        s = common["loss_scaler"]
        trainer.scaler._scale.fill_(s["scale"])
        trainer.scaler._growth_tracker, trainer.scaler._hysteresis_tracker = s["growth_tracker"], s["hysteresis_tracker"]
    rng = path / f"rng.rank{dist.get_rank()}.pt"
    if common["plan_hash"] == trainer.plan.content_hash() and rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=False))
    return common


def _adam_step(optimizer) -> int:
    steps = [int(s["step"]) for s in optimizer.optimizer.state.values() if "step" in s]
    return max(steps, default=0)


def _rng_state() -> dict:
    from megatron.core.tensor_parallel import random as mrandom

    state = {"torch": torch.get_rng_state(), "tracker": mrandom.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import random as mrandom

    torch.set_rng_state(state["torch"])
    mrandom.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
