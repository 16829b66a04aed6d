"""The int8 error-feedback residual: the state ``parallel.grad_compression=int8`` adds to a mode, over its whole
life. Created (zero) by the mode's ``init_state``, placed one row per device, updated by the compressed
reduction, saved in checkpoints (as ``TrainState.mode_state``), and adapted when a checkpoint is restored onto
another device count. The arithmetic is ``parallel.compress``; this object is the one place that applies it,
and nothing outside ``parallel/`` names it."""

from __future__ import annotations

from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from parallel.compress import adapt_residual, init_residual, int8_mean
from parallel.reduce import BATCH_AXES

# Checkpoints written before the residual became generic mode state hold it under this key of the state tree.
LEGACY_KEY = "grad_residual"


class ErrorFeedback:
    """The residual ``{"worker": f32 [devices, padded], "server": f32 [devices, chunk]}`` of one mesh.

    Row i belongs to device i; it is stored divided by the loss scale (``reduce`` multiplies by the current
    scale before use and divides after), so a change of loss scale does not change its meaning. It differs
    between devices, so it is not part of the replica-sync check.
    """

    saved_keys = (LEGACY_KEY,)  # other keys of a saved state tree this object reads as its own

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.num_devices = mesh.size

    def init(self, params: Any) -> dict[str, np.ndarray]:
        """Zero residual (host numpy) for ``params`` on this mesh (``parallel.compress.init_residual``)."""
        return init_residual(params, self.num_devices)

    def shardings(self, residual: Any):
        """Sharding of every residual leaf: the leading (row) axis split over every mesh axis."""
        per_device = NamedSharding(self.mesh, P(BATCH_AXES))
        return jax.tree.map(lambda _: per_device, residual)

    def place(self, residual: Any):
        """``residual`` (host) placed one row per device."""
        return jax.device_put(residual, self.shardings(residual))

    def reduce(self, grad_sums: Any, residual_row: Any, scale, axis) -> tuple[Any, Any]:
        """Per device (inside ``shard_map``/``pmap``): the int8 mean of ``grad_sums`` over ``axis`` with this
        device's residual row. Returns ``(mean of the gradient sums, new residual row)``."""
        mean, new = int8_mean(grad_sums, axis, jax.tree.map(lambda r: r * scale, residual_row))
        return mean, jax.tree.map(lambda r: r / scale, new)

    @staticmethod
    def restore_target(saved: Optional[dict]) -> Optional[dict]:
        """Host zeros of the saved residual's shapes (``saved``: orbax leaf metadata), read as saved; None when the
        checkpoint holds none."""
        return {k: np.zeros(v.shape, v.dtype) for k, v in saved.items()} if saved else None

    def adapt(self, restored: Any, params: Any):
        """The placed residual to resume with on this mesh: kept when saved for this device count, else zeros
        (warns; ``parallel.compress.adapt_residual``)."""
        return self.place(adapt_residual(restored, params, self.num_devices))
