"""``python train.py ...`` with a breakdown of where its wall time goes (for ``benchmarks/startup.py``).

Runs ``train.py`` as ``__main__`` with the given arguments and, without changing what it does, times:

- every import, by top-level package (exclusive time: a package's own modules, not the packages they import);
- a set of functions of the repository (data load, build, compile, W&B init/finish, checkpoint save/wait,
  evaluation, logging windows, ...), each as exclusive time (an import or a timed function inside another
  is counted once, in the innermost);
- XLA compilation of every program (JAX's ``/jax/core/compile/backend_compile_duration`` events; this
  overlaps the regions above, so it is reported beside them).

Functions are wrapped when their module is first imported (an import hook), so the repository's own
``from module import name`` bindings see the wrapped ones; a target that no longer exists is skipped and
listed under ``missing``. At exit the seconds are written as JSON to ``$TIMED_TRAIN_OUT``:
``{"t0_epoch_s": ..., "end_epoch_s": ..., "regions_s": {...}, "background_regions_s": {...}, "xla_compile_s": ...,
"missing": [...]}`` (``regions_s``: the main thread; ``background_regions_s``: other threads, such as orbax's background
import, inclusive, overlapping the main thread's time).

    TIMED_TRAIN_OUT=t.json python benchmarks/timed_train.py runtime.cpu_devices=1 hydra.run.dir=/tmp/x
"""

from __future__ import annotations

import collections
import functools
import importlib.abc
import importlib.util
import json
import os
import runpy
import sys
import threading
import time

T0_EPOCH_S = time.time()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (module, "attribute" or "Class.method", label). Targets that move are skipped (listed as missing).
TARGETS = [
    ("conf.schema", "to_typed", "config (typed, checked)"),
    ("training.runtime", "setup_runtime", "runtime setup (devices, distributed, cache)"),
    ("training.build", "plan", "plan (config checks)"),
    ("training.build", "build", "build (model, optimizer, placed state)"),
    ("data.sources", "load_tfds_split", "data load"),
    ("data.pipeline", "make_eval_set", "eval set placement"),
    ("jax.stages", "Lowered.compile", "compile (train step, AOT)"),
    ("jax.stages", "Traced.lower", "lower (train step, AOT)"),
    ("training.report", "Reporter.start_wandb", "W&B init"),
    ("training.report", "Reporter.close", "W&B finish + files closed"),
    ("training.report", "Reporter.log", "metrics written (jsonl + W&B)"),
    ("training.report", "Reporter.summary", "summary written"),
    ("training.checkpoint.plan", "prepare", "checkpoint prepare/resume"),
    ("training.prepare", "restore", "checkpoint prepare/resume"),
    ("training.checkpoint.run_checkpoints", "RunCheckpoints.__init__", "checkpoint manager start"),
    ("training.checkpoint.run_checkpoints", "RunCheckpoints.save", "checkpoint saves (blocking part)"),
    ("training.checkpoint.run_checkpoints", "RunCheckpoints.close", "checkpoint wait + close (end)"),
    ("training.run", "evaluate", "evaluation"),
    ("training.hooks", "flush_window", "logging windows (device->host)"),
    ("parallel.base", "ParallelMode.replica_divergence", "replica sync checks"),
    ("measure.compiled", "compiled_step_metrics", "compiled-step metrics (HLO walk)"),
    ("training.prepare", "compile_step", "compile (train step, AOT)"),
    ("training.loop", "train_loop", "training loop"),
    ("training.run", "run", "the rest of run()"),
    ("training.app", "run_and_report", "run_and_report (rest)"),
]


class Clock:
    """Exclusive time per label on the main thread: entering a region pauses the one it is nested in. Regions
    entered on other threads (orbax's background import) are timed apart, inclusive, in ``background``
    (they overlap the main thread's regions)."""

    def __init__(self):
        self.totals = collections.defaultdict(float)
        self.background = collections.defaultdict(float)
        self.stack: list[list] = []  # [label, start]
        self.other = threading.local()  # per background thread: [[label, start], ...]

    def enter(self, label: str) -> None:
        now = time.perf_counter()
        if threading.current_thread() is not threading.main_thread():
            stack = self.other.__dict__.setdefault("stack", [])
            stack.append([label, now])
            return
        if self.stack:
            top = self.stack[-1]
            self.totals[top[0]] += now - top[1]
        self.stack.append([label, now])

    def exit(self) -> None:
        now = time.perf_counter()
        if threading.current_thread() is not threading.main_thread():
            label, start = self.other.stack.pop()
            if not self.other.stack:  # outermost region of this thread: inclusive time
                self.background[label] += now - start
            return
        label, start = self.stack.pop()
        self.totals[label] += now - start
        if self.stack:
            self.stack[-1][1] = now


CLOCK = Clock()
MISSING: list[str] = []
XLA = {"compile_s": 0.0, "programs": 0, "cache_hits": 0}


def timed(fn, label: str):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        CLOCK.enter(label)
        try:
            return fn(*args, **kwargs)
        finally:
            CLOCK.exit()

    return wrapper


def patch(module, where: str, label: str) -> None:
    owner, _, attr = where.rpartition(".")
    obj = getattr(module, owner, None) if owner else module
    if obj is None or not hasattr(obj, attr):
        MISSING.append(f"{module.__name__}.{where}")
        return
    setattr(obj, attr, timed(getattr(obj, attr), label))


def timing_exec(loader):
    """Wraps ``loader.exec_module`` of one module's loader (the loader object itself stays, so
    ``importlib.resources`` and friends keep working)."""
    inner = loader.exec_module

    def exec_module(module):
        CLOCK.enter("import " + module.__name__.split(".")[0])
        try:
            inner(module)
        finally:
            CLOCK.exit()
        for mod, where, label in TARGETS:
            if mod == module.__name__:
                patch(module, where, label)

    loader.exec_module = exec_module


class TimingFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        spec = None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        if (
            spec is not None
            and spec.loader is not None
            and not isinstance(spec.loader, type)
            and hasattr(spec.loader, "exec_module")
        ):
            timing_exec(spec.loader)
        return spec


def main() -> None:
    out = os.environ.get("TIMED_TRAIN_OUT")
    sys.meta_path.insert(0, TimingFinder())
    sys.path.insert(0, REPO)
    sys.argv = [os.path.join(REPO, "train.py")] + sys.argv[1:]

    def on_compile(event: str, seconds: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            XLA["compile_s"] += seconds
            XLA["programs"] += 1

    def on_event(event: str, **_) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            XLA["cache_hits"] += 1

    import jax.monitoring  # the listeners must exist before anything compiles

    jax.monitoring.register_event_duration_secs_listener(on_compile)
    jax.monitoring.register_event_listener(on_event)
    code = 0
    CLOCK.enter("train.py (other: hydra, loop steps, Python)")
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        while CLOCK.stack:
            CLOCK.exit()
        if out:
            with open(out, "w") as f:
                json.dump(
                    {
                        "t0_epoch_s": T0_EPOCH_S,
                        "end_epoch_s": time.time(),
                        "regions_s": dict(CLOCK.totals),
                        "background_regions_s": dict(CLOCK.background),
                        "xla_compile_s": XLA["compile_s"],
                        "xla_programs": XLA["programs"],
                        "cache_hits": XLA["cache_hits"],
                        "missing": MISSING,
                    },
                    f,
                    indent=1,
                )
    sys.exit(code)


if __name__ == "__main__":
    main()
