"""FSDP (ZeRO-3 style, Rajbhandari et al. 2020; PyTorch FSDP): parameters and optimizer state sharded.

Every array is split along one dimension that the ``fsdp`` axis size divides (the largest such dimension);
arrays that no dimension fits, or smaller than ``parallel.min_shard_bytes``, stay replicated. Inside
``shard_map`` each device all-gathers the weights it needs (in the compute dtype, once per optimizer step,
before the microbatch loop), computes its local gradient sums, and then:

* sharded arrays: ``psum_scatter`` (reduce-scatter) over ``fsdp`` (XLA:CPU never creates a reduce-scatter by
  itself, so it is written explicitly), then ``psum`` over ``data`` (hybrid sharding on a 2-D mesh);
* replicated arrays and the metric sums: ``psum`` (all-reduce) over every axis.

The optimizer update runs outside ``shard_map`` on the sharded gradients, params and optimizer state
(elementwise, so each device updates only its shard; the global gradient norm is one scalar all-reduce).
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from parallel.base import BATCH_AXES, ParallelMode, pcast_varying, reduce_dtype
from core.step import global_mean

FSDP = "fsdp"


def shard_dim(shape, itemsize: int, fsdp_size: int, min_shard_bytes: int):
    """The dimension of an array of ``shape`` to split over ``fsdp_size`` devices, or None (replicate).

    The largest dimension divisible by ``fsdp_size`` (the first on ties); None when the axis has one device,
    no dimension fits, or the array has fewer than ``min_shard_bytes`` bytes.
    """
    if fsdp_size == 1 or math.prod(shape) * itemsize < min_shard_bytes:
        return None
    fits = [d for d, n in enumerate(shape) if n % fsdp_size == 0 and n > 0]
    return max(fits, key=lambda d: (shape[d], -d)) if fits else None


def spec_for(shape, dim) -> P:
    return P() if dim is None else P(*([None] * dim + [FSDP]))


class Fsdp(ParallelMode):
    name = "fsdp"
    default_mesh_shape = (1, -1)
    allows_fsdp_axis = True
    compressions = ("none",)  # int8 is not implemented for sharded parameters

    @classmethod
    def check(cls, mesh_shape):
        pass

    def _dim(self, x):
        return shard_dim(np.shape(x), np.dtype(x.dtype).itemsize, self.mesh.shape[FSDP], self.min_shard_bytes)

    def param_specs(self, params):
        return jax.tree.map(lambda x: spec_for(np.shape(x), self._dim(x)), params)

    def state_shardings(self, abstract_state):
        return jax.tree.map(lambda x: NamedSharding(self.mesh, spec_for(np.shape(x), self._dim(x))), abstract_state)

    def sharded_and_replicated_bytes(self, params) -> tuple[int, int]:
        """Bytes of the params that are sharded and that stay replicated (float32)."""
        sharded = replicated = 0
        for x in jax.tree.leaves(params):
            nbytes = math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize
            if self._dim(x) is None:
                replicated += nbytes
            else:
                sharded += nbytes
        return sharded, replicated

    def grads(self, local, params, batch, step, scale):
        dims = jax.tree.map(lambda x: -1 if self._dim(x) is None else self._dim(x), params)  # -1: replicated
        specs = self.param_specs(params)
        dtype = reduce_dtype(self.grad_reduce_dtype)
        compute = local.compute_dtype

        def gather(x, d):
            # Gather in the compute dtype (half the bytes in bf16/fp16), then hold a float32 copy so the
            # microbatch gradients accumulate in float32 (bf16 -> f32 -> bf16 is lossless).
            x = x.astype(compute)
            x = x if d < 0 else jax.lax.all_gather(x, FSDP, axis=d, tiled=True)
            return x.astype("float32")

        def reduce(g, d):
            g = g.astype(dtype)
            if d < 0:
                return jax.lax.psum(g, BATCH_AXES).astype("float32")
            g = jax.lax.psum_scatter(g, FSDP, scatter_dimension=d, tiled=True)
            return jax.lax.psum(g, "data").astype("float32")

        def per_device(shards, batch, step, scale):
            full = jax.tree.map(gather, shards, dims)
            grad_sums, sums = local(pcast_varying(full, BATCH_AXES), batch, step, scale)
            grads = jax.tree.map(reduce, grad_sums, dims)
            return grads, jax.lax.psum(sums, BATCH_AXES)

        grad_sums, sums = jax.shard_map(
            per_device, mesh=self.mesh, in_specs=(specs, P(BATCH_AXES), P(), P()), out_specs=(specs, P())
        )(params, batch, step, scale)
        return global_mean(grad_sums, sums, self.global_batch)
