"""Real tokens and any corpus for the language model: the byte-level BPE (``data.tokenizer=bpe``, a
``data.tokenizer_file``), bits per byte, and ``data=text`` over a file, a folder or a glob read through a
memory-mapped token file (the same batches as in memory, exact on resume, equal across process counts)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

from core.errors import ConfigError, DataError
from data.text import (
    SHARED_TINY_SHAKESPEARE,
    WindowSource,
    corpus_files,
    load_text,
    load_text_splits,
    split_90_10,
)
from data.tokens import ByteTokenizer, load_tokenizer_file, text_pieces, train_bpe
from training import checkpoint
from training.build import load_data, plan
from utils import REPO, make_cfg

SHAKESPEARE = SHARED_TINY_SHAKESPEARE.read_text() if SHARED_TINY_SHAKESPEARE.exists() else None
needs_corpus = pytest.mark.skipif(SHAKESPEARE is None, reason="Tiny Shakespeare not present")
TEXT = "ROMEO:\nBut, soft! what light through yonder window breaks?\n\nJULIET: café, naïve, 東京 ✓\n" * 3


@pytest.fixture
def corpus(tmp_path) -> Path:
    """A folder of three files (one not ASCII, one hidden file skipped, one in a subfolder): 60,000+ characters."""
    folder = tmp_path / "corpus"
    (folder / "b").mkdir(parents=True)
    base = SHAKESPEARE[:30_000] if SHAKESPEARE else "to be or not to be\n" * 1500
    (folder / "a.txt").write_text(base[:20_000])
    (folder / "b" / "c.txt").write_text(TEXT * 40)
    (folder / "d.txt").write_text(base[20_000:])
    (folder / ".hidden.txt").write_text("never read")
    return folder


# ---- tokens ------------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_text_pieces_do_not_depend_on_how_the_text_is_read():
    """The pieces (whole lines, at most ``limit`` characters; a long line cut) of a text are the same however
    the text is cut into chunks: a streamed corpus encodes to the tokens of the same text in memory."""
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(
            rng.choice(["ab", "\n", "\n\n", " ", "x" * rng.randint(0, 30)]) for _ in range(rng.randint(0, 40))
        )
        limit = rng.randint(1, 16)
        ref = list(text_pieces([text], limit))
        assert "".join(ref) == text and all(0 < len(p) <= limit for p in ref)
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        assert list(text_pieces([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])], limit)) == ref
    assert list(text_pieces(["ab\ncd\n", "ef"], 6)) == ["ab\ncd\n", "ef"]
    assert list(text_pieces(["abcdefgh\nxy\n"], 4)) == ["abcd", "efgh", "\nxy\n"]


@pytest.mark.unit
@needs_corpus
def test_bpe_round_trip_determinism_and_bytes_per_token(tmp_path):
    """The byte-level BPE trained on a training split: deterministic; any text (non-ASCII too) encodes and decodes
    back exactly; ``token_bytes`` counts exactly the UTF-8 bytes the tokens stand for; a saved tokenizer.json
    (``data.tokenizer_file``) encodes the same tokens."""
    train, validation = split_90_10(SHAKESPEARE[:200_000])
    bpe = train_bpe(text_pieces([train]), 512)
    again = train_bpe(text_pieces([train]), 512)
    assert bpe.vocab_size == 512 and bpe.to_json() == again.to_json() and bpe.fingerprint == again.fingerprint
    for text in (validation, TEXT, "", "\n\n\n  x\n"):
        ids = bpe.encode(text)
        assert ids.dtype == np.int32 and bpe.decode(ids) == text
        assert int(bpe.token_bytes()[ids].sum()) == len(text.encode("utf-8"))
    ids = bpe.encode(validation)
    assert len(ids) < 0.6 * len(validation.encode())  # real merges (512 tokens: ~1.9 bytes per token)
    (tmp_path / "tokenizer.json").write_text(bpe.to_json() or "")
    loaded = load_tokenizer_file(tmp_path / "tokenizer.json")
    np.testing.assert_array_equal(loaded.encode(validation), ids)
    assert loaded.fingerprint == bpe.fingerprint
    bytes_ = ByteTokenizer()
    assert bytes_.decode(bytes_.encode(TEXT)) == TEXT and bytes_.token_bytes().tolist() == [1] * 256
    with pytest.raises(DataError, match=r"^data\.tokenizer_file=.*missing\.json does not exist"):
        load_tokenizer_file(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DataError) as e:
        load_tokenizer_file(tmp_path / "bad.json")
    assert str(e.value) == (
        f"data.tokenizer_file={tmp_path / 'bad.json'} is an empty JSON object, not a tokenizer.json; give a "
        f"tokenizer.json (Hugging Face tokenizers' format), or leave data.tokenizer_file out and set data.tokenizer=bpe"
    )


# ---- the corpus: files, folders, globs ---------------------------------------------------------------------
@pytest.mark.unit
def test_corpus_files_and_their_one_line_errors(corpus, tmp_path):
    files = corpus_files(str(corpus))
    assert files == [corpus / "a.txt", corpus / "b" / "c.txt", corpus / "d.txt"]  # sorted, hidden skipped
    assert corpus_files(str(corpus / "*.txt")) == [corpus / "a.txt", corpus / "d.txt"]
    assert corpus_files(str(corpus / "**" / "*.txt")) == files
    assert corpus_files(str(corpus / "a.txt")) == [corpus / "a.txt"]
    (tmp_path / "empty").mkdir()
    (tmp_path / "latin1").mkdir()
    (tmp_path / "latin1" / "x.txt").write_bytes("ok\n".encode() * 10 + "caf\u00e9".encode("latin-1"))
    cases = [
        (str(tmp_path / "nothing*.txt"), r"matches no file"),
        (str(tmp_path / "empty"), r"is a folder without files"),
        (str(tmp_path / "missing.txt"), r"cannot be read \(FileNotFoundError"),
    ]
    for path, message in cases:
        with pytest.raises(DataError, match=rf"^data\.path={path.replace('*', '[*]')} {message}"):
            corpus_files(path)
    folder = tmp_path / "latin1"  # a file of a folder: named in it (converted in place: test_gpt.py)
    with pytest.raises(DataError, match=rf"^{folder / 'x.txt'} in data\.path={folder} is not UTF-8 \(byte 33:"):
        load_text("text", str(tmp_path / "latin1"), str(tmp_path / "cache"), False)


@pytest.mark.unit
def test_linked_folders_are_read_once_and_copies_of_a_text_are_warned(corpus, tmp_path, caplog):
    """A linked folder in a folder corpus was skipped without a word; a link loop under a ``**`` glob listed the
    same files dozens of times (their text trained on, and evaluated, once per path). Linked folders are followed,
    each real file read once; files holding the same text are named in one warning."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "e.txt").write_text("linked text\n" * 50)
    (corpus / "linked").symlink_to(other)
    (corpus / "b" / "up").symlink_to(corpus)  # a loop
    files = [corpus / "a.txt", corpus / "b" / "c.txt", corpus / "d.txt", corpus / "linked" / "e.txt"]
    assert corpus_files(str(corpus)) == files
    assert corpus_files(str(corpus / "**" / "*.txt")) == files
    (corpus / "f.txt").write_text((corpus / "a.txt").read_text())
    load_text("text", str(corpus), str(tmp_path / "cache"), False)
    warned = [r.getMessage() for r in caplog.records if r.name == "data.text" and r.levelname == "WARNING"]
    assert warned == [
        f"1 file(s) of data.path={corpus} hold the same text as another ({corpus / 'f.txt'}: the text of "
        f"{corpus / 'a.txt'}): each copy is trained on, and a copy in the validation split evaluates text also "
        f"trained on; leave the copies out of data.path"
    ]


@pytest.mark.unit
def test_a_stop_signal_during_bpe_training_is_taken_at_once():
    """A signal during a BPE's training (seconds on a corpus of many megabytes) was taken only when the trainer's
    Rust loop let go of the interpreter lock (2.5 s later here, 10-13 s on a loaded machine); the trainer now runs on
    a thread of its own and the caller's thread takes the signal within its 0.1 s wait."""
    import signal
    import time

    big = (SHAKESPEARE or TEXT * 400) * 10  # 11 MB: training takes seconds
    pieces = text_pieces([big])

    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, stop)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            train_bpe(pieces, 4096)
        late_s = time.monotonic() - t0 - 0.5
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert late_s < 0.5, late_s


@pytest.mark.unit
@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_the_token_file_holds_the_in_memory_tokens_and_gives_the_same_batches(corpus, tmp_path, tokenizer):
    """``data=text`` over a folder writes its tokens once into the cache (uint16, atomically: no temporary folder
    left), memory-maps them, and every batch equals the one drawn from the same tokens in memory (any rows);
    a second load reuses the files; the BPE is cached and trained on the training split only."""
    cache = tmp_path / "cache"
    text = load_text("text", str(corpus), str(cache), False, tokenizer=tokenizer, vocab_size=400)
    assert isinstance(text.train, np.memmap) and text.train.dtype == np.uint16 and text.token_dir is not None
    assert [p.name for p in (cache / "text").iterdir()] == [text.token_dir.name]  # no temporary folder left
    whole = "".join(f.read_text() for f in corpus_files(str(corpus)))
    train_text, validation_text = split_90_10(whole)
    mem_train, mem_validation = load_text_splits("text", str(corpus), str(cache), False, text.tokenizer)
    np.testing.assert_array_equal(np.asarray(text.train), mem_train)
    np.testing.assert_array_equal(np.asarray(text.validation), mem_validation)
    assert (text.train_bytes, text.validation_bytes) == (len(train_text.encode()), len(validation_text.encode()))
    if tokenizer == "bytes":
        np.testing.assert_array_equal(mem_train, np.frombuffer(train_text.encode(), np.uint8))
    else:
        assert text.tokenizer.vocab_size == 400 and text.tokenizer.decode(mem_validation) == validation_text
        assert [p.name for p in (cache / "tokenizers").iterdir()] == [Path(str(text.tokenizer.path)).name]
    mapped, memory = (WindowSource(t, 32, 12, seed=5) for t in (text.train, mem_train))
    for step in (0, 1, 17):
        for rows in (slice(0, 12), slice(0, 6), slice(6, 12)):
            a, b = mapped.local_batch(step, rows), memory.local_batch(step, rows)
            assert a["image"].dtype == np.int32
            for key in ("image", "label", "index"):
                np.testing.assert_array_equal(a[key], b[key])
    stamp = (text.token_dir / "train.bin").stat().st_mtime_ns
    again = load_text("text", str(corpus), str(cache), False, tokenizer=tokenizer, vocab_size=400)
    assert again.token_dir == text.token_dir and (text.token_dir / "train.bin").stat().st_mtime_ns == stamp


@pytest.mark.unit
@pytest.mark.parametrize("damage", ["cut train.bin", "empty meta.json", "no validation.bin", "id outside"])
def test_damaged_token_files_are_written_again_with_one_warning(corpus, tmp_path, caplog, damage):
    """The token files are derived data: a cut ``train.bin`` (a traceback from ``np.memmap`` before), an emptied
    ``meta.json`` (a JSONDecodeError), a missing file or a token id outside the vocabulary (bytes overwritten in
    place: the run read NaN from the embedding and stopped at step 1 blaming the learning rate) is named in one
    warning and written again; the run gets the same tokens."""
    cache = tmp_path / "cache"
    first = load_text("text", str(corpus), str(cache), False)
    tokens, folder = np.asarray(first.train).copy(), first.token_dir
    del first
    if damage == "cut train.bin":
        with open(folder / "train.bin", "r+b") as f:
            f.truncate(1000)
    elif damage == "empty meta.json":
        (folder / "meta.json").write_text("")
    elif damage == "no validation.bin":
        (folder / "validation.bin").unlink()
    else:
        with open(folder / "validation.bin", "r+b") as f:
            f.seek(600)
            f.write(np.uint16(60_000).tobytes())
    again = load_text("text", str(corpus), str(cache), False)
    np.testing.assert_array_equal(np.asarray(again.train), tokens)
    warned = [r.getMessage() for r in caplog.records if r.name == "data.text" and r.levelname == "WARNING"]
    assert len(warned) == 1 and warned[0].startswith(f"the token files in {folder} are damaged ("), warned
    if damage == "id outside":
        assert warned[0] == (
            f"the token files in {folder} are damaged (validation.bin holds token id 60000, outside the vocabulary "
            f"of 256); writing them again"
        )
    assert warned[0].endswith("); writing them again")
    assert [p.name for p in (cache / "text").iterdir()] == [folder.name]  # nothing moved aside is left


@pytest.mark.unit
def test_a_token_file_cut_while_a_run_reads_it_is_one_line(corpus, tmp_path):
    """Another process cutting a memory-mapped token file made the next read end the run with SIGBUS and no line:
    each batch first checks the mapped file's size (``check_mapped_size``); a cut file is one DataError naming it,
    and the same command then writes the token files anew."""
    cache = tmp_path / "cache"
    text = load_text("text", str(corpus), str(cache), False)
    source = WindowSource(text.train, 32, 8, seed=0)
    before = source.local_batch(0, slice(0, 8))
    path = text.token_dir / "train.bin"
    with open(path, "r+b") as f:  # as `truncate -s 1000 train.bin` from another shell
        f.truncate(1000)
    with pytest.raises(DataError) as e:
        source.local_batch(1, slice(0, 8))
    assert str(e.value) == (
        f"the token file {path} was cut to 1000 bytes (another process rewrote it?) while this run read its "
        f"{text.train.nbytes}; run the same command again: the token files are written anew"
    )
    again = load_text("text", str(corpus), str(cache), False)  # the same command: the files are written again
    np.testing.assert_array_equal(WindowSource(again.train, 32, 8, seed=0).local_batch(0, slice(0, 8))["image"],
                                  before["image"])  # fmt: skip


@pytest.mark.unit
def test_a_token_id_outside_the_vocabulary_in_a_batch_is_one_line_and_the_files_are_written_again(
    corpus, tmp_path, monkeypatch
):
    """Token files too large to read whole at the start (``FULL_CHECK_BYTES``) are checked batch by batch: a window
    holding an id outside the tokenizer's is one DataError naming the file (not NaN at step 1), and the same command
    then writes the files anew."""
    import data.text

    cache = tmp_path / "cache"
    first = load_text("text", str(corpus), str(cache), False)
    path, tokens = first.token_dir / "train.bin", np.asarray(first.train).copy()
    del first
    damaged = tokens.astype(np.uint16)
    damaged[::50] = 300
    damaged.tofile(path)
    monkeypatch.setattr(data.text, "FULL_CHECK_BYTES", 0)
    text = load_text("text", str(corpus), str(cache), False)
    source = WindowSource(text.train, 32, 8, seed=0)
    source.tokenizer = text.tokenizer
    with pytest.raises(DataError) as e:
        source.local_batch(0, slice(0, 8))
    assert str(e.value) == (
        f"the token file {path} holds token id 300, outside the tokenizer's 256 ids (damaged after it was "
        f"written); run the same command again: the token files are written anew"
    )
    again = load_text("text", str(corpus), str(cache), False)
    np.testing.assert_array_equal(np.asarray(again.train), tokens)


def _word_level(tmp_path: Path, vocab: dict, unk: Optional[str]) -> Path:
    """A Hugging Face WordLevel tokenizer.json of ``vocab`` (whitespace pre-tokenizer; ``unk``: its unknown token)."""
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "word_level.json"
    tok.save(str(path))
    return path


def test_a_tokenizer_that_cannot_encode_the_text_is_one_line_and_writes_nothing(corpus, tmp_path):
    """A WordLevel tokenizer without an unknown token fails on a word outside its vocabulary (a 34-line traceback
    of the library's plain Exception before): one line naming the file, the reason and the fix, exit 1, in the run
    folder only what a refused run leaves, and no token folder in the cache."""
    from utils import run_train

    path = _word_level(tmp_path, {"the": 0, "to": 1}, None)
    run = tmp_path / "run"
    r = run_train(
        run, "model=gpt", "data=text", f"data.path={corpus}", f"data.tokenizer_file={path}",
        f"data.cache_dir={tmp_path / 'cache'}", "wandb=disabled", timeout=300,
    )  # fmt: skip
    assert r.returncode == 1
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("error:")] == [
        f"error: data.tokenizer_file={path} cannot encode the text (WordLevel error: Missing [UNK] token from the "
        f"vocabulary); its vocabulary lacks words of the text and it has no unknown token: set its model's unk_token "
        f"to a token of its vocabulary, or leave data.tokenizer_file out and set data.tokenizer=bpe (a byte-level "
        f"BPE encodes any text)"
    ], r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert sorted(p.name for p in run.iterdir()) == [".hydra", ".lock", "summary.json", "train.log"]
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"
    assert list((tmp_path / "cache" / "text").iterdir()) == []


@pytest.mark.unit
def test_a_tokenizer_mapping_much_of_the_text_to_its_unknown_token_is_warned_with_the_figures(corpus, tmp_path, caplog):
    """A tokenizer whose vocabulary misses most words of the text trained silently and reported 93% accuracy (it
    predicted the unknown token): one warning with the share, the counts, the token and the file, and the share in
    the summary (``data/unknown_token_share``); recorded with the token files, the same on a second load. A
    tokenizer with gaps in its ids counts its vocabulary to its largest id (its tokens were outside the model's)."""
    from data.load import text_info
    from data.text import UNKNOWN_SHARE

    path = _word_level(tmp_path, {"[UNK]": 0, "the": 1, "and": 2, "to": 3, "of": 700}, "[UNK]")
    for attempt in ("written", "cached"):
        caplog.clear()
        text = load_text("text", str(corpus), str(tmp_path / "cache"), False, tokenizer_file=str(path))
        ids = np.concatenate([np.asarray(text.train), np.asarray(text.validation)])
        unknown = int((ids == 0).sum())
        assert text.tokenizer.vocab_size == 701 and int(ids.max()) == 700
        assert text.unknown_tokens == unknown and text.unknown_share == unknown / len(ids) > 0.8
        warned = [r.getMessage() for r in caplog.records if r.name == "data.text" and r.levelname == "WARNING"]
        assert warned == [
            f"{100 * unknown / len(ids):.1f}% of the text's tokens ({unknown} of {len(ids)}) are the unknown token "
            f"'[UNK]' of data.tokenizer_file={path}: the model learns to predict it, and its accuracy and eval/bpb "
            f"count a predicted '[UNK]' as the text it replaced, so they do not measure this text; give a tokenizer "
            f"whose vocabulary covers the text, or leave data.tokenizer_file out and set data.tokenizer=bpe (a "
            f"byte-level BPE has no unknown token)"
        ], attempt
    assert text_info(text, type("Eval", (), {"bytes_per_token": 1.0}))["data/unknown_token_share"] == (
        unknown / len(ids)
    )
    caplog.clear()  # a BPE has no unknown token; below the threshold, no warning
    bpe = load_text("text", str(corpus), str(tmp_path / "cache"), False, tokenizer="bpe", vocab_size=300)
    assert bpe.tokenizer.unk_id is None and bpe.unknown_tokens == 0 and UNKNOWN_SHARE == 0.01
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    with pytest.raises(DataError) as e:  # (it said "does not exist")
        load_tokenizer_file(tmp_path)
    assert str(e.value) == (
        f"data.tokenizer_file={tmp_path} is a folder; give a tokenizer.json (Hugging Face tokenizers' format)"
    )


@pytest.mark.unit
def test_a_file_that_is_not_a_tokenizer_json_says_what_it_is_and_the_fix(corpus, tmp_path):
    """A transformers ``tokenizer_config.json`` (JSON without a ``model`` key) was refused with a JSON parse error
    ("expected `,` or `}`") and no fix; a tokenizer.json cut short had no fix either. The line says what the file
    is and ends with the fix, which, followed (data.tokenizer=bpe), loads the corpus."""
    fix = (
        "give a tokenizer.json (Hugging Face tokenizers' format), or leave data.tokenizer_file out and set "
        "data.tokenizer=bpe"
    )
    config, cut, other, good = (tmp_path / n for n in ("tokenizer_config.json", "cut.json", "other.json", "t.json"))
    config.write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer", "model_max_length": 1024, "bos_token": "<s>"}))
    good.write_text(train_bpe(text_pieces([TEXT * 20]), 280).to_json())
    cut.write_text(good.read_text()[:100])
    other.write_text(json.dumps({"vocab": {"a": 0}, "merges": []}))
    said = {
        config: "is a tokenizer_config.json of transformers (its settings, without the vocabulary and merges), not "
        "a tokenizer.json",
        cut: f"is not JSON, so not a tokenizer.json ({_json_error(cut)})",
        other: "is JSON without the 'model' key a tokenizer.json has (its keys: vocab, merges), not a tokenizer.json",
    }
    for path, why in said.items():
        with pytest.raises(DataError) as e:
            load_text("text", str(corpus), str(tmp_path / "cache"), False, tokenizer_file=str(path))
        assert str(e.value) == f"data.tokenizer_file={path} {why}; {fix}"
    text = load_text("text", str(corpus), str(tmp_path / "cache"), False, tokenizer="bpe", vocab_size=300)
    assert text.tokenizer.name != "bytes" and len(text.train) > 0
    assert load_tokenizer_file(good).vocab_size == 280


def _json_error(path: Path) -> str:
    try:
        json.loads(path.read_text())
    except ValueError as e:
        return str(e)
    raise AssertionError(f"{path} parses")


@pytest.mark.unit
def test_a_tokenizer_that_drops_text_outside_its_vocabulary_is_warned_with_the_figures(corpus, tmp_path, caplog):
    """A BPE of nine letters and no unknown token silently dropped every other character (eval/bpb was not the
    text's, data/unknown_token_share 0.0): one warning with the share and the bytes its tokens stand for (eval/bpb's
    byte table, counted when the token files are written and kept in meta.json), the share in the summary
    (``data/dropped_text_share``); followed (data.tokenizer=bpe), nothing is dropped and nothing warned."""
    import tokenizers

    from data.load import text_info

    letters = "etaoinshr"
    path = tmp_path / "letters.json"
    tokenizers.Tokenizer(tokenizers.models.BPE({c: i for i, c in enumerate(letters)}, [])).save(str(path))
    raw = b"".join(f.read_bytes() for f in corpus_files(str(corpus)))
    kept = sum(raw.count(c.encode()) for c in letters)  # each letter a token of one byte; the rest dropped
    visible = len(raw.translate(None, b" \t\n\r\x0b\x0c"))  # (whitespace is not compared)
    for attempt in ("written", "cached"):
        caplog.clear()
        text = load_text("text", str(corpus), str(tmp_path / "cache"), False, tokenizer_file=str(path))
        assert text.unknown_tokens == 0 and len(text.train) + len(text.validation) == kept < 0.6 * len(raw)
        assert text.covered_bytes == kept and text.text_bytes == visible and len(raw) - visible > 5_000
        warned = [r.getMessage() for r in caplog.records if r.name == "data.text" and r.levelname == "WARNING"]
        assert warned == [
            f"data.tokenizer_file={path} drops {100 * (1 - kept / visible):.1f}% of the text: its tokens stand for "
            f"{kept} of the text's {visible} bytes other than whitespace (the rest is text its vocabulary has no "
            f"token for), so the model never sees that text and eval/bpb is not this text's; give a tokenizer whose "
            f"vocabulary covers the text, or leave data.tokenizer_file out and set data.tokenizer=bpe (a byte-level "
            f"BPE encodes any text)"
        ], attempt
    meta = json.loads((text.token_dir / "meta.json").read_text())
    assert meta["train_covered_bytes"] + meta["validation_covered_bytes"] == kept
    assert meta["train_text_bytes"] + meta["validation_text_bytes"] == visible
    info = text_info(text, type("Eval", (), {"bytes_per_token": 1.0}))
    assert info["data/dropped_text_share"] == 1 - kept / visible and info["data/unknown_token_share"] == 0.0
    caplog.clear()
    bpe = load_text("text", str(corpus), str(tmp_path / "cache"), False, tokenizer="bpe", vocab_size=300)
    assert bpe.covered_bytes == bpe.text_bytes == visible and bpe.dropped_share == 0.0
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    # a SentencePiece-style tokenizer (Metaspace: a token decoded alone loses its leading space) drops nothing
    sp = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    sp.pre_tokenizer, sp.decoder = tokenizers.pre_tokenizers.Metaspace(), tokenizers.decoders.Metaspace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"], show_progress=False)
    sp.train_from_iterator([raw.decode()], trainer)
    sp.save(str(tmp_path / "sp.json"))
    caplog.clear()
    text = load_text("text", str(corpus), str(tmp_path / "cache"), False, tokenizer_file=str(tmp_path / "sp.json"))
    assert text.unknown_tokens == 0 and text.covered_bytes == text.text_bytes == visible
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


@pytest.mark.unit
def test_a_stopped_writer_leaves_no_temporary_folder(corpus, tmp_path, monkeypatch):
    """A signal while the token files are written (a KeyboardInterrupt in the tokenizer's loop) removes this
    process's temporary folder; one left by a process that no longer runs (kill -9) goes at the next write, one of
    a live process stays."""
    import os
    import socket

    cache = tmp_path / "cache"

    def stopped(self, pieces):
        raise KeyboardInterrupt

    monkeypatch.setattr(ByteTokenizer, "encode_pieces", stopped)
    with pytest.raises(KeyboardInterrupt):
        load_text("text", str(corpus), str(cache), False)
    assert list((cache / "text").iterdir()) == []
    monkeypatch.undo()
    dead = next(p for p in range(4_194_303, 0, -1) if not Path(f"/proc/{p}").exists())  # no such process
    host = socket.gethostname()
    first = load_text("text", str(corpus), str(cache), False)
    name = first.token_dir.name
    del first
    for pid in (dead, os.getppid()):
        (cache / "text" / f"{name}.tmp-{host}-{pid}").mkdir()
    (cache / "text" / name / "meta.json").write_text("")  # damaged: the next load writes again
    load_text("text", str(corpus), str(cache), False)
    assert sorted(p.name for p in (cache / "text").iterdir()) == [name, f"{name}.tmp-{host}-{os.getppid()}"]


@pytest.mark.unit
def test_a_tokenizer_file_other_than_the_checkpoints_is_refused(tmp_path):
    """A resume uses the tokenizer saved with its checkpoint; a ``data.tokenizer_file`` that differs from it was
    ignored without a word (the run continued on the saved one): one line naming both; the same file is fine."""
    from data.text import choose_tokenizer

    pieces = text_pieces([TEXT * 20])
    saved, other = tmp_path / "saved.json", tmp_path / "other.json"
    saved.write_text(train_bpe(pieces, 300).to_json())
    other.write_text(train_bpe(pieces, 280).to_json())
    choose = lambda given: choose_tokenizer(  # noqa: E731
        "bpe", 4096, given, str(tmp_path / "cache"), lambda: "x", lambda: pieces, saved=saved
    )
    with pytest.raises(DataError) as e:
        choose(str(other))
    assert str(e.value) == (
        f"data.tokenizer_file={other} is not the tokenizer the checkpoint was trained with (saved as {saved}); "
        f"leave data.tokenizer_file out to continue with the saved one, or start afresh with another checkpoint.dir"
    )
    same = tmp_path / "same.json"
    same.write_text(saved.read_text())
    assert choose(str(same)).fingerprint == choose(None).fingerprint == load_tokenizer_file(saved).fingerprint


@pytest.mark.unit
def test_model_vocabulary_follows_the_tokenizer_and_bpb(corpus, tmp_path):
    """``model.vocab_size`` null follows a BPE (set larger: kept; smaller: refused in one line); the evaluation
    set's bytes per token are the UTF-8 bytes of its target tokens (byte tokens: 1), the factor of eval/bpb."""
    from data.load import text_corpus
    from training.build import with_text_vocab

    base = {"model": {"name": "gpt", "context": 32}, "data": {"name": "text", "path": str(corpus)}}
    cfg = make_cfg({**base, "data": {**base["data"], "tokenizer": "bpe", "vocab_size": 300}})
    cfg.data.cache_dir = str(tmp_path / "cache")
    text = text_corpus(cfg.data)
    resolved = with_text_vocab(cfg, text.tokenizer)
    assert resolved.model.vocab_size == text.tokenizer.vocab_size == 300
    source, evalset = load_data(resolved, plan(resolved), text)
    labels = evalset.labels.reshape(-1)
    assert evalset.bytes_per_token == len(text.tokenizer.decode(labels).encode("utf-8")) / labels.size
    assert evalset.bytes_per_token > 1.2 and source.tokenizer is text.tokenizer
    larger = make_cfg({**base, "model": {**base["model"], "vocab_size": 512}, "data": cfg.data.__dict__})
    assert with_text_vocab(larger, text.tokenizer).model.vocab_size == 512
    smaller = make_cfg({**base, "model": {**base["model"], "vocab_size": 280}, "data": cfg.data.__dict__})
    with pytest.raises(
        ConfigError, match=r"^model\.vocab_size=280 is smaller than the 300 tokens of data\.tokenizer=bpe"
    ):
        load_data(smaller, plan(smaller), text)
    plain = make_cfg(base)
    plain.data.cache_dir = str(tmp_path / "cache")
    _, byte_eval = load_data(plain, plan(plain))
    assert byte_eval.bytes_per_token == 1.0 and with_text_vocab(plain, ByteTokenizer()) is plain


# ---- whole runs --------------------------------------------------------------------------------------------
def gpt_run(tmp_path: Path, name: str, data: dict, **train) -> tuple[Path, dict]:
    from training.run import run_and_report

    run = tmp_path / name
    run.mkdir()
    cfg = make_cfg(
        {
            "model": {"name": "gpt", "size": "tiny", "depth": 1, "width": 32, "heads": 2, "context": 32},
            "data": {"name": "text", "cache_dir": str(tmp_path / "cache"), **data},
            "mesh": {"devices": 1},
            "optim": {"lr": 3e-3},
            "wandb": {"mode": "disabled"},
            "checkpoint": {"dir": str(tmp_path / f"ckpt_{name}"), "every": 2},
            "train": {"steps": 4, "log_every": 2, "eval_batch": 64, "global_batch": 8, **train},
        }
    )
    assert run_and_report(cfg, run)
    return run, json.loads((run / "summary.json").read_text())


def losses(run: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in recs if "train/loss" in r}


@pytest.mark.unit
def test_a_bpe_run_saves_its_tokenizer_for_sample_evaluate_and_a_tokenizer_file_run(corpus, tmp_path, capsys):
    """A BPE run reports eval/bpb (= eval/loss x tokens / bytes / ln 2) and train/bpb, and saves tokenizer.json in
    the run and checkpoint folders; ``python -m evaluate`` gives the run's numbers, ``python -m sample`` encodes
    and decodes with it; a run given that file as ``data.tokenizer_file`` trains on the very same token files."""
    import evaluate
    import sample

    run, s = gpt_run(tmp_path, "bpe", {"path": str(corpus), "tokenizer": "bpe", "vocab_size": 320}, sample_tokens=20)
    ckpt = tmp_path / "ckpt_bpe"
    assert (s["data/tokenizer"], s["data/tokenizer_vocab_size"], s["model/vocab_size"]) == ("bpe", 320, 320)
    assert s["eval/bpb"] == pytest.approx(s["eval/loss"] / math.log(2) / s["data/eval_bytes_per_token"], rel=1e-12)
    assert s["train/bpb"] == pytest.approx(s["train/loss"] / math.log(2) / s["data/train_bytes_per_token"], rel=1e-12)
    assert 1.2 < s["data/eval_bytes_per_token"] < 4 and s["eval/bpb"] < s["eval/loss"] / math.log(2)
    saved = (run / "tokenizer.json").read_text()
    assert (ckpt / "tokenizer.json").read_text() == saved and checkpoint.complete_steps(ckpt) == [2, 4]
    assert checkpoint.read_metadata(ckpt / "4")["config"]["model"]["vocab_size"] == 320
    out = evaluate.evaluate_checkpoint(ckpt)
    for key in ("eval/loss", "eval/bpb"):
        assert out[key] == pytest.approx(s[key], rel=1e-6)
    step_dir = sample.find_checkpoint(ckpt)
    tokenizer = sample.load_tokenizer(step_dir)
    assert tokenizer.fingerprint == load_tokenizer_file(run / "tokenizer.json").fingerprint
    text = sample.sample_text(sample.load_model(step_dir), "JULIET: café", 12, tokenizer=tokenizer)
    assert text.startswith("JULIET: café") and len(text) > len("JULIET: café")
    assert sample.main([str(ckpt), "--prompt", "ROMEO:", "--tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("ROMEO:")
    assert isinstance(s["sample/text"], str)
    # the saved tokenizer.json as data.tokenizer_file: the same tokenizer, hence the same token files
    _, f = gpt_run(tmp_path, "file", {"path": str(corpus), "tokenizer_file": str(run / "tokenizer.json")})
    assert (f["data/token_dir"], f["data/tokenizer_vocab_size"], f["model/vocab_size"]) == (
        s["data/token_dir"],
        320,
        320,
    )
    assert losses(tmp_path / "file") == losses(run)  # the same tokens, model and batches: the same losses


@pytest.mark.unit
def test_the_memory_mapped_corpus_resumes_exactly(corpus, tmp_path):
    """4 steps, then the same run to 8 from its checkpoint: the losses of steps 5-8 are bitwise those of an
    uninterrupted 8-step run (the batches are a pure function of (seed, step, row), read from the token file)."""
    data = {"path": str(corpus)}
    straight, _ = gpt_run(tmp_path, "straight", data, steps=8)
    first, _ = gpt_run(tmp_path, "first", data, steps=4)
    import shutil

    shutil.copytree(tmp_path / "ckpt_first", tmp_path / "ckpt_resumed")
    from training.run import run_and_report

    (tmp_path / "resumed").mkdir()
    cfg = make_cfg(
        {
            "model": {"name": "gpt", "size": "tiny", "depth": 1, "width": 32, "heads": 2, "context": 32},
            "data": {"name": "text", "cache_dir": str(tmp_path / "cache"), **data},
            "mesh": {"devices": 1},
            "optim": {"lr": 3e-3},
            "wandb": {"mode": "disabled"},
            "checkpoint": {"dir": str(tmp_path / "ckpt_resumed"), "every": 2},
            "train": {"steps": 8, "log_every": 2, "eval_batch": 64, "global_batch": 8},
        }
    )
    assert run_and_report(cfg, tmp_path / "resumed")
    summary = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert summary["checkpoint/resumed_step"] == 4
    want, got = losses(straight), losses(tmp_path / "resumed")
    assert sorted(got) == list(range(1, 9)) and all(got[s] == want[s] for s in range(1, 9)), (got, want)
    assert summary["eval/loss"] == json.loads((straight / "summary.json").read_text())["eval/loss"]


# (~25 s: 3 processes; CI runs it, not the in-process unit tier)
def test_two_processes_read_the_token_file_as_one(corpus, tmp_path):
    """2 processes x 4 devices (scripts/launch_local.py) == 1 process x 8 devices on the memory-mapped corpus of a
    BPE: the same losses and evaluation. The two processes start with an empty cache of their own, so both train
    the BPE and write the token files at once (atomic renames: one folder, the same tokens), then each reads its
    rows of every window from the memory-mapped file."""
    from test_multihost import clean_env, finish, per_step, start

    common = [
        "model=gpt",
        "model.depth=1",
        "model.width=32",
        "model.heads=2",
        "model.context=32",
        "data=text",
        f"data.path={corpus}",
        "data.tokenizer=bpe",
        "data.vocab_size=300",
        "precision=fp32",
        "train.steps=6",
        "train.global_batch=16",
        "train.log_every=2",
        "train.eval_batch=64",
        "checkpoint.enabled=false",
    ]
    env = clean_env(tmp_path)
    one = start(
        ["train.py", f"hydra.run.dir={tmp_path / 'one'}", "runtime.cpu_devices=8", f"data.cache_dir={tmp_path / 'c1'}"]
        + common,
        env,
        tmp_path / "one.txt",
    )
    code, out = finish(one, tmp_path / "one.txt", 600)
    assert code == 0, out[-3000:]
    launcher = [str(REPO / "scripts" / "launch_local.py"), "-n", "2", "--cpu-devices", "4", "--timeout-s", "120"]
    two = start(
        [*launcher, f"hydra.run.dir={tmp_path / 'two'}", f"data.cache_dir={tmp_path / 'c2'}", *common],
        env,
        tmp_path / "two.txt",
    )
    code, out = finish(two, tmp_path / "two.txt", 600)
    assert code == 0, out[-3000:]
    a, b = per_step(tmp_path / "one", "train/loss"), per_step(tmp_path / "two", "train/loss")
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert max(abs(a[s] - b[s]) for s in a) <= 1e-5
    s1, s2 = (json.loads((tmp_path / r / "summary.json").read_text()) for r in ("one", "two"))
    assert (s1["process_count"], s2["process_count"]) == (1, 2)
    assert Path(s1["data/token_dir"]).name == Path(s2["data/token_dir"]).name  # the same corpus and tokenizer
    assert [p.name for p in (tmp_path / "c2" / "text").iterdir()] == [Path(s2["data/token_dir"]).name]  # no tmp
    assert abs(s1["eval/loss"] - s2["eval/loss"]) <= 1e-5 and abs(s1["eval/bpb"] - s2["eval/bpb"]) <= 1e-5


@pytest.mark.unit
def test_a_text_too_short_for_its_batch_or_its_evaluation_is_warned_with_the_figures(caplog):
    """A 1,500-byte corpus trained silently (before): its train split (1,350 bytes) is smaller than one step's batch
    of 256 x 128 tokens, and its validation split holds one window. One warning each, with the figures; none for
    Tiny Shakespeare's splits, nor for a validation split the user capped (``data.eval_windows``)."""
    import types

    from data.load import MIN_EVAL_WINDOWS, small_text_warnings

    d = types.SimpleNamespace(path="small.txt", name="text", eval_windows=None)
    small_text_warnings(d, 1_350, 150, 128, 256, "bytes")
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "the train split of data.path=small.txt has 1,350 bytes, fewer than one step's batch of 256 x 128 = 32,768: "
        "every step sees each of them about 24 times and the model memorises them; give a longer text, or a smaller "
        "train.global_batch or model.context",
        "the validation split of data.path=small.txt holds 1 window(s) of model.context=128 (150 bytes): eval/loss "
        "and eval/accuracy rest on them alone, too few to compare runs by; give a longer text (its last 10% is the "
        "validation split)",
    ]
    caplog.clear()
    small_text_warnings(d, 1_003_854, 55_770, 128, 256, "bytes")  # Tiny Shakespeare: 435 validation windows
    small_text_warnings(d, 32_768, MIN_EVAL_WINDOWS * 128 + 1, 128, 256, "bytes")  # exactly one batch; 10 windows
    d.eval_windows = 1
    small_text_warnings(d, 1_003_854, 150, 128, 256, "bytes")
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


@pytest.mark.unit
def test_a_bpe_that_learns_fewer_tokens_than_asked_is_warned_when_trained_and_when_cached(tmp_path, caplog):
    """``data.vocab_size=30000`` on 20 kB of Tiny Shakespeare: the BPE learned 2,540 tokens and the model used 2,540
    silently (a sweep over ``data.vocab_size`` would compare the same vocabulary). One warning with both figures,
    trained or read from the cache; none when the text gives every token asked for."""
    from data.tokens import cached_bpe

    text = TEXT * 50
    for attempt in ("trained", "cached"):
        caplog.clear()
        bpe = cached_bpe(str(tmp_path), "f" * 32, 30_000, lambda: [text])
        assert 256 < bpe.vocab_size < 30_000
        assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
            f"data.vocab_size=30000: the BPE learned only {bpe.vocab_size} tokens from this text (it holds no more "
            f"merges); the model's vocabulary is {bpe.vocab_size}, and a larger data.vocab_size gives the same "
            f"tokenizer"
        ], attempt
    caplog.clear()
    assert cached_bpe(str(tmp_path), "f" * 32, 300, lambda: [text]).vocab_size == 300
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
