"""Where numbers go: ``metrics.jsonl`` and ``summary.json`` in the run folder, and W&B.

Only process 0 reports; the others construct a ``Reporter`` with ``enabled=False`` that does nothing. Across
restarts ``metrics.jsonl`` holds every step once (a resumed run keeps the records up to its checkpoint,
``continue_metrics``; a restart without one sets the file aside, ``start_metrics``), and every start that trains
is a new W&B run that first replays the kept records, so the W&B run named by ``summary.json`` holds every step
exactly once (docs/internals.md, "W&B history across restarts", says why the W&B id is not resumed).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from conf.schema import Config, as_dict

log = logging.getLogger(__name__)
_OFFLINE_HINT_SHOWN = False  # the offline-W&B hint was logged in this process

WANDB_MODES = ("online", "offline", "disabled")
_WANDB_ENV_ALIASES = {"dryrun": "offline", "run": "online", "shared": "online"}  # W&B's older and other names


NONFINITE_KEY = "nonfinite"


def jsonable(value: Any) -> Any:
    """numpy / jax scalars -> Python numbers; NaN/inf -> None (strict JSON has no NaN/Infinity)."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "item") and np.ndim(value) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def strict_record(record: dict) -> dict:
    """``record`` as strict JSON: every non-finite float becomes ``null`` and the key ``nonfinite`` maps each
    such top-level key to the value it had (``"nan"``, ``"inf"`` or ``"-inf"``), e.g.
    ``{"step": 1, "eval/loss": null, "nonfinite": {"eval/loss": "inf"}}``; finite records are unchanged."""
    bad = {}
    for k, v in record.items():
        if hasattr(v, "item") and np.ndim(v) == 0:
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            bad[k] = str(v)
    out = jsonable(record)
    if bad:
        out[NONFINITE_KEY] = {**out.get(NONFINITE_KEY, {}), **bad}
    return out


def write_json(path: Path, obj: dict) -> None:
    """Writes ``obj`` atomically (tmp file + rename) as strict JSON (``strict_record``)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(strict_record(obj), indent=2, sort_keys=True, allow_nan=False) + "\n")
    os.replace(tmp, path)


def write_summary(run_dir: Path, values: dict) -> None:
    """Writes ``run_dir/summary.json``; one already there (a reused run folder) is kept as
    ``summary.previous-<time>.json`` first, with a warning, so nothing a user saved is lost. The placeholder of a
    sweep's job that never started (``status: skipped``: the sweep was stopped before it) is no run's result: it
    is replaced without a copy or a warning when the resumed sweep runs the job."""
    path = Path(run_dir) / "summary.json"
    if path.exists() and _never_started(path):
        path.unlink()
    if path.exists():
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
        backup = path.with_name(f"summary.previous-{stamp}.json")
        if not backup.exists():
            os.replace(path, backup)
            log.warning("%s already existed: kept as %s", path, backup.name)
    write_json(path, values)


def _never_started(path: Path) -> bool:
    """Whether the summary at ``path`` is a placeholder of a job that never started (``status: skipped``)."""
    try:
        return json.loads(path.read_text()).get("status") == "skipped"
    except (OSError, ValueError, AttributeError):
        return False


def resolve_wandb_mode(mode: Optional[str]) -> str:
    """``mode``, else the environment's ``WANDB_MODE``, else 'online' with a W&B API key (env or netrc), else
    'offline'. Raises ValueError for an unknown mode or a ``WANDB_MODE`` W&B would refuse (unless disabled)."""
    if mode is not None and mode not in WANDB_MODES:
        raise ValueError(f"wandb.mode={mode!r} is unknown; choose one of online, offline, disabled (or null)")
    env = os.environ.get("WANDB_MODE")
    if env is not None and env not in (*WANDB_MODES, *_WANDB_ENV_ALIASES) and mode != "disabled":
        # W&B itself reads WANDB_MODE and refuses other values with a traceback (wandb.Settings)
        raise ValueError(
            f"the environment variable WANDB_MODE={env!r} is not a W&B mode; unset it or set it to online, offline "
            "or disabled"
        )
    if mode is not None:
        return mode
    if env is not None:
        return _WANDB_ENV_ALIASES.get(env, env)
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        import netrc

        auth = netrc.netrc().authenticators("api.wandb.ai")
        if auth and auth[2]:
            return "online"
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        pass
    return "offline"


def prestart_wandb(mode: Optional[str], process_priority: str = "normal") -> None:
    """Starts the W&B process (``tracking.wandb_process.prestart``: it imports wandb and waits) when this process
    will report to W&B: process 0 (of a multi-process job: ``training.distributed.settings``) and a ``wandb.mode``
    that resolves to online or offline. Creates no W&B run; a bad ``WANDB_MODE`` is reported later, at start."""
    from tracking import wandb_process
    from training.distributed import settings

    s = settings()
    if s is not None and s.process_id > 0:
        return
    try:
        resolved = resolve_wandb_mode(mode)
    except ValueError:
        return
    if resolved != "disabled":
        wandb_process.prestart(process_priority, resolved)


class Reporter:
    """Writes records to ``metrics.jsonl`` and W&B, the summary to ``summary.json`` and W&B's summary; with
    ``enabled`` False (processes other than 0) every method does nothing."""

    def __init__(self, run_dir: Path, enabled: bool = True):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.wandb_process = None  # tracking.wandb_process.WandbProcess: W&B in its own process
        self.wandb_error: Optional[str] = None  # W&B failed in its process; the run went on without it
        self._wandb_started: Optional[dict] = None  # the W&B process's ``started`` reply
        self._wandb_run_id: Optional[str] = None
        self._abandoned = None  # the W&B process dropped after a failure, reaped at close
        self.previous_run_id: Optional[str] = None
        self._jsonl = None

    # ---- W&B -------------------------------------------------------------------------------------
    def start_wandb(
        self,
        mode: str,
        project: str,
        entity: Optional[str],
        group: Optional[str],
        job_type: str,
        tags: list[str],
        config: dict,
        init_timeout_s: float,
        previous_run_id: Optional[str] = None,
        process_priority: str = "normal",
    ) -> None:
        """Starts a new W&B run (a fresh id, never a resumed one) inside the run folder, in W&B's own process
        (``tracking.wandb_process``): returns once ``wandb.init`` is sent, with the id chosen (``wandb_run_id``).

        ``previous_run_id``: the W&B run of the checkpoint this run continues (None from step 0); named in the
        config (``resumed.*``), the tag ``resumed`` and the summary, never resumed (module docstring). Online
        failure -> offline within ``init_timeout_s``; a failure of W&B never stops the run (``_drop_wandb``).
        """
        if not self.enabled or mode == "disabled":
            return
        from tracking import wandb_process

        if previous_run_id is not None:
            tags = [*tags, "resumed"]
            config = {**config, "resumed": {"previous_wandb_run_id": previous_run_id}}
        self.previous_run_id = previous_run_id
        kwargs = dict(
            project=project,
            entity=entity,
            group=group,
            job_type=job_type,
            tags=tags,
            config=config,
            dir=str(self.run_dir),
            reinit="finish_previous",
        )
        settings = dict(init_timeout=init_timeout_s, console="off", x_disable_stats=True, silent=True)
        self.wandb_process = wandb_process.for_run(process_priority, mode)
        self.wandb_process.on_started = self._on_wandb_started
        self._wandb_run_id = self.wandb_process.init(mode, kwargs, settings)

    def _on_wandb_started(self, info: dict) -> None:
        """Keeps what ``wandb.init`` in the W&B process reported; logs its fallback to offline at once."""
        self._wandb_started = info
        if info.get("warning"):
            log.warning(info["warning"])  # on stderr too: the run recovered, the user must still see it

    def _check_wandb(self) -> None:
        """Drops W&B (``_drop_wandb``) when its process reported errors since the last check."""
        if self.wandb_process is not None:
            errors = self.wandb_process.take_errors()
            if errors:
                self._drop_wandb(errors)

    def _drop_wandb(self, errors: list[str]) -> None:
        """W&B failed in its process: one warning line, no more W&B calls, ``wandb/error`` in the summary; the
        training and metrics.jsonl go on (the W&B process, if alive, finishes its run with exit code 1)."""
        self.wandb_error = "; ".join(errors)
        log.warning(
            f"W&B failed ({self.wandb_error}); the run goes on without W&B: metrics.jsonl and summary.json keep every "
            f"record"
        )
        self._abandoned, self.wandb_process = self.wandb_process, None
        if self._abandoned is not None:
            self._abandoned.abandon()

    def _offline_hint(self) -> None:
        """The offline run's ``wandb sync`` line, once per process (the jobs of a sweep get one line at its end)."""
        info = self._wandb_started
        if info is None or info["mode"] != "offline" or self.wandb_error is not None:
            return
        global _OFFLINE_HINT_SHOWN
        level = logging.DEBUG if _OFFLINE_HINT_SHOWN else logging.INFO
        _OFFLINE_HINT_SHOWN = True
        log.log(level, "W&B is offline; upload the run later with: wandb sync %s", info["dir"])

    @property
    def wandb_info(self) -> dict:
        """``wandb/run_id``, ``wandb/run_dir``, ``wandb/group`` (and ``wandb/previous_run_id``) of this run's W&B
        run, waiting for ``wandb.init`` in the W&B process; ``wandb/error`` when W&B failed there (the W&B run,
        if it started, is incomplete). {} without W&B."""
        if self.wandb_process is not None:
            self.wandb_process.started()
            self._check_wandb()
        info: dict[str, Any] = {}
        started = self._wandb_started
        if started is not None:
            info = {"wandb/run_id": started["id"], "wandb/run_dir": started["dir"], "wandb/group": started["group"]}
        if self.wandb_error is not None:
            info["wandb/error"] = self.wandb_error
        if info and self.previous_run_id is not None:
            info["wandb/previous_run_id"] = self.previous_run_id
        return info

    @property
    def wandb_run_id(self) -> Optional[str]:
        """This run's W&B run id (known before ``wandb.init`` has finished: it is chosen here), or None."""
        if self.wandb_error is not None and self._wandb_started is None:  # wandb.init failed: no such run
            return None
        return self._wandb_run_id

    def _wandb_log(self, rec: dict) -> None:
        """One strict-JSON record (``strict_record``) into the W&B history at its ``step``: numbers only
        (``null`` for a non-finite value, strings, lists and the ``nonfinite`` map are left out)."""
        self.wandb_process.log(
            {k: v for k, v in rec.items() if k != "step" and v is not None and not isinstance(v, (str, list, dict))},
            int(rec["step"]),
        )

    # ---- records ---------------------------------------------------------------------------------
    # checkpoints: a resumed run continues metrics.jsonl
    def continue_metrics(self, previous: Optional[Path], step: int, final_step: int) -> int:
        """Starts this run's metrics.jsonl as the history of a run resumed after optimizer step ``step``: the
        records of ``previous`` (the saved run's file) up to ``step``, the later ones (written after the checkpoint
        by a run that crashed) and a cut-off last line dropped; at ``final_step`` the final evaluation's record too
        (this run writes it again). The kept records are replayed into this run's W&B history. Call it before
        ``log``. Returns the number of records kept (0 when ``previous`` does not exist).
        """
        if not self.enabled:
            return 0
        target = self.run_dir / "metrics.jsonl"
        source = Path(previous) if previous is not None else target
        kept: list[dict] = []
        if source.exists():
            for line in source.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                s = int(rec.get("step", -1))
                if s < step or (s == step and (step < final_step or "train/loss" in rec)):
                    kept.append(rec)
        elif previous is not None:
            log.warning("the resumed run's metrics.jsonl (%s) is gone; %s starts at step %d", source, target, step + 1)
        tmp = target.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(rec, sort_keys=True) + "\n" for rec in kept))
        os.replace(tmp, target)
        if self.wandb_process is not None:
            self.wandb_process.config_update({"resumed": {"previous_wandb_run_id": self.previous_run_id, "step": step}})
            for rec in kept:
                self._wandb_log(rec)
            self.wandb_process.flush()
            self._check_wandb()
        return len(kept)

    def start_metrics(self) -> Optional[Path]:
        """Starts an empty metrics.jsonl for a run from step 0; one already there (a run killed before its first
        checkpoint, or not resumed, in the same folder) is kept as ``metrics.previous-<time>.jsonl`` and returned."""
        if not self.enabled:
            return None
        path = self.run_dir / "metrics.jsonl"
        if not path.exists() or path.stat().st_size == 0:
            return None
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
        backup = path.with_name(f"metrics.previous-{stamp}.jsonl")
        os.replace(path, backup)
        log.warning("%s held an earlier run's history; this run starts at step 0: kept as %s", path, backup.name)
        return backup

    def log(self, records: list[dict]) -> None:
        """Appends records (each carries ``step``) to metrics.jsonl and the W&B history."""
        if not self.enabled or not records:
            return
        if self._jsonl is None:
            self._jsonl = open(self.run_dir / "metrics.jsonl", "a")
        for rec in records:
            rec = strict_record(rec)
            self._jsonl.write(json.dumps(rec, sort_keys=True, allow_nan=False) + "\n")
            if self.wandb_process is not None:
                self._wandb_log(rec)
        self._jsonl.flush()
        if self.wandb_process is not None:
            self.wandb_process.flush()
            self._check_wandb()

    def summary(self, values: dict) -> None:
        """Writes summary.json (also for failed runs) and copies the values into the W&B summary (which then
        equals summary.json: the values set here are the last summary updates of the W&B run)."""
        if not self.enabled:
            return
        try:
            values = {**values, **self.wandb_info}  # waits for wandb.init in the W&B process
        except KeyboardInterrupt:  # a Ctrl-C while W&B starts: the summary is still written, without W&B's run
            self._write_summary(values)
            raise
        self._write_summary(values)
        if self.wandb_process is not None:
            # The W&B process commits the pending history row first: W&B commits the last step's row at finish()
            # and would then overwrite these values with that row's (e.g. the last window's perf/examples_per_s).
            self.wandb_process.summary_update(strict_record(values))

    def _write_summary(self, values: dict) -> None:
        write_summary(self.run_dir, values)

    def close(self, exit_code: int = 0) -> None:
        """Closes the files and finishes the W&B run (always, also after an error): waits until the W&B process
        has finished the run and exited, then logs the offline run's ``wandb sync`` line. A prestarted W&B process
        that no run took ends here. A W&B failure at finish is one warning line."""
        from tracking import wandb_process

        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        wandb_process.discard_prestarted()
        if self._abandoned is not None:
            self._abandoned.reap()
            self._abandoned = None
        if self.wandb_process is not None:
            try:
                errors = self.wandb_process.finish(exit_code)
            finally:
                self.wandb_process = None
            if errors:
                self.wandb_error = "; ".join(errors)
                log.warning(f"W&B failed ({self.wandb_error}); its run may be incomplete")
        self._offline_hint()


def wandb_group(cfg: Config) -> Optional[str]:
    """``wandb.group``, else, inside a Hydra multirun, the sweep's id (its folder), so a sweep is one group."""
    if cfg.wandb.group:
        return cfg.wandb.group
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN:
            return "sweep-" + Path(hc.sweep.dir).as_posix().strip("/").replace("/", "_")
    except Exception:  # not under Hydra (tests, library use)
        pass
    return None


def start_reporting(
    reporter: Reporter, cfg: Config, info: dict, num_devices: int, restored, start: int, n_steps: int
) -> None:
    """Starts W&B (a new run that names the saved run's id when resuming) and writes the step-0 record, or
    continues the saved run's ``metrics.jsonl`` history from ``restored`` (a ``training.checkpoint.Restored``)."""
    import jax

    from training.distributed import process_layout

    wandb_cfg = {
        **as_dict(cfg),
        "process_count": jax.process_count(),
        "process_layout": process_layout(),  # devices of every process
        "resolved": {k: v for k, v in info.items() if not isinstance(v, list)},
    }
    reporter.start_wandb(
        resolve_wandb_mode(cfg.wandb.mode),
        cfg.wandb.project,
        cfg.wandb.entity,
        wandb_group(cfg),
        job_type=f"{cfg.parallel.name}-{cfg.precision.name}",
        tags=list(cfg.wandb.tags) + [cfg.parallel.name, cfg.precision.name, f"devices={num_devices}"],
        config=wandb_cfg,
        init_timeout_s=cfg.wandb.init_timeout_s,
        process_priority=cfg.wandb.process_priority,
        previous_run_id=None if restored is None else restored.metadata.get("wandb_run_id"),
    )
    if restored is None:
        reporter.start_metrics()  # a restart without a checkpoint: the earlier history is set aside, not repeated
        static = {k: v for k, v in info.items() if k.startswith(("comm/", "mem/", "perf/"))}
        reporter.log([{"step": 0, **{k: v for k, v in static.items() if not isinstance(v, (list, str))}}])
    else:  # metrics.jsonl continues the saved run's history (records after the checkpoint dropped)
        previous = restored.metadata.get("run_dir")
        reporter.continue_metrics(Path(previous) / "metrics.jsonl" if previous else None, start, n_steps)
        info.update({"checkpoint/resumed_from": str(restored.path), "checkpoint/resumed_step": start})
