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


def test_cli_dry_run_prints_json_spec(tmp_path):
    res = _cli(
        "--entity",
        "e",
        "--project",
        "p",
        "--group",
        "g-1",
        "--dry-run",
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


def _fake_multirun(root: Path) -> Path:
    """4 jobs: 2 modes x 2 seeds, each with summary.json (W&B group) and .hydra/config.yaml."""
    job = 0
    for mode in ("fsdp", "jit_sharding"):
        for seed in (0, 1):
            d = root / str(job)
            (d / ".hydra").mkdir(parents=True)
            (d / "summary.json").write_text(json.dumps({"status": "ok", "wandb/group": "sweep-x", "parallel": mode}))
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
    assert found == {
        "group": "sweep-x",
        "project": "proj-a",
        "entity": None,
        "config_keys": ["parallel.name"],
        "jobs": 4,
    }
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no job under"):
        read_multirun(tmp_path / "empty")


def test_cli_multirun_folder_dry_run_groups_runset_by_configuration(tmp_path):
    root = _fake_multirun(tmp_path / "mr")
    res = _cli(str(root), "--dry-run", env={"HOME": str(tmp_path), "WANDB_CONFIG_DIR": str(tmp_path)})
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
