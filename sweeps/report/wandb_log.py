"""Log a sweep's scaling report to W&B as one ``job_type="scaling_report"`` run in the jobs' group."""

from __future__ import annotations

import os
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from sweeps.report.aggregate import COLUMNS, series_labels
from sweeps.report.tables import csv_value, platform_header


def _most_common(records: list[dict], key: str) -> str | None:
    values = [str(r[key]) for r in records if r.get(key) not in (None, "")]
    return Counter(values).most_common(1)[0][0] if values else None


def jobs_wandb_setting(summaries: list[dict], key: str) -> str | None:
    """The jobs' ``wandb.<key>`` (``project``, ``entity``): their summaries' ``wandb/<key>``, else the most common
    value in their ``.hydra/config.yaml`` (what ``train.py`` logged to), else None."""
    found = _most_common(summaries, f"wandb/{key}")
    if found:
        return found
    import yaml

    values = []
    for summary in summaries:
        path = Path(str(summary.get("_job_dir", ""))) / ".hydra" / "config.yaml"
        try:
            value = ((yaml.safe_load(path.read_text()) or {}).get("wandb") or {}).get(key)
        except (OSError, ValueError, AttributeError, yaml.YAMLError):
            continue
        if value not in (None, ""):
            values.append(str(value))
    return Counter(values).most_common(1)[0][0] if values else None


def infer_group(summaries: list[dict], folder) -> str:
    """W&B group of the jobs: the summaries' ``wandb/group``, else the folder name."""
    return _most_common(summaries, "wandb/group") or Path(folder).resolve().name


def _metric_name(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "_", label).strip("_") or "series"


def log_to_wandb(
    rows: list[dict],
    plots: dict[str, Path],
    summaries: list[dict],
    folder,
    group: str | None = None,
    project: str | None = None,
    entity: str | None = None,
    out_dir=None,
) -> dict[str, Any]:
    """Logs ``scaling_table`` (``wandb.Table`` of ``COLUMNS``, intervals included), the PNGs as
    ``plots/<name>`` and, per device count (x axis ``scaling/devices``), ``scaling/<metric>/<series>`` for
    examples/s (with ``_ci_low``/``_ci_high``; tokens/s too for a token model), speedup and efficiency.
    The mode is a run's (``training.report.resolve_wandb_mode``): WANDB_MODE, else online with an API key, else
    offline. WANDB_DIR (default: ``out_dir``, else the current folder), WANDB_PROJECT and WANDB_ENTITY are honoured.

    Returns ``{"wandb_run_id", "wandb_group", "wandb_sync_file", "wandb_url", "offline", "wandb_run_dir"}``, or
    ``{"disabled": True}`` (nothing logged) when WANDB_MODE is disabled.
    """
    import wandb

    from training.report import resolve_wandb_mode

    mode = resolve_wandb_mode(None)
    if mode == "disabled":
        return {"disabled": True}

    group = group or infer_group(summaries, folder)
    project = project or jobs_wandb_setting(summaries, "project") or os.environ.get("WANDB_PROJECT")
    entity = entity or jobs_wandb_setting(summaries, "entity") or os.environ.get("WANDB_ENTITY")
    platforms, kinds = platform_header(rows)
    run = wandb.init(
        mode=mode,
        dir=None if os.environ.get("WANDB_DIR") or out_dir is None else str(out_dir),
        project=project,
        entity=entity,
        group=group,
        job_type="scaling_report",
        name=f"scaling-report-{group}",
        config={
            "multirun_folder": str(Path(folder).resolve()),
            "n_jobs": len(summaries),
            "n_configurations": len(rows),
            "platforms": platforms,
            "device_kinds": kinds,
        },
        settings=wandb.Settings(
            x_disable_stats=True, x_disable_machine_info=True, save_code=False, disable_git=True, console="off"
        ),
    )
    try:
        run.define_metric("scaling/devices")
        run.define_metric("scaling/*", step_metric="scaling/devices")
        labels, _ = series_labels(rows)
        by_devices: dict[int, dict[str, float]] = defaultdict(dict)
        for row in rows:
            if not row["repeats"] or not row["devices"]:
                continue
            name = _metric_name(labels[row["_series"]])
            for key in (
                "examples_per_s",
                "examples_per_s_ci_low",
                "examples_per_s_ci_high",
                "tokens_per_s",
                "tokens_per_s_ci_low",
                "tokens_per_s_ci_high",
                "speedup",
                "efficiency",
                "time_to_target_s",
            ):
                if row[key] is not None:
                    by_devices[row["devices"]][f"scaling/{key}/{name}"] = row[key]
        for devices in sorted(by_devices):
            run.log({"scaling/devices": devices, **by_devices[devices]})
        table = wandb.Table(
            columns=COLUMNS,
            data=[
                [csv_value(row.get(c)) if isinstance(row.get(c), tuple) else row.get(c) for c in COLUMNS]
                for row in rows
            ],
            allow_mixed_types=True,
        )
        payload: dict[str, Any] = {"scaling_table": table}
        for name, path in plots.items():
            payload[f"plots/{name}"] = wandb.Image(str(path), caption=name)
        run.log(payload)
        run.summary["scaling/n_jobs"] = len(summaries)
        run.summary["scaling/n_configurations"] = len(rows)
        info = {
            "wandb_run_id": run.id,
            "wandb_group": group,
            "wandb_sync_file": Path(run.settings.sync_file),
            "wandb_url": getattr(run, "url", None),
            "offline": mode == "offline",
            "wandb_run_dir": Path(run.settings.sync_file).parent,
        }
    finally:
        run.finish()
    return info
