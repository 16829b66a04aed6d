"""``train.py``'s ``sys.excepthook``: a Ctrl-C outside the training steps stops the process with one line.

Inside the training steps ``training.signals.StopOnSignal`` turns the first Ctrl-C into a checkpoint and a stop;
anywhere else (the imports, Hydra's composition, the start-up, the end, or a second, impatient Ctrl-C) Python
raises ``KeyboardInterrupt``, whose traceback says nothing a user needs. Only the standard library is imported
here: ``train.py`` installs the hook before its other imports.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

# read at import, i.e. as train.py starts: its cli() sets HYDRA_FULL_ERROR itself later, for Hydra's composition
_USER_FULL_ERROR = os.environ.get("HYDRA_FULL_ERROR") == "1"
INTERRUPTED_LINE = (
    "error: interrupted by SIGINT (Ctrl-C) and stopped; a single Ctrl-C during the training steps saves a "
    "checkpoint first (HYDRA_FULL_ERROR=1 prints where it stopped)"
)


def interrupted(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a ``KeyboardInterrupt`` or was raised while handling one (its ``__cause__`` /
    ``__context__`` chain holds one): a Ctrl-C inside a C extension's import (numpy, jaxlib) surfaces as an
    ``ImportError`` raised during the ``KeyboardInterrupt``."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


@contextlib.contextmanager
def interrupt_as_keyboard() -> Iterator[None]:
    """Raises ``KeyboardInterrupt`` (from None) for an exception of the block that ``interrupted`` says a Ctrl-C
    caused, so that Hydra's job report (which catches ``Exception``) lets it through to ``interrupt_hook``."""
    try:
        yield
    except Exception as e:
        if interrupted(e):
            raise KeyboardInterrupt from None
        raise


def interrupt_hook(exc_type, exc, tb, fallback=sys.excepthook) -> None:
    """An uncaught ``KeyboardInterrupt``, or an exception a Ctrl-C caused (``interrupted``), prints
    ``INTERRUPTED_LINE`` on stderr (after a ``KeyboardInterrupt`` Python still exits by SIGINT: exit status 130 in a
    shell); anything else, or any exception when the user set ``HYDRA_FULL_ERROR=1``, goes to ``fallback``
    (Python's own hook: the traceback)."""
    if interrupted(exc if exc is not None else exc_type()) and not _USER_FULL_ERROR:
        print(INTERRUPTED_LINE, file=sys.stderr, flush=True)
        return
    fallback(exc_type, exc, tb)
