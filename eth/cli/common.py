"""Shared CLI plumbing: one-line errors with exit code 2 for bad input."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from eth.errors import SpecError
from eth.fileio import CHECKOUT, probe_folder  # noqa: F401  (CHECKOUT: the tools' name for it)


def run_main(main: Callable[[Sequence[str] | None], int | None], argv=None) -> int:
    """Run ``main(argv)``; a SpecError becomes ``error: <message>`` on stderr and exit 2.
    A reader that stops reading (``| head``) ends the output quietly: what was printed
    stands, exit 0."""
    try:
        return main(argv) or 0
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that fails no more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def int_list(text: str) -> list[int]:
    """Parse "1,2,4" into [1, 2, 4] (argparse type)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SpecError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise SpecError(f"expected positive integers, got {text!r}")
    return values


def check_output_file(path, flag: str = "-o") -> None:
    """Fail early (SpecError) when ``path`` cannot become a file: it is a directory, or
    its folder cannot be created or written (``fileio.probe_folder``).  Called before long work."""
    path = Path(path)
    if path.is_dir():
        raise SpecError(f"{flag} {path} is a directory; give a file name (e.g. {path / 'plan.json'})")
    probe_folder(path.parent, f"{flag} {path}")


def check_output_dir(path, flag: str) -> None:
    """Fail early (SpecError) when ``path`` cannot be (or become) a writable folder."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise SpecError(f"{flag} {path} is a file, not a folder")
    probe_folder(path, f"{flag} {path}")
