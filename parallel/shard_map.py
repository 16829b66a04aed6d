"""``jax.shard_map``: explicit per-device code with exactly one explicit cross-device reduction.

Each device casts the replicated params to "varying" (``lax.pcast``) once, so differentiating w.r.t. them
gives its *local* gradient sum (with ``check_vma=True`` the gradient of an un-cast replicated input would
already be psum-ed by the transpose, and a further ``pmean`` would scale it by the device count: see
DESIGN.md). The microbatch scan runs locally; after it, ONE ``psum`` over every mesh axis reduces the
gradient sums and the metric sums together, and dividing by the global batch turns sums into the mean.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from parallel.base import BATCH_AXES, ParallelMode, cast_tree, pcast_varying, reduce_dtype
from training.step import global_mean


class ShardMap(ParallelMode):
    name = "shard_map"

    def grads(self, local, params, batch, step, scale):
        dtype = reduce_dtype(self.grad_reduce_dtype)

        def per_device(params, batch, step, scale):
            grad_sums, sums = local(pcast_varying(params, BATCH_AXES), batch, step, scale)
            grad_sums = cast_tree(jax.lax.psum(cast_tree(grad_sums, dtype), BATCH_AXES), "float32")
            return grad_sums, jax.lax.psum(sums, BATCH_AXES)

        grad_sums, sums = jax.shard_map(per_device, mesh=self.mesh, in_specs=(P(), P(BATCH_AXES), P(), P()),
                                        out_specs=(P(), P()))(params, batch, step, scale)
        return global_mean(grad_sums, sums, self.global_batch)
