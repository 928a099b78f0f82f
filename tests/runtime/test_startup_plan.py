"""Plan at start-up (pretrain_gpt.py --hpp-cluster, megatron/hpp/training/startup_plan.py):
the device type of each rank, the cluster of the ranks present, reuse of a stored plan,
bad input, and one launch that plans for 4 ranks and trains to the single-process losses."""
import json
import re

import pytest
import torch

from eth.errors import SpecError
from eth.spec.cluster import load_cluster
from eth.spec.model import get_model
from eth.spec.plan_history import HISTORY_FILE, PLAN_FILE, PLANS_DIR, PROGRESS_FILE, format_history
from megatron.hpp.training.startup_plan import (Member, PlanRequest, device_type, membership, plan_for,
                                                present_cluster)

from _rt_reference import assert_same_params, train_reference
from _rt_spawn import REPO, launch

DEMO = REPO / "examples" / "clusters" / "cpu-demo.yaml"
PROFILES = str(REPO / "profiles" / "measured" / "cpu.json")


def test_device_type_from_env_list_cuda_name_or_the_only_type():
    fleet = load_cluster(DEMO)
    assert device_type(fleet, {"HPP_DEVICE_TYPE": "cpu-slow"}) == "cpu-slow"
    assert device_type(fleet, {"HPP_DEVICE_TYPE": "cpu-fast, cpu-slow", "LOCAL_RANK": "1"}) == "cpu-slow"
    with pytest.raises(SpecError, match="names 2 device types, LOCAL_RANK is 2"):
        device_type(fleet, {"HPP_DEVICE_TYPE": "cpu-fast,cpu-slow", "LOCAL_RANK": "2"})
    for local in range(4):   # too few or too many entries: every local rank says so
        for given in ("cpu-fast,cpu-fast,cpu-slow", "cpu-fast,cpu-fast,cpu-slow,cpu-slow,cpu-slow"):
            with pytest.raises(SpecError, match=f"names {given.count(',') + 1} device types for the 4 ranks on "
                                                "this host"):
                device_type(fleet, {"HPP_DEVICE_TYPE": given, "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": "4"})
    assert device_type(fleet, {"HPP_DEVICE_TYPE": "cpu-fast,cpu-slow", "LOCAL_RANK": "1",
                               "LOCAL_WORLD_SIZE": "2"}) == "cpu-slow"
    assert device_type(fleet, {}) is None                      # two types, nothing tells
    mixed = load_cluster(REPO / "examples" / "clusters" / "mixed4-64.yaml")
    assert device_type(mixed, {}, "NVIDIA A100-SXM4-40GB") == "A100-40GB"   # the longest name it contains
    assert device_type(mixed, {}, "NVIDIA A100-SXM4-80GB") == "A100"
    assert device_type(mixed, {}, "NVIDIA GeForce RTX 3090") == "RTX3090"
    one = load_cluster(REPO / "examples" / "clusters" / "b2b4-64.yaml")
    assert device_type(one, {}, "Ascend910B2") == "910B2"


def test_present_cluster_is_one_node_per_host_and_type_run_in_rank_order():
    fleet = load_cluster(DEMO)
    members = [Member(2, "b", "cpu-slow"), Member(0, "a", "cpu-fast"), Member(1, "a", "cpu-fast"),
               Member(3, "b", "cpu-fast")]
    c = present_cluster(fleet, members)
    assert [(g.type, g.devices_per_node, g.count) for g in c.nodes] == [("cpu-fast", 2, 1), ("cpu-slow", 1, 1),
                                                                         ("cpu-fast", 1, 1)]
    assert [d.type for d in c.devices] == ["cpu-fast", "cpu-fast", "cpu-slow", "cpu-fast"]
    assert c.types["cpu-slow"].emulate_speed == fleet.types["cpu-slow"].emulate_speed
    assert c.inter_node_gbps == fleet.inter_node_gbps
    assert membership(members) == [["a", "cpu-fast", 2], ["b", "cpu-slow", 1], ["b", "cpu-fast", 1]]
    with pytest.raises(SpecError) as err:
        present_cluster(fleet, [Member(0, "a", "cpu-fast"), Member(1, "gpu7", None, "NVIDIA H100")])
    assert str(err.value) == ("rank 1 on host gpu7: its device type is not known (device NVIDIA H100); set "
                              "HPP_DEVICE_TYPE to one of the fleet's types (cpu-fast, cpu-slow)")
    with pytest.raises(SpecError, match="rank 0 on host a is a H100, which the fleet file does not list"):
        present_cluster(fleet, [Member(0, "a", "H100")])


def test_the_same_nodes_in_another_rank_order_reuse_the_stored_plan_with_its_ranks_moved(tmp_path):
    """A rendezvous may admit the same nodes in another order: the stored plan is used
    again, each stage on the same devices, now at their new ranks."""
    request = PlanRequest(str(DEMO), "tiny", 16, profiles=PROFILES, precision="fp32")
    hosts = [("a", "cpu-fast"), ("b", "cpu-fast"), ("c", "cpu-slow"), ("d", "cpu-slow")]
    first = [Member(r, h, t) for r, (h, t) in enumerate(hosts)]
    plan, reused, *_ = plan_for(request, first, str(tmp_path))
    assert not reused
    order = [2, 0, 3, 1]                                  # host c now rank 0, a rank 1, d rank 2, b rank 3
    again = [Member(r, *hosts[i]) for r, i in enumerate(order)]
    moved, reused, previous, _ = plan_for(request, again, str(tmp_path))
    assert reused and previous == membership(first)
    assert moved.search["startup"]["membership"] == membership(again)
    assert moved.predicted["iteration_ms"] == plan.predicted["iteration_ms"]
    host_now = {m.rank: m.host for m in again}
    host_then = {m.rank: m.host for m in first}
    for p, q in zip(plan.pipelines, moved.pipelines):
        for st, mv in zip(p.stages, q.stages):
            assert [host_now[r] for r in mv.ranks] == [host_then[r] for r in st.ranks]
            assert (mv.device_type, mv.tp, mv.dp, mv.layers) == (st.device_type, st.tp, st.dp, st.layers)
            assert all(moved.cluster.type_of(r).name == mv.device_type for r in mv.ranks)
    lines = [json.loads(line) for line in (tmp_path / HISTORY_FILE).read_text().splitlines()]
    assert [line["reused"] for line in lines] == [False, True] and lines[0]["plan"] == lines[1]["plan"]
    assert json.loads((tmp_path / PLAN_FILE).read_text())["search"]["startup"]["membership"] == membership(again)
    other = [Member(r, h, t) for r, (h, t) in enumerate(hosts[:3] + [("e", "cpu-slow")])]
    assert not plan_for(request, other, str(tmp_path))[1]      # another node: searched again


def test_a_stored_plan_is_used_again_for_the_same_membership_and_request(tmp_path):
    request = PlanRequest(str(DEMO), "tiny", 16, profiles=PROFILES, precision="fp32")
    four = [Member(r, "vm", "cpu-fast" if r < 2 else "cpu-slow") for r in range(4)]
    plan, reused, previous, lost = plan_for(request, four, str(tmp_path))
    assert not reused and previous is None and lost is None and plan.world_size == 4   # nothing to resume
    assert plan.search["startup"]["membership"] == [["vm", "cpu-fast", 2], ["vm", "cpu-slow", 2]]
    again, reused, previous, _ = plan_for(request, four, str(tmp_path))
    assert reused and again.to_dict() == plan.to_dict() and previous == [["vm", "cpu-fast", 2], ["vm", "cpu-slow", 2]]
    other_batch, reused, *_ = plan_for(PlanRequest(str(DEMO), "tiny", 8, profiles=PROFILES, precision="fp32"), four,
                                      str(tmp_path))
    assert not reused and other_batch.gbs == 8
    three, reused, *_ = plan_for(request, four[:3], str(tmp_path))
    assert not reused and three.world_size == 3
    assert [s.device_type for p in three.pipelines for s in p.stages].count("cpu-slow") >= 1
    assert json.loads((tmp_path / PLAN_FILE).read_text())["search"]["startup"]["membership"] == \
        [["vm", "cpu-fast", 2], ["vm", "cpu-slow", 1]]
    back, reused, previous, _ = plan_for(request, four, str(tmp_path))     # the fleet grows back: its earlier plan
    assert reused and back.to_dict() == plan.to_dict() and previous == [["vm", "cpu-fast", 2], ["vm", "cpu-slow", 1]]
    lines = [json.loads(line) for line in (tmp_path / HISTORY_FILE).read_text().splitlines()]
    assert [line["reused"] for line in lines] == [False, True, False, False, True]
    assert lines[3]["membership"] == [["vm", "cpu-fast", 2], ["vm", "cpu-slow", 1]]
    assert lines[3]["predicted_ms"] == pytest.approx(three.predicted["iteration_ms"], abs=1e-3)
    assert lines[0]["plan"] == lines[4]["plan"] != lines[3]["plan"] and (tmp_path / lines[3]["plan"]).is_file()
    assert len(list((tmp_path / PLANS_DIR).iterdir())) == 3
    shown = format_history(tmp_path).splitlines()       # tools/show_plan.py --history
    assert len(shown) == 6 and shown[1].split()[2:7] == [
        "4", f"{plan.predicted['iteration_ms']:.1f}", "searched", "-", "-"]
    assert shown[4].endswith("1xcpu-slow on vm  [vm (cpu-slow) 2 -> 1 ranks]")
    assert shown[5].endswith("[vm (cpu-slow) 1 -> 2 ranks]") and shown[5].split()[4] == "reused"
    from eth.cli.show_plan import main as show_plan
    assert show_plan(["--history", str(tmp_path)]) == 0
    assert show_plan(["--history", str(tmp_path / "nothing")]) == 2
    with pytest.raises(SpecError, match="gpt3-175b needs .* GB for weights"):   # no plan fits: one line
        plan_for(PlanRequest(str(DEMO), "gpt3-175b", 16), four, None)


def test_flags_of_the_two_ways_to_get_a_plan(capsys):
    import pretrain_gpt

    base = ["--train-iters", "2"]
    for argv, line in [
            (base, "give --hpp-plan PLAN.json (a plan made by tools/search_hpp.py) or --hpp-cluster FLEET.yaml "
                   "(plan at start-up), not neither"),
            (base + ["--hpp-plan", "p.json", "--hpp-cluster", str(DEMO)], "not both"),
            (base + ["--hpp-cluster", str(DEMO), "--model", "tiny"],
             "--hpp-cluster plans at start-up: give --model and --global-batch-size"),
            (base + ["--hpp-plan", "p.json", "--model", "tiny"], "--model tiny is read with --hpp-cluster only"),
            (base + ["--hpp-cluster", str(DEMO), "--model", "nope", "--global-batch-size", "16"], "nope"),
            (base + ["--hpp-cluster", str(DEMO), "--model", "tiny", "--global-batch-size", "16",
                     "--hpp-profiles", "/nonexistent"], "--hpp-profiles /nonexistent does not exist"),
            (base + ["--hpp-cluster", str(DEMO), "--model", "tiny", "--global-batch-size", "16",
                     "--hpp-time-limit", "nan"], "--hpp-time-limit must be a number of seconds >= 0 (0: none), got nan"),
            (base + ["--hpp-cluster", str(DEMO), "--model", "tiny", "--global-batch-size", "16",
                     "--save", "/proc/nope/ck"], "--save /proc/nope/ck cannot be written"),
            (base + ["--hpp-plan", "p.json", "--hpp-objective", "cost"],
             "--hpp-objective cost is read with --hpp-cluster only"),
            (base + ["--hpp-cluster", str(DEMO), "--model", "tiny", "--global-batch-size", "16",
                     "--hpp-min-throughput", "5"],
             "--hpp-min-throughput constrains the fleet choice: give --hpp-objective throughput|cost too"),
            (base + ["--hpp-cluster", str(DEMO), "--model", "tiny", "--global-batch-size", "16",
                     "--hpp-objective", "cost"],
             "objective cost needs a price_per_hour for every device type; cpu-fast, cpu-slow have none")]:
        assert pretrain_gpt.config(argv) is None
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and line in err[0], (argv, err)
    request = PlanRequest(str(DEMO), "gpt3-350m", 16, profiles=PROFILES)     # a shape the profiles lack
    with pytest.raises(SpecError, match=r"^--hpp-profiles .* has no entry for model gpt3-350m .* or drop "
                                        r"--hpp-profiles \(analytic estimates\)$"):
        plan_for(request, [Member(0, "vm", "cpu-fast")], None)
    cfg = pretrain_gpt.config(base + ["--hpp-cluster", str(DEMO), "--model", "tiny", "--global-batch-size", "16",
                                      "--fp32", "--zero-stage", "1", "--hpp-time-limit", "5"])
    assert cfg.plan is None and cfg.startup == PlanRequest(str(DEMO), "tiny", 16, {}, None, "fp32", 1, "fp32", 5.0)


@pytest.mark.slow
def test_four_ranks_plan_at_start_up_and_train_to_the_single_process_losses(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = ["--hpp-cluster", str(DEMO), "--model", "tiny", "--global-batch-size", "16", "--fp32",
            "--hpp-profiles", PROFILES, "--train-iters", "3", "--save", str(ckpt),
            "--save-params", str(tmp_path / "a.pt")]
    ranks = launch(4, args, extra_env={"HPP_DEVICE_TYPE": "cpu-fast,cpu-fast,cpu-slow,cpu-slow",
                                       "HPP_HOST": "node-a"})
    for r in ranks:
        assert r.returncode == 0, f"rank {r.rank}:\n{r.stderr[-3000:]}"
    said = [line for line in ranks[0].stdout.splitlines() if line.startswith("plan at start-up")]
    assert said == [f"plan at start-up: a new plan, 2xcpu-fast on node-a, 2xcpu-slow on node-a, predicted "
                    f"{json.loads((ckpt / PLAN_FILE).read_text())['predicted']['iteration_ms']:.1f} ms per iteration"]
    assert all("plan at start-up" not in r.stdout for r in ranks[1:])
    assert json.loads((ckpt / PROGRESS_FILE).read_text()) == {"iteration": 3}
    # a membership no plan fits: one line naming the memory needed and present, exit 2 on every
    # rank, the checkpoints kept
    refused = launch(4, ["--hpp-cluster", str(DEMO), "--model", "gpt3-175b", "--global-batch-size", "16",
                         "--fp32", "--train-iters", "3", "--save", str(ckpt)],
                     extra_env={"HPP_DEVICE_TYPE": "cpu-fast,cpu-fast,cpu-slow,cpu-slow"})
    assert [r.returncode for r in refused] == [2] * 4
    lines = refused[0].stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(r"model gpt3-175b needs [\d.]+ GB .* the cluster has [\d.]+ GB", lines[0]), lines
    assert (ckpt / "iter_0000003").is_dir() and (ckpt / "latest").read_text().strip() == "iter_0000003"
    got = torch.load(tmp_path / "a.pt")
    ref_losses, ref_params = train_reference(get_model("tiny"), 16, 3)
    assert got["losses"] == pytest.approx(ref_losses, abs=1e-5)
    assert_same_params(got["params"], ref_params)
    # --hpp-objective: the fleet choice leaves the slow ranks out at this batch; they exit 0,
    # the fast ones train as ranks 0-1 of a group of their own, to the same losses
    fleet = launch(4, ["--hpp-cluster", str(DEMO), "--model", "tiny", "--global-batch-size", "16", "--fp32",
                       "--hpp-profiles", PROFILES, "--train-iters", "3", "--save", str(tmp_path / "fleet"),
                       "--save-params", str(tmp_path / "b.pt"), "--hpp-objective", "throughput"],
                   extra_env={"HPP_DEVICE_TYPE": "cpu-fast,cpu-fast,cpu-slow,cpu-slow"})
    for r in fleet:
        assert r.returncode == 0, f"rank {r.rank}:\n{r.stderr[-3000:]}"
    assert ("plan at start-up: the fleet choice (throughput) uses 2 of 4 ranks; ranks 2-3 are left out and exit"
            in fleet[0].stdout)
    assert "on 2 ranks" in fleet[0].stdout and not fleet[2].stdout.strip() and not fleet[3].stdout.strip()
    kept = json.loads((tmp_path / "fleet" / PLAN_FILE).read_text())
    assert [g["used"] for g in kept["search"]["fleet"]["groups"]] == [1, 0]
    got = torch.load(tmp_path / "b.pt")
    assert got["losses"] == pytest.approx(ref_losses, abs=1e-5)
    assert_same_params(got["params"], ref_params)
