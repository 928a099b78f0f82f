import itertools

from eth.planner.enumerate import (assign_ranks, count_groups, device_groups, make_blocks, pipeline_ranks, scale_groups,
                                   stage_groups)

from _planner_data import make_cluster


def naive_groups(total, parts):
    """Vector partitions by brute force: assign each unit of each type to a pipeline label."""
    units = [t for t, c in enumerate(total) for _ in range(c)]
    seen = set()
    for labels in itertools.product(range(parts), repeat=len(units)):
        vecs = [[0] * len(total) for _ in range(parts)]
        for t, lab in zip(units, labels):
            vecs[lab][t] += 1
        if any(not any(v) for v in vecs):
            continue
        seen.add(tuple(sorted((tuple(v) for v in vecs), reverse=True)))
    return seen


def test_device_groups_match_naive_enumeration():
    for total in [(2, 2), (3, 1), (4,), (2, 1, 1)]:
        for parts in range(1, sum(total) + 1):
            got = list(device_groups(total, parts))
            assert len(got) == len(set(got)), "a group was generated twice"
            assert set(got) == naive_groups(total, parts)
            assert count_groups(total, parts) == len(got)


def test_filter_is_applied_to_every_pipeline():
    ok = lambda v: v[0] >= 1  # noqa: E731 every pipeline needs a type-0 block
    got = list(device_groups((3, 3), 2, ok))
    assert got and all(v[0] >= 1 for g in got for v in g)
    assert count_groups((3, 3), 2, ok) == len(got)


def test_blocks_cap_and_granularity():
    big = make_cluster([{"type": "910B2", "devices_per_node": 8, "count": 64},
                        {"type": "910B4", "devices_per_node": 8, "count": 64}])
    b = make_blocks(big, 8)
    assert b.count == (8, 8) and b.block == (64, 64)
    small = make_cluster([{"type": "A100", "devices_per_node": 3}, {"type": "RTX3090", "devices_per_node": 2}])
    b = make_blocks(small, 8)
    assert b.block == (1, 1) and b.count == (3, 2)


def test_stage_groups_are_homogeneous_ordered_and_bounded():
    groups = stage_groups(("A", "B"), (2, 2), num_layers=4, max_stages=16)
    stages = {g.stages for g in groups}
    assert (("A", 2), ("B", 2)) in stages and (("B", 2), ("A", 2)) in stages
    assert (("A", 1), ("A", 1), ("B", 1), ("B", 1)) in stages
    assert len(stages) == len(groups) == 8
    for g in stage_groups(("A", "B"), (8, 8), num_layers=40, max_stages=4):
        assert g.num_stages <= 4
        assert sum(n for t, n in g.stages if t == "A") == 8


def test_assign_ranks_uses_every_rank_once_and_keeps_tp_in_a_node():
    c = make_cluster([{"type": "910B2", "devices_per_node": 8, "count": 2},
                      {"type": "910B4", "devices_per_node": 8, "count": 2}])
    b = make_blocks(c, 8)
    pipelines = [[("910B2", 4), ("910B4", 8)], [("910B2", 8), ("910B2", 4), ("910B4", 2)] + [("910B4", 2)] * 3]
    ranks = assign_ranks(b, pipelines)
    flat = [r for p in ranks for s in p for r in s]
    assert sorted(flat) == list(range(32))
    for p, rk in zip(pipelines, ranks):
        for (t, n), stage in zip(p, rk):
            assert len(stage) == n and all(c.devices[r].type == t for r in stage)
            # power-of-two stages start at a multiple of their size: any tp | n stays in a node
            assert len({c.devices[r].node for r in stage}) == max(1, n // 8)


def test_1024_devices_stay_enumerable():
    big = make_cluster([{"type": "910B2", "devices_per_node": 8, "count": 64},
                        {"type": "910B4", "devices_per_node": 8, "count": 64}])
    b = make_blocks(big, 8)
    total = sum(count_groups(b.count, p) for p in range(1, b.total + 1))
    assert total == 8406  # vector partitions of (8, 8)
    g = next(device_groups(b.count, 3))
    assert sum(v[0] for v in g) == 8 and sum(b.devices(v)[0] for v in g) == 512


def _tp_ok(cluster, ranks, tp):
    return all(len({cluster.devices[r].node for r in ranks[k:k + tp]}) == 1 for k in range(0, len(ranks), tp))


def test_assign_ranks_keeps_power_of_two_chunks_in_a_node_for_odd_sizes():
    # 4 devices per node: a 3-device stage placed before 2-device stages used to push
    # them across the node boundary (ranks 3, 4)
    c = make_cluster([{"type": "910B2", "devices_per_node": 4, "count": 2}])
    b = make_blocks(c, 8)
    pipelines = [[("910B2", 3)], [("910B2", 2)], [("910B2", 2)], [("910B2", 1)]]
    ranks = assign_ranks(b, pipelines)
    assert sorted(r for p in ranks for s in p for r in s) == list(range(8))
    assert _tp_ok(c, ranks[1][0], 2) and _tp_ok(c, ranks[2][0], 2)
    # 6-device stage (granule 2) next to 2-device stages
    ranks = assign_ranks(b, [[("910B2", 6)], [("910B2", 2)]])
    assert _tp_ok(c, ranks[0][0], 2) and _tp_ok(c, ranks[1][0], 2)


def test_assign_ranks_with_three_devices_per_node():
    c = make_cluster([{"type": "A100", "devices_per_node": 3, "count": 2}])
    b = make_blocks(c, 8)
    ranks = assign_ranks(b, [[("A100", 2), ("A100", 1)], [("A100", 2), ("A100", 1)]])
    assert sorted(r for p in ranks for s in p for r in s) == list(range(6))
    assert _tp_ok(c, ranks[0][0], 2) and _tp_ok(c, ranks[1][0], 2)
    # three 2-device stages on two 3-device nodes: two of them can stay node-local
    ranks = assign_ranks(b, [[("A100", 2)], [("A100", 2)], [("A100", 2)]])
    assert sum(_tp_ok(c, p[0], 2) for p in ranks) == 2
    # a single pipeline's 2-device stages: first node-local, the leftover pair crosses
    ranks = assign_ranks(b, [[("A100", 2), ("A100", 2), ("A100", 2)]])
    assert sum(_tp_ok(c, s, 2) for s in ranks[0]) == 2


def test_assign_ranks_without_node_information_is_contiguous():
    from eth.planner.enumerate import Blocks
    c = make_cluster([{"type": "A100", "devices_per_node": 3, "count": 2}])
    b = make_blocks(c, 8)
    bare = Blocks(b.types, b.block, b.count, b.ranks)
    assert assign_ranks(bare, [[("A100", 1)], [("A100", 3)], [("A100", 2)]]) == [[[5]], [[0, 1, 2]], [[3, 4]]]


def test_stage_groups_of_given_type_orders_and_their_scale_samples():
    types, devices = ("A", "B", "C", "D"), (4, 2, 0, 8)
    every = stage_groups(types, devices, num_layers=40, max_stages=16)
    some = stage_groups(types, devices, 40, 16, orders=[("D", "A", "B"), ("B", "A", "D")])
    assert {g.stages for g in some} == {g.stages for g in every
                                        if [t for i, (t, _) in enumerate(g.stages)
                                            if i == 0 or g.stages[i - 1][0] != t] in (["D", "A", "B"], ["B", "A", "D"])}
    assert len(every) == 3 * len(some)             # 6 orders, each with the same size choices
    samples = scale_groups(("D", "A", "B"), {"A": 4, "B": 2, "D": 8}, num_layers=40, max_stages=16)
    # one stage per type, then about twice as many each time, down to single devices
    assert [g.stages for g in samples] == [
        (("D", 8), ("A", 4), ("B", 2)),
        (("D", 4),) * 2 + (("A", 2),) * 2 + (("B", 1),) * 2,
        (("D", 2),) * 4 + (("A", 1),) * 4 + (("B", 1),) * 2,
        (("D", 1),) * 8 + (("A", 1),) * 4 + (("B", 1),) * 2]
    assert all(g.stages in {e.stages for e in every} for g in samples)
    assert len(scale_groups(("D", "A", "B"), {"A": 4, "B": 2, "D": 8}, num_layers=40, max_stages=5)) == 1


def test_blocks_budget_over_types_leaves_two_types_alone():
    four = make_cluster([{"type": t, "devices_per_node": 8, "count": 8} for t in ("H100", "A100", "V100", "RTX3090")])
    assert make_blocks(four, 8).count == (8, 8, 8, 8)
    assert make_blocks(four, 8, 16).count == (4, 4, 4, 4) and make_blocks(four, 8, 16).block == (16,) * 4
    six = make_cluster([{"type": t, "devices_per_node": 8, "count": 4}
                        for t in ("H100", "A100", "V100", "RTX3090", "L40S", "A100-40GB")])
    assert make_blocks(six, 8, 16).count == (2,) * 6                  # max(2, 16 // 6)
    two = make_cluster([{"type": "910B2", "devices_per_node": 8, "count": 64},
                        {"type": "910B4", "devices_per_node": 8, "count": 64}])
    assert make_blocks(two, 8, 16) == make_blocks(two, 8)


def test_pipeline_ranks_equal_assign_ranks_of_the_pipeline_alone():
    c = make_cluster([{"type": "H100", "devices_per_node": 8, "count": 2},
                      {"type": "A100", "devices_per_node": 4, "count": 3},
                      {"type": "V100", "devices_per_node": 3, "count": 2}])
    b, memo = make_blocks(c, 8), {}
    for g in stage_groups(b.types, (16, 12, 6), num_layers=24, max_stages=12):
        want = tuple(tuple(r) for r in assign_ranks(b, [list(g.stages)])[0])
        assert pipeline_ranks(b, g.stages, memo) == want, g.stages
    odd = (("A100", 3), ("H100", 8), ("A100", 2), ("A100", 4), ("V100", 1))   # unequal, interleaved
    assert pipeline_ranks(b, odd, memo) == tuple(tuple(r) for r in assign_ranks(b, [list(odd)])[0])
    assert hash(b) == hash(make_blocks(c, 8)) and b == make_blocks(c, 8)
