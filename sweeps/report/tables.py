"""Write the aggregated rows as ``scaling.csv`` (raw numbers) and ``scaling.md`` (human readable)."""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sweeps.report.aggregate import (
    COLUMNS,
    MIN_REPEATS,
    few_windows_note,
    is_cpu,
    overrides_text,
    projection_title,
    ratio_known,
    ratio_label,
    regime_text,
    settings_text,
    throughput_key,
    too_few_note,
    workload_text,
)

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


BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def byte_unit(value) -> str:
    """The binary unit ``format_bytes`` writes ``value`` in (``B`` for None)."""
    value = abs(float(value or 0))
    for unit in BYTE_UNITS:
        if value < 1024 or unit == "TiB":
            return unit
        value /= 1024
    return "TiB"


def format_bytes(value, unit: str | None = None) -> str:
    """``1536`` -> ``1.5 KiB`` (binary units; ``unit``: that one, e.g. the unit of a column's largest value, so a
    column reads in one unit), blank for None."""
    if value is None:
        return ""
    unit = unit or byte_unit(value)
    scaled = float(value) / 1024 ** BYTE_UNITS.index(unit)
    return f"{scaled:.0f} {unit}" if unit == "B" else f"{scaled:.3g} {unit}"


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


def sig3(x: float) -> str:
    """``x`` to 3 significant digits, trailing zeros kept so a column reads alike (0.76 -> '0.760', 1 -> '1.00',
    0.0977 -> '0.0977'); from 1,000 up in plain decimals with thousands separated, never in e-notation."""
    if abs(x) >= 1000:
        return plain_4(x)
    return f"{x:#.3g}".rstrip(".")


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


def comm_ratio_note(rows: list[dict]) -> str | None:
    """Why no configuration has a communication ratio, and how to get one (None when some has)."""
    if any(r["comm_ratio"] is not None for r in rows):
        return None
    profiles = sorted({str(r["_other_device_profile"]) for r in rows if r.get("_other_device_profile")} - {"cpu"})
    kinds = ", ".join(platform_header(rows)[1]) or "the devices that ran"
    project = f"python -m sweeps.project <sweep folder> --hardware {profiles[0] if profiles else 'h100_sxm'} --mfu 0.4"
    measured = "profile.enabled=true measures comm/ratio_measured, valid on a GPU or TPU"
    if profiles:
        return (
            f"No comm ratio: hardware={', '.join(profiles)} describes another device than the one that ran ({kinds}), "
            f"and a ratio of its link bandwidth to these step times would mix two machines. `{project}` models the "
            f"ratio wholly for it (`--projection` then shows it here); {measured}."
        )
    return (
        f"No comm ratio: no link bandwidth is known for {kinds}; {measured}, and `{project}` models one for a target."
    )


def setup_text(rows: list[dict]) -> str:
    """What every configuration shares, said once per caption: the model and data (``workload_text``), precision
    and batch (``settings_text``), and the regime when the settings leave it out."""
    settings = settings_text(rows)
    regime = "" if "scaling" in settings else regime_text(rows)
    return "; ".join(t for t in (workload_text(rows), settings, regime) if t)


def captions(rows: list[dict], plots: Iterable[str], projection_rows: list[dict] | None = None) -> dict[str, str]:
    """{figure name: its caption in ``scaling.md``}: what is drawn, the axes' scales, what the bars are (the method
    that made them), what is left out and why, and the setup once (``setup_text``)."""
    _, unit = throughput_key(rows)
    cpu = " Timings of devices simulated on one CPU: not accelerator timings." if is_cpu(rows) else ""
    few = f"configurations with fewer than {MIN_REPEATS} repeats have none"
    bars = f"bars: 95% intervals (Student's t on the log scale; {few})"
    devices = {r["devices"] for r in rows if r["devices"] and r["repeats"]}
    dotted = "; dotted: linear scaling from 1 device" if 1 in devices and len(devices) > 1 else ""
    out = {
        "throughput": (
            f"Global {unit} against the device count (log-log axes), per configuration the geometric mean of its "
            f"repeats; {bars}{dotted}.{cpu}"
        ),
        "speedup": (
            f"Speedup: {unit} over that of the same configuration on 1 device (the reference: 1, no bar), on log-log "
            f"axes (the y axis is log scale, ticks at powers of 2); bars: Welch's 95% interval of the ratio (t on the "
            f"difference of mean log throughputs; {few}); dotted: ideal (y = x).{cpu}"
        ),
        "efficiency": (
            "Scaling efficiency: speedup / devices (linear y axis; 1 = linear scaling; the 1-device reference is 1, "
            "no bar); bars: the speedup's Welch 95% interval (as in speedup.png) divided by the device count "
            f"({few}).{cpu}"
        ),
        "comm": (
            "Bytes of the collectives of one compiled optimizer step: the payload (the sum of their operands) and what "
            "each device sends under the ring model, both panels in one unit; exact on any platform, read from the "
            "compiled program."
            + (
                f" Right: {ratio_label(rows)}, communication time / step time.{cpu}"
                if ratio_known(rows)
                else " No comm ratio panel: the note above says why and how to get one."
            )
        ),
        "memory": (
            "Parameters and optimizer state held by one device (exact, from the compiled program); activations and "
            "other working memory are not included (scaling.csv's temp_bytes_per_device has XLA's temporary buffers)."
        ),
        "time_to_target": f"Time from the first step to the first evaluation reaching the target accuracy.{cpu}",
        "batch": "Final evaluation accuracy (median, min-max bars) and time to target against the global batch.",
    }
    if projection_rows:
        out["throughput"] = (
            f"Left: measured global {unit} against the device count (log-log axes), the geometric mean of the "
            f"repeats; {bars}{dotted}.{cpu} Right: {projection_title(projection_rows, rows)}, from the sweep's "
            "compiled collectives and FLOPs (`sweeps.project`): a model, not a measurement."
            + (
                " The two panels answer different questions (strong against weak scaling)."
                if "strong" in regime_text(rows)
                else ""
            )
        )
    setup = setup_text(rows)
    if setup:
        out = {k: v + f" Setup: {setup}." for k, v in out.items()}
    return {Path(name).stem: out.get(Path(name).stem, "") for name in plots}


def _sentence(text: str) -> str:
    """``text`` with its first letter upper case (``str.capitalize`` would lower the rest)."""
    return text[:1].upper() + text[1:]


def projection_lines(
    projection_rows: list[dict], source: str = "", unit: str = "examples/s", rows: list[dict] | None = None
) -> list[str]:
    """``scaling.md``'s projection section: the projected throughput, efficiency and communication ratio per
    configuration and device count (blank where ``sweeps.project`` left them out: a step below any device's)."""
    lines = [
        "## Projection (a model, not a measurement)",
        "",
        _sentence(projection_title(projection_rows, rows)) + (f", from `{source}`" if source else "") + ".",
        "comm ratio (projected) = modelled communication time / modelled step time on that hardware.",
        "",
        f"| configuration | devices | {unit} (projected) | efficiency | comm ratio (projected) |",
        "|---|---|---|---|---|",
    ]
    for p in projection_rows:
        left_out = bool(p.get("below_step_floor"))
        cells = [
            str(p["label"]),
            str(p["devices"]),
            ""
            if left_out
            else plain_4(p["tokens_per_s"] if unit == "tokens/s" and p.get("tokens_per_s") else p["examples_per_s"]),
            "" if left_out or p.get("efficiency") is None else f"{p['efficiency']:.3g}",
            "" if left_out or p.get("comm_ratio") is None else f"{p['comm_ratio']:.3g}",
        ]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    if any(p.get("below_step_floor") for p in projection_rows):
        lines += [
            "",
            "Blank: the configuration's modelled step computes below what a step takes on any real device, so "
            "sweeps.project leaves its throughput, efficiency and ratio out (projection.csv keeps them, flagged).",
        ]
    return lines + [""]


def write_markdown(
    rows: list[dict],
    path,
    source: str = "",
    plots: Iterable[str] = (),
    n_jobs: int = 0,
    n_failed: int = 0,
    projection_rows: list[dict] | None = None,
    projection_source: str = "",
    unfinished: Iterable[str] = (),
) -> Path:
    """The report as Markdown: header (platforms, device kinds, the settings every job shares, CPU warning, the
    jobs not finished), the table with 95% intervals, notes (how the figures are made; configurations with too
    few repeats; why there is no comm ratio), the projection section with ``projection_rows``, then each plot with
    a caption (``captions``). The ``config`` column (what distinguishes configurations beyond the other columns),
    the time-to-target and comm-ratio columns are left out when blank in every row; without any target a note
    says how to set one. A token model's sweep (``throughput_key``) shows ``tokens/s [95% interval]``,
    ``tokens/s per device`` and ``tokens/example`` in place of ``examples/s [95% interval]``."""
    key, unit = throughput_key(rows)
    tokens = key == "tokens_per_s"
    platforms, kinds = platform_header(rows)
    lines = ["# Scaling report", ""]
    if source:
        lines.append(f"Source: `{source}`  ")
    head = [
        f"Jobs: {n_jobs - n_failed} ok, {n_failed} failed; {len(rows)} configuration(s)",
        f"Platform(s): {', '.join(platforms) or 'unknown'}",
        f"Device kind(s): {', '.join(kinds) or 'unknown'}",
    ]
    if workload_text(rows):
        head.append(f"Model and data: {workload_text(rows)}")
    if overrides_text(rows):
        head.append(f"Overrides every job shares: `{overrides_text(rows)}`")
    lines += [line + "  " for line in head[:-1]] + head[-1:]  # Markdown line breaks
    lines.append("")
    if is_cpu(rows):
        lines += [f"> {CPU_WARNING}", ""]
    unfinished = list(unfinished)
    if unfinished:
        lines += [f"**Unfinished: {len(unfinished)} job(s) are not in this report:** " + "; ".join(unfinished), ""]
    header = [
        "mode",
        "precision",
        "accum",
        "scaling",
        "devices",
        "global batch",
        "config",
        "repeats",
        f"{unit} [95% interval]",
        *(["tokens/s per device", "tokens/example"] if tokens else []),
        "speedup [95% interval]",
        "efficiency [95% interval]",
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
    # both comm columns in one unit, the largest byte count's (as comm.png's panels)
    comm_unit = byte_unit(max((r[k] or 0 for r in rows for k in ("comm_payload_bytes", "comm_ring_bytes")), default=0))
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
            eps,
            *(per_device if tokens else []),
            _with_interval(r, "speedup", sig3),
            _with_interval(r, "efficiency", sig3),
            _num(r["eval_accuracy"], "{:.4f}"),
            _num(r["time_to_target_s"]),
            _num(r["steps_to_target"], "{:.0f}") + (f" ({r['target_reached']})" if r["target_reached"] else ""),
            format_bytes(r["comm_payload_bytes"], comm_unit),
            format_bytes(r["comm_ring_bytes"], comm_unit),
            _num(r["comm_ratio"]) + (f" ({r['comm_ratio_source']})" if r["comm_ratio"] is not None else ""),
            format_bytes(r["state_bytes_per_device"]),
            r["status"],
        ]
        table.append([c.replace("|", "/") for c in cells])
    optional = ("config", "time to target (s)", "steps to target", "comm ratio")
    keep = [i for i, h in enumerate(header) if h not in optional or any(row[i] for row in table)]
    lines += ["| " + " | ".join(header[i] for i in keep) + " |", "|" + "---|" * len(keep)]
    lines += ["| " + " | ".join(row[i] for i in keep) + " |" for row in table]
    lines.append("")
    lines.append(
        f"{unit}: the geometric mean over repeats (jobs differing only in train.seed) of each job's median over its "
        "logging windows (the first window after compilation excluded); 95% interval: Student's t on the log scale "
        f"(from {MIN_REPEATS} repeats). speedup: over the same configuration on 1 device (its reference, no "
        "interval), with Welch's 95% interval of the ratio; efficiency = speedup / devices, its interval the speedup's "
        "divided likewise. Speedup and efficiency to 3 significant digits."
    )
    if tokens:
        lines += [
            "",
            "tokens/s = examples/s x tokens/example (an example is one window of model.context tokens): the "
            "language model's unit of work; scaling.csv has both.",
        ]
    for note in (too_few_note(rows), few_windows_note(rows)):
        if note:
            lines += ["", f"**{note}.**"]
    ratio = comm_ratio_note(rows)
    if ratio:
        lines += ["", ratio]
    if not any(r["time_to_target_s"] is not None for r in rows):
        lines += ["", NO_TARGET_SENTENCE]
    lines.append("")
    if projection_rows:
        lines += projection_lines(projection_rows, projection_source, unit, rows)
    plots = list(plots)
    if plots:
        lines += ["## Figures", ""]
    for i, (name, caption) in enumerate(captions(rows, plots, projection_rows).items(), start=1):
        lines += [f"![{name}]({name}.png)", "", f"*Figure {i} ({name}.png).* {caption}", ""]
    path = Path(path)
    path.write_text("\n".join(lines))
    return path
