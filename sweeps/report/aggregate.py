"""Aggregate job records into one row per configuration: repeats, intervals, speedup and efficiency.

Repeats: jobs that differ only in ``train.seed`` (same configuration fields and the same other overrides) are
samples of one configuration. A configuration row holds the median over its successful repeats of each job's
own median throughput, and an interval:

- ``bootstrap95`` with at least ``BOOTSTRAP_MIN`` (5) repeats: the 2.5 and 97.5 percentiles of the median of
  ``BOOTSTRAP_RESAMPLES`` resamples (with replacement) of the repeats (percentile bootstrap, Efron &
  Tibshirani 1993, ch. 13; fixed seed, so a report is reproducible);
- ``min-max`` with fewer repeats (one repeat: a zero-width interval).

A token model's sweep (``collect.sweep_unit``: ``model=gpt``) also has ``tokens_per_s`` = examples/s x its
tokens per example (T), likewise its interval and per-device figure (exact products of the examples/s
figures); speedup and efficiency have no unit and are the same in both. A sweep that mixes token and image
models is refused (ReportError).

Speedup(N) = median examples/s(N) / median examples/s(1 device, same series); a series is a configuration
without its device count (strong scaling: same global batch; weak scaling: same per-device batch). Its
interval: the bootstrap of the ratio of the two medians (resampling both) with enough repeats on both sides,
else [min(N) / max(1), max(N) / min(1)]. Efficiency(N) = speedup(N) / N, interval likewise divided by N.

Time to target: the median over repeats where a repeat that never reached the target counts as +infinity
(so the median is null when half or more never reached it); ``target_reached`` = "k/n".
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any

import numpy as np

from sweeps.report.collect import MIN_WINDOWS, _sort_part, sweep_unit

BOOTSTRAP_MIN = 5
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0

# Configuration fields (with ``overrides``); ``devices`` is left out of the series key.
# ``config`` (a column) lists the overrides that differ between configurations of the sweep.
CONFIG_FIELDS = (
    "parallel",
    "precision",
    "accum_steps",
    "scaling",
    "grad_reduce_dtype",
    "grad_compression",
    "global_batch",
    "per_device_batch",
    "devices",
    "overrides",
)

# scaling.csv columns, in order (raw values: bytes in bytes, throughput in examples/s, times in s).
COLUMNS = [
    "devices",
    "parallel",
    "precision",
    "accum_steps",
    "scaling",
    "global_batch",
    "per_device_batch",
    "grad_reduce_dtype",
    "grad_compression",
    "config",
    "repeats",
    "failed",
    "interval",
    "examples_per_s",
    "examples_per_s_ci_low",
    "examples_per_s_ci_high",
    "examples_per_s_per_device",
    "tokens_per_example",
    "tokens_per_s",
    "tokens_per_s_ci_low",
    "tokens_per_s_ci_high",
    "tokens_per_s_per_device",
    "step_time_s",
    "speedup",
    "speedup_ci_low",
    "speedup_ci_high",
    "efficiency",
    "efficiency_ci_low",
    "efficiency_ci_high",
    "windows_measured_min",
    "few_windows",
    "eval_accuracy",
    "eval_accuracy_min",
    "eval_accuracy_max",
    "target_accuracy",
    "time_to_target_s",
    "steps_to_target",
    "target_reached",
    "comm_payload_bytes",
    "comm_payload_bytes_lowered",
    "comm_ring_bytes",
    "comm_ratio",
    "comm_ratio_source",
    "state_bytes_per_device",
    "temp_bytes_per_device",
    "wall_s",
    "status",
    "jobs",
]


def config_key(record: dict) -> tuple:
    """The configuration a job belongs to (every identifying field but the seed)."""
    return tuple(record.get(f) for f in CONFIG_FIELDS)


def series_key(row: dict) -> tuple:
    """The curve a configuration row belongs to: its configuration without ``devices`` and without the
    batch field that follows the device count (global batch under weak scaling, per-device under strong)."""
    weak = row.get("scaling") == "weak"
    batch = ("per-device", row.get("per_device_batch")) if weak else ("global", row.get("global_batch"))
    return (
        row.get("parallel"),
        row.get("precision"),
        row.get("accum_steps"),
        row.get("scaling"),
        row.get("grad_reduce_dtype"),
        row.get("grad_compression"),
        tuple(row.get("overrides") or ()),
        batch,
    )


def _rng() -> np.random.Generator:
    return np.random.default_rng(BOOTSTRAP_SEED)


def median_interval(values: list[float]) -> tuple[float | None, float | None, float | None, str]:
    """(median, low, high, kind) of repeat values; kind ``bootstrap95`` (>= 5 values) or ``min-max``.
    All None (kind ``none``) for no values."""
    if not values:
        return None, None, None, "none"
    med = float(statistics.median(values))
    if len(values) >= BOOTSTRAP_MIN:
        data = np.asarray(values, dtype=np.float64)
        idx = _rng().integers(0, len(data), size=(BOOTSTRAP_RESAMPLES, len(data)))
        meds = np.median(data[idx], axis=1)
        low, high = np.percentile(meds, [2.5, 97.5])
        return med, min(float(low), med), max(float(high), med), "bootstrap95"
    return med, float(min(values)), float(max(values)), "min-max"


def ratio_interval(num: list[float], den: list[float]) -> tuple[float | None, float | None]:
    """Interval of median(num) / median(den) (see the module docstring); (None, None) without values."""
    if not num or not den or min(den) <= 0:
        return None, None
    if len(num) >= BOOTSTRAP_MIN and len(den) >= BOOTSTRAP_MIN:
        rng = _rng()
        a, b = np.asarray(num, np.float64), np.asarray(den, np.float64)
        ma = np.median(a[rng.integers(0, len(a), (BOOTSTRAP_RESAMPLES, len(a)))], axis=1)
        mb = np.median(b[rng.integers(0, len(b), (BOOTSTRAP_RESAMPLES, len(b)))], axis=1)
        low, high = np.percentile(ma / mb, [2.5, 97.5])
        return float(low), float(high)
    return min(num) / max(den), max(num) / min(den)


def _median_censored(values: list[float | None]) -> float | None:
    """Median where None (never reached) counts as +infinity; None when that median is infinite."""
    if not values:
        return None
    med = statistics.median([math.inf if v is None else v for v in values])
    return None if math.isinf(med) else float(med)


def _same(values: list[Any]) -> Any:
    """The common value of ``values`` (first non-None; these are per-configuration constants)."""
    for v in values:
        if v is not None:
            return v
    return None


def _median_or_none(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return float(statistics.median(values)) if values else None


def aggregate(records: list[dict]) -> list[dict[str, Any]]:
    """One row per configuration, keyed by ``COLUMNS`` plus private keys ``_series`` (series key),
    ``_values`` (per-repeat examples/s), ``_unit`` (``"tokens"`` or ``"examples"``: ``throughput_key``),
    ``_platform`` and ``_device_kind``. Sorted by series, then devices.

    A configuration whose every job failed keeps its configuration, ``repeats=0`` and the first error as
    ``status``; its measured columns are None. The ``tokens_per_*`` columns are None for image models.

    Raises:
      ReportError: the records mix token and image models (``collect.sweep_unit``).
    """
    unit = sweep_unit(records)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for rec in records:
        if rec["ok"]:
            groups[config_key(rec)].append(rec)
    for rec in records:  # a failed job's summary may lack fields: it joins the configuration it matches
        if not rec["ok"]:
            key = config_key(rec)
            match = next((k for k in groups if all(a is None or a == b for a, b in zip(key, k))), key)
            groups[match].append(rec)
    rows = []
    for key, recs in groups.items():
        ok = [r for r in recs if r["ok"]]
        eps = [r["examples_per_s"] for r in ok if r["examples_per_s"] is not None]
        med, low, high, kind = median_interval(eps)
        row: dict[str, Any] = dict(zip(CONFIG_FIELDS, key))
        windows = [r["windows_measured"] for r in ok if r["windows_measured"] is not None]
        accs = [r["eval_accuracy"] for r in ok if r["eval_accuracy"] is not None]
        target = _same([r["target_accuracy"] for r in ok])
        failed = [r for r in recs if not r["ok"]]
        row.update(
            {
                "repeats": len(ok),
                "failed": len(failed),
                "interval": kind,
                "examples_per_s": med,
                "examples_per_s_ci_low": low,
                "examples_per_s_ci_high": high,
                "examples_per_s_per_device": med / row["devices"] if med is not None and row["devices"] else None,
                "step_time_s": _median_or_none([r["step_time_s"] for r in ok]),
                "windows_measured_min": min(windows) if windows else None,
                "few_windows": sum(bool(r["few_windows"]) for r in ok),
                "eval_accuracy": float(statistics.median(accs)) if accs else None,
                "eval_accuracy_min": min(accs) if accs else None,
                "eval_accuracy_max": max(accs) if accs else None,
                "target_accuracy": target,
                "time_to_target_s": _median_censored([r["time_to_target_s"] for r in ok]) if target else None,
                "steps_to_target": _median_censored([r["steps_to_target"] for r in ok]) if target else None,
                "target_reached": (
                    f"{sum(r['steps_to_target'] is not None for r in ok)}/{len(ok)}" if target else None
                ),
                "comm_payload_bytes": _same([r["comm_payload_bytes"] for r in ok]),
                "comm_payload_bytes_lowered": _same([r["comm_payload_bytes_lowered"] for r in ok]),
                "comm_ring_bytes": _same([r["comm_ring_bytes"] for r in ok]),
                "comm_ratio": _median_or_none([r["comm_ratio"] for r in ok]),
                "comm_ratio_source": _same([r["comm_ratio_source"] for r in ok]),
                "state_bytes_per_device": _same([r["state_bytes_per_device"] for r in ok]),
                "temp_bytes_per_device": _same([r["temp_bytes_per_device"] for r in ok]),
                "wall_s": _median_or_none([r["wall_s"] for r in ok]),
                "status": "ok"
                if not failed
                else (failed[0]["status"] if not ok else f"ok ({len(failed)} failed: {failed[0]['status']})"),
                "jobs": " ".join(str(r["job"]) for r in recs),
                "speedup": None,
                "speedup_ci_low": None,
                "speedup_ci_high": None,
                "efficiency": None,
                "efficiency_ci_low": None,
                "efficiency_ci_high": None,
                "_values": eps,
                "_unit": unit,
                "_platform": _same([r["platform"] for r in recs]),
                "_device_kind": _same([r["device_kind"] for r in recs]),
            }
        )
        tokens = _same([r["tokens_per_example"] for r in ok])
        row["tokens_per_example"] = tokens
        for key in ("", "_ci_low", "_ci_high", "_per_device"):
            value = row[f"examples_per_s{key}"]
            row[f"tokens_per_s{key}"] = value * tokens if value is not None and tokens else None
        row["_series"] = series_key(row)
        rows.append(row)
    common = set.intersection(*(set(r["overrides"] or ()) for r in rows)) if rows else set()
    # fields without a column of their own, named in the config column where they differ between configurations
    named = [f for f in ("grad_reduce_dtype", "grad_compression") if len({r.get(f) for r in rows}) > 1]
    for row in rows:  # the config column names what distinguishes a configuration, not the sweep's constants
        fields = [f"{f}={row.get(f) or 'none'}" for f in named]
        row["config"] = " ".join(fields + [o for o in row["overrides"] or () if o not in common])
    baselines = {r["_series"]: r for r in rows if r["devices"] == 1 and r["examples_per_s"]}
    for row in rows:
        base = baselines.get(row["_series"])
        if base is None or row["examples_per_s"] is None or not row["devices"]:
            continue
        n = row["devices"]
        row["speedup"] = row["examples_per_s"] / base["examples_per_s"]
        row["speedup_ci_low"], row["speedup_ci_high"] = ratio_interval(row["_values"], base["_values"])
        row["efficiency"] = row["speedup"] / n
        if row["speedup_ci_low"] is not None:
            row["efficiency_ci_low"], row["efficiency_ci_high"] = row["speedup_ci_low"] / n, row["speedup_ci_high"] / n
    rows.sort(
        key=lambda r: (
            tuple(_sort_part(x) for x in r["_series"][:6])
            + (tuple(r["_series"][6]), _sort_part(r["_series"][7][1]), _sort_part(r["devices"]))
        )
    )
    return rows


def series_labels(rows: list[dict]) -> tuple[dict[tuple, str], str]:
    """Short legend labels per series key: the fields that differ between series (the mode always); the
    fields common to all series are returned once as ``common`` (a subtitle)."""
    keys = list(dict.fromkeys(r["_series"] for r in rows))
    if not keys:
        return {}, ""

    def parts(k):
        mode, precision, accum, scaling, reduce_dtype, compression, overrides, (kind, batch) = k
        return [
            ("mode", str(mode) if mode is not None else "?"),
            ("precision", precision or ""),
            ("accum", f"accum={accum}" if accum is not None else ""),
            ("scaling", scaling or ""),
            ("batch", "" if batch is None else (f"b={batch}/device" if kind == "per-device" else f"B={batch}")),
            ("reduce", f"reduce={reduce_dtype}" if reduce_dtype else ""),
            ("compression", f"compression={compression}" if compression else ""),
            ("overrides", " ".join(overrides)),
        ]

    table = {k: parts(k) for k in keys}
    names = [n for n, _ in table[keys[0]]]
    varying = {n for i, n in enumerate(names) if n == "mode" or len({table[k][i][1] for k in keys}) > 1}
    labels = {k: " ".join(v for n, v in table[k] if n in varying and v) for k in keys}
    common = ", ".join(v for n, v in table[keys[0]] if n not in varying and v)
    return labels, common


def recipe_rows(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows grouped by recipe for plots against the global batch: every configuration field but the batch
    (and ``train.global_batch`` overrides), one device count at a time. {label: rows sorted by batch}."""

    def recipe(row):
        overrides = tuple(o for o in row["overrides"] if not o.startswith(("train.global_batch=",)))
        return (row["parallel"], row["precision"], row["accum_steps"], row["devices"], overrides)

    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        if row["repeats"]:
            groups[recipe(row)].append(row)
    keys = list(groups)
    if not keys:
        return {}
    varying = [i for i in range(5) if len({k[i] for k in keys}) > 1]
    out = {}
    for k in keys:
        label = (
            " ".join((" ".join(k[i]) if i == 4 else f"{('', '', 'accum=', 'devices=')[i]}{k[i]}") for i in varying)
            or "all"
        )
        out[label] = sorted(groups[k], key=lambda r: r["global_batch"] or 0)
    return out


def throughput_key(rows: list[dict]) -> tuple[str, str]:
    """(row key, unit text) of the sweep's throughput: ``("tokens_per_s", "tokens/s")`` for a token model's
    sweep, else ``("examples_per_s", "examples/s")``."""
    if any(r.get("_unit") == "tokens" for r in rows):
        return "tokens_per_s", "tokens/s"
    return "examples_per_s", "examples/s"


def is_cpu(rows: list[dict]) -> bool:
    """Whether the timings come from simulated CPU devices."""
    return any((r.get("_platform") or "").lower() == "cpu" for r in rows)


def few_windows_note(rows: list[dict]) -> str | None:
    """A sentence flagging configurations with repeats that measured fewer than 5 windows, else None."""
    flagged = [r for r in rows if r["few_windows"]]
    if not flagged:
        return None
    return (
        f"{len(flagged)} configuration(s) have repeats with fewer than {MIN_WINDOWS} measured logging "
        f"windows (marked *): raise train.steps or lower train.log_every"
    )
