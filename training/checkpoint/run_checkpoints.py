"""A run's checkpoints as the training loop sees them (``training.hooks.CheckpointHook``): when to save, the
metadata saved with each state, where the last one went, and the summary's ``checkpoint/*`` values."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import jax

from training.checkpoint.plan import CheckpointPlan
from training.checkpoint.resuming import warn
from training.checkpoint.store import Saver, metadata

# one logger for the package: its log lines all name training.checkpoint
log = logging.getLogger("training.checkpoint")


class RunCheckpoints:
    """Saving for one run of ``training.run``: when to save, the metadata, and where the last one went.

    Args:
      plan: from ``prepare``.
      cfg_dict: the resolved config (``conf.schema.as_dict``).
      mode: the run's parallel mode (its placed state is saved in host form).
      mesh_shape, global_batch, steps_per_epoch, n_steps: the run's numbers.
      run_dir: the run folder (recorded, so a resumed run finds the saved run's metrics.jsonl).
      restored_step: the step this run resumed from (None: started fresh).
    """

    def __init__(
        self,
        plan: CheckpointPlan,
        *,
        cfg_dict: dict,
        mode,
        mesh_shape,
        global_batch: int,
        steps_per_epoch: int,
        n_steps: int,
        run_dir: Path,
        restored_step: Optional[int] = None,
    ):
        self.plan, self.cfg_dict, self.mode = plan, cfg_dict, mode
        self.mesh_shape, self.global_batch, self.steps_per_epoch = list(mesh_shape), global_batch, steps_per_epoch
        self.n_steps, self.run_dir = n_steps, Path(run_dir)
        self._saver: Optional[Saver] = None  # created at the first save (training.prepare has imported orbax by then)
        self.last_step: Optional[int] = None  # newest step saved (or restored) in this folder by this run
        self.last_path: Optional[Path] = None
        if plan.directory is not None and restored_step is not None and plan.resume_path is None:
            self.last_step, self.last_path = restored_step, Path(plan.directory) / str(restored_step)

    @property
    def enabled(self) -> bool:
        return self.plan.directory is not None

    @property
    def saver(self) -> Saver:
        if self._saver is None:
            self._saver = Saver(self.plan.directory, self.plan.keep)
            self._saver.last_step = self.last_step
        return self._saver

    def saves_at(self, done: int) -> bool:
        return self.plan.saves_at(done, self.n_steps, self.steps_per_epoch)

    def save(self, state, done: int, wandb_run_id: Optional[str], reason: str) -> Optional[Path]:
        """Saves the state after ``done`` steps (asynchronously); None when disabled or already saved.

        Raises:
          NonFiniteError: the state is not finite (nothing written).
          UndeletableError: after a periodic save, more than ``checkpoint.keep`` older steps could not be deleted
            (this one is saved).
        """
        if not self.enabled or self.last_step == done:
            return self.last_path if self.enabled and self.last_step == done else None
        meta = metadata(
            step=done,
            steps_per_epoch=self.steps_per_epoch,
            global_batch=self.global_batch,
            cfg_dict=self.cfg_dict,
            mode_name=self.mode.name,
            mesh_shape=self.mesh_shape,
            num_devices=self.mode.num_devices,
            process_count=jax.process_count(),
            wandb_run_id=wandb_run_id,
            run_dir=self.run_dir,
            reason=reason,
        )
        self.last_path = self.saver.save(state, done, meta, self.mode)
        self.last_step = done
        log.info("checkpoint of step %d -> %s (%s)", done, self.last_path, reason)
        self._warn_undeleted()
        if reason == "periodic":  # the final save and one for a signal end the run anyway (and keep their message)
            self.saver.check_undeleted()
        return self.last_path

    def close(self) -> None:
        """Waits until every save is on disk (also after an error: the last good checkpoint stays whole)."""
        if self._saver is not None:
            self._saver.close()
            self._warn_undeleted()

    def _warn_undeleted(self) -> None:
        """One warning per step beyond ``checkpoint.keep`` that orbax could not delete (it stays on disk)."""
        assert self._saver is not None
        for step, error in self._saver.take_undeleted():
            warn(
                f"could not delete the checkpoint {self._saver.step_dir(step)} (older than the newest "
                f"checkpoint.keep={self.plan.keep}): {error}; it is left there, possibly in part: delete it yourself"
            )

    def summary(self) -> dict:
        if not self.enabled:
            return {}
        return {
            "checkpoint/dir": str(self.plan.directory),
            "checkpoint/last_step": self.last_step,
            "checkpoint/last_path": str(self.last_path) if self.last_path else None,
        }
