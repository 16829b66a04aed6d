"""``python -m sweeps.report <multirun folder> [--out DIR] [--wandb]``: tables, plots, optional W&B run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sweeps.report.aggregate import aggregate, throughput_key
from sweeps.report.collect import SUMMARY_NAME, ReportError, job_record, load_summaries
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
) -> dict[str, Path]:
    """Builds the scaling report of the multirun ``folder`` into ``out_dir`` (default ``folder``):
    ``scaling.csv`` (one row per configuration, repeats aggregated), ``jobs.csv`` (one row per job),
    ``scaling.md`` and one PNG per figure of ``plots.make_figures``; with ``use_wandb`` also a W&B run.

    Returns {name: path} (``csv``, ``jobs_csv``, ``md``, the figure names, and ``wandb_sync_file`` with W&B).

    Raises:
      ReportError: the folder does not exist, holds no summary, or W&B logging failed (files written first).
    """
    folder = Path(folder)
    out = Path(out_dir) if out_dir is not None else folder
    summaries = load_summaries(folder, exclude=[out] if out_dir is not None else [])
    if not summaries:
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
    )
    paths.update(plots)
    if use_wandb:
        from sweeps.report.wandb_log import log_to_wandb

        try:
            info = log_to_wandb(rows, plots, summaries, folder, group=group, project=project, entity=entity)
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [""])[0]
            raise ReportError(
                f"report written to {out}, but W&B logging failed: {type(exc).__name__}: {first}"
            ) from exc
        paths["wandb_sync_file"] = info["wandb_sync_file"]
    return paths


def read_projection(path) -> list[dict]:
    """Rows of a ``projection.csv`` as ``{"label", "devices", "examples_per_s"}`` (label: its ``config``
    column), with ``"tokens_per_s"`` when the CSV has that column (a token model's projection; None in a blank
    cell).

    Raises:
      ReportError: the file is missing or lacks the ``devices`` / ``examples_per_s`` columns.
    """
    import csv

    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        out = []
        for r in rows:
            row = {
                "label": r.get("config") or "projection",
                "devices": int(r["devices"]),
                "examples_per_s": float(r["examples_per_s"]),
            }
            if "tokens_per_s" in r:
                row["tokens_per_s"] = float(r["tokens_per_s"]) if r["tokens_per_s"] else None
            out.append(row)
        return out
    except (OSError, KeyError, ValueError) as exc:
        raise ReportError(
            f"--projection {path}: not a projection.csv of sweeps.project ({type(exc).__name__}: "
            f"{exc}); write one with `python -m sweeps.project ... --out DIR`"
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
        help="projection.csv of `python -m sweeps.project`: dotted lines on the throughput plot",
    )
    args = parser.parse_args(argv)
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
        )
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0
