"""Mistakes a new user makes, each ending in one clear line with the fix (or just working): paths Hydra cannot
parse unquoted, a checkpoint folder that cannot be written, an empty W&B tag, ``evaluate --json`` among the
overrides, TFDS's look for an unprepared dataset."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

from utils import REPO


# ---- a path with spaces, brackets or non-ASCII letters: Hydra's parse error says how to quote it -------------
def _parse_error(override: str) -> str:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from conf.errors import is_composition_error, one_line
    from conf.schema import OPTION_SCHEMAS, Config

    try:
        OverridesParser.create().parse_overrides([override])
    except Exception as e:
        assert is_composition_error(e), repr(e)
        return one_line(e, Config, OPTION_SCHEMAS)
    raise AssertionError(f"{override!r} parsed")


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "checkpoint.dir=ckpt/my run (1)",
            "cannot parse the override 'checkpoint.dir=ckpt/my run (1)': mismatched input ' (' expecting <EOF>; "
            "quote the value for Hydra inside the shell's quotes: 'checkpoint.dir=\"ckpt/my run (1)\"'",
        ),
        (
            "hydra.run.dir=runs/a [b]",
            "cannot parse the override 'hydra.run.dir=runs/a [b]': mismatched input '[' expecting <EOF>; "
            "quote the value for Hydra inside the shell's quotes: 'hydra.run.dir=\"runs/a [b]\"'",
        ),
        (
            "data.cache_dir=/tmp/c é",
            "cannot parse the override 'data.cache_dir=/tmp/c é': LexerNoViableAltException: data.cache_dir=/tmp/c é; "
            "quote the value for Hydra inside the shell's quotes: 'data.cache_dir=\"/tmp/c é\"'",
        ),
        # a broken list is a typo, not a quoting matter: no hint
        ("train.steps=[1,2", "cannot parse the override 'train.steps=[1,2': no viable alternative at input '[1,2'"),
    ],
)
def test_unparsable_path_override_names_the_quoting(override, message):
    assert _parse_error(override) == message


def test_the_quoted_form_the_hint_gives_parses_to_the_path():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    (parsed,) = OverridesParser.create().parse_overrides(['checkpoint.dir="ckpt/my run (1) ü=a,b%#"'])
    assert parsed.value() == "ckpt/my run (1) ü=a,b%#"


# ---- a checkpoint folder that cannot be created or written stops at start, not after training -------------------
def test_unwritable_checkpoint_dir_is_one_line_before_training(tmp_path):
    from core.errors import ConfigError
    from training.validate import check_writable_folder

    with pytest.raises(ConfigError) as e:
        check_writable_folder("checkpoint.dir", "/proc/x/ckpt")  # /proc refuses new folders, also to root
    assert str(e.value) == (
        "checkpoint.dir=/proc/x/ckpt cannot be written (No such file or directory in /proc); choose a folder "
        "you can write to"
    )
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError) as e:
        check_writable_folder("checkpoint.dir", tmp_path / "afile" / "sub")
    assert str(e.value) == (
        f"checkpoint.dir={tmp_path}/afile/sub is inside {tmp_path}/afile, which is a file; give a folder"
    )
    check_writable_folder("checkpoint.dir", tmp_path / "new" / "deeper")  # fine, and nothing is left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_read_only_folder_is_refused(tmp_path, monkeypatch):
    import tempfile

    from core.errors import ConfigError
    from training.validate import check_run_folder
    from utils import make_cfg

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", denied)  # what a read-only folder gives a user who is not root
    with pytest.raises(ConfigError) as e:
        check_run_folder(tmp_path / "run", make_cfg().checkpoint)  # checkpoint.dir null: the run folder
    assert str(e.value) == (
        f"the run folder (hydra.run.dir / hydra.sweep.dir)={tmp_path}/run/checkpoints cannot be written "
        f"(Permission denied in {tmp_path}); choose a folder you can write to"
    )
    check_run_folder(tmp_path / "run", make_cfg(checkpoint__enabled=False).checkpoint)  # no checkpoints: no probe


def test_unwritable_checkpoint_dir_in_train_py_writes_only_the_failed_summary(tmp_path):
    from utils import run_train

    run_dir = tmp_path / "run"
    proc = run_train(run_dir, "data=synthetic", "train.steps=10", "checkpoint.dir=/proc/x", "wandb.mode=disabled")
    assert proc.returncode == 1
    assert [ln for ln in proc.stderr.splitlines() if ln.strip()] == [
        "error: checkpoint.dir=/proc/x cannot be written (No such file or directory in /proc); choose a folder "
        "you can write to"
    ]
    assert sorted(p.name for p in run_dir.iterdir()) == [".hydra", "summary.json", "train.log"]


# ---- an empty W&B tag: the fix is not "shorten it" ------------------------------------------------------------
def test_empty_wandb_tag_says_remove_it():
    from core.errors import ConfigError
    from training.validate import check_wandb
    from utils import make_cfg

    with pytest.raises(ConfigError) as e:
        check_wandb(make_cfg(wandb__tags="[fast,'']").wandb)
    assert (
        str(e.value)
        == "wandb.tags[1]='' is 0 characters; W&B tags must have 1 to 64 characters: remove it or write one"
    )


# ---- evaluate: --json anywhere among the overrides ------------------------------------------------------------
@pytest.mark.parametrize(
    "argv", [["ck", "--json", "mesh.devices=2", "parallel=pmap"], ["ck", "mesh.devices=2", "--json", "parallel=pmap"]]
)
def test_evaluate_takes_json_between_overrides(argv, monkeypatch, capsys):
    import evaluate

    seen = {}

    def fake(checkpoint, overrides):
        seen.update(checkpoint=checkpoint, overrides=list(overrides))
        return {"eval/accuracy": 0.5, "eval/loss": 1.0, "step": 3, "examples": 10, "checkpoint": "ck/3"}

    monkeypatch.setattr(evaluate, "evaluate_checkpoint", fake)
    assert evaluate.main(argv) == 0
    assert seen == {"checkpoint": Path("ck"), "overrides": ["mesh.devices=2", "parallel=pmap"]}
    assert capsys.readouterr().out == (
        '{"checkpoint": "ck/3", "eval/accuracy": 0.5, "eval/loss": 1.0, "examples": 10, "step": 3}\n'
    )


# ---- TFDS's look for an unprepared dataset is silenced (the one-line error that follows says it all) -----------
def test_tfds_unprepared_variant_warning_is_known_noise(caplog):
    from training.console import quiet_known_noise

    quiet_known_noise()
    absl_logger = logging.getLogger("absl")
    with caplog.at_level(logging.WARNING, logger="absl"):
        absl_logger.warning("Variant folder /x/mnist/3.0.1 has no dataset_info.json")
        absl_logger.warning("a real warning stays")
    assert [r.getMessage() for r in caplog.records] == ["a real warning stays"]


def test_evaluate_missing_dataset_is_one_line_on_stderr(tmp_path):
    import subprocess

    from utils import run_train

    run_dir = tmp_path / "run"
    proc = run_train(run_dir, "data=synthetic", "train.steps=2", "wandb.mode=disabled")
    assert proc.returncode == 0, proc.stderr[-2000:]
    env = {**os.environ, "TFDS_DATA_DIR": str(tmp_path / "empty_tfds")}
    (tmp_path / "empty_tfds").mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "evaluate", str(run_dir / "checkpoints"), "data=mnist", "data.download=false"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1
    assert [ln for ln in proc.stderr.splitlines() if ln.strip()] == [
        f"error: dataset 'mnist' (test) is not prepared in {tmp_path}/empty_tfds and data.download=false "
        "(NotImplementedError); point TFDS_DATA_DIR (or data.data_dir) at a prepared copy, set "
        "data.download=true, or run with data=synthetic"
    ]


# ---- a finite but exploded loss: one line; the run fails unless allowed --------------------------------------------
def test_exploded_final_loss_warns_above_ten_uniform_guesses():
    from training.hooks import exploded_final

    assert exploded_final({"train/loss": 0.35}, {"eval/loss": 0.33}, 10) is None
    assert exploded_final({"train/loss": 11.1}, {"eval/loss": 9.0}, 10) is None  # Adam lr 1: high, recovering
    assert exploded_final({}, {"eval/loss": 23.0}, 10) is None  # 23.0 < 10 x ln 10 = 23.03
    assert exploded_final({"train/loss": float("inf")}, {}, 10) is None  # non-finite: nonfinite_final fails it
    assert exploded_final({"train/loss": 261.0}, {"eval/loss": 2.0}, 10) == (
        "warning: the loss exploded: final train/loss=261 is above 10 x ln(10) = 23 (a uniform guess scores "
        "ln(10)); lower optim.lr or enable optim.clip_grad_norm"
    )
    assert exploded_final({"train/loss": 7.865e32}, {"eval/loss": 6.908e32}, 100) == (
        "warning: the loss exploded: final train/loss=7.865e+32 and eval/loss=6.908e+32 are above 10 x ln(100) = "
        "46.1 (a uniform guess scores ln(100)); lower optim.lr or enable optim.clip_grad_norm"
    )


def test_huge_lr_run_fails_without_a_final_checkpoint_unless_allowed(tmp_path):
    """optim.lr=1e30: the final loss (~1e32) is finite but exploded. By default the run fails with one line before
    its final checkpoint (so a rerun does not resume it as finished); train.allow_exploded_loss=true keeps it ok
    with one warning line."""
    import json

    from utils import run_train

    run_dir = tmp_path / "run"
    proc = run_train(run_dir, "data=synthetic", "train.steps=10", "optim.lr=1e30", "wandb.mode=disabled")
    assert proc.returncode == 1
    (line,) = [ln for ln in proc.stderr.splitlines() if "loss exploded" in ln]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "failed" and s["error"] == line.removeprefix("error: ")
    assert line.startswith("error: the loss exploded: final train/loss=") and line.endswith(
        "lower optim.lr or enable optim.clip_grad_norm (train.allow_exploded_loss=true keeps the run)"
    )
    assert not list((run_dir / "checkpoints").glob("[0-9]*"))  # no final checkpoint of the exploded state

    run_dir = tmp_path / "allowed"
    proc = run_train(
        run_dir,
        "data=synthetic",
        "train.steps=10",
        "optim.lr=1e30",
        "wandb.mode=disabled",
        "checkpoint.enabled=false",
        "train.allow_exploded_loss=true",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if "loss exploded" in ln]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "ok" and s["train/loss"] > 1e30
    assert line == (
        f"warning: the loss exploded: final train/loss={s['train/loss']:.4g} and eval/loss={s['eval/loss']:.4g} "
        "are above 10 x ln(10) = 23 (a uniform guess scores ln(10)); lower optim.lr or enable optim.clip_grad_norm"
    )


# ---- killed after its final checkpoint, before summary.json: the restart reports the run's own windows ----------
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


# ---- evaluate with another model than the checkpoint's: one line naming it, not an internal tree path ---------
def test_evaluate_refuses_another_model_by_name(tmp_path):
    import evaluate
    from core.errors import ConfigError
    from utils import run_train

    ckpt = tmp_path / "ckpt"
    proc = run_train(
        tmp_path / "run", "data=synthetic", "train.steps=2", f"checkpoint.dir={ckpt}", "wandb.mode=disabled"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for overrides, change in [
        (["model=cnn"], "model.name: 'mlp' -> 'cnn'"),
        (["model.hidden=128"], "model.hidden: 256 -> 128"),
        (["data.image_shape=[32,32,3]"], "data.image_shape: [28, 28, 1] -> [32, 32, 3]"),
        (["optim=sgd"], "optim.name: 'adam' -> 'sgd'"),  # another optimizer's state: named, not a tree path
        (["optim.b1=0.8"], "optim.b1: 0.9 -> 0.8"),
    ]:
        with pytest.raises(ConfigError) as e:
            evaluate.evaluate_checkpoint(ckpt, overrides)
        assert str(e.value) == (
            f"checkpoint {ckpt}/2 holds a model trained with other settings ({change}); evaluate it with its own: "
            "leave out these overrides"
        )
    saved = {"model": {"name": "mlp", "hidden": 256, "activation": "tanh", "dropout": 0.0, "init_std": 0.01}}
    cfg = evaluate.compose_eval_config(saved, ["model.dropout=0.5", "mesh.devices=2"])
    assert evaluate.model_changes(saved, cfg) == []  # dropout is off in evaluation; the device count is free


# ---- -m after an override; a compilation cache folder that cannot be written ---------------------------------
@pytest.mark.unit
def test_multirun_flag_moves_before_the_overrides():
    from conf.errors import multirun_flag_first

    assert multirun_flag_first(["data=synthetic", "-m", "accum=1,2"]) == ["-m", "data=synthetic", "accum=1,2"]
    assert multirun_flag_first(["a=1", "--multirun"]) == ["--multirun", "a=1"]
    assert multirun_flag_first(["a=1", "b=2"]) == ["a=1", "b=2"]


@pytest.mark.unit
@pytest.mark.parametrize("where", ["file", "inside_file", "proc"])
def test_unwritable_compilation_cache_is_turned_off_with_one_warning(tmp_path, caplog, where):
    import jax

    from training.runtime import configure_compilation_cache

    (tmp_path / "f").write_text("x")
    folder = {"file": tmp_path / "f", "inside_file": tmp_path / "f" / "sub", "proc": Path("/proc/nope")}[where]
    saved = {n: getattr(jax.config, n) for n in ("jax_enable_compilation_cache", "jax_compilation_cache_dir")}
    try:
        with caplog.at_level(logging.WARNING, logger="training.runtime"):
            assert configure_compilation_cache(str(folder)) is None
        assert jax.config.jax_enable_compilation_cache is False
        [record] = [r for r in caplog.records if r.name == "training.runtime"]
        message = record.getMessage()
        assert message.startswith(f"runtime.compilation_cache_dir={folder} ")
        assert message.endswith("the compilation cache is off for this run (or set runtime.compilation_cache_dir=null)")
        assert "\n" not in message
    finally:
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()
        for name, value in saved.items():
            jax.config.update(name, value)
