#!/usr/bin/env python
"""Starts N ``train.py`` processes on this machine as one multi-process JAX job (try multi-host on one box).

    python scripts/launch_local.py -n 2 --cpu-devices 4 -- parallel=fsdp optim=sgd train.steps=20

Every process gets ``distributed.coordinator=127.0.0.1:<free port>``, ``distributed.num_processes=N``, its
own ``distributed.process_id`` and the same run folder (``hydra.run.dir``; default
``outputs/<date>/<time>-<N>proc``, or the one given among the overrides) and, unless given, the same
``checkpoint.dir=<run folder>/checkpoints`` (orbax needs one folder every process sees). Process 0 writes the usual
outputs (``train.log``, ``.hydra/``, ``summary.json``, ``metrics.jsonl``, ``wandb/``); process i > 0 writes
only ``train_process<i>.log`` (its ``.hydra/`` is switched off with ``hydra.output_subdir=null``). All
processes print to this terminal (processes > 0 only warnings and errors, prefixed ``[process i]``).

Exit code: 0 when every process succeeded, else the first failing process's code (process 0 first). When
one process fails, the others get ``--grace-s`` seconds to finish on their own (they usually fail the same
way) and are then terminated, so the launcher never waits for JAX's heartbeat timeout.

With ``--cpu-devices K`` each process simulates K CPU devices (``runtime.cpu_devices=K``); on a GPU machine
leave it out and give each process its GPUs yourself (e.g. CUDA_VISIBLE_DEVICES) or use SLURM.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def commands(
    n: int, overrides: list[str], run_dir: str, port: int, cpu_devices: int | None, timeout_s: int | None
) -> list[list[str]]:
    """The ``train.py`` command line of each of the ``n`` processes."""
    common = [f"hydra.run.dir={run_dir}", f"distributed.coordinator=127.0.0.1:{port}", f"distributed.num_processes={n}"]
    if cpu_devices is not None:
        common.append(f"runtime.cpu_devices={cpu_devices}")
    if timeout_s is not None:
        common.append(f"distributed.timeout_s={timeout_s}")
    user = [o for o in overrides if not o.startswith("hydra.run.dir=")]
    if not any(o.startswith("checkpoint.dir=") for o in user):
        common.append(f"checkpoint.dir={Path(run_dir).absolute() / 'checkpoints'}")  # one folder all processes see
    return [
        [sys.executable, str(REPO / "train.py"), *user, *common, f"distributed.process_id={i}"]
        + (["hydra.output_subdir=null"] if i > 0 else [])
        for i in range(n)
    ]


# gloo (JAX's CPU collectives across processes) prints one such line per rank and communicator when it connects;
# they are expected and say nothing about the run, so they are counted, not shown.
GLOO_CONNECTED = re.compile(
    rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. Expected number of connected "
    rb"peer ranks is : \d+"
)


def forward_filtered(src, dst, counter: list) -> None:
    """Copies ``src`` (a child's stdout or stderr) to ``dst`` as it comes (``\r`` and ``\n`` end a piece, so
    progress bars stay live), leaving out gloo's per-rank connection lines; ``counter[0]`` counts them."""
    pending = b""
    while True:
        chunk = os.read(src.fileno(), 65536)
        if not chunk:
            break
        pending += chunk
        pieces = re.split(rb"(?<=[\r\n])", pending)
        pending = pieces.pop()  # not yet ended
        for piece in pieces:
            if GLOO_CONNECTED.search(piece):
                counter[0] += 1
                piece = GLOO_CONNECTED.sub(b"", piece)
                if not piece.strip():
                    continue
            dst.write(piece)
        dst.flush()
    if pending:
        dst.write(pending)
        dst.flush()


def stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    """Waits ``grace_s`` for running processes, then SIGTERM, then SIGKILL after 10 s (only our children)."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        alive = [p for p in procs if p.poll() is None]
        if not alive:
            return
        for p in alive:
            p.send_signal(sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(p.poll() is None for p in alive):
            time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        usage="%(prog)s -n N [--cpu-devices K] [options] -- [train.py overrides ...]",
    )
    ap.add_argument("-n", "--num-processes", type=int, required=True, help="processes to start")
    ap.add_argument("--cpu-devices", type=int, default=None, help="simulated CPU devices per process")
    ap.add_argument("--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one)")
    ap.add_argument("--timeout-s", type=int, default=None, help="distributed.timeout_s for every process")
    ap.add_argument(
        "--grace-s",
        type=float,
        default=30.0,
        help="after one process fails, seconds the others get before they are terminated",
    )
    ap.add_argument("overrides", nargs="*", help="Hydra overrides passed to every process")
    args = ap.parse_args(argv)
    if args.num_processes < 1:
        ap.error(f"--num-processes={args.num_processes} must be at least 1")
    given = [o.split("=", 1)[1] for o in args.overrides if o.startswith("hydra.run.dir=")]
    now = datetime.datetime.now()
    run_dir = (
        given[-1]
        if given
        else str(Path("outputs") / now.strftime("%Y-%m-%d") / f"{now.strftime('%H-%M-%S')}-{args.num_processes}proc")
    )
    port = args.port or free_port()
    cmds = commands(args.num_processes, args.overrides, run_dir, port, args.cpu_devices, args.timeout_s)
    print(
        f"launch_local: {args.num_processes} processes"
        + (f" x {args.cpu_devices} CPU devices" if args.cpu_devices else "")
        + f", coordinator 127.0.0.1:{port}, run folder {run_dir} (process i>0 logs to train_process<i>.log)",
        file=sys.stderr,
        flush=True,
    )
    procs = [subprocess.Popen(c, cwd=os.getcwd(), stdout=subprocess.PIPE, stderr=subprocess.PIPE) for c in cmds]
    gloo_lines = [0]
    readers = [
        threading.Thread(target=forward_filtered, args=(src, dst, gloo_lines), daemon=True)
        for p in procs
        for src, dst in ((p.stdout, sys.stdout.buffer), (p.stderr, sys.stderr.buffer))
    ]
    for r in readers:
        r.start()
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                stop(procs, args.grace_s)
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        stop(procs, 0.0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    for r in readers:
        r.join(timeout=5.0)
    if gloo_lines[0]:
        print(
            f"launch_local: {gloo_lines[0]} gloo connection lines of the processes left out (expected: one per "
            f"rank and communicator when the CPU collectives connect)",
            file=sys.stderr,
            flush=True,
        )
    codes = [p.returncode for p in procs]
    failed = [(i, c) for i, c in enumerate(codes) if c != 0]
    if failed:
        print(
            "launch_local: exit codes " + ", ".join(f"process {i}: {c}" for i, c in enumerate(codes)),
            file=sys.stderr,
            flush=True,
        )
        code = failed[0][1]
        return code if 0 < code < 256 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
