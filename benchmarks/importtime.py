"""Which libraries ``python train.py`` imports and what they cost, from ``python -X importtime``.

Runs ``python -X importtime train.py runtime.cpu_devices=1 train.steps=20 [variant]`` for a few variants (W&B
offline, W&B disabled, W&B disabled without checkpoints), ``--repeats`` times each, interleaved, and prints the
median cumulative milliseconds of the named imports (0: not imported). ``--before DIR``: the same runs with
another checkout's ``train.py`` (e.g. ``git archive <commit> | tar -x -C DIR``), interleaved with this one.

    python benchmarks/importtime.py [--repeats 3] [--before DIR]

Needs MNIST prepared (``TFDS_DATA_DIR``) and its decoded cache (written by any earlier ``train.py`` run).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = (
    "jax",
    "hydra",
    "flax.nnx",
    "IPython",
    "optax",
    "wandb",
    "orbax.checkpoint",
    "tensorflow_datasets",
    "matplotlib",
    "submitit",
    "training.app",
)
VARIANTS = {
    "W&B offline (default)": [],
    "wandb.mode=disabled": ["wandb.mode=disabled"],
    "wandb.mode=disabled checkpoint.enabled=false": ["wandb.mode=disabled", "checkpoint.enabled=false"],
}


def importtime(checkout: str, overrides: list[str], run_dir: str, env: dict) -> dict[str, float]:
    """Cumulative ms per name in ``NAMES`` (summed over places it is imported) and ``all`` (top level)."""
    cmd = [sys.executable, "-X", "importtime", "train.py", f"hydra.run.dir={run_dir}"]
    cmd += ["runtime.cpu_devices=1", "train.steps=20", *overrides]
    proc = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr[-1500:]}")
    out = {name: 0.0 for name in NAMES + ("all",)}
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative_us, name = line[len("import time:") :].split("|")
        if len(name) - len(name.lstrip()) == 1:
            out["all"] += int(cumulative_us) / 1000
        if name.strip() in NAMES:
            out[name.strip()] += int(cumulative_us) / 1000
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before", default=None, help="another checkout to compare with")
    args = ap.parse_args()
    if args.before is not None and not os.path.isfile(os.path.join(args.before, "train.py")):
        ap.error(f"--before {args.before}: no train.py there; give a checkout of this repository")
    work = tempfile.mkdtemp(prefix="importtime_")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env.pop("WANDB_API_KEY", None)
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        env[var] = os.path.join(work, "wandb_aux")
    checkouts = {"this checkout": REPO} | ({"before": os.path.abspath(args.before)} if args.before is not None else {})
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    try:
        count = 0
        for _ in range(args.repeats):
            for variant, overrides in VARIANTS.items():
                for label, checkout in checkouts.items():
                    count += 1
                    run = importtime(checkout, overrides, os.path.join(work, f"run{count}"), env)
                    results.setdefault((variant, label), []).append(run)
        print(f"python -X importtime train.py runtime.cpu_devices=1 train.steps=20: median of {args.repeats} runs, ms")
        print(f"load average {os.getloadavg()[0]:.1f}")
        for (variant, label), runs in results.items():
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print(f"{variant}, {label}: " + ", ".join(f"{k} {v:.0f}" for k, v in med.items()))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
