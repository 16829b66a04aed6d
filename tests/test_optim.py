"""nanoGPT's optimizer settings: ``optim.min_lr`` (the floor of the decayed learning rate) and
``optim.weight_decay_mask`` (AdamW decays only the tensors of 2 or more dimensions), and what a resumed run keeps
(``training.checkpoint.policy``: INHERITED, ABSENT_MEANS)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conf.schema import as_dict
from core.errors import ConfigError
from core.optim import make_optimizer, make_schedule
from models import build_model
from training import checkpoint
from training.build import _optimizer, plan
from training.checkpoint.policy import inherited_values, resume_conflicts
from utils import make_cfg

pytestmark = pytest.mark.unit


def values(schedule, steps) -> np.ndarray:
    return np.asarray([schedule(jnp.int32(s)) for s in steps], np.float32)


def test_min_lr_is_the_floor_of_the_cosine_schedule():
    """nanoGPT's schedule: 100 warm-up steps to 1e-3, cosine decay to 1e-4 reached at step 5,000, then 1e-4."""
    s = make_schedule(1e-3, "cosine", 100, 4900, min_lr=1e-4)
    floor, peak = np.float32(1e-4), np.float32(1e-3)
    assert values(s, [0])[0] == 0.0 and values(s, [100])[0] == peak
    np.testing.assert_array_equal(values(s, [5000, 5001, 6000, 10**6]), [floor] * 4)  # exactly the floor
    assert np.all(values(s, range(100, 5001, 50)) >= floor) and values(s, [4999])[0] > floor
    np.testing.assert_allclose(values(s, [100 + 2450])[0], (1e-3 + 1e-4) / 2, rtol=1e-6)  # halfway: the middle
    # min_lr 0: optax's cosine decay, bit for bit (runs made before optim.min_lr are unchanged)
    plain = make_schedule(3e-3, "cosine", 100, 300)
    joined = optax.join_schedules(
        [optax.linear_schedule(0.0, 3e-3, 100), optax.cosine_decay_schedule(3e-3, 300)], [100]
    )
    steps = range(0, 450, 7)
    np.testing.assert_array_equal(values(plain, steps), values(joined, steps))
    assert values(plain, [400])[0] == 0.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(schedule="constant", min_lr=1e-4), r"^optim\.min_lr=0\.0001 is the floor of a decaying schedule"),
        (dict(schedule="cosine", min_lr=2e-3), r"^optim\.min_lr=0\.002 is above the peak learning rate 0\.001"),
        (dict(schedule="cosine", min_lr=-1.0), r"^optim\.min_lr=-1\.0 is out of range"),
    ],
)
def test_bad_min_lr_is_refused_in_one_line(kwargs, message):
    cfg = make_cfg(
        optim__lr=1e-3, optim__decay_steps=10, data__name="synthetic", **{f"optim__{k}": v for k, v in kwargs.items()}
    )
    with pytest.raises(ConfigError, match=message) as e:
        plan(cfg)
    assert "\n" not in str(e.value)


def tiny_gpt_params():
    model = build_model("gpt", (), 0, seed=0, size="tiny", vocab_size=16, context=4, width=8, depth=1, heads=2)
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def decayed_leaves(tx, params) -> set[str]:
    """The leaves the weight decay of ``tx`` moves: with zero gradients Adam's own update is 0, so an update of
    -lr * weight_decay * param (params all 1) can only be the decay's."""
    ones = jax.tree.map(jnp.ones_like, params)
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, ones), tx.init(ones), ones)
    flat = jax.tree_util.tree_flatten_with_path(updates)[0]
    out = set()
    for path, u in flat:
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        u = np.asarray(u)
        if np.any(u != 0):
            np.testing.assert_array_equal(u, np.full(u.shape, np.float32(-0.5 * 0.1)))  # lr 0.5 x decay 0.1, exactly
            out.add(name)
    return out


MATRICES = {
    "embed.embedding",
    "pos_embed",
    "blocks.0.qkv.kernel",
    "blocks.0.proj.kernel",
    "blocks.0.fc1.kernel",
    "blocks.0.fc2.kernel",
}


def test_weight_decay_mask_decays_only_matrices():
    """``matrices`` decays the kernels and the embeddings (tensors of >= 2 dimensions), never a bias or a norm's
    scale or bias; ``all`` decays every parameter; a new run's default (null) is ``matrices``."""
    params = tiny_gpt_params()
    every = {
        ".".join(str(getattr(k, "key", k)) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    assert MATRICES < every and "blocks.0.norm1.scale" in every and "blocks.0.qkv.bias" in every
    for mask, want in (("matrices", MATRICES), (None, MATRICES), ("all", every)):
        tx = make_optimizer("adam", 0.5, weight_decay=0.1, weight_decay_mask=mask)
        assert decayed_leaves(tx, params) == want, mask
    # through the run's own optimizer (training.build): the default and the explicit choices
    for mask, want in ((None, MATRICES), ("all", every), ("matrices", MATRICES)):
        cfg = make_cfg({"optim": {"lr": 0.5, "weight_decay": 0.1, "weight_decay_mask": mask}})
        tx, _ = _optimizer(cfg, 0.5)
        assert decayed_leaves(tx, params) == want


def test_a_resumed_run_keeps_its_weight_decay_mask_and_attention_dropout():
    """Null settings take the checkpoint's value when resuming: a checkpoint saved before the keys existed
    resumes as it was trained (mask ``all``, no attention dropout); a new run gets the new defaults."""
    cfg = make_cfg({"model": {"name": "gpt", "dropout": 0.2}, "optim": {"weight_decay": 0.1}})
    now = as_dict(cfg)
    assert now["optim"]["weight_decay_mask"] is None and now["model"]["attention_dropout"] is None
    new = {"optim.weight_decay_mask": "matrices", "model.attention_dropout": 0.2}
    assert inherited_values(None, now) == new
    old = json.loads(json.dumps(now))
    del old["optim"]["weight_decay_mask"], old["model"]["attention_dropout"]
    assert inherited_values(old, now) == {"optim.weight_decay_mask": "all", "model.attention_dropout": 0.0}
    saved = json.loads(json.dumps(now))
    saved["optim"]["weight_decay_mask"], saved["model"]["attention_dropout"] = "matrices", 0.1
    assert inherited_values(saved, now) == {"optim.weight_decay_mask": "matrices", "model.attention_dropout": 0.1}
    explicit = make_cfg(
        {"model": {"name": "gpt", "dropout": 0.2, "attention_dropout": 0.0}, "optim": {"weight_decay_mask": "all"}}
    )
    assert inherited_values(old, as_dict(explicit)) == {}  # given explicitly: compared by the resume policy
    # an older checkpoint is compared as what it ran with: the inherited values resume it, another is refused
    resumed = json.loads(json.dumps(now))
    resumed["optim"]["weight_decay_mask"], resumed["model"]["attention_dropout"] = "all", 0.0
    resumed["optim"]["min_lr"] = 0.0
    del old["optim"]["min_lr"]
    assert resume_conflicts(old, resumed, 256, 256) == []
    resumed["optim"]["weight_decay_mask"], resumed["optim"]["min_lr"] = "matrices", 1e-4
    assert resume_conflicts(old, resumed, 256, 256) == [
        "optim.min_lr: 0.0 -> 0.0001",
        "optim.weight_decay_mask: 'all' -> 'matrices'",
    ]


def test_an_old_checkpoint_resumes_with_the_mask_it_was_trained_with(tmp_path, capsys):
    """A checkpoint that lacks ``optim.weight_decay_mask`` (saved before the key existed, when AdamW decayed every
    parameter: ``all``, whose optimizer state has another structure than ``matrices``'s) resumes and evaluates with
    ``all``; ``matrices`` given explicitly is refused in one line; a fresh run records ``matrices``."""
    import evaluate
    from training.run import run_and_report

    ckpt = tmp_path / "ckpt"
    for run in ("a", "b", "c", "fresh"):
        (tmp_path / run).mkdir()
    base = {
        "data": {"name": "synthetic", "eval_size": 500},
        "mesh": {"devices": 1},
        "wandb": {"mode": "disabled"},
        "optim": {"weight_decay": 0.1},
        "checkpoint": {"dir": str(ckpt), "every": 2},
        "train": {"log_every": 2, "eval_batch": 500, "global_batch": 32},
    }
    fresh = make_cfg(
        {**base, "checkpoint": {"dir": str(tmp_path / "fresh_ckpt")}, "train": {**base["train"], "steps": 2}}
    )
    assert run_and_report(fresh, tmp_path / "fresh")
    assert checkpoint.read_metadata(tmp_path / "fresh_ckpt" / "2")["config"]["optim"]["weight_decay_mask"] == "matrices"
    old = {**base, "optim": {"weight_decay": 0.1, "weight_decay_mask": "all"}}  # what the code before the key did
    assert run_and_report(make_cfg({**old, "train": {**base["train"], "steps": 2}}), tmp_path / "a")
    meta_file = ckpt / "2" / checkpoint.META / "metadata"
    meta = json.loads(meta_file.read_text())
    del meta["config"]["optim"]["weight_decay_mask"], meta["config"]["optim"]["min_lr"]  # as saved before the keys
    meta_file.write_text(json.dumps(meta))
    assert evaluate.evaluate_checkpoint(ckpt / "2")["step"] == 2  # its optimizer state restores
    explicit = {**base, "optim": {"weight_decay": 0.1, "weight_decay_mask": "matrices"}}
    capsys.readouterr()
    assert not run_and_report(make_cfg({**explicit, "train": {**base["train"], "steps": 4}}), tmp_path / "c")
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "(optim.weight_decay_mask: 'all' -> 'matrices'); to resume it set them back" in err[0]
    assert run_and_report(make_cfg({**base, "train": {**base["train"], "steps": 4}}), tmp_path / "b")  # null: all
    assert checkpoint.read_metadata(ckpt / "4")["config"]["optim"]["weight_decay_mask"] == "all"
