"""``benchmarks/bare_gpt.py`` computes what ``train.py model=gpt data=tiny_shakespeare`` computes.

The overhead benchmark compares the repository with this bare script, so the two must train the same model on
the same batches: same parameter shapes and count, same data windows, and from the repository's initial
parameters the same loss and the same parameters after 3 Adam steps (float32, 1 device).
"""

from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from data.text import WindowSource, load_text_splits
from models.gpt import param_count_of, resolve_dims
from training.build import build, plan
from utils import REPO, make_cfg

BATCH, STEPS = 8, 3


def bare_module():
    spec = importlib.util.spec_from_file_location("bare_gpt", str(REPO / "benchmarks" / "bare_gpt.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def as_bare_layout(repo_params) -> dict:
    """The repository's pure-dict params (blocks keyed 0..L-1) in the bare script's layout (blocks a list)."""
    blocks = repo_params["blocks"]
    return {**repo_params, "blocks": [blocks[i] for i in range(len(blocks))]}


NO_CORPUS = not os.path.exists(bare_module().default_corpus())


@pytest.mark.skipif(NO_CORPUS, reason="Tiny Shakespeare not present")
def test_bare_gpt_has_the_repository_parameters_and_windows():
    bare = bare_module()
    own = bare.init_params(jax.random.key(0))
    dims = resolve_dims("tiny")
    assert (bare.VOCAB, bare.CONTEXT, bare.WIDTH, bare.DEPTH, bare.HEADS) == (
        dims.vocab_size,
        dims.context,
        dims.width,
        dims.depth,
        dims.heads,
    )
    assert sum(x.size for x in jax.tree.leaves(own)) == param_count_of(dims) == 842_496
    train_tokens, valid_tokens = load_text_splits("tiny_shakespeare", None, "/nonexistent", False)
    bare_train, bare_valid = bare.splits(bare.default_corpus())
    np.testing.assert_array_equal(bare_train, train_tokens)
    np.testing.assert_array_equal(bare_valid, valid_tokens)
    source = WindowSource(train_tokens, 128, BATCH, 0, with_index=False)
    for s in (0, 7):
        x, y = bare.batch_of(bare_train, 0, s, BATCH)
        np.testing.assert_array_equal(x, source.local_batch(s, slice(0, BATCH))["image"])
        np.testing.assert_array_equal(y, source.local_batch(s, slice(0, BATCH))["label"])


@pytest.mark.slow  # ~75-145 s on the shared 2-core machine (two GPT compilations)
@pytest.mark.skipif(NO_CORPUS, reason="Tiny Shakespeare not present")
def test_bare_gpt_is_the_repository_computation():
    bare = bare_module()
    cfg = make_cfg(
        {"model": {"name": "gpt", "size": "tiny"}, "data": {"name": "tiny_shakespeare"}},
        mesh__devices=1,
        train__global_batch=BATCH,
    )
    exp = build(plan(cfg))
    repo_initial = as_bare_layout(jax.device_get(exp.state.params))
    own = bare.init_params(jax.random.key(0))
    # same shapes and count (842,496, README "The language model")
    assert jax.tree.map(np.shape, own) == jax.tree.map(np.shape, repo_initial)
    assert sum(x.size for x in jax.tree.leaves(own)) == 842_496

    # same data: the bare split and windows are the repository's
    train_tokens, valid_tokens = load_text_splits("tiny_shakespeare", None, cfg.data.cache_dir, False)
    bare_train, bare_valid = bare.splits(bare.default_corpus())
    np.testing.assert_array_equal(bare_train, train_tokens)
    np.testing.assert_array_equal(bare_valid, valid_tokens)
    source = WindowSource(train_tokens, 128, BATCH, 0, with_index=False)
    layout = exp.mode.batch_layout()

    # same computation: the repository's step vs the bare step from the same params, on the same batches
    tx = optax.adam(1e-3)
    step = jax.jit(bare.make_train_step(tx, jnp.float32))
    params, opt_state = repo_initial, tx.init(repo_initial)
    state = exp.state
    for s in range(STEPS):
        x, y = bare.batch_of(bare_train, 0, s, BATCH)
        repo_batch = source.local_batch(s, slice(0, BATCH))
        np.testing.assert_array_equal(x, repo_batch["image"])
        np.testing.assert_array_equal(y, repo_batch["label"])
        state, metrics = exp.steps.train(state, layout.place(repo_batch, BATCH))
        params, opt_state, loss = step(params, opt_state, x, y)
        np.testing.assert_allclose(float(loss), float(metrics["train/loss"]), rtol=1e-5)
    assert float(metrics["train/loss"]) < np.log(256)  # it trains (initial loss ~ ln 256 = 5.55)
    repo_final = as_bare_layout(jax.device_get(state.params))
    # atol: the key projection's bias has a zero gradient in exact arithmetic (softmax ignores a constant
    # per query), so Adam turns its float32 noise into updates that differ by ~3e-6 between the two programs
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(repo_final)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-5)


@pytest.mark.unit
@pytest.mark.parametrize(
    "model",
    [
        {"dropout": 0.1},  # the attention probabilities dropped too (model.attention_dropout null = model.dropout)
        {"dropout": 0.1, "attention_dropout": 0.0},
        {"dropout": 0.0, "attention_dropout": 0.3},
        {"loss_chunk": 200},
        {"dropout": 0.1, "remat": "full", "loss_chunk": 512},
    ],
)
def test_bare_gpt_computes_the_repository_loss_and_gradients_with_its_levers(model):
    """With dropout (per-example keys from (seed, step, example index), one fold_in per site; the attention
    probabilities too), the fused chunked loss and remat, the bare script's loss and gradients are the
    repository's, from the same parameters and batch (float32, 1 device): the yardstick computes what the product
    computes."""
    from core.step import example_keys

    bare = bare_module()
    cfg = make_cfg(
        {"model": {"name": "gpt", "size": "tiny", **model}, "data": {"name": "synthetic"}},
        mesh__devices=1,
        train__global_batch=4,
        train__seed=3,
    )
    exp = build(plan(cfg))
    params = jax.device_get(exp.state.params)
    rng = np.random.default_rng(0)
    x, y = (jnp.asarray(rng.integers(0, 256, (4, 128)), jnp.int32) for _ in range(2))
    step, index = jnp.int32(5), jnp.arange(8, 12, dtype=jnp.int32)
    rate = model.get("dropout", 0.0)
    attn_rate = model.get("attention_dropout")
    drops = rate or attn_rate
    keys = example_keys(3, step, index) if drops else None

    def repo_loss(p):
        objective, per_example, _ = exp.local.losses(p, x, y, keys, jnp.float32(1.0 / 4))
        return jnp.sum(per_example) / 4 if objective is None else objective

    key = jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(jax.random.key(3), step), i))(index)

    def bare_loss(p):
        kw = {"rate": rate, "remat": model.get("remat", "none"), "loss_chunk": model.get("loss_chunk", 0)}
        return bare.loss_fn(as_bare_layout(p), x, y, jnp.float32, key=key if drops else None, attn_rate=attn_rate, **kw)

    want, want_grads = jax.value_and_grad(repo_loss)(params)
    got, got_grads = jax.value_and_grad(bare_loss)(params)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(as_bare_layout(want_grads)), jax.tree.leaves(got_grads)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-7)
    if drops:  # dropout really drew masks: the loss differs from the one without it
        assert abs(float(got) - float(bare.loss_fn(as_bare_layout(params), x, y, jnp.float32))) > 1e-4
    if rate and attn_rate is None:  # the attention probabilities are dropped as well: not the residual sites alone
        residual_only = bare.loss_fn(as_bare_layout(params), x, y, jnp.float32, key=key, rate=rate, attn_rate=0.0)
        assert abs(float(got) - float(residual_only)) > 1e-4
