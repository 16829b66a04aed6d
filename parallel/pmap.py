"""Classic ``jax.pmap``: a leading device axis on the batch and the state, ``lax.pmean`` over axis ``data``.

The state is replicated with an explicit leading axis of size ``devices`` (one copy per device) and
donated; the per-step metrics come back with that axis and replica 0's values are logged; for saving,
replica 0's copy is taken.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from core.layout import BatchLayout
from parallel.base import ParallelMode, StepFns, cast_tree, host_finite_flags, reduce_dtype

AXIS = "data"


class Pmap(ParallelMode):
    name = "pmap"

    def _stacked(self):
        return NamedSharding(self.mesh, P(("data", "fsdp")))

    def state_shardings(self, abstract_state):
        return jax.tree.map(lambda _: self._stacked(), abstract_state)

    def init_state(self, init_fn):
        # created once on this process's first device (the same values as under any sharding), then stacked
        state = jax.jit(init_fn, out_shardings=jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))()
        host = jax.device_get(state)
        if self.grad_compression == "int8":
            host = host.replace(grad_residual=self.feedback.init(host.params))
        return self.place_state(host)

    def place_state(self, host_state):
        n = self.num_devices
        # The int8 error-feedback residual already has one row per device: it is split, not broadcast.
        residual = host_state.grad_residual
        stacked = jax.tree.map(
            lambda x: np.broadcast_to(np.asarray(x), (n,) + np.shape(x)), host_state.replace(grad_residual=None)
        )
        return jax.device_put(stacked.replace(grad_residual=residual), self._stacked())

    def batch_layout(self) -> BatchLayout:
        n = self.num_devices
        return BatchLayout(
            sharding=self._stacked(),
            reshape=lambda s: (n, s[0] // n) + tuple(s[1:]),
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )

    def state_to_host(self, state):
        # replica 0 from this process's own first shard (with several processes x[0] may live on
        # another process's device); every replica holds the same values.
        host = jax.tree.map(
            lambda x: np.asarray(jax.device_get(x.addressable_shards[0].data))[0], state.replace(grad_residual=None)
        )
        residual = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), state.grad_residual)  # every row
        return host.replace(grad_residual=residual)

    # ---- checkpoints: saved and restored as host arrays without the device axis ----------------------
    def host_abstract(self, placed_state):
        residual = jax.eval_shape(lambda r: r, placed_state.grad_residual)
        host = jax.eval_shape(lambda s: jax.tree.map(lambda x: x[0], s), placed_state.replace(grad_residual=None))
        return host.replace(grad_residual=residual)

    def restore_target(self, abstract):
        return jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), abstract)

    def from_restored(self, restored, abstract, residual):
        state = restored.replace(grad_residual=residual)
        return self.place_state(state), int(state.step)

    def state_for_save(self, state):
        return self.state_to_host(state)

    def finite_flags(self, state):
        return host_finite_flags(state.params, state.opt_state)

    def metrics_to_host(self, metrics):
        # replica 0 of THIS process (all replicas hold the same reduced values); with several
        # processes the whole [devices] array is not addressable and cannot be fetched.
        def first(x):
            if isinstance(x, jax.Array):
                return np.asarray(jax.device_get(x.addressable_shards[0].data))[0]
            return np.asarray(x)[0]

        return jax.tree.map(first, metrics)

    def grads(self, local, params, batch, step, scale):
        grad_sums, sums = local(params, batch, step, scale)
        per_device_batch = self.global_batch // self.num_devices
        if self.grad_reduce_dtype is None:
            grads = jax.tree.map(lambda g: g / per_device_batch, jax.lax.pmean(grad_sums, AXIS))
        else:  # psum in that dtype, back to float32, then the mean
            dtype = reduce_dtype(self.grad_reduce_dtype)
            summed = cast_tree(jax.lax.psum(cast_tree(grad_sums, dtype), AXIS), "float32")
            grads = jax.tree.map(lambda g: g / self.global_batch, summed)
        return grads, {**jax.lax.psum(sums, AXIS), "count": jnp.float32(self.global_batch)}

    def compressed_grads(self, local, params, batch, step, scale, residual):
        """int8 mean with error feedback (``parallel.compress``) over the pmap axis; ``residual`` is this
        device's row (stored divided by the loss scale). Returns ``(grads, sums, residual)``."""
        grad_sums, sums = local(params, batch, step, scale)
        mean, residual = self.feedback.reduce(grad_sums, residual, scale, AXIS)
        per_device_batch = self.global_batch // self.num_devices
        return (
            jax.tree.map(lambda g: g / per_device_batch, mean),
            {**jax.lax.psum(sums, AXIS), "count": jnp.float32(self.global_batch)},
            residual,
        )

    def build(self, local, updater, abstract_state) -> StepFns:
        devices = list(self.mesh.devices.flat)

        def train_step(state, batch):
            state, grads, sums = self.reduce_step(local, state, batch)
            return updater(state, grads, sums)

        def eval_step(params, batch):
            return jax.lax.psum(local.eval_sums(params, batch), AXIS)

        return StepFns(
            train=jax.pmap(train_step, axis_name=AXIS, devices=devices, donate_argnums=0),
            eval=jax.pmap(eval_step, axis_name=AXIS, devices=devices),
        )

    def replica_divergence(self, tree) -> float:
        worst = 0.0
        for leaf in jax.tree.leaves(tree):
            rows = [np.asarray(s.data, dtype=np.float64) for s in leaf.addressable_shards]
            worst = max([worst] + [float(np.max(np.abs(r - rows[0]), initial=0.0)) for r in rows[1:]])
        return worst
