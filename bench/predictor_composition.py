"""The cost model's composition checked apart from its op times (bench/predictor_accuracy.py).

A predicted iteration is op times (the profile) composed by the cost model: Eq. 5's
pipeline fill, steady state and drain, the stage-boundary p2p, the gradient sync, the
optimizer step and the rest of the training step.  On this shared 2-core host the op
times move by tens of percent between a profile and a run taken minutes apart (the
bench's host drift; ``bench/profile_repeatability.py``), which hides how good the
composition is.  :func:`iteration_from_compute` therefore feeds the same composition with
each stage's compute as the runtime measured it in the run (``schedule.ComputeClock``
per rank, the slowest rank of the stage): every stage's own forward and backward time is
scaled by measured / predicted compute, the rest of the prediction is left as it is.  Its
error against the measured iteration is what the cost model gets wrong when the op times
are right; the raw error minus it is the op times' share.
"""
from __future__ import annotations

from dataclasses import replace


def stage_scales(plan, costs, rank_compute_ms) -> list[list[float]]:
    """For every stage of every pipeline: measured / predicted compute of one step on the
    stage's slowest rank (predicted: micro-batches x the stage's forward + backward without
    its tp collectives and p2p, as the runtime's ComputeClock counts it)."""
    out = []
    for p, pcosts in zip(plan.pipelines, costs):
        m = p.lbs // p.mbs
        out.append([max(rank_compute_ms[r] for r in st.ranks) / (m * (c.fwd_ms + c.bwd_ms - c.comm_ms))
                    for st, c in zip(p.stages, pcosts)])
    return out


def _scaled(c, k: float):
    """Stage cost ``c`` with its own compute (fwd + bwd - comm) times ``k``, its tp
    collectives and p2p unchanged: both directions grow by the same share of their time."""
    grow = (k - 1) * (c.fwd_ms + c.bwd_ms - c.comm_ms) / c.total_ms
    return replace(c, fwd_ms=c.fwd_ms * (1 + grow), bwd_ms=c.bwd_ms * (1 + grow),
                   recompute_ms=c.recompute_ms * k)


def iteration_from_compute(plan, db, rank_compute_ms) -> dict:
    """{"iteration_ms", "scales"}: the cost model's iteration time (as
    ``CostModel.evaluate``: max over pipelines and stages of ``CostModel.stage_end_ms``)
    with every stage's compute set to what its slowest rank measured
    (``rank_compute_ms[r]``: rank r's compute ms of one step)."""
    from eth.cost.model import CostModel

    db.ensure(plan.model, plan.cluster.types.values())
    cm = CostModel(plan.model, plan.cluster, db, plan.training)
    ar = cm.stage_allreduce_ms(plan.pipelines)
    costs = [cm.pipeline_costs(p) for p in plan.pipelines]
    scales = stage_scales(plan, costs, rank_compute_ms)
    iteration = 0.0
    for p, pcosts, ks, ar_p in zip(plan.pipelines, costs, scales, ar):
        ends = cm.stage_end_ms(p, [_scaled(c, k) for c, k in zip(pcosts, ks)], ar_p, plan.world_size)
        iteration = max(iteration, max(ends))
    return {"iteration_ms": iteration, "scales": scales}


def composition_rows(name, pred, meas, composed) -> list[str]:
    """One row of the composition table: measured iteration, the raw prediction and its
    error, the prediction from the run's own compute and its error, the stage scales."""
    it = meas["iteration_ms"]
    scales = "; ".join(f"p{i} " + " ".join(f"{k:.2f}" for k in ks) for i, ks in enumerate(composed["scales"]))
    return [f"| {name} | {it:.1f} | {pred['iteration_ms']:.1f} ({pred['iteration_ms'] / it - 1:+.1%}) | "
            f"{composed['iteration_ms']:.1f} ({composed['iteration_ms'] / it - 1:+.1%}) | {scales} |"]


COMPOSITION_HEADER = [
    "| config | measured iteration ms | predicted from the profile (err) | predicted from the run's compute (err) "
    "| measured / predicted compute per stage |",
    "|---|---|---|---|---|"]
