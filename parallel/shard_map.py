"""``jax.shard_map``: explicit per-device code with exactly one explicit cross-device reduction.

Each device casts the replicated params to "varying" (``lax.pcast``) once, so differentiating w.r.t. them
gives its *local* gradient sum (with ``check_vma=True`` the gradient of an un-cast replicated input would
already be psum-ed by the transpose, and a further ``pmean`` would scale it by the device count). The
microbatch scan runs locally; after it, ONE ``psum`` over every mesh axis reduces the gradient sums and the
metric sums together, and dividing by the global batch turns sums into the mean.
"""

from __future__ import annotations

from parallel.base import ParallelMode


class ShardMap(ParallelMode):
    name = "shard_map"

    def grads(self, local, params, batch, step, scale):
        # The explicit shard_map psum (in parallel.grad_reduce_dtype, float32 when null) lives in the base class,
        # shared with jit_sharding when that option is set.
        return self.explicit_grads(local, params, batch, step, scale)
