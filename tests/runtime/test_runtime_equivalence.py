"""Heterogeneous plans on 3-5 gloo ranks reproduce a single-process dense reference.

Each launch trains 3 steps of the tiny fp32 GPT and checks, in one go: every rank
exited 0, rank 0 logged every iteration, the losses and the final full parameters
match the reference (plain torch, whole global batch) to 1e-5, with gradient
clipping active so that the global norm must count every element exactly once.
"""
import pytest
import torch

import _rt_plans as plans
from _rt_reference import train_reference
from _rt_spawn import launch

ITERS = 3
TOL = 1e-5
CLIP = 0.5  # below the gradient norms of these runs (~0.8), so clipping and the norm count


@pytest.fixture(scope="module")
def reference():
    spec = plans.two_pipelines_different_depth().model
    return train_reference(spec, plans.GBS, ITERS, clip=CLIP)


@pytest.mark.parametrize("make_plan", [plans.two_pipelines_different_depth,
                                       plans.tp_stage_next_to_dp_stage,
                                       plans.uneven_lbs_different_mbs,
                                       plans.same_layers_different_tp],
                         ids=lambda f: f.__name__)
def test_plan_matches_single_process(make_plan, reference, tmp_path):
    plan = make_plan()
    plan.save(tmp_path / "plan.json")
    out = tmp_path / "params.pt"
    results = launch(plan.world_size, ["--hpp-plan", str(tmp_path / "plan.json"),
                                       "--train-iters", str(ITERS), "--clip-grad", str(CLIP),
                                       "--save-params", str(out)])
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exit {r.returncode}:\n{r.stderr[-3000:]}"
    log = [line for line in results[0].stdout.splitlines() if line.startswith("iteration")]
    assert len(log) == ITERS, results[0].stdout
    saved = torch.load(out)
    ref_losses, ref_params = reference
    assert saved["losses"] == pytest.approx(ref_losses, abs=TOL), (saved["losses"], ref_losses)
    assert set(saved["params"]) == set(ref_params)
    worst = max((saved["params"][k] - ref_params[k]).abs().max().item() for k in ref_params)
    assert worst < TOL, f"largest parameter difference {worst:.3g}"
    # The reference really moved the weights, so equality above is not trivial.
    from megatron.hpp.model import all_specs, full_parameter
    spec = plan.model
    moved = max((ref_params[s.name] - full_parameter(spec, s, 1234)).abs().max().item()
                for s in all_specs(spec))
    assert moved > 1e-3
