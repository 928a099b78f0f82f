"""The HPP search without seeds against every baseline strategy (issue 11 item 2).

With seeds, ``search()`` returns a baseline's plan whenever it is faster, so "never
slower than a baseline" would hold by construction; here the search runs alone
(``seeds=False``) against every strategy registered in ``eth.planner.baselines``
(``BASELINES``: uniform, metis, metis-strong, hexiscale, hexiscale-strong, typesplit) on
seeded random small clusters (1-3 device types, 1-4 devices each, 2-6 layer models, gbs
4-64, memory cut to 2-4 GB in 30% of the draws).  A baseline that finds no plan is left
out; the search must find one whenever any baseline does.  Both are compared by the
paper's Eq. 5, what both rank their candidates by (``SEARCH_OBJECTIVE``; the search's
finalists are not re-scored here): with few micro-batches the gradient-blocks objective
plays 1F1B op by op, which their Eq. 5 lines do not see.

Known gaps (``KNOWN_GAPS``, strict xfail, fails once fixed): none.  Draw #2 (2 A100 +
1 V100 + 3 910B4, m2, gbs 16), where typesplit's plan was 0.19% faster than the unseeded
search's, is closed since the polish tries the joint tp moves of its re-planned
configurations (eth.planner.balance.joint_moves), descends before it re-plans and also
reverses pipelines' stage orders (eth/planner/polish.py, issue 11 items 2 and 3).
"""
import random

import pytest

from eth.errors import InfeasibleError
from eth.spec.model import ModelSpec
from eth.planner.baselines import plan_baseline
from eth.planner.baselines.common import BASELINES, BaselineOptions
from eth.planner.options import SearchOptions
from eth.planner.search import search

from _planner_data import M4, M6, make_cluster, profiles_for

M2 = ModelSpec("m2", num_layers=2, hidden=1024, heads=8, seq_len=1024, vocab=1024)
M3 = ModelSpec("m3", num_layers=3, hidden=2048, heads=16, seq_len=512, vocab=4096)
SEED, DRAWS = 3, 10
KNOWN_GAPS: dict[int, str] = {}


def draws():
    rng = random.Random(SEED)
    for i in range(DRAWS):
        types = rng.sample(["A100", "RTX3090", "V100", "910B4"], rng.randint(1, 3))
        nodes = [{"type": t, "devices_per_node": rng.randint(1, 4)} for t in types]
        model, gbs = rng.choice([M2, M3, M4, M6]), rng.choice([4, 8, 16, 32, 64])
        memory = {t: {"memory_gb": rng.choice([2, 3, 4])} for t in types} if rng.random() < 0.3 else None
        bw = rng.choice([25, 100, 400])
        yield i, nodes, model, gbs, memory, bw


CASES = [pytest.param(*d, id=f"#{d[0]}", marks=pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[d[0]]))
         if d[0] in KNOWN_GAPS else pytest.param(*d, id=f"#{d[0]}") for d in draws()]


@pytest.mark.parametrize("i, nodes, model, gbs, memory, bw", CASES)
def test_unseeded_search_is_never_slower_than_a_baseline(i, nodes, model, gbs, memory, bw):
    cluster = make_cluster(nodes, inter_node_gbps=bw, **({"device_types": memory} if memory else {}))
    db = profiles_for(model, cluster)
    try:
        hpp = search(model, cluster, db, SearchOptions(gbs=gbs, seeds=False, objective="eq5",
                                                       simulate_finalists=False)).predicted["iteration_ms"]
    except InfeasibleError:
        hpp = float("inf")
    for strategy in BASELINES:
        try:
            base = plan_baseline(strategy, model, cluster, db, gbs,
                                 BaselineOptions(objective="eq5")).predicted["iteration_ms"]
        except InfeasibleError:
            continue
        assert hpp <= base * (1 + 1e-9), (strategy, hpp, base)
