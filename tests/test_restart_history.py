"""W&B history across restarts (training/report.py, module docstring): a run that continues a checkpoint is a new
W&B run that first replays the kept metrics.jsonl history, so its history holds every step once with the values
of the surviving timeline; and ``hardware/profile`` names the hardware profile in summary.json and W&B.

In-process, on 2 of the session's simulated CPU devices, W&B offline inside the test's temp folder; the
restart sequence (killed, finished, rerun, killed before its summary) runs train.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
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

    def dies_in_the_step_30_save(self, state, done, wandb_run_id, reason, **kwargs):
        if done == 30:
            raise Killed()
        return original(self, state, done, wandb_run_id, reason, **kwargs)

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


# ---- killed before the first checkpoint, finished, rerun, killed before the summary -----------------------
def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def test_killed_before_first_checkpoint_then_finished_then_rerun(tmp_path):
    import signal
    import time

    from test_checkpoint import finish, last_logged_step, start_train
    from wandb_reader import assert_history_matches_metrics, offline_runs, read_run

    run, ckpt = tmp_path / "run", tmp_path / "ck"
    extra = ["train.steps=60", "checkpoint.every=50", "wandb=offline"]
    proc = start_train(run, ckpt, *extra)
    deadline = time.monotonic() + 600
    while last_logged_step(run) < 5:
        assert proc.poll() is None and time.monotonic() < deadline, Path(f"{run}.err").read_text()[-2000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert finish(proc) == -signal.SIGKILL
    from training.checkpoint import complete_steps

    assert complete_steps(ckpt) == []  # killed before the first checkpoint (step 50)
    assert finish(start_train(run, ckpt, *extra)) == 0, Path(f"{run}.err").read_text()[-2000:]
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == list(range(1, 61))
    assert len(list(run.glob("metrics.previous-*.jsonl"))) == 1
    first = summary(run)
    # W&B: the restart is its own run (the killed one stays apart), holding steps 0..60 once, as metrics.jsonl
    runs = offline_runs(run)
    assert len(runs) == 2 and Path(first["wandb/run_dir"]).name == Path(runs[1]).name
    assert assert_history_matches_metrics(runs[1], run / "metrics.jsonl") == list(range(61))
    assert "resumed" not in read_run(runs[1])["config"] and "wandb/previous_run_id" not in first

    # rerun of the finished run: says so, keeps its summary, no nan, no W&B run
    err_before = len(Path(f"{run}.err").read_text())
    assert finish(start_train(run, ckpt, *extra)) == 0
    err = Path(f"{run}.err").read_text()[err_before:]
    assert f"already complete at step 60: eval/accuracy={first['eval/accuracy']}" in err
    assert "nan" not in err and summary(run) == first
    assert offline_runs(run) == runs

    # killed after the final checkpoint, before its summary: the restart writes a complete one
    (run / "summary.json").unlink()
    assert finish(start_train(run, ckpt, *extra)) == 0
    s = summary(run)
    last_train = [r for r in records if "train/loss" in r][-1]
    for key in ("train/loss", "train/accuracy", "optim/lr", "sync/max_replica_divergence"):
        assert s[key] == last_train[key], key
    # throughput: the run's own windows (metrics.jsonl), as its first summary had them: median, not last window
    assert s["perf/examples_per_s_last_window"] == pytest.approx(last_train["perf/examples_per_s"], rel=1e-9)
    for key in ("perf/examples_per_s", "perf/examples_per_s_p25", "perf/examples_per_s_p75"):
        assert s[key] == pytest.approx(first[key], rel=1e-9), key
    assert s["perf/windows_measured"] == first["perf/windows_measured"]
    assert s["eval/accuracy"] == first["eval/accuracy"]
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == list(range(1, 61))
    assert sum("eval/loss" in r for r in records) == 1
    # W&B: a third run replays the kept history 0..60, adds the final evaluation, and has the full summary
    runs = offline_runs(run)
    assert len(runs) == 3 and Path(s["wandb/run_dir"]).name == Path(runs[2]).name
    assert assert_history_matches_metrics(runs[2], run / "metrics.jsonl") == list(range(61))
    wb = read_run(runs[2])
    assert wb["config"]["resumed"] == {"previous_wandb_run_id": first["wandb/run_id"], "step": 60}
    assert s["wandb/previous_run_id"] == first["wandb/run_id"] != s["wandb/run_id"]
    for key in (
        "train/loss",
        "train/accuracy",
        "optim/lr",
        "perf/examples_per_s",
        "sync/max_replica_divergence",
        "eval/loss",
        "eval/accuracy",
    ):
        assert wb["summary"][key] == s[key], key
