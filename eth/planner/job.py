"""One planning job: the profiles of a model on a cluster's device types, the search, and
where the op costs came from, recorded in the plan (tools/search_hpp.py and the runtime's
plan at start-up, megatron/hpp/training/startup_plan.py, both run it)."""
from __future__ import annotations

from pathlib import Path

from eth.errors import SpecError
from eth.fileio import CHECKOUT
from eth.planner.fleet import FleetOptions, choose_fleet
from eth.planner.options import SearchOptions
from eth.spec.cluster import Cluster
from eth.spec.model import ModelSpec
from eth.spec.plan import Plan

def plan_job(model: ModelSpec, cluster: Cluster, profiles: str | None, options: SearchOptions,
             fallback: str = "none", flag: str = "--profiles",
             instead: str = "or pass --profiles-fallback analytic", fleet: FleetOptions | None = None) -> Plan:
    """Search ``options.strategy`` for ``model`` on ``cluster`` with the profiles of file or
    folder ``profiles`` (None: analytic profiles in memory).  A device type those profiles
    lack for the model is a SpecError unless ``fallback`` is "analytic" (its line names
    the caller's ``flag`` and what to do ``instead`` of profiling).  ``plan.search``
    records per type where the op costs came from ("profiles"), where the profiles are
    ("profiles_checkout_path" relative to this checkout when they lie in it, so that
    tools/show_plan.py finds them in any clone; else "profiles_path", absolute) and the
    types given analytic profiles ("analytic_profiles").

    ``fleet`` (None: every device) chooses which of the cluster's devices the plan uses
    (:func:`eth.planner.fleet.choose_fleet`; ``fleet.use_all`` keeps them all and checks the
    constraints only); ``plan.predicted`` gets ``samples_per_s`` and, where every device has
    a price, ``cost_per_hour`` (:func:`eth.cost.price.plan_rates`)."""
    from eth.cost.price import plan_rates
    from eth.planner.search import search
    from eth.profiles.db import ProfileDB

    db = ProfileDB.load(profiles) if profiles else ProfileDB()
    added = db.ensure(model, cluster.types.values())
    if profiles and added and fallback == "none":
        raise SpecError(f"{flag} {profiles} has no entry for model {model.name} (hidden {model.hidden}, "
                        f"heads {model.heads}, kv_heads {model.kv_heads}, ffn {model.ffn}, seq {model.seq_len}, "
                        f"vocab {model.vocab}, {model.norm}, {model.position}, {model.attention} attention"
                        f"{', swiglu' if model.swiglu else ''}{'' if model.bias else ', no bias'}) on "
                        f"{', '.join(added)}: profile it with tools/profile_ops.py, {instead}")
    if fleet is not None:
        fleet.check(cluster)
    if fleet is None or fleet.use_all:
        plan = search(model, cluster, db, options)
        if fleet is not None and fleet.constrained:
            fleet.check_plan(plan_rates(plan))
    else:
        plan, _ = choose_fleet(model, cluster, db, options, fleet)
    plan.search["profiles"] = {t: "analytic (generated for this search)" if t in added
                               else db.get(t).source for t in sorted(cluster.types)}
    if profiles:   # a path of this machine only where the profiles lie outside the checkout
        where = Path(profiles).resolve()
        if where.is_relative_to(CHECKOUT):
            plan.search["profiles_checkout_path"] = where.relative_to(CHECKOUT).as_posix()
        else:
            plan.search["profiles_path"] = str(where)
    if added:
        plan.search["analytic_profiles"] = added
    plan.predicted.update(plan_rates(plan))
    return plan
