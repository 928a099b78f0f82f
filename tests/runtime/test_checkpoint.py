"""Checkpoints that survive a re-plan (megatron.hpp.training.checkpoint).

* The boxes a flat range of a piece is written as cover exactly that range (brute force).
* 4 steps under plan A (7 ranks: two pipelines of different splits, a dp 2 stage, tp 2
  stages with unordered ranks; ZeRO 1), saved and stopped by --exit-interval; resumed
  under plan B (3 ranks: pipelines of 1 and 2 stages, tp 1; ZeRO 2) for 4 more steps:
  losses and parameters equal an uninterrupted 8-step single-process run with a warm-up
  + cosine schedule (1e-5).  Before the resume a half-written newer save is left in the
  folder (what a killed save leaves): it is ignored, and the next save replaces it.
* A checkpoint of another model shape is refused with one line and exit 2 on every rank.
"""
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

import _rt_plans as plans
from _rt_reference import assert_same_params, train_reference
from _rt_spawn import launch
from eth.layout.blocks import Piece
from eth.errors import SpecError
from eth.layout.params import ShardSpec
from eth.spec.plan import PipelinePlan
from eth.spec.precision import TrainSetup
from megatron.hpp.training.checkpoint import _piece_boxes, check_load, file_entries, write_manifest

SCHEDULE = ["--lr", "2e-3", "--min-lr", "1e-4", "--warmup", "2", "--clip-grad", "0.5"]


@pytest.mark.parametrize("shape,dim,chunks", [((12, 8), 0, 3), ((8, 12), 1, 4), ((24,), 0, 2), ((5, 7), None, 1)])
def test_boxes_cover_a_flat_range_exactly(shape, dim, chunks):
    piece_of = [Piece(ShardSpec("p", "layer 0", shape, dim, "normal"), c, chunks) for c in range(chunks)]
    rng = np.random.default_rng(0)
    for piece in piece_of:
        for _ in range(20):
            lo, hi = sorted(rng.integers(0, piece.numel + 1, size=2))
            if lo == hi:
                continue
            full, seen = np.zeros(shape, dtype=int), 0
            for off, size, s, e in _piece_boxes(piece, int(lo), int(hi)):
                full[tuple(slice(o, o + n) for o, n in zip(off, size))] += 1
                assert np.prod(size) == e - s
                seen += e - s
            expect = np.zeros(piece.shape, dtype=int).reshape(-1)
            expect[lo:hi] = 1
            where = [slice(None)] * len(shape)
            if dim is not None:
                rows = piece.shape[dim]
                where[dim] = slice(piece.chunk * rows, (piece.chunk + 1) * rows)
            assert (full[tuple(where)] == expect.reshape(piece.shape)).all() and full.sum() == hi - lo == seen


def _write_common(folder, common) -> None:
    """common.json alone, sealed by a manifest as a save seals it."""
    (folder / "common.json").write_text(json.dumps(common))
    write_manifest(folder, file_entries(folder, ["common.json"]))


def test_checkpoint_of_another_shape_is_refused(tmp_path):
    (tmp_path / "iter_0000004").mkdir()
    model = plans.tp_1_2_4_same_layers().model
    common = {"iteration": 4, "model": dict(model.to_dict(), hidden=32)}
    _write_common(tmp_path / "iter_0000004", common)
    (tmp_path / "latest").write_text("iter_0000004\n")
    with pytest.raises(SpecError, match="another model shape .* hidden 32 != 64"):
        check_load(tmp_path, model)
    assert check_load(tmp_path / "none", model, save=tmp_path / "none") is None
    # a stale marker (its folder replaced by a killed re-save): the newest complete folder
    (tmp_path / "latest").write_text("iter_0000008\n")
    (tmp_path / "iter_0000008.tmp").mkdir()
    with pytest.raises(SpecError, match="iter_0000004 is of another model shape"):
        check_load(tmp_path, model)
    # same sizes, other layers (a LayerNorm / learned-position / bias GPT into an RMSNorm /
    # rope / no-bias model), or another rope base: refused; a checkpoint written before
    # these fields existed reads as the GPT defaults
    common["model"] = {k: v for k, v in model.to_dict(compact=True).items()}
    _write_common(tmp_path / "iter_0000004", common)
    assert check_load(tmp_path, model)["iteration"] == 4
    llama = replace(model, norm="rmsnorm", position="rope", bias=False)
    with pytest.raises(SpecError, match="norm layernorm != rmsnorm, position learned != rope, bias True != False"):
        check_load(tmp_path, llama)
    with pytest.raises(SpecError, match="rope_theta 10000.0 != 500000.0"):
        check_load(tmp_path, replace(model, rope_theta=500000.0))


@pytest.mark.slow
def test_resume_under_another_plan_equals_an_uninterrupted_run(tmp_path):
    plan_a, plan_b = plans.different_splits_with_dp(), plans.two_pipelines_different_depth()
    plan_a.training, plan_b.training = TrainSetup("fp32", 1, "fp32"), TrainSetup("fp32", 2, "fp32")
    plan_a.save(tmp_path / "a.json")
    plan_b.save(tmp_path / "b.json")
    ckpt = tmp_path / "ckpt"
    first = launch(7, ["--hpp-plan", str(tmp_path / "a.json"), "--train-iters", "8", *SCHEDULE,
                       "--save", str(ckpt), "--save-interval", "4", "--exit-interval", "4",
                       "--save-params", str(tmp_path / "a.pt")])
    for r in first:
        assert r.returncode == 0, f"rank {r.rank}:\n{r.stderr[-3000:]}"
    assert (ckpt / "latest").read_text().strip() == "iter_0000004"
    junk = ckpt / "iter_0000008.tmp"          # what a save killed half-way leaves
    junk.mkdir()
    (junk / "__0_0.distcp").write_bytes(b"half")
    second = launch(3, ["--hpp-plan", str(tmp_path / "b.json"), "--train-iters", "8", *SCHEDULE,
                        "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "4",
                        "--save-params", str(tmp_path / "b.pt")])
    for r in second:
        assert r.returncode == 0, f"rank {r.rank}:\n{r.stderr[-3000:]}"
    assert (ckpt / "latest").read_text().strip() == "iter_0000008" and not junk.exists()
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    ref_losses, ref_params = train_reference(plan_a.model, plan_a.gbs, 8, clip=0.5, lr=2e-3,
                                             min_lr=1e-4, warmup=2)
    assert len(a["losses"]) == 4 and len(b["losses"]) == 4
    assert a["losses"] + b["losses"] == pytest.approx(ref_losses, abs=1e-5)
    assert_same_params(b["params"], ref_params)

    other = plans.make(1, [PipelinePlan(2, 16, [plans.stage([0], 1, 1, (0, 2))])])
    other.model = replace(other.model, num_layers=2)
    other.save(tmp_path / "other.json")
    refused = launch(1, ["--hpp-plan", str(tmp_path / "other.json"), "--train-iters", "2", "--load", str(ckpt)])
    lines = refused[0].stderr.strip().splitlines()
    assert refused[0].returncode == 2 and len(lines) == 1
    assert "another model shape" in lines[0] and "num_layers 4 != 2" in lines[0]
    # the --save folder itself (auto-resume) starts fresh with a line saying so (a --load
    # typo or a folder without a checkpoint: test_bad_inputs.py, test_metrics_failures.py)
    other = ["--hpp-plan", str(tmp_path / "other.json"), "--train-iters", "2"]
    (fresh,) = launch(1, [*other, "--load", str(tmp_path / "new"), "--save", str(tmp_path / "new")])
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert f"no checkpoint yet in {tmp_path / 'new'} (the --save folder): starting from iteration 0" in fresh.stdout
    assert (tmp_path / "new" / "latest").read_text().strip() == "iter_0000002"


@pytest.mark.slow
def test_resume_across_every_precision_pair(tmp_path):
    """A checkpoint saved under fp32, bf16 or fp16 resumes under each of the other two (the
    fp32 main weights and moments carry over; the fp16 loss scaler is restored only where
    both runs have one): each of the six resumes runs on from iteration 2, says what
    changed, and its losses continue the saved run's."""
    import math

    plan = plans.make(1, [PipelinePlan(2, 16, [plans.stage([0], 1, 1, (0, 2))])])
    plan.model = replace(plan.model, num_layers=2)
    precisions = ("fp32", "bf16", "fp16")
    saved = {}
    for p in precisions:
        plan.training = TrainSetup(p, 0, "fp32")
        plan.save(tmp_path / f"{p}.json")
        (r,) = launch(1, ["--hpp-plan", str(tmp_path / f"{p}.json"), "--train-iters", "2", "--lr", "1e-3",
                          "--save", str(tmp_path / f"ckpt-{p}"), "--save-interval", "2",
                          "--save-params", str(tmp_path / f"{p}.pt")])
        assert r.returncode == 0, f"{p}:\n{r.stderr[-3000:]}"
        saved[p] = torch.load(tmp_path / f"{p}.pt")["losses"]
    for a in precisions:
        for b in precisions:
            if a == b:
                continue
            (r,) = launch(1, ["--hpp-plan", str(tmp_path / f"{b}.json"), "--train-iters", "4", "--lr", "1e-3",
                              "--load", str(tmp_path / f"ckpt-{a}"), "--save-params", str(tmp_path / f"{a}-{b}.pt")])
            assert r.returncode == 0, f"{a} -> {b}:\n{r.stderr[-3000:]}"
            out = r.stdout + r.stderr
            assert f"precision {a}, this run uses {b}" in out, (a, b, out[-2000:])
            losses = torch.load(tmp_path / f"{a}-{b}.pt")["losses"]
            assert len(losses) == 2 and all(math.isfinite(x) for x in losses), (a, b, losses)
            assert losses[0] < saved[a][0], (a, b, losses, saved[a])     # on from the saved weights
