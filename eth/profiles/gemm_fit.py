"""Fitting a device type's GEMM efficiency curve (:mod:`eth.profiles.gemm_efficiency`) to
measured GEMM times: the GEMM ops of measured profiles (:func:`gemm_points`), Aceso op
CSVs (:func:`aceso_points`) or XLA's GEMM perf table (:func:`xla_points`, read by
:func:`parse_txtpb`); :func:`fit` minimises the relative error of the predicted forward
time, d0 and overhead_ms on grids, peak_eff in closed form for each pair (weighted
linear least squares).  ``tools/fit_gemm_efficiency.py`` (:mod:`eth.cli.fit_gemm_efficiency`)
prints the YAML entry.
"""
from __future__ import annotations

import math

from eth.errors import ProfileError
from eth.profiles.gemm_efficiency import FIT_OPS, GemmEfficiency, gemm_dims
from eth.spec.model import ModelSpec


def gemm_points(profile_data: dict, model: ModelSpec, ops=FIT_OPS) -> list[tuple]:
    """[(op, mbs, tp, (m, n, k), flops, fwd_ms)] of every GEMM op and (mbs, tp) entry of
    ``model``'s shape in a profile JSON dict."""
    from eth.spec.model import op_shapes
    from eth.profiles.db import entry_shape, shape_key

    key = shape_key(model)
    points = []
    for m in profile_data["models"]:
        if entry_shape(m["shape"]) != key:
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
# relative tolerance, the model fields it checks).  As eth.profiles.aceso.SHAPE_CHECKS, but the heads
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
    ``{prefix}_mbs{m}_tp{t}_algo{algo}.csv`` of ``folder`` (read by eth/profiles/aceso.py: times in
    microseconds; weight / activation sizes checked against ``model``: GEMM_SHAPE_CHECKS), without
    the row-parallel ops at tp > 1 (their times hold the tp All-Reduce) and the ops Aceso
    could not run (ACESO_FAILED)."""
    import re
    from pathlib import Path

    from eth.profiles.aceso import read_op_csv
    from eth.spec.model import op_shapes

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
