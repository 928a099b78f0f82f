"""Cluster YAML and device catalog: ordering, bandwidths, overrides, errors."""
import subprocess
import sys
from pathlib import Path

import pytest

from eth.spec.cluster import Cluster, catalog, load_cluster
from eth.errors import SpecError

ROOT = Path(__file__).resolve().parents[2]


def test_catalog_has_paper_table1_and_current_parts():
    cat = catalog()
    assert (cat["910B2"].tflops, cat["910B2"].memory_gb, cat["910B2"].link_gbps) == (376, 64, 1536)
    assert (cat["910B3"].tflops, cat["910B3"].memory_gb, cat["910B3"].link_gbps) == (313, 64, 1536)
    assert (cat["910B4"].tflops, cat["910B4"].memory_gb, cat["910B4"].link_gbps) == (280, 32, 736)
    assert (cat["A100"].tflops, cat["A100"].memory_gb, cat["A100"].link_gbps) == (312, 80, 1536)
    assert (cat["RTX3090"].tflops, cat["RTX3090"].memory_gb, cat["RTX3090"].link_gbps) == (80, 24, 1408)
    for name in ("H100", "H200", "A100-40GB", "V100", "L40S", "RTX4090"):
        assert cat[name].source, name


def test_ranks_are_node_major_and_links_depend_on_placement():
    c = load_cluster(ROOT / "examples/clusters/b2b4-64.yaml")
    assert c.world_size == 64 and c.type_counts() == {"910B2": 32, "910B4": 32}
    assert [d.type for d in c.devices[30:34]] == ["910B2", "910B2", "910B4", "910B4"]
    assert c.devices[9].node == 1 and c.devices[9].local == 1
    assert c.link_gbps([0, 7]) == 1536          # one 910B2 node: catalog link
    assert c.link_gbps([32, 33]) == 736         # one 910B4 node
    assert c.link_gbps([0, 8]) == 200           # two 910B2 nodes
    assert c.link_gbps([0, 40]) == 100          # across device types


def test_every_table2_example_cluster_loads():
    sizes = {4, 8, 16, 32, 64, 512, 1024}
    for pair in ("b2b3", "b2b4", "b3b4", "a100-3090"):
        for n in sizes:
            assert load_cluster(ROOT / f"examples/clusters/{pair}-{n}.yaml").world_size == n


def test_overrides_and_new_types():
    c = Cluster.from_dict({"inter_node_gbps": 50, "intra_node_gbps": 300,
                           "device_types": {"910B4": {"memory_gb": 48},
                                            "slow": {"base": "cpu", "emulate_speed": 0.5},
                                            "mine": {"tflops": 10, "memory_gb": 8, "link_gbps": 1,
                                                     "mem_bw_gbs": 100}},
                           "nodes": [{"type": "910B4", "devices_per_node": 2},
                                     {"type": "slow", "devices_per_node": 1},
                                     {"type": "mine", "devices_per_node": 1, "count": 2}]})
    assert c.types["910B4"].memory_gb == 48 and c.types["910B4"].tflops == 280
    assert c.types["slow"].emulate_speed == 0.5 and c.types["slow"].tflops == catalog()["cpu"].tflops
    assert c.world_size == 5 and c.link_gbps([0, 1]) == 300 and c.inter_type_gbps == 50
    again = Cluster.from_dict(c.to_dict())
    assert again.to_dict() == c.to_dict() and [d.type for d in again.devices] == [d.type for d in c.devices]


@pytest.mark.parametrize("data, message", [
    ({"nodes": [{"type": "A100", "devices_per_node": 2}]}, "inter_node_gbps is missing"),
    ({"inter_node_gbps": 10, "nodes": [{"type": "TPUv9", "devices_per_node": 2}]},
     r"nodes\[0\].type 'TPUv9' is not in the device catalog"),
    ({"inter_node_gbps": 10, "nodes": [{"type": "A100", "devices_per_node": 0}]},
     r"nodes\[0\].devices_per_node must be a positive integer, got 0"),
    ({"inter_node_gbps": -1, "nodes": [{"type": "A100", "devices_per_node": 1}]}, "inter_node_gbps must be a positive"),
    ({"inter_node_gbps": 10, "nodes": []}, "nodes is empty"),
    ({"inter_node_gbps": float("nan"), "nodes": [{"type": "A100", "devices_per_node": 1}]},
     "inter_node_gbps must be a positive number, got nan"),
    ({"inter_node_gbps": 10, "device_types": {"A100": {"memory_gb": float("inf")}},
     "nodes": [{"type": "A100", "devices_per_node": 1}]}, "memory_gb must be a positive number, got inf"),
    ({"inter_node_gbps": 10, "nodes": [{"type": "A100", "devices_per_node": True}]},
     "devices_per_node must be a positive integer, got True"),
    ({"inter_node_gbps": 10, "device_types": {"A100": {"tflops": -3}},
      "nodes": [{"type": "A100", "devices_per_node": 1}]}, "tflops must be a positive number, got -3"),
    ({"inter_node_gbps": 10, "device_types": {"x": {"tflops": 3}},
      "nodes": [{"type": "x", "devices_per_node": 1}]}, "not in the catalog and lacks"),
    ({"inter_node_gbps": 10, "gpus": 3, "nodes": []}, r"unknown field\(s\) \['gpus'\]"),
    ({"version": 7, "inter_node_gbps": 10, "nodes": []}, "version is 7"),
    # refused before one Device per rank is built (it hung on a billion)
    ({"inter_node_gbps": 10, "nodes": [{"type": "A100", "devices_per_node": 8, "count": 1000000000}]},
     r"nodes\[0\] \(1000000000 x 8 A100\) takes the cluster to 8000000000 devices; at most 131072"),
    ({"inter_node_gbps": 10, "nodes": [{"type": "A100", "devices_per_node": 8, "count": 16384},
                                       {"type": "H100", "devices_per_node": 1}]},
     r"nodes\[1\] \(1 x 1 H100\) takes the cluster to 131073 devices"),
])
def test_cluster_errors_name_the_field(data, message):
    with pytest.raises(SpecError, match=message):
        Cluster.from_dict(data)


def test_cluster_file_errors(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        load_cluster(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_cluster(bad)


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "tools/make_profiles.py"), "--devices", "TPUv9",
                           "-o", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "unknown device ['TPUv9']" in proc.stderr
    assert not list(tmp_path.iterdir())
