"""``checkpoint.keep_best``: the best evaluated step kept in ``<checkpoint.dir>/best`` beside the newest, never
rotated away; ``python -m sample --best`` / ``python -m evaluate --best`` read it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from core.errors import ConfigError
from training import checkpoint
from utils import make_cfg, save_steps

pytestmark = pytest.mark.unit


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def mlp_cfg(ckpt: Path, **checkpoint_keys):
    return make_cfg(
        {
            "data": {"name": "synthetic", "eval_size": 500},
            "mesh": {"devices": 2},
            "wandb": {"mode": "disabled"},
            "checkpoint": {"dir": str(ckpt), "every": 2, "keep": 1, **checkpoint_keys},
            "train": {"steps": 8, "log_every": 2, "eval_every": 2, "eval_batch": 500, "global_batch": 32},
        }
    )


def test_the_best_evaluated_step_is_kept_beside_the_newest(tmp_path, monkeypatch, capsys):
    """Evaluation losses 3.0, 2.0, 2.5, 2.7 (steps 2, 4, 6, 8; down, then up): the best folder holds step 4, which
    the keep=1 rotation never deletes, with the state of step 4 (the arrays a periodic save of step 4 wrote); a
    resumed run keeps it; ``evaluate --best`` and ``sample``'s lookup load it."""
    import evaluate
    import sample
    import training.run
    from training.run import run_and_report

    losses = iter([3.0, 2.0, 2.5, 2.7])
    real = training.run.evaluate

    def scripted(exp, params, eval_set, *args):
        return {**real(exp, params, eval_set, *args), "eval/loss": next(losses)}

    monkeypatch.setattr(training.run, "evaluate", scripted)
    ckpt, ref = tmp_path / "ckpt", tmp_path / "ref"
    for run in ("run", "ref"):
        (tmp_path / run).mkdir()
    assert run_and_report(mlp_cfg(ckpt, keep_best="eval/loss"), tmp_path / "run")
    assert checkpoint.complete_steps(ckpt) == [8]  # checkpoint.keep=1
    assert checkpoint.complete_steps(ckpt / "best") == [4]
    meta = checkpoint.read_metadata(ckpt / "best" / "4")
    assert meta["best"] == {"metric": "eval/loss", "value": 2.0, "mode": "min"} and meta["reason"] == "best"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["checkpoint/best_step"], summary["checkpoint/best_value"]) == (4, 2.0)
    assert summary["checkpoint/best_path"] == str(ckpt / "best" / "4")
    # the same run without keep_best, keeping every step: its step 4 is the best folder's state, array for array
    losses = iter([3.0, 2.0, 2.5, 2.7])
    cfg = mlp_cfg(ref)
    cfg.checkpoint.keep = 10
    assert run_and_report(cfg, tmp_path / "ref")
    best, periodic = checkpoint.read_arrays(ckpt / "best" / "4"), checkpoint.read_arrays(ref / "4")
    assert best.keys() == periodic.keys()
    for k in best:
        np.testing.assert_array_equal(best[k], periodic[k])
    assert not (ref / "best").exists()
    # --best: evaluate and sample look up the best step (a run folder or its checkpoint folder)
    monkeypatch.setattr(training.run, "evaluate", real)
    assert evaluate.evaluate_checkpoint(ckpt, best=True)["step"] == 4
    assert evaluate.find_best_step_dir(ckpt) == ckpt / "best" / "4"
    assert sample.find_checkpoint(ckpt) == ckpt / "8"
    assert sample.find_checkpoint(ckpt, best=True) == ckpt / "best" / "4"
    assert evaluate.main([str(ckpt), "--best", "--json", "mesh.devices=1"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["checkpoint"] == str(ckpt / "best" / "4")
    # without keep_best: --best is one error line
    assert evaluate.main([str(ref), "--best"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: no best checkpoint in {ref / 'best'}: the run was trained without checkpoint.keep_best (train with "
        f"checkpoint.keep_best=eval/loss and train.eval_every=N to keep one), or leave out --best for the newest"
    ]
    with pytest.raises(ConfigError, match=r"^--best takes a run folder or a checkpoint folder, not the step folder"):
        evaluate.find_best_step_dir(ckpt / "8")
    # a resumed run starts from the recorded best: worse evaluations (2.1 > 2.0) replace nothing
    losses = iter([2.1, 2.2])
    monkeypatch.setattr(training.run, "evaluate", scripted)
    (tmp_path / "more").mkdir()
    cfg = mlp_cfg(ckpt, keep_best="eval/loss")
    cfg.train.steps = 12
    assert run_and_report(cfg, tmp_path / "more")
    assert checkpoint.complete_steps(ckpt / "best") == [4] and checkpoint.complete_steps(ckpt) == [12]
    summary = json.loads((tmp_path / "more" / "summary.json").read_text())
    assert (summary["checkpoint/best_step"], summary["checkpoint/best_value"]) == (4, 2.0)


def test_max_mode_and_the_real_losses_of_a_gpt(tmp_path):
    """eval/accuracy is kept by its maximum (auto), eval/loss by its minimum: the best folder's value is the best
    of the evaluations the run logged."""
    from training.run import run_and_report

    for metric, pick in (("eval/accuracy", max), ("eval/loss", min)):
        run, ckpt = tmp_path / metric.replace("/", "_"), tmp_path / f"ckpt_{metric.replace('/', '_')}"
        run.mkdir()
        cfg = make_cfg(
            {
                "model": {"name": "gpt", "size": "tiny", "depth": 1, "width": 32, "heads": 2, "context": 16},
                "data": {"name": "synthetic", "train_size": 4000, "eval_size": 500},
                "mesh": {"devices": 1},
                "optim": {"lr": 1e-2},
                "wandb": {"mode": "disabled"},
                "checkpoint": {"dir": str(ckpt), "every": 0, "keep_best": metric},
                "train": {"steps": 12, "log_every": 3, "eval_every": 3, "eval_batch": 64, "global_batch": 8},
            }
        )
        assert run_and_report(cfg, run)
        logged = {r["step"]: r[metric] for r in records(run) if metric in r}
        assert sorted(logged) == [3, 6, 9, 12]
        best_step = pick(logged, key=lambda s: (logged[s], -s) if pick is max else (logged[s], s))
        meta = checkpoint.read_metadata(checkpoint.best_step_dir(ckpt / "best"))
        assert meta["step"] == best_step and meta["best"]["value"] == logged[best_step]
        assert meta["best"]["mode"] == ("max" if metric == "eval/accuracy" else "min")


@pytest.mark.parametrize(
    "keys, model, message",
    [
        (
            {"keep_best": "eval/los"},
            "mlp",
            r"^checkpoint\.keep_best=eval/los is not an evaluation metric; choose one of",
        ),
        ({"keep_best": "eval/bpb"}, "mlp", r"^checkpoint\.keep_best=eval/bpb is a language model's metric"),
        ({"keep_best": "eval/loss", "enabled": False}, "mlp", r"^checkpoint\.keep_best=eval/loss keeps a checkpoint"),
        (  # it kept the worst accuracy, deleting the better checkpoint
            {"keep_best": "eval/accuracy", "best_mode": "min"},
            "mlp",
            r"^checkpoint\.best_mode=min keeps the lowest eval/accuracy, the worst one; use checkpoint\.best_mode=auto "
            r"\(max for eval/accuracy\)$",
        ),
        (
            {"keep_best": "eval/perplexity", "best_mode": "max"},
            "gpt",
            r"^checkpoint\.best_mode=max keeps the highest eval/perplexity, the worst one; use "
            r"checkpoint\.best_mode=auto \(min for eval/perplexity\)$",
        ),
    ],
)
def test_bad_keep_best_is_one_line(tmp_path, capsys, keys, model, message):
    from training.run import run_and_report

    cfg = make_cfg(
        {
            "model": {"name": model},
            "data": {"name": "synthetic"},
            "wandb": {"mode": "disabled"},
            "checkpoint": {"dir": str(tmp_path / "ck"), **keys},
            "train": {"steps": 2},
        }
    )
    (tmp_path / "run").mkdir()
    assert not run_and_report(cfg, tmp_path / "run")
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1
    assert re.match(message, err[0].removeprefix("error: ")), err
    assert not (tmp_path / "ck").exists()


def test_the_best_folder_keeps_the_best_value_not_the_newest_step(tmp_path, monkeypatch, capsys):
    """A resumed run that evaluates more often (``train.eval_every`` may change on resume) can find a better step
    before the recorded best: the folder keeps that one (orbax ranks the best folder's steps by their value). A
    fresh run in a folder holding an earlier run's best moves it aside first."""
    import training.run
    from training.run import run_and_report

    values = {4: 3.0, 8: 2.0}
    real = training.run.evaluate
    steps = iter([4, 8])
    monkeypatch.setattr(training.run, "evaluate", lambda *a: {**real(*a), "eval/loss": values[next(steps)]})
    ckpt = tmp_path / "ckpt"
    for run in ("a", "b", "c"):
        (tmp_path / run).mkdir()
    cfg = mlp_cfg(ckpt, keep_best="eval/loss")
    cfg.train.eval_every, cfg.checkpoint.keep = 4, 10
    assert run_and_report(cfg, tmp_path / "a")
    assert checkpoint.complete_steps(ckpt / "best") == [8]
    import shutil

    for step in (6, 8):  # as if the run had stopped after step 5 (its best of step 8 already saved)
        shutil.rmtree(ckpt / str(step))
    values, steps = {6: 1.0, 8: 1.5}, iter([6, 8])
    cfg = mlp_cfg(ckpt, keep_best="eval/loss")
    cfg.checkpoint.keep = 10  # eval_every 2: resumed at step 4, evaluations at 6 and 8
    assert run_and_report(cfg, tmp_path / "b")
    assert checkpoint.complete_steps(ckpt / "best") == [6]
    assert checkpoint.read_metadata(ckpt / "best" / "6")["best"]["value"] == 1.0
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert (summary["checkpoint/best_step"], summary["checkpoint/best_value"]) == (6, 1.0)
    # a fresh run (no step left to resume) in that folder: the old best is moved aside, not compared with
    for step in checkpoint.complete_steps(ckpt):
        shutil.rmtree(ckpt / str(step))
    values, steps = {2: 9.0, 4: 8.0, 6: 7.0, 8: 6.0}, iter([2, 4, 6, 8])
    capsys.readouterr()
    assert run_and_report(mlp_cfg(ckpt, keep_best="eval/loss"), tmp_path / "c")
    assert checkpoint.complete_steps(ckpt / "best") == [8]
    moved = [p for p in ckpt.iterdir() if p.name.startswith("best.previous-")]
    assert len(moved) == 1 and checkpoint.complete_steps(moved[0]) == [6]
    assert f"moved to {moved[0]}" in capsys.readouterr().err


def test_a_damaged_best_checkpoint_is_named_not_guessed(tmp_path):
    """A best checkpoint whose metadata was lost was reported as "trained without checkpoint.keep_best" (a false
    cause); now the line names the damaged step and what to do."""
    import evaluate
    from core.errors import ConfigError
    from utils import make_cfg, save_steps

    ckpt = tmp_path / "ckpt"
    save_steps(ckpt / "best", make_cfg({"data": {"name": "synthetic"}}), {4: 1.0})
    assert evaluate.find_best_step_dir(ckpt) == ckpt / "best" / "4"
    (ckpt / "best" / "4" / "meta" / "metadata").unlink()
    with pytest.raises(ConfigError) as e:
        evaluate.find_best_step_dir(ckpt)
    assert str(e.value).startswith(f"the best checkpoint {ckpt / 'best' / '4'} is incomplete or corrupt (")
    assert str(e.value).endswith(
        "); leave out --best for the newest checkpoint, or train again with checkpoint.keep_best to keep a new best one"
    )


def test_a_moved_best_folder_is_named_not_a_run_without_keep_best(tmp_path):
    """A run whose summary.json records checkpoint.keep_best but whose best/ folder is gone was said to be "trained
    without checkpoint.keep_best" (false); now the line names the summary's best_path and the fixes, and the folder
    it was moved to (under any name) is read with --best."""
    import evaluate
    from core.errors import ConfigError
    from utils import make_cfg, save_steps

    run, cfg = tmp_path / "run", make_cfg({"data": {"name": "synthetic"}})
    save_steps(run / "checkpoints", cfg, {8: 1.0})
    save_steps(run / "checkpoints" / "best", cfg, {4: 1.0})
    meta = run / "checkpoints" / "best" / "4" / "meta" / "metadata"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "best": {"metric": "eval/loss", "value": 1.0}}))
    best_path = run / "checkpoints" / "best" / "4"
    summary = {"status": "ok", "checkpoint/best_metric": "eval/loss", "checkpoint/best_path": str(best_path)}
    (run / "summary.json").write_text(json.dumps(summary))
    moved = tmp_path / "kept_best"
    (run / "checkpoints" / "best").rename(moved)
    for given in (run, run / "checkpoints"):
        with pytest.raises(ConfigError) as e:
            evaluate.find_best_step_dir(given)
        assert str(e.value) == (
            f"no best checkpoint in {run / 'checkpoints' / 'best'}, but {run / 'summary.json'} says the run kept one "
            f"in {best_path}: the best folder was moved or deleted; give the folder it was moved to with --best, or "
            f"leave out --best for the newest"
        )
    assert evaluate.find_best_step_dir(moved) == moved / "4"  # the fix: the folder it was moved to
    assert evaluate.find_step_dir(run) == run / "checkpoints" / "8"  # the other fix: without --best


@pytest.mark.unit
def test_a_best_checkpoint_saved_by_another_run_is_named(tmp_path, capsys):
    """best/ holding a step another run saved (its metadata's run_dir, another model.hidden) was reported silently
    as this run's best; now one warning names the step and the run that saved it, and it is still the one read."""
    import json

    import evaluate
    from utils import make_cfg, save_steps

    run, other = tmp_path / "run", tmp_path / "other"
    (run / ".hydra").mkdir(parents=True)
    save_steps(run / "checkpoints", make_cfg({"data": {"name": "synthetic"}}), {8: 1.0})
    save_steps(run / "checkpoints" / "best", make_cfg({"data": {"name": "synthetic"}, "model": {"hidden": 64}}), {4: 1})
    for step, saver in ((run / "checkpoints" / "8", run), (run / "checkpoints" / "best" / "4", other)):
        meta = step / "meta" / "metadata"
        meta.write_text(json.dumps({**json.loads(meta.read_text()), "run_dir": str(saver)}))
    capsys.readouterr()

    assert evaluate.find_best_step_dir(run) == run / "checkpoints" / "best" / "4"
    assert capsys.readouterr().err.splitlines() == [
        f"warning: the best checkpoint {run / 'checkpoints' / 'best' / '4'} was saved by another run, {other}, with "
        "other model settings; it is read as given"
    ]
    meta = run / "checkpoints" / "best" / "4" / "meta" / "metadata"  # the same run: no warning
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "run_dir": str(run)}))
    assert evaluate.find_best_step_dir(run / "checkpoints") == run / "checkpoints" / "best" / "4"
    assert capsys.readouterr().err == ""


@pytest.mark.unit
@pytest.mark.parametrize("name", ["best", "checkpoints", "3"])
def test_a_run_folder_named_like_the_checkpoint_layout_is_a_run(tmp_path, name):
    """A run folder named ``best`` was taken for a best folder: ``python -m sample <runs>/best --best`` said "the best
    folder was moved or deleted"; a run folder named ``checkpoints`` or a step number is a run as well, for --best,
    without it, and as ``checkpoint.resume`` (its checkpoint folder, named a number)."""
    import evaluate
    import sample
    from utils import save_steps

    run, cfg = tmp_path / name, make_cfg({"data": {"name": "synthetic"}})
    (run / ".hydra").mkdir(parents=True)
    save_steps(run / "checkpoints", cfg, {8: 1.0})
    save_steps(run / "checkpoints" / "best", cfg, {4: 1.0})
    (run / "summary.json").write_text(json.dumps({"status": "ok", "checkpoint/best_metric": "eval/loss"}))
    assert sample.find_checkpoint(run, best=True) == run / "checkpoints" / "best" / "4"
    assert evaluate.find_best_step_dir(run / "checkpoints") == run / "checkpoints" / "best" / "4"
    assert evaluate.find_step_dir(run) == run / "checkpoints" / "8"
    assert evaluate.find_best_step_dir(run / "checkpoints" / "best") == run / "checkpoints" / "best" / "4"


@pytest.mark.unit
def test_a_checkpoint_folder_named_a_number_resumes_from_its_newest_step(tmp_path):
    """``checkpoint.resume=<tmp>/7`` for a checkpoint folder named ``7`` (``checkpoint.dir=<tmp>/7`` of a run) was read
    as one step folder: "cannot be read: it is incomplete or corrupt (Unknown key: state ...)"; it is a folder of
    steps, resumed from its newest (4)."""
    from training.run import run_and_report

    cfg = make_cfg({"data": {"name": "synthetic"}, "wandb": {"mode": "disabled"}, "train": {"steps": 3}})
    save_steps(tmp_path / "7", cfg, {2: 1.0, 4: 1.0})
    cfg.train.steps, cfg.checkpoint.resume = 6, str(tmp_path / "7")
    (tmp_path / "run").mkdir()
    assert run_and_report(cfg, tmp_path / "run")
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["checkpoint/resumed_step"] == 4


def test_a_resume_from_the_best_folder_judges_the_training_data_by_its_bytes(tmp_path, capsys):
    """Best steps recorded no fingerprint of their training data ("data_fingerprint": null): a resume from
    ``<checkpoint.dir>/best`` then refused the same file moved elsewhere (data.path compared as a setting) and took
    a file edited in place with a false warning ("saved before they were"). Now the best step records it: the moved
    file resumes, the edited one is refused in one line naming the file."""
    import shutil

    from training.run import run_and_report

    text, moved = tmp_path / "corpus.txt", tmp_path / "moved.txt"
    text.write_text("".join(f"{i} the quick brown fox jumps over the lazy dog\n" for i in range(300)))
    shutil.copy(text, moved)

    def gpt(run: str, path: Path, steps: int, **checkpoint_keys) -> bool:
        (tmp_path / run).mkdir()
        cfg = make_cfg(
            {
                "model": {"name": "gpt", "size": "tiny", "depth": 1, "width": 32, "heads": 2, "context": 16},
                "data": {"name": "text", "path": str(path), "cache_dir": str(tmp_path / "cache")},
                "mesh": {"devices": 1},
                "wandb": {"mode": "disabled"},
                "checkpoint": {"every": 0, **checkpoint_keys},
                "train": {"steps": steps, "log_every": 2, "eval_every": 2, "eval_batch": 64, "global_batch": 8},
            }
        )
        return run_and_report(cfg, tmp_path / run)

    assert gpt("old", text, 2, keep_best="eval/loss")
    best = tmp_path / "old" / "checkpoints" / "best"
    saved = checkpoint.read_metadata(best / "2")["data_fingerprint"]
    assert saved["file"] == str(text) and saved["bytes"] == 14290
    capsys.readouterr()
    assert gpt("moved", moved, 4, resume=str(best))  # the same bytes elsewhere: the same data
    assert "fingerprint" not in capsys.readouterr().err
    text.write_text(text.read_text().replace("fox", "cat"))  # the same length, edited in place
    assert not gpt("edited", text, 4, resume=str(best))
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: checkpoint {best / '2'} was trained on other data ({text} was 14,290 bytes, blake2b "
        f"{saved['blake2b'][:12]}; it is now 14,290 bytes"
    ), errors
