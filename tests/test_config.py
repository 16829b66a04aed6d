"""Unknown config keys stop the run at start with one line (compose-level unit tests + one train.py run)."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir

from conf.errors import UnknownKeyError
from conf.schema import register, to_typed
from utils import REPO, run_train


def _typed(*overrides: str):
    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return to_typed(compose(config_name="config", overrides=list(overrides)))


@pytest.mark.unit
@pytest.mark.parametrize(
    "override, message",
    [
        (
            "+optim.learning_rate=0.5",
            "unknown config key optim.learning_rate for optim=adam; optim=adam has: lr, schedule, warmup_steps, "
            "decay_steps, lr_scaling, base_batch, clip_grad_norm, min_lr, b1, b2, eps, weight_decay, weight_decay_mask",
        ),
        ("+train.stepz=3", "unknown config key train.stepz; did you mean train.steps?"),
        ("+model.hiden=3", "unknown config key model.hiden for model=mlp; did you mean model.hidden?"),
        ("+mesh.devics=2", "unknown config key mesh.devics; did you mean mesh.devices?"),
        (
            "+foo=1",
            "unknown config key foo; known keys: parallel, precision, model, data, optim, mesh, wandb, "
            "train, runtime, hardware, profile, checkpoint, distributed, xla",
        ),
    ],
)
def test_unknown_key_is_one_line(override, message):
    with pytest.raises(UnknownKeyError) as e:
        _typed(override)
    assert str(e.value) == message


@pytest.mark.unit
def test_known_keys_pass():
    cfg = _typed("optim.lr=0.5", "train.steps=3", "+sweep=precision")
    assert (cfg.optim.lr, cfg.train.steps) == (0.5, 3)


def test_train_py_stops_at_start(tmp_path):
    r = run_train(tmp_path / "run", "data=synthetic", "train.steps=10", "+optim.learning_rate=0.5", timeout=300)
    assert r.returncode == 1
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [
        "error: unknown config key optim.learning_rate for optim=adam; optim=adam has: lr, schedule, "
        "warmup_steps, decay_steps, lr_scaling, base_batch, clip_grad_norm, min_lr, b1, b2, eps, weight_decay, "
        "weight_decay_mask"
    ]
    # nothing but Hydra's .hydra/ and log, and a failed summary naming the key
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == {
        "status": "failed",
        "error": lines[0].removeprefix("error: "),
    }
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".hydra", ".lock", "summary.json", "train.log"]


@pytest.mark.unit
def test_every_option_schema_pickles_by_reference():
    """A submitit job unpickles its config in a fresh process: every option's schema class must be found by name in
    ``conf.schema`` (a class made with ``dataclasses.make_dataclass`` lives in ``types`` unless told otherwise, and
    such a job's config lost the mode's keys)."""
    import pickle

    from conf import schema

    for schemas, _ in schema.OPTION_SCHEMAS.values():
        for cls in schemas.values():
            assert cls.__module__ == "conf.schema" and getattr(schema, cls.__qualname__) is cls
            assert pickle.loads(pickle.dumps(cls())) == cls()
