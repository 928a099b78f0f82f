"""Baseline planners in the HPP cost model (paper section 7): one entry point.

    plan = plan_baseline("metis", model, cluster, profiles, gbs=1024, options=None)

| strategy | what it may choose | module |
|---|---|---|
| ``uniform``   | Megatron-LM: one pipeline, identical stages (tp, dp), even layer split | :mod:`.uniform` |
| ``metis``     | Metis as published: one pipeline, no recompute, tp raised from (N, 1) only under memory pressure (least free stage first, memory summed over a stage's devices), speed-proportional layers, mixed-type stages; its choice out of memory per device is an OOM | :mod:`.metis` |
| ``metis-strong`` | one pipeline, per-stage tp/dp, uneven layers (HPP balancer, Mbs moves, recompute per stage, Lbs = Gbs) | :mod:`.metis_strong` |
| ``hexiscale`` | HexiScale as published: k identical pipelines, dp = 1 per stage, memory-proportional layers, one fixed Mbs, k <= max(1, N // 5), full recompute always, Lbs = Gbs / k | :mod:`.hexiscale` |
| ``hexiscale-strong`` | k identical pipelines, dp = 1 per stage, layers balanced by time, Mbs searched, recompute per stage | :mod:`.hexiscale_strong` |
| ``typesplit`` | homogeneous pipelines per device type, HPP phases 1-3 | :mod:`.typesplit` |

All use the same profiles and :class:`eth.cost.model.CostModel` as the HPP search, return a
validated :class:`eth.spec.plan.Plan` with predictions (:meth:`CostModel.annotate`) and
``plan.search["strategy"]``, and raise :class:`eth.errors.InfeasibleError` when nothing
fits.  The faithful and strong planners record ``plan.search["variant"]`` ("faithful" /
"strong").  Old plans: the strategy name is metadata (``plan.search``), never checked when a
plan loads, so a plan written before the split with ``"strategy": "metis"`` or
``"hexiscale"`` (and no ``"variant"``) still loads and runs; it came from what is now the
``-strong`` planner.  ``options`` may be a :class:`BaselineOptions`, None, or any object with some of
its field names (an :class:`eth.planner.options.SearchOptions` works).
"""
from __future__ import annotations

from eth.errors import SpecError
from eth.spec.plan import Plan
from eth.planner.baselines.common import BASELINES, BaselineOptions
from eth.planner.options import check_gbs


def plan_baseline(strategy: str, model, cluster, profiles, gbs: int, options=None) -> Plan:
    """Run baseline ``strategy`` (one of :data:`BASELINES`) and return its plan."""
    from eth.planner.baselines.hexiscale import plan_hexiscale
    from eth.planner.baselines.hexiscale_strong import plan_hexiscale_strong
    from eth.planner.baselines.metis import plan_metis
    from eth.planner.baselines.metis_strong import plan_metis_strong
    from eth.planner.baselines.typesplit import plan_typesplit
    from eth.planner.baselines.uniform import plan_uniform

    planners = {"uniform": plan_uniform, "metis": plan_metis, "metis-strong": plan_metis_strong,
                "hexiscale": plan_hexiscale, "hexiscale-strong": plan_hexiscale_strong,
                "typesplit": plan_typesplit}
    if strategy not in planners:
        raise SpecError(f"unknown baseline strategy {strategy!r}; known: {', '.join(BASELINES)}")
    check_gbs(gbs)
    options = BaselineOptions.from_any(options)
    plan = planners[strategy](model, cluster, profiles, gbs, options)
    plan.training = options.setup
    return plan


__all__ = ["BASELINES", "BaselineOptions", "plan_baseline"]
