"""What every mode does with its state and metrics, as plain functions: placing a host state, copying state and
metrics to the host, the checkpoint's restore target and the placed state restored from it, and the replica
check. A function that needs the mode asks it (``state_shardings``, ``saved_state_keys``, ``feedback``), never
which mode it is."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from core.step import TrainState
from parallel.base import ParallelMode
from parallel.feedback import ErrorFeedback


def place_state(mode: ParallelMode, host_state: TrainState) -> TrainState:
    """Host (or single-device) state -> device state with the mode's ``state_shardings``."""
    return jax.device_put(host_state, mode.state_shardings(host_state))


def state_to_host(state: TrainState) -> TrainState:
    """The full state as numpy arrays (gathers shards), for saving and comparing."""
    return jax.tree.map(_to_host, state)


def metrics_to_host(metrics):
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


# ---- checkpoints: the mode says how its state is restored ------------------------------------------------------
def host_abstract(placed_state):
    """``jax.ShapeDtypeStruct`` tree of the state a checkpoint holds (the canonical state's shapes)."""
    return jax.eval_shape(lambda s: s, placed_state)


def restore_target(mode: ParallelMode, abstract, saved_tree: Optional[dict] = None) -> dict:
    """What a checkpoint is restored into, keyed as saved: ``abstract``'s fields with ``mode``'s shardings
    (straight onto the devices), plus host zeros of any mode-owned state the checkpoint holds
    (``saved_state_keys`` of ``saved_tree``, orbax's metadata tree), read as saved and adapted by
    ``from_restored``."""
    common = abstract.replace(mode_state=None)
    placed = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), common, mode.state_shardings(common)
    )
    target = {f.name: getattr(placed, f.name) for f in dataclasses.fields(placed) if f.name != "mode_state"}
    for key in mode.saved_state_keys:  # present (maybe as an empty entry): restored as saved
        if isinstance(saved_tree, dict) and key in saved_tree:
            saved = saved_tree[key]
            target[key] = ErrorFeedback.restore_target(saved if isinstance(saved, dict) else None)
    return target


def from_restored(mode: ParallelMode, restored: dict, abstract) -> tuple[TrainState, int]:
    """``(placed state, its step)`` from what ``restore_target`` received. The mode-owned state is kept when
    it fits this run (saved for this device count), else created anew (a warning: ``ErrorFeedback.adapt``)."""
    saved_own = next((restored[k] for k in mode.saved_state_keys if restored.get(k) is not None), None)
    common = {k: v for k, v in restored.items() if k not in mode.saved_state_keys}
    own = None if mode.feedback is None else mode.feedback.adapt(saved_own, abstract.params)
    state = TrainState(**common, mode_state=own)
    return state, int(np.asarray(_to_host(state.step)))


def replica_divergence(tree: Any) -> float:
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
