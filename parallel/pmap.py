"""Classic ``jax.pmap``: the batch with a leading device axis ``[devices, B/devices, ...]``, the reduction over
the pmap axis ``data``.

The state is the canonical one of every mode (global arrays, replicated with ``NamedSharding``): the step maps
it with ``in_axes=None``/``out_axes=None`` (no stacked copy; the int8 residual, one row per device, is mapped
over its rows), so it is donated, saved and restored like any other mode's. Inside the map (``mapped``) each
device runs the shared ``ParallelMode._per_device`` (local gradient sums, then ``reduce`` over ``data``) and the
optimizer.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from core.layout import BatchLayout
from parallel.base import BATCH_AXES, ParallelMode, StepFns

AXIS = "data"


class Pmap(ParallelMode):
    name = "pmap"
    axes = AXIS
    mapped = True  # _compile maps the step: the gradients are computed inside the map
    fuses_feed = False  # the gather stays a program of its own (data.pipeline.DeviceSource.gather_program)

    def batch_layout(self) -> BatchLayout:
        n = self.num_devices
        return BatchLayout(
            sharding=NamedSharding(self.mesh, P(BATCH_AXES)),
            reshape=lambda s: (n, s[0] // n) + tuple(s[1:]),
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )

    def _compile(self, train_step, local, abstract_state, batch_sharding=None) -> StepFns:
        devices = list(self.mesh.devices.flat)
        own_rows = abstract_state.replace(step=None, params=None, opt_state=None, loss_scale=None, mode_state=0)
        state_sh = self.state_shardings(abstract_state)
        train = jax.pmap(
            train_step, AXIS, in_axes=(own_rows, 0), out_axes=(own_rows, None), devices=devices, donate_argnums=0
        )
        evaluate = jax.pmap(
            lambda p, b: jax.lax.psum(local.eval_sums(p, b), AXIS),
            AXIS,
            in_axes=(None, 0),
            out_axes=None,
            devices=devices,
        )
        if jax.process_count() == 1:
            return StepFns(train=train, eval=evaluate)
        from jax.experimental import multihost_utils as mhu

        # with several processes pmap returns process-local arrays: made global again (canonical state)
        def train_global(state, batch):
            new, metrics = train(state, batch)
            specs = jax.tree.map(lambda s: s.spec, state_sh)
            return mhu.host_local_array_to_global_array(new, self.mesh, specs), metrics

        train_global.lower = train.lower  # type: ignore[attr-defined]  # compile-time metrics (training.run.compile_step)
        return StepFns(train=train_global, eval=evaluate)
