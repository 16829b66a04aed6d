"""The interface every parallel mode implements, and the mesh.

A mode decides only how the pure step of ``core.step`` is wrapped (``jit`` with shardings, ``pmap``,
``shard_map``) and which collectives reduce the gradients; ``train.py`` and the step never branch on it.

Mesh: two axes, ``data`` (replicas) and ``fsdp`` (parameter shards), built from the first
``mesh.devices`` devices. The batch is always split over both axes (every device gets a different slice).
"""

from __future__ import annotations

import abc
import contextlib
import importlib
import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from core.errors import ConfigError
from core.layout import BatchLayout
from core.step import LocalGrads, TrainState, Updater
from parallel import shard_map_ops
from parallel.feedback import ErrorFeedback
from parallel.shard_map_ops import BATCH_AXES, MESH_AXES, cast_tree, pcast_varying, reduce_dtype  # noqa: F401


def resolve_mesh_shape(
    shape: Optional[Sequence[int]], default: Sequence[int], num_devices: int, mode: str
) -> tuple[int, int]:
    """Sizes of (data, fsdp): ``shape`` (or the mode's ``default``) with one -1 filled in.

    Raises:
      ConfigError: wrong length, zero/negative sizes, more than one -1, or a product != ``num_devices``.
    """
    given = list(default if shape is None else shape)
    text = f"mesh.shape={list(shape) if shape is not None else given}"
    if len(given) != 2:
        raise ConfigError(f"{text} must list 2 sizes (data, fsdp), e.g. mesh.shape=[-1,1]")
    if given.count(-1) > 1 or any(s == 0 or s < -1 for s in given):
        raise ConfigError(f"{text}: sizes must be positive with at most one -1")
    known = math.prod(s for s in given if s != -1)
    if -1 in given:
        if num_devices % known:
            raise ConfigError(f"{text} cannot fill -1: {num_devices} devices are not divisible by {known}")
        given[given.index(-1)] = num_devices // known
    if math.prod(given) != num_devices:
        raise ConfigError(
            f"{text} has {math.prod(given)} devices but mesh.devices={num_devices}; "
            f"make the product equal {num_devices} (use -1 to fill)"
        )
    return given[0], given[1]


def make_mesh(devices: Sequence[jax.Device], shape: tuple[int, int]) -> Mesh:
    """A ``Mesh`` with axes (data, fsdp) of ``shape`` over ``devices`` (Auto axes: sharding propagation)."""
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto))


@dataclasses.dataclass
class StepFns:
    """What a mode builds: the jitted train and eval steps and the lowered/compiled train step."""

    train: Callable  # (state, batch) -> (state, metrics)
    eval: Callable  # (params, batch) -> metric sums


class ParallelMode(abc.ABC):
    """One data-parallel strategy. Subclasses are tiny: they choose shardings and the gradient reduction.

    Args:
      mesh: the (data, fsdp) mesh.
      global_batch: examples per optimizer step (all devices, all microbatches).
      accum_steps: microbatches per optimizer step.
      min_shard_bytes: fsdp only: arrays smaller than this stay replicated.
      grad_reduce_dtype: None (the mode's own reduction) or a dtype name for an explicit reduction.
      grad_compression: 'none' | 'int8' (``parallel.compress``; the state then carries ``grad_residual``).
    """

    name: str = "base"
    default_mesh_shape: tuple[int, int] = (-1, 1)
    allows_fsdp_axis: bool = False
    # parallel.grad_compression values this mode implements.
    compressions: tuple[str, ...] = ("none", "int8")

    def __init__(
        self,
        mesh: Mesh,
        *,
        global_batch: int,
        accum_steps: int,
        min_shard_bytes: int = 0,
        grad_reduce_dtype: Optional[str] = None,
        grad_compression: str = "none",
    ):
        self.mesh = mesh
        self.global_batch = global_batch
        self.accum_steps = accum_steps
        self.min_shard_bytes = min_shard_bytes
        self.grad_reduce_dtype = grad_reduce_dtype
        self.grad_compression = grad_compression
        self.num_devices = mesh.size
        self.replicated = NamedSharding(mesh, P())
        self.feedback = ErrorFeedback(mesh)  # the int8 error-feedback residual, when the state carries one

    # ---- validation ------------------------------------------------------------------------------
    @classmethod
    def check(cls, mesh_shape: tuple[int, int]) -> None:
        """Raises ConfigError when the mode cannot use ``mesh_shape``."""
        if not cls.allows_fsdp_axis and mesh_shape[1] != 1:
            raise ConfigError(
                f"parallel={cls.name} needs an fsdp axis of 1 but mesh.shape={list(mesh_shape)}; "
                f"use mesh.shape=[-1,1] or parallel=fsdp"
            )

    # ---- placement -------------------------------------------------------------------------------
    def state_shardings(self, abstract_state: TrainState):
        """Sharding of every state leaf (default: replicated on every device; the int8 error-feedback residual:
        one row per device, its leading axis split over every mesh axis)."""
        shardings = jax.tree.map(lambda _: self.replicated, abstract_state)
        if getattr(abstract_state, "grad_residual", None) is not None:
            shardings = shardings.replace(grad_residual=self.feedback.shardings(abstract_state.grad_residual))
        return shardings

    def init_state(self, init_fn: Callable[[], TrainState]) -> TrainState:
        """The placed initial state: ``init_fn`` (pure, no arguments, returns the canonical ``TrainState``) run
        under ``jax.jit`` with this mode's ``state_shardings`` as ``out_shardings``, so each device creates only
        its own shards and no device ever holds an array it does not keep (under fsdp: never the whole model).
        The values do not depend on the shardings (threefry in its partitionable mode: each random bit depends
        only on the key and the element's index), so every mode and device count starts from the same state.
        With ``grad_compression=int8`` the state also carries this mode's zero error-feedback residual."""
        shardings = self.state_shardings(jax.eval_shape(init_fn))
        sharded = any(s.spec != P() for s in jax.tree.leaves(shardings, is_leaf=lambda s: hasattr(s, "spec")))
        # a sharded state: large parameters are drawn in their own shape, so each device draws only its shards
        draws = importlib.import_module("models.common").partitioned_draws  # models/ is outside the typed packages
        with draws() if sharded else contextlib.nullcontext():
            state = jax.jit(init_fn, out_shardings=shardings)()
        if self.grad_compression == "int8":
            state = state.replace(grad_residual=self.place_residual(self.feedback.init(state.params)))
        return state

    def place_residual(self, residual):
        """The host error-feedback residual placed one row per device."""
        return jax.device_put(residual, self.feedback.shardings(residual))

    def place_state(self, host_state: TrainState) -> TrainState:
        """Host (or single-device) state -> device state with ``state_shardings``."""
        return jax.device_put(host_state, self.state_shardings(host_state))

    def batch_layout(self) -> BatchLayout:
        """The global batch ``[B, ...]`` split over every device of the mesh."""
        return BatchLayout(
            sharding=NamedSharding(self.mesh, P(BATCH_AXES)),
            reshape=lambda s: tuple(s),
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )

    def state_to_host(self, state: TrainState) -> TrainState:
        """The full state as numpy arrays (gathers shards), for saving and comparing."""
        return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), state)

    def metrics_to_host(self, metrics) -> dict:
        """Per-step metrics (device) -> numpy scalars."""
        return jax.tree.map(lambda x: np.asarray(x), jax.device_get(metrics))

    # ---- checkpoints: the mode says how its state is saved and restored ------------------------------
    def host_abstract(self, placed_state):
        """``jax.ShapeDtypeStruct`` tree of the host-form state (what a checkpoint holds) of a placed state.

        The int8 error-feedback residual keeps its rows: it has one row per device in every form."""
        return jax.eval_shape(lambda s: s, placed_state)

    def restore_target(self, abstract):
        """What a checkpoint is restored into: ``abstract`` with this mode's shardings (straight onto the devices)."""
        shardings = self.state_shardings(abstract)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)

    def from_restored(self, restored, abstract, residual) -> tuple[TrainState, int]:
        """``(placed state, its step)`` from what ``restore_target`` received; ``residual``: the error-feedback
        residual as host numpy (already adapted to this device count), or None."""
        if residual is not None:
            residual = jax.device_put(residual, self.feedback.shardings(residual))
        state = restored.replace(grad_residual=residual)
        return state, int(np.asarray(state.step.addressable_data(0)))

    def state_for_save(self, state: TrainState) -> TrainState:
        """The form of the placed state a checkpoint writes (default: as placed; orbax gathers the shards)."""
        return state

    def finite_flags(self, state: TrainState) -> tuple[bool, bool]:
        """(params all finite, optimizer state all finite) of the placed state (one small device op)."""
        params_ok, opt_ok = (
            bool(np.asarray(f.addressable_data(0))) for f in _finite_flags(state.params, state.opt_state)
        )
        return params_ok, opt_ok

    # ---- the step --------------------------------------------------------------------------------
    @abc.abstractmethod
    def grads(self, local: LocalGrads, params, batch, step, scale):
        """Global-mean gradients (times the loss scale) and metric sums, with this mode's collectives."""

    def build(self, local: LocalGrads, updater: Updater, abstract_state: TrainState) -> StepFns:
        """The jitted train step ``(state, batch) -> (state, metrics)`` and eval step."""
        state_sh = self.state_shardings(abstract_state)
        batch_sh = self.batch_layout().sharding

        def train_step(state: TrainState, batch):
            state, grads, sums = self.reduce_step(local, state, batch)
            return updater(state, grads, sums)

        train = jax.jit(
            train_step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, self.replicated), donate_argnums=0
        )
        evaluate = jax.jit(local.eval_sums, in_shardings=(state_sh.params, batch_sh), out_shardings=self.replicated)
        return StepFns(train=train, eval=evaluate)

    # explicit and compressed reductions
    def reduce_step(self, local: LocalGrads, state: TrainState, batch):
        """``(state, grads, sums)`` of one step: ``grads`` (global mean x loss scale) with this mode's reduction,
        or, with ``grad_compression=int8``, the int8 mean and ``state.grad_residual`` updated."""
        scale = state.loss_scale.scale
        if self.grad_compression == "none":
            grads, sums = self.grads(local, state.params, batch, state.step, scale)
            return state, grads, sums
        grads, sums, residual = self.compressed_grads(
            local, state.params, batch, state.step, scale, state.grad_residual
        )
        return state.replace(grad_residual=residual), grads, sums

    def explicit_grads(self, local, params, batch, step, scale):
        """Gradients with ONE explicit ``psum`` in ``grad_reduce_dtype`` (``parallel.shard_map_ops``)."""
        return shard_map_ops.explicit_grads(self, local, params, batch, step, scale)

    def compressed_grads(self, local, params, batch, step, scale, residual):
        """int8 mean with error feedback under ``shard_map`` (``parallel.shard_map_ops``); returns
        ``(grads, sums, residual)``. pmap overrides it with the same reduction over its axis."""
        return shard_map_ops.compressed_grads(self, local, params, batch, step, scale, residual)

    # ---- replica synchronisation -------------------------------------------------------------------
    def replica_divergence(self, tree: Any) -> float:
        """Max |difference| between the copies of every replicated piece of ``tree`` held by different devices.

        For each array, the addressable shards holding the same slice (same ``index``) must be bitwise equal
        in data-parallel training; returns 0.0 when they are. Only this process's devices are compared.
        """
        worst = 0.0
        for leaf in jax.tree.leaves(tree):
            if not isinstance(leaf, jax.Array):
                continue
            groups: dict[Any, list[np.ndarray]] = {}
            for shard in leaf.addressable_shards:
                key = tuple((s.start, s.stop) for s in shard.index) if shard.index else ()
                groups.setdefault(key, []).append(np.asarray(shard.data, dtype=np.float64))
            for copies in groups.values():
                for other in copies[1:]:
                    worst = max(worst, float(np.max(np.abs(other - copies[0]), initial=0.0)))
        return worst


@jax.jit
def _finite_flags(params, opt_state):
    def all_finite(tree):
        leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
        return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)

    return all_finite(params), all_finite(opt_state)


def host_finite_flags(params, opt_state) -> tuple[bool, bool]:
    """(params all finite, optimizer state all finite) of host arrays, or of this process's first copy of each
    device array (every replica holds the whole array; a multi-process array cannot be fetched whole)."""
    first = lambda x: (
        np.asarray(jax.device_get(x.addressable_shards[0].data)) if isinstance(x, jax.Array) else np.asarray(x)
    )
    host = jax.tree.map(first, (params, opt_state))
    params_ok, opt_ok = (
        bool(all(np.all(np.isfinite(x)) for x in jax.tree.leaves(t) if np.issubdtype(x.dtype, np.inexact)))
        for t in host
    )
    return params_ok, opt_ok
