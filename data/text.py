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

import hashlib
import logging
import os
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

    Raises:
      ValueError: the split is not longer than one window.
    """

    def __init__(self, tokens: np.ndarray, context: int, global_batch: int, seed: int, with_index: bool = True):
        if len(tokens) <= context:
            raise ValueError(f"the train split has {len(tokens)} tokens, not more than one window of {context}")
        self.tokens, self.context, self.global_batch, self.seed = tokens, context, global_batch, seed
        self.with_index = with_index
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


def read_utf8(path: Path, what: str) -> str:
    """The text of ``path``. Raises DataError (one line): missing, unreadable, empty or not UTF-8."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise DataError(f"{what}={path} cannot be read ({type(e).__name__}: {e.strerror or e}); give a readable file")
    if not raw:
        raise DataError(f"{what}={path} is empty; give a UTF-8 text file with at least one window of text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{what}={path} is not UTF-8 (byte {e.start}: {e.reason}); convert it first, e.g. "
            f"iconv -f latin1 -t utf-8 {path} > out.txt"
        ) from None


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


def load_text_splits(name: str, path: Optional[str], cache_dir: str, download: bool) -> tuple[np.ndarray, np.ndarray]:
    """(train tokens, validation tokens), int32 byte tokens of ``data=tiny_shakespeare`` or ``data=text``.

    Raises:
      DataError (one line): the file is missing, unreadable, empty or not UTF-8 (``data=text`` without
        ``data.path`` too).
    """
    if name == "tiny_shakespeare":
        file = tiny_shakespeare_path(path, cache_dir, download)
        train, validation, _ = tfds_splits(read_utf8(file, "data.path"))
    else:
        if not path:
            raise DataError("data=text needs data.path=FILE (a UTF-8 text file)")
        train, validation = split_90_10(read_utf8(Path(path), "data.path"))
    return byte_tokens(train), byte_tokens(validation)


def synthetic_tokens(vocab_size: int, train_size: int, eval_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) int32 random tokens, uniform in ``[0, vocab_size)``, from (seed, split)."""
    train = np.random.default_rng([seed, 2**21]).integers(0, vocab_size, train_size, dtype=np.int32)
    test = np.random.default_rng([seed, 2**21 + 1]).integers(0, vocab_size, eval_size, dtype=np.int32)
    return train, test
