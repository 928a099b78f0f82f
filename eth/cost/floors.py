"""Lower bounds of a stage's time over every recompute set that fits (the planner's exact pruning).

:class:`StageFloors` is a part of :class:`eth.cost.model.CostModel`: it reads the model's
memoised shape terms (``_shape_parts``) and cache, and gives
:func:`eth.planner.bounds.stage_group_floor` the floors by which phase 1 orders and
prunes stage groups.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from eth.cost.activations import LayerKeep
from eth.spec.model import KNOWN_LAYER_OPS, layer_dataflow

_LAYER_OP_SET = frozenset(KNOWN_LAYER_OPS)


class StageFloors:
    """Stage-time floors of :class:`eth.cost.model.CostModel` (module docstring)."""

    def stage_time_floors(self, device_type: str, first: bool, last: bool, shapes, layers):
        """Lower bounds of T_j (fwd_ms + bwd_ms of :meth:`stage_cost_at`) of a stage, one
        row per shape (tp, dp, micro, links, in-flight micro-batches) of ``shapes`` and one
        column per layer count of ``layers`` (a numpy array of counts >= 1), over every
        recompute set that fits in memory; inf where none fits.  For
        :func:`eth.planner.bounds.stage_group_floor`.

        The terms of :meth:`_stage_shape` without recompute (a profile's per-checkpoint
        overheads, which may be negative, counted at their most negative: every op of every
        layer its own checkpointed run), plus the least recompute time that frees enough:
        fitting needs inflight x act + backward + params x state bytes + reserved <=
        capacity (the peak counts at least those; the re-materialised run adds >= 0), and
        the recompute frees the sum over the stage's layers of what each layer's set frees
        (:meth:`eth.cost.model.CostModel.recompute_savings`) for the sum of their forward ms, so
        the least time is at least layers x h(bytes to free / layers) for a convex h below
        one layer's least time per bytes freed (:func:`_recompute_hull`): a convex
        piecewise-linear function, the largest of its segments' lines."""
        return self.stage_time_floors_at(self.floor_table(device_type, first, last, shapes),
                                         [f for *_, f in shapes], layers)

    def floor_table(self, device_type: str, first: bool, last: bool, shapes) -> tuple:
        """The arrays :meth:`stage_time_floors` combines, for ``shapes`` (their in-flight
        counts are not read): one row per shape."""
        terms = [self._floor_terms(device_type, tp, micro, first, last, links) for tp, _, micro, links, _ in shapes]
        k = max(len(t[-1]) for t in terms)
        rows = np.array([t[:7] for t in terms])            # per_layer, fixed, sa, ea, sw, ew, base
        slopes = np.zeros((len(terms), k))
        heads = np.zeros((len(terms), k))
        for r, t in enumerate(terms):
            slopes[r, :len(t[-1])] = t[-1]
            heads[r, :len(t[-2])] = t[-2]
        most = np.array([t[7] for t in terms])[:, None]   # bytes one layer can free at most
        state = np.array([self.setup.state_bytes_per_param(dp) for _, dp, _, _, _ in shapes])[:, None]
        capacity = self.cluster.types[device_type].memory_bytes
        return tuple(rows[:, c:c + 1] for c in range(7)) + (slopes[:, None, :], heads[:, None, :], most, state,
                                                            capacity)

    @staticmethod
    def stage_time_floors_at(table, inflight, layers):
        """:meth:`stage_time_floors` from its :meth:`floor_table` and the shapes' in-flight
        micro-batches."""
        per_layer, fixed, sa, ea, sw, ew, base, slopes, heads, most, state, capacity = table
        room = (capacity - base - (layers * sw + ew) * state) / np.asarray(inflight, dtype=float)[:, None]
        need = np.maximum(layers * sa + ea - room, 0.0) / layers          # bytes to free per layer
        out = layers * per_layer + fixed
        # the recompute term only where some set frees enough (most entries of a long
        # row cannot fit at all: inf)
        r, c = np.nonzero(need <= most)
        knapsack = np.max(need[r, c][:, None] * slopes[r, 0] + heads[r, 0], axis=1)
        out[need > most] = math.inf
        out[r, c] += layers[c] * knapsack
        return out

    def _floor_terms(self, device_type: str, tp: int, micro: int, first: bool, last: bool, links) -> tuple:
        """:meth:`stage_time_floors`' terms of one shape, memoised: (ms per layer, fixed ms,
        saved bytes per layer, boundary ops' saved bytes, params per layer, boundary
        params, reserved + backward bytes, bytes one layer can free, the intercepts and
        slopes (ascending, from 0) of :func:`_recompute_hull`'s lines)."""
        fkey = ("floor", device_type, tp, micro, first, last) + links
        hit = self._cache.get(fkey)
        if hit is not None:
            return hit
        pkey = ("parts", device_type, tp, micro, first, last) + links
        parts = self._cache.get(pkey)
        if parts is None:
            parts = self._cache[pkey] = self._shape_parts(device_type, tp, micro, first, last, links)
        ops, reserved, dtype_bytes, sf, sb, sw, sa, extra, tp_parts, ag, send_f, send_b, oh, backward = parts
        per_layer = sf + sb + oh[0] + oh[1]
        fixed = sum(f + b for f, b, _, _ in extra) + oh[2] + oh[3] + send_f + send_b
        for per, f_sum, b_sum in tp_parts or ():
            if per:
                per_layer += f_sum + b_sum
            else:
                fixed += f_sum + b_sum
        if tp_parts is not None and ag is not None:
            per_layer += ag[0] + ag[1]
        in_layer = [ops[op] for op in ops if op in _LAYER_OP_SET]
        per_layer += sum(min(c.fwd_ms, 0.0) for c in in_layer)
        per_layer += len(in_layer) * sum(min(x, 0.0) for x in oh[6:10])
        hkey = ("floor hull", device_type, tp, micro)
        hull = self._cache.get(hkey)
        if hull is None:
            hull = self._cache[hkey] = _recompute_hull(layer_dataflow(self.model), ops)
        heads, slopes, freed = hull
        hit = self._cache[fkey] = (per_layer, fixed, sa, sum(x[3] for x in extra), sw / dtype_bytes,
                                   sum(x[2] for x in extra) / dtype_bytes, reserved + backward, freed,
                                   heads, slopes)
        return hit


MAX_HULL_OPS = 16
"""Layer ops up to which :func:`_recompute_hull` enumerates every recompute set of a layer."""


def _recompute_hull(flow, ops) -> tuple[list, list, float]:
    """(intercepts, slopes, most bytes) of the lines whose maximum is a convex lower bound
    of the least recompute ms that frees x bytes of one layer, 0 <= x <= most.

    A layer that recomputes the set R of its ops (the dataflow ``flow``, op costs ``ops``)
    frees :meth:`eth.cost.activations.LayerKeep.freed` (R) for sum_{o in R} fwd ms
    (counted here at max(fwd, 0)): one vectorised pass over every R (up to
    ``MAX_HULL_OPS`` ops).  The lower convex hull of the points (freed, ms) from (0, 0) is
    below the step function min{ms(R) : freed(R) >= x}, non-decreasing and convex, so a
    stage's least recompute time over its layers is at least layers x hull(bytes to free
    / layers) (Jensen).  With more ops, the fractional knapsack of the ops by ms per byte
    (a set frees at most its ops' act_bytes: what the others count they keep), which is
    below the hull.  Memoised by the dataflow and the ops' numbers (searches of one
    profile database share them)."""
    return _hull(tuple(flow), tuple((max(ops[f.name].fwd_ms, 0.0), ops[f.name].act_bytes, ops[f.name].input_bytes,
                                     ops[f.name].output_bytes) for f in flow))


class _Sizes(NamedTuple):
    fwd_ms: float
    act_bytes: float
    input_bytes: float
    output_bytes: float


@functools.lru_cache(maxsize=4096)
def _hull(flow: tuple, ops: tuple) -> tuple[list, list, float]:
    """:func:`_recompute_hull` of ``flow`` with ``ops`` = ((fwd ms >= 0, act, input and
    output bytes), ...) in its order."""
    if len(ops) > MAX_HULL_OPS:
        cand = sorted((ms / act, act) for ms, act, _, _ in ops if act > 0)
        slopes, heads, freed, spent = [0.0], [0.0], 0.0, 0.0
        for ratio, act in cand:      # the segment's line: spent + ratio x (x - freed)
            slopes.append(ratio)
            heads.append(spent - ratio * freed)
            freed += act
            spent += ratio * act
        return heads, slopes, freed
    members, freed = LayerKeep(flow, {f.name: _Sizes(*o) for f, o in zip(flow, ops)}).freed_all()
    ms = members @ np.array([o[0] for o in ops])
    # the lower hull from (0, 0), vertex by vertex: the point of least slope (the
    # farthest of equal slopes) among those beyond the last vertex
    x0, y0, heads, slopes = 0.0, 0.0, [0.0], [0.0]
    while True:
        beyond = freed > x0
        if not beyond.any():
            return heads, slopes, x0
        f, t = freed[beyond], ms[beyond]
        slope = (t - y0) / (f - x0)
        least = slope.min()
        k = np.flatnonzero(slope == least)
        k = k[np.argmax(f[k])]
        slopes.append(float(least))
        heads.append(y0 - float(least) * x0)
        x0, y0 = float(f[k]), float(t[k])
