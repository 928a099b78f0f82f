#!/usr/bin/env python
"""Write analytic profile databases or import Aceso CSVs (the body is eth/cli/make_profiles.py;
installed as ``hpp-profiles``)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eth.cli.make_profiles import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
