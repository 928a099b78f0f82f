"""Reading input files with one-line errors, atomic writes, and where the checkout is."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import yaml

from eth.errors import SpecError

CHECKOUT = Path(__file__).resolve().parents[1]
"""The checkout (or install prefix) the tools run from: a planning job records a profile
path relative to it, show_plan finds that path again in another clone."""


def read_text(path, what: str, error=SpecError) -> str:
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        raise error(f"{what} file {path} does not exist") from None
    except IsADirectoryError:
        raise error(f"{what} file {path} is a directory") from None
    except UnicodeDecodeError as exc:
        raise error(f"{what} file {path} is not text (byte {exc.start} is {exc.object[exc.start]:#04x}: "
                    f"an image or a binary file?)") from None
    except PermissionError:
        raise error(f"{what} file {path} cannot be read (permission denied)") from None


def read_json(path, what: str, error=SpecError):
    """Parsed JSON of ``path``; ``error`` (a SpecError subclass) names the file on failure."""
    text = read_text(path, what, error)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{what} file {path} is not valid JSON: {exc}") from None


def read_yaml(path, what: str, error=SpecError):
    text = read_text(path, what, error)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise error(f"{what} file {path} is not valid YAML: {str(exc).splitlines()[0]}") from None


def atomic_write_text(path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def probe_folder(folder, what: str) -> None:
    """SpecError (naming ``what``) unless files can be created in ``folder`` or, where it
    does not exist yet, in its nearest existing ancestor: a probe folder is created there
    and removed (``os.access`` says yes to root everywhere, /proc included).  Several
    processes may probe the same folder at once."""
    existing = Path(folder)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise SpecError(f"{what} cannot be written: {existing} is a file, not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".probe-"))
    except OSError as exc:
        raise SpecError(f"{what} cannot be written: cannot create anything in {existing} "
                        f"({exc.strerror or exc})") from None
