"""The resume policy: what a run may change when it resumes another run's checkpoint, what it warns about,
and what a finished run reports again. Pure functions of configs, metadata and run files.

Rule (``resume_conflicts``; ``training.checkpoint.resuming.check_resume_settings`` applies it to the metadata of
the step a run would resume, before anything is restored):

- Allowed: keys that only extend or re-place the run: ``train.steps``/``train.epochs``, logging, evaluation,
  sync-check and in-flight settings, the checkpoint period/keep/folder, W&B, profiling, device count and mesh
  (``mesh.*``, ``runtime.cpu_devices``), the parallel mode (``parallel.name``, ``parallel.min_shard_bytes``:
  the state restores onto any layout), XLA flags, hardware figures, data paths, prefetch and ``data.on_device``
  (the same batches), ``distributed.*``,
  the GPT's end-of-run sample length (``train.sample_tokens``), the verdict on an exploded final loss
  (``train.allow_exploded_loss``: the fix its error line names).
- Adapted by an exact rule: ``train.global_batch`` / ``train.per_device_batch`` may change as long as the
  resolved global batch (per-device batch x devices under weak scaling) equals the checkpoint's, so the same
  examples make each step; otherwise the keys are refused.
- Refused unless ``checkpoint.allow_data_change=true``: other training data than the checkpoint's (``data_change``
  of the fingerprints: a text file edited in place, another TFDS version), named with the file in the line. With
  both fingerprints at hand, ``data.path`` may change (the file moved): its bytes decide.
- Refused: every other difference (seed, data set and its sizes/augmentation, model, optimizer and its
  settings, clipping, schedule, precision and loss scaling, accumulation, gradient reduction dtype and
  compression): the run would continue another experiment's parameters. The one-line error names the keys
  with both values and the two ways out (set them back, or give the run its own ``checkpoint.dir``). Nothing
  is renamed or deleted: the checkpoint is healthy. A GPT's vocabulary / context / position table are
  compared as resolved from its size preset, so the line names both table sizes (``gpt_table_changes``).
- Keys newer than a checkpoint: compared as what it ran with (``ABSENT_MEANS``); ``INHERITED`` keys left null take
  the checkpoint's value (``inherited_values``; ``training.checkpoint.saved.inherit_settings``).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Iterator, Optional


ALLOWED = (
    "train.steps",
    "train.epochs",
    "train.log_every",
    "train.eval_every",
    "train.eval_batch",
    "train.sync_every",
    "train.sync_strict",
    "train.max_in_flight",
    "train.debug_dump_indices",
    "train.transfer_guard",
    "train.grad_norm_every",
    "train.sample_tokens",
    "train.allow_exploded_loss",  # only the verdict on the final loss: the advice of its error line resumes
    "checkpoint.",
    "wandb.",
    "profile.",
    "mesh.",
    "runtime.",
    "parallel.name",
    "parallel.min_shard_bytes",
    "parallel.fsdp_rules",  # where arrays live, like parallel.name (a checkpoint restores onto any sharding)
    "xla.",
    "hardware.",
    "distributed.",
    "data.cache_dir",
    "data.data_dir",
    "data.prefetch",
    "data.on_device",  # where the same batches are made (data/pipeline.py: DeviceSource)
    "data.eval_windows",  # how much of the validation split is evaluated (training is the same)
)
BATCH_KEYS = ("train.global_batch", "train.per_device_batch")
# Where the advice to change refused settings (a lower learning rate after a divergence) works: a resume of the
# same checkpoint.dir refuses them, so the advice says to start a new run there.
NEW_RUN = "in a new run (its own checkpoint.dir where one is pinned)"
# Nodes whose keys depend on the chosen option (conf/schema.py OPTION_SCHEMAS); checkpoints saved before hold
# every option's keys.
OPTION_NODES = ("model.", "parallel.", "optim.")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


# Keys added after checkpoints were saved without them: the value that reproduces what such a checkpoint was
# trained with (compared in its place, so an older checkpoint resumes under the defaults that mean the same).
ABSENT_MEANS: dict[str, Any] = {
    "optim.min_lr": 0.0,  # the cosine schedule decayed to 0
    "optim.weight_decay_mask": "all",  # AdamW decayed every parameter
    "model.attention_dropout": 0.0,  # no dropout on the attention probabilities
    "data.tokenizer": "bytes",
    "data.tokenizer_file": None,
    "data.vocab_size": 4096,  # (unused with byte tokens)
    "data.eval_windows": None,  # every validation window
}
# Keys whose null means "the checkpoint's value when this run resumes one, else the new-run default"
# (``inherit_settings``): a resumed run keeps what it was trained with, a new one gets the current default.
INHERITED = ("optim.weight_decay_mask", "model.attention_dropout")


def _with_absent(saved: dict, now: dict) -> dict:
    """The flat saved config ``saved`` with ``ABSENT_MEANS`` for the keys it lacks and ``now`` has."""
    return {**{k: v for k, v in ABSENT_MEANS.items() if k in now and k not in saved}, **saved}


def new_run_value(key: str, cfg_dict: dict) -> Any:
    """The value an ``INHERITED`` key left null takes in a new run: ``optim.weight_decay_mask`` matrices (nanoGPT's
    rule), ``model.attention_dropout`` the run's ``model.dropout`` (nanoGPT uses one rate for both)."""
    if key == "optim.weight_decay_mask":
        return "matrices"
    if key == "model.attention_dropout":
        return _flat(cfg_dict).get("model.dropout", 0.0)
    raise KeyError(key)


def inherited_values(saved_cfg: Optional[dict], cfg_dict: dict) -> dict[str, Any]:
    """``{key: value}`` for every ``INHERITED`` key that ``cfg_dict`` has and leaves null: the saved config's value
    when this run resumes a checkpoint (``saved_cfg``; ``ABSENT_MEANS`` when that config lacks the key, the new-run
    value when it holds null), else the new-run value (``new_run_value``). A key given explicitly is not touched: the
    resume policy compares it like any other."""
    now = _flat(cfg_dict)
    saved = None if saved_cfg is None else _with_absent(_flat(saved_cfg), now)
    out = {}
    for key in INHERITED:
        if key not in now or now[key] is not None:
            continue
        value = None if saved is None else saved.get(key)
        out[key] = new_run_value(key, cfg_dict) if value is None else value
    return out


# The GPT's table dimensions as resolved from ``model.size`` and its overrides (a null key takes the preset's
# value): compared resolved, so that ``vocab_size: null`` and ``vocab_size: 256`` on size tiny are the same table.
GPT_TABLE_KEYS = {"vocab_size": "GPT vocabulary", "context": "GPT context", "max_positions": "GPT position table"}


def gpt_tables(model_cfg: dict) -> Optional[dict[str, int]]:
    """``{"vocab_size", "context", "max_positions"}`` of a ``model.name=gpt`` config node as the model resolves
    them (``models.gpt.resolve_dims``: tokens, rows of the embedding and position tables); None for another
    model or dimensions that do not resolve (the model's own validation reports those)."""
    if not isinstance(model_cfg, dict) or model_cfg.get("name") != "gpt":
        return None
    from models.gpt import resolve_dims

    try:
        dims = resolve_dims(
            model_cfg.get("size") or "tiny",
            **{k: model_cfg.get(k) for k in ("vocab_size", "context", "max_positions", "width", "depth", "heads")},
        )
    except (ValueError, TypeError):
        return None
    return {k: getattr(dims, k) for k in GPT_TABLE_KEYS}


def gpt_table_changes(saved_model: dict, model_now: dict) -> tuple[list[str], set[str]]:
    """The GPT table dimensions that differ between two ``model`` config nodes, resolved:
    ``model.vocab_size (GPT vocabulary): 256 -> 300``; and the ``model.<key>`` names compared that way (their
    raw values are not compared again). Empty when either model is not a GPT."""
    old, new = gpt_tables(saved_model), gpt_tables(model_now)
    if old is None or new is None:
        return [], set()
    out = [f"model.{k} ({what}): {old[k]} -> {new[k]}" for k, what in GPT_TABLE_KEYS.items() if old[k] != new[k]]
    return out, {f"model.{k}" for k in GPT_TABLE_KEYS}


def resume_conflicts(
    saved_cfg: dict,
    cfg_dict: dict,
    saved_global_batch: Optional[int],
    global_batch: int,
    data_compared: bool = False,
) -> list[str]:
    """``key: saved -> now`` for every difference the rule above refuses (empty: the resume is allowed).

    Args:
      saved_cfg: the checkpoint's resolved config (``metadata["config"]``).
      cfg_dict: this run's resolved config (``conf.schema.as_dict``).
      saved_global_batch / global_batch: resolved global batches (examples per optimizer step); None when the
        checkpoint does not record it (then the batch keys are compared as written).
      data_compared: both sides have a data fingerprint (``data_change`` judges the file by its bytes): another
        ``data.path`` holding the same bytes (the file moved) is allowed.

    A GPT's vocabulary, context and position table are compared as resolved from its size preset (listed
    first, ``gpt_table_changes``), so the line names both table sizes even where a key was left null.
    """
    new = _flat(cfg_dict)
    old = _with_absent(_flat(saved_cfg), new)
    out, resolved = gpt_table_changes(saved_cfg.get("model", {}), cfg_dict.get("model", {}))
    for key in sorted(set(old) | set(new)):
        if old.get(key) == new.get(key) or key.startswith(ALLOWED) or key in resolved:
            continue
        if key in INHERITED and new.get(key) is None:
            continue  # null: this run takes the checkpoint's value (``inherit_settings``)
        if key not in new and key.startswith(OPTION_NODES):
            continue  # a key of the union schema that this run's model / mode / optimizer lacks (so never used)
        if key in BATCH_KEYS and saved_global_batch is not None and saved_global_batch == global_batch:
            continue
        if key == "data.path" and data_compared:
            continue
        out.append(f"{key}: {old.get(key)!r} -> {new.get(key)!r}")
    if (
        saved_global_batch is not None
        and saved_global_batch != global_batch
        and not any(c.startswith(BATCH_KEYS) for c in out)
    ):
        out.append(f"train.global_batch: {saved_global_batch} -> {global_batch}")  # (resolved)
    return out


def start_afresh(resume_path: Optional[Path]) -> str:
    """How a run starts without the checkpoint it would resume: its own ``checkpoint.dir``, or, when the checkpoint
    was named by ``checkpoint.resume=<path>`` (another folder of its own would resume it again), without that."""
    if resume_path is None:
        return "give this run its own checkpoint.dir"
    return f"leave out checkpoint.resume={resume_path}, saving into a checkpoint.dir of this run's own"


def refusal(step_dir: Path, conflicts: list[str], limit: int = 4, resume_path: Optional[Path] = None) -> str:
    """The one-line error for refused changes (``resume_path``: the run's ``checkpoint.resume`` folder, if any);
    those beyond ``limit`` as the overrides that set them back (``key=saved``), so that one step restores all."""
    back = " ".join(f"{c.split(' (')[0].split(': ')[0]}={c.split(': ')[1].split(' -> ')[0]}" for c in conflicts[limit:])
    shown = "; ".join(conflicts[:limit]) + (f"; and {back.replace(chr(39), '').replace('=None', '=null')}" * bool(back))
    return (
        f"checkpoint {step_dir} was trained with other settings ({shown}); to resume it set them back, "
        f"otherwise {start_afresh(resume_path)} (the checkpoint is kept as it is)"
    )


# ---- the data a checkpoint was trained on ------------------------------------------------------------------
# A checkpoint's metadata holds the fingerprint of its training data (``data_fingerprint``: ``data.text.
# file_fingerprint`` for a text file, ``data.sources.tfds_fingerprint`` for a TFDS split, none for synthetic
# data). A text file edited in place keeps every config value, so only its fingerprint tells the resume it changed.
FINGERPRINT_KEYS = {"file": ("bytes", "blake2b"), "tfds": ("dataset", "version", "split", "examples")}


def describe_data(fp: dict) -> str:
    """A fingerprint in words: ``/data/a.txt (20,531 bytes, blake2b 1a2b3c4d5e6f)`` or ``mnist 3.0.1 (train,
    60,000 examples)``."""
    if fp.get("kind") == "file":
        return f"{fp.get('file')} ({fp.get('bytes', 0):,} bytes, blake2b {str(fp.get('blake2b'))[:12]})"
    examples = fp.get("examples")
    return f"{fp.get('dataset')} {fp.get('version')} ({fp.get('split')}, {examples:,} examples)"


def data_change(saved: Optional[dict], now: Optional[dict]) -> Optional[str]:
    """How this run's training data differs from the checkpoint's, in words, or None: the same data (a file's
    size and hash, wherever it lies; a TFDS split's name, version, split and size), or either side unknown
    (a checkpoint saved before fingerprints were recorded, synthetic data)."""
    if not saved or not now:
        return None
    kind = now.get("kind")
    if saved.get("kind") == kind and all(saved.get(k) == now.get(k) for k in FINGERPRINT_KEYS.get(kind, ())):
        return None
    if kind == "file" and saved.get("kind") == kind and saved.get("file") == now.get("file"):
        return (
            f"{now['file']} was {saved.get('bytes', 0):,} bytes, blake2b {str(saved.get('blake2b'))[:12]}; it is now "
            f"{now['bytes']:,} bytes, blake2b {now['blake2b'][:12]}"
        )
    return f"it was {describe_data(saved)}; this run reads {describe_data(now)}"


def data_refusal(step_dir: Path, change: str, resume_path: Optional[Path] = None) -> str:
    """The one-line error for a resume on other data (``data_change``; ``resume_path`` as for ``refusal``)."""
    return (
        f"checkpoint {step_dir} was trained on other data ({change}); put back the data it was trained on, "
        f"{start_afresh(resume_path)}, or set checkpoint.allow_data_change=true to continue it on this data"
    )


# ---- what a resumed run warns about ----------------------------------------------------------------------
def data_order_warnings(saved: dict, *, global_batch: int, seed: int, steps_per_epoch: int, data: str) -> list[str]:
    """Why the resumed data order differs from the saved run's (empty: it is the same)."""
    cfg = saved.get("config", {})
    out = []
    checks = (
        ("train.global_batch", saved.get("global_batch"), global_batch),
        ("train.seed", cfg.get("train", {}).get("seed"), seed),
        ("steps per epoch", saved.get("steps_per_epoch"), steps_per_epoch),
        ("data.name", cfg.get("data", {}).get("name"), data),
    )
    for key, old, new in checks:
        if old is not None and old != new:
            out.append(
                f"{key} is {new} but the checkpoint was trained with {old}: the data order after the "
                f"restored step is not the one the saved run would have seen"
            )
    return out


IGNORED_CHANGES = ("checkpoint.", "wandb.", "profile.", "data.cache_dir", "data.data_dir", "distributed.")


def config_changes(saved_cfg: dict, cfg_dict: dict, limit: int = 6) -> list[str]:
    """``key: saved -> now`` for every config value that differs from the checkpoint's (where to save, W&B,
    profiling and data paths are left out), at most ``limit`` of them: a resumed run with another device count
    or mode is legitimate, a checkpoint.dir shared by the jobs of a sweep is a mistake; the user sees which.
    When a model, mode or optimizer changes (``parallel.name: 'jit_sharding' -> 'fsdp'``), the keys only one of
    the two options has (``parallel.fsdp_rules``) are not listed: that line says it."""
    new = _flat(cfg_dict)
    old = _with_absent(_flat(saved_cfg), new)
    switched = tuple(node for node in OPTION_NODES if old.get(f"{node}name") != new.get(f"{node}name"))

    def listed(k: str) -> bool:
        if k.startswith(IGNORED_CHANGES) or old.get(k) == new.get(k) or (k in INHERITED and new.get(k) is None):
            return False
        return not ((k not in old or k not in new) and k.startswith(switched))

    keys = sorted(k for k in set(old) | set(new) if listed(k))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys[:limit]] + (
        [f"... {len(keys) - limit} more"] if len(keys) > limit else []
    )


# ---- a run restored at its final step ---------------------------------------------------------------------
SUMMARY_PREFIXES = ("train/", "optim/", "perf/", "sync/", "mesh/", "loss_scale/", "comm/", "mem/")


def _records(metrics_path: Path, up_to_step: int) -> Iterator[dict[str, Any]]:
    """The readable JSON records of ``metrics_path`` with ``step`` <= ``up_to_step``, in file order; none when
    the file is missing (a line cut short by a kill is skipped)."""
    try:
        lines = Path(metrics_path).read_text().splitlines()
    except OSError:
        return
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if int(rec.get("step", -1)) <= up_to_step:
            yield rec


def history_values(metrics_path: Path, up_to_step: int) -> dict[str, Any]:
    """The last value of every training key (``train/``, ``optim/``, ``perf/``, ``sync/`` ...) in the records of
    ``metrics_path`` with ``step`` <= ``up_to_step``, plus ``perf/step_time_s_median`` over its logging windows;
    empty when the file is missing. Non-finite values (written as null) are skipped."""
    out: dict[str, Any] = {}
    step_times = []
    for rec in _records(metrics_path, up_to_step):
        out.update({k: v for k, v in rec.items() if k.startswith(SUMMARY_PREFIXES) and v is not None})
        if rec.get("perf/step_time_s") is not None:
            step_times.append(rec["perf/step_time_s"])
    if step_times:
        out["perf/step_time_s_median"] = statistics.median(step_times)
    return out


def history_windows(metrics_path: Path, up_to_step: int) -> list[tuple[float, int]]:
    """The logging windows of ``metrics_path``'s records with ``step`` <= ``up_to_step``, as ``(elapsed_s,
    steps)`` for ``measure.throughput.WindowStats.add``: each record with ``perf/step_time_s`` ends a window of
    (its step - the previous window's step) steps. Empty when the file is missing or holds no window."""
    out: list[tuple[float, int]] = []
    previous = 0
    for rec in _records(metrics_path, up_to_step):
        step, step_time_s = int(rec.get("step", -1)), rec.get("perf/step_time_s")
        if step_time_s is None or step <= previous:
            continue
        out.append((step_time_s * (step - previous), step - previous))
        previous = step
    return out


def finished_summary(saved_run_dir: Optional[str], step: int) -> Optional[dict]:
    """The saved run's ``summary.json`` when that run finished successfully at ``step`` (a rerun of a finished
    run reports it again instead of training 0 steps), else None."""
    if not saved_run_dir:
        return None
    try:
        s = json.loads((Path(saved_run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if s.get("status") == "ok" and s.get("train/steps") == step and "train/loss" in s:
        return s
    return None
