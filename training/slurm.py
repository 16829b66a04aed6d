"""A SLURM batch job that was preempted or requeued goes back into the queue under its own id and continues by itself.

SLURM preempts a job (``PreemptMode=REQUEUE``, a partition of higher priority) by sending SIGTERM to its tasks and
requeueing it after the partition's ``GraceTime``, but a job whose tasks save and exit within the grace time ends
as failed and is never requeued. So a run stopped by SIGTERM asks SLURM whether its job was preempted
(``scontrol show job``: ``PreemptTime`` set) and may be requeued (``Requeue=1``, a batch job); if so, process 0
requeues it with ``scontrol requeue`` as its very last act (``training.process``, at exit), and the requeued job
(same id, same ``checkpoint.dir``) continues from the saved step. A job of Hydra's submitit launcher is left to it.

Standard library only.
"""

from __future__ import annotations

import os
import subprocess
from typing import Optional

TIMEOUT_S = 30.0


def job_fields(job_id: str) -> dict[str, str]:
    """``scontrol -o show job <id>``'s ``key=value`` fields ({} when scontrol is missing or fails)."""
    try:
        r = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return {}
    line = r.stdout.splitlines()[0] if r.returncode == 0 and r.stdout else ""
    return dict(field.split("=", 1) for field in line.split() if "=" in field)


def comes_back(environ=os.environ) -> Optional[tuple[str, str]]:
    """``(job id, how)`` when this process's SLURM batch job will run again by itself after this stop: ``requeued``
    (``scontrol requeue``, or a requeue SLURM already made: its ``Restarts`` is past this run's
    ``SLURM_RESTART_COUNT``) or ``preempted`` (``PreemptTime`` set and ``Requeue=1``: process 0 requeues it,
    ``training.process.arm_requeue``); None otherwise (not under SLURM, a job of the submitit launcher, a
    ``scancel``, a time limit)."""
    job = environ.get("SLURM_JOB_ID")
    if not job or environ.get("SUBMITIT_EXECUTOR"):
        return None
    fields = job_fields(job)
    if fields.get("BatchFlag") != "1" or fields.get("Requeue") != "1":
        return None
    try:
        if int(fields.get("Restarts", "0")) > int(environ.get("SLURM_RESTART_COUNT", "0")):
            return job, "requeued"
    except ValueError:
        pass
    if fields.get("PreemptTime", "None") not in ("None", "Unknown", ""):
        return job, "preempted"
    return None


def requeue(job_id: str) -> bool:
    """``scontrol requeue <job_id>``; whether SLURM took it."""
    try:
        r = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0
