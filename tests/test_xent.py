"""The output layer fused with the cross-entropy (``core.xent``): the same losses, argmax and gradients as the
logits-then-``optax`` computation, for chunks that do not divide the token count and a padded vocabulary."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from core.xent import fused_token_xent, token_xent

pytestmark = pytest.mark.unit

N, D, V, VALID = 37, 16, 48, 41  # 37 tokens (no chunk size divides it), 48 rows of which 41 real tokens


def data(seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k[0], (N, D), jnp.float32)
    w = jax.random.normal(k[1], (V, D), jnp.float32) * 0.5
    y = jax.random.randint(k[2], (N,), 0, VALID)
    best = jnp.argmax((x @ w.T)[:, :VALID], -1)
    return x, w, jnp.where(jnp.arange(N) % 2 == 0, best, y)  # every other token's label is its argmax


def reference(x, w, y, weights):
    logits = (x @ w.T)[:, :VALID]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    correct = (jnp.argmax(logits, -1) == y).astype(jnp.float32)
    return jnp.sum(loss * weights), loss, correct


@pytest.mark.parametrize("chunk", [5, 16, 37, 64])
def test_fused_equals_logits_then_loss(chunk):
    x, w, y = data()
    weights = jnp.full((N,), 0.7 / N, jnp.float32)
    total, loss, correct = fused_token_xent(x, w, y, weights, chunk, VALID)
    ref_total, ref_loss, ref_correct = reference(x, w, y, weights)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(correct, ref_correct)
    assert 0 < float(jnp.sum(correct)) < N  # some right, some wrong: the argmax is really compared
    np.testing.assert_allclose(total, ref_total, rtol=1e-5)
    eval_loss, eval_correct = token_xent(x, w, y, chunk, VALID)
    np.testing.assert_allclose(eval_loss, ref_loss, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(eval_correct, ref_correct)

    fused_grad = jax.grad(lambda x, w: 3.0 * fused_token_xent(x, w, y, weights, chunk, VALID)[0], argnums=(0, 1))
    ref_grad = jax.grad(lambda x, w: 3.0 * reference(x, w, y, weights)[0], argnums=(0, 1))
    for got, want in zip(fused_grad(x, w), ref_grad(x, w)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
        assert float(jnp.max(jnp.abs(want))) > 1e-3
    # the padding rows get no gradient (their logits are masked out of the softmax)
    assert float(jnp.max(jnp.abs(fused_grad(x, w)[1][VALID:]))) == 0.0


def test_fused_in_bf16_stays_close_to_float32():
    x, w, y = data(1)
    weights = jnp.full((N,), 1.0 / N, jnp.float32)
    total32 = fused_token_xent(x, w, y, weights, 8, VALID)[0]
    total16, loss16, _ = fused_token_xent(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), y, weights, 8, VALID)
    assert loss16.dtype == jnp.float32
    np.testing.assert_allclose(total16, total32, rtol=2e-2)
    gx, gw = jax.grad(lambda x, w: fused_token_xent(x, w, y, weights, 8, VALID)[0], argnums=(0, 1))(
        x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    )
    assert gx.dtype == gw.dtype == jnp.bfloat16
