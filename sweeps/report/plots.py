"""Figures of the scaling report (matplotlib, Agg canvas, no pyplot state).

Each ``plot_*`` draws on given axes from aggregated rows (``sweeps.report.aggregate``) and returns the legend
handles it created, one per series; ``make_figures`` builds every figure, ``save`` writes a PNG. Tests inspect
the returned ``Figure`` objects (scales, lines, error-bar containers, legend entries).

Series share one colour, marker and line style in every figure (``series_style``); in the byte panels, modes
whose values are equal (e.g. the communication bytes of pmap, jit_sharding and shard_map) are drawn side by side
(``dodged_x``), so none hides another.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullLocator

from sweeps.report.aggregate import (
    is_cpu,
    projection_title,
    ratio_known,
    ratio_label,
    recipe_rows,
    regime_text,
    series_labels,
    settings_text,
    throughput_key,
    workload_text,
)
from sweeps.report.tables import NO_TARGET_SENTENCE

CPU_SUBTITLE = "measured on devices simulated on one CPU: these are not accelerator timings"
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", "-.", ":")
IDEAL_STYLE = dict(color="0.45", linestyle=":", linewidth=1.2)
PLOT_NAMES = ("throughput", "speedup", "efficiency", "comm", "memory", "time_to_target")


def series_style(i: int) -> dict:
    """Colour, marker, line style and marker size of the i-th series (sizes shrink so equal values show)."""
    import matplotlib

    colors = matplotlib.colormaps["tab10"].colors
    return dict(
        color=colors[i % len(colors)],
        marker=MARKERS[i % len(MARKERS)],
        linestyle=LINESTYLES[i % len(LINESTYLES)],
        markersize=max(4.0, 9.0 - 1.5 * (i % 4)),
        markerfacecolor="none",
        markeredgewidth=1.4,
    )


def _series(rows: list[dict]) -> list[tuple[str, dict, list[dict]]]:
    """[(label, style, rows sorted by devices)] for rows with at least one successful repeat."""
    labels, _ = series_labels(rows)
    out = []
    for i, key in enumerate(labels):
        members = sorted(
            (r for r in rows if r["_series"] == key and r["repeats"] and r["devices"]), key=lambda r: r["devices"]
        )
        if members:
            out.append((labels[key], series_style(i), members))
    return out


BINARY_UNITS = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B"))


def human_number(value: float) -> str:
    """A tick label in plain decimals: ``0.25``, ``3``, ``40k``, ``1.5M``, ``2G`` (no offset, no exponent)."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:g}{suffix}"
    return f"{value:g}"


def nice_log_ticks(low: float, high: float) -> list[float]:
    """Tick values in [low, high] (both > 0) for a log axis: 1-2-5 x 10^k, only 10^k when that gives more
    than 8 ticks, denser (1-2-3-5-7, then 1-1.5-2-3-4-5-6-8) until at least 3 ticks fall inside."""
    ticks: list[float] = []
    sparse = high / low > 10**3.5
    for mantissas in ((1,) if sparse else (1, 2, 5), (1, 2, 5), (1, 2, 3, 5, 7), (1, 1.5, 2, 3, 4, 5, 6, 8)):
        ticks = []
        for k in range(math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 1):
            for m in mantissas:
                t = float(f"{m * 10.0**k:.6g}")
                if low <= t <= high:
                    ticks.append(t)
        if len(ticks) >= 3:
            break
    return ticks


def log_y_axis(ax, values, pad: float = 1.25, powers_of_2: bool = False, fmt=human_number) -> None:
    """Log y axis whose limits hold every value (times/divided by ``pad``) with plain-decimal ticks
    (``powers_of_2``: 0.25, 0.5, 1, 2, 4 ... when at least 3 fall inside, else 1-2-5 x 10^k), labelled by
    ``fmt`` (value -> text; default :func:`human_number`)."""
    ax.set_yscale("log")
    vals = [float(v) for v in values if v is not None and v > 0 and math.isfinite(v)]
    if not vals:
        return
    low, high = min(vals) / pad, max(vals) * pad
    ax.set_ylim(low, high)
    ticks = nice_log_ticks(low, high)
    if powers_of_2:
        twos = [2.0**k for k in range(math.ceil(math.log2(low)), math.floor(math.log2(high)) + 1)]
        ticks = twos if len(twos) >= 3 else ticks
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt(v)))
    ax.yaxis.set_minor_locator(NullLocator())


def bytes_unit(max_bytes: float) -> tuple[int, str]:
    """(bytes per unit, unit name): the largest binary unit (KiB, MiB, ...) not above ``max_bytes``."""
    return next(((size, name) for size, name in BINARY_UNITS if max_bytes >= size), (1, "B"))


def _bytes_y(ax, values, unit_of: float | None = None) -> None:
    """Linear y axis from 0 with ticks at round numbers of one binary unit (``0 MiB``, ``0.5 MiB``...): the unit of
    ``unit_of`` bytes when given (panels side by side share one unit), else of the largest value."""
    vals = [float(v) for v in values if v is not None]
    top = max(vals, default=0.0)
    size, name = bytes_unit(top if unit_of is None else unit_of)
    if top <= 0:
        ax.set_ylim(0, 1)
        ax.set_yticks([0])
        ax.set_yticklabels(["0 B"])
        return
    ticks = [t * size for t in MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]).tick_values(0, top * 1.08 / size)]
    ticks = [t for t in ticks if t <= top * 1.08 + 1e-9 * size] or [0.0]
    ax.set_ylim(0, max(top * 1.08, ticks[-1]))
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / size:g} {name}"))


def devices_x_axis(ax, rows: list[dict]) -> None:
    """Log-2 x axis with one tick per device count of ``rows`` (``{"devices": N}``), labelled plainly."""
    _log2_x(ax, rows)


def _log2_x(ax, rows: list[dict]) -> None:
    devices = sorted({r["devices"] for r in rows if r["devices"]})
    ax.set_xscale("log", base=2)
    if devices:
        ax.set_xticks(devices)
        ax.set_xticklabels([str(d) for d in devices])
        ax.set_xlim(devices[0] / 1.3, devices[-1] * 1.3)
    ax.set_xlabel("devices")
    ax.grid(True, which="major", alpha=0.3)


SERIES_DODGE = 0.06  # octaves between neighbouring series' error bars at one device count (about 1.6% of the axis)


def series_shift(i: int, n: int) -> float:
    """The factor by which the i-th of ``n`` series' x positions are moved on a log-2 axis, so that error bars of
    several series at one device count stand side by side, centred on it, instead of on top of each other."""
    return 2.0 ** ((i - (n - 1) / 2) * SERIES_DODGE) if n > 1 else 1.0


def _errorbar(ax, xs, ys, lows, highs, label, style, shift: float = 1.0):
    """One error-bar container (asymmetric bars from the interval; none where it is unknown), its x positions
    multiplied by ``shift`` (``series_shift``)."""
    yerr = [
        [y - lo if lo is not None else 0.0 for y, lo in zip(ys, lows)],
        [hi - y if hi is not None else 0.0 for y, hi in zip(ys, highs)],
    ]
    return ax.errorbar([x * shift for x in xs], ys, yerr=yerr, label=label, capsize=3, **style)


def _message(ax, text: str) -> None:
    """Replaces the panel by one wrapped sentence (the axes are hidden; the text is ``ax.texts[0]``)."""
    ax.text(0.5, 0.5, textwrap.fill(text, 40), ha="center", va="center", fontsize=9, transform=ax.transAxes)
    ax.set_axis_off()


def plot_throughput(ax, rows: list[dict], solid: bool = False) -> list:
    """Examples/s (tokens/s for a token model's sweep: ``throughput_key``) vs devices on log-log axes: per
    series the geometric mean of its repeats with error bars from the 95% interval (none with fewer than 3
    repeats), and its ideal line (linear from the series' 1-device figure; one legend entry for all ideal
    lines). The y axis holds every point, bar and ideal line, with plain-decimal ticks (``40k``, ``100k``).
    ``solid``: every measured series drawn solid (beside a projection, whose lines are dashed)."""
    key, unit = throughput_key(rows)
    handles = []
    ideal_drawn = False
    values: list[float] = []
    series = _series(rows)
    for i, (label, style, members) in enumerate(series):
        pts = [r for r in members if r[key] is not None]
        if not pts:
            continue
        if solid:
            style = {**style, "linestyle": "-"}
        handles.append(
            _errorbar(
                ax,
                [r["devices"] for r in pts],
                [r[key] for r in pts],
                [r[f"{key}_ci_low"] for r in pts],
                [r[f"{key}_ci_high"] for r in pts],
                label,
                style,
                series_shift(i, len(series)),
            )
        )
        values += [r[k] for r in pts for k in (key, f"{key}_ci_low", f"{key}_ci_high")]
        base = next((r for r in pts if r["devices"] == 1), None)
        if base is not None and len(pts) > 1:
            xs = [r["devices"] for r in pts]
            ideal = [base[key] * d for d in xs]
            ax.plot(xs, ideal, label="_nolegend_", gid="ideal", **{**IDEAL_STYLE, "color": style["color"]})
            values += ideal
            ideal_drawn = True
    if ideal_drawn:
        handles.append(Line2D([], [], label="ideal (linear from 1 device)", **IDEAL_STYLE))
    _log2_x(ax, rows)
    log_y_axis(ax, values)
    ax.set_ylabel(f"{unit} (global)")
    return handles


def mode_styles(rows: list[dict]) -> dict[str, dict]:
    """{mode: colour and marker of the first measured series of that mode} (``series_style``)."""
    styles: dict[str, dict] = {}
    for _, style, members in _series(rows):
        styles.setdefault(str(members[0]["parallel"]), {"color": style["color"], "marker": style["marker"]})
    return styles


def plot_projection(ax, rows: list[dict], projection_rows: list[dict]) -> list:
    """Projected examples/s vs devices (``projection_rows``: ``{"label", "devices", "examples_per_s"}``, the
    label's first word being the mode; tokens/s from their ``tokens_per_s`` for a token model's sweep) on
    their own log-log axes, dashed with open markers, in the colour of the measured series of the same mode,
    with its marker (a mode the sweep did not measure gets the next colour)."""
    key, unit = throughput_key(rows)
    styles = mode_styles(rows)
    by_label: dict[str, list[dict]] = {}
    for p in projection_rows:
        by_label.setdefault(str(p["label"]), []).append(p)
    handles, values = [], []
    extra = len(styles)
    for label, pts in by_label.items():
        if any(p.get("below_step_floor") for p in pts):  # its throughput is the model's latency terms only
            continue
        pts = sorted(pts, key=lambda p: p["devices"])
        mode = label.split()[0] if label.split() else label
        if mode not in styles:
            styles[mode] = {k: series_style(extra)[k] for k in ("color", "marker")}
            extra += 1
        (line,) = ax.plot(
            [p["devices"] for p in pts],
            [p[key] for p in pts],
            linestyle="--",
            markerfacecolor="none",
            **styles[mode],
            label=label,
            gid="projection",
        )
        handles.append(line)
        values += [p[key] for p in pts]
    ax.set_title(textwrap.fill(projection_title(projection_rows, rows), 62), fontsize=9)
    if not values:
        ax.set_axis_off()
        ax.text(
            0.5,
            0.5,
            textwrap.fill(
                "Not drawn: every projected configuration's modelled step computes below what a step takes on any "
                "real device (projection.csv keeps the model's numbers, flagged).",
                50,
            ),
            ha="center",
            va="center",
            fontsize=9,
        )
        return handles
    _log2_x(ax, projection_rows)
    log_y_axis(ax, values)
    ax.set_ylabel(f"{unit} (global, projected)")
    return handles


def plot_speedup(ax, rows: list[dict]) -> list:
    """Speedup vs devices (log-log) with error bars and the y = x line (one legend entry); the y axis holds
    every point and bar, with plain-decimal ticks (``0.5``, ``1``, ``2``)."""
    handles = []
    values: list[float] = []
    series = _series(rows)
    for i, (label, style, members) in enumerate(series):
        pts = [r for r in members if r["speedup"] is not None]
        if pts:
            values += [r[k] for r in pts for k in ("speedup", "speedup_ci_low", "speedup_ci_high")]
            handles.append(
                _errorbar(
                    ax,
                    [r["devices"] for r in pts],
                    [r["speedup"] for r in pts],
                    [r["speedup_ci_low"] for r in pts],
                    [r["speedup_ci_high"] for r in pts],
                    label,
                    style,
                    series_shift(i, len(series)),
                )
            )
    devices = sorted({r["devices"] for r in rows if r["devices"]})
    if devices:
        (line,) = ax.plot(devices, devices, label="ideal (y = x)", **IDEAL_STYLE)
        handles.append(line)
        values += devices
    _log2_x(ax, rows)
    log_y_axis(ax, values, powers_of_2=True)
    ax.set_ylabel("speedup vs 1 device (log scale)")
    return handles


def plot_efficiency(ax, rows: list[dict]) -> list:
    """Scaling efficiency (speedup / devices) vs devices, y from 0 to 1.1 (higher when a point or an interval bar
    reaches above: nothing is clipped), a line at 1.0 (one legend entry). The 1-device point is each series'
    reference: 1.0 by definition, without a bar."""
    handles = []
    top = 1.0
    series = _series(rows)
    for i, (label, style, members) in enumerate(series):
        pts = [r for r in members if r["efficiency"] is not None]
        if pts:
            top = max([top] + [r[k] for r in pts for k in ("efficiency", "efficiency_ci_high") if r[k] is not None])
            handles.append(
                _errorbar(
                    ax,
                    [r["devices"] for r in pts],
                    [r["efficiency"] for r in pts],
                    [r["efficiency_ci_low"] for r in pts],
                    [r["efficiency_ci_high"] for r in pts],
                    label,
                    style,
                    series_shift(i, len(series)),
                )
            )
    handles.append(ax.axhline(1.0, label="ideal (1.0)", **IDEAL_STYLE))
    _log2_x(ax, rows)
    ax.set_ylim(0.0, max(1.1, round(top * 1.05, 2)))
    ax.set_ylabel("scaling efficiency (speedup / devices)")
    return handles


DODGE = 0.025  # neighbours among coinciding points: this fraction of the x axis apart (at most 0.6 octave in all)
SIDE_BY_SIDE = "equal values side by side"


def dodged_x(points: list[list[tuple[int, float]]], x_span_octaves: float) -> tuple[list[list[float]], list[bool]]:
    """x of every point of every series (``points``: per series its (devices, value) pairs), where points of
    several series that coincide (values within 1% of the largest) are spread side by side around their device
    count, in series order, ``DODGE`` x the axis width apart on the log-2 axis; a point that no other series
    shares keeps its x. Equal communication bytes (``pmap``, ``jit_sharding``, ``shard_map``) stay visible.
    Also returns, per series, whether some point of it coincided with another series'."""
    tol = 0.01 * max((abs(v) for pts in points for _, v in pts), default=0.0)
    xs = [[float(d) for d, _ in pts] for pts in points]
    shared = [False] * len(points)
    for d in sorted({d for pts in points for d, _ in pts}):
        here = sorted((v, i, j) for i, pts in enumerate(points) for j, (dd, v) in enumerate(pts) if dd == d)
        groups: list[list[tuple[float, int, int]]] = []
        for item in here:
            if groups and item[0] - groups[-1][0][0] <= tol:
                groups[-1].append(item)
            else:
                groups.append([item])
        for group in groups:
            if len(group) < 2:
                continue
            step = min(DODGE * x_span_octaves, 0.6 / (len(group) - 1))
            for k, (_, i, j) in enumerate(sorted(group, key=lambda t: t[1])):
                xs[i][j] = d * 2.0 ** ((k - (len(group) - 1) / 2) * step)
                shared[i] = True
    return xs, shared


def _bytes_panel(ax, rows, key: str, ylabel: str, in_bytes: bool = True, unit_of: float | None = None) -> list:
    """One line per series of ``key`` vs devices; byte values on a linear axis from 0 in KiB/MiB/GiB (the unit of
    ``unit_of`` bytes when given: ``_bytes_y``). Series with equal values are drawn side by side (``dodged_x``;
    their lines have the gid ``"dodged"``)."""
    drawn = [(label, style, [r for r in members if r[key] is not None]) for label, style, members in _series(rows)]
    drawn = [(label, style, pts) for label, style, pts in drawn if pts]
    devices = sorted({r["devices"] for r in rows if r["devices"]})
    span = math.log2(devices[-1] / devices[0] * 1.3**2) if devices else 1.0
    xs, shared = dodged_x([[(r["devices"], float(r[key])) for r in pts] for _, _, pts in drawn], span)
    handles, values = [], []
    for (label, style, pts), x, moved in zip(drawn, xs, shared):
        (line,) = ax.plot(x, [r[key] for r in pts], label=label, gid="dodged" if moved else None, **style)
        handles.append(line)
        values += [r[key] for r in pts]
    _log2_x(ax, rows)
    if in_bytes:
        _bytes_y(ax, values, unit_of)
    ax.set_ylabel(ylabel)
    return handles


def _title(ax, text: str) -> None:
    """``text`` as the panel's title, with ``SIDE_BY_SIDE`` when some of its series were moved apart."""
    moved = any(line.get_gid() == "dodged" for line in ax.get_lines())
    if moved:
        text = f"{text} ({SIDE_BY_SIDE})" if text else SIDE_BY_SIDE
    ax.set_title(text, fontsize=9)


def plot_comm(axes, rows: list[dict]) -> list:
    """Payload bytes per step, ring bytes per device per step (KiB/MiB axes) and, when ``axes`` has a third
    panel (``ratio_known``), the communication ratio: comm time / step time of the device that ran. Both byte
    panels use one unit: that of the largest byte count of either."""
    top = max((float(r[k]) for r in rows for k in ("comm_payload_bytes", "comm_ring_bytes") if r[k]), default=0.0)
    handles = _bytes_panel(axes[0], rows, "comm_payload_bytes", "payload / step", unit_of=top)
    _title(axes[0], "payload: the sum of collective operands")
    _bytes_panel(axes[1], rows, "comm_ring_bytes", "sent per device / step (ring model)", unit_of=top)
    _title(axes[1], "ring model: sent by each device")
    if len(axes) > 2:
        _bytes_panel(axes[2], rows, "comm_ratio", "comm time / step time", in_bytes=False)
        _title(axes[2], ratio_label(rows))
    return handles


def plot_memory(ax, rows: list[dict]) -> list:
    """State bytes per device (parameters + optimizer state) vs devices, one series per configuration."""
    handles = _bytes_panel(ax, rows, "state_bytes_per_device", "state (parameters + optimizer) per device")
    _title(ax, "")
    return handles


def plot_time_to_target(ax, rows: list[dict]) -> list:
    """Time to the target accuracy vs devices (median over repeats). ``make_figures`` draws it only when some
    configuration reached a target (``has_target``); otherwise one sentence naming ``train.target_accuracy``."""
    handles = []
    for label, style, members in _series(rows):
        pts = [r for r in members if r["time_to_target_s"] is not None]
        if pts:
            handles.append(
                ax.plot([r["devices"] for r in pts], [r["time_to_target_s"] for r in pts], label=label, **style)[0]
            )
    if not handles:
        _message(ax, NO_TARGET_SENTENCE)
        return handles
    _log2_x(ax, rows)
    ax.set_ylabel("time to target accuracy (s)")
    return handles


def has_target(rows: list[dict]) -> bool:
    """Whether some configuration has a time to target (a target was set and reached)."""
    return any(r["time_to_target_s"] is not None for r in rows)


def plot_vs_batch(axes, rows: list[dict]) -> list:
    """Large-batch study: final eval accuracy (median, min-max bars) and, when ``axes`` has a second panel
    (``has_target``), time to target vs global batch (log2 x), one series per recipe (the configuration
    without the batch)."""
    handles = []
    for i, (label, members) in enumerate(recipe_rows(rows).items()):
        style = series_style(i)
        pts = [r for r in members if r["eval_accuracy"] is not None]
        if pts:
            handles.append(
                _errorbar(
                    axes[0],
                    [r["global_batch"] for r in pts],
                    [r["eval_accuracy"] for r in pts],
                    [r["eval_accuracy_min"] for r in pts],
                    [r["eval_accuracy_max"] for r in pts],
                    label,
                    style,
                )
            )
        pts = [r for r in members if r["time_to_target_s"] is not None]
        if pts and len(axes) > 1:
            axes[1].plot([r["global_batch"] for r in pts], [r["time_to_target_s"] for r in pts], **style)
    batches = sorted({r["global_batch"] for r in rows if r["global_batch"]})
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches)
        ax.set_xticklabels([str(b) for b in batches])
        ax.set_xlabel("global batch")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("final eval accuracy")
    if len(axes) > 1:
        axes[1].set_ylabel("time to target accuracy (s)")
    return handles


def _figure(title: str, common: str, cpu: bool, ncols: int = 1, width: float = 7.5, notes: tuple = ()):
    """A figure with ``ncols`` axes (always a list); the title carries the settings common to all series (in
    words, ``aggregate.settings_text``), the ``notes`` and, for timings from simulated CPU devices,
    ``CPU_SUBTITLE`` (``fig._suptitle.get_text()``), each wrapped to the figure's width so no line is cut.
    Commands and tips go to ``scaling.md``'s captions, not here."""
    width_in = width if ncols == 1 else 5.0 * ncols
    fig = Figure(figsize=(width_in, 5.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    chars = int(width_in * 72 / (10 * 0.58))  # about 0.58 em per character at fontsize 10
    lines = [title] + [w for text in (common, *notes, CPU_SUBTITLE if cpu else "") for w in _wrap(text, chars)]
    fig.suptitle("\n".join(lines), fontsize=10)
    return fig, list(axes)


def _wrap(text: str, chars: int) -> list[str]:
    """``text`` in lines of at most ``chars``, broken at its ``; `` separators first (a phrase such as ``global
    batch 256`` is never cut), then at spaces inside a part that is still too long."""
    if len(text) <= chars:
        return [text] if text else []
    lines: list[str] = []
    for part in text.split("; "):
        if lines and len(lines[-1]) + 2 + len(part) <= chars:
            lines[-1] = f"{lines[-1]}; {part}"
        else:
            lines += textwrap.wrap(part, chars) or [part]
    return lines


MAX_LEGEND = 16  # more series than this: no legend, a note pointing to scaling.csv


def _legend(fig, ax, handles, outside: bool = False, below: bool = False) -> None:
    if not handles:
        return
    if len(handles) > MAX_LEGEND:
        ax.text(
            0.01,
            0.99,
            f"{len(handles)} series: too many for a legend (see scaling.csv)",
            va="top",
            fontsize=8,
            transform=ax.transAxes,
        )
        return
    if below:
        fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=8)
    elif outside:
        fig.legend(handles=handles, loc="outside right upper", fontsize=8)
    else:
        ax.legend(handles=handles, fontsize=8, loc="best")


def make_figures(rows: list[dict], projection_rows: list[dict] | None = None) -> dict[str, Figure]:
    """Every figure of the report: ``throughput`` (with a second panel for ``projection_rows``),
    ``speedup``, ``efficiency``, ``comm``, ``memory``, ``time_to_target`` when some configuration reached a
    target, and ``batch`` when a device count has more than one global batch. No figure is empty: what is
    missing (a communication ratio, a target) is said in ``scaling.md``'s captions."""
    workload = workload_text(rows)
    common = "; ".join(t for t in (workload, settings_text(rows)) if t)
    cpu = is_cpu(rows)
    unit = throughput_key(rows)[1]
    figs = {}
    if projection_rows:
        measured_on = ", ".join(sorted({str(r["_platform"]) for r in rows if r.get("_platform")})) or "this sweep"
        # the figure's title holds what both panels share; each panel's title its own regime (and the CPU label)
        fig, (ax, ax_p) = _figure(f"Throughput ({unit}) vs devices", workload, False, ncols=2)
        where = (
            "measured on devices simulated on one CPU (not accelerator timings)"
            if cpu
            else f"measured on {measured_on}"
        )
        ax.set_title(textwrap.fill(f"{where}: {settings_text(rows) or regime_text(rows)}", 62), fontsize=9)
        _legend(fig, ax, plot_throughput(ax, rows, solid=True))
        _legend(fig, ax_p, plot_projection(ax_p, rows, projection_rows))
    else:
        fig, (ax,) = _figure(f"Throughput ({unit}) vs devices", common, cpu)
        _legend(fig, ax, plot_throughput(ax, rows))
    figs["throughput"] = fig
    fig, (ax,) = _figure("Speedup vs devices", common, cpu)
    _legend(fig, ax, plot_speedup(ax, rows))
    figs["speedup"] = fig
    fig, (ax,) = _figure("Scaling efficiency vs devices", common, cpu)
    _legend(fig, ax, plot_efficiency(ax, rows))
    figs["efficiency"] = fig
    ratio = ratio_known(rows)
    fig, axes = _figure(
        "Communication per optimizer step vs devices",
        common,
        cpu and ratio,  # bytes are exact anywhere; a ratio is a timing
        ncols=3 if ratio else 2,
    )
    _legend(fig, axes[0], plot_comm(axes, rows), below=True)
    figs["comm"] = fig
    fig, (ax,) = _figure("Parameters + optimizer state per device vs devices", common, False)
    _legend(fig, ax, plot_memory(ax, rows), below=True)  # flat lines: a legend inside would cover their points
    figs["memory"] = fig
    if has_target(rows):
        fig, (ax,) = _figure("Time to target accuracy vs devices", common, cpu)
        _legend(fig, ax, plot_time_to_target(ax, rows))
        figs["time_to_target"] = fig
    by_devices: dict = {}
    for r in rows:
        by_devices.setdefault(r["devices"], set()).add(r["global_batch"])
    if any(len(b) > 1 for b in by_devices.values()):
        target = has_target(rows)
        title = "Final accuracy and time to target vs global batch" if target else "Final accuracy vs global batch"
        fig, axes = _figure(title, "", cpu, ncols=2 if target else 1)
        fig.set_size_inches(12 if target else 7.5, 7)
        _legend(fig, axes[0], plot_vs_batch(axes, rows), below=True)
        figs["batch"] = fig
    return figs


def save(fig: Figure, path, dpi: int = 110) -> Path:
    """Writes ``fig`` as a PNG; returns the path."""
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    return path
