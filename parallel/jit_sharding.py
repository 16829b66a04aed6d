"""Replicated parameters, the batch split on the mesh: two modes that differ only in who writes the reduction.

``jit_sharding`` (``jit`` + ``Mesh`` + ``NamedSharding``, no explicit collectives): sharding propagation (GSPMD)
inserts the gradient all-reduce. With ``accum_steps > 1`` a ``lax.scan`` over microbatches of the *global*
batch would put that all-reduce inside the loop (K reductions per step), so the accumulation is written with an
explicit leading device axis: the batch is reshaped to ``[devices, B/devices, ...]`` (sharded on that axis),
each device's scan is ``vmap``-ed over it, and the per-device gradient sums are added over the device axis
once, after the loop: one all-reduce per step. The same form is used for bf16/fp16 compute even with one
microbatch: under plain ``jit`` GSPMD reduces the weight gradient where the batch contraction happens, i.e. in
the compute dtype *before* the cast back to float32 (an f16 all-reduce under ``precision=fp16``). With the
explicit device axis each device casts its local gradient to float32 first, so the reduction is float32 as the
design requires (``ParallelMode._implicit``). With
``parallel.grad_reduce_dtype`` or ``grad_compression`` set it runs the explicit form of ``shard_map``.

``shard_map`` (``jax.shard_map``: explicit per-device code with exactly one explicit cross-device reduction,
the base class's ``reduce``): each device casts the replicated params to "varying" (``lax.pcast``) once, so
differentiating w.r.t. them gives its *local* gradient sum (with ``check_vma=True`` the gradient of an un-cast
replicated input would already be psum-ed by the transpose, and a further ``pmean`` would scale it by the device
count). The microbatch scan runs locally; after it, ONE ``psum`` over every mesh axis reduces the gradient sums
(in ``parallel.grad_reduce_dtype``, float32 when null) and the metric sums, and dividing by the global batch
turns sums into the mean.
"""

from __future__ import annotations

from parallel.base import ParallelMode


class JitSharding(ParallelMode):
    name = "jit_sharding"
    explicit = False


class ShardMap(ParallelMode):
    name = "shard_map"
    explicit = True
