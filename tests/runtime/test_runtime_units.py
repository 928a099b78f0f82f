"""Runtime pieces without real process groups: layout of a 1024-rank plan (symbolic and
on torch's fake backend), data slicing, resharding overlaps, weight independence of
the plan; plus bad-input launches that must fail on every rank with exit code 2."""
import numpy
import pytest
import torch

import _rt_plans as plans
from _rt_spawn import REPO, launch
from eth.errors import PlanError
from megatron.hpp.parallel import topology
from megatron.hpp.data.batches import SyntheticData, batch, overlaps, sample_range


def test_layout_of_1024_rank_plan():
    plan = plans.large_1024().validate()
    layout = topology.check_plan(plan, 1024)
    assert [s.rank for s in layout.slots] == list(range(1024))
    tp_members = sorted(r for g in layout.groups if g.kind == "tp" for r in g.ranks)
    assert tp_members == list(range(1024))  # every rank in exactly one tp group
    # Layer 0 lives in the first stage of all 8 pipelines: 4 x 32 + 4 x 16 ranks.
    assert len(layout.holders["layer 0"]) == 4 * 32 + 4 * 16
    assert layout.holders["embedding"] == layout.holders["layer 0"]
    # Layer 23 is in the last stage of every pipeline; every layer held by 192 ranks.
    assert all(len(layout.holders[f"layer {i}"]) == 192 for i in range(24))
    slot = layout.slots[700]  # RTX3090 part starts at 512; 128 ranks per pipeline
    assert (slot.pipeline, slot.stage, slot.tp_rank, slot.dp_rank) == (5, 3, 0, 3)
    text = layout.describe()
    assert "world 1024" in text and "pipeline 7: mbs 4 lbs 96" in text


def test_layout_errors_name_the_numbers():
    plan = plans.large_1024()
    with pytest.raises(PlanError, match="plan needs 1024 ranks, WORLD_SIZE is 32"):
        topology.check_plan(plan, 32)
    with pytest.raises(PlanError, match=r"sum of pipeline lbs is 16 but gbs is 12"):
        topology.check_plan(plans.too_large_gbs_sum(), 2)
    from dataclasses import replace

    gqa = plans.two_pipelines_different_depth()   # grouped-query attention runs (tests/runtime/test_llama.py)
    gqa.model = replace(gqa.model, kv_heads=2)
    assert topology.check_plan(gqa, 3).world_size == 3


def test_dry_run_cli_on_fake_backend(tmp_path, capsys):
    plans.large_1024().save(tmp_path / "big.json")
    assert topology.main(["--plan", str(tmp_path / "big.json"), "--dry-run", "--fake-rank", "700"]) == 0
    out = capsys.readouterr().out
    assert "fake backend: rank 700 = pipeline 5 stage 3 tp 0 dp 3" in out
    # every layer has 32 replicas (8 pipelines x dp 4) at tp 8 and tp 4: g = 8 sub-blocks of
    # 32 ranks; the holder sets change every 3 layers (the tp 4 pipelines' stages): 8 x 8
    # groups, one buffer each (< 40M elements); a rank holds 2 of them (tp 8: 6 layers =
    # two sets; tp 4: 2 sub-blocks)
    assert "gradient sync (block-wise, fp32, ZeRO 0): 64 collective buffers in 64 participant " \
           "groups, at most 2 per rank" in out
    assert topology.main(["--plan", str(tmp_path / "big.json"), "--world-size", "512"]) == 2
    assert "plan needs 1024 ranks, WORLD_SIZE is 512" in capsys.readouterr().err
    for extra, said in ((["--world-size", "0"], "--world-size must be >= 1 (default: the plan's), got 0"),
                        (["--ddp-bucket-size", "-1"], "--ddp-bucket-size must be >= 0 (0: unbucketed), got -1")):
        assert topology.main(["--plan", str(tmp_path / "big.json"), *extra]) == 2
        assert capsys.readouterr().err == f"error: {said}\n"


def test_sample_ranges_cover_global_batch_once():
    plan = plans.uneven_lbs_different_mbs()
    seen = []
    for i, pipe in enumerate(plan.pipelines):
        for stage in pipe.stages:
            per_stage = []
            for mb in range(pipe.num_microbatches):
                for d in range(stage.dp):
                    per_stage.extend(range(*sample_range(plan, i, mb, stage.dp, d)))
            assert per_stage == list(range(sum(p.lbs for p in plan.pipelines[:i]),
                                           sum(p.lbs for p in plan.pipelines[:i + 1])))
        seen.extend(per_stage)
    assert seen == list(range(plan.gbs))
    assert sample_range(plan, 0, 1, 1, 0) == (5, 10)       # lbs 10, mbs 5
    assert sample_range(plan, 1, 2, 2, 1) == (10 + 4 + 1, 10 + 4 + 2)  # mbs 2 over dp 2


def test_overlaps_reshard_every_sample_once():
    for mbs, a, b in ((4, 1, 2), (4, 2, 1), (12, 4, 3), (6, 3, 2), (8, 8, 8)):
        pieces = overlaps(mbs, a, b)
        covered = sorted(i for _, _, lo, hi in pieces for i in range(lo, hi))
        assert covered == list(range(mbs))
        for s, d, lo, hi in pieces:
            assert s * mbs // a <= lo < hi <= (s + 1) * mbs // a
            assert d * mbs // b <= lo < hi <= (d + 1) * mbs // b
    assert overlaps(12, 4, 3) == [(0, 0, 0, 3), (1, 0, 3, 4), (1, 1, 4, 6), (2, 1, 6, 8),
                                  (2, 2, 8, 9), (3, 2, 9, 12)]


def test_data_is_deterministic_per_sample():
    data = SyntheticData(256, 32, 7)
    whole = batch(data, 3, 0, 16)
    assert whole.shape == (16, 33)
    assert batch(data, 3, 5, 9).equal(whole[5:9])
    assert not batch(data, 4, 0, 16).equal(whole)
    assert int(whole.max()) < 256


def test_layer_runs_the_13_ops_in_order():
    from eth.spec.model import LAYER_OPS
    from megatron.hpp.models.gpt import Layer

    assert tuple(op[0] for op in Layer.OPS) == LAYER_OPS


def test_weights_do_not_depend_on_tp():
    import torch

    from eth.layout.params import layer_specs
    from megatron.hpp.models.gpt import full_parameter

    spec = plans.two_pipelines_different_depth().model
    qkv = layer_specs(spec, 2)["qkv.weight"]
    full = full_parameter(spec, qkv, 1234)
    assert full.equal(full_parameter(spec, qkv, 1234))
    assert not full.equal(full_parameter(spec, layer_specs(spec, 3)["qkv.weight"], 1234))
    shards = [qkv.local(full, t, 2) for t in range(2)]
    assert torch.cat(shards, 0).equal(full) and shards[0].shape == (3 * spec.hidden // 2, spec.hidden)


@pytest.mark.slow
def test_bad_input_fails_on_every_rank_and_rank_0_says_it(tmp_path):
    plans.tp_stage_next_to_dp_stage().save(tmp_path / "five.json")
    plans.too_large_gbs_sum().save(tmp_path / "sum.json")
    short = ["--data-path", str(tmp_path / "short"), "--split", "100,0,0"]
    cases = [(2, tmp_path / "five.json", "plan needs 5 ranks, WORLD_SIZE is 2", []),
             (2, tmp_path / "sum.json", "sum of pipeline lbs is 16 but gbs is 12", []),
             (2, tmp_path / "missing.json", "does not exist", []),
             (3, tmp_path / "three.json", "a sample needs 33", short),
             # plan.training is fp32 / ZeRO 0 (a plan without the field)
             (3, tmp_path / "three.json", "--bf16/--fp16/--fp32 asks for precision 'bf16' but the plan was "
                                          "made for 'fp32'", ["--bf16"]),
             (3, tmp_path / "three.json", "--zero-stage asks for zero_stage 2 but the plan was made "
                                          "for 0", ["--zero-stage", "2"])]
    plans.two_pipelines_different_depth().save(tmp_path / "three.json")
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(tmp_path / "short.bin"), dtype=numpy.uint8)
    builder.add_document(numpy.full(32, 120, dtype=numpy.uint8), [32])  # tiny's seq_len 32 needs 33 tokens
    builder.finalize(str(tmp_path / "short.idx"))
    for nproc, path, message, extra in cases:
        results = launch(nproc, ["--hpp-plan", str(path), "--train-iters", "2", *extra], timeout=60, preload=False)
        for r in results:   # every rank finds it, rank 0 prints it (once, as under torchrun)
            assert r.returncode == 2, (r.rank, r.returncode, r.stderr)
            lines = r.stderr.strip().splitlines()
            if r.rank:
                assert lines == [], (r.rank, r.stderr)
                continue
            assert len(lines) == 1 and message in lines[0], r.stderr
            # checked before any process group exists: no rank-prefixed runtime error
            assert lines[0].startswith("error: ") and not lines[0].startswith("error: rank "), lines[0]


@pytest.fixture(scope="module")
def world_of_one():
    """A one-rank gloo group in this process (for stage-level checks; an in-memory
    store, so no port is involved)."""
    import torch.distributed as dist

    from megatron.hpp.compat import quiet_megatron_warnings

    quiet_megatron_warnings()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.new_group([0])
    dist.destroy_process_group()


def _stage_grads(group, spec, recompute, calls):
    import torch

    from megatron.hpp.compat import Backend, setup_rng
    from megatron.hpp.models.gpt import GPTStage

    tracker = setup_rng(Backend("gloo", torch.device("cpu")), 5, 11, 0)
    stage = GPTStage(spec, (0, 2), True, True, group, tracker, recompute, seed=3)
    original = stage.layers[0].op_softmax

    def counted(scores):
        calls.append(1)
        return original(scores)

    stage.layers[0].op_softmax = counted
    tokens = batch(SyntheticData(spec.vocab, spec.seq_len, 1), 0, 0, 4)
    loss = stage(tokens[:, :-1], tokens[:, 1:], 0.25)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in stage.named_parameters()}


def test_recompute_replays_ops_with_same_dropout_masks(world_of_one):
    from dataclasses import replace

    from eth.spec.model import get_model

    spec = replace(get_model("tiny"), dropout=0.2)
    plain_calls, recompute_calls = [], []
    loss_a, grads_a = _stage_grads(world_of_one, spec, {}, plain_calls)
    # runs of one checkpoint each, with tracker (attention) and default-RNG dropouts:
    # layer 0 {softmax, attn-dropout, context}, {post-attn-dropout, 2nd-layernorm},
    # {gelu, mlp-gemm-2, post-mlp-dropout}; layer 1 {attn-dropout}, {gelu, ..., post-mlp-dropout}
    recompute = {"softmax": 1, "attn-dropout": 2, "post-attn-dropout": 1, "2nd-layernorm": 1,
                 "gelu": 2, "mlp-gemm-2": 2, "post-mlp-dropout": 2, "context": 1}
    loss_b, grads_b = _stage_grads(world_of_one, spec, recompute, recompute_calls)
    assert len(plain_calls) == 1 and len(recompute_calls) == 2  # softmax of layer 0 re-ran
    assert loss_a == loss_b
    for name, grad in grads_a.items():
        assert grad.equal(grads_b[name]), name
    _, grads_c = _stage_grads(world_of_one, replace(spec, dropout=0.0), {}, [])
    assert not grads_c["layers.0.qkv.weight"].equal(grads_a["layers.0.qkv.weight"])  # dropout acts


def test_lr_schedule():
    from megatron.hpp.training.loop import TrainConfig

    cfg = TrainConfig(plan="p.json", train_iters=10, lr=1.0, min_lr=0.1, warmup=2)
    assert [cfg.lr_at(i) for i in (0, 1)] == [0.5, 1.0]
    assert cfg.lr_at(2) == pytest.approx(1.0) and cfg.lr_at(10) == pytest.approx(0.1)
    assert TrainConfig(plan="p.json", train_iters=5, lr=0.3).lr_at(4) == 0.3


def test_rng_seeds_differ_per_stage_not_per_tp_or_dp_replica():
    from megatron.hpp.parallel.topology import rng_seeds

    plan = plans.tp_stage_next_to_dp_stage()        # stages: [0] tp1, [1, 2] tp2, [3, 4] dp 2
    layout = topology.check_plan(plan, 5)
    seeds = {r: rng_seeds(layout, r, 1234) for r in range(5)}
    assert [seeds[r][0] for r in range(5)] == [1234, 1334, 1334, 1434, 1434]  # megatron: +100 * stage
    assert seeds[1][1] != seeds[2][1] == 1334 + 2718 + 1   # tracker: per tp rank
    assert seeds[3] == seeds[4]                             # dp replicas of one stage alike
    two = plans.two_pipelines_different_depth()            # p0: 1 stage, p1: 2 stages
    layout = topology.check_plan(two, 3)
    assert len({rng_seeds(layout, r, 7) for r in range(3)}) == 3  # pipeline 1 stage 0 != p0 stage 0
    big = topology.check_plan(plans.large_1024(), 1024)
    per_stage = {}
    for r, slot in enumerate(big.slots):
        per_stage.setdefault((slot.pipeline, slot.stage), set()).add(rng_seeds(big, r, 1)[0])
    assert all(len(v) == 1 for v in per_stage.values())
    assert len({next(iter(v)) for v in per_stage.values()}) == len(per_stage) == 4 * 4 + 4 * 8


def test_tp_node_warning():
    from megatron.hpp.parallel.topology import tp_node_warning

    layout = topology.check_plan(plans.tp_stage_next_to_dp_stage(), 5)   # tp group (1, 2)
    assert tp_node_warning(layout, None) is None and tp_node_warning(layout, 5) is None
    assert "tp p0 s1 d0" in tp_node_warning(layout, 1)  # one device per node
    line = tp_node_warning(layout, 2)                  # nodes {0, 1}, {2, 3}, {4}
    assert line.startswith("warning: LOCAL_WORLD_SIZE 2 puts 1 tp group(s) across nodes")
    assert "tp p0 s1 d0 (ranks 1..2)" in line and "5 devices per node and keeps that group on one node" in line
    assert "\n" not in line
    big = topology.check_plan(plans.large_1024(), 1024)    # tp 8 / tp 4 groups on 8-device nodes
    assert tp_node_warning(big, 8) is None and tp_node_warning(big, 4).count("tp group") == 1


def test_gradient_norm_is_fp64_accurate_on_large_buffers():
    from megatron.hpp.distributed.grad_sync import NORM_ROW, squared_norm

    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(1_700_000, generator=gen) * 1e-3, torch.randn(3 * NORM_ROW, generator=gen),
             torch.randn(7, 5, generator=gen), torch.zeros(0)]
    exact = sum(float(g.double().square().sum()) for g in grads)
    assert float(squared_norm(grads, "cpu")) == pytest.approx(exact, rel=2e-7)   # fp32 sqrt of each row: ~6e-8
    # one fp32 norm over the large buffer is measurably off: the rows are what makes it exact
    one = float(torch.linalg.vector_norm(grads[0], dtype=torch.float32).double() ** 2)
    assert abs(one / float(grads[0].double().square().sum()) - 1) > 1e-5


def test_exit_rank_keeps_buffered_output_and_the_code():
    """rank_exit.exit_rank ends the process without interpreter exit, yet what stdout and
    stderr still buffer (block-buffered pipes: PYTHONUNBUFFERED unset) reaches the pipe, and
    the code is the exit status."""
    import os
    import subprocess
    import sys

    from _rt_spawn import REPO

    code = ("import sys; from megatron.hpp.rank_exit import exit_rank; "
            "print('out-no-newline', end=''); sys.stderr.write('err-no-newline'); exit_rank(3)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 3, run.stderr
    assert run.stdout == "out-no-newline" and run.stderr == "err-no-newline"


def test_reduce_scatter_without_the_deprecation_warning_on_every_rank(tmp_path):
    """ZeRO 1/2 reduce gradients with compat.reduce_scatter: torch's reduce_scatter_single
    where it exists (reduce_scatter_tensor warned on every rank of every ZeRO run), the
    same sums.  Two gloo ranks, warnings as errors."""
    import subprocess
    import sys

    script = f"""
import os, sys, warnings
warnings.simplefilter("error")
import torch, torch.distributed as dist
from megatron.hpp import compat
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=rank, world_size=2)
full = torch.arange(4.0) + 10 * rank
part = torch.empty(2)
compat.reduce_scatter(part, full)
work = compat.reduce_scatter(part, full, async_op=True)
work.wait()
assert part.tolist() == ([10.0, 12.0] if rank == 0 else [14.0, 16.0]), part
dist.destroy_process_group()
print("ok", rank)
"""
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and out.strip() == f"ok {r}", err[-2000:]


def test_the_setup_line_says_which_types_are_emulated_and_which_run_at_full_speed():
    """A plan edited to emulate_speed 0 for one CPU type trains that type at full speed:
    the run's setup line says so instead of calling the whole run emulated."""
    import json

    from eth.spec.plan import Plan
    from megatron.hpp.training.loop import emulation_line

    data = json.loads((REPO / "examples" / "plans" / "cpu-demo.json").read_text())
    assert emulation_line(Plan.from_dict(data)) == "emulated: cpu-fast 0.25 of a core, cpu-slow 0.064 of a core"
    data["cluster"]["device_types"]["cpu-slow"]["emulate_speed"] = 0.0
    assert emulation_line(Plan.from_dict(data)) == ("emulated: cpu-fast 0.25 of a core, "
                                                    "cpu-slow not emulated (full core)")
