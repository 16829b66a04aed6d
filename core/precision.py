"""Loss scaling for float16 training (Micikevicius et al., "Mixed Precision Training", ICLR 2018).

Dynamic scaling as in NVIDIA Apex / ``jmp.DynamicLossScale``: multiply the loss by ``scale`` before the
backward pass, divide the gradients by it; when any gradient is not finite skip the update and halve the
scale (never below 1); after ``growth_interval`` consecutive finite steps double it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Self

import jax
import jax.numpy as jnp
from flax import struct

LOSS_SCALING_MODES = ("dynamic", "static", "none")


@struct.dataclass
class LossScaleState:
    """scale: float32 ``[]``; good_steps: int32 ``[]`` finite steps since the last change;
    skipped: int32 ``[]`` total skipped (non-finite) steps."""

    scale: jax.Array
    good_steps: jax.Array
    skipped: jax.Array

    if TYPE_CHECKING:  # flax.struct.dataclass adds replace() at run time; declared here for the type checker

        def replace(self, **updates: Any) -> Self: ...


def init_loss_scale(mode: str, init_scale: float) -> LossScaleState:
    """Initial state: ``init_scale`` for dynamic/static scaling, 1.0 for 'none'.

    Raises:
      ValueError: unknown mode.
    """
    if mode not in LOSS_SCALING_MODES:
        raise ValueError(f"precision.loss_scale={mode!r} is unknown; choose one of {', '.join(LOSS_SCALING_MODES)}")
    scale = 1.0 if mode == "none" else float(init_scale)
    return LossScaleState(
        scale=jnp.asarray(scale, jnp.float32), good_steps=jnp.zeros((), jnp.int32), skipped=jnp.zeros((), jnp.int32)
    )


def update_loss_scale(state: LossScaleState, finite: jax.Array, mode: str, growth_interval: int) -> LossScaleState:
    """Next loss-scale state after a step whose gradients were ``finite`` (bool ``[]``)."""
    if mode == "none":
        return state
    skipped = state.skipped + jnp.where(finite, 0, 1).astype(jnp.int32)
    if mode == "static":
        return state.replace(skipped=skipped)
    good = jnp.where(finite, state.good_steps + 1, 0)
    grow = good >= growth_interval
    scale = jnp.where(finite, jnp.where(grow, state.scale * 2.0, state.scale), jnp.maximum(state.scale / 2.0, 1.0))
    return LossScaleState(
        scale=scale.astype(jnp.float32), good_steps=jnp.where(grow, 0, good).astype(jnp.int32), skipped=skipped
    )
