"""W&B workspace with data-parallel scaling comparison panels for one sweep group.

Usage::

    python -m sweeps.dashboard --entity E --project P --group G --dry-run   # print spec, offline
    python -m sweeps.dashboard --entity E --project P --group G             # save, print URL

The workspace (built with ``wandb_workspaces``; building it needs no network)
shows only the runs of W&B group ``G`` (runset filter ``Group == G``) and has
these sections:

* **Scaling** - one point per run (summary metrics), x = ``summary:mesh/devices``
  (log axis): throughput ``perf/examples_per_s`` [examples/s], per-device
  throughput ``perf/examples_per_s_per_device`` [examples/s/device; flat =
  linear scaling], and - from the ``job_type=scaling_report`` run logged by
  ``python -m sweeps.report --wandb`` - line plots of
  ``scaling/efficiency/<group>`` (= speedup / N) and ``scaling/speedup/<group>``
  (= examples/s(N) / examples/s(1)) against ``scaling/devices``.
* **Communication** - ``comm/ratio_model``, ``comm/ratio_measured`` (only
  meaningful where ``comm/ratio_measured_valid``), ``comm/bytes_per_step``
  [bytes/device/step, ring all-reduce model] vs devices.
* **Memory per device** - ``mem/state_bytes_per_device``,
  ``mem/temp_bytes_per_device``, ``mem/peak_bytes_per_device`` [bytes] vs devices.
* **Training curves by mode** - line plots of ``train/loss``, ``eval/loss``,
  ``eval/accuracy`` and ``perf/step_time_s`` [s] against step, grouped by the
  run config key ``parallel.name`` (mean line, min-max band). train.py logs the config nested
  (``config.parallel = {"name": "fsdp", ...}``), so the mode is ``parallel.name``; a plain ``parallel``
  would group by the whole sub-dict.
* **Scaling report** - the ``scaling_table`` table and ``plots/*`` images of the
  report run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from typing import Any
from urllib.parse import urlparse

import wandb_workspaces.reports.v2 as wr
import wandb_workspaces.workspaces as ws

DEVICES = "mesh/devices"
REPORT_PLOTS = ("throughput", "efficiency", "comm", "memory")


def _scatter(title: str, y: str, log_y: bool | None = None) -> wr.ScatterPlot:
    """One point per run: summary ``y`` vs summary ``mesh/devices`` (log x)."""
    return wr.ScatterPlot(
        title=title,
        x=wr.SummaryMetric(DEVICES),
        y=wr.SummaryMetric(y),
        log_x=True,
        log_y=log_y,
    )


def _curves(title: str, y: str, groupby: str, y_title: str) -> wr.LinePlot:
    """History of ``y`` vs step, one mean line (+ min-max band) per ``groupby`` value."""
    return wr.LinePlot(
        title=title,
        x="Step",
        y=[y],
        title_x="step",
        title_y=y_title,
        groupby=wr.Config(groupby),
        groupby_aggfunc="mean",
        groupby_rangefunc="minmax",
    )


def build_workspace_spec(entity: str, project: str, group: str, *,
                         groupby: str = "parallel.name", name: str | None = None) -> ws.Workspace:
    """Build (offline) the scaling-comparison ``wandb_workspaces`` Workspace for ``group``.

    Args:
        entity, project: where the workspace is saved.
        group: W&B run group of the sweep (the runset is filtered to it).
        groupby: run *config* key used to group training curves by parallel mode.
        name: workspace name (default ``"Scaling: <group>"``).

    Returns the ``ws.Workspace``; ``spec_to_dict`` gives its JSON view spec.
    Raises ``ValueError`` for a group name with quotes (the filter expression
    of ``wandb_workspaces`` cannot encode them).
    """
    if "'" in group or '"' in group:
        raise ValueError(f"W&B group names with quotes are not supported here: {group!r}")
    sections = [
        ws.Section(
            name="Scaling",
            is_open=True,
            layout_settings=ws.SectionLayoutSettings(columns=2, rows=2),
            panels=[
                _scatter("Throughput vs devices (examples/s)", "perf/examples_per_s"),
                _scatter("Per-device throughput vs devices (examples/s/device; flat = linear)",
                         "perf/examples_per_s_per_device"),
                wr.LinePlot(
                    title="Scaling efficiency = speedup / N (scaling_report run)",
                    x="scaling/devices",
                    metric_regex=r"^scaling/efficiency/.*",
                    range_y=(0.0, 1.1),
                    log_x=True,
                    title_x="devices",
                    title_y="scaling efficiency",
                ),
                wr.LinePlot(
                    title="Speedup vs 1 device (scaling_report run)",
                    x="scaling/devices",
                    metric_regex=r"^scaling/speedup/.*",
                    log_x=True,
                    title_x="devices",
                    title_y="speedup (x)",
                ),
            ],
        ),
        ws.Section(
            name="Communication",
            is_open=True,
            layout_settings=ws.SectionLayoutSettings(columns=3, rows=1),
            panels=[
                _scatter("Comm ratio (model) vs devices", "comm/ratio_model"),
                _scatter("Comm ratio (measured; check comm/ratio_measured_valid)",
                         "comm/ratio_measured"),
                _scatter("Comm bytes/step per device (ring model, bytes)", "comm/bytes_per_step"),
            ],
        ),
        ws.Section(
            name="Memory per device",
            is_open=True,
            layout_settings=ws.SectionLayoutSettings(columns=3, rows=1),
            panels=[
                _scatter("State bytes per device", "mem/state_bytes_per_device"),
                _scatter("Temp bytes per device", "mem/temp_bytes_per_device"),
                _scatter("Peak bytes per device", "mem/peak_bytes_per_device"),
            ],
        ),
        ws.Section(
            name="Training curves by mode",
            is_open=True,
            layout_settings=ws.SectionLayoutSettings(columns=2, rows=2),
            panels=[
                _curves("Train loss by parallel mode", "train/loss", groupby, "train loss"),
                _curves("Eval loss by parallel mode", "eval/loss", groupby, "eval loss"),
                _curves("Eval accuracy by parallel mode", "eval/accuracy", groupby, "eval accuracy"),
                _curves("Step time by parallel mode (s)", "perf/step_time_s", groupby,
                        "step time (s)"),
            ],
        ),
        ws.Section(
            name="Scaling report",
            is_open=False,
            layout_settings=ws.SectionLayoutSettings(columns=2, rows=1),
            panels=[
                wr.WeavePanelSummaryTable(table_name="scaling_table"),
                wr.MediaBrowser(media_keys=[f"plots/{p}" for p in REPORT_PLOTS]),
            ],
        ),
    ]
    return ws.Workspace(
        entity=entity,
        project=project,
        name=name or f"Scaling: {group}",
        sections=sections,
        settings=ws.WorkspaceSettings(x_axis="Step", max_runs=100),
        runset_settings=ws.RunsetSettings(
            filters=ws.And(ws.Metric("Group") == group),
            pinned_columns=[
                "summary:parallel",
                f"summary:{DEVICES}",
                "summary:perf/examples_per_s",
                "summary:comm/ratio_model",
                "summary:mem/peak_bytes_per_device",
                "summary:status",
            ],
        ),
    )


def spec_to_dict(workspace: ws.Workspace) -> dict[str, Any]:
    """The JSON-serialisable view spec that ``workspace.save()`` would upload."""
    return workspace._to_model().model_dump(by_alias=True, exclude_none=True, mode="json")


def panels_of(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Flat list of ``{"section", "type", "title", "x", "y", "groupBy"}`` from a spec dict."""
    out = []
    for section in spec["spec"]["section"]["panelBankConfig"]["sections"]:
        for panel in section["panels"]:
            config = panel.get("config", {})
            y = config.get("metrics") or config.get("yAxis")
            if config.get("useMetricRegex"):
                y = f"regex:{config.get('metricRegex')}"
            out.append({
                "section": section["name"],
                "type": panel.get("viewType"),
                "title": config.get("chartTitle"),
                "x": config.get("xAxis"),
                "y": y,
                "groupBy": config.get("groupBy"),
            })
    return out


def _have_api_key() -> bool:
    import wandb

    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return bool(wandb.login(prompt=False, verify=False))
    except Exception:  # noqa: BLE001
        return False


def _reachable(timeout: float = 5.0) -> tuple[bool, str]:
    base = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    url = urlparse(base)
    host = url.hostname or "api.wandb.ai"
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True, base
    except OSError:
        return False, base


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sweeps.dashboard",
        description="Build a W&B workspace comparing data-parallel scaling runs of one group.",
    )
    parser.add_argument("--entity", required=True, help="W&B entity (user or team)")
    parser.add_argument("--project", required=True, help="W&B project")
    parser.add_argument("--group", required=True, help="W&B run group of the sweep")
    parser.add_argument("--groupby", default="parallel.name",
                        help="run config key that names the parallel mode (default: parallel.name)")
    parser.add_argument("--name", default=None, help="workspace name (default: 'Scaling: <group>')")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the workspace spec as JSON; do not contact W&B")
    args = parser.parse_args(argv)

    try:
        workspace = build_workspace_spec(args.entity, args.project, args.group,
                                         groupby=args.groupby, name=args.name)
    except ValueError as exc:
        print(f"sweeps.dashboard: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(json.dumps(spec_to_dict(workspace), indent=2, sort_keys=True))
        return 0
    if not _have_api_key():
        print("sweeps.dashboard: error: no W&B API key (set WANDB_API_KEY or run `wandb login`); "
              "use --dry-run to only print the spec", file=sys.stderr)
        return 2
    ok, base = _reachable()
    if not ok:
        print(f"sweeps.dashboard: error: cannot reach W&B at {base} (no network?); "
              "use --dry-run to only print the spec", file=sys.stderr)
        return 2
    try:
        workspace.save()
        url = workspace.url
    except Exception as exc:  # noqa: BLE001 - one clear line, no traceback
        first = (str(exc).strip().splitlines() or [""])[0]
        print(f"sweeps.dashboard: error: saving the workspace failed: "
              f"{type(exc).__name__}: {first}", file=sys.stderr)
        return 1
    print(url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
