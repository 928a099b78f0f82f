"""Small heterogeneous plans for the runtime tests (tiny fp32 GPT, dropout 0, gbs 16)."""
from __future__ import annotations

from eth.spec.cluster import Cluster
from eth.spec.model import get_model
from eth.spec.plan import PipelinePlan, Plan, StagePlan

GBS = 16


def cluster(n: int) -> Cluster:
    return Cluster.from_dict({"name": f"test-{n}", "inter_node_gbps": 100,
                              "nodes": [{"type": "A100", "devices_per_node": n}]})


def stage(ranks, tp, dp, layers, recompute=None, ops=None) -> StagePlan:
    return StagePlan(list(ranks), "A100", tp, dp, tuple(layers), dict(recompute or {}), ops=ops)


def make(n: int, pipelines: list[PipelinePlan], gbs: int = GBS) -> Plan:
    return Plan(model=get_model("tiny"), cluster=cluster(n), gbs=gbs, pipelines=pipelines)


def two_pipelines_different_depth() -> Plan:
    """(a) pipeline 0: one stage; pipeline 1: two stages with an uneven layer split."""
    return make(3, [PipelinePlan(2, 8, [stage([0], 1, 1, (0, 4))]),
                    PipelinePlan(2, 8, [stage([1], 1, 1, (0, 1)), stage([2], 1, 1, (1, 4))])])


def tp_stage_next_to_dp_stage() -> Plan:
    """(b) one pipeline: (tp 1, dp 1) -> (tp 2, dp 1) -> (tp 1, dp 2): a tp group receives
    activations and gradients and sends both to a dp pair; recompute on the tp stage."""
    recompute = {"qkv": 1, "softmax": 1, "attn-dense": 1, "gelu": 1, "post-mlp-dropout": 1}
    return make(5, [PipelinePlan(4, 16, [stage([0], 1, 1, (0, 1)),
                                         stage([1, 2], 2, 1, (1, 2), recompute),
                                         stage([3, 4], 1, 2, (2, 4))])])


def uneven_lbs_different_mbs() -> Plan:
    """(c) lbs 10 and 6 of 16, mbs 5 and 2; the second pipeline's stage has dp 2."""
    return make(4, [PipelinePlan(5, 10, [stage([0], 1, 1, (0, 3)), stage([1], 1, 1, (3, 4))]),
                    PipelinePlan(2, 6, [stage([2, 3], 1, 2, (0, 4))])])


def same_layers_different_tp() -> Plan:
    """(d) pipeline 0 with tp 2 and pipeline 1 with tp 1 hold the same layers; recompute on."""
    everything = {op: 4 for op in ("1st-layernorm", "score", "context", "mlp-gemm-1", "mlp-gemm-2")}
    return make(3, [PipelinePlan(4, 8, [stage([0, 1], 2, 1, (0, 4), everything)]),
                    PipelinePlan(2, 8, [stage([2], 1, 1, (0, 4))])])


def boundaries_inside_layers() -> Plan:
    """(f) pipeline 0 cut inside attention (layer 1 after softmax: x, qkv and the
    probabilities cross, the last two sharded by tp) and inside the MLP (layer 2 after
    mlp-gemm-1: x2 and f1 cross), tp 1 -> tp 2 -> (tp 1, dp 2), recompute on every stage
    (runs ending at and starting after a boundary); pipeline 1 holds whole layers, so
    the cut layers' parameter blocks are reduced part by part."""
    return make(6, [PipelinePlan(4, 8, [stage([0], 1, 1, (0, 2), {"qkv": 2, "score": 1, "softmax": 1},
                                              ("1st-layernorm", "softmax")),
                                        stage([1, 2], 2, 1, (1, 3), {"attn-dropout": 1, "context": 2,
                                                                     "mlp-gemm-1": 1}, ("attn-dropout", "mlp-gemm-1")),
                                        stage([3, 4], 1, 2, (2, 4), {"gelu": 2, "mlp-gemm-2": 1},
                                              ("gelu", "post-mlp-dropout"))]),
                    PipelinePlan(2, 8, [stage([5], 1, 1, (0, 4))])])


def tp_dp_stage_to_uneven_dp3() -> Plan:
    """(e) one pipeline, gbs 18, mbs 6, 3 micro-batches: (tp 2, dp 2) on 4 ranks ->
    (tp 1, dp 3): samples 3 | 3 -> 2 | 2 | 2, so replica 0's second sample and
    replica 1's first go to one dp 3 rank (uneven overlaps 2+1, 1+2); recompute of
    multi-op runs on both stages.  7 ranks: a tp 2 x dp 2 stage and a dp 3 stage need
    4 + 3, and a dp 2 -> dp 3 boundary is the only uneven one a 2-rank rest allows
    none of."""
    first = {"score": 2, "softmax": 2, "attn-dropout": 2, "context": 1, "mlp-gemm-1": 1, "gelu": 1}
    second = {"2nd-layernorm": 2, "mlp-gemm-1": 2, "gelu": 2, "mlp-gemm-2": 1}
    return make(7, [PipelinePlan(6, 18, [stage([0, 1, 2, 3], 2, 2, (0, 2), first),
                                         stage([4, 5, 6], 1, 3, (2, 4), second)])], gbs=18)


def too_large_gbs_sum() -> Plan:
    """Valid as a plan (sum(lbs) 16 >= gbs 12) but the runtime requires equality."""
    return make(2, [PipelinePlan(2, 8, [stage([0], 1, 1, (0, 4))]),
                    PipelinePlan(2, 8, [stage([1], 1, 1, (0, 4))])], gbs=12)


def large_1024() -> Plan:
    """1024 ranks: 4 A100 pipelines (4 stages, tp 8 x dp 4) and 4 RTX3090 pipelines
    (8 stages, tp 4 x dp 4) of GPT-3 1.3B, lbs 160 / 96 (gbs 1024)."""
    from eth.spec.model import get_model

    c = Cluster.from_dict({"name": "big", "inter_node_gbps": 200,
                           "nodes": [{"type": "A100", "devices_per_node": 8, "count": 64},
                                     {"type": "RTX3090", "devices_per_node": 8, "count": 64}]})
    model, pipes, rank = get_model("gpt3-1.3b"), [], 0
    for kind, n_stages, tp, lbs in (("A100", 4, 8, 160), ("RTX3090", 8, 4, 96)):
        per = model.num_layers // n_stages
        for _ in range(4):
            stages = []
            for j in range(n_stages):
                ranks = list(range(rank, rank + tp * 4))
                rank += tp * 4
                stages.append(StagePlan(ranks, kind, tp, 4, (j * per, (j + 1) * per)))
            pipes.append(PipelinePlan(4, lbs, stages))
    return Plan(model=model, cluster=c, gbs=1024, pipelines=pipes)


def tp_1_2_4_same_layers() -> Plan:
    """(f) three pipelines hold every layer at tp 4, 2 and 1; the tp 4 stage lists its
    ranks out of order ([3, 1, 0, 2]) and the tp 2 one as [5, 4].  Every block has 3
    replicas and g = lcm(4, 2, 1) = 4 sub-blocks; lbs 8 / 4 / 4, mbs 2 / 2 / 4."""
    return make(7, [PipelinePlan(2, 8, [stage([3, 1, 0, 2], 4, 1, (0, 4))]),
                    PipelinePlan(2, 4, [stage([5, 4], 2, 1, (0, 4))]),
                    PipelinePlan(4, 4, [stage([6], 1, 1, (0, 4))])])


def different_splits_with_dp() -> Plan:
    """(g) two pipelines with different splits inside layers, non-contiguous unordered tp
    ranks and a dp 2 stage: p0 = tp 2 [5, 1] layer 0 and layer 1 through softmax -> dp 2
    [2, 3] from layer 1's attn-dropout (qkv and the probabilities all-gathered by the tp
    pair, sliced by samples for the dp pair); p1 = [4] layers 0-2 and layer 3 through
    mlp-gemm-1 -> tp 2 [6, 0] from layer 3's gelu (the MLP activation cut by the tp pair).
    Layers 1 and 3 are cut into parameter blocks at both pipelines' boundaries; layer 2
    is held by 3 ranks; lbs 10 / 6, mbs 2 / 3."""
    return make(7, [PipelinePlan(2, 10, [stage([5, 1], 2, 1, (0, 2), ops=("1st-layernorm", "softmax")),
                                         stage([2, 3], 1, 2, (1, 4), ops=("attn-dropout", "post-mlp-dropout"))]),
                    PipelinePlan(3, 6, [stage([4], 1, 1, (0, 4), ops=("1st-layernorm", "mlp-gemm-1")),
                                        stage([6, 0], 2, 1, (3, 4), ops=("gelu", "post-mlp-dropout"))])])
