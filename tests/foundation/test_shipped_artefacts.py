"""What the repository ships stays what its commands make: every shipped plan's stored
prediction is what the current cost model computes for it (``make results`` rebuilds
them), and .gitignore covers everything the README's commands write."""
import re
import subprocess
from pathlib import Path

import pytest

from eth.cost.model import CostModel
from eth.profiles.db import ProfileDB
from eth.spec.plan import load_plan

REPO = Path(__file__).resolve().parents[2]
PLANS = sorted(p.relative_to(REPO).as_posix() for p in
               list((REPO / "examples" / "plans").glob("*.json")) + list((REPO / "bench" / "results").rglob("plans/*.json")))


def test_there_are_shipped_plans():
    assert "examples/plans/cpu-demo.json" in PLANS and len(PLANS) >= 10


@pytest.mark.parametrize("path", PLANS)
def test_shipped_plan_prediction_is_current(path):
    plan = load_plan(REPO / path)
    # the profiles it was searched with, in this checkout; paper_eval: the shipped analytic ones
    where = REPO / (plan.search.get("profiles_checkout_path") or "profiles")
    profiles = ProfileDB.load(where)
    profiles.ensure(plan.model, plan.cluster.types.values())
    now = CostModel(plan.model, plan.cluster, profiles, plan.training).evaluate(plan)
    stored = plan.predicted["iteration_ms"]
    assert now["iteration_ms"] == pytest.approx(stored, rel=1e-6, abs=1e-3), (
        f"{path} stores {stored} ms, the cost model now says {now['iteration_ms']:.4f} ms: run `make results`")
    assert now["feasible"] == plan.predicted["feasible"], f"{path}: feasibility changed: run `make results`"
    # every pipeline's and stage's stored figures too (4 decimals; one last-digit flip allowed)
    again = load_plan(REPO / path)
    CostModel(again.model, again.cluster, profiles, again.training).annotate(again)
    for i, (p, q) in enumerate(zip(plan.pipelines, again.pipelines)):
        assert p.predicted.keys() == q.predicted.keys(), (path, i)
        for k in p.predicted:
            assert p.predicted[k] == pytest.approx(q.predicted[k], rel=0, abs=1.5e-4), (path, i, k)
        for j, (st, sq) in enumerate(zip(p.stages, q.stages)):
            assert st.predicted.keys() == sq.predicted.keys(), (path, i, j)
            for k in st.predicted:
                assert st.predicted[k] == pytest.approx(sq.predicted[k], rel=0, abs=1.5e-4), (path, i, j, k)


# what the README's "Using it" commands and `make run` write, relative to the checkout
README_OUTPUTS = ["plan.json", "plan.png", "cpu-plan.json", "cpu-plan0.json", "cpu-plan-hf.json", "llama-plan.json",
                  "ckpt/iter_0000010/x", "ckpt-startup/hpp-plan.json", "data/alice.bin", "my_profiles/cpu.json", "out/plan.json",
                  "out/bench/paper_eval.md"]


def test_gitignore_covers_what_the_readme_writes():
    readme = (REPO / "README.md").read_text()
    for name in ["-o plan.json", "--png plan.png", "-o cpu-plan.json", "-o cpu-plan0.json", "-o cpu-plan-hf.json",
                 "-o llama-plan.json",
                 "--save ckpt", "--save ckpt-startup", "--output-prefix data/alice", "-o my_profiles/cpu.json"]:
        assert name in readme, f"README no longer says {name!r}: update README_OUTPUTS"
    try:
        proc = subprocess.run(["git", "check-ignore", "--no-index", *README_OUTPUTS], cwd=REPO,
                              capture_output=True, text=True)
    except OSError:
        pytest.skip("no git")
    if proc.returncode == 128:
        pytest.skip("not a git checkout")
    assert sorted(proc.stdout.split()) == sorted(README_OUTPUTS)


MACHINE_PATH = re.compile(r"(/work/|/root/|/home/[A-Za-z]|/Users/|/tmp/[A-Za-z0-9_])")


def test_no_tracked_file_holds_a_path_of_the_machine_it_was_made_on():
    """Plans, results, profiles and docs carry paths relative to the checkout (tests may
    name made-up scratch paths)."""
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    found = []
    for name in files.decode().split("\0"):
        if not name or name.startswith("tests/") or not (REPO / name).is_file():
            continue
        try:
            text = (REPO / name).read_text()
        except UnicodeDecodeError:
            continue
        found += [f"{name}: {m.group(0)}" for m in MACHINE_PATH.finditer(text)]
    assert not found, found[:20]
