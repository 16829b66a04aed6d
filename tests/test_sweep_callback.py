"""The end of a sweep (sweeps/callback.py): "k of n jobs failed" with each failed job's folder and error, exit
status 1, and only the jobs this sweep ran counted; two jobs sharing a checkpoint folder with other settings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from utils import REPO


def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def _sweep(tmp_path, *overrides):
    env = {"WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    import os

    cmd = [
        sys.executable,
        "train.py",
        "-m",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "data=synthetic",
        "train.steps=2",
        "wandb.mode=disabled",
        *overrides,
    ]
    return subprocess.run(cmd, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("launcher", [[], ["hydra/launcher=submitit_local"]])
def test_sweep_with_a_failed_job_exits_nonzero(tmp_path, launcher):
    proc = _sweep(tmp_path, "train.global_batch=250,256", *launcher)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    i = lines.index("1 of 2 jobs failed")
    assert lines[i + 1] == (
        f"  {tmp_path / 'sweep' / '0'}: train.global_batch=250 is not divisible by "
        f"mesh.devices=8; choose a global batch that is a multiple of 8 (e.g. 248)"
    )
    assert summary(tmp_path / "sweep" / "1")["status"] == "ok"


@pytest.mark.unit
def test_job_outcomes_counts_a_job_without_summary(tmp_path):
    from sweeps.callback import failure_report, job_outcomes

    for name, s in (("0", {"status": "ok"}), ("1", {"status": "failed", "error": "boom"}), ("2", None)):
        (tmp_path / name / ".hydra").mkdir(parents=True)
        if s is not None:
            (tmp_path / name / "summary.json").write_text(json.dumps(s))
    lines = failure_report(job_outcomes(tmp_path))
    assert lines[0] == "2 of 3 jobs failed"
    assert lines[1] == f"  {tmp_path / '1'}: boom"
    assert lines[2].startswith(f"  {tmp_path / '2'}: no summary.json")
    assert failure_report(job_outcomes(tmp_path)[:1]) == []


@pytest.mark.unit
def test_job_outcomes_of_a_resumed_sweep_count_the_jobs_it_ran_again(tmp_path):
    """A resumed sweep reruns its jobs in their folders: Hydra rewrites ``.hydra/*`` in place, so the folder's own
    time stays that of the first start; a job is this sweep's when its ``.hydra`` files are new."""
    import os
    import time

    from sweeps.callback import failure_report, job_outcomes

    long_ago = time.time() - 3600
    for name, status in (("0", "ok"), ("1", "failed"), ("old", "failed")):
        hydra = tmp_path / name / ".hydra"
        hydra.mkdir(parents=True)
        (hydra / "config.yaml").write_text("a: 1\n")
        (tmp_path / name / "summary.json").write_text(json.dumps({"status": status, "error": "loss exploded"}))
        os.utime(hydra, (long_ago, long_ago))  # created by the first start
    old_config = tmp_path / "old" / ".hydra" / "config.yaml"
    os.utime(old_config, (long_ago, long_ago))  # a job of an earlier sweep this one did not run
    outcomes = job_outcomes(tmp_path, since_s=time.time() - 60)
    assert [job.name for job, _ in outcomes] == ["0", "1"]
    assert failure_report(outcomes)[0] == "1 of 2 jobs failed"


def test_sweep_sharing_a_checkpoint_dir_refuses_the_second_seed(tmp_path):
    ckpt = tmp_path / "ck"
    proc = _sweep(tmp_path, "train.steps=3", f"checkpoint.dir={ckpt}", "train.seed=0,1")
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = (
        f"checkpoint {ckpt / '3'} was trained with other settings (train.seed: 0 -> 1); to resume it set them "
        f"back, otherwise give this run its own checkpoint.dir (the checkpoint is kept as it is)"
    )
    assert f"error: {line}" in proc.stderr.splitlines()
    assert "1 of 2 jobs failed" in proc.stderr.splitlines()
    assert sorted(p.name for p in ckpt.iterdir()) == ["3"]  # the healthy checkpoint is neither moved nor renamed
    assert "corrupt" not in proc.stderr
