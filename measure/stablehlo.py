"""Collectives of a lowered module, walked op by op in its MLIR form (``lowered.compiler_ir("stablehlo")``)
with JAX's public MLIR bindings (``jax.extend.mlir``): op names, operand/result tensor types and the
``replica_groups`` / ``source_target_pairs`` attributes, no text grammar.

Payload sizes and the ring model: ``measure.collectives``. GSPMD (``jit`` with shardings) inserts its
collectives only at compile time, so a lowered module shows only the explicit ones (``shard_map``, ``pmap``).
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence, cast

from jax.extend.mlir import ir
from jax.interpreters import mlir as jax_mlir

from measure.collectives import Array, Collective, all_devices, dtype_label, permute_group_size

_OPS: dict[str, str] = {
    f"{dialect}.{op}": kind
    for dialect in ("stablehlo", "mhlo")
    for op, kind in {
        "all_reduce": "all-reduce",
        "all_gather": "all-gather",
        "reduce_scatter": "reduce-scatter",
        "all_to_all": "all-to-all",
        "collective_permute": "collective-permute",
    }.items()
}
_WHILE_OPS = ("stablehlo.while", "mhlo.while")


def _dtype(element_type: ir.Type) -> str:
    """MLIR element type -> HLO primitive type name (i32 -> s32, i1 -> pred, complex<f32> -> c64)."""
    elem = str(element_type)
    if m := re.fullmatch(r"complex<f(32|64)>", elem):
        return "c64" if m.group(1) == "32" else "c128"
    if elem == "i1":
        return "pred"
    if elem == "index":
        return "s64"
    if m := re.fullmatch(r"(?:si|i)(\d+)", elem):
        return f"s{m.group(1)}"
    if m := re.fullmatch(r"ui(\d+)", elem):
        return f"u{m.group(1)}"
    return elem.lower()


def _arrays(values: Iterable[ir.Value]) -> list[Array]:
    """The tensors among ``values`` (tokens carry no bytes); a dynamic dimension raises ValueError."""
    out = []
    for value in values:
        t = value.type
        if not isinstance(t, ir.RankedTensorType):
            continue
        if not t.has_static_shape:
            raise ValueError(f"cannot size dynamic tensor {t}")
        out.append(Array(_dtype(t.element_type), tuple(t.shape)))
    return out


def _group_size(op: ir.Operation, kind: str, name: str, num_devices: int | None, counts: list[int]) -> int:
    """n of one collective: the row length of ``replica_groups`` (empty: all devices), or the distinct
    devices of a permute's ``source_target_pairs`` (0 when nothing moves)."""
    attrs = op.attributes
    if kind == "collective-permute":
        if "source_target_pairs" not in attrs:
            return 0
        # a sequence of ints at run time (a splat expands to every element); the type stub omits __getitem__
        vals = list(cast(Sequence[int], ir.DenseIntElementsAttr(attrs["source_target_pairs"])))
        return permute_group_size(list(zip(vals[::2], vals[1::2])))
    shape = ir.ShapedType(attrs["replica_groups"].type).shape if "replica_groups" in attrs else []
    if len(shape) == 2 and shape[0] * shape[1] > 0:
        return shape[1]
    return all_devices(num_devices, counts, name)


def _as_module(module: ir.Module | str) -> ir.Module:
    """``module`` itself, or its text parsed in a context with JAX's dialects registered."""
    if isinstance(module, str):
        return ir.Module.parse(module, jax_mlir.make_ir_context())
    return module


def parse_stablehlo_collectives(module: ir.Module | str, num_devices: int | None = None) -> list[Collective]:
    """Collectives of a lowered module, in the order they appear in it.

    Args:
      module: ``lowered.compiler_ir("stablehlo")``, or its text (``lowered.as_text()``), parsed with JAX's
        MLIR context (stablehlo, mhlo, sdy, func dialects); text that does not parse raises MLIRError.
      num_devices: devices meant by empty ``replica_groups``; defaults to the module's
        ``mhlo.num_replicas`` x ``mhlo.num_partitions``.

    ``in_loop`` is set for ops inside a ``while`` region, or inside a function reached by ``func.call`` from
    one. GSPMD (``jit`` with shardings) inserts its collectives only at compile time, so for such programs
    this sees only explicit collectives (``shard_map``).
    """
    module = _as_module(module)
    attrs = module.operation.attributes
    counts = [ir.IntegerAttr(attrs[k]).value for k in ("mhlo.num_partitions", "mhlo.num_replicas") if k in attrs]
    found: list[tuple[str, ir.Operation, bool]] = []  # (function, op, inside a while of that function)
    calls: list[tuple[str, str, bool]] = []  # (caller, callee, inside a while of the caller)

    def walk(op: ir.Operation, func: str, in_loop: bool) -> None:
        for region in op.regions:
            for block in region.blocks:
                for view in block.operations:
                    inner = view.operation
                    if inner.name in _OPS:
                        found.append((func, inner, in_loop))
                    elif inner.name == "func.call":
                        calls.append((func, ir.FlatSymbolRefAttr(inner.attributes["callee"]).value, in_loop))
                    walk(inner, func, in_loop or inner.name in _WHILE_OPS)

    for view in module.body.operations:
        top = view.operation
        func = ir.StringAttr(top.attributes["sym_name"]).value if top.name == "func.func" else "module"
        walk(top, func, False)
    looped: set[str] = set()  # functions called, directly or through others, from inside a while
    while new := {callee for caller, callee, in_loop in calls if in_loop or caller in looped} - looped:
        looped |= new
    names = ir.AsmState(module.operation)  # SSA names as the module prints them (%0, %1#0 -> %1)
    out: list[Collective] = []
    for func, op, in_loop in found:
        kind = _OPS[op.name]
        name = f"{func}/{op.results[0].get_name(names).split('#')[0]}"
        n = _group_size(op, kind, name, num_devices, counts)
        if n <= 1:
            continue
        payload = _arrays(op.results if kind == "all-gather" else op.operands)
        out.append(
            Collective(
                kind=kind,
                payload_bytes=sum(a.nbytes for a in payload),
                group_size=n,
                in_loop=in_loop or func in looped,
                dtype=dtype_label(a.dtype for a in payload),
                name=name,
            )
        )
    return out


def lowered_payload_bytes(module: ir.Module | str, num_devices: int | None = None) -> int:
    """Sum of S over the collectives of a lowered (StableHLO) module."""
    return sum(c.payload_bytes for c in parse_stablehlo_collectives(module, num_devices))
