"""``python -m sweeps.report <multirun folder> [--out DIR] [--wandb]``: tables, plots, optional W&B run."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sweeps.report.aggregate import aggregate, throughput_key, too_few_note
from sweeps.report.collect import (
    REPORT_RUN_FILE,
    UNFINISHED,
    SUMMARY_NAME,
    ReportError,
    job_record,
    load_summaries,
    unfinished_jobs,
)
from sweeps.report.plots import make_figures, save
from sweeps.report.tables import JOB_COLUMNS, job_rows, write_csv, write_markdown


def write_report(
    folder,
    out_dir=None,
    use_wandb: bool = False,
    group: str | None = None,
    project: str | None = None,
    entity: str | None = None,
    projection_rows: list[dict] | None = None,
    projection_source: str = "",
    messages: list[str] | None = None,
) -> dict[str, Path]:
    """Builds the scaling report of the multirun ``folder`` into ``out_dir`` (default ``folder``):
    ``scaling.csv`` (one row per configuration, repeats aggregated), ``jobs.csv`` (one row per job),
    ``scaling.md`` and one PNG per figure of ``plots.make_figures``; with ``use_wandb`` also a W&B run.

    Jobs that have not finished (running, stopped, not started: ``collect.unfinished_jobs``) are left out and
    named in ``scaling.md``; ``messages`` (a list, when given) receives the lines ``main`` prints about them, about
    configurations with too few repeats for an interval and about an offline W&B run.

    Returns {name: path} (``csv``, ``jobs_csv``, ``md``, the figure names, and ``wandb_sync_file`` with W&B).

    Raises:
      ReportError: the folder does not exist, holds no finished job (naming the unfinished ones), or W&B logging
        failed (files written first).
    """
    folder = Path(folder)
    out = Path(out_dir) if out_dir is not None else folder
    summaries = load_summaries(folder, exclude=[out] if out_dir is not None else [])
    unfinished = unfinished_jobs(folder, summaries)
    summaries = [s for s in summaries if s.get("status") not in UNFINISHED]  # not started, stopped by a signal
    if not summaries:
        if unfinished:
            raise ReportError(
                f"no job of {folder} has finished yet ({'; '.join(unfinished)}); run the report when some have"
            )
        raise ReportError(f"no {SUMMARY_NAME} found under {folder}")
    records = [job_record(s) for s in summaries]
    rows = aggregate(records)
    if projection_rows and throughput_key(rows)[0] == "tokens_per_s":
        if any(p.get("tokens_per_s") is None for p in projection_rows):
            raise ReportError(
                "--projection: the sweep is a token model's (tokens/s) but the projection.csv has no tokens_per_s "
                "column; project its folder (python -m sweeps.project <sweep folder> ...) or pass "
                "--tokens-per-example to sweeps.project"
            )
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {
        "csv": write_csv(rows, out / "scaling.csv"),
        "jobs_csv": write_csv(job_rows(records), out / "jobs.csv", JOB_COLUMNS),
    }
    figures = make_figures(rows, projection_rows)
    plots = {name: save(fig, out / f"{name}.png") for name, fig in figures.items()}
    paths["md"] = write_markdown(
        rows,
        out / "scaling.md",
        source=str(folder),
        plots=[p.name for p in plots.values()],
        n_jobs=len(records),
        n_failed=sum(not r["ok"] for r in records),
        projection_rows=projection_rows,
        projection_source=projection_source,
        unfinished=unfinished,
    )
    paths.update(plots)
    said = messages if messages is not None else []
    if unfinished:
        said.append(f"warning: unfinished jobs are not in the report: {'; '.join(unfinished)}")
    few = too_few_note(rows)
    if few:
        said.append(f"note: {few}")
    if use_wandb:
        from sweeps.report.wandb_log import log_to_wandb

        try:
            info = log_to_wandb(
                rows, plots, summaries, folder, group=group, project=project, entity=entity, out_dir=out
            )
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [""])[0]
            raise ReportError(
                f"report written to {out}, but W&B logging failed: {type(exc).__name__}: {first}"
            ) from exc
        if info.get("disabled"):
            said.append("W&B is disabled (WANDB_MODE=disabled): the report was not logged to W&B")
            return paths
        (out / REPORT_RUN_FILE).write_text(  # tells sweeps.dashboard that the report's panels have a run
            json.dumps({"wandb_run_id": info["wandb_run_id"], "wandb_group": info["wandb_group"]}) + "\n"
        )
        paths["wandb_report_run"] = out / REPORT_RUN_FILE
        if info.get("offline"):
            said.append(f"W&B is offline: upload the report's run later with: wandb sync {info['wandb_run_dir']}")
        paths["wandb_sync_file"] = info["wandb_sync_file"]
    return paths


PROJECTION_COLUMNS = ("devices", "examples_per_s", "compute_s", "comm_s", "step_time_s", "efficiency")


def read_projection(path) -> list[dict]:
    """Rows of a ``projection.csv`` of ``sweeps.project`` as ``{"label", "devices", "examples_per_s",
    "efficiency", "comm_ratio", "below_step_floor", "hardware", "assumed_mfu", "assumed_step_time_s",
    "per_device_batch"}`` (label: its ``config`` column; None where the CSV has no such column or a blank cell),
    with ``"tokens_per_s"`` when the CSV has that column (a token model's projection).

    Raises:
      ReportError: the file is missing, or is not a projection: it lacks a column of ``PROJECTION_COLUMNS`` (a
        ``scaling.csv`` has ``devices`` and ``examples_per_s`` but no modelled times).
    """
    import csv

    def number(r, key):
        text = r.get(key)
        return float(text) if text not in (None, "") else None

    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            columns = list(reader.fieldnames or [])
    except OSError as exc:
        raise ReportError(f"--projection {path}: cannot be read ({exc.strerror or type(exc).__name__})") from None
    missing = [c for c in PROJECTION_COLUMNS if c not in columns]
    if missing:
        raise ReportError(
            f"--projection {path} is not a projection.csv of sweeps.project (no {', '.join(missing)} column); "
            "write one with `python -m sweeps.project <sweep folder> --hardware NAME --mfu 0.4 --out DIR`"
        )
    try:
        out = []
        for r in rows:
            row = {
                "label": r.get("config") or "projection",
                "devices": int(r["devices"]),
                "examples_per_s": float(r["examples_per_s"]),
                "efficiency": number(r, "efficiency"),
                "comm_ratio": number(r, "comm_ratio"),
                "below_step_floor": r.get("below_step_floor") == "true",
                "hardware": r.get("hardware") or None,
                "assumed_mfu": number(r, "assumed_mfu"),
                "assumed_step_time_s": number(r, "assumed_step_time_s"),
                "per_device_batch": number(r, "per_device_batch"),
            }
            if "tokens_per_s" in r:
                row["tokens_per_s"] = number(r, "tokens_per_s")
            out.append(row)
        return out
    except (KeyError, ValueError) as exc:
        raise ReportError(
            f"--projection {path}: a row cannot be read ({type(exc).__name__}: {exc}); write the file again with "
            "`python -m sweeps.project ... --out DIR`"
        ) from None


def main(argv: list[str] | None = None) -> int:
    """Command line; returns the exit status (2 with one ``error:`` line on bad input)."""
    parser = argparse.ArgumentParser(
        prog="python -m sweeps.report", description="Scaling table (CSV + Markdown) and plots from a Hydra multirun."
    )
    parser.add_argument("folder", help="multirun folder (searched recursively for summary.json)")
    parser.add_argument("--out", default=None, help="output folder (default: the multirun folder)")
    parser.add_argument(
        "--wandb",
        action="store_true",
        help="also log a job_type=scaling_report run into the jobs' W&B group (honours WANDB_MODE)",
    )
    parser.add_argument("--group", default=None, help="W&B group (default: summaries' wandb/group, else the folder)")
    parser.add_argument("--project", default=None, help="W&B project (default: summaries', else WANDB_PROJECT)")
    parser.add_argument("--entity", default=None, help="W&B entity (default: summaries', else WANDB_ENTITY)")
    parser.add_argument(
        "--projection",
        default=None,
        metavar="PROJECTION_CSV",
        help="projection.csv of `python -m sweeps.project`: a projected panel beside the measured throughput and a "
        "projection section in scaling.md",
    )
    args = parser.parse_args(argv)
    messages: list[str] = []
    try:
        projection = read_projection(args.projection) if args.projection else None
        paths = write_report(
            args.folder,
            args.out,
            use_wandb=args.wandb,
            group=args.group,
            project=args.project,
            entity=args.entity,
            projection_rows=projection,
            projection_source=str(args.projection or ""),
            messages=messages,
        )
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, path in paths.items():
        print(f"{name}: {path}")
    for line in messages:
        print(line, file=sys.stderr)
    return 0
