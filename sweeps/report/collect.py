"""Collect the jobs of a Hydra multirun: one ``summary.json`` per job -> one job record per job.

A job record is a flat dict with the configuration that identifies the job (``parallel``, ``precision``,
``accum_steps``, ``scaling``, ``global_batch``, ``per_device_batch``, ``devices``, ``grad_reduce_dtype``,
``grad_compression``, ``seed`` and ``overrides``: the job's other Hydra overrides) and its measured values
(``examples_per_s`` = the job's median over logging windows, ``windows_measured``, ``eval_accuracy``,
``time_to_target_s``, ...). A language model's job (``model=gpt``) also has ``tokens_per_example`` (its
``train/tokens_per_example``, else ``model/context``: T) and ``tokens_per_s`` = examples/s x T: its unit of
work is the token (``sweep_unit``). Nothing here aggregates; see ``sweeps.report.aggregate``. Never imports
JAX.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tracking.folders import CHECKPOINTS, RUN, STEP, enclosing_sweep, folder_kind

SUMMARY_NAME = "summary.json"
# written beside scaling.md by ``sweeps.report --wandb`` once its run is logged; sweeps.dashboard looks for it
REPORT_RUN_FILE = "wandb_report_run.json"
OVERRIDES_PATH = Path(".hydra") / "overrides.yaml"
# Overrides already represented by a record field (or that only name a repeat): not part of ``overrides``.
FIELD_OVERRIDES = (
    "train.seed",
    "mesh.devices",
    "parallel",
    "precision",
    "train.accum_steps",
    "train.global_batch",
    "train.per_device_batch",
    "parallel.grad_reduce_dtype",
    "parallel.grad_compression",
    "hydra",
    "wandb",
)
MIN_WINDOWS = 5  # measure.throughput.MIN_WINDOWS (not imported: the report stays free of the training code)


class ReportError(Exception):
    """A user-facing error (bad folder, no summaries, W&B failure); the message is one line."""


def _natural_key(path: Path) -> tuple:
    """Sort ``multirun/10/summary.json`` after ``multirun/9/summary.json``."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in path.parts)


def _parse_scalar(text: str) -> Any:
    """Parse an override value the way Hydra would (``4`` -> 4, ``true`` -> True)."""
    try:
        import yaml

        return yaml.safe_load(text)
    except Exception:  # noqa: BLE001 - no yaml or unparsable: keep the string
        return text


def _read_overrides(job_dir: Path) -> list[str]:
    """Return the override strings of ``<job_dir>/.hydra/overrides.yaml`` ([] if none)."""
    path = job_dir / OVERRIDES_PATH
    if not path.is_file():
        return []
    text = path.read_text(errors="replace")
    try:
        import yaml

        data = yaml.safe_load(text)
        if isinstance(data, list):
            return [str(x) for x in data]
    except Exception:  # noqa: BLE001 - fall back to a line parser
        pass
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("- "):
            out.append(line[2:].strip().strip("'\""))
    return out


def overrides_to_keys(overrides: Iterable[str]) -> dict[str, Any]:
    """Map Hydra overrides to summary keys: ``mesh.devices=4`` -> ``{"mesh/devices": 4}``.

    ``+``/``++`` prefixes are dropped, ``~deletions`` and ``hydra.*`` are ignored.
    """
    out: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item or item.startswith("~"):
            continue
        key, _, value = item.partition("=")
        key = key.lstrip("+").strip()
        if not key or key.startswith("hydra."):
            continue
        out[key.replace(".", "/")] = _parse_scalar(value.strip())
    return out


def _is_under(path: Path, parent: Path) -> bool:
    try:
        path.relative_to(parent)
        return True
    except ValueError:
        return False


def load_summaries(folder, exclude: Iterable = ()) -> list[dict]:
    """Load every ``summary.json`` below ``folder`` (recursively).

    Each returned dict is the job's summary plus:

    * ``_job_dir``: the job folder (``str``, absolute);
    * ``_job``: the job folder relative to ``folder`` (e.g. ``"3"``);
    * ``_overrides``: the override strings of ``.hydra/overrides.yaml``;
    * keys derived from ``.hydra/overrides.yaml`` (``mesh.devices=4`` ->
      ``mesh/devices``) for every key the summary lacks - this is what gives a
      failed job its device count and mode.

    Folders listed in ``exclude`` (e.g. the report output dir, when it is a
    sub-folder) and anything inside a ``wandb`` folder are skipped.  An
    unreadable ``summary.json`` becomes ``{"status": "failed", "error": ...}``.

    Raises ``ReportError`` if ``folder`` is not a directory, is one run's folder (holds ``summary.json`` or
    ``.hydra/``), or a checkpoint folder or step (``tracking.folders``).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ReportError(f"multirun folder does not exist or is not a directory: {folder}")
    root = folder.resolve()
    kind = folder_kind(root)
    if kind in (RUN, CHECKPOINTS, STEP):
        what = {RUN: f"one run's folder (it holds {SUMMARY_NAME} or .hydra/)", CHECKPOINTS: "a run's checkpoint folder"}
        sweep = enclosing_sweep(root)
        fix = (
            f"the sweep it belongs to: {sweep}"
            if sweep
            else "a sweep folder that holds jobs (e.g. multirun/<date>/<time>)"
        )
        raise ReportError(f"{folder} is {what.get(kind, 'a checkpoint step of a run')}, not a sweep; pass {fix}")
    excluded = [Path(p).resolve() for p in exclude if Path(p).resolve() != root]
    out = []
    for path in sorted(root.rglob(SUMMARY_NAME), key=_natural_key):
        if not path.is_file():
            continue
        rel = path.relative_to(root)
        if "wandb" in rel.parts[:-1] or any(_is_under(path, ex) for ex in excluded):
            continue
        try:
            summary = json.loads(path.read_text())
            if not isinstance(summary, dict):
                raise ValueError(f"expected a JSON object, got {type(summary).__name__}")
        except Exception as exc:  # noqa: BLE001 - keep going, mark the job failed
            summary = {"status": "failed", "error": f"unreadable {SUMMARY_NAME}: {exc}"}
        job_dir = path.parent
        overrides = _read_overrides(job_dir)
        for key, value in overrides_to_keys(overrides).items():
            summary.setdefault(key, value)
        summary["_overrides"] = overrides
        summary["_job_dir"] = str(job_dir)
        summary["_job"] = str(rel.parent) if rel.parent != Path(".") else "."
        out.append(summary)
    return out


def _num(value: Any) -> float | int | None:
    """Return ``value`` if it is a finite real number (not bool), else None."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        try:
            parsed = float(value)
        except ValueError:
            return None
        if not math.isfinite(parsed):
            return None
        return int(parsed) if parsed.is_integer() and "." not in value else parsed
    return None


def _int(value: Any) -> int | None:
    number = _num(value)
    if number is None or float(number) != int(number):
        return None
    return int(number)


def _devices(summary: dict) -> int | None:
    """Device count: ``mesh/devices``, else the product of ``mesh/shape``."""
    devices = _int(summary.get("mesh/devices"))
    if devices is None:
        shape = summary.get("mesh/shape")
        if isinstance(shape, (list, tuple)) and shape and all(_int(s) for s in shape):
            devices = math.prod(int(s) for s in shape)
    return devices


def _status(summary: dict) -> tuple[bool, str]:
    status = summary.get("status")
    if status is None:
        status = "failed" if summary.get("error") else "ok"
    status = str(status)
    if status == "ok":
        return True, "ok"
    error = summary.get("error")
    error = " ".join(str(error).split()) if error else "unknown error"
    if len(error) > 300:
        error = error[:297] + "..."
    return False, f"{status}: {error}"


def _text(value: Any) -> str | None:
    if value is None or value == "":
        return None
    return str(value)


def _sort_part(value: Any) -> tuple:
    if value is None:
        return (2, 0, "")
    number = _num(value)
    if number is not None and not isinstance(value, str):
        return (0, number, "")
    return (1, 0, str(value))


def _extra_overrides(overrides: Iterable[str]) -> tuple[str, ...]:
    """The job's overrides that are not a record field nor the seed, sorted (``optim.lr_scaling=linear``)."""
    out = []
    for item in overrides:
        if "=" not in item or item.startswith("~"):
            continue
        key = item.partition("=")[0].lstrip("+").strip()
        if key == "sweep" or any(key == f or key.startswith(f + ".") for f in FIELD_OVERRIDES):
            continue
        out.append(item.lstrip("+"))
    return tuple(sorted(out))


TOKEN_MODELS = ("gpt",)  # models whose unit of work is the token (train.py logs perf/tokens_per_s for them)


def tokens_per_example(summary: dict) -> int | None:
    """Tokens per example (the context T) of a token model's job: ``train/tokens_per_example``, else
    ``model/context`` when the model is a token model or the summary has ``perf/tokens_per_s``; else None."""
    tokens = _int(summary.get("train/tokens_per_example"))
    if tokens is None and (
        summary.get("model") in TOKEN_MODELS or "perf/tokens_per_s" in summary or "perf/tokens_per_s_median" in summary
    ):
        tokens = _int(summary.get("model/context"))
    return tokens if tokens and tokens > 0 else None


def profile_matches(summary: dict) -> bool:
    """Whether the job's hardware profile describes the device that ran it (``hardware/matches_device``; in older
    summaries, which lack it, ``measure.hardware.describes_device`` of ``hardware/profile``, ``device_kind`` and
    ``platform``): only then is a ratio of the profile's numbers to the job's measured times (``comm/ratio_model``,
    ``perf/mfu``) shown."""
    matches = summary.get("hardware/matches_device")
    if isinstance(matches, bool):
        return matches
    from measure.hardware import describes_device

    profile = summary.get("hardware/profile")
    try:
        return describes_device(
            str(profile or "auto"), [], str(summary.get("device_kind") or ""), str(summary.get("platform") or "")
        )
    except Exception:  # noqa: BLE001 - an unreadable profile: no ratio rather than a mixed one
        return False


def job_record(summary: dict) -> dict[str, Any]:
    """One job's record (see the module docstring) from its summary (as returned by ``load_summaries``).

    ``examples_per_s`` is ``perf/examples_per_s_median``, else ``perf/examples_per_s`` (older summaries),
    else ``train/global_batch / perf/step_time_s``. A failed job keeps its configuration, ``ok=False`` and
    ``status="failed: <error>"``; its measured values are None.
    """
    ok, status = _status(summary)
    devices = _devices(summary)
    global_batch = _int(summary.get("train/global_batch"))
    per_device = _int(summary.get("train/per_device_batch"))
    if per_device is None and global_batch and devices and global_batch % devices == 0:
        per_device = global_batch // devices
    eps = _num(summary.get("perf/examples_per_s_median"))
    if eps is None:
        eps = _num(summary.get("perf/examples_per_s"))
    step_time = _num(summary.get("perf/step_time_s"))
    if eps is None and global_batch and step_time:
        eps = global_batch / step_time
    matches = profile_matches(summary)
    ratio, source = (_num(summary.get("comm/ratio_model")) if matches else None), None
    if ratio is not None:
        source = "model"
    elif summary.get("comm/ratio_measured_valid") is True:
        ratio = _num(summary.get("comm/ratio_measured"))
        source = "measured" if ratio is not None else None
    windows = _int(summary.get("perf/windows_measured"))
    tokens = tokens_per_example(summary)
    model = _text(summary.get("model"))
    if tokens is not None or model in TOKEN_MODELS:
        unit = "tokens"
    else:
        unit = "examples" if ok or model is not None else None  # a failed job without a model: unknown
    record = {
        "parallel": _text(summary.get("parallel")),
        "precision": _text(summary.get("precision")),
        "accum_steps": _int(summary.get("train/accum_steps")),
        "scaling": _text(summary.get("train/scaling")),
        "global_batch": global_batch,
        "per_device_batch": per_device,
        "devices": devices,
        "grad_reduce_dtype": _text(summary.get("parallel/grad_reduce_dtype")),
        "grad_compression": _text(summary.get("parallel/grad_compression")),
        "overrides": _extra_overrides(summary.get("_overrides", [])),
        "seed": _int(summary.get("train/seed")),
        "model": model,
        "param_count": _int(summary.get("model/param_count")),
        "data": _text(summary.get("data")),
        "unit": unit,
        "tokens_per_example": tokens,
        "examples_per_s": eps,
        "tokens_per_s": eps * tokens if eps is not None and tokens else None,
        "examples_per_s_p25": _num(summary.get("perf/examples_per_s_p25")),
        "examples_per_s_p75": _num(summary.get("perf/examples_per_s_p75")),
        "examples_per_s_last_window": _num(summary.get("perf/examples_per_s_last_window")),
        "step_time_s": step_time,
        "windows_measured": windows,
        "few_windows": windows is not None and windows < MIN_WINDOWS,
        "wall_s": _num(summary.get("perf/wall_s")),
        "startup_s": _num(summary.get("perf/startup_s")),
        "eval_accuracy": _num(summary.get("eval/accuracy")),
        "target_accuracy": _num(summary.get("train/target_accuracy")),
        "steps_to_target": _int(summary.get("train/steps_to_target")),
        "time_to_target_s": _num(summary.get("perf/time_to_target_s")),
        "comm_payload_bytes": _num(summary.get("comm/payload_bytes_per_step")),
        "comm_payload_bytes_lowered": _num(summary.get("comm/payload_bytes_per_step_lowered")),
        "comm_ring_bytes": _num(summary.get("comm/bytes_per_step")),
        "comm_ratio": ratio,
        "comm_ratio_source": source,
        "link_bytes_per_s": _num(summary.get("hardware/link_bytes_per_s")),
        "hardware_profile": _text(summary.get("hardware/profile")),
        "profile_matches": matches,
        "state_bytes_per_device": _num(summary.get("mem/state_bytes_per_device")),
        "temp_bytes_per_device": _num(summary.get("mem/temp_bytes_per_device")),
        "platform": _text(summary.get("platform")),
        "device_kind": _text(summary.get("device_kind")),
        "ok": ok,
        "status": status,
        "job": _text(summary.get("_job")),
        "job_dir": summary.get("_job_dir"),
    }
    if not ok:
        for key in MEASURED:
            record[key] = None
        record["few_windows"] = False
    return record


MEASURED = (
    "examples_per_s",
    "tokens_per_s",
    "examples_per_s_p25",
    "examples_per_s_p75",
    "examples_per_s_last_window",
    "step_time_s",
    "windows_measured",
    "wall_s",
    "startup_s",
    "eval_accuracy",
    "steps_to_target",
    "time_to_target_s",
    "comm_payload_bytes",
    "comm_payload_bytes_lowered",
    "comm_ring_bytes",
    "comm_ratio",
    "comm_ratio_source",
    "state_bytes_per_device",
    "temp_bytes_per_device",
)


def sweep_unit(records: list[dict]) -> str:
    """``"tokens"`` when every job whose unit is known is a token model's (``model=gpt``), ``"examples"``
    when none is (or nothing is known).

    Raises:
      ReportError: the sweep mixes both (their throughputs are in different units: examples of 1 image or of
        T tokens), naming the models and some jobs of each.
    """
    by_unit: dict[str, list[dict]] = {}
    for rec in records:
        if rec.get("unit"):
            by_unit.setdefault(rec["unit"], []).append(rec)
    if len(by_unit) < 2:
        return next(iter(by_unit), "examples")

    def who(recs):
        models = sorted({str(r.get("model") or "?") for r in recs})
        jobs = [str(r.get("job")) for r in recs]
        shown = " ".join(jobs[:3]) + (f" ... ({len(jobs)} jobs)" if len(jobs) > 3 else "")
        return f"model={','.join(models)}: job {shown}"

    raise ReportError(
        f"the sweep mixes a token model ({who(by_unit['tokens'])}; throughput in tokens/s) with models measured "
        f"in examples/s ({who(by_unit['examples'])}); report them separately: move one kind's job folders "
        f"into another folder and run sweeps.report on each"
    )


def collect(folder, exclude: Iterable = ()) -> list[dict[str, Any]]:
    """Job records of every ``summary.json`` below ``folder`` (``load_summaries`` + ``job_record``).

    Raises:
      ReportError: ``folder`` is not a directory or holds no summary.
    """
    summaries = load_summaries(folder, exclude)
    if not summaries:
        raise ReportError(f"no {SUMMARY_NAME} found under {folder}")
    return [job_record(s) for s in summaries]


UNFINISHED = ("skipped", "stopped")  # statuses of jobs that did not finish: not started, stopped by a signal


def planned_job_count(folder) -> int | None:
    """How many jobs the sweep in ``folder`` launches (its ``multirun.yaml``, expanded as Hydra's basic sweeper
    does: ``sweeps.callback.planned_jobs``), or None when that cannot be told."""
    path = Path(folder) / "multirun.yaml"
    if not path.is_file():
        return None
    try:
        from omegaconf import OmegaConf

        from sweeps.callback import planned_jobs

        jobs = planned_jobs(OmegaConf.load(path))  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - another sweeper, an unreadable file: unknown
        return None
    return None if jobs is None else len(jobs)


def unfinished_jobs(folder, summaries: list[dict]) -> list[str]:
    """The jobs of the sweep in ``folder`` that have not finished, grouped by state, e.g. ``running: 3 (process
    4657 on host h since 2026-12-07 06:47:08)``, ``no summary.json (ended without one; see its train.log): 4``,
    ``stopped: 5 (stopped by SIGTERM after step 30 of 60 ...)``, ``not started (the sweep was stopped): 6``, ``not
    started yet: 7, 8`` (planned in ``multirun.yaml``, no folder yet). ``summaries``: ``load_summaries(folder)``."""
    from tracking.folders import job_folders
    from tracking.run_folder import running_holder

    root = Path(folder).resolve()
    with_summary = {Path(s["_job_dir"]).resolve(): s for s in summaries}
    groups: dict[str, list[str]] = {}
    folders = job_folders(root)
    for job_dir in folders:
        name = str(job_dir.relative_to(root))
        summary = with_summary.get(job_dir.resolve())
        if summary is None:
            holder = running_holder(job_dir)
            if holder is not None:
                groups.setdefault("running", []).append(f"{name} ({holder})")
            else:
                groups.setdefault("no summary.json (it ended without one: see its train.log)", []).append(name)
        elif summary.get("status") == "skipped":
            groups.setdefault("not started (the sweep was stopped)", []).append(name)
        elif summary.get("status") == "stopped":
            error = " ".join(str(summary.get("error") or "stopped").split())
            groups.setdefault("stopped", []).append(f"{name} ({error[:160]})")
    planned = planned_job_count(root)
    if planned is not None and planned > len(folders):
        numbers = {int(p.name) for p in folders if p.name.isdigit() and p.parent == root}
        missing = [str(i) for i in range(planned) if i not in numbers][: planned - len(folders)]
        shown = ", ".join(missing[:8]) + (f" ... ({len(missing)} jobs)" if len(missing) > 8 else "")
        groups.setdefault("not started yet", []).append(shown)
    return [f"{state}: {', '.join(jobs)}" for state, jobs in groups.items()]
