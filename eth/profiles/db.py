"""Profile database: per-op costs of a model shape on a device type.

One JSON file per device type (``profiles/<device>.json``), version 1::

    {"version": 1, "device": "A100", "source": "analytic" | "measured" | "aceso-csv",
     "provenance": {...what was measured / which datasheet and efficiency factors...},
     "op_fields": ["fwd_ms", "bwd_ms", "weight_bytes", "act_bytes", "input_bytes",
                   "output_bytes"],
     "models": [{"name": "gpt3-13b", "shape": {hidden, heads, kv_heads, ffn, seq_len,
                 vocab, swiglu, dropout},
                 "entries": [{"mbs": 1, "tp": 1, "reserved_bytes": 1.0e9,
                              "ops": {"qkv": [fwd_ms, bwd_ms, ...], ...}}, ...]}],
     "collectives": {"all_reduce": {"2": [[bytes, ms], ...]}, "p2p": {...}},   # optional
     "tp_comm_included": false}                                                   # optional

An entry may carry ``overhead_ms`` (measured profiles: what the runtime costs beyond the
ops, per layer, per stage call, per checkpointed run, after an emulation sleep, and the
optimizer step; :data:`OVERHEAD_KEYS`, :meth:`DeviceProfile.overheads`, docs/FORMATS.md);
absent means zeros.

A model entry may carry its own "source" (analytic entries that ``ProfileDB.ensure``
or ``analytic_profile(base=...)`` add to a measured file say "analytic").

``tp_comm_included`` (file level, or per model entry, which overrides the file): whether
the op times already contain the tensor-parallel all-reduces (a profile measured with a
real tp group, e.g. an Aceso import).  Absent means false (analytic profiles, and
tools/profile_ops.py, which runs one shard on a fake tp group); when true the cost model
adds no tp collectives of its own (:meth:`DeviceProfile.tp_comm_included`).

A model is matched by its *shape* (everything that changes one layer's cost; the
layer count does not).  Look-up rules for ``mbs`` that was not profiled (``tp`` must
be profiled exactly, since it changes the sharding):

  * between two profiled sizes: linear interpolation of every field;
  * above the largest: linear extrapolation through the two largest (proportional
    scaling when only one size exists);
  * below the smallest: proportional scaling (time and activations x mbs/m0) - this is
    optimistic for small kernels and is reported as such.

Analytic profiles (``analytic_profile``) use a roofline: a GEMM takes
``flops / (peak * eff(m, n, k)) + overhead_ms`` with the device type's size-dependent
GEMM efficiency (``eth.profiles.gemm_efficiency``; a type without a fitted curve keeps
``eff = GEMM_EFFICIENCY`` at every size and ``KERNEL_OVERHEAD_MS``), any other op
``bytes moved / (memory bandwidth * MEMORY_EFFICIENCY) + KERNEL_OVERHEAD_MS``;
backward moves/computes twice the forward.  Collectives use an alpha-beta model
(:func:`collective_ms`) with the cluster's bandwidths unless the profile carries a
measured table for that collective and group size.
"""
from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path

from eth.spec.cluster import DeviceType
from eth.errors import ProfileError, is_count, is_number
from eth.fileio import atomic_write_text, read_json
from eth.spec.model import ModelSpec, all_ops, op_shapes

PROFILE_VERSION = 1
OP_FIELDS = ("fwd_ms", "bwd_ms", "weight_bytes", "act_bytes", "input_bytes", "output_bytes")
SHAPE_FIELDS = ("hidden", "heads", "kv_heads", "ffn", "seq_len", "vocab", "swiglu", "dropout",
                "norm", "position", "bias", "attention", "attention_dropout", "activation")
SHAPE_DEFAULTS = {"norm": "layernorm", "position": "learned", "bias": True, "attention": "unfused",
                  "attention_dropout": None, "activation": "gelu"}
_LEFT_OUT = {"attention_dropout": None, "activation": "gelu"}
"""Shape fields a profile file leaves out at these values (files keep their old form)."""
"""Shape fields a profile written before they existed lacks: the GPT values."""

# Analytic efficiency factors (documented assumptions, see docs/FORMATS.md).
GEMM_EFFICIENCY = 0.6        # fraction of dense peak a large fp16 GEMM reaches (no fitted curve)
MEMORY_EFFICIENCY = 0.7      # fraction of memory bandwidth an elementwise kernel reaches
KERNEL_OVERHEAD_MS = 0.01    # launch + synchronisation cost per op and pass
RESERVED_BYTES = 1.0e9       # framework context + allocator workspace per device
COLLECTIVE_ALPHA_MS = 0.005  # per-step latency of a ring collective / p2p message
DEFAULT_MBS = (1, 2, 4, 8, 16, 32)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
DEFAULT_TP = (1, 2, 4, 8)
EMULATION_BASE = "cpu"        # profile that CPU-emulated device types (emulate_speed > 0) scale


@dataclass(frozen=True)
class OpCost:
    fwd_ms: float
    bwd_ms: float
    weight_bytes: float
    act_bytes: float
    input_bytes: float
    output_bytes: float


def shape_key(model: ModelSpec) -> tuple:
    return tuple(getattr(model, f) for f in SHAPE_FIELDS)


def shape_dict(model: ModelSpec) -> dict:
    """A profile entry's "shape" object of ``model``: :data:`SHAPE_FIELDS`, less
    the fields added later at their old meaning (``attention_dropout`` None: the same as
    ``dropout``; ``activation`` gelu), so that files keep the form they had before."""
    return {f: getattr(model, f) for f in SHAPE_FIELDS
            if not (f in _LEFT_OUT and getattr(model, f) == _LEFT_OUT[f])}


def entry_shape(shape: dict) -> tuple:
    """A profile entry's "shape" object as a :func:`shape_key` (GPT values for the
    fields written before they existed, :data:`SHAPE_DEFAULTS`); KeyError if one lacks."""
    return tuple(shape[f] if f in shape else SHAPE_DEFAULTS[f] for f in SHAPE_FIELDS)


class _ShapeKinds:
    """The layer options of a shape tuple (what ``eth.spec.model.all_ops`` reads)."""

    def __init__(self, *shape):
        for name, value in zip(SHAPE_FIELDS, shape):
            setattr(self, name, value)


def _shape_text(shape: tuple) -> str:
    return ", ".join(f"{k}={v}" for k, v in zip(SHAPE_FIELDS, shape))


class DeviceProfile:
    """Profiles of one device type (possibly for several model shapes)."""

    def __init__(self, data: dict, where: str = "profile"):
        self.where = where
        if not isinstance(data, dict):
            raise ProfileError(f"{where} must be a JSON object")
        if data.get("version") != PROFILE_VERSION:
            raise ProfileError(f"{where}.version is {data.get('version')!r}, "
                               f"this release reads version {PROFILE_VERSION}")
        for key in ("device", "source", "models"):
            if key not in data:
                raise ProfileError(f"{where}.{key} is missing")
        if tuple(data.get("op_fields", OP_FIELDS)) != OP_FIELDS:
            raise ProfileError(f"{where}.op_fields is {data.get('op_fields')}, expected {list(OP_FIELDS)}")
        self.data = data
        self.device = data["device"]
        self.source = data["source"]
        # bytes per parameter element in weight_bytes (2 unless the profile says otherwise)
        provenance = data.get("provenance") or {}
        if not isinstance(provenance, dict):
            raise ProfileError(f"{where}.provenance must be an object, got {provenance!r}")
        self.dtype_bytes = provenance.get("dtype_bytes", 2)
        if not is_number(self.dtype_bytes) or self.dtype_bytes <= 0:
            raise ProfileError(f"{where}.provenance.dtype_bytes must be a positive number, "
                               f"got {self.dtype_bytes!r}")
        if not isinstance(data["models"], list):
            raise ProfileError(f"{where}.models must be a list")
        _check_collectives(data.get("collectives"), where)
        file_tp_comm = _tp_comm_flag(data, where, False)
        self._tp_comm: dict[tuple, bool] = {}
        # (shape, tp) -> [(mbs, (layer fwd, layer bwd, stage fwd, stage bwd, wake fwd, wake bwd))]
        self._overheads: dict[tuple, list] = {}
        # shape -> {tp: sorted [(mbs, {op: OpCost}, reserved)]}
        self._table: dict[tuple, dict[int, list]] = {}
        self._names: dict[tuple, str] = {}
        for i, m in enumerate(data["models"]):
            mw = f"{where}.models[{i}]"
            try:
                shape = entry_shape(m["shape"])
            except (KeyError, TypeError):
                raise ProfileError(f"{mw}.shape must give {list(SHAPE_FIELDS)}") from None
            if not all(isinstance(v, str) if f in ("norm", "position", "attention", "activation") else
                       (is_number(v) or isinstance(v, bool) or (v is None and f == "attention_dropout"))
                       for f, v in zip(SHAPE_FIELDS, shape)):
                raise ProfileError(f"{mw}.shape must hold numbers, got {m['shape']}")
            self._names[shape] = m.get("name", "?")
            self._tp_comm[shape] = _tp_comm_flag(m, mw, file_tp_comm)
            by_tp = self._table.setdefault(shape, {})
            for j, e in enumerate(m.get("entries", [])):
                ew = f"{mw}.entries[{j}]"
                if not isinstance(e, dict) or not isinstance(e.get("ops"), dict):
                    raise ProfileError(f"{ew} must be an object with an ops object")
                mbs, tp = e.get("mbs"), e.get("tp")
                if not (is_count(mbs) and is_count(tp)):
                    raise ProfileError(f"{ew}: mbs and tp must be positive integers, got {mbs!r}, {tp!r}")
                reserved = e.get("reserved_bytes", RESERVED_BYTES)
                if not is_number(reserved) or reserved < 0:
                    raise ProfileError(f"{ew}.reserved_bytes must be a number >= 0, got {reserved!r}")
                ops = {}
                for op in all_ops(_ShapeKinds(*shape)):
                    values = e["ops"].get(op)
                    if values is None and op == "swiglu" and "norm" not in m["shape"]:
                        values = e["ops"].get("gelu")   # written before the op had its own name
                    if not (isinstance(values, list) and len(values) == len(OP_FIELDS)):
                        raise ProfileError(f"{ew}.ops[{op!r}] must be a list of {len(OP_FIELDS)} "
                                           f"numbers {list(OP_FIELDS)}, got {values!r}")
                    if any(not is_number(v) or v < 0 for v in values):
                        raise ProfileError(f"{ew}.ops[{op!r}] has a negative or non-numeric value: {values}")
                    ops[op] = OpCost(*map(float, values))
                by_tp.setdefault(tp, []).append((mbs, ops, float(reserved)))
                self._overheads.setdefault((shape, tp), []).append((mbs, _overhead_row(e, ew)))
            for tp, rows in by_tp.items():
                rows.sort(key=lambda r: r[0])
                mbs_list = [r[0] for r in rows]
                if len(set(mbs_list)) != len(mbs_list):
                    raise ProfileError(f"{mw} lists mbs {mbs_list} twice for tp {tp}")
        self._cache: dict = {}
        self.has_overheads = any(any(row) for rows in self._overheads.values() for _, row in rows)
        """Whether any entry has a non-zero ``overhead_ms`` (the cost model skips them if not)."""

    def tp_comm_included(self, model: ModelSpec) -> bool:
        """True when ``model``'s op times already contain the tp all-reduces."""
        return self._tp_comm.get(shape_key(model), False)

    def shapes(self) -> list[tuple]:
        return list(self._table)

    def tps(self, model: ModelSpec) -> list[int]:
        return sorted(self._table.get(shape_key(model), {}))

    def layer_costs(self, model: ModelSpec, mbs: float, tp: int) -> tuple[dict[str, OpCost], float]:
        """({op: OpCost} for every op, reserved bytes) at ``mbs`` samples and ``tp``."""
        key = (shape_key(model), mbs, tp)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        by_tp = self._table.get(key[0])
        if by_tp is None:
            raise ProfileError(f"profile {self.where} ({self.device}) has no entry for model "
                               f"{model.name} ({_shape_text(key[0])}); generate one with "
                               f"tools/make_profiles.py or tools/profile_ops.py")
        rows = by_tp.get(tp)
        if rows is None:
            raise ProfileError(f"profile {self.where} ({self.device}) for model {model.name} has no "
                               f"tp {tp}; profiled tp: {sorted(by_tp)}")
        result = _interpolate(rows, mbs)
        self._cache[key] = result
        return result

    def overheads(self, model: ModelSpec, mbs: float, tp: int) -> tuple:
        """(fwd, bwd) ms pairs of :data:`OVERHEAD_KEYS`, flat (layer fwd, layer bwd, stage
        fwd, ...), of the entry field ``overhead_ms`` at ``mbs`` (linear between profiled sizes, the nearest one
        outside them); zeros when the profile has none (analytic and imported profiles)."""
        key = ("overheads", shape_key(model), mbs, tp)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        rows = sorted(self._overheads.get(key[1:2] + (tp,), []), key=lambda r: r[0])
        if not rows:
            result = (0.0,) * len(OVERHEAD_KEYS) * 2
        else:
            sizes = [r[0] for r in rows]
            i = bisect.bisect_left(sizes, mbs)
            if i < len(rows) and sizes[i] == mbs or i == len(rows) or i == 0:
                result = rows[min(i, len(rows) - 1)][1]
            else:
                (m0, a), (m1, b) = rows[i - 1], rows[i]
                w = (mbs - m0) / (m1 - m0)
                result = tuple(x + w * (y - x) for x, y in zip(a, b))
        self._cache[key] = result
        return result

    def collective_table(self, kind: str, n: int):
        table = (self.data.get("collectives") or {}).get(kind, {}).get(str(n))
        return sorted(table) if table else None


OVERHEAD_KEYS = ("layer", "stage", "wake", "checkpoint", "checkpoint_op", "optimizer", "step")
"""Keys of a profile entry's optional ``overhead_ms`` object, each [fwd_ms, bwd_ms] per
micro-batch (``megatron.hpp.profiling.overheads.stage_overheads``), except "optimizer": [ms per
layer, ms per stage] of the step after the backward, and "step": [ms per iteration, ms per
sample] of the training step outside the compute calls (``profile_overheads.time_step``:
the end-of-step all-reduces, the data of each micro-batch) (docs/FORMATS.md)."""


def _overhead_row(entry: dict, where: str) -> tuple:
    """The entry's ``overhead_ms`` as a flat tuple in :data:`OVERHEAD_KEYS` order (missing
    keys or field: 0).  Values may be negative: a layer through the runtime can run faster
    than its ops timed one by one."""
    value = entry.get("overhead_ms")
    if value is None:
        return (0.0,) * len(OVERHEAD_KEYS) * 2
    if not isinstance(value, dict) or set(value) - set(OVERHEAD_KEYS):
        raise ProfileError(f"{where}.overhead_ms must be an object with keys {list(OVERHEAD_KEYS)}, "
                           f"got {value!r}")
    row = []
    for key in OVERHEAD_KEYS:
        pair = value.get(key, [0.0, 0.0])
        if not (isinstance(pair, list) and len(pair) == 2 and all(is_number(v) for v in pair)):
            raise ProfileError(f"{where}.overhead_ms.{key} must be [fwd_ms, bwd_ms], got {pair!r}")
        row += [float(v) for v in pair]
    return tuple(row)


def _tp_comm_flag(obj: dict, where: str, default: bool) -> bool:
    value = obj.get("tp_comm_included", default)
    if not isinstance(value, bool):
        raise ProfileError(f"{where}.tp_comm_included must be true or false, got {value!r}")
    return value


def _check_collectives(table, where) -> None:
    if table is None:
        return
    if not isinstance(table, dict):
        raise ProfileError(f"{where}.collectives must be an object")
    for kind, by_n in table.items():
        if kind not in COLLECTIVES or not isinstance(by_n, dict):
            raise ProfileError(f"{where}.collectives.{kind}: kind must be one of {list(COLLECTIVES)} "
                               f"mapping group size to [[bytes, ms], ...]")
        for n, rows in by_n.items():
            ok = str(n).isdigit() and int(n) >= 2 and isinstance(rows, list) and rows and all(
                isinstance(r, list) and len(r) == 2 and is_number(r[0]) and is_number(r[1])
                and r[0] > 0 and r[1] >= 0 for r in rows)
            if not ok:
                raise ProfileError(f"{where}.collectives.{kind}[{n!r}] must map a group size >= 2 to "
                                   f"[[bytes > 0, ms >= 0], ...], got {rows!r}")


def _interpolate(rows, mbs):
    sizes = [r[0] for r in rows]
    i = bisect.bisect_left(sizes, mbs)
    if i < len(sizes) and sizes[i] == mbs:
        return rows[i][1], rows[i][2]
    if len(rows) == 1 or i == 0:
        m0, ops0, res0 = rows[0] if i == 0 else rows[-1]
        scale = mbs / m0
        return {op: _scale(c, scale) for op, c in ops0.items()}, res0
    above = i == len(rows)
    (m0, ops0, res0), (m1, ops1, res1) = (rows[-2], rows[-1]) if above else (rows[i - 1], rows[i])
    w = (mbs - m0) / (m1 - m0)
    ops = {}
    for op in ops0:
        values = []
        for f, a, b in zip(OP_FIELDS, _vals(ops0[op]), _vals(ops1[op])):
            v = a if f == "weight_bytes" else a + w * (b - a)
            # beyond the largest size a noisy (decreasing) pair must not make it cheaper
            values.append(max(v, b) if above else v)
        ops[op] = OpCost(*values)
    reserved = max(res1, res0 + w * (res1 - res0)) if above else res0 + w * (res1 - res0)
    return ops, reserved


def _vals(c: OpCost):
    return (c.fwd_ms, c.bwd_ms, c.weight_bytes, c.act_bytes, c.input_bytes, c.output_bytes)


def _scale(c: OpCost, s: float) -> OpCost:
    return OpCost(c.fwd_ms * s, c.bwd_ms * s, c.weight_bytes, c.act_bytes * s,
                  c.input_bytes * s, c.output_bytes * s)


class ProfileDB:
    """All device profiles the planner may use, keyed by device type name."""

    def __init__(self, profiles: dict[str, DeviceProfile] | None = None):
        self.profiles: dict[str, DeviceProfile] = dict(profiles or {})

    def add(self, profile: DeviceProfile) -> None:
        self.profiles[profile.device] = profile

    def get(self, device: str) -> DeviceProfile:
        if device not in self.profiles:
            raise ProfileError(f"no profile for device type {device!r}; loaded: "
                               f"{', '.join(sorted(self.profiles)) or 'none'}")
        return self.profiles[device]

    def layer_costs(self, device: str, model: ModelSpec, mbs: float, tp: int):
        return self.get(device).layer_costs(model, mbs, tp)

    def overheads(self, device: str, model: ModelSpec, mbs: float, tp: int) -> tuple:
        return self.get(device).overheads(model, mbs, tp)

    @classmethod
    def load(cls, path) -> "ProfileDB":
        """Load one JSON file or every ``*.json`` in a folder."""
        path = Path(path)
        if path.is_dir():
            files = sorted(path.glob("*.json"))
            if not files:
                raise ProfileError(f"profile folder {path} has no *.json files")
        elif path.exists():
            files = [path]
        else:
            raise ProfileError(f"profile path {path} does not exist")
        db = cls()
        for f in files:
            db.add(load_profile(f))
        return db

    def ensure(self, model: ModelSpec, device_types, mbs=DEFAULT_MBS, tp=DEFAULT_TP) -> list[str]:
        """Add entries for device types that lack ``model``; returns the names of those that
        got analytic ones.  A CPU-emulated type (``emulate_speed`` > 0) without a profile of
        its own gets the ``cpu`` profile's entries for ``model`` with op times / speed
        (:func:`emulated_profile`: the runtime stretches that type's compute by 1 / speed)."""
        added = []
        base = self.profiles.get(EMULATION_BASE)
        for dt in device_types:
            prof = self.profiles.get(dt.name)
            if prof is not None and shape_key(model) in prof.shapes():
                continue
            if (prof is None and dt.emulate_speed > 0 and base is not None
                    and shape_key(model) in base.shapes()):
                self.add(DeviceProfile(emulated_profile(base.data, model, dt.name, dt.emulate_speed),
                                       where=f"{base.where} / {dt.emulate_speed:g}"))
                continue
            data = prof.data if prof is not None else None
            self.add(DeviceProfile(analytic_profile(dt, [model], mbs, tp, base=data)))
            added.append(dt.name)
        return added


def emulated_profile(base: dict, model: ModelSpec, name: str, speed: float) -> dict:
    """The profile of CPU-emulated device type ``name``: ``base`` (the ``cpu`` profile, one
    process on one core) restricted to ``model``'s shape, every op time divided by
    ``speed`` (what ``megatron.hpp.parallel.schedule.ComputeClock`` does to that type's compute);
    sizes, reserved bytes and collective tables (same machine) unchanged.  Overheads
    (``overhead_ms``) are divided by ``speed`` too, and the "wake" cost (an emulated rank
    idles after every compute call, and the next call then costs more CPU time) is moved
    into the stage overhead: every call of an emulated type pays it."""
    key = shape_key(model)
    models = []
    for m in base["models"]:
        if entry_shape(m["shape"]) != key:
            continue
        entries = []
        for e in m["entries"]:
            entry = dict(e, ops={op: [v[0] / speed, v[1] / speed, *v[2:]] for op, v in e["ops"].items()})
            if "overhead_ms" in e:
                oh = _overhead_row(e, "overhead_ms")
                entry["overhead_ms"] = {"layer": [oh[0] / speed, oh[1] / speed],
                                        "stage": [(oh[2] + oh[4]) / speed, (oh[3] + oh[5]) / speed],
                                        "wake": [0.0, 0.0],
                                        "checkpoint": [oh[6] / speed, oh[7] / speed],
                                        "checkpoint_op": [oh[8] / speed, oh[9] / speed],
                                        # the runtime does not stretch the optimizer step
                                        # nor the step's collectives and data
                                        "optimizer": [oh[10], oh[11]], "step": [oh[12], oh[13]]}
            entries.append(entry)
        models.append(dict(m, entries=entries))
    data = dict(base, device=name, models=models)
    data["provenance"] = dict(base.get("provenance") or {},
                              derived_from=f"{base['device']} profile ({base['source']}), op times / "
                                           f"emulate_speed {speed:g}")
    return data


def load_profile(path) -> DeviceProfile:
    return DeviceProfile(read_json(path, "profile", ProfileError), where=Path(path).name)


def save_profile(data: dict, path) -> None:
    DeviceProfile(data, where=str(path))  # validate before writing
    atomic_write_text(path, json.dumps(data, indent=None, separators=(",", ":")) + "\n")


def analytic_op_costs(device: DeviceType, model: ModelSpec, mbs: int, tp: int,
                      include_unapplied: bool = False) -> dict[str, list]:
    """Roofline op costs (see module docstring) as profile rows.  GEMM ops run at the
    device type's size-dependent efficiency (``eth.profiles.gemm_efficiency``: eff(m, n, k) of the
    op's GEMM dimensions, the same for the backward's two GEMMs; a GEMM op without known
    dimensions, e.g. fused attention, at the curve's peak_eff; ``include_unapplied``: also
    a fitted curve marked ``applied: false``)."""
    from eth.profiles.gemm_efficiency import efficiency_for, gemm_dims

    curve = efficiency_for(device.name, include_unapplied)
    dims = gemm_dims(model, mbs, tp)
    peak = device.tflops * 1e12 / 1e3                          # flop per ms at 100 %
    bw = device.mem_bw_gbs * 1e9 * MEMORY_EFFICIENCY / 1e3     # bytes per ms
    rows = {}
    for name, s in op_shapes(model, mbs, tp).items():
        if s.is_gemm:
            eff = curve(*dims[name]) if name in dims else curve.peak_eff
            fwd = s.flops_fwd / (peak * eff) + curve.overhead_ms
            bwd = s.flops_bwd / (peak * eff) + curve.overhead_ms
        else:
            fwd = s.traffic_bytes / bw + KERNEL_OVERHEAD_MS
            bwd = 2 * s.traffic_bytes / bw + KERNEL_OVERHEAD_MS
        rows[name] = [fwd, bwd, s.weight_bytes, s.act_bytes, s.input_bytes, s.output_bytes]
    return rows


def _curve_record(curve) -> dict:
    return {"curve": "peak_eff * m/(m+d0) * n/(n+d0) * k/(k+d0) (eth/profiles/gemm_efficiency.py)",
            "peak_eff": curve.peak_eff, "d0": curve.d0, "overhead_ms": curve.overhead_ms,
            "source": curve.source}


def analytic_profile(device: DeviceType, models, mbs=DEFAULT_MBS, tp=DEFAULT_TP,
                     base: dict | None = None, include_unapplied: bool = False) -> dict:
    """A profile JSON dict for ``device`` (merged into ``base`` if given; GEMM curve as
    :func:`analytic_op_costs`)."""
    from eth.profiles.gemm_efficiency import GemmEfficiency, efficiency_for

    curve = efficiency_for(device.name, include_unapplied)
    data = dict(base) if base else {
        "version": PROFILE_VERSION, "device": device.name, "source": "analytic",
        "provenance": {
            "generator": "eth.profiles.db.analytic_profile (roofline)",
            "datasheet": {"tflops": device.tflops, "memory_gb": device.memory_gb,
                          "mem_bw_gbs": device.mem_bw_gbs, "source": device.source},
            "gemm_efficiency": GEMM_EFFICIENCY if curve == GemmEfficiency() else _curve_record(curve),
            "memory_efficiency": MEMORY_EFFICIENCY,
            "kernel_overhead_ms": KERNEL_OVERHEAD_MS, "reserved_bytes": RESERVED_BYTES},
        "op_fields": list(OP_FIELDS), "tp_comm_included": False, "models": []}
    if not base and curve != efficiency_for(device.name):
        data["provenance"]["gemm_efficiency"]["applied"] = False   # opted in (include_unapplied)
    data["models"] = list(data["models"])
    for model in models:
        entries = [{"mbs": m, "tp": t, "reserved_bytes": RESERVED_BYTES,
                    "ops": analytic_op_costs(device, model, m, t, include_unapplied)}
                   for t in tp if model.splits(t) for m in mbs]
        data["models"].append({"name": model.name, "source": "analytic", "tp_comm_included": False,
                               "shape": shape_dict(model),
                               "entries": entries})
    return data


# ----------------------------------------------------------------------------------
# Collectives: alpha-beta model, or a measured table when the profile has one.

def collective_ms(kind: str, n: int, nbytes: float, gbps: float, profile: DeviceProfile | None = None) -> float:
    """Time of one collective over ``n`` ranks moving ``nbytes`` per rank.

    Ring all-reduce: 2(n-1)/n * bytes / bw + 2(n-1) alpha; all-gather and
    reduce-scatter: (n-1)/n * bytes / bw + (n-1) alpha; p2p: bytes / bw + alpha.
    """
    if nbytes <= 0 or (n <= 1 and kind != "p2p"):
        return 0.0
    if profile is not None:
        table = profile.collective_table(kind, n)
        if table:
            return _table_ms(table, nbytes)
    per_ms = gbps * 1e9 / 8 / 1e3  # bytes per ms
    if kind == "all_reduce":
        return 2 * (n - 1) / n * nbytes / per_ms + 2 * (n - 1) * COLLECTIVE_ALPHA_MS
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * nbytes / per_ms + (n - 1) * COLLECTIVE_ALPHA_MS
    if kind == "p2p":
        return nbytes / per_ms + COLLECTIVE_ALPHA_MS
    raise ValueError(f"unknown collective {kind!r}")


def _table_ms(table, nbytes):
    sizes = [row[0] for row in table]
    i = bisect.bisect_left(sizes, nbytes)
    if i == 0 or len(table) == 1:
        return table[0][1] * nbytes / table[0][0]
    if i == len(table):
        (b0, t0), (b1, t1) = table[-2], table[-1]
        return t1 + (nbytes - b1) * (t1 - t0) / (b1 - b0)
    (b0, t0), (b1, t1) = table[i - 1], table[i]
    return t0 + (nbytes - b0) * (t1 - t0) / (b1 - b0)
