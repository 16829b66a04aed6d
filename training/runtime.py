"""Process set-up before the JAX backend starts (simulated CPU devices, XLA flags, the persistent compilation
cache, a multi-process join), and the backend's start on a thread beside the imports that follow.

The persistent compilation cache (``runtime.compilation_cache_*``) keeps compiled programs on disk for a rerun
or a sweep's next job; ``null`` turns it off. Only process 0 writes it (JAX's rule). It is trusted code: keep
the folder private. JAX's per-entry warnings about a damaged entry become ONE log line (``CacheWarnings``)."""

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
    and the compilation cache settings for every job; returns what joining a multi-process job found. Later calls
    in one process (a sweep under Hydra's default launcher) leave the device count and flags as they are."""
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
    """Starts JAX's backend (``jax.devices()``) on a thread, after ``setup_runtime``, so that opening the accelerator
    (seconds on a TPU) overlaps the imports that follow; returns it (None: a backend is up). The main thread's
    ``jax.devices()`` waits for it and raises a failed start's error; not a daemon: no exit mid-start in C++."""
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
    """Imports inside run as if IPython were not installed, unless this is an IPython session: ``flax.nnx`` and
    ``treescope`` would import IPython, jedi and prompt_toolkit only to learn that a script is not a notebook."""
    hide = "IPython" not in sys.modules
    if hide:
        sys.modules["IPython"] = None  # type: ignore[assignment]
    try:
        yield
    finally:  # a later ``import IPython`` loads the real package
        if hide and "IPython" in sys.modules and sys.modules["IPython"] is None:
            del sys.modules["IPython"]


# ---- the persistent compilation cache -------------------------------------------------------------------------
# jax/_src/compiler.py: warnings.warn(f"Error reading persistent compilation cache entry for '{name}': {error}")
CACHE_ENTRY_WARNING = re.compile(r"Error (reading|writing) persistent compilation cache entry for '([^']*)': (.*)")


class CacheWarnings:
    """Turns JAX's per-entry cache warnings into one log line per run (``install`` wraps ``warnings.showwarning``
    once per process; other warnings pass unchanged). ``count``: cache warnings since the last ``reset``."""

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
    """The ``jax.config`` values of these keys, ``{option: value}``; ``cache_dir`` None or empty turns the cache off
    (also against ``JAX_COMPILATION_CACHE_DIR``). Raises ValueError for a negative threshold."""
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
    """Applies the cache settings to ``jax.config`` (resetting JAX's cache object when they change, so each job of a
    sweep in one process gets its own); returns the folder in use (None: off). A folder that cannot be written
    turns the cache off with one warning line: the run goes on as without one."""
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
        log.warning(f"{e}: the compilation cache is off for this run (or set runtime.compilation_cache_dir=null)")
        return None
    return cache_dir
