"""Search space: pipeline device groups, stage device groups and concrete ranks.

Paper section 4.2.1 / 4.2.2, with the restrictions that keep large clusters tractable:

* **Blocks.**  Devices of one type are interchangeable.  The ``c_t`` devices of type
  ``t`` are cut into ``k_t <= max_blocks_per_type`` (and ``<= max(2, max_blocks / T)``
  for T types) equal blocks of ``b_t`` devices
  (:func:`make_blocks`; ``b_t`` is the smallest power of two, else the smallest divisor,
  that brings ``k_t`` under the cap).  Small clusters (<= 8 devices per type) keep
  ``b_t = 1``, i.e. the full space.  A pipeline is a vector ``n = (n_t)`` of block
  counts (a device multiset); a **pipeline device group** is an unordered multiset of
  such vectors summing to ``(k_t)`` -- a vector partition, generated lazily in
  non-increasing lexicographic order by :func:`device_groups` and counted without
  generation by :func:`count_groups`.  Pipelines whose aggregate memory cannot hold
  the model's weights, gradients and optimizer states (:func:`pipeline_can_hold`) are
  never generated.  1..N pipelines, N = number of blocks (and <= gbs).
* **Stage device groups** (:func:`stage_groups`): stages are homogeneous (one device
  type, the plan format requires it); the stages of one type inside a pipeline are
  contiguous and equally sized, with size a power of two dividing the pipeline's count
  of that type (or the whole count); the order of the type blocks is any permutation
  (stage order matters under 1F1B).  1 <= #stages <= min(layers, max_stages).
* **Ranks** (:func:`assign_ranks`): per type, stages of all pipelines are placed by
  decreasing granule g (largest power of two dividing the stage size, at most the
  devices per node), then decreasing size, each as node-local runs of g ranks (smaller
  runs only when no such run is left).  With power-of-two sizes this is the contiguous
  layout by decreasing size (a power-of-two stage starts at a multiple of its size; a
  pipeline takes whole nodes where its size allows).  A tp is only used if each of its
  groups lies in one node on the stage's ranks (:meth:`eth.planner.evaluate.Evaluator.valid_tps`
  with ranks; :func:`plan_tp_in_nodes` for whole plans, which the search requires).
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

from eth.spec.cluster import Cluster
from eth.spec.model import ModelSpec


@dataclass(frozen=True)
class Blocks:
    """Granularity of the enumeration for one cluster."""

    types: tuple[str, ...]
    """Device types in order of first appearance in the cluster."""
    block: tuple[int, ...]
    """Devices per block of each type."""
    count: tuple[int, ...]
    """Blocks of each type."""
    ranks: tuple[tuple[int, ...], ...]
    """Global ranks of each type, cluster order."""
    nodes: tuple[tuple[int, ...], ...] = ()
    """Node of each rank in ``ranks`` (same shape); empty = unknown (ranks are then laid
    out contiguously by :func:`assign_ranks`)."""

    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.types, self.block, self.count, self.ranks, self.nodes))

    def __hash__(self) -> int:
        # memo keys hold the blocks; their rank tuples are hashed once, not per lookup
        return self._hash

    @property
    def total(self) -> int:
        return sum(self.count)

    def devices(self, vec) -> tuple[int, ...]:
        """Device count per type of a pipeline with block vector ``vec``."""
        return tuple(n * b for n, b in zip(vec, self.block))

    def label(self, vec) -> str:
        return "+".join(f"{d}x{t}" for t, d in zip(self.types, self.devices(vec)) if d)


def _block_size(count: int, cap: int) -> int:
    if count <= cap:
        return 1
    b = 1
    while count % (2 * b) == 0:
        b *= 2
        if count // b <= cap:
            return b
    for d in range(2, count + 1):
        if count % d == 0 and count // d <= cap:
            return d
    return count


def make_blocks(cluster: Cluster, max_blocks_per_type: int, max_blocks: int = 0) -> Blocks:
    """Cut each type's devices into at most ``max_blocks_per_type`` equal blocks, and with
    ``max_blocks`` (> 0) into at most max(2, ``max_blocks`` // types) (the pipeline
    vectors of T types number prod(k_t + 1): a budget over all types keeps them few on
    many types and leaves two types as they are)."""
    types, ranks, nodes = [], {}, {}
    for d in cluster.devices:
        if d.type not in ranks:
            types.append(d.type)
            ranks[d.type], nodes[d.type] = [], []
        ranks[d.type].append(d.rank)
        nodes[d.type].append(d.node)
    cap = min(max_blocks_per_type, max(2, max_blocks // len(types))) if max_blocks else max_blocks_per_type
    block = tuple(_block_size(len(ranks[t]), cap) for t in types)
    count = tuple(len(ranks[t]) // b for t, b in zip(types, block))
    return Blocks(tuple(types), block, count, tuple(tuple(ranks[t]) for t in types),
                  tuple(tuple(nodes[t]) for t in types))


def pipeline_can_hold(cluster: Cluster, blocks: Blocks, vec, model: ModelSpec,
                      bytes_per_param: float) -> bool:
    """Necessary memory condition: the pipeline's devices hold all states of the model."""
    mem = sum(d * cluster.types[t].memory_bytes for t, d in zip(blocks.types, blocks.devices(vec)))
    return mem >= model.num_params() * bytes_per_param


def _sub_vectors(total, upper):
    """Non-zero vectors v <= total (elementwise) with v <= upper (lexicographic), descending."""
    for v in itertools.product(*[range(t, -1, -1) for t in total]):
        if any(v) and v <= upper:
            yield v


class TimeUp(Exception):
    """Raised by :func:`count_groups` when its ``stop`` callable says time is up."""


def device_groups(total: tuple[int, ...], parts: int, ok=None, stop=None):
    """Lazily yield the vector partitions of ``total`` into exactly ``parts`` parts.

    Each group is a tuple of block vectors in non-increasing lexicographic order (so
    every unordered multiset appears once).  ``ok(vec)`` filters pipelines.  The
    generation ends early (silently) once ``stop()`` returns true; it is polled every
    few hundred steps.
    """
    ok = ok or (lambda v: True)
    ticks = [0]

    def halted():
        ticks[0] += 1
        return stop is not None and ticks[0] % 256 == 0 and stop()

    def rec(rest, upper, k):
        if k == 1:  # the last part is what is left
            if any(rest) and rest <= upper and ok(rest):
                yield (rest,)
            return
        if sum(rest) < k:
            return
        for v in _sub_vectors(rest, upper):
            if halted():
                raise TimeUp
            if not ok(v):
                continue
            remaining = tuple(a - b for a, b in zip(rest, v))
            for tail in rec(remaining, v, k - 1):
                yield (v,) + tail

    if parts < 1:
        return
    try:
        yield from rec(tuple(total), tuple(total), parts)
    except TimeUp:
        return
    finally:
        rec = None      # noqa: F841 - ends the cycle rec -> its cell -> rec, so ``ok`` is let go at once


def count_groups(total: tuple[int, ...], parts: int, ok=None, limit: int | None = None,
                 stop=None) -> int:
    """Number of groups :func:`device_groups` yields, by memoised recursion.

    With ``limit`` the count saturates: any number above ``limit`` is returned as
    ``limit + 1`` (and the recursion stops summing there).  ``stop()`` is polled every
    few hundred steps; when it returns true :class:`TimeUp` is raised.
    """
    ok = ok or (lambda v: True)
    ok_cache: dict = {}
    cap = None if limit is None else limit + 1
    ticks = [0]

    def good(v):
        if v not in ok_cache:
            ok_cache[v] = ok(v)
        return ok_cache[v]

    @functools.lru_cache(maxsize=None)
    def rec(rest, upper, k):
        if k == 1:
            return 1 if any(rest) and rest <= upper and good(rest) else 0
        if sum(rest) < k:
            return 0
        n = 0
        for v in _sub_vectors(rest, upper):
            ticks[0] += 1
            if stop is not None and ticks[0] % 256 == 0 and stop():
                raise TimeUp
            if good(v):
                n += rec(tuple(a - b for a, b in zip(rest, v)), v, k - 1)
                if cap is not None and n >= cap:
                    return cap
        return n

    if parts < 1:
        return 0
    try:
        return rec(tuple(total), tuple(total), parts)
    finally:
        rec = None      # noqa: F841 - ends the cycle rec -> its cell -> rec, so ``ok`` is let go at once


@dataclass(frozen=True)
class StageGroup:
    """Ordered stages of one pipeline: ((device_type, devices), ...)."""

    stages: tuple[tuple[str, int], ...]

    @property
    def num_stages(self) -> int:
        return len(self.stages)


def _stage_sizes(d: int, max_stages: int) -> list[int]:
    sizes = {d}
    s = 1
    while s <= d:
        if d % s == 0:
            sizes.add(s)
        s *= 2
    return sorted(x for x in sizes if d // x <= max_stages)


def stage_groups(types, devices, num_layers: int, max_stages: int, orders=None) -> list[StageGroup]:
    """All stage device groups of a pipeline with ``devices[t]`` devices of ``types[t]``;
    with ``orders`` (tuples of the present types) only those type orders, else every one."""
    present = [(t, d) for t, d in zip(types, devices) if d]
    limit = min(num_layers, max_stages)
    result = []
    count = dict(present)
    perms = itertools.permutations(present) if orders is None else \
        [tuple((t, count[t]) for t in order) for order in orders]
    for perm in perms:
        # per type: (stage count, its stages) of each allowed stage size
        options = [[(d // s, ((t, s),) * (d // s)) for s in _stage_sizes(d, limit)] for t, d in perm]
        for choice in itertools.product(*options):
            if 1 <= sum(n for n, _ in choice) <= limit:
                result.append(StageGroup(tuple(itertools.chain.from_iterable(st for _, st in choice))))
    return result


def scale_groups(order, devices: dict, num_layers: int, max_stages: int) -> list[StageGroup]:
    """A few stage device groups of the type order ``order`` (``devices[t]`` devices of
    each): for k = 0, 1, ... every type's stages are of its largest allowed size that is
    at most ``devices[t] / 2^k`` (one stage per type, then about twice as many, ...),
    while the stage count stays within the limit: the samples by which
    :func:`eth.planner.pipeline.promising_orders` ranks type orders."""
    limit = min(num_layers, max_stages)
    sizes = {t: _stage_sizes(devices[t], limit) for t in order}
    out, k = [], 0
    while True:
        pick = {t: max([s for s in sizes[t] if s * 2 ** k <= devices[t]] or sizes[t][:1]) for t in order}
        stages = tuple((t, pick[t]) for t in order for _ in range(devices[t] // pick[t]))
        if len(stages) > limit:
            return out
        if not out or out[-1].stages != stages:
            out.append(StageGroup(stages))
        if all(pick[t] == sizes[t][0] for t in order):
            return out
        k += 1


def _granule(size: int, per_node: int) -> int:
    """Largest power of two dividing ``size`` and at most ``per_node``: every tp that
    may serve the stage (a power of two, tp | size, tp <= devices per node) divides it."""
    return min(size & -size, 1 << (per_node.bit_length() - 1))


def _take(free: dict, size: int, chunk: int) -> list[int] | None:
    """``size`` ranks as node-local runs of ``chunk`` ranks (nodes in cluster order, lowest
    free ranks first); None if the free ranks do not hold that many such runs."""
    if sum(len(f) // chunk for f in free.values()) * chunk < size:
        return None
    out = []
    for f in free.values():
        n = min(len(f) // chunk * chunk, size - len(out))
        out += f[:n]
        del f[:n]
        if len(out) == size:
            break
    return out


def assign_ranks(blocks: Blocks, pipelines) -> list[list[list[int]]]:
    """Concrete ranks: ``pipelines[i]`` is a list of (device_type, size) stages.

    Returns ranks[i][j] (list of global ranks of stage j of pipeline i).  Per type, the
    stages are placed by decreasing granule g (the largest power of two dividing the
    stage size, at most the devices per node) and then decreasing size (stable in
    pipeline, stage order).  A stage takes its ranks as node-local runs of g consecutive
    ranks (nodes in cluster order, lowest free ranks first), so the tp groups of any tp
    that may serve it (tp | g) stay inside one node; when the free ranks no longer hold
    such runs, the largest smaller power of two that fits is used (down to single
    ranks).  With power-of-two node and stage sizes this is the contiguous layout by
    decreasing size: a power-of-two stage starts at a multiple of its size and a
    pipeline takes whole nodes where its size allows.  Without node information
    (``blocks.nodes`` empty) stages are laid out contiguously by decreasing size.
    """
    out = [[None] * len(p) for p in pipelines]
    for k, (t, type_ranks) in enumerate(zip(blocks.types, blocks.ranks)):
        items = [(s, i, j) for i, p in enumerate(pipelines) for j, (tt, s) in enumerate(p) if tt == t]
        if not blocks.nodes:
            items.sort(key=lambda x: (-x[0], x[1], x[2]))
            cursor = 0
            for s, i, j in items:
                out[i][j] = list(type_ranks[cursor:cursor + s])
                cursor += s
            continue
        free: dict = {}
        for r, node in zip(type_ranks, blocks.nodes[k]):
            free.setdefault(node, []).append(r)
        per_node = min(len(f) for f in free.values())
        items.sort(key=lambda x: (-_granule(x[0], per_node), -x[0], x[1], x[2]))
        for s, i, j in items:
            chunk = _granule(s, per_node)
            while (got := _take(free, s, chunk)) is None:
                chunk //= 2
                if not chunk:
                    raise ValueError(f"stages need more than the {len(type_ranks)} devices of type {t}")
            out[i][j] = got
    return out


def pipeline_ranks(blocks: Blocks, stages, memo: dict) -> tuple[tuple[int, ...], ...]:
    """``assign_ranks(blocks, [stages])[0]`` (one pipeline alone) as tuples, assembled type
    by type: a type's stages take that type's ranks whatever the other types' stages are,
    so each type's placement is memoised in ``memo`` by the sizes of its stages in order
    (the stage groups of a pipeline share a few such placements)."""
    sizes: dict = {}
    for t, n in stages:
        sizes.setdefault(t, []).append(n)
    placed = {}
    for t, ns in sizes.items():
        key = (blocks, t, tuple(ns))
        hit = memo.get(key)
        if hit is None:
            hit = memo[key] = tuple(tuple(r) for r in assign_ranks(blocks, [[(t, n) for n in ns]])[0])
        placed[t] = iter(hit)
    return tuple(next(placed[t]) for t, _ in stages)


def tp_groups_in_nodes(cluster: Cluster, ranks, tp: int) -> bool:
    """True if every tp group of a stage (``ranks[k * tp:(k + 1) * tp]``, the plan's
    layout) lies inside one node."""
    dev = cluster.devices
    return all(len({dev[r].node for r in ranks[k:k + tp]}) == 1 for k in range(0, len(ranks), tp))


def plan_tp_in_nodes(plan) -> bool:
    """:func:`tp_groups_in_nodes` for every stage of a plan."""
    return all(tp_groups_in_nodes(plan.cluster, st.ranks, st.tp) for p in plan.pipelines for st in p.stages)
