"""Fit a device type's GEMM efficiency curve and print its ``eth/data/gemm_efficiency.yaml``
entry (``tools/fit_gemm_efficiency.py``; the fit is :mod:`eth.profiles.gemm_fit`)."""
from __future__ import annotations

import dataclasses

import yaml

from eth.errors import ProfileError
from eth.profiles.gemm_fit import aceso_points, fit, gemm_points, parse_aceso_model, xla_points


def main(argv=None) -> int:
    """Fit a device type's curve to the GEMM ops of measured profiles or of a published GEMM
    table; print the YAML entry."""
    import argparse

    from eth.cli.common import run_main

    def _main(argv):
        from eth.spec.cluster import catalog
        from eth.spec.model import get_model
        from eth.profiles.db import load_profile

        ap = argparse.ArgumentParser(description=main.__doc__)
        ap.add_argument("profiles", nargs="*", help="measured profile JSON files (tools/profile_ops.py)")
        ap.add_argument("--device", required=True, help="catalog device type whose peak the fit is relative to")
        ap.add_argument("--models", help="comma-separated presets whose profile entries to use")
        ap.add_argument("--seq", type=int, default=2048, help="with --aceso-dir: the CSVs' sequence length")
        ap.add_argument("--aceso-dir", metavar="DIR",
                        help="a folder of Aceso op CSVs ({NAME}_mbs{m}_tp{t}_algo0.csv) instead of profiles")
        ap.add_argument("--aceso-model", metavar="NAME:hidden:heads:ffn", action="append", default=[],
                        help="with --aceso-dir: the CSVs of Aceso model NAME and its shape (repeatable)")
        ap.add_argument("--xla-perf-table", metavar="TXTPB",
                        help="an XLA GEMM perf table (default_matmul_perf_table.txtpb) instead of profiles")
        ap.add_argument("--xla-gpu", help="with --xla-perf-table: the table's entry key (e.g. sm_90)")
        args = ap.parse_args(argv)
        if args.device not in catalog():
            raise ProfileError(f"--device {args.device} is not in the device catalog")
        sources = [bool(args.profiles), bool(args.aceso_dir), bool(args.xla_perf_table)]
        if sum(sources) != 1:
            raise ProfileError("give one source: profile files with --models, --aceso-dir DIR with "
                               "--aceso-model, or --xla-perf-table FILE with --xla-gpu")
        if bool(args.models) != bool(args.profiles) or bool(args.aceso_model) != bool(args.aceso_dir) \
                or bool(args.xla_gpu) != bool(args.xla_perf_table):
            raise ProfileError("--models goes with profile files, --aceso-model with --aceso-dir, "
                               "--xla-gpu with --xla-perf-table (each needs the other)")
        if args.seq <= 0:
            raise ProfileError(f"--seq must be positive, got {args.seq}")
        if args.aceso_dir:
            points = []
            for spec in args.aceso_model:
                prefix, model = parse_aceso_model(spec)
                points += aceso_points(args.aceso_dir, prefix, dataclasses.replace(model, seq_len=args.seq))
        elif args.xla_perf_table:
            points = xla_points(args.xla_perf_table, args.xla_gpu)
        else:
            points = []
            for path in args.profiles:
                data = load_profile(path).data
                for name in args.models.split(","):
                    model = get_model(name.strip())
                    try:
                        points += gemm_points(data, model)
                    except ProfileError:
                        continue
            if not points:
                raise ProfileError(f"{', '.join(args.profiles)} hold no entries for {args.models}")
        tflops = catalog()[args.device].tflops
        curve, stats = fit(points, tflops)
        _, linear = fit(points, tflops, d0_grid=[0.0])
        print(yaml.safe_dump({args.device: {
            "peak_eff": round(curve.peak_eff, 4), "d0": round(curve.d0, 3),
            "overhead_ms": round(curve.overhead_ms, 4),
            "fit": {"points": stats["points"], "rms_rel_err": round(stats["rms_rel_err"], 4),
                    "max_abs_rel_err": round(stats["max_abs_rel_err"], 4),
                    "linear_rms_rel_err": round(linear["rms_rel_err"], 4),
                    "op_mean_rel_err": {op: round(e, 3) for op, e in stats["op_mean_rel_err"].items()},
                    "command": "python tools/fit_gemm_efficiency.py " + " ".join(argv)}}},
            sort_keys=False).rstrip())
        return 0

    import sys

    return run_main(_main, sys.argv[1:] if argv is None else list(argv))
