"""Typed config -> validated plan -> mesh, mode, model, state and jitted steps (no data, no logging).

``plan(cfg)`` checks everything that can be checked without touching data or compiling (batch and mesh
divisibility, names of modes, optimizers, schedules ...), raising ``ConfigError`` with one line naming the
offending values; ``build(plan)`` then creates the state and the steps.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from conf.schema import Config, model_kwargs, optimizer_kwargs
from core.errors import ConfigError
from core.layout import BatchLayout
from core.optim import effective_lr, make_optimizer, make_schedule
from core.precision import LOSS_SCALING_MODES, init_loss_scale
from core.step import LocalGrads, TrainState, Updater, create_state
from data.augment import augment_spec
from measure.profiler import check_window
from measure.throughput import check_target_accuracy
from models import build_model
from parallel import ParallelMode, make_mesh, mode_class, resolve_mesh_shape
from parallel.base import StepFns, reduce_dtype
from parallel.fsdp import check_rules
from parallel.options import COMPRESSIONS
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
    """(global batch, 'strong'|'weak'). Weak scaling: per_device_batch x devices.

    Raises:
      ConfigError: both set, or a non-positive value.
    """
    if global_batch is not None and per_device_batch is not None:
        raise ConfigError(
            f"train.global_batch={global_batch} and train.per_device_batch={per_device_batch} are "
            f"both set; set one (global_batch: strong scaling, per_device_batch: weak scaling)"
        )
    if per_device_batch is not None:
        if per_device_batch <= 0:
            raise ConfigError(f"train.per_device_batch={per_device_batch} must be positive")
        return per_device_batch * num_devices, "weak"
    gb = DEFAULT_GLOBAL_BATCH if global_batch is None else global_batch
    if gb <= 0:
        raise ConfigError(f"train.global_batch={gb} must be positive")
    return gb, "strong"


def plan(cfg: Config) -> Plan:
    """Validates ``cfg`` against the visible devices. Raises ConfigError (one line) on bad input."""
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
    mode.check(shape)
    gb, scaling = resolve_batch(cfg.train.global_batch, cfg.train.per_device_batch, n)
    k = cfg.train.accum_steps
    if k <= 0:
        raise ConfigError(f"train.accum_steps={k} must be positive")
    if gb % (n * k):
        what = f"mesh.devices={n}" + (f" x train.accum_steps={k} = {n * k}" if k > 1 else "")
        raise ConfigError(
            f"train.global_batch={gb} is not divisible by {what}; choose a global batch that is "
            f"a multiple of {n * k} (e.g. {max(1, round(gb / (n * k))) * n * k})"
        )
    if gb % jax.process_count():
        raise ConfigError(f"train.global_batch={gb} is not divisible by {jax.process_count()} processes")
    if cfg.precision.compute_dtype not in COMPUTE_DTYPES:
        raise ConfigError(
            f"precision.compute_dtype={cfg.precision.compute_dtype!r} is unknown; "
            f"choose one of {', '.join(COMPUTE_DTYPES)}"
        )
    if cfg.precision.loss_scale not in LOSS_SCALING_MODES:
        raise ConfigError(
            f"precision.loss_scale={cfg.precision.loss_scale!r} is unknown; "
            f"choose one of {', '.join(LOSS_SCALING_MODES)}"
        )
    for key, value in (
        ("train.log_every", cfg.train.log_every),
        ("train.eval_batch", cfg.train.eval_batch),
        ("train.sync_every", cfg.train.sync_every),
        ("train.max_in_flight", cfg.train.max_in_flight),
    ):
        if value <= 0:
            raise ConfigError(f"{key}={value} must be positive")
    if cfg.train.steps is not None and cfg.train.steps <= 0:
        raise ConfigError(f"train.steps={cfg.train.steps} must be positive (or null to use train.epochs)")
    if cfg.train.steps is None and cfg.train.epochs <= 0:
        raise ConfigError(f"train.epochs={cfg.train.epochs} must be positive")
    if cfg.train.eval_every is not None and cfg.train.eval_every <= 0:
        raise ConfigError(f"train.eval_every={cfg.train.eval_every} must be positive (or null: only at the end)")
    if cfg.train.sample_tokens < 0:
        raise ConfigError(
            f"train.sample_tokens={cfg.train.sample_tokens} must be >= 0 (bytes the GPT generates at the end; 0: none)"
        )
    if cfg.train.grad_norm_every is not None and not 0 < cfg.train.grad_norm_every < 2**31:
        raise ConfigError(
            f"train.grad_norm_every={cfg.train.grad_norm_every} must be in [1, {2**31 - 1}] (or null: no gradient norm)"
        )
    if cfg.data.on_device and cfg.model.name == "gpt":
        raise ConfigError(
            f"data.on_device=true keeps an image data set on the devices; model=gpt's text windows "
            f"(data={cfg.data.name}) are gathered on the host: set data.on_device=null or false"
        )
    check_compression(cfg.parallel.grad_compression, cfg.parallel.grad_reduce_dtype, mode)
    check_rules(getattr(cfg.parallel, "fsdp_rules", ()))
    check_numbers(cfg)
    check_library_settings(cfg, extra_tags=[mode.name, cfg.precision.name, f"devices={n}"])
    check_measurement(cfg)
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
        from parallel import MODES

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


def check_measurement(cfg: Config) -> None:
    """Raises ConfigError for an unknown ``train.transfer_guard``, a ``train.target_accuracy`` outside (0, 1], or
    a profile window past ``train.steps`` (with ``train.epochs`` the step count needs the data;
    ``training.prepare`` checks the window then)."""
    target_error = check_target_accuracy(cfg.train.target_accuracy)
    if target_error:
        raise ConfigError(target_error)
    if cfg.train.transfer_guard not in TRANSFER_GUARDS:
        raise ConfigError(
            f"train.transfer_guard={cfg.train.transfer_guard!r} is unknown; choose one of {', '.join(TRANSFER_GUARDS)}"
        )
    if cfg.train.steps is not None and cfg.train.steps > 0:
        window_error = check_window(cfg.profile.enabled, cfg.profile.start_step, cfg.profile.num_steps, cfg.train.steps)
        if window_error:
            raise ConfigError(window_error)


def check_numbers(cfg: Config) -> None:
    """Range checks of numeric settings that would otherwise train silently into nonsense.

    Raises:
      ConfigError: naming the key, its value and the allowed range.
    """
    o, pr, m = cfg.optim, cfg.precision, cfg.model
    checks = [
        ("optim.lr", o.lr, math.isfinite(o.lr) and o.lr >= 0, "a finite value >= 0"),
        (
            "optim.clip_grad_norm",
            o.clip_grad_norm,
            o.clip_grad_norm is None or (math.isfinite(o.clip_grad_norm) and o.clip_grad_norm > 0),
            "null (off) or a finite value > 0",
        ),
        *_optimizer_checks(o),
        ("optim.warmup_steps", o.warmup_steps, o.warmup_steps >= 0, ">= 0"),
        ("optim.base_batch", o.base_batch, o.base_batch > 0, "> 0"),
        (
            "precision.init_scale",
            pr.init_scale,
            math.isfinite(pr.init_scale) and pr.init_scale >= 1,
            "a finite value >= 1",
        ),
        ("precision.growth_interval", pr.growth_interval, pr.growth_interval > 0, "> 0"),
        ("parallel.min_shard_bytes", cfg.parallel.min_shard_bytes, cfg.parallel.min_shard_bytes >= 0, ">= 0"),
        ("data.prefetch", cfg.data.prefetch, cfg.data.prefetch >= 0, ">= 0 (0: no background thread)"),
        ("runtime.cpu_devices", cfg.runtime.cpu_devices, cfg.runtime.cpu_devices >= 1, ">= 1"),
        (
            "runtime.compilation_cache_min_compile_time_s",
            cfg.runtime.compilation_cache_min_compile_time_s,
            cfg.runtime.compilation_cache_min_compile_time_s >= 0,
            ">= 0",
        ),
        (
            "runtime.compilation_cache_min_entry_bytes",
            cfg.runtime.compilation_cache_min_entry_bytes,
            cfg.runtime.compilation_cache_min_entry_bytes >= 0,
            ">= 0",
        ),
        (
            "hardware.link_bytes_per_s",
            cfg.hardware.link_bytes_per_s,
            cfg.hardware.link_bytes_per_s is None or cfg.hardware.link_bytes_per_s > 0,
            "null or > 0",
        ),
        (
            "hardware.peak_flops_per_s",
            cfg.hardware.peak_flops_per_s,
            cfg.hardware.peak_flops_per_s is None or cfg.hardware.peak_flops_per_s > 0,
            "null or > 0",
        ),
        (
            "wandb.init_timeout_s",
            cfg.wandb.init_timeout_s,
            0 < cfg.wandb.init_timeout_s < math.inf,
            "finite and > 0",
        ),
    ]
    for k in ("hidden", "width", "depth"):  # each model has its own keys (conf/schema.py MODEL_SCHEMAS)
        if getattr(m, k, None) is not None:  # (gpt: null = the size preset's value)
            checks.append((f"model.{k}", getattr(m, k), getattr(m, k) > 0, "> 0"))
    if hasattr(m, "init_std"):
        checks.append(
            ("model.init_std", m.init_std, math.isfinite(m.init_std) and m.init_std > 0, "a finite value > 0")
        )
    for key, value, ok, allowed in checks:
        if not ok:
            raise ConfigError(f"{key}={value} is out of range; it must be {allowed}")


# The optimizers' own keys (conf/schema.py OPTIM_SCHEMAS): (key, in range, allowed range).
_OPTIMIZER_RANGES = (
    ("momentum", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("b1", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("b2", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("eps", lambda v: math.isfinite(v) and v > 0, "a finite value > 0"),
    ("weight_decay", lambda v: math.isfinite(v) and v >= 0, ">= 0"),
)


def _optimizer_checks(o) -> list[tuple[str, Any, bool, str]]:
    """``check_numbers`` entries for the keys the chosen optimizer has."""
    return [
        (f"optim.{k}", getattr(o, k), ok(getattr(o, k)), allowed)
        for k, ok, allowed in _OPTIMIZER_RANGES
        if hasattr(o, k)
    ]


def uses_dropout(cfg: Config) -> bool:
    """Whether the model draws dropout masks (per-example keys): ``model.dropout`` > 0, or the GPT's
    ``model.attention_dropout`` > 0 (null: ``model.dropout``)."""
    return cfg.model.dropout > 0 or (getattr(cfg.model, "attention_dropout", None) or 0) > 0


def is_language_model(cfg: Config) -> bool:
    """Whether the model is the GPT language model (token batches, per-token loss averaged per window)."""
    return cfg.model.name == "gpt"


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
    """``(graphdef, init_fn)``: the model's graph and a pure function ``() -> TrainState`` creating the initial
    state from ``train.seed`` (run by the mode under ``jax.jit`` with its shardings: ``ParallelMode.init_state``).
    ``graphdef``: the graph when the caller has it (``Plan.graphdef``); None builds it from an abstract model
    (``nnx.eval_shape``: ~50 ms of Python for GPT size tiny, nothing computed).

    The params are a plain nested dict of float32 arrays (``nnx.merge`` takes it back): jit flattens it in C++,
    while an ``nnx.State`` of ``Param`` variables costs ~60 us of Python per step to flatten/unflatten."""
    if graphdef is None:
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: _model(cfg)))

    def init_fn() -> TrainState:
        _, params = nnx.split(_model(cfg), nnx.Param)
        params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), nnx.to_pure_dict(params))
        return create_state(params, tx, init_loss_scale(cfg.precision.loss_scale, cfg.precision.init_scale))

    return graphdef, init_fn


def init_host_state(cfg: Config, tx) -> tuple[Any, TrainState]:
    """(graphdef, state) as host numpy arrays: the initial state every mode starts from (``state_init_fn``, run
    under ``jax.jit`` on this process's first device)."""
    graphdef, init_fn = state_init_fn(cfg, tx)
    state = jax.jit(init_fn, out_shardings=jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))()
    return graphdef, jax.device_get(state)


def build(p: Plan, feed_for: Optional[Callable[[BatchLayout], Any]] = None) -> Experiment:
    """Mesh, mode, initial state (placed) and the jitted train/eval steps for plan ``p``.

    ``feed_for``: ``layout -> DeviceFeed`` (``data.pipeline.DeviceSource.feed``): when the mode can
    (``ParallelMode.fuses_feed``), the train step gathers its own batches from the split on the devices
    (``Experiment.feed`` is then that feed; else None and the step takes batches)."""
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
    state = mode.init_state(init_fn)  # created directly in the mode's layout (fsdp: sharded)
    feed = feed_for(mode.batch_layout()) if feed_for is not None and mode.fuses_feed else None
    steps = mode.build(local, updater, mode.host_abstract(state), feed=feed)
    return Experiment(
        plan=p, mode=mode, local=local, updater=updater, state=state, steps=steps, graphdef=graphdef, feed=feed
    )
