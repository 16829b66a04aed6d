"""Pieces shared by the models."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def per_example_dropout(x_Bx: jax.Array, rate: float, keys_B: jax.Array | None) -> jax.Array:
    """Inverted dropout with one PRNG key per example.

    Each example's mask is drawn from its own key (derived by the caller from (seed, step, global example
    index)), so masks do not depend on device count, mode, microbatching or process count.

    Args:
      x_Bx: activations, leading batch axis ``B``, any dtype.
      rate: probability of dropping a unit; 0 returns ``x_Bx`` unchanged.
      keys_B: typed PRNG keys of shape ``[B]``, or None (evaluation: no dropout).
    Returns:
      Array of the same shape and dtype as ``x_Bx``.
    """
    if rate == 0.0 or keys_B is None:
        return x_Bx
    keep = 1.0 - rate
    mask = jax.vmap(lambda k: jax.random.bernoulli(k, keep, x_Bx.shape[1:]))(keys_B)
    return jnp.where(mask, x_Bx / jnp.asarray(keep, x_Bx.dtype), jnp.zeros_like(x_Bx))
