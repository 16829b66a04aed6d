"""What W&B's process-wide offline mode saves an offline run: ``wandb.init(mode="offline")`` alone against the same
with ``WANDB_MODE=offline`` in the environment (what ``training/wandb_process.py`` sets for an offline run).

Each round runs two fresh processes, the order alternating, each doing what the W&B process does for a 10-epoch
MNIST run: ``import wandb``, ``wandb.init(mode="offline")`` with the repository's settings, 2,340 ``run.log`` calls
of four metrics, ``run.finish()``. Printed per round and as medians: wall seconds and CPU seconds (user + system of
the process and the ``wandb-core`` it waited for, ``resource.getrusage(RUSAGE_CHILDREN)``) and whether W&B's
OpenTelemetry analytics was on; then, with ``strace`` installed, one more (untimed) run of each under ``strace``
for the network connections it tried (``connect`` calls other than local sockets).

    python benchmarks/wandb_offline_env.py [--rounds 3] [--records 2340]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = """
import sys, wandb
from wandb.analytics.opentelemetry import opentelemetry_proxy
settings = wandb.Settings(init_timeout=60, console="off", x_disable_stats=True, silent=True)
run = wandb.init(mode="offline", project="p", dir=sys.argv[1], settings=settings)
for i in range(int(sys.argv[2])):
    run.log({"train/loss": 0.1 * i, "train/accuracy": 0.5, "train/grad_norm": 1.0, "optim/lr": 1e-3}, step=i + 1)
print("analytics", opentelemetry_proxy.get_open_telemetry_proxy() is not None)
run.finish()
"""


def one(records: int, process_wide: bool, folder: str, traced: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_MODE", "WANDB_API_KEY")}
    env.update(WANDB_DIR=folder, WANDB_CACHE_DIR=folder, WANDB_CONFIG_DIR=folder, WANDB_DATA_DIR=folder)
    if process_wide:
        env["WANDB_MODE"] = "offline"
    cmd = [sys.executable, "-c", CHILD, folder, str(records)]
    trace = os.path.join(folder, "strace.txt")
    if traced:  # strace slows the process several times: its timings are not used
        cmd = ["strace", "-f", "-qq", "-e", "trace=connect", "-o", trace, *cmd]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=True).stdout
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    connects = None
    if os.path.exists(trace):
        lines = open(trace).read().splitlines()
        connects = [line.split(" ", 1)[1][:90] for line in lines if "connect(" in line and "AF_UNIX" not in line]
    return dict(wall=wall, cpu=cpu, analytics="analytics True" in out, connects=connects)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--records", type=int, default=2340)
    args = ap.parse_args()
    if args.rounds < 1 or args.records < 0:
        ap.error(f"--rounds {args.rounds} --records {args.records}: need at least one round and no negative records")
    results: dict[bool, list[dict]] = {False: [], True: []}
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for process_wide in order:
            with tempfile.TemporaryDirectory() as folder:
                res = one(args.records, process_wide, folder)
            results[process_wide].append(res)
            name = "WANDB_MODE=offline" if process_wide else "init(mode=offline)"
            print(
                f"round {r} {name:18s} wall {res['wall']:.2f} s, cpu {res['cpu']:.2f} s, analytics "
                f"{'on' if res['analytics'] else 'off'}",
                flush=True,
            )
    if shutil.which("strace"):
        for process_wide in (False, True):
            with tempfile.TemporaryDirectory() as folder:
                res = one(args.records, process_wide, folder, traced=True)
            name = "WANDB_MODE=offline" if process_wide else "init(mode=offline)"
            print(f"under strace, {name}: network connects {res['connects']}", flush=True)
    for process_wide, rs in results.items():
        name = "WANDB_MODE=offline" if process_wide else "init(mode=offline)"
        print(
            f"{name:18s} median wall {statistics.median(r['wall'] for r in rs):.2f} s, "
            f"cpu {statistics.median(r['cpu'] for r in rs):.2f} s (min-max {min(r['cpu'] for r in rs):.2f}-"
            f"{max(r['cpu'] for r in rs):.2f}) over {len(rs)} runs of {args.records} records"
        )


if __name__ == "__main__":
    main()
