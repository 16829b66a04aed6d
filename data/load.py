"""A run's data from its ``data`` settings (the ``conf.schema.DataConfig`` node, read as plain attributes): the
training source and the host evaluation split, of images (TFDS or synthetic) or of text (bytes or BPE tokens). A
source's ``fingerprint`` says what it was read from (a text file's size and hash, a TFDS data set's name, version
and split; None for synthetic data), for the checkpoints to record.

Raises ``ConfigError`` (one line) when the data does not fit the settings, ``DataError`` when it cannot be read.
"""

from __future__ import annotations

import logging
from typing import Optional

import jax
import numpy as np

from core.errors import ConfigError
from data.pipeline import DeviceSource, SyntheticSource, TrainSource, split_bytes, split_fits_on_device, synthetic_eval
from data.sources import load_tfds_split, tfds_fingerprint

log = logging.getLogger(__name__)

TEXT_DATA = ("tiny_shakespeare", "text")


def text_corpus(d, saved_tokenizer=None):
    """The tokens and the tokenizer of ``data=tiny_shakespeare`` / ``data=text`` (``data.text.load_text``):
    ``saved_tokenizer``, the ``tokenizer.json`` saved with the checkpoint a run resumes or evaluates, wins over
    training or loading another. Raises DataError (one line)."""
    from data.text import load_text

    return load_text(
        d.name,
        d.path,
        d.cache_dir,
        d.download,
        tokenizer=d.tokenizer,
        vocab_size=d.vocab_size,
        tokenizer_file=d.tokenizer_file,
        saved_tokenizer=saved_tokenizer,
    )


# fewer validation windows than this: eval/* rest on too few tokens to compare runs by
MIN_EVAL_WINDOWS = 10


def small_text_warnings(d, train_tokens: int, eval_tokens: int, context: int, global_batch: int, unit: str) -> None:
    """A warning each when one step's batch (``global_batch`` windows of ``context`` tokens) holds more tokens than
    the train split (every step sees each of them again: the model memorises the split), and when the validation
    split holds fewer than ``MIN_EVAL_WINDOWS`` windows (``data.eval_windows`` aside: the user's own cap)."""
    name, per_step = d.path or d.name, global_batch * context
    if per_step > train_tokens:
        log.warning(
            f"the train split of data.path={name} has {train_tokens:,} {unit}, fewer than one step's batch of "
            f"{global_batch} x {context} = {per_step:,}: every step sees each of them about "
            f"{per_step / train_tokens:.0f} times and the model memorises them; give a longer text, or a smaller "
            f"train.global_batch or model.context"
        )
    windows = (eval_tokens - 1) // context
    if windows < MIN_EVAL_WINDOWS and d.eval_windows is None:
        log.warning(
            f"the validation split of data.path={name} holds {windows} window(s) of model.context={context} "
            f"({eval_tokens:,} {unit}): eval/loss and eval/accuracy rest on them alone, too few to compare runs by; "
            f"give a longer text (its last 10% is the validation split)"
        )


def text_data(d, *, context: int, vocab_size: int, global_batch: int, seed: int, with_index: bool, text=None):
    """(train ``WindowSource``, host validation windows ``data.text.TextEvalSet``) for a language model of
    ``context`` tokens: the tokens of ``data=tiny_shakespeare`` / ``data=text`` (``text``: ``text_corpus``'s,
    loaded here when None), or random tokens with ``data=synthetic``.

    Raises:
      ConfigError: an image data set, tokens outside the model's vocabulary, a split shorter than one window.
      DataError: the text is missing, empty or not UTF-8; a bad tokenizer setting.
    """
    from data.text import VOCAB_BYTES, WindowSource, eval_windows, synthetic_tokens

    t = context
    tokenizer, token_bytes = None, None
    if d.name == "synthetic":
        if d.train_size <= t or d.eval_size <= t:
            raise ConfigError(
                f"data.train_size={d.train_size} and data.eval_size={d.eval_size} tokens: each must exceed one "
                f"window of model.context={t} tokens"
            )
        train, test = synthetic_tokens(vocab_size, d.train_size, d.eval_size, seed)
        fingerprint = None  # random tokens: the config says all there is
    elif d.name in TEXT_DATA:
        if d.tokenizer == "bytes" and not d.tokenizer_file and vocab_size < VOCAB_BYTES:
            raise ConfigError(
                f"model.vocab_size={vocab_size} is smaller than the {VOCAB_BYTES} byte tokens of "
                f"data={d.name}; set model.vocab_size={VOCAB_BYTES} (or leave it null with model.size=tiny)"
            )
        if d.eval_windows is not None and d.eval_windows < 1:
            raise ConfigError(f"data.eval_windows={d.eval_windows} must be >= 1 (or null: every validation window)")
        text = text if text is not None else text_corpus(d)
        tokenizer = text.tokenizer
        if vocab_size < tokenizer.vocab_size:
            which = f"data.tokenizer_file={d.tokenizer_file}" if d.tokenizer_file else f"data.tokenizer={d.tokenizer}"
            raise ConfigError(
                f"model.vocab_size={vocab_size} is smaller than the {tokenizer.vocab_size} tokens of {which}; "
                f"leave model.vocab_size null (the tokenizer's size) or raise it"
            )
        train, test, fingerprint = text.train, text.validation, text.fingerprint
        unit = "bytes" if tokenizer.name == "bytes" else "tokens"
        for split, tokens in (("train", train), ("validation", test)):
            if len(tokens) <= t:
                raise ConfigError(
                    f"the {split} split of data.path={d.path or d.name} has {len(tokens)} {unit}, not more than "
                    f"one window of model.context={t}; give a longer text or lower model.context (at most "
                    f"{max(1, min(len(train), len(test)) - 1)} for this text)"
                )
        token_bytes = tokenizer.token_bytes()
        small_text_warnings(d, len(train), len(test), t, global_batch, unit)
    else:
        raise ConfigError(
            f"model=gpt trains on text, not data={d.name}; use data=tiny_shakespeare, data=text data.path=FILE "
            f"or data=synthetic"
        )
    source = WindowSource(train, t, global_batch, seed, with_index=with_index, fingerprint=fingerprint)
    source.tokenizer = tokenizer
    return source, eval_windows(test, t, getattr(d, "eval_windows", None), token_bytes)


def text_info(text, test) -> dict:
    """Summary keys of a text data set: the tokenizer, its vocabulary, the splits' tokens and the bytes per token
    (``data/eval_bytes_per_token`` of the evaluated targets: ``eval/bpb``; ``data/train_bytes_per_token`` of the
    training split: ``train/bpb``), where the tokens live (a token folder, or null: in memory), and the share of the
    tokens that are the tokenizer's unknown token and of the text's bytes no token stands for
    (``data.text.warn_unknown``)."""
    tok = text.tokenizer
    return {
        "data/tokenizer": tok.name,
        "data/tokenizer_vocab_size": tok.vocab_size,
        "data/tokenizer_path": None if tok.path is None else str(tok.path),
        "data/train_tokens": int(len(text.train)),
        "data/validation_tokens": int(len(text.validation)),
        "data/train_bytes_per_token": text.train_bytes_per_token,
        "data/eval_bytes_per_token": test.bytes_per_token,
        "data/token_dir": None if text.token_dir is None else str(text.token_dir),
        "data/unknown_token_share": text.unknown_share,
        "data/dropped_text_share": text.dropped_share,
    }


def image_data(d, *, model: str, global_batch: int, seed: int, with_index: bool, bytes_limit: Optional[int]):
    """(train source, host test split) of an image data set. The train source is a ``DeviceSource`` (the split in
    device memory) or a ``TrainSource`` (host batches), as ``data.on_device`` says (null: ``split_fits_on_device``
    of the split's bytes and ``bytes_limit``, the bytes JAX may use on a device, None when unknown); synthetic
    data is generated on the devices either way.

    Raises DataError with one line when the dataset is missing, ConfigError when the data does not fit the settings
    (text data for an image ``model``, image shape, labels, fewer examples than one global batch,
    ``data.on_device=true`` with a split larger than a device's memory limit)."""
    if d.name in TEXT_DATA:
        raise ConfigError(f"data={d.name} is text: train it with model=gpt (model={model} reads images)")
    if d.name == "synthetic":
        # synthetic sizes and shape are checked before anything is generated
        if len(d.image_shape) != 3 or min(d.image_shape) <= 0 or d.num_classes < 2:
            raise ConfigError(
                f"data.image_shape={list(d.image_shape)} and data.num_classes={d.num_classes} must "
                f"be [H, W, C] with positive sizes and at least 2 classes"
            )
        if d.eval_size <= 0 or d.train_size < global_batch:
            raise ConfigError(
                f"data.train_size={d.train_size} and data.eval_size={d.eval_size}: the train split "
                f"needs at least train.global_batch={global_batch} examples and the eval split one"
            )
        train = SyntheticSource(d.image_shape, d.num_classes, d.train_size, global_batch, seed, with_index=with_index)
        return train, synthetic_eval(d.image_shape, d.num_classes, d.eval_size, seed)
    if not d.tfds_name:
        raise ConfigError(f"data={d.name} has no data.tfds_name; set it or use data=synthetic")
    train = load_tfds_split(d.tfds_name, "train", d.data_dir, d.cache_dir, download=d.download)
    test = load_tfds_split(d.tfds_name, "test", d.data_dir, d.cache_dir, download=d.download)
    if tuple(train.images.shape[1:]) != tuple(d.image_shape):
        raise ConfigError(
            f"data.image_shape={list(d.image_shape)} but {d.tfds_name} images are "
            f"{list(train.images.shape[1:])}; fix data.image_shape"
        )
    # labels must fit data.num_classes; the split must hold one global batch
    top = int(max(train.labels.max(initial=0), test.labels.max(initial=0)))
    if top >= d.num_classes:
        raise ConfigError(
            f"data.num_classes={d.num_classes} but {d.tfds_name} has label {top}; set data.num_classes={top + 1}"
        )
    if len(train) < global_batch:
        raise ConfigError(
            f"train.global_batch={global_batch} exceeds the {len(train)} examples of "
            f"{d.tfds_name}/train; lower train.global_batch"
        )
    needed = split_bytes(train)
    if d.on_device and bytes_limit and needed > bytes_limit:
        raise ConfigError(
            f"data.on_device=true: the {d.tfds_name} training split takes {needed} bytes on every device, more "
            f"than the {bytes_limit} bytes JAX may use on one; set data.on_device=null or false (host batches)"
        )
    on_device = on_every_process(split_fits_on_device(needed, bytes_limit)) if d.on_device is None else d.on_device
    kind = DeviceSource if on_device else TrainSource
    source = kind(train, global_batch, seed, with_index=with_index)
    source.fingerprint = tfds_fingerprint(d.tfds_name, d.data_dir, "train", len(train))
    return source, test


def on_every_process(fits: bool) -> bool:
    """``data.on_device=null`` with several processes: the split goes to the devices only when it fits on every
    process's devices (one ``multihost_utils.process_allgather`` of an int32: every process calls it), so that all
    run the same programs even on hosts with different devices. One process: ``fits``."""
    if jax.process_count() == 1:
        return fits
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.int32(fits))))
