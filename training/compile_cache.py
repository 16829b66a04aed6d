"""JAX's persistent compilation cache: compiled programs kept on disk, so a repeated run or a sweep's next job
loads them instead of compiling again.

Keys (``runtime.*``, ``conf/schema.py``):

- ``compilation_cache_dir``: the folder; default ``$JAX_COMPILATION_CACHE_DIR``, else
  ``<XDG cache or ~/.cache>/dp_scaling/jax_compilation_cache``. ``null`` (or an empty string) turns the cache
  off for the process, whatever the environment says.
- ``compilation_cache_min_compile_time_s``: programs that compiled faster than this are not written
  (``jax_persistent_cache_min_compile_time_secs``; JAX's own default, 1 s, would skip every program of the
  MNIST models on XLA:CPU, whose steps compile in under a second).
- ``compilation_cache_min_entry_bytes``: entries smaller than this are not written
  (``jax_persistent_cache_min_entry_size_bytes``; 0: no limit).

Works on CPU as well as GPU/TPU (JAX >= 0.4.36 caches CPU executables). With several processes
(``jax.distributed``) every process reads the cache but only process 0 writes it (JAX's rule), so the folder
should be one that all processes see (a shared file system), or each node compiles for itself.

The cache is trusted code: a folder that others can write lets them run code in your process (JAX's
warning); keep it private.

A damaged entry (a truncated file after a full disk or a killed write) is not an error for JAX: it compiles
the program again and warns, one multi-line ``UserWarning`` per program, every run (the entry is not
rewritten). Such warnings become ONE log line per run naming the folder and how to rebuild it
(``CacheWarnings``); the run itself is unaffected.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from typing import Optional

log = logging.getLogger(__name__)

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
