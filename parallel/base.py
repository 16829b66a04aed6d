"""The interface every parallel mode implements (a small declarative strategy), the shared step, and the mesh.

A mode is data plus one function: the shardings of the state (``state_shardings``, ``param_specs``) and of the
batch (``batch_layout``), and ``reduce``, the per-device gradient reduction (all-reduce, reduce-scatter over
``fsdp``, int8 compressed). ``ParallelMode.build`` applies it in ONE shared jitted step: each device sums its
local gradients (``core.step.LocalGrads``), ``reduce`` makes them the global mean, the optimizer updates
(``core.step.Updater``). The state is canonical in every mode (global arrays with ``NamedSharding``); state a
mode owns besides the model's (the int8 error-feedback residual) is ``TrainState.mode_state``, created by the
mode's ``init_state`` and saved/restored through the mode. ``train.py`` and the step never branch on the mode.

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
    """One data-parallel strategy: shardings of the state and the batch, and ``reduce``.

    The base class is plain data parallelism: every array of the state replicated, the batch split over every
    device, and one explicit reduction per step under ``shard_map``: ``psum`` in ``grad_reduce_dtype``, or, with
    ``grad_compression=int8``, the int8 mean with error feedback. A subclass changes only what differs:
    ``explicit = False`` (jit_sharding: GSPMD inserts the all-reduce), ``param_specs``/``reduce`` (fsdp),
    ``batch_layout`` and how the one step is compiled (pmap: ``_compile``).

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

    # ---- validation ------------------------------------------------------------------------------
    @classmethod
    def check(cls, mesh_shape: tuple[int, int]) -> None:
        """Raises ConfigError when the mode cannot use ``mesh_shape``."""
        if not cls.allows_fsdp_axis and mesh_shape[1] != 1:
            raise ConfigError(
                f"parallel={cls.name} needs an fsdp axis of 1 but mesh.shape={list(mesh_shape)}; "
                f"use mesh.shape=[-1,1] or parallel=fsdp"
            )

    # ---- the declarative part: shardings of the state and of the batch -----------------------------
    def param_specs(self, params):
        """``PartitionSpec`` of every leaf of ``params`` (and of the optimizer state's leaves of the same
        shapes): replicated (``P()``); fsdp shards them."""
        return jax.tree.map(lambda _: P(), params)

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
    def init_state(self, init_fn: Callable[[], TrainState], on_host: Optional[bool] = None) -> TrainState:
        """The placed initial state: ``init_fn`` (pure, no arguments, returns the canonical ``TrainState``) run
        under ``jax.jit`` with this mode's ``state_shardings`` as ``out_shardings``, so each device creates only
        its own shards and no device ever holds an array it does not keep (under fsdp: never the whole model).
        The values do not depend on the shardings (threefry in its partitionable mode: each random bit depends
        only on the key and the element's index), so every mode and device count starts from the same state.
        The mode adds the state it owns (``mode_state``: the zero error-feedback residual under int8).

        ``on_host`` (None: when the state is replicated and the mesh is not the CPU's): ``init_fn`` runs on the
        host's CPU backend and the state is then placed. A replicated state is whole on every device anyway, and
        XLA:CPU compiles the random draws of a GPT's initialisation in a second or two where a TPU's compiler
        takes many (``benchmarks/accelerator.py --part init``); the values are those of a CPU run.
        A sharded state is created on the devices, its large parameters drawn in their shape so that each
        device draws only its own shards (``core.draws.partitioned_draws``)."""
        shardings = self.state_shardings(jax.eval_shape(init_fn))
        sharded = any(s.spec != P() for s in jax.tree.leaves(shardings, is_leaf=lambda s: hasattr(s, "spec")))
        if on_host is None:
            on_host = not sharded and self.mesh.devices.flat[0].platform != "cpu" and _host_cpu() is not None
        if on_host:
            cpu = _host_cpu()
            if cpu is None:
                raise ValueError("on_host=True needs JAX's CPU backend (JAX_PLATFORMS without cpu)")
            host = jax.jit(init_fn, out_shardings=jax.sharding.SingleDeviceSharding(cpu))()
            state = jax.device_put(jax.device_get(host), shardings)
        else:
            with partitioned_draws() if sharded else contextlib.nullcontext():
                state = jax.jit(init_fn, out_shardings=shardings)()
        if self.feedback is not None:
            state = state.replace(mode_state=self.feedback.place(self.feedback.init(state.params)))
        return state

    def place_state(self, host_state: TrainState) -> TrainState:
        """Host (or single-device) state -> device state with ``state_shardings``."""
        return jax.device_put(host_state, self.state_shardings(host_state))

    def state_to_host(self, state: TrainState) -> TrainState:
        """The full state as numpy arrays (gathers shards), for saving and comparing."""
        return jax.tree.map(_to_host, state)

    def metrics_to_host(self, metrics):
        """Device metrics -> numpy arrays, any pytree (one step's ``{name: scalar}``, or a logging window's list of
        them); a window's list comes back as a list of the same trees.

        A window of at least ``WINDOW_MIN_STACK_STEPS`` steps whose metrics are alike is stacked on the device by
        one small program and copied in one transfer per metric name (``window_to_host``). Anything else, when
        this process holds every array whole (every array fully addressable, as in a one-process run), is one
        ``jax.device_get`` of the whole tree (its copies start together); else array by array (``_to_host``: a
        multi-process array is gathered, a collective).
        """
        if isinstance(metrics, list):
            stacked = window_to_host(metrics)
            if stacked is not None:
                return stacked
        if held_whole(metrics):
            return jax.device_get(metrics)  # numpy arrays
        return jax.tree.map(_to_host, metrics)

    # ---- checkpoints: the mode says how its state is restored ----------------------------------------
    def host_abstract(self, placed_state):
        """``jax.ShapeDtypeStruct`` tree of the state a checkpoint holds (the canonical state's shapes)."""
        return jax.eval_shape(lambda s: s, placed_state)

    def restore_target(self, abstract, saved_tree: Optional[dict] = None) -> dict:
        """What a checkpoint is restored into, keyed as saved: ``abstract``'s fields with this mode's shardings
        (straight onto the devices), plus host zeros of any mode-owned state the checkpoint holds
        (``saved_state_keys`` of ``saved_tree``, orbax's metadata tree), read as saved and adapted by
        ``from_restored``."""
        common = abstract.replace(mode_state=None)
        placed = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), common, self.state_shardings(common)
        )
        target = {f.name: getattr(placed, f.name) for f in dataclasses.fields(placed) if f.name != "mode_state"}
        for key in self.saved_state_keys:  # present (maybe as an empty entry): restored as saved
            if isinstance(saved_tree, dict) and key in saved_tree:
                saved = saved_tree[key]
                target[key] = ErrorFeedback.restore_target(saved if isinstance(saved, dict) else None)
        return target

    def from_restored(self, restored: dict, abstract) -> tuple[TrainState, int]:
        """``(placed state, its step)`` from what ``restore_target`` received. The mode-owned state is kept when
        it fits this run (saved for this device count), else created anew (a warning: ``ErrorFeedback.adapt``)."""
        saved_own = next((restored[k] for k in self.saved_state_keys if restored.get(k) is not None), None)
        common = {k: v for k, v in restored.items() if k not in self.saved_state_keys}
        own = None if self.feedback is None else self.feedback.adapt(saved_own, abstract.params)
        state = TrainState(**common, mode_state=own)
        return state, int(np.asarray(_to_host(state.step)))

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
        or, for ``explicit = False``, the GSPMD form (``_implicit``)."""
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

    def grads(self, local: LocalGrads, params, batch, step, scale):
        """``(grads, sums)`` of ``_gradients`` for a mode without mode-owned state (for inspection and tests)."""
        return self._gradients(local, params, batch, step, scale)[:2]

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

    # ---- replica synchronisation -------------------------------------------------------------------
    def replica_divergence(self, tree: Any) -> float:
        """Max |difference| between the copies of every replicated piece of ``tree`` held by different devices.

        For each array, the addressable shards holding the same slice (same ``index``) must be bitwise equal
        in data-parallel training; returns 0.0 when they are, ``inf`` where one copy holds NaN or inf and another
        does not (NaN in both, or the same inf, counts as equal). Only this process's devices are compared. Copies
        are compared bitwise first (their bytes, in their own dtype); only copies that differ are converted to
        float64 for the difference, which keeps the check's host time small. A slice this process holds only once
        (one device, or an fsdp shard not replicated over another mesh axis) has nothing to compare and is never
        copied to the host.
        """
        worst = 0.0
        for leaf in jax.tree.leaves(tree):
            if not isinstance(leaf, jax.Array):
                continue
            groups: dict[Any, list] = {}
            for shard in leaf.addressable_shards:
                key = tuple((s.start, s.stop) for s in shard.index) if shard.index else ()
                groups.setdefault(key, []).append(shard)
            for shards in groups.values():
                if len(shards) < 2:
                    continue  # one copy here: divergence 0 by definition, no device-to-host copy
                copies = [np.asarray(shard.data) for shard in shards]
                first, first_bytes = copies[0], copies[0].tobytes()
                for other in copies[1:]:
                    if other.tobytes() == first_bytes:
                        continue  # bitwise equal: difference 0
                    # at least 1-d: a 0-d difference is a numpy scalar, which the masked assignments below cannot change
                    a, b = np.atleast_1d(other.astype(np.float64)), np.atleast_1d(first.astype(np.float64))
                    with np.errstate(invalid="ignore"):  # inf - inf, NaN - x: set just below
                        diff = np.abs(a - b)
                    diff[(a == b) | (np.isnan(a) & np.isnan(b))] = 0.0  # -0.0 and 0.0, the same inf, NaN in both
                    diff[np.isnan(diff)] = np.inf  # NaN (or an inf) against a number: diverged
                    worst = max(worst, float(np.max(diff, initial=0.0)))
        return worst


def _host_cpu() -> Optional[jax.Device]:
    """This process's first CPU device, or None when JAX's CPU backend is off (``JAX_PLATFORMS`` without cpu)."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return None


def held_whole(tree) -> bool:
    """Whether every leaf of ``tree`` is a ``jax.Array`` this process holds whole (``is_fully_addressable``: true
    of every array in a one-process run), so that one ``jax.device_get`` brings the whole tree to the host."""
    return all(isinstance(x, jax.Array) and x.is_fully_addressable for x in jax.tree.leaves(tree))


# steps per call of the stacking program: windows are padded to a multiple of it, so that one compiled program
# serves every window length (the main job's windows are 1-50 steps: 50-step windows cut by epoch-end saves)
WINDOW_CHUNK_STEPS = 64
# shorter windows are copied array by array: below this the stacking program's dispatch and copy cost more than
# the copies it saves
WINDOW_MIN_STACK_STEPS = 8


def _as_bits(x):
    """A floating array as the unsigned integers of its bits (same width; ``lax.bitcast_convert_type``), so that
    the stacking program moves bits and cannot change a value (an accelerator may flush subnormals or rewrite NaN
    payloads in floating-point operations); any other dtype as it is."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    return x


@jax.jit
def _stack_steps(window):
    """A tuple of ``WINDOW_CHUNK_STEPS`` lists of arrays (one list per step, alike) -> one list of arrays, each of
    shape ``(WINDOW_CHUNK_STEPS, *leaf shape)``: the window's metrics stacked on the device, floating leaves as
    the unsigned integers of their bits (``_as_bits``; the host views them back)."""
    return jax.tree.map(lambda *xs: jnp.stack([_as_bits(x) for x in xs]), *window)


def window_to_host(window: list) -> Optional[list]:
    """A logging window's device metrics (a list of per-step trees of ``jax.Array``) -> the same list of trees of
    numpy arrays, bitwise equal to ``jax.device_get(window)``'s (values, dtypes and shapes; a scalar metric comes
    back as a 0-d array, as from ``device_get``).

    The steps' leaves are stacked on the device in chunks of ``WINDOW_CHUNK_STEPS`` steps (the last chunk
    padded with its last step) by one compiled program and copied to the host together: one dispatch and one
    copy per metric name and chunk instead of one copy per metric and step (docs/performance.md, "Host cost of
    one step").

    Returns None (the caller copies array by array) when the window has fewer than ``WINDOW_MIN_STACK_STEPS``
    steps (a copy per array is cheaper there), or its steps' trees differ in structure, shape, dtype or sharding,
    or a leaf is not a fully addressable ``jax.Array``, or the leaves of a step are not all on the same devices,
    or a leaf is complex.

    Raises:
      RuntimeError: a leaf was deleted (donated), as ``jax.device_get`` raises.
    """
    if len(window) < WINDOW_MIN_STACK_STEPS:
        return None
    flat: list[tuple[list, Any]] = [jax.tree.flatten(m) for m in window]
    first, treedef = flat[0]
    if not first or not held_whole(first):
        return None
    devices = first[0].sharding.device_set
    if any(x.sharding.device_set != devices or jnp.issubdtype(x.dtype, jnp.complexfloating) for x in first):
        return None
    avals = [(x.shape, x.dtype, x.sharding) for x in first]
    steps = [leaves for leaves, _ in flat]
    for leaves, tree in flat:
        if len(leaves) != len(first) or tree != treedef:
            return None
        for x, (shape, dtype, sharding) in zip(leaves, avals):
            if not isinstance(x, jax.Array) or x.shape != shape or x.dtype != dtype or x.sharding != sharding:
                return None
    chunks = []
    for start in range(0, len(steps), WINDOW_CHUNK_STEPS):
        part = steps[start : start + WINDOW_CHUNK_STEPS]
        chunks.append(_stack_steps(tuple(part) + (part[-1],) * (WINDOW_CHUNK_STEPS - len(part))))
    host = [[leaf.view(dtype) for leaf, (_, dtype, _) in zip(chunk, avals)] for chunk in jax.device_get(chunks)]
    return [
        jax.tree.unflatten(treedef, [leaf[i - start, ...] for leaf in host[start // WINDOW_CHUNK_STEPS]])
        for start in range(0, len(steps), WINDOW_CHUNK_STEPS)
        for i in range(start, min(start + WINDOW_CHUNK_STEPS, len(steps)))
    ]


def _to_host(x) -> np.ndarray:
    """A numpy copy of ``x``: the whole array; of a multi-process array, this process's copy when replicated, else
    gathered from every process (a collective: every process calls it)."""
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    if x.sharding.is_fully_replicated:
        return np.asarray(x.addressable_shards[0].data)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def device_finite_flags(state: TrainState) -> tuple[bool, bool]:
    """(params all finite, optimizer state all finite) of a placed state (one small device op)."""
    params_ok, opt_ok = (_to_host(f) for f in _finite_flags(state.params, state.opt_state))
    return bool(params_ok), bool(opt_ok)


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
        # jnp.issubdtype: numpy's own says bfloat16 and the float8 types (ml_dtypes) are not inexact
        bool(all(np.all(np.isfinite(x)) for x in jax.tree.leaves(t) if jnp.issubdtype(x.dtype, jnp.inexact)))
        for t in host
    )
    return params_ok, opt_ok
