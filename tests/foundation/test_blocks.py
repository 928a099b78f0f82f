"""The gradient layout (eth.layout.blocks) of block-, device- and tensor-wise sync, without processes.

Checked by hand on the paper's Fig. 5/7 situation (a dp 2 pipeline next to a tp 2
pipeline), by brute force on the coverage property every strategy must have (each
replica adds every element of every parameter exactly once, and every participant of
a buffer lays out the same pieces), and against the cost model's independent count
of the block structure (eth.cost.sync.block_groups).
"""
import numpy as np
import pytest

from eth.layout.blocks import GradLayout
from eth.spec.cluster import Cluster
from eth.errors import PlanError
from eth.spec.model import ModelSpec
from eth.layout.params import all_specs, block_specs, param_ops
from eth.spec.plan import PipelinePlan, Plan, StagePlan
from eth.cost.sync import block_groups

M = ModelSpec("t4", num_layers=4, hidden=8, heads=4, ffn=32, seq_len=4, vocab=16, dropout=0.0)
LAYER_PART, LAYER_REPL = 824, 48      # qkv, dense.w, fc1, fc2.w | ln1, ln2, dense.b, fc2.b
EMB_PART, EMB_REPL = 16 * 8, 4 * 8    # word (vocab-parallel) | position
HEAD_PART, HEAD_REPL = 16 * 8, 2 * 8  # output layer | final layernorm


def plan_of(n, pipelines, gbs=8) -> Plan:
    cluster = Cluster.from_dict({"name": "t", "inter_node_gbps": 100,
                                 "nodes": [{"type": "A100", "devices_per_node": n}]})
    return Plan(M, cluster, gbs, pipelines)


def st(ranks, tp, dp, layers, ops=None):
    return StagePlan(list(ranks), "A100", tp, dp, tuple(layers), ops=ops)


def fig5():
    """Pipeline 0: one stage, dp 2 (ranks 0, 1); pipeline 1: one stage, tp 2 (ranks 2, 3)."""
    return plan_of(4, [PipelinePlan(2, 4, [st([0, 1], 1, 2, (0, 4))]),
                       PipelinePlan(2, 4, [st([2, 3], 2, 1, (0, 4))])])


def mixed():
    """tp 4 (ranks given out of order), tp 2 and tp 1 pipelines on different layer splits,
    a dp 2 stage: blocks held by 4 replicas at three tp degrees."""
    return plan_of(10, [PipelinePlan(2, 4, [st([3, 1, 0, 2], 4, 1, (0, 4))]),
                        PipelinePlan(2, 2, [st([5, 4], 2, 1, (0, 1)), st([6], 1, 1, (1, 4))]),
                        PipelinePlan(2, 2, [st([7], 1, 1, (0, 3)), st([9, 8], 1, 2, (3, 4))])])


def cut():
    """Stages that start and end inside layers: layer 1 cut after qkv (tp 2 | tp 1) in
    pipeline 0 and layer 2 after gelu (tp 1 | tp 2) in pipeline 1, pipeline 2 whole."""
    return plan_of(8, [PipelinePlan(2, 4, [st([0, 1], 2, 1, (0, 2), ("1st-layernorm", "qkv")),
                                           st([2], 1, 1, (1, 4), ("score", "post-mlp-dropout"))]),
                       PipelinePlan(2, 2, [st([3], 1, 1, (0, 3), ("1st-layernorm", "gelu")),
                                           st([5, 4], 2, 1, (2, 4), ("mlp-gemm-2", "post-mlp-dropout"))]),
                       PipelinePlan(2, 2, [st([6, 7], 1, 2, (0, 4))])])


def test_cut_layers_split_into_parts():
    from eth.layout.params import stage_blocks
    held = stage_blocks(cut())
    assert held[0, 0] == ("embedding", "layer 0", "layer 1:0-2")
    assert held[0, 1] == ("layer 1:2-13", "layer 2:0-11", "layer 2:11-13", "layer 3", "head")
    assert held[1, 0] == ("embedding", "layer 0", "layer 1:0-2", "layer 1:2-13", "layer 2:0-11")
    assert held[1, 1] == ("layer 2:11-13", "layer 3", "head")
    assert held[2, 0] == ("embedding", "layer 0", "layer 1:0-2", "layer 1:2-13", "layer 2:0-11",
                          "layer 2:11-13", "layer 3", "head")
    names = [p.name for p in block_specs(M, "layer 2:11-13")]
    assert names == ["layer 2.fc2.weight", "layer 2.fc2.bias"]


def test_fig5_block_wise_by_hand():
    layout = GradLayout(fig5(), "block")
    # every block: g = lcm(1, 1, 2) = 2; sub-block 0 = tp rank 2 + both dp ranks, with the
    # replicated parameters; sub-block 1 = tp rank 3 + both dp ranks; fused across blocks
    assert [(b.ranks, b.numel) for b in layout.buffers] == [
        ((0, 1, 2), EMB_PART // 2 + EMB_REPL + 4 * (LAYER_PART // 2 + LAYER_REPL) + HEAD_PART // 2 + HEAD_REPL),
        ((0, 1, 3), EMB_PART // 2 + 4 * (LAYER_PART // 2) + HEAD_PART // 2)]
    assert layout.groups() == [(0, 1, 2), (0, 1, 3)]
    # the dp ranks hold both sub-blocks of qkv.weight [24, 8]: rows 0-11 and 12-23
    qkv = next(p for p in layout.buffers[1].pieces if p.spec.name == "layer 2.qkv.weight")
    assert qkv.shape == (12, 8) and (qkv.chunk, qkv.chunks) == (1, 2)
    assert layout.region(0, qkv) == layout.region(1, qkv)
    r = layout.region(0, qkv)
    assert (r.dim, r.piece_start, r.local_start, r.length) == (0, 0, 12, 12)
    r = layout.region(3, qkv)       # tp rank 1 holds exactly this chunk
    assert (r.piece_start, r.local_start, r.length) == (0, 0, 12)
    assert layout.region(2, qkv) is None
    # row-parallel weights are cut along dim 1
    dense = next(p for p in layout.buffers[0].pieces if p.spec.name == "layer 0.dense.weight")
    assert dense.shape == (8, 4) and layout.region(3, dense) is None


def test_fig5_device_and_tensor_wise():
    dev = GradLayout(fig5(), "device")
    total = sum(s.numel for s in all_specs(M))
    assert [(b.ranks, b.numel) for b in dev.buffers] == [((0, 1, 2, 3), total)]   # padded: full size
    # tp rank 1 adds its half of a partitioned parameter, but not the replicated ones
    ln = next(p for p in dev.buffers[0].pieces if p.spec.name == "layer 0.ln1.weight")
    assert dev.contributes(2, ln) and not dev.contributes(3, ln) and dev.region(3, ln) is not None
    ten = GradLayout(fig5(), "tensor")
    assert all(len(b.pieces) == 1 for b in ten.buffers)
    assert sorted({b.ranks for b in ten.buffers}) == [(0, 1, 2), (0, 1, 3)]
    # one collective per tensor shard: 9 partitioned parameters x 2 chunks + 6 replicated per layer
    assert sum(1 for b in ten.buffers if "layer 0." in b.pieces[0].spec.name) == 6 * 2 + 6


@pytest.mark.parametrize("strategy", ["block", "device", "tensor"])
@pytest.mark.parametrize("make", [fig5, mixed, cut])
def test_every_replica_adds_every_element_once(strategy, make):
    """Brute force: mark, per replica, the elements its ranks add into buffers."""
    plan = make()
    layout = GradLayout(plan, strategy, bucket_numel=300)
    replica_of = {}
    for i, pipe in enumerate(plan.pipelines):
        for j, stage in enumerate(pipe.stages):
            for d in range(stage.dp):
                for r in stage.replica(d):
                    replica_of[r] = (i, j, d)
    marks = {}   # (replica, param) -> counts over the full parameter
    for buf in layout.buffers:
        for piece in buf.pieces:
            for rank in buf.ranks:
                region = layout.region(rank, piece)
                if region is None or not layout.contributes(rank, piece):
                    continue
                key = (replica_of[rank], piece.spec.name)
                full = marks.setdefault(key, np.zeros(piece.spec.full_shape, dtype=int))
                if region.dim is None:
                    full += 1
                    continue
                rows = piece.spec.full_shape[region.dim] // piece.chunks
                start = piece.chunk * rows + region.piece_start
                index = [slice(None)] * full.ndim
                index[region.dim] = slice(start, start + region.length)
                full[tuple(index)] += 1
    holders = {}
    for pipe_i, pipe in enumerate(plan.pipelines):
        for j, stage in enumerate(pipe.stages):
            first, last = j == 0, j == len(pipe.stages) - 1
            for spec in all_specs(M):
                b = spec.block
                held = (b == "embedding" and first) or (b == "head" and last) or (
                    b.startswith("layer") and param_ops(M)[spec.name.split(".")[1]]
                    in stage.held_ops(M, int(b.split()[1])))
                if held:
                    for d in range(stage.dp):
                        holders[((pipe_i, j, d), spec.name)] = spec
    assert set(marks) == set(holders)
    assert all((m == 1).all() for m in marks.values())


def test_rank_order_and_tp_rank_are_ascending():
    layout = GradLayout(mixed(), "block")
    # stage ranks [3, 1, 0, 2] at tp 4: tp rank t is the t-th smallest rank
    assert [layout.info[r].tp_rank for r in (0, 1, 2, 3)] == [0, 1, 2, 3]
    assert [layout.info[r].tp_rank for r in (4, 5)] == [0, 1]
    # layer 0: tp 4, tp 2, tp 1 -> g = 4; sub-block 1: rank 1 (tp 4), rank 4 (tp 2: 1 * 2 // 4 = 0), rank 7
    ranks = {b.ranks for b in layout.buffers if "layer 0" in b.blocks}
    assert ranks == {(0, 4, 7), (1, 4, 7), (2, 5, 7), (3, 5, 7)}


def test_buckets_are_cut_at_block_boundaries_and_launch_from_the_last_layer():
    whole = GradLayout(fig5(), "block")
    cut = GradLayout(fig5(), "block", bucket_numel=LAYER_PART // 2 + LAYER_REPL)
    assert len(cut.buffers) == 2 * 6 and all(len(b.blocks) == 1 for b in cut.buffers)
    assert sum(b.numel for b in cut.buffers) == sum(b.numel for b in whole.buffers)
    order = [b.blocks[0] for b in cut.buffers_of(0)]
    assert order[:2] == ["head", "head"] and order[-2:] == ["embedding", "embedding"]
    assert order[2:4] == ["layer 3", "layer 3"]


def test_single_replica_blocks_need_no_collective():
    plan = plan_of(3, [PipelinePlan(4, 8, [st([0, 1], 2, 1, (0, 2)), st([2], 1, 1, (2, 4))])])
    for strategy in ("block", "device", "tensor"):
        layout = GradLayout(plan, strategy)
        assert layout.groups() == []


def test_tp_broadcast_of_replicated_parameters():
    replicated = ["layer 0.ln1.weight", "layer 0.ln1.bias", "layer 0.dense.bias"]
    for strategy in ("block", "tensor"):
        names = GradLayout(fig5(), strategy).tp_broadcast(3)
        assert names[0] == "embedding.pos" and names[1:4] == replicated and len(names) == 1 + 4 * 6 + 2
        assert GradLayout(fig5(), strategy).tp_broadcast(0) == []          # tp 1
    assert GradLayout(fig5(), "device").tp_broadcast(3) == []              # tp ranks participate
    single = plan_of(2, [PipelinePlan(4, 8, [st([0, 1], 2, 1, (0, 4))])])
    assert len(GradLayout(single, "device").tp_broadcast(1)) == 1 + 4 * 6 + 2


def test_zero_shards_partition_each_buffer():
    layout = GradLayout(mixed(), "block")
    for b in layout.buffers:
        shards = [b.shard(r) for r in b.ranks]
        assert shards[0][0] == 0 and shards[-1][1] == b.numel
        assert all(a[1] == c[0] for a, c in zip(shards, shards[1:]))
        assert max(hi - lo for lo, hi in shards) - min(hi - lo for lo, hi in shards) <= len(b.ranks)


def test_cost_model_block_structure_matches_the_layout():
    for make in (fig5, mixed, cut):
        plan = make()
        layout, counted = GradLayout(plan, "block"), {}
        for b in layout.buffers:
            counted[b.ranks] = counted.get(b.ranks, 0) + b.numel
        assert counted == block_groups(plan)


def test_tp_degrees_whose_lcm_does_not_divide_a_dimension_are_refused():
    m = ModelSpec("t6", num_layers=2, hidden=12, heads=6, ffn=48, seq_len=4, vocab=18, dropout=0.0)
    cluster = Cluster.from_dict({"name": "t", "inter_node_gbps": 100,
                                 "nodes": [{"type": "A100", "devices_per_node": 5}]})
    plan = Plan(m, cluster, 4, [PipelinePlan(2, 2, [st([0, 1], 2, 1, (0, 2))]),
                                PipelinePlan(2, 2, [st([2, 3, 4], 3, 1, (0, 2))])])
    # lcm(2, 3) = 6 divides heads 6, ffn 48 and vocab 18: block-wise works
    assert GradLayout(plan, "block").buffers
    m8 = ModelSpec("t8", num_layers=2, hidden=12, heads=6, ffn=48, seq_len=4, vocab=20, dropout=0.0)
    bad = Plan(m8, cluster, 4, plan.pipelines)
    with pytest.raises(PlanError, match="not divisible by lcm 6 .* use --grad-sync device"):
        GradLayout(bad, "block")
    assert GradLayout(bad, "device").buffers
