"""The interface every parallel mode implements (a small declarative strategy), the shared step, and the mesh.

A mode is data plus one function: the shardings of the state (``state_shardings``, ``param_specs``) and of the
batch (``batch_layout``), and ``reduce``, the per-device gradient reduction (all-reduce, reduce-scatter over
``fsdp``, int8 compressed). ``ParallelMode.build`` applies it in ONE shared jitted step: each device sums its
local gradients (``core.step.LocalGrads``), ``reduce`` makes them the global mean, the optimizer updates
(``core.step.Updater``). The state is canonical in every mode (global arrays with ``NamedSharding``); state a
mode owns besides the model's (the int8 error-feedback residual) is ``TrainState.mode_state``, created by the
mode's ``init_state`` and saved/restored by ``parallel.state``, which asks the mode for it. ``train.py`` and the
step never branch on the mode.

Mesh: two axes, ``data`` (replicas) and ``fsdp`` (parameter shards), built from the first
``mesh.devices`` devices. The batch is always split over both axes (every device gets a different slice).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from core.draws import partitioned_draws
from core.errors import ConfigError
from core.layout import BatchLayout, batch_split
from core.step import LocalGrads, TrainState, Updater, global_mean
from parallel.feedback import ErrorFeedback
from parallel.reduce import BATCH_AXES, MESH_AXES, compressed_mean, pcast_varying, psum_mean, reduce_dtype


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
    """What a mode builds: the jitted train and eval steps."""

    train: Callable  # (state, batch) -> (state, metrics)
    eval: Callable  # (params, batch) -> metric sums


class ParallelMode:
    """One data-parallel strategy. A mode defines at most these, each with a default here:

    1. the state's shardings: ``param_specs`` (``state_shardings`` applies them to every leaf);
    2. the batch layout: ``batch_layout``;
    3. the gradient reduction: ``reduce`` (and ``local``, the per-device gradients it reduces);
    4. an optional compile hook: ``_compile`` (pmap maps the step itself);
    5. its own state: ``feedback`` (the int8 residual), created by ``init_state``;
    6. class data: ``explicit``, ``mapped``, ``axes``, ``compressions``, ``fuses_feed`` ...

    Placing, host copies, restore and the replica check are plain functions for every mode (``parallel.state``).
    The base class is plain data parallelism: every array of the state replicated, the batch split over every
    device, and one explicit reduction per step under ``shard_map``: ``psum`` in ``grad_reduce_dtype``, or, with
    ``grad_compression=int8``, the int8 mean with error feedback. jit_sharding sets ``explicit = False`` (GSPMD
    inserts the all-reduce), fsdp ``param_specs``/``local``/``reduce``, pmap ``batch_layout`` and ``_compile``.

    Args:
      mesh: the (data, fsdp) mesh.
      global_batch: examples per optimizer step (all devices, all microbatches).
      accum_steps: microbatches per optimizer step.
      min_shard_bytes: fsdp only: arrays smaller than this stay replicated.
      grad_reduce_dtype: None (the mode's own reduction) or a dtype name for an explicit reduction.
      grad_compression: 'none' | 'int8' (``parallel.compress``; the mode then owns an error-feedback residual).
    """

    name: str = "base"
    default_mesh_shape: tuple[int, int] = (-1, 1)
    allows_fsdp_axis: bool = False
    # parallel.grad_compression values this mode implements.
    compressions: tuple[str, ...] = ("none", "int8")
    # True: the gradients are reduced by ``reduce`` under shard_map; False: GSPMD reduces the global-batch
    # gradients (only without grad_reduce_dtype and compression, which always need the explicit form).
    explicit: bool = True
    # the mapped axes ``reduce`` runs over (pmap: its own axis)
    axes: Any = BATCH_AXES
    # True: ``_compile`` maps the step over the devices itself (pmap), so the gradients need no ``shard_map``
    mapped: bool = False
    # whether ``build`` can take a ``feed`` (the batch gathered inside the train step; pmap maps a batch that
    # arrives split over the devices, so it keeps the gather as a program of its own)
    fuses_feed: bool = True
    # keys of a saved state tree that hold mode-owned state (the current field and older names of it)
    saved_state_keys: tuple[str, ...] = ("mode_state",) + ErrorFeedback.saved_keys

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
        # the state this mode owns besides the model's: the int8 error-feedback residual, or none
        self.feedback = ErrorFeedback(mesh) if grad_compression == "int8" else None

    # ---- the declarative part: shardings of the state and of the batch -----------------------------
    def param_specs(self, params):
        """``PartitionSpec`` of every leaf of ``params`` (and of the optimizer state's leaves of the same
        shapes): replicated (``P()``); fsdp shards them."""
        return jax.tree.map(lambda _: P(), params)

    def setting_warnings(self, abstract_state: TrainState) -> list[str]:
        """One-line warnings on this mode's settings for the model's state (fsdp: a rule matching no array)."""
        return []

    def state_shardings(self, abstract_state: TrainState):
        """``NamedSharding`` of every state leaf: ``param_specs`` of each array (the optimizer state by the same
        rule), the mode-owned state's own (int8 residual: one row per device, its leading axis split over every
        mesh axis)."""
        specs = self.param_specs(abstract_state.replace(mode_state=None))
        shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs)
        own = abstract_state.mode_state
        if own is not None and self.feedback is not None:
            shardings = shardings.replace(mode_state=self.feedback.shardings(own))
        return shardings

    def batch_layout(self) -> BatchLayout:
        """The global batch ``[B, ...]`` split over every device of the mesh."""
        return BatchLayout(
            sharding=NamedSharding(self.mesh, P(BATCH_AXES)),
            reshape=lambda s: tuple(s),
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )

    # ---- the state -------------------------------------------------------------------------------
    def init_state(self, init_fn: Callable[[], TrainState], eager: Optional[bool] = None) -> TrainState:
        """The placed initial state: ``init_fn`` (pure, no arguments, returns the canonical ``TrainState``) run
        under ``jax.jit`` with this mode's ``state_shardings`` as ``out_shardings``, so each device creates only
        its own shards and no device ever holds an array it does not keep (under fsdp: never the whole model).
        The values do not depend on the shardings (threefry in its partitionable mode: each random bit depends
        only on the key and the element's index), so every mode and device count starts from the same state.
        The mode adds the state it owns (``mode_state``: the zero error-feedback residual under int8).

        ``eager`` (None: when the state is replicated and the mesh is not the CPU's): ``init_fn`` runs op by op on
        the mesh's first device, as a plain JAX script creates its parameters, and the state is then placed. A
        replicated state is whole on every device anyway, and each op's small program compiles in well under a
        second and comes from the persistent compilation cache on the next start, where one program of the whole
        initialisation takes a TPU's compiler many seconds (``benchmarks/accelerator.py --part init``). The
        values are the same draws; XLA folds constants differently in one program than op by op, so they may
        differ from the jitted program's in the last bit of a float32 (``tests/test_gpt.py``).
        A sharded state is created on the devices, its large parameters drawn in their shape so that each
        device draws only its own shards (``core.draws.partitioned_draws``)."""
        shardings = self.state_shardings(jax.eval_shape(init_fn))
        sharded = any(s.spec != P() for s in jax.tree.leaves(shardings, is_leaf=lambda s: hasattr(s, "spec")))
        first = self.mesh.devices.flat[0]
        if eager is None:
            eager = not sharded and first.platform != "cpu"
        if eager:
            with jax.default_device(first if first.process_index == jax.process_index() else jax.local_devices()[0]):
                state = init_fn()
            if jax.process_count() > 1:  # a global array from each process's identical host copy
                state = jax.device_get(state)
            state = jax.device_put(state, shardings)
        else:
            with partitioned_draws() if sharded else contextlib.nullcontext():
                state = jax.jit(init_fn, out_shardings=shardings)()
        if self.feedback is not None:
            state = state.replace(mode_state=self.feedback.place(self.feedback.init(state.params)))
        return state

    # ---- the step: local gradient sums, this mode's reduce, the optimizer --------------------------
    def local(self, local: LocalGrads, specs) -> LocalGrads:
        """The per-device gradient computation this mode runs on params laid out as ``specs`` (fsdp: the model
        built from parameter shards)."""
        return local

    def reduce(self, grad_sums, sums, scale, mode_state, specs):
        """Per device (inside ``shard_map``/``pmap``, over ``axes``): this device's gradient sums (laid out as
        the params, ``specs``) -> the global mean gradient (times the loss scale ``scale``) and the reduced metric
        sums (with ``count``), and the new mode-owned state. The base: one ``psum`` in ``grad_reduce_dtype``, or
        with int8 the compressed mean (``parallel.reduce``)."""
        if self.feedback is not None:
            return compressed_mean(
                self.feedback, grad_sums, sums, scale, mode_state, self.axes, self.global_batch, self.num_devices
            )
        dtype = reduce_dtype(self.grad_reduce_dtype)
        return (*psum_mean(grad_sums, sums, self.axes, dtype, self.global_batch), mode_state)

    def _per_device(self, local: LocalGrads, specs, params, batch, step, scale, mode_state):
        """One device's part of the step: its local gradient sums, then ``reduce``."""
        grad_sums, sums = self.local(local, specs)(params, batch, step, scale)
        return self.reduce(grad_sums, sums, scale, mode_state, specs)

    def _gradients(self, local: LocalGrads, params, batch, step, scale, mode_state=None):
        """``(global-mean gradients x loss scale, metric sums, new mode state)`` of global arrays: ``_per_device``
        under ``shard_map`` (the params cast to varying so each device differentiates to its LOCAL sums; int8:
        without the varying-axes check, which cannot infer that its all-gathered mean is the same everywhere),
        or, for ``explicit = False``, the GSPMD form (``_implicit``); for a ``mapped`` mode ``_per_device`` as it is."""
        if self.mapped:  # already inside the map: this device's part (params not varying-typed, the gradient local)
            return self._per_device(local, self.param_specs(params), params, batch, step, scale, mode_state)
        if not self.explicit and self.feedback is None and self.grad_reduce_dtype is None:
            return (*self._implicit(local, params, batch, step, scale), mode_state)
        # the varying-axes check, unless int8 (see above) or a Pallas kernel (it declares no varying axes)
        specs, rows, vma = self.param_specs(params), P(BATCH_AXES), self.feedback is None and not local.manual_kernels

        def body(params, batch, step, scale, mode_state):
            params = pcast_varying(params, BATCH_AXES) if vma else params
            row = jax.tree.map(lambda r: r[0], mode_state)
            grads, sums, row = self._per_device(local, specs, params, batch, step, scale, row)
            return grads, sums, jax.tree.map(lambda r: r[None], row)

        return jax.shard_map(
            body, mesh=self.mesh, in_specs=(specs, rows, P(), P(), rows), out_specs=(specs, P(), rows), check_vma=vma
        )(params, batch, step, scale, mode_state)

    def _implicit(self, local: LocalGrads, params, batch, step, scale):
        """GSPMD's reduction (jit_sharding): the gradient of the global batch, all-reduced where propagation
        puts it. With accumulation or a non-float32 compute dtype on several devices the batch gets an explicit
        device axis (``vmap`` over it, summed after the loop): one float32 all-reduce per step
        (``parallel.jit_sharding``); one device has no reduction, and computes as the plain form."""
        if self.num_devices == 1 or (self.accum_steps == 1 and jnp.dtype(local.compute_dtype) == jnp.float32):
            with batch_split(self.mesh, BATCH_AXES):
                grad_sums, sums = local(params, batch, step, scale)
        else:
            dev = NamedSharding(self.mesh, P(BATCH_AXES))
            per_device = jax.tree.map(
                lambda x: jax.lax.with_sharding_constraint(x.reshape(self.num_devices, -1, *x.shape[1:]), dev), batch
            )
            # spmd_axis_name: the device axis is split over the mesh (a per-device kernel inside sees its slice)
            with batch_split(self.mesh, None):
                grad_sums, sums = jax.vmap(local, in_axes=(None, 0, None, None), spmd_axis_name=BATCH_AXES)(
                    params, per_device, step, scale
                )
            grad_sums, sums = jax.tree.map(lambda x: x.sum(0), (grad_sums, sums))
        return global_mean(grad_sums, sums, self.global_batch)

    def build(self, local: LocalGrads, updater: Updater, abstract_state: TrainState, feed=None) -> StepFns:
        """The ONE train step of every mode, ``(state, batch) -> (state, metrics)`` (gradients with this mode's
        reduction, then the optimizer), and the eval step, compiled by ``_compile``.

        ``feed``: a ``data.pipeline.DeviceFeed`` (the training split on the devices, ``data.on_device``): the
        step is then ``(state, (split, order)) -> (state, metrics)``: it takes the feed's replicated device arrays
        (``split`` = (images uint8 ``[N, H*W*C]``, labels int32 ``[N]``), ``order`` int32 ``[steps_per_epoch,
        global_batch]``, the order of the epoch of ``state.step``) in place of a batch and gathers its batch
        itself, from its own step counter (``feed.batch_at(arrays, state.step)``), so a step is one program with
        nothing sent to the devices; the program keeps the name ``train_step``. Raises ValueError for a mode that
        cannot (``fuses_feed`` False: pmap)."""

        def train_step(state: TrainState, batch):
            scale = state.loss_scale.scale
            grads, sums, own = self._gradients(local, state.params, batch, state.step, scale, state.mode_state)
            return updater(state.replace(mode_state=own), grads, sums)

        if feed is None:
            return self._compile(train_step, local, abstract_state)
        if not self.fuses_feed:
            raise ValueError(f"parallel={self.name} cannot gather its batches inside the train step")

        def fed_step(state: TrainState, arrays):
            return train_step(state, feed.batch_at(arrays, state.step))

        fed_step.__name__ = fed_step.__qualname__ = "train_step"  # one name for the step (cache logs, traces)
        return self._compile(fed_step, local, abstract_state, batch_sharding=feed.sharding)

    def _compile(
        self, train_step: Callable, local: LocalGrads, abstract_state: TrainState, batch_sharding=None
    ) -> StepFns:
        """``jax.jit`` of the train step with the state's and batch's shardings (the state donated; the batch's:
        ``batch_sharding``, or the mode's batch layout), and of the eval step."""
        state_sh = self.state_shardings(abstract_state)
        batch_sh = self.batch_layout().sharding
        train = jax.jit(
            train_step,
            in_shardings=(state_sh, batch_sh if batch_sharding is None else batch_sharding),
            out_shardings=(state_sh, self.replicated),
            donate_argnums=0,
        )

        def eval_sums(params, batch):  # the program keeps the name eval_sums (cache logs, traces)
            with batch_split(self.mesh, BATCH_AXES):  # GSPMD splits the batch (a per-device kernel sees its slice)
                return local.eval_sums(params, batch)

        evaluate = jax.jit(eval_sums, in_shardings=(state_sh.params, batch_sh), out_shardings=self.replicated)
        return StepFns(train=train, eval=evaluate)


def check_mesh_shape(mode: type[ParallelMode], mesh_shape: tuple[int, int]) -> None:
    """Raises ConfigError when ``mode`` cannot use ``mesh_shape`` (an fsdp axis above 1 needs ``allows_fsdp_axis``)."""
    if not mode.allows_fsdp_axis and mesh_shape[1] != 1:
        raise ConfigError(
            f"parallel={mode.name} needs an fsdp axis of 1 but mesh.shape={list(mesh_shape)}; "
            f"use mesh.shape=[-1,1] or parallel=fsdp"
        )
