"""Checkpoints (orbax ``CheckpointManager``): periodic, final and preemption saves; exact resume; restore onto
another device count, mesh or parallel mode; never a non-finite checkpoint.

On disk, one folder per optimizer step under ``checkpoint.dir`` (null: ``<run folder>/checkpoints``)::

    <dir>/<step>/state/      the host-form ``TrainState`` (step int32 [], float32 params, optimizer state,
                             loss-scale state) as OCDBT/zarr arrays; every process writes its own shards
    <dir>/<step>/meta/metadata   JSON: step, epoch, position in the data order, mode, mesh shape, device and
                             process counts, the resolved config, the W&B run id, the run folder (``metadata``)
    <dir>/<step>.orbax-checkpoint-tmp   a save in progress; orbax renames it to ``<step>`` once every file
                             and ``commit_success.txt`` are written, so a crash never leaves a half ``<step>``
    <dir>/<step>.corrupt     a step folder found unreadable on resume, moved aside (orbax ignores the name)

"Host form" is the state every layout shares: no leading device axis (pmap's placed state has one; it is
detected as ``ndim(state.step) > 0``, ``step`` being a scalar). Shardings are never read back from a
checkpoint: ``restore`` builds the abstract host state with ``jax.eval_shape`` and asks the NEW run's mode for
``state_shardings``, so a state saved under fsdp on 8 devices restores onto 1 or 2 devices, another mesh or
mode (pmap: restored on the host, then ``mode.place_state``).

Saves are asynchronous (orbax copies the arrays to host memory in ``save`` and writes them in a background
thread; the donated device buffers can be reused at once). The data order is a pure function of
(``train.seed``, step) (``data.pipeline``), as is every per-example random key (``core.step``), so the
step alone fixes where a resumed run continues; epoch and position are recorded for people.

Errors: ``core.errors.ConfigError`` (bad ``checkpoint.*`` settings, a resume path that does not exist, a
checkpoint that does not fit this run's model/optimizer) and ``core.errors.TrainingError``-compatible
``NonFiniteError`` (parameters or optimizer state not finite: nothing is written). One line each.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np

from conf.schema import CheckpointConfig
from core.errors import ConfigError
from parallel.base import host_finite_flags

log = logging.getLogger(__name__)

STATE, META = "state", "meta"
RESUME_MODES = ("auto", "never")
TMP_SUFFIX = ".orbax-checkpoint-tmp"


class NonFiniteError(RuntimeError):
    """The state to save holds NaN/inf; nothing was written (``training.run`` reports it as a TrainingError)."""


class _OrbaxInfoFilter(logging.Filter):
    """Drops orbax's INFO chatter (dozens of lines per save, through absl) from the run's log; keeps warnings."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or "orbax" not in record.pathname


def _ocp():
    import orbax.checkpoint as ocp  # imported lazily: orbax pulls in tensorstore (~1 s)

    absl_logger = logging.getLogger("absl")
    if not any(isinstance(f, _OrbaxInfoFilter) for f in absl_logger.filters):
        absl_logger.addFilter(_OrbaxInfoFilter())
    return ocp


def _handlers() -> dict:
    """The two items of a step: the state (PyTree of arrays) and the JSON metadata."""
    ocp = _ocp()
    return {STATE: ocp.StandardCheckpointHandler(), META: ocp.JsonCheckpointHandler()}


def warn(line: str) -> None:
    """A warning the user must see: stderr (via ``training.report.console``) and the log."""
    from training.report import console

    log.warning("%s", line)
    console(f"warning: {line}")


# ---- settings --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CheckpointPlan:
    """Validated ``checkpoint.*`` settings of one run.

    directory: absolute folder the run saves into (None: checkpointing disabled).
    every: ``checkpoint.every`` as given (None: once per epoch; 0: only at the end / on a signal).
    keep: checkpoints kept (orbax ``max_to_keep``).
    resume: 'auto' | 'never' | 'path'.
    resume_path: absolute path for resume='path' (a checkpoint folder or one ``<step>`` folder in it).
    """

    directory: Optional[Path]
    every: Optional[int]
    keep: int
    resume: str
    resume_path: Optional[Path]

    def every_steps(self, steps_per_epoch: int) -> int:
        """Steps between periodic saves (0: none)."""
        return steps_per_epoch if self.every is None else self.every

    def saves_at(self, done: int, n_steps: int, steps_per_epoch: int) -> bool:
        """Whether the state after ``done`` optimizer steps is saved (periodic, or the last step)."""
        if self.directory is None:
            return False
        every = self.every_steps(steps_per_epoch)
        return done == n_steps or (every > 0 and done % every == 0)


def default_directory(run_dir: Path, process_count: int, environ=os.environ) -> Path:
    """``checkpoint.dir`` when it is null.

    One process: ``<run folder>/checkpoints``. Several processes: every process has its own (timestamped) run
    folder, so only a folder derived from ``SLURM_JOB_ID`` (``./checkpoints/slurm-<id>``, the same on every
    host and across ``scontrol requeue``) is shared.

    Raises:
      ConfigError: several processes and no SLURM job id.
    """
    if process_count == 1:
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
      ConfigError (one line): ``every`` < 0, ``keep`` < 1, several processes without a shared folder, or
      ``resume`` a path that does not exist or holds no checkpoint.
    """
    if cfg.every is not None and cfg.every < 0:
        raise ConfigError(f"checkpoint.every={cfg.every} must be >= 0 (0: only at the end; null: every epoch)")
    if cfg.keep < 1:
        raise ConfigError(f"checkpoint.keep={cfg.keep} must be >= 1")
    resume, resume_path = cfg.resume, None
    if resume not in RESUME_MODES:
        resume_path = Path(resume).expanduser().absolute()
        if not resume_path.exists():
            raise ConfigError(
                f"checkpoint.resume={cfg.resume} does not exist; give a checkpoint folder (or one "
                f"<step> folder in it), auto (the newest in checkpoint.dir) or never"
            )
        if not is_step_dir(resume_path) and not complete_steps(resume_path) and not _any_step_dirs(resume_path):
            raise ConfigError(
                f"checkpoint.resume={cfg.resume} holds no checkpoint (no <step> folder with "
                f"{STATE}/ and {META}/); give a checkpoint folder, auto or never"
            )
        resume = "path"
    if not cfg.enabled:
        if resume == "path":
            raise ConfigError(
                f"checkpoint.resume={cfg.resume} with checkpoint.enabled=false; enable checkpoints to resume"
            )
        return CheckpointPlan(directory=None, every=cfg.every, keep=cfg.keep, resume="never", resume_path=None)
    directory = Path(cfg.dir).expanduser() if cfg.dir else default_directory(run_dir, process_count)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"checkpoint.dir={directory} is a file; give a folder")
    if resume == "never" and complete_steps(directory):
        raise ConfigError(
            f"checkpoint.resume=never but checkpoint.dir={directory} already holds checkpoints "
            f"(steps {complete_steps(directory)}); use another checkpoint.dir, or "
            f"checkpoint.resume=auto to continue from the newest"
        )
    return CheckpointPlan(
        directory=directory.absolute(), every=cfg.every, keep=cfg.keep, resume=resume, resume_path=resume_path
    )


# ---- what is on disk ---------------------------------------------------------------------------------------
def is_step_dir(path: Path) -> bool:
    """Whether ``path`` is one finished step folder (a name of digits holding ``state/`` and ``meta/``)."""
    path = Path(path)
    return path.name.isdigit() and (path / STATE).is_dir() and (path / META).is_dir()


def _any_step_dirs(directory: Path) -> bool:
    return Path(directory).is_dir() and any(
        p.name.isdigit() or p.name.endswith(TMP_SUFFIX) for p in Path(directory).iterdir()
    )


def complete_steps(directory: Path) -> list[int]:
    """Steps of the finished (renamed, not ``*.orbax-checkpoint-tmp``) step folders of ``directory``, ascending."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def unfinished_saves(directory: Path) -> list[Path]:
    """Folders of saves that never finished (the process died while orbax was writing them)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.name.endswith(TMP_SUFFIX))


def read_metadata(step_dir: Path) -> dict:
    """The JSON metadata of one step folder. Raises OSError/ValueError when it is missing or broken."""
    import json

    return json.loads((Path(step_dir) / META / "metadata").read_text())


def _name(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _leaf_specs(tree) -> dict[str, tuple[tuple, str]]:
    """``{'params.hidden.kernel.value': ((784, 256), 'float32'), ...}`` (orbax's own leaf names)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {_name(p): (tuple(x.shape), str(np.dtype(x.dtype))) for p, x in leaves}


def finite_flags(state, mode) -> tuple[bool, bool]:
    """(params all finite, optimizer state all finite) of a host-form state or of ``mode``'s placed state."""
    if isinstance(jax.tree.leaves(state.params)[0], np.ndarray):
        return host_finite_flags(state.params, state.opt_state)
    return mode.finite_flags(state)


# ---- saving -----------------------------------------------------------------------------------------------
class Saver:
    """Writes checkpoints of one run into ``directory`` (all processes call every method).

    Args:
      directory: the checkpoint folder (created).
      keep: newest checkpoints kept; older ones are deleted by orbax after a successful save.
      async_save: write in a background thread (``save`` returns after the device-to-host copy).
    """

    def __init__(self, directory: Path, keep: int, async_save: bool = True):
        ocp = _ocp()
        self.directory = Path(directory)
        self.last_step: Optional[int] = None  # newest step saved (or restored) in this folder by this run
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save, cleanup_tmp_directories=True
        )
        self.manager = ocp.CheckpointManager(self.directory, item_handlers=_handlers(), options=options)

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def save(self, state, step: int, metadata: dict, mode) -> Path:
        """Saves the placed ``state`` (of ``mode``) as step ``step``; returns the step folder.

        Raises:
          NonFiniteError: params or optimizer state hold NaN/inf; nothing is written and the previous
            checkpoints stay as they are.
        """
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
                f"optim.lr, enable optim.clip_grad_norm, or, under bf16/fp16, use precision=fp32"
            )
        ocp = _ocp()
        to_save = mode.state_for_save(state)
        self.manager.save(
            step,
            args=ocp.args.Composite(**{STATE: ocp.args.StandardSave(to_save), META: ocp.args.JsonSave(metadata)}),
            force=True,
        )
        self.last_step = step
        return self.step_dir(step)

    def wait(self) -> None:
        """Blocks until every started save is on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases orbax's threads (also after an error)."""
        try:
            self.manager.wait_until_finished()
        finally:
            self.manager.close()


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
) -> dict:
    """The JSON saved with a state. ``epoch``/``position``: step = epoch * steps_per_epoch + position."""
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
        "config": cfg_dict,
    }


# ---- restoring --------------------------------------------------------------------------------------------
def read_arrays(step_dir: Path) -> dict[str, np.ndarray]:
    """Every array of one step folder as host numpy, keyed by orbax's leaf names
    (``params.hidden.kernel.value``, ``opt_state.0.mu...``, ``step``, ``loss_scale.scale``): for inspection and
    tests, independent of any mode or device count."""
    ocp = _ocp()
    step_dir = Path(step_dir).absolute()
    with ocp.CheckpointManager(
        step_dir.parent, item_handlers=_handlers(), options=ocp.CheckpointManagerOptions(create=False)
    ) as manager:
        step = int(step_dir.name)
        tree = manager.item_metadata(step)[STATE].tree
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

    The target is the host-form abstract state (``jax.eval_shape``) with the new mode's ``state_shardings``
    (modes with a device axis: restored to host numpy, then ``mode.place_state``).

    Raises:
      ConfigError: the checkpoint's arrays (names, shapes, dtypes) differ from this run's state (another
        model or optimizer).
      Exception: anything orbax/tensorstore raises for a truncated or corrupt folder.
    """
    ocp = _ocp()
    step_dir = Path(step_dir).absolute()
    abstract = mode.host_abstract(placed_state)
    with ocp.CheckpointManager(
        step_dir.parent, item_handlers=_handlers(), options=ocp.CheckpointManagerOptions(create=False)
    ) as manager:
        step = int(step_dir.name)
        saved = manager.item_metadata(step)[STATE]
        if saved is None:
            raise FileNotFoundError(f"{step_dir / STATE} is missing")
        # the int8 residual's shape depends on the device count; it is read as saved (host numpy)
        # and adapted below (kept, or reset to zero with a warning), so it is left out of the comparison.
        saved_residual = saved.tree.get("grad_residual") if isinstance(saved.tree, dict) else None
        residual_target = mode.feedback.restore_target(saved_residual)
        have, want = (
            {k: v for k, v in _leaf_specs(t).items() if not k.startswith("grad_residual.")}
            for t in (saved.tree, abstract.replace(grad_residual=None))
        )
        if have != want and any(k.startswith("params.") and k.endswith(".value") for k in have):
            raise ConfigError(
                f"checkpoint {step_dir} was written by an earlier version of this repository "
                f"(parameters saved as nnx.State leaves '<name>.value', before commit d3cd98a made "
                f"them plain dicts); evaluate or resume it with that version, or set "
                f"checkpoint.resume=never / another checkpoint.dir"
            )
        if have != want:
            diff = sorted(set(have.items()) ^ set(want.items()))[0][0]
            raise ConfigError(
                f"checkpoint {step_dir} does not fit this run: {diff} is {have.get(diff, 'absent')} "
                f"there but {want.get(diff, 'absent')} here; resume with the checkpoint's model and "
                f"optimizer settings, or set checkpoint.resume=never / another checkpoint.dir"
            )
        target = mode.restore_target(abstract).replace(grad_residual=residual_target)
        out = manager.restore(
            step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(target), META: ocp.args.JsonRestore()})
        )
    state, meta = out[STATE], dict(out[META])
    # keep the residual when saved for this device count, else zeros (warning); None when unused
    residual = None
    if placed_state.grad_residual is not None:
        residual = mode.feedback.adapt(state.grad_residual, abstract.params)
    state, saved_step = mode.from_restored(state, abstract, residual)
    if saved_step != step or meta.get("step") != step:
        raise ValueError(f"{step_dir} holds step {saved_step} (metadata: {meta.get('step')}), not {step}")
    return Restored(state=state, step=step, path=step_dir, metadata=meta)


def _move_aside(step_dir: Path) -> Path:
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
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            warn(f"skipping checkpoint {step_dir}: it is incomplete or corrupt ({type(e).__name__}: {reason})")
            broken.append(step_dir)
    if broken and restored is not None:  # kept in place when nothing restores: the user decides
        for step_dir in broken:
            moved = _move_aside(step_dir)
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
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
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


def data_order_warnings(saved: dict, *, global_batch: int, seed: int, steps_per_epoch: int, data: str) -> list[str]:
    """Why the resumed data order differs from the saved run's (empty: it is the same)."""
    cfg = saved.get("config", {})
    out = []
    checks = (
        ("train.global_batch", saved.get("global_batch"), global_batch),
        ("train.seed", cfg.get("train", {}).get("seed"), seed),
        ("steps per epoch", saved.get("steps_per_epoch"), steps_per_epoch),
        ("data.name", cfg.get("data", {}).get("name"), data),
    )
    for key, old, new in checks:
        if old is not None and old != new:
            out.append(
                f"{key} is {new} but the checkpoint was trained with {old}: the data order after the "
                f"restored step is not the one the saved run would have seen"
            )
    return out


# ---- the training loop's view --------------------------------------------------------------------------------
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
        self.saver = Saver(plan.directory, plan.keep) if plan.directory is not None else None
        self.last_path: Optional[Path] = None
        if self.saver is not None and restored_step is not None and plan.resume_path is None:
            self.saver.last_step, self.last_path = restored_step, self.saver.step_dir(restored_step)

    @property
    def enabled(self) -> bool:
        return self.saver is not None

    def saves_at(self, done: int) -> bool:
        return self.plan.saves_at(done, self.n_steps, self.steps_per_epoch)

    def save(self, state, done: int, wandb_run_id: Optional[str], reason: str) -> Optional[Path]:
        """Saves the state after ``done`` steps (asynchronously); None when disabled or already saved.

        Raises:
          NonFiniteError: the state is not finite (nothing written).
        """
        if self.saver is None or self.saver.last_step == done:
            return self.last_path if self.saver is not None and self.saver.last_step == done else None
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
        log.info("checkpoint of step %d -> %s (%s)", done, self.last_path, reason)
        return self.last_path

    def close(self) -> None:
        """Waits until every save is on disk (also after an error: the last good checkpoint stays whole)."""
        if self.saver is not None:
            self.saver.close()

    def summary(self) -> dict:
        if self.saver is None:
            return {}
        return {
            "checkpoint/dir": str(self.plan.directory),
            "checkpoint/last_step": self.saver.last_step,
            "checkpoint/last_path": str(self.last_path) if self.last_path else None,
        }


IGNORED_CHANGES = ("checkpoint.", "wandb.", "profile.", "data.cache_dir", "data.data_dir", "distributed.")


def config_changes(saved_cfg: dict, cfg_dict: dict, limit: int = 6) -> list[str]:
    """``key: saved -> now`` for every config value that differs from the checkpoint's (where to save, W&B,
    profiling and data paths are left out), at most ``limit`` of them: a resumed run with another device count
    or mode is legitimate, a checkpoint.dir shared by the jobs of a sweep is a mistake; the user sees which."""

    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    old, new = flat(saved_cfg), flat(cfg_dict)
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k) and not k.startswith(IGNORED_CHANGES))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys[:limit]] + (
        [f"... {len(keys) - limit} more"] if len(keys) > limit else []
    )
