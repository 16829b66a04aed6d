"""Scaling report for a Hydra multirun of ``train.py``.

Usage::

    python train.py -m mesh.devices=1,2,4,8 parallel=jit_sharding,fsdp
    python -m sweeps.report multirun/2024-01-01/12-00-00 [--out DIR] [--wandb]

Every job of the multirun writes ``<multirun folder>/<job>/summary.json`` (one
flat JSON object with keys such as ``perf/examples_per_s`` or
``comm/bytes_per_step``).  This module collects them and writes, into ``--out``
(default: the multirun folder itself):

* ``scaling.csv`` - one row per job, raw numbers (bytes in bytes, throughput in
  examples/s), blank cells where a value is unknown or the job failed;
* ``scaling.md``  - the same table, human readable, headed by the platform(s)
  and device kind(s) found (and a warning for CPU-simulated devices);
* ``throughput.png``, ``efficiency.png``, ``comm.png``, ``memory.png``.

Definitions (N = number of devices in the data-parallel mesh)::

    speedup(N)    = examples_per_s(N) / examples_per_s(1)        [dimensionless]
    efficiency(N) = speedup(N) / N                               [1.0 = linear]

``examples_per_s(1)`` is the throughput of the successful 1-device job of the
same *group*: same mode, precision, accum steps, scaling kind,
grad_reduce_dtype and grad_compression, and same global batch (strong scaling)
or same per-device batch (weak scaling).  If the group has no successful
1-device job, speedup and efficiency are left blank.  If several successful
1-device jobs exist in a group, their mean throughput is the baseline.

Comm columns: ``comm/bytes_per_step`` is the ring all-reduce model of the bytes
each device sends per step (about ``2 (N-1)/N * payload``);
``comm/payload_bytes_per_step`` is the gradient payload.  The comm ratio is
``comm/ratio_model`` when present, else ``comm/ratio_measured`` when
``comm/ratio_measured_valid`` is true, else blank; the ``comm ratio source``
column says which (``model`` / ``measured``).

This module never imports JAX; matplotlib is used headless (Agg canvas, no
pyplot state) and wandb only with ``--wandb``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Iterable

SUMMARY_NAME = "summary.json"
OVERRIDES_PATH = Path(".hydra") / "overrides.yaml"

# ---------------------------------------------------------------------------
# Columns (CSV header == Markdown header == wandb.Table columns == row keys)
# ---------------------------------------------------------------------------
C_MODE = "mode"
C_PRECISION = "precision"
C_ACCUM = "accum"
C_SCALING = "scaling"
C_DEVICES = "devices"
C_GLOBAL_BATCH = "global batch"
C_EPS = "examples/s"
C_SPEEDUP = "speedup vs 1 device"
C_EFFICIENCY = "scaling efficiency"
C_COMM_BYTES = "comm bytes/step (ring model, per device)"
C_COMM_PAYLOAD = "comm payload bytes/step"
C_COMM_RATIO = "comm ratio"
C_COMM_RATIO_SOURCE = "comm ratio source"
C_STATE = "state bytes/device"
C_TEMP = "temp bytes/device"
C_EVAL_ACC = "eval accuracy"
C_STATUS = "status"
# Extra columns (after status): they complete the group key and locate the job.
C_PER_DEVICE_BATCH = "per-device batch"
C_GRAD_REDUCE = "grad reduce dtype"
C_GRAD_COMPRESSION = "grad compression"
C_COMM_PAYLOAD_LOWERED = "comm payload bytes/step (lowered)"
C_JOB = "job"

COLUMNS = [
    C_MODE, C_PRECISION, C_ACCUM, C_SCALING, C_DEVICES, C_GLOBAL_BATCH,
    C_EPS, C_SPEEDUP, C_EFFICIENCY, C_COMM_BYTES, C_COMM_PAYLOAD,
    C_COMM_RATIO, C_COMM_RATIO_SOURCE, C_STATE, C_TEMP, C_EVAL_ACC, C_STATUS,
    C_PER_DEVICE_BATCH, C_GRAD_REDUCE, C_GRAD_COMPRESSION, C_COMM_PAYLOAD_LOWERED, C_JOB,
]
# Configuration columns kept for failed jobs; every other column is blanked.
CONFIG_COLUMNS = (
    C_MODE, C_PRECISION, C_ACCUM, C_SCALING, C_DEVICES, C_GLOBAL_BATCH,
    C_STATUS, C_PER_DEVICE_BATCH, C_GRAD_REDUCE, C_GRAD_COMPRESSION, C_JOB,
)
BYTE_COLUMNS = (C_COMM_BYTES, C_COMM_PAYLOAD, C_COMM_PAYLOAD_LOWERED, C_STATE, C_TEMP)

PLOT_NAMES = ("throughput", "efficiency", "comm", "memory")

CPU_WARNING = (
    "**WARNING - CPU-simulated devices:** the devices of this sweep are "
    "simulated on one host CPU (XLA host platform device count) and share the "
    "same cores, so timings (examples/s, speedup, scaling efficiency, measured "
    "comm ratio) do NOT predict accelerator (GPU/TPU) performance. Byte counts "
    "(communication payload, ring-model bytes) and memory per device are still "
    "meaningful."
)


class ReportError(Exception):
    """A user-facing error (bad folder, no summaries, W&B failure)."""


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------
def _natural_key(path: Path) -> tuple:
    """Sort ``multirun/10/summary.json`` after ``multirun/9/summary.json``."""
    return tuple(
        (0, int(part), "") if part.isdigit() else (1, 0, part)
        for part in path.parts
    )


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
    * keys derived from ``.hydra/overrides.yaml`` (``mesh.devices=4`` ->
      ``mesh/devices``) for every key the summary lacks - this is what gives a
      failed job its device count and mode.

    Folders listed in ``exclude`` (e.g. the report output dir, when it is a
    sub-folder) and anything inside a ``wandb`` folder are skipped.  An
    unreadable ``summary.json`` becomes ``{"status": "failed", "error": ...}``.

    Raises ``ReportError`` if ``folder`` is not a directory.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ReportError(f"multirun folder does not exist or is not a directory: {folder}")
    root = folder.resolve()
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
        for key, value in overrides_to_keys(_read_overrides(job_dir)).items():
            summary.setdefault(key, value)
        summary["_job_dir"] = str(job_dir)
        summary["_job"] = str(rel.parent) if rel.parent != Path(".") else "."
        out.append(summary)
    return out


# ---------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------
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


def _group_key(row: dict) -> tuple:
    """Group of jobs compared by speedup (see module docstring)."""
    weak = row[C_SCALING] == "weak"
    batch = ("per-device", row[C_PER_DEVICE_BATCH]) if weak else ("global", row[C_GLOBAL_BATCH])
    return (
        row[C_MODE], row[C_PRECISION], row[C_ACCUM], row[C_SCALING],
        row[C_GRAD_REDUCE], row[C_GRAD_COMPRESSION], batch,
    )


def _label_parts(key: tuple) -> list[tuple[str, str]]:
    mode, precision, accum, scaling, reduce_dtype, compression, (batch_kind, batch) = key
    return [
        ("mode", str(mode) if mode is not None else "?"),
        ("precision", str(precision) if precision is not None else ""),
        ("accum", f"accum={accum}" if accum is not None else ""),
        ("scaling", f"{scaling}" if scaling is not None else ""),
        ("batch", "" if batch is None else
         (f"b={batch}/device" if batch_kind == "per-device" else f"B={batch}")),
        ("reduce", f"reduce={reduce_dtype}" if reduce_dtype is not None else ""),
        ("compression", f"compression={compression}" if compression is not None else ""),
    ]


def group_labels(keys: Iterable[tuple]) -> tuple[dict[tuple, str], str]:
    """Short legend labels for group keys.

    Fields equal across all groups (other than the mode) are left out of the
    labels and returned once as ``common`` (used as a plot subtitle).
    Returns ``({key: label}, common)``.
    """
    keys = list(dict.fromkeys(keys))
    parts = {k: _label_parts(k) for k in keys}
    if not keys:
        return {}, ""
    names = [name for name, _ in parts[keys[0]]]
    varying = {
        name for i, name in enumerate(names)
        if name == "mode" or len({parts[k][i][1] for k in keys}) > 1
    }
    labels = {
        k: " ".join(v for name, v in parts[k] if name in varying and v) for k in keys
    }
    common = ", ".join(
        v for name, v in parts[keys[0]] if name not in varying and v
    )
    return labels, common


def build_rows(summaries: list[dict]) -> list[dict]:
    """Turn job summaries into report rows, sorted and with speedup/efficiency.

    Each row is a dict keyed by ``COLUMNS`` (raw values: ints/floats in base
    units - bytes, examples/s - or None for a blank cell) plus private keys:
    ``_ok`` (bool), ``_group`` (group key tuple), ``_platform``,
    ``_device_kind``, ``_job_dir``.

    * examples/s = ``perf/examples_per_s``, or ``train/global_batch /
      perf/step_time_s`` when only the step time is known;
    * speedup = examples/s(N) / examples/s(1 device, same group);
    * scaling efficiency = speedup / N;
    * failed jobs keep the configuration columns (mode, precision, devices, ...)
      and ``status = "failed: <error>"``; all measurement columns are None.

    Sorted by mode, precision, accum, scaling (then the rest of the group key:
    grad reduce dtype, compression, batch, so a group stays contiguous), devices.
    """
    rows = []
    for summary in summaries:
        ok, status = _status(summary)
        devices = _devices(summary)
        global_batch = _int(summary.get("train/global_batch"))
        per_device = _int(summary.get("train/per_device_batch"))
        if per_device is None and global_batch and devices and global_batch % devices == 0:
            per_device = global_batch // devices
        eps = _num(summary.get("perf/examples_per_s"))
        step_time = _num(summary.get("perf/step_time_s"))
        if eps is None and global_batch and step_time:
            eps = global_batch / step_time
        ratio, source = _num(summary.get("comm/ratio_model")), None
        if ratio is not None:
            source = "model"
        elif summary.get("comm/ratio_measured_valid") is True:
            ratio = _num(summary.get("comm/ratio_measured"))
            source = "measured" if ratio is not None else None
        row = {
            C_MODE: _text(summary.get("parallel")),
            C_PRECISION: _text(summary.get("precision")),
            C_ACCUM: _int(summary.get("train/accum_steps")),
            C_SCALING: _text(summary.get("train/scaling")),
            C_DEVICES: devices,
            C_GLOBAL_BATCH: global_batch,
            C_EPS: eps,
            C_SPEEDUP: None,
            C_EFFICIENCY: None,
            C_COMM_BYTES: _num(summary.get("comm/bytes_per_step")),
            C_COMM_PAYLOAD: _num(summary.get("comm/payload_bytes_per_step")),
            C_COMM_PAYLOAD_LOWERED: _num(summary.get("comm/payload_bytes_per_step_lowered")),
            C_COMM_RATIO: ratio,
            C_COMM_RATIO_SOURCE: source,
            C_STATE: _num(summary.get("mem/state_bytes_per_device")),
            C_TEMP: _num(summary.get("mem/temp_bytes_per_device")),
            C_EVAL_ACC: _num(summary.get("eval/accuracy")),
            C_STATUS: status,
            C_PER_DEVICE_BATCH: per_device,
            C_GRAD_REDUCE: _text(summary.get("parallel/grad_reduce_dtype")),
            C_GRAD_COMPRESSION: _text(summary.get("parallel/grad_compression")),
            C_JOB: _text(summary.get("_job")),
        }
        if not ok:
            for column in COLUMNS:
                if column not in CONFIG_COLUMNS:
                    row[column] = None
        row["_ok"] = ok
        row["_group"] = _group_key(row)
        row["_platform"] = _text(summary.get("platform"))
        row["_device_kind"] = _text(summary.get("device_kind"))
        row["_job_dir"] = summary.get("_job_dir")
        rows.append(row)

    baselines: dict[tuple, list[float]] = defaultdict(list)
    for row in rows:
        if row["_ok"] and row[C_DEVICES] == 1 and row[C_EPS] and row[C_EPS] > 0:
            baselines[row["_group"]].append(row[C_EPS])
    for row in rows:
        base = baselines.get(row["_group"])
        if row["_ok"] and base and row[C_EPS] is not None and row[C_DEVICES]:
            base_eps = sum(base) / len(base)
            row[C_SPEEDUP] = row[C_EPS] / base_eps
            row[C_EFFICIENCY] = row[C_SPEEDUP] / row[C_DEVICES]

    rows.sort(key=lambda r: (
        tuple(_sort_part(x) for x in r["_group"][:6])
        + (_sort_part(r["_group"][6][1]), _sort_part(r[C_DEVICES]), _sort_part(r[C_JOB]))
    ))
    return rows


# ---------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------
def _csv_value(value: Any) -> str:
    """Raw CSV cell: blank for None, shortest repr for floats (1.8, not 1.8000000000000003)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if abs(value) >= 1e-4:
            value = round(value, 6)
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return repr(value)
    return str(value)


def format_bytes(value: float | None) -> str:
    """Human-readable binary size: ``1536`` -> ``"1.50 KiB"``."""
    if value is None:
        return ""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{int(value)} B"


def _md_value(column: str, value: Any) -> str:
    if value is None:
        return ""
    if column in BYTE_COLUMNS:
        return format_bytes(value)
    if column == C_EPS:
        return f"{value:,.1f}"
    if column in (C_SPEEDUP, C_EFFICIENCY, C_COMM_RATIO, C_EVAL_ACC) and isinstance(value, float):
        return f"{value:.3f}"
    return str(value).replace("|", "\\|")


def _distinct(values: Iterable[Any]) -> list[str]:
    return sorted({str(v) for v in values if v not in (None, "")})


def write_csv(rows: list[dict], path) -> Path:
    """Write ``rows`` to ``path`` (columns ``COLUMNS``, raw numbers)."""
    path = Path(path)
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(COLUMNS)
        for row in rows:
            writer.writerow([_csv_value(row.get(c)) for c in COLUMNS])
    return path


def platform_header(rows: list[dict]) -> tuple[list[str], list[str]]:
    """Distinct platforms and device kinds found in ``rows``."""
    return _distinct(r["_platform"] for r in rows), _distinct(r["_device_kind"] for r in rows)


def write_markdown(rows: list[dict], path, source: str = "", plots: Iterable[str] = ()) -> Path:
    """Write the Markdown report: header (platforms, device kinds, CPU warning), table, plots."""
    path = Path(path)
    platforms, kinds = platform_header(rows)
    n_ok = sum(r["_ok"] for r in rows)
    lines = ["# Scaling report", ""]
    if source:
        lines.append(f"Multirun folder: `{source}`  ")
    lines.append(f"Jobs: {len(rows)} ({n_ok} ok, {len(rows) - n_ok} failed)  ")
    lines.append(f"Platform(s): {', '.join(platforms) or 'unknown'}  ")
    lines.append(f"Device kind(s): {', '.join(kinds) or 'unknown'}")
    lines.append("")
    if "cpu" in {p.lower() for p in platforms}:
        lines += [f"> {CPU_WARNING}", ""]
    lines.append("| " + " | ".join(COLUMNS) + " |")
    lines.append("|" + "|".join("---" for _ in COLUMNS) + "|")
    for row in rows:
        lines.append("| " + " | ".join(_md_value(c, row.get(c)) for c in COLUMNS) + " |")
    lines += [
        "",
        "- speedup = examples/s(N devices) / examples/s(1 device) within a group "
        "(same mode, precision, accum, scaling, grad reduce dtype, compression, and "
        "global batch for strong / per-device batch for weak scaling); blank when the "
        "group has no successful 1-device job.",
        "- scaling efficiency = speedup / N (1.0 = perfect linear scaling).",
        "- comm bytes/step = ring all-reduce model of the bytes each device sends per "
        "step (~ 2 (N-1)/N x payload); comm ratio source says whether the ratio is the "
        "model estimate or a (valid) measurement.",
        "- bytes are shown in binary units (KiB = 1024 B, MiB = 1024 KiB); "
        "scaling.csv holds the raw byte counts.",
    ]
    plots = list(plots)
    if plots:
        lines.append("")
        for name in plots:
            lines.append(f"![{Path(name).stem}]({Path(name).name})")
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------
def _byte_unit(max_value: float) -> tuple[str, float]:
    """Pick the binary unit that keeps axis numbers readable: (name, bytes per unit)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if max_value >= scale:
            return unit, float(scale)
    return "B", 1.0


def _series(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Successful rows with a device count, by group, sorted by devices."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        if row["_ok"] and row[C_DEVICES]:
            groups[row["_group"]].append(row)
    return {k: sorted(v, key=lambda r: r[C_DEVICES]) for k, v in groups.items()}


_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")


def _style(i: int) -> dict:
    """Colour + marker of the i-th group (distinct markers keep overlapping lines visible)."""
    return {"color": f"C{i % 10}", "marker": _MARKERS[i % len(_MARKERS)], "lw": 1.8,
            "markersize": 6 if i % 2 == 0 else 5, "alpha": 0.9}


def _setup_x(ax, devices: Iterable[int]) -> None:
    ticks = sorted({int(d) for d in devices if d}) or [1]
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlim(ticks[0] / 1.3, ticks[-1] * 1.3)
    ax.set_xlabel("devices (data-parallel mesh size, log2 axis)")
    ax.grid(True, alpha=0.3)


def _no_data(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes,
            fontsize=10, color="0.3", wrap=True)


def _title(base: str, common: str, cpu: bool) -> str:
    title = base
    if common:
        title += f"\n({common})"
    if cpu:
        title += "\nCPU-simulated devices: timings do not predict accelerators"
    return title


def _figure(ncols: int = 1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.6 * ncols + 2.6, 4.6), dpi=120)
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]
    return fig, axes


def _save(fig, path: Path, handles=None, labels=None) -> Path:
    if handles:
        fig.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 0.95),
                   fontsize=8, frameon=True, title="group", title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def plot_throughput(rows: list[dict], path, cpu: bool = False) -> Path:
    """examples/s vs devices, one line per group, dashed ideal = examples/s(1) x N."""
    from matplotlib.lines import Line2D

    series = _series(rows)
    labels, common = group_labels(series)
    fig, (ax,) = _figure()
    handles, names = [], []
    devices = [r[C_DEVICES] for rs in series.values() for r in rs]
    for i, (key, rs) in enumerate(series.items()):
        pts = [(r[C_DEVICES], r[C_EPS]) for r in rs if r[C_EPS] is not None]
        if not pts:
            continue
        color = f"C{i % 10}"
        (line,) = ax.plot(*zip(*pts), **_style(i))
        handles.append(line)
        names.append(labels[key])
        base = [r[C_EPS] for r in rs if r[C_DEVICES] == 1 and r[C_EPS]]
        if base:
            top = max(d for d, _ in pts)
            xs = [2 ** (math.log2(top) * j / 40) for j in range(41)]  # smooth on log2 x
            b = sum(base) / len(base)
            ax.plot(xs, [b * x for x in xs], ls="--", color=color, lw=1, alpha=0.7)
    if handles:
        handles.append(Line2D([], [], ls="--", color="0.4", lw=1))
        names.append("ideal linear (1-device x N)")
        ax.set_ylim(bottom=0)
    else:
        _no_data(ax, "no successful job with a throughput value")
    _setup_x(ax, devices)
    ax.set_ylabel("throughput (examples/s)")
    ax.set_title(_title("Throughput vs devices", common, cpu), fontsize=10)
    return _save(fig, Path(path), handles, names)


def plot_efficiency(rows: list[dict], path, cpu: bool = False) -> Path:
    """Scaling efficiency (speedup / N) vs devices, reference line at 1.0."""
    series = _series(rows)
    labels, common = group_labels(series)
    fig, (ax,) = _figure()
    handles, names, top = [], [], 1.1
    devices = [r[C_DEVICES] for rs in series.values() for r in rs]
    for i, (key, rs) in enumerate(series.items()):
        pts = [(r[C_DEVICES], r[C_EFFICIENCY]) for r in rs if r[C_EFFICIENCY] is not None]
        if not pts:
            continue
        (line,) = ax.plot(*zip(*pts), **_style(i))
        handles.append(line)
        names.append(labels[key])
        top = max(top, max(e for _, e in pts) * 1.05)
    ref = ax.axhline(1.0, ls="--", color="0.4", lw=1)
    if handles:
        handles.append(ref)
        names.append("ideal (efficiency = 1.0)")
    else:
        _no_data(ax, "no group has a successful 1-device job:\nefficiency undefined")
    _setup_x(ax, devices)
    ax.set_ylim(0, top)
    ax.set_ylabel("scaling efficiency = speedup / N")
    ax.set_title(_title("Scaling efficiency vs devices", common, cpu), fontsize=10)
    return _save(fig, Path(path), handles, names)


def plot_comm(rows: list[dict], path, cpu: bool = False) -> Path:
    """Two panels: ring-model comm bytes/step per device, and comm ratio, vs devices."""
    from matplotlib.lines import Line2D

    series = _series(rows)
    labels, common = group_labels(series)
    fig, (ax_b, ax_r) = _figure(2)
    devices = [r[C_DEVICES] for rs in series.values() for r in rs]
    values = [r[C_COMM_BYTES] for rs in series.values() for r in rs if r[C_COMM_BYTES] is not None]
    unit, scale = _byte_unit(max(values) if values else 0)
    handles, names, sources = [], [], set()
    for i, (key, rs) in enumerate(series.items()):
        pts = [(r[C_DEVICES], r[C_COMM_BYTES] / scale) for r in rs if r[C_COMM_BYTES] is not None]
        shown = False
        if pts:
            ax_b.plot(*zip(*pts), **_style(i))
            shown = True
        for source, ls in (("model", "-"), ("measured", ":")):
            pts = [(r[C_DEVICES], r[C_COMM_RATIO]) for r in rs
                   if r[C_COMM_RATIO] is not None and r[C_COMM_RATIO_SOURCE] == source]
            if pts:
                ax_r.plot(*zip(*pts), **{**_style(i), "ls": ls})
                sources.add(source)
                shown = True
        if shown:
            handles.append(Line2D([], [], **_style(i)))
            names.append(labels[key])
    if not values:
        _no_data(ax_b, "no comm/bytes_per_step recorded")
    if not sources:
        _no_data(ax_r, "comm ratio unknown:\nno comm/ratio_model and no valid\n"
                       "comm/ratio_measured in the summaries")
    else:
        ax_r.set_ylim(bottom=0)
        for source, ls in (("model", "-"), ("measured", ":")):
            if source in sources:
                handles.append(Line2D([], [], color="0.4", ls=ls))
                names.append(f"ratio source: {source}")
    _setup_x(ax_b, devices)
    _setup_x(ax_r, devices)
    ax_b.set_ylabel(f"bytes sent per device per step ({unit})")
    ax_b.set_title("Comm volume (ring all-reduce model)", fontsize=10)
    ax_r.set_ylabel("comm ratio (dimensionless)")
    ax_r.set_title("Comm ratio (model, or valid measurement)", fontsize=10)
    fig.suptitle(_title("Communication vs devices", common, cpu), fontsize=10)
    return _save(fig, Path(path), handles, names)


def plot_memory(rows: list[dict], path, cpu: bool = False) -> Path:
    """Two panels: state bytes/device and temp bytes/device vs devices."""
    series = _series(rows)
    labels, common = group_labels(series)
    fig, axes = _figure(2)
    devices = [r[C_DEVICES] for rs in series.values() for r in rs]
    handles, names = {}, {}
    for ax, column, what in ((axes[0], C_STATE, "state (params + optimizer)"),
                             (axes[1], C_TEMP, "temporaries (XLA temp buffers)")):
        values = [r[column] for rs in series.values() for r in rs if r[column] is not None]
        unit, scale = _byte_unit(max(values) if values else 0)
        for i, (key, rs) in enumerate(series.items()):
            pts = [(r[C_DEVICES], r[column] / scale) for r in rs if r[column] is not None]
            if pts:
                (line,) = ax.plot(*zip(*pts), **_style(i))
                handles.setdefault(key, line)
                names[key] = labels[key]
        if values:
            ax.set_ylim(bottom=0)
        else:
            _no_data(ax, f"no {column} recorded")
        _setup_x(ax, devices)
        ax.set_ylabel(f"{column} ({unit})")
        ax.set_title(f"Memory per device: {what}", fontsize=10)
    fig.suptitle(_title("Memory per device vs devices", common, False), fontsize=10)
    return _save(fig, Path(path), list(handles.values()), list(names.values()))


def write_plots(rows: list[dict], out_dir) -> dict[str, Path]:
    """Write throughput/efficiency/comm/memory PNGs into ``out_dir`` (failed jobs skipped)."""
    out_dir = Path(out_dir)
    platforms, _ = platform_header(rows)
    cpu = "cpu" in {p.lower() for p in platforms}
    funcs = {"throughput": plot_throughput, "efficiency": plot_efficiency,
             "comm": plot_comm, "memory": plot_memory}
    return {name: funcs[name](rows, out_dir / f"{name}.png", cpu=cpu) for name in PLOT_NAMES}


# ---------------------------------------------------------------------------
# W&B
# ---------------------------------------------------------------------------
def _most_common(summaries: list[dict], key: str) -> str | None:
    values = [str(s[key]) for s in summaries if s.get(key) not in (None, "")]
    return Counter(values).most_common(1)[0][0] if values else None


def infer_group(summaries: list[dict], folder) -> str:
    """W&B group of the jobs: the summaries' ``wandb/group``, else the folder name."""
    return _most_common(summaries, "wandb/group") or Path(folder).resolve().name


def _metric_name(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "_", label).strip("_") or "group"


def log_to_wandb(rows: list[dict], plots: dict[str, Path], summaries: list[dict], folder,
                 group: str | None = None, project: str | None = None,
                 entity: str | None = None) -> dict[str, Any]:
    """Log a ``job_type="scaling_report"`` run into the jobs' W&B group.

    Logs ``scaling_table`` (``wandb.Table`` of ``COLUMNS``), the PNGs as
    ``plots/<name>`` (``wandb.Image``) and, per device count N (x axis
    ``scaling/devices``), ``scaling/examples_per_s/<group>``,
    ``scaling/speedup/<group>`` and ``scaling/efficiency/<group>`` so that
    dashboards can draw cross-run curves.  WANDB_MODE (e.g. ``offline``),
    WANDB_DIR, WANDB_PROJECT and WANDB_ENTITY are honoured.

    Returns ``{"wandb_run_id", "wandb_group", "wandb_sync_file", "wandb_url"}``.
    """
    import wandb

    group = group or infer_group(summaries, folder)
    project = project or _most_common(summaries, "wandb/project") or os.environ.get("WANDB_PROJECT")
    entity = entity or _most_common(summaries, "wandb/entity") or os.environ.get("WANDB_ENTITY")
    platforms, kinds = platform_header(rows)
    run = wandb.init(
        project=project,
        entity=entity,
        group=group,
        job_type="scaling_report",
        name=f"scaling-report-{group}",
        config={
            "multirun_folder": str(Path(folder).resolve()),
            "n_jobs": len(rows),
            "n_failed": sum(not r["_ok"] for r in rows),
            "platforms": platforms,
            "device_kinds": kinds,
        },
        settings=wandb.Settings(
            x_disable_stats=True, x_disable_machine_info=True, save_code=False,
            disable_git=True, console="off",
        ),
    )
    try:
        run.define_metric("scaling/devices")
        run.define_metric("scaling/*", step_metric="scaling/devices")
        labels, _ = group_labels(_series(rows))
        by_devices: dict[int, dict[str, float]] = defaultdict(dict)
        for row in rows:
            if not row["_ok"] or not row[C_DEVICES] or row["_group"] not in labels:
                continue
            name = _metric_name(labels[row["_group"]])
            for prefix, column in (("examples_per_s", C_EPS), ("speedup", C_SPEEDUP),
                                   ("efficiency", C_EFFICIENCY)):
                if row[column] is not None:
                    by_devices[row[C_DEVICES]][f"scaling/{prefix}/{name}"] = row[column]
        for devices in sorted(by_devices):
            run.log({"scaling/devices": devices, **by_devices[devices]})
        table = wandb.Table(
            columns=COLUMNS,
            data=[[row.get(c) for c in COLUMNS] for row in rows],
            allow_mixed_types=True,
        )
        payload: dict[str, Any] = {"scaling_table": table}
        for name, path in plots.items():
            payload[f"plots/{name}"] = wandb.Image(str(path), caption=f"{name} vs devices")
        run.log(payload)
        run.summary["scaling/n_jobs"] = len(rows)
        run.summary["scaling/n_failed"] = sum(not r["_ok"] for r in rows)
        info = {
            "wandb_run_id": run.id,
            "wandb_group": group,
            "wandb_sync_file": Path(run.settings.sync_file),
            "wandb_url": getattr(run, "url", None),
        }
    finally:
        run.finish()
    return info


# ---------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------
def write_report(folder, out_dir=None, use_wandb: bool = False, group: str | None = None,
                 project: str | None = None, entity: str | None = None) -> dict[str, Path]:
    """Build the scaling report of the multirun ``folder``.

    Writes ``scaling.csv``, ``scaling.md`` and the four PNGs into ``out_dir``
    (default ``folder``) and, if ``use_wandb``, logs a ``scaling_report`` run
    (see :func:`log_to_wandb`).

    Returns ``{"csv", "md", "throughput", "efficiency", "comm", "memory"}`` ->
    ``Path`` (plus ``"wandb_sync_file"`` -> ``Path`` of the run's ``.wandb``
    file with ``use_wandb``).  Raises ``ReportError`` when the folder does not
    exist, holds no ``summary.json``, or W&B logging fails (files are written
    before W&B is contacted).
    """
    folder = Path(folder)
    out = Path(out_dir) if out_dir is not None else folder
    summaries = load_summaries(folder, exclude=[out] if out_dir is not None else [])
    if not summaries:
        raise ReportError(f"no {SUMMARY_NAME} found under {folder}")
    rows = build_rows(summaries)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {"csv": write_csv(rows, out / "scaling.csv")}
    plots = write_plots(rows, out)
    paths["md"] = write_markdown(rows, out / "scaling.md", source=str(folder),
                                 plots=[p.name for p in plots.values()])
    paths.update(plots)
    if use_wandb:
        try:
            info = log_to_wandb(rows, plots, summaries, folder, group=group,
                                project=project, entity=entity)
        except Exception as exc:  # noqa: BLE001 - report one clear line
            first = (str(exc).strip().splitlines() or [""])[0]
            raise ReportError(
                f"report written to {out}, but W&B logging failed: "
                f"{type(exc).__name__}: {first}"
            ) from exc
        paths["wandb_sync_file"] = info["wandb_sync_file"]
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sweeps.report",
        description="Scaling table (CSV + Markdown) and plots from a Hydra multirun folder.",
    )
    parser.add_argument("folder", help="multirun folder (searched recursively for summary.json)")
    parser.add_argument("--out", default=None, help="output folder (default: the multirun folder)")
    parser.add_argument("--wandb", action="store_true",
                        help="also log a job_type=scaling_report run into the jobs' W&B group "
                             "(honours WANDB_MODE, e.g. offline)")
    parser.add_argument("--group", default=None,
                        help="W&B group (default: summaries' wandb/group, else the folder name)")
    parser.add_argument("--project", default=None,
                        help="W&B project (default: summaries' wandb/project, else WANDB_PROJECT)")
    parser.add_argument("--entity", default=None,
                        help="W&B entity (default: summaries' wandb/entity, else WANDB_ENTITY)")
    args = parser.parse_args(argv)
    try:
        paths = write_report(args.folder, args.out, use_wandb=args.wandb, group=args.group,
                             project=args.project, entity=args.entity)
    except ReportError as exc:
        print(f"sweeps.report: error: {exc}", file=sys.stderr)
        return 2
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
