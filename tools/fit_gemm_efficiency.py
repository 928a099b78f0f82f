#!/usr/bin/env python
"""Fit a device type's GEMM efficiency curve to the GEMM ops of measured profiles and print
its eth/data/gemm_efficiency.yaml entry (the body is eth/profiles/gemm_efficiency.py):

    python tools/fit_gemm_efficiency.py profiles/measured/cpu.json --device cpu --models tiny,small
    python tools/fit_gemm_efficiency.py --aceso-dir DIR --aceso-model OPT-350:1024:16:4096 --device A100
    python tools/fit_gemm_efficiency.py --xla-perf-table default_matmul_perf_table.txtpb --xla-gpu sm_90 \
        --device H100

The exact command of every shipped entry, with the public repository, commit and path of
its data, is the entry's ``fit.command`` / ``fit.data`` in eth/data/gemm_efficiency.yaml.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eth.cli.fit_gemm_efficiency import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
