"""Cost model against hand-computed values on a tiny model with a flat profile.

Flat profile: every op takes fwd = mbs ms and bwd = 2*mbs ms (conftest.flat_profile).
TINY layer: 872 parameters, 1152 saved activation bytes per sample (test_model.py).
"""
from types import SimpleNamespace as NS

import pytest

from _foundation_data import RESERVED
from eth.cost.equations import eq1_pipeline_ms, eq5_end_times, eq6_allreduce_ms
from eth.cost.model import CostModel
from eth.spec.model import recompute_runs
from eth.spec.model import LAYER_OPS
from eth.spec.precision import TrainSetup
from eth.profiles.db import COLLECTIVE_ALPHA_MS

P2P_64B = 64 / (10e9 / 8 / 1e3) + COLLECTIVE_ALPHA_MS   # one 64-byte activation over a 10 Gbit/s link


def test_first_stage_time_and_memory(tiny, cpu_cluster, flat_db):
    cm = CostModel(tiny, cpu_cluster, flat_db)
    c = cm.stage_cost("cpu", tp=1, dp=1, layers=(0, 2), mbs=1, stage_index=0, num_stages=2,
                      num_microbatches=4)
    assert c.fwd_ms == pytest.approx(2 * 13 * 1 + 1 + P2P_64B)     # 2 layers + embedding + send
    assert c.bwd_ms == pytest.approx(2 * 13 * 2 + 2)               # first stage sends no gradient
    assert c.params == 2 * 872 + (16 * 8 + 4 * 8)                  # + word and position embedding
    act = 2 * 1152 + 4 * 8                                         # + token ids (int64)
    assert c.act_bytes == act and c.inflight == 2
    # default setup: bf16 weights 2 + fp32 gradients 4 + fp32 main weights and Adam 12;
    # + the backward's transient (test_backward_transient_is_one_ops_gradients_less_freed): 848
    assert c.memory_bytes == pytest.approx(c.params * 18 + 2 * act + 848 + RESERVED)
    assert c.fits and c.capacity_bytes == 4e9


def test_last_stage_dp2_and_inflight_capped_by_microbatches(tiny, cpu_cluster, flat_db):
    cm = CostModel(tiny, cpu_cluster, flat_db, TrainSetup("fp32", zero_stage=1))
    c = cm.stage_cost("cpu", tp=1, dp=2, layers=(2, 4), mbs=4, stage_index=1, num_stages=2,
                      num_microbatches=1)
    # each replica sees mbs/dp = 2 samples: every op 2 ms forward, 4 ms backward
    assert c.fwd_ms == pytest.approx(2 * 13 * 2 + 2 * 2)           # + final-layernorm, head+loss
    assert c.bwd_ms == pytest.approx(2 * 13 * 4 + 2 * 4 + 2 * 64 / (10e9 / 8 / 1e3) + COLLECTIVE_ALPHA_MS)
    assert c.inflight == 1
    assert c.params == 2 * 872 + 16 + 16 * 8
    # ZeRO 1 in the stage search: optimizer state over N >= dp = 2 holders: 4 + 4 + 12 / 2;
    # the larger of the activations and the optimizer step's all-gather of the fp32 weights
    # (4 bytes per parameter, here larger than 1 in-flight micro-batch of this tiny stage
    # + the backward's transient: head+loss's input 128 + output 32 + weights 256 = 416)
    assert c.params * 4 > c.act_bytes + 416
    assert c.memory_bytes == pytest.approx(c.params * 14 + c.params * 4 + RESERVED)
    zero0 = CostModel(tiny, cpu_cluster, flat_db, TrainSetup("fp32", zero_stage=0)).stage_cost(
        "cpu", tp=1, dp=2, layers=(2, 4), mbs=4, stage_index=1, num_stages=2, num_microbatches=1)
    assert zero0.memory_bytes == pytest.approx(c.params * 20 + c.act_bytes + 416 + RESERVED)   # no gather


def test_recompute_frees_runs_but_keeps_their_input(tiny, cpu_cluster, flat_db):
    cm = CostModel(tiny, cpu_cluster, flat_db)
    base = cm.stage_cost("cpu", 1, 1, (0, 4), 1, num_stages=1)
    rc = {"score": 2, "softmax": 2, "attn-dropout": 2, "context": 2, "gelu": 1}
    c = cm.stage_cost("cpu", 1, 1, (0, 4), 1, rc, num_stages=1)
    # run score..context: (q,k 128 + probs 64 + mask 0 + v 64) - score's input, the fused
    # qkv output (192) = the probabilities, 64 per layer, 2 layers;
    # gelu alone: 256 - its input 256 = 0.  Recompute time = 9 op-layers x 1 ms.
    assert base.act_bytes - c.act_bytes == 2 * 64
    assert c.recompute_ms == 9.0 and c.bwd_ms == pytest.approx(base.bwd_ms + 9.0)
    assert recompute_runs({"softmax", "score", "gelu"}) == [["score", "softmax"], ["gelu"]]


def _transient(c, cm):
    """Memory of a ZeRO-0 stage above its model states, in-flight activations and reserve."""
    return c.memory_bytes - c.params * cm.setup.state_bytes_per_param(1) - c.inflight * c.act_bytes - RESERVED


def test_backward_transient_is_one_ops_gradients_less_freed(tiny, cpu_cluster, flat_db):
    """Per op (mbs 1, TINY) input + output + weight bytes, less the saved activations of
    the ops backpropagated before it, scanned in backward order; counted once, whatever
    the in-flight micro-batches."""
    cm = CostModel(tiny, cpu_cluster, flat_db)
    middle = cm.stage_cost("cpu", 1, 1, (1, 3), 1, stage_index=1, num_stages=3, num_microbatches=4)
    # post-mlp-dropout 128 + 64 + 0 = 192 (nothing freed yet); mlp-gemm-2 256 + 64 + 528
    # = 848 (freed 0); gelu 512 - 256 freed = 256; mlp-gemm-1 896 - 512 = 384; the rest less
    assert middle.inflight == 2 and _transient(middle, cm) == 848
    last = cm.stage_cost("cpu", 1, 1, (3, 4), 1, stage_index=2, num_stages=3, num_microbatches=4)
    # head+loss 64 + 16 + 256 = 336 (freed 0, then its 320); final-layernorm 160 - 320 < 0
    # (then 416 freed); post-mlp-dropout 192 - 416 < 0; mlp-gemm-2 848 - 416 = 432; gelu
    # 512 - 672 < 0; mlp-gemm-1 896 - 928 < 0
    assert last.inflight == 1 and _transient(last, cm) == 432


def test_recomputed_run_is_held_again_in_the_backward(tiny, cpu_cluster, flat_db):
    """The largest recomputed run's freed bytes come back once (one layer, one
    micro-batch at a time), on top of the backward transient of 848."""
    cm = CostModel(tiny, cpu_cluster, flat_db)
    kw = dict(stage_index=0, num_stages=2, num_microbatches=4)   # 2 in flight
    attn = cm.stage_cost("cpu", 1, 1, (1, 3), 1, {"score": 2, "softmax": 2, "attn-dropout": 2, "context": 2,
                                                  "gelu": 1}, **kw)
    # score..context frees the probs 64 and keeps qkv (largest), gelu keeps its input: 0
    assert _transient(attn, cm) == 848 + 64
    full = cm.stage_cost("cpu", 1, 1, (1, 3), 1, {op: 2 for op in LAYER_OPS}, **kw)
    # the whole layer is one run: 1152 - the layer input 64 = 1088, held once, not per micro-batch
    assert full.act_bytes == 2 * 64 and _transient(full, cm) == 848 + 1088
    assert full.memory_bytes - cm.stage_cost("cpu", 1, 1, (1, 3), 1, **kw).memory_bytes == 1088 - 2 * 2 * 1088
    # recomputed in the first layer only: the backward reaches it after the second layer
    # freed its 1152 bytes, more than the 1088 it holds again
    one = cm.stage_cost("cpu", 1, 1, (1, 3), 1, {op: 1 for op in LAYER_OPS}, **kw)
    assert one.act_bytes == 1152 + 64 and _transient(one, cm) == 848
    assert cm.remat_bytes(cm.profiles.layer_costs("cpu", tiny, 1, 1)[0], {op: 1 for op in LAYER_OPS},
                                  2) == 0
    # three layers, gelu..mlp-gemm-2 recomputed in all, the whole layer in the first: the
    # whole layer is reached after two layers of 1152 - (256 + 256 - 256) = 896 each
    ops = cm.profiles.layer_costs("cpu", tiny, 1, 1)[0]
    mixed = {op: 1 for op in LAYER_OPS} | {"gelu": 3, "mlp-gemm-2": 3}
    assert cm.remat_bytes(ops, mixed, 3) == 256


def test_tp_adds_collectives(tiny, cpu_cluster, flat_db):
    cm = CostModel(tiny, cpu_cluster, flat_db)
    one = cm.stage_cost("cpu", 1, 1, (0, 4), 1, num_stages=1)
    two = cm.stage_cost("cpu", 2, 1, (0, 4), 1, num_stages=1, ranks=[0, 1])
    ar = 2 * (1 / 2) * 64 / (10e9 / 8 / 1e3) + 2 * COLLECTIVE_ALPHA_MS   # ring all-reduce, 2 ranks
    ce = 2 * (1 / 2) * 16 / (10e9 / 8 / 1e3) + 2 * COLLECTIVE_ALPHA_MS   # 16-byte cross-entropy sums
    # forward: 2 per layer + embedding + 3 cross-entropy; backward: 2 per layer + head input-grad
    assert two.fwd_ms - one.fwd_ms == pytest.approx(9 * ar + 3 * ce)
    assert two.bwd_ms - one.bwd_ms == pytest.approx(9 * ar)
    assert two.comm_ms == pytest.approx(18 * ar + 3 * ce)
    assert two.params < one.params


def test_eq1_eq5_eq6_by_hand():
    costs = [NS(fwd_ms=1.0, bwd_ms=2.0, total_ms=3.0), NS(fwd_ms=2.0, bwd_ms=3.0, total_ms=5.0)]
    assert eq1_pipeline_ms(costs, batch=8, mbs=2) == 8 + 5 * 3
    # head = (1 + 2) + 5 * (4 - 1) = 18; Te^0 = 18 + 2 + 3 + 0.5; Te^1 = 18 + 3 + 0.25
    assert eq5_end_times(costs, lbs=8, mbs=2, ar_ms=[0.5, 0.25]) == [23.5, 21.25]
    assert eq5_end_times(costs, lbs=0, mbs=2) == [0.0, 0.0]
    assert eq6_allreduce_ms(1e6, 4, 8) == pytest.approx(1.5)     # 8 Gbit/s = 1e6 B/ms
    assert eq6_allreduce_ms(1e6, 1, 8) == 0.0


def _pipes(tiny):
    st = lambda ranks, tp, dp, layers: NS(ranks=ranks, tp=tp, dp=dp, layers=layers, device_type="cpu",
                                          recompute={})
    p0 = NS(mbs=2, lbs=6, stages=[st([0, 1], 1, 2, (0, 4))])
    p1 = NS(mbs=1, lbs=2, stages=[st([2], 1, 1, (0, 3)), st([3], 1, 1, (3, 4))])
    return p0, p1


def test_stage_allreduce_by_hand(tiny, cpu_cluster, flat_db):
    cm = CostModel(tiny, cpu_cluster, flat_db)
    p0, p1 = _pipes(tiny)
    ar = cm.stage_allreduce_ms([p0, p1])
    g = lambda params, n: eq6_allreduce_ms(params * 4, n, 10)  # fp32 grads, one node: 10 Gbit/s
    # every layer is held by p0 (dp 2) and one stage of p1 (dp 1): N = 3
    emb, head = 16 * 8 + 4 * 8, 16 * 8 + 2 * 8
    assert ar[0][0] == pytest.approx(4 * g(872, 3) + g(emb, 3) + g(head, 3))
    assert ar[1][0] == pytest.approx(3 * g(872, 3) + g(emb, 3))
    assert ar[1][1] == pytest.approx(g(872, 3) + g(head, 3))


def test_evaluate_uses_eq5_with_allreduce(tiny, cpu_cluster, flat_db):
    """objective "eq5": the paper's Eq. 5 with the stage's own AR_i^j; "blocks" (the
    default): each block after its slowest holder, one after another on a stage's link
    (eth.cost.equations.synced_end_times); both plus the optimizer step streamed through
    memory (no measured optimizer time in this profile)."""
    p0, p1 = _pipes(tiny)
    plan = NS(pipelines=[p0, p1])
    paper = CostModel(tiny, cpu_cluster, flat_db, objective="eq5", optimizer_passes=0)
    ev = paper.evaluate(plan)
    ar = paper.stage_allreduce_ms([p0, p1])
    c0, c1 = paper.pipeline_costs(p0), paper.pipeline_costs(p1)
    assert ev["pipelines"][0]["end_ms"] == pytest.approx(eq5_end_times(c0, 6, 2, ar[0]))
    assert ev["iteration_ms"] == max(pp["pipeline_ms"] for pp in ev["pipelines"])
    assert ev["feasible"]
    # blocks: emb+L0-2 on (P0 S0, P1 S0), L3+head on (P0 S0, P1 S1); P1 is done first, so
    # both blocks wait for P0 S0, whose link carries both of its shares one after the other
    cm = CostModel(tiny, cpu_cluster, flat_db, optimizer_passes=0)
    blocks = cm.sync_blocks([p0, p1])
    assert sorted(b.holders for b in blocks) == [((0, 0), (1, 0)), ((0, 0), (1, 1))]
    e0, e1 = eq5_end_times(c0, 6, 2), eq5_end_times(c1, 2, 1)
    assert max(e1) < e0[0]
    got = cm.evaluate(plan)
    own = [dict(zip(b.holders, b.holder_ms)) for b in blocks]
    assert got["iteration_ms"] == pytest.approx(e0[0] + sum(o[0, 0] for o in own))
    assert got["iteration_ms"] == pytest.approx(ev["iteration_ms"])        # P0's own shares: the same
    late = max(b.duration_ms for b in blocks)      # a P1 stage ends with its block, not at its own end + AR
    assert got["pipelines"][1]["end_ms"][1] >= e0[0] + min(o[0, 0] for o in own) - 1e-9
    assert got["pipelines"][1]["end_ms"][1] > ev["pipelines"][1]["end_ms"][1] and late > 0
    # the optimizer step: params x the bytes a fused AdamW streams / memory bandwidth
    with_opt = CostModel(tiny, cpu_cluster, flat_db).evaluate(plan)
    bw = cpu_cluster.types["cpu"].mem_bw_gbs * 1e6
    step = c0[0].params * (4 + 2 * 12 + 2) / bw       # fused AdamW, bf16 weights, fp32 main copy
    assert with_opt["pipelines"][0]["end_ms"][0] == pytest.approx(got["pipelines"][0]["end_ms"][0] + step)
    with pytest.raises(Exception, match="objective must be one of blocks, eq5, got 'eq7'"):
        CostModel(tiny, cpu_cluster, flat_db, objective="eq7")


def test_boundary_sends_use_the_link_to_each_neighbour(tiny, flat_db):
    from eth.spec.cluster import Cluster
    two_nodes = Cluster.from_dict({"inter_node_gbps": 1, "intra_node_gbps": 100,
                                   "nodes": [{"type": "cpu", "devices_per_node": 2, "count": 2}]})
    cm = CostModel(tiny, two_nodes, flat_db)
    st = lambda ranks, layers: NS(ranks=ranks, tp=1, dp=1, layers=layers, device_type="cpu", recompute={})
    pipe = NS(mbs=1, lbs=4, stages=[st([0], (0, 1)), st([1], (1, 2)), st([2], (2, 4))])
    c = cm.pipeline_costs(pipe)
    send = lambda gbps: 64 / (gbps * 1e9 / 8 / 1e3) + COLLECTIVE_ALPHA_MS
    assert (c[0].send_fwd_ms, c[0].send_bwd_ms) == (pytest.approx(send(100)), 0.0)
    assert c[1].send_fwd_ms == pytest.approx(send(1)) and c[1].send_bwd_ms == pytest.approx(send(100))
    assert (c[2].send_fwd_ms, c[2].send_bwd_ms) == (0.0, pytest.approx(send(1)))
    assert c[2].bwd_ms == pytest.approx(1 * 13 * 2 * 2 + 2 + 2 + send(1))


def test_parameter_count_uses_the_profile_element_size(tiny, cpu_cluster):
    from _foundation_data import flat_profile
    from eth.profiles.db import DeviceProfile, ProfileDB
    data = flat_profile()
    for e in data["models"][0]["entries"]:               # an fp32 profile: 4 bytes per weight
        for vals in e["ops"].values():
            vals[2] *= 2
    data["provenance"] = {"dtype_bytes": 4}
    fp32 = CostModel(tiny, cpu_cluster, ProfileDB({"cpu": DeviceProfile(data)}))
    half = CostModel(tiny, cpu_cluster, ProfileDB({"cpu": DeviceProfile(flat_profile())}))
    a = fp32.stage_cost("cpu", 1, 1, (0, 4), 1)
    b = half.stage_cost("cpu", 1, 1, (0, 4), 1)
    assert a.params == b.params == 4 * 872 + 160 + 144
    # activations travel in the profiled dtype too: 4-byte elements double the boundary send
    send = fp32.stage_cost("cpu", 1, 1, (0, 2), 1, num_stages=2).send_fwd_ms
    assert send == pytest.approx(128 / (10e9 / 8 / 1e3) + COLLECTIVE_ALPHA_MS)


def test_measured_collective_tables_apply_inside_a_node(tiny):
    from _foundation_data import flat_profile
    from eth.spec.cluster import Cluster
    from eth.profiles.db import DeviceProfile, ProfileDB
    data = flat_profile()
    data["collectives"] = {"all_reduce": {"2": [[1, 0.5], [1000, 0.5]]}, "p2p": {"2": [[1, 0.25], [1000, 0.25]]}}
    db = ProfileDB({"cpu": DeviceProfile(data)})
    two_nodes = Cluster.from_dict({"inter_node_gbps": 1, "nodes": [{"type": "cpu", "devices_per_node": 2, "count": 2}]})
    cm = CostModel(tiny, two_nodes, db)
    st = lambda ranks, tp, layers: NS(ranks=ranks, tp=tp, dp=1, layers=layers, device_type="cpu", recompute={})
    c = cm.pipeline_costs(NS(mbs=1, lbs=2, stages=[st([0, 1], 2, (0, 2)), st([2, 3], 2, (2, 4))]))
    # tp groups {0,1} and {2,3} are inside a node: the table's 0.5 ms per all-reduce;
    # the stage boundary 0 -> 2 crosses nodes: alpha-beta at 1 Gbit/s
    assert c[0].fwd_ms == pytest.approx(2 * 13 + 1 + (2 * 2 + 1) * 0.5 + 64 / (1e9 / 8 / 1e3) + COLLECTIVE_ALPHA_MS)
    one_node = CostModel(tiny, Cluster.from_dict({"inter_node_gbps": 1, "nodes": [{"type": "cpu", "devices_per_node": 4}]}), db)
    c1 = one_node.pipeline_costs(NS(mbs=1, lbs=2, stages=[st([0, 1], 2, (0, 2)), st([2, 3], 2, (2, 4))]))
    assert c1[0].send_fwd_ms == 0.25                         # measured p2p inside the node


def test_tp_collectives_not_added_when_op_times_include_them(tiny, cpu_cluster):
    from _foundation_data import flat_profile
    from eth.errors import ProfileError
    from eth.profiles.db import DeviceProfile, ProfileDB
    data = flat_profile()
    data["tp_comm_included"] = True       # measured with a real tp group (e.g. an Aceso import)
    cm = CostModel(tiny, cpu_cluster, ProfileDB({"cpu": DeviceProfile(data)}))
    one = cm.stage_cost("cpu", 1, 1, (0, 4), 1, num_stages=1)
    two = cm.stage_cost("cpu", 2, 1, (0, 4), 1, num_stages=1, ranks=[0, 1],
                        recompute={"attn-dense": 2})
    # flat profile: the same op times at tp 1 and 2, so nothing is added for tp 2 -- not even
    # the re-done forward all-reduce of the recomputed row-parallel GEMM
    assert two.fwd_ms == one.fwd_ms and two.comm_ms == 0.0
    assert two.bwd_ms == pytest.approx(one.bwd_ms + 2 * 1.0)   # recompute: attn-dense fwd in 2 layers
    # a model entry overrides the file; an old file without the field means "not included"
    data["models"][0]["tp_comm_included"] = False
    cm = CostModel(tiny, cpu_cluster, ProfileDB({"cpu": DeviceProfile(data)}))
    assert cm.stage_cost("cpu", 2, 1, (0, 4), 1, num_stages=1, ranks=[0, 1]).comm_ms > 0
    assert not DeviceProfile(flat_profile()).tp_comm_included(tiny)
    data["tp_comm_included"] = "yes"
    with pytest.raises(ProfileError, match=r"profile.tp_comm_included must be true or false, got 'yes'"):
        DeviceProfile(data)


def _cut_model():
    from eth.profiles.db import ProfileDB
    from eth.spec.cluster import Cluster
    from eth.spec.model import ModelSpec

    m = ModelSpec("m4", num_layers=4, hidden=1024, heads=8, seq_len=512, vocab=8192)
    cluster = Cluster.from_dict({"name": "t", "inter_node_gbps": 100,
                                 "nodes": [{"type": "A100", "devices_per_node": 4},
                                           {"type": "RTX3090", "devices_per_node": 4}]})
    db = ProfileDB()
    db.ensure(m, cluster.types.values())
    return m, cluster, db


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_cut_stage_cost_of_whole_layers_is_the_stage_cost(precision):
    """A stage written with ops spanning whole layers costs what the layer-count path says."""
    from eth.spec.model import layer_ops

    m, cluster, db = _cut_model()
    cm = CostModel(m, cluster, db, TrainSetup(precision, zero_stage=1))
    names = layer_ops(m)
    for recompute in ({}, {"softmax": 2, "gelu": 1, "context": 2}):
        for tp in (1, 2):
            args = dict(device_type="A100", tp=tp, dp=1, layers=(1, 3), mbs=2, recompute=recompute,
                        stage_index=1, num_stages=3, num_microbatches=4, ranks=list(range(tp)),
                        next_ranks=[4], prev_ranks=[5])
            whole, cut = cm.stage_cost(**args), cm.stage_cost(**args, ops=(names[0], names[-1]))
            for f in ("fwd_ms", "bwd_ms", "recompute_ms", "comm_ms", "params", "act_bytes", "memory_bytes",
                      "send_fwd_ms", "send_bwd_ms"):
                assert getattr(cut, f) == pytest.approx(getattr(whole, f), rel=1e-12), (f, recompute, tp)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_cut_position_on_a_first_middle_and_last_stage(tp):
    """Whole layers written as ops cost what the layer path says on a first, a middle and
    a last stage (the embedding's and head's tp all-reduces are the first and last
    stage's); and a split after every op of layer 1 divides the model's weights and,
    without tp, its compute between the two sides."""
    from eth.spec.model import layer_ops

    m, cluster, db = _cut_model()
    cm = CostModel(m, cluster, db, TrainSetup("bf16"))
    names = layer_ops(m)
    common = dict(device_type="A100", tp=tp, dp=1, mbs=2, recompute={}, num_microbatches=4,
                  ranks=list(range(tp)))
    fields = ("fwd_ms", "bwd_ms", "recompute_ms", "comm_ms", "params", "act_bytes", "memory_bytes",
              "send_fwd_ms", "send_bwd_ms")
    for layers, index in (((0, 2), 0), ((1, 3), 1), ((2, 4), 2)):
        args = dict(common, layers=layers, stage_index=index, num_stages=3, next_ranks=[4], prev_ranks=[5])
        whole, cut = cm.stage_cost(**args), cm.stage_cost(**args, ops=(names[0], names[-1]))
        assert whole.comm_ms > 0 or tp == 1
        for f in fields:
            assert getattr(cut, f) == pytest.approx(getattr(whole, f), rel=1e-12), (f, layers, tp)
    one = cm.stage_cost(layers=(0, 4), stage_index=0, num_stages=1, **common)
    for k in range(1, len(names)):
        a = cm.stage_cost(layers=(0, 2), stage_index=0, num_stages=2, ops=(names[0], names[k - 1]),
                          next_ranks=[4], **common)
        b = cm.stage_cost(layers=(1, 4), stage_index=1, num_stages=2, ops=(names[k], names[-1]),
                          prev_ranks=[5], **common)
        assert a.params + b.params == pytest.approx(one.params), names[k - 1]
        assert a.send_fwd_ms > 0 and b.send_bwd_ms > 0, names[k - 1]
        if tp == 1:
            assert a.fwd_ms - a.send_fwd_ms + b.fwd_ms == pytest.approx(one.fwd_ms), names[k - 1]
            assert a.bwd_ms + b.bwd_ms - b.send_bwd_ms == pytest.approx(one.bwd_ms), names[k - 1]
        else:   # the tp all-reduces and the cut's all-gathers on top of the compute
            assert a.fwd_ms + b.fwd_ms > one.fwd_ms and a.comm_ms + b.comm_ms > one.comm_ms, names[k - 1]


def test_cut_stage_cost_splits_a_layer_and_sends_what_crosses():
    """Layer 1 cut after softmax: the two sides' weights and compute add up to the whole
    layer's, the p2p message is x + qkv + the probabilities, and the receiver keeps the
    received buffer and its own copy of the qkv output (both sides keep one)."""
    from eth.profiles.db import collective_ms
    from eth.spec.model import ACT_BYTES, cut_tensors, layer_ops

    m, cluster, db = _cut_model()
    cm = CostModel(m, cluster, db, TrainSetup("bf16"))
    names = layer_ops(m)
    args = dict(device_type="A100", tp=1, dp=1, mbs=2, num_stages=2, num_microbatches=4)
    whole = cm.stage_cost(layers=(0, 4), stage_index=0, num_stages=1, **{k: v for k, v in args.items()
                                                                         if k != "num_stages"})
    a = cm.stage_cost(layers=(0, 2), stage_index=0, ops=(names[0], "softmax"), **args)
    b = cm.stage_cost(layers=(1, 4), stage_index=1, ops=("attn-dropout", names[-1]), **args)
    cut = cut_tensors(m, "softmax")
    assert [t.name for t in cut] == ["x", "qkv", "probs"]
    message = 2 * sum(t.numel for t in cut) * ACT_BYTES
    link = cm.cluster.intra_node_gbps or cm.cluster.types["A100"].link_gbps
    p2p = collective_ms("p2p", 2, message, link, cm._measured(db.get("A100"), "A100", link))
    assert a.send_fwd_ms == pytest.approx(p2p) and b.send_bwd_ms == pytest.approx(p2p)
    assert a.params + b.params == pytest.approx(whole.params)
    assert a.fwd_ms - a.send_fwd_ms + b.fwd_ms == pytest.approx(whole.fwd_ms)
    assert a.bwd_ms + b.bwd_ms - b.send_bwd_ms == pytest.approx(whole.bwd_ms)
    qkv = 2 * m.seq_len * m.qkv_width * ACT_BYTES
    assert a.act_bytes + b.act_bytes == pytest.approx(whole.act_bytes + message + qkv)
