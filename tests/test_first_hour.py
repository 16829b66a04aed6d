"""A new user's mistakes end in one clear line (diverged runs, failed sweep jobs, evaluate overrides, settings
handed to libraries, changed settings on resume, restarted runs, relative and special paths)."""

from __future__ import annotations

import json
from pathlib import Path
import math
import subprocess
import sys

import pytest

from utils import REPO, run_train


def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def error_lines(proc) -> list[str]:
    return [l for l in proc.stderr.splitlines() if l.startswith("error:")]


# ---- a diverged run fails; metrics.jsonl and summary.json stay strict JSON ----------------------------------
def test_diverged_run_fails_with_one_line(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, "data=synthetic", "optim=sgd", "optim.lr=1e37", "train.steps=1", "wandb.mode=disabled")
    assert proc.returncode == 1
    (err,) = error_lines(proc)
    assert err == (
        "error: the run diverged: final eval/loss=inf is not finite; lower optim.lr, enable "
        "optim.clip_grad_norm, or, under bf16/fp16, use precision=fp32"
    )
    assert "Traceback" not in proc.stderr
    s = summary(run_dir)
    assert s["status"] == "failed" and s["error"] == err[len("error: ") :]
    strict = lambda c: (_ for _ in ()).throw(ValueError(c))  # noqa: E731  (NaN/Infinity are not JSON)
    records = [json.loads(l, parse_constant=strict) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = records[-1]
    assert final["step"] == 1 and final["eval/loss"] is None and final["nonfinite"] == {"eval/loss": "inf"}
    assert math.isfinite(records[-2]["train/loss"])  # the step's own loss was finite: only the update blew up
    # the final evaluation runs before the final save: a diverged run leaves no checkpoint claiming success
    assert not (run_dir / "checkpoints" / "1").exists()


@pytest.mark.unit
def test_strict_record_writes_null_and_lists_the_keys():
    import numpy as np

    from training.report import strict_record

    rec = {"step": 3, "a": float("nan"), "b": np.float32("-inf"), "c": 1.5, "d": [float("inf"), 2.0]}
    assert strict_record(rec) == {
        "step": 3,
        "a": None,
        "b": None,
        "c": 1.5,
        "d": [None, 2.0],
        "nonfinite": {"a": "nan", "b": "-inf"},
    }
    assert strict_record({"step": 1, "c": 1.0}) == {"step": 1, "c": 1.0}


@pytest.mark.unit
def test_nonfinite_final_names_every_key():
    from training.hooks import nonfinite_final

    assert nonfinite_final({"train/loss": 2.3}, {"eval/loss": 1.0, "eval/accuracy": 0.5}) is None
    msg = nonfinite_final({"train/loss": float("nan")}, {"eval/loss": float("inf"), "eval/accuracy": 0.1})
    assert msg.startswith("the run diverged: final eval/loss=inf, train/loss=nan is not finite;")


# ---- a sweep with failed jobs ends with "k of n jobs failed" and exit 1 -------------------------------------
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


# ---- evaluate takes train.py's override syntax ----------------------------------------------------------------
@pytest.mark.unit
def test_evaluate_overrides_compose_like_train():
    from conf.schema import as_dict
    from evaluate import compose_eval_config
    from parallel import ConfigError
    from utils import make_cfg

    saved = as_dict(
        make_cfg(
            train__seed=7,
            model__hidden=64,
            parallel__name="fsdp",
            precision__name="bf16",
            precision__compute_dtype="bfloat16",
        )
    )
    cfg = compose_eval_config(saved, ["parallel=pmap", "mesh.devices=2"])
    assert (cfg.parallel.name, cfg.mesh.devices, cfg.train.seed, cfg.model.hidden) == ("pmap", 2, 7, 64)
    assert cfg.precision.compute_dtype == "bfloat16" and cfg.wandb.mode == "disabled"  # saved, EVAL_DEFAULTS
    # the option picks the schema: parallel.name alone would put pmap's name on jit_sharding's node
    with pytest.raises(
        ConfigError,
        match=r"^parallel.name=pmap does not match the chosen option "
        r"parallel=jit_sharding; choose the parallel with parallel=pmap$",
    ):
        compose_eval_config(saved, ["parallel.name=pmap"])
    assert compose_eval_config(saved, []).parallel.name == "jit_sharding"
    assert compose_eval_config(saved, ["precision=fp32"]).precision.compute_dtype == "float32"
    for bad, needle in (
        (["parallel=pmapp"], "parallel=pmapp is not an option"),
        (["paralel=pmap"], "paralel"),
        (["+foo=1"], "foo"),
        (["mesh.devices=1,2"], "not a sweep"),
    ):
        with pytest.raises(ConfigError, match=needle):
            compose_eval_config(saved, bad)


# ---- settings handed to libraries are checked in plan(), before data and compilation -------------------------
def test_long_wandb_tag_fails_at_start(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, "data=synthetic", "train.steps=10", f"wandb.tags=[{'t' * 70}]")
    assert proc.returncode == 1
    assert error_lines(proc) == [
        "error: wandb.tags[0]='tttttttttttttttttttt...' is 70 characters; W&B tags must "
        "have 1 to 64 characters: shorten it"
    ]
    assert "Traceback" not in proc.stderr and not (run_dir / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "dotted,needle",
    [
        ({"wandb__tags": "[" + "x" * 65 + "]"}, "65 characters"),
        ({"wandb__tags": "['']"}, "0 characters"),
        ({"wandb__project": "a/b"}, "wandb.project='a/b'"),
        ({"wandb__project": "p" * 129}, "1 to 128"),
        ({"wandb__group": "g" * 129}, "wandb.group="),
        ({"wandb__entity": "a b"}, "wandb.entity='a b'"),
        ({"wandb__init_timeout_s": "inf"}, "wandb.init_timeout_s=inf is out of range; it must be finite and > 0"),
        ({"xla__flags": "[xla_gpu_foo=1]"}, "--name or --name=value"),
        ({"xla__flags": "['--xla_not_a_flag=1']"}, "XLA does not know --xla_not_a_flag=1"),
        ({"checkpoint__dir": "'/tmp/a[1]'"}, "checkpoint.dir='/tmp/a[1]' contains [ ]"),
        ({"checkpoint__resume": "/tmp/ck*"}, "checkpoint.resume='/tmp/ck*' contains *"),
        ({"data__data_dir": "/d?"}, "data.data_dir='/d?' contains ?"),
        ({"data__name": "mnist", "data__tfds_name": "mnsit"}, "TFDS has no dataset 'mnsit'; did you mean mnist"),
        ({"data__name": "mnist", "data__tfds_name": "MNIST!"}, "is not a TFDS name"),
    ],
)
def test_library_settings_are_refused_in_plan(dotted, needle):
    from parallel import ConfigError
    from training.build import plan
    from utils import make_cfg

    with pytest.raises(ConfigError, match=__import__("re").escape(needle)):
        plan(make_cfg(**dotted))


def test_valid_library_settings_pass():
    from training.validate import check_library_settings, check_path
    from utils import make_cfg

    check_library_settings(
        make_cfg(
            wandb__tags="[" + "x" * 64 + "]",
            xla__flags="['--xla_cpu_use_thunk_runtime=true']",
            checkpoint__dir="'/tmp/sp ace,=%#é'",
        )
    )
    check_path("checkpoint.dir", "/tmp/a b/c=d,e%f#g/é")


# ---- paths with special characters work end to end ------------------------------------------------------------
def test_special_characters_in_checkpoint_dir_work_end_to_end(tmp_path):
    ckpt = tmp_path / "ck sp,a=c%e#é"
    run_dir = tmp_path / "run%1"  # (run_train passes hydra.run.dir unquoted: no space, comma, # or é)
    common = [
        "data=synthetic",
        "train.steps=4",
        "wandb.mode=disabled",
        "checkpoint.every=2",
        f"checkpoint.dir='{ckpt}'",
    ]
    proc = run_train(run_dir, *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in ckpt.iterdir()) == ["2", "4"]
    assert (ckpt / "4" / "state" / "manifest.ocdbt").exists()  # the OCDBT merge ran: the step is whole
    out = subprocess.run(
        [sys.executable, "-m", "evaluate", str(ckpt), "--json"], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["step"] == 4 and result["eval/accuracy"] == summary(run_dir)["eval/accuracy"]
    proc = run_train(tmp_path / "run2", *common[:-3], "train.steps=6", "checkpoint.every=2", f"checkpoint.dir='{ckpt}'")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary(tmp_path / "run2")
    assert s["checkpoint/resumed_step"] == 4 and s["checkpoint/last_step"] == 6
    assert "corrupt" not in proc.stderr and sorted(p.name for p in ckpt.iterdir()) == ["2", "4", "6"]


# ---- resuming with changed settings ----------------------------------------------------------------------------
@pytest.mark.unit
def test_resume_conflicts_rule():
    from conf.schema import as_dict
    from training.checkpoint import resume_conflicts
    from utils import make_cfg

    saved = as_dict(make_cfg())
    allowed = as_dict(
        make_cfg(
            train__steps=500,
            train__log_every=7,
            mesh__devices=4,
            parallel__name="pmap",
            checkpoint__keep=9,
            wandb__mode="offline",
            train__global_batch=256,
        )
    )
    assert resume_conflicts(saved, allowed, 256, 256) == []
    # weak scaling with the same resolved global batch (32 x 8 = 256) is the same run
    assert resume_conflicts(saved, as_dict(make_cfg(train__per_device_batch=32)), 256, 256) == []
    assert resume_conflicts(saved, as_dict(make_cfg(train__per_device_batch=16)), 256, 128) == [
        "train.per_device_batch: None -> 16"
    ]
    refused = as_dict(make_cfg(train__seed=1, optim__lr=0.5, model__hidden=64, train__accum_steps=2))
    assert resume_conflicts(saved, refused, 256, 256) == [
        "model.hidden: 256 -> 64",
        "optim.lr: 0.001 -> 0.5",
        "train.accum_steps: 1 -> 2",
        "train.seed: 0 -> 1",
    ]


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


# ---- restarted runs: every step once, complete summaries ------------------------------------------------------
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


# ---- relative paths under hydra.job.chdir=true -----------------------------------------------------------------
@pytest.mark.unit
def test_absolute_paths_against_the_launch_folder(tmp_path):
    from training.console import absolute_paths
    from utils import make_cfg

    env = {"TFDS_DATA_DIR": "data/tfds"}
    cfg = absolute_paths(
        make_cfg(checkpoint__dir="ck/x", checkpoint__resume="old/5", data__data_dir="d", data__cache_dir="/abs/cache"),
        tmp_path,
        env,
    )
    assert (cfg.checkpoint.dir, cfg.checkpoint.resume, cfg.data.data_dir, cfg.data.cache_dir) == (
        str(tmp_path / "ck/x"),
        str(tmp_path / "old/5"),
        str(tmp_path / "d"),
        "/abs/cache",
    )
    assert env["TFDS_DATA_DIR"] == str(tmp_path / "data/tfds")
    assert absolute_paths(make_cfg(), tmp_path, {}).checkpoint.resume == "auto"
    cache = absolute_paths(make_cfg(runtime__compilation_cache_dir="jc"), tmp_path, {}).runtime
    assert cache.compilation_cache_dir == str(tmp_path / "jc")
    assert (
        absolute_paths(
            make_cfg({"runtime": {"compilation_cache_dir": None}}), tmp_path, {}
        ).runtime.compilation_cache_dir
        is None
    )


def test_chdir_true_keeps_relative_checkpoint_dir_in_the_launch_folder(tmp_path):
    import os

    def train(i):
        cmd = [
            sys.executable,
            str(REPO / "train.py"),
            "data=synthetic",
            "train.steps=3",
            "wandb.mode=disabled",
            "checkpoint.dir=ck/x",
            "hydra.job.chdir=true",
            f"hydra.run.dir=run{i}",
        ]
        return subprocess.run(
            cmd, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600
        )

    assert train(1).returncode == 0
    assert sorted(p.name for p in (tmp_path / "ck" / "x").iterdir()) == ["3"]
    proc = train(2)
    assert proc.returncode == 0 and "already complete at step 3" in proc.stderr
    assert not (tmp_path / "run1" / "ck").exists() and not (tmp_path / "run2" / "ck").exists()


# ---- a fresh machine: the data set is prepared on first use ---------------------------------------------------
RAW_MNIST = REPO.parent / "shared" / "data" / "mnist"


@pytest.mark.skipif(not RAW_MNIST.exists(), reason="needs the raw MNIST files of ../shared/data/mnist")
def test_mnist_is_prepared_from_raw_files_without_tensorflow(tmp_path):
    import shutil

    import numpy as np

    from data.sources import load_tfds_split
    from utils import SHARED_TFDS

    manual = tmp_path / "tfds" / "downloads" / "manual"
    manual.mkdir(parents=True)
    for f in RAW_MNIST.iterdir():
        shutil.copy(f, manual / f.name)
    for split, n in (("train", 60000), ("test", 10000)):
        got = load_tfds_split("mnist", split, str(tmp_path / "tfds"), str(tmp_path / "cache"))
        want = load_tfds_split("mnist", split, str(SHARED_TFDS), str(tmp_path / "cache_ref"))
        assert len(got) == n and np.array_equal(got.images, want.images) and np.array_equal(got.labels, want.labels)
    assert sorted(p.name for p in (tmp_path / "tfds" / "mnist" / "3.0.1").iterdir()) == [
        "dataset_info.json",
        "features.json",
        "mnist-test.array_record-00000-of-00001",
        "mnist-train.array_record-00000-of-00001",
    ]


@pytest.mark.unit
def test_missing_dataset_without_network_or_download_is_one_line(tmp_path, monkeypatch):
    import socket

    from data.sources import DataError, load_tfds_split

    def no_network(*args, **kwargs):
        raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr(socket, "create_connection", no_network)
    with pytest.raises(DataError) as e:
        load_tfds_split("mnist", "train", str(tmp_path), str(tmp_path / "cache"))
    assert str(e.value) == (
        f"dataset 'mnist' is not prepared in {tmp_path} and storage.googleapis.com cannot be reached (OSError: "
        f"[Errno -2] Name or service not known); connect to the internet, put the raw files in "
        f"{tmp_path / 'downloads' / 'manual'}, point TFDS_DATA_DIR at a prepared copy, or run with data=synthetic"
    )
    with pytest.raises(DataError, match="is not prepared in .* and data.download=false"):
        load_tfds_split("mnist", "train", str(tmp_path), str(tmp_path / "cache"), download=False)


# ---- output that explains itself ----------------------------------------------------------------------------------
def test_startup_line_and_one_train_log_line_per_window(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(
        run_dir,
        "data=synthetic",
        "train.steps=20",
        "train.log_every=10",
        "wandb.mode=disabled",
        "train.global_batch=128",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [l.split(" - ", 1)[1] for l in (run_dir / "train.log").read_text().splitlines() if " - " in l]
    assert (
        "start: 8 cpu devices (cpu), 1 process, jit_sharding mesh [8, 1], fp32, batch 128 global / 16 per "
        "device, accum 1, 20 steps, mlp 203,530 params, data synthetic on the devices"  # generated there
    ) in lines
    windows = [l for l in lines if l.startswith("step ")]
    assert [w.split()[1] for w in windows] == ["10/20", "20/20"] and all(" examples/s=" in w for w in windows)
    assert "Unable to initialize backend 'tpu'" not in proc.stderr and "OpenCV" not in proc.stderr
    assert proc.stderr.count("wandb sync") == 0  # W&B disabled: no offline message


@pytest.mark.unit
def test_launch_local_leaves_out_gloo_connection_lines(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("launch_local", REPO / "scripts" / "launch_local.py")
    launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch)
    src = tmp_path / "src"
    src.write_bytes(
        b"start\n[Gloo] Rank 3 is connected to 3 peer ranks. Expected number of connected peer ranks is"
        b" : 3\ntrain: 50%\rtrain: 100%\nerror: real\n"
    )
    out, counter = tmp_path / "out", [0]
    with open(src, "rb") as s, open(out, "wb") as d:
        launch.forward_filtered(s, d, counter)
    assert out.read_bytes() == b"start\ntrain: 50%\rtrain: 100%\nerror: real\n" and counter == [1]
