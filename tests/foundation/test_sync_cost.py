"""Gradient-sync cost and model-state bytes by hand (Eq. 6 on the block structure).

Model t4: hidden 8, 4 heads, ffn 32, seq 4, vocab 16, 4 layers.  A layer has 824
tp-partitioned parameter elements (qkv 192 + 24, dense 64, fc1 256 + 32, fc2 256) and
48 tp-replicated ones (two layernorms 32, dense and fc2 biases 16); the embedding
128 (word) + 32 (position, replicated); the head 128 (output) + 16 (final layernorm).
One node at 80 Gbit/s = 1e7 bytes/ms, so Eq. 6 is 2 x bytes x (N - 1) / N / 1e7 ms.
"""
import pytest

from eth.spec.cluster import Cluster
from eth.cost.model import CostModel
from eth.spec.model import ModelSpec
from eth.spec.plan import PipelinePlan, Plan, StagePlan
from eth.spec.precision import TrainSetup
from eth.profiles.db import ProfileDB
from eth.cost.sync import block_groups, group_sync_bytes, rank_state_bytes

M = ModelSpec("t4", num_layers=4, hidden=8, heads=4, ffn=32, seq_len=4, vocab=16, dropout=0.0)
FP32_Z1 = TrainSetup("fp32", 1, "fp32")


def cluster(n):
    return Cluster.from_dict({"name": "t", "inter_node_gbps": 100, "intra_node_gbps": 80,
                              "nodes": [{"type": "A100", "devices_per_node": n}]})


def st(ranks, tp, dp, layers):
    return StagePlan(list(ranks), "A100", tp, dp, tuple(layers))


def fig5():
    """p0: dp 2 (ranks 0, 1) holds everything; p1: tp 2 (ranks 2, 3) holds everything."""
    return Plan(M, cluster(4), 8, [PipelinePlan(2, 4, [st([0, 1], 1, 2, (0, 4))]),
                                   PipelinePlan(2, 4, [st([2, 3], 2, 1, (0, 4))])])


def eq6(nbytes, n):
    return 2 * nbytes * (n - 1) / n / 1e7


def cost_model(plan, setup=TrainSetup()):
    db = ProfileDB()
    db.ensure(M, plan.cluster.types.values())
    return CostModel(M, plan.cluster, db, setup)


def test_allreduce_of_a_tp2_stage_counts_replicated_parameters_once():
    plan = fig5()
    ar = cost_model(plan).stage_allreduce_ms(plan.pipelines)
    # N = 3 replicas (2 dp + 1 tp group).  tp 1 stage: whole blocks, fp32 gradients
    layer1, emb1, head1 = (824 + 48) * 4, (128 + 32) * 4, (128 + 16) * 4
    assert ar[0][0] == pytest.approx(4 * eq6(layer1, 3) + eq6(emb1, 3) + eq6(head1, 3))
    # tp 2 stage, tp rank 0: half the partitioned parameters + all replicated ones
    layer2, emb2, head2 = (412 + 48) * 4, (64 + 32) * 4, (64 + 16) * 4
    assert ar[1][0] == pytest.approx(4 * eq6(layer2, 3) + eq6(emb2, 3) + eq6(head2, 3))
    # not params / tp: that would be 436 elements per layer instead of 460
    assert ar[1][0] > 4 * eq6(436 * 4, 3) + eq6(80 * 4, 3) + eq6(72 * 4, 3)


def test_allreduce_with_tp_4_2_1_and_different_layer_splits():
    p0 = PipelinePlan(2, 4, [st([0, 1, 2, 3], 4, 1, (0, 4))])
    p1 = PipelinePlan(2, 2, [st([4, 5], 2, 1, (0, 1)), st([6], 1, 1, (1, 4))])
    plan = Plan(M, cluster(7), 8, [p0, p1])
    ar = cost_model(plan).stage_allreduce_ms(plan.pipelines)
    # every block has N = 2 replicas
    assert ar[0][0] == pytest.approx(4 * eq6((206 + 48) * 4, 2) + eq6((32 + 32) * 4, 2) + eq6((32 + 16) * 4, 2))
    assert ar[1][0] == pytest.approx(eq6((412 + 48) * 4, 2) + eq6((64 + 32) * 4, 2))
    assert ar[1][1] == pytest.approx(3 * eq6(872 * 4, 2) + eq6(144 * 4, 2))


def test_zero_moves_gradients_by_reduce_scatter_and_bf16_weights_by_all_gather():
    plan = fig5()
    ar0 = cost_model(plan, TrainSetup("bf16", 0, "fp32")).stage_allreduce_ms(plan.pipelines)
    ar1 = cost_model(plan, TrainSetup("bf16", 1, "fp32")).stage_allreduce_ms(plan.pipelines)
    # all-reduce: 2 x 4 bytes x (N-1)/N; reduce-scatter of 4 + all-gather of 2: 6 x (N-1)/N
    assert ar1[0][0] == pytest.approx(ar0[0][0] * 6 / 8)
    layer = (412 + 48) * 3   # Eq. 6 with Gra = (g + w) / 2 = 3 bytes per element
    assert ar1[1][0] == pytest.approx(4 * eq6(layer, 3) + eq6(96 * 3, 3) + eq6(80 * 3, 3))


def test_groups_and_state_bytes_by_hand():
    plan = fig5()
    # sub-block 0: tp rank 0 (rank 2) + the dp ranks, carries the replicated parameters
    b0 = (64 + 32) + 4 * (412 + 48) + (64 + 16)     # 2016
    b1 = 64 + 4 * 412 + 64                          # 1776
    assert block_groups(plan) == {(0, 1, 2): b0, (0, 1, 3): b1}
    # ZeRO 1, fp32: padded to 3 x 672 and 3 x 592, reduce-scatter + all-gather of 4 bytes each
    assert group_sync_bytes(plan, FP32_Z1) == {(0, 1, 2): 3 * 672 * 8, (0, 1, 3): 3 * 592 * 8}
    assert group_sync_bytes(plan, TrainSetup("fp32", 0, "fp32")) == {(0, 1, 2): b0 * 4, (0, 1, 3): b1 * 4}
    state = rank_state_bytes(plan, FP32_Z1)
    every = 160 + 4 * 872 + 144                     # 3792 elements
    assert state[0] == {"weights": every * 4, "grads": 3 * (672 + 592) * 4, "optimizer": (672 + 592) * 12}
    # rank 2 holds sub-block 0 only and is its third participant: shard [1344, 2016)
    assert state[2] == {"weights": b0 * 4, "grads": 3 * 672 * 4, "optimizer": 672 * 12}
    # rank 3 (tp rank 1) holds as many weights (its half + the replicated ones) but sub-block 1
    assert state[3] == {"weights": b0 * 4, "grads": 3 * 592 * 4, "optimizer": 592 * 12}
    z2 = rank_state_bytes(plan, TrainSetup("bf16", 2, "fp32"))
    assert z2[2] == {"weights": b0 * 2, "grads": 672 * 4, "optimizer": 672 * 12}
    z0 = rank_state_bytes(plan, TrainSetup("bf16", 0, "bf16"))
    assert z0[3] == {"weights": b0 * 2, "grads": b1 * 2, "optimizer": b1 * 12}


def test_plan_memory_with_zero_uses_the_exact_participants():
    plan = fig5()
    base = cost_model(plan, TrainSetup("bf16", 1, "fp32"))
    ev = base.evaluate(plan)
    # stage search estimate for the tp 2 stage: N >= dp = 1, i.e. 2 + 4 + 12 per element;
    # evaluate(): 3 participants per buffer -> the exact bytes of rank 2 (weights + padded
    # gradients + a third of the optimizer state)
    cost = base.pipeline_costs(plan.pipelines[1])[0]
    estimate = cost.params * 18
    exact = 2016 * 2 + 3 * 672 * 4 + 672 * 12
    got = ev["pipelines"][1]["costs"][0].memory_bytes
    assert got == pytest.approx(cost.memory_bytes - estimate + exact)


def test_allreduce_segments_match_a_layer_by_layer_sum_on_random_plans():
    """stage_allreduce_ms sums Eq. 6 over segments of layers with one holder set; the same
    sum layer by layer (every pipeline's holder, all their ranks' slowest link), on random
    plans over two types on four nodes (intra-node, inter-node and inter-type links)."""
    import random

    from eth.cost.equations import eq6_allreduce_ms
    from eth.cost.sync import block_split

    model = ModelSpec("t8", num_layers=8, hidden=8, heads=4, ffn=32, seq_len=4, vocab=16, dropout=0.0)
    two = Cluster.from_dict({"name": "two", "inter_node_gbps": 100, "inter_type_gbps": 25, "intra_node_gbps": 80,
                             "nodes": [{"type": "A100", "devices_per_node": 4, "count": 2},
                                       {"type": "V100", "devices_per_node": 4, "count": 2}]})
    by_type = {"A100": list(range(8)), "V100": list(range(8, 16))}
    rng = random.Random(3)
    for _ in range(40):
        free = {t: rng.sample(r, len(r)) for t, r in by_type.items()}
        pipes = []
        for _ in range(rng.randint(1, 3)):
            cuts = sorted(rng.sample(range(1, 8), rng.randint(0, 3)))
            stages = []
            for a, b in zip([0] + cuts, cuts + [8]):
                t = rng.choice([t for t in free if len(free[t]) >= 2] or ["A100"])
                if len(free[t]) < 2:
                    break
                tp = rng.choice([1, 2])
                ranks = [free[t].pop() for _ in range(2)]
                stages.append(StagePlan(ranks, t, tp, 2 // tp, (a, b)))
            else:
                pipes.append(PipelinePlan(2, 2, stages))
        if not pipes:
            continue
        plan = Plan(model, two, 2 * len(pipes), pipes)
        db = ProfileDB()
        db.ensure(model, two.types.values())
        cost = CostModel(model, two, db)
        per = cost.setup.sync_bytes_per_element()

        def block(name, holders, tp):
            part, repl = block_split(model, name)
            return eq6_allreduce_ms((part / tp + repl) * per, sum(h.dp for h in holders),
                                    two.link_gbps([r for h in holders for r in h.ranks]))

        ar = cost.stage_allreduce_ms(plan.pipelines)
        for i, p in enumerate(plan.pipelines):
            for j, s in enumerate(p.stages):
                want = sum(block("layer 0", [next(h for h in q.stages if h.layers[0] <= l < h.layers[1])
                                             for q in plan.pipelines], s.tp) for l in range(*s.layers))
                if j == 0:
                    want += block("embedding", [q.stages[0] for q in plan.pipelines], s.tp)
                if j == len(p.stages) - 1:
                    want += block("head", [q.stages[-1] for q in plan.pipelines], s.tp)
                assert ar[i][j] == pytest.approx(want, rel=1e-12), (i, j)
