"""W&B workspace with data-parallel scaling comparison panels for one sweep group.

Usage::

    python -m sweeps.dashboard multirun/<date>/<time> --dry-run              # what it would build, offline
    python -m sweeps.dashboard multirun/<date>/<time> --dry-run --json       # the workspace spec as JSON
    python -m sweeps.dashboard multirun/<date>/<time> [--entity E]          # save, print URL
    python -m sweeps.dashboard --entity E --project P --group G [--dry-run]

With a multirun folder, the W&B group comes from the jobs' ``summary.json`` (``wandb/group``: the sweep's
folder, ``sweep-<path with _>``, unless ``wandb.group`` was set), project and entity from their
``.hydra/config.yaml`` (``wandb.project``, ``wandb.entity``; ``--entity``/``--project`` override), and the
runs are grouped by *configuration*: every config key whose value differs between the jobs, except
``train.seed`` (``varying_config_keys``). Repeats (jobs differing only in the seed) then form one group, so
the training curves show one line per configuration with a min-max band.

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

Given a multirun folder, a panel whose metric no job's ``summary.json`` holds is left out (and listed as left out
by ``--dry-run``): ``mem/peak_bytes_per_device`` on the CPU, ``comm/ratio_measured`` without the profiler (or
where it is never valid: simulated CPU devices), ``comm/ratio_model`` without a profile of the device that ran.
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
REPORT_PLOTS = ("throughput", "speedup", "efficiency", "comm", "memory", "time_to_target")
REPEAT_KEYS = ("train.seed",)  # config keys that only name a repeat


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: json.dumps(node, sort_keys=True) if isinstance(node, list) else node}


def read_multirun(folder) -> dict[str, Any]:
    """W&B coordinates and the configuration keys of a multirun folder (``<job>/summary.json`` and
    ``<job>/.hydra/config.yaml``): ``{"group", "project", "entity", "config_keys", "jobs", "logged"}``;
    ``logged``: summary key -> how many jobs hold a value (``comm/ratio_measured`` only where valid); also
    ``"report_run"`` (whether ``sweeps.report --wandb`` logged this sweep's report run: its
    ``REPORT_RUN_FILE`` lies under ``folder``) and ``"cpu"`` (whether some job ran on simulated CPU devices).

    ``config_keys``: dotted config keys (e.g. ``parallel.name``, ``mesh.devices``) whose values differ
    between jobs, ``train.seed`` and ``hydra``/``wandb`` keys left out; sorted.

    Raises:
      ValueError: no job with a ``summary.json`` and a W&B group under ``folder`` (one-line message).
    """
    from collections import Counter
    from pathlib import Path

    import yaml

    from sweeps.report.collect import REPORT_RUN_FILE, profile_matches

    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"multirun folder does not exist or is not a directory: {folder}")
    groups: Counter = Counter()
    configs = []
    logged: Counter = Counter()  # summary keys -> jobs holding a value
    cpu = False
    for summary_path in sorted(root.rglob("summary.json")):
        if "wandb" in summary_path.relative_to(root).parts[:-1]:
            continue
        try:
            summary = json.loads(summary_path.read_text())
        except ValueError:
            continue
        if summary.get("wandb/group"):
            groups[summary["wandb/group"]] += 1
        logged.update(k for k, v in summary.items() if v is not None)
        cpu = cpu or str(summary.get("platform") or "").lower() == "cpu"
        if summary.get("comm/ratio_measured_valid") is False:  # logged, but not a measurement of a link
            logged.subtract(["comm/ratio_measured"])
        if "comm/ratio_model" in summary and not profile_matches(summary):  # another device's profile (older runs)
            logged.subtract(["comm/ratio_model"])
        config_path = summary_path.parent / ".hydra" / "config.yaml"
        if config_path.is_file():
            configs.append(_flatten(yaml.safe_load(config_path.read_text()) or {}))
    if not groups:
        raise ValueError(f"no job under {folder} has a summary.json with wandb/group (was W&B disabled?)")
    keys = sorted({k for c in configs for k in c})
    varying = [
        k
        for k in keys
        if k not in REPEAT_KEYS
        and not k.startswith(("hydra.", "wandb."))
        and len({json.dumps(c.get(k), sort_keys=True, default=str) for c in configs}) > 1
    ]
    first = configs[0] if configs else {}
    return {
        "group": groups.most_common(1)[0][0],
        "project": first.get("wandb.project"),
        "entity": first.get("wandb.entity"),
        "config_keys": varying,
        "jobs": len(configs),
        "logged": {k: n for k, n in logged.items() if n > 0},
        "report_run": any(root.rglob(REPORT_RUN_FILE)),
        "cpu": cpu,
    }


# panels whose values are timings: on simulated CPU devices they are not accelerator timings
TIMING_METRICS = (
    "perf/examples_per_s",
    "perf/examples_per_s_per_device",
    "perf/step_time_s",
    "perf/tokens_per_s",
    "scaling/efficiency/*",
    "scaling/speedup/*",
)


def _scatter(title: str, y: str, log_y: bool | None = None) -> wr.ScatterPlot:
    """One point per run: summary ``y`` vs summary ``mesh/devices`` (log x)."""
    return wr.ScatterPlot(
        title=title,
        x=wr.SummaryMetric(DEVICES),
        y=wr.SummaryMetric(y),
        log_x=True,
        log_y=log_y,
    )


def _curves(title: str, y: str, groupby: str | None, y_title: str) -> wr.LinePlot:
    """History of ``y`` vs step, one mean line (+ min-max band) per ``groupby`` value (None: per group of
    the runset's grouping)."""
    return wr.LinePlot(
        title=title,
        x="Step",
        y=[y],
        title_x="step",
        title_y=y_title,
        groupby=wr.Config(groupby) if groupby else None,
        groupby_aggfunc="mean",
        groupby_rangefunc="minmax",
    )


def panel_table(by: str, curve_group: str | None) -> list[tuple[str, int, int, list[tuple[Any, str, str]]]]:
    """Sections of the workspace: ``(name, columns, rows, [(panel, metric, source)])``; ``source`` is
    ``summary`` (one value per run), ``history`` (per step) or ``report`` (the ``scaling_report`` run of
    ``python -m sweeps.report <folder> --wandb``)."""
    return [
        (
            "Scaling",
            2,
            2,
            [
                (
                    _scatter("Throughput vs devices (examples/s)", "perf/examples_per_s"),
                    "perf/examples_per_s",
                    "summary",
                ),
                (
                    _scatter(
                        "Per-device throughput vs devices (examples/s/device; flat = linear)",
                        "perf/examples_per_s_per_device",
                    ),
                    "perf/examples_per_s_per_device",
                    "summary",
                ),
                (
                    wr.LinePlot(
                        title="Scaling efficiency = speedup / N (scaling_report run)",
                        x="scaling/devices",
                        metric_regex=r"^scaling/efficiency/.*",
                        range_y=(0.0, 1.1),
                        log_x=True,
                        title_x="devices",
                        title_y="scaling efficiency",
                    ),
                    "scaling/efficiency/*",
                    "report",
                ),
                (
                    wr.LinePlot(
                        title="Speedup vs 1 device (scaling_report run)",
                        x="scaling/devices",
                        metric_regex=r"^scaling/speedup/.*",
                        log_x=True,
                        title_x="devices",
                        title_y="speedup (x)",
                    ),
                    "scaling/speedup/*",
                    "report",
                ),
            ],
        ),
        (
            "Communication",
            3,
            1,
            [
                (_scatter("Comm ratio (model) vs devices", "comm/ratio_model"), "comm/ratio_model", "summary"),
                (
                    _scatter("Comm ratio (measured; check comm/ratio_measured_valid)", "comm/ratio_measured"),
                    "comm/ratio_measured",
                    "summary",
                ),
                (
                    _scatter("Comm bytes/step per device (ring model, bytes)", "comm/bytes_per_step"),
                    "comm/bytes_per_step",
                    "summary",
                ),
            ],
        ),
        (
            "Memory per device",
            3,
            1,
            [
                (
                    _scatter(f"{name} bytes per device", f"mem/{key}_bytes_per_device"),
                    f"mem/{key}_bytes_per_device",
                    "summary",
                )
                for name, key in (("State", "state"), ("Temp", "temp"), ("Peak", "peak"))
            ],
        ),
        (
            f"Training curves by {'configuration' if by == 'configuration' else 'mode'}",
            3,
            2,
            [
                (_curves(f"{title} by {by}{unit}", key, curve_group, y_title), key, "history")
                for title, key, y_title, unit in (
                    ("Train loss", "train/loss", "train loss", ""),
                    ("Eval loss", "eval/loss", "eval loss", ""),
                    ("Eval accuracy", "eval/accuracy", "eval accuracy", ""),
                    ("Step time", "perf/step_time_s", "step time (s)", " (s)"),
                    ("Throughput per logging window", "perf/examples_per_s", "examples/s", " (examples/s)"),
                )
            ],
        ),
        (
            "Scaling report",
            2,
            1,
            [
                (wr.WeavePanelSummaryTable(table_name="scaling_table"), "scaling_table", "report"),
                (wr.MediaBrowser(media_keys=[f"plots/{p}" for p in REPORT_PLOTS]), "plots/*", "report"),
            ],
        ),
    ]


def _title(panel: Any) -> str:
    names = {"WeavePanelSummaryTable": "Scaling table", "MediaBrowser": "Report figures"}
    return str(getattr(panel, "title", None) or names.get(type(panel).__name__, type(panel).__name__))


def build_workspace_spec(
    entity: str,
    project: str,
    group: str,
    *,
    groupby: str = "parallel.name",
    name: str | None = None,
    config_keys: list[str] | None = None,
    logged: dict[str, int] | None = None,
    plan: list[dict[str, Any]] | None = None,
) -> ws.Workspace:
    """Build (offline) the scaling-comparison ``wandb_workspaces`` Workspace for ``group``.

    Args:
        entity, project: where the workspace is saved.
        group: W&B run group of the sweep (the runset is filtered to it).
        groupby: run *config* key used to group training curves by parallel mode.
        name: workspace name (default ``"Scaling: <group>"``).
        config_keys: group the runset by these config keys (one group per configuration: repeats share
            one line with a min-max band); the curves then follow that grouping instead of ``groupby``.
        logged: summary key -> jobs logging it (``read_multirun``); with it, a panel of a summary or history
            metric no job logs is left out (None: every panel).
        plan: when a list, receives one ``{"section", "title", "metric", "source", "kept", "jobs"}`` per panel
            (``describe`` prints it).

    Returns the ``ws.Workspace``; ``spec_to_dict`` gives its JSON view spec.
    Raises ``ValueError`` for a group name with quotes (the filter expression
    of ``wandb_workspaces`` cannot encode them).
    """
    if "'" in group or '"' in group:
        raise ValueError(f"W&B group names with quotes are not supported here: {group!r}")
    by_config = bool(config_keys)
    curve_group = None if by_config else groupby
    by = "configuration" if by_config else "parallel mode"
    sections = []
    for section, columns, rows, panels in panel_table(by, curve_group):
        kept = []
        for panel, metric, source in panels:
            jobs = None if logged is None or source == "report" else logged.get(metric, 0)
            keep = jobs is None or jobs > 0
            if plan is not None:
                plan.append(
                    {
                        "section": section,
                        "title": _title(panel),
                        "metric": metric,
                        "source": source,
                        "kept": keep,
                        "jobs": jobs,
                    }
                )
            if keep:
                kept.append(panel)
        if kept:
            sections.append(
                ws.Section(
                    name=section,
                    is_open=section != "Scaling report",
                    layout_settings=ws.SectionLayoutSettings(columns=columns, rows=rows),
                    panels=kept,
                )
            )
    pinned = [
        "parallel",
        DEVICES,
        "perf/examples_per_s_median",
        "comm/ratio_model",
        "mem/peak_bytes_per_device",
        "status",
    ]
    return ws.Workspace(
        entity=entity,
        project=project,
        name=name or f"Scaling: {group}",
        sections=sections,
        settings=ws.WorkspaceSettings(x_axis="Step", max_runs=100),
        runset_settings=ws.RunsetSettings(
            filters=ws.And(ws.Metric("Group") == group),
            groupby=[ws.Config(k) for k in config_keys or []],
            pinned_columns=[f"summary:{k}" for k in pinned if logged is None or k in logged or k == "status"],
        ),
    )


def describe(
    workspace: ws.Workspace,
    group: str,
    plan: list[dict[str, Any]],
    jobs: int | None,
    config_keys,
    report_run: bool | None = None,
    cpu: bool = False,
) -> str:
    """The human summary ``--dry-run`` prints: where the workspace goes, its runset, then per section its panels,
    each with its metric and whether the sweep's runs log it, and the panels left out because no run does.
    ``report_run`` False (``read_multirun``): the report panels say their run does not exist yet and how to make
    it; ``cpu``: the timing panels (``TIMING_METRICS``) say their timings come from simulated CPU devices."""
    where = f"{workspace.entity or '<entity>'}/{workspace.project}"
    grouping = f"grouped by configuration ({', '.join(config_keys)})" if config_keys else "grouped by mode"
    lines = [f'W&B workspace "{workspace.name}" in {where}: the runs of group {group!r}, {grouping}']
    sources = {
        "summary": "one point per run",
        "history": "per step",
        "report": "from the scaling_report run (python -m sweeps.report <sweep folder> --wandb)",
    }
    for section in dict.fromkeys(p["section"] for p in plan):
        panels = [p for p in plan if p["section"] == section and p["kept"]]
        if not panels:
            continue
        lines.append(f"{section} ({len(panels)} panel{'s' if len(panels) > 1 else ''}):")
        for p in panels:
            logged = "" if p["jobs"] is None or jobs is None else f"; logged by {p['jobs']} of {jobs} runs"
            if p["jobs"] is None and p["source"] != "report":
                logged = "; not checked (no sweep folder given)"
            if p["source"] == "report" and report_run is False:
                logged = (
                    "; not logged yet: no report run of this sweep was found under its folder, run that command first"
                )
            if cpu and p["metric"] in TIMING_METRICS:
                logged += "; timings of devices simulated on one CPU, not accelerator timings"
            lines.append(f"  {p['title']}: {p['metric']} ({sources[p['source']]}{logged})")
    left = [p for p in plan if not p["kept"]]
    if left:
        lines.append("Left out, no run logs their metric: " + "; ".join(f"{p['title']} ({p['metric']})" for p in left))
    lines.append("--json prints the workspace spec that would be saved; without --dry-run it is saved to W&B")
    return "\n".join(lines)


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
            out.append(
                {
                    "section": section["name"],
                    "type": panel.get("viewType"),
                    "title": config.get("chartTitle"),
                    "x": config.get("xAxis"),
                    "y": y,
                    "groupBy": config.get("groupBy"),
                }
            )
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
    parser.add_argument(
        "folder",
        nargs="?",
        default=None,
        help="multirun folder: group, project, entity and configuration keys from its jobs",
    )
    parser.add_argument("--entity", default=None, help="W&B entity (user or team)")
    parser.add_argument("--project", default=None, help="W&B project")
    parser.add_argument("--group", default=None, help="W&B run group of the sweep")
    parser.add_argument(
        "--groupby",
        default="parallel.name",
        help="run config key that names the parallel mode (default: parallel.name)",
    )
    parser.add_argument("--name", default=None, help="workspace name (default: 'Scaling: <group>')")
    parser.add_argument(
        "--dry-run", action="store_true", help="print what the workspace would hold (sections, panels); contact no one"
    )
    parser.add_argument("--json", action="store_true", help="print the workspace spec as JSON (implies --dry-run)")
    args = parser.parse_args(argv)
    dry = args.dry_run or args.json

    try:
        entity, project, group, config_keys, found = args.entity, args.project, args.group, None, None
        entity = entity or os.environ.get("WANDB_ENTITY")
        if args.folder is not None:
            found = read_multirun(args.folder)
            entity = entity or found["entity"]
            project = project or found["project"]
            group = group or found["group"]
            config_keys = found["config_keys"]
        missing = [flag for flag, value in (("--project", project), ("--group", group)) if not value]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}: give a multirun folder or set them")
        if not entity and not dry:
            said = "its jobs' config has wandb.entity=null" if found is not None else "no multirun folder names one"
            raise ValueError(
                f"missing --entity: {said} and WANDB_ENTITY is not set; give --entity <your W&B user or team> "
                "(or --dry-run to see the workspace without saving it)"
            )
        plan: list[dict[str, Any]] = []
        workspace = build_workspace_spec(
            entity or "",
            project,
            group,
            groupby=args.groupby,
            name=args.name,
            config_keys=config_keys,
            logged=found["logged"] if found is not None else None,
            plan=plan,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(spec_to_dict(workspace), indent=2, sort_keys=True))
        return 0
    if dry:
        print(
            describe(
                workspace,
                group,
                plan,
                found["jobs"] if found is not None else None,
                config_keys,
                report_run=found["report_run"] if found is not None else None,
                cpu=bool(found and found["cpu"]),
            )
        )
        return 0
    if not _have_api_key():
        print(
            "error: no W&B API key (set WANDB_API_KEY or run `wandb login`); use --dry-run to only print the spec",
            file=sys.stderr,
        )
        return 2
    ok, base = _reachable()
    if not ok:
        print(
            f"error: cannot reach W&B at {base} (no network?); use --dry-run to only print the spec",
            file=sys.stderr,
        )
        return 2
    try:
        workspace.save()
        url = workspace.url
    except Exception as exc:  # noqa: BLE001 - one clear line, no traceback
        first = (str(exc).strip().splitlines() or [""])[0]
        print(f"error: saving the workspace failed: {type(exc).__name__}: {first}", file=sys.stderr)
        return 1
    print(url)
    return 0


if __name__ == "__main__":
    from training import process

    process.run_tool(main, imports_jax=False)  # a signal: one line, no traceback
