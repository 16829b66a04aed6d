"""The gradient reductions every mode shares, written once: each runs per device (inside ``shard_map`` or
``pmap``) over the mapped axes it is given. A mode's ``reduce`` picks one (``parallel.base``)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp

from core.step import global_mean

MESH_AXES = ("data", "fsdp")
BATCH_AXES = MESH_AXES  # the batch dimension is split over every device


def cast_tree(tree, dtype):
    """Every leaf of ``tree`` cast to ``dtype``."""
    return jax.tree.map(lambda x: x.astype(dtype), tree)


def reduce_dtype(name: Optional[str]):
    """dtype of an explicit gradient reduction (None: float32, the gradients' own).

    Raises:
      ConfigError: a name other than null, float32, bfloat16.
    """
    from core.errors import ConfigError

    if name is None:
        return jnp.float32
    if name not in ("float32", "bfloat16"):
        raise ConfigError(f"parallel.grad_reduce_dtype={name!r} is unknown; choose null, float32 or bfloat16")
    return jnp.dtype(name)


def pcast_varying(tree, axes: Sequence[str]):
    """Marks every leaf as varying over ``axes`` (inside ``shard_map``), skipping axes it already varies over.

    Differentiating w.r.t. the result gives each device its LOCAL gradient: no collective is inserted by the
    transpose, so the single cross-device reduction stays explicit and outside any microbatch loop.
    """

    def cast(x):
        missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def psum_mean(grad_sums, sums, axes: Any, dtype, global_batch: int, grad_axes: Any = None):
    """All-reduce: ONE ``psum`` of the gradient sums over ``axes`` in ``dtype`` (visible in the lowered module),
    cast back to float32, and of the float32 metric sums; then divided by ``global_batch``.

    ``grad_axes``: None (every leaf over ``axes``) or a tree of axes per gradient leaf (fsdp: the sharded leaves
    were already reduce-scattered over ``fsdp`` and only need ``data``). Returns ``(grads, sums with count)``.
    """
    if grad_axes is None:
        grad_axes = jax.tree.map(lambda _: axes, grad_sums)
    # (a tuple of axes in ``grad_axes`` is the subtree matching one gradient leaf: passed whole)
    summed = jax.tree.map(lambda g, a: jax.lax.psum(g.astype(dtype), a).astype(jnp.float32), grad_sums, grad_axes)
    return global_mean(summed, jax.lax.psum(sums, axes), global_batch)


def compressed_mean(feedback, grad_sums, sums, scale, residual_row, axes: Any, global_batch: int, devices: int):
    """The int8 mean with error feedback (``parallel.feedback.ErrorFeedback.reduce``) of the gradient sums over
    ``axes``, and the float32 ``psum`` of the metric sums. Returns ``(grads, sums with count, residual row)``."""
    mean, residual_row = feedback.reduce(grad_sums, residual_row, scale, axes)
    inv = 1.0 / (global_batch // devices)  # mean of per-device sums -> mean per example
    sums = {**jax.lax.psum(sums, axes), "count": jnp.float32(global_batch)}
    return jax.tree.map(lambda g: g * inv, mean), sums, residual_row
