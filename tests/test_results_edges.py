"""What a run and its tools show a researcher: no contradictory figure, one clear line per problem."""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import subprocess
import sys
import time

import pytest

from measure.throughput import WindowStats
from tests.utils import REPO, run_train, train_probe_cmd
from training.console import throughput_text


@pytest.mark.unit
def test_no_steady_state_window_is_said_plainly():
    """A run that ends in its first logging window has no steady-state figure: the warning and the end line say
    so instead of a 'median of 0 windows'."""
    stats = WindowStats(global_batch=256, num_devices=8)
    stats.add(0.5, 5)
    assert stats.warning() == (
        "warning: no steady-state throughput: all 5 step(s) ran in the first logging window, which follows "
        "compilation and is not steady state; for a figure run at least 6 windows (train.steps >= 6 x "
        "train.log_every)"
    )
    summary = stats.summary()
    assert summary["perf/windows_measured"] == 0
    assert throughput_text(summary) == (
        "examples/s=n/a (no steady-state window: the run ended in its first logging window)"
    )
    stats.add(0.25, 5)
    assert throughput_text(stats.summary()) == "examples/s=5120 (1 window)"
    for _ in range(3):
        stats.add(0.5, 5)
    assert throughput_text(stats.summary()) == "examples/s=2560 (median of 4 windows, p25-p75 2560-3200)"
    assert throughput_text({}) == throughput_text({"perf/windows_measured": 0, "perf/examples_per_s": 13981.0})


def test_short_run_end_line(tmp_path):
    """`train.steps=5` (one logging window): one warning, and the end line has no examples/s figure."""
    res = run_train(tmp_path / "run", "data=synthetic", "train.steps=5")
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout + res.stderr
    assert out.count("warning: no steady-state throughput") == 1
    assert "median of 0" not in out
    (end,) = [line for line in out.splitlines() if "outputs in" in line]
    assert "examples/s=n/a (no steady-state window: the run ended in its first logging window)" in end
    # the folder printed as "outputs in" is accepted by evaluate: it stands for its checkpoints/
    from evaluate import find_step_dir

    run_dir = tmp_path / "run"
    assert end.endswith(f"outputs in {run_dir}")
    assert find_step_dir(run_dir) == run_dir / "checkpoints" / "5"
    res = subprocess.run(
        [sys.executable, "-m", "evaluate", str(run_dir), "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout.strip().splitlines()[-1])["step"] == 5


@pytest.mark.unit
def test_evaluate_run_folder_and_missing_step_lines(tmp_path):
    """evaluate's argument: a run folder without checkpoints and a missing step each get one line naming
    what exists."""
    from core.errors import ConfigError
    from evaluate import find_step_dir, run_checkpoint_dir

    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text(f"checkpoint:\n  dir: {tmp_path / 'ckpt'}\n")
    assert run_checkpoint_dir(run_dir) == tmp_path / "ckpt"
    with pytest.raises(ConfigError) as info:
        find_step_dir(run_dir)
    assert str(info.value) == (  # what the run folder's own files say, not a guess
        f"run folder {run_dir} has no checkpoint in {tmp_path / 'ckpt'}: it has no summary.json: it is still "
        "running, or stopped before its first save"
    )
    (run_dir / "summary.json").write_text('{"status": "failed", "error": "data.path=x.txt is empty"}')
    with pytest.raises(ConfigError, match=r"ckpt: its summary.json says status failed: data.path=x.txt is empty$"):
        find_step_dir(run_dir)
    (run_dir / ".hydra" / "config.yaml").write_text(f"checkpoint:\n  dir: {tmp_path / 'ckpt'}\n  enabled: false\n")
    with pytest.raises(ConfigError, match=r"ckpt: it ran with checkpoint.enabled=false$"):
        find_step_dir(run_dir)
    for step in (20, 40):
        (tmp_path / "ckpt" / str(step) / "state").mkdir(parents=True)
        (tmp_path / "ckpt" / str(step) / "meta").mkdir()
    with pytest.raises(ConfigError) as info:
        find_step_dir(tmp_path / "ckpt" / "30")
    assert str(info.value) == (
        f"no step 30 in {tmp_path / 'ckpt'}: its steps are 20, 40; give one of them or the folder "
        f"{tmp_path / 'ckpt'} (its newest step)"
    )
    assert find_step_dir(tmp_path / "ckpt" / "40") == tmp_path / "ckpt" / "40"
    assert run_checkpoint_dir(tmp_path / "ckpt") is None  # a checkpoint folder is not a run folder


@pytest.mark.unit
def test_evaluate_run_folder_with_a_relative_checkpoint_dir(tmp_path, monkeypatch):
    """A run's relative ``checkpoint.dir`` is taken from the folder the run was started in (Hydra's
    ``hydra.runtime.cwd``), as the run took it, whichever folder ``evaluate`` runs in."""
    from evaluate import find_step_dir, run_checkpoint_dir

    started_in = tmp_path / "project"
    run_dir = started_in / "outputs" / "2026-12-03" / "18-00-03"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("checkpoint:\n  dir: ckpt/ref\n")
    (run_dir / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  runtime:\n    cwd: {started_in}\n")
    (started_in / "ckpt" / "ref" / "120" / "state").mkdir(parents=True)
    (started_in / "ckpt" / "ref" / "120" / "meta").mkdir()
    (started_in / "ckpt" / "ref" / "120" / "meta" / "metadata").write_text('{"step": 120}')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert run_checkpoint_dir(run_dir) == started_in / "ckpt" / "ref"
    assert find_step_dir(run_dir) == started_in / "ckpt" / "ref" / "120"
    (run_dir / ".hydra" / "hydra.yaml").unlink()  # no record of where it started: the current folder
    assert run_checkpoint_dir(run_dir) == elsewhere / "ckpt" / "ref"


@pytest.mark.slow
def test_readme_sweep_example_runs_clean(tmp_path):
    """The README's `-m accum=1,2,4,8 ...` example runs its 4 jobs without a warning."""
    readme = (REPO / "README.md").read_text()
    (command,) = re.findall(r"`(python train.py -m accum=1,2,4,8 [^`]*)`", readme)
    overrides = shlex.split(command)[2:]
    res = run_train(tmp_path / "unused", *overrides, f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout + res.stderr
    assert "warning" not in out.lower(), [line for line in out.splitlines() if "warning" in line.lower()]
    assert len(re.findall(r"median of 5 windows", out)) == 4


def _python(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("flag", ["hydra.run.dir", "hydra.sweep.dir"])
def test_run_folder_that_cannot_be_created_is_one_line(tmp_path, flag):
    """A run (or sweep) folder below a regular file cannot be created: one line, exit 1, no traceback."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    args = ["train.py", *(["-m"] if flag == "hydra.sweep.dir" else []), f"{flag}={blocker}/run", "data=synthetic"]
    res = _python(*args)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [
        f"error: cannot create the run folder: Not a directory: {blocker}/run; set hydra.run.dir "
        "(hydra.sweep.dir with -m) to a folder you can write"
    ]
    assert "Traceback" not in res.stdout + res.stderr


@pytest.mark.parametrize(
    "args, sweep",
    [
        (["-m", "--cfg", "job"], True),
        (["--cfg", "job", "--multirun", "mesh.devices=1,2"], True),
        (["-m", "--info", "config"], True),
        (["--info", "config", "--cfg", "job"], False),
    ],
)
def test_two_run_flags_are_one_line(tmp_path, args, sweep):
    """Hydra refuses two run flags (-m with --cfg or --info, --info with --cfg) by raising before anything is
    written: one line naming the flags (with -m, what to do instead), exit 1, no traceback, no folder."""
    res = _python("train.py", *args, f"hydra.sweep.dir={tmp_path / 'sweep'}", f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode == 1
    hint = "; drop -m (--multirun) and give one job's values, e.g. python train.py --cfg job mesh.devices=2"
    assert res.stderr.strip().splitlines() == [
        "error: Only one of --run, --multirun, --cfg, --info and --shell_completion can be specified"
        + (hint if sweep else "")
    ]
    assert "Traceback" not in res.stdout + res.stderr
    assert list(tmp_path.iterdir()) == []


# Ctrl-C at a known point of the start-up: the patched function sends the process SIGINT, whose default handler
# raises KeyboardInterrupt there, as a Ctrl-C in a terminal does
_SIGINT_IN = """
import os, signal, {module} as m
real = m.{name}
def interrupted(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)
    return real(*args, **kwargs)
m.{name} = interrupted
"""


STOPPED_AT_START = (
    "stopped by SIGINT (Ctrl-C) during the start-up, before the first training step: nothing trained or saved; the "
    "same command starts the run again (from its newest checkpoint, if any)"
)


@pytest.mark.parametrize(
    "module, name",
    [("training.report", "prestart_wandb"), ("training.run", "run")],
    ids=["before-the-run", "in-the-run"],
)
@pytest.mark.parametrize("full_error", [False, True], ids=["default", "HYDRA_FULL_ERROR"])
def test_ctrl_c_outside_the_steps_is_one_line(tmp_path, module, name, full_error):
    """Ctrl-C before the training steps (W&B's start, the run's start-up): one line instead of a traceback, exit by
    SIGINT (status 130 in a shell), nothing written but Hydra's files and summary.json with status stopped; with
    HYDRA_FULL_ERROR=1 set by the user the traceback is printed instead."""
    import signal

    run_dir = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "1" if full_error else ""}
    cmd = train_probe_cmd(_SIGINT_IN.format(module=module, name=name), "", f"hydra.run.dir={run_dir}", "data=synthetic")
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == -signal.SIGINT, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    if full_error:
        assert "Traceback" in res.stderr and lines[-1] == "KeyboardInterrupt"
    else:
        assert "Traceback" not in res.stderr and lines[-1] == f"error: {STOPPED_AT_START}"
    assert STOPPED_AT_START not in res.stdout
    assert {p.name for p in run_dir.iterdir()} == {".hydra", ".lock", "train.log", "summary.json"}
    written = json.loads((run_dir / "summary.json").read_text())
    assert (written["status"], written["error"]) == ("stopped", STOPPED_AT_START)


def _raised_during_interrupt() -> ImportError:
    """An ImportError raised while a KeyboardInterrupt is handled, as numpy's or jaxlib's import raises one when a
    Ctrl-C lands in their C extension's set-up."""
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise ImportError("numpy._core.multiarray failed to import")
    except ImportError as e:
        return e


_SIGINT_IN_COMPOSITION = """
import json, os, signal
from hydra._internal import config_loader_impl as m
real = m.ConfigLoaderImpl.load_configuration
def composing(self, *args, **kwargs):
    if not os.path.exists({out!r}):  # the first composition (Hydra's get_mode)
        held = getattr(signal.getsignal(signal.SIGINT), "__name__", "") == "_record"  # a HeldSigint's
        open({out!r}, "w").write(json.dumps(held))
        os.kill(os.getpid(), signal.SIGINT)
    return real(self, *args, **kwargs)
m.ConfigLoaderImpl.load_configuration = composing
"""


def test_ctrl_c_during_hydras_composition_stops_the_run(tmp_path):
    """A Ctrl-C during Hydra's composition is held until the job starts (Hydra's get_mode catches every Exception,
    and OmegaConf's clean-up can turn the KeyboardInterrupt into one: the Ctrl-C was lost and the run went on),
    then stops the run with the one line and summary.json with status stopped, before anything else is written."""
    import signal

    run_dir, held = tmp_path / "run", tmp_path / "held.json"
    env = {**os.environ, "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": ""}
    cmd = train_probe_cmd(
        _SIGINT_IN_COMPOSITION.format(out=str(held)), "", f"hydra.run.dir={run_dir}", "data=synthetic"
    )
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert json.loads(held.read_text()) is True  # SIGINT was held while Hydra composed
    assert res.returncode == -signal.SIGINT, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and res.stderr.strip().splitlines()[-1] == f"error: {STOPPED_AT_START}"
    assert {p.name for p in run_dir.iterdir()} == {".hydra", ".lock", "train.log", "summary.json"}
    written = json.loads((run_dir / "summary.json").read_text())
    assert (written["status"], written["error"]) == ("stopped", STOPPED_AT_START)


@pytest.mark.unit
def test_interrupt_hook_words_interrupts_and_passes_other_exceptions_on(capsys, monkeypatch):
    """train.py's excepthook words a KeyboardInterrupt, and an error a Ctrl-C caused, as one line; any other
    exception reaches Python's own hook. interrupt_as_keyboard turns such an error into a KeyboardInterrupt (which
    Hydra's job report does not catch) and lets others through unchanged."""
    from training.process import INTERRUPTED_LINE, interrupt_as_keyboard, interrupt_hook, interrupted

    import training.process

    seen, exits = [], []
    fallback = lambda *exc: seen.append(exc[0])  # noqa: E731
    monkeypatch.setattr(training.process.os, "_exit", exits.append)
    caused = _raised_during_interrupt()
    for exc in (KeyboardInterrupt(), caused):
        monkeypatch.setattr(training.process, "_reported", False)
        interrupt_hook(type(exc), exc, None, fallback)
        assert capsys.readouterr().err == INTERRUPTED_LINE + "\n"
    assert exits == [130]  # after the ImportError (after a KeyboardInterrupt Python exits by SIGINT itself)
    # numpy's import prints the Ctrl-C through the hook, then raises an ImportError with no KeyboardInterrupt in
    # its chain: the hook's report stands for it (one line, exit 130), and later errors count as interrupted
    monkeypatch.setattr(training.process, "_reported", False)
    interrupt_hook(KeyboardInterrupt, KeyboardInterrupt(), None, fallback)
    interrupt_hook(ImportError, ImportError("numpy._core.multiarray failed to import"), None, fallback)
    assert capsys.readouterr().err == INTERRUPTED_LINE + "\n" and exits == [130, 130] and seen == []
    assert interrupted(ValueError("after a reported Ctrl-C"))
    monkeypatch.setattr(training.process, "_reported", False)
    interrupt_hook(ValueError, ValueError("x"), None, fallback)
    assert seen == [ValueError]
    assert interrupted(caused) and not interrupted(ValueError("x")) and not interrupted(None)
    with pytest.raises(KeyboardInterrupt):
        with interrupt_as_keyboard():
            raise caused
    with pytest.raises(ImportError, match="plain"):
        with interrupt_as_keyboard():
            raise ImportError("plain")


@pytest.mark.unit
def test_a_ctrl_c_during_a_deferred_block_is_raised_after_it():
    """HeldSigint around a block (jaxlib's import, whose initialisation can abort when interrupted): a SIGINT inside
    the block raises nothing there; KeyboardInterrupt comes when the block ends, and Python's handler is back; an
    error of the block itself goes on instead."""
    import signal

    from training.process import HeldSigint

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        reached_end = []
        with pytest.raises(KeyboardInterrupt):
            with HeldSigint():
                signal.raise_signal(signal.SIGINT)
                reached_end.append(True)
        assert reached_end == [True]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with HeldSigint():  # no signal: nothing raised
            pass
        with pytest.raises(ValueError):  # the block's own error goes on, the handler is back
            with HeldSigint():
                signal.raise_signal(signal.SIGINT)
                raise ValueError("the block's own")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.unit
def test_a_ctrl_c_in_an_exit_handler_or_in_orbax_log_is_one_line(capsys, monkeypatch):
    """A Ctrl-C that Python ignores (sys.unraisablehook): inside an exit handler, one line saying so; inside a gc
    callback, passed on to the main thread as if it came again. orbax's log record of a Ctrl-C in its save's wait
    is dropped (the stop's line says it: it was a second voice); other records are kept with their traceback."""
    import logging
    import types

    from training.process import NoInterruptTraceback, unraisable_hook

    import signal

    import training.process

    seen, passed_on = [], []
    monkeypatch.setattr(training.process._thread, "interrupt_main", passed_on.append)
    for exc, err_msg in (
        (KeyboardInterrupt(), "Exception ignored in atexit callback"),
        (KeyboardInterrupt(), "Exception ignored in"),  # a gc callback: passed on to the main thread
        (ValueError("x"), None),
    ):
        unraisable = types.SimpleNamespace(exc_type=type(exc), exc_value=exc, exc_traceback=None, err_msg=err_msg)
        unraisable_hook(unraisable, fallback=seen.append)
    assert capsys.readouterr().err.splitlines() == [
        "warning: a Ctrl-C (SIGINT) came during Python's exit handlers and was ignored there; the run had ended",
    ]
    assert passed_on == []  # not from inside the hook: on the main thread it would raise there, ignored again
    time.sleep(20 * training.process.PASS_ON_DELAY_S)
    assert passed_on == [signal.SIGINT]
    assert [u.exc_type for u in seen] == [ValueError]
    keep = NoInterruptTraceback()
    for exc, kept in ((KeyboardInterrupt(), False), (_raised_during_interrupt(), False), (OSError(), True)):
        record = logging.LogRecord("absl", logging.ERROR, __file__, 1, "failed", None, (type(exc), exc, None))
        assert keep.filter(record) == kept and record.exc_info is not None  # another error: kept, with its traceback


@pytest.mark.unit
def test_deleting_an_unknown_key_gets_did_you_mean():
    """`~train.stepz` is worded like `train.stepz=3`: one line with a did-you-mean."""
    from hydra.errors import ConfigCompositionException

    from conf.errors import one_line as reword
    from conf.schema import OPTION_SCHEMAS, Config

    one_line = lambda e: reword(e, Config, OPTION_SCHEMAS)  # noqa: E731  (the schema train.py passes)
    e = ConfigCompositionException("Could not delete from config. 'train.stepz' does not exist.")
    assert one_line(e) == "cannot delete ~train.stepz: unknown config key train.stepz; did you mean train.steps?"
    e = ConfigCompositionException("Could not delete from config. 'model.hiden' does not exist.")
    assert (
        one_line(e)
        == "cannot delete ~model.hiden: unknown config key model.hiden for model=mlp; did you mean model.hidden?"
    )
    e = ConfigCompositionException("Could not delete from config. 'hydra.foo' does not exist.")
    assert one_line(e) == "Could not delete from config. 'hydra.foo' does not exist."  # no schema: Hydra's line


def test_error_lines_share_one_prefix(tmp_path):
    """train.py (config and run folder), evaluate, sweeps.report and sweeps.project: `error: ...`, one line."""
    results = [
        _python("train.py", "train.stepz=3", f"hydra.run.dir={tmp_path / 'r'}"),
        _python("train.py", "~train.stepz", f"hydra.run.dir={tmp_path / 'r'}"),
        _python("-m", "evaluate", str(tmp_path / "none")),
        _python("-m", "sweeps.report", str(tmp_path / "none")),
        _python("-m", "sweeps.project", str(tmp_path / "none"), "--hardware", "h100_sxm", "--mfu", "0.4"),
    ]
    lines = [r.stderr.strip().splitlines() for r in results]
    assert all(r.returncode != 0 for r in results)
    assert [len(x) for x in lines] == [1] * 5, lines
    assert all(x[0].startswith("error: ") for x in lines), lines
    assert lines[0][0] == "error: unknown config key train.stepz; did you mean train.steps?"
    assert lines[1][0] == "error: cannot delete ~train.stepz: unknown config key train.stepz; did you mean train.steps?"


def test_sweep_console_says_each_thing_once(tmp_path):
    """A 2-job sweep with output to a file: the missing-link line once, the offline-W&B hint once per job's process
    plus one `wandb sync` line for the whole sweep, and no progress-bar carriage returns glued to log lines."""
    sweep = tmp_path / "sweep"
    res = run_train(
        tmp_path / "unused",
        "-m",
        "mesh.devices=1,2",
        "data=synthetic",
        "train.steps=3",
        "train.allow_exploded_loss=true",
        f"hydra.sweep.dir={sweep}",
    )
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout + res.stderr
    assert out.count("no link bandwidth known for cpu") == 1
    assert out.count("upload the run later with: wandb sync") == 1
    assert f"W&B is offline: upload the sweep's 2 run(s) later with: wandb sync {sweep}/*/wandb/offline-run-*" in out
    assert "\r" not in out and "step/s" not in out  # no tqdm bar when stderr is not a terminal
    assert out.count("outputs in") == 2


def test_documented_output_folders_are_ignored_by_git():
    paths = ["outputs/x", "multirun/x", "proj/projection.csv", "projection.csv", "projection.png", "ckpt/x", "wandb/x"]
    res = subprocess.run(["git", "check-ignore", *paths], cwd=REPO, capture_output=True, text=True)
    assert res.stdout.split() == paths
    kept = REPO / "benchmarks" / "results" / "overhead_cpu.txt"  # a raw output docs/performance.md cites
    assert kept.is_file()
    tracked = subprocess.run(["git", "check-ignore", str(kept.relative_to(REPO))], cwd=REPO, capture_output=True)
    assert tracked.returncode == 1  # committed results stay tracked


@pytest.mark.unit
def test_readme_puts_the_quick_start_first():
    """The first screenful (40 lines) holds set-up, one experiment, one sweep and its report; the set-up is one
    `make setup` line (a Makefile target); the CI test command line is kept exactly."""
    readme = (REPO / "README.md").read_text().splitlines()
    first = "\n".join(readme[:40])
    for needle in ("make setup", "python train.py parallel=", "python train.py -m ", "python -m sweeps.report "):
        assert needle in first, needle
    assert "Reading the results" in first
    # the repeats of the quick-start sweep interleave (train.seed varies slowest), as docs/report.md advises, which
    # also names the launcher for timing sweeps
    sweep = [line for line in readme[:40] if line.startswith("python train.py -m ") and "train.seed=" in line]
    assert sweep and all(line.startswith("python train.py -m train.seed=") for line in sweep), sweep
    report_doc = (REPO / "docs" / "report.md").read_text()
    assert (
        "`train.seed` first" in report_doc and "For a timing sweep prefer `hydra/launcher=submitit_local`" in report_doc
    )
    assert 'python -m pytest -q -m "not slow"' in readme
    makefile = (REPO / "Makefile").read_text()
    setup = makefile[makefile.index("\nsetup:") :]
    assert (
        "pip install -r requirements.txt" in setup and "python train.py parallel=jit_sharding precision=bf16" in setup
    )


@pytest.mark.slow
def test_readme_quick_start_experiment_runs_clean(tmp_path):
    readme = (REPO / "README.md").read_text()
    (command,) = re.findall(r"^(python train.py parallel=fsdp precision=bf16 data=synthetic \S+)", readme, re.M)
    res = run_train(tmp_path / "run", *shlex.split(command)[2:])
    assert res.returncode == 0, res.stderr[-2000:]
    assert "warning" not in (res.stdout + res.stderr).lower()


# ---- metrics.jsonl and summary.json are strict JSON ---------------------------------------------------------
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


def test_readme_any_corpus_line_is_a_quick_clean_try(tmp_path):
    """The README's "any corpus" GPT line is a quick try: it ends in well under a minute on a CPU without a
    warning (at least 5 measured windows) and saves a checkpoint per epoch, not per step. Its corpus here: a file
    of 40,000 words in a folder matched by the line's glob. Those words are only 400 distinct ones, so the BPE
    learns 264 of its 4,096 tokens and says so in its one warning (a real corpus gives all of them)."""
    readme = (REPO / "README.md").read_text()
    (command,) = re.findall(r"^(python train.py model=gpt data=text .*?)\s+# any corpus", readme, re.M)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    syllables = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "de", "gu"]  # a fixed corpus of 40,000 words
    words = [a + b + c for a in syllables for b in syllables for c in syllables[:4]]
    (corpus / "words.txt").write_text(" ".join(random.Random(0).choice(words) for _ in range(40_000)))
    overrides = [o.replace("corpus/*.txt", str(corpus / "*.txt")) for o in shlex.split(command)[2:]]
    assert [o for o in overrides if o.startswith("train.")] == [
        "train.global_batch=32",
        "train.steps=20",
        "train.log_every=2",
    ]
    start = time.perf_counter()
    res = run_train(tmp_path / "run", *overrides, "wandb.mode=disabled")
    elapsed_s = time.perf_counter() - start
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout + res.stderr
    warned = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert warned == [
        "warning: data.vocab_size=4096: the BPE learned only 264 tokens from this text (it holds no more merges); "
        "the model's vocabulary is 264, and a larger data.vocab_size gives the same tokenizer"
    ], warned
    message = warned[0].removeprefix("warning: ")  # in the log (stdout) too: no other warning there
    assert not [line for line in out.splitlines() if "warning" in line.lower() and message not in line]
    assert "(median of 9 windows" in out
    steps = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [8, 16, 20]  # one per epoch (8 steps of this corpus) and the final one, not one per step
    assert elapsed_s < 120, elapsed_s
