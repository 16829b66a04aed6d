"""Process set-up that must happen before the JAX backend starts: simulated CPU devices, XLA flags."""

from __future__ import annotations

import logging
import os

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
