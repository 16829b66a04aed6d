"""Static measurements of the compiled step: communication, memory, FLOPs, and hardware tables.

Each metric's definition is in its function's docstring (README, "Metrics", lists them).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import jax

from measure.collectives import comm_metrics
from measure.hlo_text import parse_hlo_collectives
from measure.stablehlo import parse_stablehlo_collectives

log = logging.getLogger(__name__)

# Per-direction interconnect bandwidth, bytes/s, by device kind (substring match, lower case).
# NVLink 4 (H100/H200): 900 GB/s bidirectional = 450e9 per direction; NVLink 3 (A100): 600 GB/s = 300e9.
# Source: "How to Scale Your Model" (Austin et al.), GPU chapter; NVIDIA H100/A100 datasheets.
# TPU ICI per-link, per direction: v4 45e9 x 6 links... we use the per-chip one-axis figure of the
# scaling book's TPU chapter: v4 ~4.5e10, v5e ~4.5e10, v5p ~9e10 bytes/s per link per direction.
LINK_BYTES_PER_S = {
    "h100": 450e9, "h200": 450e9, "gh200": 450e9, "a100": 300e9,
    "tpu v4": 4.5e10, "tpu v5 lite": 4.5e10, "tpu v5e": 4.5e10, "tpu v5p": 9e10, "tpu v5": 9e10,
}

# Dense peak FLOP/s per device by (device kind substring, compute dtype). Sources: NVIDIA H100 SXM datasheet
# (bf16/fp16 dense 989e12, tf32 494e12 dense; the 1979e12 figure is with 2:4 sparsity), A100 datasheet
# (bf16 312e12, tf32 156e12), Google Cloud TPU docs (v4 275e12, v5e 197e12, v5p 459e12 bf16).
PEAK_FLOPS_PER_S = {
    ("h100", "bfloat16"): 989e12, ("h100", "float16"): 989e12, ("h100", "float32"): 494e12,
    ("h200", "bfloat16"): 989e12, ("h200", "float16"): 989e12, ("h200", "float32"): 494e12,
    ("a100", "bfloat16"): 312e12, ("a100", "float16"): 312e12, ("a100", "float32"): 156e12,
    ("tpu v4", "bfloat16"): 275e12, ("tpu v5 lite", "bfloat16"): 197e12, ("tpu v5e", "bfloat16"): 197e12,
    ("tpu v5p", "bfloat16"): 459e12,
}


def lookup_link_bytes_per_s(device_kind: str) -> Optional[float]:
    """Per-direction link bandwidth (bytes/s) for ``device_kind``, or None (e.g. CPU)."""
    kind = device_kind.lower()
    for key, value in LINK_BYTES_PER_S.items():
        if key in kind:
            return value
    return None


def lookup_peak_flops_per_s(device_kind: str, dtype_name: str) -> Optional[float]:
    """Dense peak FLOP/s of one device of ``device_kind`` in ``dtype_name``, or None when unknown."""
    kind = device_kind.lower()
    for (key, dt), value in PEAK_FLOPS_PER_S.items():
        if key in kind and dt == dtype_name:
            return value
    return None


def compiled_step_metrics(lowered, compiled, num_devices: int) -> dict[str, Any]:
    """Communication, temporary memory and FLOPs of one compiled optimizer step.

    Returns ``comm/*`` (from the compiled HLO; ``comm/payload_bytes_per_step_lowered`` from the lowered
    StableHLO), ``mem/temp_bytes_per_device`` (``compiled.memory_analysis().temp_size_in_bytes``) and
    ``perf/flops_per_step_per_device`` (``compiled.cost_analysis()['flops']``, XLA counts a multiply-add as 2).
    """
    out: dict[str, Any] = {}
    collectives = parse_hlo_collectives(compiled.as_text(), num_devices=num_devices)
    out.update(comm_metrics(collectives))
    try:
        lowered_collectives = parse_stablehlo_collectives(lowered.as_text(), num_devices=num_devices)
        out["comm/payload_bytes_per_step_lowered"] = int(sum(c.payload_bytes for c in lowered_collectives))
    except Exception as e:  # the lowered text of some wrappers (pmap) may not parse; compiled numbers stand
        log.warning("could not parse the lowered module for collectives: %s", e)
    out["comm/collectives"] = [f"{c.kind} {c.dtype} {c.payload_bytes}B n={c.group_size}{' loop' if c.in_loop else ''}"
                               for c in collectives]
    mem = compiled.memory_analysis()
    if mem is not None:
        out["mem/temp_bytes_per_device"] = int(mem.temp_size_in_bytes)
    cost = compiled.cost_analysis()
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    if cost and "flops" in cost:
        out["perf/flops_per_step_per_device"] = float(cost["flops"])
    return out


def state_bytes_per_device(state) -> int:
    """Bytes of the state (params + optimizer state + scalars) resident on the first device of the mesh."""
    total = 0
    for leaf in jax.tree.leaves(state):
        if isinstance(leaf, jax.Array):
            shards = leaf.addressable_shards
            total += shards[0].data.nbytes if shards else 0
    return int(total)


def peak_bytes_per_device() -> Optional[int]:
    """Peak bytes in use on the first local device (GPU/TPU memory statistics), None where unavailable."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:
        return None
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return int(stats["peak_bytes_in_use"])
