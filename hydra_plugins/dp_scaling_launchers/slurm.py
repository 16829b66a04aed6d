"""``hydra/launcher=submitit_slurm``: hydra-submitit-launcher's SLURM launcher, fitted to the cluster it runs on.

* Resources: ``tasks_per_node``, ``gpus_per_node`` and ``cpus_per_task`` default to ``auto``, read from ``sinfo`` for
  the partition: one task per GPU with one GPU each on GPU nodes, one task per node on CPU nodes, and the node's CPUs
  shared among its tasks. The same command runs on a GPU cluster and on a CPU-only one (a GPU request on a cluster
  without GPUs is an ``Invalid generic resource`` error from sbatch).
* No wait without bound: submitit asks ``sacct`` for the jobs' states, and a cluster without accounting has none
  (submitit then waits forever). ``ClusterWatcher`` falls back to ``squeue``, then ``scontrol show job`` for a job
  squeue no longer lists; a job SLURM does not list at all any more has ended. Polls every ``POLL_S`` seconds.
* A job that ends without a result (a process died, a cancel before it started, a node failure) is one line naming
  it, its state and its folder, not submitit's traceback; the sweep's end report then counts it from its
  ``summary.json`` (``sweeps.callback``), and the launcher goes on with the other jobs.
* SIGTERM or SIGINT to the sweep (``training.process.SweepStop``): the submitted jobs get SIGTERM (``scancel
  --signal=TERM``): they save a checkpoint and stop; the sweep resumes with the same command and its folder.

Configured by ``conf/hydra/launcher/submitit_slurm.yaml`` (schema ``SlurmClusterQueueConf``, registered by
``serial_local.RegisterSerialLocalSchema`` in the same way as the local launcher's).
"""

import logging
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import OmegaConf

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]
AUTO = "auto"
POLL_S = 10.0  # between two looks at the jobs' states
INCOMPLETE = (
    "READY",
    "PENDING",
    "RUNNING",
    "UNKNOWN",
    "REQUEUED",
    "COMPLETING",
    "PREEMPTED",
    "CONFIGURING",
    "RESIZING",
    "SUSPENDED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "STAGE_OUT",
    "SIGNALING",
)


class LauncherError(RuntimeError):
    """A sweep the cluster cannot run as configured; the message is one line."""


# ---- resources ----------------------------------------------------------------------------------------------
def node_resources(partition: Optional[str]) -> tuple[int, int]:
    """``(CPUs, GPUs)`` of the smallest node of ``partition`` (None: the default partition), from ``sinfo``.

    Raises:
      LauncherError: sinfo is missing or fails, or the partition has no nodes.
    """
    cmd = ["sinfo", "-h", "-o", "%c|%G"] + (["-p", partition] if partition else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise LauncherError(f"hydra/launcher=submitit_slurm cannot ask SLURM for its nodes ({' '.join(cmd)}: {e})")
    rows = [line.split("|", 1) for line in out.splitlines() if "|" in line]
    if not rows:
        where = f"partition {partition}" if partition else "the default partition"
        raise LauncherError(f"sinfo lists no nodes in {where}; set hydra.launcher.partition to one sinfo lists")
    cpus = min(int(re.sub(r"\D.*", "", c) or 1) for c, _ in rows)
    gpus = min(sum(int(n) for n in re.findall(r"gpu(?::[^:,(]+)?:(\d+)", g)) for _, g in rows)
    return cpus, gpus


def resolve_resources(params: Dict[str, Any], resources=node_resources) -> Dict[str, Any]:
    """``params`` with ``auto`` in ``tasks_per_node``, ``gpus_per_node`` and ``cpus_per_task`` replaced: one task per
    GPU and a GPU each on GPU nodes (none on CPU nodes, one task per node), the node's CPUs divided among its tasks."""
    keys = ("tasks_per_node", "gpus_per_node", "cpus_per_task")
    if not any(params.get(k) == AUTO for k in keys):
        return params
    cpus, gpus = resources(params.get("partition"))
    out = dict(params)
    if out.get("tasks_per_node") == AUTO:
        out["tasks_per_node"] = gpus or 1
    if out.get("gpus_per_node") == AUTO:
        out["gpus_per_node"] = min(gpus, int(out["tasks_per_node"])) if gpus else None
    if out.get("cpus_per_task") == AUTO:
        out["cpus_per_task"] = max(1, cpus // int(out["tasks_per_node"]))
    log.info(
        "submitit_slurm: %s task(s) per node, %s GPU(s) per node, %s CPU(s) per task (nodes of %d CPUs, %d GPUs)",
        out["tasks_per_node"],
        out["gpus_per_node"] or 0,
        out["cpus_per_task"],
        cpus,
        gpus,
    )
    return out


# ---- the jobs' states ---------------------------------------------------------------------------------------
def _squeue(ids: set[str]) -> Dict[str, str]:
    """{job id (``12_3`` for an array element): state} of the jobs of ``ids`` (main ids) that squeue lists."""
    cmd = ["squeue", "-h", "-r", "-o", "%i|%T", "-j", ",".join(sorted(ids))]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if r.returncode != 0 and "Invalid job id" not in r.stderr:
        raise OSError(r.stderr.strip() or f"{cmd[0]} exit {r.returncode}")
    return dict(line.split("|", 1) for line in r.stdout.split() if "|" in line)


def _scontrol(main_id: str) -> Dict[str, str]:
    """{job id: state} of job ``main_id`` (all its array elements) as ``scontrol show job`` says; {} once SLURM has
    forgotten it (``MinJobAge`` after its end)."""
    r = subprocess.run(["scontrol", "-o", "show", "job", main_id], capture_output=True, text=True, timeout=60)
    states = {}
    for line in r.stdout.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "JobState" not in fields:
            continue
        key = fields.get("JobId", "")
        if fields.get("ArrayJobId") and fields.get("ArrayTaskId", "").isdigit():
            key = f"{fields['ArrayJobId']}_{fields['ArrayTaskId']}"
        states[key] = fields["JobState"]
    return states


def job_states(registered: set[str]) -> Dict[str, str]:
    """{job id: state} of ``registered`` (submitit's ids: ``12`` or ``12_3``) without accounting: squeue, then
    scontrol for those squeue no longer lists; ``GONE`` for a job SLURM lists nowhere (it ended long ago)."""
    mains = {j.split("_")[0] for j in registered}
    states = _squeue(mains)
    for main in {j.split("_")[0] for j in registered if j not in states}:
        states.update({k: v for k, v in _scontrol(main).items() if k not in states})
    return {j: states.get(j, "GONE") for j in registered}


def install_watcher() -> None:
    """Makes submitit's SLURM job watcher fall back to ``job_states`` where ``sacct`` does not work, and poll every
    ``POLL_S`` seconds (submitit's default: up to 600 s between two looks). submitit is imported here, not when
    Hydra scans its plugins at every start."""
    from submitit.slurm import slurm

    class ClusterWatcher(slurm.SlurmInfoWatcher):
        """submitit's ``SlurmInfoWatcher``, asking ``squeue``/``scontrol`` when ``sacct`` fails (no accounting)."""

        sacct_works: Optional[bool] = None

        def update(self) -> None:
            if self.sacct_works is not False:
                command = self._make_command()
                if command is None:
                    return
                if shutil.which("sacct") is not None:
                    r = subprocess.run(command, capture_output=True, timeout=60)
                    if r.returncode == 0:
                        self.sacct_works = True
                        super().update()
                        return
                self.sacct_works = False
                log.info("submitit_slurm: no job accounting (sacct); following the jobs with squeue and scontrol")
            pending = self._registered - self._finished
            if not pending:
                return
            self._num_calls += 1
            try:
                states = job_states(pending)
            except (OSError, subprocess.SubprocessError) as e:
                log.warning("submitit_slurm: squeue/scontrol failed (%s); asking again in %g s", e, POLL_S)
            else:
                self._info_dict.update({j: {"JobID": j, "State": s} for j, s in states.items()})
            self._last_status_check = time.time()
            for job_id in pending:
                if self.is_done(job_id, mode="cache"):
                    self._finished.add(job_id)

        def is_done(self, job_id: str, mode: str = "standard") -> bool:
            state = (self.get_state(job_id, mode=mode).split() or ["UNKNOWN"])[0].upper()
            return state not in INCOMPLETE

    if type(slurm.SlurmJob.watcher).__name__ != "ClusterWatcher":
        slurm.SlurmJob.watcher = ClusterWatcher(delay_s=int(POLL_S))


# ---- the launcher -------------------------------------------------------------------------------------------
class ClusterSlurmLauncher(SlurmLauncher):
    """hydra-submitit-launcher's ``SlurmLauncher`` with ``auto`` resources, a bounded wait and one line per job that
    ended without a result (module docstring)."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit
        from hydra.core.singleton import Singleton
        from hydra.core.utils import filter_overrides
        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

        assert self.config is not None
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if str(REPO) not in paths:  # the job processes unpickle this launcher and the task from the repository
            os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *paths])
        from training.process import sweep

        if shutil.which("sbatch") is None:
            raise LauncherError("hydra/launcher=submitit_slurm needs SLURM's sbatch on this machine; none is on PATH")
        params = resolve_resources(dict(self.params))
        install_watcher()
        executor = submitit.AutoExecutor(
            cluster="slurm", folder=params["submitit_folder"], slurm_max_num_timeout=params["max_num_timeout"]
        )
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(
            **{
                (k if k in base else f"slurm_{k}"): v
                for k, v in params.items()
                if k not in ("submitit_folder", "max_num_timeout")
            }
        )
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info("submitit_slurm: sweep folder %s", sweep_dir)
        job_params: List[Any] = []
        for idx, overrides in enumerate(job_overrides, initial_job_idx):
            log.info("\t#%d : %s", idx, " ".join(filter_overrides(overrides)))
            job_params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        jobs = executor.map_array(self, *zip(*job_params))
        stop = sweep()
        if stop is not None:
            stop.on_signal.append(lambda signum: signal_jobs([j.job_id for j in jobs]))
        return [
            self._result(job, idx, overrides)
            for idx, (job, overrides) in enumerate(zip(jobs, job_overrides), initial_job_idx)
        ]

    def _result(self, job, idx: int, overrides: Sequence[str]) -> JobReturn:
        """The job's ``JobReturn``; a job that ended without one is one line, and the sweep's end report counts it
        from its folder (its ``summary.json``, or none)."""
        from submitit.core.utils import FailedJobError, UncompletedJobError

        while not job.done():
            time.sleep(1.0)
        try:
            return job.results()[0]
        except (UncompletedJobError, FailedJobError):
            folder = Path(str(self.config.hydra.sweep.dir)) / str(idx)
            state = job.watcher.get_state(job.job_id, mode="cache")
            started = (folder / ".hydra").is_dir()
            if not started:  # cancelled while pending: the sweep's end report counts it from this folder
                not_started(folder, overrides, f"SLURM job {job.job_id} ended ({state}) before it started")
            print(
                f"submitit_slurm: job #{idx} (SLURM job {job.job_id}, {state}) ended without a result"
                + (
                    f"; its summary.json and logs: {folder}, {job.paths.stderr.parent}"
                    if started
                    else f" before it started; nothing of it ran ({folder}/summary.json says so)"
                ),
                file=sys.stderr,
                flush=True,
            )
            # as a job that failed in train.py itself returns: its summary.json says how (sweeps.callback)
            return JobReturn(
                overrides=list(overrides), working_dir=str(folder), task_name="train", status=JobStatus.COMPLETED
            )


def not_started(folder: Path, overrides: Sequence[str], why: str) -> None:
    """The folder of a job of the sweep that never ran: its ``.hydra/overrides.yaml`` (so a resumed sweep runs it
    with these values) and a ``summary.json`` with status failed and ``why``."""
    import json

    (folder / ".hydra").mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(list(overrides)), folder / ".hydra" / "overrides.yaml")
    (folder / "summary.json").write_text(json.dumps({"status": "failed", "error": why}, indent=2) + "\n")


def signal_jobs(job_ids: List[str]) -> None:
    """SIGTERM to every task of the sweep's jobs still running (they save and stop); jobs still pending are left."""
    ids = sorted({j.split("_")[0] for j in job_ids})
    if ids:
        subprocess.run(["scancel", "--signal=TERM", "--state=RUNNING", *ids], capture_output=True, timeout=60)


@dataclass
class SlurmClusterQueueConf(SlurmQueueConf):
    """``SlurmQueueConf`` targeting ``ClusterSlurmLauncher``, with ``auto`` allowed for the three resources."""

    _target_: str = "hydra_plugins.dp_scaling_launchers.slurm.ClusterSlurmLauncher"
    tasks_per_node: Any = AUTO
    gpus_per_node: Any = AUTO
    cpus_per_task: Any = AUTO
