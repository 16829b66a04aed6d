"""A run's checkpoints as the training loop sees them (``training.hooks.CheckpointHook``): when to save, the
metadata saved with each state, where the last one went, and the summary's ``checkpoint/*`` values."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import jax

from training.checkpoint.plan import CheckpointPlan
from training.checkpoint.store import CheckpointWriteError, Saver, complete_steps, metadata, storage_error_text

# what orbax and TensorStore raise when a write fails (a full disk, a folder that is no longer writable)
WRITE_ERRORS = (OSError, ValueError)

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
      best_mode: min | max for the best checkpoint's folder (``training.checkpoint.best``: the step kept is the best
        by the metrics its save passed, not the newest); None: the newest steps are kept.
      data_fingerprint: what the training data was read from (the source's ``fingerprint``), saved with each state.
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
        best_mode: Optional[str] = None,
        data_fingerprint: Optional[dict] = None,
    ):
        self.plan, self.cfg_dict, self.mode = plan, cfg_dict, mode
        self.data_fingerprint = data_fingerprint
        self.mesh_shape, self.global_batch, self.steps_per_epoch = list(mesh_shape), global_batch, steps_per_epoch
        self.n_steps, self.run_dir = n_steps, Path(run_dir)
        self.best_mode = best_mode
        self._saver: Optional[Saver] = None  # created at the first save (training.run.prepare imported orbax)
        self.last_step: Optional[int] = None  # newest step saved (or restored) in this folder by this run
        self.last_path: Optional[Path] = None
        self.pending_step: Optional[int] = None  # a step whose background write is not known to have finished
        self.write_failed = False  # a CheckpointWriteError was raised: the run is stopping for it
        if plan.directory is not None and restored_step is not None and plan.resume_path is None:
            self.last_step, self.last_path = restored_step, Path(plan.directory) / str(restored_step)

    @property
    def enabled(self) -> bool:
        return self.plan.directory is not None

    @property
    def saver(self) -> Saver:
        if self._saver is None:
            self._saver = Saver(self.plan.directory, self.plan.keep, best_mode=self.best_mode)
            self._saver.last_step = self.last_step
        return self._saver

    def saves_at(self, done: int) -> bool:
        return self.plan.saves_at(done, self.n_steps, self.steps_per_epoch)

    def save(
        self,
        state,
        done: int,
        wandb_run_id: Optional[str],
        reason: str,
        extra: Optional[dict] = None,
        metrics: Optional[dict] = None,
    ) -> Optional[Path]:
        """Saves the state after ``done`` steps (asynchronously); None when disabled or already saved. ``extra``:
        more keys for the metadata (the best checkpoint's metric); ``metrics``: what a ``best_mode`` folder ranks
        the step by.

        Raises:
          NonFiniteError: the state is not finite (nothing written).
          UndeletableError: after a periodic save, more than ``checkpoint.keep`` older steps could not be deleted
            (this one is saved).
          CheckpointWriteError: the previous save's background write, or this save, failed.
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
            data_fingerprint=self.data_fingerprint,
        )
        meta.update(extra or {})
        self.wait()  # the previous save's background write (orbax's save would wait for it too)
        try:
            self.last_path = self.saver.save(state, done, meta, self.mode, metrics=metrics)
        except WRITE_ERRORS as e:
            raise self._write_error(done, e) from None
        self.last_step = self.pending_step = done
        log.info("checkpoint of step %d -> %s (%s)", done, self.last_path, reason)
        self._warn_undeleted()
        if reason == "periodic":  # the final save and one for a signal end the run anyway (and keep their message)
            self.saver.check_undeleted()
        return self.last_path

    def wait(self) -> None:
        """Waits until the last save is on disk.

        Raises:
          CheckpointWriteError: its background write failed.
        """
        if self._saver is not None and self.pending_step is not None:
            step, self.pending_step = self.pending_step, None
            try:
                self._saver.wait()
            except WRITE_ERRORS as e:
                raise self._write_error(step, e) from None

    def close(self) -> None:
        """Waits until every save is on disk (also after an error: the last good checkpoint stays whole).

        Raises:
          CheckpointWriteError: the last save's background write failed (orbax is closed all the same), unless an
            earlier one was raised (then it is only logged: one error line per run).
        """
        if self._saver is not None:
            step, self.pending_step = self.pending_step, None
            try:
                self._saver.close()
            except WRITE_ERRORS as e:
                if self.write_failed:  # the run is already stopping for a write error, reported once
                    log.info("closing the checkpoints after the write error: %s: %s", type(e).__name__, e)
                    return
                raise self._write_error(step, e) from None
            self._warn_undeleted()

    def _write_error(self, step: Optional[int], error: BaseException) -> CheckpointWriteError:
        """The one-line error for a checkpoint of ``step`` that could not be written: the step, the folder, the
        error, the newest complete checkpoint left (``last_step``/``last_path`` then name it) and what to do."""
        directory = Path(self.plan.directory)
        done = [s for s in complete_steps(directory) if s != step]
        self.last_step = done[-1] if done else None
        self.last_path = directory / str(done[-1]) if done else None
        what = f"the checkpoint of step {step}" if step is not None else "a checkpoint"
        then = (
            f"the newest complete checkpoint is {self.last_path}; free space or make the folder writable, then run "
            f"the same command to continue from it"
            if done
            else "no complete checkpoint is left; free space or make the folder writable, then run the same command"
        )
        self.write_failed = True
        return CheckpointWriteError(f"could not write {what} in {directory} ({storage_error_text(error)}); {then}")

    def _warn_undeleted(self) -> None:
        """One warning per step beyond ``checkpoint.keep`` that orbax could not delete (it stays on disk)."""
        assert self._saver is not None
        for step, error in self._saver.take_undeleted():
            log.warning(
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
