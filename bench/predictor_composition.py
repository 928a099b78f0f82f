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
    """{"iteration_ms", "eq5_ms", "simulated_ms", "scales"}: the cost model's iteration
    time by its objective (``CostModel.evaluate``, gradient blocks), by the paper's Eq. 5
    (``objective="eq5"``) and by the event simulator (``eth.report.simulate``), each with
    every stage's compute set to what its slowest rank measured (``rank_compute_ms[r]``:
    rank r's compute ms of one step)."""
    from eth.cost.model import CostModel
    from eth.report.simulate import simulate

    db.ensure(plan.model, plan.cluster.types.values())
    out = {}
    for objective in ("blocks", "eq5"):
        cm = CostModel(plan.model, plan.cluster, db, plan.training, objective=objective)
        costs = [cm.pipeline_costs(p) for p in plan.pipelines]
        scales = stage_scales(plan, costs, rank_compute_ms)
        measured = {id(p): [_scaled(c, k) for c, k in zip(pcosts, ks)]
                    for p, pcosts, ks in zip(plan.pipelines, costs, scales)}
        # the same model with each pipeline's stage costs as the run measured them
        cm.pipeline_costs = lambda p, measured=measured: list(measured[id(p)])
        out["iteration_ms" if objective == "blocks" else "eq5_ms"] = cm.evaluate(plan)["iteration_ms"]
        if objective == "blocks":
            out["simulated_ms"] = simulate(plan, cm).iteration_ms
    return dict(out, scales=scales)


def composition_rows(name, pred, meas, composed) -> list[str]:
    """One row of the composition table: measured iteration, the raw prediction and its
    error, from the run's own compute the objective's, Eq. 5's and the simulator's
    iteration and their errors, the stage scales."""
    it = meas["iteration_ms"]
    scales = "; ".join(f"p{i} " + " ".join(f"{k:.2f}" for k in ks) for i, ks in enumerate(composed["scales"]))
    cells = " | ".join(f"{composed[k]:.1f} ({composed[k] / it - 1:+.1%})"
                       for k in ("iteration_ms", "simulated_ms", "eq5_ms"))
    return [f"| {name} | {it:.1f} | {pred['iteration_ms']:.1f} ({pred['iteration_ms'] / it - 1:+.1%}) | "
            f"{cells} | {scales} |"]


COMPOSITION_HEADER = [
    "| config | measured iteration ms | predicted from the profile (err) | from the run's compute: objective (err) "
    "| simulated (err) | Eq. 5 (err) | measured / predicted compute per stage |",
    "|---|---|---|---|---|---|---|"]
