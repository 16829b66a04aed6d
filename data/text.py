"""Text for the language model: byte tokens, random training windows, every validation window once.

Tokens are the bytes of UTF-8 text (vocabulary 256; nothing to download or train). A batch uses the same keys
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
- ``text``: any UTF-8 file (``data.path``), split 90/10 by characters (train / validation).
- ``synthetic`` with the GPT: uniform random tokens below ``vocab_size`` (``data.train_size`` and
  ``data.eval_size`` tokens).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shlex
import socket
import urllib.request
from pathlib import Path
from typing import Optional

import numpy as np

from core.errors import DataError
from core.layout import Batch
from data.sources import HostDataset

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
        self.fingerprint = fingerprint  # the text file's (file_fingerprint); None for random tokens
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
        windows = self.tokens[self.global_starts(step)[rows, None] + self._offsets]
        batch = {"image": windows[:, :-1], "label": windows[:, 1:]}
        if self.with_index:
            batch["index"] = self.global_indices(step)[rows]
        return batch


def eval_windows(tokens: np.ndarray, context: int) -> HostDataset:
    """Every non-overlapping window of ``tokens``: ``images`` int32 ``[W, T]`` (window ``w`` = tokens
    ``[wT, wT + T)``), ``labels`` int32 ``[W, T]`` (the same shifted by one), ``W = (N - 1) // T``; each target
    token ``1 .. W*T`` is counted once.

    Raises:
      ValueError: fewer than ``context + 1`` tokens.
    """
    n = (len(tokens) - 1) // context
    if n < 1:
        raise ValueError(f"the split has {len(tokens)} tokens, fewer than one window of {context} + 1")
    x = tokens[: n * context + 1]
    return HostDataset(images=x[:-1].reshape(n, context), labels=x[1:].reshape(n, context))


def byte_tokens(text: str) -> np.ndarray:
    """int32 ``[N]``: the UTF-8 bytes of ``text``."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)


def file_fingerprint(path: Path, raw: bytes) -> dict:
    """What a run trained on, recorded with its checkpoints: ``{"kind": "file", "file": absolute path, "bytes":
    size, "blake2b": hex digest (16 bytes) of the contents}``. Two files with the same size and digest hold the
    same text, wherever they are."""
    digest = hashlib.blake2b(raw, digest_size=16).hexdigest()
    return {"kind": "file", "file": str(Path(path).absolute()), "bytes": len(raw), "blake2b": digest}


# Byte-order marks of the encodings a text editor saves besides UTF-8 (UTF-32 first: its LE mark starts as UTF-16's)
BOMS = (
    (b"\xff\xfe\x00\x00", "UTF-32LE"),
    (b"\x00\x00\xfe\xff", "UTF-32BE"),
    (b"\xff\xfe", "UTF-16LE"),
    (b"\xfe\xff", "UTF-16BE"),
)


def wide_encoding(raw: bytes) -> Optional[str]:
    """``UTF-16LE``/``UTF-16BE``/``UTF-32LE``/``UTF-32BE`` when ``raw`` starts with that byte-order mark, or, with
    no mark, when a quarter or more of its first 64 KiB are NUL bytes and the others sit at one offset modulo 4
    (UTF-32) or 2 (UTF-16), as ASCII letters do in those encodings; else None. UTF-8 text holds no NUL bytes."""
    for bom, name in BOMS:
        if raw.startswith(bom):
            return name
    head = np.frombuffer(raw[: 1 << 16], np.uint8)
    if len(head) < 4 or int((head == 0).sum()) < len(head) // 4:
        return None
    offsets = np.flatnonzero(head)
    for width, names in ((4, ("UTF-32LE", None, None, "UTF-32BE")), (2, ("UTF-16LE", "UTF-16BE"))):
        share = np.bincount(offsets % width, minlength=width) / max(1, len(offsets))
        at = int(share.argmax())
        if share[at] >= 0.9 and names[at]:
            return names[at]
    return None


def _shell(path: Path) -> str:
    """``path`` quoted for a shell, so that an advised command works when pasted."""
    return shlex.quote(str(path))


def read_text_file(path: Path, what: str) -> tuple[str, dict]:
    """The text of ``path`` (``~`` expanded) and its ``file_fingerprint``.

    Raises:
      DataError (one line): missing, unreadable, empty, or not UTF-8: a UTF-16/UTF-32 file (a byte-order mark, or
        NUL bytes between ASCII letters; read as UTF-8 it would train on NUL bytes) is told to convert from its
        encoding, one with other NUL bytes or invalid UTF-8 from its own (e.g. UTF-16LE, latin1), each with the
        ``iconv`` command that writes a UTF-8 copy to pass instead.
    """
    path = Path(path).expanduser()
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{what}={path} cannot be read ({type(e).__name__}: {e.strerror or e}); give a readable file")
    if not raw:
        raise DataError(f"{what}={path} is empty; give a UTF-8 text file with at least one window of text")
    out = path.with_name(path.stem + ".utf8.txt")  # where the advised conversion writes its UTF-8 copy
    wide = wide_encoding(raw)
    if wide is not None:
        # with a byte-order mark iconv's UTF-16 / UTF-32 read it (and drop it); without one, name the byte order
        source = wide[:6] if raw.startswith(tuple(bom for bom, _ in BOMS)) else wide
        raise DataError(
            f"{what}={path} is {wide} text, not UTF-8 (read as UTF-8 it would train on NUL bytes); convert it: "
            f"iconv -f {source} -t UTF-8 {_shell(path)} > {_shell(out)}, then pass {what}={out}"
        )
    nul = raw.count(0)
    if nul * 100 >= len(raw):  # UTF-16 of other scripts without a mark, or no text: say what is known, not a guess
        raise DataError(
            f"{what}={path} holds {nul} NUL bytes, which UTF-8 text never does: convert it to UTF-8 from its "
            f"encoding (e.g. UTF-16LE: iconv -f UTF-16LE -t UTF-8 {_shell(path)} > {_shell(out)}, then pass "
            f"{what}={out}); an archive or other binary file is not text"
        )
    try:
        return raw.decode("utf-8"), file_fingerprint(path, raw)
    except UnicodeDecodeError as e:
        raise DataError(
            f"{what}={path} is not UTF-8 (byte {e.start}: {e.reason}); convert it from its encoding, e.g. latin1: "
            f"iconv -f latin1 -t UTF-8 {_shell(path)} > {_shell(out)}, then pass {what}={out}"
        ) from None


def read_utf8(path: Path, what: str) -> str:
    """The text of ``path``. Raises DataError (one line): missing, unreadable, empty or not UTF-8
    (``read_text_file``)."""
    return read_text_file(path, what)[0]


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
        log.warning("downloaded tiny_shakespeare to %s", cached)
        return cached
    except DataError:
        raise
    except Exception as e:
        raise DataError(
            f"tiny_shakespeare could not be downloaded from {TINY_SHAKESPEARE_URL} ({type(e).__name__}: {e}); "
            f"set data.path to a copy of it, or run with data=synthetic"
        ) from None


@dataclasses.dataclass(frozen=True)
class TextSplits:
    """The token splits of a text file: ``train``, ``validation`` int32 byte tokens ``[N]``, and the file's
    ``fingerprint`` (``file_fingerprint``)."""

    train: np.ndarray
    validation: np.ndarray
    fingerprint: dict


def load_text(name: str, path: Optional[str], cache_dir: str, download: bool) -> TextSplits:
    """The splits of ``data=tiny_shakespeare`` or ``data=text`` (``~`` in ``data.path`` expanded).

    Raises:
      DataError (one line): the file is missing, unreadable, empty or not UTF-8 (``data=text`` without
        ``data.path`` too).
    """
    if name == "tiny_shakespeare":
        file = tiny_shakespeare_path(path and os.path.expanduser(path), cache_dir, download)
        text, fingerprint = read_text_file(file, "data.path")
        train, validation, _ = tfds_splits(text)
    else:
        if not path:
            raise DataError("data=text needs data.path=FILE (a UTF-8 text file)")
        text, fingerprint = read_text_file(Path(path), "data.path")
        train, validation = split_90_10(text)
    return TextSplits(byte_tokens(train), byte_tokens(validation), fingerprint)


def load_text_splits(name: str, path: Optional[str], cache_dir: str, download: bool) -> tuple[np.ndarray, np.ndarray]:
    """(train tokens, validation tokens) of ``load_text``. Raises DataError as it does."""
    splits = load_text(name, path, cache_dir, download)
    return splits.train, splits.validation


def synthetic_tokens(vocab_size: int, train_size: int, eval_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) int32 random tokens, uniform in ``[0, vocab_size)``, from (seed, split)."""
    train = np.random.default_rng([seed, 2**21]).integers(0, vocab_size, train_size, dtype=np.int32)
    test = np.random.default_rng([seed, 2**21 + 1]).integers(0, vocab_size, eval_size, dtype=np.int32)
    return train, test
