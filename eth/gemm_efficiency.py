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
the GEMM ops of measured profiles (``tools/fit_gemm_efficiency.py``), or, for a type
without an entry, the previous fixed assumption (peak_eff 0.6, d0 0, 0.01 ms), so its
analytic profiles are unchanged.  The fit minimises the relative error of the predicted
forward time over every GEMM op (head+loss excluded: it holds the cross entropy too)
and (mbs, tp) entry, ``t_i = flops_i / (P * eff_i) + overhead_ms``: d0 and overhead_ms
on grids, peak_eff in closed form for each pair (weighted linear least squares).
"""
from __future__ import annotations

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


def efficiency_for(device_name: str) -> GemmEfficiency:
    """The device type's curve (``eth/data/gemm_efficiency.yaml``; the default otherwise)."""
    entry = _table().get(device_name)
    if entry is None:
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


def fit(points, tflops: float, d0_grid=None, overhead_grid=None) -> tuple[GemmEfficiency, dict]:
    """(curve, stats) minimising sum ((t_pred - t) / t)^2 over ``points`` (as
    :func:`gemm_points` gives them) at catalog peak ``tflops``: d0 and overhead_ms on
    grids, peak_eff in closed form for each pair; stats: rms and max relative error,
    point count."""
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
    stats = {"points": len(errs), "rms_rel_err": math.sqrt(sq / len(errs)),
             "max_abs_rel_err": max(abs(e) for e in errs)}
    return curve, stats


D0_GRID = (0.0,) + tuple(2 ** (i / 8) for i in range(0, 113))          # 1 .. 16384
OVERHEAD_GRID = tuple(i * 0.005 for i in range(0, 41))                  # 0 .. 0.2 ms


# ----------------------------------------------------------------------------------
# The fit CLI (tools/fit_gemm_efficiency.py).

def main(argv=None) -> int:
    """Fit a device type's curve to the GEMM ops of measured profiles; print the YAML entry."""
    import argparse

    from eth.cli import run_main

    def _main(argv):
        from eth.cluster import catalog
        from eth.model import get_model
        from eth.profiles import load_profile

        ap = argparse.ArgumentParser(description=main.__doc__)
        ap.add_argument("profiles", nargs="+", help="measured profile JSON files (tools/profile_ops.py)")
        ap.add_argument("--device", required=True, help="catalog device type whose peak the fit is relative to")
        ap.add_argument("--models", required=True, help="comma-separated presets whose entries to use")
        args = ap.parse_args(argv)
        if args.device not in catalog():
            raise ProfileError(f"--device {args.device} is not in the device catalog")
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
        curve, stats = fit(points, catalog()[args.device].tflops)
        print(yaml.safe_dump({args.device: {
            "peak_eff": round(curve.peak_eff, 4), "d0": round(curve.d0, 3),
            "overhead_ms": round(curve.overhead_ms, 4),
            "fit": {"points": stats["points"], "rms_rel_err": round(stats["rms_rel_err"], 4),
                    "max_abs_rel_err": round(stats["max_abs_rel_err"], 4),
                    "command": "python tools/fit_gemm_efficiency.py " + " ".join(argv)}}},
            sort_keys=False).rstrip())
        return 0

    import sys

    return run_main(_main, sys.argv[1:] if argv is None else list(argv))
