"""``train.py``'s ``sys.excepthook``: a Ctrl-C outside the training steps stops the process with one line.

Inside the training steps ``training.signals.StopOnSignal`` turns the first Ctrl-C into a checkpoint and a stop;
anywhere else (the imports, Hydra's composition, the start-up, the end, or a second, impatient Ctrl-C) Python
raises ``KeyboardInterrupt``, whose traceback says nothing a user needs. Only the standard library is imported
here: ``train.py`` installs the hooks before its other imports. ``python -m evaluate`` installs them too, with its
own line.
"""

from __future__ import annotations

import _thread
import contextlib
import functools
import logging
import os
import signal
import sys
import threading
from typing import Iterator

# read at import, i.e. as train.py starts: its cli() sets HYDRA_FULL_ERROR itself later, for Hydra's composition
_USER_FULL_ERROR = os.environ.get("HYDRA_FULL_ERROR") == "1"
INTERRUPTED_LINE = (
    "error: interrupted by SIGINT (Ctrl-C) and stopped; a single Ctrl-C during the training steps saves a "
    "checkpoint first (HYDRA_FULL_ERROR=1 prints where it stopped)"
)


PASS_ON_DELAY_S = 0.01  # unraisable_hook: after it has returned
_reported = False  # interrupt_hook printed a Ctrl-C and the process went on (numpy's import does: see interrupted)


def interrupted(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a ``KeyboardInterrupt``, was raised while handling one (its ``__cause__`` /
    ``__context__`` chain holds one), or came after ``interrupt_hook`` reported a Ctrl-C in this process. A Ctrl-C
    inside a C extension's import surfaces as an ``ImportError``: raised during the ``KeyboardInterrupt``, or, in
    numpy's, after printing it through ``sys.excepthook`` (``_import_array``: ``PyErr_Print``), which clears it from
    the chain."""
    if _reported:
        return True
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


class HeldSigint:
    """A Ctrl-C (SIGINT) held back from ``hold()`` to ``release()``, which then raises ``KeyboardInterrupt``; as a
    context manager, around a block (an error of the block itself goes on instead).

    For code that cannot be interrupted safely: imports of C extensions (jaxlib's initialisation aborts,
    ``nanobind::python_error``, exit status 134, or crashes, 139, when a ``KeyboardInterrupt`` is raised inside
    it), and Hydra's composition (``Hydra.get_mode`` catches every ``Exception``: a ``KeyboardInterrupt`` that
    OmegaConf's clean-up turns into another error there would be lost and the run would go on). Holds only on the
    main thread and when Python's default SIGINT handler is installed; otherwise nothing changes.
    """

    def __init__(self) -> None:
        self.holding, self.received = False, False

    def hold(self) -> None:
        if self.holding or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return
        self.holding, self.received = True, False
        signal.signal(signal.SIGINT, self._record)

    def _record(self, signum, frame) -> None:
        self.received = True

    def release(self) -> None:
        """Python's handler back; raises ``KeyboardInterrupt`` if a SIGINT came while held (once)."""
        if not self.holding:
            return
        signal.signal(signal.SIGINT, signal.default_int_handler)
        self.holding = False
        if self.received:
            self.received = False
            raise KeyboardInterrupt

    def __enter__(self) -> HeldSigint:
        self.hold()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.received = False  # the block's own error goes on
        self.release()


def interrupt_hook(exc_type, exc, tb, fallback=sys.excepthook, line: str = INTERRUPTED_LINE) -> None:
    """An uncaught ``KeyboardInterrupt``, or an exception a Ctrl-C caused (``interrupted``), prints ``line`` on
    stderr and the process exits with status 130 (after a ``KeyboardInterrupt`` Python exits by SIGINT itself;
    after another exception, ``os._exit(130)``); anything else, or any exception when the user set
    ``HYDRA_FULL_ERROR=1``, goes to ``fallback`` (Python's own hook: the traceback)."""
    global _reported
    if interrupted(exc if exc is not None else exc_type()) and not _USER_FULL_ERROR:
        if not _reported:  # once: numpy's import prints the Ctrl-C through this hook, then fails on
            print(line, file=sys.stderr, flush=True)
            _reported = True
        if not issubclass(exc_type, KeyboardInterrupt):  # e.g. an ImportError: exit as a Ctrl-C does
            sys.stdout.flush()
            os._exit(130)
        return
    fallback(exc_type, exc, tb)


def unraisable_hook(unraisable, fallback=sys.unraisablehook) -> None:
    """``sys.unraisablehook`` of the same kind. Python ignores an exception raised inside an exit handler
    (``atexit``, e.g. JAX's clean-up) or a garbage-collector callback (JAX's), a Ctrl-C included, and goes on.
    At exit this prints one line saying so (the run had ended); elsewhere the Ctrl-C is passed on to the main
    thread (``_thread.interrupt_main`` from a timer thread ``PASS_ON_DELAY_S`` later: as if it arrived again once
    the hook has returned), so it stops the process as any other."""
    if interrupted(unraisable.exc_value) and not _USER_FULL_ERROR:
        if "atexit" in (unraisable.err_msg or ""):
            print(
                "warning: a Ctrl-C (SIGINT) came during Python's exit handlers and was ignored there; the run had "
                "ended",
                file=sys.stderr,
                flush=True,
            )
        else:  # from another thread, a moment later: on the main thread it would raise inside this hook, ignored
            timer = threading.Timer(PASS_ON_DELAY_S, _thread.interrupt_main, args=(signal.SIGINT,))
            timer.daemon = True
            timer.start()
        return
    fallback(unraisable)


def install(line: str = INTERRUPTED_LINE) -> None:
    """Makes ``interrupt_hook`` (with ``line``) and ``unraisable_hook`` this process's hooks (a script's
    ``__main__``)."""
    sys.excepthook = functools.partial(interrupt_hook, fallback=sys.excepthook, line=line)
    sys.unraisablehook = functools.partial(unraisable_hook, fallback=sys.unraisablehook)


class NoInterruptTraceback(logging.Filter):
    """Keeps a log record but drops its traceback when the exception logged is a Ctrl-C (orbax logs "Save
    Finalize thread (save_finalize) failed." with the ``KeyboardInterrupt`` of a Ctrl-C during the final save's
    wait)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and interrupted(record.exc_info[1]) and not _USER_FULL_ERROR:
            record.exc_info, record.exc_text = None, None
        return True
