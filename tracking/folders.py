"""Which kind of output folder a path is, so that a tool given the wrong kind says which kind it got and what to
pass: a sweep folder (``hydra.sweep.dir``: ``multirun.yaml`` and one folder per job), a run folder
(``hydra.run.dir`` or one job of a sweep: ``.hydra/``, ``summary.json``, ``checkpoints/``), a checkpoint folder
(``<step>`` folders) or one step folder (``state/`` and ``meta/``). Only paths and small YAML files are read."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

SWEEP, RUN, CHECKPOINTS, STEP = "a sweep folder", "a run folder", "a checkpoint folder", "a step folder"
RUNS = "a folder of runs"  # run folders below it but no multirun.yaml: e.g. outputs/, or multirun/ of many sweeps


def is_step_folder(path: Path) -> bool:
    """One finished checkpoint step: a name of digits holding ``state/`` and ``meta/`` (``checkpoint.store``)."""
    path = Path(path)
    return path.name.isdigit() and (path / "state").is_dir() and (path / "meta").is_dir()


def is_run_folder(path: Path) -> bool:
    """A run folder: it holds Hydra's ``.hydra/`` or a run's ``summary.json``."""
    return (Path(path) / ".hydra").is_dir() or (Path(path) / "summary.json").is_file()


def _natural(path: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def job_folders(sweep_dir: Path) -> list[Path]:
    """The job folders below ``sweep_dir`` (each holds Hydra's ``.hydra/``), in natural order (2 before 10)."""
    return sorted((p.parent for p in Path(sweep_dir).glob("**/.hydra") if p.parent != Path(sweep_dir)), key=_natural)


def folder_kind(path: Path) -> Optional[str]:
    """``STEP``, ``RUN``, ``SWEEP``, ``RUNS`` or ``CHECKPOINTS`` for the folder at ``path`` (tried in this order),
    else None (no folder, or none of these)."""
    path = Path(path)
    if not path.is_dir():
        return None
    if is_step_folder(path):
        return STEP
    if is_run_folder(path):
        return RUN
    if (path / "multirun.yaml").is_file():
        return SWEEP
    if any(p.parent != path for p in path.glob("**/.hydra")):
        return RUNS
    if any(is_step_folder(p) for p in path.iterdir()):
        return CHECKPOINTS
    return None


def jobs_in_words(sweep_dir: Path, limit: int = 3, noun: str = "job") -> str:
    """``jobs 0, 1, 2 ... (8 in all)`` of a sweep folder (``noun``: ``run`` for a folder of runs), relative to it
    (``no job folder yet`` when none)."""
    jobs = [str(p.relative_to(sweep_dir)) for p in job_folders(sweep_dir)]
    if not jobs:
        return f"no {noun} folder yet"
    more = f" ... ({len(jobs)} in all)" if len(jobs) > limit else ""
    return f"{noun}{'s' if len(jobs) > 1 else ''} {', '.join(jobs[:limit])}{more}"


def many_runs(path: Path) -> Optional[str]:
    """``a sweep folder (jobs 0, 1)`` / ``a folder of runs (runs a, b)`` when ``path`` holds several runs, for a
    tool that takes one; else None."""
    kind = folder_kind(path)
    if kind not in (SWEEP, RUNS):
        return None
    return f"{kind} ({jobs_in_words(path, noun='job' if kind == SWEEP else 'run')})"


def first_job(sweep_dir: Path) -> str:
    """The first job folder of a sweep folder, or ``<sweep folder>/<job>`` when it has none yet."""
    jobs = job_folders(sweep_dir)
    return str(jobs[0]) if jobs else f"{sweep_dir}/<job>"


def enclosing_sweep(path: Path, levels: int = 4) -> Optional[Path]:
    """The sweep folder (``multirun.yaml``) that holds ``path`` (a job folder, its checkpoints or a step), looking
    at most ``levels`` folders up; None outside a sweep."""
    for parent in list(Path(path).absolute().parents)[:levels]:
        if (parent / "multirun.yaml").is_file():
            return parent
    return None


def run_checkpoint_dir(run_dir: Path) -> Optional[Path]:
    """The checkpoint folder of a run folder (the one a run prints as "outputs in"): its ``checkpoint.dir``
    from ``.hydra/config.yaml`` when set (a relative one taken from the folder the run was started in, Hydra's
    ``hydra.runtime.cwd`` in ``.hydra/hydra.yaml``, as the run itself took it), else ``<run folder>/checkpoints``;
    None when ``run_dir`` is not a run folder (neither ``.hydra/`` nor ``checkpoints/`` in it)."""
    run_dir = Path(run_dir)
    if (run_dir / "checkpoints").is_dir():
        return run_dir / "checkpoints"
    config = run_dir / ".hydra" / "config.yaml"
    if not config.is_file():
        return None
    from omegaconf import OmegaConf

    try:
        saved = OmegaConf.to_container(OmegaConf.load(config), resolve=False)
        folder = ((saved or {}).get("checkpoint") or {}).get("dir")  # type: ignore[union-attr]
    except Exception:  # an unreadable config: the default location (the caller names what it finds there)
        folder = None
    if not folder:
        return run_dir / "checkpoints"
    path = Path(str(folder)).expanduser()
    if path.is_absolute():
        return path
    try:
        hydra_cfg = OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "hydra.yaml"), resolve=False)
        started_in = Path(str(((hydra_cfg or {}).get("hydra") or {})["runtime"]["cwd"]))  # type: ignore[union-attr]
    except Exception:  # no readable hydra.yaml: the current folder
        return path.absolute()
    return started_in / path


def why_no_checkpoint(run_dir: Path) -> str:
    """What a run folder's own files say about why it has no checkpoint: ``checkpoint.enabled=false`` in its
    ``.hydra/config.yaml``, else its ``summary.json`` status and error, else that it has no summary (still
    running, or stopped before writing one)."""
    from omegaconf import OmegaConf

    try:
        saved = OmegaConf.to_container(OmegaConf.load(Path(run_dir) / ".hydra" / "config.yaml"), resolve=False)
        if ((saved or {}).get("checkpoint") or {}).get("enabled") is False:  # type: ignore[union-attr]
            return "it ran with checkpoint.enabled=false"
    except Exception:  # no readable config: the summary says the rest
        pass
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    except FileNotFoundError:
        return "it has no summary.json: it is still running, or stopped before its first save"
    except (OSError, ValueError) as e:
        return f"its summary.json cannot be read ({type(e).__name__})"
    error = f": {summary['error']}" if summary.get("error") else ""
    return f"its summary.json says status {summary.get('status')}{error}"


def _saved_by(checkpoints: Path) -> str:
    """``run <folder>``: the run folder holding checkpoint folder ``checkpoints``, else the run folder its newest step
    names (``meta/metadata`` ``run_dir``); ``another run`` when neither says."""
    if folder_kind(checkpoints.parent) == RUN:
        return f"run {checkpoints.parent}"
    steps = sorted((p for p in checkpoints.iterdir() if is_step_folder(p)), key=lambda p: int(p.name))
    try:
        return f"run {json.loads((steps[-1] / 'meta' / 'metadata').read_text())['run_dir']}"
    except (IndexError, OSError, ValueError, KeyError, TypeError):
        return "another run"


def not_a_checkpoint_dir(path: Path, run_dir: Path, quote=lambda key, value: f"{key}={value}") -> Optional[str]:
    """Why ``checkpoint.dir=path`` would write steps among what is not this run's (``run_dir``) checkpoints, in one
    line with the fix (``quote(key, value)`` writes an override): a sweep's folder (its jobs are named like steps),
    or a folder inside another run's folder that is not its checkpoint folder (the run folder, its ``.hydra/``, a
    step, its ``best/``); None when it may be used (another run's checkpoint folder continues that run)."""
    path, run_dir = Path(path).absolute(), Path(run_dir).absolute()
    key, own = quote("checkpoint.dir", path), "or a folder of its own"
    if (path / "multirun.yaml").is_file() and (several := many_runs(path)):
        theirs = quote("checkpoint.dir", f"{first_job(path)}/checkpoints")
        why = f"{key} is {several}, not a checkpoint folder"
        return f"{why}; to continue a job give its checkpoint folder, e.g. {theirs}, {own}"
    owner = next((p for p in [path, *path.parents][:5] if is_run_folder(p)), None)
    if owner is None or run_dir in (path, *path.parents):
        return None
    theirs = run_checkpoint_dir(owner) or owner / "checkpoints"
    try:  # the folder its summary names (a run without Hydra's .hydra/ saves where it was told)
        recorded = json.loads((owner / "summary.json").read_text()).get("checkpoint/dir") or theirs
    except (OSError, ValueError, AttributeError):
        recorded = theirs
    if path in (Path(theirs).absolute(), Path(recorded).absolute()):
        return None
    what = (
        "the folder of another run (summary.json or .hydra/), not a checkpoint folder"
        if owner == path
        else f"inside the folder of another run, {owner}, and not its checkpoint folder"
    )
    return f"{key} is {what}; give its checkpoint folder, {quote('checkpoint.dir', recorded)}, to continue it, {own}"


def not_own_folder(path: Path, key: str) -> Optional[str]:
    """Why ``key=path`` (``hydra.run.dir``, or ``hydra.sweep.dir`` of a ``-m`` sweep) is a folder that belongs to
    something else, in one line with the fix: a run's checkpoint folder or one step of it, a sweep's folder for a
    single run, a single run's folder for a sweep, or a folder inside a run's folder, its ``.hydra/``, checkpoint
    folder or step (a resume would take a folder named like a step for a damaged one); None when it may be used (new,
    empty, its own kind, inside a plain folder or a sweep's)."""
    path = Path(path)
    kind = folder_kind(path)
    whose = "sweep" if key.startswith("hydra.sweep") else "run"
    own = f"give the {whose} a folder of its own"
    if kind == CHECKPOINTS:
        steps = sorted(int(p.name) for p in path.iterdir() if is_step_folder(p))
        return f"{key}={path} is the checkpoint folder of {_saved_by(path)} (it holds checkpoint steps " + (
            f"{', '.join(map(str, steps[-3:]))}); {own}"
        )
    if kind == STEP:
        return f"{key}={path} is checkpoint step {path.name} of {_saved_by(path.parent)} (state/, meta/); {own}"
    if kind == SWEEP and whose == "run":
        return (
            f"{key}={path} is a sweep's folder (multirun.yaml, {jobs_in_words(path)}); {own}, or resume the sweep "
            f"with -m and hydra.sweep.dir={path}"
        )
    if kind == RUN and whose == "sweep" and not (path / "multirun.yaml").is_file():
        marks = [name for name in ("summary.json", ".hydra/") if (path / name.rstrip("/")).exists()]
        return f"{key}={path} is one run's folder ({', '.join(marks)}); {own}"
    here = path.absolute()
    for inside in [here, *here.parents][:5]:  # what holds it: Hydra's files or checkpoints of a run
        if inside.name == ".hydra":
            where = f"inside {inside}, " if inside != here else ""
            return f"{key}={path} is {where}Hydra's folder of run {inside.parent}; {own}"
        if inside == here:
            continue
        if is_step_folder(inside):
            return f"{key}={path} is inside checkpoint step {inside.name} of {_saved_by(inside.parent)}; {own}"
        if (inside.name == "checkpoints" and is_run_folder(inside.parent)) or (
            inside.is_dir() and any(is_step_folder(p) for p in inside.iterdir())
        ):
            return f"{key}={path} is inside the checkpoint folder of {_saved_by(inside)}; {own}"
        if is_run_folder(inside) and not (inside / "multirun.yaml").is_file():  # (a sweep's jobs are its own)
            said = next((p for p in path.parents if p.absolute() == inside), inside)  # as the user gave it
            return f"{key}={path} is inside the folder of run {said}; {own}"
    return None
