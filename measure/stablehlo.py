"""Collectives of a lowered module, from its StableHLO MLIR text (``jitted.lower(...).as_text()``).

Payload sizes and the ring model: ``measure.collectives``. GSPMD (``jit`` with shardings) inserts its
collectives only at compile time, so a lowered module shows only the explicit ones (``shard_map``, ``pmap``).
"""

from __future__ import annotations

import re

from measure.collectives import Array, Collective, all_devices, dtype_label, parse_dim, permute_group_size
from measure.text_scan import blank_strings_keep_len, match_close, skip_whitespace, statement_end

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


def _mlir_tensors(type_text: str) -> list[Array]:
    out = []
    for m in _MLIR_TENSOR_RE.finditer(type_text):
        body = _MLIR_TENSOR_BODY_RE.match(m.group("body").strip())
        if body is None:
            raise ValueError(f"cannot parse tensor type {m.group(0)!r}")
        dims = tuple(parse_dim(d) for d in body.group("dims").split("x") if d)
        out.append(Array(_mlir_dtype(body.group("elem")), dims))
    return out


def _mlir_signature(stmt: str) -> tuple[list[Array], list[Array]]:
    """(operand types, result types) from an op's trailing ``: (ins) -> outs``."""
    depth, colon, arrow = 0, -1, -1
    for i, ch in enumerate(stmt):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and ch == ":" and stmt[i - 1 : i] == " ":
            colon, arrow = i, -1
        elif depth == 0 and colon >= 0 and stmt.startswith("->", i):
            arrow = i
    if colon < 0:
        raise ValueError(f"no type signature in {stmt[:80]!r}")
    if arrow < 0:
        types = _mlir_tensors(stmt[colon + 1 :])
        return types, types
    return _mlir_tensors(stmt[colon + 1 : arrow]), _mlir_tensors(stmt[arrow + 2 :])


def _mlir_while_span(text: str, m: re.Match) -> tuple[int, int]:
    """Character span covering a while op and its cond/body regions."""
    args_end = match_close(text, text.index("(", m.end()))
    # Pretty form: `stablehlo.while(...) : types` NEWLINE `cond { } do { }`.
    line_end = text.find("\n", args_end)
    line_end = len(text) if line_end < 0 else line_end
    cond = re.compile(r"\s*cond\s*\{").match(text, line_end)
    if cond:
        cond_end = match_close(text, cond.end() - 1)
        body = re.compile(r"\s*do\s*\{").match(text, cond_end + 1)
        if not body:
            raise ValueError("stablehlo.while: 'cond' region without 'do' region")
        return m.start(), match_close(text, body.end() - 1)
    # Generic form: `"stablehlo.while"(...) [attrs] ({cond}, {body}) : ...`.
    i = skip_whitespace(text, args_end + 1)
    if text.startswith("<{", i):
        i = skip_whitespace(text, match_close(text, i + 1) + 2)
    elif text.startswith("{", i):
        i = skip_whitespace(text, match_close(text, i) + 1)
    if not text.startswith("(", i):
        raise ValueError(f"stablehlo.while without regions near {text[m.start() : m.start() + 80]!r}")
    return m.start(), match_close(text, i)


def _mlir_loop_spans(text: str) -> list[tuple[int, int]]:
    """Spans that execute per loop iteration: while regions, plus whole
    bodies of functions called (transitively) from inside one."""
    spans = [_mlir_while_span(text, m) for m in _MLIR_WHILE_RE.finditer(text)]
    funcs = {
        m.group("name"): (m.start(), match_close(text, text.rindex("{", m.start(), m.end())))
        for m in _MLIR_FUNC_RE.finditer(blank_strings_keep_len(text))
    }
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


def _inside(pos: int, spans: list[tuple[int, int]]) -> bool:
    return any(a <= pos <= b for a, b in spans)


def _mlir_enclosing_func(text: str, pos: int) -> str:
    name = "module"
    for m in _MLIR_FUNC_RE.finditer(text, 0, pos):
        name = m.group("name")
    return name


def _mlir_group_size(stmt: str, kind: str, name: str, num_devices: int | None, counts: list[int]) -> int:
    if kind == "collective-permute":
        m = _MLIR_PAIRS_RE.search(stmt)
        if not m:
            return 0
        vals = [int(v) for v in _INT_RE.findall(m.group("val"))]
        n_pairs = int(m.group("shape").split("x")[0] or 0)
        if len(vals) == 1:  # splat: every pair is (v, v)
            vals = vals * 2 * n_pairs
        return permute_group_size(list(zip(vals[::2], vals[1::2])))
    m = _MLIR_GROUPS_RE.search(stmt)
    dims = [int(d) for d in m.group("shape").split("x")] if m else []
    if len(dims) == 2 and dims[0] * dims[1] > 0:
        return dims[1]
    return all_devices(num_devices, counts, name)


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
        stmt = mlir_text[m.start() : statement_end(mlir_text, m.end())]
        name = f"{_mlir_enclosing_func(mlir_text, m.start())}/{m.group('res')}"
        n = _mlir_group_size(stmt, kind, name, num_devices, counts)
        if n <= 1:
            continue
        operands, results = _mlir_signature(stmt)
        payload = results if kind == "all-gather" else operands
        out.append(
            Collective(
                kind=kind,
                payload_bytes=sum(a.nbytes for a in payload),
                group_size=n,
                in_loop=_inside(m.start(), spans),
                dtype=dtype_label(a.dtype for a in payload),
                name=name,
            )
        )
    return out


def lowered_payload_bytes(mlir_text: str, num_devices: int | None = None) -> int:
    """Sum of S over the collectives of a lowered (StableHLO) module."""
    return sum(c.payload_bytes for c in parse_stablehlo_collectives(mlir_text, num_devices))
