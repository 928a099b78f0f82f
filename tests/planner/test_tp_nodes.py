"""Searched plans keep every tp group inside one node (tp <= devices per node always)."""
from pathlib import Path

import pytest

from eth.spec.cluster import load_cluster
from eth.spec.model import ModelSpec, get_model
from eth.planner.options import SearchOptions
from eth.planner.search import HPPSearch

from _planner_data import M4, make_cluster, profiles_for

ROOT = Path(__file__).resolve().parents[2]
M3 = ModelSpec("m3", num_layers=3, hidden=2048, heads=16, seq_len=512, vocab=4096)


def _check(cluster, plan):
    for p in plan.pipelines:
        for st in p.stages:
            per_node = min(g.devices_per_node for g in cluster.nodes if g.type == st.device_type)
            assert st.tp <= per_node
            for k in range(0, len(st.ranks), st.tp):
                group = st.ranks[k:k + st.tp]
                assert len({cluster.devices[r].node for r in group}) == 1, (st.ranks, st.tp)


class _Recording(HPPSearch):
    """Keeps every candidate plan the search accepted into its ranking."""

    def _consider(self, cand):
        self.seen.append(cand.plan)
        super()._consider(cand)


def _plans(model, cluster, gbs, **opts):
    s = _Recording(model, cluster, profiles_for(model, cluster), SearchOptions(gbs=gbs, **opts))
    s.seen = []
    plan = s.run()
    return [plan] + s.seen


@pytest.mark.parametrize("model,gbs", [(M4, 12), (get_model("gpt3-6.7b", seq_len=1024), 24)])
def test_b2b4_16_plans_keep_tp_groups_in_a_node(model, gbs):
    cluster = load_cluster(ROOT / "examples/clusters/b2b4-16.yaml")
    plans = _plans(model, cluster, gbs)
    for plan in plans:
        _check(cluster, plan)
    if model is not M4:  # 6.7B on 32/64 GB devices needs tp > 1 somewhere
        assert any(st.tp > 1 for plan in plans for p in plan.pipelines for st in p.stages)


@pytest.mark.parametrize("model,gbs,tp_used", [(M4, 12, True), (M3, 24, True), (M4, 36, False)])
def test_three_devices_per_node_plans_keep_tp_groups_in_a_node(model, gbs, tp_used):
    # small memory pushes the search towards tp > 1
    cluster = make_cluster([{"type": "A100", "devices_per_node": 3, "count": 2},
                            {"type": "RTX3090", "devices_per_node": 3}],
                           device_types={"A100": {"memory_gb": 2 * 18 / 16},   # 18 B/param
                                         "RTX3090": {"memory_gb": 2 * 18 / 16}})
    plans = _plans(model, cluster, gbs)
    for plan in plans:
        _check(cluster, plan)
    # gbs 36: with the fitted A100/RTX3090 GEMM curves (narrow tp GEMMs run below the
    # constant's efficiency) no candidate takes tp > 1 (recompute instead); the other two
    # still exercise the node check with tp > 1
    if tp_used:
        assert any(st.tp > 1 for plan in plans for p in plan.pipelines for st in p.stages)
