"""Collectives of a compiled module, from its HLO text (``jitted.lower(...).compile().as_text()``).

HLO semantics (replica groups, async start/done pairs, source-target pairs) follow
https://openxla.org/xla/operation_semantics and https://openxla.org/xla/async_ops. Payload sizes and the ring
model: ``measure.collectives``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterator

from measure.collectives import Array, Collective, all_devices, dtype_label, parse_dim, permute_group_size

_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_COMMENT_RE = re.compile(r"/\*.*?\*/", re.DOTALL)
_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')
_WS_RE = re.compile(r"\s*")


def skip_whitespace(text: str, i: int) -> int:
    """The index of the first non-whitespace character of ``text`` at or after ``i`` (``len(text)`` if none)."""
    m = _WS_RE.match(text, i)
    return m.end() if m else i  # r"\s*" matches (possibly empty) at every position: m is never None


def blank_strings(text: str) -> str:
    """Replace every string literal by ``""`` (metadata may contain anything)."""
    return _STRING_RE.sub('""', text)


def match_close(text: str, i: int) -> int:
    """Index of the bracket closing the one at ``text[i]``; string literals are skipped and only ``()[]{}``
    are tracked (``<>`` cannot be, because of ``->``). Raises ValueError when there is none."""
    depth = 0
    while i < len(text):
        ch = text[i]
        if ch == '"':
            m = _STRING_RE.match(text, i)
            i = m.end() if m else len(text)
            continue
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise ValueError(f"unbalanced bracket at offset {i} near {text[i : i + 40]!r}")


def _parse_shape(s: str, i: int = 0) -> tuple[Array | list, int]:
    """Parse an HLO shape starting at ``s[i]``; returns (shape, end index)."""
    i = skip_whitespace(s, i)
    if s.startswith("(", i):
        elems: list = []
        i = skip_whitespace(s, i + 1)
        if s.startswith(")", i):
            return elems, i + 1
        while True:
            elem, i = _parse_shape(s, i)
            elems.append(elem)
            i = skip_whitespace(s, i)
            if s.startswith(",", i):
                i += 1
            elif s.startswith(")", i):
                return elems, i + 1
            else:
                raise ValueError(f"bad tuple shape near {s[i : i + 40]!r}")
    m = _ARRAY_RE.match(s, i)
    if not m:
        raise ValueError(f"no shape at {s[i : i + 40]!r}")
    dims = tuple(parse_dim(d) for d in m.group(2).split(",") if d.strip())
    i = m.end()
    if s.startswith("{", i):  # layout, may hold tiles like {1,0:T(8,128)}
        i = match_close(s, i) + 1
    return Array(m.group(1), dims), i


def _leaves(shape: Array | list) -> Iterator[Array]:
    if isinstance(shape, Array):
        yield shape
    else:
        for elem in shape:
            yield from _leaves(elem)


@dataclasses.dataclass(frozen=True)
class _Instr:
    name: str
    shape: Array | list
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
    operands_end = match_close(stmt, op.end() - 1)
    return _Instr(head.group("name"), shape, op.group("op"), stmt[operands_end + 1 :])


def _may_matter(stmt: str) -> bool:
    """Whether ``stmt`` may be a collective, a ``while``, an ``async-start`` or a call of other computations
    (``_MAY_MATTER``; substring tests, cheaper than one regular expression)."""
    return any(key in stmt for key in _MAY_MATTER)


def _split_hlo(text: str, keep=_may_matter) -> tuple[str, dict[str, list[_Instr]]]:
    """Split HLO text into (module header line, {computation: instructions}); only the instructions whose
    statement passes ``keep`` (default ``_may_matter``) are parsed and listed.

    Instructions spanning several lines (hand-written HLO) are joined until
    their brackets balance.
    """
    header = ""
    comps: dict[str, list[_Instr]] = {}
    current: list[_Instr] | None = None
    pending = ""
    for raw in _COMMENT_RE.sub("", blank_strings(text)).splitlines():
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
        instr = _parse_instruction(pending) if keep(pending) else None
        pending = ""
        if instr is not None:
            current.append(instr)
    return header, comps


def _balance(s: str) -> int:
    return sum(s.count(c) for c in "([{") - sum(s.count(c) for c in ")]}")


# -- call graph / loops -----------------------------------------------------

_CALLEE_ATTRS = (
    "calls",
    "to_apply",
    "body",
    "condition",
    "true_computation",
    "false_computation",
    "branch_computations",
    "called_computations",
)
_CALLEE_ATTR_RE = re.compile(rf"\b(?P<attr>{'|'.join(_CALLEE_ATTRS)})=(?P<val>\{{[^{{}}]*\}}|%?[\w.\-]+)")
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
    graph = {name: {c for ins in instrs for _, c in _callees(ins.attrs)} for name, instrs in comps.items()}
    todo = [
        c
        for instrs in comps.values()
        for ins in instrs
        if ins.opcode == "while"
        for attr, c in _callees(ins.attrs)
        if attr in ("body", "condition")
    ]
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
        return permute_group_size(pairs)
    if m := _MESH_GROUPS_RE.search(attrs):
        # mesh['a'=2,'b'=4] {'b'}: group = product of the named axes' sizes;
        # a sub-axis 'b':(pre)size contributes its own size.
        sizes = {a.group("name"): int(a.group("size")) for a in _MESH_AXIS_RE.finditer(m.group("axes"))}
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
        return all_devices(num_devices, counts, instr.name)
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

# What the collectives need of an instruction: its opcode is a collective, ``while`` or ``async-start``, or it calls
# other computations (the call graph that says which collectives run per loop iteration). ``_split_hlo`` parses
# only the statements holding one of these (the GPT size tiny's step on 8 devices, bf16: 786 of 6,937 instructions);
# a superset of what ``parse_hlo_collectives`` reads, so the result is the same (``tests/test_comm.py``).
_MAY_MATTER = (
    *sorted({opcode.removesuffix("-start") for opcode in _HLO_OPCODES}),
    "while(",
    "async-start(",
    *(f"{attr}=" for attr in _CALLEE_ATTRS),
)


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
    return nbytes, dtype_label(a.dtype for a in leaves)


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
    if not any(f"{opcode}(" in hlo_text for opcode in _HLO_OPCODES):
        # no collective instruction anywhere (one device): nothing to parse, which skips a long scan of the text
        return []
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
            out.append(
                Collective(
                    kind=_HLO_OPCODES[instr.opcode][0],
                    payload_bytes=nbytes,
                    group_size=n,
                    in_loop=comp in in_loop,
                    dtype=dtype,
                    name=async_names.get(comp, instr.name),
                )
            )
    return out


def _async_wrapper_names(comps: dict[str, list[_Instr]]) -> dict[str, str]:
    """{wrapped computation: name of the ``async-start`` that calls it}."""
    return {
        callee: ins.name
        for instrs in comps.values()
        for ins in instrs
        if ins.opcode == "async-start"
        for attr, callee in _callees(ins.attrs)
        if attr == "calls"
    }
