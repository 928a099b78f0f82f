"""Checkpoints that detect damage, and runs that end on a signal.

* ``checkpoint.find`` (pure): a manifest missing or not JSON, a file missing, a size
  changed, ``common.json`` changed at the same size: each passes the folder over for the
  newest older intact one, with the reason; folders above the one ``latest`` names are
  another run's and are not read; nothing intact is one line naming the newest.
* One rank killed (SIGKILL) in the middle of a save, after the shards are written: every
  rank stops, the ``.tmp`` folder is never read, and ``--load`` resumes from the last
  intact iteration; the losses equal a single-process run of all iterations (1e-5).
  Then a shard cut short plus ``common.json`` replaced by ``{``: the next ``--load``
  passes both over and gives the same losses again; one changed byte in a shard (size
  kept): the checksums, compared by default on --load, find it and fall back.
* SIGTERM to torchrun with ``--exit-signal-handler``: the iteration in progress ends, a
  checkpoint is saved, the run exits before torchrun's grace period; resumed under a
  plan with half the global batch, training goes on from the saved consumed samples
  (log, checkpoint and the dataset positions read).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

import _rt_plans as plans
from _rt_reference import train_reference
from _rt_spawn import REPO, launch
from eth.errors import SpecError
from eth.spec.plan import PipelinePlan
from eth.spec.precision import TrainSetup
from megatron.hpp.data.datasets import DataConfig, build_sources, shipped_corpus
from megatron.hpp.training.checkpoint import check_load, file_entries, find, setup_changes, write_manifest

ITERS = 8


def two_ranks(gbs: int = 16):
    """Two one-stage pipelines on ranks 0 and 1, lbs gbs/2 each."""
    half = gbs // 2
    return plans.make(2, [PipelinePlan(4, half, [plans.stage([0], 1, 1, (0, 4))]),
                          PipelinePlan(4, half, [plans.stage([1], 1, 1, (0, 4))])], gbs=gbs)


def _fake(root, iteration: int, files: dict) -> None:
    folder = root / f"iter_{iteration:07d}"
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    write_manifest(folder, file_entries(folder, sorted(files)))


def test_find_passes_damaged_checkpoints_over(tmp_path):
    for it in (2, 4, 6, 8, 10):
        _fake(tmp_path, it, {"common.json": b'{"iteration": %d}' % it, "__0_0.distcp": b"x" * 100})
    (tmp_path / "latest").write_text("iter_0000008\n")   # 10: a leftover of another run
    assert find(tmp_path).path == tmp_path / "iter_0000008"
    (tmp_path / "iter_0000008" / "__0_0.distcp").write_bytes(b"x" * 60)             # cut short
    (tmp_path / "iter_0000006" / "common.json").write_bytes(b'{"iteration": 7}')    # same size
    (tmp_path / "iter_0000004" / "manifest.json").unlink()                          # unsealed
    found = find(tmp_path)
    assert found.path == tmp_path / "iter_0000002" and found.candidates == [found.path]
    assert [(p.name, why) for p, why in found.damaged] == [
        ("iter_0000008", "__0_0.distcp has 60 bytes, the manifest says 100 (cut short or overwritten)"),
        ("iter_0000006", "common.json does not match its checksum (its bytes were changed)"),
        ("iter_0000004", "no manifest.json (a save that did not finish, or one written without checksums)")]
    assert found.lines()[0] == (f"checkpoint {tmp_path / 'iter_0000008'} is damaged (__0_0.distcp has 60 bytes, "
                                f"the manifest says 100 (cut short or overwritten)): passed over")
    (tmp_path / "iter_0000002" / "__0_0.distcp").unlink()                          # deleted
    assert find(tmp_path).damaged[-1] == (tmp_path / "iter_0000002", "__0_0.distcp is missing")
    with pytest.raises(SpecError, match=r"no intact checkpoint: iter_0000008 is damaged \(__0_0.distcp has 60 "
                                        r"bytes.*\), and 3 older one\(s\) too; the folder is left as it is"):
        check_load(tmp_path, None)
    (tmp_path / "iter_0000002" / "manifest.json").write_text("{")
    assert find(tmp_path).damaged[-1][1] == "manifest.json is not a manifest (not JSON or no files list)"


def test_setup_changes_on_resume_are_said():
    plan = two_ranks(8)
    plan.training = TrainSetup("fp32", 1, "fp32")
    trainer = SimpleNamespace(plan=plan, setup=plan.training)
    common = {"iteration": 4, "consumed_samples": 64,
              "training": {"precision": "bf16", "zero_stage": 1, "grad_reduce": "fp32"}}
    assert setup_changes(common, trainer) == [
        "note: the checkpoint was trained with precision bf16, this run uses fp32 (the fp32 main weights and "
        "moments carry over; the compute weights are cast)",
        "note: the checkpoint's run consumed 64 samples in 4 iterations, this plan's global batch is 8: training "
        "goes on from sample 64"]
    assert setup_changes(dict(common, consumed_samples=32, training=plan.training.to_dict()), trainer) == []


def _ok(results):
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exit {r.returncode}:\n{r.stderr[-3000:]}"
    return results[0]


def _corrupt_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_killed_save_and_damaged_checkpoints_resume_from_the_last_intact(tmp_path):
    two_ranks().save(tmp_path / "p.json")
    ref, _ = train_reference(two_ranks().model, 16, ITERS)
    ckpt = tmp_path / "ck"
    run = ["--hpp-plan", str(tmp_path / "p.json"), "--train-iters", str(ITERS), "--log-interval", "8"]
    killed = launch(2, [*run, "--save", str(ckpt), "--save-interval", "2"],
                    extra_env={"HPP_TEST_KILL_IN_SAVE": "1:6"})
    assert killed[1].returncode == -signal.SIGKILL and killed[0].returncode == 1, killed[0].stderr[-2000:]
    assert "communication failed during checkpoint saving" in killed[0].stderr
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "iter_0000004", "iter_0000006.tmp", "latest"]

    out = _ok(launch(2, [*run, "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "2",
                         "--save-params", str(tmp_path / "a.pt")]))
    assert f"resumed from {ckpt / 'iter_0000004'} at iteration 4 (64 samples consumed)" in out.stdout
    resumed = torch.load(tmp_path / "a.pt")["losses"]
    assert resumed == pytest.approx(ref[4:], abs=1e-5)
    assert (ckpt / "latest").read_text().strip() == "iter_0000008" and not (ckpt / "iter_0000006.tmp").exists()

    damaged = tmp_path / "damaged"
    shutil.copytree(ckpt, damaged)
    shard = sorted((damaged / "iter_0000008").glob("*.distcp"))[1]
    shard.write_bytes(shard.read_bytes()[:1000])
    (damaged / "iter_0000006" / "common.json").write_text("{")
    out = _ok(launch(2, [*run, "--load", str(damaged), "--save-params", str(tmp_path / "b.pt")]))
    lines = out.stdout.splitlines()
    assert any(line.startswith(f"checkpoint {damaged / 'iter_0000008'} is damaged ({shard.name} has 1000 bytes")
               for line in lines), out.stdout
    assert f"checkpoint {damaged / 'iter_0000006'} is damaged (common.json has 1 bytes" in out.stdout
    assert f"resumed from {damaged / 'iter_0000004'} at iteration 4" in out.stdout
    assert torch.load(tmp_path / "b.pt")["losses"] == resumed

    flipped = tmp_path / "flipped"
    shutil.copytree(ckpt, flipped)
    _corrupt_byte(sorted((flipped / "iter_0000008").glob("*.distcp"))[0])
    out = _ok(launch(2, [*run, "--train-iters", "9", "--load", str(flipped),     # verified by default
                         "--save-params", str(tmp_path / "c.pt")]))
    assert "does not match its checksum (its bytes were changed)): passed over" in out.stdout, out.stdout
    assert f"resumed from {flipped / 'iter_0000006'} at iteration 6" in out.stdout
    assert torch.load(tmp_path / "c.pt")["losses"][:2] == resumed[2:]


@pytest.mark.slow
def test_sigterm_saves_and_a_smaller_global_batch_goes_on_from_the_consumed_samples(tmp_path):
    two_ranks(16).save(tmp_path / "p16.json")
    two_ranks(8).save(tmp_path / "p8.json")
    ckpt, data = tmp_path / "ck", ["--data-path", shipped_corpus()]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", XDG_CACHE_HOME=str(tmp_path / "xdg"))
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "pretrain_gpt.py", "--hpp-plan", str(tmp_path / "p16.json"), "--train-iters", "500",
                             "--save", str(ckpt), "--exit-signal-handler", *data],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:           # the first logged iteration: the run is under way
        seen.append(line)
        if line.startswith("iteration 2/500"):
            break
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    rest, _ = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 30, "torchrun kills its workers 30 s after forwarding SIGTERM"
    stopped = [line for line in (seen + rest.splitlines()) if "SIGTERM received" in line]
    assert len(stopped) == 1, "".join(seen) + rest
    done = int(stopped[0].split("stopped after iteration ")[1].split(",")[0])
    assert 2 <= done < 500 and stopped[0].endswith(f"checkpoint in {ckpt}")
    assert (ckpt / "latest").read_text().strip() == f"iter_{done:07d}"
    common = json.loads((ckpt / f"iter_{done:07d}" / "common.json").read_text())
    assert common["consumed_samples"] == 16 * done and common["data"]["train_samples_built"] == 16 * 500

    # half the global batch: iterations done+1, done+2 read samples 16*done on, 8 each
    out = _ok(launch(2, ["--hpp-plan", str(tmp_path / "p8.json"), "--train-iters", str(done + 2), *data,
                         "--load", str(ckpt), "--save", str(ckpt), "--log-interval", "1"],
                     extra_env={"XDG_CACHE_HOME": str(tmp_path / "xdg")}))
    assert (f"note: the checkpoint's run consumed {16 * done} samples in {done} iterations, this plan's global "
            f"batch is 8: training goes on from sample {16 * done}") in out.stdout
    logged = [line.split(" | ")[1] for line in out.stdout.splitlines() if line.startswith("iteration")]
    assert logged == [f"consumed samples {16 * done + 8}", f"consumed samples {16 * done + 16}"]
    common = json.loads((ckpt / f"iter_{done + 2:07d}" / "common.json").read_text())
    assert common["consumed_samples"] == 16 * done + 16 and common["data"]["train_samples_built"] == 16 * 500
    # the positions: the resumed source's global batch done is the first run's samples 16*done ..
    cfg = DataConfig((shipped_corpus(),), 32, 256, 1234)
    os.environ["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    try:
        first = build_sources(cfg, 16, 500, progress=False).train
        second = build_sources(cfg, 8, done + 2, progress=False, train_samples=16 * 500,
                               offset=16 * done - 8 * done).train
    finally:
        del os.environ["XDG_CACHE_HOME"]
    for i in range(8):
        assert torch.equal(second.sample(done, i), first.sample(done, i))
        assert torch.equal(second.sample(done + 1, i), first.sample(done, 8 + i))
