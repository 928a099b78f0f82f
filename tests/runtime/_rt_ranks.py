"""Rank template of ``_rt_spawn.launch``: imports once what every rank imports, then forks
the ranks.

    python _rt_ranks.py NPROC OUT_DIR SCRIPT [ARGS ...]

Each child sets ``RANK``/``LOCAL_RANK``, sends its stdout and stderr to
``OUT_DIR/rank<r>.out`` / ``.err`` and runs SCRIPT as ``__main__`` with ARGS; the template
waits for all of them and writes ``OUT_DIR/codes.json`` (each rank's exit code; -N: killed
by signal N).  Importing torch and megatron-core costs every rank about 3.5 s of CPU on 2
cores, more than a small launch's training: forked after the imports, the ranks skip it.
The template has started no thread, run no tensor op and made no process group when it
forks, and the imports are the ones a rank makes anyway (megatron-core through
``compat.quiet_megatron_warnings``, as ``Trainer`` does).
"""
from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def kill_in_save(rank: int, spec: str) -> None:
    """``HPP_TEST_KILL_IN_SAVE=RANK:ITERATION``: that rank kills itself (SIGKILL) in the save
    of that iteration after its shards are written, before the manifest (where it hashes
    its share of the files), as a crash would."""
    from megatron.hpp.training import checkpoint

    victim, iteration = (int(x) for x in spec.split(":"))
    hash_files = checkpoint.file_entries

    def file_entries(folder, names):
        if rank == victim and Path(folder).name == f"iter_{iteration:07d}.tmp":
            os.kill(os.getpid(), signal.SIGKILL)
        return hash_files(folder, names)

    checkpoint.file_entries = file_entries


def run_rank(rank: int, out: Path, script: str, args: list[str]) -> int:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    if os.environ.get("HPP_TEST_KILL_IN_SAVE"):
        kill_in_save(rank, os.environ["HPP_TEST_KILL_IN_SAVE"])
    for fd, suffix in ((1, "out"), (2, "err")):
        target = os.open(out / f"rank{rank}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [script, *args]
    sys.path[0] = str(Path(script).parent)     # as `python SCRIPT` puts it
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:   # noqa: BLE001 -- a rank's traceback, as the interpreter prints it
        traceback.print_exc()
        return 1
    return 0


def main() -> None:
    nproc, out, script, args = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
    sys.path.insert(0, str(REPO))
    if os.environ.get("HPP_TEST_PRELOAD", "1") == "1":   # _rt_spawn.launch(preload=False): "0"
        import torch.distributed  # noqa: F401

        from megatron.hpp import compat

        compat.quiet_megatron_warnings()
        import megatron.hpp.training.loop  # noqa: F401
    sys.stdout.flush()
    sys.stderr.flush()
    ranks = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            code = run_rank(rank, out, script, args)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        ranks[pid] = rank
    codes = {}
    while ranks:
        pid, status = os.wait()
        codes[ranks.pop(pid)] = os.waitstatus_to_exitcode(status)
    (out / "codes.json").write_text(json.dumps(codes))


if __name__ == "__main__":
    main()
