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

from data.pipeline import BatchLayout
from parallel.base import ParallelMode, StepFns

AXIS = "data"


class Pmap(ParallelMode):
    name = "pmap"

    def _stacked(self):
        return NamedSharding(self.mesh, P(("data", "fsdp")))

    def state_shardings(self, abstract_state):
        return jax.tree.map(lambda _: self._stacked(), abstract_state)

    def place_state(self, host_state):
        n = self.num_devices
        stacked = jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (n,) + np.shape(x)), host_state)
        return jax.device_put(stacked, self._stacked())

    def batch_layout(self) -> BatchLayout:
        n = self.num_devices
        return BatchLayout(sharding=self._stacked(), reshape=lambda s: (n, s[0] // n) + tuple(s[1:]),
                           process_index=jax.process_index(), process_count=jax.process_count())

    def state_to_host(self, state):
        return jax.tree.map(lambda x: np.asarray(jax.device_get(x[0])), state)

    def metrics_to_host(self, metrics):
        return jax.tree.map(lambda x: np.asarray(x)[0], jax.device_get(metrics))

    def grads(self, local, params, batch, step, scale):
        grad_sums, sums = local(params, batch, step, scale)
        per_device_batch = self.global_batch // self.num_devices
        grads = jax.tree.map(lambda g: g / per_device_batch, jax.lax.pmean(grad_sums, AXIS))
        return grads, {**jax.lax.psum(sums, AXIS), "count": jnp.float32(self.global_batch)}

    def build(self, local, updater, abstract_state) -> StepFns:
        devices = list(self.mesh.devices.flat)

        def train_step(state, batch):
            grads, sums = self.grads(local, state.params, batch, state.step, state.loss_scale.scale)
            return updater(state, grads, sums)

        def eval_step(params, batch):
            return jax.lax.psum(local.eval_sums(params, batch), AXIS)

        return StepFns(train=jax.pmap(train_step, axis_name=AXIS, devices=devices, donate_argnums=0),
                       eval=jax.pmap(eval_step, axis_name=AXIS, devices=devices))

    def replica_divergence(self, tree) -> float:
        worst = 0.0
        for leaf in jax.tree.leaves(tree):
            rows = [np.asarray(s.data, dtype=np.float64) for s in leaf.addressable_shards]
            worst = max([worst] + [float(np.max(np.abs(r - rows[0]), initial=0.0)) for r in rows[1:]])
        return worst
