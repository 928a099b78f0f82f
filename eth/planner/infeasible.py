"""Why an HPP search has no plan: the one-line reasons of :class:`eth.planner.search.HPPSearch`
(a device type that cannot hold one layer, a model larger than the cluster, a time limit
reached before any group, or the reasons counted over the evaluated groups)."""
from __future__ import annotations


def type_too_small(search) -> str | None:
    """The one-line reason when a device type cannot hold even one layer's model states
    (weights, gradients, optimizer states; activations and reserved memory left out, so
    this is a lower bound of every stage's memory): all its devices as one stage at its
    largest tp, ZeRO-sharded over all its replicas.  Every device takes part in a plan,
    so then no plan fits."""
    for t, n in search.cluster.type_counts().items():
        tps = search.ev.valid_tps(t, n)
        if not tps:
            continue
        tp = max(tps)
        dp = n // tp
        c = search.cost.stage_cost_at(t, tp, dp, 1, False, False, dp, {}, 1, (1e9,) * 3)
        need = c.params * search.cost.setup.state_bytes_per_param(dp)
        if need > c.capacity_bytes:
            return (f"device type {t} ({c.capacity_bytes / 1e9:.2f} GB per device) cannot hold one layer of "
                    f"{search.model.name}: its weights, gradients and optimizer states alone take "
                    f"{need / 1e9:.2f} GB per device with all {n} devices as one stage at tp {tp}; "
                    f"leave it out of the cluster")
    return None


def infeasible_message(search) -> str:
    """The one-line error of a search that found no plan: the model larger than the
    cluster's memory, the time limit before any group, or the reasons counted over the
    groups evaluated."""
    need = search.model.num_params() * search.cost.bytes_per_param / 1e9
    have = sum(d.memory_gb * n for d, n in
               ((search.cluster.types[t], c) for t, c in search.cluster.type_counts().items()))
    if not search.can_hold(search.blocks.count):  # not even the whole cluster as one pipeline
        return (f"model {search.model.name} needs {need:.1f} GB for weights, gradients and optimizer "
                f"states but the cluster has {have:.1f} GB of device memory")
    if search.stats.time_limited and search.stats.groups_evaluated + search.stats.groups_by_dp == 0:
        return f"time limit {search.opt.time_limit}s reached before any device group was evaluated"
    reasons = ", ".join(f"{k}: {v}" for k, v in sorted(search.stats.reasons.items())) or "none evaluated"
    evaluated = search.stats.groups_evaluated + search.stats.groups_by_dp
    lead = f"no feasible plan for model {search.model.name} with gbs {search.opt.gbs}"
    if set(search.stats.reasons) <= {"no Lbs split with sum == gbs", "more pipelines than gbs",
                                     "no pipeline configuration whose mbs divides gbs"}:
        lead = (f"gbs {search.opt.gbs} cannot be split into local batches that are whole multiples "
                f"of the pipelines' mbs for model {search.model.name}")
    return f"{lead} on {search.cluster.world_size} devices ({evaluated} device groups evaluated; {reasons})"
