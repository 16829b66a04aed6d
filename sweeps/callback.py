"""The Hydra callback of every sweep (``hydra.callbacks.sweep_summary`` in ``conf/config.yaml``): at the end, count
the failed jobs, name their folders and errors, exit non-zero when any failed; during it, stop on a signal.

Hydra calls ``on_multirun_end`` in the launching process after every job has returned, for the basic launcher
(jobs in-process) and for ``hydra/launcher=submitit_local`` (jobs in their own processes) alike, so the count is
taken from the job folders on disk: each job writes ``summary.json`` with ``status`` ok or failed; a job folder
without one died before it could write it (killed, out of memory, a crash of the interpreter).

SIGTERM or SIGINT during a sweep (``training.process.SweepStop``, installed at the sweep's start): the running
job saves a checkpoint and stops, no later job starts (``train.py`` writes ``status: skipped`` for it), and the
end prints which jobs finished, stopped or never started and how to resume, and exits 1.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from training.process import SweepStop, release_gc

# summary.json "error" of a job that never started because its sweep received a signal (then the signal's name)
NOT_STARTED = "not started: the sweep was stopped by "


def _written_s(hydra_dir: Path) -> float:
    """When the job last started: the newest modification time of the files in its ``.hydra/`` (Hydra rewrites
    them in place at every start, so the folder's own time stays that of the first start)."""
    times = [hydra_dir.stat().st_mtime]
    for f in hydra_dir.iterdir():
        try:
            times.append(f.stat().st_mtime)
        except OSError:
            continue
    return max(times)


def job_outcomes(sweep_dir: Path, since_s: Optional[float] = None) -> list[tuple[Path, Optional[str]]]:
    """``(job folder, error or None)`` of every job folder of ``sweep_dir`` (a folder holding ``.hydra/``).

    Args:
      sweep_dir: ``hydra.sweep.dir``.
      since_s: only folders whose ``.hydra/`` files were written at or after this time (seconds since the epoch):
        jobs of an earlier sweep into the same folder that this sweep did not run again are not counted.
    Returns:
      sorted by folder; error is ``summary.json``'s ``error`` for ``status: failed``, or a sentence saying
      that the summary is missing or unreadable.
    """
    out = []
    for hydra_dir in sorted(Path(sweep_dir).glob("**/.hydra")):
        job = hydra_dir.parent
        if since_s is not None and _written_s(hydra_dir) < since_s - 1.0:
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


def stop_report(
    outcomes: list[tuple[Path, Optional[str]]], signal_name: str, not_submitted: int, sweep_dir: Path
) -> list[str]:
    """The lines printed at the end of a sweep stopped by ``signal_name``: how many jobs finished, stopped
    (saved a checkpoint), never started (``not_submitted`` more that have no folder) or failed, each job's
    folder and state, and the command that resumes the sweep."""
    groups: dict[str, list[Path]] = {"finished": [], "stopped": [], "never started": [], "failed": []}
    for job, err in outcomes:
        if err is None:
            groups["finished"].append(job)
        elif err.startswith("stopped by"):
            groups["stopped"].append(job)
        elif err.startswith(NOT_STARTED):
            groups["never started"].append(job)
        else:
            groups["failed"].append(job)
    counts = {k: len(v) for k, v in groups.items()}
    counts["never started"] += not_submitted
    total = sum(counts.values())
    head = ", ".join(f"{n} {k}" for k, n in counts.items() if n or k != "failed")
    lines = [f"sweep stopped by {signal_name}: {head} (of {total} jobs)"]
    lines += [f"  {job}: {state}" for state, jobs in groups.items() for job in jobs]
    lines.append(
        f"resume with the same command and hydra.sweep.dir={sweep_dir} (finished jobs are not run again, "
        f"stopped ones continue from their checkpoint)"
    )
    return lines


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
    """Prints ``k of n jobs failed`` with each failed job's folder and error, and exits with code 1 when k > 0.

    Also stops the sweep on SIGTERM/SIGINT (``SweepStop``) and then prints ``stop_report`` and exits 1.
    """

    def __init__(self) -> None:
        self.start_s: Optional[float] = None
        self.stop: Optional[SweepStop] = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        release_gc()  # a sweep's process keeps Python's garbage collector on (training.process)
        self.start_s = time.time()
        self.stop = SweepStop().install()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        outcomes = job_outcomes(sweep_dir, self.start_s)
        stop, self.stop = self.stop, None
        if stop is not None:
            stop.uninstall()
            if stop.signal_name is not None:
                print(
                    "\n".join(stop_report(outcomes, stop.signal_name, stop.not_submitted, sweep_dir)), file=sys.stderr
                )
                sys.exit(1)
        lines = failure_report(outcomes)
        hint = offline_wandb_hint(sweep_dir)
        if hint:
            print(hint, file=sys.stderr, flush=True)
        if not lines:
            print(f"all {len(outcomes)} jobs of the sweep in {sweep_dir} succeeded", file=sys.stderr, flush=True)
            return
        print("\n".join(lines), file=sys.stderr, flush=True)
        sys.exit(1)  # SystemExit passes Hydra's callback wrapper (it only catches Exception)
