"""Which checkpoint a run continues from, whether it may, and restoring it.

``check_resume_settings`` reads only the JSON metadata of the step folder ``resume`` will try first and
refuses settings the resume policy (``training.checkpoint.policy``) does not allow, before anything is
restored. ``resume`` then restores the newest readable step (``checkpoint.resume=auto``) or the given one
onto this run's mode: unfinished saves and unreadable steps are named in a warning, and unreadable ones
are moved aside once an older step restores.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from core.errors import ConfigError, first_line
from training.checkpoint.plan import CheckpointPlan
from training.checkpoint.policy import data_change, data_refusal, refusal, resume_conflicts
from training.checkpoint.store import (
    Restored,
    complete_steps,
    is_step_dir,
    move_aside,
    read_metadata,
    restore_step,
    unfinished_saves,
)

# one logger for the package: its log lines all name training.checkpoint
log = logging.getLogger("training.checkpoint")


def warn(line: str) -> None:
    """A checkpoint warning the user must see: ``training.console.warn`` under this package's logger."""
    from training.console import warn as report_warn

    report_warn(line, log)


def candidate_step_dir(ckpt_plan: CheckpointPlan) -> Optional[Path]:
    """The step folder ``checkpoint.resume`` will try first (newest finished step whose metadata reads), or
    None (no checkpoint, resume=never, checkpoints disabled)."""
    if ckpt_plan.directory is None or ckpt_plan.resume == "never":
        return None
    where = ckpt_plan.directory if ckpt_plan.resume == "auto" else ckpt_plan.resume_path
    if is_step_dir(where):
        return Path(where)
    for step in reversed(complete_steps(where)):
        try:
            read_metadata(Path(where) / str(step))
            return Path(where) / str(step)
        except (OSError, ValueError):
            continue
    return None


def check_resume_settings(
    ckpt_plan: CheckpointPlan,
    cfg_dict: dict,
    global_batch: int,
    data_fingerprint: Optional[dict] = None,
    allow_data_change: bool = False,
) -> None:
    """Raises ConfigError (one line) when the checkpoint this run would resume was trained with refused
    settings, or on other data than ``data_fingerprint`` (this run's training data, ``data.load``) unless
    ``allow_data_change`` (then one warning); call before restoring (nothing is read but the JSON metadata). A
    checkpoint that records no fingerprint (saved before they were recorded) resumes, with one warning for a file."""
    step_dir = candidate_step_dir(ckpt_plan)
    if step_dir is None:
        return
    try:
        meta = read_metadata(step_dir)
    except (OSError, ValueError):
        return  # unreadable: checkpoint.resume reports it (one line) or skips to an older step
    conflicts = resume_conflicts(meta.get("config", {}), cfg_dict, meta.get("global_batch"), global_batch)
    if conflicts:
        raise ConfigError(refusal(step_dir, conflicts))
    saved = meta.get("data_fingerprint")
    change = data_change(saved, data_fingerprint)
    if change and not allow_data_change:
        raise ConfigError(data_refusal(step_dir, change))
    if change:
        warn(f"resuming {step_dir} on other data, as checkpoint.allow_data_change=true allows ({change})")
    elif saved is None and data_fingerprint is not None and data_fingerprint.get("kind") == "file":
        warn(
            f"checkpoint {step_dir} records no fingerprint of its training data (saved before they were): that "
            f"{data_fingerprint['file']} is the text it was trained on is not checked"
        )


def _newest_readable(directory: Path, mode, placed_state) -> Optional[Restored]:
    """The newest step of ``directory`` that restores; broken newer ones are warned about and moved aside."""
    for tmp in unfinished_saves(directory):
        warn(f"ignoring {tmp}: a checkpoint save that never finished (the process stopped while writing it)")
    broken: list[Path] = []
    restored = None
    for step in reversed(complete_steps(directory)):
        step_dir = Path(directory) / str(step)
        try:
            restored = restore_step(step_dir, mode, placed_state)
            break
        except ConfigError:
            raise
        except Exception as e:  # truncated / corrupt: tensorstore, orbax and OS errors all land here
            reason = first_line(e, 200)
            warn(f"skipping checkpoint {step_dir}: it is incomplete or corrupt ({type(e).__name__}: {reason})")
            broken.append(step_dir)
    if broken and restored is not None:  # kept in place when nothing restores: the user decides
        for step_dir in broken:
            moved = move_aside(step_dir)
            log.warning("moved the unreadable checkpoint %s to %s", step_dir, moved)
    if restored is not None and broken:
        warn(f"resuming from the previous checkpoint {restored.path} (step {restored.step})")
    return restored


def resume(plan: CheckpointPlan, mode, placed_state) -> Optional[Restored]:
    """The checkpoint this run continues from, restored onto ``mode`` (None: start from step 0).

    ``auto``: the newest readable step in ``plan.directory`` (unfinished or unreadable ones are skipped with
    a warning naming them, and moved aside); ``never``: None; a path: that step folder, or the newest readable
    step of that folder.

    Raises:
      ConfigError: the path's checkpoint is unreadable or does not fit this run; or, resuming from a path,
        ``plan.directory`` already holds checkpoints after the restored step (they would be overwritten).
    """
    if plan.directory is None or plan.resume == "never":
        return None
    if plan.resume == "auto":
        restored = _newest_readable(plan.directory, mode, placed_state)
        if restored is None and complete_steps(plan.directory):
            raise ConfigError(
                f"no readable checkpoint in checkpoint.dir={plan.directory} (see the warnings); "
                f"move its step folders away, or use another checkpoint.dir"
            )
    else:
        path = plan.resume_path
        if is_step_dir(path) or path.name.isdigit():
            try:
                restored = restore_step(path, mode, placed_state)
            except ConfigError:
                raise
            except Exception as e:
                reason = first_line(e, 200)
                raise ConfigError(
                    f"checkpoint.resume={path} cannot be read ({type(e).__name__}: {reason}); give "
                    f"another step folder or its parent folder (the newest readable step)"
                ) from None
        else:
            restored = _newest_readable(path, mode, placed_state)
            if restored is None:
                raise ConfigError(f"checkpoint.resume={path} holds no readable checkpoint (see the warnings)")
        later = [s for s in complete_steps(plan.directory) if s > restored.step]
        if later and plan.directory != restored.path.parent:
            raise ConfigError(
                f"checkpoint.dir={plan.directory} already holds checkpoints after step {restored.step} "
                f"(steps {later}); resuming from {restored.path} would overwrite them: set another "
                f"checkpoint.dir"
            )
        if later:  # rolling back inside the same folder: the later steps belong to the abandoned future
            raise ConfigError(
                f"checkpoint.resume={restored.path} is older than checkpoints {later} in the same "
                f"folder; resume from the newest (checkpoint.resume=auto) or move the later ones away"
            )
    if restored is not None:
        log.info(
            "resuming from %s (step %d, epoch %d, position %d; saved under %s on %d devices, mesh %s)",
            restored.path,
            restored.step,
            restored.metadata.get("epoch", -1),
            restored.metadata.get("position", -1),
            restored.metadata.get("mode"),
            restored.metadata.get("device_count", -1),
            restored.metadata.get("mesh_shape"),
        )
    return restored
