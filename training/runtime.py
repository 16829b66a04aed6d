"""Process set-up that must happen before the JAX backend starts (simulated CPU devices, XLA flags, the persistent
compilation cache, a multi-process join), and the backend's start itself, on a thread beside the imports that
follow (``start_backend``).

JAX's persistent compilation cache (``runtime.compilation_cache_*``) keeps compiled programs on disk, so a
repeated run or a sweep's next job loads them instead of compiling again; ``null`` for the folder turns it off.
With several processes every process reads it but only process 0 writes it (JAX's rule), so it should be on a
file system all processes see. The cache is trusted code: keep the folder private. A damaged entry is compiled
again, and JAX's per-entry warnings become ONE log line per run (``CacheWarnings``)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import warnings
from typing import Iterator, Optional

from conf.schema import Config
from core.compat import backend_started
from training.distributed import Startup, initialize

log = logging.getLogger(__name__)


def setup_runtime(cfg: Config) -> Startup:
    """Applies ``xla.flags``, ``runtime.cpu_devices`` and ``distributed`` once per process, before the backend starts,
    and the persistent compilation cache settings (``runtime.compilation_cache_*``) for every job.

    Returns what joining a multi-process job found (``Startup.error``: a bad setting, raised by ``training.run``).

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
        jax.config.update("jax_num_cpu_devices", cfg.runtime.cpu_devices)  # >= 1: the schema checked it
    r = cfg.runtime
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
    CPU backend opens at once. The main thread's own first ``jax.devices()`` (``training.run.run_and_report``)
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


# ---- the persistent compilation cache -------------------------------------------------------------------------
# jax/_src/compiler.py: warnings.warn(f"Error reading persistent compilation cache entry for '{name}': {error}")
CACHE_ENTRY_WARNING = re.compile(r"Error (reading|writing) persistent compilation cache entry for '([^']*)': (.*)")


class CacheWarnings:
    """Turns JAX's per-entry cache warnings into one log line per run (``install`` wraps ``warnings.showwarning``,
    once per process; other warnings pass to the previous hook unchanged).

    ``count``: cache warnings since the last ``reset`` (the first one is logged, the rest only counted).
    """

    folder: Optional[str] = None
    count = 0

    @classmethod
    def reset(cls, folder: Optional[str]) -> None:
        """A new run with cache ``folder``: its first damaged entry is reported again."""
        cls.folder, cls.count = folder, 0

    @classmethod
    def line(cls, message: str) -> Optional[str]:
        """The one line for a JAX cache warning ``message`` (None: not a cache warning)."""
        m = CACHE_ENTRY_WARNING.match(message)
        if m is None:
            return None
        verb, program, error = m.groups()
        first_error = error.splitlines()[0] if error else "unknown error"
        return (
            f"persistent compilation cache {cls.folder or ''}: error {verb} an entry ({program}: {first_error}); "
            f"such programs are compiled again (results unaffected); delete the folder to rebuild it, or set "
            f"runtime.compilation_cache_dir=null (said once per run)"
        )

    @classmethod
    def install(cls) -> None:
        """Wraps ``warnings.showwarning`` (no-op when already wrapped)."""
        previous = warnings.showwarning
        if getattr(previous, "_compile_cache_hook", False):
            return

        def showwarning(message, category, filename, lineno, file=None, line=None):
            text = cls.line(str(message))
            if text is None:
                return previous(message, category, filename, lineno, file, line)
            cls.count += 1
            if cls.count == 1:
                log.warning("%s", text)

        showwarning._compile_cache_hook = True  # type: ignore[attr-defined]
        warnings.showwarning = showwarning


def cache_settings(cache_dir: Optional[str], min_compile_time_s: float, min_entry_bytes: int) -> dict:
    """The ``jax.config`` values for these keys: ``{option name: value}``.

    ``cache_dir`` None or empty: ``jax_enable_compilation_cache`` false (off, also when the
    ``JAX_COMPILATION_CACHE_DIR`` environment variable set a folder).

    Raises:
      ValueError: a negative threshold (the message names the key).
    """
    if min_compile_time_s < 0:
        raise ValueError(f"runtime.compilation_cache_min_compile_time_s={min_compile_time_s} must be >= 0")
    if min_entry_bytes < 0:
        raise ValueError(f"runtime.compilation_cache_min_entry_bytes={min_entry_bytes} must be >= 0")
    if not cache_dir:
        return {"jax_enable_compilation_cache": False}
    return {
        "jax_enable_compilation_cache": True,
        "jax_compilation_cache_dir": os.path.abspath(os.path.expanduser(str(cache_dir))),
        "jax_persistent_cache_min_compile_time_secs": float(min_compile_time_s),
        "jax_persistent_cache_min_entry_size_bytes": int(min_entry_bytes),
    }


def configure_compilation_cache(
    cache_dir: Optional[str], min_compile_time_s: float = 0.0, min_entry_bytes: int = 0
) -> Optional[str]:
    """Applies the cache settings to ``jax.config``; returns the cache folder in use (None: off).

    Settings that differ from the process's current ones reset JAX's cache object first (public
    ``jax.experimental.compilation_cache.reset_cache``), so the jobs of a sweep that share one process
    each get their own settings; unchanged settings leave it as it is. The folder is created on the first
    write, by JAX. A folder that cannot be written (a file, /proc, a read-only mount) turns the cache off with
    one warning line naming the key (a cache is an optimisation: the run goes on, as it would without one).

    Raises:
      ValueError: a negative threshold.
    """
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if cache_dir:
        cache_dir = _writable_or_none(cache_dir)
    wanted = cache_settings(cache_dir, min_compile_time_s, min_entry_bytes)
    current = {name: getattr(jax.config, name) for name in wanted}
    if current != wanted:
        logging.getLogger("jax._src.compilation_cache").setLevel(logging.WARNING)  # "Resetting cache at ..."
        compilation_cache.reset_cache()
        for name, value in wanted.items():
            jax.config.update(name, value)
    folder = wanted.get("jax_compilation_cache_dir")
    CacheWarnings.reset(folder)
    CacheWarnings.install()
    log.debug("JAX persistent compilation cache: %s", folder or "off")
    return folder


def _writable_or_none(cache_dir: str) -> Optional[str]:
    """``cache_dir`` if it is (or can be created as) a writable folder, else None after one warning line."""
    from core.errors import ConfigError
    from training.validate import check_writable_folder

    try:
        check_writable_folder("runtime.compilation_cache_dir", os.path.expanduser(str(cache_dir)))
    except ConfigError as e:
        log.warning("%s: the compilation cache is off for this run (or set runtime.compilation_cache_dir=null)", e)
        return None
    return cache_dir
