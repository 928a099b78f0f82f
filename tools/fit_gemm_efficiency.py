#!/usr/bin/env python
"""Fit a device type's GEMM efficiency curve to the GEMM ops of measured profiles and print
its eth/data/gemm_efficiency.yaml entry (the body is eth/gemm_efficiency.py):

    python tools/fit_gemm_efficiency.py profiles/measured/cpu.json --device cpu --models tiny,small
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eth.gemm_efficiency import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
