"""Sweeps (issue 6): weak-scaling batch derivation, a real Hydra multirun (default launcher) with one failing
job, offline W&B runs per job in one group, the scaling report on it, the sweep presets and the
one-job-at-a-time submitit_local launcher."""

from __future__ import annotations

import csv
import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parallel import ConfigError
from training.build import plan
from utils import REPO, make_cfg
from wandb_reader import read_run


def multirun(sweep_dir: Path, *overrides: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """``python train.py -m <overrides>`` into ``sweep_dir`` with offline W&B (W&B's own folders in tmp)."""
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1"}
    env.pop("WANDB_API_KEY", None)
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        env[var] = str(sweep_dir.parent / ".wandb_aux")
    cmd = [sys.executable, "train.py", "-m", f"hydra.sweep.dir={sweep_dir}", *overrides]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def job_dirs(sweep_dir: Path) -> list[Path]:
    return sorted((p for p in sweep_dir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))


def overrides_of(job: Path) -> dict[str, str]:
    lines = (job / ".hydra" / "overrides.yaml").read_text().splitlines()
    return dict(line.lstrip("- ").split("=", 1) for line in lines if "=" in line)


# ---- strong / weak scaling -------------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_weak_scaling_derives_global_batch(devices):
    p = plan(make_cfg(mesh__devices=devices, train__per_device_batch=32))
    assert (p.global_batch, p.per_device_batch, p.scaling) == (32 * devices, 32, "weak")
    p = plan(make_cfg(mesh__devices=devices))  # global_batch null -> 256, strong
    assert (p.global_batch, p.per_device_batch, p.scaling) == (256, 256 // devices, "strong")


@pytest.mark.unit
def test_schema_global_batch_default_is_null():
    assert make_cfg().train.global_batch is None and make_cfg().train.per_device_batch is None


@pytest.mark.unit
def test_setting_both_batches_is_one_clear_error():
    with pytest.raises(
        ConfigError,
        match=r"^train.global_batch=256 and train.per_device_batch=32 are both set; "
        r"set one \(global_batch: strong scaling, per_device_batch: weak",
    ):
        plan(make_cfg(train__global_batch=256, train__per_device_batch=32))


# ---- presets ---------------------------------------------------------------------------------------------

PRESETS = {
    "scaling_devices": {
        "mesh.devices": "1,2,4,8",
        "parallel": "pmap,jit_sharding,shard_map,fsdp",
        "train.per_device_batch": "null,32",
        "train.seed": "0,1,2",
    },
    "precision": {"precision": "fp32,bf16,fp16", "parallel": "pmap,jit_sharding,shard_map,fsdp", "train.seed": "0,1,2"},
    "accumulation": {
        "train.accum_steps": "1,2,4,8",
        "parallel": "pmap,jit_sharding,shard_map,fsdp",
        "train.seed": "0,1,2",
    },
}


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_sweep_presets_compose(name):
    """``+sweep=<name>`` sets hydra.sweeper.params (3 seeds: repeats), enough steps for 6 measured logging
    windows (70 steps, windows of 10, the first excluded) and its own sweep folder."""
    from hydra import compose, initialize_config_dir

    from conf.schema import register

    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"+sweep={name}"], return_hydra_config=True)
    assert dict(cfg.hydra.sweeper.params) == PRESETS[name]
    assert cfg.train.steps == 70 and cfg.train.log_every == 10
    assert cfg.hydra.sweep.dir.startswith(f"multirun/{name}/")


@pytest.mark.unit
def test_large_batch_preset_composes_epoch_based_lengths():
    """+sweep=large_batch: batch x lr scaling x warmup x optimizer x seeds; eval every epoch, warmup in epochs."""
    from hydra import compose, initialize_config_dir

    from conf.schema import register

    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["+sweep=large_batch"], return_hydra_config=True)
        assert dict(cfg.hydra.sweeper.params) == {
            "optim": "sgd_momentum,adam",
            "train.global_batch": "256,512,1024,2048,4096,8192",
            "optim.lr_scaling": "none,linear",
            "+warmup": "none,epochs2",
            "train.seed": "0,1,2",
        }
        job = compose(
            "config",
            overrides=["+sweep=large_batch", "optim=sgd_momentum", "train.global_batch=8192", "+warmup=epochs2"],
        )
    assert (job.train.eval_every, job.train.log_every, job.optim.warmup_steps) == (7, 3, 14)  # 60000 // 8192 = 7
    assert (job.optim.name, job.optim.momentum, job.mesh.devices, job.train.target_accuracy) == ("sgd", 0.9, 1, 0.97)


# ---- a real multirun -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_multirun_default_launcher_wandb_groups_and_report(tmp_path):
    """4 real jobs (devices 1,2 x jit_sharding,fsdp, weak scaling 16/device) + 2 jobs asking for 16 devices
    that fail; the sweep goes on; each job records its own devices; one offline W&B run per successful job,
    all in the sweep's group, each with its own history; the report has 6 rows and marks the failures."""
    sweep = tmp_path / "sweep"
    steps = 4
    res = multirun(
        sweep,
        "mesh.devices=1,2,16",
        "parallel=jit_sharding,fsdp",
        "data=synthetic",
        "data.eval_size=256",
        "train.per_device_batch=16",
        f"train.steps={steps}",
        "train.log_every=2",
        "wandb.mode=offline",
        "checkpoint.enabled=false",
    )
    assert res.returncode == 1, res.stderr[-3000:]  # the sweep goes on, then reports its failed jobs
    assert "2 of 6 jobs failed" in res.stderr.splitlines()
    jobs = job_dirs(sweep)
    assert len(jobs) == 6
    groups, run_ids = set(), set()
    for job in jobs:
        o = overrides_of(job)
        s = json.loads((job / "summary.json").read_text())
        assert s["parallel"] == o["parallel"]
        wandb_runs = glob.glob(str(job / "wandb" / "offline-run-*"))
        if o["mesh.devices"] == "16":
            assert s["status"] == "failed"
            assert s["error"].startswith("mesh.devices=16 but only 8 cpu devices are visible")
            assert wandb_runs == [] and not (job / "metrics.jsonl").exists()
            continue
        devices = int(o["mesh.devices"])
        assert s["status"] == "ok" and s["mesh/devices"] == devices
        assert s["train/global_batch"] == 16 * devices and s["train/scaling"] == "weak"
        (run_dir,) = wandb_runs
        run = read_run(run_dir)
        assert run["run"].run_id == s["wandb/run_id"]
        run_ids.add(run["run"].run_id)
        groups.add(run["run"].run_group)
        assert run["config"]["parallel"]["name"] == o["parallel"]  # nested: the dashboard groups by parallel.name
        assert run["config"]["mesh"]["devices"] == devices
        losses = [(h["_step"], h["train/loss"]) for h in run["history"] if "train/loss" in h]
        assert [step for step, _ in losses] == list(range(1, steps + 1))
        jsonl = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
        assert [(r["step"], r["train/loss"]) for r in jsonl if "train/loss" in r] == pytest.approx(losses)
        assert all(h.get("mesh/devices", devices) == devices for h in run["history"])
    assert len(run_ids) == 4
    (group,) = groups
    assert group == "sweep-" + sweep.as_posix().strip("/").replace("/", "_")

    rep = subprocess.run(
        [sys.executable, "-m", "sweeps.report", str(sweep)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert rep.returncode == 0, rep.stderr[-3000:]
    with open(sweep / "scaling.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6  # one configuration per job (no repeats here)
    failed = [r for r in rows if r["status"].startswith("failed")]
    assert len(failed) == 2 and all("mesh.devices=16" in r["status"] for r in failed)
    assert sorted((r["parallel"], r["devices"]) for r in rows if r["status"] == "ok") == [
        ("fsdp", "1"),
        ("fsdp", "2"),
        ("jit_sharding", "1"),
        ("jit_sharding", "2"),
    ]
    for png in ("throughput", "speedup", "efficiency", "comm", "memory"):
        assert (sweep / f"{png}.png").stat().st_size > 10_000
    assert not (sweep / "time_to_target.png").exists()  # no train.target_accuracy: no time-to-target figure


@pytest.mark.slow
def test_submitit_local_runs_one_job_at_a_time(tmp_path):
    """hydra/launcher=submitit_local: a fresh process per job (its own device count), jobs never overlap."""
    sweep = tmp_path / "sweep"
    res = multirun(
        sweep,
        "hydra/launcher=submitit_local",
        "mesh.devices=1,2",
        "runtime.cpu_devices=2",
        "data=synthetic",
        "data.eval_size=64",
        "train.steps=2",
        "train.log_every=1",
        "wandb.mode=disabled",
        "checkpoint.enabled=false",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    jobs = job_dirs(sweep)
    assert [json.loads((j / "summary.json").read_text())["mesh/devices"] for j in jobs] == [1, 2]
    # a job starts when Hydra creates its .hydra folder and ends when it writes summary.json
    (s0, e0), (s1, e1) = [((j / ".hydra").stat().st_mtime, (j / "summary.json").stat().st_mtime) for j in jobs]
    assert e0 <= s1, f"jobs overlapped: job 0 ran {s0:.1f}-{e0:.1f}, job 1 started {s1:.1f}"
    assert "array_parallelism=1" in res.stderr + res.stdout
