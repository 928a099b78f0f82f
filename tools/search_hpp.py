#!/usr/bin/env python
"""Offline HPP planner: cluster + model + profiles -> plan.json (the body is eth/cli/search_hpp.py;
installed as ``hpp-search``)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eth.cli.search_hpp import main, parse_args  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(main())
