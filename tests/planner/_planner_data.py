"""Shared small inputs for the planner tests (analytic profiles, in memory).

A uniquely named module (not conftest.py): test folders have no __init__.py, so every
folder's conftest.py is the top-level module ``conftest`` and importing names from it
reads whichever folder's conftest pytest loaded last."""
from eth.spec.cluster import Cluster
from eth.spec.model import ModelSpec
from eth.profiles.db import ProfileDB


def make_cluster(nodes, **extra) -> Cluster:
    return Cluster.from_dict({"name": "test", "inter_node_gbps": 100, "nodes": nodes, **extra})


def profiles_for(model, cluster) -> ProfileDB:
    db = ProfileDB()
    db.ensure(model, cluster.types.values())
    return db


M4 = ModelSpec("m4", num_layers=4, hidden=1024, heads=8, seq_len=512, vocab=8192)
M6 = ModelSpec("m6", num_layers=6, hidden=2048, heads=16, seq_len=1024, vocab=8192)

A2R2 = [{"type": "A100", "devices_per_node": 2}, {"type": "RTX3090", "devices_per_node": 2}]

EQ5 = {"objective": "eq5", "simulate_finalists": False}
"""Plans scored and chosen by the paper's Eq. 5, what the search ranks candidates by
(``eth.planner.options.SEARCH_OBJECTIVE``): the tests of the search's own optimality."""
