"""bench/aceso_profiles.py's converter of a plan to Aceso's config format."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from eth.spec.cluster import Cluster
from eth.spec.model import get_model
from eth.spec.plan import PipelinePlan, Plan, StagePlan

REPO = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_aceso_profiles", REPO / "bench/aceso_profiles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_cut_plan_becomes_aceso_stages_of_ops():
    """Two stages cut after layer 1's qkv: Aceso counts the embedding, 13 ops per layer and
    the final layernorm + head; the recompute flags sit on the ops of the layers that
    recompute them (the first n layers of the stage that run the op)."""
    tiny = get_model("tiny")
    cluster = Cluster.from_dict({"name": "t", "inter_node_gbps": 10,
                                 "nodes": [{"type": "A100", "devices_per_node": 3}]})
    stages = [StagePlan([0, 1], "A100", 2, 1, (0, 2), {"qkv": 2}, ops=("1st-layernorm", "qkv")),
              StagePlan([2], "A100", 1, 1, (1, 4), {"score": 1, "gelu": 3}, ops=("score", "post-mlp-dropout"))]
    plan = Plan(tiny, cluster, 8, [PipelinePlan(2, 8, stages)])
    cfg = _bench().aceso_config(plan.validate(), "tiny")
    assert cfg["num_ops_in_each_stage"] == [1 + 13 + 2, 11 + 2 * 13 + 2]
    assert sum(cfg["num_ops_in_each_stage"]) == 1 + 4 * 13 + 2
    assert cfg["model_parallel_size_of_each_op"] == [[2] * 16, [1] * 39] and cfg["num_gpus"] == [2, 1]
    first, second = cfg["recompute_ops"]
    assert [i for i, r in enumerate(first) if r] == [2, 15]          # qkv in layers 0 and 1
    # layer 1 from score (its ops at 0-10): score, gelu; layers 2 and 3 (from 11, 24): gelu
    assert [i for i, r in enumerate(second) if r] == [0, 8, 11 + 10, 24 + 10]
    with pytest.raises(ValueError, match="holds one pipeline, the plan has 2"):
        _bench().aceso_config(Plan(tiny, cluster, 8, [PipelinePlan(2, 4, stages[:1]), PipelinePlan(2, 4, stages[1:])]),
                              "tiny")
