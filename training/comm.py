"""Static communication accounting for one compiled optimizer step.

Given the text of a compiled XLA module (``jitted.lower(...).compile().as_text()``,
HLO text) or of a lowered module (``jitted.lower(...).as_text()``, StableHLO MLIR),
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

Ring model (DESIGN formulas)
----------------------------
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
from typing import Iterable, Iterator

__all__ = [
    "KINDS",
    "Collective",
    "parse_hlo_collectives",
    "parse_stablehlo_collectives",
    "comm_metrics",
    "lowered_payload_bytes",
]

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
    "s1": 1, "u1": 1, "s2": 1, "u2": 1, "s4": 1, "u4": 1,
    "s8": 1, "u8": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8,
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


def comm_metrics(
    collectives: Iterable[Collective], prefix: str = "comm/"
) -> dict[str, float | int]:
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


def lowered_payload_bytes(mlir_text: str, num_devices: int | None = None) -> int:
    """Sum of S over the collectives of a lowered (StableHLO) module."""
    return sum(c.payload_bytes for c in parse_stablehlo_collectives(mlir_text, num_devices))


# --------------------------------------------------------------------------
# Shared text helpers
# --------------------------------------------------------------------------

_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')


def _blank_strings(text: str) -> str:
    """Replace every string literal by ``""`` (metadata may contain anything)."""
    return _STRING_RE.sub('""', text)


def _match_close(text: str, i: int) -> int:
    """Index of the bracket closing the one at ``text[i]``; skips strings.

    Only ``()[]{}`` are tracked (``<>`` cannot be, because of ``->``).
    """
    depth = 0
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == '"':
            m = _STRING_RE.match(text, i)
            i = m.end() if m else n
            continue
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise ValueError(f"unbalanced bracket at offset {i} near {text[i:i + 40]!r}")


def _dtype_label(dtypes: Iterable[str]) -> str:
    return ",".join(dict.fromkeys(dtypes))


def _all_devices(num_devices: int | None, counts: list[int], name: str) -> int:
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


def _permute_group_size(pairs: list[tuple[int, int]]) -> int:
    """Distinct devices in a permute's pairs; 0 (a no-op) when nothing moves."""
    if all(s == t for s, t in pairs):
        return 0
    return len({d for pair in pairs for d in pair})


# --------------------------------------------------------------------------
# HLO text (compiled module)
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Array:
    dtype: str
    dims: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return element_bytes(self.dtype) * math.prod(self.dims)


_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_WS_RE = re.compile(r"\s*")
_COMMENT_RE = re.compile(r"/\*.*?\*/", re.DOTALL)


def _parse_dim(tok: str) -> int:
    tok = tok.strip()
    if tok.startswith("<="):  # bounded dynamic dimension: count the bound
        tok = tok[2:]
    if not tok.isdigit():
        raise ValueError(f"cannot size dimension {tok!r}")
    return int(tok)


def _parse_shape(s: str, i: int = 0) -> tuple[_Array | list, int]:
    """Parse an HLO shape starting at ``s[i]``; returns (shape, end index)."""
    i = _WS_RE.match(s, i).end()
    if s.startswith("(", i):
        elems: list = []
        i = _WS_RE.match(s, i + 1).end()
        if s.startswith(")", i):
            return elems, i + 1
        while True:
            elem, i = _parse_shape(s, i)
            elems.append(elem)
            i = _WS_RE.match(s, i).end()
            if s.startswith(",", i):
                i += 1
            elif s.startswith(")", i):
                return elems, i + 1
            else:
                raise ValueError(f"bad tuple shape near {s[i:i + 40]!r}")
    m = _ARRAY_RE.match(s, i)
    if not m:
        raise ValueError(f"no shape at {s[i:i + 40]!r}")
    dims = tuple(_parse_dim(d) for d in m.group(2).split(",") if d.strip())
    i = m.end()
    if s.startswith("{", i):  # layout, may hold tiles like {1,0:T(8,128)}
        i = _match_close(s, i) + 1
    return _Array(m.group(1), dims), i


def _leaves(shape: _Array | list) -> Iterator[_Array]:
    if isinstance(shape, _Array):
        yield shape
    else:
        for elem in shape:
            yield from _leaves(elem)


@dataclasses.dataclass(frozen=True)
class _Instr:
    name: str
    shape: _Array | list
    opcode: str
    attrs: str  # text after the operand list, string literals blanked


_INSTR_HEAD_RE = re.compile(r"\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*")
_OPCODE_RE = re.compile(r"\s*(?P<op>[a-z][\w\-]*)\(")
_COMP_HEAD_RE = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\b.*\{\s*$")
_COMP_END_RE = re.compile(r"^\}")


def _parse_instruction(stmt: str) -> _Instr | None:
    """Parse ``[ROOT] %name = shape opcode(operands), attrs``; None if not one."""
    head = _INSTR_HEAD_RE.match(stmt)
    if not head:
        return None
    try:
        shape, i = _parse_shape(stmt, head.end())
    except ValueError:
        return None
    op = _OPCODE_RE.match(stmt, i)
    if not op:
        return None
    operands_end = _match_close(stmt, op.end() - 1)
    return _Instr(head.group("name"), shape, op.group("op"), stmt[operands_end + 1:])


def _split_hlo(text: str) -> tuple[str, dict[str, list[_Instr]]]:
    """Split HLO text into (module header line, {computation: instructions}).

    Instructions spanning several lines (hand-written HLO) are joined until
    their brackets balance.
    """
    header = ""
    comps: dict[str, list[_Instr]] = {}
    current: list[_Instr] | None = None
    pending = ""
    for raw in _COMMENT_RE.sub("", _blank_strings(text)).splitlines():
        line = raw.rstrip()
        if current is None:
            if line.startswith("HloModule"):
                header = line
            elif m := _COMP_HEAD_RE.match(line):
                current = comps.setdefault(m.group("name"), [])
            continue
        if not pending and _COMP_END_RE.match(line):
            current = None
            continue
        pending = f"{pending} {line.strip()}" if pending else line
        if _balance(pending) > 0 or pending.endswith(","):
            continue
        instr = _parse_instruction(pending)
        pending = ""
        if instr is not None:
            current.append(instr)
    return header, comps


def _balance(s: str) -> int:
    return sum(s.count(c) for c in "([{") - sum(s.count(c) for c in ")]}")


# -- call graph / loops -----------------------------------------------------

_CALLEE_ATTR_RE = re.compile(
    r"\b(?P<attr>calls|to_apply|body|condition|true_computation|false_computation"
    r"|branch_computations|called_computations)=(?P<val>\{[^{}]*\}|%?[\w.\-]+)"
)
_NAME_RE = re.compile(r"%?([\w.\-]+)")


def _callees(attrs: str) -> Iterator[tuple[str, str]]:
    for m in _CALLEE_ATTR_RE.finditer(attrs):
        for name in _NAME_RE.findall(m.group("val")):
            yield m.group("attr"), name


def _loop_computations(comps: dict[str, list[_Instr]]) -> set[str]:
    """Computations executed per iteration of some ``while``.

    Roots are the ``body=`` and ``condition=`` computations of every while;
    everything they reach through ``calls=``/``to_apply=``/branches/nested
    whiles is included.
    """
    graph = {name: {c for ins in instrs for _, c in _callees(ins.attrs)}
             for name, instrs in comps.items()}
    todo = [c for instrs in comps.values() for ins in instrs if ins.opcode == "while"
            for attr, c in _callees(ins.attrs) if attr in ("body", "condition")]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph.get(name, ()))
    return seen


# -- replica groups ---------------------------------------------------------

_MESH_GROUPS_RE = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
    r"(?:,\s*device_ids=\((?:[^()]|\([^()]*\))*\))?"
    r"\s*\{(?P<group>[^{}]*)\}"
)
_MAXIMAL_MESH_RE = re.compile(r"replica_groups=maximal_mesh\[")
_IOTA_GROUPS_RE = re.compile(r"replica_groups=\[(?P<dims>[\d,\s]+)\]<=")
_LIST_GROUPS_RE = re.compile(r"replica_groups=\{(?P<body>(?:\s*\{[^{}]*\}\s*,?)*)\s*\}")
_INNER_GROUP_RE = re.compile(r"\{([^{}]*)\}")
_MESH_AXIS_RE = re.compile(r"'?(?P<name>[^'=,\s]+)'?\s*=\s*(?P<size>\d+)")
_AXIS_REF_RE = re.compile(r"'?(?P<name>[^':,\s]+)'?(?::\((?P<pre>\d+)\)(?P<size>\d+))?")
_PAIRS_RE = re.compile(r"source_target_pairs=\{(?P<body>(?:\s*\{[^{}]*\}\s*,?)*)\s*\}")
_PAIR_RE = re.compile(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}")
_HEADER_COUNT_RE = re.compile(r"\b(num_partitions|replica_count)=(\d+)")


def _hlo_group_size(instr: _Instr, num_devices: int | None, counts: list[int]) -> int:
    """Devices per replica group of a collective (0 or 1 = no-op)."""
    attrs = instr.attrs
    if instr.opcode.startswith("collective-permute"):
        m = _PAIRS_RE.search(attrs)
        pairs = [(int(a), int(b)) for a, b in _PAIR_RE.findall(m.group("body"))] if m else []
        return _permute_group_size(pairs)
    if m := _MESH_GROUPS_RE.search(attrs):
        # mesh['a'=2,'b'=4] {'b'}: group = product of the named axes' sizes;
        # a sub-axis 'b':(pre)size contributes its own size.
        sizes = {a.group("name"): int(a.group("size"))
                 for a in _MESH_AXIS_RE.finditer(m.group("axes"))}
        group = 1
        for ref in _AXIS_REF_RE.finditer(m.group("group")):
            group *= int(ref.group("size")) if ref.group("size") else sizes[ref.group("name")]
        return group
    if _MAXIMAL_MESH_RE.search(attrs):
        return 1
    if m := _IOTA_GROUPS_RE.search(attrs):
        # [num_groups,group_size]<=[...] (optionally transposed T(...)).
        return int(m.group("dims").split(",")[-1])
    m = _LIST_GROUPS_RE.search(attrs)
    groups = _INNER_GROUP_RE.findall(m.group("body")) if m else []
    if not groups:
        return _all_devices(num_devices, counts, instr.name)
    return max(len([t for t in g.split(",") if t.strip()]) for g in groups)


# -- payloads ---------------------------------------------------------------

# opcode -> (kind, which part of the result shape holds the payload)
#   None: the whole result;  int k: element k of the result tuple.
# Async starts: all-gather-start -> (operand, output); collective-permute-start
# -> (operand, output, contexts...); reduce-scatter-start / all-to-all-start
# (async syntax sugar) -> ((operands...), output, contexts...).
_HLO_OPCODES: dict[str, tuple[str, int | None]] = {
    "all-reduce": ("all-reduce", None),
    "all-reduce-start": ("all-reduce", None),
    "all-gather": ("all-gather", None),
    "all-gather-start": ("all-gather", 1),
    "reduce-scatter": ("reduce-scatter", None),  # result * n, see below
    "reduce-scatter-start": ("reduce-scatter", 0),
    "all-to-all": ("all-to-all", None),
    "all-to-all-start": ("all-to-all", 0),
    "collective-permute": ("collective-permute", None),
    "collective-permute-start": ("collective-permute", 0),
}


def _hlo_payload(instr: _Instr, n: int) -> tuple[int, str]:
    kind, part = _HLO_OPCODES[instr.opcode]
    shape = instr.shape
    if part is not None:
        if not isinstance(shape, list) or len(shape) <= part:
            raise ValueError(f"{instr.name}: unexpected {instr.opcode} shape")
        shape = shape[part]
    leaves = list(_leaves(shape))
    nbytes = sum(a.nbytes for a in leaves)
    if instr.opcode == "reduce-scatter":
        nbytes *= n  # output is the input with the scatter dimension split n ways
    return nbytes, _dtype_label(a.dtype for a in leaves)


def parse_hlo_collectives(hlo_text: str, num_devices: int | None = None) -> list[Collective]:
    """Collectives of a compiled module, from its HLO text.

    Args:
      hlo_text: ``jitted.lower(...).compile().as_text()`` (or any HLO module text).
      num_devices: devices meant by an empty ``replica_groups={}``; defaults to
        the header's ``replica_count`` x ``num_partitions``.

    Each collective is counted once: synchronous ops, ``*-start`` of async
    pairs (``*-done``/``*-update`` are skipped), and for generic
    ``async-start(...), calls=%wrapped`` the collective inside the wrapped
    computation (reported under the ``async-start``'s name).  Collectives over groups of one device, and permutes that
    move nothing, are dropped.  Returned in text order.
    """
    header, comps = _split_hlo(hlo_text)
    counts = [int(v) for _, v in _HEADER_COUNT_RE.findall(header)]
    in_loop = _loop_computations(comps)
    async_names = _async_wrapper_names(comps)
    out: list[Collective] = []
    for comp, instrs in comps.items():
        for instr in instrs:
            if instr.opcode not in _HLO_OPCODES:
                continue
            n = _hlo_group_size(instr, num_devices, counts)
            if n <= 1:
                continue
            nbytes, dtype = _hlo_payload(instr, n)
            out.append(Collective(
                kind=_HLO_OPCODES[instr.opcode][0], payload_bytes=nbytes, group_size=n,
                in_loop=comp in in_loop, dtype=dtype,
                name=async_names.get(comp, instr.name)))
    return out


def _async_wrapper_names(comps: dict[str, list[_Instr]]) -> dict[str, str]:
    """{wrapped computation: name of the ``async-start`` that calls it}."""
    return {callee: ins.name for instrs in comps.values() for ins in instrs
            if ins.opcode == "async-start"
            for attr, callee in _callees(ins.attrs) if attr == "calls"}


# --------------------------------------------------------------------------
# StableHLO MLIR text (lowered module)
# --------------------------------------------------------------------------

_MLIR_OPS: dict[str, str] = {
    "all_reduce": "all-reduce",
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "all_to_all": "all-to-all",
    "collective_permute": "collective-permute",
}
_MLIR_COLLECTIVE_RE = re.compile(
    r"(?P<res>%[\w$.\-]+)(?::\d+)?(?:\s*,\s*%[\w$.\-]+(?::\d+)?)*\s*=\s*"
    r"\"?(?:stablehlo|mhlo)\.(?P<op>" + "|".join(_MLIR_OPS) + r")\"?(?=[\s(])"
)
_MLIR_WHILE_RE = re.compile(r"\"?(?:stablehlo|mhlo)\.while\"?(?=\s*\()")
_MLIR_FUNC_RE = re.compile(
    r"^[ \t]*func\.func\s+(?:(?:public|private|nested)\s+)?@(?P<name>[\w$.\-]+)[^\n]*\{[ \t]*$",
    re.MULTILINE,
)
_MLIR_CALL_RE = re.compile(r"\bcall\s+@(?P<name>[\w$.\-]+)")
_MLIR_TENSOR_RE = re.compile(r"tensor<(?P<body>[^<>]*(?:<[^<>]*>[^<>]*)*)>")
_MLIR_TENSOR_BODY_RE = re.compile(r"^(?P<dims>(?:(?:\d+|\?)x)*)(?P<elem>[^,]+?)\s*(?:,.*)?$")
_MLIR_DENSE_ATTR = r"\s*=\s*dense<(?P<val>[^<>]*)>\s*:\s*tensor<(?P<shape>[\dx]*)x[a-z]+\d*>"
_MLIR_GROUPS_RE = re.compile(r"replica_groups" + _MLIR_DENSE_ATTR)
_MLIR_PAIRS_RE = re.compile(r"source_target_pairs" + _MLIR_DENSE_ATTR)
_MLIR_COUNT_RE = re.compile(r"\bmhlo\.(num_partitions|num_replicas)\s*=\s*(\d+)")
_INT_RE = re.compile(r"-?\d+")


def _mlir_dtype(elem: str) -> str:
    """MLIR element type -> HLO primitive type name (i32 -> s32, i1 -> pred)."""
    elem = elem.strip()
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


def _mlir_tensors(type_text: str) -> list[_Array]:
    out = []
    for m in _MLIR_TENSOR_RE.finditer(type_text):
        body = _MLIR_TENSOR_BODY_RE.match(m.group("body").strip())
        if body is None:
            raise ValueError(f"cannot parse tensor type {m.group(0)!r}")
        dims = tuple(_parse_dim(d) for d in body.group("dims").split("x") if d)
        out.append(_Array(_mlir_dtype(body.group("elem")), dims))
    return out


def _mlir_statement_end(text: str, i: int) -> int:
    """End of the op starting at ``i``: first newline outside brackets."""
    depth = 0
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == '"':
            m = _STRING_RE.match(text, i)
            i = m.end() if m else n
            continue
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "\n" and depth <= 0:
            return i
        i += 1
    return n


def _mlir_signature(stmt: str) -> tuple[list[_Array], list[_Array]]:
    """(operand types, result types) from an op's trailing ``: (ins) -> outs``."""
    depth, colon, arrow = 0, -1, -1
    for i, ch in enumerate(stmt):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and ch == ":" and stmt[i - 1:i] == " ":
            colon, arrow = i, -1
        elif depth == 0 and colon >= 0 and stmt.startswith("->", i):
            arrow = i
    if colon < 0:
        raise ValueError(f"no type signature in {stmt[:80]!r}")
    if arrow < 0:
        types = _mlir_tensors(stmt[colon + 1:])
        return types, types
    return _mlir_tensors(stmt[colon + 1:arrow]), _mlir_tensors(stmt[arrow + 2:])


def _mlir_while_span(text: str, m: re.Match) -> tuple[int, int]:
    """Character span covering a while op and its cond/body regions."""
    args_end = _match_close(text, text.index("(", m.end()))
    # Pretty form: `stablehlo.while(...) : types` NEWLINE `cond { } do { }`.
    line_end = text.find("\n", args_end)
    line_end = len(text) if line_end < 0 else line_end
    cond = re.compile(r"\s*cond\s*\{").match(text, line_end)
    if cond:
        cond_end = _match_close(text, cond.end() - 1)
        body = re.compile(r"\s*do\s*\{").match(text, cond_end + 1)
        if not body:
            raise ValueError("stablehlo.while: 'cond' region without 'do' region")
        return m.start(), _match_close(text, body.end() - 1)
    # Generic form: `"stablehlo.while"(...) [attrs] ({cond}, {body}) : ...`.
    i = _WS_RE.match(text, args_end + 1).end()
    if text.startswith("<{", i):
        i = _WS_RE.match(text, _match_close(text, i + 1) + 2).end()
    elif text.startswith("{", i):
        i = _WS_RE.match(text, _match_close(text, i) + 1).end()
    if not text.startswith("(", i):
        raise ValueError(f"stablehlo.while without regions near {text[m.start():m.start() + 80]!r}")
    return m.start(), _match_close(text, i)


def _mlir_loop_spans(text: str) -> list[tuple[int, int]]:
    """Spans that execute per loop iteration: while regions, plus whole
    bodies of functions called (transitively) from inside one."""
    spans = [_mlir_while_span(text, m) for m in _MLIR_WHILE_RE.finditer(text)]
    funcs = {m.group("name"): (m.start(), _match_close(text, text.rindex("{", m.start(), m.end())))
             for m in _MLIR_FUNC_RE.finditer(_blank_strings_keep_len(text))}
    calls = [(m.start(), m.group("name")) for m in _MLIR_CALL_RE.finditer(text)]
    looped: set[str] = set()
    changed = True
    while changed:
        changed = False
        for pos, callee in calls:
            if callee in funcs and callee not in looped and _inside(pos, spans):
                looped.add(callee)
                spans.append(funcs[callee])
                changed = True
    return spans


def _blank_strings_keep_len(text: str) -> str:
    return _STRING_RE.sub(lambda m: '"' + " " * (len(m.group(0)) - 2) + '"', text)


def _inside(pos: int, spans: list[tuple[int, int]]) -> bool:
    return any(a <= pos <= b for a, b in spans)


def _mlir_enclosing_func(text: str, pos: int) -> str:
    name = "module"
    for m in _MLIR_FUNC_RE.finditer(text, 0, pos):
        name = m.group("name")
    return name


def _mlir_group_size(stmt: str, kind: str, name: str, num_devices: int | None,
                     counts: list[int]) -> int:
    if kind == "collective-permute":
        m = _MLIR_PAIRS_RE.search(stmt)
        if not m:
            return 0
        vals = [int(v) for v in _INT_RE.findall(m.group("val"))]
        n_pairs = int(m.group("shape").split("x")[0] or 0)
        if len(vals) == 1:  # splat: every pair is (v, v)
            vals = vals * 2 * n_pairs
        return _permute_group_size(list(zip(vals[::2], vals[1::2])))
    m = _MLIR_GROUPS_RE.search(stmt)
    dims = [int(d) for d in m.group("shape").split("x")] if m else []
    if len(dims) == 2 and dims[0] * dims[1] > 0:
        return dims[1]
    return _all_devices(num_devices, counts, name)


def parse_stablehlo_collectives(mlir_text: str, num_devices: int | None = None) -> list[Collective]:
    """Collectives of a lowered module, from its StableHLO MLIR text.

    Args:
      mlir_text: ``jitted.lower(...).as_text()``.
      num_devices: devices meant by empty ``replica_groups``; defaults to the
        module's ``mhlo.num_replicas`` x ``mhlo.num_partitions``.

    Handles generic (``"stablehlo.all_reduce"(...)``) and pretty op syntax.
    ``in_loop`` is set for ops inside a ``stablehlo.while`` region, or inside a
    function reached by ``func.call`` from one.  GSPMD (``jit`` with
    shardings) inserts its collectives only at compile time, so for such
    programs this sees only explicit collectives (``shard_map``).
    """
    counts = [int(v) for _, v in _MLIR_COUNT_RE.findall(mlir_text)]
    spans = _mlir_loop_spans(mlir_text)
    out: list[Collective] = []
    for m in _MLIR_COLLECTIVE_RE.finditer(mlir_text):
        kind = _MLIR_OPS[m.group("op")]
        stmt = mlir_text[m.start():_mlir_statement_end(mlir_text, m.end())]
        name = f"{_mlir_enclosing_func(mlir_text, m.start())}/{m.group('res')}"
        n = _mlir_group_size(stmt, kind, name, num_devices, counts)
        if n <= 1:
            continue
        operands, results = _mlir_signature(stmt)
        payload = results if kind == "all-gather" else operands
        out.append(Collective(
            kind=kind, payload_bytes=sum(a.nbytes for a in payload), group_size=n,
            in_loop=_inside(m.start(), spans), dtype=_dtype_label(a.dtype for a in payload),
            name=name))
    return out
