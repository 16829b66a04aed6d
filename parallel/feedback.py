"""The int8 error-feedback residual of a mode, over its whole life: created (zero) with the state, placed one
row per device, updated by the compressed reduction, and adapted when a checkpoint is restored onto another
device count. The arithmetic is ``parallel.compress``; this object is the one place that applies it."""

from __future__ import annotations

from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from parallel.compress import adapt_residual, init_residual, int8_mean
from parallel.shard_map_ops import BATCH_AXES


class ErrorFeedback:
    """The residual ``{"worker": f32 [devices, padded], "server": f32 [devices, chunk]}`` of one mesh.

    Row i belongs to device i; it is stored divided by the loss scale (``reduce`` multiplies by the current
    scale before use and divides after), so a change of loss scale does not change its meaning.
    """

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

    def reduce(self, grad_sums: Any, residual_row: Any, scale, axis) -> tuple[Any, Any]:
        """Inside ``shard_map``/``pmap``: the int8 mean of ``grad_sums`` over ``axis`` with this device's residual
        row (unscaled). Returns ``(mean of the gradient sums, new residual row)``."""
        mean, new = int8_mean(grad_sums, axis, jax.tree.map(lambda r: r * scale, residual_row))
        return mean, jax.tree.map(lambda r: r / scale, new)

    def restore_target(self, saved: Optional[dict]) -> Optional[dict]:
        """Host zeros of the saved residual's shapes (``saved``: orbax leaf metadata), read as saved; None when the
        checkpoint holds none."""
        return {k: np.zeros(v.shape, v.dtype) for k, v in saved.items()} if saved else None

    def adapt(self, restored: Any, params: Any) -> dict[str, np.ndarray]:
        """The residual to resume with on this mesh: kept when saved for this device count, else zeros (warns)."""
        return adapt_residual(restored, params, self.num_devices)
