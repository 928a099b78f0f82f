"""The gradient path on gloo: block / device / tensor sync x ZeRO 0 / 1 / 2, mixed precision.

One launch per plan trains, in the same processes, every variant in turn
(tests/runtime/_rt_variants.py), and checks against a plain-torch single-process
reference (whole global batch, the same AdamW, clipping and a warm-up + cosine
learning-rate schedule computed independently by the reference):

* fp32, 3 steps (2 of warm-up, then the peak rate; the cosine decay after it is
  test_checkpoint.py's), each of the 9 variants: losses and parameters equal to 1e-5
  (the block-wise ZeRO 0 variant with one bucket per sub-block, so buffers are
  launched during the backward pass; the test checks that some were);
* per rank, the bytes of weights, gradient buffers and optimizer state counted from
  the tensors equal the cost model's prediction (eth.cost.sync.rank_state_bytes),
  and the bytes of every collective group equal eth.cost.sync.group_sync_bytes;
* block-wise needs fewer collectives than tensor-wise and moves fewer bytes than
  device-wise on every rank;
* bf16 (ZeRO 1), 10 steps: losses within 2e-3 relative and parameters within 0.02
  absolute of the fp32 reference.  Why: bf16 keeps 8 significant bits (relative
  rounding 2^-9 = 2e-3 per value) in weights and activations, while the optimizer
  works on fp32 main weights and fp32 gradients, so errors do not accumulate across
  steps: the loss, a mean over 16 x 32 tokens, differs by ~5e-5 relative in practice
  and each weight by about one bf16 ulp (2^-7 = 0.008 at the layernorm weights ~1);
* fp16 with an initial loss scale of 2^40 overflows: steps are skipped (logged) until
  the dynamic scale backs off, and the losses stay finite.

Plans: (f) tp 4 / 2 / 1 pipelines on the same layers, ranks listed out of order;
(g) different splits inside layers (after softmax: tp 2 -> dp 2; after mlp-gemm-1:
tp 1 -> tp 2; the cut layers' parameters in part blocks), unordered non-contiguous tp
ranks, a dp 2 stage: bf16 and fp16 too on boundaries inside layers;
(e) one pipeline whose tp 2 x dp 2 stage feeds a dp 3 stage (blocks held by 3 ranks).
"""
import json

import pytest
import torch

import _rt_plans as plans
from _rt_reference import assert_same_params, train_reference
from _rt_spawn import REPO, launch
from eth.spec.plan import load_plan
from eth.spec.precision import TrainSetup
from eth.cost.sync import group_sync_bytes, rank_state_bytes

pytestmark = pytest.mark.slow   # gloo launches: `make test-fast` leaves them out

ITERS, BF16_ITERS, TOL, CLIP = 3, 10, 1e-5, 0.5
SCHEDULE = {"lr": 2e-3, "min_lr": 1e-4, "warmup": 2}


def fp32(zero):
    return {"precision": "fp32", "zero_stage": zero, "grad_reduce": "fp32"}


def variants(extra):
    out = []
    for strategy in ("block", "device", "tensor"):
        for zero in (0, 1, 2):
            v = {"name": f"{strategy}-z{zero}", "grad_sync": strategy, "training": fp32(zero),
                 "train_iters": ITERS, "clip_grad": CLIP, **SCHEDULE}
            if strategy == "block" and zero == 0:
                v["bucket_numel"] = 1       # one bucket per sub-block: launched during backward
            out.append(v)
    out.append({"name": "bf16", "training": {"precision": "bf16", "zero_stage": 1, "grad_reduce": "fp32"},
                "train_iters": BF16_ITERS, "clip_grad": CLIP})
    return out + extra


FP16_SKIP = {"name": "fp16-skip", "training": {"precision": "fp16", "zero_stage": 0, "grad_reduce": "fp32"},
             "train_iters": 4, "clip_grad": CLIP, "initial_loss_scale": 2.0 ** 40}


@pytest.fixture(scope="module")
def reference():
    runs = {}

    def get(gbs, iters, schedule):
        key = (gbs, iters, tuple(sorted(schedule.items())))
        if key not in runs:
            runs[key] = train_reference(plans.tp_1_2_4_same_layers().model, gbs, iters, clip=CLIP, **schedule)
        return runs[key]
    return get


def _records(out, name, world):
    return [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(world)]


def _per_group(collectives):
    got = {}
    for ranks, nbytes in collectives:
        got[tuple(ranks)] = got.get(tuple(ranks), 0) + nbytes
    return got


@pytest.mark.parametrize("make_plan", [plans.tp_1_2_4_same_layers, plans.different_splits_with_dp,
                                       plans.tp_dp_stage_to_uneven_dp3], ids=lambda f: f.__name__)
def test_every_grad_sync_and_zero_stage_matches_single_process(make_plan, reference, tmp_path):
    plan = make_plan()
    plan.save(tmp_path / "plan.json")
    extra = [FP16_SKIP] if make_plan is plans.different_splits_with_dp else []
    runs = variants(extra)
    results = launch(plan.world_size, [str(tmp_path / "plan.json"), str(tmp_path), json.dumps(runs)],
                     timeout=600, script=REPO / "tests/runtime/_rt_variants.py")
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exit {r.returncode}:\n{r.stderr[-3000:]}"
    world = plan.world_size
    ref_losses, ref_params = reference(plan.gbs, ITERS, SCHEDULE)
    stats = {}
    for v in runs[:9]:
        saved = torch.load(tmp_path / f"{v['name']}.pt")
        assert saved["losses"] == pytest.approx(ref_losses, abs=TOL), (v["name"], saved["losses"], ref_losses)
        assert_same_params(saved["params"], ref_params, TOL, v["name"])
        records = _records(tmp_path, v["name"], world)
        stats[v["name"]] = records
        setup = TrainSetup(**v["training"])
        if v["grad_sync"] == "block":
            predicted = rank_state_bytes(load_plan(tmp_path / "plan.json"), setup)
            for rank, rec in enumerate(records):
                assert {k: rec[k] for k in ("weights", "grads", "optimizer")} == predicted[rank], (v["name"], rank)
            groups = group_sync_bytes(load_plan(tmp_path / "plan.json"), setup)
            for rank, rec in enumerate(records):
                assert _per_group(rec["collectives"]) == {g: b for g, b in groups.items() if rank in g}
    assert sum(r["launched_early"] for r in stats["block-z0"]) > 0
    for rank in range(world):
        block, tensor, device = (stats[f"{s}-z0"][rank]["collectives"] for s in ("block", "tensor", "device"))
        assert len(block) <= len(tensor)
        assert sum(b for _, b in block) <= sum(b for _, b in device)
    assert sum(len(stats["tensor-z0"][r]["collectives"]) for r in range(world)) > \
        sum(len(stats["block-z0"][r]["collectives"]) for r in range(world))

    bf16 = torch.load(tmp_path / "bf16.pt")
    ref_losses, ref_params = reference(plan.gbs, BF16_ITERS, {})
    assert bf16["losses"] == pytest.approx(ref_losses, rel=2e-3)
    diffs = [(bf16["params"][k] - ref_params[k]).abs().max().item() for k in ref_params]
    assert max(diffs) < 0.02 and max(diffs) > 1e-4   # bf16 rounding is there, and bounded

    if extra:
        records = _records(tmp_path, "fp16-skip", world)
        assert records[0]["skipped"] >= 2 and all(r["finite"] for r in records)
        assert {r["skipped"] for r in records} == {records[0]["skipped"]}   # every rank agrees
