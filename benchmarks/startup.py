"""Whole-process cost of ``python train.py`` vs a bare JAX script (``benchmarks/bare_train.py``), and what the
persistent compilation cache saves.

For each setup (default: 1 device fp32, 8 simulated devices bf16; 10 epochs of the MNIST MLP, batch 256,
``train.py``'s defaults otherwise: W&B offline, a checkpoint every epoch, compilation cache on):

1. cache: ``train.py`` twice with an empty cache folder of its own: compile seconds (``perf/compile_time_s``,
   the AOT train step) and whole-process seconds of the first (cold) and second (warm) run.
2. pairs: ``--pairs`` rounds of three processes, in rotating order so that a drift of the shared machine
   favours none: ``train.py`` (warm cache), ``train.py runtime.compilation_cache_dir=null`` (no cache, as
   the bare script), and the bare script (and, with ``--before DIR``, the ``train.py`` of another
   checkout). Prints each round, the median ratio and the range (min-max).
   Whole-process time = from ``Popen`` to the process's exit, as a user waits for it.
3. breakdown: one more ``train.py`` run under ``benchmarks/timed_train.py`` (exclusive seconds per import,
   repository function and W&B/checkpoint call) beside one bare run with phase marks: where the extra seconds
   go. Steady state from the same runs: ``train.py``'s ``perf/examples_per_s`` (median of its logging windows)
   vs the bare script's examples/s over epochs 2..N (``benchmarks/overhead.py`` measures the step loop
   itself, in one process).

    python benchmarks/startup.py [--setups 1:fp32,8:bf16] [--pairs 5] [--epochs 10] [-- extra train.py overrides]

Needs MNIST prepared (``TFDS_DATA_DIR``) and its decoded cache (written by any earlier ``train.py`` run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_process(cmd: list[str], env: dict, cwd: str = REPO) -> float:
    """Runs ``cmd`` in ``cwd``; returns its wall seconds. Raises RuntimeError (with its stderr tail)."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-1500:]}")
    return wall


class Setup:
    """Commands of one setup (device count, precision) with run folders under ``work``."""

    def __init__(self, devices: int, precision: str, epochs: int, extra: list[str], work: str):
        self.devices, self.precision, self.epochs, self.extra, self.work = devices, precision, epochs, extra, work
        self.cache = os.path.join(work, "jax_cache")
        self.count = 0
        os.makedirs(work, exist_ok=True)

    def train(self, *overrides: str, timed: bool = False) -> tuple[list[str], str]:
        self.count += 1
        run_dir = os.path.join(self.work, f"run{self.count}")
        script = os.path.join(REPO, "benchmarks", "timed_train.py") if timed else "train.py"
        return (
            [
                sys.executable,
                script,
                f"hydra.run.dir={run_dir}",
                f"runtime.cpu_devices={self.devices}",
                f"precision={self.precision}",
                f"train.epochs={self.epochs}",
                f"runtime.compilation_cache_dir={self.cache}",
                *overrides,
                *self.extra,
            ],
            run_dir,
        )

    def before(self, checkout: str) -> tuple[list[str], str]:
        """``train.py`` of another checkout (e.g. the commit before a change; no compilation cache keys)."""
        self.count += 1
        run_dir = os.path.join(self.work, f"run{self.count}")
        return (
            [
                sys.executable,
                "train.py",
                f"hydra.run.dir={run_dir}",
                f"runtime.cpu_devices={self.devices}",
                f"precision={self.precision}",
                f"train.epochs={self.epochs}",
                *self.extra,
            ],
            run_dir,
        )

    def bare(self, timings: str | None = None) -> list[str]:
        cmd = [
            sys.executable,
            os.path.join(REPO, "benchmarks", "bare_train.py"),
            f"--devices={self.devices}",
            f"--precision={self.precision}",
            f"--epochs={self.epochs}",
        ]
        return cmd + ([f"--timings={timings}"] if timings else [])


def summary(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f} (range {min(values):.3f}-{max(values):.3f}, n={len(values)})"


GROUPS = [  # (label, region labels of timed_train.py or import prefixes)
    ("imports: wandb", ["import wandb"]),
    (
        "imports: jax, jaxlib, flax, optax, numpy",
        [
            "import jax",
            "import jaxlib",
            "import flax",
            "import optax",
            "import numpy",
            "import ml_dtypes",
            "import treescope",
        ],
    ),
    (
        "imports: IPython/jedi (pulled in by flax.nnx)",
        ["import IPython", "import jedi", "import prompt_toolkit", "import pygments"],
    ),
    ("imports: tensorflow_datasets", ["import tensorflow_datasets"]),
    ("imports: orbax", ["import orbax"]),
    ("imports: hydra, omegaconf", ["import hydra", "import omegaconf", "import antlr4", "import yaml"]),
    (
        "imports: the repository",
        [
            "import training",
            "import conf",
            "import data",
            "import parallel",
            "import measure",
            "import models",
            "import train",
        ],
    ),
    ("W&B init", ["W&B init"]),
    ("W&B finish + files closed", ["W&B finish + files closed"]),
    ("metrics written (jsonl + W&B log per step)", ["metrics written (jsonl + W&B)"]),
    (
        "checkpoints (manager start, saves, final wait)",
        [
            "checkpoint manager start",
            "checkpoint saves (blocking part)",
            "checkpoint wait + close (end)",
            "checkpoint prepare/resume",
        ],
    ),
    ("data load", ["data load"]),
    ("build (model, optimizer, placed state)", ["build (model, optimizer, placed state)"]),
    ("lower + compile train step", ["lower (train step, AOT)", "compile (train step, AOT)"]),
    ("evaluation (final + eval set)", ["evaluation", "eval set placement"]),
    ("logging windows (device->host, lr)", ["logging windows (device->host)"]),
    ("replica sync checks", ["replica sync checks"]),
    ("training loop and the rest of run()", ["training loop and the rest of run()"]),
]


def breakdown(setup: Setup, env: dict) -> None:
    """One timed train.py run and one bare run with marks, printed side by side."""
    out = os.path.join(setup.work, "timed.json")
    cmd, run_dir = setup.train(timed=True)
    t_launch = time.time()
    wall_a = run_process(cmd, {**env, "TIMED_TRAIN_OUT": out})
    t_exit_a = t_launch + wall_a
    with open(out) as f:
        timed = json.load(f)
    marks_path = os.path.join(setup.work, "bare.json")
    t_launch_b = time.time()
    wall_b = run_process(setup.bare(marks_path), env)
    with open(marks_path) as f:
        marks = json.load(f)
    regions = dict(timed["regions_s"])
    rows = []
    for label, keys in GROUPS:
        rows.append((label, sum(regions.pop(k, 0.0) for k in keys)))
    other_imports = sum(v for k, v in list(regions.items()) if k.startswith("import "))
    rows.append(("imports: everything else", other_imports))
    rest = sum(v for k, v in regions.items() if not k.startswith("import "))
    rows.append(("other (Hydra compose, run_and_report, small calls)", rest))
    rows.append(("interpreter start (launch -> script)", timed["t0_epoch_s"] - t_launch))
    rows.append(("exit (script end -> process gone)", t_exit_a - timed["end_epoch_s"]))
    s = summary(run_dir)
    print(
        f"  breakdown, train.py (exclusive seconds; {wall_a:.2f} s whole process, XLA compiled "
        f"{timed['xla_programs']} programs in {timed['xla_compile_s']:.2f} s, {timed['cache_hits']} cache hits):"
    )
    for label, sec in rows:
        print(f"    {sec:7.2f}  {label}")
    steps_s = s["train/steps"] * s["train/global_batch"] / s["perf/examples_per_s"]
    print(f"    (of the loop: ~{steps_s:.2f} s of steps at the median window rate)")
    for label, sec in sorted(timed.get("background_regions_s", {}).items(), key=lambda kv: -kv[1]):
        print(f"    {sec:7.2f}  background thread, overlapping the above: {label}")
    print(f"  bare script ({wall_b:.2f} s whole process):")
    t0b = marks["t0_epoch_s"] - t_launch_b
    phases = [
        ("interpreter start", t0b),
        ("imports", marks["imports"]),
        ("data", marks["data"] - marks["imports"]),
        ("init + compile + first step", marks["first_step"] - marks["data"]),
        ("training loop", marks["train"] - marks["first_step"]),
        ("evaluation", marks["eval"] - marks["train"]),
        ("exit", wall_b - t0b - marks["end"]),
    ]
    for label, sec in phases:
        print(f"    {sec:7.2f}  {label}")
    print(
        f"  steady state (same two runs): train.py {s['perf/examples_per_s']:.0f} examples/s (median of "
        f"windows), bare {marks['steady_examples_per_s']:.0f} examples/s (epochs 2..{setup.epochs}): ratio "
        f"{s['perf/examples_per_s'] / marks['steady_examples_per_s']:.3f}"
    )


def bench(setup: Setup, pairs: int, env: dict, before: str | None) -> None:
    print(f"\n=== {setup.devices} device(s), {setup.precision}, {setup.epochs} epochs MNIST MLP ===", flush=True)
    shutil.rmtree(setup.cache, ignore_errors=True)
    cold_cmd, cold_dir = setup.train()
    cold_wall = run_process(cold_cmd, env)
    warm_cmd, warm_dir = setup.train()
    warm_wall = run_process(warm_cmd, env)
    cold, warm = summary(cold_dir), summary(warm_dir)
    entries = len([n for n in os.listdir(setup.cache) if n.endswith("-cache")])
    print(
        f"compilation cache: train step compile {cold['perf/compile_time_s']:.2f} s -> "
        f"{warm['perf/compile_time_s']:.2f} s, start-up (perf/startup_s) {cold['perf/startup_s']:.2f} s -> "
        f"{warm['perf/startup_s']:.2f} s, whole process {cold_wall:.2f} s -> {warm_wall:.2f} s "
        f"({entries} programs cached)",
        flush=True,
    )
    kinds = ["warm", "off", "bare"] + (["before"] if before else [])
    ratios: dict[str, list[float]] = {k: [] for k in kinds if k != "bare"}
    ss_warm = []
    for i in range(pairs):
        order = kinds[i % len(kinds) :] + kinds[: i % len(kinds)]  # rotating order
        walls, dirs = {}, {}
        for kind in order:
            if kind == "bare":
                walls[kind] = run_process(setup.bare(), env)
            elif kind == "before":
                cmd, dirs[kind] = setup.before(before)
                walls[kind] = run_process(cmd, env, cwd=before)
            else:
                cmd, dirs[kind] = setup.train(*(["runtime.compilation_cache_dir=null"] if kind == "off" else []))
                walls[kind] = run_process(cmd, env)
        for kind in ratios:
            ratios[kind].append(walls[kind] / walls["bare"])
        ss_warm.append(summary(dirs["warm"])["perf/examples_per_s"])
        print(
            f"round {i} ({' '.join(order)}): "
            + ", ".join(f"{k} {walls[k]:.2f} s" for k in kinds)
            + "; ratios to bare "
            + " / ".join(f"{ratios[k][-1]:.3f}" for k in ratios),
            flush=True,
        )
    print(f"whole process, train.py / bare: {spread(ratios['warm'])}")
    print(f"  with the cache off (runtime.compilation_cache_dir=null): {spread(ratios['off'])}")
    if before:
        print(f"  train.py of {before}: {spread(ratios['before'])}")
    print(f"train.py steady state in these runs: {spread(ss_warm)} examples/s")
    breakdown(setup, env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setups", default="1:fp32,8:bf16", help="devices:precision, comma-separated")
    ap.add_argument("--pairs", type=int, default=5, help="rounds of (train.py, train.py without cache, bare)")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--keep", action="store_true", help="keep the run folders (printed)")
    ap.add_argument(
        "--before",
        default=None,
        help="another checkout whose train.py joins every round (e.g. a worktree of the commit before a change)",
    )
    ap.add_argument("extra", nargs="*", help="extra train.py overrides (after --)")
    args = ap.parse_args()
    env = {**os.environ, "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
    env.pop("WANDB_API_KEY", None)
    work = tempfile.mkdtemp(prefix="startup_bench_")
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        env[var] = os.path.join(work, "wandb_aux")
    print(
        f"startup: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start; extra overrides: "
        f"{' '.join(args.extra) or 'none'}; folders in {work}"
    )
    try:
        for item in args.setups.split(","):
            devices, precision = item.split(":")
            bench(
                Setup(int(devices), precision, args.epochs, args.extra, os.path.join(work, item.replace(":", "_"))),
                args.pairs,
                env,
                args.before and os.path.abspath(args.before),
            )
    finally:
        print(f"load average {os.getloadavg()[0]:.1f} at end")
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
