"""Start-up: ``perf/startup_s`` split into phases that add up to it, and libraries imported only when used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from measure.throughput import STARTUP_PHASES, JobClock, StartupPhases
from training.console import startup_breakdown_line
from utils import REPO, modules_probe_cmd, train_probe_cmd

# Imported only when a run needs them: W&B (wandb.mode online/offline), TFDS (a dataset to decode or prepare),
# orbax (checkpoints), matplotlib (plots of a sweep report), submitit (the submitit launchers).
LAZY = ("wandb", "tensorflow_datasets", "orbax", "matplotlib", "submitit")


@pytest.mark.unit
def test_startup_phases_add_up_to_startup_time():
    phases = StartupPhases()
    t0 = time.perf_counter()
    phases.start(t0 - 1.0)  # the job started 1 s ago
    phases.mark("imports", t0 - 0.5)
    phases.mark("config", t0 - 0.25)
    phases.mark("imports", t0 - 0.125)  # a phase may end several times: its pieces add up
    clock = JobClock(phases=phases)
    clock.first_step()
    s = clock.summary()
    assert [k for k in s if k.startswith("perf/startup/")] == [f"perf/startup/{p}_s" for p in STARTUP_PHASES]
    assert s["perf/startup/imports_s"] == pytest.approx(0.625) and s["perf/startup/config_s"] == pytest.approx(0.25)
    assert s["perf/startup/data_s"] == 0.0  # never marked
    assert s["perf/startup/first_step_s"] == pytest.approx(0.125, abs=0.05)
    assert sum(s[f"perf/startup/{p}_s"] for p in STARTUP_PHASES) == pytest.approx(s["perf/startup_s"], abs=1e-9)
    with pytest.raises(ValueError, match="unknown start-up phase 'compiling'; one of imports, config"):
        phases.mark("compiling")
    # a clock without phases (library use, tests) has no breakdown
    plain = JobClock()
    plain.first_step()
    assert not any(k.startswith("perf/startup/") for k in plain.summary())


@pytest.mark.unit
def test_startup_breakdown_line():
    line = startup_breakdown_line(
        {"perf/wall_s": 9.0, "perf/startup_s": 3.0, "perf/startup/imports_s": 2.0, "perf/startup/compile_s": 1.0},
        "hit",
    )
    assert line == "start-up 3.00 s: imports 2.00, compile 1.00 (cache hit)"


@pytest.mark.unit
def test_without_ipython_probe_hides_ipython_only_inside():
    from training.runtime import without_ipython_probe

    saved = {k: v for k, v in sys.modules.items() if k == "IPython" or k.startswith("IPython.")}
    for k in saved:
        del sys.modules[k]
    try:
        with without_ipython_probe():
            with pytest.raises(ImportError):
                import IPython  # noqa: F401
        assert "IPython" not in sys.modules  # afterwards a plain import looks for the real package again
        sys.modules["IPython"] = stand_in = saved.get("IPython") or type(sys)("IPython")
        with without_ipython_probe():  # already imported (an IPython session): nothing changes
            assert sys.modules["IPython"] is stand_in
    finally:
        sys.modules.pop("IPython", None)
        sys.modules.update(saved)


def test_run_reports_startup_phases_and_imports_no_unused_library(tmp_path):
    """A real run (synthetic data, 8 devices, W&B disabled, no checkpoints): the phases are in summary.json
    and train.log, add up to ``perf/startup_s``, and W&B, TFDS, orbax, matplotlib and submitit were never
    imported (``sys.modules`` at the process's exit)."""
    run_dir, modules = tmp_path / "run", tmp_path / "modules.json"
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}  # the config's wandb.mode wins
    cmd = modules_probe_cmd(
        modules,
        f"hydra.run.dir={run_dir}",
        "data=synthetic",
        "train.steps=20",
        "train.log_every=10",
        "wandb.mode=disabled",
        "checkpoint.enabled=false",
        f"runtime.compilation_cache_dir={tmp_path / 'jax_cache'}",
    )
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    phases = {p: s[f"perf/startup/{p}_s"] for p in STARTUP_PHASES}
    assert all(v >= 0.0 for v in phases.values()), phases
    assert sum(phases.values()) == pytest.approx(s["perf/startup_s"], abs=0.01)
    assert phases["imports"] > 0 and phases["compile"] > 0 and phases["build"] > 0
    assert s["perf/startup/compile_cache"] == "miss"  # an empty cache folder
    line = next(l for l in (run_dir / "train.log").read_text().splitlines() if " - start-up " in l)
    assert line.split(" - ", 1)[1].startswith(f"start-up {s['perf/startup_s']:.2f} s: imports ")
    assert "compile " in line and "(cache miss)" in line and "first_step " in line
    loaded = set(json.loads(modules.read_text()))
    assert [m for m in LAZY if m in loaded] == []
    assert "IPython" not in loaded and "prompt_toolkit" not in loaded  # training.runtime.without_ipython_probe
    assert "jax" in loaded and "optax" in loaded  # the probe saw the run's modules


def test_orbax_import_ends_before_the_first_step(tmp_path):
    """With checkpoints on, orbax is imported on a background thread during the start-up, and that import has
    ended when the step loop starts: no import thread runs beside the steps (beside a dispatch-bound step loop it
    took the interpreter lock from the steps on a TPU host; ``git show
    7559600:benchmarks/results/overhead_history.md``, "TPU v5e, first session"). The run still saves its final
    checkpoint, and the wait is timed in the ``checkpoint`` phase."""
    run_dir, probe = tmp_path / "run", tmp_path / "probe.json"
    before = (
        "import json, sys, threading\n"
        "import training.run as L\n"
        "real = L.train_loop\n"
        "def probed(*a, **k):\n"
        "    json.dump({'orbax': 'orbax.checkpoint' in sys.modules,\n"
        "               'threads': [t.name for t in threading.enumerate()]},\n"
        f"              open({str(probe)!r}, 'w'))\n"
        "    return real(*a, **k)\n"
        "L.train_loop = probed\n"
    )
    s = run_synthetic_probe(tmp_path, before, "train.steps=20", "train.log_every=10")
    seen = json.loads(probe.read_text())
    assert seen["orbax"] is True  # imported (checkpoints are on) ...
    assert "orbax-import" not in seen["threads"], seen["threads"]  # ... and the import ended before the loop
    assert (run_dir / "checkpoints" / "20" / "state").is_dir()
    assert s["perf/startup/checkpoint_s"] >= 0.0


def test_backend_starts_beside_the_imports_and_its_rest_is_timed_as_runtime(tmp_path):
    """The backend's start (on a TPU host the chip opens in ~10 s) runs on its own thread
    (``training.runtime.start_backend``) while ``train.py`` imports the training modules; what is left of it when
    they are in is the ``runtime`` phase, never ``config``. Here a backend start that waits until
    ``training.run`` is fully imported (up to 20 s) and then 2 s more: it ran on the ``jax-backend-start`` thread,
    saw the import end (a start that blocked the imports would wait the whole 20 s), and ``runtime`` holds the
    seconds it kept the run waiting (``git show 7559600:benchmarks/results/backend_start_tpu_v5e.txt``)."""
    probe = tmp_path / "backend.json"
    before = (
        "import json, sys, threading, time\n"
        "from jax._src import xla_bridge\n"
        "def hook(backend):\n"
        "    t0 = time.perf_counter()\n"
        "    while not hasattr(sys.modules.get('training.run'), 'run_and_report') and time.perf_counter() - t0 < 20:\n"
        "        time.sleep(0.01)\n"
        "    imported = hasattr(sys.modules.get('training.run'), 'run_and_report')\n"
        "    time.sleep(2.0)\n"
        "    json.dump({'thread': threading.current_thread().name, 'imported': imported,\n"
        "               'waited_s': time.perf_counter() - t0}, open(%r, 'w'))\n"
        "xla_bridge.register_backend_initialization_hook(hook)\n"
    ) % str(probe)
    s = run_synthetic_probe(tmp_path, before, "train.steps=4", "train.log_every=2", "checkpoint.enabled=false")
    seen = json.loads(probe.read_text())
    assert seen["thread"] == "jax-backend-start", seen
    assert seen["imported"] is True and seen["waited_s"] < 20, seen
    assert s["perf/startup/runtime_s"] >= 1.5, s
    assert s["perf/startup/config_s"] < 1.5, s


def test_start_backend_honours_the_settings_before_it_and_reports_a_failed_start_on_the_main_thread():
    """``start_backend`` after the device count is set starts that many devices on a non-daemon thread, and
    returns None once a backend is up; a start that fails there (an unknown platform) raises the same error
    from the main thread's own ``jax.devices()`` as without it."""
    code = (
        "import jax\n"
        "jax.config.update('jax_num_cpu_devices', 3)\n"
        "from training.runtime import start_backend\n"
        "t = start_backend()\n"
        "print(t.name, t.daemon)\n"
        "t.join()\n"
        "print(len(jax.devices()), start_backend())\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["jax-backend-start", "False", "3", "None"]
    failed = {}
    for started in (True, False):
        code = (
            "import jax\n"
            + ("from training.runtime import start_backend\nstart_backend().join()\n" if started else "")
            + "try:\n    jax.devices()\nexcept RuntimeError as e:\n    print('error:', str(e).splitlines()[0])\n"
        )
        env = {**os.environ, "JAX_PLATFORMS": "no_such_platform"}
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        failed[started] = proc.stdout.strip()
    assert failed[True].startswith("error: ") and failed[True] == failed[False], failed


def run_synthetic_probe(tmp_path, before: str, *overrides: str) -> dict:
    """Runs ``train.py`` on synthetic data with W&B disabled in ``tmp_path / "run"`` after the code ``before``
    (``train_probe_cmd``); checks it exits 0 and that its start-up phases add up to ``perf/startup_s``; returns its
    summary."""
    run_dir = tmp_path / "run"
    cmd = train_probe_cmd(
        before,
        "",
        f"hydra.run.dir={run_dir}",
        "data=synthetic",
        "wandb.mode=disabled",
        f"runtime.compilation_cache_dir={tmp_path / 'jax_cache'}",
        *overrides,
    )
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert sum(s[f"perf/startup/{p}_s"] for p in STARTUP_PHASES) == pytest.approx(s["perf/startup_s"], abs=0.01)
    return s


# ---- the garbage collector during start-up (training.process) -------------------------------------------------
@pytest.fixture
def collector():
    """Restores the collector after a test that pauses, freezes or releases it."""
    import gc

    from training import process

    yield gc
    process._gc_paused = False
    gc.unfreeze()
    gc.enable()


@pytest.mark.unit
def test_pause_then_resume_freezes_what_is_alive_and_turns_the_collector_back_on(collector):
    from training import process

    gc = collector
    process.resume_gc()  # not paused (a library user, a test): nothing changes
    assert gc.isenabled() and gc.get_freeze_count() == 0
    process.pause_gc()
    assert not gc.isenabled()
    kept = [[]]  # alive at resume: frozen
    process.resume_gc()
    assert gc.isenabled() and gc.get_freeze_count() > 1000 and kept
    gc.unfreeze()
    process.resume_gc()  # once only
    assert gc.get_freeze_count() == 0
    process.pause_gc()
    process.release_gc()  # a sweep: back on, nothing frozen
    assert gc.isenabled() and gc.get_freeze_count() == 0
    process.resume_gc()
    assert gc.get_freeze_count() == 0
    gc.disable()  # not paused here (the caller's own choice): release leaves it
    process.release_gc()
    assert not gc.isenabled()


def _gc_probe(out: Path, *overrides: str, ipython: bool = False) -> list[str]:
    """``train_probe_cmd`` (``ipython``: with IPython imported, as in IPython's ``%run``) that writes the
    collector's state after the run (on, objects frozen, full collections so far) as JSON to ``out``."""
    after = (
        "state = dict(on=gc.isenabled(), frozen=gc.get_freeze_count(), full=gc.get_stats()[2]['collections'])\n"
        f"json.dump(state, open({str(out)!r}, 'w'))"
    )
    return train_probe_cmd("import gc, json" + ("\nimport IPython" if ipython else ""), after, *overrides)


def test_train_py_runs_its_start_up_without_full_collections_and_leaves_the_collector_on(tmp_path):
    """A run: no full (generation 2) collection at all (without the pause: three), ~180k objects of the start-up
    frozen, the collector on. A sweep (``-m``, Hydra's default launcher: the job in this process): the collector
    on, nothing frozen. A run stopped at bad input (before its imports were done): the collector back on. Inside an
    IPython session (``%run train.py``): nothing paused or frozen."""
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    common = (
        "data=synthetic",
        "train.steps=20",
        "train.log_every=10",
        "wandb.mode=disabled",
        "checkpoint.enabled=false",
    )
    state = {}
    for kind, extra, ipython in (
        ("run", [f"hydra.run.dir={tmp_path / 'run'}"], False),
        ("sweep", ["-m", f"hydra.sweep.dir={tmp_path / 'sweep'}"], False),
        ("bad input", [f"hydra.run.dir={tmp_path / 'bad'}", "optim.lr=abc"], False),
        ("ipython", [f"hydra.run.dir={tmp_path / 'ipython'}"], True),
    ):
        out = tmp_path / f"{kind}.json"
        cmd = _gc_probe(out, *extra, *common, ipython=ipython)
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == (1 if kind == "bad input" else 0), proc.stderr[-3000:]
        state[kind] = json.loads(out.read_text())
    assert state["run"]["on"] and state["run"]["full"] == 0 and state["run"]["frozen"] > 100_000, state
    assert state["sweep"]["on"] and state["sweep"]["frozen"] == 0, state
    assert json.loads((tmp_path / "sweep" / "0" / "summary.json").read_text())["status"] == "ok"
    assert state["bad input"]["on"] and state["bad input"]["frozen"] == 0, state
    assert not (tmp_path / "bad").exists()  # refused at composition (one error line), before any run folder
    assert state["ipython"]["on"] and state["ipython"]["frozen"] == 0, state
    assert json.loads((tmp_path / "ipython" / "summary.json").read_text())["status"] == "ok"
