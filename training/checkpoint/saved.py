"""What a run takes from the checkpoint it resumes or evaluates before building anything: the null settings it
inherits (``policy.INHERITED``) and the tokenizer saved beside it; and the checks of ``checkpoint.keep_best``
that need the run's model and evaluation settings."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import jax

from conf.schema import Config, as_dict
from core.errors import ConfigError
from training.checkpoint.plan import prepare
from training.checkpoint.policy import inherited_values
from training.checkpoint.resuming import candidate_step_dir, log
from training.checkpoint.store import complete_steps, read_metadata

TOKENIZER_FILE = "tokenizer.json"  # the run's tokenizer, saved in the run folder and the checkpoint folder


def inherit_settings(cfg: Config, run_dir: Path) -> Config:
    """``cfg`` with every key of ``policy.INHERITED`` it leaves null set: to the value of the checkpoint this run
    would resume (its saved config; ``ABSENT_MEANS`` for a checkpoint saved before the key existed), else to the
    new-run default (``optim.weight_decay_mask`` matrices, ``model.attention_dropout`` = ``model.dropout``). Reads
    only the JSON metadata of the step ``checkpoint.resume`` would try first; a bad checkpoint setting or an
    unreadable step is left to ``checkpoint.prepare`` and the resume to report."""
    saved = None
    try:
        step_dir = candidate_step_dir(prepare(cfg.checkpoint, run_dir, jax.process_count()))
        if step_dir is not None:
            saved = read_metadata(step_dir).get("config", {})
    except (ConfigError, OSError, ValueError):
        saved = None
    return with_inherited(cfg, saved)


def with_inherited(cfg: Config, saved_cfg: Optional[dict]) -> Config:
    """``cfg`` with the ``INHERITED`` keys it leaves null set from ``saved_cfg`` (the config saved with the
    checkpoint it resumes or evaluates; None: a new run), ``policy.inherited_values``."""
    for key, value in inherited_values(saved_cfg, as_dict(cfg)).items():
        group, name = key.split(".")
        cfg = dataclasses.replace(cfg, **{group: dataclasses.replace(getattr(cfg, group), **{name: value})})
    return cfg


def saved_tokenizer(ckpt_plan) -> Optional[Path]:
    """The ``tokenizer.json`` saved with the checkpoint this run would resume (beside its step folder), or None
    (no checkpoint to resume; byte tokens save none)."""
    step_dir = candidate_step_dir(ckpt_plan)
    return None if step_dir is None else tokenizer_beside(step_dir)


def tokenizer_beside(step_dir: Path) -> Optional[Path]:
    """The ``tokenizer.json`` of the checkpoint at ``step_dir``: in its checkpoint folder (for ``<dir>/best/<step>``:
    ``<dir>``), else in the run folder its metadata names; None when there is none."""
    step_dir = Path(step_dir)
    places = [step_dir.parent, step_dir.parent.parent]
    try:
        run_dir = read_metadata(step_dir).get("run_dir")
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
        if not (kept.is_file() and complete_steps(ckpt_plan.directory)):
            write_atomic(kept, text)


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
        log.warning(
            f"checkpoint.keep_best={metric} without train.eval_every: only the final evaluation is compared, so the "
            f"best checkpoint is the last step's; set train.eval_every=N to keep the best of every N steps"
        )
