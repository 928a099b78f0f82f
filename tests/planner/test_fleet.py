"""Fleet planning: prices, zones and their links in the cluster file; what a plan costs
(devices and egress, against hand-computed figures); which devices the planner uses
(against a brute-force search of every fleet); constraints; the frontier CSV and plot."""
import csv
import itertools
import json
import math

import pytest
import yaml

from eth.cost.price import egress_usd_per_iteration, plan_rates
from eth.errors import InfeasibleError, SpecError
from eth.planner.fleet import FleetChoice, FleetOptions, choose_fleet, device_rates
from eth.planner.job import plan_job
from eth.planner.options import SearchOptions
from eth.planner.search import search
from eth.spec.cluster import Cluster
from eth.spec.plan import Plan
from eth.spec.precision import TrainSetup

from _planner_data import M4, make_cluster, profiles_for

ZONES = {"name": "zones", "inter_node_gbps": 100, "inter_zone_gbps": 10, "egress_usd_per_gb": 0.01,
         "device_types": {"A100": {"price_per_hour": 3.5}, "RTX3090": {"price_per_hour": 1.0}},
         "nodes": [{"type": "A100", "devices_per_node": 2, "count": 2, "zone": "eu"},
                   {"type": "RTX3090", "devices_per_node": 2, "zone": "eu"},
                   {"type": "A100", "devices_per_node": 2, "zone": "us", "price_per_hour": 3.0}],
         "zone_links": [{"zones": ["eu", "us"], "gbps": 0.5, "egress_usd_per_gb": 0.05}]}
FAST = SearchOptions(gbs=16, progress=False, seeds=False)


def test_cluster_file_fleet_fields():
    c = Cluster.from_dict(ZONES)
    again = Cluster.from_dict(c.to_dict())
    assert again.to_dict() == c.to_dict()
    assert [c.zone_of(r) for r in (0, 3, 4, 6)] == ["eu", "eu", "eu", "us"]
    assert [c.price_of(r) for r in (0, 4, 6)] == [3.5, 1.0, 3.0]
    assert c.devices_per_hour_usd() == 4 * 3.5 + 2 * 1.0 + 2 * 3.0
    assert c.link_gbps([0, 2]) == 100          # two nodes of one zone
    assert c.link_gbps([0, 6]) == 0.5          # the listed pair, not inter_zone_gbps
    assert c.zone_link("us", "eu") == (0.5, 0.05)
    sub = c.subset([1, 0, 1])
    assert sub.world_size == 4 and [d.type for d in sub.devices] == ["A100"] * 4
    assert [sub.zone_of(r) for r in range(4)] == ["eu", "eu", "us", "us"] and sub.price_of(3) == 3.0
    # a cluster file without the new fields keeps its resolved form (plans keep their hash)
    plain = make_cluster([{"type": "A100", "devices_per_node": 2}])
    assert set(plain.to_dict()) == {"version", "name", "inter_node_gbps", "inter_type_gbps", "intra_node_gbps",
                                    "device_types", "nodes"}
    assert plain.to_dict()["nodes"] == [{"type": "A100", "devices_per_node": 2, "count": 1}]


def _with(path, value):
    data = {**ZONES, "nodes": [dict(n) for n in ZONES["nodes"]], "zone_links": [dict(z) for z in ZONES["zone_links"]],
            "device_types": {k: dict(v) for k, v in ZONES["device_types"].items()}}
    *head, last = path
    at = data
    for key in head:
        at = at[key]
    if value is KeyError:
        del at[last]
    else:
        at[last] = value
    return data


@pytest.mark.parametrize("path, value, says", [
    (("device_types", "A100", "price_per_hour"), -1, "price_per_hour must be a number of USD >= 0, got -1"),
    (("device_types", "A100", "price_per_hour"), math.nan, "price_per_hour must be a number of USD >= 0"),
    (("nodes", 2, "price_per_hour"), "3", "cluster.nodes[2].price_per_hour must be a number of USD >= 0, got '3'"),
    (("nodes", 1, "zone"), KeyError, "cluster.nodes[1] has no zone while nodes[0] is in 'eu'"),
    (("nodes", 0, "colour"), "red", "nodes[0] has unknown field(s) ['colour']"),
    (("zone_links", 0, "gbps"), 0, "cluster.zone_links[0].gbps must be a positive number, got 0"),
    (("zone_links", 0, "egress_usd_per_gb"), -0.1, "zone_links[0].egress_usd_per_gb must be a number >= 0"),
    (("zone_links", 0, "zones"), ["eu", "eu"], "zone_links[0].zones ['eu', 'eu'] must name two different zones"),
    (("zone_links", 0, "zones"), ["eu"], "zone_links[0].zones must be two zone names, got ['eu']"),
    (("zone_links", 0, "mtu"), 9000, "zone_links[0] has unknown field(s) ['mtu']"),
    (("zone_links",), {"eu": 1}, "zone_links must be a list"),
    (("inter_zone_gbps",), -5, "cluster.inter_zone_gbps must be a number >= 0, got -5"),
    (("egress_usd_per_gb",), math.inf, "cluster.egress_usd_per_gb must be a number >= 0, got inf"),
])
def test_bad_fleet_fields_are_one_line(path, value, says):
    with pytest.raises(SpecError) as err:
        Cluster.from_dict(_with(path, value))
    assert says in str(err.value) and "\n" not in str(err.value)


def test_zones_need_a_link():
    data = _with(("zone_links",), [])
    data.pop("inter_zone_gbps")
    with pytest.raises(SpecError, match=r"zones 'eu' and 'us' with no link between them; give inter_zone_gbps"):
        Cluster.from_dict(data)


def _plan(cluster, pipelines, gbs, setup=TrainSetup("bf16", 0, "fp32")):
    return Plan.from_dict({"version": 1, "model": M4.to_dict(), "cluster": cluster.to_dict(), "gbs": gbs,
                           "seq_len": M4.seq_len, "pipelines": pipelines, "training": setup.to_dict(),
                           "predicted": {"iteration_ms": 1000.0}})


def test_egress_against_hand_computed_figures():
    c = Cluster.from_dict(ZONES)
    # one pipeline, stage 0 in eu (ranks 0-1), stage 1 in us (6-7): activations forward and
    # gradients back over the eu-us link, 2 x Lbs x seq x hidden x 2 bytes at 0.05 USD/GB;
    # each block is held by one stage only: no gradient crosses
    stage = {"device_type": "A100", "tp": 1, "dp": 2, "recompute": {}}
    one = _plan(c, [{"mbs": 8, "lbs": 16, "stages": [dict(stage, ranks=[0, 1], layers=[0, 2]),
                                                      dict(stage, ranks=[6, 7], layers=[2, 4])]}], 16)
    assert egress_usd_per_iteration(one) == pytest.approx(2 * 16 * 512 * 1024 * 2 / 1e9 * 0.05)
    # two one-stage pipelines, one per zone: each parameter's fp32 gradient is all-reduced by
    # two ranks (one per zone) in a ring of 2 edges, both crossing, each carrying B
    two = _plan(c, [{"mbs": 8, "lbs": 8, "stages": [dict(stage, ranks=[0], dp=1, layers=[0, 4])]},
                    {"mbs": 8, "lbs": 8, "stages": [dict(stage, ranks=[6], dp=1, layers=[0, 4])]}], 16)
    assert egress_usd_per_iteration(two) == pytest.approx(2 * M4.num_params() * 4 / 1e9 * 0.05)
    # ZeRO 1: reduce-scatter + all-gather, (n - 1) / n of (fp32 + bf16) bytes of the padded buffer per edge
    z1 = _plan(c, two.to_dict()["pipelines"], 16, TrainSetup("bf16", 1, "fp32"))
    assert egress_usd_per_iteration(z1) == pytest.approx(2 * 0.5 * M4.num_params() * 6 / 1e9 * 0.05, rel=1e-6)
    # within one zone: nothing
    eu = _plan(c, [{"mbs": 8, "lbs": 8, "stages": [dict(stage, ranks=[0], dp=1, layers=[0, 4])]},
                   {"mbs": 8, "lbs": 8, "stages": [dict(stage, ranks=[4], dp=1, device_type="RTX3090",
                                                        layers=[0, 4])]}], 16)
    assert egress_usd_per_iteration(eu) == 0.0
    rates = plan_rates(two)
    egress = 2 * M4.num_params() * 4 / 1e9 * 0.05 * 3600
    assert rates["samples_per_s"] == 16.0
    assert rates["egress_per_hour"] == pytest.approx(egress, rel=1e-6)
    assert rates["cost_per_hour"] == pytest.approx(4 * 3.5 + 2 + 2 * 3.0 + egress, rel=1e-6)
    assert rates["usd_per_sample"] == pytest.approx(rates["cost_per_hour"] / 3600 / 16)


def _fleet(cluster, objective="throughput", **kw):
    db = profiles_for(M4, cluster)
    return choose_fleet(M4, cluster, db, FAST, FleetOptions(objective, **kw))


def _brute(cluster, value):
    """The best full search over every fleet with whole groups in or out."""
    db = profiles_for(M4, cluster)
    best = None
    for counts in itertools.product(*[(0, g.count) for g in cluster.nodes]):
        if not any(counts):
            continue
        try:
            plan = search(M4, cluster.subset(counts), db, FAST)
        except InfeasibleError:
            continue
        rates = plan_rates(plan)
        if best is None or value(rates) < value(best[1]):
            best = (counts, rates)
    return best


@pytest.mark.parametrize("objective", ["throughput", "cost"])
def test_fleet_choice_matches_brute_force(objective):
    cluster = Cluster.from_dict(_with(("zone_links", 0, "gbps"), 2.0))
    value = ((lambda r: -r["samples_per_s"]) if objective == "throughput"
             else (lambda r: r["cost_per_hour"] / r["samples_per_s"]))
    plan, choice = _fleet(cluster, objective)
    counts, rates = _brute(cluster, value)
    # the cost objective also tries 1 node of the 2 A100@eu: no worse than whole groups
    assert value(plan_rates(plan)) <= value(rates) + abs(value(rates)) * 1e-9
    if objective == "throughput":
        assert [g["used"] for g in plan.search["fleet"]["groups"]] == list(counts)
    for p in choice.points:   # the bound holds for every fleet searched
        assert p.plan is None or p.samples_per_s <= p.bound * (1 + 1e-9)


def test_a_slow_zone_is_left_out_when_that_is_faster():
    slow = Cluster.from_dict(_with(("zone_links", 0, "gbps"), 0.01))
    plan, _ = _fleet(slow)
    assert {g["zone"] for g in plan.search["fleet"]["groups"] if g["used"]} == {"eu"}
    assert {slow.zone_of(0)} == {"eu"} and all(d.type in ("A100", "RTX3090") for d in plan.cluster.devices)
    every = search(M4, slow, profiles_for(M4, slow), FAST)
    assert plan.predicted["iteration_ms"] < every.predicted["iteration_ms"]
    # a fast link: the us zone pays its way (the RTX node does not, at this small batch)
    fast = Cluster.from_dict(_with(("zone_links", 0, "gbps"), 400))
    plan, _ = _fleet(fast)
    assert [g["used"] for g in plan.search["fleet"]["groups"]] == [2, 0, 1]


def test_device_rates_bound_every_stage():
    # r_t: no configuration of one layer on one device computes more layer-samples per ms
    cluster = make_cluster([{"type": "A100", "devices_per_node": 2}, {"type": "RTX3090", "devices_per_node": 2}])
    db = profiles_for(M4, cluster)
    rates = device_rates(M4, cluster, db, 16)
    assert rates["A100"] > rates["RTX3090"] > 0
    plan = search(M4, cluster, db, FAST)
    for p in plan.pipelines:
        for s in p.stages:
            done = (s.layers[1] - s.layers[0]) * p.mbs / (s.tp * s.dp)   # layer-samples per device per micro-batch
            assert done / (s.predicted["fwd_ms"] + s.predicted["bwd_ms"]) <= rates[s.device_type] * (1 + 1e-9)


def test_constraints_and_missing_prices():
    cluster = Cluster.from_dict(ZONES)
    with pytest.raises(InfeasibleError, match=r"min_throughput 1e\+06 samples/s: no fleet can reach it \(at most"):
        _fleet(cluster, min_throughput=1e6)
    with pytest.raises(InfeasibleError, match=r"max_cost_per_hour 0.5 USD: the cheapest fleet that can hold the "
                                              r"weights costs 2 USD/h for its devices \(2 RTX3090@eu\)"):
        _fleet(cluster, "cost", max_cost_per_hour=0.5)
    # the budget decides: at most 8 USD/h buys the RTX node and one A100 node at most
    plan, _ = _fleet(cluster, max_cost_per_hour=8)
    assert plan_rates(plan)["cost_per_hour"] <= 8 and plan.cluster.devices_per_hour_usd() <= 8
    unpriced = make_cluster([{"type": "A100", "devices_per_node": 2}, {"type": "RTX3090", "devices_per_node": 2}],
                            device_types={"A100": {"price_per_hour": 2.0}})
    with pytest.raises(SpecError, match=r"^objective cost needs a price_per_hour for every device type; RTX3090 "
                                        r"has none"):
        FleetOptions("cost").check(unpriced)
    with pytest.raises(SpecError, match=r"^max_cost_per_hour needs a price_per_hour"):
        FleetOptions(max_cost_per_hour=3).check(unpriced)
    with pytest.raises(SpecError, match=r"^min_throughput must be a number >= 0 \(0: none\), got nan"):
        FleetOptions(min_throughput=math.nan).check(unpriced)
    # every device, constraint checked on the one plan
    with pytest.raises(InfeasibleError, match=r"min_throughput 1e\+06 samples/s: the plan on every device reaches"):
        plan_job(M4, cluster, None, FAST, fleet=FleetOptions(use_all=True, min_throughput=1e6))


def test_search_hpp_fleet_flags(tmp_path, capsys):
    from eth.cli.search_hpp import main

    path = tmp_path / "zones.yaml"
    path.write_text(yaml.safe_dump(_with(("zone_links", 0, "gbps"), 0.01)))
    m4 = tmp_path / "m4.yaml"
    m4.write_text(yaml.safe_dump({k: v for k, v in M4.to_dict().items()}))
    args = ["--cluster", str(path), "--model", str(m4), "--gbs", "16", "--no-progress", "--no-seeds", "--jobs", "1"]
    assert main(args + ["--pareto", str(tmp_path / "f.csv"), "--png", str(tmp_path / "f.png"),
                        "-o", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "fleet [throughput]: 4/4 A100@eu, 0/2 RTX3090@eu, 0/2 A100@us;" in out
    plan = Plan.from_dict(json.loads((tmp_path / "plan.json").read_text()))
    assert plan.cluster.world_size == 4 and plan.predicted["samples_per_s"] == pytest.approx(
        16e3 / plan.predicted["iteration_ms"], rel=1e-6)
    assert plan.predicted["cost_per_hour"] == pytest.approx(4 * 3.5)   # one zone: no egress
    rows = list(csv.DictReader((tmp_path / "f.csv").open()))
    assert len(rows) == plan.search["fleet"]["searched"] and sum(r["chosen"] == "yes" for r in rows) == 1
    front = [r for r in rows if r["frontier"] == "yes"]
    for r in rows:   # the frontier: no row is faster and cheaper than a frontier row
        for f in front:
            assert not (float(r["samples_per_s"]) > float(f["samples_per_s"])
                        and float(r["cost_per_hour"]) < float(f["cost_per_hour"]))
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
    # bad combinations: one line, exit 2, nothing written
    for extra, says in ((["--png", str(tmp_path / "g.png")], "--png draws the frontier of --pareto"),
                        (["--use-all", "--pareto", str(tmp_path / "g.csv")], "cannot be given with --use-all"),
                        (["--min-throughput", "1e9"], "min_throughput 1e+09 samples/s")):
        assert main(args + extra) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1
    assert not (tmp_path / "g.csv").exists() and not (tmp_path / "g.png").exists()


def test_pareto_screens_every_fleet_not_dominated_by_bound():
    cluster = Cluster.from_dict(ZONES)
    db = profiles_for(M4, cluster)
    choice = FleetChoice(M4, cluster, db, FAST, FleetOptions(pareto=True))
    choice.run()
    searched = [p for p in choice.points if p.plan is not None]
    for p in choice.points:
        if p.status == "not searched":   # skipped only where a searched plan is as fast as its bound, and cheaper
            assert any(q.samples_per_s >= p.bound and q.cost_per_hour <= p.price for q in searched)
