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
from training.console_lines import startup_breakdown_line
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


# ---- the garbage collector during start-up (training/startup_gc.py) ------------------------------------------
@pytest.fixture
def collector():
    """Restores the collector after a test that pauses, freezes or releases it."""
    import gc

    from training import startup_gc

    yield gc
    startup_gc._paused = False
    gc.unfreeze()
    gc.enable()


@pytest.mark.unit
def test_pause_then_resume_freezes_what_is_alive_and_turns_the_collector_back_on(collector):
    from training import startup_gc

    gc = collector
    startup_gc.resume()  # not paused (a library user, a test): nothing changes
    assert gc.isenabled() and gc.get_freeze_count() == 0
    startup_gc.pause()
    assert not gc.isenabled()
    kept = [[]]  # alive at resume: frozen
    startup_gc.resume()
    assert gc.isenabled() and gc.get_freeze_count() > 1000 and kept
    gc.unfreeze()
    startup_gc.resume()  # once only
    assert gc.get_freeze_count() == 0
    startup_gc.pause()
    startup_gc.release()  # a sweep: back on, nothing frozen
    assert gc.isenabled() and gc.get_freeze_count() == 0
    startup_gc.resume()
    assert gc.get_freeze_count() == 0
    gc.disable()  # not paused here (the caller's own choice): release leaves it
    startup_gc.release()
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


@pytest.mark.unit
def test_composes_once_only_where_no_command_line_flag_override_or_config_file_can_set_the_run_mode(tmp_path):
    import train

    assert train.composes_once(["mesh.devices=2", "hydra.run.dir=/x/y", "wandb.name=my-model-cd"])
    assert train.composes_once(["model=gpt", "data=tiny_shakespeare", "accum=4", "+experiment=cnn_mnist"])
    assert train.composes_once([])
    for argv in (
        ["-m", "mesh.devices=1,2"],
        ["mesh.devices=1", "--multirun"],
        ["hydra.mode=MULTIRUN"],
        ["+hydra.mode=RUN"],
        ["hydra/launcher=submitit_local"],
        ["hydra.searchpath=[file:///x]"],
        ["--config-dir=/x"],
        ["-cn", "other"],
        ["hydra={mode: MULTIRUN}"],
        ["+experiment=not_in_conf"],  # a group option from elsewhere (a plugin's search path) could set the mode
        ["model@other=gpt"],
    ):
        assert not train.composes_once(argv), argv

    def conf(files: dict[str, str]) -> Path:
        root = tmp_path / f"conf{len(list(tmp_path.iterdir()))}"
        for name, text in {
            "config.yaml": "defaults:\n  - _self_\n",
            "wandb/offline.yaml": "mode: offline\n",
            **files,
        }.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
        return root

    assert train.composes_once([], conf_dir=conf({"mesh/a.yaml": "# every parallel mode (a comment)\ndevices: 2\n"}))
    for files in (  # each a config file that sets the mode, or might: Hydra decides
        {"experiment/a.yaml": "# @package _global_\nhydra:\n  mode: MULTIRUN\n"},
        {"experiment/a.yaml": "# @package _global_\nhydra: {mode: MULTIRUN}\n"},
        {"experiment/a.yaml": '# @package _global_\nhydra:\n  "mode": MULTIRUN\n'},
        {"experiment/a.yaml": "# @package _global_\nhydra:\n  mode: ${oc.env:RUN_MODE,MULTIRUN}\n"},
        {"experiment/a.yaml": "# @package _global_\nx: &m MULTIRUN\nhydra:\n  mode: *m\n"},
        {"experiment/a.yaml": '# @package _global_\nhydra: {"mo\\x64e": MULTIRUN}\n'},
        {"experiment/a.yaml": "# @package hydra\nmode: MULTIRUN\n"},
        {"wandb/odd.yaml": "# @package hydra\nmode: MULTIRUN\n"},
        {"config.yaml": "defaults:\n  - wandb@hydra: offline\n"},
        {"config.yaml": "hydra:\n  searchpath: [file:///elsewhere]\n"},
    ):
        assert not train.composes_once([], conf_dir=conf(files)), files
    unreadable = conf({})
    (unreadable / ".#config.yaml").symlink_to("user@host.1234:1700000000")  # an editor's lock file: a dangling link
    assert not train.composes_once([], conf_dir=unreadable)
    (unreadable / ".#config.yaml").unlink()
    (unreadable / "folder.yaml").mkdir()
    assert not train.composes_once([], conf_dir=unreadable)


@pytest.mark.unit
def test_the_first_composition_is_skipped_without_composing_and_hydra_is_restored(monkeypatch):
    from hydra._internal.hydra import Hydra

    import train

    composed = []
    monkeypatch.setattr(Hydra, "compose_config", lambda self, *a, **k: composed.append(k))
    original = Hydra.get_mode
    with train.first_composition_skipped(["mesh.devices=2"]):
        assert Hydra.get_mode(object.__new__(Hydra), "config", ["mesh.devices=2"]) is None
    assert composed == [] and Hydra.get_mode is original
    with train.first_composition_skipped(["-m", "mesh.devices=1,2"]):  # a sweep: Hydra's own get_mode
        assert Hydra.get_mode is original


def test_a_run_composes_its_config_once_into_the_same_config_as_hydras_two_compositions(tmp_path):
    """``python train.py``: one composition (Hydra's ``get_mode`` skipped, ``train.composes_once``), where Hydra's path
    (taken here by naming ``hydra.mode=RUN`` on the command line) composes twice; the run folders' configs,
    overrides included, are the same."""
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    before = (
        "import hydra._internal.hydra as H\n"
        "calls = []\n"
        "_compose = H.Hydra.compose_config\n"
        "def compose(self, *a, **k):\n"
        "    calls.append(str(k.get('run_mode')))\n"
        "    return _compose(self, *a, **k)\n"
        "H.Hydra.compose_config = compose"
    )
    common = ("data=synthetic", "train.steps=2", "wandb.mode=disabled", "checkpoint.enabled=false")
    hydra_cfg = {}
    for kind, extra in (("once", []), ("hydra", ["hydra.mode=RUN"])):
        run_dir = tmp_path / kind
        cmd = train_probe_cmd(before, "print('compositions:', calls)", f"hydra.run.dir={run_dir}", *extra, *common)
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        expected = "['RunMode.RUN']" if kind == "once" else "['RunMode.MULTIRUN', 'RunMode.RUN']"
        assert f"compositions: {expected}" in proc.stdout, proc.stdout[-2000:]
        text = (run_dir / ".hydra" / "hydra.yaml").read_text().replace(str(run_dir), "<run_dir>")
        hydra_cfg[kind] = [line for line in text.splitlines() if "hydra.mode=RUN" not in line]
        assert (run_dir / ".hydra" / "config.yaml").read_text() == (
            tmp_path / "once" / ".hydra" / "config.yaml"
        ).read_text()
    assert "  mode: RUN" in hydra_cfg["once"]
    assert hydra_cfg["once"] == hydra_cfg["hydra"]
