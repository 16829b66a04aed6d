"""The best evaluated step of a run (``checkpoint.keep_best``): kept beside the newest checkpoints, never rotated.

Every evaluation (``train.eval_every`` and the final one) that improves on the best value of the metric so far
(``min`` or ``max``: ``training.checkpoint.plan.best_direction``; strictly better, a NaN never is) saves the state
into ``<checkpoint.dir>/best/<step>``: a checkpoint folder of its own (its own orbax manager, one step kept), so
the ``checkpoint.keep`` rotation of ``<checkpoint.dir>`` never sees it (orbax lists only step folders); that
manager keeps the best step by the value each save passes (orbax's ``best_fn``), not the newest by step number
(a resumed run with another ``train.eval_every`` may find a better step before the recorded one). Its metadata is
a checkpoint's (``store.metadata``, ``reason: best``) plus ``best: {metric, value, mode}``.

A resumed run starts from the best recorded there (a run that resumes at or before that step re-evaluates the
same values and does not replace it); a run that starts fresh moves an earlier run's best folder aside
(``best.previous-<time>``); ``python -m sample --best`` and ``python -m evaluate --best`` read it.
The saves cost a state write each time the metric improves (none otherwise); the step's state is the same one a
periodic save would write.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from pathlib import Path
from typing import Optional

import jax

from training.checkpoint.plan import BEST_DIR, CheckpointPlan
from training.checkpoint.run_checkpoints import RunCheckpoints
from training.checkpoint.store import any_step_dirs, complete_steps, read_metadata

log = logging.getLogger("training.checkpoint")


def best_step_dir(best_dir: Path) -> Optional[Path]:
    """The newest complete step folder of ``best_dir`` whose metadata reads, or None."""
    for step in reversed(complete_steps(best_dir)):
        try:
            read_metadata(Path(best_dir) / str(step))
            return Path(best_dir) / str(step)
        except (OSError, ValueError):
            continue
    return None


def recorded_best(best_dir: Path, metric: str) -> Optional[tuple[int, float]]:
    """(step, value) of the best checkpoint already in ``best_dir`` for ``metric``, or None (none there, or one
    kept for another metric)."""
    step_dir = best_step_dir(best_dir)
    if step_dir is None:
        return None
    best = read_metadata(step_dir).get("best") or {}
    if best.get("metric") != metric or not isinstance(best.get("value"), (int, float)):
        return None
    return int(step_dir.name), float(best["value"])


def is_better(value: float, best: Optional[float], mode: str) -> bool:
    """Whether ``value`` beats ``best`` (None: nothing yet) under ``mode`` (min | max); a NaN never does."""
    if value is None or math.isnan(value):
        return False
    if best is None:
        return True
    return value < best if mode == "min" else value > best


class BestCheckpoint:
    """Saving of the best evaluated step for one run (``training.hooks.BestCheckpointHook``).

    Args:
      plan: the run's checkpoint plan (``plan.keep_best`` set, ``plan.best_directory`` the folder).
      kwargs: what ``RunCheckpoints`` takes (config, mode, mesh, batch ...; never a restored step: the best folder
        is not the one the run resumes from).
    """

    def __init__(self, plan: CheckpointPlan, *, resumed: bool, **kwargs):
        assert plan.keep_best and plan.best_directory is not None
        self.metric, self.mode, self.directory = plan.keep_best, plan.best_mode, plan.best_directory
        own = dataclasses.replace(plan, directory=plan.best_directory, keep=1, resume_path=None, keep_best=None)
        self.ckpts = RunCheckpoints(own, **{**kwargs, "restored_step": None, "best_mode": self.mode})
        found = None
        if resumed:
            try:
                found = recorded_best(self.directory, self.metric)
            except (OSError, ValueError):
                found = None
        elif any_step_dirs(self.directory):  # an abandoned run's best: not this run's, kept aside
            moved = self.directory.with_name(f"{BEST_DIR}.previous-{time.strftime('%Y%m%d-%H%M%S')}")
            if jax.process_index() == 0:
                os.replace(self.directory, moved)
            log.warning(
                f"{self.directory} holds an earlier run's best checkpoint (this run resumes none): moved to {moved}"
            )
        self.step: Optional[int] = None if found is None else found[0]
        self.value: Optional[float] = None if found is None else found[1]
        self.path: Optional[Path] = None if found is None else self.directory / str(found[0])

    def observe(self, state, step: int, metrics: dict, wandb_run_id: Optional[str]) -> Optional[Path]:
        """Saves ``state`` (after ``step`` steps) when ``metrics[metric]`` beats the best so far; returns the
        folder it saved into, else None.

        Raises:
          KeyError: the evaluation has no such metric (``training.run.prepare`` refuses such settings first).
          NonFiniteError, CheckpointWriteError: as ``RunCheckpoints.save``.
        """
        value = float(metrics[self.metric])
        if not is_better(value, self.value, self.mode):
            return None
        best = {"metric": self.metric, "value": value, "mode": self.mode}
        path = self.ckpts.save(state, step, wandb_run_id, "best", extra={"best": best}, metrics={"value": value})
        self.step, self.value, self.path = step, value, path
        log.info("best %s=%.6g at step %d -> %s", self.metric, value, step, path)
        return path

    def close(self) -> None:
        """Waits for the last best save (``RunCheckpoints.close``: a former best orbax could not delete is warned
        about there)."""
        self.ckpts.close()

    def summary(self) -> dict:
        return {
            "checkpoint/best_metric": self.metric,
            "checkpoint/best_mode": self.mode,
            "checkpoint/best_step": self.step,
            "checkpoint/best_value": self.value,
            "checkpoint/best_path": None if self.path is None else str(self.path),
        }
