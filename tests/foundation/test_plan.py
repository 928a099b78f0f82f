"""Plan format: JSON round trip, atomic save, and every validation error."""
import json
from dataclasses import replace

import pytest

from _foundation_data import TINY
from eth.spec.cluster import Cluster
from eth.errors import PlanError, SpecError
from eth.spec.plan import WHOLE_LAYER_VERSION, PipelinePlan, Plan, StagePlan, load_plan

MIXED = {"name": "mix", "inter_node_gbps": 10,
         "nodes": [{"type": "A100", "devices_per_node": 2}, {"type": "RTX3090", "devices_per_node": 2}]}


def make_plan():
    cluster = Cluster.from_dict(MIXED)
    p0 = PipelinePlan(mbs=2, lbs=10, stages=[StagePlan([0, 1], "A100", tp=1, dp=2, layers=(0, 4))])
    p1 = PipelinePlan(mbs=1, lbs=6, stages=[StagePlan([2], "RTX3090", 1, 1, (0, 2), {"softmax": 2}),
                                            StagePlan([3], "RTX3090", 1, 1, (2, 4))])
    return Plan(TINY, cluster, gbs=16, pipelines=[p0, p1])


def test_round_trip(tmp_path):
    plan = make_plan()
    plan.predicted = {"iteration_ms": 12.5}
    path = tmp_path / "plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    assert data["version"] == WHOLE_LAYER_VERSION and data["seq_len"] == TINY.seq_len
    again = load_plan(path)
    assert again.to_dict() == plan.to_dict()
    assert again.world_size == 4 and again.pipelines[1].num_microbatches == 6
    assert again.pipelines[0].stages[0].rank(tp_rank=0, dp_rank=1) == 1
    assert data["hash"] == plan.content_hash()
    plan.predicted = {"iteration_ms": 99.0}
    assert plan.content_hash() == data["hash"]      # predictions do not change the hash


def _set(path, value):
    def mutate(plan):
        obj = plan
        for key in path[:-1]:
            obj = obj[key] if isinstance(key, int) else getattr(obj, key)
        setattr(obj, path[-1], value) if not isinstance(path[-1], int) else obj.__setitem__(path[-1], value)
    return mutate


CASES = [
    (_set(("pipelines", 0, "stages", 0, "tp"), 2), r"pipelines\[0\].stages\[0\]: tp 2 x dp 2 = 4 but the stage has 2 ranks"),
    (_set(("pipelines", 0, "lbs"), 7), r"pipelines\[0\]: lbs 7 is not a multiple of mbs 2"),
    (_set(("pipelines", 0, "mbs"), 4), r"pipelines\[0\]: lbs 10 is not a multiple of mbs 4"),
    (lambda p: (setattr(p.pipelines[0], "mbs", 1), setattr(p.pipelines[0], "lbs", 9)),
     r"stages\[0\]: pipeline mbs 1 is not divisible by stage dp 2"),
    (_set(("pipelines", 1, "stages", 1, "layers"), (3, 4)), r"stages\[1\] starts at layer 3 but must start at layer 2 \(where the previous stage ends\)"),
    (_set(("pipelines", 1, "stages", 1, "layers"), (2, 3)), r"pipelines\[1\] covers layers \[0, 3\) but the model has 4"),
    (_set(("pipelines", 1, "stages", 1, "ranks"), [2]), r"rank 2 is used twice: plan.pipelines\[1\].stages\[0\] and"),
    (_set(("pipelines", 1, "stages", 1, "ranks"), [7]), r"ranks has 7, cluster ranks are 0..3"),
    (_set(("pipelines", 1, "stages", 0, "device_type"), "A100"), r"device_type is 'A100' but cluster rank 2 is a 'RTX3090'"),
    (lambda p: p.pipelines.pop(), r"plan uses 2 ranks but the cluster has 4; unused ranks: \[2, 3\]"),
    (_set(("gbs",), 17), r"sum of pipeline lbs 16 is below gbs 17"),
    (_set(("pipelines", 1, "stages", 0, "recompute"), {"flux": 1}), r"recompute names unknown op 'flux'"),
    (_set(("pipelines", 1, "stages", 0, "recompute"), {"gelu": 3}), r"recompute\['gelu'\] is 3, must be in \[0, 2\]"),
    (_set(("pipelines", 0, "mbs"), 0), r"pipelines\[0\].mbs must be a positive integer, got 0"),
]


@pytest.mark.parametrize("mutate, message", CASES)
def test_validation_errors(mutate, message):
    plan = make_plan()
    plan.validate()
    mutate(plan)
    with pytest.raises(PlanError, match=message):
        plan.validate()


def test_tp_must_divide_model():
    plan = make_plan()
    st = plan.pipelines[0].stages[0]
    st.tp, st.dp, st.ranks = 2, 1, [0, 1]
    plan.pipelines[0].mbs, plan.pipelines[0].lbs = 1, 10
    plan.validate()                                  # tiny has 4 heads: tp 2 is fine
    plan.model = replace(TINY, ffn=99)
    with pytest.raises(PlanError, match=r"stages\[0\]: tp 2 does not divide model.ffn 99"):
        plan.validate()


def test_failed_save_keeps_old_file(tmp_path):
    path = tmp_path / "plan.json"
    good = make_plan()
    good.save(path)
    before = path.read_text()
    bad = make_plan()
    bad.gbs = 1000
    with pytest.raises(PlanError):
        bad.save(path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(version=3), "plan.version is 3"),
    (lambda d: d.pop("pipelines"), r"plan is missing field\(s\) \['pipelines'\]"),
    (lambda d: d.update(version=True), "plan.version is True"),
    (lambda d: d.update(recomptue={}), r"plan has unknown field\(s\) \['recomptue'\]"),
    (lambda d: d["pipelines"][1]["stages"][0].update(recomptue={"gelu": 1}),
     r"stages\[0\] has unknown field\(s\) \['recomptue'\]"),
    (lambda d: d["pipelines"][0]["stages"][0].update(layers=[0.0, 4.0]), r"layers must be \[start, end\) integers"),
    (lambda d: d["pipelines"][0]["stages"][0].update(ranks=7), "ranks must be a non-empty list of integers, got 7"),
    (lambda d: d["pipelines"][0]["stages"][0].update(recompute=None), "recompute must be an object, got None"),
    (lambda d: d["pipelines"][1]["stages"][0].update(recompute={"softmax": True}), r"recompute\['softmax'\] is True"),
    (lambda d: d["pipelines"][0].update(predicted=[1]), r"pipelines\[0\].predicted must be an object"),
    (lambda d: d["pipelines"][0]["stages"][0].update(device_type=3), "device_type must be a string, got 3"),
    (lambda d: d["pipelines"][0]["stages"][0].pop("tp"), r"stages\[0\] is missing field\(s\) \['tp'\]"),
    (lambda d: d.update(seq_len=99), "plan.seq_len 99 != plan.model.seq_len 4"),
    (lambda d: d["model"].update(hidden=-8), "model.hidden must be a positive integer"),
])
def test_load_errors(tmp_path, edit, message):
    data = make_plan().to_dict()
    edit(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SpecError, match=message):
        load_plan(path)


def test_load_missing_and_broken_files(tmp_path):
    with pytest.raises(PlanError, match="does not exist"):
        load_plan(tmp_path / "none.json")
    (tmp_path / "b.json").write_text("{")
    with pytest.raises(PlanError, match="not valid JSON"):
        load_plan(tmp_path / "b.json")


def make_cut_plan():
    """Pipeline 1 cut inside layer 1 after qkv (tp 1 -> tp 2 in the test cluster's A100s)."""
    plan = make_plan()
    plan.pipelines[1].stages = [
        StagePlan([2], "RTX3090", 1, 1, (0, 2), {"qkv": 2}, ops=("1st-layernorm", "qkv")),
        StagePlan([3], "RTX3090", 1, 1, (1, 4), {"gelu": 3, "score": 1}, ops=("score", "post-mlp-dropout"))]
    return plan


def test_cut_round_trip_and_ops(tmp_path):
    plan = make_cut_plan()
    plan.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["version"] == 2 and data["pipelines"][1]["stages"][0]["ops"] == ["1st-layernorm", "qkv"]
    assert "ops" not in data["pipelines"][0]["stages"][0]
    again = load_plan(tmp_path / "plan.json")
    assert again.to_dict() == plan.to_dict()
    first, second = again.pipelines[1].stages
    assert first.held_ops(TINY, 1) == ("1st-layernorm", "qkv") and first.held_ops(TINY, 2) == ()
    assert second.held_ops(TINY, 1)[0] == "score" and len(second.held_ops(TINY, 2)) == 13
    assert first.span(TINY) == (0, 15) and second.span(TINY) == (15, 52)
    assert second.recompute_layers(TINY, "score") == [1] and second.recompute_layers(TINY, "gelu") == [1, 2, 3]
    # a whole-layer stage written with ops spanning whole layers reads the same
    assert StagePlan([0], "A100", 1, 1, (0, 2), ops=("1st-layernorm", "post-mlp-dropout")).span(TINY) == (0, 26)


def _cut(j, **changes):
    def mutate(plan):
        for k, v in changes.items():
            setattr(plan.pipelines[1].stages[j], k, v)
    return mutate


@pytest.mark.parametrize("mutate, message", [
    (_cut(0, ops=("1st-layernorm", "qkvv")), r"stages\[0\].ops last op 'qkvv' is not a layer op of model t: 1st-layernorm, qkv,"),
    (_cut(1, ops=("softmax", "post-mlp-dropout")),
     r"stages\[1\] starts at layer 1 at op softmax but must start at layer 1 at op score"),
    (_cut(0, layers=(0, 1), ops=("1st-layernorm", "qkv"), recompute={}), r"pipelines\[1\].stages\[1\] starts at layer 1 at op score "
     r"but must start at layer 0 at op score"),
    (lambda p: setattr(p.pipelines[1], "stages", [p.pipelines[1].stages[0], StagePlan(
        [3], "RTX3090", 1, 1, (1, 2), {}, ops=("score", "qkv")), p.pipelines[1].stages[1]]),
     r"stages\[1\] holds no op: layers \[1, 2\) ops score .. qkv"),
    (_cut(1, recompute={"qkv": 3}), r"recompute\['qkv'\] is 3, must be in \[0, 2\] \(the stage's layers\) \(the stage "
     r"runs qkv in 2 of its 3 layers, ops score .. post-mlp-dropout: a recompute run cannot cross a stage boundary\)"),
    (_cut(1, layers=(1, 3), recompute={}), r"pipelines\[1\] covers layers \[0, 3\) but the model has 4 layers"),
    (_cut(1, ops=("score", "gelu")), r"pipelines\[1\] covers up to op gelu of layer 3 but the model has 4 layers"),
])
def test_cut_validation_errors(mutate, message):
    plan = make_cut_plan()
    plan.validate()
    mutate(plan)
    with pytest.raises(PlanError, match=message):
        plan.validate()


def test_cut_needs_version_2_and_tp_within_kv_heads(tmp_path):
    data = make_cut_plan().to_dict()
    data["version"] = 1
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match=r"stages\[0\].ops needs plan version 2, the plan is version 1"):
        load_plan(tmp_path / "p.json")
    plan = make_cut_plan()
    plan.model = replace(TINY, kv_heads=1)
    st = plan.pipelines[0].stages[0]
    st.tp, st.dp, st.ops, st.layers = 2, 1, ("1st-layernorm", "softmax"), (0, 1)
    plan.pipelines[0].stages.append(StagePlan([], "A100", 1, 1, (0, 4), ops=("attn-dropout", "post-mlp-dropout")))
    with pytest.raises(PlanError, match=r"stages\[0\]: tp 2 > kv_heads 1 replicates key/value heads inside the qkv "
                                        r"output, which a boundary there cannot carry"):
        plan.validate()
