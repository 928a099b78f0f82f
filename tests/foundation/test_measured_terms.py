"""The cost-model terms that published measurements of GPU runs call for: a device's fixed
memory, a node's shared network card, fp32 weights stepped in place, transfers that block
both ends, attention dropout apart from hidden dropout, Sailor's layer profiles."""
import json
from dataclasses import replace

import pytest

from eth.cost.model import CostModel
from eth.errors import PlanError, ProfileError, SpecError
from eth.profiles.db import DeviceProfile, ProfileDB, analytic_op_costs, analytic_profile
from eth.profiles.sailor import import_sailor
from eth.report.simulate import simulate
from eth.spec.cluster import Cluster, catalog
from eth.spec.model import ModelSpec, get_model, layer_dataflow, layer_ops, op_shapes
from eth.spec.plan import PipelinePlan, Plan, StagePlan
from eth.spec.precision import TrainSetup

GPT = get_model("gpt3-350m")


def _cluster(nodes=2, per_node=4, **extra):
    node = {"type": "A100", "devices_per_node": per_node, "count": nodes}
    node.update(extra.pop("node", {}))
    return Cluster.from_dict({"name": "t", "inter_node_gbps": 200, "nodes": [node], **extra})


def _plan(cluster, stages, mbs=4, lbs=64, setup=TrainSetup("fp32", 0, "fp32"), model=GPT):
    return Plan(model, cluster, lbs, [PipelinePlan(mbs, lbs, stages)], training=setup).validate()


def _db(cluster, model=GPT):
    return ProfileDB({t: DeviceProfile(analytic_profile(cluster.types[t], [model], (1, 2, 4), (1, 2, 4)))
                      for t in cluster.types})


def test_fixed_device_memory_is_added_to_every_stage_and_left_out_of_plans_at_zero():
    plain = _cluster()
    held = _cluster(device_types={"A100": {"overhead_gb": 3.5}})
    assert "overhead_gb" not in plain.to_dict()["device_types"]["A100"]
    assert held.to_dict()["device_types"]["A100"]["overhead_gb"] == 3.5
    stages = [StagePlan([0, 1, 2, 3], "A100", 2, 2, (0, 12)), StagePlan([4, 5, 6, 7], "A100", 2, 2, (12, 24))]
    a = CostModel(GPT, plain, _db(plain)).evaluate(_plan(plain, stages))
    b = CostModel(GPT, held, _db(held)).evaluate(_plan(held, stages))
    for ca, cb in zip(a["pipelines"][0]["costs"], b["pipelines"][0]["costs"]):
        assert cb.memory_bytes - ca.memory_bytes == pytest.approx(3.5e9)
    assert a["iteration_ms"] == b["iteration_ms"]
    with pytest.raises(SpecError, match=r"device type A100: overhead_gb must be >= 0 and below memory_gb 80, got 90"):
        _cluster(device_types={"A100": {"overhead_gb": 90}})


def test_a_nodes_network_card_is_shared_by_its_ranks_that_leave_the_node():
    cluster = _cluster(node={"nic_gbps": 400})
    assert cluster.link_gbps([0, 4]) == 200                # one stream: the inter-node link
    assert cluster.link_gbps([0, 1, 4, 5]) == 200           # two per node: 400 / 2
    assert cluster.link_gbps(range(8)) == 100               # four per node share the card
    assert cluster.link_gbps([0, 1, 2, 3]) == cluster.types["A100"].link_gbps   # inside a node
    assert _cluster().link_gbps(range(8)) == 200            # no card given: no shared limit
    assert cluster.to_dict()["nodes"][0]["nic_gbps"] == 400 and "nic_gbps" not in _cluster().to_dict()["nodes"][0]
    # a stage of tp 4 on each of two nodes all-reduces its 4 shards through one card each
    stages = [StagePlan(list(range(8)), "A100", 4, 2, (0, 24))]
    shared = CostModel(GPT, cluster, _db(cluster)).stage_allreduce_ms(_plan(cluster, stages, mbs=8).pipelines)
    own = CostModel(GPT, _cluster(), _db(_cluster())).stage_allreduce_ms(_plan(_cluster(), stages, mbs=8).pipelines)
    assert shared[0][0] == pytest.approx(2 * own[0][0])
    with pytest.raises(SpecError, match=r"cluster.nodes\[0\].nic_gbps must be a positive number \(Gbit/s\), got -1"):
        _cluster(node={"nic_gbps": -1})


def test_fp32_weights_stepped_in_place_hold_16_bytes_and_the_runtime_refuses_them():
    master, in_place = TrainSetup("fp32", 0, "fp32"), TrainSetup("fp32", 0, "fp32", fp32_master=False)
    assert master.state_bytes_per_param() == 20 and in_place.state_bytes_per_param() == 16
    assert TrainSetup("fp32", 1, "fp32", fp32_master=False).state_bytes_per_param(4) == 4 + 4 + 8 / 4
    assert master.to_dict() == {"precision": "fp32", "zero_stage": 0, "grad_reduce": "fp32"}   # plan hashes kept
    assert TrainSetup.from_dict(in_place.to_dict()) == in_place
    with pytest.raises(PlanError, match="fp32_master false needs fp32 weights, precision is bf16"):
        TrainSetup("bf16", 0, "fp32", fp32_master=False)
    cluster = _cluster(nodes=1)
    stages = [StagePlan([0, 1, 2, 3], "A100", 4, 1, (0, 24))]
    a = CostModel(GPT, cluster, _db(cluster), master).evaluate(_plan(cluster, stages))["pipelines"][0]["costs"][0]
    b = CostModel(GPT, cluster, _db(cluster), in_place).evaluate(_plan(cluster, stages))["pipelines"][0]["costs"][0]
    assert a.memory_bytes - b.memory_bytes == pytest.approx(4 * a.params)
    from eth.cost.sync import rank_state_bytes
    plan = _plan(cluster, stages, setup=in_place)
    assert rank_state_bytes(plan, in_place)[0]["optimizer"] * 12 == rank_state_bytes(plan, master)[0]["optimizer"] * 8
    from megatron.hpp.training.loop import TrainConfig
    with pytest.raises(SpecError, match=r"plan.training.fp32_master is false .* this runtime keeps fp32 main weights"):
        TrainConfig(plan=None, train_iters=1).setup_for(plan)


def test_transfers_that_block_both_ends_are_in_the_receivers_time_too():
    cluster = _cluster(nodes=3, per_node=1)
    stages = [StagePlan([r], "A100", 1, 1, (8 * r, 8 * r + 8)) for r in range(3)]
    plan = _plan(cluster, stages, mbs=2, lbs=32)
    sender = CostModel(GPT, cluster, _db(cluster))
    both = CostModel(GPT, cluster, _db(cluster), p2p_blocking=True)
    s, b = sender.pipeline_costs(plan.pipelines[0]), both.pipeline_costs(plan.pipelines[0])
    t = s[0].send_fwd_ms                                  # one transfer (the same link everywhere)
    assert t > 0 and s[1].send_bwd_ms == t
    assert [c.send_fwd_ms for c in b] == pytest.approx([t, 2 * t, t])    # send + receive of the input
    assert [c.send_bwd_ms for c in b] == pytest.approx([t, 2 * t, t])    # send + receive of the gradient
    assert [cb.total_ms - cs.total_ms for cs, cb in zip(s, b)] == pytest.approx([t, 2 * t, t])
    # the simulator holds them in both compute streams: its iteration grows with Eq. 5's
    ev_s, ev_b = sender.evaluate(plan)["iteration_ms"], both.evaluate(plan)["iteration_ms"]
    sim_s, sim_b = simulate(plan, sender).iteration_ms, simulate(plan, both).iteration_ms
    assert ev_b > ev_s and sim_b > sim_s
    assert sim_b == pytest.approx(ev_b, rel=0.02)


def test_attention_dropout_apart_from_hidden_dropout():
    neo = replace(GPT, attention_dropout=0.0)
    assert neo.attn_dropout == 0.0 and neo.dropout == 0.1 and GPT.attn_dropout == 0.1
    assert replace(GPT, attention_dropout=0.1).attention_dropout is None       # equal: one form
    assert "attention_dropout" not in GPT.to_dict() and neo.to_dict()["attention_dropout"] == 0.0
    assert ModelSpec.from_dict(neo.to_dict()) == neo
    plain, apart = op_shapes(GPT, 2, 1), op_shapes(neo, 2, 1)
    assert apart["attn-dropout"].act_bytes == 0 < plain["attn-dropout"].act_bytes      # no mask
    assert apart["context"].act_bytes == 0 < plain["context"].act_bytes                # softmax's probs
    assert apart["post-attn-dropout"].act_bytes == plain["post-attn-dropout"].act_bytes > 0
    flow = {f.name: f for f in layer_dataflow(neo)}
    assert flow["attn-dropout"].output == "probs" and flow["context"].inputs[0] == "probs"
    with pytest.raises(SpecError, match=r"model.attention_dropout must be in \[0, 1\) or null, got 1.5"):
        replace(GPT, attention_dropout=1.5)


def _sailor_file(tmp_path, model, layers):
    """A Sailor profiles_tmp.json of one model on "GH-96": layer 0, 1 .. L, L + 1 (seconds)."""
    def rows(mbs):
        out = {"0": [0.001 * mbs, 1e-6, 0.0005]}
        out.update({str(i): [0.002 * mbs, 0.005 * mbs, 0.0005] for i in range(1, layers + 1)})
        out[str(layers + 1)] = [0.003 * mbs, 0.004 * mbs, 0.0005]
        return out
    path = tmp_path / "profiles_tmp.json"
    path.write_text(json.dumps({"OPT-350": {"GH-96": {"1": {"4": rows(1), "3": rows(1)}, "8": {"4": rows(8)}}}}))
    return path


def test_sailor_layer_profiles_keep_the_measured_layer_times(tmp_path):
    opt = replace(GPT, vocab=50688, dropout=0.0)
    path = _sailor_file(tmp_path, opt, opt.num_layers)
    gh = catalog()["GH200"]
    data = import_sailor(path, "OPT-350", "GH-96", gh, opt)
    prof = DeviceProfile(data)
    assert prof.tps(opt) == [4]                                    # tp 3 does not split the model
    ops = prof.layer_costs(opt, 8, 4)[0]
    assert sum(ops[op].fwd_ms for op in layer_ops(opt)) == pytest.approx(16.0)
    assert sum(ops[op].bwd_ms for op in layer_ops(opt)) == pytest.approx(40.0)
    assert ops["final-layernorm"].fwd_ms + ops["head+loss"].fwd_ms == pytest.approx(24.0)
    assert ops["embedding"].fwd_ms == pytest.approx(8.0)
    # the layer's time is spread in the analytic profile's proportions
    shares = analytic_op_costs(gh, opt, 8, 4)
    whole = sum(shares[op][0] for op in layer_ops(opt))
    assert ops["qkv"].fwd_ms == pytest.approx(16.0 * shares["qkv"][0] / whole)
    assert ops["softmax"].act_bytes == op_shapes(opt, 8, 4, elem_bytes=4)["softmax"].act_bytes
    # the optimizer step: one per stage
    cluster = Cluster.from_dict({"name": "g", "inter_node_gbps": 200,
                                 "nodes": [{"type": "GH200", "devices_per_node": 4}]})
    cm = CostModel(opt, cluster, ProfileDB({"GH200": prof}), TrainSetup("fp32", 0, "fp32"))
    assert cm.optimizer_ms(8, StagePlan([0, 1, 2, 3], "GH200", 4, 1, (0, 24))) == pytest.approx(0.5)
    # an absent head: its time goes nowhere, the final layernorm keeps the last layer's
    ops = DeviceProfile(import_sailor(path, "OPT-350", "GH-96", gh, opt, absent=("head+loss",))).layer_costs(opt, 8, 4)[0]
    assert (ops["head+loss"].fwd_ms, ops["head+loss"].weight_bytes) == (0.0, 0.0)
    assert ops["final-layernorm"].fwd_ms == pytest.approx(24.0)
    with pytest.raises(ProfileError, match=r"model OPT-350 has no GPU 'A100'; it holds GH-96"):
        import_sailor(path, "OPT-350", "A100", gh, opt)
    with pytest.raises(ProfileError, match=r"holds layers 0 .. 25, not 0, 1 .. 13 of a 12-layer model"):
        import_sailor(path, "OPT-350", "GH-96", gh, replace(opt, num_layers=12))


def test_relu_keeps_its_output_which_the_second_gemm_keeps_anyway():
    opt = replace(GPT, activation="relu", dropout=0.0)
    assert "relu" in layer_ops(opt) and "gelu" not in layer_ops(opt)
    gelu, relu = op_shapes(replace(GPT, dropout=0.0), 2, 1), op_shapes(opt, 2, 1)
    ffn_wide = 2 * GPT.seq_len * GPT.ffn * 2                         # b s f x 2 bytes
    assert relu["relu"].act_bytes == ffn_wide and relu["mlp-gemm-2"].act_bytes == 0
    assert sum(gelu[op].act_bytes for op in layer_ops(GPT)) - sum(relu[op].act_bytes for op in layer_ops(opt)) \
        == ffn_wide
    assert opt.to_dict()["activation"] == "relu" and "activation" not in GPT.to_dict(compact=True)
    with pytest.raises(SpecError, match=r"model.activation 'relu' with swiglu true"):
        replace(get_model("llama2-7b"), activation="relu")
    with pytest.raises(SpecError, match=r"model.activation must be one of \['gelu', 'relu'\], got 'tanh'"):
        replace(GPT, activation="tanh")
