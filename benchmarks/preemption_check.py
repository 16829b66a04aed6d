#!/usr/bin/env python
"""Cost of the per-step stop check of a multi-process run (``training.signals.StopOnSignal.requested``).

Every step, every process asks JAX's preemption service whether the processes have agreed to stop
(``multihost_utils.reached_preemption_sync_point``): a local flag read, no communication unless a SIGTERM
arrived. For comparison, the alternative the loop does NOT use: an all-reduce of a stop flag across the
processes (``multihost_utils.process_allgather`` of one int32). Starts 2 processes on this machine (1 CPU
device each, gloo over 127.0.0.1) and prints microseconds per call from process 0.

    python benchmarks/preemption_check.py [--calls 20000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def worker(pid: int, port: int, calls: int) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, pid)
    import numpy as np
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("start")
    t0 = time.perf_counter()
    for step in range(calls):
        multihost_utils.reached_preemption_sync_point(step)
    sync_us = (time.perf_counter() - t0) / calls * 1e6
    flag = np.zeros((), np.int32)
    n_reduce = max(calls // 100, 20)
    multihost_utils.process_allgather(flag)
    t0 = time.perf_counter()
    for _ in range(n_reduce):
        multihost_utils.process_allgather(flag)
    reduce_us = (time.perf_counter() - t0) / n_reduce * 1e6
    if pid == 0:
        print(
            f"reached_preemption_sync_point: {sync_us:.2f} us/call ({calls} calls); "
            f"all-reduce (process_allgather) of a stop flag: {reduce_us:.0f} us/call ({n_reduce} calls); "
            f"ratio {reduce_us / sync_us:.0f}x"
        )
    jax.distributed.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker, args.port, args.calls)
        return 0
    sys.path.insert(0, str(REPO / "scripts"))
    from launch_local import free_port

    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(i), "--port", str(port), "--calls", str(args.calls)], env=env
        )
        for i in range(2)
    ]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return max(abs(c) for c in codes)


if __name__ == "__main__":
    sys.exit(main())
