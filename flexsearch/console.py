"""The ``flexsearch`` command's entry point, importing nothing heavy itself: the
command's modules (torch among them, about 2.5 s) are imported inside it with a SIGINT
handler of its own, so that a Ctrl-C during those imports exits 130 with one line, as it
does later (:func:`flexsearch.cli.main`), instead of a traceback. (A KeyboardInterrupt
raised inside an import is not always one when it arrives: torch's import of numpy,
interrupted, surfaced as ``ImportError: cannot load module more than once per
process``.)"""

from __future__ import annotations

import os
import signal
import sys


def _interrupted(signum, frame) -> None:  # noqa: ARG001 - a signal handler's signature
    """Nothing was done yet: say so and leave at once."""
    sys.stderr.write("interrupted\n")
    sys.stderr.flush()
    os._exit(130)


def entry() -> None:
    """Import :mod:`flexsearch.cli` under :func:`_interrupted`, then put Python's own
    SIGINT handler back and run :func:`flexsearch.cli.entry`."""
    previous = signal.signal(signal.SIGINT, _interrupted)
    try:
        from flexsearch.cli import entry as run
    finally:
        signal.signal(signal.SIGINT, previous)
    run()
