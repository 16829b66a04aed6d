"""Stop on a signal: SIGTERM/SIGINT let the loop finish its step, save a checkpoint and stop."""

from __future__ import annotations

import logging
from typing import Optional

import jax

log = logging.getLogger(__name__)


class StopOnSignal:
    """While active, SIGTERM and SIGINT only set ``signal_name`` (the loop finishes its step, saves and stops).

    A second SIGINT raises ``KeyboardInterrupt`` at once (an impatient Ctrl-C). Handlers are installed only
    in the main thread and the previous ones are put back on exit.

    With several processes (``jax.distributed``) no Python handler is installed: JAX's preemption service
    already catches SIGTERM and agrees on one step at which every process stops
    (``jax.experimental.multihost_utils.reached_preemption_sync_point``, asked once per step by ``requested``),
    so all processes save the same step together.
    """

    def __init__(self):
        self.signal_name: Optional[str] = None
        self._previous: dict = {}
        self._multi = jax.process_count() > 1

    def requested(self, done: int) -> bool:
        """Whether the run must save and stop after step ``done`` (call once per step, on every process)."""
        if self._multi and self.signal_name is None:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(done):
                self.signal_name = "SIGTERM (preemption, all processes)"
        return self.signal_name is not None

    def _handle(self, signum, frame):
        import signal

        name = signal.Signals(signum).name
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = name
        log.warning("%s received: finishing the current step, then saving a checkpoint and stopping", name)

    def install(self) -> "StopOnSignal":
        import signal
        import threading

        if not self._multi and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    __enter__ = install

    def __exit__(self, *exc) -> None:
        self.uninstall()
