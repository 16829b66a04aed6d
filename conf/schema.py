"""Typed schema of the configuration (Hydra structured configs; every key: docs/configuration.md) and its
validation: a misspelt key, a wrong type or a value out of range fails at start with one line (``to_typed``;
``conf.errors`` words Hydra's refusals). Models, modes and optimizers have one schema per option, so
``model=cnn model.hidden=512`` fails. ``train.py`` types the config once; library code never reads it."""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any, List, Mapping, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from conf import errors
from conf.errors import ConfigInputError, keys_of
from measure.profiler import check_window
from measure.throughput import check_target_accuracy

# ---- fixed choices (member names equal their values: OmegaConf reads an enum by member name) ----------------------
ComputeDtype = enum.StrEnum("ComputeDtype", ["float32", "bfloat16", "float16"])
LossScale = enum.StrEnum("LossScale", ["dynamic", "static", "none"])
ReduceDtype = enum.StrEnum("ReduceDtype", ["float32", "bfloat16"])
Activation = enum.StrEnum("Activation", ["tanh", "relu", "gelu", "sigmoid"])
OptimizerName = enum.StrEnum("OptimizerName", ["adam", "sgd"])
Schedule = enum.StrEnum("Schedule", ["constant", "cosine"])
LrScaling = enum.StrEnum("LrScaling", ["none", "linear"])  # linear: lr * global_batch / base_batch
TransferGuard = enum.StrEnum("TransferGuard", ["allow", "log", "disallow", "log_explicit", "disallow_explicit"])
Compression = enum.StrEnum("Compression", ["none", "int8"])  # parallel.compress (int8: with error feedback)
WandbMode = enum.StrEnum("WandbMode", ["online", "offline", "disabled"])
WandbPriority = enum.StrEnum("WandbPriority", ["normal", "idle"])  # idle: SCHED_IDLE, else nice 19
Remat = enum.StrEnum("Remat", ["none", "full", "dots_saveable"])
Norm = enum.StrEnum("Norm", ["layernorm", "rmsnorm"])
Attention = enum.StrEnum("Attention", ["auto", "xla", "splash"])
WeightDecayMask = enum.StrEnum("WeightDecayMask", ["all", "matrices"])  # matrices: tensors of >= 2 dims (nanoGPT)
TokenizerName = enum.StrEnum("TokenizerName", ["bytes", "bpe"])  # bpe: byte-level BPE trained on the train split
BestMode = enum.StrEnum("BestMode", ["auto", "min", "max"])  # auto: max for an accuracy, min for a loss/ppl/bpb


@dataclass
class ParallelConfig:  # a node of one of PARALLEL_SCHEMAS (parallel=<name>)
    name: str = MISSING
    grad_reduce_dtype: Optional[ReduceDtype] = None  # null: the mode's own reduction
    grad_compression: Compression = Compression.none

    @property
    def min_shard_bytes(self) -> int:  # replicated parameters: only fsdp's schema has it as a key
        return 0


_HERE = {"__module__": __name__}  # (pickled configs, e.g. a submitit job's, find the class here)
JitShardingConfig, PmapConfig, ShardMapConfig = (  # the modes with no keys of their own
    dataclasses.make_dataclass(cls, [("name", str, field(default=name))], bases=(ParallelConfig,), namespace=_HERE)
    for cls, name in (("JitShardingConfig", "jit_sharding"), ("PmapConfig", "pmap"), ("ShardMapConfig", "shard_map"))
)


@dataclass
class FsdpConfig(ParallelConfig):
    name: str = "fsdp"
    min_shard_bytes: int = 0  # smaller arrays stay replicated
    fsdp_rules: List[Any] = field(default_factory=list)  # [regex, dim] pairs tried before the default rule


PARALLEL_SCHEMAS: dict[str, type] = {s.name: s for s in (JitShardingConfig, PmapConfig, ShardMapConfig, FsdpConfig)}


@dataclass
class PrecisionConfig:  # master params and optimizer state stay float32 whatever compute_dtype is
    name: str = "fp32"
    compute_dtype: ComputeDtype = ComputeDtype.float32
    loss_scale: LossScale = LossScale.none
    init_scale: float = 32768.0  # 2**15
    growth_interval: int = 2000


@dataclass
class ModelConfig:  # a node of one of MODEL_SCHEMAS (model=<name>), with only the keys that model uses
    name: str = MISSING


@dataclass
class MLPConfig(ModelConfig):
    name: str = "mlp"
    hidden: int = 256
    activation: Activation = Activation.tanh
    dropout: float = 0.0
    init_std: float = 0.01


@dataclass
class CNNConfig(ModelConfig):
    name: str = "cnn"
    width: int = 16
    dropout: float = 0.0


@dataclass
class ResNetConfig(ModelConfig):
    name: str = "resnet"
    width: int = 64  # stage widths width*(1,2,4,8); 64: ResNet-18 proper

    @property
    def dropout(self) -> float:  # this ResNet-18 has no dropout
        return 0.0


@dataclass
class ViTConfig(ModelConfig):
    name: str = "vit"
    width: int = 64
    depth: int = 4
    patch: int = 4  # image sides must be multiples of it
    heads: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.0


@dataclass
class GPTConfig(ModelConfig):  # every dimension left null takes the size preset's (models/gpt.py)
    name: str = "gpt"
    size: str = "tiny"
    vocab_size: Optional[int] = None
    context: Optional[int] = None  # tokens per training window
    max_positions: Optional[int] = None  # rows of the position table (null: context)
    width: Optional[int] = None
    depth: Optional[int] = None
    heads: Optional[int] = None
    mlp_ratio: int = 4
    dropout: float = 0.0
    remat: Remat = Remat.none
    tied_embeddings: bool = True
    norm: Norm = Norm.layernorm
    attention: Attention = Attention.auto
    loss_chunk: int = 0  # 0, or tokens per chunk of the output layer fused with the loss
    vocab_multiple: int = 1  # embedding rows rounded up to a multiple of this (padded logits masked)
    attention_dropout: Optional[float] = None  # on attention probabilities; null: dropout (resumed: as saved)


MODEL_SCHEMAS: dict[str, type] = {s.name: s for s in (MLPConfig, CNNConfig, ResNetConfig, ViTConfig, GPTConfig)}


@dataclass
class DataConfig:
    name: str = "mnist"
    tfds_name: Optional[str] = "mnist"
    data_dir: Optional[str] = None  # null: TFDS_DATA_DIR, else ../shared/tensorflow_datasets, else TFDS's default
    cache_dir: str = "${oc.env:XDG_CACHE_HOME,${oc.env:HOME}/.cache}/dp_scaling"  # decoded arrays
    download: bool = True  # a data set missing under data_dir is prepared there; false: stop instead
    image_shape: List[int] = field(default_factory=lambda: [28, 28, 1])
    num_classes: int = 10
    train_size: int = 60000
    eval_size: int = 10000
    augment: bool = False  # random crop (crop_padding) and flip, on the device, keyed per example
    crop_padding: int = 4
    flip: bool = False
    prefetch: int = 2  # host batches placed this many steps ahead on a thread; 0: inline
    on_device: Optional[bool] = None  # the training split in device memory; null: on GPU/TPU when it fits
    path: Optional[str] = None  # data=text: a UTF-8 file, folder or glob (tiny_shakespeare: null = found or downloaded)
    tokenizer: TokenizerName = TokenizerName.bytes  # text: UTF-8 bytes, or a byte-level BPE of vocab_size tokens
    vocab_size: int = 4096
    tokenizer_file: Optional[str] = None  # a tokenizer.json (Hugging Face tokenizers) instead of data.tokenizer's
    eval_windows: Optional[int] = None  # text: evaluate the first N validation windows; null: every one


@dataclass
class OptimConfig:  # the keys every optimizer has; each optimizer's schema adds its own
    name: OptimizerName = MISSING
    lr: float = MISSING
    schedule: Schedule = Schedule.constant
    warmup_steps: int = 0
    decay_steps: int = 0
    lr_scaling: LrScaling = LrScaling.none
    base_batch: int = 256
    clip_grad_norm: Optional[float] = None
    min_lr: float = 0.0  # the floor of a decaying schedule (absolute, not scaled by lr_scaling)


@dataclass
class AdamConfig(OptimConfig):  # optax.adam; weight_decay > 0: AdamW (decoupled weight decay)
    name: OptimizerName = OptimizerName.adam
    lr: float = 1e-3
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    weight_decay_mask: Optional[WeightDecayMask] = None  # null: matrices (resumed: the checkpoint's)


@dataclass
class SGDConfig(OptimConfig):  # optax.sgd; momentum > 0: heavy-ball momentum
    name: OptimizerName = OptimizerName.sgd
    lr: float = 0.1
    momentum: float = 0.0


OPTIM_SCHEMAS: dict[str, type] = {"adam": AdamConfig, "sgd": SGDConfig}


# group -> (option name -> schema, default option): the nodes whose keys depend on the chosen option.
OPTION_SCHEMAS = {
    "model": (MODEL_SCHEMAS, "mlp"),
    "parallel": (PARALLEL_SCHEMAS, "jit_sharding"),
    "optim": (OPTIM_SCHEMAS, "adam"),
}


@dataclass
class MeshConfig:
    devices: Optional[int] = None  # null: all visible devices
    shape: Optional[List[int]] = None  # sizes of (data, fsdp), -1 fills; null: the mode's default


@dataclass
class TrainConfig:
    global_batch: Optional[int] = None  # null: 256 unless per_device_batch is set (weak scaling)
    per_device_batch: Optional[int] = None
    eval_batch: int = 1000
    epochs: int = 10
    steps: Optional[int] = None  # null: run ``epochs`` epochs
    accum_steps: int = 1
    log_every: int = 50
    grad_norm_every: Optional[int] = None  # null: no optim/grad_norm (an extra pass over the gradients)
    eval_every: Optional[int] = None  # null: evaluate only at the end
    target_accuracy: Optional[float] = None
    allow_exploded_loss: bool = False
    seed: int = 0
    sync_every: int = 100
    sync_strict: bool = False
    max_in_flight: int = 2
    debug_dump_indices: bool = False
    transfer_guard: TransferGuard = TransferGuard.allow
    sample_tokens: int = 0


@dataclass
class WandbConfig:
    mode: Optional[WandbMode] = None  # null: online with an API key, else offline
    project: str = "dp-scaling"
    entity: Optional[str] = None
    group: Optional[str] = None
    tags: List[str] = field(default_factory=list)
    init_timeout_s: float = 30.0
    process_priority: WandbPriority = WandbPriority.normal


@dataclass
class RuntimeConfig:
    cpu_devices: int = 8  # simulated devices on the CPU platform
    compilation_cache_dir: Optional[str] = (
        "${oc.env:JAX_COMPILATION_CACHE_DIR,${oc.env:XDG_CACHE_HOME,${oc.env:HOME}/.cache}/dp_scaling/jax_compilation_cache}"
    )
    compilation_cache_min_compile_time_s: float = 0.0
    compilation_cache_min_entry_bytes: int = 0


@dataclass
class HardwareConfig:  # a profile of conf/hardware/; null figures: looked up from the device kind (detect)
    name: str = "auto"
    detect: bool = True
    link_bytes_per_s: Optional[float] = None
    peak_flops_per_s: Optional[float] = None
    peak_flops_per_s_float32: Optional[float] = None
    devices_per_node: Optional[int] = None
    intra_node_bytes_per_s: Optional[float] = None
    inter_node_bytes_per_s: Optional[float] = None
    latency_s: Optional[float] = None
    device_kinds: List[str] = field(default_factory=list)
    source: str = ""


@dataclass
class ProfileConfig:
    enabled: bool = False
    start_step: int = 10
    num_steps: int = 5


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None  # null: <run folder>/checkpoints
    every: Optional[int] = None  # null: every epoch; 0: only at the end
    keep: int = 3
    resume: str = "auto"  # auto | never | <path>
    enabled: bool = True
    keep_best: Optional[str] = None  # an eval/ metric: its best step is also kept in <dir>/best (null: off)
    best_mode: BestMode = BestMode.auto
    allow_data_change: bool = False  # true: resume a checkpoint although its training data changed (one warning)


@dataclass
class DistributedConfig:  # jax.distributed (training/distributed.py); enabled null: as settings or cluster say
    enabled: Optional[bool] = None
    coordinator: Optional[str] = None
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    timeout_s: int = 300


@dataclass
class XlaConfig:
    name: str = "default"
    flags: List[str] = field(default_factory=list)


@dataclass
class Config:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    xla: XlaConfig = field(default_factory=XlaConfig)


def register() -> None:
    """Registers ``base_config`` (conf/config.yaml's first default) and each option's ``schema/<group>/<name>``."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, (schemas, _) in OPTION_SCHEMAS.items():
        for name, schema in schemas.items():
            cs.store(group=f"schema/{group}", name=name, node=schema)
    if not OmegaConf.has_resolver("epochs_to_steps"):  # optimizer steps in E epochs of N examples at batch B
        OmegaConf.register_new_resolver("epochs_to_steps", lambda e, b, n: int(float(e) * (int(n) // int(b))))


# ---- validation ------------------------------------------------------------------------------------------------
# (key, in range, allowed): numeric settings that would train silently into nonsense, in the order they are
# reported; null passes, and a key the chosen option's schema lacks is skipped
_RANGES = (
    ("optim.lr", lambda v: math.isfinite(v) and v >= 0, "a finite value >= 0"),
    ("optim.clip_grad_norm", lambda v: math.isfinite(v) and v > 0, "null (off) or a finite value > 0"),
    ("optim.momentum", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("optim.b1", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("optim.b2", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("optim.eps", lambda v: math.isfinite(v) and v > 0, "a finite value > 0"),
    ("optim.weight_decay", lambda v: math.isfinite(v) and v >= 0, ">= 0"),
    ("optim.warmup_steps", lambda v: v >= 0, ">= 0"),
    ("optim.base_batch", lambda v: v > 0, "> 0"),
    ("precision.init_scale", lambda v: math.isfinite(v) and v >= 1, "a finite value >= 1"),
    ("precision.growth_interval", lambda v: v > 0, "> 0"),
    ("parallel.min_shard_bytes", lambda v: v >= 0, ">= 0"),
    ("data.prefetch", lambda v: v >= 0, ">= 0 (0: no background thread)"),
    ("runtime.cpu_devices", lambda v: v >= 1, ">= 1"),
    ("runtime.compilation_cache_min_compile_time_s", lambda v: v >= 0, ">= 0"),
    ("runtime.compilation_cache_min_entry_bytes", lambda v: v >= 0, ">= 0"),
    ("hardware.link_bytes_per_s", lambda v: v > 0, "null or > 0"),
    ("hardware.peak_flops_per_s", lambda v: v > 0, "null or > 0"),
    ("wandb.init_timeout_s", lambda v: 0 < v < math.inf, "finite and > 0"),
    ("model.hidden", lambda v: v > 0, "> 0"),
    ("model.width", lambda v: v > 0, "> 0"),  # gpt: null = the size preset's value
    ("model.depth", lambda v: v > 0, "> 0"),
    ("model.init_std", lambda v: math.isfinite(v) and v > 0, "a finite value > 0"),
)


def validate(cfg: Config) -> Config:
    """``cfg`` when every value is in its range, else ``ConfigInputError``: one line naming the first failing key,
    its value and what it must be. What needs devices, data or libraries: ``training.build.plan``."""
    t, gb, pdb, p = cfg.train, cfg.train.global_batch, cfg.train.per_device_batch, cfg.profile
    checks = [
        (gb is None or pdb is None, f"train.global_batch={gb} and train.per_device_batch={pdb} are both set; set "
         f"one (global_batch: strong scaling, per_device_batch: weak scaling)"),
        (pdb is None or pdb > 0, f"train.per_device_batch={pdb} must be positive"),
        (gb is None or gb > 0, f"train.global_batch={gb} must be positive"),
        (t.accum_steps > 0, f"train.accum_steps={t.accum_steps} must be positive"),
        *[(getattr(t, k) > 0, f"train.{k}={getattr(t, k)} must be positive")
          for k in ("log_every", "eval_batch", "sync_every", "max_in_flight")],
        (t.steps is None or t.steps > 0, f"train.steps={t.steps} must be positive (or null to use train.epochs)"),
        (t.steps is not None or t.epochs > 0, f"train.epochs={t.epochs} must be positive"),
        (t.eval_every is None or t.eval_every > 0,
         f"train.eval_every={t.eval_every} must be positive (or null: only at the end)"),
        (t.sample_tokens >= 0,
         f"train.sample_tokens={t.sample_tokens} must be >= 0 (bytes the GPT generates at the end; 0: none)"),
        (t.grad_norm_every is None or 0 < t.grad_norm_every < 2**31,
         f"train.grad_norm_every={t.grad_norm_every} must be in [1, {2**31 - 1}] (or null: no gradient norm)"),
        (not (cfg.data.on_device and cfg.model.name == "gpt"),
         f"data.on_device=true keeps an image data set on the devices; model=gpt's text windows (data="
         f"{cfg.data.name}) are gathered on the host: set data.on_device=null or false"),
    ]  # fmt: skip
    for key, ok, allowed in _RANGES:
        node, _, leaf = key.partition(".")
        value = getattr(getattr(cfg, node), leaf, None)
        checks.append((value is None or ok(value), f"{key}={value} is out of range; it must be {allowed}"))
    target = check_target_accuracy(t.target_accuracy)
    window = t.steps and check_window(p.enabled, p.start_step, p.num_steps, t.steps)
    checks += [(target is None, target), (not window, window)]
    message = next((message for ok, message in checks if not ok), None)
    if message:
        raise ConfigInputError(message)
    return cfg


def _plain_strings(obj: Any) -> Any:
    """Replaces every Enum member in a dataclass tree by its value (plain ``str``), in place."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, enum.Enum):
            setattr(obj, f.name, value.value)
        elif dataclasses.is_dataclass(value):
            _plain_strings(value)
    return obj


def to_typed(cfg: DictConfig) -> Config:
    """``cfg`` resolved into the typed ``Config`` (Enum fields as plain strings), its values checked (``validate``).
    Raises ``ConfigInputError`` (``UnknownKeyError`` for a key the schema lacks) with one line naming the key."""
    errors.check_keys(cfg, OPTION_SCHEMAS)
    try:
        obj = OmegaConf.to_object(cfg)
        if not isinstance(obj, Config):  # composed without the schema (should not happen)
            obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), cfg))
    except OmegaConfBaseException as e:
        raise ConfigInputError(errors.one_line(e, Config, OPTION_SCHEMAS)) from None
    return validate(_plain_strings(obj))


def from_dict(data: Mapping[str, Any], *, lenient: bool = False) -> Config:
    """``to_typed`` of a nested plain dict (a checkpoint's saved config), defaults for absent keys. ``lenient``: keys
    an option's schema lacks are dropped, not refused (saved when these nodes held every option's keys)."""
    data = dict(data)
    try:
        for group, (schemas, default) in OPTION_SCHEMAS.items():
            node = dict(data.get(group) or {})
            name = node.get("name", default)
            if name not in schemas:
                raise ConfigInputError(f"{group}.name={name!r} is unknown; choose one of {', '.join(schemas)}")
            if lenient:
                node = {k: v for k, v in node.items() if k in keys_of(schemas[name])}
            data[group] = OmegaConf.merge(OmegaConf.structured(schemas[name]), node)
        cfg = OmegaConf.merge(OmegaConf.structured(Config), data)
    except OmegaConfBaseException as e:
        raise ConfigInputError(errors.one_line(e, Config, OPTION_SCHEMAS)) from None
    return to_typed(cfg)


def as_dict(cfg: Config) -> dict[str, Any]:
    """The resolved config as a plain dict (for W&B and checkpoints)."""
    return dataclasses.asdict(cfg)
