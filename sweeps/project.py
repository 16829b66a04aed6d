"""Project data-parallel throughput and scaling efficiency to clusters of up to 1024 devices.

    python -m sweeps.project RUN_OR_SWEEP_FOLDER --hardware h100_sxm --mfu 0.4 --devices 8,64,512
    python -m sweeps.project --hardware custom --set devices_per_node=8 --set intra_node_bytes_per_s=100e9 \\
        --set inter_node_bytes_per_s=10e9 --set latency_s=0 --params 25000000 --grad-bytes-per-param 4 \\
        --flops-per-example 1e9 --per-device-batch 32 --step-time-s 0.1 --overlap 0 --devices 1,8,16 --out DIR

Inputs: either a run folder (or a sweep folder: every ``summary.json`` below it; per configuration the job
with the most devices is used) from which the compiled step's collectives (``comm/collectives``: kind and
payload S of each; in-loop ones repeat ``train/accum_steps`` times), ``perf/flops_per_step_per_device`` and the
per-device batch (``train/global_batch`` / ``mesh/devices``) are read; or explicit ``--params``,
``--grad-bytes-per-param``, ``--flops-per-example``, ``--per-device-batch``, ``--parallel``.
The payload S of every collective is the same for every N (the gradients and parameters keep their full
size; tests/test_project.py checks this against the compiled step at 2, 4 and 8 devices).

For a language model (``model=gpt``: a summary with ``train/tokens_per_example`` or ``model/context``, or
``--tokens-per-example T`` with explicit inputs) the unit of work is the token: the rows gain
``tokens_per_example`` (T), ``tokens_per_s`` = examples_per_s x T and ``flops_per_token`` = FLOPs per step
per device / (per-device batch x T), and the console, Markdown and plot show tokens/s. ``--flops-per-token F``
gives the FLOPs as F x T per example (with ``--tokens-per-example``).

The hardware is a profile of ``conf/hardware/`` (``--hardware NAME``) with ``--set key=value`` overrides.
The compute time of one step is ``--step-time-s`` (measured on one device of the target) or
``--mfu`` x peak: FLOPs per step per device / (mfu * peak_flops_per_s).

Writes ``projection.csv``, ``projection.md`` and ``projection.png`` into ``--out`` (default: the folder, or
the current directory) and with ``--wandb`` logs them as a ``job_type="projection"`` run in the sweep's W&B
group. The model is that of sweeps/projection.py (docs/projection.md). Bad input: one line on
stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any, Optional, Sequence

from measure.hardware import HardwareError, load_profile, set_field
from sweeps.report.collect import tokens_per_example
from sweeps.projection import (
    ALGORITHMS,
    COLUMNS,
    Collective,
    Hardware,
    ProjectionError,
    collectives_for,
    overlay_projection,
    project,
)
from tracking.folders import CHECKPOINTS, STEP, folder_kind

SUMMARY_NAME = "summary.json"
_COLLECTIVE_RE = re.compile(r"^(?P<kind>[a-z\-]+) (?P<dtype>\S+) (?P<bytes>\d+)B n=(?P<n>\d+)(?P<loop> loop)?$")
# Summary keys that make two jobs "the same configuration" (all but the device count, the seed and the batch
# that follows the device count: see ``config_key``).
CONFIG_KEYS = (
    "parallel",
    "precision",
    "model",
    "model/context",
    "data",
    "parallel/grad_reduce_dtype",
    "parallel/grad_compression",
    "train/accum_steps",
    "train/scaling",
)


def parse_devices(text: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]; raises ProjectionError for anything but positive integers."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise ProjectionError(f"--devices {text!r}: give positive integers separated by commas, e.g. 1,8,64,1024")
    return sorted(set(values))


def load_summaries(folder: Path) -> list[dict[str, Any]]:
    """Every readable ``summary.json`` below ``folder`` (a run or sweep folder) whose ``status`` is ok (``wandb``
    folders skipped). Raises ProjectionError for a missing folder, a checkpoint folder or step (naming the run
    folder to pass), or no finished run."""
    if not folder.is_dir():
        raise ProjectionError(f"run folder does not exist or is not a directory: {folder}")
    kind = folder_kind(folder)
    if kind in (CHECKPOINTS, STEP):  # the run folder holds the summary: one or two levels up
        run = folder.parent if kind == CHECKPOINTS else folder.parent.parent
        what = "a run's checkpoint folder" if kind == CHECKPOINTS else "a checkpoint step of a run"
        raise ProjectionError(f"{folder} is {what}, not a run or sweep folder; pass the run folder {run}")
    out, unreadable, other = [], [], []
    for path in sorted(folder.rglob(SUMMARY_NAME)):
        if "wandb" in path.relative_to(folder).parts[:-1]:
            continue
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError) as e:  # named below when no run is left
            unreadable.append(f"{path} ({type(e).__name__})")
            continue
        if isinstance(summary, dict) and summary.get("status", "ok") == "ok":
            summary["_job_dir"] = str(path.parent)
            out.append(summary)
        else:
            other.append(f"{path} (status {summary.get('status') if isinstance(summary, dict) else '?'})")
    if not out:
        found = "; ".join((unreadable + other)[:3]) or "none found"
        raise ProjectionError(f"no finished run (summary.json with status ok) below {folder}: {found}")
    return out


def collectives_from_summary(summary: dict[str, Any]) -> list[Collective]:
    """The compiled step's collectives from ``comm/collectives`` (``"all-reduce f32 814128B n=8[ loop]"``).

    In-loop collectives get ``repeats = train/accum_steps``. Without the list (older summaries), one kind with
    ``comm/count/<kind>`` > 0 is accepted: its ``comm/payload_bytes_per_step`` split evenly over the count.
    Raises ProjectionError when neither is usable.
    """
    accum = int(summary.get("train/accum_steps") or 1)
    entries = summary.get("comm/collectives")
    if isinstance(entries, list):
        out = []
        for entry in entries:
            match = _COLLECTIVE_RE.match(str(entry))
            if not match:
                raise ProjectionError(f"{summary.get('_job_dir')}: cannot read collective {entry!r}")
            out.append(Collective(match["kind"], float(match["bytes"]), accum if match["loop"] else 1))
        return out
    kinds = {k[len("comm/count/") :]: int(v) for k, v in summary.items() if k.startswith("comm/count/") and v}
    payload = summary.get("comm/payload_bytes_per_step")
    if len(kinds) == 1 and payload is not None:
        ((kind, count),) = kinds.items()
        return [Collective(kind, float(payload) / count) for _ in range(count)]
    raise ProjectionError(
        f"{summary.get('_job_dir')}: summary.json has no comm/collectives; rerun the job "
        "with this version of train.py or give --params/--grad-bytes-per-param"
    )


def _config_label(summary: dict[str, Any]) -> str:
    parts = [str(summary.get(k)) for k in ("parallel", "precision", "model") if summary.get(k) not in (None, "")]
    if summary.get("train/global_batch") and summary.get("mesh/devices"):
        parts.append(f"batch/device={summary['train/global_batch'] / summary['mesh/devices']:g}")
    if tokens_per_example(summary):
        parts.append(f"context={tokens_per_example(summary)}")
    if int(summary.get("train/accum_steps") or 1) > 1:
        parts.append(f"accum={summary['train/accum_steps']}")
    if summary.get("parallel/grad_compression") not in (None, "", "none"):
        parts.append(f"compression={summary['parallel/grad_compression']}")
    if summary.get("parallel/grad_reduce_dtype") not in (None, ""):
        parts.append(f"reduce={summary['parallel/grad_reduce_dtype']}")
    return " ".join(parts) or "run"


def config_key(summary: dict[str, Any]) -> tuple:
    """The configuration a job belongs to: :data:`CONFIG_KEYS` plus the batch held fixed across its device
    counts (the global batch under strong scaling, as in ``sweeps.report``; the per-device batch under weak
    scaling and in summaries that do not record ``train/scaling``)."""
    strong = summary.get("train/scaling") == "strong"
    batch = summary.get("train/global_batch") if strong else summary.get("train/per_device_batch")
    return tuple(str(summary.get(k)) for k in CONFIG_KEYS) + (str(batch),)


def has_collectives(summary: dict[str, Any]) -> bool:
    """Whether the job's compiled step communicates: more than one device and at least one collective in
    ``comm/collectives`` (or a ``comm/count/<kind>`` > 0 in older summaries)."""
    if int(summary.get("mesh/devices") or 1) < 2:
        return False
    entries = summary.get("comm/collectives")
    if isinstance(entries, list):
        return bool(entries)
    return any(v for k, v in summary.items() if k.startswith("comm/count/"))


def configurations(summaries: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """(one summary per configuration (:func:`config_key`): its job with the most devices among those whose
    compiled step has a collective; the labels of configurations skipped because none of their jobs has one).

    A job without collectives (one device) would project perfect scaling to any device count, so it is
    never a source.
    """
    best: dict[tuple, dict[str, Any]] = {}
    skipped: dict[tuple, str] = {}
    for s in summaries:
        key = config_key(s)
        if not has_collectives(s):
            skipped.setdefault(key, _config_label(s))
            continue
        if key not in best or int(s.get("mesh/devices") or 0) > int(best[key].get("mesh/devices") or 0):
            best[key] = s
    return [best[k] for k in sorted(best)], [skipped[k] for k in sorted(skipped) if k not in best]


def hardware_from_args(name: str, sets: Sequence[str]) -> tuple[Hardware, dict[str, Any]]:
    """The profile ``name`` with the ``key=value`` overrides applied; raises HardwareError/ProjectionError."""
    profile = load_profile(name)
    for item in sets:
        if "=" not in item:
            raise HardwareError(f"--set {item!r}: expected key=value, e.g. --set inter_node_bytes_per_s=25e9")
        key, value = item.split("=", 1)
        profile = set_field(profile, key.strip(), value.strip())
    return Hardware.from_profile(profile), profile


def _compute_s(args, flops_per_step: Optional[float], hw: Hardware) -> float:
    if (args.step_time_s is None) == (args.mfu is None):
        raise ProjectionError(
            "give exactly one of --step-time-s (compute time of one step on one device) "
            "or --mfu (with the profile's peak_flops_per_s)"
        )
    if args.step_time_s is not None:
        if not args.step_time_s > 0:
            raise ProjectionError(f"--step-time-s {args.step_time_s}: must be > 0")
        return float(args.step_time_s)
    if not 0 < args.mfu <= 1:
        raise ProjectionError(f"--mfu {args.mfu}: must be in (0, 1]")
    if not hw.peak_flops_per_s:
        raise ProjectionError(
            f"--mfu needs the peak: profile {hw.name!r} has no peak_flops_per_s; "
            "add --set peak_flops_per_s=... or use --step-time-s"
        )
    if not flops_per_step:
        raise ProjectionError(
            "--mfu needs the FLOPs of a step: give --flops-per-example (and --per-device-batch) "
            "or a run folder whose summary has perf/flops_per_step_per_device"
        )
    return float(flops_per_step) / (args.mfu * hw.peak_flops_per_s)


TOKEN_COLUMNS = ["tokens_per_example", "tokens_per_s", "flops_per_token"]


def with_tokens(
    rows: list[dict[str, Any]], tokens: Optional[int], flops_per_step: Optional[float], per_device_batch: float
) -> list[dict[str, Any]]:
    """``rows`` of :func:`sweeps.projection.project` with :data:`TOKEN_COLUMNS` when ``tokens`` (tokens per
    example, T) is given: ``tokens_per_s`` = examples_per_s x T, ``flops_per_token`` = ``flops_per_step`` (per
    device) / (``per_device_batch`` x T), None without FLOPs. Unchanged when ``tokens`` is None."""
    if not tokens:
        return rows
    per_token = flops_per_step / (per_device_batch * tokens) if flops_per_step else None
    return [
        {**r, "tokens_per_example": tokens, "tokens_per_s": r["examples_per_s"] * tokens, "flops_per_token": per_token}
        for r in rows
    ]


def _explicit_flops(args, tokens: Optional[int]) -> Optional[float]:
    """FLOPs per example from --flops-per-example, or --flops-per-token x ``tokens`` (--tokens-per-example,
    else the run's context); None when neither is given."""
    if args.tokens_per_example is not None and not (args.tokens_per_example >= 1):
        raise ProjectionError(f"--tokens-per-example {args.tokens_per_example}: must be a positive integer")
    for flag, value in (("--flops-per-token", args.flops_per_token), ("--flops-per-example", args.flops_per_example)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ProjectionError(f"{flag} {value:g}: must be a positive number")
    if args.flops_per_token is None:
        return args.flops_per_example
    if args.flops_per_example is not None:
        raise ProjectionError(
            f"--flops-per-token {args.flops_per_token:g} and --flops-per-example {args.flops_per_example:g}: "
            "give one of them"
        )
    if not tokens:
        raise ProjectionError(
            f"--flops-per-token {args.flops_per_token:g} needs --tokens-per-example (tokens in one example, "
            "e.g. model.context)"
        )
    return args.flops_per_token * tokens


def by_hand(summaries: list[dict[str, Any]], args) -> str:
    """The command that projects the model of the first of ``summaries`` (1-device runs) from explicit inputs:
    its parameters, per-device batch and FLOPs per example, with this command's hardware, devices and MFU (0.4 when
    none was given)."""
    s = summaries[0] if summaries else {}
    params, batch = s.get("model/param_count"), s.get("train/per_device_batch")
    flops = s.get("perf/flops_per_step_per_device")
    per_example = f"{flops / batch:.6g}" if flops and batch else "F"
    mfu = f"--step-time-s {args.step_time_s}" if args.step_time_s else f"--mfu {args.mfu or 0.4}"
    return (
        f"python -m sweeps.project --params {params or 'N'} --per-device-batch {batch or 'B'} "
        f"--flops-per-example {per_example} {mfu} --hardware {args.hardware} --devices {args.devices}"
    )


def build_projection(args) -> tuple[list[dict[str, Any]], Hardware, dict[str, Any], list[dict[str, Any]]]:
    """Rows (one per configuration and device count, with a ``config`` column), the hardware, the profile
    and the summaries used (empty for explicit inputs)."""
    hw, profile = hardware_from_args(args.hardware, args.set)
    devices = parse_devices(args.devices)
    explicit = args.params is not None
    if explicit == (args.folder is not None):
        raise ProjectionError(
            "give a run or sweep folder, or --params with --grad-bytes-per-param "
            "(and --per-device-batch), not both and not neither"
        )
    rows: list[dict[str, Any]] = []
    if explicit:
        if args.per_device_batch is None:
            raise ProjectionError("--params needs --per-device-batch (examples per device per optimizer step)")
        collectives = collectives_for(args.parallel, args.params, args.grad_bytes_per_param)
        per_example = _explicit_flops(args, args.tokens_per_example)
        flops = None if per_example is None else per_example * args.per_device_batch
        compute = _compute_s(args, flops, hw)
        projected = project(
            collectives, compute, args.per_device_batch, devices, hw, args.overlap, args.algorithm, flops
        )
        for row in with_tokens(projected, args.tokens_per_example, flops, args.per_device_batch):
            rows.append({"config": args.parallel, **row, "per_device_batch": args.per_device_batch})
        return rows, hw, profile, []
    summaries = load_summaries(Path(args.folder))
    sources, skipped = configurations(summaries)
    if not sources:
        raise ProjectionError(
            f"no job below {args.folder} has a collective in its compiled step (only 1-device jobs?): "
            "a projection needs a job with mesh.devices >= 2, or the model given by hand instead of the folder: "
            + by_hand(summaries, args)
        )
    args.skipped = skipped
    for summary in sources:
        collectives = collectives_from_summary(summary)
        n_run = int(summary.get("mesh/devices") or 1)
        batch = args.per_device_batch
        if batch is None:
            global_batch = summary.get("train/global_batch")
            batch = global_batch / n_run if global_batch else summary.get("train/per_device_batch")
        if not batch:
            raise ProjectionError(
                f"{summary['_job_dir']}: no train/global_batch in summary.json; give --per-device-batch"
            )
        run_tokens = tokens_per_example(summary)
        if args.tokens_per_example and args.tokens_per_example != run_tokens:
            what = f"its context is {run_tokens}" if run_tokens else "it is not a language model (no model/context)"
            raise ProjectionError(
                f"--tokens-per-example {args.tokens_per_example} does not match the run {summary['_job_dir']}: "
                f"{what}; leave --tokens-per-example out when projecting from a run"
            )
        tokens = run_tokens
        flops = summary.get("perf/flops_per_step_per_device")
        per_example = _explicit_flops(args, tokens)
        if per_example is not None:
            flops = per_example * batch
        compute = _compute_s(args, flops, hw)
        projected = project(collectives, compute, batch, devices, hw, args.overlap, args.algorithm, flops)
        for row in with_tokens(projected, tokens, flops, batch):
            rows.append(
                {
                    "config": _config_label(summary),
                    "run_devices": n_run,
                    **row,
                    "per_device_batch": batch,
                    # private (not in the CSV): what the source job held fixed, for regime_note
                    "_run_scaling": summary.get("train/scaling"),
                    "_run_global_batch": summary.get("train/global_batch"),
                    "_batch_given": args.per_device_batch is not None,
                }
            )
    return rows, hw, profile, summaries


def assumptions(args, hw: Hardware) -> str:
    """One line in words: the profile's numbers and the assumptions (``projection.md``'s header), e.g. ``h100_sxm:
    8 devices per node, links 450 GB/s within a node and 50 GB/s between nodes, 4 µs latency; MFU 0.4, no overlap,
    hierarchical collectives; weak scaling (per-device batch fixed)``."""
    compute = (
        f"compute {format_seconds(args.step_time_s)} per step" if args.step_time_s is not None else f"MFU {args.mfu:g}"
    )
    overlap = f"{args.overlap:g} of the compute overlapping communication" if args.overlap else "no overlap"
    return (
        f"{hw.name}: {hw.devices_per_node} devices per node, links {format_rate(hw.intra_node_bytes_per_s)} within a "
        f"node and {format_rate(hw.inter_node_bytes_per_s)} between nodes, {format_seconds(hw.latency_s)} latency; "
        f"{compute}, {overlap}, {args.algorithm} collectives; weak scaling (per-device batch fixed)"
    )


def format_rate(bytes_per_s: float) -> str:
    """A link bandwidth in decimal units: ``450 GB/s``, ``12.5 GB/s``, ``800 MB/s``."""
    for scale, unit in ((1e12, "TB/s"), (1e9, "GB/s"), (1e6, "MB/s"), (1e3, "kB/s")):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.3g} {unit}"
    return f"{bytes_per_s:.3g} B/s"


def plot_title(args, hw: Hardware, rows: Sequence[dict[str, Any]]) -> str:
    """projection.png's title: hardware, assumed MFU of its peak (or compute time) and regime, e.g. ``Projected for
    h100_sxm at MFU 0.4 of 989 TFLOP/s peak: weak scaling, 64 examples per device (a model, not a measurement)``."""
    peak = f" of {hw.peak_flops_per_s / 1e12:.3g} TFLOP/s peak" if hw.peak_flops_per_s else ""
    at = (
        f"{format_seconds(args.step_time_s)} of compute per step"
        if args.step_time_s is not None
        else f"MFU {args.mfu:g}{peak}"
    )
    batches = sorted({float(f"{r['per_device_batch']:.6g}") for r in rows if r.get("per_device_batch")})
    per_device = f", {'/'.join(f'{b:g}' for b in batches)} examples per device" if batches else ""
    return f"Projected for {hw.name} at {at}: weak scaling{per_device} (a model, not a measurement)"


def regime_note(rows: Sequence[dict[str, Any]]) -> str:
    """A sentence when a strong-scaling sweep was projected as weak scaling (the per-device batch of its job with
    the most devices held fixed at every projected count), else empty."""
    strong = [r for r in rows if r.get("_run_scaling") == "strong" and not r.get("_batch_given")]
    if not strong:
        return ""
    first = strong[0]
    return (
        f"The sweep ran strong scaling (global batch {first['_run_global_batch']} fixed); projected as weak scaling "
        f"at the per-device batch of its largest job ({first['run_devices']} devices: "
        f"{first['per_device_batch']:g} examples per device), held fixed at every projected device count."
    )


# Columns after the model's: what the projection assumed (the same in every row) and the floor flag.
META_COLUMNS = ["per_device_batch", "scaling", "hardware", "assumed_mfu", "assumed_step_time_s", "below_step_floor"]
# Columns derived from the compute time: meaningless for a step below ``STEP_FLOOR_S`` (left out of the .md and .png).
FLOOR_COLUMNS = ("step_time_s", "examples_per_s", "tokens_per_s", "speedup", "efficiency", "comm_ratio", "mfu")


def annotate(rows: list[dict[str, Any]], args, hw: Hardware) -> list[dict[str, Any]]:
    """``rows`` with :data:`META_COLUMNS`: the per-device batch (as given, else ``examples_per_s`` x step time / N),
    ``scaling`` ``weak``, the hardware profile, the assumed MFU or compute time, and ``below_step_floor``
    (``below_floor``)."""
    tiny = below_floor(rows)
    return [
        {
            **r,
            "per_device_batch": r.get("per_device_batch") or r["examples_per_s"] * r["step_time_s"] / r["devices"],
            "scaling": "weak",
            "hardware": hw.name,
            "assumed_mfu": args.mfu,
            "assumed_step_time_s": args.step_time_s,
            "below_step_floor": r["config"] in tiny,
        }
        for r in rows
    ]


def _columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    """``config`` [, ``run_devices``], :data:`COLUMNS`, with :data:`TOKEN_COLUMNS` after ``examples_per_s``
    when some row is a token model's."""
    lead = ["config"] + (["run_devices"] if any("run_devices" in r for r in rows) else [])
    meta = [c for c in META_COLUMNS if any(c in r for r in rows)]
    if not any("tokens_per_s" in r for r in rows):
        return lead + COLUMNS + meta
    i = COLUMNS.index("examples_per_s") + 1
    return lead + COLUMNS[:i] + TOKEN_COLUMNS + COLUMNS[i:] + meta


def _throughput(rows: Sequence[dict[str, Any]]) -> tuple[str, str]:
    """(row key, unit) of the plot: tokens/s when every row is a token model's, else examples/s."""
    if rows and all(r.get("tokens_per_s") is not None for r in rows):
        return "tokens_per_s", "tokens/s"
    return "examples_per_s", "examples/s"


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return repr(value) if value == value else ""
    return str(value)


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """``projection.csv``: :data:`COLUMNS` (with ``config`` first); floats at full precision."""
    cols = _columns(rows)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(cols)
        for row in rows:
            writer.writerow([_fmt(row.get(c)) for c in cols])
    return path


# projection.md's headers for the columns it writes in units (the CSV keeps the raw numbers and names)
MD_HEADERS = {
    "payload_bytes": "payload",
    "compute_s": "compute",
    "comm_s": "comm",
    "exposed_comm_s": "exposed comm",
    "step_time_s": "step time",
}


def md_cell(column: str, value: Any) -> str:
    """One cell of projection.md, never in e-notation: times with their unit (``140 ns``), bytes in binary units,
    rates and counts in plain decimals with thousands separated (``8,633,000``), fractions to 4 significant
    digits (``0.9876``, ``0.0001235``)."""
    import numpy as np

    from sweeps.report.tables import format_bytes, plain_4

    if value is None:
        return ""
    if not isinstance(value, float):
        return str(value)
    if column.endswith("_s") and not column.endswith("_per_s"):
        return format_seconds(value)
    if column.endswith("_bytes"):
        return format_bytes(value)
    if abs(value) >= 1000:
        return plain_4(value)
    return str(np.format_float_positional(value, precision=4, unique=False, fractional=False, trim="-"))


def write_markdown(rows: Sequence[dict[str, Any]], path: Path, header: str, source: str) -> Path:
    """``projection.md``: a titled table (a projection, not a measurement) with the assumptions, the regime (a
    strong-scaling sweep is projected as weak scaling: ``regime_note``) and sources, in plain numbers
    (``md_cell``). The columns derived from the compute time (:data:`FLOOR_COLUMNS`) are blank for a configuration
    ``below_floor``, and a line says why (``projection.csv`` keeps them, flagged ``below_step_floor``)."""
    cols = [c for c in _columns(rows) if c not in META_COLUMNS]
    note = regime_note(rows)
    lines = [
        "# Projection (model, not a measurement)",
        "",
        header,
        "",
        *([note, ""] if note else []),
        f"Hardware sources: {source or 'n/a'}",
        "",
        "comm_ratio = comm_s / step_time_s: the communication ratio modelled wholly for the target (its compute time "
        "from the FLOPs and the assumed MFU or step time), not a measurement; efficiency = compute_s / step_time_s; "
        "speedup = efficiency x devices.",
        "",
        "| " + " | ".join(MD_HEADERS.get(c, c) for c in cols) + " |",
        "|" + "---|" * len(cols),
    ]
    tiny = below_floor(rows)
    for row in rows:
        cells = [md_cell(c, None if c in FLOOR_COLUMNS and row["config"] in tiny else row.get(c)) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    for config, compute_s in tiny.items():
        lines += ["", "Blank cells: " + floor_note(config, compute_s)]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_plot(rows: Sequence[dict[str, Any]], path: Path, header: str) -> Path:
    """``projection.png``: examples/s (tokens/s when every row is a token model's) and efficiency (in %)
    against devices, log-log with plain-decimal ticks at the projected device counts, one line per
    configuration; ``header`` (``plot_title``) is its title, with ``regime_note`` below. When no configuration's
    efficiency can be drawn, one panel; a configuration ``below_floor`` is not drawn at all (its throughput comes from
    the same compute time), and when none is left the panel says why."""
    key, unit = _throughput(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tiny = below_floor(rows)
    configs = [c for c in dict.fromkeys(r["config"] for r in rows) if c not in tiny]  # a step below the floor:
    shown = [r["efficiency"] for r in rows if r["config"] not in tiny]  # nothing of it is drawn
    if shown:
        fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(12, 5.4), layout="constrained")
        axes = [ax_t, ax_e]
    else:
        fig, ax_t = plt.subplots(1, 1, figsize=(7.5, 5.6), layout="constrained")
        ax_e, axes = None, [ax_t]
    linear: list[float] = []
    for config in configs:
        sub = [r for r in rows if r["config"] == config]
        line = overlay_projection(ax_t, sub, key, label=config)
        if ax_e is None:
            continue
        overlay_projection(ax_e, sub, "efficiency", label=config, color=line.get_color())
        # linear scaling of one device's throughput (per_device_batch / compute_s = examples_per_s / efficiency)
        linear += [r[key] / r["efficiency"] for r in sub]
        ax_t.plot(
            [r["devices"] for r in sub],
            [r[key] / r["efficiency"] for r in sub],
            color=line.get_color(),
            linewidth=0.8,
            linestyle=":",
            label="linear (no communication)" if len(linear) == len(sub) else None,
        )
    from sweeps.report.plots import devices_x_axis, log_y_axis

    drawn = [r[key] for r in rows if r["config"] not in tiny] + linear
    if drawn:
        log_y_axis(ax_t, drawn)
    else:
        ax_t.set_axis_off()
    if ax_e is not None:
        log_y_axis(ax_e, shown, fmt=lambda v: f"{100 * v:g}%")
    for ax, ylabel in zip(axes if configs else [], (f"{unit} (global, projected)", "efficiency = compute / step time")):
        devices_x_axis(ax, rows)
        ax.set_ylabel(ylabel)
    notes = [regime_note(rows)]
    if tiny:
        text = (
            f"Left out: {len(tiny)} configuration(s) whose modelled step computes below "
            f"~{format_seconds(STEP_FLOOR_S)}, less than any real device takes: its throughput and efficiency would "
            "show the model's latency terms only (projection.csv keeps them, flagged)."
        )
        if not configs:
            ax_t.text(0.5, 0.5, "\n".join(textwrap.wrap(text, 60)), ha="center", va="center", fontsize=10)
        else:
            notes.append(text)
    if configs:
        ax_t.legend(fontsize=8)
    width = 150 if ax_e is not None else 88
    fig.suptitle("\n".join(textwrap.wrap(header, width)), fontsize=10)
    below = "\n".join(line for note in notes if note for line in textwrap.wrap(note, width + 10))
    if below:
        fig.supxlabel(below, fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def format_seconds(value_s: float) -> str:
    """A time in one format with its unit: ``"0 s"``, ``"540 ns"``, ``"227 µs"``, ``"4.55 ms"``, ``"1.25 s"``
    (three significant digits)."""
    if value_s == 0:
        return "0 s"
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if abs(value_s) >= scale:
            return f"{value_s / scale:.3g} {unit}"
    return f"{value_s / 1e-9:.3g} ns"


def format_count(value: float) -> str:
    """A rate in one format: three significant digits with k/M/G/T (``"66.9k"``, ``"2.43G"``)."""
    for scale, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"


def format_percent(fraction: float) -> str:
    """A fraction as a percentage with three significant digits (``"99.7%"``, ``"0.0245%"``, ``"100%"``)."""
    return f"{100 * fraction:.3g}%"


# No real accelerator runs a training step in less (one dispatch of a compiled program; the TPU v5e took 366 µs per
# step of the quick-start MLP: benchmarks/results/overhead_tpu_v5e.txt). A modelled compute time below it (a small
# model at --mfu x a big peak: 67 ns for the quick-start MLP on an H100) leaves efficiencies that only show the
# model's latency terms (0.03%).
STEP_FLOOR_S = 5e-6


def below_floor(rows: Sequence[dict[str, Any]], floor_s: float = STEP_FLOOR_S) -> dict[str, float]:
    """{configuration: its compute time per step [s]} for the configurations whose compute is below ``floor_s``."""
    return {r["config"]: r["compute_s"] for r in rows if r["compute_s"] < floor_s}


def floor_warning(config: str, compute_s: float, floor_s: float = STEP_FLOOR_S) -> str:
    """One line for a configuration whose modelled step is shorter than any real device's."""
    return (
        f"warning: {config}: its step computes in {format_seconds(compute_s)}, below what a step takes on any real "
        f"device (~{format_seconds(floor_s)}), so its efficiencies are left out here (projection.csv keeps the "
        "model's); project a larger model or give --step-time-s measured on the target"
    )


def floor_note(config: str, compute_s: float, floor_s: float = STEP_FLOOR_S) -> str:
    """The sentence of ``projection.md`` for a configuration whose efficiencies are left out."""
    return (
        f"{config}: its step computes in {format_seconds(compute_s)}, below what a step takes on any real device "
        f"(~{format_seconds(floor_s)}): its {', '.join(FLOOR_COLUMNS)} are left out here and from projection.png "
        "(projection.csv keeps the model's, with below_step_floor=true)"
    )


def console_lines(rows: Sequence[dict[str, Any]], skipped: Sequence[str] = ()) -> list[str]:
    """What ``main`` prints: per configuration a header line, then one aligned line per device count
    (step time, communication time, examples/s (tokens/s for a token model), efficiency as a percentage,
    MFU when known; no efficiency or MFU for a configuration ``below_floor``, which ``main`` warns about); then
    one line per configuration skipped for having no job with collectives."""
    lines = []
    tiny = below_floor(rows)
    for config in dict.fromkeys(r["config"] for r in rows):
        sub = [r for r in rows if r["config"] == config]
        source = f" (from the {sub[0]['run_devices']}-device job)" if "run_devices" in sub[0] else ""
        lines.append(f"{config}{source}:")
        for row in sub:
            tokens = row.get("tokens_per_s") is not None
            rate = (
                f"{format_count(row['tokens_per_s']):>7} tokens/s"
                if tokens
                else f"{format_count(row['examples_per_s']):>7} examples/s"
            )
            mfu = f"  MFU {format_percent(row['mfu'])}" if tokens and row.get("mfu") is not None else ""
            efficiency = "" if config in tiny else f"  efficiency {format_percent(row['efficiency']):>8}{mfu}"
            lines.append(
                f"  N={row['devices']:>5}  step {format_seconds(row['step_time_s']):>9}  "
                f"comm {format_seconds(row['comm_s']):>9}  {rate}{efficiency}"
            )
    for label in skipped:
        lines.append(f"skipped {label}: only 1-device jobs (no collective to scale)")
    return lines


def log_to_wandb(rows, paths: dict[str, Path], summaries, args, header: str) -> str:
    """Logs a ``job_type="projection"`` run into the sweep's W&B group (the jobs' project and entity), in the mode a
    run would take (``training.report.resolve_wandb_mode``: offline without an API key); returns the line to print:
    the group, and the ``wandb sync`` command of an offline run."""
    import wandb

    from sweeps.report.wandb_log import jobs_wandb_setting
    from training.report import resolve_wandb_mode

    def common(key):
        values = [str(s[key]) for s in summaries if s.get(key) not in (None, "")]
        return Counter(values).most_common(1)[0][0] if values else None

    try:
        mode = resolve_wandb_mode(None)
    except ValueError as exc:  # a WANDB_MODE W&B would refuse
        raise ProjectionError(str(exc)) from None
    if mode == "disabled":
        return "W&B is disabled (WANDB_MODE=disabled): the projection was not logged to W&B"
    group = args.group or common("wandb/group") or (Path(args.folder).resolve().name if args.folder else "projection")
    run = wandb.init(
        mode=mode,
        dir=None if os.environ.get("WANDB_DIR") else str(paths["csv"].parent),
        project=jobs_wandb_setting(summaries, "project") or os.environ.get("WANDB_PROJECT", "dp-scaling"),
        entity=jobs_wandb_setting(summaries, "entity") or os.environ.get("WANDB_ENTITY"),
        group=group,
        job_type="projection",
        name=f"projection-{args.hardware}-{group}",
        config={
            "hardware": args.hardware,
            "set": list(args.set),
            "overlap": args.overlap,
            "algorithm": args.algorithm,
            "step_time_s": args.step_time_s,
            "mfu": args.mfu,
            "assumptions": header,
        },
        settings=wandb.Settings(
            x_disable_stats=True, x_disable_machine_info=True, save_code=False, disable_git=True, console="off"
        ),
    )
    try:
        run.define_metric("projection/devices")
        run.define_metric("projection/*", step_metric="projection/devices")
        for row in rows:
            name = re.sub(r"[^A-Za-z0-9_.=+-]+", "_", row["config"])
            shown = not row.get("below_step_floor")  # a step below any device's floor: no efficiency
            run.log(
                {
                    "projection/devices": row["devices"],
                    f"projection/examples_per_s/{name}": row["examples_per_s"],
                    **({f"projection/tokens_per_s/{name}": row["tokens_per_s"]} if row.get("tokens_per_s") else {}),
                    **({f"projection/efficiency/{name}": row["efficiency"]} if shown else {}),
                    **({f"projection/comm_ratio/{name}": row["comm_ratio"]} if shown else {}),
                }
            )
        cols = _columns(rows)
        run.log(
            {
                "projection_table": wandb.Table(
                    columns=cols, data=[[r.get(c) for c in cols] for r in rows], allow_mixed_types=True
                ),
                "plots/projection": wandb.Image(str(paths["png"]), caption="projection (model)"),
            }
        )
    finally:
        run.finish()
    line = f"logged the projection to W&B group {group!r}"
    if mode == "offline":
        line += f"; W&B is offline: upload it later with: wandb sync {Path(run.settings.sync_file).parent}"
    return line


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sweeps.project",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("folder", nargs="?", help="run folder or sweep (multirun) folder with summary.json files")
    parser.add_argument("--params", type=int, help="parameter count (explicit input)")
    parser.add_argument(
        "--grad-bytes-per-param",
        type=float,
        default=4.0,
        help="bytes of one gradient element in the reduction (4: float32)",
    )
    parser.add_argument(
        "--flops-per-example",
        type=float,
        help="training FLOPs per example (forward + backward, e.g. 6 x params for dense layers)",
    )
    parser.add_argument(
        "--flops-per-token",
        type=float,
        help="training FLOPs per token (language models: 6N + 12 L d T), with --tokens-per-example",
    )
    parser.add_argument(
        "--tokens-per-example",
        type=int,
        help="tokens per example (a language model's context T): columns in tokens/s and FLOPs per token "
        "(default from a run folder: its model/context)",
    )
    parser.add_argument("--per-device-batch", type=float, help="examples per device per optimizer step")
    parser.add_argument(
        "--parallel", default="allreduce", help="allreduce (jit_sharding, pmap, shard_map) or fsdp (explicit input)"
    )
    parser.add_argument("--hardware", required=True, help="a profile of conf/hardware (e.g. h100_sxm, custom)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a profile number, e.g. --set inter_node_bytes_per_s=25e9 (repeatable)",
    )
    parser.add_argument("--step-time-s", type=float, help="compute time of one step on one target device (s)")
    parser.add_argument("--mfu", type=float, help="model FLOPs utilisation; compute = FLOPs / (mfu * peak)")
    parser.add_argument(
        "--overlap", type=float, default=0.0, help="fraction of the compute time that hides communication, in [0, 1]"
    )
    parser.add_argument("--devices", default="1,2,4,8,16,32,64,128,256,512,1024", help="device counts")
    parser.add_argument(
        "--algorithm",
        default="hierarchical",
        choices=ALGORITHMS,
        help="collective cost model (hierarchical: the README's; ring/tree/nccl: NCCL's)",
    )
    parser.add_argument("--out", help="output folder (default: the run folder, else the current directory)")
    parser.add_argument("--wandb", action="store_true", help="log to the sweep's W&B group")
    parser.add_argument("--group", help="W&B group (default: the runs' wandb/group, else the folder name)")
    args = parser.parse_args(argv)
    try:
        rows, hw, profile, summaries = build_projection(args)
        rows = annotate(rows, args, hw)
        out = Path(args.out or args.folder or ".")
        out.mkdir(parents=True, exist_ok=True)
        header = assumptions(args, hw)
        paths = {
            "csv": write_csv(rows, out / "projection.csv"),
            "md": write_markdown(rows, out / "projection.md", header, hw.source),
            "png": write_plot(rows, out / "projection.png", plot_title(args, hw, rows)),
        }
        if args.wandb:
            print(log_to_wandb(rows, paths, summaries, args, header))
    except (ProjectionError, HardwareError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for config, compute_s in below_floor(rows).items():
        print(floor_warning(config, compute_s), file=sys.stderr)
    for line in console_lines(rows, getattr(args, "skipped", [])):
        print(line)
    if regime_note(rows):
        print(regime_note(rows))
    print(f"wrote {paths['csv']}, {paths['md']}, {paths['png']}")
    return 0


if __name__ == "__main__":
    from training import process

    process.run_tool(main, imports_jax=False)  # a signal: one line, no traceback
