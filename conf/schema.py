"""Typed schema of the whole configuration (Hydra structured configs).

The schema is registered in Hydra's ConfigStore as ``base_config`` and is the first entry of
``conf/config.yaml``'s defaults list, so every group option (``conf/<group>/<option>.yaml``) is merged into a
typed node: a misspelt key or a value of the wrong type fails at start with Hydra's own message.

Library code never reads the config: ``train.py`` turns it into these dataclasses once (``to_typed``) and the
builders take plain, typed fields.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf


@dataclass
class ParallelConfig:
    """How the step is spread over devices. ``name``: pmap | jit_sharding | shard_map | fsdp."""

    name: str = "jit_sharding"
    # fsdp: arrays smaller than this stay replicated (their gradients are all-reduced).
    min_shard_bytes: int = 0
    # null: the mode's own reduction; float32 | bfloat16: explicit reduction in that dtype (shard_map psum /
    # psum_scatter, visible in the lowered module; jit_sharding then reduces under shard_map; pmap: psum),
    # cast back to float32 before the optimizer.
    grad_reduce_dtype: Optional[str] = None
    # none | int8: quantised all-to-all + int32 sum + int8 all-gather with error feedback (parallel/compress.py;
    # jit_sharding, shard_map, pmap; needs grad_reduce_dtype=null).
    grad_compression: str = "none"


@dataclass
class PrecisionConfig:
    """``compute_dtype``: float32 | bfloat16 | float16. Master params and optimizer state are always float32."""

    name: str = "fp32"
    compute_dtype: str = "float32"
    # dynamic | static | none (only used when compute_dtype is float16).
    loss_scale: str = "none"
    init_scale: float = 32768.0  # 2**15
    growth_interval: int = 2000


@dataclass
class ModelConfig:
    """``name``: mlp | cnn | resnet | vit. Fields that a model does not use are ignored by it."""

    name: str = "mlp"
    hidden: int = 256
    activation: str = "tanh"
    dropout: float = 0.0
    init_std: float = 0.01
    # cnn / resnet / vit
    width: int = 32
    depth: int = 4
    patch: int = 4
    heads: int = 4
    mlp_ratio: int = 4


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
    prefetch: int = 2


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule (optax)."""

    name: str = "adam"
    lr: float = 1e-3
    momentum: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    schedule: str = "constant"  # constant | cosine
    warmup_steps: int = 0
    decay_steps: int = 0  # cosine: steps over which lr decays to 0 (after warmup); its own key, never derived
    lr_scaling: str = "none"  # none | linear  (lr * global_batch / base_batch)
    base_batch: int = 256
    clip_grad_norm: Optional[float] = None


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
    seed: int = 0
    sync_every: int = 100
    sync_strict: bool = False
    max_in_flight: int = 2
    # DEBUG AID: every process writes the global example indices it placed on its devices at each
    # step to <run dir>/debug_indices_process<i>.jsonl (one device->host copy per step).
    debug_dump_indices: bool = False
    # jax.transfer_guard level around the step dispatch: allow | log | disallow (implicit host<->device
    # transfers between logging windows raise) | log_explicit | disallow_explicit.
    transfer_guard: str = "allow"


@dataclass
class WandbConfig:
    """``mode``: null (online with an API key, else offline) | online | offline | disabled."""

    mode: Optional[str] = None
    project: str = "dp-scaling"
    entity: Optional[str] = None
    group: Optional[str] = None
    tags: List[str] = field(default_factory=list)
    init_timeout_s: float = 30.0


@dataclass
class RuntimeConfig:
    """``cpu_devices``: simulated devices when the platform is CPU (set before the backend starts).

    ``compilation_cache_dir``: JAX's persistent compilation cache (training/compile_cache.py): compiled
    programs are kept there and a repeated run or a sweep's next job loads them; null turns it off.
    Programs that compile in less than ``compilation_cache_min_compile_time_s`` seconds, or whose entry is
    smaller than ``compilation_cache_min_entry_bytes``, are not written.
    """

    cpu_devices: int = 8
    compilation_cache_dir: Optional[str] = \
        "${oc.env:JAX_COMPILATION_CACHE_DIR,${oc.env:XDG_CACHE_HOME,${oc.env:HOME}/.cache}/dp_scaling/jax_compilation_cache}"
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
    """Registers the schema as ``base_config`` in Hydra's ConfigStore (idempotent)."""
    ConfigStore.instance().store(name="base_config", node=Config)
    if not OmegaConf.has_resolver("epochs_to_steps"):
        # ${epochs_to_steps:E,B,N}: optimizer steps in E epochs of N examples at global batch B (whole batches;
        # e.g. optim.warmup_steps in epochs, for presets that sweep the batch: conf/sweep/large_batch.yaml).
        OmegaConf.register_new_resolver("epochs_to_steps", lambda e, b, n: int(float(e) * (int(n) // int(b))))


class UnknownKeyError(ValueError):
    """A key the schema does not know (e.g. ``+optim.learning_rate=0.5``); the message is one line."""


def unknown_keys(cfg: DictConfig, prefix: str = "") -> list[tuple[str, list[str]]]:
    """(dotted key, known keys of its parent) for every key of ``cfg`` that its dataclass schema lacks.

    Hydra's ``+key=value`` adds keys even to a typed (struct) node and ``OmegaConf.to_object`` then drops
    them silently, so they are looked for here, recursively, in every node that has a dataclass type.
    """
    found: list[tuple[str, list[str]]] = []
    schema = OmegaConf.get_type(cfg)
    known = [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else None
    for key in cfg.keys():
        dotted = f"{prefix}{key}"
        if known is not None and key not in known:
            found.append((dotted, known))
            continue
        child = cfg._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            found.extend(unknown_keys(child, dotted + "."))
    return found


def check_known_keys(cfg: DictConfig) -> None:
    """Raises ``UnknownKeyError`` (one line, with a "did you mean" hint) for the first key the schema lacks."""
    bad = unknown_keys(cfg)
    if not bad:
        return
    key, known = bad[0]
    parent, _, leaf = key.rpartition(".")
    close = difflib.get_close_matches(leaf, known, n=1, cutoff=0.5)
    where = f"{parent}." if parent else ""
    hint = f"did you mean {where}{close[0]}?" if close else f"known keys{' of ' + parent if parent else ''}: " + \
        ", ".join(known)
    more = f" (and {len(bad) - 1} more: {', '.join(k for k, _ in bad[1:])})" if len(bad) > 1 else ""
    raise UnknownKeyError(f"unknown config key {key}{more}; {hint}")


def to_typed(cfg: DictConfig) -> Config:
    """Resolves ``cfg`` and converts it into the typed ``Config`` dataclass tree.

    Raises:
      UnknownKeyError: ``cfg`` holds a key the schema does not know (one line naming it).
    """
    check_known_keys(cfg)
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, Config):  # composed without the schema (should not happen)
        obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), cfg))
    return obj


def as_dict(cfg: Config) -> dict[str, Any]:
    """The resolved config as a plain dict (for W&B and checkpoints)."""
    return dataclasses.asdict(cfg)
