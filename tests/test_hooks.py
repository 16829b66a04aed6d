"""Whether a run's final numbers are usable (training/hooks.py: FinalEvaluation, nonfinite_final, exploded_final):
a diverged or exploded run fails with one line before its final checkpoint; metrics.jsonl and summary.json stay
strict JSON."""

from __future__ import annotations

import json
import math

import pytest

from utils import run_train


def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def test_diverged_run_fails_with_one_line(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, "data=synthetic", "optim=sgd", "optim.lr=1e37", "train.steps=1", "wandb.mode=disabled")
    assert proc.returncode == 1
    (err,) = error_lines(proc)
    assert err == (
        "error: the run diverged: final eval/loss=inf is not finite; lower optim.lr, enable "
        "optim.clip_grad_norm, or, under bf16/fp16, use precision=fp32, in a new run (its own checkpoint.dir where "
        "one is pinned)"
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
def test_nonfinite_final_names_every_key():
    from training.hooks import nonfinite_final

    assert nonfinite_final({"train/loss": 2.3}, {"eval/loss": 1.0, "eval/accuracy": 0.5}) is None
    msg = nonfinite_final({"train/loss": float("nan")}, {"eval/loss": float("inf"), "eval/accuracy": 0.1})
    assert msg.startswith("the run diverged: final eval/loss=inf, train/loss=nan is not finite;")


def test_exploded_final_loss_warns_above_ten_uniform_guesses():
    from training.hooks import exploded_final

    assert exploded_final({"train/loss": 0.35}, {"eval/loss": 0.33}, 10) is None
    assert exploded_final({"train/loss": 11.1}, {"eval/loss": 9.0}, 10) is None  # Adam lr 1: high, recovering
    assert exploded_final({}, {"eval/loss": 23.0}, 10) is None  # 23.0 < 10 x ln 10 = 23.03
    assert exploded_final({"train/loss": float("inf")}, {}, 10) is None  # non-finite: nonfinite_final fails it
    assert exploded_final({"train/loss": 261.0}, {"eval/loss": 2.0}, 10) == (
        "warning: the loss exploded: final train/loss=261 is above 10 x ln(10) = 23 (a uniform guess scores "
        "ln(10)); lower optim.lr or enable optim.clip_grad_norm in a new run (its own checkpoint.dir where one is "
        "pinned)"
    )
    assert exploded_final({"train/loss": 7.865e32}, {"eval/loss": 6.908e32}, 100) == (
        "warning: the loss exploded: final train/loss=7.865e+32 and eval/loss=6.908e+32 are above 10 x ln(100) = "
        "46.1 (a uniform guess scores ln(100)); lower optim.lr or enable optim.clip_grad_norm in a new run (its own "
        "checkpoint.dir where one is pinned)"
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
        "lower optim.lr or enable optim.clip_grad_norm in a new run (its own checkpoint.dir where one is pinned) "
        "(train.allow_exploded_loss=true keeps the run)"
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
        "are above 10 x ln(10) = 23 (a uniform guess scores ln(10)); lower optim.lr or enable optim.clip_grad_norm "
        "in a new run (its own checkpoint.dir where one is pinned)"
    )


def test_the_exploded_loss_advice_resumes_when_followed(tmp_path):
    """The exploded-loss error says ``train.allow_exploded_loss=true keeps the run``: the same command with that
    key, in the same run folder, resumes the run's periodic checkpoint and ends ok (it is not a changed setting
    the resume refuses)."""
    import json

    from utils import run_train

    run_dir = tmp_path / "run"
    args = ("data=synthetic", "train.steps=10", "checkpoint.every=5", "optim.lr=1e30", "wandb.mode=disabled")
    proc = run_train(run_dir, *args)
    assert proc.returncode == 1
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert line.endswith("(train.allow_exploded_loss=true keeps the run)")
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("[0-9]*")) == ["5"]

    proc = run_train(run_dir, *args, "train.allow_exploded_loss=true")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "ok" and s["train/steps"] == 10 and s["checkpoint/last_step"] == 10
    assert "resuming" in proc.stderr and "train.allow_exploded_loss: False -> True" in proc.stderr

    # the line's other fix: a lower learning rate in a new run, with its own checkpoint.dir (this one is pinned)
    lower = [a for a in args if not a.startswith("optim.lr")]
    proc = run_train(run_dir, *lower, "optim.lr=1e-3", f"checkpoint.dir={tmp_path / 'new'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "ok" and s["train/loss"] < 23 and (tmp_path / "new" / "10").is_dir()
