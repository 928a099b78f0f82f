#!/usr/bin/env python
"""Text -> megatron-core indexed dataset (.bin/.idx) for pretrain_gpt.py --data-path (the body is
megatron/hpp/cli/preprocess_data.py; installed as ``hpp-preprocess``)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron.hpp.cli.preprocess_data import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
