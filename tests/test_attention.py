"""Causal attention kernels (``models.attention``): XLA's and the Pallas splash kernel (interpreted on the CPU)
compute the same attention and gradients as a float64 reference, and ``auto`` picks splash only on a TPU with a
context of at least 512 that is a multiple of 128."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.attention import causal_attention, resolve_attention

pytestmark = pytest.mark.unit

B, T, H, K = 2, 256, 2, 32


def reference_attention(q_BxTxHxK: np.ndarray, k_BxTxHxK: np.ndarray, v_BxTxHxK: np.ndarray) -> np.ndarray:
    """float64 numpy causal attention, for tests."""
    q, k, v = (np.asarray(x, np.float64) for x in (q_BxTxHxK, k_BxTxHxK, v_BxTxHxK))
    t, d = q.shape[1], q.shape[-1]
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


def qkv():
    return tuple(jax.random.normal(jax.random.key(i), (B, T, H, K), jnp.float32) for i in range(3))


@pytest.mark.parametrize("kind", ["xla", "splash"])
def test_kernel_equals_reference_with_gradients(kind):
    q, k, v = qkv()
    out = causal_attention(q, k, v, kind)
    np.testing.assert_allclose(out, reference_attention(q, k, v), rtol=1e-4, atol=1e-5)
    # position 0 attends only to itself: its output is its own value (causality)
    np.testing.assert_allclose(out[:, 0], v[:, 0], rtol=1e-5, atol=1e-6)
    loss = lambda kind: lambda q, k, v: jnp.sum(jnp.sin(causal_attention(q, k, v, kind)))
    got = jax.grad(loss(kind), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_auto_and_explicit_choices():
    assert resolve_attention("auto", 1024, "tpu") == "splash"
    assert resolve_attention("auto", 512, "tpu") == "splash"
    assert resolve_attention("auto", 256, "tpu") == "xla"  # shorter: XLA's attention was the faster on a v5e
    assert resolve_attention("auto", 640, "tpu") == "splash"
    assert resolve_attention("auto", 600, "tpu") == "xla"  # not a multiple of 128
    assert resolve_attention("auto", 256, "cpu") == "xla"
    assert resolve_attention("auto", 256, "gpu") == "xla"
    assert resolve_attention("xla", 200, "tpu") == "xla"
    assert resolve_attention("splash", 384, "cpu") == "splash"  # interpreted (tests)
    needs = r"^model.attention=splash needs model.context to be a multiple of 128, got 200; use model.attention=xla"
    with pytest.raises(ValueError, match=needs + r" or a context of 256$"):
        resolve_attention("splash", 200, "tpu")
    with pytest.raises(ValueError, match=r"^model.attention='flash' is unknown; choose one of auto, xla, splash$"):
        resolve_attention("flash", 256, "tpu")


def test_written_out_attention_without_dropout_equals_the_kernels():
    """``dropout_attention`` (the path attention dropout takes) with rate 0 is the same causal attention."""
    from models.attention import dropout_attention

    q, k, v = qkv()
    out = dropout_attention(q, k, v, 0.0, None)
    np.testing.assert_allclose(out, reference_attention(q, k, v), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out, causal_attention(q, k, v, "xla"), rtol=1e-5, atol=1e-6)


def test_attention_dropout_drops_probabilities_per_example():
    """With per-example keys each example's probabilities are dropped from its own key alone (the same output
    for the example whatever batch it sits in: independent of the device count), with the expected rate, scaled
    by 1/keep so the expectation is unchanged; with rate 0 or no keys nothing is dropped."""
    from models.attention import dropout_attention
    from models.common import per_example_dropout

    q, k, v = qkv()
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(7), i))(jnp.arange(B))
    out = causal_attention(q, k, v, "xla", 0.25, keys)
    alone = causal_attention(q[1:], k[1:], v[1:], "xla", 0.25, keys[1:])
    np.testing.assert_allclose(out[1:], alone, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(causal_attention(q, k, v, "xla", 0.25, None), causal_attention(q, k, v, "xla"))
    assert not np.allclose(out, causal_attention(q, k, v, "xla"), atol=1e-3)
    # the written-out attention with the dropout mask equals the float64 reference with that mask applied
    s = np.einsum("bqhd,bkhd->bhqk", np.float64(q), np.float64(k)) / np.sqrt(K)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    kept = np.asarray(per_example_dropout(jnp.ones((B, H, T, T)), 0.25, keys))  # 0 or 1/0.75 per probability
    assert abs((kept == 0).mean() - 0.25) < 0.01
    want = np.einsum("bhqk,bkhd->bqhd", p * kept, np.float64(v))
    np.testing.assert_allclose(dropout_attention(q, k, v, 0.25, keys), want, rtol=1e-4, atol=1e-5)


def test_splash_with_attention_dropout_is_refused_and_auto_takes_xla():
    assert resolve_attention("auto", 1024, "tpu", attention_dropout=0.1) == "xla"
    assert resolve_attention("auto", 1024, "tpu", attention_dropout=0.0) == "splash"
    with pytest.raises(ValueError, match=r"model.attention=splash cannot drop attention probabilities"):
        resolve_attention("splash", 1024, "tpu", attention_dropout=0.1)
