"""Where the CPU of a run goes: ``train.py`` against the bare script, thread by thread, in interleaved pairs.

When the training steps already keep every core busy (on a 2-core machine XLA's compute threads use both), each
CPU-second of host work beyond the bare script's lengthens the run: this prints those CPU-seconds, so that the
whole-process ratio of ``benchmarks/overhead.py`` can be traced to its parts. For ``--pairs`` interleaved pairs
(the order alternating), ``python train.py runtime.cpu_devices=N precision=P train.epochs=E OVERRIDES`` against
``benchmarks/bare_train.py --devices N --precision P --epochs E`` (its own persistent compilation cache, as
``overhead.py --bare-cache``), each under ``benchmarks/cpu_probe.py``; one uncounted run of each first fills the
compilation caches. Printed, per side, the median (min-max) over the pairs of CPU seconds:

- ``process tree``: the process and every process it started and waited for (W&B's process and its
  ``wandb-core``): ``RUSAGE_CHILDREN`` of this script around the run;
- ``exit + children``: process tree minus the process: the interpreter's shutdown after the record is taken
  (``train.py`` freezes its objects at exit, the bare script does not) and the child processes (W&B's);
- ``process``: the process itself (``os.times`` at exit), split into the rows below;
- ``main thread``; ``XLA's threads``: threads alive at exit that Python did not start, named ``tf_XLAEigen``
  (the compute pool) or ``python`` (the XLA runtime's own); ``tensorstore``: ``ts_pool_worker`` (orbax's writes);
- Python threads by name: ``batch-prefetch`` (the data pipeline), ``orbax-import`` (orbax imported beside the
  first steps), ``other Python`` (every other thread: orbax's per-checkpoint ``async_save``, ``asyncio``, ...,
  tqdm's monitor);
- ``other``: the process minus all of the above (native threads that ended before the exit).

For ``train.py`` also, in wall seconds: ``after the first step, outside the windows`` = ``perf/wall_s`` minus
``perf/startup_s`` minus the sum of the logging windows' step time (``metrics.jsonl``): the loop's hooks (the
windows' records, checkpoint saves, the final evaluation) and the end of the run, during which the devices wait.

    python benchmarks/cpu_budget.py [--pairs 3] [--setups 1:fp32] [--epochs 10] [--also wandb.mode=disabled]

Linux only (``/proc``). Needs MNIST prepared (``TFDS_DATA_DIR``); the first ``train.py`` run writes the decoded
cache the bare script reads.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = os.path.join(REPO, "benchmarks", "cpu_probe.py")
ROWS = (
    "process tree",
    "exit + children",
    "process",
    "main thread",
    "XLA's threads",
    "tensorstore",
    "batch-prefetch",
    "orbax-import",
    "other Python",
    "other",
)


def budget(probe: dict, tree_s: float) -> dict[str, float]:
    """The rows of ``ROWS`` (CPU seconds) from one ``cpu_probe.py`` record and the process tree's CPU seconds."""
    native, python = probe["native_s"], dict(probe["python_threads_s"])
    row = {
        "process tree": tree_s,
        "exit + children": tree_s - probe["process_s"],
        "process": probe["process_s"],
        "main thread": probe["main_s"],
        "XLA's threads": sum(v for k, v in native.items() if k in ("tf_XLAEigen", "python") or k.startswith("llvm")),
        "tensorstore": native.get("ts_pool_worker", 0.0),
        "batch-prefetch": python.pop("batch-prefetch", 0.0),
        "orbax-import": python.pop("orbax-import", 0.0),
        "other Python": sum(python.values()),
    }
    attributed = sum(row[k] for k in ROWS[3:-1])
    row["other"] = probe["process_s"] - attributed
    return row


def outside_windows_s(run_dir: str) -> float:
    """``perf/wall_s - perf/startup_s - sum of the windows' step time`` of a ``train.py`` run folder (seconds)."""
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    windows_s, last = 0.0, 0
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "perf/step_time_s" in rec:
                windows_s += (rec["step"] - last) * rec["perf/step_time_s"]
                last = rec["step"]
    return summary["perf/wall_s"] - summary["perf/startup_s"] - windows_s


def probed(cmd: list[str], out: str, env: dict) -> tuple[dict, float]:
    """Runs ``python cpu_probe.py out <cmd>``; returns (its record, the process tree's CPU seconds).

    Raises:
      RuntimeError: the command failed (its stderr's end in the message).
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, PROBE, out, *cmd], cwd=REPO, env=env, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-1500:]}")
    with open(out) as f:
        record = json.load(f)
    return record, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--setups", default="1:fp32", help="devices:precision, comma-separated (default 1:fp32)")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--also", action="append", nargs="+", default=None, help="a train.py variant: its overrides")
    args = ap.parse_args()
    if args.pairs < 1 or args.epochs < 1:
        ap.error(f"--pairs={args.pairs} and --epochs={args.epochs} must be at least 1")
    if not os.path.isdir("/proc/self/task"):
        ap.error("needs Linux (/proc/self/task)")
    setups = []
    for item in args.setups.split(","):
        devices, _, precision = item.partition(":")
        if devices not in {str(n) for n in range(1, 9)} or precision not in ("fp32", "bf16"):
            ap.error(f"--setups item {item!r}: use devices:precision with devices 1-8 and precision fp32 or bf16")
        setups.append((int(devices), precision))
    work = tempfile.mkdtemp(prefix="cpu_budget_")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
    for var in ("WANDB_API_KEY", "JAX_COMPILATION_CACHE_DIR", "JAX_NUM_CPU_DEVICES", "XLA_FLAGS"):
        env.pop(var, None)
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        env[var] = os.path.join(work, "wandb_aux")
    variants = [("train.py", [])] + [(f"train.py {' '.join(a)}", list(a)) for a in (args.also or [])]
    print(
        f"cpu_budget: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, {args.pairs} interleaved pairs, "
        f"{args.epochs} epoch{'s' if args.epochs != 1 else ''} MNIST MLP; CPU seconds per run, median (min-max)",
        flush=True,
    )
    runs = [0]
    for devices, precision in setups:
        folder = os.path.join(work, f"{devices}_{precision}")

        def command(extra):
            runs[0] += 1
            if extra is None:
                return [
                    os.path.join(REPO, "benchmarks", "bare_train.py"),
                    f"--devices={devices}",
                    f"--precision={precision}",
                    f"--epochs={args.epochs}",
                    f"--compilation-cache={os.path.join(folder, 'bare_jax_cache')}",
                ], None
            run_dir = os.path.join(folder, f"run{runs[0]}")
            return [
                os.path.join(REPO, "train.py"),
                f"hydra.run.dir={run_dir}",
                f"runtime.cpu_devices={devices}",
                f"precision={precision}",
                f"train.epochs={args.epochs}",
                f"runtime.compilation_cache_dir={os.path.join(folder, 'jax_cache')}",
                *extra,
            ], run_dir

        members = [("bare", None)] + variants
        for _, extra in members:  # not counted: the compilation caches, the OS file cache
            probed(command(extra)[0], os.path.join(folder, "warm.json"), env)
        rows: dict[str, dict[str, list]] = {name: collections.defaultdict(list) for name, _ in members}
        outside: dict[str, list[float]] = {name: [] for name, _ in variants}
        for i in range(args.pairs):
            for name, extra in members if i % 2 else members[1:] + members[:1]:
                cmd, run_dir = command(extra)
                record, tree_s = probed(cmd, os.path.join(folder, f"probe{runs[0]}.json"), env)
                for key, value in budget(record, tree_s).items():
                    rows[name][key].append(value)
                if run_dir is not None:
                    outside[name].append(outside_windows_s(run_dir))
        print(f"\n=== {devices} device(s), {precision} ===")
        width = max(len(name) for name, _ in members)
        print(f"  {'CPU s':<16}" + "".join(f"  {name:>{max(width, 22)}}" for name, _ in members))
        for key in ROWS:
            print(f"  {key:<16}" + "".join(f"  {spread(rows[name][key]):>{max(width, 22)}}" for name, _ in members))
        for name, _ in variants:
            print(f"  {name}: after the first step, outside the windows: {spread(outside[name]).strip()} s (wall)")
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
