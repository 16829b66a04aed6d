"""The end of a sweep (sweeps/callback.py): "k of n jobs failed" with each failed job's folder and error, exit
status 1, and only the jobs this sweep ran counted; two jobs sharing a checkpoint folder with other settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from utils import REPO


def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def _sweep(tmp_path, *overrides):
    env = {"WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
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
    assert sorted(p.name for p in ckpt.iterdir()) == [".lock", "3"]  # the healthy checkpoint neither moved nor renamed
    assert "corrupt" not in proc.stderr


# ---- a sweep started again in the same hydra.sweep.dir ----------------------------------------------------
def _files(folder):
    """``path -> (modification time, bytes)`` of every file below ``folder``."""
    return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_sweep_started_again_with_other_values_is_refused_before_anything_changes(tmp_path):
    """Seeds 0,1 then 2,3 in the same folder: Hydra used to rewrite multirun.yaml and each job's .hydra/, and every
    job then failed on its checkpoint, leaving failed summaries in finished jobs' folders. Now one line names the
    changed values and no file changes; the same values again resume (the finished jobs are complete)."""
    sweep = tmp_path / "sweep"
    first = _sweep(tmp_path, "train.seed=0,1")
    assert first.returncode == 0, first.stderr[-3000:]
    before = _files(sweep)

    other = _sweep(tmp_path, "train.seed=2,3")
    assert other.returncode == 1
    assert [ln for ln in other.stderr.splitlines() if ln.startswith("error:")] == [
        f"error: hydra.sweep.dir={sweep} holds the jobs of a sweep with other values (train.seed: 0,1 -> 2,3); to "
        "resume that sweep run it with its own values, otherwise give this sweep its own hydra.sweep.dir (nothing in "
        "the folder was changed)"
    ], other.stderr[-3000:]
    assert "Traceback" not in other.stderr
    assert _files(sweep) == before  # multirun.yaml, .hydra/, summaries, checkpoints: all as they were

    same = _sweep(tmp_path, "train.seed=0,1")
    assert same.returncode == 0, same.stderr[-3000:]
    assert same.stderr.count("already complete at step 2") == 2
    assert [summary(sweep / job)["status"] for job in ("0", "1")] == ["ok", "ok"]


@pytest.mark.unit
def test_sweep_changes_name_the_swept_values_and_pass_a_resume(tmp_path):
    import yaml

    from sweeps.callback import sweep_changes

    def job(num, *overrides):
        hydra = tmp_path / str(num) / ".hydra"
        hydra.mkdir(parents=True)
        (hydra / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"job": {"num": num}}}))
        (hydra / "overrides.yaml").write_text(yaml.safe_dump(list(overrides)))

    assert sweep_changes(tmp_path, [["train.seed=0"]]) == []  # an empty folder: a new sweep
    job(0, "parallel=pmap", "train.seed=0", "train.steps=30")
    job(1, "parallel=pmap", "train.seed=1", "train.steps=30")
    same = [["parallel=pmap", f"train.seed={s}", "train.steps=30"] for s in (0, 1)]
    assert sweep_changes(tmp_path, same) == []
    longer = [["parallel=pmap", f"train.seed={s}", "train.steps=60", "wandb=offline"] for s in (0, 1)]
    assert sweep_changes(tmp_path, longer) == []  # more steps, W&B: what a resumed run may change
    assert sweep_changes(tmp_path, same + [["parallel=pmap", "train.seed=2", "train.steps=30"]]) == []  # one more
    assert sweep_changes(tmp_path, [["parallel=fsdp", f"train.seed={s}", "train.steps=30"] for s in (0, 1)]) == [
        "parallel: pmap -> fsdp"
    ]
    lr = [[*job, "optim.lr=0.1"] for job in same]
    assert sweep_changes(tmp_path, lr) == ["optim.lr: (not set) -> 0.1"]  # a setting the jobs' checkpoints refuse
    assert sweep_changes(tmp_path, same[::-1]) == [
        f"the same values in another order: job 0 ({tmp_path / '0'}) ran train.seed=0, would run train.seed=1"
    ]
    assert sweep_changes(tmp_path, same[:1]) == ["train.seed: 0,1 -> 0"]


@pytest.mark.unit
def test_planned_jobs_are_the_basic_sweepers_own():
    """A preset's ``hydra.sweeper.params`` first, then the command line's overrides, in Hydra's product order."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from conf.schema import register
    from sweeps.callback import planned_jobs

    register()
    with initialize_config_dir(config_dir=str(Path(REPO / "conf")), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+sweep=precision", "train.steps=3"], return_hydra_config=True)
    jobs = planned_jobs(cfg)
    assert len(jobs) == 36
    assert jobs[:2] == [
        ["precision=fp32", "parallel=pmap", "train.seed=0", "+sweep=precision", "train.steps=3"],
        ["precision=fp32", "parallel=pmap", "train.seed=1", "+sweep=precision", "train.steps=3"],
    ]


# ---- a sweep folder as a run's folder, a run folder as a sweep's ------------------------------------------------
def _run(run_dir, *overrides):
    cmd = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", "data=synthetic", "train.steps=2", *overrides]
    env = {**os.environ, "WANDB_MODE": "disabled"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_a_sweep_folder_as_a_single_runs_folder_is_refused_and_the_sweep_resumes(tmp_path):
    """hydra.run.dir=<sweep folder> used to add a run beside jobs 0/ and 1/, and sweeps.report then took the sweep
    for one run's folder. Now one line says it is a sweep's folder, nothing changes, and the advised -m resume runs."""
    sweep = tmp_path / "sweep"
    assert _sweep(tmp_path, "train.seed=0,1").returncode == 0
    before = _files(sweep)

    proc = _run(sweep, "wandb.mode=disabled")
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"error: hydra.run.dir={sweep} is a sweep's folder (multirun.yaml, jobs 0, 1); give the run a folder of its "
        f"own, or resume the sweep with -m and hydra.sweep.dir={sweep}"
    ], proc.stderr[-3000:]
    assert _files(sweep) == before
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "1", "multirun.yaml"]

    resumed = _sweep(tmp_path, "train.seed=0,1")  # the advice: -m with hydra.sweep.dir=<sweep> (its own values)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.count("already complete at step 2") == 2


def test_a_run_folder_as_a_sweeps_folder_is_refused_before_anything_is_written(tmp_path):
    """hydra.sweep.dir=<finished run> used to add multirun.yaml and jobs 0/, 1/ inside the run. Now one line says
    it is one run's folder and nothing changes; a folder of its own (the fix) sweeps."""
    run = tmp_path / "sweep"  # the folder _sweep passes as hydra.sweep.dir
    assert _run(run, "wandb.mode=disabled").returncode == 0
    before = _files(run)

    proc = _sweep(tmp_path, "train.seed=0,1")
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"error: hydra.sweep.dir={run} is one run's folder (summary.json, .hydra/); give the sweep a folder of its own"
    ], proc.stderr[-3000:]
    assert _files(run) == before
    assert not (run / "multirun.yaml").exists() and not (run / "0").exists()

    own = _sweep(tmp_path / "own", "train.seed=0,1")
    assert own.returncode == 0, own.stderr[-3000:]
    assert [summary(tmp_path / "own" / "sweep" / job)["status"] for job in ("0", "1")] == ["ok", "ok"]


@pytest.mark.unit
def test_a_resumed_job_that_never_started_replaces_its_placeholder_silently(tmp_path, caplog):
    """A sweep stopped by a signal leaves `status: skipped` in the folders of jobs it never started; resumed, such a
    job's summary replaces that placeholder without a copy or a warning. A real run's summary is still kept (as
    summary.previous-<time>.json) with one warning."""
    import logging

    from sweeps.callback import NOT_STARTED
    from training.report import write_json, write_summary

    job = tmp_path / "3"
    job.mkdir()
    write_json(job / "summary.json", {"status": "skipped", "error": NOT_STARTED + "SIGTERM"})
    with caplog.at_level(logging.WARNING):
        write_summary(job, {"status": "ok", "train/steps": 60})
    assert summary(job) == {"status": "ok", "train/steps": 60}
    assert sorted(p.name for p in job.iterdir()) == ["summary.json"] and not caplog.records
    write_summary(job, {"status": "ok", "train/steps": 80})  # a rerun over a finished run's summary
    (kept,) = [p for p in job.iterdir() if p.name.startswith("summary.previous-")]
    assert json.loads(kept.read_text()) == {"status": "ok", "train/steps": 60}
    assert [r.getMessage() for r in caplog.records] == [f"{job / 'summary.json'} already existed: kept as {kept.name}"]
