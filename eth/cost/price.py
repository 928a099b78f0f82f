"""What a plan costs per hour: the devices it uses and the bytes it sends between zones.

    cost_per_hour = sum over the plan's devices of their price_per_hour
                  + egress USD per iteration x iterations per hour

Egress (bytes that cross from one zone to another in one iteration, each at the price of
its pair of zones, ``eth.spec.cluster.Cluster.zone_link``):

- stage boundaries: where a stage and the next lie in different zones (or either spans
  zones), the activations of the pipeline's Lbs samples forward and their gradients back,
  seq x hidden x the weight dtype's bytes per sample each way, at the dearest pair of the
  two stages' zones;
- gradient blocks: every collective of the block-wise All-Reduce over ranks in z >= 2
  zones (``eth.cost.sync.group_sync_bytes``: B bytes over n ranks) runs as a ring ordered
  by zone, which crosses zones on z of its edges; a ring All-Reduce sends 2 (n - 1) / n x B
  over each edge (ZeRO's reduce-scatter + all-gather: (n - 1) / n x their bytes); edge k
  from zone z_k to z_k+1 pays that pair's price.

Tensor-parallel collectives stay inside a node (the planner puts tp groups in one node),
so inside one zone.
"""
from __future__ import annotations

from eth.cost.sync import group_sync_bytes


def egress_usd_per_iteration(plan) -> float:
    """USD of the bytes ``plan`` sends between zones in one iteration (module docstring)."""
    cluster = plan.cluster
    if len(set(cluster.zones)) < 2:
        return 0.0
    usd = 0.0
    per_sample = plan.model.seq_len * plan.model.hidden * plan.training.weight_bytes
    for pipe in plan.pipelines:
        for a, b in zip(pipe.stages, pipe.stages[1:]):
            za = {cluster.zone_of(r) for r in a.ranks}
            zb = {cluster.zone_of(r) for r in b.ranks}
            if za == zb and len(za) == 1:
                continue
            price = max((cluster.zone_link(x, y)[1] for x in za for y in zb if x != y), default=0.0)
            usd += 2 * pipe.lbs * per_sample / 1e9 * price
    twice = 2 if plan.training.zero_stage == 0 else 1
    for ranks, size in group_sync_bytes(plan, plan.training).items():
        zones = sorted({cluster.zone_of(r) for r in ranks})
        if len(zones) < 2:
            continue
        n = len(ranks)
        per_edge = twice * (n - 1) / n * size / 1e9
        usd += sum(per_edge * cluster.zone_link(a, b)[1] for a, b in zip(zones, zones[1:] + zones[:1]))
    return usd


def plan_rates(plan) -> dict:
    """``samples_per_s`` of ``plan`` at its predicted iteration time and, where every device
    has a price, ``cost_per_hour`` (devices + egress, USD), its ``egress_per_hour`` and
    ``usd_per_sample``: the fields :func:`eth.planner.job.plan_job` records in
    ``plan.predicted``."""
    iteration_ms = plan.predicted["iteration_ms"]
    rates = {"samples_per_s": round(plan.gbs * 1e3 / iteration_ms, 6)}
    if plan.cluster.unpriced_types():
        return rates
    egress = egress_usd_per_iteration(plan) * 3.6e6 / iteration_ms
    total = plan.cluster.devices_per_hour_usd() + egress
    return rates | {"cost_per_hour": round(total, 6), "egress_per_hour": round(egress, 6),
                    "usd_per_sample": total / 3600 / rates["samples_per_s"]}
