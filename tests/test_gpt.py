"""The GPT language model (model=gpt) and its text data: model shapes and checks, data splits and windows,
every parallel mode equal to one device, accumulation, exact resume, communication and FSDP state bytes.

The in-process runs use ``model.size=tiny`` (4 layers, 128 wide, 4 heads) with a shorter context (32 tokens)
and a small batch so that each compiles and runs in seconds on 8 simulated CPU devices.
"""

from __future__ import annotations

import functools
import gzip
from pathlib import Path
import json
import math
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.errors import ConfigError, DataError
from core.step import METRIC_SUM_BYTES
from data.text import (
    SHARED_TINY_SHAKESPEARE,
    WindowSource,
    byte_tokens,
    eval_windows,
    load_text_splits,
    tfds_splits,
)
from measure.compiled import compiled_step_metrics, state_bytes_per_device
from models import build_model
from models.gpt import flops_per_token, param_count_of, resolve_dims
from parallel.state import metrics_to_host, state_to_host
from training import checkpoint
from training.build import build, plan
from training.build import load_data
from utils import assert_matches_reference, make_cfg, max_abs_diff, run_train

CONTEXT = 32
GLOBAL_BATCH = 16
STEPS = 8
TOL = {"sgd": 1e-6, "adam": 5e-5}  # the MLP's margins (tests/test_equivalence.py)
LR = {"sgd": 0.1, "adam": 1e-3}
TOKENS = byte_tokens(
    "".join(f"{i} the quick brown fox jumps over the lazy dog {i * i}\n" for i in range(400))
)  # ~21k bytes of learnable text
TINY_PARAMS = 842_496  # size tiny, context 128 (the position table: 128 x 128)


def gpt_cfg(**overrides):
    base = {
        "model": {"name": "gpt", "size": "tiny", "context": CONTEXT},
        "data": {"name": "synthetic"},
        "train": {"global_batch": GLOBAL_BATCH},
    }
    return make_cfg(base, **overrides)


def run_lm_steps(cfg, steps: int = STEPS, tokens=TOKENS):
    """Like ``utils.run_steps`` for the GPT: windows of ``tokens`` (``data.text.WindowSource``)."""
    p = plan(cfg)
    exp = build(p)
    initial = state_to_host(exp.state)
    source = WindowSource(tokens, cfg.model.context or CONTEXT, p.global_batch, cfg.train.seed)
    layout = exp.mode.batch_layout()
    rows = layout.local_rows(p.global_batch)
    state, losses = exp.state, []
    for s in range(steps):
        state, m = exp.steps.train(state, layout.place(source.local_batch(s, rows), p.global_batch))
        losses.append(float(metrics_to_host(m)["train/loss"]))
        jax.block_until_ready(m)
    exp.state = state
    return np.asarray(losses), state_to_host(state), exp, initial


_reference: dict = {}


def reference(opt: str):
    if opt not in _reference:
        _reference[opt] = run_lm_steps(gpt_cfg(optim__name=opt, optim__lr=LR[opt], mesh__devices=1))
    return _reference[opt]


# ---- model ---------------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_presets_and_parameter_counts():
    """Parameter counts of the presets from the closed form, checked against the built tiny model; GPT-2 small
    is the 124M model (tied embeddings, vocabulary 50257, context 1024)."""
    model = build_model("gpt", (), 0, seed=0, size="tiny", width=None, depth=None, heads=None)
    n = sum(x.size for x in jax.tree.leaves(nnx_params(model)))
    assert n == param_count_of(resolve_dims("tiny")) == TINY_PARAMS
    untied = build_model("gpt", (), 0, seed=0, size="tiny", width=None, depth=None, heads=None, tied_embeddings=False)
    assert sum(x.size for x in jax.tree.leaves(nnx_params(untied))) == TINY_PARAMS + 256 * 128
    assert param_count_of(resolve_dims("gpt2_small")) == 124_439_808  # GPT-2 small (HF: 124,439,808)
    assert param_count_of(resolve_dims("gpt2_medium")) == 354_823_168  # GPT-2 medium (HF: 354,823,168)
    assert 1.2e9 < param_count_of(resolve_dims("1b")) < 1.4e9
    # PaLM appendix B: 6N + 12 L d T
    assert flops_per_token(124_439_808, 12, 768, 1024) == 6 * 124_439_808 + 12 * 12 * 768 * 1024


def nnx_params(model):
    from flax import nnx

    return nnx.state(model, nnx.Param)


@pytest.mark.unit
def test_logits_are_causal_and_remat_changes_nothing():
    """Changing token t changes no logit before t; remat full / dots_saveable give the same loss and gradients."""
    from flax import nnx

    kw = dict(size="tiny", width=None, depth=None, heads=None, context=16)
    model = build_model("gpt", (), 0, seed=0, **kw)
    x = jnp.asarray(TOKENS[:32].reshape(2, 16))
    y = jnp.asarray(TOKENS[1:33].reshape(2, 16))
    logits = model(x)
    assert logits.shape == (2, 16, 256) and logits.dtype == jnp.float32
    changed = model(x.at[:, 9].set((x[:, 9] + 1) % 256))
    np.testing.assert_array_equal(np.asarray(logits[:, :9]), np.asarray(changed[:, :9]))
    assert float(jnp.max(jnp.abs(logits[:, 9:] - changed[:, 9:]))) > 0

    def loss_and_grads(remat):
        m = build_model("gpt", (), 0, seed=0, remat=remat, **kw)
        graphdef, params = nnx.split(m, nnx.Param)

        def loss(p):
            out = nnx.merge(graphdef, p)(x)
            return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(out), y[..., None], -1))

        return jax.value_and_grad(loss)(params)

    ref_loss, ref_grads = loss_and_grads("none")
    for remat in ("full", "dots_saveable"):
        l, g = loss_and_grads(remat)
        assert abs(float(l) - float(ref_loss)) < 1e-6
        assert max_abs_diff(g, ref_grads) < 1e-6


@pytest.mark.unit
@pytest.mark.parametrize(
    "model,message",
    [
        ({"heads": 5}, r"^model\.heads=5 does not divide model\.width=128; choose heads among"),
        (
            {"context": 256, "max_positions": 128},
            r"^model\.context=256 is longer than the position table model\.max_positions=128; lower model\.context "
            r"or raise model\.max_positions to at least 256$",
        ),
        ({"size": "huge"}, r"^model\.size='huge' is unknown; choose one of tiny, gpt2_small, gpt2_medium, 1b$"),
        ({"width": 0}, r"^model\.width=0 is out of range"),
    ],
)
def test_bad_dimensions_are_one_line(model, message):
    with pytest.raises(ConfigError, match=message):
        plan(make_cfg({"model": {"name": "gpt", **model}, "data": {"name": "synthetic"}}))


@pytest.mark.unit
def test_unknown_remat_policy_is_refused_by_the_schema():
    from conf.schema import ConfigInputError

    with pytest.raises(
        ConfigInputError, match=r"model\.remat.*not a valid choice; choose one of none, full, dots_saveable"
    ):
        make_cfg({"model": {"name": "gpt", "remat": "some"}})


# ---- data ----------------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_tiny_shakespeare_splits_match_tfds():
    """TFDS tiny_shakespeare: 90% / 5% / 5% by characters (1,003,854 / 55,770 / 55,770)."""
    if not SHARED_TINY_SHAKESPEARE.exists():
        pytest.fail(f"the shared copy of Tiny Shakespeare is missing: {SHARED_TINY_SHAKESPEARE}")
    text = SHARED_TINY_SHAKESPEARE.read_text()
    train, validation, test = tfds_splits(text)
    assert (len(train), len(validation), len(test)) == (1_003_854, 55_770, 55_770)
    assert train + validation + test == text
    tr, va = load_text_splits("tiny_shakespeare", None, "/nonexistent", download=False)
    assert tr.dtype == np.int32 and len(tr) == 1_003_854 and len(va) == 55_770
    assert bytes(va[:20].astype(np.uint8)) == validation[:20].encode()


@pytest.mark.unit
def test_windows_are_a_function_of_seed_step_and_row():
    tokens = np.arange(1000, dtype=np.int32)
    src = WindowSource(tokens, 10, 8, seed=3)
    whole = src.local_batch(5, slice(0, 8))
    assert whole["image"].shape == whole["label"].shape == (8, 10)
    np.testing.assert_array_equal(whole["label"][:, :-1], whole["image"][:, 1:])  # targets = inputs shifted by 1
    np.testing.assert_array_equal(whole["image"][:, 1:] - whole["image"][:, :-1], 1)  # contiguous windows
    halves = [src.local_batch(5, slice(0, 4)), WindowSource(tokens, 10, 8, seed=3).local_batch(5, slice(4, 8))]
    for key in ("image", "label", "index"):  # any process split reads the same global batch
        np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), whole[key])
    np.testing.assert_array_equal(whole["index"], 5 * 8 + np.arange(8))
    assert not np.array_equal(src.local_batch(6, slice(0, 8))["image"], whole["image"])
    assert not np.array_equal(WindowSource(tokens, 10, 8, seed=4).local_batch(5, slice(0, 8))["image"], whole["image"])
    assert int(whole["label"].max()) <= 999  # windows never run past the end


@pytest.mark.unit
def test_eval_windows_count_every_target_once():
    ds = eval_windows(np.arange(105, dtype=np.int32), 10)
    assert len(ds) == 10  # (105 - 1) // 10
    np.testing.assert_array_equal(ds.labels.reshape(-1), np.arange(1, 101))
    np.testing.assert_array_equal(ds.images.reshape(-1), np.arange(0, 100))


@pytest.mark.unit
def test_text_file_errors(tmp_path):
    cases = {
        "empty.txt": (b"", r"is empty"),
        "latin1.txt": ("caf\u00e9 ".encode("latin-1") * 100, r"is not UTF-8 \(byte 3: invalid continuation byte\)"),
    }
    for name, (raw, message) in cases.items():
        (tmp_path / name).write_bytes(raw)
        cfg = make_cfg({"model": {"name": "gpt"}, "data": {"name": "text", "path": str(tmp_path / name)}})
        with pytest.raises(DataError, match=rf"^data\.path={tmp_path / name} {message}"):
            load_data(cfg, plan(cfg))
    (tmp_path / "short.txt").write_text("to be or not to be " * 8)  # 152 bytes: validation 16 < one window
    cfg = make_cfg({"model": {"name": "gpt"}, "data": {"name": "text", "path": str(tmp_path / "short.txt")}})
    with pytest.raises(
        ConfigError,
        match=r"^the validation split of data\.path=.* has 16 bytes, not more than one window of model\.context=128",
    ):
        load_data(cfg, plan(cfg))
    cfg = make_cfg({"model": {"name": "gpt"}, "data": {"name": "text"}})
    with pytest.raises(DataError, match=r"^data=text needs data\.path=FILE"):
        load_data(cfg, plan(cfg))
    cfg = make_cfg({"model": {"name": "gpt"}, "data": {"name": "mnist"}})
    with pytest.raises(ConfigError, match=r"^model=gpt trains on text, not data=mnist"):
        load_data(cfg, plan(cfg))
    cfg = make_cfg({"data": {"name": "tiny_shakespeare"}})
    with pytest.raises(ConfigError, match=r"^data=tiny_shakespeare is text: train it with model=gpt"):
        load_data(cfg, plan(cfg))
    cfg = make_cfg({"model": {"name": "gpt", "vocab_size": 65}, "data": {"name": "tiny_shakespeare"}})
    with pytest.raises(ConfigError, match=r"^model\.vocab_size=65 is smaller than the 256 byte tokens"):
        load_data(cfg, plan(cfg))


def test_not_utf8_file_fails_in_one_line_with_a_failed_summary(tmp_path):
    """A UTF-16 file (its byte-order mark first) is told to convert from UTF-16, and the command the line gives
    writes a UTF-8 copy that loads."""
    bad = tmp_path / "bad.txt"
    text = "To be, or not to be, that is the question.\n" * 120
    bad.write_bytes(text.encode("utf-16"))  # a byte-order mark, then UTF-16LE
    run = tmp_path / "run"
    r = run_train(run, "model=gpt", "data=text", f"data.path={bad}", "wandb=disabled", timeout=300)
    assert r.returncode != 0
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    out = tmp_path / "bad.utf8.txt"
    assert errors == [
        f"error: data.path={bad} is UTF-16LE text, not UTF-8 (read as UTF-8 it would train on NUL bytes); convert "
        f"it: iconv -f UTF-16 -t UTF-8 {bad} > {out}, then pass data.path={out}"
    ], r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"
    assert not (run / "checkpoints").exists()
    _follow_the_conversion(errors[0], text)


def _follow_the_conversion(line: str, text: str) -> None:
    """Runs the ``iconv`` command of an encoding error line (a process: not for a ``unit`` test; Python's codec
    where iconv is missing), then loads the file it names: the UTF-8 copy holds ``text``."""
    import shlex
    import shutil
    import subprocess

    command, _, passed = line.partition(": iconv ")[2].partition(", then pass data.path=")
    args = shlex.split("iconv " + command)
    source, target = args[2], Path(args[-1])
    if shutil.which("iconv"):
        subprocess.run(" ".join(shlex.quote(a) if a != ">" else a for a in args), shell=True, check=True)
    else:  # the same conversion: iconv's UTF-16 / UTF-32 read and drop the byte-order mark, as Python's codecs
        target.write_text(Path(args[-3]).read_bytes().decode(source.lower()), encoding="utf-8")
    assert Path(passed) == target
    cfg = make_cfg({"model": {"name": "gpt"}, "data": {"name": "text", "path": passed}})
    train = load_data(cfg, plan(cfg))[0]
    assert bytes(train.tokens.astype(np.uint8)).decode() == text[: int(len(text) * 0.9)]  # data=text's train split


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "latin-1"])
def test_a_file_in_another_encoding_is_told_how_to_convert_it(tmp_path, encoding):
    """UTF-16 without a byte-order mark decodes as UTF-8 (ASCII letters and NUL bytes): it used to train on NUL
    bytes silently. Each encoding is named, and its conversion command, followed, gives a file that loads."""
    text = "To be, or not to be, that is the question. Caf\u00e9.\n" * 100
    path = tmp_path / "corpus.txt"
    path.write_bytes(text.encode(encoding))
    cfg = make_cfg({"model": {"name": "gpt"}, "data": {"name": "text", "path": str(path)}})
    with pytest.raises(DataError) as e:
        load_data(cfg, plan(cfg))
    out = tmp_path / "corpus.utf8.txt"
    named, source = {
        "utf-16": ("UTF-16LE", "UTF-16"),
        "utf-16-le": ("UTF-16LE", "UTF-16LE"),
        "utf-16-be": ("UTF-16BE", "UTF-16BE"),
        "utf-32": ("UTF-32LE", "UTF-32"),
        "latin-1": (None, "latin1"),
    }[encoding]
    if named:
        assert str(e.value) == (
            f"data.path={path} is {named} text, not UTF-8 (read as UTF-8 it would train on NUL bytes); convert it: "
            f"iconv -f {source} -t UTF-8 {path} > {out}, then pass data.path={out}"
        )
    else:
        assert str(e.value) == (
            f"data.path={path} is not UTF-8 (byte 46: invalid continuation byte); convert it from its encoding, e.g. "
            f"latin1: iconv -f latin1 -t UTF-8 {path} > {out}, then pass data.path={out}"
        )
    _follow_the_conversion(str(e.value), text)


def _run_advice(line: str) -> str:
    """Runs the command of an error line (between its last ``: `` before the command and ``, then pass ``) in a shell
    and returns the ``data.path`` the line says to pass (Hydra's quotes taken off)."""
    import shlex
    import subprocess

    assert shutil.which("iconv") and shutil.which("cp"), "the advice is a shell command of iconv and cp"
    head, _, passed = line.rpartition(", then pass ")
    command = head[head.index(": ", head.index("); ")) + 2 :]
    subprocess.run(command, shell=True, check=True)
    (value,) = shlex.split(passed)
    return value.removeprefix("data.path=").strip('"')


@pytest.mark.parametrize("encoding", ["utf-16", "latin-1"])
def test_a_file_of_a_folder_in_another_encoding_is_converted_into_a_copy_of_the_folder(tmp_path, encoding):
    """A file of a folder corpus in another encoding: the line names the file in the folder and converts it in a copy
    of the folder made of links (it used to convert it in place, over the original: on a read-only corpus that
    fails, and a binary file became "text"); followed, the copy loads both files and the corpus is unchanged."""
    import shlex

    folder = tmp_path / "my corpus"
    folder.mkdir()
    good, bad = "Good text, first file.\n" * 100, "To be, or not to be. Caf\u00e9.\n" * 100
    (folder / "a.txt").write_text(good, encoding="utf-8")
    (folder / "b.txt").write_bytes(bad.encode(encoding))
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    cfg = make_cfg({"model": {"name": "gpt"}, "data": {"name": "text", "path": str(folder)}})
    with pytest.raises(DataError) as e:
        load_data(cfg, plan(cfg))
    copy = tmp_path / "my corpus.utf8"
    source = {"utf-16": "UTF-16", "latin-1": "latin1"}[encoding]
    q = shlex.quote
    command = (
        f"cp -rsL {q(str(folder))} {q(str(copy))} && chmod -R u+w {q(str(copy))} && rm -f {q(str(copy / 'b.txt'))} && "
        f"iconv -f {source} -t UTF-8 {q(str(folder / 'b.txt'))} > {q(str(copy / 'b.txt'))}"
    )
    why = {
        "utf-16": "is UTF-16LE text, not UTF-8 (read as UTF-8 it would train on NUL bytes); convert it",
        "latin-1": "is not UTF-8 (byte 24: invalid continuation byte); convert it from its encoding, e.g. latin1,",
    }[encoding]
    assert str(e.value) == (
        f"{folder / 'b.txt'} in data.path={folder} {why} in a copy of the folder made of links to its files (the "
        f"corpus stays as it is): {command}, then pass 'data.path=\"{copy}\"'"  # (quoted: a space in the name)
    )
    assert _run_advice(str(e.value)) == str(copy)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # the corpus is as it was
    cfg.data.path = str(copy)
    train = load_data(cfg, plan(cfg))[0]
    text = good + bad
    assert bytes(train.tokens.astype(np.uint8)).decode() == text[: int(len(text) * 0.9)]


def test_paths_and_files_that_are_not_text_are_refused_as_such_and_a_copy_leaves_them_out(tmp_path):
    """A FIFO (reading it blocked for ever), a device, a broken link or a link loop is refused as what it is; a
    binary file is refused as binary (it was offered a latin1 conversion that made it "text"); in a folder every
    such file is named in one line whose copy of the folder leaves them out and converts the latin1 one; followed,
    the copy holds the text files only."""
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "broken").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "random.bin").write_bytes(np.random.default_rng(0).integers(0, 256, 50_000, np.uint8).tobytes())
    gz = tmp_path / "corpus.txt.gz"
    gz.write_bytes(gzip.compress(np.random.default_rng(1).integers(0, 256, 30_000, np.uint8).tobytes()))
    cases = {
        "fifo": "is a FIFO (named pipe), not a regular file; give a UTF-8 text file, a folder of them or a glob",
        "broken": f"is a broken symbolic link (to {tmp_path / 'nowhere'}); give a UTF-8 text file, a folder of them "
        "or a glob",
        "loop": "is a symbolic link loop, not a regular file; give a UTF-8 text file, a folder of them or a glob",
        "/dev/zero": "is a character device, not a regular file; give a UTF-8 text file, a folder of them or a glob",
        "random.bin": "is binary, not text (1 of its 50000 bytes from byte 0 are control codes, which text in no "
        "encoding holds); give a UTF-8 text file",
    }
    for name, message in cases.items():
        path = tmp_path / name
        cfg = make_cfg({"model": {"name": "gpt"}, "data": {"name": "text", "path": str(path)}})
        with pytest.raises(DataError) as e:
            load_data(cfg, plan(cfg))
        if name != "random.bin":
            assert str(e.value) == f"data.path={path} {message}"
        else:  # the count of control bytes is the random file's
            assert re.fullmatch(
                rf"data\.path={path} is binary, not text \(\d+ of its 50000 bytes from byte 0 are control codes, "
                r"which text in no encoding holds\); give a UTF-8 text file",
                str(e.value),
            ), str(e.value)
    cfg = make_cfg({"model": {"name": "gpt"}, "data": {"name": "text", "path": str(gz)}})
    with pytest.raises(DataError, match=rf"^data\.path={gz} is binary, not text \(a gzip file; \d+ of its "):
        load_data(cfg, plan(cfg))

    folder = tmp_path / "corpus"
    folder.mkdir()
    good, latin = "Good text, first file.\n" * 300, "Caf\u00e9 au lait.\n" * 100
    (folder / "a.txt").write_text(good)
    (folder / "b.txt").write_bytes(latin.encode("latin-1"))
    (folder / "c.bin").write_bytes((tmp_path / "random.bin").read_bytes())
    os.mkfifo(folder / "d.pipe")
    (folder / "e.txt").symlink_to(tmp_path / "nowhere")
    cfg = make_cfg({"model": {"name": "gpt"}, "data": {"name": "text", "path": str(folder)}})
    with pytest.raises(DataError) as e:
        load_data(cfg, plan(cfg))
    line = str(e.value)
    copy = tmp_path / "corpus.utf8"
    assert line.startswith(
        f"4 files in data.path={folder} are not UTF-8 text ({folder / 'b.txt'} is not UTF-8 (byte 3: invalid "
        f"continuation byte); {folder / 'c.bin'} is binary, not text ("
    ), line
    assert line.endswith(
        f"; and 1 more); convert them (text in another encoding, e.g. latin1) or leave them out (not text) in a copy "
        f"of the folder made of links to its files (the corpus stays as it is): {{ cp -rsL {folder} {copy} || "
        f"test -d {copy}; }} && chmod -R u+w {copy} && rm -f {copy / 'b.txt'} {copy / 'c.bin'} {copy / 'd.pipe'} "
        f"{copy / 'e.txt'} && iconv -f latin1 -t UTF-8 {folder / 'b.txt'} > {copy / 'b.txt'}, then pass "
        f"data.path={copy}"
    ), line
    assert _run_advice(line) == str(copy)
    assert sorted(p.name for p in folder.iterdir()) == ["a.txt", "b.txt", "c.bin", "d.pipe", "e.txt"]
    assert sorted(p.name for p in copy.iterdir()) == ["a.txt", "b.txt"]
    cfg.data.path = str(copy)
    train = load_data(cfg, plan(cfg))[0]
    text = good + latin
    assert bytes(train.tokens.astype(np.uint8)).decode() == text[: int(len(text) * 0.9)]


def test_a_folder_of_only_binary_files_is_told_it_holds_no_text_and_offered_no_copy(tmp_path):
    """Every file binary: the line offered a copy of the folder without them (and "convert them"), which, followed,
    was "a folder without files"; it says the folder holds no text and what to give."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in ("a.bin", "b.bin"):
        (folder / name).write_bytes(rng.integers(0, 256, 20_000, np.uint8).tobytes())
    cfg = make_cfg({"model": {"name": "gpt"}, "data": {"name": "text", "path": str(folder)}})
    with pytest.raises(DataError) as e:
        load_data(cfg, plan(cfg))
    assert re.fullmatch(
        rf"data\.path={folder} holds no text: none of its 2 files is text \({folder / 'a.bin'} is binary, not text "
        rf"\(\d+ of its 20000 bytes from byte 0 are control codes, which text in no encoding holds\); "
        rf"{folder / 'b.bin'} is binary, not text \(\d+ of its 20000 bytes from byte 0 are control codes, which "
        r"text in no encoding holds\)\); give a UTF-8 text file, a folder of them or a glob",
        str(e.value),
    ), str(e.value)
    assert "cp -rsL" not in str(e.value) and "convert" not in str(e.value)
    (folder / "c.txt").write_text("text at last\n" * 100)  # one text file: the copy leaves the others out
    with pytest.raises(DataError) as e:
        load_data(cfg, plan(cfg))
    assert "leave them out (not text) in a copy" in str(e.value) and "convert" not in str(e.value), str(e.value)
    cfg.data.path = _run_advice(str(e.value))
    assert sorted(os.listdir(cfg.data.path)) == ["c.txt"]


@pytest.mark.parametrize("where", ["file", "folder"])
def test_utf8_text_with_a_latin1_line_is_told_it_mixes_encodings_and_no_conversion_garbles_it(tmp_path, where):
    """UTF-8 text then one latin1 line: the line advised ``iconv -f latin1`` of the whole file, which turned every
    UTF-8 character into mojibake. It names the byte and the line, says the file mixes encodings, and its copy drops
    the bytes that are not UTF-8 only: followed, the UTF-8 characters are as they were."""
    good = "Caf\u00e9, na\u00efve, \u6771\u4eac \u2713\n" * 120
    path = tmp_path / "corpus" / "mixed.txt"
    path.parent.mkdir()
    path.write_bytes(good.encode() + "latin1 caf\u00e9\n".encode("latin-1") + b"last line\n")
    at = len(good.encode()) + len("latin1 caf")
    given = path if where == "file" else path.parent
    cfg = make_cfg({"model": {"name": "gpt"}, "data": {"name": "text", "path": str(given)}})
    with pytest.raises(DataError) as e:
        load_data(cfg, plan(cfg))
    line = str(e.value)
    why = (
        f"mixes encodings: UTF-8 text with characters of more than one byte, then at byte {at} (line 121) a byte "
        f"that is not UTF-8 (invalid continuation byte), so no one encoding reads it all (a conversion of the whole "
        f"file from latin1 would garble its UTF-8 characters)"
    )
    if where == "file":
        out = tmp_path / "corpus" / "mixed.utf8.txt"
        assert line == (
            f"data.path={path} {why}; fix or remove that line, or drop the file's bytes that are not UTF-8: iconv -f "
            f"UTF-8 -t UTF-8 -c {path} > {out}, then pass data.path={out}"
        )
    else:
        copy = tmp_path / "corpus.utf8"
        assert line == (
            f"{path} in data.path={given} {why}; fix or remove that line, or drop the file's bytes that are not UTF-8 "
            f"in a copy of the folder made of links to its files (the corpus stays as it is): cp -rsL {given} {copy} "
            f"&& chmod -R u+w {copy} && rm -f {copy / 'mixed.txt'} && iconv -f UTF-8 -t UTF-8 -c {path} > "
            f"{copy / 'mixed.txt'}, then pass data.path={copy}"
        )
    assert "latin1 -t" not in line
    cfg.data.path = _run_advice(line)
    train, validation = load_data(cfg, plan(cfg))[:2]
    text = good + "latin1 caf\nlast line\n"  # the latin1 byte dropped, every UTF-8 character kept
    assert bytes(train.tokens.astype(np.uint8)).decode() == text[: int(len(text) * 0.9)]


def test_the_copy_of_a_read_only_folder_is_made_writable_before_files_are_converted_in_it(tmp_path):
    """A read-only corpus (chmod 555): ``cp -rsL`` copies its folders' modes, so ``rm`` and ``iconv`` in the copy
    failed with Permission denied; ``chmod -R u+w`` on the copy comes first (its links are not followed: the
    corpus's files keep their modes), and the command, followed, gives a copy that loads."""
    folder = tmp_path / "ro"
    (folder / "sub").mkdir(parents=True)
    good, latin = "Good text, first file.\n" * 300, "Caf\u00e9 au lait.\n" * 100
    (folder / "a.txt").write_text(good)
    (folder / "sub" / "b.txt").write_bytes(latin.encode("latin-1"))
    modes = {p: p.stat().st_mode for p in (folder / "a.txt", folder / "sub" / "b.txt")}
    for d in (folder / "sub", folder):
        d.chmod(0o555)
    try:
        cfg = make_cfg({"model": {"name": "gpt"}, "data": {"name": "text", "path": str(folder)}})
        with pytest.raises(DataError) as e:
            load_data(cfg, plan(cfg))
        copy = tmp_path / "ro.utf8"
        assert f": cp -rsL {folder} {copy} && chmod -R u+w {copy} && rm -f {copy / 'sub' / 'b.txt'} && " in str(
            e.value
        ), str(e.value)
        cfg.data.path = _run_advice(str(e.value))
        assert (copy / "sub").stat().st_mode & 0o200 and (copy / "a.txt").is_symlink()
        assert {p: p.stat().st_mode for p in modes} == modes and (folder / "sub").stat().st_mode & 0o777 == 0o555
        train = load_data(cfg, plan(cfg))[0]
        text = good + latin
        assert bytes(train.tokens.astype(np.uint8)).decode() == text[: int(len(text) * 0.9)]
    finally:
        for d in (folder, folder / "sub"):
            d.chmod(0o755)


def test_the_copy_of_a_folder_never_reaches_through_a_linked_folder_into_the_corpus(tmp_path):
    """A bad file inside a linked folder of the corpus: ``cp -rs`` kept the link, so ``rm`` and ``iconv`` in the copy
    would have deleted and overwritten the original; the copy's folders are real (``cp -rsL``), a link loop in the
    corpus does not stop the command, and the files outside the corpus stay as they were."""
    outside = tmp_path / "outside"
    outside.mkdir()
    latin = "Caf\u00e9 au lait.\n" * 100
    (outside / "f.txt").write_bytes(latin.encode("latin-1"))
    folder = tmp_path / "corpus"
    folder.mkdir()
    good = "Good text, first file.\n" * 300
    (folder / "a.txt").write_text(good)
    (folder / "linked").symlink_to(outside)
    (folder / "loop").symlink_to(folder)
    cfg = make_cfg({"model": {"name": "gpt"}, "data": {"name": "text", "path": str(folder)}})
    with pytest.raises(DataError) as e:
        load_data(cfg, plan(cfg))
    copy = tmp_path / "corpus.utf8"
    assert str(e.value).endswith(
        f": {{ cp -rsL {folder} {copy} || test -d {copy}; }} && chmod -R u+w {copy} && rm -f "
        f"{copy / 'linked' / 'f.txt'} && iconv -f latin1 -t UTF-8 {folder / 'linked' / 'f.txt'} > "
        f"{copy / 'linked' / 'f.txt'}, then pass data.path={copy}"
    ), str(e.value)
    cfg.data.path = _run_advice(str(e.value))
    assert (outside / "f.txt").read_bytes() == latin.encode("latin-1") and os.listdir(outside) == ["f.txt"]
    train = load_data(cfg, plan(cfg))[0]
    text = good + latin
    assert bytes(train.tokens.astype(np.uint8)).decode() == text[: int(len(text) * 0.9)]


def test_a_conversion_never_overwrites_and_goes_to_the_cache_where_the_folder_cannot_be_written(tmp_path, monkeypatch):
    """The UTF-8 copy is named so that it overwrites nothing (``corpus.utf8.txt`` taken: ``corpus.utf8-2.txt``), and
    where the corpus's folder cannot be written (a read-only corpus: converting beside it failed) it goes to
    ``<data.cache_dir>/converted/``, made by the command; followed, it loads."""
    from data.textfiles import TextFault, fault_line

    text = "Caf\u00e9 au lait, s'il vous pla\u00eet.\n" * 200
    path = tmp_path / "corpus.txt"
    path.write_bytes(text.encode("latin-1"))
    (tmp_path / "corpus.utf8.txt").write_text("the user's own file")
    fault = TextFault(path, "is not UTF-8 (byte 3: invalid continuation byte)", "latin1", guess=True)
    out = tmp_path / "corpus.utf8-2.txt"
    assert fault_line(fault, "data.path", str(tmp_path / "cache")) == (
        f"data.path={path} is not UTF-8 (byte 3: invalid continuation byte); convert it from its encoding, e.g. "
        f"latin1: iconv -f latin1 -t UTF-8 {path} > {out}, then pass data.path={out}"
    )
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == tmp_path else real_access(p, mode))
    cfg = make_cfg({"model": {"name": "gpt"}, "data": {"name": "text", "path": str(path)}})
    cfg.data.cache_dir = str(tmp_path / "cache")
    with pytest.raises(DataError) as e:
        load_data(cfg, plan(cfg))
    converted = tmp_path / "cache" / "converted"
    assert str(e.value) == (
        f"data.path={path} is not UTF-8 (byte 3: invalid continuation byte); convert it from its encoding, e.g. "
        f"latin1: mkdir -p {converted} && iconv -f latin1 -t UTF-8 {path} > {converted / 'corpus.utf8.txt'}, then "
        f"pass data.path={converted / 'corpus.utf8.txt'}"
    )
    cfg.data.path = _run_advice(str(e.value))
    assert (tmp_path / "corpus.utf8.txt").read_text() == "the user's own file"
    train = load_data(cfg, plan(cfg))[0]
    assert bytes(train.tokens.astype(np.uint8)).decode() == text[: int(len(text) * 0.9)]


@pytest.mark.unit
def test_a_text_path_with_a_tilde_is_expanded(tmp_path, monkeypatch):
    """``data.path="~/corpus.txt"`` (quoted for Hydra, as its parse error of the bare form says) reads the file in
    the home folder, as the shell would; the run's paths are made absolute the same way (``absolute_paths``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from conf.errors import one_line
    from conf.schema import as_dict
    from training.console import absolute_paths

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "corpus.txt").write_text("to be or not to be " * 200)
    with pytest.raises(Exception) as e:
        OverridesParser.create().parse_overrides(["data.path=~/corpus.txt"])
    assert one_line(e.value) == (
        "cannot parse the override 'data.path=~/corpus.txt': LexerNoViableAltException: data.path=~/corpus.txt; "
        "quote the value for Hydra inside the shell's quotes: 'data.path=\"~/corpus.txt\"'"
    )
    (quoted,) = OverridesParser.create().parse_overrides(['data.path="~/corpus.txt"'])
    cfg = make_cfg({"model": {"name": "gpt"}, "data": {"name": "text", "path": quoted.value()}})
    assert len(load_data(cfg, plan(cfg))[0].tokens) == 3420  # the data layer expands it itself (evaluate, sample)
    assert as_dict(absolute_paths(cfg, Path("/elsewhere"), {}))["data"]["path"] == str(tmp_path / "corpus.txt")
    assert load_data(cfg, plan(cfg))[0].fingerprint["file"] == str(tmp_path / "corpus.txt")


@pytest.mark.parametrize(
    "case",
    ["heads", "context", "short", "empty"],
)
def test_bad_gpt_input_from_the_cli_fails_in_one_line_writing_nothing(tmp_path, case):
    """The issue's bad input through train.py: one line naming the values and the fix, exit 1, and in the run
    folder only .hydra/, train.log and summary.json (status failed)."""
    (tmp_path / "short.txt").write_text("hello world\n")
    (tmp_path / "empty.txt").write_text("")
    overrides, line = {
        "heads": (
            ["data=synthetic", "model.heads=3"],
            "error: model.heads=3 does not divide model.width=128; choose heads among [1, 2, 4, 8, 16, 32, 64] "
            "or a width that is a multiple of 3",
        ),
        "context": (
            ["data=synthetic", "model.context=256", "model.max_positions=128"],
            "error: model.context=256 is longer than the position table model.max_positions=128; lower "
            "model.context or raise model.max_positions to at least 256",
        ),
        "short": (
            ["data=text", f"data.path={tmp_path / 'short.txt'}"],
            f"error: the train split of data.path={tmp_path / 'short.txt'} has 10 bytes, not more than one window "
            "of model.context=128; give a longer text or lower model.context (at most 1 for this text)",
        ),
        "empty": (
            ["data=text", f"data.path={tmp_path / 'empty.txt'}"],
            f"error: data.path={tmp_path / 'empty.txt'} is empty; give a UTF-8 text file with at least one window "
            "of text",
        ),
    }[case]
    run = tmp_path / "run"
    r = run_train(run, "model=gpt", *overrides, "wandb=disabled", timeout=300)
    assert r.returncode == 1
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("error:")] == [line], r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert sorted(p.name for p in run.iterdir()) == [".hydra", ".lock", "summary.json", "train.log"]
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"


def test_unknown_remat_policy_from_the_cli_is_refused_before_any_folder(tmp_path):
    """A policy name is checked when Hydra composes the config (like model.activation): one line, exit 1, no
    run folder at all."""
    r = run_train(tmp_path / "run", "model=gpt", "model.remat=bogus", "wandb=disabled", timeout=300)
    assert r.returncode == 1
    assert [ln for ln in r.stderr.splitlines() if ln.strip()] == [
        "error: model.remat=bogus is not a valid choice; choose one of none, full, dots_saveable"
    ]
    assert not (tmp_path / "run").exists()


# ---- every mode equals one device ------------------------------------------------------------------------------
CASES = [("pmap", None), ("jit_sharding", None), ("shard_map", None), ("fsdp", None), ("fsdp", [2, 4])]


@pytest.mark.parametrize("opt", ["sgd", pytest.param("adam", marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode,shape", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_mode_matches_single_device(mode, shape, opt):
    cfg = make_cfg(
        {
            "model": {"name": "gpt", "size": "tiny", "context": CONTEXT},
            "data": {"name": "synthetic"},
            "train": {"global_batch": GLOBAL_BATCH},
            "mesh": {"devices": 8, "shape": shape},
            "parallel": {"name": mode},
            "optim": {"name": opt, "lr": LR[opt]},
        }
    )
    assert_matches_reference(run_lm_steps(cfg), reference(opt), TOL[opt], 8, STEPS)


@pytest.mark.unit
def test_losses_actually_fall():
    """Guards the equivalence test against comparing runs that do nothing."""
    losses, state, _, init = reference("sgd")
    assert losses[0] > math.log(256) - 0.5 and losses[-1] < losses[0] - 1.0
    assert max_abs_diff(state.params, init.params) > 1e-3


@pytest.mark.parametrize("mode", ["jit_sharding", "fsdp"])
def test_accumulation_k4_equals_k1(mode):
    def cfg(k):
        return make_cfg(
            {
                "model": {"name": "gpt", "size": "tiny", "context": CONTEXT},
                "data": {"name": "synthetic"},
                "train": {"global_batch": 32, "accum_steps": k},
                "mesh": {"devices": 8},
                "parallel": {"name": mode},
                "optim": {"name": "sgd", "lr": LR["sgd"]},
            }
        )

    one, four = run_lm_steps(cfg(1), steps=4), run_lm_steps(cfg(4), steps=4)
    assert np.max(np.abs(one[0] - four[0])) <= 1e-6
    assert max_abs_diff(one[1].params, four[1].params) <= 1e-6


# ---- the speed levers: the splash kernel, the fused loss, a padded vocabulary ----------------------------------
LEVER_CONTEXT = 128  # the splash kernel's smallest context (interpreted on the CPU)


def lever_cfg(devices: int = 1, mode: str = "jit_sharding", shape=None, precision: str = "fp32", **model):
    return make_cfg(
        {
            "model": {"name": "gpt", "size": "tiny", "context": LEVER_CONTEXT, **model},
            "data": {"name": "synthetic"},
            "train": {"global_batch": 8},
            "mesh": {"devices": devices, "shape": shape},
            "parallel": {"name": mode},
            "optim": {"name": "sgd", "lr": LR["sgd"]},
            "precision": {"name": precision, "compute_dtype": {"fp32": "float32", "bf16": "bfloat16"}[precision]},
        }
    )


def lever_run(cfg, steps: int = 3):
    """``run_lm_steps`` at the levers' context, plus the evaluation sums of the last batch (GSPMD's eval step)."""
    losses, state, exp, init = run_lm_steps(cfg, steps, tokens=TOKENS)
    src = WindowSource(TOKENS, LEVER_CONTEXT, 8, 0)
    layout = exp.mode.batch_layout()
    batch = src.local_batch(0, layout.local_rows(8))
    batch = {"image": batch["image"], "label": batch["label"], "mask": np.ones(len(batch["label"]), np.float32)}
    sums = metrics_to_host(exp.steps.eval(exp.state.params, layout.place(batch, 8)))
    return (losses, state, exp, init), float(sums["loss_sum"])


_lever_reference: dict = {}


def lever_reference(precision: str = "fp32"):
    if precision not in _lever_reference:
        _lever_reference[precision] = lever_run(lever_cfg(attention="xla", precision=precision))
    return _lever_reference[precision]


LEVER_CASES = [
    ("jit_sharding", None, {"attention": "splash"}),
    ("fsdp", [2, 4], {"attention": "splash", "loss_chunk": 200}),
    ("shard_map", None, {"attention": "splash"}),
    ("jit_sharding", None, {"loss_chunk": 300}),
    pytest.param("pmap", None, {"attention": "splash", "loss_chunk": 128}, marks=pytest.mark.slow),
    pytest.param("fsdp", None, {"loss_chunk": 128}, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("mode,shape,levers", LEVER_CASES)
def test_kernels_and_fused_loss_match_one_device_without_them(mode, shape, levers):
    """Splash attention (interpreted here) and the output layer fused with the loss give, on 8 devices in every
    mode, the one-device run with XLA's attention and logits within the modes' SGD margin, and the same
    evaluation sums (every mode's eval step runs under GSPMD, the kernel per device under shard_map)."""
    run, eval_sum = lever_run(
        lever_cfg(8, mode, shape, attention=levers.get("attention", "xla"), loss_chunk=levers.get("loss_chunk", 0))
    )
    ref, ref_eval = lever_reference()
    assert_matches_reference(run, ref, TOL["sgd"], 8, 3)
    assert eval_sum == pytest.approx(ref_eval, rel=1e-6)
    assert run[0][-1] < run[0][0]  # it trains


def test_splash_under_bf16_matches_xla_on_one_and_eight_devices():
    """jit_sharding's bf16 step on 8 devices is a vmap over an explicit device axis (one float32 all-reduce):
    the kernel runs per device inside it (vmap's spmd_axis_name); it computes what XLA's attention does, to
    bf16 rounding, and the one-device run."""
    (losses8, state8, _, _), _ = lever_run(lever_cfg(8, precision="bf16", attention="splash"))
    (losses1, state1, _, _), _ = lever_run(lever_cfg(1, precision="bf16", attention="splash"))
    (xla, xla_state, _, _), _ = lever_reference("bf16")
    assert np.max(np.abs(losses8 - losses1)) < 2e-3 and np.max(np.abs(losses8 - xla)) < 2e-3
    assert max_abs_diff(state8.params, xla_state.params) < 2e-3


def test_padded_vocabulary_trains_the_same_model():
    """model.vocab_multiple pads the embedding with rows the softmax never sees: the real rows start equal to
    the unpadded model's (the draws extend), train the same, and the padding rows keep their initial values
    under SGD (no gradient); the logits have the real vocabulary's width."""
    (losses, state, exp, init), _ = lever_run(lever_cfg(vocab_multiple=384, loss_chunk=512))
    (ref_losses, ref_state, _, ref_init), _ = lever_reference()
    emb, ref_emb = init.params["embed"]["embedding"], ref_init.params["embed"]["embedding"]
    assert emb.shape == (384, 128) and ref_emb.shape == (256, 128)
    np.testing.assert_array_equal(emb[:256], ref_emb)
    assert np.max(np.abs(losses - ref_losses)) <= TOL["sgd"]
    trained = state.params["embed"]["embedding"]
    np.testing.assert_allclose(trained[:256], ref_state.params["embed"]["embedding"], atol=TOL["sgd"])
    np.testing.assert_array_equal(trained[256:], emb[256:])
    logits = exp.local.logits(exp.state.params, np.zeros((2, LEVER_CONTEXT), np.int32))
    assert logits.shape == (2, LEVER_CONTEXT, 256)


@pytest.mark.unit
def test_compiled_peak_memory_is_arguments_plus_temporaries():
    """``mem/compiled_peak_bytes_per_device``: the step's arguments + temporaries from XLA's memory analysis (on
    a TPU it moves with model.remat, ``benchmarks/accelerator.py --part memory``; XLA:CPU's buffer assignment
    keeps the temporaries alike)."""
    _, m = compiled_gpt("jit_sharding")
    exp, _ = compiled_gpt("jit_sharding")
    assert m["mem/compiled_peak_bytes_per_device"] > m["mem/temp_bytes_per_device"] > 0
    assert m["mem/compiled_peak_bytes_per_device"] - m["mem/temp_bytes_per_device"] >= state_bytes_per_device(exp.state)


@pytest.mark.unit
@pytest.mark.parametrize("model", ["gpt", "cnn"])
def test_state_created_op_by_op_equals_the_jitted_state_to_the_last_bits(model):
    """A replicated state is created op by op on the mesh's first device and then placed when the mesh is an
    accelerator's (``ParallelMode.init_state``): the same draws as the jitted program on the mesh, whose constant
    folding may move a float32 by at most 2 units in the last place (measured: GPT 2, CNN 0); parameters are really
    drawn (not zeros) and integer leaves are equal."""
    from training.build import _optimizer, state_init_fn

    extra = {"context": CONTEXT} if model == "gpt" else {}
    p = plan(make_cfg({"model": {"name": model, **extra}, "data": {"name": "synthetic"}}, mesh__devices=8))
    tx, _ = _optimizer(p.cfg, p.peak_lr)
    _, init_fn = state_init_fn(p.cfg, tx, p.graphdef)
    exp = build(p)
    eager = exp.mode.init_state(init_fn, eager=True)
    assert jax.tree.leaves(eager.params)[0].sharding == jax.tree.leaves(exp.state.params)[0].sharding
    eager, jitted = jax.device_get(eager), jax.device_get(exp.mode.init_state(init_fn, eager=False))
    assert jax.tree.structure(eager) == jax.tree.structure(jitted)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        assert a.dtype == b.dtype and a.shape == b.shape
        if a.dtype == np.float32:
            np.testing.assert_array_max_ulp(a, b, maxulp=2)
        else:
            np.testing.assert_array_equal(a, b)
    assert max_abs_diff(eager.params, jax.tree.map(np.zeros_like, eager.params)) > 0.01


# ---- communication and memory ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def compiled_gpt(mode: str, tied: bool = True):
    cfg = make_cfg(
        {
            "model": {"name": "gpt", "size": "tiny", "context": CONTEXT, "tied_embeddings": tied},
            "data": {"name": "synthetic"},
            "train": {"global_batch": GLOBAL_BATCH},
            "parallel": {"name": mode},
        }
    )
    exp = build(plan(cfg))
    layout = exp.mode.batch_layout()
    src = WindowSource(TOKENS, CONTEXT, GLOBAL_BATCH, 0)
    batch = layout.place(src.local_batch(0, layout.local_rows(GLOBAL_BATCH)), GLOBAL_BATCH)
    lowered = exp.steps.train.lower(exp.state, batch)
    return exp, compiled_step_metrics(lowered, lowered.compile(), 8)


def gpt_param_bytes(tied: bool = True) -> int:
    return 4 * param_count_of(resolve_dims("tiny", context=CONTEXT), tied_embeddings=tied)


@pytest.mark.parametrize("mode", ["pmap", "shard_map", "jit_sharding"])
def test_all_reduce_bytes_equal_the_parameter_count(mode):
    """Replicated data parallelism: one float32 all-reduce of every gradient (4 N bytes) + the 2 metric sums.

    The untied model matches the formula in every mode. With tied embeddings (the default) the embedding
    matrix gets two gradient contributions (the lookup and the output layer): pmap and shard_map add them
    before their explicit psum, while jit_sharding's partitioner all-reduces each contribution on its own
    (4 V d bytes more)."""
    _, m = compiled_gpt(mode, tied=False)
    assert m["comm/payload_bytes_per_step"] == gpt_param_bytes(False) + METRIC_SUM_BYTES
    assert m["comm/count/all-gather"] == m["comm/count/reduce-scatter"] == 0
    _, m = compiled_gpt(mode, tied=True)
    extra = 4 * 256 * 128 if mode == "jit_sharding" else 0
    assert m["comm/payload_bytes_per_step"] == gpt_param_bytes(True) + METRIC_SUM_BYTES + extra
    assert m["comm/bytes_per_step"] == pytest.approx(2 * 7 / 8 * m["comm/payload_bytes_per_step"])


def test_fsdp_bytes_and_state_per_device():
    """FSDP [1, 8]: every array has a dimension divisible by 8 (none stays replicated in the tiny GPT). Per-layer
    gathers (parallel/fsdp.py): the blocks' weights (S_list) are all-gathered in the forward pass and again in the
    backward pass, except each block's last bias (the MLP output bias, 4 x width bytes), whose value no gradient
    needs; the embeddings and final norm are gathered once; every gradient is reduce-scattered once; the 2 metric
    sums are all-reduced. So all-gather = S + S_list - depth x 4 x width, reduce-scatter = S (float32 here).
    State per device (params + Adam mu, nu) = total / 8 + the scalars."""
    exp, m = compiled_gpt("fsdp")
    params = state_to_host(exp.state).params
    sharded, replicated = exp.mode.sharded_and_replicated_bytes(params)
    assert (sharded, replicated) == (gpt_param_bytes(), 0)
    s_list = exp.mode.per_layer_bytes(params)
    dims = resolve_dims("tiny", context=CONTEXT)
    assert s_list == 4 * dims.depth * (12 * dims.width**2 + 13 * dims.width)  # 4 blocks: attention + MLP + 2 norms
    assert m["comm/count/all-gather"] > 0 and m["comm/count/reduce-scatter"] > 0
    expected = sharded + (sharded + s_list - dims.depth * 4 * dims.width) + METRIC_SUM_BYTES
    assert m["comm/payload_bytes_per_step"] == expected
    scalars = sum(np.dtype(x.dtype).itemsize for x in jax.tree.leaves(exp.state) if np.ndim(x) == 0)
    assert state_bytes_per_device(exp.state) == 3 * sharded // 8 + scalars
    ref, _ = compiled_gpt("jit_sharding")
    assert state_bytes_per_device(ref.state) == 3 * sharded + scalars


# ---- resume --------------------------------------------------------------------------------------------------
@pytest.mark.slow  # 3 processes, ~60 s; CI keeps test_windows_are_a_function_of_seed_step_and_row (the text order
# keyed by the step) and the MLP's kill/resume bitwise test (tests/test_checkpoint.py), the same resume code
def test_resume_equals_uninterrupted_bitwise(tmp_path):
    """12 steps straight vs 6 steps, then the same folder continued to 12 (data order keyed by the step)."""
    common = [
        "model=gpt",
        "data=tiny_shakespeare",
        f"model.context={CONTEXT}",
        f"train.global_batch={GLOBAL_BATCH}",
        "train.log_every=1",
        "train.eval_batch=2048",
        "checkpoint.every=6",
        "wandb=disabled",
    ]
    ref = run_train(tmp_path / "ref", *common, "train.steps=12", timeout=400)
    assert ref.returncode == 0, ref.stderr[-2000:]
    first = run_train(tmp_path / "run", *common, "train.steps=6", timeout=400)
    assert first.returncode == 0, first.stderr[-2000:]
    second = run_train(tmp_path / "run", *common, "train.steps=12", timeout=400)
    assert second.returncode == 0, second.stderr[-2000:]
    a = checkpoint.read_arrays(tmp_path / "ref" / "checkpoints" / "12")
    b = checkpoint.read_arrays(tmp_path / "run" / "checkpoints" / "12")
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].tobytes() == b[k].tobytes(), k

    def losses(run):
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return [r["train/loss"] for r in map(json.loads, lines) if "train/loss" in r]

    assert losses(tmp_path / "run") == losses(tmp_path / "ref") and len(losses(tmp_path / "ref")) == 12
    summary = json.loads((tmp_path / "ref" / "summary.json").read_text())
    assert summary["model/param_count"] == param_count_of(resolve_dims("tiny", context=CONTEXT))
    assert summary["perf/tokens_per_s"] == pytest.approx(summary["perf/examples_per_s"] * CONTEXT)
    assert summary["eval/perplexity"] == pytest.approx(math.exp(summary["eval/loss"]))
    assert summary["perf/flops_per_token"] == flops_per_token(summary["model/param_count"], 4, 128, CONTEXT)


# ---- a checkpoint of another GPT table -----------------------------------------------------------------------
@pytest.mark.unit
def test_resume_refuses_another_vocabulary_or_position_table_by_resolved_size():
    from training.checkpoint.policy import refusal, resume_conflicts

    saved = {"model": {"name": "gpt", "size": "tiny", "context": 32, "vocab_size": None}, "train": {"seed": 0}}
    same = {"model": {"name": "gpt", "size": "tiny", "context": 32, "vocab_size": 256}, "train": {"seed": 0}}
    assert resume_conflicts(saved, same, 16, 16) == []  # null = the preset's 256: the same table
    vocab = {"model": {**same["model"], "vocab_size": 300}, "train": {"seed": 0, "sample_tokens": 20}}
    assert resume_conflicts(saved, vocab, 16, 16) == ["model.vocab_size (GPT vocabulary): 256 -> 300"]
    table = {"model": {**saved["model"], "max_positions": 64}, "train": {"seed": 0}}
    assert resume_conflicts(saved, table, 16, 16) == ["model.max_positions (GPT position table): 32 -> 64"]
    line = refusal(Path("ck/4"), resume_conflicts(saved, vocab, 16, 16))
    assert "\n" not in line and "256 -> 300" in line and "checkpoint.dir" in line
    # beyond the 4 shown, the rest as the overrides that set them back, in one step (before: "... 3 more", and each
    # resume refused named the next ones)
    many = {"model": {**vocab["model"], "max_positions": 64, "depth": 3, "width": 96, "heads": 3}, "train": {"seed": 1}}
    assert refusal(Path("ck/4"), resume_conflicts(saved, many, 16, 32)) == (
        "checkpoint ck/4 was trained with other settings (model.vocab_size (GPT vocabulary): 256 -> 300; "
        "model.max_positions (GPT position table): 32 -> 64; model.depth: None -> 3; model.heads: None -> 3; and "
        "model.width=null train.seed=0 train.global_batch=16); to resume it set them back, otherwise give this run "
        "its own checkpoint.dir (the checkpoint is kept as it is)"
    )


@pytest.mark.unit
def test_negative_sample_tokens_is_refused():
    with pytest.raises(ConfigError, match=r"train.sample_tokens=-1 must be >= 0"):
        plan(gpt_cfg(train__sample_tokens=-1))


@pytest.mark.unit
def test_on_device_true_is_refused_for_text_windows_and_null_or_false_pass():
    with pytest.raises(ConfigError, match=r"^data.on_device=true keeps an image data set .*set data.on_device=null"):
        plan(gpt_cfg(data__on_device=True))
    plan(gpt_cfg(data__on_device=False))
    plan(gpt_cfg())


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_sample_a_damaged_newest_step_samples_the_newest_complete_one(tmp_path, capsys):
    """``python -m sample`` on a checkpoint folder whose newest step has a truncated file: one warning line naming it,
    and the newest complete step's text (the same as sampling that step itself); none complete: one ``error:`` line,
    exit 1. Never a traceback."""
    import subprocess
    import sys

    import sample
    from utils import REPO, damage_step, save_steps

    ckpt = tmp_path / "ckpt"
    save_steps(ckpt, gpt_cfg(), {2: 1.0, 4: 3.0})
    damage_step(ckpt / "4")
    args = ["--prompt", "AB", "--tokens", "12"]
    fallback = subprocess.run(
        [sys.executable, "-m", "sample", str(ckpt), *args], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert fallback.returncode == 0, fallback.stderr[-3000:]
    assert "Traceback" not in fallback.stderr and "Exception ignored" not in fallback.stderr, fallback.stderr[-3000:]
    warning, started = fallback.stderr.splitlines()
    assert warning.startswith(f"warning: checkpoint {ckpt / '4'} is incomplete or corrupt (ValueError: ")
    assert warning.endswith(f"); sampling the newest complete one, {ckpt / '2'}")
    assert started.startswith(f"sample: {ckpt / '2'}, prompt 'AB', 12 bytes, greedy")

    capsys.readouterr()
    assert sample.main([str(ckpt / "2"), *args]) == 0  # in-process: the same text from step 2 itself
    assert capsys.readouterr().out == fallback.stdout and fallback.stdout.startswith("AB")

    damage_step(ckpt / "2")
    assert sample.main([str(ckpt), *args]) == 1
    out, err = capsys.readouterr()
    (line,) = err.splitlines()
    assert out == "" and line.startswith(
        f"error: checkpoints 4, 2 in {ckpt} are incomplete or corrupt (step 4: ValueError: "
    )
    assert line.endswith(f"); no complete checkpoint is left in {ckpt}: give another checkpoint folder")


def test_sample_cli_greedy_is_deterministic_and_bad_folders_are_one_line(tmp_path):
    """``python -m evaluate <run folder>``: the run's final evaluation again. ``python -m sample <run folder>``:
    greedy output is the prompt + N bytes, the same twice; a missing folder and a checkpoint whose saved
    vocabulary differs from its arrays: one line, exit 1."""
    import subprocess
    import sys

    run = tmp_path / "run"
    r = run_train(
        run,
        "model=gpt",
        "data=tiny_shakespeare",
        f"model.context={CONTEXT}",
        "train.steps=4",
        f"train.global_batch={GLOBAL_BATCH}",
        "train.eval_batch=2048",
        "wandb=disabled",
        timeout=400,
    )
    assert r.returncode == 0, r.stderr[-2000:]

    def sample(*args):
        cmd = [sys.executable, "-m", "sample", *args]
        return subprocess.run(cmd, cwd=Path(__file__).parent.parent, capture_output=True, text=True, timeout=300)

    evaluated = subprocess.run(
        [sys.executable, "-m", "evaluate", str(run), "--json"],
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    got, want = json.loads(evaluated.stdout), json.loads((run / "summary.json").read_text())
    for key in ("eval/loss", "eval/accuracy", "eval/perplexity", "eval/bpb"):  # the run's final evaluation, re-run
        assert got[key] == pytest.approx(want[key], rel=1e-6), key
    assert got["eval/bpb"] == pytest.approx(got["eval/loss"] / np.log(2), rel=1e-12)  # byte tokens: nats/byte / ln 2
    assert got["step"] == 4
    line = subprocess.run(  # the one-line output names the perplexity too (README "The language model")
        [sys.executable, "-m", "evaluate", str(run)],
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    perplexity_bpb = f"eval/perplexity={got['eval/perplexity']:.2f} eval/bpb={got['eval/bpb']:.4f} step=4 "
    assert line.returncode == 0 and perplexity_bpb in line.stdout, line.stdout
    a, b = sample(str(run), "--prompt", "AB", "--tokens", "24"), sample(str(run), "--prompt", "AB", "--tokens", "24")
    assert a.returncode == 0, a.stderr[-2000:]
    assert a.stdout == b.stdout and a.stdout.startswith("AB")
    assert len(a.stdout.rstrip("\n").encode("utf-8", errors="surrogateescape")) >= 2
    bad = sample(str(tmp_path / "missing"))
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "does not exist" in bad.stderr
    nan = sample(str(run), "--temperature", "nan")
    assert nan.returncode == 1 and nan.stderr.count("\n") == 1 and "--temperature nan" in nan.stderr
    meta = next((run / "checkpoints").iterdir()) / "meta" / "metadata"
    saved = json.loads(meta.read_text())
    saved["config"]["model"]["vocab_size"] = 300
    meta.write_text(json.dumps(saved))
    wrong = sample(str(run))
    assert wrong.returncode == 1 and wrong.stderr.count("\n") == 1
    assert "vocabulary has 256 rows in its arrays but 300" in wrong.stderr


@pytest.mark.parametrize("sig, status, said", [("SIGINT", 130, "SIGINT (Ctrl-C)"), ("SIGTERM", 143, "SIGTERM")])
def test_a_signal_stops_sample_with_one_line(tmp_path, sig, status, said):
    """Ctrl-C during ``python -m sample``'s generation printed a KeyboardInterrupt traceback, and SIGTERM ended it
    with no line at all: now one line and the signal's exit status (``training.process.run_tool``)."""
    import signal
    import subprocess
    import sys

    from utils import REPO, save_steps

    ckpt = tmp_path / "ckpt"
    save_steps(ckpt, gpt_cfg(), {2: 1.0})
    proc = subprocess.Popen(
        [sys.executable, "-m", "sample", str(ckpt), "--tokens", "1000000"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    started = proc.stderr.readline()  # "sample: <step>, ..." before it generates
    assert started.startswith("sample: "), started
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode in (status, -getattr(signal, sig)), err[-3000:]
    assert err.splitlines() == [f"error: interrupted by {said} and stopped (HYDRA_FULL_ERROR=1 prints where)"]


@pytest.mark.parametrize("sig, status, said", [("SIGINT", 130, "SIGINT (Ctrl-C)"), ("SIGTERM", 143, "SIGTERM")])
def test_a_stop_that_cpp_code_swallowed_is_delivered_again(tmp_path, sig, status, said):
    """A tool's interrupt raised inside a Python callback of C++ code (a jitted function's first call compiling) can
    be swallowed there: CI's ``python -m sample --tokens 1000000`` then generated on past a Ctrl-C. ``run_tool``
    delivers it again until ``main()`` has ended: here a main that swallows the first one, as that C++ code did."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from utils import REPO

    tool = tmp_path / "tool.py"
    tool.write_text(
        "import os, signal, sys, time\n"
        "from training import process\n"
        "def main():\n"
        "    try:\n"
        f"        os.kill(os.getpid(), signal.{sig})\n"
        "        time.sleep(5)\n"
        "    except KeyboardInterrupt:\n"
        "        print('swallowed', file=sys.stderr, flush=True)\n"
        "    while True:\n"
        "        time.sleep(0.05)\n"
        "process.run_tool(main, imports_jax=False)\n"
    )
    t0 = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(tool)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode in (status, -getattr(signal, sig)), proc.stderr[-3000:]
    said_line = f"error: interrupted by {said} and stopped (HYDRA_FULL_ERROR=1 prints where)"
    assert proc.stderr.splitlines() == ["swallowed", said_line]
    assert time.monotonic() - t0 < 15  # delivered again after REDELIVER_S (2 s), not left to run
