"""The address space JAX's CPU runtime needs under ``RLIMIT_AS`` (``ulimit -v``), checked before JAX is imported:
below it the runtime aborts in C++ (a thread it cannot start: ``Check failed ... pthread_create() failed``, exit
134) or its import cannot map its libraries. Standard library only: it runs before JAX is imported.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
from pathlib import Path
from typing import Optional

from core.errors import TrainingError

# Address space JAX's CPU runtime takes beyond what the process held before importing jax, for the smallest run
# (the MNIST MLP; docs/troubleshooting.md): its libraries (0.29 GB), compiler and buffers, plus a stack for each of
# its threads (THREADS_PER_DEVICE per simulated device, one per core). Measured from 0.17 GB before the import:
# 8 simulated devices on 2 cores trained at 1.02 GB and aborted at 0.97 GB; 1 device trained at 0.92, aborted at 0.82.
RUNTIME_BASE_BYTES = 660_000_000
THREADS_PER_DEVICE = 2
DEFAULT_STACK_BYTES = 8 << 20  # glibc's thread stack when RLIMIT_STACK is unlimited
LIMIT_MARGIN_BYTES = 16 << 20  # the limit a line offers: the process's size varies by some kB from run to run


def gb(n_bytes: float) -> str:
    """``n_bytes`` in decimal units, e.g. ``15.79 GB``, ``2.44 MB``, ``512 bytes``."""
    unit, scale = next(((u, s) for u, s in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)) if abs(n_bytes) >= s), ("", 1))
    return f"{n_bytes / scale:.2f} {unit}" if unit else f"{n_bytes:.0f} bytes"


def meminfo(key: str, path: str) -> Optional[int]:
    """``key`` of a ``/proc`` status file (``VmSize`` of ``/proc/self/status``, ``MemAvailable`` of ``/proc/meminfo``)
    in bytes, None when absent."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def under_rlimit_as() -> bool:
    """Whether this process runs under an address-space limit (``ulimit -v``): the only one a CPU allocation fails
    under (above a cgroup's ``memory.max`` or the free memory the kernel kills the process instead)."""
    return resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY


M_ARENA_MAX, M_MMAP_THRESHOLD = -8, -3  # glibc's malloc.h
MALLOC_ARENAS_UNDER_RLIMIT_AS = 2  # MALLOC_ARENA_MAX=2: 0.85 GB of VmSize after compiling a GPT, not 1.76 GB
MMAP_THRESHOLD_BYTES = 128 << 10  # glibc's default, held fixed: freed buffers give their address space back


def limit_malloc_arenas() -> Optional[int]:
    """Under ``RLIMIT_AS`` caps glibc's malloc arenas at ``MALLOC_ARENAS_UNDER_RLIMIT_AS`` (``mallopt(M_ARENA_MAX)``,
    as ``MALLOC_ARENA_MAX`` does; call it before the runtime's threads start): each thread that allocates beside
    another may get an arena of its own, reserving 64 MiB of address space (up to 8 per core), which the limit counts
    though little of it is used; and holds the mmap threshold at ``MMAP_THRESHOLD_BYTES`` (``M_MMAP_THRESHOLD``, as
    ``MALLOC_MMAP_THRESHOLD_``): glibc raises it to each large block freed, after which XLA's buffers of that size
    come from arenas that keep their address space when freed (docs/troubleshooting.md). A ``MALLOC_ARENA_MAX`` or
    ``MALLOC_MMAP_THRESHOLD_`` of the user's is kept. Returns the arena cap set, None when none (no limit, no glibc)."""
    if not under_rlimit_as() or "MALLOC_ARENA_MAX" in os.environ:
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return None
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    return MALLOC_ARENAS_UNDER_RLIMIT_AS if mallopt(M_ARENA_MAX, MALLOC_ARENAS_UNDER_RLIMIT_AS) == 1 else None


def stack_bytes() -> int:
    """Bytes of address space a thread's stack takes: ``RLIMIT_STACK`` (``ulimit -s``), glibc's 8 MiB when unlimited."""
    stack = resource.getrlimit(resource.RLIMIT_STACK)[0]
    return DEFAULT_STACK_BYTES if stack == resource.RLIM_INFINITY else stack


def runtime_bytes(cpu_devices: int) -> int:
    """Bytes of address space JAX's CPU runtime takes with ``cpu_devices`` simulated devices (the smallest run)."""
    return RUNTIME_BASE_BYTES + stack_bytes() * (THREADS_PER_DEVICE * cpu_devices + len(os.sched_getaffinity(0)))


def ulimit_to_set(address_space_bytes: int) -> str:
    """``ulimit -v N or more``: the RLIMIT_AS (KiB, rounded up to 10,000) of a process that needs
    ``address_space_bytes`` in all, with ``LIMIT_MARGIN_BYTES`` to spare."""
    return f"ulimit -v {-(-(address_space_bytes + LIMIT_MARGIN_BYTES) // 10_240_000) * 10_000} or more"


def check_runtime_fits(cfg) -> None:
    """Under ``RLIMIT_AS``, before JAX is imported: raises TrainingError (one line: the figures, the limit to set and
    the fewer simulated devices that would fit) when the limit leaves less than ``runtime_bytes`` of the run's
    ``runtime.cpu_devices`` beside what the process holds; caps malloc's arenas (``limit_malloc_arenas``). ``cfg``:
    the run's ``conf.schema.Config``."""
    if "jaxlib" in sys.modules:  # the runtime is in already (a sweep's next job in this process)
        return
    limit_malloc_arenas()
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    held, n = meminfo("VmSize", "/proc/self/status"), cfg.runtime.cpu_devices
    if soft == resource.RLIM_INFINITY or held is None or soft - held >= runtime_bytes(n):
        return
    t = cfg.train  # fewer devices that fit and divide the global batch into microbatches (training.build.plan)
    divides = lambda m: t.per_device_batch or (t.global_batch or 256) % (m * t.accum_steps) == 0  # noqa: E731
    fewer = [m for m in range(1, n) if held + runtime_bytes(m) <= soft and divides(m)]
    ways = ulimit_to_set(held + runtime_bytes(n))
    if fewer:
        mesh = f" mesh.devices={fewer[-1]}" if (cfg.mesh.devices or 0) > fewer[-1] else ""
        ways += f", or fewer simulated devices: runtime.cpu_devices={fewer[-1]}{mesh}"
    raise TrainingError(
        f"out of memory: JAX's CPU runtime with {n} simulated device(s) needs about {gb(held + runtime_bytes(n))} of "
        f"address space (its libraries, compiler and threads), above the RLIMIT_AS (ulimit -v) of {gb(soft)}; "
        f"set {ways}"
    )


def import_failure_line(error: ImportError) -> Optional[str]:
    """The one line for a library that could not be mapped under ``RLIMIT_AS`` while importing (``failed to map
    segment``); None for another import error."""
    if "failed to map segment" not in str(error) or not under_rlimit_as():
        return None
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    return (
        f"out of memory: a library could not be mapped under the RLIMIT_AS (ulimit -v) of {gb(soft)} "
        f"({str(error).splitlines()[0][:160]}); raise the limit"
    )
