"""Which checkpoint a run continues from, whether it may, and restoring it.

``check_resume_settings`` reads only the JSON metadata of the step folder ``resume`` will try first and
refuses settings the resume policy (``training.checkpoint.policy``) does not allow, before anything is
restored. ``resume`` then restores the newest readable step (``checkpoint.resume=auto``) or the given one
onto this run's mode: unfinished saves and unreadable steps are named in a warning, and unreadable ones
are moved aside once an older step restores. ``read_newest`` is that fallback for any reader (resuming,
``python -m evaluate``, ``python -m sample``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Optional, Sequence, TypeVar

from core.errors import USER_ERRORS, ConfigError
from training.checkpoint.plan import CheckpointPlan
from training.checkpoint.policy import data_change, data_refusal, refusal, resume_conflicts
from training.checkpoint.store import (
    Misfit,
    Restored,
    complete_steps,
    is_step_dir,
    move_aside,
    odd_entries,
    read_metadata,
    restore_step,
    storage_error_text,
    unfinished_saves,
)

T = TypeVar("T")

# one logger for the package: its log lines all name training.checkpoint
log = logging.getLogger("training.checkpoint")


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
    saved = meta.get("data_fingerprint")
    compared = bool(saved) and bool(data_fingerprint)  # the file is judged by its bytes, wherever it lies
    conflicts = resume_conflicts(meta.get("config", {}), cfg_dict, meta.get("global_batch"), global_batch, compared)
    if conflicts:
        raise ConfigError(refusal(step_dir, conflicts, resume_path=ckpt_plan.resume_path))
    change = data_change(saved, data_fingerprint)
    if change and not allow_data_change:
        raise ConfigError(data_refusal(step_dir, change, ckpt_plan.resume_path))
    if change:
        log.warning(f"resuming {step_dir} on other data, as checkpoint.allow_data_change=true allows ({change})")
    elif saved is None and data_fingerprint is not None and data_fingerprint.get("kind") == "file":
        log.warning(
            f"checkpoint {step_dir} records no fingerprint of its training data (saved before they were): that "
            f"{data_fingerprint['file']} is the text it was trained on is not checked"
        )


def damaged_text(damaged: Sequence[tuple[Path, str]]) -> str:
    """``checkpoint <dir>/<step> is incomplete or corrupt (<reason>)`` for one damaged step folder, ``checkpoints
    <step>, <step> in <dir> are incomplete or corrupt (step <newest>: <reason>)`` for several (``damaged``: (folder,
    reason), newest first, all in one folder)."""
    if len(damaged) == 1:
        return f"checkpoint {damaged[0][0]} is incomplete or corrupt ({damaged[0][1]})"
    names = ", ".join(d.name for d, _ in damaged)
    where = damaged[0][0].parent
    return f"checkpoints {names} in {where} are incomplete or corrupt (step {damaged[0][0].name}: {damaged[0][1]})"


def read_newest(
    step_dirs: Sequence[Path],
    read: Callable[[Path], T],
    doing: str,
    nothing_left: str,
    move_damaged: bool = False,
    misfit_damaged: bool = False,
) -> tuple[T, Path]:
    """``read(step_dir)`` of the first of ``step_dirs`` (newest first) it succeeds on, and that folder: how resuming,
    ``python -m evaluate`` and ``python -m sample`` read a checkpoint folder whose newest steps may be damaged (a
    missing or truncated file: the process or the disk failed while writing, or a file was lost since).

    The damaged ones before it are named in one warning line that says which step is used instead (``doing``,
    e.g. "evaluating"); with ``move_damaged`` (resuming: a run would save over them) they are moved aside to
    ``<step>.corrupt`` once one reads.

    Raises:
      ConfigError: every one is damaged: one line naming them and ``nothing_left`` (what to do); or ``read``'s own
        user error (``core.errors.USER_ERRORS``: a checkpoint that does not fit, which an older step would not
        either). With ``misfit_damaged`` (``read`` builds each step from its own config), a ``Misfit`` is damage:
        the step's metadata no longer fits its arrays.
    """
    damaged: list[tuple[Path, str]] = []
    for step_dir in step_dirs:
        try:
            result = read(step_dir)
        except Misfit as e:
            if not misfit_damaged:
                raise
            damaged.append((Path(step_dir), f"its metadata does not fit its arrays: {e.detail}"))
            continue
        except USER_ERRORS:
            raise
        except Exception as e:  # truncated / missing: TensorStore, orbax, JSON and OS errors all land here
            damaged.append((Path(step_dir), storage_error_text(e, 200)))
            continue
        if damaged:
            moved = ""
            if move_damaged:
                aside = [move_aside(d) for d, _ in damaged]
                moved = f", moved aside to {', '.join(p.name for p in aside)}"
            log.warning(f"{damaged_text(damaged)}{moved}; {doing} the newest complete one, {step_dir}")
        return result, Path(step_dir)
    if not damaged:
        raise ConfigError(nothing_left)
    raise ConfigError(f"{damaged_text(damaged)}; {nothing_left}")


def _warn_unfinished(directory: Path) -> None:
    if odd_entries(directory):  # another run's folder (a run's own refuses such entries: checkpoint.prepare)
        log.warning(f"{odd_entries(directory)}: ignored")
    for tmp in unfinished_saves(directory):
        log.warning(f"ignoring {tmp}: a checkpoint save that never finished (the process stopped while writing it)")


def _newest_readable(directory: Path, mode, placed_state, nothing_left: str, own: bool = True) -> Restored:
    """The newest step of ``directory`` that restores (``read_newest``); damaged newer ones are moved aside when
    ``directory`` is this run's own (its ``checkpoint.dir``: it would save over them), never in another run's."""
    _warn_unfinished(directory)
    steps = [Path(directory) / str(s) for s in reversed(complete_steps(directory))]
    restored, _ = read_newest(
        steps, lambda d: restore_step(d, mode, placed_state), "resuming from", nothing_left, move_damaged=own
    )
    return restored


def resume(plan: CheckpointPlan, mode, placed_state) -> Optional[Restored]:
    """The checkpoint this run continues from, restored onto ``mode`` (None: start from step 0).

    ``auto``: the newest readable step in ``plan.directory`` (unfinished or unreadable ones are skipped with
    a warning naming them, and moved aside); ``never``: None; a path: that step folder, or the newest readable
    step of that folder (another run's: nothing in it is moved).

    Raises:
      ConfigError: the path's checkpoint is unreadable or does not fit this run; or, resuming from a path,
        ``plan.directory`` already holds checkpoints after the restored step (they would be overwritten).
    """
    if plan.directory is None or plan.resume == "never":
        return None
    if plan.resume == "auto":
        restored = None
        if complete_steps(plan.directory):
            restored = _newest_readable(
                plan.directory,
                mode,
                placed_state,
                f"no complete checkpoint is left in checkpoint.dir={plan.directory} to resume from: move its step "
                f"folders away to start over, or use another checkpoint.dir",
            )
        else:
            _warn_unfinished(plan.directory)
    else:
        path = plan.resume_path
        if is_step_dir(path) or (path.name.isdigit() and not complete_steps(path)):  # "7/": a folder of steps
            try:
                restored = restore_step(path, mode, placed_state)
            except ConfigError:
                raise
            except Exception as e:
                raise ConfigError(
                    f"checkpoint.resume={path} cannot be read: it is incomplete or corrupt "
                    f"({storage_error_text(e, 200)}); give another step folder or its parent folder (the newest "
                    f"complete step)"
                ) from None
        else:
            restored = _newest_readable(
                path,
                mode,
                placed_state,
                f"checkpoint.resume={path} holds no complete checkpoint: give another folder",
                own=Path(path).resolve() == Path(plan.directory).resolve(),
            )
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
