"""What a run prints and the paths it reads (training/console.py): the start-up line and one train.log line per
window, known library noise silenced, and user paths taken from the launch folder (also with hydra.job.chdir)."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys

import pytest

from utils import REPO, run_train


def test_startup_line_and_one_train_log_line_per_window(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(
        run_dir,
        "data=synthetic",
        "train.steps=20",
        "train.log_every=10",
        "wandb.mode=disabled",
        "train.global_batch=128",
        "train.eval_every=10",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [l.split(" - ", 1)[1] for l in (run_dir / "train.log").read_text().splitlines() if " - " in l]
    assert (
        "start: 8 cpu devices (cpu), 1 process, jit_sharding mesh [8, 1], fp32, batch 128 global / 16 per "
        "device, accum 1, 20 steps, mlp 203,530 params, data synthetic on the devices"  # generated there
    ) in lines
    windows = [l for l in lines if l.startswith("step ")]
    assert [w.split()[1] for w in windows] == ["10/20", "20/20"] and all(" examples/s=" in w for w in windows)
    # a periodic evaluation reaches train.log and the console (the final one is the run's last line)
    (evaluation,) = [l for l in lines if l.startswith("eval at ")]
    assert re.fullmatch(r"eval at step 10/20: eval/loss=\d\.\d{4} eval/accuracy=0\.\d{4}", evaluation), evaluation
    assert evaluation in proc.stderr + proc.stdout
    assert "Unable to initialize backend 'tpu'" not in proc.stderr and "OpenCV" not in proc.stderr
    assert proc.stderr.count("wandb sync") == 0  # W&B disabled: no offline message


@pytest.mark.unit
def test_start_and_evaluation_lines_read_as_english():
    from training.console import eval_line, startup_line

    info = {
        "process_count": 1,
        "mesh/devices": 1,
        "platform": "cpu",
        "device_kind": "cpu",
        "parallel": "jit_sharding",
        "mesh/shape": [1, 1],
        "precision": "fp32",
        "train/global_batch": 64,
        "train/per_device_batch": 64,
        "train/steps": 20,
    }
    line = startup_line(info, accum_steps=1, model="gpt", param_count=842496, dataset="tiny_shakespeare")
    assert line.startswith("start: 1 cpu device (cpu), 1 process, jit_sharding mesh [1, 1], fp32, batch 64 global")
    assert startup_line({**info, "mesh/devices": 2}, accum_steps=1, model="m", param_count=1, dataset="d").startswith(
        "start: 2 cpu devices (cpu)"
    )
    metrics = {"eval/loss": 4.84321, "eval/accuracy": 0.16789, "eval/perplexity": 126.87134, "eval/bpb": 6.98721}
    assert eval_line(200, 400, metrics) == (
        "eval at step 200/400: eval/loss=4.8432 eval/accuracy=0.1679 eval/perplexity=126.87 eval/bpb=6.9872"
    )


@pytest.mark.unit
def test_a_language_models_lines_give_tokens_per_s():
    from training.console import throughput_text, window_line

    assert window_line(10, 20, 1.23456, 2560.4) == "step 10/20 loss=1.2346 examples/s=2560"
    assert window_line(10, 20, 1.23456, 2560.4, 327731.2) == "step 10/20 loss=1.2346 examples/s=2560 tokens/s=327731"
    summary = {
        "perf/windows_measured": 4,
        "perf/examples_per_s": 2560.0,
        "perf/examples_per_s_p25": 2560.0,
        "perf/examples_per_s_p75": 3200.0,
        "perf/tokens_per_s": 327680.0,
    }
    assert throughput_text(summary) == ("examples/s=2560 (median of 4 windows, p25-p75 2560-3200) tokens/s=327680")
    assert throughput_text({**summary, "perf/windows_measured": 1}) == "examples/s=2560 (1 window) tokens/s=327680"
    assert throughput_text({**summary, "perf/windows_measured": 0}) == (
        "examples/s=n/a (no steady-state window: the run ended in its first logging window)"
    )
    del summary["perf/tokens_per_s"]  # an image model's lines are unchanged
    assert throughput_text(summary) == "examples/s=2560 (median of 4 windows, p25-p75 2560-3200)"


def test_the_language_models_console_gives_tokens_per_s(tmp_path):
    """train.log's window lines and the end line of a GPT run: tokens/s = examples/s x model.context."""
    run_dir = tmp_path / "run"
    proc = run_train(
        run_dir,
        "model=gpt",
        "data=tiny_shakespeare",
        "model.context=32",
        "train.global_batch=16",
        "train.steps=6",
        "train.log_every=2",
        "train.eval_batch=2048",
        "wandb=disabled",
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [l.split(" - ", 1)[1] for l in (run_dir / "train.log").read_text().splitlines() if " - " in l]
    windows = [l for l in lines if l.startswith("step ")]
    assert [w.split()[1] for w in windows] == ["2/6", "4/6", "6/6"]
    for w in windows:
        eps, tps = (float(w.split(f"{unit}=")[1].split()[0]) for unit in ("examples/s", "tokens/s"))
        assert tps == pytest.approx(eps * 32, rel=0.01, abs=32)  # both rounded to whole numbers
    (end,) = [l for l in lines if " outputs in " in l]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "(median of 2 windows, p25-p75 " in end and f" tokens/s={summary['perf/tokens_per_s']:.0f} " in end


def test_tfds_unprepared_variant_warning_is_known_noise(caplog):
    from training.console import quiet_known_noise

    quiet_known_noise()
    absl_logger = logging.getLogger("absl")
    with caplog.at_level(logging.WARNING, logger="absl"):
        absl_logger.warning("Variant folder /x/mnist/3.0.1 has no dataset_info.json")
        absl_logger.warning("a real warning stays")
    assert [r.getMessage() for r in caplog.records] == ["a real warning stays"]


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
    assert sorted(p.name for p in (tmp_path / "ck" / "x").iterdir()) == [".lock", "3"]  # (.lock: which run writes it)
    proc = train(2)
    assert proc.returncode == 0 and "already complete at step 3" in proc.stderr
    assert not (tmp_path / "run1" / "ck").exists() and not (tmp_path / "run2" / "ck").exists()


@pytest.mark.unit
def test_a_log_file_that_stops_taking_lines_is_one_warning_line(tmp_path, monkeypatch, capsys):
    """train.log on a disk that fills: one ``warning:`` line for the first line it cannot take, none for the next
    ones and none once the run's ``error:`` line is out (instead of logging's traceback per line); an error of a
    message itself is still logging's own report."""
    import errno

    from training import console as console_module

    monkeypatch.setattr(console_module, "_error_said", False)
    monkeypatch.setattr(console_module, "_unwritable_logs", set())
    root = logging.getLogger()
    handler = logging.FileHandler(tmp_path / "train.log")
    monkeypatch.setattr(root, "handlers", [handler])
    logger = logging.getLogger("test_console.full_disk")
    monkeypatch.setattr(logger, "level", logging.INFO)
    console_module.quiet_log_write_errors()
    console_module.quiet_log_write_errors()  # idempotent

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(handler, "flush", full)
    logger.info("step 2/6 loss=2.3")
    logger.info("step 4/6 loss=2.2")
    assert capsys.readouterr().err == (
        f"warning: cannot write the log {tmp_path / 'train.log'} (OSError: [Errno 28] No space left on device); lines "
        "it cannot take are lost (free space on its disk)\n"
    )
    monkeypatch.setattr(console_module, "_unwritable_logs", set())
    console_module.console("error: could not write the checkpoint of step 2")
    logger.info("closing")
    assert capsys.readouterr().err == "error: could not write the checkpoint of step 2\n"
    monkeypatch.setattr(handler, "flush", lambda: None)
    logger.info("%d steps", "two")  # a bug of the message: logging's own report
    assert "--- Logging error ---" in capsys.readouterr().err
    handler.close()


@pytest.mark.unit
def test_every_product_warning_is_one_stderr_line_on_the_speaking_process(monkeypatch, capsys):
    """One channel: a WARNING of any product logger (``data.text``'s rewritten token files, ``training.report``'s kept
    summary.json) reaches stderr as ``warning: <message>``, once; a library's warning, an error record, and any
    warning on a process that does not speak for the job (its log has it) do not."""
    import training  # noqa: F401  (installs training.process.WarningLines)
    from training import process

    capsys.readouterr()
    logging.getLogger("data.text").warning("the token files in %s are damaged (%s); writing them again", "/c", "cut")
    logging.getLogger("training.report").warning("%s already existed: kept as %s", "/r/summary.json", "kept.json")
    logging.getLogger("jax._src.xla_bridge").warning("a library's warning")
    logging.getLogger("training.run").error("an error record: the run's error line says it")
    logging.getLogger("evaluate").info("an info record")
    assert capsys.readouterr().err.splitlines() == [
        "warning: the token files in /c are damaged (cut); writing them again",
        "warning: /r/summary.json already existed: kept as kept.json",
    ]
    monkeypatch.setattr(process, "_rank", 1)
    logging.getLogger("training.checkpoint").warning("said by process 0")
    assert capsys.readouterr().err == ""


def test_a_kept_summary_is_a_warning_line_on_stderr(tmp_path):
    """A run in a folder holding an earlier run's summary.json keeps it under another name: that was said only in the
    log on stdout; now on stderr too, as one ``warning:`` line."""
    run_dir = tmp_path / "run"
    small = ("data=synthetic", "wandb.mode=disabled", "train.global_batch=64")
    assert run_train(run_dir, *small, "train.steps=-2").returncode == 1  # refused: a failed summary.json
    proc = run_train(run_dir, *small, "train.steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (kept,) = run_dir.glob("summary.previous-*.json")
    warned = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert f"warning: {run_dir / 'summary.json'} already existed: kept as {kept.name}" in warned, proc.stderr
    assert len(warned) == len(set(warned))
