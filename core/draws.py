"""How parameter initialisers draw their random values (``models.common``'s initialisers call ``sample``).

Two ways, bitwise the same values when threefry is partitionable (each value's bits depend only on the key and
the flat element index, so a longer draw's prefix equals a shorter draw):

* flat: each parameter drawn as a 1-D array over a power-of-two "bucket" of sizes, then cut and reshaped (cheap
  to compile on XLA:CPU, where every multi-dimensional draw adds compile time);
* in shape (``partitioned_draws``, around a jitted creation of a sharded state): each parameter of at least
  ``min_bytes`` drawn directly in its shape, so that XLA partitions the draw to the output's sharding and a
  device computes only its own shards.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Iterator, Optional, Sequence

import jax
import jax.numpy as jnp

_MIN_BUCKET = 256

# bytes from which a parameter is drawn in its own shape under a trace (None: never); see ``partitioned_draws``
_IN_SHAPE_MIN_BYTES: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("in_shape_min_bytes", default=None)


def partitionable() -> bool:
    """Whether threefry is in its partitionable mode (the bits of a value depend only on key and flat index)."""
    config = jax.config  # (its option attributes are set at run time: not visible to the type checker)
    return bool(
        getattr(config, "jax_threefry_partitionable") and getattr(config, "jax_default_prng_impl") == "threefry2x32"
    )


def bucket(n: int) -> int:
    """Size actually drawn for ``n`` values: the next power of two (at least 256) when threefry is partitionable
    (a longer draw's prefix is the shorter draw, so few sizes compile), else ``n`` itself."""
    if not partitionable():
        return n
    return max(_MIN_BUCKET, 1 << (n - 1).bit_length())


def draw(key: jax.Array, scale: jax.Array, shape: tuple[int, ...], distribution: str, dtype) -> jax.Array:
    """``scale * <distribution>(key, shape)`` with JAX's own samplers: ``normal``, ``truncated_normal`` (in
    (-2, 2)), ``uniform`` (in [-1, 1))."""
    if distribution == "truncated_normal":
        x = jax.random.truncated_normal(key, -2, 2, shape, dtype)
    elif distribution == "normal":
        x = jax.random.normal(key, shape, dtype)
    else:
        x = jax.random.uniform(key, shape, dtype, -1)
    return x * scale


@contextlib.contextmanager
def partitioned_draws(min_bytes: int = 1 << 20) -> Iterator[None]:
    """Within this context, initialisers traced under ``jax.jit`` draw each parameter of at least ``min_bytes``
    bytes directly in its shape (when threefry is partitionable), so that XLA partitions the draw to the jitted
    program's output sharding: under fsdp each device computes only its own shard of a large parameter, never
    the whole of it. The values are bitwise those drawn outside the context. Smaller parameters keep the flat
    draw: on XLA:CPU each multi-dimensional draw adds compile time, and a whole small parameter
    costs little memory (``min_bytes`` at most, as a temporary)."""
    token = _IN_SHAPE_MIN_BYTES.set(min_bytes)
    try:
        yield
    finally:
        _IN_SHAPE_MIN_BYTES.reset(token)


def sample(key: jax.Array, shape: Sequence[int], dtype, distribution: str, scale: jax.Array) -> jax.Array:
    """``scale * <distribution>(key, shape)``: flat over a bucket, then cut and reshaped; in shape within
    ``partitioned_draws`` for a large parameter (under a trace, with partitionable threefry)."""
    shape = tuple(int(d) for d in shape)
    n = math.prod(shape)
    traced = isinstance(key, jax.core.Tracer) and partitionable()
    min_bytes = _IN_SHAPE_MIN_BYTES.get()
    if min_bytes is not None and n * jnp.dtype(dtype).itemsize >= min_bytes and traced:
        return draw(key, scale, shape, distribution, dtype)
    return draw(key, scale, (bucket(n),), distribution, dtype)[:n].reshape(shape)
