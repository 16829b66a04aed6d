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
