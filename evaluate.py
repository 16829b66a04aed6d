"""Evaluates a checkpoint on the test split and prints accuracy and loss.

    python -m evaluate outputs/2026-01-01/12-00-00      # a run folder ("outputs in ..."): its checkpoints/
    python -m evaluate outputs/ckpt/120                 # one step folder
    python -m evaluate outputs/ckpt                     # a checkpoint folder: its newest readable step
    python -m evaluate outputs/ckpt mesh.devices=1 data.data_dir=/data/tfds   # dotted config overrides
    python -m evaluate outputs/ckpt parallel=pmap precision=bf16               # group options, as train.py
    python -m evaluate outputs/2026-01-01/12-00-00 --best   # the best checkpoint (checkpoint.keep_best)

The model, data set and seed come from the config saved with the checkpoint (``<step>/meta/metadata``);
overrides (``train.py``'s syntax: ``group=option`` replaces a whole group, ``dotted.key=value`` one value) are
applied on top. By default the test split is evaluated with ``parallel=jit_sharding`` on every visible device
(the checkpoint restores onto any device count, see ``training.checkpoint``); the whole split is
used, padded and masked, so the denominator is exact (10,000 for MNIST).

Output: one line on stdout, ``eval/accuracy=<fraction> eval/loss=<mean cross-entropy, nats> step=<optimizer
steps> examples=<test examples> checkpoint=<step folder>`` (for the language model ``eval/perplexity=<exp of the
loss>`` after the loss, and on text ``eval/bpb=<bits per byte>``); with ``--json`` one JSON object with the same
keys. A GPT trained on BPE tokens is evaluated with the ``tokenizer.json`` saved beside its checkpoint. A damaged
newest step (a missing or truncated file) is named in one warning line and the newest complete step is evaluated.
Errors (no such checkpoint, no complete checkpoint, missing data set, bad override): one line ``error: ...`` on
stderr and exit code 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Optional, Sequence

from tracking.folders import RUN, folder_kind, run_checkpoint_dir

log = logging.getLogger("evaluate")

_NOT_A_KEY = object()
# Applied before the user's overrides: evaluation needs no training batch, W&B or other processes.
# (parallel=jit_sharding too, unless the overrides choose a mode.)
EVAL_DEFAULTS = [
    "mesh.devices=null",
    "mesh.shape=null",
    "train.global_batch=null",
    "train.per_device_batch=1",
    "train.accum_steps=1",
    "distributed.enabled=false",
    "wandb.mode=disabled",
    "profile.enabled=false",
]


def find_steps(path: Path) -> tuple[list[Path], Optional[Path]]:
    """The step folders ``path`` stands for, newest first, and the checkpoint folder they were taken from: ``[path]``
    and None for one step folder (a folder named by its step: it may be damaged), else every finished step of the
    checkpoint folder (a run folder, with ``.hydra/`` or ``checkpoints/``, stands for its checkpoint folder,
    ``tracking.folders.run_checkpoint_dir``). Nothing is read but folder names and small YAML files.

    Raises:
      ConfigError: nothing there; a step folder that does not exist names the steps that do; a sweep folder
        (named as one, with a job folder to pass instead); a run folder without a checkpoint (with what its files
        say about why); only entries named like steps that are not folders (named; beside complete steps: a
        warning).
    """
    from core.errors import ConfigError
    from training import checkpoint
    from tracking.folders import first_job, is_step_folder, many_runs, why_no_checkpoint
    from training.validate import check_path

    path = Path(path).expanduser().absolute()
    check_path("the checkpoint argument", path)
    several = many_runs(path)
    if several:  # a sweep's job folders are named by numbers, as steps are
        raise ConfigError(f"{path} is {several}, not a run: pass one run's folder, e.g. {first_job(path)}")
    if not path.exists():
        parent = path.parent
        steps = checkpoint.complete_steps(parent) if parent.is_dir() and path.name.isdigit() else []
        if steps:
            raise ConfigError(
                f"no step {path.name} in {parent}: its steps are {', '.join(map(str, steps))}; "
                f"give one of them or the folder {parent} (its newest step)"
            )
        raise ConfigError(
            f"checkpoint {path} does not exist; give a run folder, its checkpoints/ folder or one <step> folder in it"
        )
    run_ckpt = run_checkpoint_dir(path)
    if checkpoint.is_step_dir(path) or (
        path.name.isdigit() and run_ckpt is None and not checkpoint.complete_steps(path)
    ):
        return [path], None
    if run_ckpt is not None:
        empty = not run_ckpt.is_dir() or not checkpoint.complete_steps(run_ckpt)
        if empty and not checkpoint.odd_entries(run_ckpt):
            raise ConfigError(f"run folder {path} has no checkpoint in {run_ckpt}: {why_no_checkpoint(path)}")
        path = run_ckpt
    steps, odd = checkpoint.complete_steps(path), checkpoint.odd_entries(path)
    if not steps and is_step_folder(path.parent):  # e.g. its state/ folder
        raise ConfigError(f"{path} is inside the checkpoint step folder {path.parent}: pass {path.parent}")
    if odd and not steps:
        raise ConfigError(f"{path} holds no complete checkpoint: {odd}; give another checkpoint folder")
    if odd:  # skipped: a file or a broken symbolic link named like a step
        log.warning(f"{odd}: ignored; the newest complete step is {path / str(steps[-1])}")
    if not steps:
        raise ConfigError(
            f"{path} holds no checkpoint (no <step> folder with state/ and meta/); give a run folder, its checkpoint "
            f"folder or one <step> folder in it"
        )
    return [path / str(step) for step in reversed(steps)], path


def nothing_left(step_dirs: list[Path], folder: Optional[Path], tool: str) -> str:
    """What to do when every one of ``step_dirs`` (from :func:`find_steps`) is damaged, for ``tool`` ("evaluate",
    "sample"): another folder, or the given step's own folder when it holds other steps."""
    if folder is not None:
        return f"no complete checkpoint is left in {folder}: give another checkpoint folder"
    from training import checkpoint

    parent = step_dirs[0].parent
    if any(str(s) != step_dirs[0].name for s in checkpoint.complete_steps(parent)):
        return f"give its folder {parent} to {tool} the newest complete step"
    return f"it is the only checkpoint in {parent}: give another checkpoint folder"


def find_step_dir(path: Path) -> Path:
    """``path`` if it is a step folder, else the newest finished step folder whose metadata reads (a newer one whose
    metadata does not read is named in one warning line); see :func:`find_steps`.

    Raises:
      ConfigError: nothing there; a step folder that does not exist names the steps that do; no metadata reads.
    """
    from training import checkpoint

    step_dirs, folder = find_steps(path)
    if folder is None:
        return step_dirs[0]
    advice = nothing_left(step_dirs, folder, "use")
    return checkpoint.read_newest(step_dirs, checkpoint.read_metadata, "using", advice)[1]


def find_best_step_dir(path: Path) -> Path:
    """The best checkpoint of a run (``checkpoint.keep_best``): the step folder in ``<checkpoint folder>/best``,
    ``path`` being a run folder or its checkpoint folder (or that ``best`` folder itself).

    Raises:
      ConfigError: ``path`` is one step folder, or no best checkpoint was kept there (the run was trained without
        ``checkpoint.keep_best``, or its summary.json names a best folder since moved), or the one kept is damaged.
    """
    from core.errors import ConfigError, first_line
    from training import checkpoint
    from training.validate import check_path

    path = Path(path).expanduser().absolute()
    check_path("the checkpoint argument", path)
    if not path.exists():
        raise ConfigError(f"checkpoint {path} does not exist; give a run folder or its checkpoints/ folder with --best")
    if checkpoint.is_step_dir(path):
        raise ConfigError(
            f"--best takes a run folder or a checkpoint folder, not the step folder {path}; give {path.parent}"
        )
    is_best = path.name == checkpoint.BEST_DIR and folder_kind(path) != RUN  # a run folder named best is a run's
    moved = None if is_best else _kept_best(path)
    if moved is not None:  # a best folder moved under another name
        return moved
    folder = path if is_best else (run_checkpoint_dir(path) or path) / checkpoint.BEST_DIR
    found = checkpoint.best_step_dir(folder)
    if found is None and checkpoint.complete_steps(folder):  # kept, but damaged: say so, do not guess a cause
        damaged = folder / str(checkpoint.complete_steps(folder)[-1])
        try:
            checkpoint.read_metadata(damaged)
            why = "its metadata does not read"
        except (OSError, ValueError) as e:
            why = first_line(e)
        raise ConfigError(
            f"the best checkpoint {damaged} is incomplete or corrupt ({why}); leave out --best for the newest "
            f"checkpoint, or train again with checkpoint.keep_best to keep a new best one"
        )
    summary, kept = (None, {}) if found is not None else _run_summary(path, folder)
    if kept.get("checkpoint/best_path"):
        raise ConfigError(
            f"no best checkpoint in {folder}, but {summary} says the run kept one in {kept['checkpoint/best_path']}: "
            f"the best folder was moved or deleted; give the folder it was moved to with --best, or leave out --best "
            f"for the newest"
        )
    if kept.get("checkpoint/best_metric"):
        raise ConfigError(
            f"no best checkpoint in {folder}: {summary} says checkpoint.keep_best={kept['checkpoint/best_metric']} "
            f"saved none (no evaluation finished with a finite value); leave out --best for the newest"
        )
    if found is None:
        raise ConfigError(
            f"no best checkpoint in {folder}: the run was trained without checkpoint.keep_best (train with "
            f"checkpoint.keep_best=eval/loss and train.eval_every=N to keep one), or leave out --best for the newest"
        )
    _warn_other_runs_best(path, found)
    return found


def _warn_other_runs_best(path: Path, best: Path) -> None:
    """One warning when the best checkpoint ``best`` was saved by another run than the one at ``path`` (a run or
    checkpoint folder): its metadata's ``run_dir`` is not this run's (``.hydra/`` of ``path``, else the one the
    newest step names), and its model config differs from this run's newest step's. It is still the one read."""
    from training import checkpoint

    saver = checkpoint.read_metadata(best).get("run_dir")
    newest = checkpoint.best_step_dir(best.parent.parent)  # the newest step of the checkpoint folder
    mine = checkpoint.read_metadata(newest) if newest is not None else {}
    run = path if (path / ".hydra").is_dir() else mine.get("run_dir")
    if not saver or not run or Path(saver).absolute() == Path(run).absolute():
        return
    model = checkpoint.read_metadata(best).get("config", {}).get("model")
    if mine and mine.get("config", {}).get("model") == model:
        return
    other = ", with other model settings" if mine else ""
    log.warning(f"the best checkpoint {best} was saved by another run, {saver}{other}; it is read as given")


def _kept_best(folder: Path) -> Optional[Path]:
    """The newest step of ``folder`` when it is a best checkpoint's folder (its metadata has ``best``), else None."""
    from training import checkpoint

    found = checkpoint.best_step_dir(folder)
    return found if found is not None and "best" in checkpoint.read_metadata(found) else None


def _run_summary(path: Path, folder: Path) -> tuple[Optional[Path], dict]:
    """(summary.json, its values) of the run whose best folder ``folder`` is missing, when it records
    ``checkpoint.keep_best`` (``path``: the run or checkpoint folder given), else (None, {})."""
    from training import checkpoint

    places = [path, folder.parent.parent]
    newest = checkpoint.best_step_dir(folder.parent)  # the run folder its newest checkpoint names
    if newest is not None and checkpoint.read_metadata(newest).get("run_dir"):
        places.append(Path(checkpoint.read_metadata(newest)["run_dir"]))
    for summary in (place / "summary.json" for place in places):
        try:
            values = json.loads(summary.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(values, dict) and values.get("checkpoint/best_metric"):
            return summary, values
    return None, {}


def load_test_split(cfg, p, step_dir: Optional[Path] = None):
    """``(host test split, fingerprint of the training data or None)`` named by ``cfg.data`` (synthetic: the same
    split training evaluated on); for ``model=gpt`` the validation windows training evaluated on
    (``training.build.load_text_data``, which needs the run's ``Plan`` ``p``), encoded by the tokenizer saved with
    the checkpoint at ``step_dir`` (``training.checkpoint.tokenizer_beside``; else the one the config names), and
    the text's fingerprint."""
    from data.pipeline import synthetic_eval
    from data.sources import load_tfds_split
    from core.errors import ConfigError

    d = cfg.data
    if cfg.model.name == "gpt":
        from data.load import TEXT_DATA, text_corpus
        from training.build import load_text_data
        from training.checkpoint import tokenizer_beside

        text = None
        if d.name in TEXT_DATA:
            text = text_corpus(d, tokenizer_beside(step_dir) if step_dir is not None else None)
        source, windows = load_text_data(cfg, p, text)
        return windows, source.fingerprint
    if d.name == "synthetic":
        return synthetic_eval(d.image_shape, d.num_classes, d.eval_size, cfg.train.seed), None
    if not d.tfds_name:
        raise ConfigError(f"data={d.name} has no data.tfds_name; set it")
    return load_tfds_split(d.tfds_name, "test", d.data_dir, d.cache_dir, download=d.download), None


def compose_eval_config(saved_cfg: dict, overrides: Sequence[str] = ()):
    """The typed config of an evaluation: the checkpoint's saved config, then ``EVAL_DEFAULTS``, then the user's
    overrides in ``train.py``'s syntax (Hydra's compose API on ``conf/``: group options such as
    ``parallel=pmap`` replace that whole group, dotted keys such as ``mesh.devices=1`` one value).

    The overrides are composed on the checkpoint's model and optimizer (``model=<saved name>``,
    ``optim=<saved name>``) and ``parallel=jit_sharding`` unless they choose others, so ``model.*`` keys are
    checked against the checkpoint's model. Keys of the saved ``model``/``parallel``/``optim`` that their schema
    lacks (checkpoints saved when these nodes held every option's keys) are dropped.

    Raises:
      ConfigError: an override Hydra cannot parse or compose (unknown group option, unknown key, a key the model
        or mode does not have, bad type or choice), or a sweep (``a=1,2``); one line.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from conf.errors import check_keys, is_composition_error, one_line, quote_numeric_options
    from conf.schema import OPTION_SCHEMAS, Config, ConfigInputError, from_dict, register
    from core.errors import ConfigError

    register()
    conf_dir = Path(__file__).resolve().parent / "conf"
    overrides = quote_numeric_options(list(overrides), conf_dir)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        sweeps = [o.input_line for o in parsed if o.is_sweep_override()]
        if sweeps:
            raise ConfigError(f"evaluate takes one value per key, not a sweep: {', '.join(sweeps)}")
        for o in parsed:
            if o.is_delete():
                raise ConfigError(f"{o.input_line}: evaluate cannot delete keys; give a value instead")
        chosen = {o.key_or_group for o in parsed}
        base = []
        for group in ("model", "optim"):  # the checkpoint's model and optimizer
            schemas, default = OPTION_SCHEMAS[group]
            saved = (saved_cfg.get(group) or {}).get("name", default)
            if group not in chosen and saved in schemas:
                base.append(f"{group}={saved}")
        base += [] if "parallel" in chosen else ["parallel=jit_sharding"]
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            composed = compose(config_name="config", overrides=base + list(overrides))
        check_keys(composed, OPTION_SCHEMAS)
        merged = OmegaConf.merge(saved_cfg, OmegaConf.from_dotlist(EVAL_DEFAULTS))
        for key in ["parallel", *(o.key_or_group for o in parsed)]:
            value = OmegaConf.select(composed, key, default=_NOT_A_KEY)
            if value is not _NOT_A_KEY:  # (a group that only sets other keys, e.g. +experiment=..., is not one)
                OmegaConf.update(merged, key, value, merge=False)
        return from_dict(OmegaConf.to_container(merged, enum_to_str=True), lenient=True)
    except ConfigInputError as e:
        raise ConfigError(str(e)) from None
    except Exception as e:
        if not is_composition_error(e):
            raise
        raise ConfigError(one_line(e, Config, OPTION_SCHEMAS)) from None
    finally:
        GlobalHydra.instance().clear()


# Keys that fix what the saved parameters compute (their shapes or the function): an evaluation cannot change
# them. ``model.dropout`` (off in evaluation) and ``model.init_std`` (initialisation only) may differ.
MODEL_KEYS_EXEMPT = ("dropout", "attention_dropout", "init_std")
DATA_SHAPE_KEYS = ("image_shape", "num_classes")


def model_changes(saved_cfg: dict, cfg) -> list[str]:
    """``key: saved -> now`` for every ``model.*`` key (but ``MODEL_KEYS_EXEMPT``), every ``optim.*`` key both
    configs have (the restored state holds the optimizer's state) and ``data.image_shape`` /
    ``data.num_classes`` where the evaluation's typed config ``cfg`` differs from the checkpoint's saved config
    (keys the saved config lacks are not compared); another ``model.name`` (or ``optim.name``) alone when it
    differs."""
    from conf.schema import as_dict

    now = as_dict(cfg)
    saved_model = saved_cfg.get("model", {})
    if "name" in saved_model and saved_model["name"] != now["model"]["name"]:  # another model: its name says it
        return [f"model.name: {saved_model['name']!r} -> {now['model']['name']!r}"]
    saved_optim, now_optim = saved_cfg.get("optim", {}), now.get("optim", {})
    if "name" in saved_optim and saved_optim["name"] != now_optim.get("name"):  # another optimizer state
        return [f"optim.name: {saved_optim['name']!r} -> {now_optim.get('name')!r}"]
    from training.checkpoint.policy import gpt_table_changes

    out, resolved = gpt_table_changes(saved_model, now["model"])  # a GPT's tables, resolved from its preset
    pairs = [("model", k) for k in saved_model if k not in MODEL_KEYS_EXEMPT and f"model.{k}" not in resolved]
    pairs += [("optim", k) for k in saved_optim if k in now_optim]  # the optimizer state's structure
    pairs += [("data", k) for k in DATA_SHAPE_KEYS if k in saved_cfg.get("data", {})]
    for group, key in pairs:
        old, new = saved_cfg[group][key], now.get(group, {}).get(key)
        if old != new:
            out.append(f"{group}.{key}: {old!r} -> {new!r}")
    return out


def _has_metadata(step_dir: Path) -> bool:
    from training import checkpoint

    try:
        checkpoint.read_metadata(step_dir)
        return True
    except (OSError, ValueError):
        return False


def _step_config(step_dir: Path, overrides: Sequence[str]):
    """The typed config to evaluate ``step_dir`` with: its saved config, its null settings as it was trained (an
    older checkpoint: its AdamW decayed every parameter, whose optimizer state has another structure), and
    ``overrides``. Raises ConfigError when an override changes its model."""
    from core.errors import ConfigError
    from training import checkpoint

    saved = checkpoint.read_metadata(step_dir).get("config", {})
    cfg = checkpoint.with_inherited(compose_eval_config(saved, overrides), saved)
    changed = model_changes(saved, cfg)
    if changed:
        raise ConfigError(
            f"checkpoint {step_dir} holds a model trained with other settings ({'; '.join(changed)}); "
            f"evaluate it with its own: leave out these overrides"
        )
    return cfg


def evaluate_checkpoint(path: Path, overrides: Sequence[str] = (), best: bool = False) -> dict:
    """Restores the checkpoint at ``path`` (``best``: the run's best checkpoint, ``find_best_step_dir``; else the
    newest complete step, a damaged newer one, or one whose metadata no longer fits its arrays, named in one warning
    line) onto this process's devices and
    evaluates it on the test split.

    Returns ``{"eval/accuracy", "eval/loss", "step", "examples", "checkpoint"}`` (and ``eval/perplexity`` for a
    GPT, evaluated on the validation windows its training evaluated on). Raises ConfigError/DataError
    (one line) on bad input.
    """
    from training import checkpoint
    from training.runtime import setup_runtime

    if best:
        step_dirs, folder = [find_best_step_dir(path)], None
    else:
        step_dirs, folder = find_steps(path)
    advice = nothing_left(step_dirs, folder, "evaluate")
    # the config: of the newest step whose metadata reads (a damaged newer one is named when the state is read)
    step_dir = next((d for d in step_dirs if _has_metadata(d)), None)
    if step_dir is None:  # every one is damaged: read_newest raises one line naming them
        step_dir = checkpoint.read_newest(step_dirs, checkpoint.read_metadata, "evaluating", advice)[1]
    # simulated CPU devices / XLA flags, before the backend starts; a bad jax.distributed setting: one line
    setup_runtime(_step_config(step_dir, overrides)).raise_error()

    from data.pipeline import make_eval_set
    from measure.memory import check_eval_fits
    from training.build import build, gpt_dims, plan
    from training.hooks import evaluate

    built: dict = {}  # each step is built from its own config; steps of one config share one build

    def restore(step_dir: Path):
        cfg = _step_config(step_dir, overrides)
        key = json.dumps(checkpoint.read_metadata(step_dir).get("config", {}), sort_keys=True, default=str)
        if key not in built:
            p = plan(cfg)
            built[key] = (cfg, p, build(p))
        cfg, p, exp = built[key]
        return checkpoint.restore_step(step_dir, exp.mode, exp.state), cfg, p, exp

    # the newest step that restores: a damaged one (a missing or truncated file, or metadata that no longer fits
    # its arrays) is named in one warning line
    (restored, cfg, p, exp), step_dir = checkpoint.read_newest(
        step_dirs, restore, "evaluating", advice, misfit_damaged=True
    )
    test, fingerprint = load_test_split(cfg, p, step_dir)
    change = checkpoint.data_change(checkpoint.read_metadata(step_dir).get("data_fingerprint"), fingerprint)
    if change:  # a text file edited since: its validation split is not the one the run evaluated on
        log.warning(f"evaluating {step_dir} on other data than it was trained on ({change})")
    eval_set = make_eval_set(test, cfg.train.eval_batch, exp.mode.num_devices, exp.mode.batch_layout())
    dims = gpt_dims(cfg) if exp.local.tokens else None  # one line when its batch cannot fit (train.eval_batch=N)
    exp.steps.eval = check_eval_fits(exp.steps.eval, restored.state.params, eval_set, dims)
    text = cfg.model.name == "gpt" and cfg.data.name in ("tiny_shakespeare", "text")
    metrics = evaluate(exp, restored.state.params, eval_set, getattr(test, "bytes_per_token", None) if text else None)
    return {**metrics, "step": restored.step, "examples": eval_set.num_examples, "checkpoint": str(step_dir)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a run folder, its checkpoint folder or one <step> folder in it")
    parser.add_argument(
        "overrides", nargs="*", help="config overrides as for train.py, e.g. mesh.devices=1 parallel=pmap"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a line")
    parser.add_argument(
        "--best", action="store_true", help="the best checkpoint (checkpoint.keep_best) instead of the newest"
    )
    args = parser.parse_intermixed_args(argv)  # --json before, between or after the overrides
    from training.console import tool_logging

    tool_logging()  # as train.py: the TPU probe, TFDS's OpenCV notice and its look for unprepared data quieted

    from core.errors import USER_ERRORS
    from measure.memory import checkpoint_evaluation, is_out_of_memory, out_of_memory_line

    with checkpoint_evaluation():  # out-of-memory lines offer what evaluating a checkpoint can change
        try:
            result = evaluate_checkpoint(Path(args.checkpoint), args.overrides, best=args.best)
        except (*USER_ERRORS, MemoryError, RuntimeError, SystemError) as e:  # (XLA's errors are RuntimeErrors)
            if not isinstance(e, USER_ERRORS) and not is_out_of_memory(e):
                raise
            line = str(e) if isinstance(e, USER_ERRORS) else out_of_memory_line(e)
            print(f"error: {line.splitlines()[0]}", file=sys.stderr, flush=True)
            return 1
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        perplexity = f" eval/perplexity={result['eval/perplexity']:.2f}" if "eval/perplexity" in result else ""
        perplexity += f" eval/bpb={result['eval/bpb']:.4f}" if "eval/bpb" in result else ""
        print(
            f"eval/accuracy={result['eval/accuracy']:.4f} eval/loss={result['eval/loss']:.4f}{perplexity} "
            f"step={result['step']} examples={result['examples']} checkpoint={result['checkpoint']}"
        )
    return 0


if __name__ == "__main__":
    from measure.address_space import limit_malloc_arenas
    from training import process

    limit_malloc_arenas()  # under ulimit -v, before JAX's threads start
    process.run_tool(main)
