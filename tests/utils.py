"""Helpers shared by the tests: typed configs, in-process experiments and train.py subprocesses."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from omegaconf import OmegaConf

from conf.schema import Config, from_dict
from data.pipeline import TrainSource
from data.sources import HostDataset
from parallel import compress
from parallel.state import metrics_to_host, replica_divergence, state_to_host
from training.build import build, plan

REPO = Path(__file__).resolve().parent.parent
SHARED_TFDS = REPO.parent / "shared" / "tensorflow_datasets"


def make_cfg(overrides: dict | None = None, **dotted: Any) -> Config:
    """A typed Config from the schema defaults plus ``overrides`` (nested dict) and ``a__b=value`` kwargs
    (``model``/``parallel`` take the schema of their ``name``: conf.schema.from_dict)."""
    extra = OmegaConf.from_dotlist([f"{k.replace('__', '.')}={v}" for k, v in dotted.items()])
    return from_dict(OmegaConf.to_container(OmegaConf.merge(overrides or {}, extra)))


def random_dataset(n: int = 2048, seed: int = 0, shape=(28, 28, 1), classes: int = 10) -> HostDataset:
    """Random images whose labels are a fixed linear function of the pixels (learnable, so losses fall)."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
    proj = rng.normal(size=(int(np.prod(shape)), classes))
    labels = np.argmax((images.reshape(n, -1) / 255.0 - 0.5) @ proj, axis=1).astype(np.int32)
    return HostDataset(images, labels)


def run_steps(cfg: Config, dataset: HostDataset, steps: int):
    """Trains ``steps`` steps in-process.

    Returns (losses float64 [steps], host state, experiment, initial host state)."""
    p = plan(cfg)
    exp = build(p)
    initial = state_to_host(exp.state)
    source = TrainSource(dataset, p.global_batch, cfg.train.seed)
    layout = exp.mode.batch_layout()
    rows = layout.local_rows(p.global_batch)
    state, losses = exp.state, []
    for s in range(steps):
        state, m = exp.steps.train(state, layout.place(source.local_batch(s, rows), p.global_batch))
        losses.append(float(metrics_to_host(m)["train/loss"]))
        jax.block_until_ready(m)
    exp.state = state
    return np.asarray(losses), state_to_host(state), exp, initial


def mode_grads(mode, local, params, batch, step, scale):
    """``(global-mean gradients x loss scale, metric sums)`` of ``mode``'s gradient computation inside its step,
    for a mode without mode-owned state (to inspect the gradients alone)."""
    return mode._gradients(local, params, batch, step, scale)[:2]


def max_abs_diff(a, b) -> float:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    # (an empty tree, e.g. the optimizer state of constant-rate SGD, differs by 0)
    return max(
        (
            float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)), initial=0.0))
            for x, y in zip(la, lb)
        ),
        default=0.0,
    )


def run_train(
    run_dir: Path, *overrides: str, env: dict | None = None, timeout: int = 600, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """``python train.py <overrides>`` with its run folder at ``run_dir`` and offline W&B inside it."""
    e = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    e.pop("WANDB_API_KEY", None)
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        e[var] = str(run_dir.parent / ".wandb_aux")
    if SHARED_TFDS.exists():
        e.setdefault("TFDS_DATA_DIR", str(SHARED_TFDS))
    e.update(env or {})
    cmd = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", *overrides]
    return subprocess.run(cmd, cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)


def save_steps(directory: Path, cfg: Config, steps: dict[int, float]) -> None:
    """Checkpoints of ``cfg``'s initial state in ``directory``, one per ``{step: factor}``, the parameters multiplied
    by ``factor`` (so that every step evaluates differently); their metadata holds ``cfg`` as a run saves it (its
    null inherited settings resolved as a new run's, ``checkpoint.with_inherited``)."""
    from conf.schema import as_dict
    from training import checkpoint

    cfg = checkpoint.with_inherited(cfg, None)
    exp = build(plan(cfg))
    saver = checkpoint.Saver(directory, keep=len(steps))
    for step, factor in steps.items():
        state = exp.state.replace(
            step=jax.device_put(np.int32(step), exp.state.step.sharding),
            params=jax.tree.map(lambda x: x * factor, exp.state.params),
        )
        saver.save(state, step, {"step": step, "config": as_dict(cfg)}, exp.mode)
    saver.close()


def damage_step(step_dir: Path) -> Path:
    """Truncates the largest array file of a checkpoint step folder to half its size (a write cut short, as by a
    full disk or a killed copy); returns that file."""
    files = [f for f in (Path(step_dir) / "state").rglob("*") if f.is_file() and f.parent.name == "d"]
    largest = max(files, key=lambda f: f.stat().st_size)
    os.truncate(largest, largest.stat().st_size // 2)
    return largest


def train_probe_cmd(before: str, after: str, *overrides: str) -> list[str]:
    """``python -c <probe> <overrides>``: runs the code ``before``, then train.py as ``__main__`` with
    ``overrides``, then the code ``after`` (also when train.py exits), and exits with train.py's exit code. Run it in
    the repository."""
    probe = (
        f"{before}\n"
        "import runpy, sys\n"
        "sys.path.insert(0, '.')\n"
        "sys.argv = ['train.py'] + sys.argv[1:]\n"
        "code = 0\n"
        "try:\n"
        "    runpy.run_path('train.py', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    code = e.code\n"
        "finally:\n" + "".join(f"    {line}\n" for line in (after or "pass").splitlines()) + "raise SystemExit(code)\n"
    )
    return [sys.executable, "-c", probe, *overrides]


def modules_probe_cmd(modules_path: Path, *overrides: str) -> list[str]:
    """``train_probe_cmd`` that, at the process's exit, writes the sorted names in ``sys.modules`` as JSON to
    ``modules_path`` (which libraries a run imported)."""
    before = (
        "import atexit, json, sys\n"
        f"atexit.register(lambda: json.dump(sorted(sys.modules), open({str(modules_path)!r}, 'w')))"
    )
    return train_probe_cmd(before, "", *overrides)


def assert_matches_reference(run, ref, tol: float, devices: int, steps: int) -> None:
    """``run`` and ``ref`` are ``run_steps`` results (losses, host state, experiment, initial host state): the
    same initial parameters bitwise, losses, parameters and optimizer state within ``tol``, bitwise-identical
    replicas, ``steps`` optimizer steps on ``devices`` devices."""
    losses, state, exp, init = run
    ref_losses, ref_state, _, ref_init = ref
    assert max_abs_diff(init.params, ref_init.params) == 0.0  # identical initial parameters, bitwise
    assert exp.mode.num_devices == devices
    assert np.max(np.abs(losses - ref_losses)) <= tol
    assert max_abs_diff(state.params, ref_state.params) <= tol
    assert max_abs_diff(state.opt_state, ref_state.opt_state) <= tol
    assert replica_divergence((exp.state.params, exp.state.opt_state)) == 0.0  # replicas in sync
    assert int(state.step) == steps


def quantisation_scales(tree: Any, axis_name: Any, residual: Optional[dict] = None) -> jax.Array:
    """float32 ``[num_leaves]``: the scales ``int8_mean`` would use for these inputs (test-only: checks the
    quantisation)."""
    leaves = jax.tree.leaves(tree)
    n = compress._axis_size(axis_name)
    lay = compress.FlatLayout(sizes=tuple(int(math.prod(x.shape)) for x in leaves), num_devices=n)
    flat = jnp.pad(jnp.concatenate([x.reshape(-1).astype(jnp.float32) for x in leaves]), (0, lay.padded - lay.total))
    if residual is not None:
        flat = flat + residual["worker"]
    amax = jax.lax.pmax(
        jnp.stack([jnp.max(jnp.abs(flat[o : o + s])) for o, s in zip(lay.offsets, lay.sizes)]), axis_name
    )
    return jnp.where(amax > 0, amax / compress.QMAX, 1.0)


def full_hlo_parse(text: str, **kw) -> list:
    """``measure.hlo_text.parse_hlo_collectives(text, **kw)`` with every instruction parsed (its pre-filter
    ``_may_matter`` off): the reference the pre-filtered parse must equal."""
    from unittest import mock

    import measure.hlo_text as hlo

    split = hlo._split_hlo
    with mock.patch.object(hlo, "_split_hlo", lambda t: split(t, keep=lambda stmt: True)):
        return hlo.parse_hlo_collectives(text, **kw)


def fake_sweep(folder: Path, jobs: int = 2, step: int = 4) -> Path:
    """A sweep folder's layout without training (for tools given the wrong kind of folder): ``multirun.yaml`` and
    job folders ``0 .. jobs-1``, each with ``.hydra/``, an ok ``summary.json`` and ``checkpoints/<step>/{state,meta}``
    (its metadata only).
    Returns ``folder``."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "multirun.yaml").write_text("hydra: {}\n")
    for num in range(jobs):
        job = folder / str(num)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "config.yaml").write_text("checkpoint:\n  dir: null\n")
        (job / ".hydra" / "overrides.yaml").write_text(f"- train.seed={num}\n")
        (job / "summary.json").write_text(json.dumps({"status": "ok"}))
        for part in ("state", "meta"):
            (job / "checkpoints" / str(step) / part).mkdir(parents=True)
        (job / "checkpoints" / str(step) / "meta" / "metadata").write_text(json.dumps({"step": step, "config": {}}))
    return folder
