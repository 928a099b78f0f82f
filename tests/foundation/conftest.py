"""Fixtures of the foundation tests."""
import pytest

from _foundation_data import TINY, flat_profile
from eth.spec.cluster import Cluster
from eth.profiles.db import DeviceProfile, ProfileDB


@pytest.fixture
def tiny():
    return TINY


@pytest.fixture
def cpu_cluster():
    return Cluster.from_dict({"name": "cpu4", "inter_node_gbps": 10,
                              "nodes": [{"type": "cpu", "devices_per_node": 4}]})


@pytest.fixture
def flat_db():
    return ProfileDB({"cpu": DeviceProfile(flat_profile())})

