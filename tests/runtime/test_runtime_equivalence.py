"""Heterogeneous plans on 3-7 gloo ranks reproduce a single-process dense reference.
(Plan (e), a tp 2 x dp 2 stage feeding a dp 3 stage, is checked the same way by
test_grad_path.py's block-wise ZeRO 0 variant, in the launch that trains its other variants.)

Each launch trains 3 steps of the tiny fp32 GPT and checks, in one go: every rank
exited 0, rank 0 logged every iteration, the losses and the final full parameters
match the reference (plain torch, whole global batch) to 1e-5, with gradient
clipping active so that the global norm must count every element exactly once; and
that rank 0 alone warns about tp groups split across nodes (LOCAL_WORLD_SIZE 3).
"""
import pytest
import torch

import _rt_plans as plans
from _rt_reference import assert_same_params, train_reference
from _rt_spawn import launch

pytestmark = pytest.mark.slow   # gloo launches: `make test-fast` leaves them out

ITERS = 3
TOL = 1e-5
CLIP = 0.5  # below the gradient norms of these runs (~0.8), so clipping and the norm count


@pytest.fixture(scope="module")
def reference():
    """The single-process reference run for a global batch size (computed once each)."""
    spec, runs = plans.two_pipelines_different_depth().model, {}

    def get(gbs):
        if gbs not in runs:
            runs[gbs] = train_reference(spec, gbs, ITERS, clip=CLIP)
        return runs[gbs]
    return get


@pytest.mark.parametrize("make_plan", [plans.two_pipelines_different_depth,
                                       plans.tp_stage_next_to_dp_stage,
                                       plans.uneven_lbs_different_mbs,
                                       plans.same_layers_different_tp,
                                       plans.boundaries_inside_layers],
                         ids=lambda f: f.__name__)
def test_plan_matches_single_process(make_plan, reference, tmp_path):
    plan = make_plan()
    plan.save(tmp_path / "plan.json")
    out = tmp_path / "params.pt"
    # 3 ranks per "node": plan (e)'s tp group (2, 3) spans two of them, the others' fit
    results = launch(plan.world_size, ["--hpp-plan", str(tmp_path / "plan.json"),
                                       "--train-iters", str(ITERS), "--clip-grad", str(CLIP),
                                       "--save-params", str(out)],
                     extra_env={"LOCAL_WORLD_SIZE": "3"})
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exit {r.returncode}:\n{r.stderr[-3000:]}"
    log = [line for line in results[0].stdout.splitlines() if line.startswith("iteration")]
    assert len(log) == ITERS, results[0].stdout
    warned = [[line for line in r.stderr.splitlines() if "LOCAL_WORLD_SIZE" in line] for r in results]
    crosses = make_plan is plans.tp_dp_stage_to_uneven_dp3
    assert warned[0] == (["warning: LOCAL_WORLD_SIZE 3 puts 1 tp group(s) across nodes, e.g. "
                          f"tp p0 s0 d1 (ranks 2..3); the plan's cluster has {plan.world_size} devices per node and keeps "
                          "that group on one node: tp collectives will cross the inter-node link"]
                         if crosses else [])
    assert not any(warned[1:])
    saved = torch.load(out)
    ref_losses, ref_params = reference(plan.gbs)
    assert saved["losses"] == pytest.approx(ref_losses, abs=TOL), (saved["losses"], ref_losses)
    assert_same_params(saved["params"], ref_params, TOL)
    # The reference really moved the weights, so equality above is not trivial.
    from eth.layout.params import all_specs
    from megatron.hpp.models.gpt import full_parameter
    spec = plan.model
    moved = max((ref_params[s.name] - full_parameter(spec, s, 1234)).abs().max().item()
                for s in all_specs(spec))
    assert moved > 1e-3
