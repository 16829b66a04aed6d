"""Figures of the scaling report (matplotlib, Agg canvas, no pyplot state).

Each ``plot_*`` draws on given axes from aggregated rows (``sweeps.report.aggregate``) and returns the legend
handles it created, one per series; ``make_figures`` builds every figure, ``save`` writes a PNG. Tests inspect
the returned ``Figure`` objects (scales, lines, error-bar containers, legend entries).

Series share one colour, marker and line style in every figure (``series_style``): modes whose values are
equal (e.g. communication bytes of two modes) stay visible through their markers and line styles.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from sweeps.report.aggregate import is_cpu, recipe_rows, series_labels

CPU_SUBTITLE = "timings from simulated CPU devices on one host: they do not predict accelerator performance"
NO_LINK_SENTENCE = (
    "Comm ratio needs a link bandwidth: set hardware.link_bytes_per_s "
    "(bytes/s per direction, e.g. 450e9 for NVLink H100/H200)."
)
NO_TARGET_SENTENCE = "No time to target: set train.target_accuracy (and train.eval_every) in the sweep."
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


def _log2_x(ax, rows: list[dict]) -> None:
    devices = sorted({r["devices"] for r in rows if r["devices"]})
    ax.set_xscale("log", base=2)
    if devices:
        ax.set_xticks(devices)
        ax.set_xticklabels([str(d) for d in devices])
        ax.set_xlim(devices[0] / 1.3, devices[-1] * 1.3)
    ax.set_xlabel("devices")
    ax.grid(True, which="major", alpha=0.3)


def _errorbar(ax, xs, ys, lows, highs, label, style):
    """One error-bar container (asymmetric bars from the interval; none where it is unknown)."""
    yerr = [
        [y - lo if lo is not None else 0.0 for y, lo in zip(ys, lows)],
        [hi - y if hi is not None else 0.0 for y, hi in zip(ys, highs)],
    ]
    return ax.errorbar(xs, ys, yerr=yerr, label=label, capsize=3, **style)


def _message(ax, text: str) -> None:
    """Replaces the panel by one wrapped sentence (the axes are hidden; the text is ``ax.texts[0]``)."""
    ax.text(0.5, 0.5, textwrap.fill(text, 40), ha="center", va="center", fontsize=9, transform=ax.transAxes)
    ax.set_axis_off()


def plot_throughput(ax, rows: list[dict], projection_rows: list[dict] | None = None) -> list:
    """Examples/s vs devices on log-log axes: per series the median over repeats with error bars from the
    interval, and its ideal line (linear from the series' 1-device median; one legend entry for all ideal
    lines). ``projection_rows``: optional ``{"label", "devices", "examples_per_s"}`` dicts drawn as dotted
    lines, one legend entry per projection label (a projection model can overlay its prediction here)."""
    handles = []
    ideal_drawn = False
    for label, style, members in _series(rows):
        pts = [r for r in members if r["examples_per_s"] is not None]
        if not pts:
            continue
        handles.append(
            _errorbar(
                ax,
                [r["devices"] for r in pts],
                [r["examples_per_s"] for r in pts],
                [r["examples_per_s_ci_low"] for r in pts],
                [r["examples_per_s_ci_high"] for r in pts],
                label,
                style,
            )
        )
        base = next((r for r in pts if r["devices"] == 1), None)
        if base is not None and len(pts) > 1:
            xs = [r["devices"] for r in pts]
            ax.plot(
                xs,
                [base["examples_per_s"] * d for d in xs],
                label="_nolegend_",
                gid="ideal",
                **{**IDEAL_STYLE, "color": style["color"]},
            )
            ideal_drawn = True
    if ideal_drawn:
        handles.append(Line2D([], [], label="ideal (linear from the 1-device median)", **IDEAL_STYLE))
    by_label: dict[str, list[dict]] = {}
    for p in projection_rows or []:
        by_label.setdefault(str(p["label"]), []).append(p)
    for i, (label, pts) in enumerate(by_label.items()):
        pts = sorted(pts, key=lambda p: p["devices"])
        (line,) = ax.plot(
            [p["devices"] for p in pts],
            [p["examples_per_s"] for p in pts],
            linestyle=(0, (1, 2)),
            linewidth=2,
            color=series_style(i)["color"],
            label=f"projection: {label}",
        )
        handles.append(line)
    _log2_x(ax, list(rows) + list(projection_rows or []))  # the projection may reach past the measured counts
    ax.set_yscale("log")
    ax.set_ylabel("examples/s (global)")
    return handles


def plot_speedup(ax, rows: list[dict]) -> list:
    """Speedup vs devices (log-log, base 2) with error bars and the y = x line (one legend entry)."""
    handles = []
    for label, style, members in _series(rows):
        pts = [r for r in members if r["speedup"] is not None]
        if pts:
            handles.append(
                _errorbar(
                    ax,
                    [r["devices"] for r in pts],
                    [r["speedup"] for r in pts],
                    [r["speedup_ci_low"] for r in pts],
                    [r["speedup_ci_high"] for r in pts],
                    label,
                    style,
                )
            )
    devices = sorted({r["devices"] for r in rows if r["devices"]})
    if devices:
        (line,) = ax.plot(devices, devices, label="ideal (y = x)", **IDEAL_STYLE)
        handles.append(line)
    _log2_x(ax, rows)
    ax.set_yscale("log", base=2)
    ax.set_ylabel("speedup vs 1 device")
    return handles


def plot_efficiency(ax, rows: list[dict]) -> list:
    """Scaling efficiency (speedup / devices) vs devices, y from 0 to 1.1, a line at 1.0 (one legend entry)."""
    handles = []
    for label, style, members in _series(rows):
        pts = [r for r in members if r["efficiency"] is not None]
        if pts:
            handles.append(
                _errorbar(
                    ax,
                    [r["devices"] for r in pts],
                    [r["efficiency"] for r in pts],
                    [r["efficiency_ci_low"] for r in pts],
                    [r["efficiency_ci_high"] for r in pts],
                    label,
                    style,
                )
            )
    handles.append(ax.axhline(1.0, label="ideal (1.0)", **IDEAL_STYLE))
    _log2_x(ax, rows)
    ax.set_ylim(0.0, 1.1)
    ax.set_ylabel("scaling efficiency (speedup / devices)")
    return handles


def _bytes_panel(ax, rows, key: str, ylabel: str) -> list:
    handles = []
    for label, style, members in _series(rows):
        pts = [r for r in members if r[key] is not None]
        if pts:
            (line,) = ax.plot([r["devices"] for r in pts], [r[key] for r in pts], label=label, **style)
            handles.append(line)
    _log2_x(ax, rows)
    ax.set_ylabel(ylabel)
    return handles


def link_known(rows: list[dict]) -> bool:
    """Whether a model comm ratio exists (a link bandwidth was known for some job)."""
    return any(r["comm_ratio_source"] == "model" and r["comm_ratio"] is not None for r in rows)


def plot_comm(axes, rows: list[dict]) -> list:
    """Three panels: payload bytes per step, ring bytes per device per step, and the comm ratio (model) when
    a link bandwidth is known, else one sentence naming ``hardware.link_bytes_per_s``."""
    handles = _bytes_panel(axes[0], rows, "comm_payload_bytes", "payload bytes / step")
    axes[0].set_title("payload (sum of collective operands)", fontsize=9)
    _bytes_panel(axes[1], rows, "comm_ring_bytes", "bytes sent per device / step (ring model)")
    axes[1].set_title("ring model, per device", fontsize=9)
    if link_known(rows):
        _bytes_panel(axes[2], rows, "comm_ratio", "comm time (model) / step time")
        axes[2].set_title("comm ratio (model)", fontsize=9)
    else:
        _message(axes[2], NO_LINK_SENTENCE)
    return handles


def plot_memory(ax, rows: list[dict]) -> list:
    """State bytes per device (parameters + optimizer state) vs devices, one series per configuration."""
    handles = _bytes_panel(ax, rows, "state_bytes_per_device", "state bytes per device")
    ax.set_yscale("log", base=2)
    return handles


def plot_time_to_target(ax, rows: list[dict]) -> list:
    """Time to the target accuracy vs devices (median over repeats; bars: min-max of the repeats that
    reached it), or one sentence naming ``train.target_accuracy`` when no job had a target."""
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


def plot_vs_batch(axes, rows: list[dict]) -> list:
    """Large-batch study: final eval accuracy (median, min-max bars) and time to target vs global batch
    (log2 x), one series per recipe (the configuration without the batch)."""
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
        if pts:
            axes[1].plot([r["global_batch"] for r in pts], [r["time_to_target_s"] for r in pts], **style)
    batches = sorted({r["global_batch"] for r in rows if r["global_batch"]})
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches)
        ax.set_xticklabels([str(b) for b in batches])
        ax.set_xlabel("global batch")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("final eval accuracy")
    axes[1].set_ylabel("time to target accuracy (s)")
    if not any(r["time_to_target_s"] is not None for r in rows):
        _message(axes[1], NO_TARGET_SENTENCE)
    return handles


def _figure(title: str, common: str, cpu: bool, ncols: int = 1, width: float = 7.5):
    """A figure with ``ncols`` axes; the title carries the fields common to all series and, for timings from
    simulated CPU devices, ``CPU_SUBTITLE`` (``fig._suptitle.get_text()``)."""
    fig = Figure(figsize=(width if ncols == 1 else 5.0 * ncols, 5.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols)
    lines = [title] + textwrap.wrap(common, 100) + ([CPU_SUBTITLE] if cpu else [])
    fig.suptitle("\n".join(lines), fontsize=10)
    return fig, axes


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
    """Every figure of the report: ``throughput``, ``speedup``, ``efficiency``, ``comm``, ``memory``,
    ``time_to_target`` and, when a device count has more than one global batch, ``batch``."""
    _, common = series_labels(rows)
    cpu = is_cpu(rows)
    figs = {}
    fig, ax = _figure("Throughput vs devices (median over repeats, interval bars)", common, cpu)
    _legend(fig, ax, plot_throughput(ax, rows, projection_rows))
    figs["throughput"] = fig
    fig, ax = _figure("Speedup vs devices", common, cpu)
    _legend(fig, ax, plot_speedup(ax, rows))
    figs["speedup"] = fig
    fig, ax = _figure("Scaling efficiency vs devices", common, cpu)
    _legend(fig, ax, plot_efficiency(ax, rows))
    figs["efficiency"] = fig
    fig, axes = _figure("Communication per optimizer step vs devices", common, False, ncols=3)
    _legend(fig, axes[0], plot_comm(axes, rows), outside=True)
    figs["comm"] = fig
    fig, ax = _figure("Memory per device vs devices", common, False)
    _legend(fig, ax, plot_memory(ax, rows))
    figs["memory"] = fig
    fig, ax = _figure("Time to target accuracy vs devices", common, cpu)
    _legend(fig, ax, plot_time_to_target(ax, rows))
    figs["time_to_target"] = fig
    by_devices: dict = {}
    for r in rows:
        by_devices.setdefault(r["devices"], set()).add(r["global_batch"])
    if any(len(b) > 1 for b in by_devices.values()):
        fig, axes = _figure("Final accuracy and time to target vs global batch", "", cpu, ncols=2)
        fig.set_size_inches(12, 7)
        _legend(fig, axes[0], plot_vs_batch(axes, rows), below=True)
        figs["batch"] = fig
    return figs


def save(fig: Figure, path, dpi: int = 110) -> Path:
    """Writes ``fig`` as a PNG; returns the path."""
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    return path
