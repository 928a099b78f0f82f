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

Atomicity: DCP writes into ``<dir>/iter_NNNNNNN.tmp``; after every rank is done, the
ranks checksum the folder's files (each a share), rank 0 writes ``manifest.json`` (every
file's size and SHA-256) last, renames the folder to ``iter_NNNNNNN`` and then replaces
``<dir>/latest`` (temp file + rename).  A save killed half-way leaves a ``.tmp`` folder
that is never read, and ``latest`` still names the previous complete checkpoint.

Integrity (:func:`find`): ``--load`` takes the checkpoint ``latest`` names, or, when it is
damaged, the newest older intact one, and says which it passed over and why.  Intact
means: a manifest, every file it lists present with its size, ``common.json`` and DCP's
``.metadata`` matching their checksums (small; always read).  The shards' checksums are
compared only with ``--verify-checkpoint`` (:func:`verify`: every rank hashes a share of
the files, so it costs one read of the checkpoint spread over the ranks); without it a
change that keeps a shard's size goes unnoticed.  Folders numbered above the one
``latest`` names are older runs' leftovers and are not considered.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, fields
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


MANIFEST = "manifest.json"
ALWAYS_HASHED = ("common.json", ".metadata")
"""Small files whose checksums every load compares; the shards' only with ``verify``."""


def _iter_dir(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}"


def _iteration_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith("iter_") or path.suffix == ".tmp" or not path.is_dir():
        return None
    try:
        return int(name[len("iter_"):])
    except ValueError:
        return None


def file_entries(folder, names) -> dict:
    """{name: [size in bytes, SHA-256 hex]} of files ``names`` in ``folder``."""
    out = {}
    for name in names:
        path = Path(folder) / name
        with open(path, "rb") as fh:
            out[name] = [path.stat().st_size, hashlib.file_digest(fh, "sha256").hexdigest()]
    return out


def write_manifest(folder, entries: dict) -> None:
    """The manifest of ``folder``: ``entries`` (:func:`file_entries`) of all its other files."""
    atomic_write_text(Path(folder) / MANIFEST, json.dumps({"version": 1, "files": entries}, indent=1,
                                                          sort_keys=True))


def damage(path, verify: bool = False, names=None) -> str | None:
    """Why the checkpoint folder ``path`` cannot be loaded (None: intact).  Sizes of every
    file and checksums of ``ALWAYS_HASHED``; with ``verify`` the checksums of every file
    (of ``names`` only, if given: one rank's share)."""
    path = Path(path)
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"no {MANIFEST} (a save that did not finish, or one written without checksums)"
    except (ValueError, KeyError, TypeError):
        return f"{MANIFEST} is not a manifest (not JSON or no files list)"
    for name, (size, digest) in sorted(files.items()):
        if names is not None and name not in names:
            continue
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        actual = file.stat().st_size
        if actual != size:
            return f"{name} has {actual} bytes, the manifest says {size} (cut short or overwritten)"
        if (verify or name in ALWAYS_HASHED) and file_entries(path, [name])[name][1] != digest:
            return f"{name} does not match its checksum (its bytes were changed)"
    return None


@dataclass
class Found:
    """What :func:`find` found under a ``--load`` folder."""

    path: Path | None
    """The checkpoint to load (None: no intact one)."""
    damaged: list
    """(path, reason) of every newer checkpoint passed over, newest first."""
    candidates: list
    """Intact checkpoints (sizes and small checksums), newest first: where
    ``--verify-checkpoint`` falls back to."""

    def lines(self) -> list[str]:
        return [f"checkpoint {p} is damaged ({why}): passed over" for p, why in self.damaged]

    @property
    def iteration(self) -> int | None:
        """The iteration of :attr:`path` (None: no intact checkpoint)."""
        return _iteration_of(self.path) if self.path is not None else None


def find(root) -> Found:
    """The newest intact checkpoint under ``root`` (see the module docstring)."""
    root = Path(root)
    folders = sorted(((n, p) for p in (root.glob("iter_*") if root.is_dir() else ())
                      if (n := _iteration_of(p)) is not None), reverse=True)
    marker = root / "latest"
    if marker.is_file():
        named = _iteration_of(root / marker.read_text().strip())
        if named is not None:
            folders = [(n, p) for n, p in folders if n <= named]
    damaged, candidates = [], []
    for _, path in folders:
        why = damage(path)
        if why is None:
            candidates.append(path)
        elif not candidates:
            damaged.append((path, why))
    return Found(candidates[0] if candidates else None, damaged, candidates)


def check_load(load, model, save=None) -> dict | None:
    """Pure check before any process group: the common state of the checkpoint ``--load``
    resumes (its model checked against ``model``), or None where the ``--save`` folder
    holds nothing yet (the auto-resume idiom starts fresh).  SpecError unless ``load``
    names a folder with an intact checkpoint of ours of the same model."""
    path = Path(load)
    auto_resume = save is not None and path.resolve() == Path(save).resolve()
    if path.exists() and not path.is_dir():
        raise SpecError(f"--load {load} is a file, not a checkpoint folder")
    if not path.exists() and not auto_resume:
        raise SpecError(f"--load {load} does not exist (to start fresh and resume later, give the same "
                        f"folder to --save and --load)")
    found = find(path)
    if found.path is None and found.damaged:
        raise SpecError(_none_intact(load, found))
    if found.path is None and not auto_resume:
        names = sorted(p.name for p in path.iterdir())
        listed = (f"{len(names)} entries: {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}"
                  if names else "nothing")
        raise SpecError(f"--load {load} holds no checkpoint (no iter_*/{MANIFEST}; it holds {listed})")
    return None if found.path is None else check_common(found.path, model)


def _none_intact(load, found: Found) -> str:
    (newest, why), more = found.damaged[0], len(found.damaged) - 1
    return (f"--load {load}: no intact checkpoint: {newest.name} is damaged ({why})"
            + (f", and {more} older one(s) too" if more else "") + "; the folder is left as it is")


def check_common(path, model) -> dict:
    """``path``'s common state; SpecError if its model differs from ``model`` (SHAPE_FIELDS)."""
    common = json.loads((Path(path) / "common.json").read_text())
    saved = {f.name: f.default for f in fields(model) if f.name in SHAPE_FIELDS} | common["model"]
    diff = [f"{k} {saved.get(k)} != {getattr(model, k)}" for k in SHAPE_FIELDS if saved.get(k) != getattr(model, k)]
    if diff:
        raise SpecError(f"checkpoint {path} is of another model shape than plan.model {model.name} "
                        f"(checkpoint: {common['model'].get('name')}): " + ", ".join(diff))
    return common


def verify(found: Found) -> Found:
    """Collective (every rank calls): the newest of ``found.candidates`` whose every file
    matches its checksum, each rank hashing every world-size-th file; the ones passed
    over join ``found.damaged``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    damaged = list(found.damaged)
    for i, path in enumerate(found.candidates):
        files = sorted(json.loads((path / MANIFEST).read_text())["files"])
        why = damage(path, verify=True, names=set(files[rank::world]))
        reasons = [None] * world
        dist.all_gather_object(reasons, why)
        why = next((r for r in reasons if r is not None), None)
        if why is None:
            return Found(path, damaged, found.candidates[i:])
        damaged.append((path, why))
    return Found(None, damaged, [])


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
                  "data": {"train_samples_built": getattr(trainer, "train_samples_built", None)},
                  "model": trainer.plan.model.to_dict(), "training": trainer.setup.to_dict(),
                  "plan_hash": trainer.plan.content_hash(), "world_size": trainer.plan.world_size,
                  "loss_scaler": None if scaler is None else
                  {"scale": float(scaler.scale), "growth_tracker": scaler._growth_tracker,
                   "hysteresis_tracker": scaler._hysteresis_tracker}}
        (tmp / "common.json").write_text(json.dumps(common, indent=1))
    dist.barrier()
    names = sorted(p.name for p in tmp.iterdir())
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, file_entries(tmp, names[rank::len(shares)]))
    if rank == 0:
        write_manifest(tmp, {k: v for share in shares for k, v in share.items()})   # last: the seal
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_text(root / "latest", final.name + "\n")
    dist.barrier()
    return final


def load(path, trainer) -> dict:
    """Load the checkpoint folder ``path`` (:func:`find`) into ``trainer`` (all ranks call);
    returns its common state."""
    path = Path(path)
    common = check_common(path, trainer.plan.model)
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


def setup_changes(common: dict, trainer) -> list[str]:
    """Lines on how the resuming run's training setup differs from the checkpoint's
    (precision, ZeRO stage, gradient dtype, global batch): allowed, and said."""
    saved, now = common.get("training") or {}, trainer.setup.to_dict()
    lines = [f"note: the checkpoint was trained with {key} {saved[key]}, this run uses {now[key]}"
             + (" (the fp32 main weights and moments carry over; the compute weights are cast)"
                if key == "precision" else "")
             for key in ("precision", "zero_stage", "grad_reduce") if key in saved and saved[key] != now[key]]
    iteration, consumed, gbs = common["iteration"], common["consumed_samples"], trainer.plan.gbs
    if consumed != iteration * gbs:
        lines.append(f"note: the checkpoint's run consumed {consumed} samples in {iteration} iterations, this plan's "
                     f"global batch is {gbs}: training goes on from sample {consumed}")
    return lines


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
