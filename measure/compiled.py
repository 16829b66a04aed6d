"""Static measurements of the compiled step: communication, memory, FLOPs, and hardware look-ups.

Each metric's definition is in its function's docstring (docs/metrics.md lists them).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import jax

from measure.collectives import comm_metrics
from measure.hlo_text import parse_hlo_collectives
from measure.stablehlo import parse_stablehlo_collectives

log = logging.getLogger(__name__)


def hardware_profile(hardware, device_kind: str) -> Optional[str]:
    """The name of the hardware profile (``conf/hardware/<name>.yaml``) whose numbers this run uses for
    ``comm/time_model_s``, ``comm/ratio_model`` and ``perf/mfu``, or None when there is none.

    ``hardware`` is the run's ``HardwareConfig``. A chosen profile names itself (``hardware=h100_sxm`` ->
    ``"h100_sxm"``, ``hardware=custom`` -> ``"custom"``); under ``hardware=auto`` (``detect`` true) the profile
    matched by ``device_kind`` (``measure.hardware.profile_for_device_kind``; ``"cpu"`` on CPU, whose numbers
    are null); None for ``hardware=none``, ``auto`` without a match, or ``detect=false`` without a profile.
    Values set by hand on top of a profile (``hardware.link_bytes_per_s=...``) show in ``hardware/*`` keys.
    """
    if hardware.detect:
        from measure.hardware import profile_for_device_kind

        profile = profile_for_device_kind(device_kind)
        return None if profile is None else profile["name"]
    return None if hardware.name in ("auto", "none", "") else hardware.name


def lookup_link_bytes_per_s(device_kind: str) -> Optional[float]:
    """Per-direction link bandwidth (bytes/s) for ``device_kind``, or None (e.g. CPU).

    The ``link_bytes_per_s`` of the hardware profile matching the device kind (``conf/hardware/*.yaml``,
    measure/hardware.py: ``profile_for_device_kind``).
    """
    from measure.hardware import profile_for_device_kind

    profile = profile_for_device_kind(device_kind)
    return None if profile is None else profile["link_bytes_per_s"]


def lookup_peak_flops_per_s(device_kind: str, dtype_name: str) -> Optional[float]:
    """Dense peak FLOP/s of one device of ``device_kind`` in ``dtype_name``, or None when unknown.

    From the hardware profile matching the device kind: ``peak_flops_per_s`` for bfloat16/float16,
    ``peak_flops_per_s_float32`` for float32 (TF32 tensor cores on NVIDIA); None for other dtypes.
    """
    from measure.hardware import profile_for_device_kind

    profile = profile_for_device_kind(device_kind)
    if profile is None:
        return None
    if dtype_name in ("bfloat16", "float16"):
        return profile["peak_flops_per_s"]
    if dtype_name == "float32":
        return profile["peak_flops_per_s_float32"]
    return None


def compiled_step_metrics(lowered, compiled, num_devices: int) -> dict[str, Any]:
    """Communication, temporary memory and FLOPs of one compiled optimizer step.

    Returns ``comm/*`` (from the compiled HLO; ``comm/payload_bytes_per_step_lowered`` from the lowered
    StableHLO), ``mem/temp_bytes_per_device`` (``compiled.memory_analysis().temp_size_in_bytes``),
    ``mem/compiled_peak_bytes_per_device`` (``compiled_peak_bytes``: what the step needs at once, its
    temporaries included: what ``model.remat`` changes) and
    ``perf/flops_per_step_per_device`` (``compiled.cost_analysis()['flops']``, XLA counts a multiply-add as 2).
    """
    out: dict[str, Any] = {}
    collectives = parse_hlo_collectives(compiled.as_text(), num_devices=num_devices)
    out.update(comm_metrics(collectives))
    try:
        lowered_collectives = parse_stablehlo_collectives(lowered.compiler_ir("stablehlo"), num_devices=num_devices)
        out["comm/payload_bytes_per_step_lowered"] = int(sum(c.payload_bytes for c in lowered_collectives))
    except Exception as e:  # e.g. a dynamic dimension cannot be sized: a secondary figure, the compiled numbers stand
        log.warning("could not list the collectives of the lowered module: %s", e)
    out["comm/collectives"] = [
        f"{c.kind} {c.dtype} {c.payload_bytes}B n={c.group_size}{' loop' if c.in_loop else ''}" for c in collectives
    ]
    mem = compiled.memory_analysis()
    if mem is not None:
        out["mem/temp_bytes_per_device"] = int(mem.temp_size_in_bytes)
        out["mem/compiled_peak_bytes_per_device"] = compiled_peak_bytes(compiled)["peak_bytes"]
    cost = compiled.cost_analysis()
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    if cost and "flops" in cost:
        out["perf/flops_per_step_per_device"] = float(cost["flops"])
    return out


def compiled_peak_bytes(compiled) -> dict[str, int]:
    """Memory per device of a compiled program, from ``compiled.memory_analysis()``: ``argument_bytes``
    (inputs: the state and the batch), ``temp_bytes`` (temporaries) and their sum ``peak_bytes``, the most
    the program needs at once (outputs alias donated arguments). Raises ValueError when the backend gives no
    memory analysis."""
    mem = compiled.memory_analysis()
    if mem is None:
        raise ValueError("this backend gives no memory analysis of a compiled program")
    args, temp = int(mem.argument_size_in_bytes), int(mem.temp_size_in_bytes)
    return {"argument_bytes": args, "temp_bytes": temp, "peak_bytes": args + temp}


def state_bytes_per_device(state) -> int:
    """Bytes of the state (params + optimizer state + scalars) resident on the first device of the mesh."""
    total = 0
    for leaf in jax.tree.leaves(state):
        if isinstance(leaf, jax.Array):
            shards = leaf.addressable_shards
            total += shards[0].data.nbytes if shards else 0
    return int(total)


def device_memory_stat(key: str) -> Optional[int]:
    """One figure (bytes) of the first local device's ``Device.memory_stats()`` (GPU, TPU: e.g.
    ``peak_bytes_in_use``, ``bytes_limit``), None where the backend reports none (CPU), lacks the key or the
    statistics cannot be read."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # a backend without memory statistics: treated as reporting none
        return None
    return int(stats[key]) if stats and key in stats else None


def peak_bytes_per_device() -> Optional[int]:
    """Peak bytes in use on the first local device (GPU/TPU memory statistics), None where unavailable."""
    return device_memory_stat("peak_bytes_in_use")


class CacheEvents:
    """Counts JAX's persistent compilation cache events while open (``jax.monitoring`` listeners).

    ``outcome()``: ``"hit"`` (every program compiled inside was loaded from the cache), ``"miss"`` (at least one
    was compiled and not found), ``"off"`` (no program asked the cache: it is off, or nothing compiled).
    """

    EVENTS = {
        "/jax/compilation_cache/compile_requests_use_cache": "requests",
        "/jax/compilation_cache/cache_hits": "hits",
        "/jax/compilation_cache/cache_misses": "misses",
    }

    def __init__(self) -> None:
        self.counts = {"requests": 0, "hits": 0, "misses": 0}

    def _on_event(self, event: str, **kwargs) -> None:
        name = self.EVENTS.get(event)
        if name is not None:
            self.counts[name] += 1

    def __enter__(self) -> "CacheEvents":
        jax.monitoring.register_event_listener(self._on_event)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_listener(self._on_event)

    def outcome(self) -> str:
        if self.counts["misses"]:
            return "miss"
        return "hit" if self.counts["hits"] else "off"
