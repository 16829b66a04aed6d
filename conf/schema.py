"""Typed schema of the whole configuration (Hydra structured configs).

The schema is registered in Hydra's ConfigStore as ``base_config`` and is the first entry of
``conf/config.yaml``'s defaults list, so every group option (``conf/<group>/<option>.yaml``) is merged into a
typed node: a misspelt key or a value of the wrong type fails at start, and ``one_line`` turns Hydra's and
OmegaConf's messages into one line.

One schema per model, per parallel mode and per optimizer (``OPTION_SCHEMAS``): ``conf/model/<name>.yaml`` starts
with ``defaults: [/schema/model/<name>@_here_]`` (``MODEL_SCHEMAS``, registered under the group ``schema/model``;
likewise ``conf/parallel/``, ``conf/optim/``), so ``model=cnn model.hidden=512`` fails (``hidden`` is an MLP key)
and ``optim=sgd optim.b1=0.8`` fails (``b1`` is an Adam key) instead of being ignored. The base node types
(``ModelConfig``, ``ParallelConfig``, ``OptimConfig``) hold ``name`` and the keys every option shares; OmegaConf
merges a subclass into them.

Fixed choices are ``StrEnum`` fields: a wrong value lists the choices; YAML and saved configs hold plain
strings; ``to_typed`` hands plain strings to the code (a ``StrEnum`` member equals its string anyway).

Library code never reads the config: ``train.py`` turns it into these dataclasses once (``to_typed``) and the
builders take plain, typed fields.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Mapping, Optional, Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from parallel.options import Compression


# ---- fixed choices ---------------------------------------------------------------------------------------------
# Member names equal their values: OmegaConf reads an enum from YAML or the command line by member name.
class ComputeDtype(enum.StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class LossScale(enum.StrEnum):
    dynamic = "dynamic"
    static = "static"
    none = "none"


class ReduceDtype(enum.StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"


class Activation(enum.StrEnum):
    tanh = "tanh"
    relu = "relu"
    gelu = "gelu"
    sigmoid = "sigmoid"


class OptimizerName(enum.StrEnum):
    adam = "adam"
    sgd = "sgd"


class Schedule(enum.StrEnum):
    constant = "constant"
    cosine = "cosine"


class WeightDecayMask(enum.StrEnum):
    """Which parameters AdamW decays: ``all`` or ``matrices`` (tensors of 2 or more dimensions: kernels and
    embeddings, not biases or norm scales; nanoGPT's rule)."""

    all = "all"
    matrices = "matrices"


class TokenizerName(enum.StrEnum):
    """The language model's tokens of text data: ``bytes`` (UTF-8 bytes) or ``bpe`` (a byte-level BPE trained
    on the training split)."""

    bytes = "bytes"
    bpe = "bpe"


class BestMode(enum.StrEnum):
    """Which value of ``checkpoint.keep_best``'s metric is the best: ``min``, ``max``, or ``auto`` (max for an
    accuracy, min for a loss, perplexity or bits per byte)."""

    auto = "auto"
    min = "min"
    max = "max"


class LrScaling(enum.StrEnum):
    none = "none"
    linear = "linear"  # lr * global_batch / base_batch


class TransferGuard(enum.StrEnum):
    """``jax.transfer_guard`` levels."""

    allow = "allow"
    log = "log"
    disallow = "disallow"
    log_explicit = "log_explicit"
    disallow_explicit = "disallow_explicit"


class WandbMode(enum.StrEnum):
    online = "online"
    offline = "offline"
    disabled = "disabled"


class WandbPriority(enum.StrEnum):
    """CPU priority of the W&B process (training/wandb_process.py): ``normal`` (the training's own) or ``idle``
    (Linux ``SCHED_IDLE``, else nice 19: only CPU time the training leaves; starved on a busy machine)."""

    normal = "normal"
    idle = "idle"


# ---- parallel modes: one schema each -----------------------------------------------------------------------------
@dataclass
class ParallelConfig:
    """How the step is spread over devices; a node of one of ``PARALLEL_SCHEMAS`` (``parallel=<name>``).

    ``grad_reduce_dtype``: null = the mode's own reduction; float32 | bfloat16 = explicit reduction in that dtype
    (shard_map psum / psum_scatter, visible in the lowered module; jit_sharding then reduces under shard_map;
    pmap: psum), cast back to float32 before the optimizer. ``grad_compression``: ``parallel.options.Compression``
    (quantised gradient exchange with error feedback, parallel/compress.py; jit_sharding, shard_map, pmap; needs
    grad_reduce_dtype=null).
    """

    name: str = MISSING
    grad_reduce_dtype: Optional[ReduceDtype] = None
    grad_compression: Compression = Compression.none


@dataclass
class _ReplicatedParallelConfig(ParallelConfig):
    @property
    def min_shard_bytes(self) -> int:
        """Parameters are replicated in this mode (only ``parallel=fsdp`` shards them): 0."""
        return 0


@dataclass
class JitShardingConfig(_ReplicatedParallelConfig):
    name: str = "jit_sharding"


@dataclass
class PmapConfig(_ReplicatedParallelConfig):
    name: str = "pmap"


@dataclass
class ShardMapConfig(_ReplicatedParallelConfig):
    name: str = "shard_map"


@dataclass
class FsdpConfig(ParallelConfig):
    """``min_shard_bytes``: arrays smaller than this stay replicated (their gradients are all-reduced).
    ``fsdp_rules``: ``[regex, dim]`` pairs tried in order before the default rule (the largest dimension the
    ``fsdp`` axis divides): dim an integer, null (replicate) or "largest" (``parallel/fsdp.py``)."""

    name: str = "fsdp"
    min_shard_bytes: int = 0
    fsdp_rules: List[Any] = field(default_factory=list)


PARALLEL_SCHEMAS: dict[str, type] = {
    "jit_sharding": JitShardingConfig,
    "pmap": PmapConfig,
    "shard_map": ShardMapConfig,
    "fsdp": FsdpConfig,
}


@dataclass
class PrecisionConfig:
    """``compute_dtype``: float32 | bfloat16 | float16. Master params and optimizer state are always float32."""

    name: str = "fp32"
    compute_dtype: ComputeDtype = ComputeDtype.float32
    # dynamic | static | none (only used when compute_dtype is float16).
    loss_scale: LossScale = LossScale.none
    init_scale: float = 32768.0  # 2**15
    growth_interval: int = 2000


# ---- models: one schema each ---------------------------------------------------------------------------------
@dataclass
class ModelConfig:
    """The model; a node of one of ``MODEL_SCHEMAS`` (``model=<name>``), each with only the keys it uses."""

    name: str = MISSING


@dataclass
class MLPConfig(ModelConfig):
    """784 -> hidden -> classes, weights N(0, init_std^2), biases zero (models/mlp.py)."""

    name: str = "mlp"
    hidden: int = 256
    activation: Activation = Activation.tanh
    dropout: float = 0.0
    init_std: float = 0.01


@dataclass
class CNNConfig(ModelConfig):
    """conv3x3(width) relu, conv3x3(2*width) relu, maxpool 2, [dropout], dense 128 relu, [dropout], dense
    classes (models/cnn.py). width 16: 596,042 params on 28x28x1."""

    name: str = "cnn"
    width: int = 16
    dropout: float = 0.0


@dataclass
class ResNetConfig(ModelConfig):
    """ResNet-18, CIFAR stem, GroupNorm; stage widths width*(1,2,4,8) (models/resnet.py). 64: ResNet-18 proper."""

    name: str = "resnet"
    width: int = 64

    @property
    def dropout(self) -> float:
        """This ResNet-18 has no dropout: 0.0."""
        return 0.0


@dataclass
class ViTConfig(ModelConfig):
    """Small ViT: patch embedding, CLS token, ``depth`` pre-LN blocks of ``heads`` heads and MLP width
    ``width * mlp_ratio`` (models/vit.py). Image sides must be multiples of ``patch``."""

    name: str = "vit"
    width: int = 64
    depth: int = 4
    patch: int = 4
    heads: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.0


class Remat(enum.StrEnum):
    none = "none"
    full = "full"
    dots_saveable = "dots_saveable"


class Norm(enum.StrEnum):
    layernorm = "layernorm"
    rmsnorm = "rmsnorm"


class Attention(enum.StrEnum):
    auto = "auto"
    xla = "xla"
    splash = "splash"


@dataclass
class GPTConfig(ModelConfig):
    """Decoder-only transformer language model (models/gpt.py). ``size``: tiny (0.84M parameters, byte
    vocabulary, context 128) | gpt2_small (124M) | gpt2_medium (355M) | 1b (1.3B); every dimension left null
    takes the preset's value. ``context``: tokens per training window (T); ``max_positions``: rows of the
    learned position table (null = context). ``remat``: none | full | dots_saveable (``jax.checkpoint`` per
    block). ``attention``: auto (the splash kernel on TPU for a context of 512 or more, a multiple of 128; else XLA's) |
    xla | splash. ``loss_chunk``: 0, or tokens per chunk of the output layer fused with the loss (no [B, T, vocab]
    logits). ``vocab_multiple``: the embedding's rows rounded up to a multiple of this (padded logits masked).
    ``attention_dropout``: dropout of the attention probabilities; null = ``dropout`` for a new run (nanoGPT uses one
    rate for both), the checkpoint's own for a resumed one (0 for a checkpoint saved before this key existed)."""

    name: str = "gpt"
    size: str = "tiny"
    vocab_size: Optional[int] = None
    context: Optional[int] = None
    max_positions: Optional[int] = None
    width: Optional[int] = None
    depth: Optional[int] = None
    heads: Optional[int] = None
    mlp_ratio: int = 4
    dropout: float = 0.0
    remat: Remat = Remat.none
    tied_embeddings: bool = True
    norm: Norm = Norm.layernorm
    attention: Attention = Attention.auto
    loss_chunk: int = 0
    vocab_multiple: int = 1
    attention_dropout: Optional[float] = None


MODEL_SCHEMAS: dict[str, type] = {
    "mlp": MLPConfig,
    "cnn": CNNConfig,
    "resnet": ResNetConfig,
    "vit": ViTConfig,
    "gpt": GPTConfig,
}


def model_kwargs(model: ModelConfig) -> dict[str, Any]:
    """The hyper-parameters of ``model`` (every field but ``name``) as keyword arguments of
    ``models.build_model``."""
    return {f.name: getattr(model, f.name) for f in dataclasses.fields(model) if f.name != "name"}


@dataclass
class DataConfig:
    """``name``: mnist | fashion_mnist | cifar10 (TFDS) or synthetic."""

    name: str = "mnist"
    tfds_name: Optional[str] = "mnist"
    # null: the TFDS_DATA_DIR environment variable, else TFDS's own default.
    data_dir: Optional[str] = None
    # Decoded arrays are cached here (never inside the TFDS folder).
    cache_dir: str = "${oc.env:XDG_CACHE_HOME,${oc.env:HOME}/.cache}/dp_scaling"
    # A data set missing under data_dir is downloaded and prepared there (TFDS, array_record); false: stop instead.
    download: bool = True
    image_shape: List[int] = field(default_factory=lambda: [28, 28, 1])
    num_classes: int = 10
    train_size: int = 60000
    eval_size: int = 10000
    augment: bool = False
    # with augment=true, every training example is zero-padded by crop_padding pixels per side and
    # randomly cropped back to its size, then (flip=true) mirrored left-right with probability 1/2, on the
    # device, keyed by (train.seed, step, example index) (data/augment.py).
    crop_padding: int = 4
    flip: bool = False
    # Host batches are gathered and placed this many steps ahead in a background thread; 0: inline, on the
    # training thread, when the step asks for its batch (no second thread; data/pipeline.py: train_batches).
    prefetch: int = 2
    # Image data sets: keep the whole training split in device memory, replicated on every device, and gather
    # each step's batch there, inside the train step (pmap, train.debug_dump_indices: a program of its own; no
    # per-step host gather or transfer; the same batches). null: on a GPU or TPU when the split takes at most
    # 1/8 of the memory JAX may use on a device, never on the CPU backend (its devices are the host's cores; no
    # gain resolved there); false: host batches (data.prefetch);
    # true: always (refused for model=gpt and for a split larger than that memory). Synthetic data is generated
    # on the devices regardless.
    on_device: Optional[bool] = None
    # Text data (data=tiny_shakespeare, data=text; model=gpt): the UTF-8 text to read (data=text: required, a file,
    # a folder of files or a glob, read through a memory-mapped token file; tiny_shakespeare: null = found or
    # downloaded, data/text.py).
    path: Optional[str] = None
    # Text data: bytes (tokens are the UTF-8 bytes, vocabulary 256) | bpe (a byte-level BPE of data.vocab_size tokens
    # trained on the training split, cached in data.cache_dir and saved with the run; data/tokens.py). The GPT's
    # model.vocab_size null follows a BPE's size.
    tokenizer: TokenizerName = TokenizerName.bytes
    vocab_size: int = 4096
    # a tokenizer.json (Hugging Face tokenizers) to use instead of data.tokenizer's (e.g. one a bpe run saved)
    tokenizer_file: Optional[str] = None
    # text data: evaluate the first N non-overlapping validation windows; null = every one
    eval_windows: Optional[int] = None


# ---- optimizers: one schema each ------------------------------------------------------------------------------
@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule (optax); a node of one of ``OPTIM_SCHEMAS`` (``optim=<name>``).

    The keys every optimizer has live here; each optimizer's schema adds its own (``optimizer_kwargs``).
    ``schedule``: constant | cosine (decays to ``min_lr`` over ``decay_steps`` after ``warmup_steps``, its own key,
    never derived); ``min_lr``: the floor of a decaying schedule (absolute, not scaled by ``lr_scaling``; 0: decay
    to 0); ``lr_scaling``: none | linear (lr * global_batch / base_batch); ``clip_grad_norm``: null = off.
    """

    name: OptimizerName = MISSING
    lr: float = MISSING
    schedule: Schedule = Schedule.constant
    warmup_steps: int = 0
    decay_steps: int = 0
    lr_scaling: LrScaling = LrScaling.none
    base_batch: int = 256
    clip_grad_norm: Optional[float] = None
    min_lr: float = 0.0


@dataclass
class AdamConfig(OptimConfig):
    """Adam (Kingma and Ba 2015), ``optax.adam``; ``weight_decay`` > 0: AdamW, decoupled weight decay (Loshchilov
    and Hutter 2019), ``optax.adamw``. ``weight_decay_mask``: all | matrices (only tensors of 2 or more dimensions
    are decayed); null = matrices for a new run, the checkpoint's own for a resumed one (all for a checkpoint saved
    before this key existed): ``training.checkpoint.policy.INHERITED``."""

    name: OptimizerName = OptimizerName.adam
    lr: float = 1e-3
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    weight_decay_mask: Optional[WeightDecayMask] = None


@dataclass
class SGDConfig(OptimConfig):
    """Stochastic gradient descent, ``optax.sgd``; ``momentum`` > 0: heavy-ball momentum (0: none)."""

    name: OptimizerName = OptimizerName.sgd
    lr: float = 0.1
    momentum: float = 0.0


OPTIM_SCHEMAS: dict[str, type] = {"adam": AdamConfig, "sgd": SGDConfig}


def optimizer_kwargs(optim: OptimConfig) -> dict[str, Any]:
    """The optimizer's own hyper-parameters (the fields its schema adds to ``OptimConfig``) as keyword arguments
    of ``core.optim.make_optimizer``: e.g. ``{"momentum": 0.0}`` for SGD."""
    shared = set(_keys(OptimConfig))
    return {f.name: getattr(optim, f.name) for f in dataclasses.fields(optim) if f.name not in shared}


# group -> (option name -> schema, default option): the nodes whose keys depend on the chosen option.
OPTION_SCHEMAS: dict[str, tuple[dict[str, type], str]] = {
    "model": (MODEL_SCHEMAS, "mlp"),
    "parallel": (PARALLEL_SCHEMAS, "jit_sharding"),
    "optim": (OPTIM_SCHEMAS, "adam"),
}


@dataclass
class MeshConfig:
    """``devices``: null = all visible devices. ``shape``: sizes of the axes (data, fsdp); -1 fills."""

    devices: Optional[int] = None
    # null: the mode's default ([-1, 1] data-parallel modes, [1, -1] fsdp).
    shape: Optional[List[int]] = None


@dataclass
class TrainConfig:
    # null: 256 unless per_device_batch is set (weak scaling).
    global_batch: Optional[int] = None
    per_device_batch: Optional[int] = None
    eval_batch: int = 1000
    epochs: int = 10  # reaches eval/accuracy ~0.978 with the MLP on MNIST (0.975 at epoch 8)
    # null: run ``epochs`` epochs; otherwise this many optimizer steps.
    steps: Optional[int] = None
    accum_steps: int = 1
    log_every: int = 50
    # null: no optim/grad_norm; N: the global gradient norm is computed and logged every N steps (1: every
    # step). It is a full extra pass over the gradients (~15% of the MNIST-MLP step on 8 simulated CPU
    # devices), so it is off unless asked for; loss scaling (fp16) computes and logs it every step anyway.
    grad_norm_every: Optional[int] = None
    # null: evaluate only at the end.
    eval_every: Optional[int] = None
    # null: not tracked; in (0, 1]: train/steps_to_target = the first evaluated step (every eval_every steps
    # and the final evaluation) with eval/accuracy >= this, perf/time_to_target_s = wall time from the first
    # step dispatched to the end of that evaluation (evaluation time included); both null if never reached.
    target_accuracy: Optional[float] = None
    # false: a final loss above 10 x ln(num_classes) (finite but exploded) fails the run, before the final
    # checkpoint (training/outcome.py); true: a warning line and status ok
    allow_exploded_loss: bool = False
    seed: int = 0
    sync_every: int = 100
    sync_strict: bool = False
    max_in_flight: int = 2
    # DEBUG AID: every process writes the global example indices it placed on its devices at each
    # step to <run dir>/debug_indices_process<i>.jsonl (one device->host copy per step).
    debug_dump_indices: bool = False
    # jax.transfer_guard level around the step dispatch: allow | log | disallow (implicit host<->device
    # transfers between logging windows raise) | log_explicit | disallow_explicit.
    transfer_guard: TransferGuard = TransferGuard.allow
    # model=gpt: after training, print this many generated bytes (greedy, from a newline) and keep them in
    # summary.json as sample/text; 0: none. python -m sample <run folder> samples a checkpoint later.
    sample_tokens: int = 0


@dataclass
class WandbConfig:
    """``mode``: null (online with an API key, else offline) | online | offline | disabled.
    ``process_priority``: normal | idle, the CPU priority of the W&B process (README "Offline W&B")."""

    mode: Optional[WandbMode] = None
    project: str = "dp-scaling"
    entity: Optional[str] = None
    group: Optional[str] = None
    tags: List[str] = field(default_factory=list)
    init_timeout_s: float = 30.0
    process_priority: WandbPriority = WandbPriority.normal


@dataclass
class RuntimeConfig:
    """``cpu_devices``: simulated devices when the platform is CPU (set before the backend starts).

    ``compilation_cache_dir``: JAX's persistent compilation cache (training/compile_cache.py): compiled
    programs are kept there and a repeated run or a sweep's next job loads them; null turns it off.
    Programs that compile in less than ``compilation_cache_min_compile_time_s`` seconds, or whose entry is
    smaller than ``compilation_cache_min_entry_bytes``, are not written.
    """

    cpu_devices: int = 8
    compilation_cache_dir: Optional[str] = (
        "${oc.env:JAX_COMPILATION_CACHE_DIR,${oc.env:XDG_CACHE_HOME,${oc.env:HOME}/.cache}/dp_scaling/jax_compilation_cache}"
    )
    compilation_cache_min_compile_time_s: float = 0.0
    compilation_cache_min_entry_bytes: int = 0


@dataclass
class HardwareConfig:
    """The target machine: a profile of ``conf/hardware/<name>.yaml`` (``hardware=h100_sxm``), every field
    overridable (``hardware.inter_node_bytes_per_s=25e9``).

    ``link_bytes_per_s``: bandwidth (bytes/s, per device, one direction) for ``comm/time_model_s`` and
    ``comm/ratio_model``; a profile sets it to its ``intra_node_bytes_per_s``. ``peak_flops_per_s``: the peak
    for ``perf/mfu`` (profiles: bf16 dense). Both null (``hardware=auto``, the default) = looked up from the
    detected device kind among the profiles' ``device_kinds`` when ``detect`` is true (measure/hardware.py).
    ``devices_per_node``, ``intra_node_bytes_per_s``, ``inter_node_bytes_per_s``, ``latency_s`` (per
    collective step) feed ``python -m sweeps.project``; ``source`` names the documents the numbers come from.
    """

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
    # null: <run folder>/checkpoints
    dir: Optional[str] = None
    # null: every epoch; 0: no periodic saving (still saved at the end)
    every: Optional[int] = None
    keep: int = 3
    # auto | never | <path>
    resume: str = "auto"
    enabled: bool = True
    # null: off; an evaluation metric (eval/loss, eval/accuracy; the GPT's eval/perplexity, eval/bpb): the best
    # evaluated step is also kept, in <checkpoint.dir>/best/<step>, which the checkpoint.keep rotation never deletes
    # (python -m sample / evaluate --best); training/checkpoint/best.py
    keep_best: Optional[str] = None
    # min | max | auto (max for eval/accuracy, min for the others)
    best_mode: BestMode = BestMode.auto


@dataclass
class DistributedConfig:
    """Many processes on ``jax.distributed`` (training/distributed.py; README "Running on a cluster").

    ``enabled``: null = auto: on when coordinator/num_processes/process_id is set, or when JAX's cluster
    detection (SLURM, Open MPI, Cloud TPU) finds more than one process; false = never; true = always.
    Unset values come from the detected cluster. ``coordinator``: HOST:PORT of process 0, reachable by all.
    ``timeout_s``: seconds to wait for every peer at start; then JAX aborts the process (non-zero exit).
    """

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
    # Typed by the chosen option (conf/model/<name>.yaml -> MODEL_SCHEMAS[name], likewise parallel and optim).
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
    """Registers the schema in Hydra's ConfigStore (idempotent): ``base_config`` and, under the groups
    ``schema/model``, ``schema/parallel`` and ``schema/optim``, one node per option (the first default of each
    ``conf/<group>/<name>.yaml`` of these groups)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, (schemas, _) in OPTION_SCHEMAS.items():
        for name, schema in schemas.items():
            cs.store(group=f"schema/{group}", name=name, node=schema)
    if not OmegaConf.has_resolver("epochs_to_steps"):
        # ${epochs_to_steps:E,B,N}: optimizer steps in E epochs of N examples at global batch B (whole batches;
        # e.g. optim.warmup_steps in epochs, for presets that sweep the batch: conf/sweep/large_batch.yaml).
        OmegaConf.register_new_resolver("epochs_to_steps", lambda e, b, n: int(float(e) * (int(n) // int(b))))


# ---- errors: one line each ---------------------------------------------------------------------------------------
class ConfigInputError(ValueError):
    """A command-line override or config value the schema refuses; the message is one line naming the key."""


class UnknownKeyError(ConfigInputError):
    """A key the schema does not know (e.g. ``+optim.learning_rate=0.5``, ``model=cnn model.hidden=512``)."""


def _keys(schema: type) -> list[str]:
    return [f.name for f in dataclasses.fields(schema)]


def _option_of(schema: Optional[type]) -> Optional[tuple[str, str]]:
    """(group, option) when ``schema`` is one option's schema (e.g. CNNConfig -> ("model", "cnn"))."""
    for group, (schemas, _) in OPTION_SCHEMAS.items():
        for name, s in schemas.items():
            if s is schema:
                return group, name
    return None


def unknown_key_message(key: str, schema: Optional[type], more: str = "") -> str:
    """One line for ``key`` (dotted) missing from the dataclass ``schema`` of its parent node.

    Under ``model``/``parallel``/``optim`` it names the chosen option and the keys it has, and the options the key
    belongs to; elsewhere a "did you mean" hint, else the parent's keys. ``more`` is appended after the key."""
    parent, _, leaf = key.rpartition(".")
    known = _keys(schema) if dataclasses.is_dataclass(schema) else []
    option = _option_of(schema)
    close = difflib.get_close_matches(leaf, known, n=1, cutoff=0.5)
    if option is not None:
        group, name = option
        if "." not in key:  # (a node merged on its own, e.g. by from_dict)
            key = f"{group}.{key}"
        own = ", ".join(k for k in known if k != "name")
        elsewhere = [n for n, s in OPTION_SCHEMAS[group][0].items() if leaf in _keys(s)]
        if elsewhere:
            return (
                f"{key}{more} does not apply to {group}={name} (only to {group}={', '.join(elsewhere)}); "
                f"{group}={name} has: {own}"
            )
        hint = f"did you mean {group}.{close[0]}?" if close else f"{group}={name} has: {own}"
        return f"unknown config key {key}{more} for {group}={name}; {hint}"
    where = f"{parent}." if parent else ""
    hint = (
        f"did you mean {where}{close[0]}?"
        if close
        else f"known keys{' of ' + parent if parent else ''}: " + ", ".join(known)
    )
    return f"unknown config key {key}{more}; {hint}"


def unknown_keys(cfg: DictConfig, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted key, dataclass of its parent) for every key of ``cfg`` that its dataclass schema lacks.

    Hydra's ``+key=value`` adds keys even to a typed (struct) node and ``OmegaConf.to_object`` then drops
    them silently, so they are looked for here, recursively, in every node that has a dataclass type.
    """
    found: list[tuple[str, type]] = []
    schema = OmegaConf.get_type(cfg)
    known = _keys(schema) if dataclasses.is_dataclass(schema) else None
    for key in cfg.keys():
        dotted = f"{prefix}{key}"
        if known is not None and key not in known:
            found.append((dotted, schema))
            continue
        child = cfg._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            found.extend(unknown_keys(child, dotted + "."))
    return found


def _schema_at(path: str) -> Optional[type]:
    """The dataclass of the node at dotted ``path`` of :class:`Config` ("" is the root; ``model``,
    ``parallel`` and ``optim`` give their default option's schema), or None when there is no such node."""
    schema: Optional[type] = Config
    for part in [p for p in path.split(".") if p]:
        if schema is Config and part in OPTION_SCHEMAS:
            schemas, default = OPTION_SCHEMAS[part]
            schema = schemas.get(default)
            continue
        fields = {f.name: f for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else {}
        if part not in fields or not callable(fields[part].default_factory):
            return None
        schema = type(fields[part].default_factory())
    return schema if dataclasses.is_dataclass(schema) else None


def check_known_keys(cfg: DictConfig) -> None:
    """Raises ``UnknownKeyError`` (one line, with a "did you mean" hint) for the first key the schema lacks."""
    bad = unknown_keys(cfg)
    if bad:
        key, schema = bad[0]
        more = f" (and {len(bad) - 1} more: {', '.join(k for k, _ in bad[1:])})" if len(bad) > 1 else ""
        raise UnknownKeyError(unknown_key_message(key, schema, more))


def check_option_names(cfg: DictConfig) -> None:
    """``model.name`` / ``parallel.name`` / ``optim.name`` must be the chosen option's: the option picks the schema, so
    ``model.name=cnn`` on ``model=mlp`` would build a CNN from MLP settings. Raises ConfigInputError."""
    for group, (schemas, _) in OPTION_SCHEMAS.items():
        node = cfg.get(group)
        if not isinstance(node, DictConfig) or "name" not in node:
            continue
        option = _option_of(OmegaConf.get_type(node))
        name = node.get("name")
        if option is not None and name != option[1]:
            how = f"{group}={name}" if name in schemas else f"{group}=<one of {', '.join(schemas)}>"
            raise ConfigInputError(
                f"{group}.name={name} does not match the chosen option {group}={option[1]}; "
                f"choose the {group} with {how}"
            )


def _choices(e: OmegaConfBaseException) -> Optional[list[str]]:
    """The members of the Enum field an OmegaConf validation error is about, else None."""
    schema, key = getattr(e, "object_type", None), getattr(e, "key", None)
    if not dataclasses.is_dataclass(schema) or key is None:
        return None
    hint = typing.get_type_hints(schema).get(str(key))
    for t in (hint, *typing.get_args(hint)):  # Optional[E] -> (E, NoneType)
        if isinstance(t, type) and issubclass(t, enum.Enum):
            return [m.value for m in t]
    return None


def _first_line(text: str) -> str:
    return next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")


# Characters Hydra's override grammar reads as syntax (or cannot lex) in an unquoted value: a path holding one
# must be quoted inside the shell's quotes ('key="a b"').
_NEEDS_QUOTES = re.compile(r"[\s()\[\]{}=,'\"#%:$\\]|[^\x00-\x7f]")


def _quote_hint(override: str) -> str:
    """``; quote the value: 'key="value"'`` for an unquoted override value Hydra cannot parse because of a
    space, a bracket or another character of its grammar (also any non-ASCII letter); else ``""`` (also for
    a value that starts as a list or dict: a typo there is not a quoting matter)."""
    key, sep, value = str(override).partition("=")
    if not sep or not value or value[0] in "'\"[{" or '"' in value or not _NEEDS_QUOTES.search(value):
        return ""
    return f"; quote the value for Hydra inside the shell's quotes: '{key}=\"{value}\"'"


# Groups whose options only set existing keys: an unlisted value can be given through the key itself.
GROUP_KEYS = {"accum": "train.accum_steps", "mesh": "mesh.devices / mesh.shape"}


def one_line(e: BaseException) -> str:
    """One line for an error of Hydra's composition or OmegaConf's validation (the messages are multi-line:
    search path, option lists, object types): the key, the value, the choices or a "did you mean" hint.

    Handles Hydra's ``MissingConfigException`` (unknown group option), ``OverrideParseException``,
    ``ConfigCompositionException`` (unknown key without ``+``, wrong type or choice, ambiguous value) and
    OmegaConf's own errors; anything else: its first line.
    """
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException

    if isinstance(e, MissingConfigException) and e.missing_cfg_file and "/" in e.missing_cfg_file:
        group, _, value = e.missing_cfg_file.rpartition("/")
        options = sorted(o for o in (e.options or []) if not o.startswith("_"))
        close = difflib.get_close_matches(value, options, n=1, cutoff=0.5)
        hint = f"; did you mean {group}={close[0]}?" if close else ""
        key = GROUP_KEYS.get(group)
        other = f" (or set {key} directly)" if key else ""
        return f"{group}={value} is not an option of group {group}; choose one of {', '.join(options)}{other}{hint}"
    if isinstance(e, OverrideParseException):
        return f"cannot parse the override {e.override!r}: {_first_line(str(e))}{_quote_hint(e.override)}"
    cause = e.__cause__ if isinstance(e, ConfigCompositionException) else e
    text = str(e)
    if isinstance(e, ConfigCompositionException) and "Ambiguous value for argument" in text:
        arg = text.split("'")[1] if "'" in text else text
        return (
            f"{arg}: a comma-separated value is a sweep (add -m); for a list write key=[a,b], for a string "
            f"quote it: key='a,b'"
        )
    if isinstance(e, ConfigCompositionException) and "Could not delete from config" in text and "'" in text:
        key = text.split("'")[1]
        schema = _schema_at(key.rpartition(".")[0])
        if schema is not None:
            return f"cannot delete ~{key}: " + unknown_key_message(key, schema)
    if isinstance(e, ConfigCompositionException) and "No match in the defaults list" in text:
        group = text.split("'")[1] if "'" in text else "?"
        return f"{group} is not in the defaults list: add it with a + (+{group}=<option>)"
    if isinstance(cause, OmegaConfBaseException):
        key = getattr(cause, "full_key", None) or getattr(cause, "key", None)
        override = text.split("override ", 1)[1].strip() if "Error merging override " in text else None
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and key and "not in" in str(cause):
            return unknown_key_message(str(key), getattr(cause, "object_type", None))
        choices = _choices(cause)
        option = _option_of(getattr(cause, "object_type", None))
        if option is not None and "." not in str(key):  # (a node merged on its own, e.g. by from_dict)
            key = f"{option[0]}.{key}"
        value = getattr(cause, "value", None)
        shown = override or (f"{key}={value}" if value is not None else str(key))
        if choices is not None:
            return f"{shown} is not a valid choice; choose one of {', '.join(choices)}"
        return f"{shown}: {_first_line(str(cause))}"
    if isinstance(e, ValueError) and text.startswith("Config group override"):
        return f"{_first_line(text)}: a group option is a name, e.g. accum=4 or parallel=fsdp"
    return _first_line(text)


def is_composition_error(e: BaseException) -> bool:
    """Whether ``e`` is Hydra's or OmegaConf's refusal of a config or override (``one_line`` words it)."""
    from hydra.errors import HydraException

    return isinstance(e, (HydraException, OmegaConfBaseException)) or (
        isinstance(e, ValueError) and str(e).startswith("Config group override")
    )


_NUMBERS = re.compile(r"\d+(,\d+)*")


def quote_numeric_options(args: Sequence[str], conf_dir: Path) -> list[str]:
    """``args`` with numeric values of config groups quoted: ``accum=4`` -> ``accum='4'``, ``accum=1,2,4,8`` ->
    ``accum='1','2','4','8'``. Hydra parses an unquoted number as an integer and refuses it as a group option
    ("Config group override must be a string or a list"); every other argument is returned unchanged."""
    out = []
    for arg in args:
        key, sep, value = arg.partition("=")
        group = key.lstrip("+~").split("@")[0]
        if (
            sep
            and not arg.startswith("-")
            and group
            and (Path(conf_dir) / group).is_dir()
            and _NUMBERS.fullmatch(value)
        ):
            arg = f"{key}=" + ",".join(f"'{v}'" for v in value.split(","))
        out.append(arg)
    return out


# ---- typed configs -----------------------------------------------------------------------------------------
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
    """Resolves ``cfg`` and converts it into the typed ``Config`` dataclass tree (Enum fields as plain strings).

    Raises:
      UnknownKeyError: ``cfg`` holds a key the schema does not know (one line naming it).
      ConfigInputError: ``model.name``/``parallel.name`` differs from the chosen option, or a value fails
        the schema when resolved (one line).
    """
    check_known_keys(cfg)
    check_option_names(cfg)
    try:
        obj = OmegaConf.to_object(cfg)
        if not isinstance(obj, Config):  # composed without the schema (should not happen)
            obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), cfg))
    except OmegaConfBaseException as e:
        raise ConfigInputError(one_line(e)) from None
    return _plain_strings(obj)


def from_dict(data: Mapping[str, Any], *, lenient: bool = False) -> Config:
    """A typed ``Config`` from a nested plain dict (e.g. a checkpoint's saved config); schema defaults fill
    every absent key. ``model``/``parallel``/``optim`` take the schema of their ``name`` (default mlp /
    jit_sharding / adam).

    Args:
      lenient: drop the keys of ``model``/``parallel``/``optim`` that the option's schema lacks instead of refusing
        them (configs saved when these nodes were one union of every option's keys).
    Raises:
      ConfigInputError / UnknownKeyError: one line naming the key.
    """
    data = dict(data)
    try:
        for group, (schemas, default) in OPTION_SCHEMAS.items():
            node = dict(data.get(group) or {})
            name = node.get("name", default)
            if name not in schemas:
                raise ConfigInputError(f"{group}.name={name!r} is unknown; choose one of {', '.join(schemas)}")
            if lenient:
                node = {k: v for k, v in node.items() if k in _keys(schemas[name])}
            data[group] = OmegaConf.merge(OmegaConf.structured(schemas[name]), node)
        cfg = OmegaConf.merge(OmegaConf.structured(Config), data)
    except OmegaConfBaseException as e:
        raise ConfigInputError(one_line(e)) from None
    return to_typed(cfg)


def as_dict(cfg: Config) -> dict[str, Any]:
    """The resolved config as a plain dict (for W&B and checkpoints)."""
    return dataclasses.asdict(cfg)
