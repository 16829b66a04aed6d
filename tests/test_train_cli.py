"""train.py end to end (subprocesses): the main job, offline W&B read back, bad input."""

from __future__ import annotations

import glob
import json
import math

import pytest

from utils import run_train
from wandb_reader import assert_history_matches_metrics, read_run


def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def assert_failed_cleanly(proc, run_dir, *needles):
    assert proc.returncode != 0
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    assert "Traceback" not in proc.stderr
    left = sorted(p.name for p in run_dir.iterdir())
    assert left == [".hydra", ".lock", "summary.json", "train.log"], left  # no W&B run, no metrics.jsonl, no checkpoint
    s = summary(run_dir)
    assert s["status"] == "failed" and s["error"] == errors[0][len("error: ") :]


def test_main_job_short_run_logs_to_offline_wandb(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, "parallel=jit_sharding", "precision=bf16", "train.steps=40", "train.log_every=10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary(run_dir)
    assert s["status"] == "ok" and s["mesh/devices"] == 8 and s["train/steps"] == 40
    assert s["precision"] == "bf16" and s["parallel"] == "jit_sharding"
    assert 0.1 < s["eval/accuracy"] <= 1.0
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in records if "train/loss" in r]
    assert train_steps == list(range(1, 41))  # one record per step, none repeated or skipped
    steps = [r for r in records if "train/loss" in r]
    assert all(r["optim/lr"] == pytest.approx(1e-3) for r in steps)  # added on the host, every step
    assert not any("optim/grad_norm" in r for r in records)  # off unless train.grad_norm_every is set
    assert sum("perf/examples_per_s" in r for r in records) == 4
    (wandb_dir,) = glob.glob(str(run_dir / "wandb" / "offline-run-*"))
    assert s["wandb/run_dir"] == wandb_dir
    run = read_run(wandb_dir)
    losses = [h["train/loss"] for h in run["history"] if "train/loss" in h]
    assert len(losses) == 40 and losses[0] == pytest.approx(records[1]["train/loss"])
    assert sum("perf/examples_per_s" in h for h in run["history"]) == 4
    assert run["summary"]["eval/accuracy"] == s["eval/accuracy"]
    config = {k: (v["value"] if isinstance(v, dict) and "value" in v else v) for k, v in run["config"].items()}
    assert config["parallel"]["name"] == "jit_sharding"
    assert config["precision"]["compute_dtype"] == "bfloat16"
    assert config["process_count"] == 1
    # nothing secret is logged
    blob = (run_dir / ".hydra" / "config.yaml").read_text() + json.dumps(run["config"])
    assert "api_key" not in blob.lower()


def test_many_steps_between_logs_respects_the_in_flight_bound(tmp_path):
    # 300 steps without a logging window: without the 2-in-flight bound the CPU backend aborts (~32 queued)
    proc = run_train(
        tmp_path / "run", "data=synthetic", "train.steps=300", "train.log_every=1000", "wandb.mode=disabled"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary(tmp_path / "run")["train/steps"] == 300


@pytest.mark.parametrize(
    "overrides,needles",
    [
        (["train.global_batch=250", "mesh.devices=8"], ["250", "8"]),
        (["mesh.devices=16"], ["16", "8"]),
        (["mesh.shape=[3,3]"], ["[3, 3]", "8"]),
        (["parallel=pmap", "train.global_batch=250"], ["250", "8"]),
        (["parallel=pmap", "mesh.shape=[2,4]"], ["pmap", "[2, 4]"]),
        (["train.accum_steps=3"], ["256", "3", "24"]),
        (["train.global_batch=256", "train.per_device_batch=32"], ["256", "32"]),
        (["optim.lr=-1"], ["optim.lr=-1.0", ">= 0"]),
        (["runtime.cpu_devices=0"], ["runtime.cpu_devices=0", ">= 1"]),
        (["model=vit", "model.patch=5"], ["model.patch=5", "28"]),
        (["train.grad_norm_every=0"], ["train.grad_norm_every=0", "[1, 2147483647]"]),
        (["train.grad_norm_every=2147483648"], ["train.grad_norm_every=2147483648", "[1, 2147483647]"]),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, overrides, needles):
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, *overrides, "wandb.mode=offline", timeout=120)
    assert_failed_cleanly(proc, run_dir, *needles)


def test_missing_dataset_is_one_line(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(
        run_dir,
        f"data.data_dir={tmp_path}/nowhere",
        f"data.cache_dir={tmp_path}/cache",
        env={"TFDS_DATA_DIR": ""},
        timeout=120,
    )
    assert_failed_cleanly(proc, run_dir, "nowhere", "TFDS_DATA_DIR", "data=synthetic")


def test_too_many_steps_in_flight_on_cpu_devices_is_refused_before_anything_runs(tmp_path):
    """16 steps in flight on 8 CPU devices aborted the process after XLA:CPU's 40 s rendezvous timeout (exit 134,
    no summary); it is bad input, refused with one line."""
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, "data=synthetic", "train.steps=20", "train.max_in_flight=16", timeout=120)
    assert_failed_cleanly(proc, run_dir, "train.max_in_flight=16 with 8 CPU devices", "train.max_in_flight=8 or less")


def test_non_finite_loss_stops_with_the_first_bad_step(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(
        run_dir,
        "data=synthetic",
        "precision=fp16",
        "precision.loss_scale=none",
        "optim=sgd",
        "optim.lr=1e12",
        "train.steps=30",
        "train.log_every=10",
        "checkpoint.every=0",
    )
    assert proc.returncode != 0
    (line,) = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert "non-finite" in line and "step 2" in line
    assert summary(run_dir)["status"] == "failed"
    # the failing window's steps are recorded up to and including the first bad one (strict JSON: null + nonfinite)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert math.isfinite(records[1]["train/loss"])
    assert (records[2]["train/loss"], records[2]["nonfinite"]) == (None, {"train/loss": "nan"})
    (wandb_run,) = glob.glob(str(run_dir / "wandb" / "offline-run-*"))
    assert assert_history_matches_metrics(wandb_run, run_dir / "metrics.jsonl") == [0, 1, 2]


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (
            ["parallel=nonsense"],
            "error: parallel=nonsense is not an option of group parallel; choose one of fsdp, "
            "jit_sharding, pmap, shard_map",
        ),
        (["train.global_bach=256"], "error: unknown config key train.global_bach; did you mean train.global_batch?"),
        (
            ["train.global_batch=abc"],
            "error: train.global_batch=abc: Value 'abc' of type 'str' could not be converted to Integer",
        ),
        (
            ["model.activation=foo"],
            "error: model.activation=foo is not a valid choice; choose one of tanh, relu, gelu, sigmoid",
        ),
        (
            ["precision=fp8"],
            "error: precision=fp8 is not an option of group precision; choose one of bf16, fp16, "
            "fp32; did you mean precision=fp32?",
        ),
    ],
)
def test_hydra_rejects_unknown_options_and_keys(tmp_path, overrides, needle):
    """Hydra's multi-line composition errors arrive as one line (conf/schema.py: one_line), exit code 1."""
    proc = run_train(tmp_path / "run", *overrides, timeout=120)
    assert proc.returncode == 1
    assert [ln for ln in proc.stderr.splitlines() if ln.strip()] == [needle]


@pytest.mark.slow
def test_main_job_acceptance_bf16_on_mnist(tmp_path):
    """The issue's acceptance run: default epochs on real MNIST, 8 devices, bf16, eval accuracy >= 0.975."""
    import time

    run_dir = tmp_path / "run"
    t0 = time.time()
    proc = run_train(run_dir, "parallel=jit_sharding", "precision=bf16", timeout=900)
    elapsed = time.time() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary(run_dir)
    assert s["eval/accuracy"] >= 0.975 and s["mesh/devices"] == 8
    assert elapsed < 180, elapsed


def test_unreachable_wandb_falls_back_to_offline_and_writes_no_secret(tmp_path):
    run_dir = tmp_path / "run"
    key = "k" * 40
    proc = run_train(
        run_dir,
        "data=synthetic",
        "train.steps=10",
        "wandb.mode=online",
        "wandb.init_timeout_s=10",
        env={"WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_API_KEY": key, "WANDB_CONFIG_DIR": str(tmp_path / "wbcfg")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "continuing offline" in proc.stderr + proc.stdout
    s = summary(run_dir)
    assert s["status"] == "ok" and "offline-run-" in s["wandb/run_dir"]
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert key.encode() not in path.read_bytes(), path


def test_a_failed_run_in_a_reused_folder_keeps_the_earlier_summary(tmp_path):
    run_dir = tmp_path / "run"
    ok = run_train(run_dir, "data=synthetic", "train.steps=5", "wandb.mode=disabled", "checkpoint.enabled=false")
    assert ok.returncode == 0, ok.stderr[-2000:]
    first = summary(run_dir)
    bad = run_train(run_dir, "train.global_batch=0", timeout=120)
    assert bad.returncode != 0 and summary(run_dir)["status"] == "failed"
    (kept,) = run_dir.glob("summary.previous-*.json")
    assert json.loads(kept.read_text()) == first


def test_a_run_whose_files_outgrow_the_disk_stops_with_one_line(tmp_path):
    """A file of the run that the disk cannot take (here: a file-size limit, EFBIG, as a full disk gives ENOSPC):
    metrics.jsonl stops the run with one ``error:`` line, exit 1 and a failed summary; nothing else on the console,
    neither the OSError's traceback nor the "--- Logging error ---" tracebacks of W&B's process, whose debug.log
    outgrew the limit first."""
    import os
    import subprocess

    from utils import REPO, train_probe_cmd

    run_dir = tmp_path / "run"
    limit = (
        "import resource\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))"
    )
    cmd = train_probe_cmd(
        limit,
        "",
        f"hydra.run.dir={run_dir}",
        "data=synthetic",
        "train.steps=300",
        "train.log_every=1",
        "checkpoint.enabled=false",
        "runtime.compilation_cache_dir=null",
        "wandb=offline",
    )
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out and "Logging error" not in out, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        "error: a write failed (OSError: [Errno 27] File too large); raise the file-size limit (ulimit -f), then run "
        "the same command"
    ]
    s = summary(run_dir)
    assert s["status"] == "failed" and s["error"] == proc.stderr.splitlines()[0][len("error: ") :]
    assert (run_dir / "metrics.jsonl").stat().st_size == 4096


@pytest.mark.unit
def test_a_run_folder_that_stops_taking_writes_is_one_line(tmp_path):
    """A finished run's folder made read-only, then resumed with more steps: the metrics' rewrite raised a
    PermissionError with two tracebacks; it is one line naming the folder to make writable (as a full disk is)."""
    import errno

    from core.errors import TrainingError
    from training.run import disk_full_as_error

    target = tmp_path / "run" / "metrics.jsonl.tmp"
    with pytest.raises(TrainingError) as e:
        with disk_full_as_error(tmp_path / "run"):
            raise PermissionError(errno.EACCES, "Permission denied", str(target))
    assert str(e.value) == (
        f"a write failed (PermissionError: [Errno 13] Permission denied: '{target}'); make {target.parent} "
        f"writable, then run the same command"
    )
    with pytest.raises(FileNotFoundError):  # other errors go on
        with disk_full_as_error(tmp_path):
            raise FileNotFoundError(errno.ENOENT, "No such file", "x")
