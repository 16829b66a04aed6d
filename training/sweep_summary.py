"""End of a Hydra sweep: count the failed jobs, name their folders and errors, exit non-zero when any failed.

Registered in ``conf/config.yaml`` as ``hydra.callbacks.sweep_summary``. Hydra calls ``on_multirun_end`` in
the launching process after every job has returned, for the basic launcher (jobs in-process) and for
``hydra/launcher=submitit_local`` (jobs in their own processes) alike, so the count is taken from the job
folders on disk: each job writes ``summary.json`` with ``status`` ok or failed (``training.app``); a job
folder without one died before it could write it (killed, out of memory, a crash of the interpreter).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


def job_outcomes(sweep_dir: Path, since_s: Optional[float] = None) -> list[tuple[Path, Optional[str]]]:
    """``(job folder, error or None)`` of every job folder of ``sweep_dir`` (a folder holding ``.hydra/``).

    Args:
      sweep_dir: ``hydra.sweep.dir``.
      since_s: only folders whose ``.hydra/`` was created at or after this time (seconds since the epoch):
        jobs of an earlier sweep into the same folder are not counted.
    Returns:
      sorted by folder; error is ``summary.json``'s ``error`` for ``status: failed``, or a sentence saying
      that the summary is missing or unreadable.
    """
    out = []
    for hydra_dir in sorted(Path(sweep_dir).glob("**/.hydra")):
        job = hydra_dir.parent
        if since_s is not None and hydra_dir.stat().st_mtime < since_s - 1.0:
            continue
        path = job / "summary.json"
        try:
            summary = json.loads(path.read_text())
        except FileNotFoundError:
            out.append((job, "no summary.json: the job stopped before it could write one (see its train.log)"))
            continue
        except (OSError, ValueError) as e:
            out.append((job, f"summary.json cannot be read ({e})"))
            continue
        out.append((job, None if summary.get("status") == "ok" else str(summary.get("error", "status failed"))))
    return out


def failure_report(outcomes: list[tuple[Path, Optional[str]]]) -> list[str]:
    """The lines printed at the end of a sweep: ``k of n jobs failed`` then ``  <folder>: <error>`` per failure
    (empty when every job succeeded)."""
    failed = [(job, err) for job, err in outcomes if err is not None]
    if not failed:
        return []
    return [f"{len(failed)} of {len(outcomes)} jobs failed"] + [f"  {job}: {err}" for job, err in failed]


def offline_wandb_hint(sweep_dir: Path) -> Optional[str]:
    """One line naming the command that uploads every offline W&B run of the sweep, or None without any."""
    runs = sorted(Path(sweep_dir).glob("**/wandb/offline-run-*"))
    if not runs:
        return None
    return (
        f"W&B is offline: upload the sweep's {len(runs)} run(s) later with: "
        f"wandb sync {sweep_dir}/*/wandb/offline-run-*"
    )


class SweepSummary(Callback):
    """Prints ``k of n jobs failed`` with each failed job's folder and error, and exits with code 1 when k > 0."""

    def __init__(self) -> None:
        self.start_s: Optional[float] = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.start_s = time.time()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        outcomes = job_outcomes(sweep_dir, self.start_s)
        lines = failure_report(outcomes)
        hint = offline_wandb_hint(sweep_dir)
        if hint:
            print(hint, file=sys.stderr, flush=True)
        if not lines:
            print(f"all {len(outcomes)} jobs of the sweep in {sweep_dir} succeeded", file=sys.stderr, flush=True)
            return
        print("\n".join(lines), file=sys.stderr, flush=True)
        sys.exit(1)  # SystemExit passes Hydra's callback wrapper (it only catches Exception)
