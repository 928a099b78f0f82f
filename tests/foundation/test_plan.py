"""Plan format: JSON round trip, atomic save, and every validation error."""
import json
from dataclasses import replace

import pytest

from _foundation_data import TINY
from eth.spec.cluster import Cluster
from eth.errors import PlanError, SpecError
from eth.spec.plan import PLAN_VERSION, PipelinePlan, Plan, StagePlan, load_plan

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
    assert data["version"] == PLAN_VERSION and data["seq_len"] == TINY.seq_len
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
    (_set(("pipelines", 1, "stages", 1, "layers"), (3, 4)), r"stages\[1\].layers is \[3, 4\) but must start at layer 2"),
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
    (lambda d: d.update(version=2), "plan.version is 2"),
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
