"""Text for the language model: tokens (``data.tokens``), random training windows, every validation window once.

Tokens are the bytes of UTF-8 text (vocabulary 256; nothing to download or train), or a byte-level BPE's
(``data.tokenizer=bpe``, ``data.tokenizer_file``; ``data.tokens``). A batch uses the same keys
as the image data (``core.layout``), so every parallel mode, accumulation and the checkpoints handle it
unchanged: ``image`` = input tokens int32 ``[B, T]``, ``label`` = the next tokens int32 ``[B, T]`` (the window
shifted by one), ``index`` int32 ``[B]`` and, for evaluation, ``mask``.

Training (``WindowSource``): the global batch of step ``s`` is ``B`` windows of ``T + 1`` tokens whose start
offsets are drawn from ``numpy.random.default_rng([seed, s])`` (uniform over every offset of the train split),
row ``i`` of the global batch being global example ``s * B + i``. A batch is a pure function of (seed, step,
row): the same for any device or process count, and a resumed run continues the same sequence from its step
with no iterator state to save. Evaluation: the validation split cut into ``floor((N - 1) / T)``
non-overlapping windows, each counted once (a ``HostDataset`` padded and masked like MNIST's test split).

Data sets:
- ``tiny_shakespeare``: the corpus TFDS ``tiny_shakespeare`` downloads (char-rnn's ``input.txt``, 1,115,394
  bytes, md5 ``6fb458f1232090904fb40fe944165e91``), split as TFDS does: train = the first ``int(0.9 n)``
  characters, validation = the next ``int(0.5 (n - int(0.9 n)))``, test = the rest (1,003,854 / 55,770 /
  55,770). Read from ``data.path``, else from ``../shared/data/tiny_shakespeare/input.txt`` beside the
  repository, else from ``<data.cache_dir>/tiny_shakespeare/input.txt``, else downloaded there (with
  ``data.download``) and checked against the md5.
- ``text``: any UTF-8 text (``data.path``: a file, a folder (every file in it and below, sorted by path, hidden
  ones skipped) or a glob), the files' texts concatenated in that order and split 90/10 by characters (train /
  validation; nanoGPT's split). Its tokens are written once into a token file per split (uint16 when the
  vocabulary fits, else uint32), in ``<data.cache_dir>/text/<key>/`` (the key: the files' sizes and SHA-256, the
  tokenizer and the split), atomically (a temporary folder renamed), as nanoGPT's ``prepare.py`` does; training
  reads its windows from the memory-mapped file, so a corpus larger than memory trains, reading only its windows.
  The batches are those of the same tokens in memory (``WindowSource`` indexes either the same way).
- ``synthetic`` with the GPT: uniform random tokens below ``vocab_size`` (``data.train_size`` and
  ``data.eval_size`` tokens).
"""

from __future__ import annotations

import codecs
import dataclasses
import glob as globlib
import hashlib
import json
import logging
import os
import shutil
import socket
import urllib.request
import weakref
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Union

import numpy as np

from core.errors import DataError
from core.layout import Batch
from data.sources import HostDataset
from data.textfiles import (
    GLOB_CHARS,
    TextFault,
    corpus_fault_line,
    fault_line,
    head_fault,
    not_regular,
    undecodable_fault,
)
from data.tokens import ByteTokenizer, HFTokenizer, cached_bpe, load_tokenizer_file, text_pieces

log = logging.getLogger(__name__)

VOCAB_BYTES = 256
TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TINY_SHAKESPEARE_MD5 = "6fb458f1232090904fb40fe944165e91"
SHARED_TINY_SHAKESPEARE = Path(__file__).resolve().parent.parent.parent / "shared/data/tiny_shakespeare/input.txt"


class WindowSource:
    """Training windows of ``context + 1`` tokens at random offsets of ``tokens``: step -> this process's rows.

    ``steps_per_epoch``: ``len(tokens) // (global_batch * context)`` (at least 1): the steps that see as many
    target tokens as the split holds (windows are drawn with replacement, so an "epoch" is a unit of length).

    ``fingerprint``: what the tokens were read from (``file_fingerprint``), recorded with the checkpoints.

    Raises:
      ValueError: the split is not longer than one window.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        context: int,
        global_batch: int,
        seed: int,
        with_index: bool = True,
        fingerprint: Optional[dict] = None,
    ):
        if len(tokens) <= context:
            raise ValueError(f"the train split has {len(tokens)} tokens, not more than one window of {context}")
        self.tokens, self.context, self.global_batch, self.seed = tokens, context, global_batch, seed
        self.with_index = with_index
        self.fingerprint = fingerprint  # what the tokens were read from (file_fingerprint); None: random tokens
        self.tokenizer = None  # the tokenizer the tokens come from (data.tokens), when known; None: bytes
        self.steps_per_epoch = max(1, len(tokens) // (global_batch * context))
        self._offsets = np.arange(context + 1)

    def global_starts(self, step: int) -> np.ndarray:
        """Start offsets of the global batch of ``step``: int64 ``[global_batch]`` in ``[0, N - T - 1]``."""
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - self.context, size=self.global_batch)

    def global_indices(self, step: int) -> np.ndarray:
        """Global example indices of ``step``: int32 ``[global_batch]``, ``step * B + row`` (mod 2^31)."""
        return ((step * self.global_batch + np.arange(self.global_batch)) % 2**31).astype(np.int32)

    def local_batch(self, step: int, rows: slice) -> Batch:
        # int32 whatever the tokens' dtype (a memory-mapped token file holds uint16 or uint32)
        check_mapped_size(self.tokens)
        windows = np.asarray(self.tokens[self.global_starts(step)[rows, None] + self._offsets], np.int32)
        if self.tokenizer is not None:
            check_window_ids(self.tokens, windows, self.tokenizer.vocab_size)
        batch = {"image": windows[:, :-1], "label": windows[:, 1:]}
        if self.with_index:
            batch["index"] = self.global_indices(step)[rows]
        return batch


@dataclasses.dataclass(frozen=True)
class TextEvalSet(HostDataset):
    """Validation windows (``eval_windows``) and the bytes their target tokens stand for per token
    (``bytes_per_token``: ``eval/bpb`` = ``eval/loss`` / ln 2 / ``bytes_per_token``)."""

    bytes_per_token: float = 1.0


def eval_windows(
    tokens: np.ndarray, context: int, max_windows: Optional[int] = None, token_bytes: Optional[np.ndarray] = None
) -> TextEvalSet:
    """Every non-overlapping window of ``tokens`` (or the first ``max_windows``): ``images`` int32 ``[W, T]``
    (window ``w`` = tokens ``[wT, wT + T)``), ``labels`` int32 ``[W, T]`` (the same shifted by one), ``W = (N - 1)
    // T``; each target token ``1 .. W*T`` is counted once. ``token_bytes``: the bytes of each token id
    (``Tokenizer.token_bytes``; None: one per token), for ``bytes_per_token`` of the evaluated targets.

    Raises:
      ValueError: fewer than ``context + 1`` tokens.
    """
    n = (len(tokens) - 1) // context
    if n < 1:
        raise ValueError(f"the split has {len(tokens)} tokens, fewer than one window of {context} + 1")
    n = n if max_windows is None else min(n, max_windows)
    x = np.asarray(tokens[: n * context + 1], np.int32)  # (read into memory: a token file's slice)
    labels = x[1:].reshape(n, context)
    per_token = 1.0 if token_bytes is None else float(token_bytes[labels].sum()) / labels.size
    return TextEvalSet(images=x[:-1].reshape(n, context), labels=labels, bytes_per_token=per_token)


def byte_tokens(text: str) -> np.ndarray:
    """int32 ``[N]``: the UTF-8 bytes of ``text``."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)


def file_fingerprint(path: Path, raw: bytes) -> dict:
    """What a run trained on, recorded with its checkpoints: ``{"kind": "file", "file": absolute path, "bytes":
    size, "blake2b": hex digest (16 bytes) of the contents}``. Two files with the same size and digest hold the
    same text, wherever they are."""
    digest = hashlib.blake2b(raw, digest_size=16).hexdigest()
    return {"kind": "file", "file": str(Path(path).absolute()), "bytes": len(raw), "blake2b": digest}


def read_text_file(path: Path, what: str, cache_dir: Optional[str] = None) -> tuple[str, dict]:
    """The text of ``path`` (``~`` expanded) and its ``file_fingerprint``.

    Raises:
      DataError (one line): missing, unreadable, not a regular file, empty, binary, or text in another encoding
        (with the ``iconv`` command that writes a UTF-8 copy outside the corpus, ``data.textfiles``).
    """
    path = Path(path).expanduser()
    kind = not_regular(path)
    if kind:
        raise DataError(f"{what}={path} {kind}; give a UTF-8 text file")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{what}={path} cannot be read ({type(e).__name__}: {e.strerror or e}); give a readable file")
    if not raw:
        raise DataError(f"{what}={path} is empty; give a UTF-8 text file with at least one window of text")
    fault = head_fault(path, raw)
    if fault is None:
        try:
            return raw.decode("utf-8"), file_fingerprint(path, raw)
        except UnicodeDecodeError as e:
            fault = undecodable_fault(path, e.start, e.reason)
    raise DataError(fault_line(fault, what, cache_dir))


def read_utf8(path: Path, what: str, cache_dir: Optional[str] = None) -> str:
    """The text of ``path``. Raises DataError (one line): missing, unreadable, empty or not UTF-8
    (``read_text_file``)."""
    return read_text_file(path, what, cache_dir)[0]


def tfds_splits(text: str) -> tuple[str, str, str]:
    """(train, validation, test) as TFDS ``tiny_shakespeare`` cuts them (by characters: 90% / 5% / 5%)."""
    i = int(len(text) * 0.9)
    train, rest = text[:i], text[i:]
    j = int(len(rest) * 0.5)
    return train, rest[:j], rest[j:]


def split_90_10(text: str) -> tuple[str, str]:
    """(train, validation): the first ``int(0.9 n)`` characters and the rest."""
    i = int(len(text) * 0.9)
    return text[:i], text[i:]


def _md5(path: Path) -> str:
    return hashlib.md5(Path(path).read_bytes()).hexdigest()


def tiny_shakespeare_path(path: Optional[str], cache_dir: str, download: bool, timeout_s: float = 10.0) -> Path:
    """The Tiny Shakespeare file (see the module docstring for the search order); downloads it into the cache
    when nowhere else. Raises DataError (one line) when it cannot be found or downloaded, or the download's md5
    differs."""
    if path:
        return Path(path)
    if SHARED_TINY_SHAKESPEARE.exists():
        return SHARED_TINY_SHAKESPEARE
    cached = Path(cache_dir) / "tiny_shakespeare" / "input.txt"
    if cached.exists():
        return cached
    if not download:
        raise DataError(
            f"tiny_shakespeare is not at {SHARED_TINY_SHAKESPEARE} nor {cached} and data.download=false; "
            f"set data.path to a copy of {TINY_SHAKESPEARE_URL} or data.download=true"
        )
    try:
        socket.create_connection(("raw.githubusercontent.com", 443), timeout=timeout_s).close()
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f"input.txt.tmp{os.getpid()}")
        urllib.request.urlretrieve(TINY_SHAKESPEARE_URL, tmp)
        if _md5(tmp) != TINY_SHAKESPEARE_MD5:
            tmp.unlink()
            raise DataError(f"the download of {TINY_SHAKESPEARE_URL} has another md5 than {TINY_SHAKESPEARE_MD5}")
        os.replace(tmp, cached)
        log.info("downloaded tiny_shakespeare to %s", cached)
        return cached
    except DataError:
        raise
    except Exception as e:
        raise DataError(
            f"tiny_shakespeare could not be downloaded from {TINY_SHAKESPEARE_URL} ({type(e).__name__}: {e}); "
            f"set data.path to a copy of it, or run with data=synthetic"
        ) from None


Tokenizer = Union[ByteTokenizer, HFTokenizer]


def load_text_splits(
    name: str, path: Optional[str], cache_dir: str, download: bool, tokenizer: Optional[Tokenizer] = None
) -> tuple[np.ndarray, np.ndarray]:
    """(train tokens, validation tokens), int32, of ``data=tiny_shakespeare`` or ``data=text`` held in memory
    (``tokenizer``: None = bytes; the text encoded in ``data.tokens.text_pieces``). ``data=text`` trains from a
    token file (``text_token_files``) holding exactly these tokens.

    Raises:
      DataError (one line): the file is missing, unreadable, empty or not UTF-8 (``data=text`` without
        ``data.path`` too).
    """
    tokenizer = tokenizer or ByteTokenizer()
    if name == "tiny_shakespeare":
        file = tiny_shakespeare_path(path and os.path.expanduser(path), cache_dir, download)
        train, validation, _ = tfds_splits(read_utf8(file, "data.path", cache_dir))
    else:
        files = corpus_files(path)
        try:
            text = "".join(_text_chunks(files))
        except TextFault as e:
            raise DataError(_fault_line([e], files, path, cache_dir)) from None
        if not text:
            raise DataError(f"data.path={path} is empty; give a UTF-8 text file with at least one window of text")
        train, validation = split_90_10(text)
    return tokenizer.encode(train), tokenizer.encode(validation)


# ---- any corpus: files, token files --------------------------------------------------------------------------
CHUNK_BYTES = 1 << 24  # bytes read (and decoded) at a time
# token files up to this size are read whole when a run starts, for ids outside the vocabulary (0.01 s cached); a
# larger corpus's windows are checked as each batch is read (``check_window_ids``)
FULL_CHECK_BYTES = 1 << 28
TOKEN_FILES_FORMAT = 1
SPLITS = ("train", "validation")
# a tokenizer suited to its text maps far fewer of its tokens to the unknown token: from this share on, a warning
UNKNOWN_SHARE = 0.01
WHITESPACE = b" \t\n\r\x0b\x0c"  # not compared in the dropped share (``_byte_table``)


def corpus_files(path: Optional[str]) -> list[Path]:
    """The files of ``data.path``: a file; a folder: every entry in it and below that is not a folder, sorted by path,
    names starting with ``.`` skipped (at any depth); a glob (``*``, ``?``, ``[``; ``**`` recursive): the entries it
    matches that are not folders, sorted. An entry that is not a regular file (a FIFO, a broken link) is listed, for
    the reading to refuse it with the others that are not text (``corpus_fingerprint``).

    Raises:
      DataError (one line): no path, nothing there, not a regular file or folder, or no file in the folder / matching
        the glob.
    """
    if not path:
        raise DataError("data=text needs data.path=FILE (a UTF-8 text file, a folder of them or a glob)")
    p = Path(path).expanduser()
    if any(c in str(path) for c in GLOB_CHARS) and not os.path.lexists(p):
        files = _once(sorted(Path(f) for f in globlib.glob(str(p), recursive=True) if not Path(f).is_dir()))
        if not files:
            raise DataError(f"data.path={path} matches no file; check the pattern (quoted for the shell)")
        return files
    if p.is_dir():
        files = _once(sorted(_walk(p)))
        if not files:
            raise DataError(f"data.path={path} is a folder without files; give a folder of UTF-8 text files")
        return files
    kind = not_regular(p)
    if kind:
        raise DataError(f"data.path={path} {kind}; give a UTF-8 text file, a folder of them or a glob")
    if not p.exists():
        raise DataError(
            f"data.path={path} cannot be read (FileNotFoundError: No such file or directory); give a readable file"
        )
    return [p]


def _walk(folder: Path) -> Iterator[Path]:
    """The entries below ``folder`` that are not folders, names starting with ``.`` skipped; linked folders are
    followed, each real folder once (a link loop ends there)."""
    seen: set[str] = set()
    for root, dirs, names in os.walk(folder, followlinks=True):
        seen.add(os.path.realpath(root))
        dirs[:] = [d for d in dirs if not d.startswith(".") and os.path.realpath(os.path.join(root, d)) not in seen]
        seen.update(os.path.realpath(os.path.join(root, d)) for d in dirs)
        yield from (Path(root) / n for n in names if not n.startswith("."))


def _once(files: list[Path]) -> list[Path]:
    """``files`` (sorted) without a second path to the same file (through a link, or a glob's ``**`` through a link
    loop; the shortest path of each kept): its text would be counted twice, in both splits maybe."""
    best: dict[str, Path] = {}
    for f in sorted(files, key=lambda f: (len(f.parts), f)):
        best.setdefault(os.path.realpath(f), f)
    return sorted(best.values())


def _text_chunks(files: list[Path], chunk_bytes: int = CHUNK_BYTES) -> Iterator[str]:
    """The files' texts, in order, in decoded chunks of about ``chunk_bytes`` bytes.

    Raises:
      TextFault: a file that is not a regular file, binary, or not UTF-8 (``data.textfiles``; the caller words it).
      DataError (one line): a file that cannot be read.
    """
    for f in files:
        kind = not_regular(f)
        if kind:
            raise TextFault(f, kind)
        decoder = codecs.getincrementaldecoder("utf-8")("strict")
        offset = 0
        try:
            with open(f, "rb") as fh:
                while True:
                    raw = fh.read(chunk_bytes)
                    if offset == 0 and raw:
                        fault = head_fault(f, raw)
                        if fault is not None:
                            raise fault
                    pending = len(decoder.getstate()[0])  # bytes of a character the last chunk cut short
                    try:
                        text = decoder.decode(raw, final=not raw)
                    except UnicodeDecodeError as e:
                        raise undecodable_fault(f, offset - pending + e.start, e.reason) from None
                    if text:
                        yield text
                    if not raw:
                        break
                    offset += len(raw)
        except OSError as e:
            raise DataError(
                f"data.path={f} cannot be read ({type(e).__name__}: {e.strerror or e}); give a readable file"
            )


def _fault_line(faults: list[TextFault], files: list[Path], path: Optional[str], cache_dir: Optional[str]) -> str:
    """The line for files of ``data.path`` that are not UTF-8 text: of one file given itself, or of a folder / glob."""
    if len(files) == 1 and path is not None and Path(path).expanduser().absolute() == files[0].absolute():
        return fault_line(faults[0], "data.path", cache_dir)
    return corpus_fault_line(faults, str(path), cache_dir, len(files))


def corpus_fingerprint(
    files: list[Path], path: Optional[str] = None, cache_dir: Optional[str] = None
) -> tuple[str, int, dict]:
    """(fingerprint, characters, record): the SHA-256 of the files' sizes and contents in order (the token files'
    key), the characters of their concatenated text, and what the checkpoints record (``file_fingerprint``'s keys:
    ``file`` the one file, else ``path``; the bytes and blake2b of the concatenated files). Every file is read once.

    Raises:
      DataError (one line): files that are not UTF-8 text, every one named (the reading goes on after the first to
        find them all: one copy of the corpus fixes them, ``data.textfiles.corpus_fault_line``); a file that
        cannot be read.
    """
    h = hashlib.sha256()
    whole = hashlib.blake2b(digest_size=16)
    chars = total = 0
    faults: list[TextFault] = []
    first: dict[str, Path] = {}  # the first file of each text (its SHA-256), for copies of it
    copies: list[tuple[Path, Path]] = []
    for f in files:
        digest = hashlib.sha256()
        size = 0
        try:
            for text in _text_chunks([f]):
                if faults:
                    continue  # only looking for the others now
                raw = text.encode("utf-8")
                digest.update(raw)
                whole.update(raw)
                size += len(raw)
                chars += len(text)
        except TextFault as e:
            faults.append(e)
        total += size
        h.update(f"{size}:{digest.hexdigest()}\n".encode())
        if size:
            copies.append((f, first.setdefault(digest.hexdigest(), f)))
    if faults:
        raise DataError(_fault_line(faults, files, path, cache_dir))
    copies = [(f, of) for f, of in copies if f != of]
    if copies:
        log.warning(
            "%d file(s) of data.path=%s hold the same text as another (%s: the text of %s): each copy is trained on, "
            "and a copy in the validation split evaluates text also trained on; leave the copies out of data.path",
            len(copies),
            path,
            copies[0][0],
            copies[0][1],
        )
    file = str(files[0].absolute()) if len(files) == 1 else str(path)
    return h.hexdigest()[:24], chars, {"kind": "file", "file": file, "bytes": total, "blake2b": whole.hexdigest()}


class _SplitStream:
    """A stream of text chunks cut at character ``at``: ``first()`` yields the text before it, then ``second()``
    the rest (``first`` must be exhausted first)."""

    def __init__(self, chunks: Iterable[str], at: int):
        self.chunks, self.at, self.rest = iter(chunks), at, ""

    def first(self) -> Iterator[str]:
        pos = 0
        for chunk in self.chunks:
            if pos + len(chunk) >= self.at:
                cut = self.at - pos
                if cut:
                    yield chunk[:cut]
                self.rest = chunk[cut:]
                return
            pos += len(chunk)
            yield chunk

    def second(self) -> Iterator[str]:
        if self.rest:
            yield self.rest
        yield from self.chunks


@dataclasses.dataclass
class TextSplits:
    """A text data set's tokens: ``train`` and ``validation`` (int32 arrays, or a token file's memory maps of
    uint16/uint32), the ``tokenizer``, the UTF-8 bytes each split's text holds, and where the tokens live
    (``token_dir``: the token files' folder, None: in memory)."""

    train: np.ndarray
    validation: np.ndarray
    tokenizer: Tokenizer
    train_bytes: int
    validation_bytes: int
    token_dir: Optional[Path] = None
    fingerprint: Optional[dict] = None  # what the text was read from (file_fingerprint), recorded with checkpoints
    unknown_tokens: int = 0  # tokens of both splits that are the tokenizer's unknown token (``unk_id``)
    # the bytes other than whitespace of both splits' text (``text_bytes``) and those their tokens other than the
    # unknown token stand for (``covered_bytes``); None: not counted (token files written before they were)
    text_bytes: Optional[int] = None
    covered_bytes: Optional[int] = None

    @property
    def unknown_share(self) -> float:
        """The share of the tokens that are the unknown token (0 for a tokenizer without one)."""
        return self.unknown_tokens / max(1, len(self.train) + len(self.validation))

    @property
    def dropped_share(self) -> Optional[float]:
        """The share of the text's UTF-8 bytes other than whitespace that no token stands for (None: not counted)."""
        if self.text_bytes is None or self.covered_bytes is None:
            return None
        return max(0.0, 1 - self.covered_bytes / max(1, self.text_bytes))

    @property
    def train_bytes_per_token(self) -> float:
        return self.train_bytes / max(1, len(self.train))


def _memmap(path: Path, dtype: str, n: int) -> np.ndarray:
    if n == 0:  # (numpy cannot map an empty file)
        return np.zeros(0, dtype)
    tokens = np.memmap(path, dtype=dtype, mode="r", shape=(n,))
    tokens.file_descriptor = os.open(path, os.O_RDONLY)  # the mapped file itself, for check_mapped_size
    weakref.finalize(tokens, os.close, tokens.file_descriptor)
    return tokens


def check_mapped_size(tokens: np.ndarray) -> None:
    """Raises DataError (one line) when the token file ``tokens`` maps (``_memmap``) is now shorter than the mapping:
    reading past its end would end the process with SIGBUS, which Python cannot turn into an error. Checked before
    each batch is read (another process can still cut it in the microseconds between). Nothing for other arrays."""
    fd = getattr(tokens, "file_descriptor", None)
    if fd is None:
        return
    size = os.fstat(fd).st_size
    if size < tokens.nbytes:
        raise DataError(
            f"the token file {tokens.filename} was cut to {size} bytes (another process rewrote it?) while this run "
            f"read its {tokens.nbytes}; run the same command again: the token files are written anew"
        )


def check_window_ids(tokens: np.ndarray, windows: np.ndarray, vocab_size: int) -> None:
    """Raises DataError (one line) when ``windows`` read from the token file ``tokens`` maps hold an id outside the
    tokenizer's ``vocab_size`` (the file was damaged after the check at the start, or is too large for that check,
    ``FULL_CHECK_BYTES``: the model would read NaN from its embedding), after removing the file's ``meta.json``
    so that the same command writes the token files anew. Nothing for other arrays (random tokens, in memory)."""
    if getattr(tokens, "file_descriptor", None) is None or not windows.size:
        return
    top = int(windows.max())
    if top < vocab_size and int(windows.min()) >= 0:
        return
    Path(tokens.filename).with_name("meta.json").unlink(missing_ok=True)
    raise DataError(
        f"the token file {tokens.filename} holds token id {top}, outside the tokenizer's {vocab_size} ids (damaged "
        f"after it was written); run the same command again: the token files are written anew"
    )


def token_dtype(vocab_size: int) -> str:
    """uint16 when every token id fits (a vocabulary of at most 65,536), else uint32."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def text_token_files(
    files: list[Path], fingerprint: str, chars: int, tokenizer: Tokenizer, cache_dir: str
) -> TextSplits:
    """The 90/10 split (by characters) of the concatenated ``files`` as token files in
    ``<cache_dir>/text/<key>/`` (``train.bin``, ``validation.bin``, ``meta.json``; key: the corpus ``fingerprint``,
    the tokenizer's and the split rule), written once: streamed through the tokenizer in ``text_pieces`` into a
    temporary folder renamed at the end (a concurrent writer of the same key loses the race harmlessly); then
    memory-mapped.

    Raises:
      DataError (one line): the cache folder cannot be written.
    """
    split = int(chars * 0.9)
    key = hashlib.sha256(
        json.dumps([TOKEN_FILES_FORMAT, fingerprint, tokenizer.fingerprint, "90/10 characters"]).encode()
    ).hexdigest()[:20]
    folder = Path(cache_dir) / "text" / key
    meta_path = folder / "meta.json"
    meta = _complete_meta(folder) if meta_path.is_file() else None
    if meta is None:
        try:
            if folder.exists():  # damaged (cut, emptied): derived data, moved aside and written again
                aside = folder.with_name(f"{folder.name}.damaged-{socket.gethostname()}-{os.getpid()}")
                os.replace(folder, aside)
                shutil.rmtree(aside, ignore_errors=True)  # a run that mapped the old files keeps reading them
            _write_token_files(folder, files, split, tokenizer, fingerprint)
        except OSError as e:
            raise DataError(
                f"the token files of data.path cannot be written in data.cache_dir={cache_dir} ({type(e).__name__}: "
                f"{e.strerror or e}); set data.cache_dir to a folder you can write"
            ) from None
        meta = json.loads(meta_path.read_text())
    splits = {name: _memmap(folder / f"{name}.bin", meta["dtype"], meta[f"{name}_tokens"]) for name in SPLITS}
    unknown = sum(  # (token files written before the count was recorded: counted now)
        meta[key] if (key := f"{name}_unknown_tokens") in meta else _count(tokens, tokenizer.unk_id)
        for name, tokens in splits.items()
    )
    counted = all(f"{name}_{key}" in meta for name in SPLITS for key in ("text_bytes", "covered_bytes"))
    text_bytes, covered = (
        (sum(meta[f"{name}_{key}"] for name in SPLITS) if counted else None) for key in ("text_bytes", "covered_bytes")
    )
    return TextSplits(
        train=splits["train"],
        validation=splits["validation"],
        tokenizer=tokenizer,
        train_bytes=meta["train_bytes"],
        validation_bytes=meta["validation_bytes"],
        token_dir=folder,
        unknown_tokens=unknown,
        text_bytes=text_bytes,
        covered_bytes=covered,
    )


def _count(tokens: np.ndarray, token: Optional[int]) -> int:
    """How many of ``tokens`` (an array or a token file's map, read in chunks) are ``token`` (0 for None)."""
    if token is None:
        return 0
    step = CHUNK_BYTES // tokens.itemsize
    return sum(int(np.count_nonzero(tokens[i : i + step] == token)) for i in range(0, len(tokens), step))


def _byte_table(tokenizer: Tokenizer) -> np.ndarray:
    """The bytes other than whitespace each token id stands for (``Tokenizer.token_bytes``, eval/bpb's table; a
    decoded SentencePiece token loses its leading space, so whitespace is not compared), 0 for the unknown token."""
    table = tokenizer.token_bytes(WHITESPACE)
    if tokenizer.unk_id is not None:
        table[tokenizer.unk_id] = 0
    return table


def covered_bytes(tokens: np.ndarray, table: np.ndarray) -> int:
    """The bytes ``tokens`` (an array or a token file's map, read in chunks) stand for by ``table`` (``_byte_table``):
    the text's bytes when the tokenizer drops none."""
    step = CHUNK_BYTES // tokens.itemsize
    return sum(int(table[np.asarray(tokens[i : i + step])].sum()) for i in range(0, len(tokens), step))


def text_bytes(text: str) -> int:
    """The UTF-8 bytes of ``text`` other than whitespace (``WHITESPACE``): what ``covered_bytes`` is compared with."""
    return len(text.encode("utf-8").translate(None, WHITESPACE))


def warn_unknown(text: TextSplits) -> None:
    """One warning when ``UNKNOWN_SHARE`` or more of the text's tokens are its tokenizer's unknown token: the model
    learns to predict it, and accuracy and bits per byte count a predicted unknown token as the text it replaced;
    else one when ``UNKNOWN_SHARE`` or more of the text's bytes are in no token (``TextSplits.dropped_share``: a
    tokenizer without an unknown token drops what its vocabulary lacks), which the model never sees and eval/bpb
    does not count."""
    tok = text.tokenizer
    named = f"{tok.what}={tok.path}" if isinstance(tok, HFTokenizer) and tok.path else "the tokenizer"
    if text.unknown_share < UNKNOWN_SHARE:
        dropped = text.dropped_share
        if dropped is not None and dropped >= UNKNOWN_SHARE:
            log.warning(
                "%s drops %.1f%% of the text: its tokens stand for %d of the text's %d bytes other than whitespace "
                "(the rest is text its vocabulary has no token for), so the model never sees that text and eval/bpb "
                "is not this text's; give a tokenizer whose vocabulary covers the text, or leave data.tokenizer_file "
                "out and set data.tokenizer=bpe (a byte-level BPE encodes any text)",
                named,
                100 * dropped,
                text.covered_bytes,
                text.text_bytes,
            )
        return
    total = len(text.train) + len(text.validation)
    log.warning(
        "%.1f%% of the text's tokens (%d of %d) are the unknown token %r of %s: the model learns to predict it, and "
        "its accuracy and eval/bpb count a predicted %r as the text it replaced, so they do not measure this text; "
        "give a tokenizer whose vocabulary covers the text, or leave data.tokenizer_file out and set "
        "data.tokenizer=bpe (a byte-level BPE has no unknown token)",
        100 * text.unknown_share,
        text.unknown_tokens,
        total,
        getattr(tok, "unk_token", None),
        named,
        getattr(tok, "unk_token", None),
    )


def _complete_meta(folder: Path) -> Optional[dict]:
    """``folder``'s ``meta.json`` when it and both token files are whole (each file exactly its tokens' bytes), else
    None after one warning naming what is damaged (the caller writes them again)."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        size = np.dtype(meta["dtype"]).itemsize
        for name in ("train", "validation"):
            have, want = (folder / f"{name}.bin").stat().st_size, meta[f"{name}_tokens"] * size
            if have != want:
                raise ValueError(f"{name}.bin has {have} bytes, not {want}")
        if (meta["train_tokens"] + meta["validation_tokens"]) * size <= FULL_CHECK_BYTES:
            for name in ("train", "validation"):
                top = _max_id(folder / f"{name}.bin", meta["dtype"], meta[f"{name}_tokens"])
                if top >= meta["vocab_size"]:
                    raise ValueError(f"{name}.bin holds token id {top}, outside the vocabulary of {meta['vocab_size']}")
        return meta
    except (OSError, ValueError, KeyError, TypeError) as e:  # (json's decode error is a ValueError)
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
        log.warning("the token files in %s are damaged (%s); writing them again", folder, why)
        return None


def _max_id(path: Path, dtype: str, n: int) -> int:
    """The largest token id in the token file ``path`` (-1 when empty), read in chunks of ``CHUNK_BYTES``."""
    tokens, step = _memmap(path, dtype, n), CHUNK_BYTES // np.dtype(dtype).itemsize
    return max((int(tokens[i : i + step].max()) for i in range(0, n, step)), default=-1)


def _remove_abandoned(folder: Path) -> None:
    """Removes the temporary folders of ``folder``'s key that a process of this host left when it was stopped while
    writing (its process no longer runs)."""
    prefix = f"{folder.name}.tmp-{socket.gethostname()}-"
    for tmp in folder.parent.glob(f"{folder.name}.tmp-*"):
        pid = tmp.name[len(prefix) :] if tmp.name.startswith(prefix) else ""
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except OSError:  # another user's live process
            pass


def _write_token_files(folder: Path, files: list[Path], split: int, tokenizer: Tokenizer, fingerprint: str) -> None:
    tmp = folder.with_name(f"{folder.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    if folder.parent.is_dir():
        _remove_abandoned(folder)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write_token_splits(tmp, folder, files, split, tokenizer, fingerprint)
    except BaseException:  # a stop (a signal) or a failure while writing: no half-written folder is left
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_token_splits(
    tmp: Path, folder: Path, files: list[Path], split: int, tokenizer: Tokenizer, fingerprint: str
) -> None:
    dtype = token_dtype(tokenizer.vocab_size)
    table = _byte_table(tokenizer)
    stream = _SplitStream(_text_chunks(files), split)
    counts = {}
    for name, chunks in (("train", stream.first), ("validation", stream.second)):
        n_tokens = n_bytes = 0

        def counted(pieces: Iterable[str]) -> Iterator[str]:
            nonlocal n_bytes, n_text
            for piece in pieces:
                raw = piece.encode("utf-8")
                n_bytes += len(raw)
                n_text += len(raw.translate(None, WHITESPACE))
                yield piece

        n_unknown = n_covered = n_text = 0
        with open(tmp / f"{name}.bin", "wb") as out:
            for ids in tokenizer.encode_pieces(counted(text_pieces(chunks()))):
                out.write(ids.astype(dtype).tobytes())
                n_tokens += len(ids)
                n_unknown += 0 if tokenizer.unk_id is None else int(np.count_nonzero(ids == tokenizer.unk_id))
                n_covered += int(table[ids].sum())
        counts[f"{name}_tokens"], counts[f"{name}_bytes"] = n_tokens, n_bytes
        counts[f"{name}_unknown_tokens"] = n_unknown
        counts[f"{name}_text_bytes"], counts[f"{name}_covered_bytes"] = n_text, n_covered
    meta = {
        "format": TOKEN_FILES_FORMAT,
        "dtype": dtype,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer": tokenizer.fingerprint,
        "corpus": fingerprint,
        "files": [str(f) for f in files],
        "split_char": split,
        **counts,
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    try:
        os.replace(tmp, folder)
    except OSError:
        if not (folder / "meta.json").is_file():  # not another writer's finished folder: a real failure
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    log.info(
        "wrote %d + %d tokens (%s) of %d file(s) to %s",
        counts["train_tokens"],
        counts["validation_tokens"],
        dtype,
        len(files),
        folder,
    )


def choose_tokenizer(
    kind: str,
    vocab_size: int,
    tokenizer_file: Optional[str],
    cache_dir: str,
    train_fingerprint: Callable[[], str],
    train_pieces: Callable[[], Iterable[str]],
    saved: Optional[Path] = None,
) -> Tokenizer:
    """The tokenizer of a run: the one saved with its checkpoint (``saved``: a resumed run, evaluation) when the
    data are not bytes (a ``data.tokenizer_file`` that differs from it is refused); else ``data.tokenizer_file``;
    else for ``bpe`` the BPE of ``vocab_size`` tokens cached for the training split (``train_fingerprint()``), trained
    on ``train_pieces()`` when not cached; else bytes.

    Raises:
      DataError (one line): an unknown kind, a tokenizer file that cannot be read or is not the saved one, a bad
        ``vocab_size``.
    """
    if kind not in ("bytes", "bpe"):
        raise DataError(f"data.tokenizer={kind!r} is unknown; choose bytes or bpe")
    if kind == "bytes" and not tokenizer_file:
        return ByteTokenizer()
    if saved is not None and saved.is_file():
        kept = load_tokenizer_file(saved, "the run's saved tokenizer")
        given = load_tokenizer_file(Path(tokenizer_file).expanduser()) if tokenizer_file else None
        if given is not None and given.fingerprint != kept.fingerprint:  # a resume keeps its tokens' meaning
            raise DataError(
                f"data.tokenizer_file={tokenizer_file} is not the tokenizer the checkpoint was trained with "
                f"(saved as {saved}); leave data.tokenizer_file out to continue with the saved one, or start "
                f"afresh with another checkpoint.dir"
            )
        return kept
    if tokenizer_file:
        return load_tokenizer_file(Path(tokenizer_file).expanduser())
    return cached_bpe(cache_dir, train_fingerprint(), vocab_size, train_pieces)


def load_text(
    name: str,
    path: Optional[str],
    cache_dir: str,
    download: bool,
    *,
    tokenizer: str = "bytes",
    vocab_size: int = 4096,
    tokenizer_file: Optional[str] = None,
    saved_tokenizer: Optional[Path] = None,
) -> TextSplits:
    """The tokens of ``data=tiny_shakespeare`` (in memory, TFDS's cut) or ``data=text`` (token files of any corpus,
    nanoGPT's 90/10 cut) with the run's tokenizer (``choose_tokenizer``; a BPE is trained on the training split).

    Raises:
      DataError (one line): files missing, unreadable, empty or not UTF-8; a bad tokenizer setting.
    """
    if name == "tiny_shakespeare":
        file = tiny_shakespeare_path(path and os.path.expanduser(path), cache_dir, download)
        text, fingerprint = read_text_file(file, "data.path", cache_dir)
        train, validation, _ = tfds_splits(text)
        tok = choose_tokenizer(
            tokenizer,
            vocab_size,
            tokenizer_file,
            cache_dir,
            lambda: hashlib.sha256(train.encode("utf-8")).hexdigest()[:24],
            lambda: text_pieces([train]),
            saved_tokenizer,
        )
        ids = {"train": tok.encode(train), "validation": tok.encode(validation)}
        text_splits = TextSplits(
            ids["train"],
            ids["validation"],
            tok,
            len(train.encode("utf-8")),
            len(validation.encode("utf-8")),
            fingerprint=fingerprint,
            unknown_tokens=sum(_count(t, tok.unk_id) for t in ids.values()),
            text_bytes=text_bytes(train) + text_bytes(validation),
            covered_bytes=sum(covered_bytes(t, _byte_table(tok)) for t in ids.values()),
        )
        warn_unknown(text_splits)
        return text_splits
    files = corpus_files(path)
    fingerprint, chars, record = corpus_fingerprint(files, path, cache_dir)
    if chars == 0:
        raise DataError(f"data.path={path} is empty; give a UTF-8 text file with at least one window of text")
    split = int(chars * 0.9)
    tok = choose_tokenizer(
        tokenizer,
        vocab_size,
        tokenizer_file,
        cache_dir,
        lambda: hashlib.sha256(f"{fingerprint}:{split}".encode()).hexdigest()[:24],
        lambda: text_pieces(_SplitStream(_text_chunks(files), split).first()),
        saved_tokenizer,
    )
    text_splits = dataclasses.replace(text_token_files(files, fingerprint, chars, tok, cache_dir), fingerprint=record)
    warn_unknown(text_splits)
    return text_splits


def synthetic_tokens(vocab_size: int, train_size: int, eval_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) int32 random tokens, uniform in ``[0, vocab_size)``, from (seed, split)."""
    train = np.random.default_rng([seed, 2**21]).integers(0, vocab_size, train_size, dtype=np.int32)
    test = np.random.default_rng([seed, 2**21 + 1]).integers(0, vocab_size, eval_size, dtype=np.int32)
    return train, test
