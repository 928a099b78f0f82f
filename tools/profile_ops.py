#!/usr/bin/env python
"""Measure every op of a model on this device type and write a profile JSON (the body is
megatron/hpp/cli/profile_ops.py; installed as ``hpp-profile``)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron.hpp.cli.profile_ops import main, parse_args  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(main())
