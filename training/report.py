"""Where numbers go: ``metrics.jsonl`` and ``summary.json`` in the run folder, W&B, and the console.

Only process 0 reports; the others construct a ``Reporter`` with ``enabled=False`` that does nothing.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

log = logging.getLogger(__name__)

WANDB_MODES = ("online", "offline", "disabled")


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


def resolve_wandb_mode(mode: Optional[str]) -> str:
    """``mode`` or, when None, 'online' if a W&B API key is configured (env or netrc), else 'offline'.

    Raises:
      ValueError: unknown mode.
    """
    if mode is not None:
        if mode not in WANDB_MODES:
            raise ValueError(f"wandb.mode={mode!r} is unknown; choose one of online, offline, disabled (or null)")
        return mode
    env = os.environ.get("WANDB_MODE")
    if env in WANDB_MODES or env == "dryrun":
        return "offline" if env == "dryrun" else env
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


class Reporter:
    """Writes records to ``metrics.jsonl`` and W&B; the summary to ``summary.json`` and W&B's summary.

    Args:
      run_dir: the Hydra run folder.
      enabled: False on processes other than 0 (then every method is a no-op).
    """

    def __init__(self, run_dir: Path, enabled: bool = True):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.wandb_run = None
        self._jsonl = None

    # ---- W&B -------------------------------------------------------------------------------------
    def start_wandb(self, mode: str, project: str, entity: Optional[str], group: Optional[str], job_type: str,
                    tags: list[str], config: dict, init_timeout_s: float, resume_id: Optional[str] = None) -> None:
        """Starts the W&B run inside the run folder. Online failure -> offline within ``init_timeout_s``."""
        if not self.enabled or mode == "disabled":
            return
        import wandb

        kwargs = dict(project=project, entity=entity, group=group, job_type=job_type, tags=tags,
                      config=config, dir=str(self.run_dir), reinit="finish_previous")
        if resume_id:
            kwargs.update(id=resume_id, resume="allow")
        settings = dict(init_timeout=init_timeout_s, console="off", x_disable_stats=True, silent=True)
        try:
            self.wandb_run = wandb.init(mode=mode, settings=wandb.Settings(**settings), **kwargs)
        except Exception as e:
            if mode != "online":
                raise
            log.warning("W&B could not be reached (%s); continuing offline", str(e).splitlines()[0][:200])
            self.wandb_run = wandb.init(mode="offline", settings=wandb.Settings(**settings), **kwargs)
            mode = "offline"
        if mode == "offline":
            log.info("W&B is offline; upload the run later with: wandb sync %s", os.path.dirname(self.wandb_run.dir))

    @property
    def wandb_info(self) -> dict:
        if self.wandb_run is None:
            return {}
        return {"wandb/run_id": self.wandb_run.id, "wandb/run_dir": os.path.dirname(self.wandb_run.dir),
                "wandb/group": self.wandb_run.group}

    # ---- records ---------------------------------------------------------------------------------
    # checkpoints: a resumed run continues metrics.jsonl
    def continue_metrics(self, previous: Optional[Path], step: int, final_step: int) -> int:
        """Starts this run's metrics.jsonl as the history of a run resumed after optimizer step ``step``.

        Keeps the records of ``previous`` (the saved run's metrics.jsonl; this run's own file when it is the
        same folder) with ``step`` <= the restored step and drops the later ones (written after the checkpoint
        by a run that then crashed), so no step is repeated or skipped. A cut-off last line (a crash while
        writing it) is dropped. When the restored step is ``final_step`` the final-evaluation record (no
        ``train/loss``) is dropped too: this run writes it again. Must be called before ``log``. Returns the
        number of records kept (0 when ``previous`` does not exist).
        """
        if not self.enabled:
            return 0
        target = self.run_dir / "metrics.jsonl"
        source = Path(previous) if previous is not None else target
        kept: list[str] = []
        if source.exists():
            for line in source.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                s = int(rec.get("step", -1))
                if s < step or (s == step and (step < final_step or "train/loss" in rec)):
                    kept.append(json.dumps(rec, sort_keys=True))
        elif previous is not None:
            log.warning("the resumed run's metrics.jsonl (%s) is gone; %s starts at step %d", source, target, step + 1)
        tmp = target.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, target)
        return len(kept)

    def start_metrics(self) -> Optional[Path]:
        """Starts an empty metrics.jsonl for a run that starts at step 0 (no checkpoint to continue).

        A metrics.jsonl already in the run folder (a run killed before its first checkpoint, restarted in the
        same folder) is kept as ``metrics.previous-<time>.jsonl`` and returned, so no step is recorded twice.
        """
        if not self.enabled:
            return None
        path = self.run_dir / "metrics.jsonl"
        if not path.exists() or path.stat().st_size == 0:
            return None
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
        backup = path.with_name(f"metrics.previous-{stamp}.jsonl")
        os.replace(path, backup)
        log.warning("%s held the history of an earlier run that left no checkpoint: kept as %s", path, backup.name)
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
            if self.wandb_run is not None:
                self.wandb_run.log({k: v for k, v in rec.items() if k != "step" and v is not None
                                    and not isinstance(v, (str, list, dict))}, step=int(rec["step"]))
        self._jsonl.flush()

    def summary(self, values: dict) -> None:
        """Writes summary.json (also for failed runs) and copies the values into the W&B summary."""
        if not self.enabled:
            return
        values = {**values, **self.wandb_info}
        path = self.run_dir / "summary.json"
        if path.exists():  # a reused run folder: keep the earlier run's summary (nothing a user saved is lost)
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
            backup = path.with_name(f"summary.previous-{stamp}.json")
            if not backup.exists():
                os.replace(path, backup)
                log.warning("%s already existed: kept as %s", path, backup.name)
        write_json(path, values)
        if self.wandb_run is not None:
            for k, v in strict_record(values).items():
                self.wandb_run.summary[k] = v

    def close(self, exit_code: int = 0) -> None:
        """Closes the files and finishes the W&B run (always, also after an error)."""
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self.wandb_run is not None:
            try:
                self.wandb_run.finish(exit_code=exit_code)
            finally:
                self.wandb_run = None


def console(line: str) -> None:
    """One line on stderr (errors, warnings a user must see even with logging redirected).

    Processes other than 0 of a multi-process job send it to their own log instead (``[process i]`` prefix,
    ``<job>_process<i>.log``; see ``training.distributed.route_logging``): process 0 owns the console.
    """
    # distributed
    from training.distributed import settings

    s = settings()
    if s is not None and s.process_id > 0:
        log.error("%s", line)
        return
    print(line, file=sys.stderr, flush=True)
