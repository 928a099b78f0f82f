"""The search's memoised costs equal fresh ones (issue 11 item 1).

``CostModel.stage_cost`` / ``stage_cost_at`` and ``Evaluator.fit_stage`` memoise by
shape, in-flight micro-batches and links instead of stage position and ranks.  On
seeded random stages of GPT-3 13B on a 64-device 910B2/910B4 cluster, one shared
model (every result cached and reused) must return exactly what a fresh model,
computing each call from scratch, returns.
"""
import random

from eth.spec.cluster import Cluster
from eth.cost.model import CostModel
from eth.spec.model import LAYER_OPS, get_model
from eth.planner.evaluate import Evaluator, StageState
from eth.profiles.db import ProfileDB


def _setup():
    model = get_model("gpt3-13b")
    cluster = Cluster.from_dict({"name": "b2b4-64", "inter_node_gbps": 200, "inter_type_gbps": 100,
                                 "nodes": [{"type": "910B2", "devices_per_node": 8, "count": 4},
                                           {"type": "910B4", "devices_per_node": 8, "count": 4}]})
    db = ProfileDB()
    db.ensure(model, cluster.types.values())
    return model, cluster, db


def _random_stage(rng, L):
    t = rng.choice(["910B2", "910B4"])
    tp, dp = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4])
    a = rng.randrange(0, L)
    b = rng.randrange(a + 1, min(L, a + 12) + 1)
    base = 0 if t == "910B2" else 32
    ranks = tuple(range(base + 8 * rng.randrange(4), base + 32))[:tp * dp] if rng.random() < 0.8 else None
    nxt = (rng.randrange(64),) if rng.random() < 0.7 else None
    prv = (rng.randrange(64),) if rng.random() < 0.7 else None
    S = rng.randint(1, 8)
    return t, tp, dp, (a, b), dp * rng.choice([1, 2, 4]), rng.randrange(S), S, ranks, nxt, prv


def test_stage_cost_memo_equals_fresh():
    model, cluster, db = _setup()
    shared = CostModel(model, cluster, db)
    rng = random.Random(11)
    for _ in range(400):
        t, tp, dp, layers, mbs, j, S, ranks, nxt, prv = _random_stage(rng, model.num_layers)
        n = layers[1] - layers[0]
        rec = {op: rng.randint(0, n) for op in rng.sample(LAYER_OPS, rng.randint(0, 4))}
        nmb = rng.choice([None, 1, 2, 8, 64])
        args = (t, tp, dp, layers, mbs, rec, j, S, nmb, ranks, nxt, prv)
        assert shared.stage_cost(*args) == CostModel(model, cluster, db).stage_cost(*args), args


def test_fit_stage_memo_equals_fresh():
    model, cluster, db = _setup()
    shared = Evaluator(CostModel(model, cluster, db))
    rng = random.Random(12)
    for _ in range(300):
        t, tp, dp, layers, mbs, j, S, ranks, nxt, prv = _random_stage(rng, model.num_layers)
        st = StageState(t, tp * dp, tp, layers[1] - layers[0])
        args = (st, layers, mbs, j, S, rng.choice([1, 2, 8, 64]), ranks, nxt, prv)
        assert shared.fit_stage(*args) == Evaluator(CostModel(model, cluster, db)).fit_stage(*args), args


def test_search_memo_changes_no_plan():
    """SearchOptions.memo (per-stage evaluation memo, layer re-split memo, rank layout and
    All-Reduce memo, sorted greedy, memos of whole allocations and free-Mbs allocations,
    one ranks tuple per stage group) only saves time: with and without it the search
    returns the same plan on seeded small clusters, with no more cost evaluations (the
    free-Mbs allocation memo skips the evaluations of a repeated allocation; every other
    memo keeps the evaluation count)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from _planner_data import M4, make_cluster, profiles_for
    from eth.planner.options import SearchOptions
    from eth.planner.search import search
    rng = random.Random(11)
    for _ in range(6):
        types = rng.sample(["A100", "RTX3090", "V100", "910B4"], rng.randint(1, 3))
        nodes = [{"type": t, "devices_per_node": rng.randint(1, 3)} for t in types]
        cluster = make_cluster(nodes, inter_node_gbps=rng.choice([25, 100, 400]))
        db = profiles_for(M4, cluster)
        gbs = rng.choice([4, 8, 12, 16])
        on, off = (search(M4, cluster, db, SearchOptions(gbs=gbs, seeds=False, memo=m)) for m in (True, False))
        assert on.predicted == off.predicted
        assert on.to_dict()["pipelines"] == off.to_dict()["pipelines"]
        assert on.search["cost_evaluations"] <= off.search["cost_evaluations"]
