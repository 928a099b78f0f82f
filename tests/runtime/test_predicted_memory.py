"""The cost model's memory of a one-rank plan (model states + in-flight activations +
the backward's transient, from the shipped measured CPU profile) against the bytes the
runtime's tensors really hold at their peak (torch.profiler's CPU allocation counter over
Trainer construction and two steps, ``frees_on_all_threads`` included), as
bench/predictor_accuracy.py measures it for its multi-rank table.  One process, an
in-memory gloo store: deterministic, no timing.  Then the bench's pure parts: how repeated
launches of one configuration are combined (``--runs``), the per-rank step breakdown
(``StepPhases``), its bad-input line, and the composition check
(``predictor_composition``: the cost model fed with the run's own compute), and
bench/profile_repeatability.py's bad input and spread."""
import gc
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("predictor_accuracy", REPO / "bench/predictor_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def world_of_one():
    import torch.distributed as dist

    from megatron.hpp.compat import quiet_megatron_warnings

    quiet_megatron_warnings()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _measured_peak(bench, plan, tmp_path) -> float:
    from torch.profiler import ProfilerActivity, profile

    from megatron.hpp.training.loop import TrainConfig, Trainer, prepare

    path = tmp_path / "plan.json"
    plan.save(path)
    cfg = TrainConfig(plan=str(path), train_iters=2, log_interval=2)
    _, layout, rank = prepare(cfg)
    with bench.frees_on_all_threads(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer = Trainer(cfg, layout, rank)
        trainer.step(0)
        trainer.step(1)
    peak = bench._peak_tensor_bytes(prof)
    del trainer, prof
    gc.collect()
    return peak


FULL = {op: 4 for op in ("1st-layernorm", "qkv", "score", "softmax", "attn-dropout", "context", "attn-dense",
                         "post-attn-dropout", "2nd-layernorm", "mlp-gemm-1", "gelu", "mlp-gemm-2",
                         "post-mlp-dropout")}


@pytest.mark.parametrize("recompute", [{}, {"score": 2, "softmax": 2, "attn-dropout": 2, "context": 2}, FULL],
                         ids=["plain", "attention-recomputed", "fully-recomputed"])
def test_one_rank_memory_prediction_matches_tensor_bytes(bench, world_of_one, tmp_path, recompute):
    from eth.profiles.db import ProfileDB

    plan = bench._plan("mem", [("cpu-a", 1)], [(4, 16, [([0], "cpu-a", 1, 1, (0, 4), recompute)])])
    predicted = bench.predict(plan, ProfileDB.load(REPO / "profiles/measured/cpu.json"))["memory_bytes"][0]
    measured = _measured_peak(bench, plan, tmp_path)
    # fp32 states (w 4 + g 4 + AdamW main weights and moments 12 bytes per parameter, ~4.5 MiB)
    # plus one micro-batch's saved activations (~2.7 MiB; with full recompute the layer
    # inputs, ~0.3 MiB) plus the backward's transient (eth.cost.model: one op's gradients, ~0.1
    # MiB; with full recompute also the layer the backward re-materialises, ~0.6 MiB,
    # without which the fully recomputed prediction was 11% low)
    assert measured > 5 * 2 ** 20
    assert predicted == pytest.approx(measured, rel=0.05)


def _run(it, compute, memory):
    return {"iteration_ms": it, "compute_ms": compute, "memory_bytes": memory}


def test_combine_runs_keeps_medians_per_figure_and_the_spread(bench):
    runs = [_run(200.0, [190.0, 150.0], [7.0, 5.0]), _run(260.0, [150.0, 160.0], [7.0, 6.0]),
            _run(220.0, [175.0, 120.0], [7.0, 5.0])]
    got = bench.combine_runs(runs)
    # medians taken figure by figure, not the median run's figures
    assert got["iteration_ms"] == 220.0
    assert got["compute_ms"] == [175.0, 150.0]
    assert got["memory_bytes"] == [7.0, 5.0]
    assert got["spread"]["iteration"] == pytest.approx(60 / 220)
    assert got["spread"]["compute"] == pytest.approx([40 / 175, 40 / 150])
    assert got["runs"] == runs
    row = bench.rows_for("x", "desc", {"iteration_ms": 220.0, "compute_ms": [175.0, 150.0],
                                       "memory_bytes": [7.0, 5.0]}, got, "load")[0]
    assert "| 27%; p0 23%, p1 27% |" in row


def test_one_run_has_no_spread_column_value(bench):
    one = bench.combine_runs([_run(100.0, [90.0], [3.0])])
    assert one["spread"]["iteration"] == 0.0
    row = bench.rows_for("x", "desc", {"iteration_ms": 100.0, "compute_ms": [90.0], "memory_bytes": [3.0]},
                         one, "load")[0]
    assert row.count(" - |") == 2      # drift and run spread


def test_runs_below_one_is_refused(bench, capsys):
    assert bench.main(["--runs", "0"]) == 2
    err = capsys.readouterr().err
    assert "--runs >= 1" in err and "got 3, 10, 0" in err


def test_step_phases_times_the_wrapped_calls_and_leaves_the_rest(bench):
    import time

    class Owner:
        def work(self, x):
            time.sleep(0.002)
            return x + 1

    phases = bench.StepPhases()
    owner = Owner()
    phases.wrap(owner, "work", "optimizer")
    assert owner.work(1) == 2                      # the wrapped call still returns its result
    assert owner.work(2) == 3
    assert len(phases.seconds["optimizer"]) == 2 and min(phases.seconds["optimizer"]) >= 0.002
    seen = []
    phases.wrap(owner, "work", "grad norm", after=seen.append)   # called with the call's arguments
    assert owner.work(5) == 6 and seen == [(5,)]
    phases.seconds = {"schedule": [0.010, 0.020], "grad sync finish": [0.001, 0.002], "grad norm": [0.0, 0.001],
                      "optimizer": [0.003, 0.004]}
    phases.compute = [0.009, 0.015]
    got = phases.medians_ms(1, [0.020, 0.030])      # the first step is left out
    assert got["schedule"] == pytest.approx(20.0) and got["optimizer"] == pytest.approx(4.0)
    assert got["compute"] == pytest.approx(15.0)    # not a phase: not taken off the rest
    assert got["rest"] == pytest.approx(30.0 - 20.0 - 2.0 - 1.0 - 4.0)
    row = bench.phase_rows("cfg", {"optimizer_ms": [0.5], "step_ms": [1.25]}, {"phases_ms": [got]})[0]
    assert row == "| cfg | r0 | 20.0 | 2.0 | 1.0 | 4.0 | 3.0 | 0.5 | 1.2 |"


def _predicted_rank_compute(plan, db) -> list[float]:
    """Each rank's compute of one step as the cost model predicts it (micro-batches x its
    stage's forward + backward without tp collectives and p2p)."""
    from eth.cost.model import CostModel

    db.ensure(plan.model, plan.cluster.types.values())
    cm = CostModel(plan.model, plan.cluster, db, plan.training)
    compute = {}
    for p in plan.pipelines:
        for st, c in zip(p.stages, cm.pipeline_costs(p)):
            for r in st.ranks:
                compute[r] = p.lbs // p.mbs * (c.fwd_ms + c.bwd_ms - c.comm_ms)
    return [compute[r] for r in sorted(compute)]


def test_iteration_from_the_runs_compute_is_the_prediction_when_compute_is_as_predicted(bench):
    import predictor_composition

    from eth.profiles.db import ProfileDB

    db = ProfileDB.load(REPO / "profiles/measured/cpu.json")
    for name in ("het-3pipes", "demo", "pp2-rec"):
        plan = bench.CONFIGS[name][1]()
        got = predictor_composition.iteration_from_compute(plan, db, _predicted_rank_compute(plan, db))
        assert got["iteration_ms"] == pytest.approx(bench.predict(plan, db)["iteration_ms"], rel=1e-12), name
        assert [len(ks) for ks in got["scales"]] == [len(p.stages) for p in plan.pipelines]
        assert all(k == pytest.approx(1.0) for ks in got["scales"] for k in ks)


def test_iteration_from_the_runs_compute_moves_by_the_measured_compute(bench):
    import predictor_composition

    from eth.profiles.db import ProfileDB

    db = ProfileDB.load(REPO / "profiles/measured/cpu.json")
    plan = bench.CONFIGS["1st"][1]()        # one stage, tp 1: no p2p, no tp collectives
    pred = bench.predict(plan, db)
    got = predictor_composition.iteration_from_compute(plan, db, [300.0])
    # Eq. 5 of one stage is all its compute; the optimizer and the rest of the step stay
    assert got["iteration_ms"] == pytest.approx(300.0 + pred["iteration_ms"] - pred["compute_ms"][0])
    assert got["scales"] == [[pytest.approx(300.0 / pred["compute_ms"][0])]]
    # two stages, the second (cpu-b) the slower: it is on the critical path once in the
    # fill, m - 1 times in the steady state and once in the drain, so the iteration grows
    # by exactly what its rank's compute of the step grows by
    plan = bench.CONFIGS["het-pp"][1]()
    base = _predicted_rank_compute(plan, db)
    assert base[1] > base[0]
    before = bench.predict(plan, db)["iteration_ms"]
    slower = predictor_composition.iteration_from_compute(plan, db, [base[0], base[1] + 50.0])
    assert slower["iteration_ms"] == pytest.approx(before + 50.0)
    # the faster first stage growing by less than the gap stays off the steady state
    first = predictor_composition.iteration_from_compute(plan, db, [base[0] + 50.0, base[1]])
    assert before < first["iteration_ms"] < before + 50.0 / 2


def test_profile_repeatability_refuses_fewer_than_two_profiles_and_measures_spread(capsys):
    spec = importlib.util.spec_from_file_location("profile_repeatability", REPO / "bench/profile_repeatability.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--times", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --times must be >= 2, --mbs >= 1, --tp 1 or 2, --repeats >= 1, got 1, 4, 1, 20")
    assert module.spread_of([0.8, 1.0, 1.2]) == pytest.approx(0.4)
