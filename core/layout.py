"""Where a global batch goes on the devices (the mode chooses; the input pipeline places batches with it).

Every batch is a dict: ``image`` uint8 ``[B, H, W, C]``, ``label`` int32 ``[B]``, optionally ``index`` int32
``[B]`` (global example index) and, for evaluation, ``mask`` float32 ``[B]``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Iterator, Optional

import jax

Batch = dict  # str -> np.ndarray (host) or jax.Array (device)


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """Where a global batch goes: its global shape transform and its sharding.

    ``reshape(global_shape) -> device shape`` (identity, or (devices, per-device, ...) for pmap) and the
    ``sharding`` of the device array; ``process_index``/``process_count`` pick this process's rows.
    """

    sharding: jax.sharding.Sharding
    reshape: Callable[[tuple], tuple]
    process_index: int
    process_count: int

    @property
    def replicated(self) -> jax.sharding.NamedSharding:
        """Every device of the batch's mesh holding the whole value (for the step number, a split kept on the
        devices and its order). Needs a ``NamedSharding`` batch sharding (every mode's)."""
        mesh = self.sharding.mesh  # type: ignore[attr-defined]  # a NamedSharding in every mode
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def local_rows(self, global_batch: int) -> slice:
        """This process's contiguous rows of a global batch of ``global_batch`` examples."""
        per_process = global_batch // self.process_count
        return slice(self.process_index * per_process, (self.process_index + 1) * per_process)

    def place(self, local: Batch, global_batch: int) -> Batch:
        """Assembles this process's rows into global device arrays (``make_array_from_process_local_data``).

        With one process the local rows are the global batch: one ``jax.device_put`` of the whole dict (same
        arrays, same sharding, cheaper than assembling it from per-device pieces).
        """
        if self.process_count == 1:  # cheaper single-process placement
            return jax.device_put(
                {k: v.reshape(self.reshape((global_batch,) + v.shape[1:])) for k, v in local.items()}, self.sharding
            )
        out = {}
        for key, value in local.items():
            gshape = self.reshape((global_batch,) + value.shape[1:])
            lshape = (gshape[0] // self.process_count,) + gshape[1:]
            out[key] = jax.make_array_from_process_local_data(self.sharding, value.reshape(lshape), gshape)
        return out


# (mesh, mesh axes of the leading batch dimension, or None) while a GSPMD-partitioned step is traced, else None
_BATCH_SPLIT: contextvars.ContextVar[Optional[tuple[Any, Any]]] = contextvars.ContextVar("batch_split", default=None)


@contextlib.contextmanager
def batch_split(mesh, axes) -> Iterator[None]:
    """Declares, while a step is traced under this context, that the model's batch dimension is split over the mesh
    ``axes`` (a name or tuple of names; None: not split, e.g. under a ``vmap`` whose ``spmd_axis_name`` already
    splits it) by GSPMD. Code XLA cannot partition (a Pallas kernel) reads it with ``current_batch_split`` and runs
    per device under ``shard_map``. A mesh of one device declares nothing."""
    token = _BATCH_SPLIT.set((mesh, axes) if mesh is not None and mesh.size > 1 else None)
    try:
        yield
    finally:
        _BATCH_SPLIT.reset(token)


def current_batch_split() -> Optional[tuple[Any, Any]]:
    """``(mesh, axes)`` of the enclosing ``batch_split``, or None (one device, or inside per-device code)."""
    return _BATCH_SPLIT.get()
