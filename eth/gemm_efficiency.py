"""GEMM efficiency of small and narrow matrix multiplies (analytic profiles, issue 10 item 4).

A GEMM C[m, n] = A[m, k] B[k, n] of ``2 m n k`` FLOPs on a device of dense peak P takes,
in the analytic profiles (``eth.profiles.analytic_op_costs``),

    t = 2 m n k / (P * eff(m, n, k)) + overhead_ms
    eff(m, n, k) = peak_eff * m / (m + d0) * n / (n + d0) * k / (k + d0)

Why this curve: a GEMM kernel computes C in tiles and streams A and B through a
pipeline along k; a dimension d much larger than the tile/pipeline granularity keeps
the units busy, one of the same order wastes a fixed amount per tile row / column /
k-sweep, so each dimension contributes a saturating factor d / (d + d0) (the
"wave/tile quantisation" and pipeline fill-drain losses, smoothed).  Properties the
tests check: eff rises monotonically in every dimension and tends to ``peak_eff`` as
all three grow; one d0 for all three dimensions makes eff symmetric, so the backward
pass's two GEMMs (the same three dimensions, permuted) run at the forward's efficiency.
d0 = 0 gives the old linear model (t proportional to FLOPs at any size).

Batched GEMMs (attention score and context: b * a / t matrices of [s, hd] x [hd, s] and
[s, s] x [s, hd]) count their batch in m (rows of independent products stacked),
which is how batched kernels fill the device.

The parameters of a device type (peak_eff, d0, overhead_ms) live in
``eth/data/gemm_efficiency.yaml`` with where they come from: fitted (:func:`fit`) to
the GEMM ops of measured profiles or of published GPU measurements read from their
original files (:func:`aceso_points`: Aceso op CSVs; :func:`xla_points`: XLA's GEMM perf
table, a protobuf text file read by :func:`parse_txtpb`) by ``tools/fit_gemm_efficiency.py``,
or, for a type without an entry, the previous fixed assumption (peak_eff 0.6, d0 0,
0.01 ms), so its analytic profiles are unchanged; an entry marked ``applied: false`` is
fitted and kept but used for analytic profiles only on request (``include_unapplied``;
``tools/make_profiles.py --gemm-efficiency fitted``): the GPU fits, whose effect on the
plans awaits a decision (docs/EVALUATION.md).  The fit minimises the relative error of the predicted
forward time over every GEMM op (head+loss excluded: it holds the cross entropy too)
and (mbs, tp) entry, ``t_i = flops_i / (P * eff_i) + overhead_ms``: d0 and overhead_ms
on grids, peak_eff in closed form for each pair (weighted linear least squares).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from importlib import resources

import yaml

from eth.errors import ProfileError, is_number
from eth.model import ModelSpec

DEFAULT_PEAK_EFF = 0.6       # the previous fixed assumption (fraction of dense peak)
DEFAULT_D0 = 0.0             # no size dependence
DEFAULT_OVERHEAD_MS = 0.01   # eth.profiles.KERNEL_OVERHEAD_MS
GEMM_OPS = ("qkv", "score", "context", "attn-dense", "mlp-gemm-1", "mlp-gemm-2", "head+loss")
FIT_OPS = GEMM_OPS[:-1]      # head+loss also holds the cross entropy: not a pure GEMM


@dataclass(frozen=True)
class GemmEfficiency:
    peak_eff: float = DEFAULT_PEAK_EFF
    """Efficiency of a large GEMM, a fraction of the catalog's dense peak (above 1 only
    where the catalog figure is below the real peak: the nominal ``cpu`` entry)."""
    d0: float = DEFAULT_D0
    """Half-saturation dimension: a dimension of d0 halves the efficiency."""
    overhead_ms: float = DEFAULT_OVERHEAD_MS
    """Fixed time per GEMM op and pass (launch; on a CPU the op's Python and dispatch)."""
    source: str = "assumed (no measured data): the fixed 60 % of peak of the roofline profiles"

    def __post_init__(self):
        for name in ("peak_eff", "d0", "overhead_ms"):
            value = getattr(self, name)
            if not is_number(value) or value < 0 or (name == "peak_eff" and value == 0):
                raise ProfileError(f"gemm efficiency {name} must be a number "
                                   f"{'> 0' if name == 'peak_eff' else '>= 0'}, got {value!r}")

    def __call__(self, m: float, n: float, k: float) -> float:
        """eff(m, n, k), a fraction of the device's dense peak."""
        d0 = self.d0
        return self.peak_eff * (m / (m + d0)) * (n / (n + d0)) * (k / (k + d0))

    def ms(self, dims, flops: float, tflops: float) -> float:
        """Time of a GEMM of ``flops`` FLOPs with dimensions ``dims`` at peak ``tflops``."""
        return flops / (tflops * 1e9 * self(*dims)) + self.overhead_ms


def gemm_dims(model: ModelSpec, mbs: int, tp: int) -> dict[str, tuple[int, int, int]]:
    """(m, n, k) of the forward GEMM of every GEMM op on one tp rank (Megatron sharding:
    column-parallel qkv / mlp-gemm-1 / head split n, row-parallel attn-dense / mlp-gemm-2
    split k, attention splits heads)."""
    b, s, h, t = mbs, model.seq_len, model.hidden, tp
    hd = model.head_dim
    kvd = model.kv_heads * hd
    f1 = 2 * model.ffn if model.swiglu else model.ffn
    heads = b * model.heads // t
    return {
        "qkv": (b * s, (h + 2 * kvd) // t, h),
        "score": (heads * s, s, hd),
        "context": (heads * s, hd, s),
        "attn-dense": (b * s, h, h // t),
        "mlp-gemm-1": (b * s, f1 // t, h),
        "mlp-gemm-2": (b * s, h, model.ffn // t),
        "head+loss": (b * s, model.vocab // t, h),
    }


@functools.lru_cache(maxsize=1)
def _table() -> dict:
    text = resources.files("eth").joinpath("data/gemm_efficiency.yaml").read_text()
    data = yaml.safe_load(text) or {}
    if data.get("version") != 1 or not isinstance(data.get("devices"), dict):
        raise ProfileError("eth/data/gemm_efficiency.yaml: expected version 1 and a devices mapping")
    return data["devices"]


def efficiency_for(device_name: str, include_unapplied: bool = False) -> GemmEfficiency:
    """The device type's curve (``eth/data/gemm_efficiency.yaml``; the default otherwise,
    also for an entry marked ``applied: false`` unless ``include_unapplied``)."""
    entry = _table().get(device_name)
    if entry is None:
        return GemmEfficiency()
    applied = entry.get("applied", True) if isinstance(entry, dict) else True
    if not isinstance(applied, bool):
        raise ProfileError(f"eth/data/gemm_efficiency.yaml: {device_name}.applied must be true or false, "
                           f"got {applied!r}")
    if not applied and not include_unapplied:
        return GemmEfficiency()
    try:
        return GemmEfficiency(float(entry["peak_eff"]), float(entry["d0"]), float(entry["overhead_ms"]),
                              str(entry.get("source", "")))
    except (KeyError, TypeError, ValueError):
        raise ProfileError(f"eth/data/gemm_efficiency.yaml: {device_name} needs numbers peak_eff, d0 "
                           f"and overhead_ms, got {entry!r}") from None


# ----------------------------------------------------------------------------------
# Fitting.

def gemm_points(profile_data: dict, model: ModelSpec, ops=FIT_OPS) -> list[tuple]:
    """[(op, mbs, tp, (m, n, k), flops, fwd_ms)] of every GEMM op and (mbs, tp) entry of
    ``model``'s shape in a profile JSON dict."""
    from eth.model import op_shapes
    from eth.profiles import SHAPE_FIELDS, shape_key

    key = shape_key(model)
    points = []
    for m in profile_data["models"]:
        if tuple(m["shape"][f] for f in SHAPE_FIELDS) != key:
            continue
        for e in m["entries"]:
            dims, shapes = gemm_dims(model, e["mbs"], e["tp"]), op_shapes(model, e["mbs"], e["tp"])
            for op in ops:
                points.append((op, e["mbs"], e["tp"], dims[op], shapes[op].flops_fwd, e["ops"][op][0]))
    if not points:
        raise ProfileError(f"profile {profile_data.get('device')} has no entries for {model.name}")
    return points


# ----------------------------------------------------------------------------------
# Published GPU measurements, read from their original files (nothing of them is
# shipped here): Aceso op-profile CSVs and OpenXLA's GEMM performance table.

ROW_PARALLEL = ("attn-dense", "mlp-gemm-2")   # at tp > 1 Aceso times them with their All-Reduce
# What an Aceso CSV must show of the shape the GEMM dimensions come from: (op, CSV column,
# relative tolerance, the model fields it checks).  As eth.aceso.SHAPE_CHECKS, but the heads
# come from the score's output (its activations column): the softmax's holds allocator
# noise at tp 8 (e.g. 48 MB for 16 MB in Sailor's RTX-3090 OPT-350 CSVs), and no vocabulary
# check (head+loss is not fitted).
ACESO_FAILED = 1e7   # Aceso's value (us, MB) for an op it could not run (out of memory): no measurement
GEMM_SHAPE_CHECKS = (("qkv", "weights", 0.02, ("hidden",)), ("mlp-gemm-1", "weights", 0.02, ("hidden", "ffn")),
                     ("score", "activations", 0.10, ("heads", "seq_len")))


def parse_aceso_model(text: str) -> tuple[str, ModelSpec]:
    """``NAME:hidden:heads:ffn`` (``--aceso-model``) -> (Aceso's file prefix NAME, a
    one-layer GPT shape); the sequence length is set by the caller."""
    parts = text.split(":")
    try:
        if len(parts) != 4 or not parts[0]:
            raise ValueError
        h, a, f = (int(x) for x in parts[1:])
        if min(h, a, f) <= 0 or h % a:
            raise ValueError
    except ValueError:
        raise ProfileError(f"--aceso-model must be NAME:hidden:heads:ffn with positive integers and "
                           f"hidden divisible by heads, got {text!r}") from None
    return parts[0], ModelSpec(parts[0], 1, h, a, f)


def aceso_points(folder, prefix: str, model: ModelSpec, algo: int = 0, ops=FIT_OPS) -> list[tuple]:
    """[(op, mbs, tp, (m, n, k), flops, fwd_ms)] of the GEMM ops in the Aceso op CSVs
    ``{prefix}_mbs{m}_tp{t}_algo{algo}.csv`` of ``folder`` (read by eth/aceso.py: times in
    microseconds; weight / activation sizes checked against ``model``: GEMM_SHAPE_CHECKS), without
    the row-parallel ops at tp > 1 (their times hold the tp All-Reduce) and the ops Aceso
    could not run (ACESO_FAILED)."""
    import re
    from pathlib import Path

    from eth.aceso import read_op_csv
    from eth.model import op_shapes

    folder = Path(folder)
    if not folder.is_dir():
        raise ProfileError(f"--aceso-dir {folder} is not a folder")
    name = re.compile(rf"^{re.escape(prefix)}_mbs(\d+)_tp(\d+)_algo{algo}\.csv$")
    points = []
    for path in sorted(folder.iterdir()):
        hit = name.match(path.name)
        if not hit:
            continue
        mbs, tp = int(hit[1]), int(hit[2])
        rows, _, raw = read_op_csv(path, 2 ** 20)
        dims, shapes = gemm_dims(model, mbs, tp), op_shapes(model, mbs, tp)
        for op, column, rel, fields in GEMM_SHAPE_CHECKS:
            want = shapes[op].weight_bytes if column == "weights" else shapes[op].output_bytes
            got = raw[op][column]
            if got >= ACESO_FAILED * 2 ** 20:
                continue
            if abs(got - want) > rel * want + 0.0015 * 2 ** 20:   # + the CSV's rounding to 0.001 MB
                named = ", ".join(f"{f} {getattr(model, f)}" for f in fields)
                raise ProfileError(f"{path.name}: {op} {column} {got / 2 ** 20:.3f} MB, but --aceso-model "
                                   f"{prefix} ({named}) at mbs {mbs}, tp {tp} gives {want / 2 ** 20:.3f} MB")
        for op in ops:
            if (tp > 1 and op in ROW_PARALLEL) or rows[op][0] * 1000 >= ACESO_FAILED:
                continue
            if not rows[op][0] > 0:
                raise ProfileError(f"{path.name}: {op} forward time must be > 0, got {rows[op][0] * 1000} us")
            points.append((op, mbs, tp, dims[op], shapes[op].flops_fwd, rows[op][0]))
    if not points:
        raise ProfileError(f"{folder} has no files named {prefix}_mbs<m>_tp<t>_algo{algo}.csv")
    return points


def parse_txtpb(text: str, where: str = "text proto") -> dict:
    """A protobuf text-format message as {field: [values]} (every field a list; nested
    messages as dicts, scalars as int, float or str).  Enough for data tables: no
    extensions, Any or escapes other than \\" and \\\\ in strings."""
    import re

    token = re.compile(r'\s+|#[^\n]*|(?P<str>"(?:[^"\\]|\\.)*")|(?P<punct>[{}:<>;,\[\]])|(?P<word>[^\s{}:<>;,\[\]"#]+)')
    toks, pos = [], 0
    while pos < len(text):
        m = token.match(text, pos)
        if not m:
            raise ProfileError(f"{where}: cannot read {text[pos:pos + 20]!r} at offset {pos}")
        pos = m.end()
        if m["str"] is not None:
            toks.append(("str", re.sub(r'\\(.)', r'\1', m["str"][1:-1])))
        elif m["punct"] is not None:
            toks.append(("punct", m["punct"]))
        elif m["word"] is not None:
            toks.append(("word", m["word"]))

    def scalar(word):
        for kind in (int, float):
            try:
                return kind(word)
            except ValueError:
                pass
        return word

    def message(i, close):
        out: dict = {}
        while True:
            if i == len(toks):
                if close is None:
                    return out, i
                raise ProfileError(f"{where}: missing {close!r} at the end")
            kind, val = toks[i]
            if kind == "punct" and val == close:
                return out, i + 1
            if kind != "word":
                raise ProfileError(f"{where}: expected a field name, got {val!r}")
            i += 1
            if i < len(toks) and toks[i] == ("punct", ":"):
                i += 1
            if i == len(toks):
                raise ProfileError(f"{where}: field {val} has no value")
            kind2, v = toks[i]
            if kind2 == "punct" and v in "{<":
                sub, i = message(i + 1, "}" if v == "{" else ">")
                out.setdefault(val, []).append(sub)
            elif kind2 == "str":
                out.setdefault(val, []).append(v)
                i += 1
            elif kind2 == "word":
                out.setdefault(val, []).append(scalar(v))
                i += 1
            else:
                raise ProfileError(f"{where}: field {val} has no value, got {v!r}")
            if i < len(toks) and toks[i] in (("punct", ";"), ("punct", ",")):
                i += 1

    return message(0, None)[0]


XLA_DTYPE = "bf16xbf16->bf16"


def xla_points(path, gpu: str, dtype: str = XLA_DTYPE) -> list[tuple]:
    """[("matmul", b, 1, (b * n, m, k), 2 b m n k, ms)] of the ``gpu`` entry (e.g. "sm_90")
    of an XLA GEMM performance table (``xla.GemmPerfTable`` text proto, as
    xla/service/gpu/model/default_matmul_perf_table.txtpb: per dot [b, n, k] x [b, k, m]
    its FLOP/s by dtype): the batch stacked on the output rows, as :func:`gemm_dims`
    counts batched GEMMs; time = FLOPs / FLOP/s."""
    try:
        with open(path) as fh:
            table = parse_txtpb(fh.read(), str(path))
    except OSError as exc:
        raise ProfileError(f"cannot read XLA perf table {path}: {exc.strerror}") from None
    keys = [e.get("key", ["?"])[0] for e in table.get("entries", [])]
    if gpu not in keys:
        raise ProfileError(f"{path} has no entry for --xla-gpu {gpu}; it holds {', '.join(map(str, keys)) or 'none'}")
    value = table["entries"][keys.index(gpu)].get("value", [{}])[0]
    points = []
    for i, e in enumerate(value.get("entries", [])):
        try:
            b, m, n, k = (int(e.get(f, [1 if f == "b" else None])[0]) for f in ("b", "m", "n", "k"))
            rate = {f["key"][0]: float(f["value"][0]) for f in e.get("flops", [])}[dtype]
        except (KeyError, TypeError, ValueError, IndexError):
            raise ProfileError(f"{path}: {gpu} entry {i + 1} needs integers m, n, k and a {dtype} flops "
                               f"value, got {e!r}") from None
        if min(b, m, n, k) <= 0 or not rate > 0:
            raise ProfileError(f"{path}: {gpu} entry {i + 1}: b, m, n, k and the flops must be > 0, got "
                               f"{b}, {m}, {n}, {k}, {rate}")
        flops = 2 * b * m * n * k
        points.append(("matmul", b, 1, (b * n, m, k), flops, flops / rate * 1e3))
    if not points:
        raise ProfileError(f"{path}: entry {gpu} holds no GEMMs")
    return points


def fit(points, tflops: float, d0_grid=None, overhead_grid=None) -> tuple[GemmEfficiency, dict]:
    """(curve, stats) minimising sum ((t_pred - t) / t)^2 over ``points`` (as
    :func:`gemm_points` gives them) at catalog peak ``tflops``: d0 and overhead_ms on
    grids, peak_eff in closed form for each pair; stats: rms and max relative error,
    point count, mean relative error per op (predicted / measured - 1)."""
    d0_grid = D0_GRID if d0_grid is None else d0_grid
    overhead_grid = OVERHEAD_GRID if overhead_grid is None else overhead_grid
    ts = [p[5] for p in points]
    best = None
    for d0 in d0_grid:
        unit = GemmEfficiency(1.0, d0, 0.0)
        xs = [unit.ms(dims, flops, tflops) for _, _, _, dims, flops, _ in points]   # at peak_eff 1
        for c in overhead_grid:
            # t = x / peak_eff + c: weighted least squares for 1 / peak_eff
            num = sum(x / t * (1 - c / t) for x, t in zip(xs, ts))
            den = sum((x / t) ** 2 for x, t in zip(xs, ts))
            inv = num / den if den > 0 else 0.0
            if inv <= 0:
                continue
            sq = sum(((x * inv + c) / t - 1) ** 2 for x, t in zip(xs, ts))
            if best is None or sq < best[0]:
                best = (sq, d0, 1.0 / inv, c)
    if best is None:
        raise ProfileError("no GEMM efficiency fits these points (times below the overhead grid)")
    sq, d0, peak_eff, c = best
    curve = GemmEfficiency(peak_eff, d0, c, "fitted")
    errs = [curve.ms(dims, flops, tflops) / t - 1 for _, _, _, dims, flops, t in points]
    by_op: dict[str, list[float]] = {}
    for p, e in zip(points, errs):
        by_op.setdefault(p[0], []).append(e)
    stats = {"points": len(errs), "rms_rel_err": math.sqrt(sq / len(errs)),
             "max_abs_rel_err": max(abs(e) for e in errs),
             "op_mean_rel_err": {op: sum(v) / len(v) for op, v in by_op.items()}}
    return curve, stats


D0_GRID = (0.0,) + tuple(2 ** (i / 8) for i in range(0, 113))          # 1 .. 16384
OVERHEAD_GRID = tuple(i * 0.005 for i in range(0, 41))                  # 0 .. 0.2 ms


# ----------------------------------------------------------------------------------
# The fit CLI (tools/fit_gemm_efficiency.py).

def main(argv=None) -> int:
    """Fit a device type's curve to the GEMM ops of measured profiles or of a published GEMM
    table; print the YAML entry."""
    import argparse

    from eth.cli import run_main

    def _main(argv):
        from eth.cluster import catalog
        from eth.model import get_model
        from eth.profiles import load_profile

        ap = argparse.ArgumentParser(description=main.__doc__)
        ap.add_argument("profiles", nargs="*", help="measured profile JSON files (tools/profile_ops.py)")
        ap.add_argument("--device", required=True, help="catalog device type whose peak the fit is relative to")
        ap.add_argument("--models", help="comma-separated presets whose profile entries to use")
        ap.add_argument("--seq", type=int, default=2048, help="with --aceso-dir: the CSVs' sequence length")
        ap.add_argument("--aceso-dir", metavar="DIR",
                        help="a folder of Aceso op CSVs ({NAME}_mbs{m}_tp{t}_algo0.csv) instead of profiles")
        ap.add_argument("--aceso-model", metavar="NAME:hidden:heads:ffn", action="append", default=[],
                        help="with --aceso-dir: the CSVs of Aceso model NAME and its shape (repeatable)")
        ap.add_argument("--xla-perf-table", metavar="TXTPB",
                        help="an XLA GEMM perf table (default_matmul_perf_table.txtpb) instead of profiles")
        ap.add_argument("--xla-gpu", help="with --xla-perf-table: the table's entry key (e.g. sm_90)")
        args = ap.parse_args(argv)
        if args.device not in catalog():
            raise ProfileError(f"--device {args.device} is not in the device catalog")
        sources = [bool(args.profiles), bool(args.aceso_dir), bool(args.xla_perf_table)]
        if sum(sources) != 1:
            raise ProfileError("give one source: profile files with --models, --aceso-dir DIR with "
                               "--aceso-model, or --xla-perf-table FILE with --xla-gpu")
        if bool(args.models) != bool(args.profiles) or bool(args.aceso_model) != bool(args.aceso_dir) \
                or bool(args.xla_gpu) != bool(args.xla_perf_table):
            raise ProfileError("--models goes with profile files, --aceso-model with --aceso-dir, "
                               "--xla-gpu with --xla-perf-table (each needs the other)")
        if args.seq <= 0:
            raise ProfileError(f"--seq must be positive, got {args.seq}")
        if args.aceso_dir:
            points = []
            for spec in args.aceso_model:
                prefix, model = parse_aceso_model(spec)
                points += aceso_points(args.aceso_dir, prefix, dataclasses.replace(model, seq_len=args.seq))
        elif args.xla_perf_table:
            points = xla_points(args.xla_perf_table, args.xla_gpu)
        else:
            points = []
            for path in args.profiles:
                data = load_profile(path).data
                for name in args.models.split(","):
                    model = get_model(name.strip())
                    try:
                        points += gemm_points(data, model)
                    except ProfileError:
                        continue
            if not points:
                raise ProfileError(f"{', '.join(args.profiles)} hold no entries for {args.models}")
        tflops = catalog()[args.device].tflops
        curve, stats = fit(points, tflops)
        _, linear = fit(points, tflops, d0_grid=[0.0])
        print(yaml.safe_dump({args.device: {
            "peak_eff": round(curve.peak_eff, 4), "d0": round(curve.d0, 3),
            "overhead_ms": round(curve.overhead_ms, 4),
            "fit": {"points": stats["points"], "rms_rel_err": round(stats["rms_rel_err"], 4),
                    "max_abs_rel_err": round(stats["max_abs_rel_err"], 4),
                    "linear_rms_rel_err": round(linear["rms_rel_err"], 4),
                    "op_mean_rel_err": {op: round(e, 3) for op, e in stats["op_mean_rel_err"].items()},
                    "command": "python tools/fit_gemm_efficiency.py " + " ".join(argv)}}},
            sort_keys=False).rstrip())
        return 0

    import sys

    return run_main(_main, sys.argv[1:] if argv is None else list(argv))
