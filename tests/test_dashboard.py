"""Offline tests of the W&B workspace spec built by sweeps.dashboard."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import wandb_workspaces.reports.v2 as wr
import wandb_workspaces.workspaces as ws

from sweeps.dashboard import build_workspace_spec, panels_of, spec_to_dict

REPO = Path(__file__).resolve().parents[1]


def _cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + ([full_env["PYTHONPATH"]] if full_env.get("PYTHONPATH") else [])
    )
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "sweeps.dashboard", *args],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _find(panels, y):
    hits = [p for p in panels if p["y"] == y]
    assert len(hits) == 1, (y, panels)
    return hits[0]


@pytest.mark.unit
def test_workspace_spec_panels_and_group_filter():
    workspace = build_workspace_spec("my-entity", "my-project", "sweep-42")
    assert isinstance(workspace, ws.Workspace)
    assert (workspace.entity, workspace.project) == ("my-entity", "my-project")
    assert "sweep-42" in workspace.name

    spec = spec_to_dict(workspace)
    json.dumps(spec)  # serialisable
    panels = panels_of(spec)

    # summary-metric scatter plots against the device count
    for y in (
        "perf/examples_per_s",
        "perf/examples_per_s_per_device",
        "comm/ratio_model",
        "comm/bytes_per_step",
        "mem/state_bytes_per_device",
        "mem/temp_bytes_per_device",
        "mem/peak_bytes_per_device",
    ):
        panel = _find(panels, f"summary:{y}")
        assert panel["type"] == "Scatter Plot"
        assert panel["x"] == "summary:mesh/devices"
    assert _find(panels, "summary:perf/examples_per_s")["section"] == "Scaling"
    assert _find(panels, "summary:comm/ratio_model")["section"] == "Communication"
    assert _find(panels, "summary:mem/state_bytes_per_device")["section"] == "Memory per device"

    # scaling efficiency from the scaling_report run's history
    eff = _find(panels, "regex:^scaling/efficiency/.*")
    assert eff["type"] == "Run History Line Plot" and eff["x"] == "scaling/devices"

    # loss curves grouped by the parallel mode (nested config key `parallel.name`)
    loss = _find(panels, ["train/loss"])
    assert loss["type"] == "Run History Line Plot"
    assert loss["x"] == "_step" and loss["groupBy"] == "parallel.value.name"
    assert _find(panels, ["eval/loss"])["groupBy"] == "parallel.value.name"

    # report run's table and images
    types = {p["type"] for p in panels if p["section"] == "Scaling report"}
    assert types == {"Weave", "Media Browser"}
    assert "scaling_table" in json.dumps(spec)

    # runset filtered to the group
    (runset,) = spec["spec"]["section"]["runSets"]
    assert runset["filters"]["filters"] == [
        {"key": {"section": "run", "name": "group"}, "op": "=", "value": "sweep-42", "disabled": False}
    ]
    assert workspace.runset_settings.filters == "Metric(\"Group\") == 'sweep-42'"


@pytest.mark.unit
def test_group_with_quote_is_rejected():
    with pytest.raises(ValueError, match="quotes"):
        build_workspace_spec("e", "p", "it's")


@pytest.mark.unit
def test_workspace_objects_use_expected_metric_keys():
    workspace = build_workspace_spec("e", "p", "g", groupby="parallel.name")
    panels = [p for s in workspace.sections for p in s.panels]
    scatters = [p for p in panels if isinstance(p, wr.ScatterPlot)]
    assert scatters and all(p.x == wr.SummaryMetric("mesh/devices") for p in scatters)
    assert wr.SummaryMetric("perf/examples_per_s") in [p.y for p in scatters]
    loss = [p for p in panels if isinstance(p, wr.LinePlot) and p.y == ["train/loss"]]
    assert len(loss) == 1 and loss[0].groupby == wr.Config("parallel.name")
    assert panels_of(spec_to_dict(workspace))[0]["x"] == "summary:mesh/devices"


def test_cli_json_prints_the_spec(tmp_path):
    res = _cli(
        "--entity",
        "e",
        "--project",
        "p",
        "--group",
        "g-1",
        "--json",
        env={"HOME": str(tmp_path), "WANDB_CONFIG_DIR": str(tmp_path)},
    )
    assert res.returncode == 0, res.stderr
    spec = json.loads(res.stdout)
    assert spec["entity"] == "e" and spec["project"] == "p"
    assert any(p["y"] == "summary:perf/examples_per_s" for p in panels_of(spec))
    assert "g-1" in json.dumps(spec["spec"]["section"]["runSets"])


def test_cli_without_api_key_fails_with_one_line(tmp_path):
    res = _cli(
        "--entity",
        "e",
        "--project",
        "p",
        "--group",
        "g",
        env={"HOME": str(tmp_path), "NETRC": str(tmp_path / "netrc"), "WANDB_CONFIG_DIR": str(tmp_path)},
    )
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert "API key" in lines[0]


# what a CPU job's summary.json holds of the dashboard's metrics: no peak memory (a CPU has no such statistic), a
# measured comm ratio that is not valid (simulated devices), no comm/ratio_model (no profile of the device)
CPU_SUMMARY = {
    "status": "ok",
    "platform": "cpu",
    "wandb/group": "sweep-x",
    "mesh/devices": 2,
    "perf/examples_per_s": 1000.0,
    "perf/examples_per_s_per_device": 500.0,
    "perf/step_time_s": 0.1,
    "comm/bytes_per_step": 8.0,
    "comm/ratio_measured": 0.2,
    "comm/ratio_measured_valid": False,
    "mem/state_bytes_per_device": 16,
    "mem/temp_bytes_per_device": 32,
    "train/loss": 0.5,
    "eval/loss": 0.6,
    "eval/accuracy": 0.9,
}


def _fake_multirun(root: Path) -> Path:
    """4 jobs: 2 modes x 2 seeds, each with summary.json (W&B group) and .hydra/config.yaml."""
    job = 0
    for mode in ("fsdp", "jit_sharding"):
        for seed in (0, 1):
            d = root / str(job)
            (d / ".hydra").mkdir(parents=True)
            (d / "summary.json").write_text(json.dumps({**CPU_SUMMARY, "parallel": mode}))
            (d / ".hydra" / "config.yaml").write_text(
                f"parallel:\n  name: {mode}\n  min_shard_bytes: 0\ntrain:\n  seed: {seed}\n  steps: 80\n"
                f"mesh:\n  shape: [1, -1]\nwandb:\n  project: proj-a\n  entity: null\n  tags: [t{seed}]\n"
            )
            job += 1
    return root


@pytest.mark.unit
def test_read_multirun_groups_by_configuration_not_seed(tmp_path):
    from sweeps.dashboard import read_multirun

    found = read_multirun(_fake_multirun(tmp_path / "mr"))
    logged = found.pop("logged")
    assert found == {
        "group": "sweep-x",
        "project": "proj-a",
        "entity": None,
        "config_keys": ["parallel.name"],
        "jobs": 4,
        "report_run": False,
        "cpu": True,
    }
    assert logged == {k: 4 for k in CPU_SUMMARY if k != "comm/ratio_measured"} | {"parallel": 4}  # never valid
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no job under"):
        read_multirun(tmp_path / "empty")


def test_cli_multirun_folder_dry_run_groups_runset_by_configuration(tmp_path):
    root = _fake_multirun(tmp_path / "mr")
    res = _cli(str(root), "--dry-run", "--json", env={"HOME": str(tmp_path), "WANDB_CONFIG_DIR": str(tmp_path)})
    assert res.returncode == 0, res.stderr
    spec = json.loads(res.stdout)
    assert spec["project"] == "proj-a"
    (runset,) = spec["spec"]["section"]["runSets"]
    assert runset["grouping"] == [{"section": "config", "name": "parallel.value.name"}]
    assert "sweep-x" in json.dumps(runset["filters"])
    curves = [p for p in panels_of(spec) if p["type"] == "Run History Line Plot" and p["x"] == "_step"]
    assert len(curves) == 5 and all(p["groupBy"] is None for p in curves)
    assert all(p["section"] == "Training curves by configuration" for p in curves)


def test_cli_without_folder_or_group_is_one_line(tmp_path):
    res = _cli("--dry-run", env={"HOME": str(tmp_path), "WANDB_CONFIG_DIR": str(tmp_path)})
    assert (
        res.returncode == 2
        and res.stderr.strip() == "error: missing --project, --group: give a multirun folder or set them"
    )


@pytest.mark.unit
def test_dry_run_is_a_human_summary_without_panels_the_runs_never_log(tmp_path, capsys):
    """--dry-run prints sections and panels, each panel's metric and how many runs log it (tens of lines, not 768 of
    JSON); a panel whose metric no run logs is left out of the workspace and listed: peak memory on a CPU, the
    measured ratio where it is never valid, the model ratio without a profile of the device that ran."""
    from sweeps.dashboard import main

    root = _fake_multirun(tmp_path / "mr")
    assert main([str(root), "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) < 30
    assert out[0] == (
        "W&B workspace \"Scaling: sweep-x\" in <entity>/proj-a: the runs of group 'sweep-x', grouped by configuration "
        "(parallel.name)"
    )
    assert "Scaling (4 panels):" in out and "Communication (1 panel):" in out and "Memory per device (2 panels):" in out
    cpu = "; timings of devices simulated on one CPU, not accelerator timings"
    assert (
        f"  Throughput vs devices (examples/s): perf/examples_per_s (one point per run; logged by 4 of 4 runs{cpu})"
        in out
    )
    # the report's run is not logged yet: the panel says so and which command makes it
    assert (
        "  Scaling efficiency = speedup / N (scaling_report run): scaling/efficiency/* (from the scaling_report run "
        "(python -m sweeps.report <sweep folder> --wandb); not logged yet: no report run of this sweep was found "
        f"under its folder, run that command first{cpu})"
    ) in out
    assert "  Scaling table: scaling_table (from the scaling_report run (python -m sweeps.report <sweep folder> " in (
        "\n".join(out)
    )
    assert "  Train loss by configuration: train/loss (per step; logged by 4 of 4 runs)" in out
    assert out[-2] == (
        "Left out, no run logs their metric: Comm ratio (model) vs devices (comm/ratio_model); Comm ratio (measured; "
        "check comm/ratio_measured_valid) (comm/ratio_measured); Peak bytes per device (mem/peak_bytes_per_device)"
    )
    assert not any("timings" in line for line in out if "mem/" in line or "comm/" in line or "train/loss" in line)
    (root / "wandb_report_run.json").write_text("{}")  # what sweeps.report --wandb leaves once its run is logged
    assert main([str(root), "--dry-run"]) == 0
    assert "not logged yet" not in capsys.readouterr().out
    assert main([str(root), "--json"]) == 0
    spec = json.loads(capsys.readouterr().out)
    ys = {p["y"] for p in panels_of(spec) if isinstance(p["y"], str)}
    assert "summary:mem/state_bytes_per_device" in ys and "summary:comm/bytes_per_step" in ys
    assert not {"summary:mem/peak_bytes_per_device", "summary:comm/ratio_measured", "summary:comm/ratio_model"} & ys
    pinned = spec["spec"]["section"]["runSets"][0]["runFeed"]["columnPinned"]
    assert "summary:perf/examples_per_s_median" not in pinned and "summary:status" in pinned
    assert not any("peak_bytes" in k or "ratio_model" in k for k in pinned), pinned
    # an older CPU run's summary with an H100 link model over its step time: no ratio panel either
    for summary in root.glob("*/summary.json"):
        summary.write_text(json.dumps({**json.loads(summary.read_text()), "comm/ratio_model": 1e-4, "platform": "cpu"}))
    assert main([str(root), "--json"]) == 0
    assert "summary:comm/ratio_model" not in capsys.readouterr().out


@pytest.mark.unit
def test_a_folder_without_an_entity_says_what_is_missing(tmp_path, capsys, monkeypatch):
    """Given a sweep folder whose jobs set no wandb.entity, the error names the entity, not the folder it was given."""
    from sweeps.dashboard import main

    monkeypatch.delenv("WANDB_ENTITY", raising=False)
    root = _fake_multirun(tmp_path / "mr")
    assert main([str(root)]) == 2
    assert capsys.readouterr().err == (
        "error: missing --entity: its jobs' config has wandb.entity=null and WANDB_ENTITY is not set; give --entity "
        "<your W&B user or team> (or --dry-run to see the workspace without saving it)\n"
    )
