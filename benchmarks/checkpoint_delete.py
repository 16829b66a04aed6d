"""What deleting the oldest checkpoint costs a save, by orbax's number of deletion threads.

orbax 0.12.8 deletes a step beyond ``max_to_keep`` inside the finalize of the save that pushed it out. With
``CheckpointManagerOptions.num_deletion_threads`` unset it uses ``min(16, max(1, os.cpu_count() // 2))`` threads on
a local folder, and with more than one its parallel deleter's scheduler returns only once a 0.1 s queue poll has
timed out. The repository's ``Saver`` asks for one thread (a plain recursive delete). This script saves the main
job's state (the MNIST MLP's 784-256-10 float32 parameters and two Adam moments, 2.44 MB, as numpy arrays: what
``train.py`` hands orbax in one process) ``--saves`` times per variant with ``keep=3``, each save followed by
``wait_until_finished``, the variants interleaved round by round, and prints the wall milliseconds of every save,
then per variant the median (min-max over the rounds) of the saves' medians before any deletion (saves 1-3) and
with one (saves 4 on).

Variants: ``orbax default`` (threads from this host's core count), ``threads=N`` for each ``--threads`` value, and
``Saver`` (the repository's ``training.checkpoint.Saver``, the options ``train.py`` uses).

    python benchmarks/checkpoint_delete.py [--saves 10] [--rounds 3] [--threads 6,1] [--dir DIR]

``--dir``: where the step folders go (default a temporary folder; its filesystem matters: a network filesystem makes
every deletion slower). Needs no data and no devices beyond the CPU.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def mlp_state():
    """The main job's MLP parameters (784-256-10, ``conf/schema.py`` MLPConfig) and Adam moments as numpy float32
    arrays (203,530 x 3 x 4 bytes = 2.44 MB), and a step count."""
    import numpy as np

    rng = np.random.default_rng(0)
    shapes = [(784, 256), (256,), (256, 10), (10,)]
    params = {f"layer{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}
    zeros = {k: np.zeros_like(v) for k, v in params.items()}
    return {"params": params, "mu": zeros, "nu": dict(zeros), "step": np.int32(0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--saves", type=int, default=10, help="saves per variant and round (>= 5)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="6,1", help="comma-separated num_deletion_threads values to time")
    ap.add_argument("--dir", default=None, help="folder for the step folders (default: a temporary one)")
    args = ap.parse_args()
    if args.saves < 5:
        ap.error(f"--saves={args.saves}: give at least 5 (3 before the first deletion, then some with one)")

    try:
        thread_counts = [int(t) for t in args.threads.split(",") if t.strip()]
    except ValueError:
        ap.error(f"--threads={args.threads!r}: give comma-separated whole numbers, e.g. --threads 6,1")
    if any(t < 1 for t in thread_counts):
        ap.error(f"--threads={args.threads!r}: every count must be at least 1")

    import orbax.checkpoint as ocp

    from training.checkpoint.store import META, STATE, Saver

    state = mlp_state()
    base = Path(args.dir or tempfile.mkdtemp(prefix="checkpoint_delete_"))
    cores = os.cpu_count() or 1
    default = min(16, max(1, cores // 2))  # orbax 0.12.8's PathDeleter on a local folder
    variants = [f"orbax default ({default} thread{'s' * (default > 1)} on {cores} cores)"]
    variants += [f"threads={t}" for t in thread_counts]
    variants += ["Saver"]
    before: dict[str, list[float]] = {v: [] for v in variants}
    after: dict[str, list[float]] = {v: [] for v in variants}
    print(f"checkpoint_delete: {args.saves} saves per variant and round, keep=3, {args.rounds} rounds, in {base}")
    for r in range(args.rounds):
        for variant in variants if r % 2 == 0 else variants[::-1]:
            folder = base / f"r{r}_{variant.split(' ')[0].replace('=', '')}"
            shutil.rmtree(folder, ignore_errors=True)
            saver = None
            if variant == "Saver":
                saver = Saver(folder, keep=3)
                manager = saver.manager
            else:
                threads = int(variant.split("=")[1]) if variant.startswith("threads=") else None
                options = ocp.CheckpointManagerOptions(max_to_keep=3, create=True, num_deletion_threads=threads)
                manager = ocp.CheckpointManager(folder, options=options)
            times = []
            for i in range(args.saves):
                t = time.perf_counter()
                item = ocp.args.StandardSave(state)
                if saver is not None:  # the Saver's manager holds two items, as train.py saves them
                    item = ocp.args.Composite(**{STATE: item, META: ocp.args.JsonSave({"step": i})})
                manager.save(i, args=item, force=True)
                manager.wait_until_finished()
                times.append(1e3 * (time.perf_counter() - t))
            (saver or manager).close()
            left = sorted(p.name for p in folder.iterdir() if p.is_dir())
            shutil.rmtree(folder, ignore_errors=True)
            before[variant].append(statistics.median(times[:3]))
            after[variant].append(statistics.median(times[3:]))
            each = " ".join(f"{x:.0f}" for x in times)
            print(f"round {r} {variant}: ms per save then wait {each}; left {left}")
    print("median (min-max over rounds) of each round's median ms per save then wait:")
    for v in variants:
        b, a = before[v], after[v]
        print(
            f"  {v:<40} saves 1-3 {statistics.median(b):6.1f} ({min(b):.1f}-{max(b):.1f})"
            f"   saves 4-{args.saves}, each deleting a step: {statistics.median(a):6.1f} ({min(a):.1f}-{max(a):.1f})"
        )
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
