"""Stop on a signal: SIGTERM/SIGINT let the loop finish its step, save a checkpoint and stop.

Two levels: ``StopOnSignal`` (one run, while its loop runs) and ``SweepStop`` (a Hydra sweep, in the process
that launches the jobs, from the sweep's start to its end): a signal during a sweep stops the current job
after it saves and no later job starts (``sweep_stopped``; ``train.py`` skips such jobs).
"""

from __future__ import annotations

import logging
from typing import Optional

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
        # a signal the sweep received while this job was starting: stop after the first step
        self.signal_name: Optional[str] = sweep_stopped()
        self._previous: dict = {}
        import jax

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
        if _sweep is not None and _sweep.signal_name is None:
            _sweep.signal_name = name  # no later job of the sweep starts
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


class SweepStop:
    """While a sweep runs: SIGTERM and SIGINT set ``signal_name`` (one log line); the job running then saves
    and stops (its ``StopOnSignal`` has the handlers while its loop runs; a job still starting stops after
    its first step) and no later job starts. ``on_signal`` callbacks run at the first signal (e.g. forward
    it to job processes). A second SIGINT raises ``KeyboardInterrupt``.

    ``not_submitted``: jobs a launcher never started because of the signal (counted by the launcher).
    Installed only in the main thread; ``uninstall`` puts the previous handlers back.
    """

    def __init__(self):
        self.signal_name: Optional[str] = None
        self.not_submitted = 0
        self.on_signal: list = []
        self._previous: dict = {}

    def _handle(self, signum, frame):
        import signal

        name = signal.Signals(signum).name
        if self.signal_name is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.signal_name = name
        log.warning("%s received: the running job saves a checkpoint and stops; no further job starts", name)
        for callback in self.on_signal:
            callback(signum)

    def install(self) -> "SweepStop":
        global _sweep
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        _sweep = self
        return self

    def uninstall(self) -> None:
        global _sweep
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if _sweep is self:
            _sweep = None


_sweep: Optional[SweepStop] = None  # the sweep running in this process, if any


def sweep() -> Optional[SweepStop]:
    """The ``SweepStop`` of the sweep this process launches, or None (a single run, or a job process)."""
    return _sweep


def sweep_stopped() -> Optional[str]:
    """The signal that stopped this process's sweep (``SIGTERM``/``SIGINT``), or None."""
    return None if _sweep is None else _sweep.signal_name
