"""The measured profile file that ``tools/profile_ops.py`` writes (docs/FORMATS.md).

:func:`megatron.hpp.profiling.ops.measure_entries` measures the (mbs, tp) entries; this
module makes the file of them.  :func:`provenance` records what was measured and how
(device, torch and megatron-core versions, dtype, repeats, timer, date, command line,
what each size means); :func:`profile_dict` wraps the entries and the collective tables
into a version-1 profile of ``eth.profiles.db`` ("source": "measured") holding one model
shape.  Merging (:func:`merge_profiles`): an existing file must hold measured profiles
of the same device type (:func:`check_merge_target`, else SpecError); the new file's
model shapes replace the same shapes in it, its other shapes are kept (each with its own
provenance), and the collective tables are merged per kind and group size.
:func:`summary_table` is the text printed after a run; :func:`check_output_path`
refuses an unwritable output before anything is measured.
"""
from __future__ import annotations

import datetime as _dt

import torch

from eth.errors import SpecError
from eth.spec.model import ACT_BYTES, all_ops, op_shapes
from eth.profiles.db import OP_FIELDS, PROFILE_VERSION, RESERVED_BYTES, DeviceProfile, entry_shape, shape_dict
from megatron.hpp.profiling.ops import DTYPE_BYTES, ProfileConfig, device_description

def provenance(cfg: ProfileConfig, device: torch.device, command: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    try:
        mcore = version("megatron-core")
    except PackageNotFoundError:
        mcore = "unknown"
    cuda = device.type == "cuda"
    return {
        "generator": "tools/profile_ops.py (megatron.hpp.profiling.ops)",
        "device_name": device_description(device), "device": str(device),
        "torch": torch.__version__, "megatron_core": mcore, "cuda": torch.version.cuda if cuda else None,
        "dtype": cfg.dtype, "dtype_bytes": DTYPE_BYTES[cfg.dtype],
        "repeats": cfg.repeats, "warmup": cfg.warmup, "statistic": "median",
        "timer": "CUDA events" if cuda else ("time.thread_time (thread CPU time)" if torch.get_num_threads() == 1
                                             else "time.perf_counter"),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "op_modules": "megatron.hpp.models.gpt Layer / GPTStage at one tp rank's shard shapes " + (
            "(tp > 1: tp processes on a real gloo group, rank 0's times: tp collectives included)"
            if cfg.real_tp else "(fake tp group: tp collectives are not included)"),
        "act_bytes": "unique non-parameter storages packed by saved_tensors_hooks in the op's forward "
                     "(a storage saved by several ops is counted once, in the first)",
        "reserved_bytes": ("CUDA context (mem_get_info used - memory_reserved) + largest op workspace "
                           "(max_memory_reserved - memory_allocated before the op)") if cuda else
                          f"eth.profiles.db.RESERVED_BYTES = {RESERVED_BYTES:g} (analytic default; not measured on CPU)",
    }


def profile_dict(cfg: ProfileConfig, entries: list[dict], prov: dict, collectives: dict | None = None) -> dict:
    """A version-1 profile JSON dict holding one model shape."""
    model = {"name": cfg.model.name, "shape": shape_dict(cfg.model),
             "provenance": prov, "entries": entries}
    if cfg.real_tp and max(cfg.tp) > 1:   # tp > 1 timed on a real tp group: its collectives are in the op times
        model["tp_comm_included"] = True
    # one shard timed on a fake tp group: the tp all-reduces are not in the op times
    data = {"version": PROFILE_VERSION, "device": cfg.device_type, "source": "measured",
            "provenance": prov, "op_fields": list(OP_FIELDS), "tp_comm_included": False,
            "models": [model]}
    if collectives:
        data["collectives"] = collectives
    return data


def check_merge_target(old: dict, device_type: str, where: str = "output") -> None:
    """A measured profile of ``device_type`` may be merged into ``old`` (else SpecError)."""
    prof = DeviceProfile(old, where=where)
    if prof.device != device_type:
        raise SpecError(f"{where} holds device {prof.device!r}, not {device_type!r}; "
                        f"write to another file")
    if prof.source != "measured":
        raise SpecError(f"{where} holds {prof.source!r} profiles; write measured ones to another "
                        f"file (e.g. profiles/measured/{device_type}.json)")


def merge_profiles(old: dict, new: dict, where: str = "output") -> dict:
    """``new``'s model shapes and collective tables replace the same ones in ``old``;
    other shapes (each with its own provenance) are kept."""
    check_merge_target(old, new["device"], where)
    shapes = {entry_shape(m["shape"]) for m in new["models"]}
    models = [m for m in old["models"] if entry_shape(m["shape"]) not in shapes]
    merged = dict(old, provenance=new["provenance"], models=models + new["models"])
    colls = _merge_tables(old.get("collectives"), new.get("collectives"))
    if colls:
        merged["collectives"] = colls
    return merged


def add_collectives(old: dict, collectives: dict, provenance: dict) -> dict:
    """``old`` with ``collectives``' tables merged in (same kind and group size: replaced)
    and ``provenance`` filed as its provenance's "collectives"; its models unchanged."""
    return dict(old, collectives=_merge_tables(old.get("collectives"), collectives),
                provenance=dict(old.get("provenance") or {}, collectives=provenance))


def _merge_tables(old: dict | None, new: dict | None) -> dict:
    """Collective tables ``{kind: {"n": rows}}``: ``new``'s replace ``old``'s of the same
    kind and group size, the others are kept."""
    colls = {k: dict(v) for k, v in (old or {}).items()}
    for kind, table in (new or {}).items():
        colls.setdefault(kind, {}).update(table)
    return colls


# ----------------------------------------------------------------------------------
# Summary.

def summary_table(cfg: ProfileConfig, entries: list[dict]) -> str:
    """op, fwd/bwd ms, act MB at the largest mbs (smallest tp), and measured/analytic ratios
    of fwd time and act bytes (analytic act scaled from 2-byte to the measured dtype)."""
    from eth.spec.cluster import catalog

    mbs, tp = max(cfg.mbs), min(cfg.tp)
    entry = next(e for e in entries if e["mbs"] == mbs and e["tp"] == tp)
    dev = catalog().get(cfg.device_type)
    analytic = shapes = None
    if dev is not None:
        from eth.profiles.db import analytic_op_costs

        analytic = analytic_op_costs(dev, cfg.model, mbs, tp)
    shapes = op_shapes(cfg.model, mbs, tp)
    scale = DTYPE_BYTES[cfg.dtype] / ACT_BYTES
    lines = [f"{cfg.model.name} on {cfg.device_type} ({cfg.dtype}), mbs {mbs}, tp {tp}:",
             f"{'op':<18}{'fwd ms':>10}{'bwd ms':>10}{'act MB':>10}{'fwd/an':>9}{'act/an':>9}"]
    for op in all_ops(cfg.model):
        fwd, bwd, _, act = entry["ops"][op][:4]
        r_fwd = f"{fwd / analytic[op][0]:.2f}" if analytic else "-"
        an_act = shapes[op].act_bytes * scale
        r_act = f"{act / an_act:.2f}" if an_act > 0 else ("-" if act == 0 else "inf")
        lines.append(f"{op:<18}{fwd:>10.4f}{bwd:>10.4f}{act / 2**20:>10.4f}{r_fwd:>9}{r_act:>9}")
    note = (f"fwd/an: measured / roofline for catalog {cfg.device_type}" if analytic
            else f"fwd/an: '{cfg.device_type}' is not in the device catalog")
    lines.append(f"{note}; act/an: measured / eth.spec.model.op_shapes scaled to {cfg.dtype}")
    lines.append("(the formula's token ids, layernorm stats and fp32 logits do not scale with the dtype; "
                 "differences per op: docs/RUNTIME.md, 'Measured profiles')")
    return "\n".join(lines)


def check_output_path(path) -> None:
    """Fail early (SpecError) when ``path`` cannot be written (before any measuring)."""
    from eth.cli.common import check_output_file

    check_output_file(path, "-o")