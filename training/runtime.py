"""Process set-up that must happen before the JAX backend starts (simulated CPU devices, XLA flags, a multi-process
join), and the backend's start itself, on a thread beside the imports that follow (``start_backend``)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from typing import Iterator, Optional

from conf.schema import Config
from core.compat import backend_started
from training.distributed import Startup, initialize

log = logging.getLogger(__name__)


def setup_runtime(cfg: Config) -> Startup:
    """Applies ``xla.flags``, ``runtime.cpu_devices`` and ``distributed`` once per process, before the backend starts,
    and the persistent compilation cache settings (``runtime.compilation_cache_*``) for every job.

    Returns what joining a multi-process job found (``Startup.error``: a bad setting, raised by ``training.app``).

    Later calls in the same process (Hydra's default launcher runs every sweep job in one process) leave the
    settings as they are: the device count of a process is fixed once its backend is up.
    """
    import jax

    if backend_started():
        if cfg.xla.flags:
            log.warning(
                "xla=%s flags not applied: the JAX backend of this process is already running "
                "(use hydra/launcher=submitit_local for a fresh process per job)",
                cfg.xla.name,
            )
    else:
        from training.validate import xla_flags_error

        if cfg.xla.flags and xla_flags_error(cfg.xla.flags) is None:  # bad flags: plan() reports them (one line)
            os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS", "")] + list(cfg.xla.flags)))
            log.info("XLA flags (xla=%s): %s", cfg.xla.name, " ".join(cfg.xla.flags))
        if cfg.runtime.cpu_devices >= 1:  # a bad value is reported by training.build.plan (one line)
            jax.config.update("jax_num_cpu_devices", cfg.runtime.cpu_devices)
    r = cfg.runtime
    if r.compilation_cache_min_compile_time_s >= 0 and r.compilation_cache_min_entry_bytes >= 0:  # else: plan()
        from training.compile_cache import configure_compilation_cache

        configure_compilation_cache(
            r.compilation_cache_dir, r.compilation_cache_min_compile_time_s, r.compilation_cache_min_entry_bytes
        )
    # join a multi-process job before anything queries the devices; a no-op when already done
    return initialize(cfg.distributed)


def start_backend() -> Optional[threading.Thread]:
    """Starts JAX's backend (``jax.devices()``) on a thread of its own, so that opening the accelerator overlaps
    the imports that follow it; returns the thread, or None when a backend is already up.

    Call it after ``setup_runtime`` (the device count, XLA flags and a multi-process job's join must come first).
    Opening a TPU chip takes seconds, part of it holding the interpreter lock, so the imports overlap the rest; a
    CPU backend opens at once. The main thread's own first ``jax.devices()`` (``training.app.run_and_report``)
    waits for it under JAX's backend lock and raises what a failed start raises (the thread swallows it, so a
    failure is reported once, by the main thread). The thread is not a daemon: a process that ends during the
    imports (a Ctrl-C) waits for the backend's start to finish, so it never exits while the start still runs in
    C++ beside its teardown.
    """
    if backend_started():
        return None
    import jax

    def start() -> None:
        try:
            jax.devices()
        except BaseException:  # noqa: BLE001 - reported by the main thread's own jax.devices()
            pass

    thread = threading.Thread(target=start, name="jax-backend-start")
    thread.start()
    return thread


@contextlib.contextmanager
def without_ipython_probe() -> Iterator[None]:
    """Imports inside run as if IPython were not installed, when this process is not an IPython session.

    ``flax.nnx`` (its reprs: ``IPython.get_ipython()``, to choose colours) and ``treescope`` (its notebook
    display hooks) import IPython when it is installed, which loads IPython, jedi and prompt_toolkit, to learn
    what a script already knows (no IPython session). Both
    handle a missing IPython (``ImportError``), so inside this block ``import IPython`` raises ImportError
    (``sys.modules["IPython"] = None``, Python's documented way); afterwards the entry is removed and a later
    ``import IPython`` loads the real package. Inside an IPython session (IPython already imported) nothing
    changes.
    """
    if "IPython" in sys.modules:
        yield
        return
    sys.modules["IPython"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if "IPython" in sys.modules and sys.modules["IPython"] is None:
            del sys.modules["IPython"]
