"""Checks of the settings this repository hands to libraries (W&B, orbax, TFDS, XLA), done at start.

A library validates its own settings late (``wandb.init`` after the step compiled, XLA when its backend starts,
orbax at the first checkpoint); ``check_library_settings`` (called by ``training.build.plan``) applies their rules
before any data is read, raising ``ConfigError`` with one line naming the key, the value and the fix:
- W&B (``wandb_settings.py`` and its server): tags 1-64 characters; project 1-128 characters without any of
  ``/ \\ # ? % :``; group at most 128; entity without ``/`` or spaces.
- XLA: every flag ``--name`` or ``--name=value``, known to XLA (one probe in a subprocess: XLA's parser is the
  only complete list).
- TFDS: ``data.tfds_name`` is ``name[/config][:version]`` of a builder TFDS knows (not checked for synthetic or text
  data, which never read it: TFDS need not be installed for them).
- Paths: ``[ ] * ?`` are refused in checkpoint and data folders: orbax's OCDBT merge finds a checkpoint's files
  with a glob, so there they would leave a step folder reported saved but unreadable."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from core.errors import ConfigError

GLOB_CHARS = "[]*?"
WANDB_TAG_MAX_CHARS = 64
WANDB_NAME_MAX_CHARS = 128
WANDB_PROJECT_BAD_CHARS = "/\\#?%:"
XLA_FLAG = re.compile(r"--[A-Za-z0-9_]+(=.*)?")
TFDS_NAME = re.compile(r"[a-z0-9_]+(/[A-Za-z0-9_.\-]+)?(:[0-9]+\.[0-9]+\.[0-9]+)?")
# data sets read without TFDS (generated, or text: ``data.load.TEXT_DATA``): their ``data.tfds_name`` is never used
NO_TFDS_DATA = ("synthetic", "tiny_shakespeare", "text")


def check_wandb(wandb_cfg, extra_tags: Sequence[str] = ()) -> None:
    """W&B ``tags`` (plus the tags the run adds, ``extra_tags``), ``project``, ``group``, ``entity`` and, when the
    schema has them, ``name`` and ``notes``. Raises ConfigError (one line)."""
    for i, tag in enumerate(list(wandb_cfg.tags) + list(extra_tags)):
        tag = str(tag)
        if not 1 <= len(tag) <= WANDB_TAG_MAX_CHARS:
            key = f"wandb.tags[{i}]" if i < len(wandb_cfg.tags) else "a tag this run adds"
            shown = tag if len(tag) <= 24 else tag[:20] + "..."
            fix = "shorten it" if tag else "remove it or write one"
            raise ConfigError(
                f"{key}={shown!r} is {len(tag)} characters; W&B tags must have 1 to "
                f"{WANDB_TAG_MAX_CHARS} characters: {fix}"
            )
    project = wandb_cfg.project
    if not project or len(project) > WANDB_NAME_MAX_CHARS or any(c in project for c in WANDB_PROJECT_BAD_CHARS):
        raise ConfigError(
            f"wandb.project={project!r} must have 1 to {WANDB_NAME_MAX_CHARS} characters and none "
            f"of {' '.join(WANDB_PROJECT_BAD_CHARS)}"
        )
    for key in ("group", "name"):
        value = getattr(wandb_cfg, key, None)
        if value is not None and not 1 <= len(str(value)) <= WANDB_NAME_MAX_CHARS:
            raise ConfigError(
                f"wandb.{key}={str(value)[:24]!r}... has {len(str(value))} characters; W&B allows "
                f"1 to {WANDB_NAME_MAX_CHARS} (or null)"
            )
    notes = getattr(wandb_cfg, "notes", None)
    if notes is not None and not isinstance(notes, str):
        raise ConfigError(f"wandb.notes={notes!r} must be a string (or null)")
    entity = wandb_cfg.entity
    if entity is not None and (not entity or any(c in entity for c in "/ ")):
        raise ConfigError(f"wandb.entity={entity!r} must be a W&B user or team name (no '/' or spaces), or null")


def xla_flags_error(flags: Sequence[str]) -> Optional[str]:
    """One-line error for malformed or unknown XLA flags, else None. Cached per flag list (one probe)."""
    return _xla_flags_error(tuple(flags))


@functools.lru_cache(maxsize=8)
def _xla_flags_error(flags: tuple) -> Optional[str]:
    if not flags:
        return None
    bad = [f for f in flags if not XLA_FLAG.fullmatch(str(f))]
    if bad:
        return f"xla.flags {bad} are not of the form --name or --name=value"
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    try:
        probe = subprocess.run(
            [sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired):
        return None  # the probe could not run: XLA itself reports bad flags when the backend starts
    unknown = re.findall(r"Unknown flags? in XLA_FLAGS: (.*)", probe.stderr)
    if unknown:
        return f"xla.flags: XLA does not know {unknown[0].strip()}; fix or remove it (see xla/debug_options_flags.cc)"
    return None


def check_tfds_name(tfds_name: str, data_dir: Optional[str] = None) -> None:
    """``data.tfds_name`` must name a TFDS builder. Raises ConfigError (one line, with close names).

    A copy already prepared under ``data_dir`` (``data.data_dir``, else ``TFDS_DATA_DIR``) is a known builder:
    then TFDS (slow to import) is not imported for the check."""
    if not TFDS_NAME.fullmatch(tfds_name):
        raise ConfigError(f"data.tfds_name={tfds_name!r} is not a TFDS name (name[/config][:x.y.z], e.g. mnist)")
    name = tfds_name.split(":")[0].split("/")[0]
    from data.sources import prepared_version, resolve_data_dir

    if prepared_version(name, resolve_data_dir(data_dir)) is not None:
        return
    import difflib

    import tensorflow_datasets as tfds

    known = tfds.list_builders(with_community_datasets=False)
    if name not in known:
        close = difflib.get_close_matches(name, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"data.tfds_name={tfds_name!r}: TFDS has no dataset {name!r}{hint}")


def check_path(key: str, path) -> None:
    """Refuses glob characters in a path handed to orbax/TFDS (see the module docstring). Raises ConfigError."""
    if path is None:
        return
    found = sorted({c for c in str(path) if c in GLOB_CHARS})
    if found:
        raise ConfigError(
            f"{key}={str(path)!r} contains {' '.join(found)}: orbax and TFDS read these folders "
            f"with glob patterns, where they are wildcards; choose a path without {' '.join(found)}"
        )


def check_library_settings(cfg, extra_tags: Sequence[str] = ()) -> None:
    """Every check of this module on a typed ``conf.schema.Config``. Raises ConfigError (one line)."""
    check_wandb(cfg.wandb, extra_tags)
    error = xla_flags_error(cfg.xla.flags)
    if error:
        raise ConfigError(error)
    check_path("checkpoint.dir", cfg.checkpoint.dir)
    if cfg.checkpoint.resume not in ("auto", "never"):
        check_path("checkpoint.resume", cfg.checkpoint.resume)
    check_path("data.data_dir", cfg.data.data_dir)
    if not cfg.data.data_dir:
        check_path("TFDS_DATA_DIR", os.environ.get("TFDS_DATA_DIR"))
    if cfg.data.name not in NO_TFDS_DATA and cfg.data.tfds_name:
        check_tfds_name(cfg.data.tfds_name, cfg.data.data_dir)


def check_writable_folder(key: str, path) -> None:
    """``path`` can be created (or is) a folder this process can write into. Raises ConfigError (one line).

    The nearest existing folder of ``path`` is probed by creating and removing an empty temporary folder in
    it (permission bits alone do not tell: root ignores them, and /proc or a read-only mount refuse anyway),
    so nothing is left behind; orbax would otherwise fail at the first save, after training, with a traceback.
    """
    path = Path(path).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        where = "is a file" if existing == path else f"is inside {existing}, which is a file"
        raise ConfigError(f"{key}={path} {where}; give a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-probe-", dir=existing))
    except OSError as e:
        from training.checkpoint.store import complete_steps  # jax: imported only on this error path

        try:
            holds_steps = existing == path and bool(complete_steps(path))
        except OSError:  # not even readable
            holds_steps = False
        fix = (
            "it holds checkpoints to continue from: make it writable again and run the same command (or choose "
            "another folder to start over)"
            if holds_steps
            else "choose a folder you can write to"
        )
        raise ConfigError(
            f"{key}={path} cannot be written ({e.strerror or type(e).__name__} in {existing}); {fix}"
        ) from None


def check_run_folder(run_dir: Path, checkpoint_cfg) -> None:
    """The run folder holds the checkpoints when ``checkpoint.dir`` is null: no glob characters then. The
    checkpoint folder (``checkpoint.dir``, else the run folder's ``checkpoints/``) must be writable
    (``check_writable_folder``). Raises ConfigError (one line)."""
    if checkpoint_cfg.enabled and not checkpoint_cfg.dir:
        check_path("the run folder (hydra.run.dir / hydra.sweep.dir)", Path(run_dir) / "checkpoints")
    if checkpoint_cfg.enabled:
        key = "checkpoint.dir" if checkpoint_cfg.dir else "the run folder (hydra.run.dir / hydra.sweep.dir)"
        check_writable_folder(key, checkpoint_cfg.dir or Path(run_dir) / "checkpoints")
