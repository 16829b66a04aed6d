"""``hydra/launcher=submitit_local`` that runs at most ``array_parallelism`` jobs at a time (default 1).

hydra-submitit-launcher 1.2.0's local launcher (``LocalQueueConf``) has no ``array_parallelism`` key (only its
Slurm launcher has): it starts every job of a sweep at once, and on a small machine concurrent jobs distort each
other's timings. This launcher submits the sweep in chunks of ``array_parallelism`` jobs and waits for each chunk;
every job is still a fresh process (``python -m submitit.core._submit``), so JAX's device count is set per job.

SIGTERM or SIGINT to the sweep (``training.process.SweepStop``): the signal is forwarded as SIGTERM to the
running job processes (a job in its training loop saves a checkpoint and stops; submitit's own handler ignores
SIGTERM in a job that is still starting, which then runs to its end) and no further chunk is submitted (those
jobs are counted as never started in the sweep's end report).

Configured by ``conf/hydra/launcher/submitit_local.yaml``. The other keys are those of ``LocalQueueConf``
(``timeout_min``, ``cpus_per_task``, ``tasks_per_node``, ``submitit_folder`` ...). Hydra only instantiates
launcher classes from the ``hydra_plugins`` namespace, hence this package at the repository root.

Schema: Hydra (1.1-1.3) validates a YAML file against a ConfigStore entry of the same name ("automatic schema
matching", deprecated, with a warning): ``hydra/launcher/submitit_local`` is hydra-submitit-launcher's
``LocalQueueConf``, which rejects ``array_parallelism``. So ``RegisterSerialLocalSchema`` drops that entry and
registers ``SerialLocalQueueConf`` as ``hydra/launcher/submitit_local_schema``, which the YAML names in its
defaults list (Hydra's recommended form). It runs in ``manipulate_search_path``, which Hydra calls after its
plugin scan (the scan re-executes every plugin module, so a registration at import time would be undone by the
submitit plugin's own) and before it composes the config; the ConfigStore then travels to the job processes
with Hydra's singleton state.
"""

import logging
import os
import signal
from pathlib import Path
from typing import Any, List, Sequence

from dataclasses import dataclass

from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn
from hydra.plugins.search_path_plugin import SearchPathPlugin
from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]


class SerialLocalLauncher(LocalLauncher):
    """Local submitit launcher with at most ``array_parallelism`` jobs running at once.

    Args:
      array_parallelism: jobs run concurrently (>= 1).
      **params: ``LocalQueueConf`` keys, passed on to submitit's local executor.
    Raises:
      ValueError: ``array_parallelism`` < 1.
    """

    def __init__(self, array_parallelism: int = 1, **params: Any) -> None:
        if int(array_parallelism) < 1:
            raise ValueError(f"hydra.launcher.array_parallelism={array_parallelism} must be >= 1")
        super().__init__(**params)
        self.array_parallelism = int(array_parallelism)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        # The job processes unpickle this launcher and the task: make the repository importable from any cwd.
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if str(REPO) not in paths:
            os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *paths])
        from training.process import sweep  # the repository is importable from here on

        k = self.array_parallelism
        results: List[JobReturn] = []
        stop = sweep()
        if stop is not None:
            stop.on_signal.append(lambda signum: forward_to_jobs(signal.SIGTERM))
        for start in range(0, len(job_overrides), k):
            if stop is not None and stop.signal_name is not None:
                stop.not_submitted += len(job_overrides) - start
                log.warning("submitit_local: %d job(s) not started (%s)", len(job_overrides) - start, stop.signal_name)
                break
            chunk = list(job_overrides[start : start + k])
            if len(job_overrides) > k:
                first, last = initial_job_idx + start, initial_job_idx + start + len(chunk) - 1
                which = f"job #{first}" if first == last else f"jobs #{first}-#{last}"
                log.info("submitit_local: %s of %d (array_parallelism=%d)", which, len(job_overrides), k)
            results.extend(super().launch(chunk, initial_job_idx + start))
        return results


def descendants(pid: int) -> List[int]:
    """Process ids of ``pid``'s children, their children and so on, from ``/proc`` (Linux; elsewhere [])."""
    found: List[int] = []
    todo = [pid]
    while todo:
        for children in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            try:
                kids = [int(p) for p in children.read_text().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def job_processes() -> List[int]:
    """Process ids of this process's descendants that run a submitit job (``python -m submitit.core._submit``,
    started by submitit's ``submitit.local._local`` controller)."""
    pids = descendants(os.getpid())
    jobs = []
    for pid in pids:
        try:
            if b"submitit.core._submit" in Path(f"/proc/{pid}/cmdline").read_bytes():
                jobs.append(pid)
        except OSError:  # it ended meanwhile
            continue
    return jobs


def forward_to_jobs(sig: int) -> None:
    """Sends ``sig`` to every running submitit job process started by this process."""
    for pid in job_processes():
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@dataclass
class SerialLocalQueueConf(LocalQueueConf):
    """``LocalQueueConf`` + ``array_parallelism`` (jobs at once), targeting ``SerialLocalLauncher``."""

    _target_: str = "hydra_plugins.dp_scaling_launchers.serial_local.SerialLocalLauncher"
    array_parallelism: int = 1


SCHEMA_NAME = "submitit_local_schema"
SLURM_SCHEMA_NAME = "submitit_slurm_schema"


class RegisterSerialLocalSchema(SearchPathPlugin):
    """Registers ``SerialLocalQueueConf`` as ``hydra/launcher/submitit_local_schema`` and ``SlurmClusterQueueConf``
    (``slurm.py``) as ``hydra/launcher/submitit_slurm_schema``, and removes the submitit plugin's same-named
    ``submitit_local`` and ``submitit_slurm`` schemas, which would shadow-validate our YAML files."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from hydra_plugins.dp_scaling_launchers.slurm import SlurmClusterQueueConf

        store = ConfigStore.instance()
        launchers = store.repo.get("hydra", {}).get("launcher", {})
        for name in ("submitit_local.yaml", "submitit_slurm.yaml"):
            launchers.pop(name, None)  # no public removal API
        store.store(group="hydra/launcher", name=SCHEMA_NAME, node=SerialLocalQueueConf, provider="dp_scaling")
        store.store(group="hydra/launcher", name=SLURM_SCHEMA_NAME, node=SlurmClusterQueueConf, provider="dp_scaling")
