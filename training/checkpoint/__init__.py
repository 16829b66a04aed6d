"""Checkpoints (orbax): periodic, final and preemption saves; exact resume; restore onto another device count,
mesh or parallel mode; never a non-finite checkpoint. One module per reason to change:

- ``plan``: the validated ``checkpoint.*`` settings of a run (``prepare`` -> ``CheckpointPlan``: where, how
  often, how many, what to resume).
- ``store``: the step folders on disk and orbax (``Saver``, ``restore_step``, ``read_arrays``,
  ``read_metadata``, ``complete_steps``, ``unfinished_saves``, moving a corrupt folder aside); the run's
  parallel mode says how its state is saved and restored, nothing here asks which mode runs.
- ``policy``: what a resumed run may change, what it warns about, what a finished run reports again (pure
  functions of configs, metadata and run files).
- ``resuming``: which checkpoint a run continues from, whether the policy allows it, and restoring it; reading
  the newest complete step of a folder whose newest ones are damaged (``read_newest``, also for evaluate, sample).
- ``run_checkpoints``: ``RunCheckpoints``, the training loop's view (when to save, metadata, summary).
- ``best``: ``BestCheckpoint``, the best evaluated step kept in ``<dir>/best`` (``checkpoint.keep_best``).
- ``saved``: what a run takes from its checkpoint before building (inherited null settings, the tokenizer).

The names below are the package's interface (``from training import checkpoint``; ``checkpoint.resume(...)``).
"""

from training.checkpoint.best import BestCheckpoint, best_step_dir
from training.checkpoint.plan import (
    BEST_DIR,
    BEST_METRICS,
    RESUME_MODES,
    CheckpointPlan,
    claim,
    release_claim,
    default_directory,
    prepare,
)
from training.checkpoint.policy import (
    config_changes,
    data_change,
    data_order_warnings,
    finished_summary,
    history_values,
    history_windows,
    refusal,
    resume_conflicts,
)
from training.checkpoint.resuming import candidate_step_dir, check_resume_settings, read_newest, resume
from training.checkpoint.run_checkpoints import RunCheckpoints
from training.checkpoint.store import (
    META,
    STATE,
    TMP_SUFFIX,
    CheckpointWriteError,
    Misfit,
    NonFiniteError,
    UndeletableError,
    Restored,
    Saver,
    complete_steps,
    finite_flags,
    is_step_dir,
    metadata,
    odd_entries,
    preload_orbax,
    read_arrays,
    read_metadata,
    restore_step,
    storage_error_text,
    unfinished_saves,
    wait_for_orbax,
)
from training.checkpoint.saved import (
    TOKENIZER_FILE,
    check_keep_best,
    inherit_settings,
    save_tokenizer,
    saved_tokenizer,
    tokenizer_beside,
    with_inherited,
)

__all__ = [
    "BEST_DIR",
    "TOKENIZER_FILE",
    "check_keep_best",
    "inherit_settings",
    "save_tokenizer",
    "saved_tokenizer",
    "tokenizer_beside",
    "with_inherited",
    "BEST_METRICS",
    "BestCheckpoint",
    "best_step_dir",
    "META",
    "Misfit",
    "RESUME_MODES",
    "STATE",
    "TMP_SUFFIX",
    "CheckpointPlan",
    "CheckpointWriteError",
    "NonFiniteError",
    "UndeletableError",
    "Restored",
    "RunCheckpoints",
    "Saver",
    "candidate_step_dir",
    "check_resume_settings",
    "claim",
    "release_claim",
    "complete_steps",
    "config_changes",
    "data_change",
    "data_order_warnings",
    "default_directory",
    "finished_summary",
    "finite_flags",
    "history_values",
    "history_windows",
    "is_step_dir",
    "metadata",
    "odd_entries",
    "preload_orbax",
    "prepare",
    "read_arrays",
    "read_metadata",
    "read_newest",
    "refusal",
    "resume",
    "resume_conflicts",
    "restore_step",
    "storage_error_text",
    "unfinished_saves",
    "wait_for_orbax",
]
