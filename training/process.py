"""The process: Ctrl-C and signals, the garbage collector during start-up, the coordinator's port.

Standard library only at import: ``train.py`` calls ``guard_start`` before its other imports, and
``scripts/launch_local.py`` checks the port without starting JAX.
- A Ctrl-C outside the training steps is one line, not a traceback (``install_interrupt_hooks``); inside them
  ``StopOnSignal`` turns SIGTERM/SIGINT into a checkpoint and a stop; ``SweepStop`` does it for a sweep.
- ``train.py`` stops on SIGTERM as on a Ctrl-C before and after the steps (``install_stop_handlers``): one line
  (``stop_line``), ``summary.json`` with status ``stopped``, the process ends by that signal.
- The cyclic garbage collector is off while ``train.py`` imports, then every object alive is frozen
  (``pause_gc``, ``resume_gc``; docs/internals.md, "The garbage collector during start-up").
- A taken coordinator port crashes JAX's runtime after its timeout, so it is checked first (``port_in_use``)."""

from __future__ import annotations

import _thread
import atexit
import contextlib
import errno
import functools
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable, Iterator, Optional, Union

from core.errors import override

log = logging.getLogger(__name__)


# ---- one voice per job -------------------------------------------------------------------------------------
def _cluster_rank() -> int:
    """This process's rank in a cluster job of several tasks (SLURM, Open MPI), read from the environment before
    JAX starts; 0 outside one."""
    for count, rank in (("SLURM_NTASKS", "SLURM_PROCID"), ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")):
        try:
            if int(os.environ.get(count, "1")) > 1:
                return int(os.environ.get(rank, "0"))
        except ValueError:
            continue
    return 0


_rank = _cluster_rank()  # set_rank: the process id it joined the job with


def set_rank(rank: int) -> None:
    """This process's index in its multi-process job (0: a single process), once it is known."""
    global _rank
    _rank = int(rank)


def speaks() -> bool:
    """Whether this process prints the job's lines (errors, warnings, a stop's line) on the console: process 0 of a
    multi-process job, or a single process. The others log them to their own file only, so that a job says each
    line once, not once per process (``training.peers`` speaks for a dead process 0)."""
    return _rank == 0


# the product's packages: a WARNING of their loggers is a line the user must read; a library's stays in the log
PRODUCT_LOGGERS = ("train", "training", "data", "tracking", "measure", "parallel", "core", "models", "evaluate")


class WarningLines(logging.Handler):
    """On the product's loggers (installed as ``training`` is imported): each WARNING record as ``warning: <message>``
    on stderr from the process that speaks (the others' logs have it); the root's handlers still log it."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno == logging.WARNING and speaks():
            print(f"warning: {record.getMessage()}", file=sys.stderr, flush=True)


for _name in PRODUCT_LOGGERS:  # Hydra's logging setup keeps the handlers of loggers it does not configure
    logging.getLogger(_name).addHandler(WarningLines())


# ---- Ctrl-C outside the training steps ---------------------------------------------------------------------
# read at import, i.e. as train.py starts: training.entry.cli sets HYDRA_FULL_ERROR later, for Hydra's composition
_USER_FULL_ERROR = os.environ.get("HYDRA_FULL_ERROR") == "1"
INTERRUPTED_LINE = (
    "error: interrupted by SIGINT (Ctrl-C) and stopped; a single Ctrl-C during the training steps saves a "
    "checkpoint first (HYDRA_FULL_ERROR=1 prints where it stopped)"
)


PASS_ON_DELAY_S = 0.01  # unraisable_hook: after it has returned
_reported = False  # interrupt_hook printed a Ctrl-C and the process went on (numpy's import does: see interrupted)


def interrupted(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a ``KeyboardInterrupt`` or was raised while handling one (its cause/context chain), or came
    after ``interrupt_hook`` reported a Ctrl-C (numpy's import prints one through it, then fails: an ``ImportError``)
    or after ``stop_handler`` received a signal (an interrupt that C++ code turned into another error)."""
    if _reported or (_installed and _stop is not None):  # after a stop signal, what failed failed because of it
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
    """A Ctrl-C, and a SIGTERM that ``stop_handler`` handles, held from ``hold()`` to ``release()``, which then raises
    ``KeyboardInterrupt`` (as a context manager: unless the block raised). For code a signal must not interrupt:
    jaxlib's initialisation (it aborts), Hydra's composition (it catches every ``Exception``), ``train.py``'s imports
    (no run folder for the summary yet). A second signal raises at once. Main thread only; Python's or
    ``stop_handler``'s signals only."""

    def __init__(self) -> None:
        self.holding, self.received = False, False
        self._previous: dict = {}

    def hold(self) -> None:
        if self.holding or threading.current_thread() is not threading.main_thread():
            return
        self._previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            handler = signal.getsignal(sig)
            if handler is stop_handler or (sig == signal.SIGINT and handler is signal.default_int_handler):
                self._previous[sig] = handler
                signal.signal(sig, self._record)
        self.holding, self.received = bool(self._previous), False

    def _record(self, signum, frame) -> None:
        if not self.holding:  # left installed by a handler that replaced it meanwhile (a sweep's, undone)
            return stop_handler(signum, frame)
        _note_stop(signum)
        if self.received:  # a second signal: at once
            self.release()
        self.received = True

    def release(self) -> None:
        """The handlers held back again (unless another replaced them meanwhile: a sweep's ``SweepStop``); raises
        ``KeyboardInterrupt`` if a signal came while held (once)."""
        if not self.holding:
            return
        for sig, handler in self._previous.items():
            if signal.getsignal(sig) == self._record:
                signal.signal(sig, handler)
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


# ---- SIGTERM and SIGINT outside the training steps (train.py) ------------------------------------------------
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # SIGHUP: the terminal closed; stops as SIGTERM does
_stop: Optional[str] = None  # the first SIGTERM/SIGINT stop_handler (or a HeldSigint) received
phase = "start-up"  # where the run is: start-up, steps, end (training.run sets it)
_exit_by: Optional[int] = None  # the signal this process ends with (interrupt_hook: SIGTERM, SIGHUP)
_installed = False  # install_stop_handlers ran (train.py)
PHASES = ("start-up", "steps", "end")


def _note_stop(signum: int) -> None:
    global _stop
    if _stop is None:
        _stop = signal.Signals(signum).name


def stop_handler(signum, frame) -> None:
    """``train.py``'s SIGTERM and SIGINT handler outside the training steps: records the first signal (``stop_signal``)
    and raises ``KeyboardInterrupt`` where the main thread is (inside C++: once the call returns to Python;
    ``raise_if_stopped`` catches one C++ swallowed; in a tool, ``run_tool`` delivers it again), so the run stops with
    one line and a ``stopped`` summary."""
    _note_stop(signum)
    quiet_background_logs()  # the run stops here: orbax's reads and writes cut short are not reported
    if _tool_running and _redeliver is None:
        _start_redelivery(signum)
    raise KeyboardInterrupt


REDELIVER_S = 2.0  # run_tool: a stop whose interrupt C++ code swallowed is delivered again this often
_tool_running = False  # run_tool's main() runs: a stop signal is delivered again until main() has ended
_redeliver: Optional[threading.Thread] = None


def _start_redelivery(signum: int) -> None:
    """A thread that interrupts the main thread again every ``REDELIVER_S`` until the tool's ``main()`` has ended: an
    interrupt raised inside a Python callback of C++ code (a jitted function's first call compiles) can be swallowed
    there, and the tool would go on (``python -m sample --tokens 1000000`` for hours)."""
    global _redeliver

    def again() -> None:
        while True:
            time.sleep(REDELIVER_S)
            if not _tool_running:
                return
            _thread.interrupt_main(signum)

    _redeliver = threading.Thread(target=again, name="stop-redelivery", daemon=True)
    _redeliver.start()


def install_stop_handlers() -> None:
    """Makes ``stop_handler`` the handler of ``STOP_SIGNALS`` (main thread; first thing): SIGTERM no longer kills the
    run before it can say so (Python's default), a SIGINT a background shell ignored (``cmd &``) stops it too; the
    process then ends by that signal (status 143, 130, as Python does) after Python's exit handlers."""
    global _installed
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, stop_handler)
    _installed = True
    atexit.register(_exit_by_signal)  # before the libraries register theirs (W&B, orbax, JAX): it runs after them
    atexit.register(_requeue_if_armed)  # after theirs too (JAX's shutdown: every process has ended its run)


_requeue_job: Optional[str] = None  # arm_requeue: the preempted SLURM job process 0 requeues at its exit


def arm_requeue(job_id: str) -> None:
    """Process 0 requeues SLURM job ``job_id`` as the last of its exit handlers (``training.slurm``)."""
    global _requeue_job
    if speaks():
        _requeue_job = job_id


def _requeue_if_armed() -> None:
    if _requeue_job is None:
        return
    from training import slurm

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the requeue signals every task of the job, this one too
    if not slurm.requeue(_requeue_job):
        print(
            f"warning: scontrol requeue {_requeue_job} failed: the job is not requeued; continue it by submitting "
            "the same command",
            file=sys.stderr,
            flush=True,
        )


def _exit_by_signal() -> None:
    if _exit_by is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(_exit_by, signal.SIG_DFL)
    signal.pthread_kill(threading.get_ident(), _exit_by)  # to this thread: delivered before the call returns
    os._exit(128 + _exit_by)  # still here: a process that ignores it (PID 1 of a container) exits with its status


def stop_signal() -> Optional[str]:
    """The name of the first SIGTERM/SIGINT that ``stop_handler`` received (``SIGTERM``, ``SIGINT``), or None."""
    return _stop


def set_phase(name: str) -> None:
    """Where the run is, for ``stop_line``: ``start-up`` (before the first step), ``steps``, ``end`` (after them)."""
    global phase
    if name not in PHASES:
        raise ValueError(f"unknown phase {name!r}; one of {', '.join(PHASES)}")
    phase = name


def raise_if_stopped() -> None:
    """Raises ``KeyboardInterrupt`` when ``stop_handler`` (``train.py``'s, not a run inside another program) received
    a signal whose interrupt C++ code swallowed (it called back into Python); called before the steps."""
    if _installed and _stop is not None:
        raise KeyboardInterrupt


def stop_text(signal_name: Optional[str] = None) -> str:
    """What stopped the run and what to do, without ``error: `` (``summary.json``'s ``error``): the signal
    (``signal_name``, else the one received, else SIGINT), where the run was (``set_phase``), a sweep's resumption."""
    name = signal_name or _stop or "SIGINT"
    said = "SIGINT (Ctrl-C)" if name == "SIGINT" else name
    if phase == "start-up":
        again = _sweep_again() or "the same command starts the run again (from its newest checkpoint, if any)"
        return (
            f"stopped by {said} during the start-up, before the first training step: nothing trained or saved; {again}"
        )
    if phase == "steps":
        return (
            f"stopped at once by {said} during the training steps (a second signal: it did not wait for a checkpoint); "
            f"{_resume_hint}"
        )
    again = _sweep_again(" (this job finishes from its final checkpoint)") or (
        "the same command finishes it from its final checkpoint (or says it is complete)"
    )
    return f"stopped by {said} after the training steps, while the run was ending; {again}"


def tool_line() -> str:
    """The line a tool (``python -m evaluate``, ``sample``, ``sweeps.report``, ...) prints when a signal stopped it."""
    name = _stop or "SIGINT"
    said = "SIGINT (Ctrl-C)" if name == "SIGINT" else name
    return f"error: interrupted by {said} and stopped (HYDRA_FULL_ERROR=1 prints where)"


def run_tool(main: Callable[[], int], imports_jax: bool = True) -> None:
    """A tool's ``__main__``: SIGTERM and SIGINT stop it with ``tool_line`` and exit status 143 / 130, no traceback
    (the interrupt is delivered again every ``REDELIVER_S`` until ``main()`` has ended: C++ code can swallow one);
    ``imports_jax``: JAX imported with a Ctrl-C held (``HeldSigint``). Exits with ``main()``'s status."""
    global _tool_running
    install_stop_handlers()
    install_interrupt_hooks(tool_line)
    _tool_running = True
    try:
        with interrupt_as_keyboard():  # a Ctrl-C in numpy's or jaxlib's import surfaces as an ImportError
            if imports_jax:
                with HeldSigint():
                    import jax  # noqa: F401
            code = main()
    finally:
        _tool_running = False  # the exit handlers run undisturbed
    sys.exit(code)


_resume_hint = "the same command continues from the newest checkpoint"  # set_resume_hint: with its checkpoint.dir
_sweep_dir: Optional[str] = None  # the sweep of this job (set_sweep_dir), None: a single run


def set_sweep_dir(sweep_dir: Optional[str]) -> None:
    """This job's sweep folder (None: a single run): the lines of a stop say to resume the sweep, not the job."""
    global _sweep_dir
    _sweep_dir = sweep_dir


def sweep_dir() -> Optional[str]:
    """The ``hydra.sweep.dir`` of the sweep this job belongs to (``set_sweep_dir``), or None for a single run."""
    return _sweep_dir


def _sweep_again(then: str = "") -> str:
    """How a stopped job of a sweep is continued (with ``then`` after it), or "" for a single run."""
    if _sweep_dir is None:
        return ""
    return f"resume the sweep with the same command and {override('hydra.sweep.dir', _sweep_dir)}{then}"


def set_resume_hint(checkpoint_dir: Optional[str]) -> None:
    """Names ``checkpoint_dir`` (None: the run saves none) in the line of a stop during the steps: "the same command"
    alone would start over in a new run folder. A job of a sweep is told to resume the sweep instead."""
    global _resume_hint
    if _sweep_dir is not None:
        then = " (this job continues from its newest checkpoint)" if checkpoint_dir else " (this job starts over)"
        _resume_hint = _sweep_again(then)
    elif checkpoint_dir:
        _resume_hint = (
            f"continue with the same command and {override('checkpoint.dir', checkpoint_dir)} (its newest checkpoint)"
        )
    else:
        _resume_hint = "nothing was saved (checkpoint.enabled=false): the same command starts over"


def resume_hint() -> str:
    """How this run continues after a stop during its steps (``set_resume_hint``)."""
    return _resume_hint


def saved_stop_text(saved: Optional[str], checkpoint_dir) -> str:
    """How to continue after a stop that saved ``saved`` (None: none) in ``checkpoint_dir``, the end of ``stopped by
    <signal> after step S of N; ...`` (a sweep: resume it; a preempted SLURM batch job: it is requeued)."""
    if not saved:
        return "no checkpoint written (checkpoint.enabled=false)"
    from training import slurm

    back = slurm.comes_back()
    if back is not None:
        job, how = back
        if how == "preempted":
            arm_requeue(job)
        what = "preempted the job and requeues it" if how == "preempted" else "requeued the job"
        return f"checkpoint saved in {saved}; SLURM {what} (job {job}): it continues from this checkpoint by itself"
    if _sweep_dir is not None:
        return f"checkpoint saved in {saved}; " + _sweep_again(" (this job continues from it)")
    return (
        f"checkpoint saved in {saved}; continue with the same command and {override('checkpoint.dir', checkpoint_dir)} "
        f"(or {override('checkpoint.resume', saved)})"
    )


def stop_line() -> str:
    """``error: `` + ``stop_text()``: the one line ``train.py`` prints when a signal stopped it."""
    return f"error: {stop_text()}"


# train.py's signals from its first line until its job starts (then its run folder holds the stop's summary.json)
STARTING = HeldSigint()


def guard_start() -> None:
    """``train.py``'s first call, before it imports Hydra and JAX: a stop from here on is one line (``stop_line``)
    and a ``stopped`` summary; a signal waits (``STARTING``) until the job has its run folder, where that summary
    goes (``training.entry``); the collector is off until the imports are done (``pause_gc``)."""
    install_interrupt_hooks(stop_line)
    install_stop_handlers()
    STARTING.hold()
    if "IPython" not in sys.modules:  # not in an IPython session's %run, whose own objects would be frozen
        pause_gc()


def interrupt_hook(
    exc_type, exc, tb, fallback=sys.excepthook, line: Union[str, Callable[[], str]] = INTERRUPTED_LINE
) -> None:
    """An uncaught ``KeyboardInterrupt``, or an exception a Ctrl-C caused (``interrupted``), prints ``line`` (or
    ``line()``) on stderr; the process exits with status 130 (by SIGINT, or ``os._exit``), 143 after a SIGTERM (by
    SIGTERM, after its exit handlers). Anything else, or all with ``HYDRA_FULL_ERROR=1``: ``fallback``'s traceback."""
    global _reported, _exit_by
    caused = interrupted(exc if exc is not None else exc_type())
    if caused and _stop in ("SIGTERM", "SIGHUP"):
        _exit_by = signal.Signals[_stop]
    if caused and not _USER_FULL_ERROR:
        if not _reported:  # once: numpy's import prints the Ctrl-C through this hook, then fails on
            if speaks():  # one voice per job
                print(line() if callable(line) else line, file=sys.stderr, flush=True)
            _reported = True
        if not issubclass(exc_type, KeyboardInterrupt):  # e.g. an ImportError: exit as a Ctrl-C does
            sys.stdout.flush()
            os._exit(128 + _exit_by if _exit_by is not None else 130)
        return
    fallback(exc_type, exc, tb)


def unraisable_hook(unraisable, fallback=sys.unraisablehook) -> None:
    """Python ignores a Ctrl-C raised in an exit handler or a collector callback: at exit this says so in one line;
    elsewhere it is passed on to the main thread ``PASS_ON_DELAY_S`` later, to stop the process as any other."""
    if interrupted(unraisable.exc_value) and not _USER_FULL_ERROR:
        if "atexit" in (unraisable.err_msg or ""):
            if not speaks():  # one voice per job
                return
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


def install_interrupt_hooks(line: Union[str, Callable[[], str]] = INTERRUPTED_LINE) -> None:
    """Makes ``interrupt_hook`` (with ``line``, or a function that says it) and ``unraisable_hook`` the hooks."""
    sys.excepthook = functools.partial(interrupt_hook, fallback=sys.excepthook, line=line)
    sys.unraisablehook = functools.partial(unraisable_hook, fallback=sys.unraisablehook)


class NoInterruptTraceback(logging.Filter):
    """Drops a record whose exception a stop signal caused (orbax logs "Save Finalize thread (save_finalize) failed."
    for one during a save's wait): the stop's line says it. ``HYDRA_FULL_ERROR=1`` keeps it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and interrupted(record.exc_info[1]) and not _USER_FULL_ERROR)


def quiet_background_logs() -> None:
    """Quiets absl's logger: orbax's background reads and writes cut short by a stop (``HYDRA_FULL_ERROR=1``: not)."""
    if not _USER_FULL_ERROR:
        logging.getLogger("absl").setLevel(logging.CRITICAL + 1)


# ---- stop on a signal: a run, a sweep ------------------------------------------------------------------------
class StopOnSignal:
    """While active (main thread; the previous handlers back on exit), SIGTERM and SIGINT set ``signal_name``: the
    loop saves after its step and stops; a second SIGINT raises ``KeyboardInterrupt``. With several processes none
    is installed: JAX's preemption service catches SIGTERM, ``requested`` asks it for the step to save and stop at."""

    def __init__(self):
        self.signal_name: Optional[str] = sweep_stopped()  # the sweep's, while this job started: stop after a step
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
        name = signal.Signals(signum).name
        if self.signal_name is not None and signum == signal.SIGINT:
            first = self.signal_name.split()[0]  # the stop's line and summary name the first signal, whatever follows
            _note_stop(signal.Signals[first] if first in signal.Signals.__members__ else signum)
            quiet_background_logs()
            raise KeyboardInterrupt
        self.signal_name = name
        if _sweep is not None and _sweep.signal_name is None:
            _sweep.signal_name = name  # no later job of the sweep starts
        log.info("%s received: finishing the current step, then saving a checkpoint and stopping", name)

    def install(self) -> "StopOnSignal":
        if not self._multi and threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    __enter__ = install

    def __exit__(self, *exc) -> None:
        self.uninstall()


class SweepStop:
    """While a sweep runs: SIGTERM and SIGINT set ``signal_name`` (one log line); the running job saves and stops,
    no later job starts, ``on_signal`` callbacks run at the first signal (e.g. forward it to job processes), and a
    second SIGINT raises ``KeyboardInterrupt``. ``not_submitted``: jobs a launcher never started because of it."""

    def __init__(self):
        self.signal_name: Optional[str] = None
        self.not_submitted = 0
        self.on_signal: list = []
        self._previous: dict = {}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.signal_name is not None:
            if signum == signal.SIGINT:
                quiet_background_logs()
                raise KeyboardInterrupt
            return
        self.signal_name = name
        log.info("%s received: the running job saves a checkpoint and stops; no further job starts", name)
        for callback in self.on_signal:
            callback(signum)

    def install(self) -> "SweepStop":
        global _sweep
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        _sweep = self
        return self

    def uninstall(self) -> None:
        global _sweep
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if _sweep is self:
            _sweep = None


_sweep: Optional[SweepStop] = None  # the sweep running in this process, if any
NOT_STARTED = "not started: the sweep was stopped by "  # summary.json's error of a job it skipped, + the signal


def sweep() -> Optional[SweepStop]:
    """The ``SweepStop`` of the sweep this process launches, or None (a single run, or a job process)."""
    return _sweep


def sweep_stopped() -> Optional[str]:
    """The signal that stopped this process's sweep (``SIGTERM``/``SIGINT``), or None."""
    return None if _sweep is None else _sweep.signal_name


# ---- the garbage collector during start-up -------------------------------------------------------------------
_gc_paused = False


def pause_gc() -> None:
    """Turns the cyclic collector off until ``resume_gc`` (reference counting still frees everything not in a cycle)."""
    global _gc_paused
    gc.disable()
    _gc_paused = True


def resume_gc() -> None:
    """After ``pause_gc`` (else nothing): every object alive now frozen (``gc.freeze``), the collector back on."""
    global _gc_paused
    if _gc_paused:
        _gc_paused = False
        gc.freeze()
        gc.enable()


def release_gc() -> None:
    """After ``pause_gc`` (else nothing): the collector back on, nothing frozen; when ``train.py`` ends, and when a
    sweep starts (``sweeps.callback``: its process lives as long as its jobs, or runs them all itself)."""
    global _gc_paused
    if _gc_paused:
        _gc_paused = False
        gc.enable()


# ---- the coordinator's port ----------------------------------------------------------------------------------
def port_in_use(port: int) -> bool:
    """Whether binding TCP ``port`` (1 .. 65535) on all addresses fails with ``EADDRINUSE``: binds (never listens)
    with ``SO_REUSEADDR`` as gRPC does, on ``::`` then ``0.0.0.0``, so a port only in TIME_WAIT counts as free."""
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this machine
            continue
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((address, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return True
                continue  # e.g. EADDRNOTAVAIL for :: without IPv6: try the next family
    return False


def port_taken_line(port: int, how_to_choose: str) -> str:
    """The one line printed when the coordinator port is taken; ``how_to_choose`` says how to pick another."""
    return (
        f"coordinator port {port} is already in use on this machine (another program or an earlier run "
        f"listens there); {how_to_choose}"
    )
