"""The checkpoint plan of one run: where it saves, how often, how many it keeps and what it resumes.

``prepare`` validates ``checkpoint.*`` before anything is loaded, built or logged (it only looks at folders;
nothing is read or written). Errors: ``core.errors.ConfigError``, one line naming the value and the fix.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Optional

from conf.schema import CheckpointConfig
from core.errors import ConfigError, override
from training.checkpoint.store import META, STATE, any_step_dirs, complete_steps, is_step_dir, odd_entries
from training import process
from tracking import run_folder
from tracking.folders import RUN, first_job, folder_kind, many_runs, not_a_checkpoint_dir, run_checkpoint_dir

RESUME_MODES = ("auto", "never")
# what ``checkpoint.keep_best`` may name: the evaluation's metrics (the last two: the GPT's only)
BEST_METRICS = ("eval/loss", "eval/accuracy", "eval/perplexity", "eval/bpb")
BEST_MODES = ("auto", "min", "max")
BEST_DIR = "best"  # <checkpoint.dir>/best/<step>: the best evaluated step (training/checkpoint/best.py)


def best_direction(metric: str, mode: str) -> str:
    """``min`` or ``max``: ``mode`` itself, or for ``auto`` max for an accuracy and min for a loss, perplexity or
    bits per byte."""
    if mode != "auto":
        return mode
    return "max" if "accuracy" in metric else "min"


@dataclasses.dataclass(frozen=True)
class CheckpointPlan:
    """Validated ``checkpoint.*`` settings of one run.

    directory: absolute folder the run saves into (None: checkpointing disabled).
    every: ``checkpoint.every`` as given (None: once per epoch; 0: only at the end / on a signal).
    keep: checkpoints kept (orbax ``max_to_keep``).
    resume: 'auto' | 'never' | 'path'.
    resume_path: absolute path for resume='path' (a checkpoint folder or one ``<step>`` folder in it).
    keep_best: the evaluation metric whose best step is kept in ``<directory>/best`` (None: off).
    best_mode: ``min`` or ``max`` (``best_direction``).
    """

    directory: Optional[Path]
    every: Optional[int]
    keep: int
    resume: str
    resume_path: Optional[Path]
    keep_best: Optional[str] = None
    best_mode: str = "min"

    @property
    def best_directory(self) -> Optional[Path]:
        """``<directory>/best`` when the best step is kept, else None."""
        return None if self.directory is None or not self.keep_best else self.directory / BEST_DIR

    def every_steps(self, steps_per_epoch: int) -> int:
        """Steps between periodic saves (0: none)."""
        return steps_per_epoch if self.every is None else self.every

    def saves_at(self, done: int, n_steps: int, steps_per_epoch: int) -> bool:
        """Whether the state after ``done`` optimizer steps is saved (periodic, or the last step)."""
        if self.directory is None:
            return False
        every = self.every_steps(steps_per_epoch)
        return done == n_steps or (every > 0 and done % every == 0)


def default_directory(run_dir: Path, process_count: int, environ=os.environ, in_sweep: Optional[bool] = None) -> Path:
    """``checkpoint.dir`` when it is null.

    One process, or a job of a sweep (``in_sweep``; None: ``training.process.sweep_dir`` says; its folder
    ``<sweep dir>/<job number>`` is the same for all of its processes, which get the launcher's config, and for the
    job that resumes it in the same sweep folder, under a new SLURM job id): ``<run folder>/checkpoints``. Several
    processes of a single run: every process has its own (timestamped) run folder, so only a folder derived from
    ``SLURM_JOB_ID`` (``./checkpoints/slurm-<id>``, the same on every host and across ``scontrol requeue``) is shared.

    Raises:
      ConfigError: several processes of a single run and no SLURM job id.
    """
    if in_sweep is None:
        in_sweep = process.sweep_dir() is not None
    if process_count == 1 or in_sweep:
        return Path(run_dir) / "checkpoints"
    job = environ.get("SLURM_JOB_ID")
    if job:
        return Path("checkpoints") / f"slurm-{job}"
    raise ConfigError(
        f"checkpoint.dir=null with {process_count} processes: each process would save into its own "
        f"run folder; set checkpoint.dir to one folder every process can reach (shared file system "
        f"or bucket), or checkpoint.enabled=false"
    )


def prepare(cfg: CheckpointConfig, run_dir: Path, process_count: int = 1) -> CheckpointPlan:
    """Validates ``checkpoint.*`` before anything is loaded, built or logged.

    Raises:
      ConfigError (one line): ``every`` < 0, ``keep`` < 1, several processes without a shared folder, ``dir`` a
      sweep's folder or inside another run's folder (``not_a_checkpoint_dir``), or ``resume`` a path that does not
      exist or holds no checkpoint.
    """
    if cfg.every is not None and cfg.every < 0:
        raise ConfigError(f"checkpoint.every={cfg.every} must be >= 0 (0: only at the end; null: every epoch)")
    if cfg.keep < 1:
        raise ConfigError(f"checkpoint.keep={cfg.keep} must be >= 1")
    if cfg.keep_best is not None and cfg.keep_best not in BEST_METRICS:
        raise ConfigError(
            f"checkpoint.keep_best={cfg.keep_best} is not an evaluation metric; choose one of "
            f"{', '.join(BEST_METRICS)} (the last two for model=gpt), or null (off)"
        )
    if cfg.best_mode not in BEST_MODES:
        raise ConfigError(f"checkpoint.best_mode={cfg.best_mode} is unknown; choose one of {', '.join(BEST_MODES)}")
    right = best_direction(cfg.keep_best or "", "auto")  # a loss is best at its minimum, an accuracy at its maximum
    if cfg.keep_best is not None and cfg.best_mode not in ("auto", right):
        raise ConfigError(
            f"checkpoint.best_mode={cfg.best_mode} keeps the {'lowest' if right == 'max' else 'highest'} "
            f"{cfg.keep_best}, the worst one; use checkpoint.best_mode=auto ({right} for {cfg.keep_best})"
        )
    if cfg.keep_best is not None and not cfg.enabled:
        raise ConfigError(
            f"checkpoint.keep_best={cfg.keep_best} keeps a checkpoint, but checkpoint.enabled=false; enable "
            f"checkpoints or set checkpoint.keep_best=null"
        )
    best = {"keep_best": cfg.keep_best, "best_mode": best_direction(cfg.keep_best or "", cfg.best_mode)}
    resume, resume_path = cfg.resume, None
    if resume not in RESUME_MODES:
        resume_path = Path(resume).expanduser().absolute()
        if not resume_path.exists():
            raise ConfigError(
                f"checkpoint.resume={cfg.resume} does not exist; give a checkpoint folder (or one "
                f"<step> folder in it), auto (the newest in checkpoint.dir) or never"
            )
        if several := many_runs(resume_path):  # a sweep's job folders are named by numbers, as steps are
            raise ConfigError(
                f"checkpoint.resume={cfg.resume} is {several}, not a checkpoint folder; give one run's checkpoint "
                f"folder, e.g. {first_job(resume_path)}/checkpoints"
            )
        if folder_kind(resume_path) == RUN:
            where = run_checkpoint_dir(resume_path)
            raise ConfigError(
                f"checkpoint.resume={cfg.resume} is a run folder, not a checkpoint folder; give its checkpoint "
                f"folder, {override('checkpoint.resume', where)} (or one <step> folder in it)"
            )
        if not is_step_dir(resume_path) and not complete_steps(resume_path) and not any_step_dirs(resume_path):
            raise ConfigError(
                f"checkpoint.resume={cfg.resume} holds no checkpoint (no <step> folder with "
                f"{STATE}/ and {META}/); give a checkpoint folder, auto or never"
            )
        resume = "path"
    if not cfg.enabled and resume == "path":
        raise ConfigError(f"checkpoint.resume={cfg.resume} with checkpoint.enabled=false; enable checkpoints to resume")
    if not cfg.enabled:
        return CheckpointPlan(directory=None, every=cfg.every, keep=cfg.keep, resume="never", resume_path=None)
    directory = Path(cfg.dir).expanduser() if cfg.dir else default_directory(run_dir, process_count)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"checkpoint.dir={directory} is a file; give a folder")
    if foreign := not_a_checkpoint_dir(directory, run_dir, override):  # before its lock: nothing written there
        raise ConfigError(foreign)
    for folder in [directory.absolute()] + ([directory.absolute() / BEST_DIR] if cfg.keep_best else []):
        odd = odd_entries(folder)  # a save of that step would fail on it, after training: refused now
        if odd:
            them = "them" if odd.endswith("folders") else "it"
            raise ConfigError(f"{odd}; move {them} out of {folder}, then run the same command again")
    if resume == "never" and complete_steps(directory):
        raise ConfigError(
            f"checkpoint.resume=never but checkpoint.dir={directory} already holds checkpoints "
            f"(steps {complete_steps(directory)}); use another checkpoint.dir, or "
            f"checkpoint.resume=auto to continue from the newest"
        )
    return CheckpointPlan(
        directory=directory.absolute(), every=cfg.every, keep=cfg.keep, resume=resume, resume_path=resume_path, **best
    )


def claim(plan: CheckpointPlan, run_dir: Path, process_count: int = 1) -> None:
    """Claims ``plan``'s checkpoint folder for this run before anything is written there
    (``tracking.run_folder.claim_checkpoints``; shared by the processes of one run); none: nothing.

    Raises:
      ConfigError (one line): another run writes there (named), or the folder cannot be made.
    """
    if plan.directory is None:
        return
    try:
        run_folder.claim_checkpoints(plan.directory, run_dir, shared=process_count > 1)
    except run_folder.RunFolderError as e:
        raise ConfigError(str(e)) from None


def release_claim() -> None:
    """Releases the checkpoint folder ``claim`` took (``tracking.run_folder.release_checkpoints``): a folder the run
    made and never wrote into is removed. Nothing when none is held."""
    run_folder.release_checkpoints()
