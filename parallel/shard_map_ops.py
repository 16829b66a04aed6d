"""The ``shard_map`` reductions the modes share: one explicit ``psum`` in a chosen dtype, and the int8 mean with
error feedback (``parallel.compress``). ``mode`` is the ``ParallelMode`` calling (its mesh, global batch and
``grad_reduce_dtype``)."""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from core.step import global_mean

MESH_AXES = ("data", "fsdp")
BATCH_AXES = MESH_AXES  # the batch dimension is split over every device


def cast_tree(tree, dtype):
    """Every leaf of ``tree`` cast to ``dtype``."""
    return jax.tree.map(lambda x: x.astype(dtype), tree)


def reduce_dtype(name: Optional[str]):
    """dtype of an explicit gradient reduction (None: float32, the gradients' own)."""
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


def explicit_grads(mode, local, params, batch, step, scale):
    """Gradients with ONE explicit ``psum`` over every mesh axis in ``grad_reduce_dtype`` (null: float32).

    Inside ``shard_map``: local gradient sums (params cast to varying, see ``pcast_varying``), cast to the
    reduce dtype, ``psum`` (visible in the lowered module), cast back to float32, then divided by the global
    batch. The metric sums are reduced in float32.
    """
    dtype = reduce_dtype(mode.grad_reduce_dtype)

    def per_device(params, batch, step, scale):
        grad_sums, sums = local(pcast_varying(params, BATCH_AXES), batch, step, scale)
        grad_sums = cast_tree(jax.lax.psum(cast_tree(grad_sums, dtype), BATCH_AXES), "float32")
        return grad_sums, jax.lax.psum(sums, BATCH_AXES)

    grad_sums, sums = jax.shard_map(
        per_device, mesh=mode.mesh, in_specs=(P(), P(BATCH_AXES), P(), P()), out_specs=(P(), P())
    )(params, batch, step, scale)
    return global_mean(grad_sums, sums, mode.global_batch)


def compressed_grads(mode, local, params, batch, step, scale, residual):
    """int8 mean of the gradients with error feedback (``parallel.compress.int8_mean``).

    Two ``shard_map``s in the same jitted step (no data moves between them): the first computes each
    device's local gradient sums (``[devices, ...]``, one row per device) and psums the metric sums; the
    second exchanges them as int8. The second runs with ``check_vma=False``: its all-gathered output is the
    same on every device, which the varying-axes type check cannot infer (JAX's ``all_gather_invariant``
    is private). ``residual``: ``{"worker": f32 [devices, padded], "server": f32 [devices, chunk]}``,
    stored divided by the loss scale. Returns ``(grads, sums, residual)``.
    """
    dev = P(BATCH_AXES)

    def local_sums(params, batch, step, scale):
        grad_sums, sums = local(pcast_varying(params, BATCH_AXES), batch, step, scale)
        return jax.tree.map(lambda g: g[None], grad_sums), jax.lax.psum(sums, BATCH_AXES)

    grad_rows, sums = jax.shard_map(local_sums, mesh=mode.mesh, in_specs=(P(), dev, P(), P()), out_specs=(dev, P()))(
        params, batch, step, scale
    )

    def reduce(grad_rows, residual, scale):
        mean, new = mode.feedback.reduce(
            jax.tree.map(lambda g: g[0], grad_rows), jax.tree.map(lambda r: r[0], residual), scale, BATCH_AXES
        )
        return mean, jax.tree.map(lambda r: r[None], new)

    mean, residual = jax.shard_map(
        reduce, mesh=mode.mesh, in_specs=(dev, dev, P()), out_specs=(P(), dev), check_vma=False
    )(grad_rows, residual, scale)
    inv = 1.0 / (mode.global_batch // mode.num_devices)  # mean of per-device sums -> mean per example
    return (jax.tree.map(lambda g: g * inv, mean), {**sums, "count": jnp.float32(mode.global_batch)}, residual)
