"""Stage boundaries inside layers (plan version 2): after the search, op by op.

The search places whole layers.  With ``SearchOptions.op_boundaries`` (``--op-boundaries``)
:func:`refine_search` refines its best plan, the polished groups' plans close to it and
deeper variants of it (:func:`deeper`: tp or dp stages as pipeline stages), in order of a
floor (:func:`balanced_floor`).  :func:`refine_boundaries` refines one plan, each
pipeline in two ways, keeping the faster:

* Aceso-style moves from its own split: the bottleneck stage (largest forward + backward
  time) sheds up to one layer's ops, op by op, to either neighbour (op i of layer l at
  position l * k + i; each stage keeps one op at least), taking the boundary position
  that gives the pipeline the earliest end time (Eq. 5 at its Lbs, the All-Reduce times
  of the plan as given, every stage within its memory), in rounds until no move helps;
* :func:`minmax_partition` of all the model's ops over its stages (bisection on the
  slowest stage's time with a greedy fill), then the same moves.

Every stage a move or the partition changes gets its recompute fitted again
(:func:`fit_recompute`: none if that fits, else the faster of its counts before the move
-- ``recompute[op] = n``, the first n of the stage's layers that run op, capped at those
after it -- and the least recompute that fits by the search's run order).  The batch is
then allocated again over the pipelines' new end-time lines (Eq. 2-4,
:func:`eth.planner.allocate.allocate`), and the refined plan is kept only if the
whole-plan evaluation (:meth:`eth.cost.model.CostModel.evaluate`) is faster.  A boundary
that would carry the qkv output of a stage whose tp exceeds the model's kv_heads is not
tried (the plan format refuses it).
"""
from __future__ import annotations

import math
from dataclasses import replace

from eth.errors import SpecError
from eth.planner.allocate import allocate, pipeline_line
from eth.planner.evaluate import Evaluator
from eth.spec.model import cut_tensors, layer_ops
from eth.spec.plan import PipelinePlan, StagePlan


OP_BOUNDARY_MARGIN = 1.10
"""``--op-boundaries`` refines the polished groups whose whole-layer plan is within 10% of
the best one's (on Aceso's 1.3B / 4 V100 profiles the best split inside layers comes from
a group 5% behind with whole layers)."""
OP_BOUNDARY_VARIANTS = 2
"""... and the best plan's deeper variants with the lowest floors, this many (on Aceso's
13B / 32 V100 profiles the best is the lowest floor's; each refinement of a deep
pipeline takes about a second there)."""


def refine_search(search, plan):
    """``--op-boundaries`` at the end of :class:`eth.planner.search.HPPSearch`: ``plan``
    (the search's choice, :meth:`eth.planner.search.HPPSearch.final_choice`), the polished groups' plans within :data:`OP_BOUNDARY_MARGIN` of
    it, and the :data:`OP_BOUNDARY_VARIANTS` deeper variants of ``plan`` with the lowest
    floors (:func:`deeper`); after ``plan`` the others by ascending
    :func:`balanced_floor`, skipping those whose floor is not below the best time so far,
    each refined (:func:`refine_boundaries`; a group or a pipeline depth whose whole-layer
    split is slower may hold the better split inside layers).  The fastest, with its
    record for plan.search (``candidates``: how many were refined)."""
    opt, cost = search.opt, search.cost
    best_ms = cost.evaluate(plan)["iteration_ms"]
    others = [c.plan for c in sorted(search.top, key=lambda c: c.iteration_ms)
              if c.plan is not plan and c.iteration_ms <= best_ms * OP_BOUNDARY_MARGIN]
    seen, variants = {p.content_hash() for p in [plan] + others}, []
    for v in deeper(plan):
        if v.content_hash() not in seen:
            seen.add(v.content_hash())
            variants.append(v)
    floors = {id(p): balanced_floor(p, cost) for p in others + variants}
    others += sorted(variants, key=lambda p: floors[id(p)])[:OP_BOUNDARY_VARIANTS]
    best, after, moves, tried = plan, best_ms, 0, 0
    for candidate in [plan] + sorted(others, key=lambda p: floors[id(p)]):
        if search.out_of_time() and tried:
            break
        if tried and floors[id(candidate)] >= after:
            continue
        tried += 1
        got, rec = refine_boundaries(candidate, cost, opt.gbs, opt.allow_overshoot)
        if rec["kept"] and rec["after_ms"] < after * (1 - 1e-9):
            best, after, moves = got, rec["after_ms"], rec["moves"]
    return best, {"before_ms": round(best_ms, 4), "after_ms": round(after, 4), "moves": moves,
                  "kept": best is not plan, "candidates": tried}


def respan(stage: StagePlan, spec, a: int, b: int) -> StagePlan:
    """``stage`` holding the ops [a, b) (positions), recompute counts capped."""
    names = layer_ops(spec)
    k = len(names)
    layers = (a // k, (b - 1) // k + 1)
    ops = None if a % k == 0 and b % k == 0 else (names[a % k], names[(b - 1) % k])
    moved = replace(stage, layers=layers, ops=ops, recompute={}, predicted={})
    moved.recompute = {op: min(n, len([layer for layer in range(*layers) if op in moved.held_ops(spec, layer)]))
                       for op, n in stage.recompute.items()}
    moved.recompute = {op: n for op, n in moved.recompute.items() if n > 0}
    return moved


def fit_recompute(cost, order, pipe: PipelinePlan, j: int) -> StagePlan | None:
    """Stage j of ``pipe`` with the faster of its own recompute (if it fits) and the least
    recompute that fits by the search's rule (``Evaluator.recompute_order``: runs of ops
    taken whole, each in the fewest of the stage's layers that run it); None if neither
    fits."""
    spec, stages = cost.model, pipe.stages
    st = stages[j]
    nmb = max(pipe.lbs // pipe.mbs, 1)

    def stage_cost(recompute):
        return cost.stage_cost(st.device_type, st.tp, st.dp, tuple(st.layers), pipe.mbs, recompute, j,
                               len(stages), nmb, st.ranks, stages[j + 1].ranks if j + 1 < len(stages) else None,
                               stages[j - 1].ranks if j > 0 else None, st.ops)

    held = [st.held_ops(spec, layer) for layer in range(*st.layers)]
    counts = {op: sum(op in h for h in held) for op in layer_ops(spec)}
    runs_in = counts.__getitem__

    if stage_cost({}).fits:            # recompute only adds time
        return replace(st, recompute={})
    options = []
    own = stage_cost(st.recompute)
    if own.fits:
        options.append((own.total_ms, st.recompute))
    chosen: dict[str, int] = {}
    for run in order(st.device_type, pipe.mbs // st.dp, st.tp):
        most = max(runs_in(op) for op in run)
        if not most:
            continue
        chosen.update((op, runs_in(op)) for op in run)
        if stage_cost(chosen).fits:
            lo, hi = 0, most
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if stage_cost(chosen | {op: min(mid, runs_in(op)) for op in run}).fits:
                    hi = mid
                else:
                    lo = mid
            chosen.update((op, min(hi, runs_in(op))) for op in run)
            break
    if stage_cost(chosen).fits:
        options.append((stage_cost(chosen).total_ms, dict(chosen)))
    if not options:
        return None
    return replace(st, recompute={op: n for op, n in min(options, key=lambda o: o[0])[1].items() if n > 0})


def minmax_partition(cost, order, pipe: PipelinePlan, spec, steps: int = 10) -> list[StagePlan] | None:
    """The stages of ``pipe`` (devices, tp, dp kept) over a partition of all the model's
    ops that makes the slowest stage (forward + backward, recompute fitted to memory) as
    fast as the bisection on that time finds in ``steps`` halvings: for a time T the
    stages take, in order, as many ops as keep them within T and their memory (the
    greedy of min-max contiguous partitioning); None if the current time is not met."""
    names = layer_ops(spec)
    n_ops, stages = spec.num_layers * len(names), list(pipe.stages)
    count = len(stages)
    memo: dict = {}

    def stage(j, a, b):
        key = (j, a, b)
        if key not in memo:
            trial = stages[:j] + [respan(stages[j], spec, a, b)] + stages[j + 1:]
            fitted = fit_recompute(cost, order, PipelinePlan(pipe.mbs, pipe.lbs, trial), j)
            if fitted is None:
                memo[key] = (math.inf, None)
            else:
                trial[j] = fitted
                c = cost.pipeline_costs(PipelinePlan(pipe.mbs, pipe.lbs, trial))[j]
                memo[key] = (c.total_ms, fitted)
        return memo[key]

    def blocked(j, a, b):   # a boundary at a or b the stage's tp cannot carry
        tp = stages[j].tp
        return tp > spec.kv_heads and any(0 < p < n_ops and _carries_qkv(spec, p) for p in (a, b))

    def partition(limit):
        out, a = [], 0
        for j in range(count):
            if j == count - 1:
                t, st = stage(j, a, n_ops)
                return out + [st] if t <= limit and not blocked(j, a, n_ops) else None
            lo, hi = a, n_ops - (count - 1 - j)     # the largest end b in (a, hi] within limit
            if stage(j, a, a + 1)[0] > limit:
                return None
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if stage(j, a, mid)[0] <= limit:
                    lo = mid
                else:
                    hi = mid
            b = hi if stage(j, a, hi)[0] <= limit else lo
            while b > a + 1 and blocked(j, a, b):
                b -= 1
            if b <= a or stage(j, a, b)[0] > limit:
                return None
            out.append(stage(j, a, b)[1])
            a = b
        return None

    costs = cost.pipeline_costs(pipe)
    current = max(c.total_ms for c in costs) if all(c.fits for c in costs) else sum(c.total_ms for c in costs)
    best = partition(current)
    if best is None:
        return None
    lo, hi = max(c.total_ms for c in costs) / count, current
    for _ in range(steps):
        mid = (lo + hi) / 2
        got = partition(mid)
        if got is None:
            lo = mid
        else:
            best, hi = got, mid
    return best


def balanced_floor(plan, cost) -> float:
    """About the least iteration time a partition of ``plan``'s ops over its stages can
    reach, for pipelines whose stages are alike (one device type, tp and dp): Eq. 5's end
    of the first stage is at least the sum T of the stages' forward + backward times (the
    fill and the drain) plus Lbs / Mbs - 1 times the slowest stage, itself at least T / S
    and at least the first (last) stage holding the embedding (head) and one layer op (T as
    at the plan's split; moving ops changes it only by the boundary's messages and
    recompute, which add).  0 where a pipeline's stages differ (a faster stage could take
    more)."""
    spec = plan.model
    n_ops = spec.num_layers * len(layer_ops(spec))
    floor = 0.0
    for p in plan.pipelines:
        if len({(st.device_type, st.tp, st.dp) for st in p.stages}) > 1:
            return 0.0
        total = sum(c.total_ms for c in cost.pipeline_costs(p))
        slowest = total / len(p.stages)
        if len(p.stages) > 1:   # the first stage holds the embedding, the last the head: one op at least
            ends = list(p.stages)
            ends[0], ends[-1] = respan(ends[0], spec, 0, 1), respan(ends[-1], spec, n_ops - 1, n_ops)
            costs = cost.pipeline_costs(PipelinePlan(p.mbs, p.lbs, ends))
            slowest = max(slowest, costs[0].total_ms, costs[-1].total_ms)
        floor = max(floor, total + (p.lbs // p.mbs - 1) * slowest)
    return floor


def _split(st: StagePlan, by_tp: bool, by_dp: bool) -> list[StagePlan]:
    """``st`` as several stages: one per tp rank (``by_tp``: tp 1, the stage's dp; the
    ranks of that tp rank in every replica) and / or one per replica (``by_dp``: dp 1)."""
    reps = [st.replica(d) for d in range(st.dp)]
    tps = range(st.tp) if by_tp else [None]
    dps = range(st.dp) if by_dp else [None]
    out = []
    for t in tps:
        for d in dps:
            ranks = [r for dd, rep in enumerate(reps) if d in (None, dd)
                     for tt, r in enumerate(rep) if t in (None, tt)]
            out.append(replace(st, ranks=ranks, tp=1 if by_tp else st.tp, dp=1 if by_dp else st.dp,
                               recompute={}, predicted={}, ops=None))
    return out


def deeper(plan) -> list:
    """Variants of ``plan`` with deeper pipelines: every stage of tp t > 1 as t stages of
    tp 1, every stage of dp d > 1 as d stages of dp 1, or both (:func:`_split`), at the
    pipeline's micro-batch size and each halving of it that the new stages' dp divides,
    the ops split evenly over the stages (:func:`refine_boundaries` then partitions
    them): a split inside layers can balance a deeper pipeline that whole layers could
    not."""
    spec = plan.model
    total = spec.num_layers * len(layer_ops(spec))
    out = []
    for by_tp, by_dp in ((False, True), (True, False), (True, True)):
        if not any((by_tp and st.tp > 1) or (by_dp and st.dp > 1) for p in plan.pipelines for st in p.stages):
            continue
        for halvings in range(max(p.mbs for p in plan.pipelines).bit_length()):
            pipes = []
            for p in plan.pipelines:
                split = [new for st in p.stages for new in _split(st, by_tp, by_dp)]
                mbs = max(p.mbs >> halvings, 1)
                if len(split) > total or any(mbs % st.dp for st in split):
                    break
                bounds = [round(i * total / len(split)) for i in range(len(split) + 1)]
                stages = [respan(st, spec, a, b) for st, a, b in zip(split, bounds, bounds[1:])]
                pipes.append(PipelinePlan(mbs, max(p.lbs // mbs, 1) * mbs, stages))
            else:
                out.append(replace(plan, pipelines=pipes, predicted={}))
    return out


def _carries_qkv(spec, position: int) -> bool:
    names = layer_ops(spec)
    k = position % len(names)
    return bool(k) and any(t.name in ("qkv", "qkv_r") for t in cut_tensors(spec, names[k - 1]))


def refine_boundaries(plan, cost, gbs: int, allow_overshoot: bool = False):
    """(plan, record): ``plan`` with its boundaries moved inside layers where that makes
    it faster (module docstring), else ``plan`` itself; ``record`` for plan.search."""
    spec, world = plan.model, plan.world_size
    k = len(layer_ops(spec))
    before = cost.evaluate(plan)["iteration_ms"]
    order = Evaluator(cost).recompute_order
    ar = cost.stage_allreduce_ms(plan.pipelines)
    moves, pipes = 0, []
    for i, pipe in enumerate(plan.pipelines):
        def end_ms(stages):
            trial = PipelinePlan(pipe.mbs, pipe.lbs, stages)
            try:
                costs = cost.pipeline_costs(trial)
            except SpecError:
                return math.inf
            if not all(c.fits for c in costs):
                return math.inf
            return max(cost.stage_end_ms(trial, costs, ar[i], world))

        def move(stages, j, pos):
            """``stages`` with the boundary after stage j at ``pos``, the two stages'
            recompute refitted (:func:`fit_recompute`), or None if one does not fit."""
            a, b = stages[j].span(spec), stages[j + 1].span(spec)
            out = stages[:j] + [respan(stages[j], spec, a[0], pos), respan(stages[j + 1], spec, pos, b[1])] + stages[j + 2:]
            for m in (j, j + 1):
                fitted = fit_recompute(cost, order, PipelinePlan(pipe.mbs, pipe.lbs, out), m)
                if fitted is None:
                    return None
                out[m] = fitted
            return out

        def local(stages):
            """Aceso-style moves from ``stages``: (stages, end ms, moves)."""
            best, moves = end_ms(stages), 0
            for _ in range(8 * len(stages)):
                # the bottleneck stage sheds up to one layer's ops to either neighbour
                totals = [c.total_ms for c in cost.pipeline_costs(PipelinePlan(pipe.mbs, pipe.lbs, stages))]
                j = max(range(len(stages)), key=totals.__getitem__)
                a, b = stages[j].span(spec)
                tries = []
                if j > 0:
                    tries += [(j - 1, pos) for pos in range(a + 1, min(a + k, b - 1) + 1)]
                if j + 1 < len(stages):
                    tries += [(j, pos) for pos in range(max(b - k, a + 1), b)]
                choice = None
                for left, pos in tries:
                    if _carries_qkv(spec, pos) and max(stages[left].tp, stages[left + 1].tp) > spec.kv_heads:
                        continue
                    trial = move(stages, left, pos)
                    if trial is None:
                        continue
                    t = end_ms(trial)
                    if t < best * (1 - 1e-9):
                        best, choice = t, trial
                if choice is None:
                    break
                stages, moves = choice, moves + 1
            return stages, best, moves

        original = list(pipe.stages)
        results = [local(original)]
        balanced = minmax_partition(cost, order, pipe, spec)
        if balanced is not None:
            results.append(local(balanced))
        stages, _, n = min(results, key=lambda r: r[1])
        if stages != original:
            moves += max(n, 1)
        pipes.append(PipelinePlan(pipe.mbs, pipe.lbs, stages))
    record = {"before_ms": round(before, 4), "after_ms": round(before, 4), "moves": moves, "kept": False}
    if not moves:
        return plan, record
    ar = cost.stage_allreduce_ms(pipes)
    lines = [pipeline_line(cost.pipeline_costs(q), q.mbs, ar[i]) for i, q in enumerate(pipes)]
    alloc = allocate(lines, [q.mbs for q in pipes], gbs, allow_overshoot)
    if alloc is None:
        return plan, record
    for q, lbs in zip(pipes, alloc.lbs):
        q.lbs = lbs
    refined = replace(plan, pipelines=pipes, predicted={})
    try:
        refined.validate()
    except SpecError:
        return plan, record
    after = cost.evaluate(refined)
    if not after["feasible"] or after["iteration_ms"] >= before * (1 - 1e-9):
        return plan, record
    record.update(after_ms=round(after["iteration_ms"], 4), kept=True)
    return refined, record
