"""``python -m evaluate``: train.py's override syntax, ``--json`` anywhere among the overrides, a missing data set
and another model than the checkpoint's refused in one line."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from utils import REPO


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


@pytest.mark.parametrize(
    "argv", [["ck", "--json", "mesh.devices=2", "parallel=pmap"], ["ck", "mesh.devices=2", "--json", "parallel=pmap"]]
)
def test_evaluate_takes_json_between_overrides(argv, monkeypatch, capsys):
    import evaluate

    seen = {}

    def fake(checkpoint, overrides, best):
        seen.update(checkpoint=checkpoint, overrides=list(overrides), best=best)
        return {"eval/accuracy": 0.5, "eval/loss": 1.0, "step": 3, "examples": 10, "checkpoint": "ck/3"}

    monkeypatch.setattr(evaluate, "evaluate_checkpoint", fake)
    assert evaluate.main(argv) == 0
    assert seen == {"checkpoint": Path("ck"), "overrides": ["mesh.devices=2", "parallel=pmap"], "best": False}
    assert capsys.readouterr().out == (
        '{"checkpoint": "ck/3", "eval/accuracy": 0.5, "eval/loss": 1.0, "examples": 10, "step": 3}\n'
    )


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


@pytest.mark.unit
def test_a_sweep_folder_is_named_with_a_job_to_pass(tmp_path, capsys):
    """evaluate and sample given a sweep folder: its job folders are named by numbers as checkpoint steps are, and
    were each taken for a corrupt step (two warnings, then "holds no checkpoint"). Now one line says it is a sweep
    and which job folder to pass; that folder is accepted. A folder inside a step names the step."""
    import evaluate
    import sample
    from core.errors import ConfigError
    from utils import fake_sweep

    sweep = fake_sweep(tmp_path / "sweep", jobs=3)
    line = f"error: {sweep} is a sweep folder (jobs 0, 1, 2), not a run: pass one run's folder, e.g. {sweep / '0'}"
    assert evaluate.main([str(sweep)]) == 1
    assert capsys.readouterr().err.strip() == line
    assert sample.main([str(sweep)]) == 1
    assert capsys.readouterr().err.strip() == line
    assert evaluate.find_step_dir(sweep / "0") == sweep / "0" / "checkpoints" / "4"  # the advice, followed
    assert sample.find_checkpoint(sweep / "0") == sweep / "0" / "checkpoints" / "4"
    state = sweep / "0" / "checkpoints" / "4" / "state"
    with pytest.raises(ConfigError) as e:
        evaluate.find_step_dir(state)
    assert str(e.value) == f"{state} is inside the checkpoint step folder {state.parent}: pass {state.parent}"
    (sweep / "multirun.yaml").unlink()  # run folders below, no sweep of theirs (e.g. outputs/ of dated runs)
    with pytest.raises(ConfigError) as e:
        evaluate.find_step_dir(sweep)
    assert (
        str(e.value)
        == f"{sweep} is a folder of runs (runs 0, 1, 2), not a run: pass one run's folder, e.g. {sweep / '0'}"
    )


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_evaluate_a_damaged_newest_step_evaluates_the_newest_complete_one(tmp_path, capsys):
    """A checkpoint folder whose newest step has a truncated file: one warning line naming it, and the newest complete
    step is evaluated (the same numbers as evaluating that step itself); none complete, or the damaged step given
    itself: one ``error:`` line, exit 1. Never a traceback (orbax's event loop ends after its pending reads)."""
    import json
    import subprocess

    from utils import damage_step, make_cfg, save_steps

    ckpt = tmp_path / "ckpt"
    cfg = make_cfg({"data": {"name": "synthetic", "eval_size": 512}, "mesh": {"devices": 2}})
    save_steps(ckpt, cfg, {2: 1.0, 4: 3.0})
    damage_step(ckpt / "4")

    def evaluate(*args):
        cmd = [sys.executable, "-m", "evaluate", *map(str, args)]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
        assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-3000:]
        return proc

    fallback, direct = evaluate(ckpt, "--json"), evaluate(ckpt / "2", "--json")
    assert fallback.returncode == 0 and direct.returncode == 0, fallback.stderr[-3000:]
    got, want = json.loads(fallback.stdout), json.loads(direct.stdout)
    assert got == want and got["step"] == 2 and got["checkpoint"] == str(ckpt / "2")
    assert direct.stderr == ""
    (line,) = fallback.stderr.splitlines()
    assert line.startswith(f"warning: checkpoint {ckpt / '4'} is incomplete or corrupt (ValueError: ")
    assert line.endswith(f"); evaluating the newest complete one, {ckpt / '2'}")

    import evaluate as tool  # the same in-process (and faster), on the test session's devices

    capsys.readouterr()
    assert tool.main([str(ckpt / "4")]) == 1  # the damaged step itself: its folder holds a complete one
    out, err = capsys.readouterr()
    (line,) = err.splitlines()
    assert out == "" and line.startswith(f"error: checkpoint {ckpt / '4'} is incomplete or corrupt (ValueError: ")
    assert line.endswith(f"); give its folder {ckpt} to evaluate the newest complete step")

    damage_step(ckpt / "2")
    assert tool.main([str(ckpt)]) == 1
    out, err = capsys.readouterr()
    (line,) = err.splitlines()
    assert out == "" and line.startswith(
        f"error: checkpoints 4, 2 in {ckpt} are incomplete or corrupt (step 4: ValueError: "
    )
    assert line.endswith(f"); no complete checkpoint is left in {ckpt}: give another checkpoint folder")
    assert sorted(p.name for p in ckpt.iterdir()) == ["2", "4"]  # a reader moves nothing


@pytest.mark.unit
def test_an_entry_named_like_a_step_that_is_not_a_folder_is_named(tmp_path, capsys):
    """A broken symbolic link ``30`` and a file ``20`` beside the complete step 10: evaluate and sample ignored them
    silently (or, with no complete step, blamed the run's summary); now one warning names both and the newest
    complete step is used, and with none complete one error line names them."""
    import evaluate
    import sample
    from core.errors import ConfigError
    from utils import make_cfg, save_steps

    run = tmp_path / "run"
    ckpt = run / "checkpoints"
    save_steps(ckpt, make_cfg({"data": {"name": "synthetic"}}), {10: 1.0})
    (ckpt / "20").write_text("not a step")
    (ckpt / "30").symlink_to(tmp_path / "gone")
    (run / "summary.json").write_text('{"status": "ok"}')
    odd = f"{ckpt / '20'} (a file), {ckpt / '30'} (a broken symbolic link) are not checkpoint step folders"
    for find in (evaluate.find_step_dir, sample.find_checkpoint):
        capsys.readouterr()
        assert find(run) == ckpt / "10"
        assert capsys.readouterr().err.splitlines() == [
            f"warning: {odd}: ignored; the newest complete step is {ckpt / '10'}"
        ]
    shutil.rmtree(ckpt / "10")
    for given in (run, ckpt):
        with pytest.raises(ConfigError) as e:
            evaluate.find_step_dir(given)
        assert str(e.value) == f"{ckpt} holds no complete checkpoint: {odd}; give another checkpoint folder"


@pytest.mark.unit
def test_a_step_whose_metadata_no_longer_fits_its_arrays_is_named_and_an_earlier_one_evaluated(tmp_path, capsys):
    """model.hidden edited in the newest step's meta/metadata: evaluate said train.py's "does not fit this run ...
    resume with the checkpoint's model ... checkpoint.resume=never" (no evaluate option; following it gave the same
    error). Now the step is damaged: one warning naming it and the newest step that fits is evaluated; the step given
    itself is one line whose advice (its folder) evaluates."""
    import json

    import evaluate as tool
    from utils import make_cfg, save_steps

    ckpt = tmp_path / "ckpt"
    save_steps(
        ckpt, make_cfg({"data": {"name": "synthetic", "eval_size": 256}, "mesh": {"devices": 2}}), {2: 1.0, 4: 3.0}
    )
    meta = ckpt / "4" / "meta" / "metadata"
    edited = json.loads(meta.read_text())
    edited["config"]["model"]["hidden"] = 64
    meta.write_text(json.dumps(edited))
    damaged = (
        f"checkpoint {ckpt / '4'} is incomplete or corrupt (its metadata does not fit its arrays: "
        "opt_state.0.mu.hidden.bias is ((256,), 'float32') in its arrays but ((64,), 'float32') by its config)"
    )
    capsys.readouterr()

    assert tool.main([str(ckpt / "4")]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [f"error: {damaged}; give its folder {ckpt} to evaluate the newest complete step"]

    assert tool.main([str(ckpt), "--json"]) == 0  # the advice followed
    out, err = capsys.readouterr()
    assert err.splitlines() == [f"warning: {damaged}; evaluating the newest complete one, {ckpt / '2'}"]
    got = json.loads(out)
    assert got["step"] == 2 and got["checkpoint"] == str(ckpt / "2")
    assert json.loads(meta.read_text())["config"]["model"]["hidden"] == 64  # a reader changes nothing
