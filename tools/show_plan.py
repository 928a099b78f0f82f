#!/usr/bin/env python
"""Show a plan, simulate it, draw a Gantt chart (the body is eth/cli/show_plan.py; installed as
``hpp-show``).  ``--legend`` explains the abbreviations."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eth.cli.show_plan import DEFAULT_PROFILES, main  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(main())
