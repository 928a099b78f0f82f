"""``hpp-run``: torchrun, with a failing run summarised in one line.

Takes torchrun's arguments (``hpp-run --nproc-per-node 4 pretrain_gpt.py ...``) and
runs torch's launcher in this process.  When a worker fails, torchrun prints its own
report and traceback under the worker's line; ``hpp-run`` prints instead:

* nothing more when the first failing rank exited 2 (bad input: that rank's one
  ``error:`` line is already on stderr), and exits 2;
* ``error: rank R exited with code C (its output is above)`` for another exit code, or
  ``error: rank R was killed by SIGKILL`` for a signal, and exits with that code (128 +
  the signal's number for a signal);
* ``hpp-run: stopped by SIGTERM`` (or SIGINT) when the launcher itself is signalled: it
  stops the workers (with ``--exit-signal-handler`` they save first) and exits 128 + the
  signal's number, as a shell reports a signalled program.

On more than one node it first says which rendezvous it waits at and for how many
nodes (torchrun waits there without a word).  The launcher's own log lines about a
failing worker are left out.  Everything else
(rendezvous, elastic restarts, environment) is torchrun's.
"""
from __future__ import annotations

import logging
import signal
import sys


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def main(argv=None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, parse_min_max_nnodes, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    low, high = parse_min_max_nnodes(args.nnodes)
    if high > 1:   # torchrun waits at the rendezvous without a word until enough nodes come
        print(f"hpp-run: waiting at the rendezvous {args.rdzv_endpoint or args.master_addr} (run id "
              f"{args.rdzv_id}) for {low if low == high else f'{low} to {high}'} nodes", file=sys.stderr, flush=True)
    # the launcher's own lines about a failing worker ("failed (exitcode: 2) ...", "Sending
    # process ... closing signal"): the one line below says it
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = failure.exitcode
        if code == 2:
            return 2
        if code < 0:
            print(f"error: rank {rank} was killed by {_signal_name(-code)}", file=sys.stderr, flush=True)
            return 128 - code
        print(f"error: rank {rank} exited with code {code} (its output is above)", file=sys.stderr, flush=True)
        return code
    except SignalException as exc:
        print(f"hpp-run: stopped by {_signal_name(exc.sigval)}", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
