"""What a text corpus's files are, and the advice for those that are not UTF-8 text.

A file is refused in one line when it is not a regular file (a FIFO, a device, a socket, a broken symbolic link, a
link loop: reading one blocks or never ends), when it is binary (an archive, an image: a 64 KiB block where 1% or
more of the bytes are control codes that text in no encoding holds), or when it is text in another encoding (UTF-16
or UTF-32, told by a byte-order mark or NUL bytes between ASCII letters; invalid UTF-8: a single-byte encoding, e.g.
latin1). Only text is offered a conversion, and the conversion never touches the corpus: ``iconv`` writes a UTF-8
copy beside the file (or, where that folder cannot be written, in ``<data.cache_dir>/converted/``) under a name that
does not exist yet, to pass as ``data.path``. A file of a folder or glob corpus: a copy of the folder made of
symbolic links to its files (``cp -rsL``, no text copied), in which the files named are converted or left out.
"""

from __future__ import annotations

import errno
import os
import shlex
import stat
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from core.errors import DataError

GLOB_CHARS = "*?["
BLOCK_BYTES = 1 << 16  # the unit of the binary test: a block with CONTROL_SHARE or more control bytes is not text
CONTROL_SHARE = 0.01
# C0 control codes but tab, line feed, vertical tab, form feed, carriage return and escape: no text encoding uses them
CONTROL = np.zeros(256, bool)
CONTROL[[*range(0, 9), *range(14, 27), *range(28, 32)]] = True
NOT_CONTROL = bytes(i for i in range(256) if not CONTROL[i])  # (bytes.translate deletes these: a fast count)
ASCII = bytes(range(128))
# what a binary file is, by its first bytes (named in the line; the test itself is CONTROL's)
MAGIC = (
    (b"\x1f\x8b", "a gzip file"),
    (b"PK\x03\x04", "a zip archive"),
    (b"\xfd7zXZ\x00", "an xz file"),
    (b"\x28\xb5\x2f\xfd", "a zstd file"),
    (b"BZh", "a bzip2 file"),
    (b"\x89PNG", "a PNG image"),
    (b"\x7fELF", "an executable (ELF)"),
    (b"\x93NUMPY", "a NumPy array"),
)
# Byte-order marks of the encodings a text editor saves besides UTF-8 (UTF-32 first: its LE mark starts as UTF-16's)
BOMS = (
    (b"\xff\xfe\x00\x00", "UTF-32LE"),
    (b"\x00\x00\xfe\xff", "UTF-32BE"),
    (b"\xff\xfe", "UTF-16LE"),
    (b"\xfe\xff", "UTF-16BE"),
)


class TextFault(DataError):
    """A corpus file that is not UTF-8 text: ``why`` follows its name in the line; ``source``: the encoding a UTF-8
    copy is converted from (``guess``: a likely one, said as "e.g."), None: not text, not offered a conversion;
    ``drop``: UTF-8 text with bytes of another encoding, whose copy drops those bytes (``iconv -c``)."""

    def __init__(self, path: Path, why: str, source: Optional[str] = None, guess: bool = False, drop: bool = False):
        super().__init__(f"{path} {why}")
        self.path, self.why, self.source, self.guess, self.drop = Path(path), why, source, guess, drop


def _shell(path: Path | str) -> str:
    """``path`` quoted for a shell, so that an advised command works when pasted."""
    return shlex.quote(str(path))


def _passed(what: str, value: Path | str, glob: bool = False) -> str:
    """``what=value`` as a shell and Hydra read it when pasted: bare when it needs no quotes, else quoted for both
    (``'data.path="my corpus/*.txt"'``)."""
    bare = f"{what}={value}"
    return bare if shlex.quote(bare) == bare and not glob else f"'{what}=\"{value}\"'"


def not_regular(path: Path) -> Optional[str]:
    """What ``path`` is when it is neither a regular file nor a folder (e.g. ``is a FIFO (named pipe), not a
    regular file``, ``is a broken symbolic link (to X)``), else None (a missing path too: the caller says so)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symbolic link loop, not a regular file"
        if os.path.islink(path):
            return f"is a broken symbolic link (to {os.readlink(path)})"
        return None
    for test, name in (
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return f"is {name}, not a regular file"
    return None


def wide_encoding(raw: bytes) -> Optional[str]:
    """``UTF-16LE``/``UTF-16BE``/``UTF-32LE``/``UTF-32BE`` when ``raw`` starts with that byte-order mark, or, with
    no mark, when a quarter or more of its first 64 KiB are NUL bytes and the others sit at one offset modulo 4
    (UTF-32) or 2 (UTF-16), as ASCII letters do in those encodings; else None. UTF-8 text holds no NUL bytes."""
    for bom, name in BOMS:
        if raw.startswith(bom):
            return name
    head = np.frombuffer(raw[:BLOCK_BYTES], np.uint8)
    if len(head) < 4 or int((head == 0).sum()) < len(head) // 4:
        return None
    offsets = np.flatnonzero(head)
    for width, names in ((4, ("UTF-32LE", None, None, "UTF-32BE")), (2, ("UTF-16LE", "UTF-16BE"))):
        share = np.bincount(offsets % width, minlength=width) / max(1, len(offsets))
        at = int(share.argmax())
        if share[at] >= 0.9 and names[at]:
            return names[at]
    return None


def control_block(raw: bytes, offset: int = 0) -> Optional[tuple[int, int, int]]:
    """The first block of ``BLOCK_BYTES`` (``raw`` read from byte ``offset`` of its file) with ``CONTROL_SHARE`` or
    more control bytes: (its offset in the file, its control bytes, its bytes); None when there is none."""
    least = max(1, CONTROL_SHARE * min(len(raw), BLOCK_BYTES))  # (a short last block needs a whole block's count)
    if len(raw.translate(None, NOT_CONTROL)) < least:  # text: no block can hold that many
        return None
    b = np.frombuffer(raw, np.uint8)
    starts = np.arange(0, len(b), BLOCK_BYTES)
    counts = np.add.reduceat(CONTROL[b].astype(np.int32), starts)
    sizes = np.diff(np.append(starts, len(b)))
    bad = np.flatnonzero(counts >= least)
    if not len(bad):
        return None
    i = int(bad[0])
    return offset + int(starts[i]), int(counts[i]), int(sizes[i])


def _utf16_without_mark(raw: bytes) -> Optional[str]:
    """``UTF-16LE`` or ``UTF-16BE`` when the first 64 KiB of ``raw`` decode in it to 95% or more printable
    characters (text of a script whose code units are not NUL-padded ASCII, e.g. CJK), else None."""
    head = raw[: BLOCK_BYTES & ~1]
    for name in ("UTF-16LE", "UTF-16BE"):
        try:
            text = head.decode(name.lower())
        except UnicodeDecodeError as e:  # a character cut at the block's end is no evidence against it
            if e.start < len(head) - 4:
                continue
            text = head[: e.start].decode(name.lower())
        if text and sum(c.isprintable() or c in "\t\n\r" for c in text) >= 0.95 * len(text):
            return name
    return None


def binary_fault(path: Path, raw: bytes, found: tuple[int, int, int]) -> TextFault:
    """``path`` refused as binary (``raw``: its first bytes; ``found``: ``control_block``'s answer)."""
    kind = next((name for magic, name in MAGIC if raw.startswith(magic)), None)
    at, count, size = found
    detail = f"{kind}; " if kind else ""
    return TextFault(
        path,
        f"is binary, not text ({detail}{count} of its {size} bytes from byte {at} are control codes, which text in no "
        f"encoding holds)",
    )


def head_fault(path: Path, raw: bytes) -> Optional[TextFault]:
    """What is wrong with the file ``path`` whose first bytes are ``raw``, or None when they may be UTF-8 text:
    UTF-16/UTF-32 text (a byte-order mark, NUL bytes between ASCII letters, or UTF-16 of another script) is to be
    converted from that encoding; binary bytes (``control_block``) are not text."""
    wide = wide_encoding(raw)
    if wide is not None:
        # with a byte-order mark iconv's UTF-16 / UTF-32 read it (and drop it); without one, name the byte order
        source = wide[:6] if raw.startswith(tuple(bom for bom, _ in BOMS)) else wide
        return TextFault(path, f"is {wide} text, not UTF-8 (read as UTF-8 it would train on NUL bytes)", source)
    found = control_block(raw)
    if found is None:
        return None
    utf16 = _utf16_without_mark(raw)
    if utf16 is not None:
        return TextFault(path, f"is {utf16} text without a byte-order mark, not UTF-8", utf16)
    return binary_fault(path, raw, found)


def undecodable_fault(path: Path, at: int, reason: str, chunk_bytes: int = 1 << 24) -> TextFault:
    """``path`` is not UTF-8 at byte ``at``: binary when a block of it holds control codes (``control_block``; the
    whole file is read, an error's cost only); UTF-8 text with bytes of another encoding when multi-byte UTF-8
    characters come before ``at`` (a whole-file conversion would garble them: their bytes are dropped into a copy);
    else text in another encoding (a conversion from e.g. latin1)."""
    lines, multibyte = 1, False  # of the bytes before ``at`` (valid UTF-8: the decoder read them)
    try:
        with open(path, "rb") as fh:
            head, offset = fh.read(chunk_bytes), 0
            raw = head
            while raw:
                found = control_block(raw, offset)
                if found is not None:
                    return binary_fault(path, head, found)
                before = raw[: max(0, at - offset)]
                lines += before.count(b"\n")
                multibyte = multibyte or len(before.translate(None, ASCII)) > 0
                offset += len(raw)
                raw = fh.read(chunk_bytes)
    except OSError:
        pass
    if multibyte:
        return TextFault(
            path,
            f"mixes encodings: UTF-8 text with characters of more than one byte, then at byte {at} (line {lines}) a "
            f"byte that is not UTF-8 ({reason}), so no one encoding reads it all (a conversion of the whole file from "
            f"latin1 would garble its UTF-8 characters)",
            "UTF-8",
            drop=True,
        )
    return TextFault(path, f"is not UTF-8 (byte {at}: {reason})", "latin1", guess=True)


def _free(path: Path) -> Path:
    """``path``, or ``<stem>-2<suffix>``, ``-3``...: the first that does not exist (a copy overwrites nothing)."""
    out, n = path, 1
    while os.path.lexists(out):
        n += 1
        out = path.with_name(f"{path.stem}-{n}{path.suffix}")
    return out


def copy_place(original: Path, name: str, cache_dir: Optional[str]) -> tuple[Path, str]:
    """(where a converted copy of ``original``, a file or folder, is advised to go, the command that makes its
    folder first or ""): ``name`` beside the original when that folder can be written, else in
    ``<cache_dir>/converted/``; never an existing path (``_free``)."""
    parent, mkdir = original.absolute().parent, ""
    if not os.access(parent, os.W_OK) and cache_dir:
        parent = Path(cache_dir).expanduser().absolute() / "converted"
        mkdir = f"mkdir -p {_shell(parent)} && "
    return _free(parent / name), mkdir


def _convert_how(fault: TextFault) -> str:
    if fault.drop:
        return "fix or remove that line, or drop the file's bytes that are not UTF-8"
    return f"convert it from its encoding, e.g. {fault.source}," if fault.guess else "convert it"


def _iconv(fault: TextFault, out: Path) -> str:
    """The command writing the UTF-8 copy ``out`` of ``fault``'s file (``-c``: its bytes that are not UTF-8 dropped)."""
    drop = " -c" if fault.drop else ""
    return f"iconv -f {fault.source} -t UTF-8{drop} {_shell(fault.path)} > {_shell(out)}"


def fault_line(fault: TextFault, what: str, cache_dir: Optional[str]) -> str:
    """The one-line error for a corpus of one file (``what``: its setting, e.g. ``data.path``): a conversion into a
    UTF-8 copy (``copy_place``) to pass instead, or, for a file that is not text, what to give."""
    path = fault.path
    if fault.source is None:
        return f"{what}={path} {fault.why}; give a UTF-8 text file"
    out, mkdir = copy_place(path, f"{path.stem}.utf8.txt", cache_dir)
    return (
        f"{what}={path} {fault.why}; {_convert_how(fault).rstrip(',')}: {mkdir}{_iconv(fault, out)}, then pass "
        f"{_passed(what, out)}"
    )


def glob_base(corpus: str) -> tuple[Path, str]:
    """(the folder a folder or glob corpus lies in, the glob below it or ""): ``a/b/*.txt`` -> (``a/b``, ``*.txt``)."""
    parts = Path(corpus).expanduser().parts
    n = next((i for i, part in enumerate(parts) if any(c in part for c in GLOB_CHARS)), len(parts))
    return Path(*parts[:n]), "/".join(parts[n:])


def _has_loop(folder: Path) -> bool:
    """Whether a linked folder below ``folder`` leads back to a folder above it (``cp -L`` refuses to copy it)."""
    for root, dirs, _ in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        for d in list(dirs):
            target = os.path.realpath(os.path.join(root, d))
            if os.path.islink(os.path.join(root, d)) and (real + os.sep).startswith(target + os.sep):
                return True
    return False


def corpus_fault_line(
    faults: Sequence[TextFault], corpus: str, cache_dir: Optional[str], files: Optional[int] = None
) -> str:
    """The one-line error for files of a folder or glob corpus that are not UTF-8 text (every one, found in one
    reading): a copy of the corpus's folder made of symbolic links (``cp -rsL``: nothing in the corpus changes, no
    text is copied; ``chmod -R u+w``: its folders writable, a read-only corpus's too) in which those files are
    converted (text in another encoding) or left out (not text), to pass as ``data.path``. When all ``files`` of the
    corpus are refused and none is text, there is nothing to copy: the line says the corpus holds no text."""
    if files is not None and len(faults) >= files and not any(f.source for f in faults):
        named = "; ".join(f"{f.path} {f.why}" for f in faults[:3])
        more = f"; and {len(faults) - 3} more" if len(faults) > 3 else ""
        return (
            f"data.path={corpus} holds no text: none of its {len(faults)} file{'s' if len(faults) != 1 else ''} is "
            f"text ({named}{more}); give a UTF-8 text file, a folder of them or a glob"
        )
    base, rest = glob_base(corpus)
    copy, mkdir = copy_place(base, f"{base.absolute().name}.utf8", cache_dir)
    rel = [f.path.absolute().relative_to(base.absolute()) for f in faults]
    # -L: linked folders become folders of the copy (rm and iconv must not reach through a link into the corpus); a
    # link loop or a broken link makes cp say so and fail after copying the rest, which is all there is to copy
    cp = f"cp -rsL {_shell(base.absolute())} {_shell(copy)}"
    broken = any(f.why.startswith(("is a broken symbolic link", "is a symbolic link loop")) for f in faults)
    cp = f"{{ {cp} || test -d {_shell(copy)}; }}" if broken or _has_loop(base) else cp
    # cp -r gives the copy's folders the corpus's modes: a read-only corpus's copy must be made writable (chmod -R
    # skips the links it meets, so the corpus's files keep their modes)
    steps = [f"{mkdir}{cp}", f"chmod -R u+w {_shell(copy)}", "rm -f " + " ".join(_shell(copy / r) for r in rel)]
    steps += [_iconv(f, copy / r) for f, r in zip(faults, rel) if f.source]
    passed = _passed("data.path", copy / rest if rest else copy, glob=bool(rest))
    folder = "a copy of the folder made of links to its files (the corpus stays as it is)"
    if len(faults) == 1:
        f = faults[0]
        said = f"{f.path} in data.path={corpus} {f.why}"
        how = f"{_convert_how(f)} in {folder}" if f.source else f"leave it out of {folder}"
    else:
        named = "; ".join(f"{f.path} {f.why}" for f in faults[:3])
        more = f"; and {len(faults) - 3} more" if len(faults) > 3 else ""
        said = f"{len(faults)} files in data.path={corpus} are not UTF-8 text ({named}{more})"
        ways = ["convert them (text in another encoding, e.g. latin1)"] * any(f.source and not f.drop for f in faults)
        ways += ["drop the bytes that are not UTF-8 (text of mixed encodings)"] * any(f.drop for f in faults)
        ways += ["leave them out (not text)"] * any(not f.source for f in faults)
        how = f"{' or '.join(ways)} in {folder}"
    return f"{said}; {how}: {' && '.join(steps)}, then pass {passed}"
