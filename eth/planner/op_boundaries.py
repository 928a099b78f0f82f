"""Stage boundaries inside layers (plan version 2): after the search, op by op.

The search places whole layers.  With ``SearchOptions.op_boundaries`` its best plan is
then refined: in every pipeline, each boundary between two adjacent stages may move to
any op position within one layer either side of where it is (op i of layer l at
position l * k + i; each stage keeps at least one op), and the position that gives the
pipeline the earliest end time (Eq. 5 at its Lbs, the All-Reduce times of the plan as
searched, every stage within its memory) is taken; rounds over the boundaries repeat
until none moves.  The batch is then allocated again over the pipelines' new end-time
lines (Eq. 2-4, :func:`eth.planner.allocate.allocate`), and the refined plan is kept
only if the whole-plan evaluation (:meth:`eth.cost.model.CostModel.evaluate`) is faster
than the plan as searched.  A boundary that would carry the qkv output of a stage whose
tp exceeds the model's kv_heads is not tried (the plan format refuses it).

A stage's recompute counts (``recompute[op] = n``: the first n of its layers that run
op) are kept, capped at the layers that run op after the move.
"""
from __future__ import annotations

import math
from dataclasses import replace

from eth.errors import SpecError
from eth.planner.allocate import allocate, pipeline_line
from eth.spec.model import cut_tensors, layer_ops
from eth.spec.plan import PipelinePlan, StagePlan


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

        stages = list(pipe.stages)
        best = end_ms(stages)
        for _ in range(4 * len(stages)):
            moved = False
            for j in range(len(stages) - 1):
                a, cut = stages[j].span(spec)
                b = stages[j + 1].span(spec)[1]
                choice = None
                for pos in range(max(cut - k, a + 1), min(cut + k, b - 1) + 1):
                    if pos == cut or (_carries_qkv(spec, pos) and max(stages[j].tp, stages[j + 1].tp) > spec.kv_heads):
                        continue
                    trial = stages[:j] + [respan(stages[j], spec, a, pos), respan(stages[j + 1], spec, pos, b)] + stages[j + 2:]
                    t = end_ms(trial)
                    if t < best * (1 - 1e-9):
                        best, choice = t, trial
                if choice is not None:
                    stages, moved, moves = choice, True, moves + 1
            if not moved:
                break
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
