"""Everything before the first training step: plan, data, build, restore, compile, static measurements.

``prepare(cfg, run_dir)`` returns one ``Prepared`` value that the loop (``training.loop``) consumes, or
``Finished`` when the run's final checkpoint and successful summary already exist (a rerun of a finished run).
Every check that needs no data already happened in ``training.build.plan``; the ones here need the run folder,
the data (sizes, labels) or a checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import jax
import numpy as np

from conf.schema import Config, as_dict
from core.errors import ConfigError
from data.pipeline import (
    DeviceSource,
    SyntheticSource,
    TrainSource,
    make_eval_set,
    split_bytes,
    split_fits_on_device,
    synthetic_eval,
    train_batches,
)
from data.sources import load_tfds_split
from measure.compiled import (
    compiled_step_metrics,
    device_memory_stat,
    hardware_profile,
    lookup_link_bytes_per_s,
    lookup_peak_flops_per_s,
    state_bytes_per_device,
)
from measure.profiler import check_window
from measure.rates import comm_time_model_s
from measure.throughput import STARTUP
from training import checkpoint
from training.build import Experiment, Plan, build, plan, uses_dropout
from training.distributed import dump_batch_indices
from training.loop import check_in_flight
from training.validate import check_run_folder

log = logging.getLogger(__name__)
_NO_LINK_REPORTED: set[str] = set()  # device kinds whose missing link bandwidth was reported


def describe(cfg: Config) -> dict[str, Any]:
    """Summary keys known before anything is built (also written for failed runs)."""
    return {
        "parallel": cfg.parallel.name,
        "precision": cfg.precision.name,
        "model": cfg.model.name,
        "data": cfg.data.name,
        "mesh/devices_requested": cfg.mesh.devices,
        "train/accum_steps": cfg.train.accum_steps,
        "process_count": jax.process_count(),
    }


def inherit_settings(cfg: Config, run_dir: Path) -> Config:
    """``cfg`` with every key of ``training.checkpoint.policy.INHERITED`` it leaves null set: to the value of the
    checkpoint this run would resume (its saved config; ``ABSENT_MEANS`` for a checkpoint saved before the key
    existed), else to the new-run default (``optim.weight_decay_mask`` matrices, ``model.attention_dropout`` =
    ``model.dropout``). Read before ``plan``: only the JSON metadata of the step ``checkpoint.resume`` would try
    first; a bad checkpoint setting or an unreadable step is left to ``checkpoint.prepare`` and the resume to
    report."""
    saved = None
    try:
        step_dir = checkpoint.candidate_step_dir(checkpoint.prepare(cfg.checkpoint, run_dir, jax.process_count()))
        if step_dir is not None:
            saved = checkpoint.read_metadata(step_dir).get("config", {})
    except (ConfigError, OSError, ValueError):
        saved = None
    return with_inherited(cfg, saved)


TOKENIZER_FILE = "tokenizer.json"  # the run's tokenizer, saved in the run folder and the checkpoint folder


def saved_tokenizer(ckpt_plan) -> Optional[Path]:
    """The ``tokenizer.json`` saved with the checkpoint this run would resume (beside its step folder), or None
    (no checkpoint to resume; byte tokens save none)."""
    step_dir = checkpoint.candidate_step_dir(ckpt_plan)
    return None if step_dir is None else tokenizer_beside(step_dir)


def tokenizer_beside(step_dir: Path) -> Optional[Path]:
    """The ``tokenizer.json`` of the checkpoint at ``step_dir``: in its checkpoint folder (for ``<dir>/best/<step>``:
    ``<dir>``), else in the run folder its metadata names; None when there is none."""
    step_dir = Path(step_dir)
    places = [step_dir.parent, step_dir.parent.parent]
    try:
        run_dir = checkpoint.read_metadata(step_dir).get("run_dir")
        places += [Path(run_dir)] if run_dir else []
    except (OSError, ValueError):
        pass
    return next((place / TOKENIZER_FILE for place in places if (place / TOKENIZER_FILE).is_file()), None)


def save_tokenizer(tokenizer, run_dir: Path, ckpt_plan) -> None:
    """Writes a BPE or file tokenizer as ``tokenizer.json`` into the run folder and the checkpoint folder (process
    0; atomically), so that ``python -m sample`` / ``evaluate`` and a resumed run encode with the same one.
    A checkpoint folder that already holds checkpoints keeps its own (the run resumed with it)."""
    from data.tokens import write_atomic

    text = tokenizer.to_json()
    if text is None or jax.process_index() != 0:
        return
    write_atomic(Path(run_dir) / TOKENIZER_FILE, text)
    if ckpt_plan.directory is not None:
        kept = Path(ckpt_plan.directory) / TOKENIZER_FILE
        if not (kept.is_file() and checkpoint.complete_steps(ckpt_plan.directory)):
            write_atomic(kept, text)


def with_inherited(cfg: Config, saved_cfg: Optional[dict]) -> Config:
    """``cfg`` with the ``INHERITED`` keys it leaves null set from ``saved_cfg`` (the config saved with the
    checkpoint it resumes or evaluates; None: a new run), ``training.checkpoint.policy.inherited_values``."""
    from training.checkpoint.policy import inherited_values

    for key, value in inherited_values(saved_cfg, as_dict(cfg)).items():
        group, name = key.split(".")
        cfg = dataclasses.replace(cfg, **{group: dataclasses.replace(getattr(cfg, group), **{name: value})})
    return cfg


def check_keep_best(cfg: Config, ckpt_plan) -> None:
    """``checkpoint.keep_best`` must name a metric this run's evaluation logs (``eval/perplexity`` and ``eval/bpb``:
    the GPT's only); without ``train.eval_every`` only the final evaluation is compared, which a warning says.
    Raises ConfigError (one line)."""
    metric = ckpt_plan.keep_best
    if metric in ("eval/perplexity", "eval/bpb") and cfg.model.name != "gpt":
        raise ConfigError(
            f"checkpoint.keep_best={metric} is a language model's metric; model={cfg.model.name} logs eval/loss and "
            f"eval/accuracy"
        )
    if metric and not cfg.train.eval_every:
        checkpoint.warn(
            f"checkpoint.keep_best={metric} without train.eval_every: only the final evaluation is compared, so the "
            f"best checkpoint is the last step's; set train.eval_every=N to keep the best of every N steps"
        )


def batches_need_index(cfg: Config) -> bool:
    """Whether training batches must carry ``index`` (without it a step places 2 arrays, not 3): per-example
    keys (dropout, augmentation) or the debug dump of placed indices need it."""
    return uses_dropout(cfg) or cfg.data.augment or cfg.train.debug_dump_indices


TEXT_DATA = ("tiny_shakespeare", "text")


def gpt_dims(cfg: Config):
    """The GPT's resolved dimensions (``models.gpt.GPTDims``) of ``cfg.model``."""
    from models.gpt import resolve_dims

    m = cfg.model
    return resolve_dims(
        m.size,
        vocab_size=m.vocab_size,
        context=m.context,
        max_positions=m.max_positions,
        width=m.width,
        depth=m.depth,
        heads=m.heads,
        mlp_ratio=m.mlp_ratio,
    )


def load_text_corpus(cfg: Config, saved_tokenizer: Optional[Path] = None):
    """The tokens and the tokenizer of ``data=tiny_shakespeare`` / ``data=text`` (``data.text.load_text``):
    ``saved_tokenizer``, the ``tokenizer.json`` saved with the checkpoint this run resumes or evaluates, wins over
    training or loading another. Raises DataError (one line)."""
    from data.text import load_text

    d = cfg.data
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


def with_text_vocab(cfg: Config, tokenizer) -> Config:
    """``cfg`` whose ``model.vocab_size`` follows a BPE or file tokenizer: null becomes the tokenizer's size (byte
    tokens keep the size preset's vocabulary, 256 for ``tiny``); a value set stays (``load_text_data`` refuses one
    smaller than the tokenizer's)."""
    if tokenizer.name == "bytes" or getattr(cfg.model, "vocab_size", 0) is not None:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size))


def load_text_data(cfg: Config, p: Plan, text=None):
    """(train ``WindowSource``, host validation windows ``data.text.TextEvalSet``) for the language model: the
    tokens of ``data=tiny_shakespeare`` / ``data=text`` (``text``: ``load_text_corpus``'s, loaded here when None),
    or random tokens with ``data=synthetic``.

    Raises:
      ConfigError: an image data set with model=gpt, tokens outside the model's vocabulary, a split shorter
        than one window. DataError: the text is missing, empty or not UTF-8; a bad tokenizer setting.
    """
    from data.text import VOCAB_BYTES, WindowSource, eval_windows, synthetic_tokens

    d, dims = cfg.data, gpt_dims(cfg)
    t = dims.context
    tokenizer, token_bytes = None, None
    if d.name == "synthetic":
        if d.train_size <= t or d.eval_size <= t:
            raise ConfigError(
                f"data.train_size={d.train_size} and data.eval_size={d.eval_size} tokens: each must exceed one "
                f"window of model.context={t} tokens"
            )
        train, test = synthetic_tokens(dims.vocab_size, d.train_size, d.eval_size, cfg.train.seed)
    elif d.name in TEXT_DATA:
        byte_tokens = d.tokenizer == "bytes" and not d.tokenizer_file
        if byte_tokens and dims.vocab_size < VOCAB_BYTES:
            raise ConfigError(
                f"model.vocab_size={dims.vocab_size} is smaller than the {VOCAB_BYTES} byte tokens of "
                f"data={d.name}; set model.vocab_size={VOCAB_BYTES} (or leave it null with model.size=tiny)"
            )
        if d.eval_windows is not None and d.eval_windows < 1:
            raise ConfigError(f"data.eval_windows={d.eval_windows} must be >= 1 (or null: every validation window)")
        text = text if text is not None else load_text_corpus(cfg)
        tokenizer = text.tokenizer
        if dims.vocab_size < tokenizer.vocab_size:
            which = f"data.tokenizer_file={d.tokenizer_file}" if d.tokenizer_file else f"data.tokenizer={d.tokenizer}"
            raise ConfigError(
                f"model.vocab_size={dims.vocab_size} is smaller than the {tokenizer.vocab_size} tokens of {which}; "
                f"leave model.vocab_size null (the tokenizer's size) or raise it"
            )
        train, test = text.train, text.validation
        unit = "bytes" if tokenizer.name == "bytes" else "tokens"
        for split, tokens in (("train", train), ("validation", test)):
            if len(tokens) <= t:
                raise ConfigError(
                    f"the {split} split of data.path={d.path or d.name} has {len(tokens)} {unit}, not more than "
                    f"one window of model.context={t}; give a longer text or lower model.context"
                )
        token_bytes = tokenizer.token_bytes()
    else:
        raise ConfigError(
            f"model=gpt trains on text, not data={d.name}; use data=tiny_shakespeare, data=text data.path=FILE "
            f"or data=synthetic"
        )
    source = WindowSource(train, t, p.global_batch, cfg.train.seed, with_index=batches_need_index(cfg))
    source.tokenizer = tokenizer
    return source, eval_windows(test, t, getattr(d, "eval_windows", None), token_bytes)


def load_data(cfg: Config, p: Plan, text=None):
    """(train source, host test split). The train source of an image data set is a ``DeviceSource`` (the split in
    device memory) or a ``TrainSource`` (host batches), as ``data.on_device`` says (null: ``split_fits_on_device``
    of the split's bytes and ``device_bytes_limit()``); synthetic data is generated on the devices either way.

    Raises DataError with one line when the dataset is missing, ConfigError when the data does not fit the config
    (image shape, labels, fewer examples than one global batch, ``data.on_device=true`` with a split larger than
    a device's memory limit)."""
    d = cfg.data
    if cfg.model.name == "gpt":
        return load_text_data(cfg, p, text)
    if d.name in TEXT_DATA:
        raise ConfigError(f"data={d.name} is text: train it with model=gpt (model={cfg.model.name} reads images)")
    if d.name == "synthetic":
        # synthetic sizes and shape are checked before anything is generated
        if len(d.image_shape) != 3 or min(d.image_shape) <= 0 or d.num_classes < 2:
            raise ConfigError(
                f"data.image_shape={list(d.image_shape)} and data.num_classes={d.num_classes} must "
                f"be [H, W, C] with positive sizes and at least 2 classes"
            )
        if d.eval_size <= 0 or d.train_size < p.global_batch:
            raise ConfigError(
                f"data.train_size={d.train_size} and data.eval_size={d.eval_size}: the train split "
                f"needs at least train.global_batch={p.global_batch} examples and the eval split one"
            )
        train = SyntheticSource(
            d.image_shape,
            d.num_classes,
            d.train_size,
            p.global_batch,
            cfg.train.seed,
            with_index=batches_need_index(cfg),
        )
        return train, synthetic_eval(d.image_shape, d.num_classes, d.eval_size, cfg.train.seed)
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
    if len(train) < p.global_batch:
        raise ConfigError(
            f"train.global_batch={p.global_batch} exceeds the {len(train)} examples of "
            f"{d.tfds_name}/train; lower train.global_batch"
        )
    needed, limit = split_bytes(train), device_bytes_limit()
    if d.on_device and limit and needed > limit:
        raise ConfigError(
            f"data.on_device=true: the {d.tfds_name} training split takes {needed} bytes on every device, more "
            f"than the {limit} bytes JAX may use on one; set data.on_device=null or false (host batches)"
        )
    on_device = on_every_process(split_fits_on_device(needed, limit)) if d.on_device is None else d.on_device
    kind = DeviceSource if on_device else TrainSource
    return kind(train, p.global_batch, cfg.train.seed, with_index=batches_need_index(cfg)), test


def on_every_process(fits: bool) -> bool:
    """``data.on_device=null`` with several processes: the split goes to the devices only when it fits on every
    process's devices (one ``multihost_utils.process_allgather`` of an int32: every process calls it), so that all
    run the same programs even on hosts with different devices. One process: ``fits``."""
    if jax.process_count() == 1:
        return fits
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.int32(fits))))


def device_bytes_limit() -> Optional[int]:
    """Bytes JAX's allocator may use on a local device (``memory_stats()['bytes_limit']``: GPU, TPU; on a GPU
    with JAX's default preallocation ~75% of its memory), None where the backend reports none (CPU) or the
    statistics cannot be read."""
    return device_memory_stat("bytes_limit") or None  # a reported 0: no limit known


def total_steps(cfg: Config, steps_per_epoch: int) -> int:
    """Optimizer steps of the run: ``train.steps``, else ``train.epochs`` x steps per epoch."""
    return cfg.train.steps if cfg.train.steps is not None else cfg.train.epochs * steps_per_epoch


@dataclasses.dataclass
class Prepared:
    """One run, ready for its first step.

    ``exp.state`` is the initial (or restored) placed state; ``first`` the batch of step ``start`` (already
    placed; with ``exp.feed`` the device arrays the step gathers it from) and ``batches`` the iterator of the
    following ones; ``compiled`` the compiled train step;
    ``info``: the static figures of the run (summary keys: mesh, batch, ``comm/*``, ``mem/*``, ``perf/*``).
    """

    cfg: Config
    plan: Plan
    run_dir: Path
    exp: Experiment
    source: Any
    eval_set: Any
    n_steps: int
    start: int
    restored: Optional[checkpoint.Restored]
    ckpt_plan: checkpoint.CheckpointPlan
    first: Any
    batches: Iterator
    lowered: Any
    compiled: Any
    info: dict[str, Any]
    peak_flops_per_s: Optional[float]

    def param_count(self) -> int:
        """Trainable parameters: elements of every leaf of the host-form params."""
        params = self.exp.mode.host_abstract(self.exp.state).params
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


@dataclasses.dataclass
class Finished:
    """A rerun of a run that already finished: the saved run's ``summary.json`` (nothing to train)."""

    summary: dict[str, Any]


def restore(cfg: Config, p: Plan, exp: Experiment, ckpt_plan, n_steps: int, steps_per_epoch: int):
    """Restores the checkpoint the resume policy picks onto THIS run's layout, before compiling; returns
    ``(restored or None, first step, the saved run's summary when it already finished or None)`` and warns
    when the data order or settings changed.

    Raises:
      ConfigError: the checkpoint was trained with settings a resume refuses (checked on its metadata before
        anything is restored: ``training.checkpoint.policy``), or it is past this run's last step.
    """
    checkpoint.check_resume_settings(
        ckpt_plan, as_dict(cfg), p.global_batch
    )  # refused changes: one line, nothing moved
    restored = checkpoint.resume(ckpt_plan, exp.mode, exp.state)
    if restored is None:
        return None, 0, None
    if restored.step > n_steps:
        raise ConfigError(
            f"checkpoint {restored.path} is at step {restored.step}, past this run's "
            f"{n_steps} steps; raise train.steps/train.epochs or set checkpoint.resume=never"
        )
    finished = (
        checkpoint.finished_summary(restored.metadata.get("run_dir"), n_steps) if restored.step == n_steps else None
    )
    if finished is not None:  # a rerun of a finished run: its summary, no training, no W&B
        return restored, restored.step, finished
    exp.state = restored.state
    for line in checkpoint.data_order_warnings(
        restored.metadata,
        global_batch=p.global_batch,
        seed=cfg.train.seed,
        steps_per_epoch=steps_per_epoch,
        data=cfg.data.name,
    ):
        checkpoint.warn(line)
    changes = checkpoint.config_changes(restored.metadata.get("config", {}), as_dict(cfg))
    if changes:
        checkpoint.warn(f"resuming {restored.path} with settings that differ from its run: {'; '.join(changes)}")
    return restored, restored.step, None


def text_info(text, test) -> dict[str, Any]:
    """Summary keys of a text data set: the tokenizer, its vocabulary, the splits' tokens and the bytes per token
    (``data/eval_bytes_per_token`` of the evaluated targets: ``eval/bpb``; ``data/train_bytes_per_token`` of the
    training split: ``train/bpb``), and where the tokens live (a token folder, or null: in memory)."""
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
    }


def static_info(cfg: Config, p: Plan, exp: Experiment, n_steps: int, steps_per_epoch: int) -> dict[str, Any]:
    """Summary keys known once the experiment is built (mesh, batch, schedule)."""
    device, mode = p.devices[0], exp.mode
    return {
        **describe(cfg),
        "platform": device.platform,
        "device_kind": device.device_kind,
        "process_count": jax.process_count(),
        "mesh/devices": mode.num_devices,
        "mesh/shape": list(p.mesh_shape),
        "train/global_batch": p.global_batch,
        "train/per_device_batch": p.per_device_batch,
        "train/scaling": p.scaling,
        "train/steps": n_steps,
        "train/steps_per_epoch": steps_per_epoch,
        "parallel/grad_reduce_dtype": cfg.parallel.grad_reduce_dtype,
        "optim/peak_lr": p.peak_lr,
        "parallel/grad_compression": cfg.parallel.grad_compression,  # sweeps.report groups by it
    }


def language_model_info(cfg: Config, p: Plan, exp: Experiment) -> dict[str, Any]:
    """The GPT's static figures: ``model/param_count``, ``model/vocab_size``, ``train/tokens_per_example`` (T),
    ``train/tokens_per_step`` (global batch x T), ``perf/flops_per_token`` = 6N + 12·L·d·T (PaLM appendix B;
    ``models.gpt.flops_per_token``) and ``perf/flops_per_step_per_device`` from it (the model FLOPs of MFU;
    XLA's count of the compiled step, which includes rematerialised work, moves to
    ``perf/flops_per_step_per_device_xla``)."""
    from models.gpt import flops_per_token

    dims = gpt_dims(cfg)
    n = int(sum(int(np.prod(x.shape)) for x in jax.tree.leaves(exp.mode.host_abstract(exp.state).params)))
    per_token = flops_per_token(n, dims.depth, dims.width, dims.context)
    tokens = p.global_batch * dims.context
    out: dict[str, Any] = {
        "model/param_count": n,
        "model/vocab_size": dims.vocab_size,
        "model/context": dims.context,
        "train/tokens_per_example": dims.context,
        "train/tokens_per_step": tokens,
        "perf/flops_per_token": per_token,
        "perf/flops_per_step_per_device": per_token * tokens / exp.mode.num_devices,
    }
    return out


class CacheEvents:
    """Counts JAX's persistent compilation cache events while open (``jax.monitoring`` listeners).

    ``outcome()``: ``"hit"`` (every program compiled inside was loaded from the cache), ``"miss"`` (at least one
    was compiled and not found), ``"off"`` (no program asked the cache: it is off, or nothing compiled).
    """

    EVENTS = {
        "/jax/compilation_cache/compile_requests_use_cache": "requests",
        "/jax/compilation_cache/cache_hits": "hits",
        "/jax/compilation_cache/cache_misses": "misses",
    }

    def __init__(self) -> None:
        self.counts = {"requests": 0, "hits": 0, "misses": 0}

    def _on_event(self, event: str, **kwargs) -> None:
        name = self.EVENTS.get(event)
        if name is not None:
            self.counts[name] += 1

    def __enter__(self) -> "CacheEvents":
        jax.monitoring.register_event_listener(self._on_event)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_listener(self._on_event)

    def outcome(self) -> str:
        if self.counts["misses"]:
            return "miss"
        return "hit" if self.counts["hits"] else "off"


def compile_step(cfg: Config, p: Plan, exp: Experiment, first, info: dict[str, Any]):
    """Lowers and compiles the train step for ``first``'s shapes; adds compile time, ``comm/*``, ``mem/*``,
    ``perf/flops_*`` and the modelled communication time to ``info``. Returns ``(lowered, compiled, peak
    FLOP/s or None)``; ``perf/startup/compile_cache`` says whether the persistent compilation cache held the
    step (``CacheEvents``: hit, miss, off)."""
    device = p.devices[0]
    t0 = time.perf_counter()
    lowered = exp.steps.train.lower(exp.state, first)
    with CacheEvents() as cache:
        compiled = lowered.compile()
    info["perf/compile_time_s"] = time.perf_counter() - t0
    info["perf/startup/compile_cache"] = cache.outcome()
    info.update(compiled_step_metrics(lowered, compiled, exp.mode.num_devices))
    if "perf/flops_per_step_per_device" in info and exp.local.tokens:
        info["perf/flops_per_step_per_device_xla"] = info["perf/flops_per_step_per_device"]
    if exp.local.tokens:
        info.update(language_model_info(cfg, p, exp))
    info["mem/state_bytes_per_device"] = state_bytes_per_device(exp.state)
    detect = cfg.hardware.detect  # hardware=auto: the profile matching the device kind; a chosen profile: its own
    info["hardware/profile"] = hardware_profile(cfg.hardware, device.device_kind)  # null when none
    link = cfg.hardware.link_bytes_per_s or (lookup_link_bytes_per_s(device.device_kind) if detect else None)
    peak_flops = cfg.hardware.peak_flops_per_s or (
        lookup_peak_flops_per_s(device.device_kind, cfg.precision.compute_dtype) if detect else None
    )
    if link is None:
        if device.device_kind not in _NO_LINK_REPORTED:  # once per process (a sweep's jobs share it)
            _NO_LINK_REPORTED.add(device.device_kind)
            log.info(
                "no link bandwidth known for %s: comm/time_model_s and comm/ratio_model are not computed "
                "(set hardware.link_bytes_per_s to model a target)",
                device.device_kind,
            )
    else:
        info["hardware/link_bytes_per_s"] = link
        info["comm/time_model_s"] = comm_time_model_s(info["comm/bytes_per_step"], link)
    return lowered, compiled, peak_flops


def prepare(cfg: Config, run_dir: Path) -> Union[Prepared, Finished]:
    """Plan, data, build, restore, compile: the run up to its first step (``Finished`` without compiling when
    the checkpoint restored is the final one of a run that already finished). Raises USER_ERRORS (one line)."""
    cfg = inherit_settings(cfg, run_dir)  # the null settings a resumed run keeps from its checkpoint
    p = plan(cfg)  # every check that needs neither data nor compilation
    check_in_flight(cfg.train.max_in_flight, p.devices)
    check_run_folder(run_dir, cfg.checkpoint)
    STARTUP.mark("config")  # perf/startup/*_s (measure.throughput.StartupPhases)
    ckpt_plan = checkpoint.prepare(cfg.checkpoint, run_dir, jax.process_count())  # the resume path exists
    check_keep_best(cfg, ckpt_plan)
    if ckpt_plan.directory is not None:  # orbax's import overlaps data, build and compile
        checkpoint.preload_orbax()
    STARTUP.mark("checkpoint")
    text = None
    if cfg.model.name == "gpt" and cfg.data.name in TEXT_DATA:  # the tokenizer fixes the model's vocabulary
        text = load_text_corpus(cfg, saved_tokenizer(ckpt_plan))
        resolved = with_text_vocab(cfg, text.tokenizer)
        if resolved is not cfg:
            cfg, p = resolved, plan(resolved)
    source, test = load_data(cfg, p, text)
    if text is not None:
        save_tokenizer(text.tokenizer, run_dir, ckpt_plan)
    n_steps = total_steps(cfg, source.steps_per_epoch)
    window_error = check_window(cfg.profile.enabled, cfg.profile.start_step, cfg.profile.num_steps, n_steps)
    if window_error:  # with train.steps set, plan() already checked this; with train.epochs it needs the data
        raise ConfigError(window_error)
    STARTUP.mark("data")
    # the split on the devices: the train step gathers its own batches (one program per step), except under pmap
    # (fuses_feed) and with the debug dump of placed indices (it reads each step's batch)
    fuse = isinstance(source, DeviceSource) and not cfg.train.debug_dump_indices
    exp = build(p, feed_for=source.feed if fuse else None)
    layout = exp.mode.batch_layout()
    STARTUP.mark("build")
    eval_set = make_eval_set(test, cfg.train.eval_batch, exp.mode.num_devices, layout)
    STARTUP.mark("data")
    restored, start, finished = restore(cfg, p, exp, ckpt_plan, n_steps, source.steps_per_epoch)
    if finished is not None:
        return Finished(finished)
    STARTUP.mark("checkpoint")
    info = static_info(cfg, p, exp, n_steps, source.steps_per_epoch)
    if text is not None:
        info.update(text_info(text, test))
    # batches made on the devices: the split in device memory (data.on_device) or synthetic data generated there
    info["data/on_device"] = isinstance(source, (DeviceSource, SyntheticSource))
    if isinstance(source, DeviceSource):
        info["data/on_device_bytes"] = source.split_bytes  # per device
        info["data/gather_in_step"] = exp.feed is not None
    first_step = min(start, n_steps - 1)  # a resumed run continues the data order at its step
    if exp.feed is not None:  # the step's own step counter picks its batch: the loop hands it the split's arrays
        batches = source.device_feeds(layout, first_step, n_steps)
    else:
        batches = train_batches(source, layout, first_step, n_steps, cfg.data.prefetch)
    if cfg.train.debug_dump_indices:  # debug aid: which examples each process placed, per step
        batches = dump_batch_indices(batches, run_dir / f"debug_indices_process{jax.process_index()}.jsonl", first_step)
    first = next(batches)
    STARTUP.mark("data")
    lowered, compiled, peak_flops = compile_step(cfg, p, exp, first, info)
    STARTUP.mark("compile")
    checkpoint.wait_for_orbax()  # no import beside the steps (it would take the interpreter lock from them)
    STARTUP.mark("checkpoint")
    return Prepared(
        cfg=cfg,
        plan=p,
        run_dir=run_dir,
        exp=exp,
        source=source,
        eval_set=eval_set,
        n_steps=n_steps,
        start=start,
        restored=restored,
        ckpt_plan=ckpt_plan,
        first=first,
        batches=batches,
        lowered=lowered,
        compiled=compiled,
        info=info,
        peak_flops_per_s=peak_flops,
    )
