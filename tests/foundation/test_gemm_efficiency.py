"""GEMM efficiency curve of analytic profiles (eth/gemm_efficiency.py): shape of the curve,
the fit recovers known parameters, the shipped CPU fit is reproducible from the shipped
measured profile and reproduces its points within the stated tolerance."""
import itertools
import random
from pathlib import Path

import pytest
import yaml

from eth.cluster import catalog
from eth.gemm_efficiency import (GEMM_OPS, GemmEfficiency, efficiency_for, fit, gemm_dims,
                                 gemm_points)
from eth.model import get_model, op_shapes
from eth.profiles import GEMM_EFFICIENCY, KERNEL_OVERHEAD_MS, analytic_op_costs, load_profile

ROOT = Path(__file__).resolve().parents[2]


def test_curve_is_monotone_symmetric_and_tends_to_the_peak():
    curve = GemmEfficiency(0.8, 64.0, 0.0)
    rng = random.Random(0)
    for _ in range(200):
        m, n, k = (rng.randint(1, 5000) for _ in range(3))
        e = curve(m, n, k)
        assert 0 < e < 0.8
        assert curve(m + 1, n, k) > e and curve(m, n + 7, k) > e and curve(m, n, k * 2) > e
        for perm in itertools.permutations((m, n, k)):   # backward GEMMs: same dims, permuted
            assert curve(*perm) == pytest.approx(e)
    assert curve(1e7, 1e7, 1e7) == pytest.approx(0.8, rel=1e-4)
    assert curve(64, 1e9, 1e9) == pytest.approx(0.4, rel=1e-6)           # a dimension of d0 halves it
    assert GemmEfficiency(0.6, 0.0)(3, 5, 7) == 0.6                        # d0 = 0: the linear model


def test_gemm_dims_match_the_flop_counts():
    for name, mbs, tp in (("tiny", 2, 1), ("small", 4, 2), ("gpt3-13b", 1, 8), ("llama2-70b", 2, 8)):
        model = get_model(name)
        shapes, dims = op_shapes(model, mbs, tp), gemm_dims(model, mbs, tp)
        for op, (m, n, k) in dims.items():
            if op in shapes and op != "head+loss":
                assert 2 * m * n * k == shapes[op].flops_fwd, (name, op)


def test_fit_recovers_known_parameters():
    truth = GemmEfficiency(0.7, 2 ** 5, 0.05)
    points = []
    for mbs, tp in itertools.product((1, 2, 4, 8, 16), (1, 2, 4)):
        model = get_model("small")
        shapes, dims = op_shapes(model, mbs, tp), gemm_dims(model, mbs, tp)
        points += [(op, mbs, tp, dims[op], shapes[op].flops_fwd, truth.ms(dims[op], shapes[op].flops_fwd, 0.05))
                   for op in GEMM_OPS[:-1]]
    curve, stats = fit(points, 0.05)
    assert curve.d0 == pytest.approx(32.0) and curve.overhead_ms == pytest.approx(0.05)
    assert curve.peak_eff == pytest.approx(0.7, rel=1e-9) and stats["rms_rel_err"] < 1e-9


def test_shipped_cpu_fit_is_reproducible_and_within_its_tolerance():
    entry = yaml.safe_load((ROOT / "eth/data/gemm_efficiency.yaml").read_text())["devices"]["cpu"]
    data = load_profile(ROOT / "profiles/measured/cpu.json").data
    points = gemm_points(data, get_model("tiny")) + gemm_points(data, get_model("small"))
    curve, stats = fit(points, catalog()["cpu"].tflops)
    assert stats["points"] == entry["fit"]["points"] == 150
    assert curve.peak_eff == pytest.approx(entry["peak_eff"], abs=1e-4)
    assert curve.d0 == pytest.approx(entry["d0"], abs=1e-3)
    assert curve.overhead_ms == pytest.approx(entry["overhead_ms"], abs=1e-4)
    assert stats["rms_rel_err"] == pytest.approx(entry["fit"]["rms_rel_err"], abs=1e-4)
    # the stated tolerance (docs/FORMATS.md): rms relative error of the fitted points <= 25 %;
    # the size-independent model (d0 = 0, best peak_eff and overhead) does clearly worse
    assert stats["rms_rel_err"] <= 0.25
    _, linear = fit(points, catalog()["cpu"].tflops, d0_grid=[0.0])
    assert linear["rms_rel_err"] == pytest.approx(entry["fit"]["linear_rms_rel_err"], abs=1e-4)
    assert linear["rms_rel_err"] > stats["rms_rel_err"] + 0.03


def test_analytic_profiles_use_the_device_curve():
    tiny = get_model("tiny")
    cpu, a100 = catalog()["cpu"], catalog()["A100"]
    curve = efficiency_for("cpu")
    assert curve.d0 > 0 and efficiency_for("A100") == GemmEfficiency()
    shapes, dims = op_shapes(tiny, 4, 2), gemm_dims(tiny, 4, 2)
    rows = analytic_op_costs(cpu, tiny, 4, 2)
    for op in ("qkv", "mlp-gemm-2", "score"):
        eff = curve(*dims[op])
        assert rows[op][0] == pytest.approx(shapes[op].flops_fwd / (cpu.tflops * 1e9 * eff) + curve.overhead_ms)
        assert rows[op][1] == pytest.approx(shapes[op].flops_bwd / (cpu.tflops * 1e9 * eff) + curve.overhead_ms)
    # no curve: the fixed efficiency at every size, so time stays linear in FLOPs
    a = analytic_op_costs(a100, tiny, 1, 1)["qkv"][0] - KERNEL_OVERHEAD_MS
    b = analytic_op_costs(a100, tiny, 8, 1)["qkv"][0] - KERNEL_OVERHEAD_MS
    assert b == pytest.approx(8 * a) and a == pytest.approx(
        op_shapes(tiny, 1, 1)["qkv"].flops_fwd / (312e9 * GEMM_EFFICIENCY))
    # with the curve, 8x the samples cost less than 8x the time (small GEMMs are inefficient)
    c1 = analytic_op_costs(cpu, tiny, 1, 1)["qkv"][0] - curve.overhead_ms
    c8 = analytic_op_costs(cpu, tiny, 8, 1)["qkv"][0] - curve.overhead_ms
    assert c8 < 8 * c1
