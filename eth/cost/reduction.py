"""Gradient blocks reduced concurrently, as the runtime's collectives run them.

The runtime launches one asynchronous collective per set of stages that hold a block of
gradients (``megatron.hpp.distributed.grad_sync``), so a block starts as soon as all its
holders, in every pipeline, have finished their last backward, whatever other blocks are
in flight, and the blocks in flight share each holder's link.  A block at full speed
takes its lowest-tp holder's Eq. 6 time (:class:`eth.cost.sync.SyncBlock`) and uses, on
each holder's link, the fraction holder time / block time; the links' capacity is shared
max-min fairly among the blocks in flight (:func:`fair_rates`, recomputed whenever a
block starts or ends).  The event simulator (``eth.report.simulate``) plays its
reduction with :func:`reduce_blocks`; :func:`simulated_iteration_ms` is its iteration
without the timeline, which the planner's finalists are re-scored by.
"""
from __future__ import annotations

from collections.abc import Sequence

from eth.cost.sync import SyncBlock


def reduce_blocks(blocks: Sequence[SyncBlock], last_bwd: dict) -> tuple[dict, list[float], list[float]]:
    """Play the reduction of ``blocks`` after the last backwards ``last_bwd``
    ((pipeline, stage) -> ms).  Returns (each stage -> when its last block is reduced,
    its last backward where it holds none; each block's start; each block's end).

    Time advances from one happening to the next (a block becomes ready, a block
    finishes); in between every block in flight progresses at the rate
    :func:`fair_rates` gives it, as a fraction of its full-speed duration."""
    done = dict(last_bwd)
    ready = [max(last_bwd[h] for h in b.holders) for b in blocks]
    waiting = sorted(range(len(blocks)), key=lambda k: (ready[k], k))
    left: dict[int, float] = {}          # block in flight -> full-speed ms still to go
    finish = list(ready)
    now, nxt = 0.0, 0
    while nxt < len(waiting) or left:
        if not left:
            now = max(now, ready[waiting[nxt]])
        while nxt < len(waiting) and ready[waiting[nxt]] <= now:
            k = waiting[nxt]
            nxt += 1
            if blocks[k].duration_ms > 0:
                left[k] = blocks[k].duration_ms
        if not left:
            continue
        rates = fair_rates({k: blocks[k] for k in left})
        step = min(left[k] / rates[k] for k in left)
        if nxt < len(waiting):
            step = min(step, ready[waiting[nxt]] - now)
        now += step
        for k in list(left):
            left[k] -= rates[k] * step
            if left[k] <= 1e-9 * blocks[k].duration_ms:
                finish[k] = now
                del left[k]
    for k, b in enumerate(blocks):
        if b.duration_ms > 0:
            for h in b.holders:
                done[h] = max(done[h], finish[k])
    return done, ready, finish


def fair_rates(active: dict) -> dict:
    """Max-min fair speeds (fractions of full speed, <= 1) of the blocks in flight.

    A block k at speed x uses x * holder_ms / duration_ms of each holder's link (its
    lowest-tp holder's whole link at full speed).  Progressive filling: all unfrozen
    blocks speed up together until a link is full; the blocks on that link keep that
    speed; repeat with the rest."""
    use = {k: {h: ms / b.duration_ms for h, ms in zip(b.holders, b.holder_ms) if ms > 0}
           for k, b in active.items()}
    rates, load, open_ = {}, {}, set(active)
    while open_:
        demand: dict = {}
        for k in open_:
            for h, a in use[k].items():
                demand[h] = demand.get(h, 0.0) + a
        level, tight = 1.0, None
        for h, d in sorted(demand.items()):
            x = (1.0 - load.get(h, 0.0)) / d
            if x < level:
                level, tight = x, h
        if tight is None:
            rates.update({k: 1.0 for k in open_})
            break
        for k in sorted(k for k in open_ if tight in use[k]):
            rates[k] = level
            open_.discard(k)
            for h, a in use[k].items():
                load[h] = load.get(h, 0.0) + level * a
    return rates


def simulated_iteration_ms(plan, cost_model) -> float:
    """The event simulator's iteration of ``plan`` (``eth.report.simulate.simulate``)
    without its timeline: the 1F1B phase from
    :meth:`eth.cost.model.CostModel.backward_end_ms` (the op-by-op recurrence of the same
    schedule, dependencies and links the simulator plays; tests/test_simulate.py checks
    that they agree), then :func:`reduce_blocks` and each stage's step after it
    (:meth:`eth.cost.model.CostModel.step_after_sync_ms`).  A fraction of the
    simulator's cost: the planner's finalists are re-scored by it."""
    last_bwd, steps = {}, {}
    world = plan.world_size
    for i, p in enumerate(plan.pipelines):
        costs = cost_model.pipeline_costs(p)
        for j, (st, c, end) in enumerate(zip(p.stages, costs, cost_model.backward_end_ms(costs, p.lbs, p.mbs))):
            last_bwd[(i, j)] = end
            steps[(i, j)] = cost_model.step_after_sync_ms(p, st, c, world)
    done, _, _ = reduce_blocks(cost_model.sync_blocks(plan.pipelines), last_bwd)
    return max(t + steps[key] for key, t in done.items())
