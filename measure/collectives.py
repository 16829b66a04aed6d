"""Collectives of one compiled optimizer step, and the ring model of the bytes they send.

The parsers that list them live beside this module: ``measure.hlo_text`` (compiled module, HLO text) and
``measure.stablehlo`` (lowered module, walked in its MLIR form).

Given the text of a compiled XLA module (``jitted.lower(...).compile().as_text()``,
HLO text) or a lowered module (``jitted.lower(...).compiler_ir("stablehlo")``, StableHLO MLIR),
list every cross-device collective together with its logical payload, its
replica-group size and whether it sits inside a loop, and turn that list into a
flat metrics dict for logging.

Units
-----
All sizes are **bytes per device per execution of the module** (one step).
``payload_bytes`` (S) is the logical buffer size of the collective on one device:

=====================  ======================================================
kind                   S
=====================  ======================================================
all-reduce             operand (== result) size
all-gather             OUTPUT size (the gathered buffer, n x input)
reduce-scatter         INPUT size (n x output)
all-to-all             whole operand size (all n chunks)
collective-permute     operand size
=====================  ======================================================

Ring model
----------
Bytes each device *sends* for one collective over a group of ``n`` devices,
following the bandwidth-optimal ring algorithms in "How to Scale Your Model"
(Austin et al., https://jax-ml.github.io/scaling-book/, "sharded matrices and
collectives" section):

* all-reduce:          ``2 (n-1)/n * S``   (reduce-scatter + all-gather)
* all-gather:          ``(n-1)/n * S``     (S = gathered output)
* reduce-scatter:      ``(n-1)/n * S``     (S = full input)
* all-to-all:          ``(n-1)/n * S``     (every chunk but one's own leaves)
* collective-permute:  ``S``               (point to point)

Divide by link bandwidth (bytes/s) to get a lower bound on the step's
communication time.  The accounting is static: a collective inside a
``while`` body is counted once, whatever the trip count (``in_loop`` flags it).

HLO semantics (replica groups, async start/done pairs, source-target pairs)
follow https://openxla.org/xla/operation_semantics and
https://openxla.org/xla/async_ops.

Observed on jax 0.10.2, XLA:CPU (see tests/fixtures/hlo/):

* only synchronous collectives are emitted (no ``*-start``/``*-done`` and no
  ``async-start`` wrappers); the async forms are supported from the XLA text
  grammar and tested on hand-written snippets;
* the all-reduce combiner merges independent all-reduces into one tuple
  all-reduce (e.g. all gradients of a data-parallel step);
* GSPMD-inserted collectives print their groups in the mesh notation
  ``replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}``;
* bf16 all-reduces are promoted to f32 in the compiled module, so the lowered
  (StableHLO) and compiled (HLO) payloads differ by 2x;
* array all-to-all is rewritten into the tuple form (one operand per chunk);
* XLA:CPU never introduces reduce-scatter on its own (only explicit
  ``psum_scatter`` produces one).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Iterable

__all__ = ["KINDS", "Array", "Collective", "comm_metrics", "element_bytes"]

KINDS: tuple[str, ...] = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)

# Bytes per element of each HLO primitive type.  Sub-byte types (s4, f4e2m1fn,
# ...) are counted as one byte per element, i.e. unpacked.
_ELEMENT_BYTES: dict[str, int] = {
    "pred": 1,
    "s1": 1,
    "u1": 1,
    "s2": 1,
    "u2": 1,
    "s4": 1,
    "u4": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "token": 0,
}
_SMALL_FLOAT_RE = re.compile(r"^f[468]e\w+$")  # f8e4m3fn, f8e5m2, f4e2m1fn, ...


def element_bytes(dtype: str) -> int:
    """Size in bytes of one element of HLO primitive type ``dtype``."""
    dtype = dtype.lower()
    if dtype in _ELEMENT_BYTES:
        return _ELEMENT_BYTES[dtype]
    if _SMALL_FLOAT_RE.match(dtype):
        return 1
    raise ValueError(f"unknown element type {dtype!r}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One cross-device collective of a compiled (or lowered) module.

    Attributes:
      kind: one of :data:`KINDS`.
      payload_bytes: S, logical bytes on one device (see module docstring for
        which buffer that is for each kind).
      group_size: n, devices per replica group (>= 2; no-ops are dropped).
      in_loop: the op runs inside a ``while`` (body or condition, directly or
        through calls / fusions / conditionals / async wrappers).
      dtype: element type(s) of the payload, comma-joined in order of first
        appearance (``'f32'``, ``'f32,s32'``).
      name: HLO instruction name, or ``func/%ssa`` for StableHLO.
    """

    kind: str
    payload_bytes: int
    group_size: int
    in_loop: bool
    dtype: str
    name: str

    @property
    def ring_bytes(self) -> float:
        """Bytes each device sends under the ring model (module docstring)."""
        n, s = self.group_size, self.payload_bytes
        if self.kind == "all-reduce":
            return 2.0 * (n - 1) / n * s
        if self.kind in ("all-gather", "reduce-scatter", "all-to-all"):
            return (n - 1) / n * s
        if self.kind == "collective-permute":
            return float(s)
        raise ValueError(f"unknown collective kind {self.kind!r}")


def comm_metrics(collectives: Iterable[Collective], prefix: str = "comm/") -> dict[str, float | int]:
    """Flat metrics for one step.

    Returns ``{prefix}payload_bytes_per_step`` (int, sum of S),
    ``{prefix}bytes_per_step`` (float, sum of ring bytes sent per device),
    ``{prefix}count/<kind>`` for every kind in :data:`KINDS` (int, 0 if absent)
    and ``{prefix}in_loop_count`` (int).
    """
    collectives = list(collectives)
    out: dict[str, float | int] = {
        f"{prefix}payload_bytes_per_step": sum(c.payload_bytes for c in collectives),
        f"{prefix}bytes_per_step": float(sum(c.ring_bytes for c in collectives)),
    }
    for kind in KINDS:
        out[f"{prefix}count/{kind}"] = sum(c.kind == kind for c in collectives)
    out[f"{prefix}in_loop_count"] = sum(c.in_loop for c in collectives)
    return out


@dataclasses.dataclass(frozen=True)
class Array:
    """One array of a collective's signature: HLO element type name and dimensions."""

    dtype: str
    dims: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the whole array (sub-byte types counted as one byte per element)."""
        return element_bytes(self.dtype) * math.prod(self.dims)


def parse_dim(tok: str) -> int:
    """One dimension of a shape (``<=N``, a bounded dynamic dimension, counts its bound)."""
    tok = tok.strip()
    if tok.startswith("<="):  # bounded dynamic dimension: count the bound
        tok = tok[2:]
    if not tok.isdigit():
        raise ValueError(f"cannot size dimension {tok!r}")
    return int(tok)


def dtype_label(dtypes: Iterable[str]) -> str:
    """Element types in order of first appearance, comma-joined (``'f32,s32'``)."""
    return ",".join(dict.fromkeys(dtypes))


def all_devices(num_devices: int | None, counts: list[int], name: str) -> int:
    """Device count meant by an empty replica-group list.

    ``num_devices`` wins when given; otherwise the product of the replica and
    partition counts stated by the module (XLA prints only those != 1).
    """
    if num_devices is not None:
        return num_devices
    if not counts:
        raise ValueError(
            f"{name}: empty replica_groups means 'all devices', but the module "
            "states neither num_partitions nor replica_count; pass num_devices"
        )
    return math.prod(counts)


def permute_group_size(pairs: list[tuple[int, int]]) -> int:
    """Distinct devices in a permute's pairs; 0 (a no-op) when nothing moves."""
    if all(s == t for s, t in pairs):
        return 0
    return len({d for pair in pairs for d in pair})
