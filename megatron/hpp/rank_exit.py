"""How a rank's process ends once it has used gloo: flushed, without interpreter finalisation.

A gloo work keeps the thread-local state of the call that issued it, Python objects
included (the saved-tensor hooks of the profiler's measured forward, for one).  gloo's
worker thread lets go of a finished work asynchronously; when that happens while this
process finalises its interpreter, the thread cannot take the GIL, is unwound inside a
destructor, and the process aborts (``terminate called without an active exception``,
SIGABRT) after a correct run.  A core of such an abort shows ``Py_FinalizeEx`` in the main
thread and ``ProcessGroupGloo::runLoop -> ~AsyncBarrierWork -> ~AsyncAllreduceWork ->
~ThreadLocalState -> decref -> take_gil -> pthread_exit -> std::terminate`` in gloo's.
A rank's entry point therefore ends with :func:`exit_rank` once its results are written and
its group is destroyed: there is no finalisation to race with.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_rank(code: int) -> NoReturn:
    """Flush logging, stdout and stderr, then end the process with ``code`` at once."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # closed or broken pipe: nothing more to save
            pass
    os._exit(code)
