"""The Hydra callback of every sweep (``hydra.callbacks.sweep_summary`` in ``conf/config.yaml``): at the end, count
the failed jobs, name their folders and errors, exit non-zero when any failed; during it, stop on a signal.

Hydra calls ``on_multirun_end`` in the launching process after every job has returned, for the basic launcher
(jobs in-process) and for ``hydra/launcher=submitit_local`` (jobs in their own processes) alike, so the count is
taken from the job folders on disk: each job writes ``summary.json`` with ``status`` ok or failed; a job folder
without one died before it could write it (killed, out of memory, a crash of the interpreter).

A sweep started in a ``hydra.sweep.dir`` that already holds jobs (``on_multirun_start``, before Hydra writes
anything there) resumes them when each job folder would run its own values again (a sweep stopped and started
again, perhaps with more ``train.steps``), and is refused in one line naming the changed values otherwise: the
jobs of another sweep are neither rerun nor mixed into this one's folder.

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

from core.errors import override
from tracking.folders import not_own_folder
from training.process import NOT_STARTED, SweepStop, release_gc, speaks  # NOT_STARTED: a job the sweep's signal skipped


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
        f"resume with the same command and {override('hydra.sweep.dir', sweep_dir)} (finished jobs are not run again, "
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


# ---- a sweep resumed in its folder: the same jobs, or refused before anything is touched -------------------
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def planned_jobs(config: DictConfig) -> Optional[list[list[str]]]:
    """The override strings of every job Hydra's basic sweeper will launch for ``config``, in job-number order
    (``BasicSweeper.sweep``: ``hydra.sweeper.params``, then the command line's overrides, their product); None
    for another sweeper or a sweep this cannot expand before the sweeper does (a ``glob`` of group options)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    sweeper = config.hydra.sweeper
    if sweeper.get("_target_") != BASIC_SWEEPER:
        return None
    params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
    arguments = list(OmegaConf.to_container(config.hydra.overrides.task, resolve=False))  # type: ignore[arg-type]
    try:
        batches = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(params + arguments), None)
    except Exception:  # the sweeper reports what it cannot parse or expand itself, in one line (conf/errors.py)
        return None
    return [list(job) for batch in batches for job in batch]


def existing_jobs(sweep_dir: Path) -> dict[int, tuple[Path, list[str]]]:
    """``job number -> (job folder, its override strings)`` of the jobs already in ``sweep_dir`` (Hydra's
    ``.hydra/hydra.yaml`` and ``.hydra/overrides.yaml`` of each job folder; unreadable ones are left out)."""
    import yaml

    out: dict[int, tuple[Path, list[str]]] = {}
    for hydra_dir in sorted(Path(sweep_dir).glob("**/.hydra")):
        try:
            num = int(yaml.safe_load((hydra_dir / "hydra.yaml").read_text())["hydra"]["job"]["num"])
            overrides = [str(o) for o in yaml.safe_load((hydra_dir / "overrides.yaml").read_text()) or []]
        except (OSError, ValueError, TypeError, KeyError, yaml.YAMLError):
            continue
        out.setdefault(num, (hydra_dir.parent, overrides))
    return out


def _as_dict(overrides: list[str]) -> dict[str, str]:
    return dict(o.split("=", 1) if "=" in o else (o, "") for o in overrides)


def _values(jobs: list[dict[str, str]], key: str) -> list[str]:
    """The distinct values of ``key`` over ``jobs`` in their order (``(not set)`` where a job lacks it)."""
    return list(dict.fromkeys(job.get(key, "(not set)") for job in jobs))


def sweep_changes(sweep_dir: Path, jobs: list[list[str]]) -> list[str]:
    """Why the jobs already in ``sweep_dir`` are not this sweep's (empty: each job folder would run its own
    values again, so the sweep resumes): ``key: old values -> new values`` for every swept key whose values
    changed, or the first job whose values moved. Keys that one value sets in every job and that a resumed run may
    change (``train.steps``, logging, ``wandb``: ``training.checkpoint.policy.ALLOWED``) are not compared."""
    existing = existing_jobs(sweep_dir)
    if not existing:
        return []
    from training.checkpoint.policy import ALLOWED

    old = {num: _as_dict(ov) for num, (_, ov) in existing.items()}
    new = [_as_dict(ov) for ov in jobs]
    keys = {k for job in [*old.values(), *new] for k in job}

    def compared(key: str) -> bool:
        swept = len(_values(list(old.values()), key)) > 1 or len(_values(new, key)) > 1
        name = key.lstrip("+~")
        return swept or not (name.startswith(ALLOWED) or f"{name}.".startswith(ALLOWED))

    keys = {k for k in keys if compared(k)}
    moved = [
        num
        for num, job in sorted(old.items())
        if num >= len(new) or {k: job.get(k) for k in keys} != {k: new[num].get(k) for k in keys}
    ]
    if not moved:
        return []
    out = []
    for key in sorted(keys):
        before, after = _values(list(old.values()), key), _values(new, key)
        if set(before) != set(after):
            out.append(f"{key}: {','.join(before)} -> {','.join(after)}")
    if not out:  # the same values, in another order or number of jobs: name the first job that moved
        num = moved[0]
        was, now = old[num], new[num] if num < len(new) else {}
        differ = [k for k in sorted(keys) if was.get(k) != now.get(k)]
        ran = " ".join(f"{k}={was[k]}" for k in differ if k in was)
        would = " ".join(f"{k}={now[k]}" for k in differ if k in now) if now else "no job"
        out.append(f"the same values in another order: job {num} ({existing[num][0]}) ran {ran}, would run {would}")
    return out


def sweep_refusal(sweep_dir: Path, changes: list[str], limit: int = 4) -> str:
    """The one-line error for a sweep started in a folder that holds another sweep's jobs."""
    shown = "; ".join(changes[:limit]) + (f"; ... {len(changes) - limit} more" if len(changes) > limit else "")
    return (
        f"hydra.sweep.dir={sweep_dir} holds the jobs of a sweep with other values ({shown}); to resume that sweep "
        f"run it with its own values, otherwise give this sweep its own hydra.sweep.dir (nothing in the folder was "
        f"changed)"
    )


def hydra_files(config: DictConfig) -> dict[Path, tuple[bytes, float]]:
    """``{path: (bytes, modification time)}`` of the files Hydra writes in a single run's ``.hydra/``, as they are
    before it writes them (``hydra.run.dir`` given an earlier run's folder: continuing it, or refused)."""
    if config.hydra.output_subdir is None:
        return {}
    folder, found = Path(str(config.hydra.run.dir)) / str(config.hydra.output_subdir), {}
    for path in (folder / "config.yaml", folder / "hydra.yaml", folder / "overrides.yaml"):
        try:
            found[path] = (path.read_bytes(), path.stat().st_mtime)
        except OSError:  # none: a new run folder
            continue
    return found


def keep_earlier(files: dict[Path, tuple[bytes, float]]) -> None:
    """Keeps each of ``files`` (``hydra_files``) that Hydra has since rewritten with other content beside it, as
    ``<name>.previous-<time>.yaml`` (its modification time), with one warning: the record of how an earlier run in
    the folder was started is not lost to a run that continues it with other overrides, or is refused."""
    kept = []
    for path, (data, mtime) in files.items():
        try:
            if path.read_bytes() == data:
                continue
        except OSError:
            pass
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(mtime))
        backup = path.with_name(f"{path.stem}.previous-{stamp}{path.suffix}")
        backup.write_bytes(data)
        kept.append(backup.name)
    if kept and speaks():
        print(
            f"warning: {path.parent} held the Hydra files of an earlier run, rewritten for this one: the earlier ones "
            f"kept as {', '.join(kept)}",
            file=sys.stderr,
            flush=True,
        )


def _refuse_foreign(folder: str, key: str) -> None:
    """Exits 1 with one line when ``key=folder`` belongs to something else (``not_own_folder``)."""
    line = not_own_folder(Path(str(folder)), key)
    if line:
        print(f"error: {line}", file=sys.stderr, flush=True)
        sys.exit(1)  # SystemExit passes Hydra's callback wrapper (it only catches Exception)


class SweepSummary(Callback):
    """Prints ``k of n jobs failed`` with each failed job's folder and error, and exits with code 1 when k > 0.

    Also stops the sweep on SIGTERM/SIGINT (``SweepStop``) and then prints ``stop_report`` and exits 1. A run or sweep
    given a folder of another kind (``tracking.folders.not_own_folder``) is refused before Hydra writes there.
    """

    def __init__(self) -> None:
        self.start_s: Optional[float] = None
        self.stop: Optional[SweepStop] = None
        self.earlier: dict[Path, tuple[bytes, float]] = {}

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _refuse_foreign(config.hydra.run.dir, "hydra.run.dir")  # another run's checkpoints, a sweep's folder
        self.earlier = hydra_files(config)  # an earlier run's, in the same folder: Hydra rewrites them next

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        keep_earlier(self.earlier)
        self.earlier = {}

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        release_gc()  # a sweep's process keeps Python's garbage collector on (training.process)
        _refuse_foreign(config.hydra.sweep.dir, "hydra.sweep.dir")  # a single run's folder, another's checkpoints
        # before the sweeper writes multirun.yaml and the jobs their folders: another sweep's jobs stay untouched
        jobs = planned_jobs(config)
        changes = sweep_changes(Path(config.hydra.sweep.dir), jobs) if jobs is not None else []
        if changes:
            print(f"error: {sweep_refusal(Path(config.hydra.sweep.dir), changes)}", file=sys.stderr, flush=True)
            sys.exit(1)  # SystemExit passes Hydra's callback wrapper (it only catches Exception)
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
