"""A model of data-parallel step time on N devices of a real cluster (pure functions, no JAX).

Notation: N devices in nodes of g = min(N, devices_per_node) devices (N must be a multiple of g), m = N / g
nodes, S the payload bytes of one collective (DESIGN.md: the operand of an all-reduce, the output of an
all-gather, the input of a reduce-scatter), B_intra / B_inter the per-device, one-direction bandwidths
inside a node / between nodes (bytes/s), a the latency of one collective step (s).

Default model, ``algorithm="hierarchical"``:

* all-reduce, hierarchical (reduce-scatter inside the node, all-reduce of the 1/g shard across nodes,
  all-gather inside the node)::

      t = 2 (g-1)/g * S / B_intra + 2 (m-1)/m * (S/g) / B_inter + a * (2 (g-1) + 2 (m-1))

  The bandwidth terms are the ring all-reduce bound 2 (n-1)/n * S / B of Patarasuk & Yuan, "Bandwidth
  optimal all-reduce algorithms for clusters of workstations" (JPDC 2009) applied at each level; the
  two-level scheme is that of Goyal et al. 2017 ("Accurate, Large Minibatch SGD", section 4: reduce within
  the server, all-reduce across servers, broadcast within) and of "How to Scale Your Model" (Austin et al.,
  GPU chapter, collectives across nodes);
* all-gather and reduce-scatter (fsdp), each::

      t = (g-1)/g * S / B_intra + (m-1)/m * (S/g) / B_inter + a * ((g-1) + (m-1))

* all-to-all (flat, only the compressed gradient exchange uses it): (N-1)/N * S / B + a (N-1), B = B_intra on one
  node, else B_inter; collective-permute: S / B + a.

``algorithm="ring"`` / ``"tree"`` / ``"nccl"`` are NCCL's own cost model (NVIDIA/nccl src/graph/tuning.cc,
``ncclTopoTuneModel``): one ring over all N ranks, pipelined, so only its slowest hop counts; bus bandwidth
B_bus = B_intra on one node, else min(B_intra, g * B_inter) (a node's g NICs carry the ring's channels):

* ring all-reduce: 2 (N-1)/N * S / B_bus + a * 2 (N-1); ring all-gather / reduce-scatter:
  (N-1)/N * S / B_bus + a (N-1);
* tree all-reduce (double binary tree, NCCL's algorithm bandwidth = bus bandwidth / 2):
  2 S / B_bus + a * 2 ((g-1) + ceil(log2 m));
* ``nccl``: the faster of ring and tree per all-reduce, as NCCL picks by this model.

Step (all algorithms): comm_s = the sum of t over the collectives of one optimizer step;
exposed_comm_s = max(0, comm_s - overlap * compute_s); step_time_s = compute_s + exposed_comm_s;
efficiency = compute_s / step_time_s; comm_ratio = comm_s / step_time_s (the communication ratio modelled
wholly for the target: ``comm/ratio_model``'s definition with the target's compute time);
examples_per_s = N * per_device_batch / step_time_s (weak scaling: the per-device batch is held fixed).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Optional, Sequence

ALGORITHMS = ("hierarchical", "ring", "tree", "nccl")
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# CSV / Markdown columns of a projection row, in order.
COLUMNS = [
    "devices",
    "nodes",
    "devices_per_node",
    "payload_bytes",
    "compute_s",
    "comm_s",
    "exposed_comm_s",
    "step_time_s",
    "examples_per_s",
    "speedup",
    "efficiency",
    "comm_ratio",
    "mfu",
]


class ProjectionError(ValueError):
    """Inputs the model cannot use; the message is one line naming the offending values and the fix."""


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The numbers the model needs (units in the names); ``name`` and ``source`` are for titles and tables."""

    name: str
    devices_per_node: int
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    latency_s: float
    peak_flops_per_s: Optional[float] = None
    source: str = ""

    @classmethod
    def from_profile(cls, profile: dict[str, Any]) -> "Hardware":
        """From a profile dict (measure/hardware.py ``load_profile``); raises :class:`ProjectionError` naming
        each missing number and the ``--set key=value`` that supplies it."""
        needed = ("devices_per_node", "intra_node_bytes_per_s", "inter_node_bytes_per_s", "latency_s")
        missing = [k for k in needed if profile.get(k) is None]
        if missing:
            sets = " ".join(f"--set {k}=..." for k in missing)
            raise ProjectionError(
                f"hardware profile {profile.get('name')!r} has no {', '.join(missing)}; "
                f"give them with {sets} (or choose another --hardware)"
            )
        return cls(
            name=str(profile.get("name")),
            devices_per_node=int(profile["devices_per_node"]),
            intra_node_bytes_per_s=float(profile["intra_node_bytes_per_s"]),
            inter_node_bytes_per_s=float(profile["inter_node_bytes_per_s"]),
            latency_s=float(profile["latency_s"]),
            peak_flops_per_s=None if profile.get("peak_flops_per_s") is None else float(profile["peak_flops_per_s"]),
            source=str(profile.get("source") or ""),
        )


@dataclasses.dataclass(frozen=True, order=True)
class Collective:
    """One collective of the step: ``kind`` (one of :data:`KINDS`), its payload S in bytes, and how often it
    runs per optimizer step (``repeats``: ``accum_steps`` for a collective inside the accumulation loop)."""

    kind: str
    payload_bytes: float
    repeats: int = 1


def node_layout(devices: int, devices_per_node: int) -> tuple[int, int]:
    """(g, m): devices per node g = min(N, devices_per_node) and nodes m = N / g.

    Raises :class:`ProjectionError` when N < 1 or N is not a multiple of g (e.g. N=12 with 8 per node).
    """
    if devices < 1 or devices_per_node < 1:
        raise ProjectionError(f"devices={devices}, devices_per_node={devices_per_node}: both must be >= 1")
    g = min(devices, devices_per_node)
    if devices % g:
        raise ProjectionError(
            f"devices={devices} is not a multiple of devices_per_node={devices_per_node}; "
            f"use whole nodes (e.g. --devices {g},{2 * g},{4 * g})"
        )
    return g, devices // g


def all_reduce_time_s(payload_bytes: float, devices: int, hw: Hardware) -> float:
    """Hierarchical all-reduce time (s): 2(g-1)/g*S/B_intra + 2(m-1)/m*(S/g)/B_inter + a*(2(g-1)+2(m-1))."""
    g, m = node_layout(devices, hw.devices_per_node)
    s = float(payload_bytes)
    return (
        2 * (g - 1) / g * s / hw.intra_node_bytes_per_s
        + 2 * (m - 1) / m * (s / g) / hw.inter_node_bytes_per_s
        + hw.latency_s * (2 * (g - 1) + 2 * (m - 1))
    )


def gather_time_s(payload_bytes: float, devices: int, hw: Hardware) -> float:
    """Hierarchical all-gather or reduce-scatter time (s): (g-1)/g*S/B_intra + (m-1)/m*(S/g)/B_inter
    + a*((g-1)+(m-1))."""
    g, m = node_layout(devices, hw.devices_per_node)
    s = float(payload_bytes)
    return (
        (g - 1) / g * s / hw.intra_node_bytes_per_s
        + (m - 1) / m * (s / g) / hw.inter_node_bytes_per_s
        + hw.latency_s * ((g - 1) + (m - 1))
    )


def bus_bytes_per_s(devices: int, hw: Hardware) -> float:
    """NCCL's bus bandwidth of one flat ring/tree: B_intra on one node, else min(B_intra, g * B_inter)."""
    g, m = node_layout(devices, hw.devices_per_node)
    return hw.intra_node_bytes_per_s if m == 1 else min(hw.intra_node_bytes_per_s, g * hw.inter_node_bytes_per_s)


def ring_time_s(kind: str, payload_bytes: float, devices: int, hw: Hardware) -> float:
    """NCCL flat ring (tuning.cc): all-reduce 2(N-1)/N*S/B_bus + 2(N-1)a; all-gather/reduce-scatter half."""
    n = devices
    steps = 2 * (n - 1) if kind == "all-reduce" else (n - 1)
    return steps / n * float(payload_bytes) / bus_bytes_per_s(n, hw) + steps * hw.latency_s


def tree_time_s(payload_bytes: float, devices: int, hw: Hardware) -> float:
    """NCCL double binary tree all-reduce (tuning.cc): 2*S/B_bus + 2*((g-1) + ceil(log2 m))*a; 0 on one device."""
    g, m = node_layout(devices, hw.devices_per_node)
    if devices == 1:
        return 0.0
    return (
        2 * float(payload_bytes) / bus_bytes_per_s(devices, hw) + 2 * ((g - 1) + math.ceil(math.log2(m))) * hw.latency_s
    )


def collective_time_s(
    kind: str, payload_bytes: float, devices: int, hw: Hardware, algorithm: str = "hierarchical"
) -> float:
    """Time (s) of one collective of ``kind`` with payload S over ``devices`` under ``algorithm``.

    Raises :class:`ProjectionError` for an unknown kind or algorithm.
    """
    if algorithm not in ALGORITHMS:
        raise ProjectionError(f"unknown algorithm {algorithm!r}; choices: {', '.join(ALGORITHMS)}")
    if kind not in KINDS:
        raise ProjectionError(f"unknown collective kind {kind!r}; kinds: {', '.join(KINDS)}")
    if devices == 1:
        return 0.0
    g, m = node_layout(devices, hw.devices_per_node)
    if kind == "all-to-all":
        b = hw.intra_node_bytes_per_s if m == 1 else hw.inter_node_bytes_per_s
        return (devices - 1) / devices * payload_bytes / b + hw.latency_s * (devices - 1)
    if kind == "collective-permute":
        b = hw.intra_node_bytes_per_s if m == 1 else hw.inter_node_bytes_per_s
        return payload_bytes / b + hw.latency_s
    if algorithm == "hierarchical":
        if kind == "all-reduce":
            return all_reduce_time_s(payload_bytes, devices, hw)
        return gather_time_s(payload_bytes, devices, hw)
    ring = ring_time_s(kind, payload_bytes, devices, hw)
    if kind != "all-reduce" or algorithm == "ring":
        return ring
    tree = tree_time_s(payload_bytes, devices, hw)
    return tree if algorithm == "tree" else min(ring, tree)


def collectives_for(parallel: str, params: int, grad_bytes_per_param: float) -> list[Collective]:
    """The collectives of one step of a model with ``params`` parameters.

    ``parallel``: ``allreduce`` (also ``jit_sharding``, ``pmap``, ``shard_map``): one all-reduce of the
    gradients, S = params * grad_bytes_per_param; ``fsdp``: an all-gather of the parameters and a
    reduce-scatter of the gradients, each S = params * grad_bytes_per_param (parameters gathered in the
    gradient dtype). Raises :class:`ProjectionError` for another name or a non-positive size.
    """
    if params <= 0 or grad_bytes_per_param <= 0:
        raise ProjectionError(f"--params {params} --grad-bytes-per-param {grad_bytes_per_param}: both must be > 0")
    s = float(params) * float(grad_bytes_per_param)
    if parallel in ("allreduce", "jit_sharding", "pmap", "shard_map"):
        return [Collective("all-reduce", s)]
    if parallel == "fsdp":
        return [Collective("all-gather", s), Collective("reduce-scatter", s)]
    raise ProjectionError(f"--parallel {parallel!r}: choose allreduce (jit_sharding, pmap, shard_map) or fsdp")


def project(
    collectives: Sequence[Collective],
    compute_s: float,
    per_device_batch: float,
    devices: Iterable[int],
    hw: Hardware,
    overlap: float = 0.0,
    algorithm: str = "hierarchical",
    flops_per_step_per_device: Optional[float] = None,
) -> list[dict[str, Any]]:
    """One row per device count N with the :data:`COLUMNS` (module docstring for the formulas).

    ``collectives``: the step's collectives with their payloads (the same S for every N: gradients and
    parameters have their full size whatever N is); ``compute_s``: compute time of one step on one device;
    ``payload_bytes`` is the sum of S over ``collectives`` (each once, like ``comm/payload_bytes_per_step``);
    ``overlap`` in [0, 1]: the fraction of ``compute_s`` that can hide communication. ``speedup`` is
    examples_per_s over the single-device throughput (per_device_batch / compute_s); ``mfu`` is
    flops_per_step_per_device / step_time_s / peak when both are known, else None.
    Raises :class:`ProjectionError` for compute_s <= 0, overlap outside [0, 1] or a bad device count.
    """
    if not compute_s > 0:
        raise ProjectionError(f"compute time {compute_s!r} s: must be > 0 (--step-time-s or --mfu)")
    if not 0.0 <= overlap <= 1.0:
        raise ProjectionError(f"--overlap {overlap}: must be in [0, 1]")
    if not per_device_batch > 0:
        raise ProjectionError(f"per-device batch {per_device_batch!r}: must be > 0")
    rows = []
    for n in devices:
        g, m = node_layout(int(n), hw.devices_per_node)
        comm_s = sum(c.repeats * collective_time_s(c.kind, c.payload_bytes, int(n), hw, algorithm) for c in collectives)
        exposed = max(0.0, comm_s - overlap * compute_s)
        step = compute_s + exposed
        eps = n * per_device_batch / step
        mfu = None
        if flops_per_step_per_device and hw.peak_flops_per_s:
            mfu = flops_per_step_per_device / step / hw.peak_flops_per_s
        rows.append(
            {
                "devices": int(n),
                "nodes": m,
                "devices_per_node": g,
                "payload_bytes": float(sum(c.payload_bytes for c in collectives)),
                "compute_s": compute_s,
                "comm_s": comm_s,
                "exposed_comm_s": exposed,
                "step_time_s": step,
                "examples_per_s": eps,
                "speedup": eps / (per_device_batch / compute_s),
                "efficiency": compute_s / step,
                "comm_ratio": comm_s / step,
                "mfu": mfu,
            }
        )
    return rows


def overlay_projection(
    ax,
    rows: Sequence[dict[str, Any]],
    metric: str = "examples_per_s",
    label: Optional[str] = "projection",
    **plot_kwargs,
):
    """Draws projection ``rows`` (from :func:`project`, or read back from ``projection.csv``) on a
    matplotlib ``Axes``: ``metric`` (``examples_per_s``, ``efficiency``, ``speedup``, ``step_time_s``...)
    against ``devices``, dashed with open markers so measured points drawn on the same axes stay distinct.

    Intended for ``sweeps.report``: draw the measured points, then call this with the projection of the
    same configuration. Extra keyword arguments go to ``ax.plot``. Returns the ``Line2D``.
    """
    pts = sorted(
        (int(float(r["devices"])), float(r[metric]))
        for r in rows
        if r.get(metric) not in (None, "") and r.get("devices") not in (None, "")
    )
    style = {"linestyle": "--", "marker": "o", "markerfacecolor": "none", **plot_kwargs}
    (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, **style)
    return line
