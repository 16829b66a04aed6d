"""W&B history across restarts (training/report.py, module docstring): a run that continues a checkpoint is a new
W&B run that first replays the kept metrics.jsonl history, so its history holds every step once with the values
of the surviving timeline; and ``hardware/profile`` names the hardware profile in summary.json and W&B.

In-process, on 2 of the session's simulated CPU devices, W&B offline inside the test's temp folder."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from training import checkpoint
from training.run import run_and_report
from utils import make_cfg
from wandb_reader import assert_history_matches_metrics, history_by_step, offline_runs, read_run


class Killed(BaseException):
    """Stands for SIGKILL in the middle of a checkpoint save (nothing of that save is written)."""


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def test_killed_during_a_save_then_restarted_keeps_one_wandb_history(tmp_path, wandb_env, monkeypatch):
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    run_dir.mkdir()
    cfg = make_cfg(
        {
            "data": {"name": "synthetic", "eval_size": 1000},
            "mesh": {"devices": 2},
            "wandb": {"mode": "offline", "group": "g1"},
            "checkpoint": {"dir": str(ckpt), "every": 10},
            "train": {"steps": 40, "log_every": 5, "eval_batch": 1000, "eval_every": 15},
        }
    )
    original = checkpoint.RunCheckpoints.save

    def dies_in_the_step_30_save(self, state, done, wandb_run_id, reason):
        if done == 30:
            raise Killed()
        return original(self, state, done, wandb_run_id, reason)

    monkeypatch.setattr(checkpoint.RunCheckpoints, "save", dies_in_the_step_30_save)
    with pytest.raises(Killed):
        run_and_report(cfg, run_dir)
    monkeypatch.setattr(checkpoint.RunCheckpoints, "save", original)
    assert checkpoint.complete_steps(ckpt) == [10, 20]
    (crashed_dir,) = offline_runs(run_dir)
    crashed = dict(history_by_step(crashed_dir))
    assert sorted(crashed) == list(range(31))  # the crashed start logged steps 0..30 (step 30 before its save)
    crashed_id = read_run(crashed_dir)["run"].run_id
    assert json.loads((ckpt / "20" / "meta" / "metadata").read_text())["wandb_run_id"] == crashed_id

    assert run_and_report(cfg, run_dir)
    s = _summary(run_dir)
    assert s["checkpoint/resumed_step"] == 20
    runs = offline_runs(run_dir)
    assert len(runs) == 2 and runs[0] == crashed_dir
    assert os.path.realpath(s["wandb/run_dir"]) == os.path.realpath(runs[1])
    # every step 0..40 once, with metrics.jsonl's values
    assert assert_history_matches_metrics(runs[1], run_dir / "metrics.jsonl") == list(range(41))
    final = dict(history_by_step(runs[1]))
    assert final[20] == crashed[20] and final[15]["eval/accuracy"] == crashed[15]["eval/accuracy"]  # replayed
    # steps 21..30 hold the surviving timeline: the same losses (exact resume), this start's own timings
    assert final[30]["train/loss"] == crashed[30]["train/loss"]
    assert final[30]["perf/step_time_s"] != crashed[30]["perf/step_time_s"]
    assert "eval/loss" in final[40] and "train/loss" in final[40]  # the final train record and evaluation, one row
    # the link to the crashed start, and a complete summary
    wb = read_run(runs[1])
    assert wb["run"].run_id == s["wandb/run_id"] != crashed_id and s["wandb/previous_run_id"] == crashed_id
    assert wb["config"]["resumed"] == {"previous_wandb_run_id": crashed_id, "step": 20}
    assert wb["run"].run_group == "g1" and "resumed" in wb["run"].tags
    for key in (
        "train/loss",
        "train/accuracy",
        "optim/lr",
        "perf/examples_per_s",
        "perf/step_time_s_median",
        "sync/max_replica_divergence",
        "eval/loss",
        "eval/accuracy",
        "checkpoint/resumed_step",
    ):
        assert key in s, key
    assert {k: wb["summary"].get(k) for k in s} == s  # every summary.json value, also those of the last row's keys
    # hardware profile: hardware=auto on CPU matches conf/hardware/cpu.yaml (no numbers, so no comm/ratio_model)
    assert s["hardware/profile"] == "cpu" and "comm/ratio_model" not in s
    assert wb["summary"]["hardware/profile"] == "cpu" and wb["config"]["resolved"]["hardware/profile"] == "cpu"


@pytest.mark.unit
@pytest.mark.parametrize(
    "hardware,kind,want",
    [
        ({"name": "auto", "detect": True}, "cpu", "cpu"),
        ({"name": "auto", "detect": True}, "NVIDIA H100 80GB HBM3", "h100_sxm"),
        ({"name": "auto", "detect": True}, "Some New Accelerator", None),
        ({"name": "h200_sxm", "detect": False}, "cpu", "h200_sxm"),
        ({"name": "custom", "detect": False}, "NVIDIA H100 80GB HBM3", "custom"),
        ({"name": "none", "detect": False}, "NVIDIA H100 80GB HBM3", None),
        ({"name": "auto", "detect": False}, "NVIDIA H100 80GB HBM3", None),
    ],
)
def test_hardware_profile_names_the_profile_in_use(hardware, kind, want):
    from measure.compiled import hardware_profile

    assert hardware_profile(SimpleNamespace(**hardware), kind) == want
