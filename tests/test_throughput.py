"""Steady-state throughput statistics, job clock and time to target (measure/throughput.py), and their
summary keys in a real run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from utils import REPO

from measure.throughput import (
    JobClock,
    TargetTracker,
    WindowStats,
    check_target_accuracy,
    process_start_epoch_s,
    quantile,
)


@pytest.mark.unit
def test_window_stats_drop_the_first_window_and_take_medians():
    stats = WindowStats(global_batch=100, num_devices=4)
    # window seconds for 10 steps: the first (warm-up) is slow and must not count
    for elapsed in (5.0, 1.0, 2.0, 0.5, 1.0, 4.0):
        stats.add(elapsed, 10)
    stats.add(1.0, 10, drop=True)  # a window the caller drops
    s = stats.summary()
    eps = sorted(1000.0 / e for e in (1.0, 2.0, 0.5, 1.0, 4.0))  # 250, 500, 1000, 1000, 2000
    assert eps == [250.0, 500.0, 1000.0, 1000.0, 2000.0]
    assert s["perf/windows_measured"] == 5 and s["perf/windows_total"] == 7 and s["perf/few_windows"] is False
    assert s["perf/examples_per_s_median"] == s["perf/examples_per_s"] == 1000.0
    assert (s["perf/examples_per_s_p25"], s["perf/examples_per_s_p75"]) == (500.0, 1000.0)
    assert s["perf/examples_per_s_per_device"] == 250.0 and s["perf/step_time_s"] == 0.1
    assert s["perf/examples_per_s_last_window"] == 1000.0
    assert stats.warning() is None
    with_model = stats.summary(time_model_s=0.05, flops_per_step_per_device=2e9, peak_flops_per_s=1e11)
    assert with_model["comm/ratio_model"] == 0.5 and with_model["perf/mfu"] == pytest.approx(0.2)


@pytest.mark.unit
def test_window_stats_warn_below_five_windows_and_fall_back_to_the_warmup_window():
    stats = WindowStats(global_batch=64, num_devices=1)
    stats.add(2.0, 4)
    assert stats.summary()["perf/windows_measured"] == 0
    assert stats.summary()["perf/includes_warmup_window"] is True and stats.summary()["perf/examples_per_s"] == 128
    stats.add(1.0, 4)
    assert stats.summary()["perf/examples_per_s"] == 256.0 and "perf/includes_warmup_window" not in stats.summary()
    assert stats.warning() == (
        "warning: only 1 logging window(s) measured after the first (need 5): throughput "
        "is the median of 1 window; raise train.steps or lower train.log_every"
    )
    with pytest.raises(ValueError, match="steps >= 1"):
        stats.add(1.0, 0)
    assert WindowStats(1, 1).summary() == {}


@pytest.mark.unit
def test_quantile_is_linear_interpolation():
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.25) == 1.75 and quantile([5.0], 0.75) == 5.0
    import numpy as np

    values = [3.0, 9.0, 1.0, 7.0, 4.0, 10.0]
    assert quantile(values, 0.25) == pytest.approx(np.percentile(values, 25))


@pytest.mark.unit
def test_target_tracker_records_the_first_evaluation_at_or_above_target():
    t = TargetTracker(0.9)
    assert not t.observe(100, 0.85, 1.0) and t.observe(200, 0.9, 2.5) and not t.observe(300, 0.95, 4.0)
    assert t.summary() == {"train/target_accuracy": 0.9, "train/steps_to_target": 200, "perf/time_to_target_s": 2.5}
    never = TargetTracker(0.999)
    never.observe(100, 0.98, 1.0)
    assert never.summary()["train/steps_to_target"] is None and never.summary()["perf/time_to_target_s"] is None
    assert TargetTracker(None).summary() == {} and not TargetTracker(None).observe(1, 1.0, 1.0)


@pytest.mark.unit
@pytest.mark.parametrize(
    "value,ok", [(None, True), (0.5, True), (1.0, True), (0.0, False), (1.5, False), (-0.1, False)]
)
def test_target_accuracy_range(value, ok):
    error = check_target_accuracy(value)
    assert (error is None) == ok
    if not ok:
        assert error == f"train.target_accuracy={value} must be in (0, 1] (a fraction of correct answers) or null"


@pytest.mark.unit
def test_job_clock_from_process_start():
    start = process_start_epoch_s()
    assert 0 < time.time() - start < 3600  # this test process started before now
    clock = JobClock(time.time() - 2.0)
    time.sleep(0.01)
    clock.first_step()
    first = clock.summary()["perf/startup_s"]
    clock.first_step()  # later calls keep the first
    s = clock.summary()
    assert s["perf/startup_s"] == first and 2.0 <= first < s["perf/wall_s"] < 10
    assert 0 <= clock.since_first_step_s() < 1


def test_run_summary_has_steady_state_keys_and_time_to_target(tmp_path):
    """A real run (synthetic data, 8 devices): 7 windows of 5 steps, 6 measured; eval every 10 steps."""
    env = {**os.environ, "WANDB_MODE": "disabled"}
    cmd = [
        sys.executable,
        "train.py",
        "data=synthetic",
        "train.steps=35",
        "train.log_every=5",
        "train.eval_every=10",
        "train.target_accuracy=0.01",
        "checkpoint.enabled=false",
        f"hydra.run.dir={tmp_path}",
    ]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["perf/windows_measured"] == 6 and s["perf/windows_total"] == 7
    assert s["perf/examples_per_s"] == s["perf/examples_per_s_median"]
    assert s["perf/examples_per_s_p25"] <= s["perf/examples_per_s_median"] <= s["perf/examples_per_s_p75"]
    assert s["perf/examples_per_s_per_device"] == pytest.approx(s["perf/examples_per_s"] / 8)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    windows = [r["perf/examples_per_s"] for r in records if "perf/examples_per_s" in r and r["step"] > 0]
    assert len(windows) == 7 and s["perf/examples_per_s_median"] == pytest.approx(
        sorted(windows[1:])[2:4][0] / 2 + sorted(windows[1:])[2:4][1] / 2
    )
    assert 0 < s["perf/startup_s"] < s["perf/wall_s"]
    assert s["train/steps_to_target"] == 10 and 0 < s["perf/time_to_target_s"] < s["perf/wall_s"]
    assert "warning: only" not in res.stderr


def test_bad_target_accuracy_is_one_line(tmp_path):
    env = {**os.environ, "WANDB_MODE": "disabled"}
    cmd = [
        sys.executable,
        "train.py",
        "data=synthetic",
        "train.steps=5",
        "train.target_accuracy=1.5",
        f"hydra.run.dir={tmp_path}",
    ]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "error: train.target_accuracy=1.5 must be in (0, 1] (a fraction of correct answers) or null" in res.stderr
