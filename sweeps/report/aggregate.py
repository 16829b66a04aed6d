"""Aggregate job records into one row per configuration: repeats, intervals, speedup and efficiency.

Repeats: jobs that differ only in ``train.seed`` (same configuration fields and the same other overrides) are
independent samples of one configuration; each job contributes its own median over its logging windows. Their
noise is multiplicative (a slower machine or a busier neighbour scales the whole job), so the figures work on
the logarithm of throughput:

- ``examples_per_s``: the geometric mean of the repeats (the median of log-normal noise), with a 95% t-interval
  on the log scale, exp(mean(log x) +/- t(0.975, n-1) s / sqrt(n)) (Student's t, e.g. Montgomery & Runger,
  "Applied Statistics and Probability for Engineers", 8.2; s: the standard deviation of log x);
- ``speedup(N)`` = examples/s(N) / examples/s(1 device, same series), a ratio of geometric means, with Welch's
  95% t-interval on the difference of mean logs (Welch 1947; Welch-Satterthwaite degrees of freedom), so the two
  configurations may have different noise. ``efficiency(N)`` = speedup / N, its interval likewise divided. The
  1-device row of a series is its reference: speedup and efficiency exactly 1, no interval.

An interval is drawn only from ``MIN_REPEATS`` (3) repeats on every side it uses: with 2 the t quantile of one
degree of freedom (12.7) makes it span +/- 9 standard deviations and nothing checks the log-normal model. With
fewer the interval columns are blank, ``interval`` is ``none`` and ``too_few_note`` says how many repeats would
do. ``tests/test_report.py`` checks the coverage on 1,000 simulated sweeps with known true throughputs and
speedups (log-normal noise of unequal spread, and a contaminated variant with occasional slow repeats): the 95%
intervals cover the truth in 90-99% of sweeps at 3, 4, 5 and 10 repeats. A series is a configuration without its
device count (strong scaling: same global batch; weak scaling: same per-device batch).

A token model's sweep (``collect.sweep_unit``: ``model=gpt``) also has ``tokens_per_s`` = examples/s x its
tokens per example (T), likewise its interval and per-device figure (exact products of the examples/s
figures); speedup and efficiency have no unit and are the same in both. A sweep that mixes token and image
models is refused (ReportError).

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

MIN_REPEATS = 3  # repeats (train.seed values) of a configuration from which its intervals are drawn
LEVEL = 0.95  # the intervals' confidence level

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


def t_quantile(p: float, df) -> np.ndarray:
    """Quantile ``p`` of Student's t with ``df`` degrees of freedom (array-like, fractional allowed)."""
    from scipy.special import stdtrit  # scipy comes with JAX; only this function is imported

    return np.asarray(stdtrit(np.asarray(df, dtype=np.float64), p))


def log_t_interval(values) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(geometric mean, low, high) of each row of ``values`` (shape ``[..., n]``, n >= 2 positive repeats): the
    ``LEVEL`` t-interval of mean(log x), exponentiated. Vectorised over the leading axes."""
    logs = np.log(np.asarray(values, dtype=np.float64))
    n = logs.shape[-1]
    mean = logs.mean(axis=-1)
    half = t_quantile(0.5 + LEVEL / 2, n - 1) * logs.std(axis=-1, ddof=1) / np.sqrt(n)
    return np.exp(mean), np.exp(mean - half), np.exp(mean + half)


def log_ratio_interval(num, den) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ratio of geometric means, low, high) of ``num`` over ``den`` (shapes ``[..., n]`` and ``[..., m]``, both
    >= 2 positive repeats): Welch's ``LEVEL`` t-interval of mean(log num) - mean(log den) with
    Welch-Satterthwaite degrees of freedom, exponentiated. Vectorised over the leading axes."""
    a, b = np.log(np.asarray(num, dtype=np.float64)), np.log(np.asarray(den, dtype=np.float64))
    n, m = a.shape[-1], b.shape[-1]
    va, vb = a.var(axis=-1, ddof=1) / n, b.var(axis=-1, ddof=1) / m
    se2 = va + vb
    with np.errstate(invalid="ignore", divide="ignore"):  # identical repeats: zero width, any df
        df = np.where(se2 > 0, se2**2 / (va**2 / (n - 1) + vb**2 / (m - 1)), float(min(n, m) - 1))
    diff = a.mean(axis=-1) - b.mean(axis=-1)
    half = t_quantile(0.5 + LEVEL / 2, df) * np.sqrt(se2)
    return np.exp(diff), np.exp(diff - half), np.exp(diff + half)


def geometric_mean(values: list[float]) -> float | None:
    """exp(mean(log x)) of positive ``values`` (within [min, max] exactly: equal values give that value, not one a
    rounding apart); None without values."""
    if not values:
        return None
    return min(max(float(np.exp(np.mean(np.log(values)))), min(values)), max(values))


def throughput_interval(values: list[float]) -> tuple[float | None, float | None, float | None, str]:
    """(geometric mean, low, high, kind) of the repeats' throughputs: kind ``t95`` (a 95% t-interval on the log
    scale, from ``MIN_REPEATS`` repeats), else ``none`` with low and high None (no values: all None)."""
    if not values:
        return None, None, None, "none"
    if len(values) < MIN_REPEATS:
        return geometric_mean(values), None, None, "none"
    _, low, high = (float(x) for x in log_t_interval(values))
    return geometric_mean(values), low, high, "t95"


def speedup_interval(num: list[float], den: list[float]) -> tuple[float | None, float | None]:
    """Interval of the ratio of the geometric means of ``num`` and ``den`` (``log_ratio_interval``); (None, None)
    with fewer than ``MIN_REPEATS`` repeats on either side."""
    if len(num) < MIN_REPEATS or len(den) < MIN_REPEATS:
        return None, None
    _, low, high = log_ratio_interval(num, den)
    return float(low), float(high)


def repeats_hint(n: int = MIN_REPEATS) -> str:
    """``train.seed=0,1,2``: the override that runs ``n`` repeats."""
    return "train.seed=" + ",".join(str(i) for i in range(n))


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
        med, low, high, kind = throughput_interval(eps)
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
                "_hardware_profile": _same([r["hardware_profile"] for r in recs]),
                "_other_device_profile": _same(  # a profile of another device than the one that ran
                    [r["hardware_profile"] for r in recs if not r["profile_matches"] and r["hardware_profile"]]
                ),
                "_device_kind": _same([r["device_kind"] for r in recs]),
                "_model": _same([r.get("model") for r in recs]),
                "_param_count": _same([r.get("param_count") for r in recs]),
                "_data": _same([r.get("data") for r in recs]),
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
        if row is not base:  # the reference carries no interval against itself
            row["speedup_ci_low"], row["speedup_ci_high"] = speedup_interval(row["_values"], base["_values"])
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


def settings_text(rows: list[dict]) -> str:
    """The settings every series shares, in words (no command-line fragments): ``fp32, global batch 256 (strong
    scaling)``; accumulation, a reduction dtype or compression only when set; overrides are left out (they are
    listed in ``scaling.md``)."""
    keys = list(dict.fromkeys(r["_series"] for r in rows))
    if not keys:
        return ""
    fields = list(zip(*keys))  # per field, its value in each series
    same = [len(set(values)) == 1 for values in fields]
    _, precision, accum, scaling, reduce_dtype, compression, _, (kind, batch) = keys[0]
    words = []
    if same[1] and precision:
        words.append(str(precision))
    if same[7] and batch is not None:
        regime = f" ({scaling} scaling)" if same[3] and scaling else ""
        size = f"{batch} examples per device" if kind == "per-device" else f"global batch {batch}"
        words.append(size + regime)
    elif same[3] and scaling:
        words.append(f"{scaling} scaling")
    if same[2] and accum and accum > 1:
        words.append(f"{accum} microbatches per step")
    if same[4] and reduce_dtype:
        words.append(f"gradients reduced in {reduce_dtype}")
    if same[5] and compression and compression != "none":
        words.append(f"{compression} gradient compression")
    return ", ".join(words)


RANDOM_DATA = ("synthetic",)  # datasets of random inputs and labels: their accuracy is chance by construction


def workload_text(rows: list[dict]) -> str:
    """The model and data of the sweep in words: ``mlp (203,530 parameters) on synthetic data (random labels:
    chance accuracy)``; several models or datasets are listed; empty when the summaries name neither."""
    models = list(dict.fromkeys((r.get("_model"), r.get("_param_count")) for r in rows if r.get("_model")))
    data = list(dict.fromkeys(str(r["_data"]) for r in rows if r.get("_data")))
    what = ", ".join(f"{m} ({n:,} parameters)" if n else str(m) for m, n in models)
    if data:
        random = " (random labels: chance accuracy)" if all(d in RANDOM_DATA for d in data) else ""
        what = (what + " on " if what else "") + f"{', '.join(data)} data{random}"
    return what


def regime_text(rows: list[dict]) -> str:
    """What the series hold fixed as the device count grows: ``strong scaling (global batch 256 fixed)``, ``weak
    scaling (32 examples per device fixed)``, or both kinds."""
    out = []
    for kind, batch in dict.fromkeys(r["_series"][7] for r in rows if r["_series"][7][1] is not None):
        out.append(
            f"weak scaling ({batch} examples per device fixed)"
            if kind == "per-device"
            else f"strong scaling (global batch {batch} fixed)"
        )
    return "; ".join(out)


def overrides_text(rows: list[dict]) -> str:
    """The overrides every configuration shares (``data=synthetic train.steps=60``), as one string."""
    common = set.intersection(*(set(r["overrides"] or ()) for r in rows)) if rows else set()
    return " ".join(sorted(common))


def projection_title(projection_rows: list[dict], rows: list[dict] | None = None) -> str:
    """The projected panel's title: the hardware, the assumed MFU (or compute time) and the regime, e.g.
    ``projected for h100_sxm at MFU 0.4 (a model): weak scaling, 64 examples per device``; with the measured
    ``rows`` of a strong-scaling sweep, also where that per-device batch comes from (its largest job)."""
    first = projection_rows[0] if projection_rows else {}
    target = f" for {first['hardware']}" if first.get("hardware") else ""
    if first.get("assumed_mfu") is not None:
        target += f" at MFU {first['assumed_mfu']:g}"
    elif first.get("assumed_step_time_s") is not None:
        target += f" at {first['assumed_step_time_s']:g} s of compute per step"
    batches = sorted({float(f"{p['per_device_batch']:.6g}") for p in projection_rows if p.get("per_device_batch")})
    per_device = f", {'/'.join(f'{b:g}' for b in batches)} examples per device" if batches else ""
    strong = rows is not None and any(r["_series"][7][0] == "global" and r.get("scaling") == "strong" for r in rows)
    source = " (the per-device batch of the sweep's largest job)" if strong and per_device else ""
    return f"projected{target} (a model): weak scaling{per_device}{source}"


def ratio_known(rows: list[dict]) -> bool:
    """Whether some configuration has a communication ratio: modelled with the profile of the device that ran
    (``collect.profile_matches``), or measured by the profiler where that is valid (not on simulated CPU devices)."""
    return any(r["comm_ratio"] is not None for r in rows)


def ratio_label(rows: list[dict]) -> str:
    """``comm ratio (model, h100_sxm)`` or ``comm ratio (measured, profiler)`` for the third comm panel."""
    sources = {r["comm_ratio_source"] for r in rows if r["comm_ratio"] is not None}
    if sources == {"measured"}:
        return "comm ratio (measured, profiler)"
    profiles = sorted({str(r.get("_hardware_profile")) for r in rows if r.get("_hardware_profile")})
    return f"comm ratio (model{', ' + ', '.join(profiles) if profiles else ''})" + (
        " and measured" if "measured" in sources else ""
    )


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


def too_few_note(rows: list[dict]) -> str | None:
    """A sentence naming how many configurations have too few repeats for an interval (fewer than
    ``MIN_REPEATS``) and the override that would give them one, else None."""
    few = [r for r in rows if 0 < r["repeats"] < MIN_REPEATS]
    if not few:
        return None
    counts = sorted({r["repeats"] for r in few})
    have = " or ".join(str(c) for c in counts)
    return (
        f"{len(few)} of {len(rows)} configuration(s) have {have} repeat(s), too few for a 95% interval (nor one "
        f"for a speedup against them): {MIN_REPEATS} repeats would do ({repeats_hint()})"
    )
