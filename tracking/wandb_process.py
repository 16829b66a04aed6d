"""W&B in a process of its own: the training process sends its W&B calls down a pipe and never imports wandb.

Why: in the training process ``import wandb`` and ``wandb.init`` (waiting for W&B's ``wandb-core`` service) come
before the first step, and each ``run.log`` call is a blocking hand-off on the training thread. A writer thread
would hold the GIL beside the step dispatch. A child process holds no GIL: it imports wandb beside the training
process's own imports (``prestart``), runs ``wandb.init`` while the first steps run, and the training thread's
per-record cost is one JSON line into a pipe (docs/internals.md, "W&B in its own process").

The W&B run is the one W&B in the training process would make: the same ``wandb.init`` arguments (plus an ``id``
chosen here, so that the checkpoint can record it without waiting for W&B), the same ``run.log`` calls in the same
order, the same config updates, summary and ``run.finish(exit_code)``; ``training.report.Reporter`` is the only
user.

Protocol: JSON lines. Parent -> child (stdin): ``{"op": "init", "mode", "kwargs", "settings"}``, ``{"op": "log",
"data", "step"}``, ``{"op": "config", "data"}``, ``{"op": "summary", "data"}`` (commits the pending history row,
then sets every key), ``{"op": "finish", "exit_code"}``. Child -> parent (a duplicate of its stdout; its own
stdout is redirected to stderr so nothing W&B prints can corrupt the replies): ``{"op": "started", "id", "dir",
"group", "mode", "warning"}``, ``{"op": "error", "error"}``, ``{"op": "finished"}``.

Environment: the child inherits the training process's, with ``WANDB_MODE=offline`` for an offline run (W&B's
process-wide mode) and ``GOMAXPROCS=1`` unless it is set (W&B's service, ``wandb-core``, is a Go program; on one
thread it spends less CPU per record).

Lifetime: the child ignores SIGINT, SIGTERM and SIGHUP (a Ctrl-C or a scheduler's SIGTERM reaches the whole
process group; the training process decides what happens and finishes the W&B run with its exit code). End of
input without ``finish`` (the training process died) finishes the run with exit code 1; end of input before
``init`` (the run stopped at bad input, or W&B was not needed) exits without creating anything. POSIX only
(``select`` on a pipe). The training process writes to the pipe without blocking (what it does not take waits in
``_pending``), so only ``finish`` waits for the child. The child reports the first failed W&B call and skips the
rest until ``finish``; the caller (``Reporter``) then drops W&B and trains on.

Priority (``wandb.process_priority``): ``normal`` (default), the training process's own CPU priority: on a machine
with spare cores W&B's work runs beside the steps; on a machine whose cores the steps keep busy it shares them (the
steady-state windows slow by its CPU use). ``idle``: ``lowest_cpu_priority`` from the child's start: it takes only
CPU time the training leaves, but on a busy machine it is starved and the run's end waits for it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import select
import signal
import string
import subprocess
import sys
import traceback
from typing import Any, Callable, Iterator, Optional

log = logging.getLogger(__name__)

_ID_ALPHABET = string.ascii_lowercase + string.digits  # W&B's own run ids: 8 of these (wandb.util.generate_id)


def _plain(value: Any) -> Any:
    """numpy / jax scalars and arrays as Python numbers and lists (JSON's ``default``). Raises TypeError."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _check_priority(priority: str) -> None:
    if priority not in ("normal", "idle"):
        raise ValueError(f"priority={priority!r} is unknown; choose normal or idle")


IGNORED_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")  # by the W&B process: the training process finishes its run


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP blocked on this thread for the block (a few ms: the ``Popen`` of the W&B process,
    which inherits the mask: they stay pending there from its first instruction, before its own imports, and
    ``_child`` then ignores them and unblocks them). The handlers are left as they are, one installed outside
    Python too (JAX's preemption notifier in a multi-process run: changing the handler through Python would replace
    it); a signal that arrives inside the block is delivered when it ends."""
    signals = {getattr(signal, name) for name in IGNORED_SIGNALS if hasattr(signal, name)}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def new_run_id() -> str:
    """A fresh W&B run id: 8 characters of ``[a-z0-9]``, the format of ``wandb.util.generate_id``."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(8))


class WandbProcess:
    """The training process's side: starts the child, sends it W&B calls, reads its replies.

    ``on_started`` (set by the caller) is called once with the ``started`` reply (a dict: ``id``, ``dir``,
    ``mode``, ``warning``) when it is read: the caller logs the fallback warning and the offline hint.

    Raises:
      OSError: the child could not be started.
    """

    def __init__(self, priority: str = "normal", mode: Optional[str] = None) -> None:
        _check_priority(priority)
        self.priority = priority  # the child's CPU priority, from its start (``idle``: ``lowest_cpu_priority``)
        self.mode = mode  # the W&B mode the child is started for (``offline``: W&B's process-wide mode too)
        env = dict(os.environ)
        if mode == "offline":
            # W&B's process-wide mode (WANDB_MODE), not only the run's: W&B's own analytics (an OpenTelemetry
            # histogram per run.log call, exported to W&B's servers at exit) is off only then, so an offline run
            # connects to nothing and spends less CPU.
            env["WANDB_MODE"] = "offline"
        # W&B's service (wandb-core, a Go program this process starts) on one OS thread at a time, unless the
        # environment says otherwise: with Go's default (one per core) it spends more CPU per record (most likely
        # waking and parking threads).
        env.setdefault("GOMAXPROCS", "1")
        with _signals_blocked():  # inherited: a Ctrl-C during the child's own imports does not reach them
            self.proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), f"--priority={priority}"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                close_fds=True,
                env=env,
            )
        self.run_id: Optional[str] = None
        self.info: Optional[dict] = None  # the ``started`` reply
        self.on_started: Optional[Callable[[dict], None]] = None
        self._errors: list[str] = []
        self._failed = False  # an error was reported (or the child died): no ``started`` reply will come
        self._buffer = b""
        self._finished = False
        self._stdin_open = True
        # The training thread never waits for the child while training: what the pipe does not take now waits
        # here (a stopped or starved child must not hold up a step, a checkpoint or a graceful stop).
        self._pending = bytearray()
        assert self.proc.stdin is not None
        os.set_blocking(self.proc.stdin.fileno(), False)

    # ---- sending -----------------------------------------------------------------------------------
    def _send(self, msg: dict, flush: bool = True) -> None:
        if not self._stdin_open:
            return
        self._pending += (json.dumps(msg, default=_plain) + "\n").encode()
        if flush:
            self._write(block=False)

    def _write(self, block: bool) -> None:
        """Writes what is pending as far as the pipe takes it; with ``block``, all of it (waiting for the child,
        reading its replies meanwhile so that neither side waits on a full pipe)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        fd = self.proc.stdin.fileno()
        while self._pending and self._stdin_open:
            if block:
                readable, _, _ = select.select([self.proc.stdout.fileno()], [fd], [])
                if readable:
                    self.poll(block=False)
            try:
                written = os.write(fd, self._pending)
            except BlockingIOError:
                if not block:
                    return
                continue
            except OSError:  # BrokenPipeError: the child died; its replies (or its exit code) say why
                self._stdin_open = False
                self._pending.clear()
                self.poll(block=False)
                if not self._failed:
                    self._error(f"the W&B process exited with code {self.proc.wait()}")
                return
            del self._pending[:written]

    def _error(self, text: str) -> None:
        self._errors.append(text)
        self._failed = True

    def init(self, mode: str, kwargs: dict, settings: dict) -> str:
        """Sends ``wandb.init(mode=mode, settings=wandb.Settings(**settings), id=<new id>, **kwargs)``; returns the
        new run's id at once (``wandb.init`` runs in the child while training goes on). An online start that
        fails falls back to offline there (``started``'s ``warning``). ``wandb-core``, which ``wandb.init``
        starts, inherits the child's priority."""
        self.run_id = new_run_id()
        self._send({"op": "init", "mode": mode, "kwargs": {**kwargs, "id": self.run_id}, "settings": settings})
        return self.run_id

    def log(self, data: dict, step: int) -> None:
        """``run.log(data, step=step)``; held until ``flush``."""
        self._send({"op": "log", "data": data, "step": step}, flush=False)

    def config_update(self, data: dict) -> None:
        """``run.config.update(data, allow_val_change=True)``."""
        self._send({"op": "config", "data": data})

    def summary_update(self, data: dict) -> None:
        """``run.log({}, commit=True)`` (the pending history row first), then ``run.summary[k] = v`` per key."""
        self._send({"op": "summary", "data": data})

    def flush(self) -> None:
        """Sends what is held as far as the pipe takes it now; reads the replies that arrived (never waits)."""
        self._write(block=False)
        self.poll(block=False)

    # ---- replies -----------------------------------------------------------------------------------
    def poll(self, block: bool) -> None:
        """Reads the replies that arrived; with ``block``, waits for at least one (or the child's exit)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            ready, _, _ = select.select([fd], [], [], None if block else 0)
            if not ready:
                return
            chunk = os.read(fd, 65536)
            if not chunk:  # the child closed its end: it exited
                if not self._finished and not self._failed:  # no "finished" reply: it died (killed, crashed)
                    self._error(f"the W&B process exited with code {self.proc.wait()} before it finished the W&B run")
                self._finished = True
                return
            self._buffer += chunk
            *lines, self._buffer = self._buffer.split(b"\n")
            for line in lines:
                self._reply(json.loads(line))
            block = False  # one read satisfied a blocking poll; take what else is there without waiting

    def _reply(self, msg: dict) -> None:
        if msg["op"] == "started":
            self.info = msg
            if self.on_started is not None:
                self.on_started(msg)
        elif msg["op"] == "error":
            self._error(msg["error"])
        elif msg["op"] == "finished":
            self._finished = True

    def take_errors(self) -> list[str]:
        """The errors the child reported so far (each returned once): ``wandb.init``, a ``run.log`` or
        ``run.finish`` raised there, or the child died."""
        errors, self._errors = self._errors, []
        return errors

    def started(self) -> Optional[dict]:
        """The ``started`` reply, waiting for ``wandb.init`` in the child; None when it failed or the child died."""
        while self.info is None and not self._failed and not self._finished:
            self.poll(block=True)
        return self.info

    def finish(self, exit_code: int) -> list[str]:
        """``run.finish(exit_code=exit_code)`` and the child's exit (waits for both: W&B has written the run when
        this returns). Returns the errors the child reported that ``take_errors`` has not returned."""
        self._send({"op": "finish", "exit_code": exit_code}, flush=False)
        self._write(block=True)
        self.close_input()
        while not self._finished:
            self.poll(block=True)
        self.proc.wait()
        errors, self._errors = self._errors, []
        return errors

    def close_input(self) -> None:
        """Ends the child's input: before ``init`` it exits creating nothing; after, it finishes the run as crashed
        unless ``finish`` was sent."""
        if self._stdin_open:
            self._stdin_open = False
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            except BrokenPipeError:
                pass

    def abandon(self) -> None:
        """Gives up on a child that failed, without waiting: drops what is held and ends its input (it finishes
        the W&B run with exit code 1 and exits); ``reap`` waits for it later."""
        self._pending.clear()
        self.close_input()

    def reap(self, timeout_s: float = 60.0) -> None:
        """Waits up to ``timeout_s`` for an abandoned child to exit, then kills it."""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def discard(self) -> None:
        """Ends a child that was never given ``init`` (``prestart``'s, when the run stopped first) and reaps it."""
        self.abandon()
        self.reap(timeout_s=30.0)


_prestarted: Optional[WandbProcess] = None
_atexit_registered = False


def prestart(priority: str = "normal", mode: Optional[str] = None) -> None:
    """Starts the W&B process now (it imports wandb and waits), so that its import overlaps this process's own;
    at ``priority`` from its start (``idle``: ``lowest_cpu_priority``, its import included), for W&B ``mode``
    (``WandbProcess``). Nothing is created until ``init``; ``take_prestarted`` hands it over,
    ``discard_prestarted`` ends it."""
    global _prestarted, _atexit_registered
    if not _atexit_registered:
        import atexit

        atexit.register(discard_prestarted)  # a run that stopped before Reporter.close (an error while importing)
        _atexit_registered = True
    if _prestarted is None:
        try:
            _prestarted = WandbProcess(priority, mode)
        except OSError as e:  # started again, at wandb.init time, where the error is reported
            log.debug("the W&B process was not prestarted: %s", e)


def take_prestarted() -> Optional[WandbProcess]:
    """The process ``prestart`` started (and forgets it), or None."""
    global _prestarted
    proc, _prestarted = _prestarted, None
    return proc


def for_run(priority: str, mode: str) -> WandbProcess:
    """The W&B process for a run at ``priority`` in W&B ``mode``: the prestarted one when it was started for both,
    else a new one (a prestarted process for another priority or mode is discarded, having created nothing).

    Raises:
      OSError: a new process could not be started.
    """
    proc = take_prestarted()
    if proc is not None and (proc.priority, proc.mode) != (priority, mode):
        proc.discard()
        proc = None
    return proc or WandbProcess(priority, mode)


def discard_prestarted() -> None:
    """Ends a prestarted process that no run took (the run stopped before starting W&B)."""
    proc = take_prestarted()
    if proc is not None:
        proc.discard()


# ---- the child ---------------------------------------------------------------------------------------------
def lowest_cpu_priority() -> str:
    """Moves every thread of this process (and the threads and processes they start afterwards) to the lowest CPU
    priority: Linux's ``SCHED_IDLE`` policy (a thread runs only when a core would otherwise idle), else ``nice``
    19. Irreversible without privileges. Returns which one."""
    try:
        tasks = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
        for tid in tasks:  # threads that imports started (a policy is per thread on Linux)
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))  # type: ignore[attr-defined]
            except ProcessLookupError:  # the thread has ended
                pass
        return "SCHED_IDLE"
    except (AttributeError, OSError):
        os.nice(19 - os.nice(0))
        return "nice 19"


def _child() -> int:
    if "--priority=idle" in sys.argv[1:]:
        lowest_cpu_priority()
    # W&B's own log files (debug.log) on a disk that fills: no "--- Logging error ---" traceback per line on the
    # user's console (logging's documented switch for such errors); a failed W&B call is still reported (error())
    logging.raiseExceptions = False
    for name in IGNORED_SIGNALS:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {getattr(signal, n) for n in IGNORED_SIGNALS if hasattr(signal, n)})
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever W&B prints goes to stderr, never into the replies

    def reply(**msg: Any) -> None:
        try:
            replies.write(json.dumps(msg) + "\n")
        except BrokenPipeError:
            pass

    def error(what: str) -> None:
        if os.environ.get("WANDB_DEBUG", "").lower() in ("1", "true"):  # W&B's own debug switch
            traceback.print_exc()
        exc = sys.exc_info()[1]
        text = " ".join(str(exc).split())  # one line (pydantic's errors span several)
        reply(op="error", error=f"{what}: {type(exc).__name__}: {text[:400]}")

    try:
        import wandb
    except Exception:  # reported at init (a run that never starts W&B needs no wandb)
        wandb = None
        import_error = traceback.format_exc()
    run = None
    broken = False  # a W&B call failed: the rest are skipped (one error, not one per record) until finish
    for line in sys.stdin.buffer:
        msg = json.loads(line)
        op = msg["op"]
        try:
            if op == "init":
                if wandb is None:
                    reply(op="error", error="import wandb failed: " + import_error.strip().splitlines()[-1])
                    continue
                mode, kwargs = msg["mode"], msg["kwargs"]
                settings, warning = wandb.Settings(**msg["settings"]), None
                try:
                    run = wandb.init(mode=mode, settings=settings, **kwargs)
                except Exception as e:
                    if mode != "online":
                        raise
                    why = str(e).splitlines()[0][:200] if str(e).strip() else type(e).__name__
                    warning = f"W&B could not be reached ({why}); continuing offline"
                    mode = "offline"
                    wandb.teardown()  # the failed start holds the id in its wandb-core ("run ID ... is in use")
                    run = wandb.init(mode=mode, settings=settings, **kwargs)
                info = dict(id=run.id, dir=os.path.dirname(run.dir), group=run.group, mode=mode, warning=warning)
                reply(op="started", **info)
            elif run is None or (broken and op != "finish"):
                continue  # nothing to do before a run (a failed init was reported), or after a failed call
            elif op == "log":
                run.log(msg["data"], step=msg["step"])
            elif op == "config":
                run.config.update(msg["data"], allow_val_change=True)
            elif op == "summary":
                # commit the pending history row first: finish() would commit it after these and overwrite them
                run.log({}, commit=True)
                for k, v in msg["data"].items():
                    run.summary[k] = v
            elif op == "finish":
                try:
                    run.finish(exit_code=msg["exit_code"])
                finally:
                    run = None
        except Exception:
            error(f"W&B {op}")
            broken = True
        if op == "finish":
            break
    else:  # end of input without finish: the training process died
        if run is not None:
            try:
                run.finish(exit_code=1)
            except Exception:
                error("W&B finish")
    if wandb is not None:
        try:  # unregisters W&B's exit hook, which would print a traceback when wandb-core has died
            wandb.teardown()
        except Exception:
            if os.environ.get("WANDB_DEBUG", "").lower() in ("1", "true"):
                traceback.print_exc()
    reply(op="finished")
    return 0


if __name__ == "__main__":
    # run as a script, its folder (training/) heads sys.path: its modules (signals, runtime, paths, ...) must not
    # shadow what wandb imports
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)
    sys.exit(_child())
