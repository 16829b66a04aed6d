"""The checkpoint store (orbax ``CheckpointManager``): the step folders on disk, saving a state (never a
non-finite one), reading one back onto any device count, mesh or parallel mode, moving a broken one aside.

On disk, one folder per optimizer step under ``checkpoint.dir`` (null: ``<run folder>/checkpoints``)::

    <dir>/<step>/state/      the host-form ``TrainState`` (step int32 [], float32 params, optimizer state,
                             loss-scale state) as OCDBT/zarr arrays; every process writes its own shards
    <dir>/<step>/meta/metadata   JSON: step, epoch, position in the data order, mode, mesh shape, device and
                             process counts, the resolved config, the W&B run id, the run folder (``metadata``)
    <dir>/<step>.orbax-checkpoint-tmp   a save in progress; orbax renames it to ``<step>`` once every file
                             and ``commit_success.txt`` are written, so a crash never leaves a half ``<step>``
    <dir>/<step>.corrupt     a step folder found unreadable on resume, moved aside (orbax ignores the name)

The state is the canonical one of every mode (global arrays, no device axis). The run's parallel mode says what
it is restored into (``host_abstract``, ``restore_target``) and how the state it owns (``TrainState.mode_state``)
is read back (``from_restored``); nothing here asks which mode runs.
Shardings are never read back from a checkpoint: the NEW run's mode gives them, so a state saved under fsdp
on 8 devices restores onto 1 or 2 devices, another mesh or mode.

Saves are asynchronous (``save`` copies the arrays to host memory, ``host_form``, and orbax writes them in a
background thread). The data order is a pure function of
(``train.seed``, step) (``data.pipeline``), as is every per-example random key (``core.step``), so the
step alone fixes where a resumed run continues; epoch and position are recorded for people.

Errors: ``core.errors.ConfigError`` (a checkpoint that does not fit this run's model/optimizer) and
``NonFiniteError`` (parameters or optimizer state not finite: nothing is written). One line each.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import functools
import json
import logging
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any, Iterator, Optional

import jax
import numpy as np

from core.errors import ConfigError, error_text, first_line
from training.checkpoint.policy import NEW_RUN
from tracking.folders import is_run_folder
from parallel.state import (
    device_finite_flags,
    from_restored,
    held_whole,
    host_abstract,
    host_finite_flags,
    restore_target,
)

STATE, META = "state", "meta"
TMP_SUFFIX = ".orbax-checkpoint-tmp"


class NonFiniteError(RuntimeError):
    """The state to save holds NaN/inf; nothing was written (``training.run`` reports it as a TrainingError)."""


class UndeletableError(RuntimeError):
    """More steps beyond ``keep`` could not be deleted than ``keep`` itself (``Saver.check_undeleted``): the folder
    would grow without bound, so the run stops (``training.hooks`` reports it as a TrainingError); every step saved
    is kept."""


class Misfit(ConfigError):
    """A step's arrays do not fit the state built from a config (``detail``: the first array that differs). Readers
    of one step's own config (``python -m evaluate``, ``python -m sample``) treat the step as damaged."""

    def __init__(self, message: str, detail: str):
        super().__init__(message)
        self.detail = detail


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (orbax raised ``OSError`` or ``ValueError`` while writing it, e.g. a full
    disk or a folder that stopped being writable); the message is one line that names the step, the folder, the
    error and the newest complete checkpoint (``training.hooks`` reports it as a TrainingError)."""


class _OrbaxInfoFilter(logging.Filter):
    """Drops orbax's INFO chatter (dozens of lines per save, through absl) from the run's log; keeps warnings, but
    not those of a read (``_quiet_read``), nor orbax's reports of a write that failed with ``OSError``/``ValueError``
    (a full disk: its writer threads log the error with its traceback, two or three times), which the run reports
    itself in one line (``CheckpointWriteError``); ``HYDRA_FULL_ERROR=1`` keeps those."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "orbax" not in record.pathname:
            return True
        failed_write = record.exc_info is not None and isinstance(record.exc_info[1], (OSError, ValueError))
        if failed_write and os.environ.get("HYDRA_FULL_ERROR") != "1":
            return False
        return record.levelno >= logging.WARNING and _reads_in_progress == 0


_reads_in_progress = 0  # restore_step / read_arrays running (_quiet_read)


@contextlib.contextmanager
def _quiet_read() -> Iterator[None]:
    """Drops orbax's warnings and errors while a step folder is read: a read that fails raises, and its reader names
    the damaged step in one line (``training.checkpoint.read_newest``); one that succeeds has read every array and
    checked the step, and orbax's messages then (e.g. "Metadata file does not exist" for a lost
    ``_CHECKPOINT_METADATA``, which only holds timestamps) were printed beside it, twice each."""
    global _reads_in_progress
    _reads_in_progress += 1
    try:
        yield
    finally:
        _reads_in_progress -= 1


_preload: Optional[threading.Thread] = None  # the background import of orbax, once per process


def preload_orbax() -> None:
    """Starts importing ``orbax.checkpoint`` on a background thread (once per process; nothing when it is imported
    already), so that the import (about a second: orbax pulls in tensorstore) overlaps data loading and compilation
    (``training.run.prepare`` calls ``wait_for_orbax`` after them); ``_ocp`` waits for an import in progress. Not a
    daemon: a process ending meanwhile waits for it (Python ends a daemon thread in C++ code with an abort, 134)."""
    global _preload
    if _preload is None and "orbax.checkpoint" not in sys.modules:
        _preload = threading.Thread(target=_import_quietly, name="orbax-import")
        _preload.start()


def wait_for_orbax() -> None:
    """Waits until the import started by ``preload_orbax`` has finished (at once when none was started), so that
    no import runs beside the training steps: a Python import holds the interpreter lock for most of its time,
    and beside the steps of a dispatch-bound step loop it slows them. Imports nothing itself."""
    if _preload is not None:
        _preload.join()


def _import_quietly() -> None:
    """The background import. A process that stops meanwhile (bad input found while orbax loads) exits under it,
    and the import, cut short, printed a traceback after the one-line error: nothing is printed here; an import
    that really fails raises again, with its traceback, in the main thread's own ``_ocp``."""
    try:
        _ocp()
    except BaseException:
        pass


def _ocp():
    import orbax.checkpoint as ocp  # imported lazily: orbax pulls in tensorstore
    from orbax.checkpoint._src import asyncio_utils

    absl_logger = logging.getLogger("absl")
    if not any(isinstance(f, _OrbaxInfoFilter) for f in absl_logger.filters):
        absl_logger.addFilter(_OrbaxInfoFilter())
    # orbax 0.12.8 runs each of its coroutines (every read and write of a checkpoint) through this function
    if getattr(asyncio_utils, "_run_sync_via_new_loop", _run_settled) is not _run_settled:
        asyncio_utils._run_sync_via_new_loop = _run_settled
    return ocp


SETTLE_TIMEOUT_S = 120.0  # how long a failed orbax call waits for its other reads and writes to end
INTERRUPTED_SETTLE_S = 2.0  # the same after a Ctrl-C: a prompt stop first (a second Ctrl-C ends the wait)


def _run_settled(coro):
    """orbax's ``asyncio_utils._run_sync_via_new_loop`` (runs one orbax coroutine to its end on a fresh event loop),
    but the loop is closed only once every task started on it has ended.

    Why: when one read or write of a checkpoint fails (a truncated file, a full disk), orbax's ``asyncio.gather``
    raises at once while the other reads and writes go on; orbax closed the loop under them, and each printed a
    traceback when it ended (TensorStore's "Event loop is closed", Python's "Exception ignored in: <coroutine ...>"
    when the unfinished coroutine was collected): tens of tracebacks beside the one line that reports the error.
    After a Ctrl-C (a ``BaseException``) the wait is short: ``INTERRUPTED_SETTLE_S``."""
    loop, timeout_s = asyncio.new_event_loop(), SETTLE_TIMEOUT_S
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    except Exception:
        raise
    except BaseException:
        timeout_s = INTERRUPTED_SETTLE_S
        raise
    finally:
        try:
            _settle(loop, timeout_s)
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _settle(loop: asyncio.AbstractEventLoop, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
    """Runs ``loop`` until its tasks have ended (at most ``timeout_s``; the rest are cancelled), and marks their
    errors as seen (asyncio would log each "never retrieved"): the first error is the one orbax raised."""
    tasks = asyncio.all_tasks(loop)
    if not tasks:
        return
    _, pending = loop.run_until_complete(asyncio.wait(tasks, timeout=timeout_s))
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.wait(pending, timeout=1.0))
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()


def _handlers() -> dict:
    """The two items of a step: the state (PyTree of arrays) and the JSON metadata."""
    ocp = _ocp()
    return {STATE: ocp.StandardCheckpointHandler(), META: ocp.JsonCheckpointHandler()}


def storage_error_text(error: BaseException, limit: int = 300) -> str:
    """``Type: message`` of the error that failed a checkpoint's read or write, for a one-line message: the innermost
    cause (orbax wraps TensorStore's error in one that only names the array), with TensorStore's quoted absolute
    paths left out so that its reason fits, e.g. ``ValueError: OUT_OF_RANGE: Error reading "params.w/0" in OCDBT
    database: Requested byte range [0, 742536) is not valid for value of size 739419`` or ``... Failed writing:
    No space left on device [os_error_code='28']``."""
    seen = {id(error)}
    while error.__cause__ is not None and id(error.__cause__) not in seen:
        error = error.__cause__
        seen.add(id(error))
    text = re.sub(r'(?::| at local file)? "/[^"]*"', "", first_line(error, 100_000))
    text = re.sub(r"\s*\[tensorstore_spec='.*?'\]", "", text)  # the whole spec of the array, in JSON
    return f"{type(error).__name__}: {text[:limit]}" if text.strip() else type(error).__name__


# ---- what is on disk ---------------------------------------------------------------------------------------
def is_step_dir(path: Path) -> bool:
    """Whether ``path`` is one finished step folder (a name of digits holding ``state/`` and ``meta/``)."""
    path = Path(path)
    return path.name.isdigit() and (path / STATE).is_dir() and (path / META).is_dir()


def any_step_dirs(directory: Path) -> bool:
    """Whether ``directory`` holds any step folder, finished or not (``<step>``, ``<step>.orbax-checkpoint-tmp``)."""
    return Path(directory).is_dir() and any(
        p.name.isdigit() or p.name.endswith(TMP_SUFFIX) for p in Path(directory).iterdir()
    )


def complete_steps(directory: Path) -> list[int]:
    """Steps of the finished (renamed, not ``*.orbax-checkpoint-tmp``) step folders of ``directory``, ascending; a
    run folder named like a step (``.hydra/``, ``summary.json``) is none: never read, moved aside or counted."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit() and not is_run_folder(p))


def odd_entries(directory: Path) -> Optional[str]:
    """``<dir>/30 (a file) is not a checkpoint step folder`` naming every entry of ``directory`` named like a step
    that is not a folder (a file, a broken symbolic link: readers skip it, a save of that step fails on it), or
    None when there is none."""
    directory = Path(directory)
    odd = sorted(p for p in directory.iterdir() if p.name.isdigit() and not p.is_dir()) if directory.is_dir() else []
    if not odd:
        return None
    kind = lambda p: "a broken symbolic link" if p.is_symlink() and not p.exists() else "a file"  # noqa: E731
    names = ", ".join(f"{p} ({kind(p)})" for p in odd)
    return f"{names} {'is not a checkpoint step folder' if len(odd) == 1 else 'are not checkpoint step folders'}"


def unfinished_saves(directory: Path) -> list[Path]:
    """Folders of saves that never finished (the process died while orbax was writing them)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.name.endswith(TMP_SUFFIX))


def read_metadata(step_dir: Path) -> dict:
    """The JSON metadata of one step folder. Raises OSError/ValueError when it is missing or broken."""
    return json.loads((Path(step_dir) / META / "metadata").read_text())


def _name(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _leaf_specs(tree) -> dict[str, tuple[tuple, str]]:
    """``{'params.hidden.kernel.value': ((784, 256), 'float32'), ...}`` (orbax's own leaf names)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {_name(p): (tuple(x.shape), str(np.dtype(x.dtype))) for p, x in leaves}


def finite_flags(state, mode=None) -> tuple[bool, bool]:
    """(params all finite, optimizer state all finite) of a host state or of a placed state."""
    if isinstance(jax.tree.leaves(state.params)[0], np.ndarray):
        return host_finite_flags(state.params, state.opt_state)
    return device_finite_flags(state)


def on_cpu_backend(state) -> bool:
    """Whether the placed ``state``'s arrays live on JAX's CPU backend (their device memory is host memory)."""
    leaf = jax.tree.leaves(state.params)[0]
    return isinstance(leaf, jax.Array) and all(d.platform == "cpu" for d in leaf.devices())


# ---- saving -----------------------------------------------------------------------------------------------
def host_form(state):
    """What ``Saver.save`` hands orbax: ``state`` as host numpy arrays when this process holds every array whole
    (one process: ``jax.device_get``, which gathers the shards of a sharded array), else ``state`` itself
    (several processes: each writes its own shards through orbax's ``jax.Array`` handler).

    Why: orbax's ``jax.Array`` handler saves a replicated array "replica-parallel" by default (each device
    writes a slice; ``ArrayHandler.use_replica_parallel``, on unless ``JAX_PLATFORMS`` names a GPU), which
    in one process only adds work: one slicing program per device and array shape (64 programs at the
    first save of the 8-device GPT state) and their dispatch at every save. From host arrays orbax writes
    the same OCDBT/zarr arrays (``NumpyHandler``) and any mode, mesh or device count restores them, since
    shardings are never read back (module docstring). A save from host arrays costs less CPU and compiles no
    program.

    The copy is made here, before ``save`` returns, as orbax itself does for device arrays; on the CPU
    backend the numpy arrays may share the device buffers, in which case JAX does not donate those
    buffers to the next step (it never donates a buffer with an outside reference) and the step
    writes new ones.
    """
    if jax.process_count() > 1 or not held_whole(state):
        return state
    return jax.device_get(state)


class Saver:
    """Writes checkpoints of one run into ``directory`` (all processes call every method).

    Args:
      directory: the checkpoint folder (created).
      keep: newest checkpoints kept; older ones are deleted by orbax after a successful save.
      async_save: write in a background thread (``save`` returns after the device-to-host copy).
    """

    def __init__(self, directory: Path, keep: int, async_save: bool = True, best_mode: Optional[str] = None):
        ocp = _ocp()
        self.directory = Path(directory)
        self.keep = keep
        self.last_step: Optional[int] = None  # newest step saved (or restored) in this folder by this run
        # Old steps are deleted inside each save's finalize (not on orbax's own thread, enable_background_delete), so
        # the next save waits for the deletion: a back-pressure that bounds the folder to `keep` + 1 steps. On a
        # thread of their own, deletions slower than the saves queue without bound, and the first failed one
        # silently stops the rest until close.
        # One deletion thread: a plain recursive delete of a checkpoint's few files. On a host with 4 or more cores
        # orbax would delete a step with a pool of threads whose scheduler returns only after a 0.1 s queue poll
        # times out: >= 0.1 s more in each save that deletes a step.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
            num_deletion_threads=1,
            # the step's temporary folder made inside save(): a folder that cannot be written fails there, at once.
            # Made in the background, such a failure would leave orbax's writer threads waiting 300 s for the
            # folder's "created" signal before the process could exit.
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
            # best_mode (the best checkpoint's folder): the `keep` steps kept are the best by the metrics each save
            # passes (``{"value": ...}``), not the newest by step number
            **(
                {"best_fn": _best_value, "best_mode": best_mode, "keep_checkpoints_without_metrics": False}
                if best_mode
                else {}
            ),
        )
        self.manager = ocp.CheckpointManager(self.directory, item_handlers=_handlers(), options=options)
        # steps beyond ``keep`` that orbax could not delete, as (step, error): kept on disk, the run goes on
        self.undeleted: list[tuple[int, str]] = []
        self._undeleted_taken = 0
        deleter = getattr(self.manager, "_checkpoint_deleter", None)  # orbax 0.12.8's step deleter
        if callable(getattr(deleter, "delete_steps", None)):
            deleter.delete_steps = functools.partial(_delete_steps_or_keep, deleter.delete_steps, self.undeleted)

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def save(self, state, step: int, metadata: dict, mode, metrics: Optional[dict] = None) -> Path:
        """Saves the placed ``state`` (of ``mode``) as step ``step``; returns the step folder. ``metrics``: what a
        ``best_mode`` saver ranks the step by (``{"value": ...}``).

        Raises:
          NonFiniteError: params or optimizer state hold NaN/inf; nothing is written and the previous
            checkpoints stay as they are.
        """
        if on_cpu_backend(state):
            # the copy orbax is given, made first: the NaN guard reads it (numpy) instead of compiling its device
            # program; a state that stays on the devices (several processes) is checked there
            saved = host_form(state)
            params_ok, opt_ok = finite_flags(saved, mode)
        else:  # an accelerator checks its own arrays (one small program), before any copy
            saved = None
            params_ok, opt_ok = finite_flags(state, mode)
        if not (params_ok and opt_ok):
            what = "parameters" if not params_ok else "optimizer state"
            prev = (
                f"the last good checkpoint is {self.step_dir(self.last_step)} (step {self.last_step})"
                if self.last_step is not None
                else "no earlier checkpoint of this run exists"
            )
            raise NonFiniteError(
                f"{what} are not finite after step {step}: no checkpoint written; {prev}; lower "
                f"optim.lr, enable optim.clip_grad_norm, or, under bf16/fp16, use precision=fp32, {NEW_RUN}"
            )
        ocp = _ocp()
        self.manager.save(
            step,
            args=ocp.args.Composite(
                **{
                    STATE: ocp.args.StandardSave(host_form(state) if saved is None else saved),
                    META: ocp.args.JsonSave(metadata),
                }
            ),
            force=True,
            **({"metrics": metrics} if metrics is not None else {}),
        )
        self.last_step = step
        return self.step_dir(step)

    def check_undeleted(self) -> None:
        """Raises UndeletableError when more than ``keep`` older steps could not be deleted so far (recorded by the
        finalizes the last save waited for): the folder would otherwise grow without bound."""
        if len(self.undeleted) > self.keep:
            undeletable, error = self.undeleted[-1]
            raise UndeletableError(
                f"{len(self.undeleted)} checkpoints older than the newest checkpoint.keep={self.keep} could not be "
                f"deleted from {self.directory} (the last, step {undeletable}: {error}); every checkpoint saved is "
                f"kept: make that folder's contents deletable (or delete those steps) and continue with the same "
                f"command, or set checkpoint.dir to another folder"
            )

    def wait(self) -> None:
        """Blocks until every started save is on disk."""
        self.manager.wait_until_finished()

    def take_undeleted(self) -> list[tuple[int, str]]:
        """The steps beyond ``keep`` that orbax could not delete since the last call, as ``(step, error)``:
        they stay on disk (``_delete_steps_or_keep``)."""
        new = self.undeleted[self._undeleted_taken :]
        self._undeleted_taken += len(new)
        return new

    def close(self) -> None:
        """Waits for pending saves and for orbax's clean-up of leftover temporary folders, then releases orbax's
        threads (also after an error)."""
        try:
            self.manager.wait_until_finished()
            # orbax 0.12: CheckpointManager.__init__ starts removing unfinished step folders of earlier runs in a
            # background future, and only save() waits for it (wait_until_finished and close do not). A run whose
            # first save is refused (NonFiniteError) would exit with it still running:
            # an absl traceback at interpreter shutdown.
            await_cleanup = getattr(self.manager, "_maybe_await_cleanup_tmp_directory", None)
            if await_cleanup is not None:
                await_cleanup()
        finally:
            self.manager.close()


def _best_value(metrics: dict) -> float:
    """The value a ``best_mode`` saver ranks a step by (orbax's ``best_fn``)."""
    return float(metrics["value"])


def _delete_steps_or_keep(delete_steps, undeleted: list, steps) -> None:
    """orbax's deletion of the steps beyond ``keep`` (called in the finalize of the save that pushed them out), one
    step at a time: a step it cannot delete (``OSError``, e.g. a folder without write permission or an immutable
    file) is appended to ``undeleted`` as ``(step, error)`` and kept, possibly in part (a deletion stops at the
    first file it cannot remove; resuming skips a step folder it cannot read), and the others are still deleted.
    Without this orbax's finalize raises, and the next save re-raises it: a traceback that stops a healthy run over a
    folder it only had to remove. A run stops once more than
    ``keep`` steps could not be deleted (``Saver.check_undeleted``), so the folder stays bounded."""
    for step in steps:
        try:
            delete_steps([step])
        except OSError as e:
            undeleted.append((step, error_text(e)))


def metadata(
    *,
    step: int,
    steps_per_epoch: int,
    global_batch: int,
    cfg_dict: dict,
    mode_name: str,
    mesh_shape,
    num_devices: int,
    process_count: int,
    wandb_run_id: Optional[str],
    run_dir: Path,
    reason: str,
    data_fingerprint: Optional[dict] = None,
) -> dict:
    """The JSON saved with a state. ``epoch``/``position``: step = epoch * steps_per_epoch + position;
    ``data_fingerprint``: what the training data was read from (``data.load``; None: synthetic)."""
    epoch, position = divmod(step, steps_per_epoch)
    return {
        "step": step,
        "epoch": epoch,
        "position": position,
        "steps_per_epoch": steps_per_epoch,
        "examples_seen": step * global_batch,
        "global_batch": global_batch,
        "mode": mode_name,
        "mesh_shape": list(mesh_shape),
        "device_count": num_devices,
        "process_count": process_count,
        "wandb_run_id": wandb_run_id,
        "run_dir": str(run_dir),
        "reason": reason,
        "jax_version": jax.__version__,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "data_fingerprint": data_fingerprint,
        "config": cfg_dict,
    }


# ---- restoring --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _saved_step(step_dir: Path) -> Iterator[tuple[Any, int, Any]]:
    """``step_dir``'s folder open (orbax's manager, reads quiet), its step and the saved state's metadata.
    Raises FileNotFoundError when the step has no saved state."""
    ocp, step_dir = _ocp(), Path(step_dir).absolute()
    options = ocp.CheckpointManagerOptions(create=False)
    with _quiet_read(), ocp.CheckpointManager(step_dir.parent, item_handlers=_handlers(), options=options) as manager:
        saved = manager.item_metadata(int(step_dir.name))[STATE]
        if saved is None:
            raise FileNotFoundError(f"{step_dir / STATE} is missing")
        yield manager, int(step_dir.name), saved


def read_arrays(step_dir: Path) -> dict[str, np.ndarray]:
    """Every array of one step folder as host numpy, keyed by orbax's leaf names
    (``params.hidden.kernel.value``, ``opt_state.0.mu...``, ``step``, ``loss_scale.scale``): for inspection and
    tests, independent of any mode or device count."""
    ocp = _ocp()
    with _saved_step(step_dir) as (manager, step, saved):
        tree = saved.tree
        target = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), tree)
        out = manager.restore(step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(target)}))[STATE]
    return {_name(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(out)[0]}


@dataclasses.dataclass
class Restored:
    """A restored checkpoint: the placed state, its step, its folder and its metadata."""

    state: Any
    step: int
    path: Path
    metadata: dict


def restore_step(step_dir: Path, mode, placed_state) -> Restored:
    """Restores one step folder onto ``mode``'s layout (``placed_state`` gives structure and shardings).

    The target is ``parallel.state.restore_target`` of the abstract state (``host_abstract``): the new mode's
    shardings, and the mode-owned state as saved, adapted by ``from_restored``.

    Raises:
      ConfigError: the checkpoint's arrays (names, shapes, dtypes) differ from this run's state (another
        model or optimizer).
      Exception: anything orbax/tensorstore raises for a truncated or corrupt folder.
    """
    ocp = _ocp()
    step_dir = Path(step_dir).absolute()
    abstract = host_abstract(placed_state)
    with _saved_step(step_dir) as (manager, step, saved):
        # state the mode owns (its shape may depend on the device count) is read as saved and adapted by the
        # mode (``from_restored``), so it is left out of the comparison
        own = mode.saved_state_keys
        have, want = (
            {k: v for k, v in _leaf_specs(t).items() if k.split(".")[0] not in own}
            for t in (saved.tree, abstract.replace(mode_state=None))
        )
        if have != want and any(k.startswith("params.") and k.endswith(".value") for k in have):
            raise ConfigError(
                f"checkpoint {step_dir} was written by an earlier version of this repository "
                f"(parameters saved as nnx.State leaves '<name>.value', before commit d3cd98a made "
                f"them plain dicts); evaluate or resume it with that version, or start afresh with "
                f"checkpoint.resume=never and a checkpoint.dir of its own"
            )
        if have != want:
            diff = sorted(set(have.items()) ^ set(want.items()))[0][0]
            raise Misfit(
                f"checkpoint {step_dir} does not fit this run: {diff} is {have.get(diff, 'absent')} "
                f"there but {want.get(diff, 'absent')} here; resume with the checkpoint's model and "
                f"optimizer settings, or start afresh with checkpoint.resume=never and a checkpoint.dir of its own",
                f"{diff} is {have.get(diff, 'absent')} in its arrays but {want.get(diff, 'absent')} by its config",
            )
        target = restore_target(mode, abstract, saved.tree)
        out = manager.restore(
            step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(target), META: ocp.args.JsonRestore()})
        )
    state, saved_step = from_restored(mode, dict(out[STATE]), abstract)
    meta = dict(out[META])
    if saved_step != step or meta.get("step") != step:
        raise ValueError(f"{step_dir} holds step {saved_step} (metadata: {meta.get('step')}), not {step}")
    return Restored(state=state, step=step, path=step_dir, metadata=meta)


def move_aside(step_dir: Path) -> Path:
    """Renames a broken step folder to ``<step>.corrupt[-k]`` (kept for inspection, invisible to orbax)."""
    target = step_dir.with_name(step_dir.name + ".corrupt")
    k = 1
    while target.exists():
        target, k = step_dir.with_name(f"{step_dir.name}.corrupt-{k}"), k + 1
    if jax.process_index() == 0:
        os.replace(step_dir, target)
    if jax.process_count() > 1:
        _ocp().multihost.sync_global_processes(f"checkpoint_move_aside_{step_dir.name}")
    return target
