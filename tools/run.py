#!/usr/bin/env python
"""torchrun with a failing run summarised in one line (the body is megatron/hpp/cli/run.py;
installed as ``hpp-run``): ``python tools/run.py --nproc-per-node 4 pretrain_gpt.py ...``."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron.hpp.cli.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
