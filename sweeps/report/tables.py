"""Write the aggregated rows as ``scaling.csv`` (raw numbers) and ``scaling.md`` (human readable)."""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sweeps.report.aggregate import COLUMNS, few_windows_note, is_cpu, throughput_key

NO_TARGET_SENTENCE = "No time to target: set train.target_accuracy (and train.eval_every) in the sweep."

CPU_WARNING = (
    "**WARNING - CPU-simulated devices:** the devices of this sweep are simulated on one host CPU (XLA host "
    "platform device count) and share the same cores, so timings (examples/s, speedup, scaling efficiency, time "
    "to target) do NOT predict accelerator (GPU/TPU) performance. Byte counts (communication payload, ring-model "
    "bytes) and memory per device are still meaningful."
)
JOB_COLUMNS = [
    "job",
    "status",
    "devices",
    "parallel",
    "precision",
    "accum_steps",
    "scaling",
    "global_batch",
    "seed",
    "config",
    "examples_per_s",
    "examples_per_s_p25",
    "examples_per_s_p75",
    "examples_per_s_last_window",
    "tokens_per_example",
    "tokens_per_s",
    "windows_measured",
    "few_windows",
    "wall_s",
    "startup_s",
    "eval_accuracy",
    "steps_to_target",
    "time_to_target_s",
]


def csv_value(value: Any) -> str:
    """CSV cell: blank for None, shortest round-tripping text for floats, ints without a decimal point."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if not math.isfinite(value):
            return ""
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
    if isinstance(value, (tuple, list)):
        return " ".join(str(v) for v in value)
    return str(value)


def write_csv(rows: list[dict], path, columns: Iterable[str] = COLUMNS) -> Path:
    """One line per row with ``columns`` as the header; returns ``path``."""
    path, columns = Path(path), list(columns)
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(columns)
        for row in rows:
            writer.writerow([csv_value(row.get(c)) for c in columns])
    return path


def job_rows(records: list[dict]) -> list[dict]:
    """Per-job records as ``jobs.csv`` rows (``config`` = the other overrides as text)."""
    return [{**r, "config": " ".join(r["overrides"])} for r in records]


def format_bytes(value) -> str:
    """``1536`` -> ``1.5 KiB`` (binary units), blank for None."""
    if value is None:
        return ""
    value = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    return ""


def _num(value, fmt="{:.3g}") -> str:
    return "" if value is None else fmt.format(value)


def plain_4(x: float) -> str:
    """``x`` to 4 significant digits in plain decimals (thousands separated), never in e-notation:
    62270.4 -> '62,270', 1234567 -> '1,235,000', 12.345 -> '12.35'."""
    if x != x or x in (float("inf"), float("-inf")):
        return str(x)
    if abs(x) >= 1000:
        digits = len(str(int(abs(x))))
        return f"{round(x, 4 - digits):,.0f}"
    return f"{x:.4g}"


def _with_interval(row, key, fmt="{:.3g}") -> str:
    if row.get(key) is None:
        return ""
    low, high = row.get(f"{key}_ci_low"), row.get(f"{key}_ci_high")
    show = fmt if callable(fmt) else fmt.format
    text = show(row[key])
    if low is not None and high is not None:
        text += f" [{show(low)}, {show(high)}]"
    return text


def platform_header(rows: list[dict]) -> tuple[list[str], list[str]]:
    """Distinct platforms and device kinds of the rows."""
    platforms = sorted({str(r["_platform"]) for r in rows if r.get("_platform")})
    kinds = sorted({str(r["_device_kind"]) for r in rows if r.get("_device_kind")})
    return platforms, kinds


def write_markdown(
    rows: list[dict], path, source: str = "", plots: Iterable[str] = (), n_jobs: int = 0, n_failed: int = 0
) -> Path:
    """The report as Markdown: header (platforms, device kinds, CPU warning), the table with intervals (the
    ``interval`` column says which), notes, then the plots. The ``config`` column (what distinguishes
    configurations beyond the other columns) and the time-to-target columns are left out when blank in
    every row; without any target a note says how to set one. A token model's sweep (``throughput_key``) shows
    ``tokens/s [interval]``, ``tokens/s per device`` and ``tokens/example`` in place of ``examples/s
    [interval]``."""
    key, unit = throughput_key(rows)
    tokens = key == "tokens_per_s"
    platforms, kinds = platform_header(rows)
    lines = ["# Scaling report", ""]
    if source:
        lines.append(f"Source: `{source}`  ")
    lines += [
        f"Jobs: {n_jobs - n_failed} ok, {n_failed} failed; {len(rows)} configuration(s)  ",
        f"Platform(s): {', '.join(platforms) or 'unknown'}  ",
        f"Device kind(s): {', '.join(kinds) or 'unknown'}",
        "",
    ]
    if is_cpu(rows):
        lines += [f"> {CPU_WARNING}", ""]
    header = [
        "mode",
        "precision",
        "accum",
        "scaling",
        "devices",
        "global batch",
        "config",
        "repeats",
        "interval",
        f"{unit} [interval]",
        *(["tokens/s per device", "tokens/example"] if tokens else []),
        "speedup [interval]",
        "efficiency",
        "eval accuracy",
        "time to target (s)",
        "steps to target",
        "comm payload/step",
        "comm ring bytes/step/device",
        "comm ratio",
        "state/device",
        "status",
    ]
    table = []
    for r in rows:
        eps = _with_interval(r, key, plain_4) + (" *" if r["few_windows"] else "")
        per_device = [
            "" if r["tokens_per_s_per_device"] is None else plain_4(r["tokens_per_s_per_device"]),
            _num(r["tokens_per_example"], "{}"),
        ]
        cells = [
            r["parallel"] or "",
            r["precision"] or "",
            _num(r["accum_steps"], "{}"),
            r["scaling"] or "",
            _num(r["devices"], "{}"),
            _num(r["global_batch"], "{}"),
            r["config"],
            str(r["repeats"]),
            r["interval"],
            eps,
            *(per_device if tokens else []),
            _with_interval(r, "speedup"),
            _num(r["efficiency"]),
            _num(r["eval_accuracy"], "{:.4f}"),
            _num(r["time_to_target_s"]),
            _num(r["steps_to_target"], "{:.0f}") + (f" ({r['target_reached']})" if r["target_reached"] else ""),
            format_bytes(r["comm_payload_bytes"]),
            format_bytes(r["comm_ring_bytes"]),
            _num(r["comm_ratio"]) + (f" ({r['comm_ratio_source']})" if r["comm_ratio_source"] else ""),
            format_bytes(r["state_bytes_per_device"]),
            r["status"],
        ]
        table.append([c.replace("|", "/") for c in cells])
    optional = ("config", "time to target (s)", "steps to target")
    keep = [i for i, h in enumerate(header) if h not in optional or any(row[i] for row in table)]
    lines += ["| " + " | ".join(header[i] for i in keep) + " |", "|" + "---|" * len(keep)]
    lines += ["| " + " | ".join(row[i] for i in keep) + " |" for row in table]
    lines.append("")
    lines.append(
        "examples/s: median over repeats (jobs differing only in train.seed) of each job's median over "
        "its logging windows (the first window after compilation excluded); interval: bootstrap95 = 95% "
        "percentile-bootstrap interval of that median (>= 5 repeats), min-max = range of the repeats."
    )
    if tokens:
        lines += [
            "",
            "tokens/s = examples/s x tokens/example (an example is one window of model.context tokens): the "
            "language model's unit of work; scaling.csv has both.",
        ]
    note = few_windows_note(rows)
    if note:
        lines += ["", f"**{note}.**"]
    if not any(r["time_to_target_s"] is not None for r in rows):
        lines += ["", NO_TARGET_SENTENCE]
    for name in plots:
        lines += ["", f"![{Path(name).stem}]({name})"]
    lines.append("")
    path = Path(path)
    path.write_text("\n".join(lines))
    return path
