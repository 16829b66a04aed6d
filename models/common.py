"""Pieces shared by the models: per-example dropout, per-site dropout keys and fast, bitwise-stock initialisers."""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from core.draws import sample


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


def variance_scaling(scale: float, mode: str, distribution: str) -> nnx.Initializer:
    """``jax.nn.initializers.variance_scaling(scale, mode, distribution)`` (in_axis=-2, out_axis=-1) with
    bitwise the same values, but cheap to compile.

    Why: eager initialisation compiles one random draw per distinct parameter shape, and on XLA:CPU a draw of
    a multi-dimensional shape (e.g. a ``3x3x4x8`` conv kernel) can take seconds to compile, a flat draw much
    less. Here every draw is flat, over a power-of-two bucket of sizes (see ``core.draws.bucket``), then cut
    and reshaped, so few programs are compiled. The bits of a threefry draw depend
    only on the flat element index (and, in partitionable mode, a longer draw extends a shorter one), so the
    values equal the stock initialiser's (``tests/test_models.py`` checks this).
    """
    if mode not in ("fan_in", "fan_out", "fan_avg") or distribution not in ("truncated_normal", "normal", "uniform"):
        raise ValueError(f"unsupported variance_scaling({mode!r}, {distribution!r})")

    def init(key: jax.Array, shape: Sequence[int], dtype=jnp.float32) -> jax.Array:
        shape = tuple(int(d) for d in shape)
        if len(shape) < 2:
            raise ValueError(f"variance_scaling needs a kernel of rank >= 2, got shape {shape}")
        receptive = math.prod(shape[:-2])
        fan_in, fan_out = shape[-2] * receptive, shape[-1] * receptive
        denominator = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}[mode]
        variance = jnp.array(scale / denominator, dtype=dtype)
        if distribution == "truncated_normal":
            # constant: stddev of a standard normal truncated to (-2, 2)
            factor = jnp.sqrt(variance) / jnp.array(0.87962566103423978, dtype)
        elif distribution == "normal":
            factor = jnp.sqrt(variance)
        else:
            factor = jnp.sqrt(3 * variance)
        return sample(key, shape, dtype, distribution, factor)

    return init


LECUN_NORMAL = variance_scaling(1.0, "fan_in", "truncated_normal")  # flax's default kernel_init
XAVIER_UNIFORM = variance_scaling(1.0, "fan_avg", "uniform")
HE_NORMAL_FAN_OUT = variance_scaling(2.0, "fan_out", "normal")  # torchvision's ResNet conv init


def normal(stddev: float) -> nnx.Initializer:
    """``N(0, stddev^2)``, bitwise ``nnx.initializers.normal(stddev)`` (drawn as in ``variance_scaling``)."""

    def init(key: jax.Array, shape: Sequence[int], dtype=jnp.float32) -> jax.Array:
        return sample(key, tuple(shape), dtype, "normal", jnp.array(stddev, dtype))

    return init


def site_keys(keys_B: jax.Array | None, site: int) -> jax.Array | None:
    """Per-example keys for dropout site ``site``: ``fold_in(key_b, site)`` for every example ``b``.

    Each dropout site of a model must draw from its own key: ``per_example_dropout`` with the same key at
    two sites would give correlated masks (threefry bits depend only on the key and the element index).
    """
    if keys_B is None:
        return None
    return jax.vmap(lambda k: jax.random.fold_in(k, site))(keys_B)
