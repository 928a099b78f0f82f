"""megatron/hpp/parallel/launch.py: the start-up check of the rank order against the cluster's
node-major order (pure), against brute force over small host assignments, and once
under two gloo ranks."""
import itertools

import pytest

from eth.spec.cluster import Cluster
from eth.errors import SpecError
from megatron.hpp.parallel.launch import RankHost, check_rank_order, expected_node_order, host_blocks

MIXED = Cluster.from_dict({"name": "mixed", "inter_node_gbps": 100, "nodes": [
    {"type": "A100", "devices_per_node": 4, "count": 2}, {"type": "RTX3090", "devices_per_node": 2}]})


def hosts(names, local=None):
    """names[r] = host of rank r; local ranks count up per host unless given."""
    count, out = {}, []
    for r, h in enumerate(names):
        out.append(RankHost(r, h, count.get(h, 0) if local is None else local[r]))
        count[h] = count.get(h, 0) + 1
    return out


def test_node_major_launch_passes():
    check_rank_order(MIXED, hosts(["a"] * 4 + ["b"] * 4 + ["c"] * 2))
    check_rank_order(MIXED, hosts(["one"] * 10))                  # one machine emulating 3 nodes
    check_rank_order(MIXED, hosts(["a"] * 4 + ["b"] * 6))         # host b holds nodes 1 and 2
    check_rank_order(MIXED, hosts(["a"] * 4 + ["b"] * 4))         # the plan uses the first 8 devices
    assert expected_node_order(MIXED) == ["node 0: A100 x 4, ranks 0-3", "node 1: A100 x 4, ranks 4-7",
                                          "node 2: RTX3090 x 2, ranks 8-9"]


@pytest.mark.parametrize("names, local, message", [
    (["a"] * 2 + ["c"] * 2 + ["b"] * 4 + ["c"] * 2, None,
     "host c holds ranks 2-3 and 8-9: a host's ranks must be consecutive"),
    (["c"] * 2 + ["a"] * 4 + ["b"] * 4, None,   # the 3090 host joined first
     "node 0 of the plan's cluster (A100 x 4, ranks 0-3) is split over hosts: 0-1 on c, 2-3 on a; "
     "start one torchrun per node with --nproc-per-node 4"),
    (["a"] * 3 + ["b"] * 5 + ["c"] * 2, None, "node 0 of the plan's cluster (A100 x 4, ranks 0-3) is split"),
    (["a"] * 4 + ["b"] * 4 + ["c"] * 2, [0, 1, 2, 3, 0, 1, 2, 3, 1, 0],
     "host c: ranks 8-9 have LOCAL_RANK [1, 0], expected 0-1 in rank order"),
])
def test_misplaced_ranks_are_one_line_errors(names, local, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")) as err:
        check_rank_order(MIXED, hosts(names, local))
    assert "\n" not in str(err.value)


def test_world_size_and_rank_set():
    with pytest.raises(SpecError, match="WORLD_SIZE is 12, the plan's cluster has 10 devices"):
        check_rank_order(MIXED, hosts(["a"] * 12))
    with pytest.raises(SpecError, match="ranks reported at start-up are 0,2, expected 0-1"):
        check_rank_order(MIXED, [RankHost(0, "a", 0), RankHost(2, "a", 1)])


def _brute_force_ok(cluster, names) -> bool:
    """Obvious definition: every node on one host, hosts consecutive, nodes in order."""
    node_host = {}
    for dev, h in zip(cluster.devices, names):
        if node_host.setdefault(dev.node, h) != h:
            return False
    order = [h for h, _ in itertools.groupby(names)]
    return len(order) == len(set(order))


def test_against_brute_force_on_every_small_assignment():
    small = Cluster.from_dict({"name": "s", "inter_node_gbps": 10, "nodes": [
        {"type": "A100", "devices_per_node": 2, "count": 2}, {"type": "V100", "devices_per_node": 1}]})
    checked = 0
    for names in itertools.product("xyz", repeat=small.world_size):
        try:
            check_rank_order(small, hosts(list(names)))
            ok = True
        except SpecError:
            ok = False
        assert ok == _brute_force_ok(small, names), names
        checked += ok
    assert checked == 3 * 2 + 3 * 2 + 3 * 2 * 1 + 3  # 1, 2 or 3 hosts in any naming
    assert [h for h, _ in host_blocks(hosts(list("xxyyz")))] == ["x", "y", "z"]


def test_check_launch_on_two_gloo_ranks(tmp_path):
    from _rt_spawn import launch

    script = tmp_path / "check.py"
    script.write_text(
        "import torch.distributed as dist; from eth.spec.cluster import Cluster; "
        "from megatron.hpp.parallel.launch import check_launch; dist.init_process_group('gloo'); "
        "c = Cluster.from_dict({'name': 'c', 'inter_node_gbps': 1, 'nodes': ["
        "{'type': 'cpu', 'devices_per_node': 1, 'count': 2}]}); check_launch(c); print('ok'); "
        "dist.destroy_process_group()\n")
    results = launch(2, [], timeout=120, script=script)
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    assert all(r.stdout.strip() == "ok" for r in results)
