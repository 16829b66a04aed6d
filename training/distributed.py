"""Many processes (one per host, or per GPU) on JAX's own distributed runtime (``jax.distributed``).

``initialize(cfg.distributed)`` is called by ``training.runtime.setup_runtime`` before anything touches the
devices. It decides whether this process is part of a multi-process job:

* ``distributed.enabled=false``: never (a single process, even inside a SLURM allocation);
* ``distributed.enabled=true``: always; missing values come from the cluster environment JAX detects;
* ``distributed.enabled=null`` (default): yes when any of ``distributed.coordinator``/``num_processes``/
  ``process_id`` is set, or when JAX's own cluster detection (SLURM, Open MPI, Cloud TPU, Kubernetes; the
  same detection ``jax.distributed.initialize()`` does without arguments) finds an environment with more
  than one process.

It then prints ONE line to stderr on process 0 (``distributed: coordinator=HOST:PORT process_id=I
num_processes=N timeout_s=T (source)``; process i > 0 logs it in its own file) and calls
``jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=timeout_s)``; CPU
collectives across processes use gloo. When a peer never arrives, JAX's runtime aborts the process (SIGABRT, exit
code 134) about ``timeout_s`` seconds later: it never hangs. Once the job runs, a process that dies stops the others
at once with one line (``training.peers``).
A second call in the same process (Hydra's basic launcher runs a sweep's jobs in one process) is a no-op.

Process 0 first checks that the coordinator's port is free on its machine (``training.process``): a taken port
is one line naming it, not a crash of JAX's runtime after the timeout.

Bad settings (a malformed coordinator, a process id out of range, nothing to detect, a taken port) are not raised here:
``initialize`` returns a ``Startup`` whose ``error`` ``training.run`` raises, so it is reported like every
other bad input (``error: ...`` on stderr, ``summary.json`` with ``status: failed``, exit 1).

After initialisation, processes other than 0 log only to their own file ``<job>_process<i>.log`` (Hydra's
``train.log`` becomes ``train_process1.log``) with every line prefixed ``[process i]``; their console shows none
of the product's lines (one voice per job), and gloo's connection lines are left out of every process's output
(``training.native_output``). Process 0 keeps the console, ``train.log``, W&B,
``metrics.jsonl`` and ``summary.json`` (``training.report.Reporter(enabled=...)``).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

from conf.schema import DistributedConfig
from core import compat
from core.errors import ConfigError
from training.native_output import filter_native_output
from training.process import port_in_use, port_taken_line, set_rank

log = logging.getLogger(__name__)


class DistributedError(ConfigError):
    """The multi-process set-up is wrong (settings, peers, device counts); the message is one line."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """Resolved arguments of ``jax.distributed.initialize``.

    ``source``: where the values came from (``config``, or the cluster JAX detected, e.g. ``SlurmCluster``).
    ``local_device_ids``: the devices this process may use (SLURM/Open MPI on GPU: one per process), or None.
    """

    coordinator: str
    num_processes: int
    process_id: int
    timeout_s: int
    source: str
    local_device_ids: Optional[tuple[int, ...]] = None

    def line(self) -> str:
        """The one line printed before initialising."""
        return (
            f"distributed: coordinator={self.coordinator} process_id={self.process_id} "
            f"num_processes={self.num_processes} timeout_s={self.timeout_s} ({self.source})"
        )


@dataclasses.dataclass(frozen=True)
class Startup:
    """What ``initialize`` found: the settings it joined with (None: a single process) and the one-line error
    of a bad setting (None when all was well), which ``training.run`` raises as a ``DistributedError``."""

    settings: Optional[Settings] = None
    error: Optional[str] = None

    def raise_error(self) -> None:
        """Raises ``DistributedError(error)``; nothing when all was well."""
        if self.error is not None:
            raise DistributedError(self.error)


_settings: Optional[Settings] = None  # what this process initialised with (None: single process)


# ---- deciding and resolving -------------------------------------------------------------------------
def detect_cluster():
    """The cluster environment ``jax.distributed.initialize()`` would use here (a ``ClusterEnv`` subclass), or None.

    Uses JAX's own detectors (``jax._src.clusters``: SLURM, Open MPI, Cloud TPU, GKE, Kubernetes), skipping
    the opt-in ones (mpi4py), in JAX's order.
    """
    clusters = compat.clusters()
    if clusters is None:  # private module moved: no auto-detection (explicit settings still work)
        return None
    for env in clusters.ClusterEnv._cluster_types:
        if env.opt_in_only_method:
            continue
        try:
            if env.is_env_present():
                return env
        except Exception:  # a detector that cannot run here (e.g. no metadata server) means "not present"
            continue
    return None


def wanted(cfg: DistributedConfig, cluster=None) -> bool:
    """Whether this process should join a multi-process job (see the module docstring for the rules)."""
    if cfg.enabled is not None:
        return bool(cfg.enabled)
    if cfg.coordinator is not None or cfg.num_processes is not None or cfg.process_id is not None:
        return True
    if cluster is None:
        return False
    try:
        return int(cluster.get_process_count()) > 1
    except Exception:
        return False


def resolve(cfg: DistributedConfig, cluster=None) -> Settings:
    """The settings for ``jax.distributed.initialize``: config values first, the detected cluster for the rest.

    Raises:
      DistributedError: a value is missing and no cluster provides it, the coordinator is not HOST:PORT, the
        process id is outside [0, num_processes), or the timeout is not positive.
    """
    if cfg.timeout_s <= 0:
        raise DistributedError(f"distributed.timeout_s={cfg.timeout_s} must be a positive number of seconds")
    coordinator, num, pid, device_ids = cfg.coordinator, cfg.num_processes, cfg.process_id, None
    source = "config"
    if cluster is not None and None in (coordinator, num, pid):
        cloud_tpu_init = compat.cloud_tpu_init()
        port = os.environ.get("JAX_COORDINATOR_PORT")
        coordinator = coordinator or cluster.get_coordinator_address(
            timeout_secs=cfg.timeout_s, override_coordinator_port=port
        )
        num = cluster.get_process_count() if num is None else num
        pid = cluster.get_process_id() if pid is None else pid
        # as JAX does: one device per process, except on TPU VMs
        if cloud_tpu_init is None or not cloud_tpu_init.running_in_cloud_tpu_vm:
            local = cluster.get_local_process_id()
            device_ids = None if local is None else (int(local),)
        source = cluster.__name__
    if coordinator is not None:
        host, _, port_text = str(coordinator).rpartition(":")
        if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise DistributedError(
                f"distributed.coordinator={coordinator!r} must be HOST:PORT (e.g. "
                f"10.0.0.1:12345) reachable from every process"
            )
    missing = [k for k, v in (("coordinator", coordinator), ("num_processes", num), ("process_id", pid)) if v is None]
    if missing:
        given = " ".join(
            f"distributed.{k}={v}"
            for k, v in (
                ("coordinator", cfg.coordinator),
                ("num_processes", cfg.num_processes),
                ("process_id", cfg.process_id),
            )
        )
        raise DistributedError(
            f"multi-process run requested ({given}, distributed.enabled={cfg.enabled}) but no SLURM/MPI/TPU "
            f"environment was detected to fill in {', '.join('distributed.' + k for k in missing)}; set them "
            f"(see scripts/launch_local.py) or use distributed.enabled=false"
        )
    num, pid = int(num), int(pid)
    if num < 1 or not 0 <= pid < num:
        raise DistributedError(
            f"distributed.process_id={pid} with distributed.num_processes={num}: the ids must "
            f"be 0 .. {num - 1}, one per process"
        )
    return Settings(
        coordinator=str(coordinator),
        num_processes=num,
        process_id=pid,
        timeout_s=int(cfg.timeout_s),
        source=source,
        local_device_ids=device_ids,
    )


# ---- initialising -----------------------------------------------------------------------------------
def initialize(cfg: DistributedConfig) -> Startup:
    """Joins the multi-process job when ``cfg`` (or the environment) asks for one; returns a ``Startup``.

    Must run before the JAX backend starts (before ``jax.devices()``). No-op when already initialised (returns
    the first call's settings). A bad setting is returned as ``Startup(error=...)``, not raised.
    """
    global _settings
    import jax

    if jax.distributed.is_initialized():
        if _settings is not None and _settings.process_id > 0:
            route_logging(_settings.process_id)  # Hydra's basic launcher set up fresh handlers for this job
        return Startup(_settings)

    cluster = detect_cluster() if cfg.enabled is not False else None
    if not wanted(cfg, cluster):
        return Startup()
    try:
        s = resolve(cfg, cluster)
        if compat.backend_started():
            raise DistributedError(
                "the JAX backend started before jax.distributed.initialize (something queried "
                "the devices first); run train.py in a fresh process per job (a sweep needs "
                "hydra/launcher=submitit_local or submitit_slurm)"
            )
        port = int(s.coordinator.rpartition(":")[2])
        if s.process_id == 0 and port_in_use(port):  # process 0 serves the coordinator on every address
            raise DistributedError(
                port_taken_line(
                    port,
                    f"choose another with distributed.coordinator={s.coordinator.rpartition(':')[0]}:<free port> "
                    f"on every process (scripts/launch_local.py picks a free one when --port is left out)",
                )
            )
    except DistributedError as e:
        return Startup(error=str(e))
    set_rank(s.process_id)
    if s.process_id > 0:
        route_logging(s.process_id)  # before JAX logs anything of this process into the shared train.log
        log.info("%s", s.line())  # one voice per job: the line of process i > 0 is in its own log
    else:
        print(s.line(), file=sys.stderr, flush=True)
    filter_native_output()  # gloo's connection lines, once per rank and communicator, say nothing to a user
    # Cross-process collectives on the CPU backend (JAX 0.10.2's default, set explicitly so an environment
    # variable cannot silently turn them off). Ignored by GPU/TPU backends.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            s.coordinator,
            s.num_processes,
            s.process_id,
            local_device_ids=list(s.local_device_ids) if s.local_device_ids else None,
            initialization_timeout=s.timeout_s,
        )
    except Exception as e:  # most failures abort inside JAX's runtime; the rest become one line here
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        return Startup(
            error=f"jax.distributed.initialize failed for process {s.process_id} of "
            f"{s.num_processes} (coordinator {s.coordinator}): {first_line}"
        )
    _settings = s
    return Startup(s)


def settings() -> Optional[Settings]:
    """The settings this process initialised with, or None (a single process)."""
    return _settings


# ---- checks after the backend is up ---------------------------------------------------------------------
def devices_per_process() -> dict[int, int]:
    """{process index: number of its devices}, from the global device list every process sees."""
    import jax

    counts = collections.Counter(d.process_index for d in jax.devices())
    return dict(sorted(counts.items()))


def check_device_counts() -> None:
    """Stops a multi-process job whose processes see different numbers of devices.

    Every process sees the same global device list, so all of them raise the same one line.

    Raises:
      DistributedError: e.g. ``processes see different local device counts: process 0: 4, process 1: 2; ...``.
    """
    counts = devices_per_process()
    if len(set(counts.values())) > 1:
        listing = ", ".join(f"process {p}: {n}" for p, n in counts.items())
        raise DistributedError(
            f"processes see different local device counts: {listing}; give every process the same number of "
            f"devices (GPU: the same GPUs per task, e.g. SLURM --gpus-per-task; CPU: the same runtime.cpu_devices)"
        )


def process_layout() -> dict[str, Any]:
    """The process layout recorded in the W&B config: who reports and how the devices are spread.

    ``process_index`` (the reporting process, 0), ``process_count``, ``devices_per_process`` (list indexed by
    process), ``local_devices`` (this process's count), ``coordinator`` (or None for one process).
    """
    import jax

    counts = devices_per_process()
    return {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "devices_per_process": [counts[p] for p in sorted(counts)],
        "local_devices": jax.local_device_count(),
        "coordinator": _settings.coordinator if _settings else None,
    }


# ---- logging of processes > 0 --------------------------------------------------------------------------
def route_logging(process_id: int) -> None:
    """Sends process ``process_id``'s log to its own file, prefixed, and nothing to its console.

    Every ``logging.FileHandler`` of the root logger (Hydra's ``<run dir>/train.log``) is replaced by one
    writing ``<stem>_process<i><suffix>`` next to it; stream handlers print nothing (one voice per job: process 0
    says every line once, ``training.process.speaks``). Records get the prefix ``[process i] ``. Nothing is written
    to the shared file by this process.
    """
    root = logging.getLogger()
    prefix = f"[process {process_id}] "
    for handler in list(root.handlers):
        if getattr(handler, "_process_routed", False):  # already this process's (a second call changes nothing)
            continue
        fmt = handler.formatter._fmt if handler.formatter is not None else "%(message)s"
        formatter = logging.Formatter(prefix + fmt, getattr(handler.formatter, "datefmt", None))
        if isinstance(handler, logging.FileHandler):
            path = Path(handler.baseFilename)
            root.removeHandler(handler)
            handler.close()
            mine = logging.FileHandler(path.with_name(f"{path.stem}_process{process_id}{path.suffix}"))
            mine.setLevel(handler.level)
            mine.setFormatter(formatter)
            mine._process_routed = True
            root.addHandler(mine)
        elif isinstance(handler, logging.StreamHandler):  # one voice per job: process 0 says it
            handler.setLevel(logging.CRITICAL + 1)
            handler.setFormatter(formatter)
            handler._process_routed = True


# ---- debug aid --------------------------------------------------------------------------------------------
def local_rows(array) -> "Any":
    """This process's part of a global batch array, in global row order: numpy ``[rows, ...]``.

    Built from the addressable shards (what was really placed on this process's devices); shards holding
    the same rows (replication) are taken once. A pmap layout ``[devices, per_device]`` is flattened.
    """
    import jax
    import numpy as np

    shards = {}
    for shard in array.addressable_shards:
        key = tuple((s.start or 0, s.stop) for s in shard.index)
        shards.setdefault(key, shard)
    rows = [np.asarray(jax.device_get(shards[k].data)) for k in sorted(shards)]  # explicit copies
    return np.concatenate([r.reshape(-1) for r in rows])


def dump_batch_indices(batches: Iterator[dict], path: Path, start_step: int) -> Iterator[dict]:
    """DEBUG AID (``train.debug_dump_indices=true``): passes ``batches`` through and records their indices.

    Writes one JSON line per step to ``path`` (``debug_indices_process<i>.jsonl`` in the run folder):
    ``{"step": s, "process_index": i, "indices": [...]}``, the global example indices (int) this process
    placed on its devices for the global batch of step ``s``, in global row order. Costs one device->host
    copy of the int32 index array per step.
    """
    import jax

    with open(path, "w") as f:
        for step, batch in enumerate(batches, start_step):
            rec = {
                "step": step,
                "process_index": jax.process_index(),
                "indices": [int(i) for i in local_rows(batch["index"])],
            }
            f.write(json.dumps(rec) + "\n")
            f.flush()
            yield batch
