"""Checkpoints (issue 8): exact resume after SIGKILL/SIGTERM, restore onto other layouts, NaN guard,
truncated checkpoints, bad resume paths, ``python -m evaluate``.

The kill tests run ``train.py`` in subprocesses (synthetic data, fp32, Adam, 8 simulated CPU devices) and compare
every array of the final checkpoint BITWISE with an uninterrupted run of the same command. The others run
in-process on the test session's 8 devices.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from conf.schema import CheckpointConfig, as_dict
from data.pipeline import TrainSource
from parallel import ConfigError
from parallel.state import host_abstract, state_to_host
from training import checkpoint
from training.build import build, plan
from utils import REPO, SHARED_TFDS, damage_step, make_cfg, random_dataset, run_steps, run_train, train_probe_cmd
from wandb_reader import assert_history_matches_metrics, offline_runs, read_run

STEPS, EVERY = 120, 20
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT
COMMON = [
    "data=synthetic",
    f"train.steps={STEPS}",
    f"checkpoint.every={EVERY}",
    "train.log_every=1",
    "train.eval_batch=2000",
    "data.eval_size=2000",
]


# ---- helpers -----------------------------------------------------------------------------------------------
def _env(tmp: Path) -> dict:
    e = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true"}
    e.pop("WANDB_API_KEY", None)
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        e[var] = str(tmp / ".wandb_aux")
    if SHARED_TFDS.exists():
        e.setdefault("TFDS_DATA_DIR", str(SHARED_TFDS))
    return e


def start_train(run_dir: Path, ckpt_dir: Path, *overrides: str) -> subprocess.Popen:
    """``python train.py`` with a pinned run folder and checkpoint folder; output in <run_dir>.out/.err."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", f"checkpoint.dir={ckpt_dir}", *COMMON, *overrides]
    out = open(f"{run_dir}.out", "a")
    err = open(f"{run_dir}.err", "a")
    return subprocess.Popen(cmd, cwd=REPO, env=_env(run_dir.parent), stdout=out, stderr=err)


def finish(proc: subprocess.Popen, timeout: float = 600) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def last_logged_step(run_dir: Path) -> int:
    """The step of the last complete train record of metrics.jsonl (0 when none yet)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [0]
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "train/loss" in rec:
            steps.append(rec["step"])
    return max(steps)


def metrics_inode(run_dir: Path):
    path = run_dir / "metrics.jsonl"
    return path.stat().st_ino if path.exists() else None


def interrupt(
    proc: subprocess.Popen,
    run_dir: Path,
    ckpt_dir: Path,
    after_step: int,
    sig: int,
    stale_inode=None,
    timeout: float = 600,
) -> int:
    """Waits for a finished checkpoint and for ``after_step`` to be logged, then sends ``sig``; returns rc.

    ``stale_inode``: metrics.jsonl of an earlier run in the same folder; a resumed run replaces that file
    (``Reporter.continue_metrics``), and only the new file counts.
    """
    deadline = time.monotonic() + timeout
    while not (
        checkpoint.complete_steps(ckpt_dir)
        and metrics_inode(run_dir) != stale_inode
        and last_logged_step(run_dir) >= after_step
    ):
        assert proc.poll() is None, (
            f"train.py ended (rc={proc.returncode}) before step {after_step}: "
            f"{Path(f'{run_dir}.err').read_text()[-2000:]}"
        )
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(0.02)
    proc.send_signal(sig)
    return finish(proc)


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "train/loss" in r]


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), f"{k} differs: max |diff| {np.max(np.abs(a[k] - b[k]))}"


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


# ---- kill / SIGTERM / restart == uninterrupted -----------------------------------------------------------------
def kill_and_resume(tmp_path: Path, mode: str, seed: int) -> None:
    """Reference run; then SIGKILL after the first checkpoint, restart + SIGTERM, restart to the end."""
    rng = np.random.default_rng(seed)
    overrides = [f"parallel={mode}"]
    ref_run, ref_ckpt = tmp_path / "ref", tmp_path / "ref_ckpt"
    assert finish(start_train(ref_run, ref_ckpt, *overrides, "wandb=disabled")) == 0, Path(
        f"{ref_run}.err"
    ).read_text()[-3000:]
    overrides.append("wandb=offline")  # the interrupted run's W&B run must be resumed under its id
    reference = checkpoint.read_arrays(ref_ckpt / str(STEPS))

    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    kill_after = int(rng.integers(EVERY + 1, STEPS - 2 * EVERY))  # a random step after the first checkpoint
    rc = interrupt(start_train(run, ckpt, *overrides), run, ckpt, kill_after, signal.SIGKILL)
    assert rc == -signal.SIGKILL
    killed_at = last_logged_step(run)
    resumable = max(checkpoint.complete_steps(ckpt))
    assert EVERY <= resumable < STEPS and killed_at >= kill_after
    print(f"{mode}: SIGKILL after step {killed_at}; newest finished checkpoint {resumable}")

    # Restart with the same command; stop it with SIGTERM a few steps later.
    term_after = int(rng.integers(resumable + 1, min(resumable + EVERY, STEPS - 10) + 1))
    rc = interrupt(
        start_train(run, ckpt, *overrides), run, ckpt, term_after, signal.SIGTERM, stale_inode=metrics_inode(run)
    )
    err = Path(f"{run}.err").read_text()
    assert rc != 0
    stopped = max(checkpoint.complete_steps(ckpt))  # SIGTERM leaves a checkpoint at the step it stopped
    assert stopped == last_logged_step(run) >= term_after, (stopped, last_logged_step(run), term_after)
    line = f"error: stopped by SIGTERM after step {stopped} of {STEPS}; checkpoint saved in {ckpt / str(stopped)};"
    assert line in err, err[-3000:]
    assert summary(run)["status"] == "stopped" and summary(run)["error"].startswith(line.removeprefix("error: "))
    stopped_by = checkpoint.read_metadata(ckpt / str(stopped))["wandb_run_id"]  # (pruned later: checkpoint.keep)
    print(f"{mode}: SIGTERM after step {stopped}")

    # Restart again: runs to the end.
    assert finish(start_train(run, ckpt, *overrides)) == 0, Path(f"{run}.err").read_text()[-3000:]
    assert_bitwise_equal(checkpoint.read_arrays(ckpt / str(STEPS)), reference)

    # metrics.jsonl: every step exactly once, with the uninterrupted run's losses.
    got, want = train_records(run), train_records(ref_run)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["train/loss"] for r in got] == [r["train/loss"] for r in want]
    # W&B: one run per start (training/report.py); the last holds steps 0..STEPS once, with metrics.jsonl's
    # values, and names the run whose checkpoint (step `stopped`) it continued.
    runs = offline_runs(run)
    ids = [Path(r).name.rsplit("-", 1)[1] for r in runs]  # offline-run-<time>-<id> (the killed file may be cut)
    assert len(runs) == 3 and len(set(ids)) == 3 and summary(run)["wandb/run_id"] == ids[2]
    assert stopped_by == ids[1] and checkpoint.read_metadata(ckpt / str(STEPS))["wandb_run_id"] == ids[2]
    assert assert_history_matches_metrics(runs[2], run / "metrics.jsonl") == list(range(STEPS + 1))
    assert read_run(runs[2])["config"]["resumed"] == {"previous_wandb_run_id": ids[1], "step": stopped}
    meta = checkpoint.read_metadata(ckpt / str(STEPS))
    assert (meta["step"], meta["mode"], meta["device_count"], meta["process_count"]) == (STEPS, mode, 8, 1)
    assert meta["epoch"] * meta["steps_per_epoch"] + meta["position"] == STEPS
    assert meta["config"]["parallel"]["name"] == mode


def test_kill_resume_bitwise_jit_sharding(tmp_path):
    kill_and_resume(tmp_path, "jit_sharding", seed=1)


@pytest.mark.slow
def test_kill_resume_bitwise_fsdp(tmp_path):
    kill_and_resume(tmp_path, "fsdp", seed=2)


def test_resume_path_that_does_not_exist(tmp_path):
    run = tmp_path / "run"
    missing = tmp_path / "no_such_checkpoint"
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            f"hydra.run.dir={run}",
            "data=synthetic",
            "wandb=offline",
            f"checkpoint.resume={missing}",
        ],
        cwd=REPO,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: checkpoint.resume={missing} does not exist; give a checkpoint folder (or one <step> "
        f"folder in it), auto (the newest in checkpoint.dir) or never"
    ]
    assert "Traceback" not in proc.stderr
    assert not (run / "wandb").exists() and not (run / "metrics.jsonl").exists()
    assert not (run / "checkpoints").exists()
    assert summary(run)["status"] == "failed"


# ---- restore onto another device count / mesh / mode ----------------------------------------------------------
def _host(exp, state):
    return jax.tree.map(np.asarray, state_to_host(state))


def _step(exp, state, dataset, step):
    p = exp.plan
    layout = exp.mode.batch_layout()
    batch = layout.place(
        TrainSource(dataset, p.global_batch, p.cfg.train.seed).local_batch(step, layout.local_rows(p.global_batch)),
        p.global_batch,
    )
    state, _ = exp.steps.train(state, batch)
    return _host(exp, state)


@pytest.mark.parametrize("optim,tol", [("sgd", 1e-6), pytest.param("adam", 5e-5, marks=pytest.mark.slow)])
def test_reshard_fsdp8_to_2_1_and_pmap4(tmp_path, optim, tol):
    dataset = random_dataset(2048)
    base = {
        "optim": {"name": "sgd", "lr": 0.1, "momentum": 0.9} if optim == "sgd" else {"name": "adam", "lr": 1e-3},
        "train": {"global_batch": 64},
    }
    cfg8 = make_cfg({**base, "parallel": {"name": "fsdp"}, "mesh": {"devices": 8, "shape": [1, 8]}})
    _, saved_host, exp8, _ = run_steps(cfg8, dataset, 20)
    saver = checkpoint.Saver(tmp_path / "ckpt", keep=3)
    step_dir = saver.save(exp8.state, 20, {"step": 20}, exp8.mode)
    saver.close()
    want = _step(exp8, exp8.state, dataset, 20)  # the 8-device continuation

    targets = [("fsdp", 2, [1, 2]), ("fsdp", 1, [1, 1]), ("pmap", 4, None)]
    for name, n, shape in targets:
        exp = build(plan(make_cfg({**base, "parallel": {"name": name}, "mesh": {"devices": n, "shape": shape}})))
        restored = checkpoint.restore_step(step_dir, exp.mode, exp.state)
        assert restored.step == 20
        got = _host(exp, restored.state)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(saved_host)):  # params AND optimizer state
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
        # Restored with the NEW layout's shardings (never the saved ones); pmap's state is canonical too.
        want_shardings = exp.mode.state_shardings(host_abstract(exp.state))
        assert all(jax.tree.leaves(jax.tree.map(lambda x, s: x.sharding == s, restored.state, want_shardings)))
        nxt = _step(exp, restored.state, dataset, 20)
        diff = max(
            float(np.max(np.abs(a.astype(np.float64) - b), initial=0.0))
            for a, b in zip(jax.tree.leaves(nxt.params), jax.tree.leaves(want.params))
        )
        print(f"{optim}: fsdp/8 -> {name}/{n}: next-step max |param diff| = {diff:.3g}")
        assert diff <= tol


@pytest.mark.parametrize("mode,devices", [("jit_sharding", 8), ("fsdp", 8), ("jit_sharding", 1)])
def test_a_save_in_one_process_writes_host_arrays(tmp_path, mode, devices):
    """One process holds every array whole, so the state goes to orbax as host numpy (``store.host_form``): a
    save compiles no program (orbax's replica-parallel path for device arrays compiles one slicing program per
    device and shape: 8 or more here; on the CPU backend the NaN guard reads that host copy instead of running
    its own program), and the step folder reads back bitwise, also from FSDP shards."""
    # a hidden width no other test uses: programs compiled by earlier tests cannot hide this save's own
    overrides = {"parallel": {"name": mode}, "mesh": {"devices": devices}, "model": {"hidden": 72}}
    cfg = make_cfg({"data": {"name": "synthetic"}, **overrides})
    exp = build(plan(cfg))
    want = _host(exp, exp.state)
    host = checkpoint.store.host_form(exp.state)
    assert all(type(x) is np.ndarray for x in jax.tree.leaves(host))
    for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    assert checkpoint.store.on_cpu_backend(exp.state)
    compiled: list[str] = []

    def on_compile(event: str, duration_s: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            compiled.append(event)

    jax.monitoring.register_event_duration_secs_listener(on_compile)
    try:
        jax.jit(lambda x: x * 3.0 + 72.0).lower(np.float32(1)).compile()  # the listener sees compilations
        assert len(compiled) == 1
        saver = checkpoint.Saver(tmp_path / "ckpt", keep=1)
        step_dir = saver.save(exp.state, 5, {"step": 5}, exp.mode)
        saver.close()
    finally:
        jax.monitoring.unregister_event_duration_listener(on_compile)
    assert len(compiled) == 1  # none in the save
    arrays = checkpoint.read_arrays(step_dir)
    assert len(arrays) == len(jax.tree.leaves(want))
    for (name, a), b in zip(sorted(arrays.items()), [x for _, x in sorted(_named(want).items())]):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name


def _named(tree) -> dict:
    return {checkpoint.store._name(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_restore_rejects_another_model(tmp_path):
    cfg = make_cfg({"data": {"name": "synthetic"}, "mesh": {"devices": 2}})
    exp = build(plan(cfg))
    saver = checkpoint.Saver(tmp_path / "ckpt", keep=1)
    step_dir = saver.save(exp.state, 5, {"step": 5}, exp.mode)
    saver.close()
    other = build(plan(make_cfg({"data": {"name": "synthetic"}, "mesh": {"devices": 2}, "model": {"hidden": 128}})))
    with pytest.raises(
        ConfigError,
        match=r"does not fit this run: opt_state\.0\.mu\.hidden\.bias is "
        r"\(\(256,\), 'float32'\) there but \(\(128,\), 'float32'\) here",
    ):
        checkpoint.restore_step(step_dir, other.mode, other.state)


@pytest.mark.unit
def test_checkpoint_of_the_nnx_state_format_names_its_version(tmp_path):
    """Checkpoints written before the parameters became plain dicts hold '<name>.value' leaves."""
    cfg = make_cfg({"data": {"name": "synthetic"}, "mesh": {"devices": 2}})
    exp = build(plan(cfg))
    old = exp.state.replace(params=jax.tree.map(lambda x: {"value": x}, exp.state.params))
    saver = checkpoint.Saver(tmp_path / "ckpt", keep=1)
    step_dir = saver.save(old, 5, {"step": 5}, exp.mode)
    saver.close()
    with pytest.raises(ConfigError, match=r"written by an earlier version of this repository .*'<name>\.value'"):
        checkpoint.restore_step(step_dir, exp.mode, exp.state)


# ---- NaN guard, truncated checkpoints ---------------------------------------------------------------------------
def test_nan_params_are_never_saved(tmp_path, capsys, monkeypatch):
    """In a real run: NaN injected into the params right before the step-20 save."""
    from training.run import run_and_report

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ckpt = tmp_path / "ckpt"
    cfg = make_cfg(
        {
            "data": {"name": "synthetic", "eval_size": 1000},
            "mesh": {"devices": 2},
            "wandb": {"mode": "disabled"},
            "checkpoint": {"dir": str(ckpt), "every": 10},
            "train": {"steps": 40, "log_every": 5, "eval_batch": 1000},
        }
    )
    original = checkpoint.RunCheckpoints.save

    def inject(self, state, done, wandb_run_id, reason, **kwargs):
        if done == 20:
            bad = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(np.nan), state.params)
            state = state.replace(params=bad)
        return original(self, state, done, wandb_run_id, reason, **kwargs)

    monkeypatch.setattr(checkpoint.RunCheckpoints, "save", inject)
    assert run_and_report(cfg, run_dir) is False
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert err == [
        f"error: parameters are not finite after step 20: no checkpoint written; the last good "
        f"checkpoint is {ckpt / '10'} (step 10); lower optim.lr, enable optim.clip_grad_norm, or, under "
        f"bf16/fp16, use precision=fp32, in a new run (its own checkpoint.dir where one is pinned)"
    ]
    assert checkpoint.complete_steps(ckpt) == [10] and not checkpoint.unfinished_saves(ckpt)
    assert summary(run_dir)["status"] == "failed"
    # The previous checkpoint is intact and restores onto a fresh run of the same config.
    exp = build(plan(cfg))
    restored = checkpoint.restore_step(ckpt / "10", exp.mode, exp.state)
    arrays = checkpoint.read_arrays(ckpt / "10")
    assert restored.step == 10 and int(arrays["step"]) == 10
    assert all(np.all(np.isfinite(v)) for v in arrays.values())
    host = state_to_host(restored.state)
    np.testing.assert_array_equal(np.asarray(host.params["hidden"]["kernel"]), arrays["params.hidden.kernel"])


@pytest.mark.unit
def test_host_nan_guard_sees_bfloat16_and_float8():
    """The host NaN guard (``parallel.base.host_finite_flags``) checks every floating leaf, also the ml_dtypes
    ones that numpy's own ``issubdtype(..., np.inexact)`` calls not inexact."""
    from ml_dtypes import bfloat16, float8_e4m3fn

    from parallel.state import host_finite_flags

    finite = {"w": np.ones(3, np.float32), "count": np.int32(7)}
    assert host_finite_flags(finite, finite) == (True, True)
    for dtype in (bfloat16, float8_e4m3fn, np.float16):
        bad = {"w": np.array([1.0, np.nan], dtype), "count": np.int32(7)}
        assert host_finite_flags(bad, finite) == (False, True), dtype
        assert host_finite_flags(finite, bad) == (True, False), dtype


def _orbax_step_deletion(monkeypatch, delete) -> None:
    """Replaces orbax 0.12.8's deletion of one checkpoint step (``StandardCheckpointDeleter.delete``, called for
    each step beyond ``keep``) by ``delete(original, deleter, step)``."""
    from orbax.checkpoint._src.path import deleter as orbax_deleter

    original = orbax_deleter.StandardCheckpointDeleter.delete
    monkeypatch.setattr(
        orbax_deleter.StandardCheckpointDeleter, "delete", lambda self, step: delete(original, self, step)
    )


@pytest.mark.unit
def test_saver_deletes_old_steps_before_the_next_save_returns(tmp_path, monkeypatch):
    """``keep``: orbax deletes a step beyond it inside the finalize of the save that pushed it out, and the next save
    waits for that finalize, so even when deleting is slow (a network filesystem) the folder never holds more than
    ``keep`` + 1 complete steps, and ``close`` leaves exactly the newest ``keep``. (orbax's
    ``enable_background_delete`` would queue the deletions instead: 254 step folders at once with a checkpoint every
    step: ``git show 7559600:benchmarks/results/background_delete_slow_cpu.txt``.)"""
    _orbax_step_deletion(monkeypatch, lambda delete, deleter, step: (time.sleep(0.2), delete(deleter, step)))
    exp = build(plan(make_cfg({"data": {"name": "synthetic"}, "mesh": {"devices": 2}})))
    ckpt = tmp_path / "ckpt"
    saver = checkpoint.Saver(ckpt, keep=2)
    most = 0
    for step in range(1, 7):
        saver.save(exp.state, step, {"step": step}, exp.mode)
        most = max(most, len(checkpoint.complete_steps(ckpt)))
    saver.close()
    assert most <= 3
    assert sorted(p.name for p in ckpt.iterdir()) == ["5", "6"]
    assert [checkpoint.read_metadata(ckpt / s)["step"] for s in ("5", "6")] == [5, 6]


@pytest.mark.unit
def test_saver_deletes_a_step_without_orbax_parallel_deleter_on_a_many_core_host(tmp_path, monkeypatch):
    """On a host with 4 or more cores (a TPU v5e host has 13) orbax 0.12.8 would delete each step beyond ``keep``
    with its parallel deleter, whose scheduler returns only after a 0.1 s queue poll times out: >= 0.1 s more per
    save (``git show 7559600:benchmarks/results/deletion_threads_cpu.txt``). ``Saver`` asks for one deletion
    thread, a plain recursive delete, whatever the core count."""
    from orbax.checkpoint._src.path import deleter as orbax_deleter

    monkeypatch.setattr(os, "cpu_count", lambda: 13)
    parallel: list[str] = []
    original = orbax_deleter._ParallelDirectoryDeleter.delete
    monkeypatch.setattr(
        orbax_deleter._ParallelDirectoryDeleter,
        "delete",
        lambda self, path: (parallel.append(os.path.basename(str(path))), original(self, path)),
    )
    exp = build(plan(make_cfg({"data": {"name": "synthetic"}})))
    ckpt = tmp_path / "ckpt"
    saver = checkpoint.Saver(ckpt, keep=1)
    for step in range(1, 4):
        saver.save(exp.state, step, {"step": step}, exp.mode)
    saver.close()
    assert parallel == []
    assert sorted(p.name for p in ckpt.iterdir()) == ["3"]


@pytest.mark.unit
def test_a_step_orbax_cannot_delete_is_kept_and_the_saves_go_on(tmp_path, monkeypatch):
    """A step beyond ``keep`` whose deletion fails (``OSError``, e.g. a folder without write permission) is kept and
    reported by ``take_undeleted``; the later saves and deletions go on (orbax alone would raise the error from the
    next save and stop the run)."""

    def refuse_step_1(delete, deleter, step):
        if step == 1:
            raise PermissionError(13, "Permission denied", "1/state")
        delete(deleter, step)

    _orbax_step_deletion(monkeypatch, refuse_step_1)
    exp = build(plan(make_cfg({"data": {"name": "synthetic"}, "mesh": {"devices": 2}})))
    ckpt = tmp_path / "ckpt"
    saver = checkpoint.Saver(ckpt, keep=2)
    for step in range(1, 6):
        saver.save(exp.state, step, {"step": step}, exp.mode)
    saver.close()
    assert saver.take_undeleted() == [(1, "PermissionError: [Errno 13] Permission denied: '1/state'")]
    assert saver.take_undeleted() == []  # each reported once
    assert sorted(p.name for p in ckpt.iterdir()) == ["1", "4", "5"]
    assert checkpoint.complete_steps(ckpt) == [1, 4, 5]


def _run_checkpoints(tmp_path, exp, keep=3):
    """A run's checkpoints (``RunCheckpoints``) in ``tmp_path / "ckpt"``, 10 steps per epoch, 5 steps."""
    cfg = CheckpointConfig(dir=str(tmp_path / "ckpt"), keep=keep, resume="never")
    return checkpoint.RunCheckpoints(
        checkpoint.prepare(cfg, tmp_path),
        cfg_dict={},
        mode=exp.mode,
        mesh_shape=[2],
        global_batch=64,
        steps_per_epoch=10,
        n_steps=5,
        run_dir=tmp_path,
    )


@pytest.mark.unit
def test_the_run_stops_once_more_than_keep_steps_could_not_be_deleted(tmp_path, monkeypatch, capsys):
    """When every deletion fails the folder would grow without bound: the periodic save after which more than
    ``keep`` steps are undeleted raises ``UndeletableError`` (one line naming the folder and the fix), after a warning
    per step; the final save does not (the run ends anyway); every step saved is kept."""

    def refuse(delete, deleter, step):
        raise PermissionError(13, "Permission denied", "meta")

    _orbax_step_deletion(monkeypatch, refuse)
    exp = build(plan(make_cfg({"data": {"name": "synthetic"}, "mesh": {"devices": 2}})))
    ckpt = tmp_path / "ckpt"
    ckpts = _run_checkpoints(tmp_path, exp, keep=1)
    for step in (1, 2, 3):  # the deletions of steps 1 and 2 fail in the finalizes of saves 2 and 3
        ckpts.save(exp.state, step, None, "periodic")
    with pytest.raises(
        checkpoint.UndeletableError,
        match=r"^2 checkpoints older than the newest checkpoint\.keep=1 could not be deleted from .*ckpt \(the last, "
        r"step 2: PermissionError: \[Errno 13\] Permission denied: 'meta'\); every checkpoint saved is kept",
    ):
        ckpts.save(exp.state, 4, None, "periodic")
    ckpts.save(exp.state, 5, None, "final")  # the run's last save: no error
    ckpts.close()
    assert checkpoint.complete_steps(ckpt) == [1, 2, 3, 4, 5]
    warned = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: could not delete")]
    assert [line.split(" (older")[0].rsplit("/", 1)[1] for line in warned] == ["1", "2", "3", "4"]  # once each


@pytest.mark.unit
def test_a_checkpoint_that_cannot_be_written_stops_at_its_save_with_one_line(tmp_path, monkeypatch):
    """A save whose step folder cannot be created (a full disk, a folder no longer writable) raises
    ``CheckpointWriteError`` from that save, in the training thread: one line naming the step, the folder, the error and
    the newest complete checkpoint; the run's summary then names that one, and ``close`` returns at once. (With orbax
    creating the folder in the background the error surfaced only at the next save or at close, and orbax's writer
    threads then waited 300 s for the folder's "created" signal before the process could exit.)"""
    from orbax.checkpoint._src.path import atomicity

    original = atomicity._create_tmp_directory

    async def refuse_step_2(makedir, tmp_dir, *args, **kwargs):
        if Path(str(tmp_dir)).name.startswith("2."):
            raise PermissionError(1, "Operation not permitted", str(tmp_dir))
        return await original(makedir, tmp_dir, *args, **kwargs)

    monkeypatch.setattr(atomicity, "_create_tmp_directory", refuse_step_2)
    exp = build(plan(make_cfg({"data": {"name": "synthetic"}, "mesh": {"devices": 2}})))
    ckpts = _run_checkpoints(tmp_path, exp)
    ckpts.save(exp.state, 1, None, "periodic")
    ckpt = tmp_path / "ckpt"
    with pytest.raises(
        checkpoint.CheckpointWriteError,
        match=rf"^could not write the checkpoint of step 2 in {ckpt} \(PermissionError: \[Errno 1\] Operation not "
        rf"permitted: '{ckpt}/2\.orbax-checkpoint-tmp'\); the newest complete checkpoint is {ckpt}/1; free space or "
        r"make the folder writable, then run the same command to continue from it$",
    ):
        ckpts.save(exp.state, 2, None, "periodic")
    # the run is stopping for that error: a write error at close (a disk that is still full) is not a second one
    monkeypatch.setattr(ckpts.saver.manager, "wait_until_finished", lambda: (_ for _ in ()).throw(OSError(28, "full")))
    t0 = time.monotonic()
    ckpts.close()
    assert time.monotonic() - t0 < 10
    assert checkpoint.complete_steps(ckpt) == [1]
    assert ckpts.summary()["checkpoint/last_path"] == str(ckpt / "1")


@pytest.mark.unit
def test_an_unwritable_checkpoint_folder_with_checkpoints_is_not_to_be_abandoned(tmp_path, monkeypatch):
    """At start, a checkpoint folder that cannot be written but holds checkpoints gets the advice to make it
    writable and rerun (continuing from them), not to choose another folder (which would start over)."""
    import tempfile

    from training.validate import check_writable_folder

    def refuse(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    empty, held = tmp_path / "empty", tmp_path / "held"
    empty.mkdir()
    (held / "500").mkdir(parents=True)
    with pytest.raises(
        ConfigError, match=r"cannot be written \(Operation not permitted in .*empty\); choose a folder you"
    ):
        check_writable_folder("checkpoint.dir", empty)
    with pytest.raises(
        ConfigError,
        match=r"^checkpoint.dir=.*held cannot be written \(Operation not permitted in .*held\); it holds checkpoints "
        r"to continue from: make it writable again and run the same command \(or choose another folder to start "
        r"over\)$",
    ):
        check_writable_folder("checkpoint.dir", held)


@pytest.mark.unit
def test_nan_guard_in_saver(tmp_path):
    exp = build(plan(make_cfg({"data": {"name": "synthetic"}, "mesh": {"devices": 4}, "parallel": {"name": "pmap"}})))
    saver = checkpoint.Saver(tmp_path / "ckpt", keep=3)
    saver.save(exp.state, 1, {"step": 1}, exp.mode)
    bad = exp.state.replace(
        opt_state=jax.tree.map(lambda x: x * np.inf if x.dtype == np.float32 else x, exp.state.opt_state)
    )
    with pytest.raises(
        checkpoint.NonFiniteError,
        match=r"^optimizer state are not finite after step 2: no "
        r"checkpoint written; the last good checkpoint is .*/1 ",
    ):
        saver.save(bad, 2, {"step": 2}, exp.mode)
    saver.close()
    assert checkpoint.complete_steps(tmp_path / "ckpt") == [1]


@pytest.mark.unit
def test_a_refused_first_save_waits_for_orbaxs_cleanup(tmp_path):
    """A run whose first save is refused (non-finite state) never calls orbax's save, the only call that waits for
    the clean-up of leftover temporary folders that creating the manager starts in the background; ``close`` waits
    for it, so the process does not exit with it running (an absl traceback at interpreter shutdown)."""
    exp = build(plan(make_cfg({"data": {"name": "synthetic"}, "mesh": {"devices": 2}})))
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "7.orbax-checkpoint-tmp-123").mkdir()  # an earlier run's unfinished save
    saver = checkpoint.Saver(tmp_path / "ckpt", keep=3)
    assert saver.manager._cleanup_tmp_directory_future is not None  # orbax 0.12.8's background clean-up
    bad = exp.state.replace(params=jax.tree.map(lambda x: x * np.nan, exp.state.params))
    with pytest.raises(checkpoint.NonFiniteError, match=r"^parameters are not finite after step 1: no checkpoint"):
        saver.save(bad, 1, {"step": 1}, exp.mode)
    saver.close()
    assert saver.manager._cleanup_tmp_directory_future is None  # awaited (orbax resets it once done)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == []


# orbax's event loop ends after the broken folder's pending reads (store._run_settled): nothing unraisable is left
@pytest.mark.unit
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_truncated_checkpoint_is_skipped_with_warning(tmp_path, capsys):
    cfg = make_cfg({"data": {"name": "synthetic"}, "mesh": {"devices": 2}, "parallel": {"name": "fsdp"}})
    _, _, exp, _ = run_steps(cfg, random_dataset(512), 1)
    ckpt = tmp_path / "ckpt"
    saver = checkpoint.Saver(ckpt, keep=5)
    at = lambda s: exp.state.replace(step=jax.device_put(np.int32(s), exp.state.step.sharding))
    saver.save(at(10), 10, {"step": 10}, exp.mode)
    saver.wait()
    saved10 = checkpoint.read_arrays(ckpt / "10")
    saver.save(at(20), 20, {"step": 20}, exp.mode)
    saver.close()
    # Truncate step 20 mid-write: drop its array data files; and leave an unfinished save of step 30.
    data_files = [f for f in (ckpt / "20" / "state").rglob("*") if f.is_file() and f.parent.name == "d"]
    assert data_files
    for f in data_files:
        f.unlink()
    shutil.copytree(ckpt / "10", ckpt / "30.orbax-checkpoint-tmp")
    capsys.readouterr()

    plan_ = checkpoint.prepare(CheckpointConfig(dir=str(ckpt)), tmp_path)
    fresh = build(plan(cfg))
    restored = checkpoint.resume(plan_, fresh.mode, fresh.state)
    err = capsys.readouterr().err.splitlines()
    assert restored.step == 10 and restored.path == ckpt / "10"
    assert len(err) == 2, err  # one line each: the unfinished save, the damaged step (which array failed first varies)
    assert err[0] == (
        f"warning: ignoring {ckpt / '30.orbax-checkpoint-tmp'}: a checkpoint save that never finished "
        f"(the process stopped while writing it)"
    )
    assert err[1].startswith(f"warning: checkpoint {ckpt / '20'} is incomplete or corrupt (ValueError: NOT_FOUND: ")
    assert err[1].endswith(f"), moved aside to 20.corrupt; resuming from the newest complete one, {ckpt / '10'}")
    assert (ckpt / "20.corrupt").is_dir() and checkpoint.complete_steps(ckpt) == [10]
    got = {
        checkpoint.store._name(p): np.asarray(x)
        for p, x in jax.tree_util.tree_flatten_with_path(state_to_host(restored.state))[0]
    }
    assert_bitwise_equal(got, saved10)


def test_resume_over_a_damaged_step_is_one_warning_line(tmp_path):
    """A rerun whose newest checkpoint has a truncated file resumes from the newest complete one with one warning line
    (naming the damaged step, where it was moved, and the step used), no traceback (orbax's pending reads end before
    its event loop closes: before, each printed "Event loop is closed" or "Exception ignored in: <coroutine ...>"),
    and trains to the same final state as the undamaged run did."""
    run, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints"
    command = ["data=synthetic", "train.steps=6", "checkpoint.every=2", "checkpoint.keep=5", "wandb=disabled"]
    first = run_train(run, *command)
    assert first.returncode == 0, first.stderr[-3000:]
    final = checkpoint.read_arrays(ckpt / "6")
    damage_step(ckpt / "6")

    # another run resuming from this run's folder (checkpoint.resume=<folder>) reads it and moves nothing there
    other = run_train(tmp_path / "other", *command, f"checkpoint.resume={ckpt}")
    assert other.returncode == 0, other.stderr[-3000:]
    (line,) = [ln for ln in other.stderr.splitlines() if "window" not in ln]
    assert line.endswith(f"); resuming from the newest complete one, {ckpt / '4'}") and "moved aside" not in line
    assert sorted(p.name for p in ckpt.iterdir()) == ["2", "4", "6"]

    again = run_train(run, *command)
    assert again.returncode == 0, again.stderr[-3000:]
    out = again.stdout + again.stderr
    assert "Traceback" not in out and "Exception ignored" not in out, again.stderr[-3000:]
    (line, kept) = [ln for ln in again.stderr.splitlines() if "window" not in ln]  # (a 2-step run: no window)
    assert kept.startswith(f"warning: {run / 'summary.json'} already existed: kept as summary.previous-")
    assert line.startswith(f"warning: checkpoint {ckpt / '6'} is incomplete or corrupt (ValueError: ")
    assert line.endswith(f"), moved aside to 6.corrupt; resuming from the newest complete one, {ckpt / '4'}")
    assert checkpoint.complete_steps(ckpt) == [2, 4, 6] and (ckpt / "6.corrupt").is_dir()
    assert_bitwise_equal(checkpoint.read_arrays(ckpt / "6"), final)  # steps 5 and 6 again, from step 4


# A background checkpoint write that fails on a full disk: TensorStore's array files (a file-size limit makes the
# write fail as a full disk does, with EFBIG), or the metadata orbax writes itself (ENOSPC, injected).
FULL_DISK = {
    "arrays": (  # the MLP's arrays hold over 800 KB each; everything else a run writes is smaller
        "import resource\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (512 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))",
        "File too large",
    ),
    "metadata": (
        "import errno\n"
        "from orbax.checkpoint._src.handlers import json_checkpoint_handler as handler\n"
        "async def full(self, item, directory):\n"
        "    raise OSError(errno.ENOSPC, 'No space left on device', str(directory / 'metadata'))\n"
        "handler.JsonCheckpointHandler._save_fn = full",
        "[Errno 28] No space left on device",
    ),
}


@pytest.mark.parametrize("where", sorted(FULL_DISK))
def test_a_disk_that_fills_during_a_background_checkpoint_write_is_one_line(tmp_path, where):
    """The periodic save of step 2 fails in orbax's background threads: the run stops at the next save with one
    ``error:`` line naming the step, the reason and what to do, and nothing else on the console: no traceback from
    orbax's writer threads (logged with their tracebacks, 3 times) nor from TensorStore's callbacks on orbax's
    closed event loop ("Event loop is closed")."""
    run, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints"
    before, reason = FULL_DISK[where]
    cmd = train_probe_cmd(
        before, "", f"hydra.run.dir={run}", "data=synthetic", "train.steps=6", "checkpoint.every=2", "wandb=offline"
    )
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out and "Exception ignored" not in out, out[-3000:]
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: could not write the checkpoint of step 2 in {ckpt} (")
    assert reason in line and line.endswith(
        "); no complete checkpoint is left; free space or make the folder writable, then run the same command"
    )
    assert summary(run)["status"] == "failed" and summary(run)["error"] == line[len("error: ") :]
    assert checkpoint.complete_steps(ckpt) == []


@pytest.mark.unit
def test_orbax_coroutines_end_before_their_event_loop_closes(monkeypatch):
    """orbax runs each read and write on an event loop of its own; when one task fails (a truncated file, a full disk)
    the others go on: the loop is closed only once they have ended (``store._run_settled``), so none is collected
    unfinished ("Exception ignored in: <coroutine ...>") nor calls back into a closed loop."""
    import asyncio
    import gc

    from orbax.checkpoint._src import asyncio_utils

    checkpoint.store._ocp()
    assert asyncio_utils._run_sync_via_new_loop is checkpoint.store._run_settled
    unraisable: list = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    ended: list[int] = []

    async def read(i: int):
        try:
            await asyncio.sleep(0.02 * i)
            ended.append(i)
        except BaseException as e:  # as orbax wraps a shard's read error (and the GeneratorExit of a collected one)
            raise RuntimeError(f"read {i} failed") from e

    async def truncated():
        raise ValueError("Truncated Zstd-compressed stream")

    async def restore():
        await asyncio.gather(truncated(), *(read(i) for i in (1, 2, 3)))

    with pytest.raises(ValueError, match="Truncated"):
        asyncio_utils.run_sync(restore())
    gc.collect()
    assert ended == [1, 2, 3] and unraisable == []

    def ctrl_c():  # Python raises it where the main thread is: here in the event loop, between tasks
        raise KeyboardInterrupt

    async def restore_interrupted():  # a Ctrl-C while orbax reads: the reads still end (in a short wait)
        asyncio.get_running_loop().call_later(0.01, ctrl_c)
        await asyncio.gather(*(read(i) for i in (4, 5)))

    with pytest.raises(KeyboardInterrupt):
        asyncio_utils.run_sync(restore_interrupted())
    gc.collect()
    assert ended == [1, 2, 3, 4, 5] and unraisable == []


@pytest.mark.unit
def test_a_failed_orbax_import_in_its_background_thread_prints_nothing(monkeypatch):
    """The orbax-import thread (``preload_orbax``) leaves a failed import to the run's own import of orbax, which
    raises it where the run reports it: no "Exception in thread orbax-import" traceback beside it."""
    seen: list = []
    monkeypatch.setattr(threading, "excepthook", seen.append)
    monkeypatch.setattr(checkpoint.store, "_preload", None)
    monkeypatch.delitem(sys.modules, "orbax.checkpoint")  # (not imported yet, as in a run's start-up)

    def broken():
        raise ImportError("cannot import name 'ocdbt' from 'tensorstore'")

    monkeypatch.setattr(checkpoint.store, "_ocp", broken)
    checkpoint.preload_orbax()
    checkpoint.wait_for_orbax()
    assert checkpoint.store._preload is not None and not checkpoint.store._preload.is_alive()
    assert seen == []


# ---- settings ---------------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_settings_are_validated(tmp_path):
    with pytest.raises(ConfigError, match=r"^checkpoint\.every=-1 must be >= 0"):
        checkpoint.prepare(CheckpointConfig(every=-1), tmp_path)
    with pytest.raises(ConfigError, match=r"^checkpoint\.keep=0 must be >= 1"):
        checkpoint.prepare(CheckpointConfig(keep=0), tmp_path)
    with pytest.raises(ConfigError, match=r"^checkpoint\.dir=null with 2 processes"):
        checkpoint.default_directory(tmp_path, 2, environ={})
    assert checkpoint.default_directory(tmp_path, 2, environ={"SLURM_JOB_ID": "77"}) == Path("checkpoints/slurm-77")
    assert checkpoint.default_directory(tmp_path, 1, environ={}) == tmp_path / "checkpoints"
    # a job of a sweep: its own folder, the same for its processes and for the sweep resumed under a new SLURM job id
    assert checkpoint.default_directory(tmp_path, 2, environ={"SLURM_JOB_ID": "77"}, in_sweep=True) == (
        tmp_path / "checkpoints"
    )
    p = checkpoint.prepare(CheckpointConfig(), tmp_path)
    assert (p.directory, p.resume, p.every_steps(234)) == (tmp_path / "checkpoints", "auto", 234)
    assert [d for d in range(1, 500) if p.saves_at(d, 480, 234)] == [234, 468, 480]
    p0 = checkpoint.prepare(CheckpointConfig(every=0), tmp_path)
    assert [d for d in range(1, 500) if p0.saves_at(d, 480, 234)] == [480]
    assert checkpoint.prepare(CheckpointConfig(enabled=False), tmp_path).directory is None
    (tmp_path / "ck" / "40").mkdir(parents=True)
    with pytest.raises(
        ConfigError,
        match=r"^checkpoint\.resume=never but checkpoint\.dir=.* already holds "
        r"checkpoints \(steps \[40\]\)",
    ):
        checkpoint.prepare(CheckpointConfig(dir=str(tmp_path / "ck"), resume="never"), tmp_path)


# ---- python -m evaluate ------------------------------------------------------------------------------------------
def test_evaluate_matches_the_runs_final_eval(tmp_path):
    """The final checkpoint of a run, evaluated by ``evaluate`` on other devices, gives the run's eval numbers."""
    from training.run import run_and_report
    import evaluate

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = make_cfg(
        {
            "data": {"name": "synthetic", "eval_size": 1000},
            "mesh": {"devices": 4},
            "wandb": {"mode": "disabled"},
            "checkpoint": {"dir": str(tmp_path / "ckpt")},
            "train": {"steps": 12, "log_every": 4, "eval_batch": 1000},
        }
    )
    assert run_and_report(cfg, run_dir)
    s = summary(run_dir)
    out = evaluate.evaluate_checkpoint(tmp_path / "ckpt", ["mesh.devices=2"])
    assert out["step"] == 12 and out["examples"] == 1000 and out["checkpoint"] == str(tmp_path / "ckpt" / "12")
    assert out["eval/accuracy"] == s["eval/accuracy"]
    assert abs(out["eval/loss"] - s["eval/loss"]) <= 1e-6 * abs(s["eval/loss"])
    assert evaluate.main([str(tmp_path / "missing")]) == 1


# ---- metrics.jsonl continuation, data-order warnings ---------------------------------------------------------
@pytest.mark.unit
def test_metrics_continue_without_repeats_or_gaps(tmp_path):
    from training.report import Reporter

    old = tmp_path / "old"
    old.mkdir()
    lines = [{"step": 0, "perf/compile_time_s": 1.5}] + [{"step": s, "train/loss": 1.0 / s} for s in range(1, 31)]
    lines.insert(21, {"step": 20, "eval/loss": 0.5})  # an eval record of step 20 (train.eval_every)
    text = "".join(json.dumps(r) + "\n" for r in lines) + '{"step": 31, "train/lo'  # crash while writing
    (old / "metrics.jsonl").write_text(text)

    # Resumed from step 20 in the same folder: records 21..31 go, step 20's records stay.
    same = Reporter(old)
    assert same.continue_metrics(old / "metrics.jsonl", 20, 100) == 22
    same.log([{"step": 21, "train/loss": 0.25}])
    same.close()
    got = [json.loads(line) for line in (old / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == list(range(0, 21)) + [20, 21]
    assert got[-1] == {"step": 21, "train/loss": 0.25} and got[-2] == {"step": 20, "eval/loss": 0.5}

    # Resumed in a new run folder: the history up to the restored step is copied there.
    new = tmp_path / "new"
    new.mkdir()
    assert Reporter(new).continue_metrics(old / "metrics.jsonl", 10, 100) == 11
    assert [json.loads(line)["step"] for line in (new / "metrics.jsonl").read_text().splitlines()] == list(range(11))

    # Restored at the final step: the final-evaluation record is written again by the new run, so it goes.
    fin = tmp_path / "fin"
    fin.mkdir()
    (fin / "metrics.jsonl").write_text('{"step": 5, "train/loss": 1.0}\n{"step": 5, "eval/loss": 2.0}\n')
    assert Reporter(fin).continue_metrics(None, 5, 5) == 1


@pytest.mark.unit
def test_data_order_warnings():
    saved = {"global_batch": 256, "steps_per_epoch": 234, "config": {"train": {"seed": 0}, "data": {"name": "mnist"}}}
    same = dict(global_batch=256, seed=0, steps_per_epoch=234, data="mnist")
    assert checkpoint.data_order_warnings(saved, **same) == []
    assert checkpoint.data_order_warnings(saved, **{**same, "global_batch": 128, "steps_per_epoch": 468}) == [
        "train.global_batch is 128 but the checkpoint was trained with 256: the data order after the restored "
        "step is not the one the saved run would have seen",
        "steps per epoch is 468 but the checkpoint was trained with 234: the data order after the restored step "
        "is not the one the saved run would have seen",
    ]


@pytest.mark.unit
def test_config_changes_are_listed():
    saved = as_dict(make_cfg())
    now = as_dict(
        make_cfg(
            {
                "mesh": {"devices": 4},
                "parallel": {"name": "pmap"},
                "checkpoint": {"dir": "/x"},
                "wandb": {"mode": "offline"},
            }
        )
    )
    assert checkpoint.config_changes(saved, now) == [
        "mesh.devices: None -> 4",
        "parallel.name: 'jit_sharding' -> 'pmap'",
    ]
    assert checkpoint.config_changes(saved, saved) == []
    # another mode: its own keys (fsdp_rules, min_shard_bytes) are not changes the user made; the name says it
    fsdp = as_dict(make_cfg({"parallel": {"name": "fsdp"}}))
    assert {"fsdp_rules", "min_shard_bytes"} <= set(fsdp["parallel"]) - set(saved["parallel"])
    assert checkpoint.config_changes(saved, fsdp) == ["parallel.name: 'jit_sharding' -> 'fsdp'"]
    assert checkpoint.config_changes(fsdp, saved) == ["parallel.name: 'fsdp' -> 'jit_sharding'"]
    # a key both options have (lr) still shows its change; adam's b1/b2/eps and sgd's momentum do not
    sgd = as_dict(make_cfg({"optim": {"name": "sgd", "lr": 0.5}}))
    assert checkpoint.config_changes(saved, sgd) == ["optim.lr: 0.001 -> 0.5", "optim.name: 'adam' -> 'sgd'"]


# ---- resume rules, restarts after the final save, special characters in the folder --------------------------
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
            train__allow_exploded_loss=True,  # the fix the exploded-loss error names
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


def test_history_windows_from_metrics(tmp_path):
    import json

    from training.checkpoint import history_windows

    path = tmp_path / "metrics.jsonl"
    records = [
        {"step": 1, "train/loss": 2.3},
        {"step": 10, "perf/step_time_s": 0.5},
        {"step": 20, "perf/step_time_s": 0.25},
        {"step": 25, "perf/step_time_s": 0.2},  # a shorter last window
        {"step": 30, "perf/step_time_s": 0.1},  # after the checkpoint: not part of the history
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\nnot json\n")
    assert history_windows(path, 25) == [(5.0, 10), (2.5, 10), (1.0, 5)]
    assert history_windows(tmp_path / "missing.jsonl", 25) == []


def test_restart_after_the_final_save_reports_the_runs_windows_and_no_nan(tmp_path):
    import json

    from utils import run_train

    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    args = ["data=synthetic", "train.steps=60", "train.log_every=10", f"checkpoint.dir={ckpt}", "wandb.mode=disabled"]
    proc = run_train(run_dir, *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").unlink()  # what SIGKILL between the final save and the summary leaves
    proc = run_train(run_dir, *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "nan" not in proc.stdout + proc.stderr and "only 0 logging window" not in proc.stderr
    again = json.loads((run_dir / "summary.json").read_text())
    assert again["perf/windows_measured"] == first["perf/windows_measured"] == 5
    assert again["perf/examples_per_s_median"] == pytest.approx(first["perf/examples_per_s_median"], rel=1e-9)
    assert again["perf/examples_per_s_p25"] == pytest.approx(first["perf/examples_per_s_p25"], rel=1e-9)
    assert again["train/loss"] == first["train/loss"] and again["eval/accuracy"] == first["eval/accuracy"]
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == list(range(1, 61))  # every step exactly once
    assert [r["step"] for r in records if "eval/loss" in r] == [60]  # one final evaluation


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
    assert sorted(p.name for p in ckpt.iterdir()) == [".lock", "2", "4"]  # .lock: which run writes there
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
    assert "corrupt" not in proc.stderr and sorted(p.name for p in ckpt.iterdir()) == [".lock", "2", "4", "6"]


# ---- the data a checkpoint was trained on ------------------------------------------------------------------
@pytest.mark.unit
def test_data_change_compares_size_and_hash_wherever_the_file_lies():
    from training.checkpoint.policy import data_change

    a = {"kind": "file", "file": "/d/a.txt", "bytes": 20531, "blake2b": "89151a0b0dcd" + "0" * 20}
    assert data_change(a, {**a, "file": "/elsewhere/copy.txt"}) is None  # the same bytes: the same data
    assert data_change(None, a) is None and data_change(a, None) is None  # unknown: a checkpoint saved before
    edited = {**a, "blake2b": "6bbd5127db70" + "0" * 20}
    assert data_change(a, edited) == (
        "/d/a.txt was 20,531 bytes, blake2b 89151a0b0dcd; it is now 20,531 bytes, blake2b 6bbd5127db70"
    )
    assert data_change(a, {**edited, "file": "/d/b.txt", "bytes": 9}) == (
        "it was /d/a.txt (20,531 bytes, blake2b 89151a0b0dcd); this run reads /d/b.txt (9 bytes, blake2b 6bbd5127db70)"
    )
    mnist = {"kind": "tfds", "dataset": "mnist", "version": "3.0.1", "split": "train", "examples": 60000}
    assert data_change(mnist, dict(mnist)) is None
    assert data_change(mnist, {**mnist, "version": "3.0.2"}) == (
        "it was mnist 3.0.1 (train, 60,000 examples); this run reads mnist 3.0.2 (train, 60,000 examples)"
    )


def test_a_text_file_edited_in_place_is_refused_on_resume(tmp_path, capsys):
    """An edit of the same length (it changes neither the config nor steps per epoch) used to resume silently on
    the new text. The resume is refused in one line naming the file, nothing saved changes; with
    checkpoint.allow_data_change=true it continues with one warning and records the new text; a checkpoint saved
    before fingerprints were recorded resumes with one warning. Moving the file (another data.path, the same
    bytes) is allowed where both sides have a fingerprint."""
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"{i} the quick brown fox jumps over the lazy dog\n" for i in range(300)))
    run_dir = tmp_path / "run"
    args = [
        "model=gpt",
        "model.depth=1",
        "model.context=16",
        "train.global_batch=8",
        "data=text",
        f"data.path={text}",
        "checkpoint.every=2",
        "train.sample_tokens=0",
        "wandb.mode=disabled",
    ]
    first = run_train(run_dir, *args, "train.steps=2")
    assert first.returncode == 0, first.stderr[-2000:]
    saved = json.loads((run_dir / "checkpoints" / "2" / "meta" / "metadata").read_text())
    assert saved["data_fingerprint"]["file"] == str(text) and saved["data_fingerprint"]["bytes"] == 14290
    before = {p: p.stat().st_mtime_ns for p in (run_dir / "checkpoints").rglob("*")}

    text.write_text(text.read_text().replace("fox", "cat"))  # the same length
    refused = run_train(run_dir, *args, "train.steps=4")
    assert refused.returncode == 1
    errors = [ln for ln in refused.stderr.splitlines() if ln.startswith("error:")]
    old_hash, new_hash = saved["data_fingerprint"]["blake2b"][:12], _blake2b(text)[:12]
    assert errors == [
        f"error: checkpoint {run_dir / 'checkpoints' / '2'} was trained on other data ({text} was 14,290 bytes, "
        f"blake2b {old_hash}; it is now 14,290 bytes, blake2b {new_hash}); put back the data it was trained on, give "
        "this run its own checkpoint.dir, or set checkpoint.allow_data_change=true to continue it on this data"
    ], refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr
    assert {p: p.stat().st_mtime_ns for p in (run_dir / "checkpoints").rglob("*")} == before
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"
    import evaluate  # evaluates on the new text's validation split, and says so

    capsys.readouterr()
    assert evaluate.evaluate_checkpoint(run_dir / "checkpoints" / "2")["step"] == 2
    assert f"warning: evaluating {run_dir / 'checkpoints' / '2'} on other data than it was trained on ({text} was" in (
        capsys.readouterr().err
    )

    allowed = run_train(run_dir, *args, "train.steps=4", "checkpoint.allow_data_change=true")
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert (
        f"warning: resuming {run_dir / 'checkpoints' / '2'} on other data, as checkpoint.allow_data_change=true "
        f"allows ({text} was 14,290 bytes" in allowed.stderr
    )
    meta = json.loads((run_dir / "checkpoints" / "4" / "meta" / "metadata").read_text())
    assert meta["data_fingerprint"]["blake2b"] == _blake2b(text)  # the text it now continues on

    from data.text import read_text_file
    from training.checkpoint.plan import CheckpointPlan
    from training.checkpoint.resuming import check_resume_settings

    # the file moved (another data.path, the same bytes): the same data, so the resume is allowed
    moved = tmp_path / "moved.txt"
    shutil.copy(text, moved)
    cfg_moved = {**meta["config"], "data": {**meta["config"]["data"], "path": str(moved)}}
    plan_ = CheckpointPlan(directory=run_dir / "checkpoints", every=2, keep=3, resume="auto", resume_path=None)
    check_resume_settings(plan_, cfg_moved, meta["global_batch"], read_text_file(moved, "data.path")[1])

    # a checkpoint saved before fingerprints were recorded: unknown, so it resumes (one warning)
    del meta["data_fingerprint"]
    (run_dir / "checkpoints" / "4" / "meta" / "metadata").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=r"was trained with other settings \(data\.path: "):
        check_resume_settings(plan_, cfg_moved, meta["global_batch"], read_text_file(moved, "data.path")[1])
    capsys.readouterr()
    check_resume_settings(plan_, meta["config"], meta["global_batch"], read_text_file(text, "data.path")[1])
    assert capsys.readouterr().err.splitlines() == [
        f"warning: checkpoint {run_dir / 'checkpoints' / '4'} records no fingerprint of its training data (saved "
        f"before they were): that {text} is the text it was trained on is not checked"
    ]


def _blake2b(path: Path) -> str:
    import hashlib

    return hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()


@pytest.mark.unit
def test_resume_from_a_sweep_or_run_folder_names_the_checkpoint_folder_to_give(tmp_path):
    """checkpoint.resume=<sweep folder> used to try each job folder as a step ("incomplete or corrupt" warnings);
    a run folder was "no checkpoint". Each is now named, with the folder to give, which resumes."""
    from training.checkpoint.plan import prepare
    from utils import fake_sweep

    sweep = fake_sweep(tmp_path / "sweep")
    cfg = CheckpointConfig(resume=str(sweep))
    with pytest.raises(ConfigError) as e:
        prepare(cfg, tmp_path / "run")
    assert str(e.value) == (
        f"checkpoint.resume={sweep} is a sweep folder (jobs 0, 1), not a checkpoint folder; give one run's checkpoint "
        f"folder, e.g. {sweep / '0'}/checkpoints"
    )
    with pytest.raises(ConfigError) as e:
        prepare(CheckpointConfig(resume=str(sweep / "0")), tmp_path / "run")
    assert str(e.value) == (
        f"checkpoint.resume={sweep / '0'} is a run folder, not a checkpoint folder; give its checkpoint folder, "
        f"checkpoint.resume={sweep / '0' / 'checkpoints'} (or one <step> folder in it)"
    )
    assert prepare(CheckpointConfig(resume=str(sweep / "0" / "checkpoints")), tmp_path / "run").resume == "path"


def test_a_checkpoint_past_the_last_step_advice_works_when_followed(tmp_path):
    """The line's fixes, each followed: train.steps up to the checkpoint's step (the run ends ok), or a fresh
    start with checkpoint.resume=never and a checkpoint.dir of its own (it used to advise resume=never alone, which
    is refused while checkpoint.dir holds checkpoints)."""
    run_dir = tmp_path / "run"
    args = ("data=synthetic", "wandb.mode=disabled")
    assert run_train(run_dir, *args, "train.steps=6").returncode == 0
    short = run_train(run_dir, *args, "train.steps=4")
    assert short.returncode == 1
    step6 = run_dir / "checkpoints" / "6"
    assert [ln for ln in short.stderr.splitlines() if ln.startswith("error:")] == [
        f"error: checkpoint {step6} is at step 6, past this run's 4 steps; raise train.steps (or train.epochs) to "
        "reach step 6, or start afresh with checkpoint.resume=never and a checkpoint.dir of its own"
    ]
    complete = run_train(run_dir, *args, "train.steps=6")
    assert complete.returncode == 0, complete.stderr[-2000:]
    assert summary(run_dir)["status"] == "ok" and summary(run_dir)["train/steps"] == 6
    fresh = run_train(run_dir, *args, "train.steps=4", "checkpoint.resume=never", f"checkpoint.dir={tmp_path / 'new'}")
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert summary(run_dir)["train/steps"] == 4 and (tmp_path / "new" / "4").is_dir() and step6.is_dir()


def test_a_refused_resume_from_a_path_says_to_leave_the_path_out(tmp_path):
    """checkpoint.resume=<another run's folder> with other settings: "give this run its own checkpoint.dir" did not
    work there (that path is resumed again whatever the folder); the line says to leave the path out, which works."""
    args = ("data=synthetic", "train.steps=2", "wandb.mode=disabled")
    assert run_train(tmp_path / "a", *args, f"checkpoint.dir={tmp_path / 'ckA'}").returncode == 0
    own = (*args, "train.seed=1", f"checkpoint.dir={tmp_path / 'ckB'}")
    refused = run_train(tmp_path / "b", *own, f"checkpoint.resume={tmp_path / 'ckA'}")
    assert [ln for ln in refused.stderr.splitlines() if ln.startswith("error:")] == [
        f"error: checkpoint {tmp_path / 'ckA' / '2'} was trained with other settings (train.seed: 0 -> 1); to resume "
        f"it set them back, otherwise leave out checkpoint.resume={tmp_path / 'ckA'}, saving into a checkpoint.dir "
        "of this run's own (the checkpoint is kept as it is)"
    ]
    followed = run_train(tmp_path / "b", *own)
    assert followed.returncode == 0, followed.stderr[-2000:]
    assert summary(tmp_path / "b")["status"] == "ok" and (tmp_path / "ckB" / "2").is_dir()


@pytest.mark.unit
def test_orbaxs_background_import_prints_nothing_when_it_fails_and_the_main_threads_import_raises(monkeypatch):
    """A run that stops at bad input while orbax is still being imported on the ``orbax-import`` thread exits
    under that import: its traceback followed the one-line error (now and then). The thread prints nothing; a
    real import error is raised, with its traceback, by the main thread's own import."""
    import threading

    from training.checkpoint import store

    def broken():
        raise ImportError("cannot import name 'x' (the interpreter is shutting down)")

    printed = []
    monkeypatch.setattr(threading, "excepthook", printed.append)
    monkeypatch.setattr(store, "_ocp", broken)
    thread = threading.Thread(target=store._import_quietly, name="orbax-import")
    thread.start()
    thread.join()
    assert printed == []
    with pytest.raises(ImportError, match="shutting down"):
        store._ocp()
    monkeypatch.undo()
    thread = threading.Thread(target=store._import_quietly, name="orbax-import")  # the real import: also quiet
    thread.start()
    thread.join()
    assert "orbax.checkpoint" in sys.modules and printed == []


@pytest.mark.unit
def test_an_entry_named_like_a_step_that_is_not_a_folder_is_refused_before_training(tmp_path, capsys):
    """A broken symbolic link ``20`` in checkpoint.dir: a resume trained to step 20, failed at its save with
    "free space or make the folder writable" (wrong) and left ``20.orbax-checkpoint-tmp``. Now the run is refused
    before training in one line naming the entry, nothing in the folder changes, and the fix works."""
    from training.run import run_and_report

    ckpt = tmp_path / "ckpt"

    def cfg(steps):
        return make_cfg(
            {
                "data": {"name": "synthetic", "eval_size": 500},
                "mesh": {"devices": 2},
                "wandb": {"mode": "disabled"},
                "checkpoint": {"dir": str(ckpt), "every": 10},
                "train": {"steps": steps, "log_every": 5, "eval_batch": 500},
            }
        )

    for run in ("a", "b"):
        (tmp_path / run).mkdir()
    assert run_and_report(cfg(10), tmp_path / "a")
    (ckpt / "20").symlink_to(tmp_path / "moved" / "20")
    before = sorted(p.name for p in ckpt.iterdir())
    capsys.readouterr()
    assert run_and_report(cfg(20), tmp_path / "b") is False
    assert [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")] == [
        f"error: {ckpt / '20'} (a broken symbolic link) is not a checkpoint step folder; move it out of {ckpt}, then "
        "run the same command again"
    ]
    assert sorted(p.name for p in ckpt.iterdir()) == before and (ckpt / "20").is_symlink()
    assert summary(tmp_path / "b")["status"] == "failed"
    (ckpt / "20").unlink()  # the fix, followed
    assert run_and_report(cfg(20), tmp_path / "b")
    assert checkpoint.complete_steps(ckpt) == [10, 20] and not checkpoint.unfinished_saves(ckpt)


def test_a_process_ending_while_orbax_is_imported_waits_for_the_import():
    """A config error found at build time sometimes ended with "terminate called without an active exception" and
    exit code 134: the process ended while the orbax-import thread, a daemon, was inside tensorstore's C++ import, and
    Python ends such a thread at its exit by unwinding it through C++ frames (std::terminate). The mechanism, checked
    deterministically: a process that exits at once after ``preload_orbax`` (the import takes about half a second)
    reaches its exit handlers with the import finished and no orbax-import thread left, and exits with its own
    code."""
    probe = (
        "import atexit, sys, threading\n"
        "from training.checkpoint.store import preload_orbax\n"
        "atexit.register(lambda: print(sorted(t.name for t in threading.enumerate()), "
        "'orbax.checkpoint' in sys.modules, flush=True))\n"
        "preload_orbax()\n"
        "sys.exit(3)\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "['MainThread'] True\n", "")
