"""Tokenizers for the language model: UTF-8 bytes, or a byte-level BPE (Hugging Face ``tokenizers``).

``data.tokenizer=bytes`` (the default): a token is one byte of the UTF-8 text (vocabulary 256; nothing trained).
``data.tokenizer=bpe``: a byte-level BPE of ``data.vocab_size`` tokens (GPT-2's scheme: the 256 byte tokens plus
merges, so any text encodes and decodes losslessly) trained on the TRAINING split only, cached in
``<data.cache_dir>/tokenizers/bpe-<vocab>-<fingerprint of the training split>.json`` and saved with the run
(``tokenizer.json`` in the run folder and the checkpoint folder), so sampling and evaluation encode and decode with
the very same one. ``data.tokenizer_file=PATH``: a ``tokenizer.json`` the user gives (any model ``tokenizers``
reads, e.g. GPT-2's, or one a BPE run saved).

Text is encoded in pieces (``text_pieces``): whole lines grouped up to ``PIECE_CHARS`` characters (a longer line
cut every ``PIECE_CHARS``), each piece encoded on its own. The pieces depend only on the text, not on how it was
read, so a corpus streamed from disk in chunks encodes to exactly the tokens of the same text held in memory
(``data.text``: the memory-mapped token file). BPE's pre-tokenizer never joins across a line end, so this is the
encoding of the whole text but for runs of blank lines that a cut may split differently.

Bits per byte (``eval/bpb``) need the bytes each token stands for: ``Tokenizer.token_bytes`` (for a byte-level
vocabulary exact, from GPT-2's byte-to-character table; for another model the UTF-8 length of the token decoded
alone).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np

from core.errors import DataError

TOKENIZERS = ("bytes", "bpe")
VOCAB_BYTES = 256
PIECE_CHARS = 1 << 16  # characters per encoded piece (whole lines; a longer line is cut)
ENCODE_BATCH = 256  # pieces per encode_batch call (the library encodes a batch on all cores)
MIN_BPE_VOCAB = VOCAB_BYTES + 1


def text_pieces(chunks: Iterable[str], limit: int = PIECE_CHARS) -> Iterator[str]:
    """The text of ``chunks`` (cut anywhere) as pieces of whole lines: lines (each with its ``\\n``) are gathered
    while the piece stays within ``limit`` characters; a line longer than ``limit`` is first cut into pieces of
    ``limit`` characters (from its start), its remainder then gathered like a line. The pieces depend only on the
    concatenated text: ``text_pieces([text])`` and ``text_pieces(any split of text)`` are equal."""
    piece: list[str] = []
    size = 0
    partial = ""

    def flush() -> Iterator[str]:
        nonlocal piece, size
        if piece:
            yield "".join(piece)
        piece, size = [], 0

    def add(line: str) -> Iterator[str]:  # a whole line (or a long line's remainder), at most `limit` characters
        nonlocal size
        if size + len(line) > limit:
            yield from flush()
        piece.append(line)
        size += len(line)

    for chunk in chunks:
        partial += chunk
        *lines, partial = partial.split("\n")
        for line in lines:
            rest = line + "\n"
            if len(rest) > limit:
                yield from flush()
                while len(rest) > limit:
                    yield rest[:limit]
                    rest = rest[limit:]
            yield from add(rest)
        if len(partial) > limit:  # a line longer than a piece, still unfinished: its leading pieces are known
            yield from flush()
            while len(partial) > limit:
                yield partial[:limit]
                partial = partial[limit:]
    if partial:
        yield from add(partial)
    yield from flush()


class ByteTokenizer:
    """Tokens are the UTF-8 bytes of the text: vocabulary 256, nothing to train or save."""

    name = "bytes"
    vocab_size = VOCAB_BYTES
    fingerprint = "bytes"
    path: Optional[Path] = None
    unk_id: Optional[int] = None  # every text encodes: no unknown token

    def encode(self, text: str) -> np.ndarray:
        """int32 ``[N]``: the UTF-8 bytes of ``text``."""
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def encode_pieces(self, pieces: Iterable[str]) -> Iterator[np.ndarray]:
        for piece in pieces:
            yield self.encode(piece)

    def decode(self, ids: Sequence[int]) -> str:
        """The bytes ``ids`` as UTF-8 (a character cut short becomes U+FFFD)."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, skip: bytes = b"") -> np.ndarray:
        """int64 ``[256]``: one byte per token (0 for the bytes of ``skip``)."""
        out = np.ones(VOCAB_BYTES, np.int64)
        out[list(skip)] = 0
        return out

    def to_json(self) -> Optional[str]:
        return None


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-to-character table inverted (``bytes_to_unicode``): the character a byte-level vocabulary
    writes for each byte -> that byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` (a byte-level BPE this repository trained, or a user's file)."""

    name = "bpe"

    def __init__(self, tokenizer, path: Optional[Path] = None, what: str = "data.tokenizer_file"):
        self.tokenizer, self.path, self.what = tokenizer, path, what
        self._json = tokenizer.to_str()
        # the largest id + 1: a vocabulary with gaps in its ids (a WordLevel {"a": 0, "b": 5000}) encodes ids up to it
        self.vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self.fingerprint = hashlib.sha256(self._json.encode()).hexdigest()[:16]
        model = json.loads(self._json).get("model") or {}
        unk = model.get("unk_token")  # (WordLevel, WordPiece, BPE; Unigram gives its id)
        self.unk_id: Optional[int] = tokenizer.token_to_id(unk) if unk is not None else model.get("unk_id")
        self.unk_token: Optional[str] = None if self.unk_id is None else tokenizer.id_to_token(self.unk_id)

    def encode(self, text: str) -> np.ndarray:
        """int32 ``[N]``: the tokens of ``text`` (encoded in ``text_pieces``)."""
        parts = list(self.encode_pieces(text_pieces([text])))
        return np.concatenate(parts) if parts else np.zeros(0, np.int32)

    def encode_pieces(self, pieces: Iterable[str]) -> Iterator[np.ndarray]:
        """int32 tokens of each piece, in order (``ENCODE_BATCH`` pieces per call of the library, on all cores)."""
        batch: list[str] = []
        for piece in pieces:
            batch.append(piece)
            if len(batch) == ENCODE_BATCH:
                yield from self._encode_batch(batch)
                batch = []
        if batch:
            yield from self._encode_batch(batch)

    def _encode_batch(self, batch: list[str]) -> Iterator[np.ndarray]:
        try:
            encoded = self.tokenizer.encode_batch(batch, add_special_tokens=False)
        except Exception as e:  # the library's errors are plain Exceptions (e.g. a WordLevel model without unk_token)
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            fix = "leave data.tokenizer_file out and set data.tokenizer=bpe (a byte-level BPE encodes any text)"
            if "unk" in reason.lower():
                fix = (
                    "its vocabulary lacks words of the text and it has no unknown token: set its model's unk_token "
                    f"to a token of its vocabulary, or {fix}"
                )
            named = f"{self.what}={self.path}" if self.path else self.what
            raise DataError(f"{named} cannot encode the text ({reason}); {fix}") from None
        for enc in encoded:
            yield np.asarray(enc.ids, np.int32)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    def token_bytes(self, skip: bytes = b"") -> np.ndarray:
        """int64 ``[vocab]``: the bytes each token stands for, those of ``skip`` not counted. A byte-level vocabulary
        (GPT-2's, and the BPE trained here) writes every byte as one character of GPT-2's table: exact. Otherwise
        (and for a token with a character outside that table, e.g. a special token) the UTF-8 length of the token
        decoded on its own (a SentencePiece token's leading space is lost that way: skip whitespace to compare)."""
        table = _byte_level_table() if (json.loads(self._json).get("decoder") or {}).get("type") == "ByteLevel" else {}
        out = np.zeros(self.vocab_size, np.int64)
        for i in range(self.vocab_size):
            token = self.tokenizer.id_to_token(i)
            if token is not None and table and all(c in table for c in token):
                out[i] = sum(table[c] not in skip for c in token)
            else:
                out[i] = len(self.tokenizer.decode([i]).encode("utf-8").translate(None, skip))
        return out

    def to_json(self) -> Optional[str]:
        return self._json


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise DataError(
            "data.tokenizer=bpe and data.tokenizer_file need Hugging Face tokenizers: pip install -r requirements.txt"
        ) from None
    return tokenizers


def load_tokenizer_file(path: Path, what: str = "data.tokenizer_file") -> HFTokenizer:
    """The tokenizer saved at ``path`` (a ``tokenizer.json``). Raises DataError (one line): missing, unreadable, not
    JSON or JSON of another kind (``_not_a_tokenizer``), with the fix for a ``data.tokenizer_file``."""
    tk = _tokenizers()
    path = Path(path)
    if not path.is_file():
        said = "is a folder" if path.is_dir() else "does not exist"
        raise DataError(f"{what}={path} {said}; give a tokenizer.json (Hugging Face tokenizers' format)")
    try:
        return HFTokenizer(tk.Tokenizer.from_file(str(path)), path, what)
    except Exception as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        fix = (
            "; give a tokenizer.json (Hugging Face tokenizers' format), or leave data.tokenizer_file out and set "
            "data.tokenizer=bpe"
            if what == "data.tokenizer_file"
            else ""
        )
        raise DataError(f"{what}={path} {_not_a_tokenizer(path, reason)}{fix}") from None


def _not_a_tokenizer(path: Path, reason: str) -> str:
    """Why the file at ``path``, refused by Hugging Face tokenizers for ``reason``, is no tokenizer.json: not JSON
    (e.g. cut short), JSON of another kind (a ``tokenizer_config.json`` of transformers: settings without the
    vocabulary), or the library's ``reason``."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        return f"is not JSON, so not a tokenizer.json ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    if isinstance(data, dict) and "model" not in data:
        if {"tokenizer_class", "model_max_length", "added_tokens_decoder"} & set(data):
            kind = "a tokenizer_config.json of transformers (its settings, without the vocabulary and merges)"
        elif data:
            kind = f"JSON without the 'model' key a tokenizer.json has (its keys: {', '.join(list(data)[:6])})"
        else:
            kind = "an empty JSON object"
        return f"is {kind}, not a tokenizer.json"
    if not isinstance(data, dict):
        return f"is JSON of a {type(data).__name__}, not a tokenizer.json (an object)"
    return f"is not a tokenizer.json that Hugging Face tokenizers reads ({reason})"


def train_bpe(pieces: Iterable[str], vocab_size: int) -> HFTokenizer:
    """A byte-level BPE (GPT-2's pre-tokenizer and decoder; the 256 byte tokens first, then merges up to
    ``vocab_size``) trained on ``pieces``; deterministic for the same text. A text too small for ``vocab_size``
    tokens gives fewer (``vocab_size`` of the result)."""
    tk = _tokenizers()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    failed: list[BaseException] = []

    def train() -> None:
        try:
            tokenizer.train_from_iterator(pieces, trainer)
        except BaseException as e:  # noqa: BLE001 - raised again by the caller's thread
            failed.append(e)

    # the trainer runs on a thread of its own and releases the interpreter lock: the caller's thread stays free to
    # take a stop signal at once (in the caller's thread, the trainer's Rust loop held it for seconds)
    worker = threading.Thread(target=train, name="bpe-train", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.1)
    if failed:
        raise failed[0]
    return HFTokenizer(tokenizer, what="the BPE trained on the text")


def check_vocab_size(vocab_size: int) -> None:
    """Raises DataError for a ``data.vocab_size`` a byte-level BPE cannot have (it starts from 256 byte tokens)."""
    if not MIN_BPE_VOCAB <= vocab_size < 2**32:
        raise DataError(
            f"data.vocab_size={vocab_size} is out of range for data.tokenizer=bpe; it must be at least {MIN_BPE_VOCAB} "
            f"(the 256 byte tokens and at least one merge), e.g. 4096"
        )


def write_atomic(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary name in the same folder (renamed over it: a reader never
    sees half a file; concurrent writers of the same content are harmless)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def bpe_cache_path(cache_dir: str, fingerprint: str, vocab_size: int) -> Path:
    """Where the BPE of ``vocab_size`` tokens trained on a training split of ``fingerprint`` is cached."""
    return Path(cache_dir) / "tokenizers" / f"bpe-{vocab_size}-{fingerprint}.json"


def cached_bpe(cache_dir: str, fingerprint: str, vocab_size: int, pieces) -> HFTokenizer:
    """The BPE cached for (``fingerprint``, ``vocab_size``), else trained on ``pieces()`` (a function returning the
    training split's pieces) and cached (a cache folder that cannot be written only loses the cache)."""
    check_vocab_size(vocab_size)
    path, tokenizer = bpe_cache_path(cache_dir, fingerprint, vocab_size), None
    if path.is_file():
        try:
            tokenizer = load_tokenizer_file(path, "the cached tokenizer")
        except DataError:
            pass  # a broken cache entry: trained again below
    if tokenizer is None:
        tokenizer = train_bpe(pieces(), vocab_size)
        try:
            write_atomic(path, tokenizer.to_json() or "")
        except OSError:
            pass
        tokenizer.path = path
    if tokenizer.vocab_size < vocab_size:  # a sweep over data.vocab_size would compare the same vocabulary
        logging.getLogger("data.text").warning(
            f"data.vocab_size={vocab_size}: the BPE learned only {tokenizer.vocab_size} tokens from this text (it "
            f"holds no more merges); the model's vocabulary is {tokenizer.vocab_size}, and a larger data.vocab_size "
            f"gives the same tokenizer"
        )
    return tokenizer
