"""The one bracket scanner shared by the HLO text and StableHLO text parsers (``measure.hlo_text``,
``measure.stablehlo``): string literals are skipped, only ``()[]{}`` are tracked (``<>`` cannot be, because of
``->``)."""

from __future__ import annotations

import re

STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')
_WS_RE = re.compile(r"\s*")


def skip_whitespace(text: str, i: int) -> int:
    """The index of the first non-whitespace character of ``text`` at or after ``i`` (``len(text)`` if none)."""
    m = _WS_RE.match(text, i)
    return m.end() if m else i  # r"\s*" matches (possibly empty) at every position: m is never None


def blank_strings(text: str) -> str:
    """Replace every string literal by ``""`` (metadata may contain anything)."""
    return STRING_RE.sub('""', text)


def blank_strings_keep_len(text: str) -> str:
    """Replace the contents of every string literal by spaces (offsets stay valid)."""
    return STRING_RE.sub(lambda m: '"' + " " * (len(m.group(0)) - 2) + '"', text)


def scan_brackets(text: str, i: int, *, stop_at_newline: bool = False) -> int:
    """Scans ``text`` from ``i`` and returns the index where the scan stops.

    Default: ``text[i]`` is an opening bracket; returns the index of the bracket that closes it (raises
    ValueError when there is none). ``stop_at_newline``: returns the first newline outside brackets (the end of
    the statement starting at ``i``), or ``len(text)``.
    """
    depth = 0
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == '"':
            m = STRING_RE.match(text, i)
            i = m.end() if m else n
            continue
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0 and not stop_at_newline:
                return i
        elif ch == "\n" and stop_at_newline and depth <= 0:
            return i
        i += 1
    if stop_at_newline:
        return n
    raise ValueError(f"unbalanced bracket at offset {i} near {text[i : i + 40]!r}")


def match_close(text: str, i: int) -> int:
    """Index of the bracket closing the one at ``text[i]`` (``scan_brackets``)."""
    return scan_brackets(text, i)


def statement_end(text: str, i: int) -> int:
    """End of the statement starting at ``i``: the first newline outside brackets (``scan_brackets``)."""
    return scan_brackets(text, i, stop_at_newline=True)
