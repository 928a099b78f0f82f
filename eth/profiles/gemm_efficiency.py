"""GEMM efficiency of small and narrow matrix multiplies (analytic profiles).

A GEMM C[m, n] = A[m, k] B[k, n] of ``2 m n k`` FLOPs on a device of dense peak P takes,
in the analytic profiles (``eth.profiles.db.analytic_op_costs``),

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
``eth/data/gemm_efficiency.yaml`` with where they come from: fitted to the GEMM ops of
measured profiles or of published GPU measurements (:mod:`eth.profiles.gemm_fit`,
``tools/fit_gemm_efficiency.py``), or, for a type without an entry, the fixed assumption
(peak_eff 0.6, d0 0, 0.01 ms).  An entry marked ``applied: false`` is fitted and kept but
used for analytic profiles only on request (``include_unapplied``;
``tools/make_profiles.py --gemm-efficiency fitted``): the GPU fits, whose effect on the
plans is described in docs/EVALUATION.md.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources

import yaml

from eth.errors import ProfileError, is_number
from eth.spec.model import ModelSpec

DEFAULT_PEAK_EFF = 0.6       # the previous fixed assumption (fraction of dense peak)
DEFAULT_D0 = 0.0             # no size dependence
DEFAULT_OVERHEAD_MS = 0.01   # eth.profiles.db.KERNEL_OVERHEAD_MS
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
