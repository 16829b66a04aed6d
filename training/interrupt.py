"""``train.py``'s ``sys.excepthook``: a Ctrl-C outside the training steps stops the process with one line.

Inside the training steps ``training.signals.StopOnSignal`` turns the first Ctrl-C into a checkpoint and a stop;
anywhere else (the imports, Hydra's composition, the start-up, the end, or a second, impatient Ctrl-C) Python
raises ``KeyboardInterrupt``, whose traceback says nothing a user needs. Only the standard library is imported
here: ``train.py`` installs the hook before its other imports.
"""

from __future__ import annotations

import os
import sys

# read at import, i.e. as train.py starts: its cli() sets HYDRA_FULL_ERROR itself later, for Hydra's composition
_USER_FULL_ERROR = os.environ.get("HYDRA_FULL_ERROR") == "1"
INTERRUPTED_LINE = (
    "error: interrupted by SIGINT (Ctrl-C) and stopped; a single Ctrl-C during the training steps saves a "
    "checkpoint first (HYDRA_FULL_ERROR=1 prints where it stopped)"
)


def interrupt_hook(exc_type, exc, tb, fallback=sys.excepthook) -> None:
    """An uncaught ``KeyboardInterrupt`` prints ``INTERRUPTED_LINE`` on stderr (Python still exits by SIGINT: exit
    status 130 in a shell); anything else, or any exception when the user set ``HYDRA_FULL_ERROR=1``, goes to
    ``fallback`` (Python's own hook: the traceback)."""
    if issubclass(exc_type, KeyboardInterrupt) and not _USER_FULL_ERROR:
        print(INTERRUPTED_LINE, file=sys.stderr, flush=True)
        return
    fallback(exc_type, exc, tb)
