"""What a run builds from its typed config before the first step: ``plan`` (the checks that need the devices,
the mode, the libraries or the model; one ``ConfigError`` line), ``load_data``, ``build`` (mesh, mode, placed
state, jitted steps) and ``static_info`` (the run's figures known once built)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from conf.schema import Config, OptimConfig
from core.errors import ConfigError
from core.layout import BatchLayout
from core.optim import effective_lr, make_optimizer, make_schedule
from core.precision import init_loss_scale
from core.step import LocalGrads, TrainState, Updater, create_state
from data.augment import augment_spec
from data.load import image_data, text_data
from measure.compiled import device_memory_stat
from measure.memory import check_state_fits
from models import build_model
from parallel import MODES, ParallelMode, make_mesh, mode_class, resolve_mesh_shape
from parallel.base import StepFns, check_mesh_shape, reduce_dtype
from parallel.compress import COMPRESSIONS
from parallel.fsdp import check_rules
from parallel.state import host_abstract
from training.report import resolve_wandb_mode
from training.validate import check_library_settings

TRANSFER_GUARDS = ("allow", "log", "disallow", "log_explicit", "disallow_explicit")  # jax.transfer_guard levels
COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
DEFAULT_GLOBAL_BATCH = 256


@dataclasses.dataclass(frozen=True)
class Plan:
    """Validated numbers of a run."""

    cfg: Config
    devices: tuple  # the jax devices of the mesh
    mesh_shape: tuple[int, int]
    global_batch: int
    per_device_batch: int
    scaling: str  # strong | weak
    compute_dtype: Any
    peak_lr: float
    # the model's nnx graph (structure, no arrays), from the abstract model plan() checks
    graphdef: Any = dataclasses.field(default=None, compare=False)
    # the model calls a Pallas kernel (splash attention): core.step.LocalGrads.manual_kernels
    manual_kernels: bool = False


def resolve_batch(global_batch: Optional[int], per_device_batch: Optional[int], num_devices: int) -> tuple[int, str]:
    """(global batch, 'strong'|'weak'). Weak scaling: per_device_batch x devices (the schema refuses both set)."""
    if per_device_batch is not None:
        return per_device_batch * num_devices, "weak"
    return DEFAULT_GLOBAL_BATCH if global_batch is None else global_batch, "strong"


def plan(cfg: Config) -> Plan:
    """Checks ``cfg`` (whose values the schema checked: ``conf.schema.validate``) against the visible devices, the
    mode, the libraries and the model. Raises ConfigError (one line) on bad input."""
    visible = jax.devices()
    n = len(visible) if cfg.mesh.devices is None else cfg.mesh.devices
    if n <= 0:
        raise ConfigError(f"mesh.devices={n} must be positive (or null for all {len(visible)} devices)")
    if n > len(visible):
        hint = (
            f"; raise runtime.cpu_devices (now {cfg.runtime.cpu_devices}) to at least {n}"
            if visible[0].platform == "cpu"
            else ""
        )
        raise ConfigError(f"mesh.devices={n} but only {len(visible)} {visible[0].platform} devices are visible{hint}")
    if jax.process_count() > 1 and n != len(visible):
        raise ConfigError(f"mesh.devices={n} with {jax.process_count()} processes must use all {len(visible)} devices")
    mode = mode_class(cfg.parallel.name)
    shape = resolve_mesh_shape(cfg.mesh.shape, mode.default_mesh_shape, n, mode.name)
    check_mesh_shape(mode, shape)
    gb, scaling = resolve_batch(cfg.train.global_batch, cfg.train.per_device_batch, n)
    k = cfg.train.accum_steps
    if gb % (n * k):
        what = f"mesh.devices={n}" + (f" x train.accum_steps={k} = {n * k}" if k > 1 else "")
        raise ConfigError(
            f"train.global_batch={gb} is not divisible by {what}; choose a global batch that is "
            f"a multiple of {n * k} (e.g. {max(1, round(gb / (n * k))) * n * k})"
        )
    if gb % jax.process_count():
        raise ConfigError(f"train.global_batch={gb} is not divisible by {jax.process_count()} processes")
    check_compression(cfg.parallel.grad_compression, cfg.parallel.grad_reduce_dtype, mode)
    check_rules(getattr(cfg.parallel, "fsdp_rules", ()))
    check_library_settings(cfg, extra_tags=[mode.name, cfg.precision.name, f"devices={n}"])
    check_in_flight(cfg.train.max_in_flight, visible[:n])
    try:
        reduce_dtype(cfg.parallel.grad_reduce_dtype)
        augment_spec(cfg.data.augment, cfg.data.crop_padding, cfg.data.flip)
        peak = effective_lr(cfg.optim.lr, cfg.optim.lr_scaling, gb, cfg.optim.base_batch)
        _optimizer(cfg, peak)
        resolve_wandb_mode(cfg.wandb.mode)
        # the model's own checks (shapes, names), without computing; its graph is what build() uses
        abstract = nnx.eval_shape(lambda: _model(cfg))
        graphdef = nnx.graphdef(abstract)
    except ValueError as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    return Plan(
        cfg=cfg,
        devices=tuple(visible[:n]),
        mesh_shape=shape,
        global_batch=gb,
        per_device_batch=gb // n,
        scaling=scaling,
        compute_dtype=COMPUTE_DTYPES[cfg.precision.compute_dtype],
        peak_lr=peak,
        graphdef=graphdef,
        manual_kernels=getattr(abstract, "attention", None) == "splash",
    )


def check_compression(compression: str, grad_reduce_dtype: Optional[str], mode: type[ParallelMode]) -> None:
    """Raises ConfigError for an unknown ``parallel.grad_compression``, one the mode does not implement, or a
    compression together with ``parallel.grad_reduce_dtype`` (it replaces the reduction, the dtype would be
    ignored)."""
    if compression not in COMPRESSIONS:
        raise ConfigError(
            f"parallel.grad_compression={compression!r} is unknown; choose one of {', '.join(COMPRESSIONS)}"
        )
    if compression not in mode.compressions:
        ok = [m for m, cls in MODES.items() if compression in cls.compressions]
        raise ConfigError(
            f"parallel.grad_compression={compression} is not implemented for parallel={mode.name}; "
            f"use parallel={', '.join(ok)}, or parallel.grad_compression=none"
        )
    if compression != "none" and grad_reduce_dtype is not None:
        raise ConfigError(
            f"parallel.grad_compression={compression} replaces the gradient reduction, so "
            f"parallel.grad_reduce_dtype={grad_reduce_dtype} would be ignored; set "
            f"parallel.grad_reduce_dtype=null"
        )


def uses_dropout(cfg: Config) -> bool:
    """Whether the model draws dropout masks (per-example keys): ``model.dropout`` > 0, or the GPT's
    ``model.attention_dropout`` > 0 (null: ``model.dropout``)."""
    return cfg.model.dropout > 0 or (getattr(cfg.model, "attention_dropout", None) or 0) > 0


def is_language_model(cfg: Config) -> bool:
    """Whether the model is the GPT language model (token batches, per-token loss averaged per window)."""
    return cfg.model.name == "gpt"


def model_kwargs(model) -> dict[str, Any]:
    """The hyper-parameters of ``cfg.model`` (every key but ``name``) as keyword arguments of ``models.build_model``."""
    return {f.name: getattr(model, f.name) for f in dataclasses.fields(model) if f.name != "name"}


def optimizer_kwargs(optim) -> dict[str, Any]:
    """The optimizer's own hyper-parameters (the keys its schema adds to ``OptimConfig``) as keyword arguments of
    ``core.optim.make_optimizer``: e.g. ``{"momentum": 0.0}`` for SGD."""
    shared = {f.name for f in dataclasses.fields(OptimConfig)}
    return {f.name: getattr(optim, f.name) for f in dataclasses.fields(optim) if f.name not in shared}


def _model(cfg: Config):
    m = cfg.model
    return build_model(
        m.name, tuple(cfg.data.image_shape), cfg.data.num_classes, seed=cfg.train.seed, **model_kwargs(m)
    )


def _optimizer(cfg: Config, peak_lr: float):
    o = cfg.optim
    schedule = make_schedule(peak_lr, o.schedule, o.warmup_steps, o.decay_steps, o.min_lr)
    # A constant rate goes to optax as a number: no schedule state (a count) and no schedule evaluation in
    # every step; the schedule function still gives the logged optim/lr.
    constant = o.schedule == "constant" and o.warmup_steps <= 0
    tx = make_optimizer(
        o.name, peak_lr if constant else schedule, clip_grad_norm=o.clip_grad_norm, **optimizer_kwargs(o)
    )
    return tx, schedule


@dataclasses.dataclass
class Experiment:
    """Everything built from a plan: mesh, mode, the placed state and the jitted steps."""

    plan: Plan
    mode: ParallelMode
    local: LocalGrads
    updater: Updater
    state: TrainState  # placed on the devices
    steps: StepFns
    graphdef: Any
    feed: Any = None  # the data.pipeline.DeviceFeed the train step gathers its batches from, or None (batches)


def state_init_fn(cfg: Config, tx, graphdef: Any = None) -> tuple[Any, Any]:
    """``(graphdef, init_fn)``: the model's graph (``graphdef`` when the caller has it, else from an abstract model)
    and a pure ``() -> TrainState`` creating the initial state from ``train.seed``, which the mode runs under
    ``jax.jit`` with its shardings. The params are a plain nested dict of float32 arrays: jit flattens it in C++,
    where an ``nnx.State`` would cost Python time in every step."""
    if graphdef is None:
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: _model(cfg)))

    def init_fn() -> TrainState:
        _, params = nnx.split(_model(cfg), nnx.Param)
        params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), nnx.to_pure_dict(params))
        return create_state(params, tx, init_loss_scale(cfg.precision.loss_scale, cfg.precision.init_scale))

    return graphdef, init_fn


def build(p: Plan, feed_for: Optional[Callable[[BatchLayout], Any]] = None) -> Experiment:
    """Mesh, mode, initial state (placed) and the jitted train/eval steps for plan ``p``. ``feed_for``: ``layout ->
    DeviceFeed``; when the mode can (``fuses_feed``), the train step gathers its own batches from the split on the
    devices (``Experiment.feed``)."""
    cfg = p.cfg
    mesh = make_mesh(p.devices, p.mesh_shape)
    mode = mode_class(cfg.parallel.name)(
        mesh,
        global_batch=p.global_batch,
        accum_steps=cfg.train.accum_steps,
        min_shard_bytes=cfg.parallel.min_shard_bytes,
        grad_reduce_dtype=cfg.parallel.grad_reduce_dtype,
        grad_compression=cfg.parallel.grad_compression,
        **({"fsdp_rules": cfg.parallel.fsdp_rules} if hasattr(cfg.parallel, "fsdp_rules") else {}),
    )
    tx, schedule = _optimizer(cfg, p.peak_lr)
    graphdef, init_fn = state_init_fn(cfg, tx, p.graphdef)
    local = LocalGrads(
        graphdef=graphdef,
        compute_dtype=p.compute_dtype,
        accum_steps=cfg.train.accum_steps,
        seed=cfg.train.seed,
        use_example_keys=uses_dropout(cfg),
        augment=augment_spec(cfg.data.augment, cfg.data.crop_padding, cfg.data.flip),
        tokens=is_language_model(cfg),
        manual_kernels=p.manual_kernels,
    )
    updater = Updater(
        tx=tx,
        lr_schedule=schedule,
        loss_scaling=cfg.precision.loss_scale,
        growth_interval=cfg.precision.growth_interval,
        grad_norm_every=cfg.train.grad_norm_every or 0,
    )
    check_state_fits(cfg, init_fn, mode.state_shardings, list(mesh.devices.flat))  # one line, before building it
    state = mode.init_state(init_fn)  # created directly in the mode's layout (fsdp: sharded)
    abstract = host_abstract(state)
    for line in mode.setting_warnings(abstract):  # e.g. an fsdp rule that matches no array (a typo)
        logging.getLogger(__name__).warning(line)
    feed = feed_for(mode.batch_layout()) if feed_for is not None and mode.fuses_feed else None
    steps = mode.build(local, updater, abstract, feed=feed)
    return Experiment(
        plan=p, mode=mode, local=local, updater=updater, state=state, steps=steps, graphdef=graphdef, feed=feed
    )


# ---- steps in flight ------------------------------------------------------------------------------------------
# the most steps in flight on the CPU backend with more than one device: more can stall XLA:CPU's all-reduce until
# its 40 s rendezvous timeout aborts the process (SIGABRT)
CPU_MAX_IN_FLIGHT = 8


def check_in_flight(max_in_flight: int, devices: Sequence) -> None:
    """Raises ConfigError (one line, with the fix) for ``train.max_in_flight`` above ``CPU_MAX_IN_FLIGHT`` on more
    than one CPU device (``devices``: the run's)."""
    if len(devices) > 1 and devices[0].platform == "cpu" and max_in_flight > CPU_MAX_IN_FLIGHT:
        raise ConfigError(
            f"train.max_in_flight={max_in_flight} with {len(devices)} CPU devices: more steps in flight than "
            f"{CPU_MAX_IN_FLIGHT} can stall XLA:CPU's collectives until a 40 s timeout aborts the process; use "
            f"train.max_in_flight={CPU_MAX_IN_FLIGHT} or less"
        )


def in_flight_bound(num_devices: int, max_in_flight: int) -> Optional[int]:
    """Steps allowed in flight: ``max_in_flight`` when more than one device takes part (the bound exists for
    simulated-device collectives), None (unbounded: no wait per step) with one device."""
    return max_in_flight if num_devices > 1 else None


# ---- data -----------------------------------------------------------------------------------------------------
def batches_need_index(cfg: Config) -> bool:
    """Whether training batches must carry ``index`` (without it a step places 2 arrays, not 3): per-example
    keys (dropout, augmentation) or the debug dump of placed indices need it."""
    return uses_dropout(cfg) or cfg.data.augment or cfg.train.debug_dump_indices


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


def with_text_vocab(cfg: Config, tokenizer) -> Config:
    """``cfg`` whose ``model.vocab_size`` follows a BPE or file tokenizer: null becomes the tokenizer's size (byte
    tokens keep the size preset's vocabulary, 256 for ``tiny``); a value set stays (``data.load.text_data`` refuses
    one smaller than the tokenizer's)."""
    if tokenizer.name == "bytes" or getattr(cfg.model, "vocab_size", 0) is not None:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size))


def load_text_data(cfg: Config, p: Plan, text=None):
    """(train ``WindowSource``, host validation windows) of the language model (``data.load.text_data``;
    ``text``: the corpus ``data.load.text_corpus`` loaded, else loaded there)."""
    dims = gpt_dims(cfg)
    return text_data(
        cfg.data,
        context=dims.context,
        vocab_size=dims.vocab_size,
        global_batch=p.global_batch,
        seed=cfg.train.seed,
        with_index=batches_need_index(cfg),
        text=text,
    )


def load_data(cfg: Config, p: Plan, text=None):
    """(train source, host test split) of the run (``data.load``): text windows for model=gpt, else images."""
    if cfg.model.name == "gpt":
        return load_text_data(cfg, p, text)
    return image_data(
        cfg.data,
        model=cfg.model.name,
        global_batch=p.global_batch,
        seed=cfg.train.seed,
        with_index=batches_need_index(cfg),
        bytes_limit=device_bytes_limit(),
    )


def device_bytes_limit() -> Optional[int]:
    """Bytes JAX's allocator may use on a local device (``memory_stats()['bytes_limit']``: GPU, TPU; on a GPU
    with JAX's default preallocation ~75% of its memory), None where the backend reports none (CPU) or the
    statistics cannot be read."""
    return device_memory_stat("bytes_limit") or None  # a reported 0: no limit known


def total_steps(cfg: Config, steps_per_epoch: int) -> int:
    """Optimizer steps of the run: ``train.steps``, else ``train.epochs`` x steps per epoch."""
    return cfg.train.steps if cfg.train.steps is not None else cfg.train.epochs * steps_per_epoch


# ---- the run's static figures ---------------------------------------------------------------------------------
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
    n = int(sum(int(np.prod(x.shape)) for x in jax.tree.leaves(host_abstract(exp.state).params)))
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
