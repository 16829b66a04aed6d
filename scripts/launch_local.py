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

Exit code: 0 when every process succeeded, else the first failing process's code (process 0 first). When one
process dies, the others stop at once with one line naming it (``training.peers``); when one fails, the others get
``--grace-s`` seconds to finish on their own and are then terminated, so the launcher never waits for JAX's
heartbeat timeout.

Signals (what SLURM, a cloud preemption or Ctrl-C send): SIGTERM or SIGINT to the launcher is forwarded to
every process as SIGTERM. JAX's preemption service in each process catches it, the processes agree on one
step, every one finishes it, saves a checkpoint there and exits with ``error: stopped by SIGTERM
(preemption, all processes) after step S of N; checkpoint saved in ...`` (exit code 1, which the launcher
returns); the same command continues from that checkpoint. Processes still running ``--stop-grace-s``
seconds after the signal are killed; a second Ctrl-C kills them at once. The processes run in their own
session, so a Ctrl-C in the terminal reaches them only through the launcher. When the launcher itself is
killed (``kill -9``, an out-of-memory kill), the kernel kills its processes too (``PR_SET_PDEATHSIG``, Linux):
none is left behind waiting for its peers.

``--port P`` that is already in use stops at once with one line naming it (JAX would crash process 0 after
its timeout instead); without ``--port`` the OS picks a free one.

Output: process 0's lines pass unchanged; process i > 0 prints none of the product's lines (one voice per job: they
are in its ``train_process<i>.log``), and whatever else it prints (JAX's C++ log, a traceback) starts with
``[process i]``.

With ``--cpu-devices K`` each process simulates K CPU devices (``runtime.cpu_devices=K``); on a GPU machine
leave it out and give each process its GPUs yourself (e.g. CUDA_VISIBLE_DEVICES) or use SLURM.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from training.native_output import is_gloo_noise  # noqa: E402  (standard library only)
from training.process import port_in_use, port_taken_line  # noqa: E402  (standard library only)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


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


def forward_filtered(src, dst, counter: list, label: bytes = b"") -> None:
    """Copies ``src`` (a child's stdout or stderr) to ``dst`` as it comes (``\r`` and ``\n`` end a piece, so
    progress bars stay live), leaving out gloo's per-rank connection lines; ``counter[0]`` counts them.
    ``label`` (e.g. ``b"[process 1] "``) starts every line that does not start with it already."""
    pending = b""
    while True:
        chunk = os.read(src.fileno(), 65536)
        if not chunk:
            break
        pending += chunk
        pieces = re.split(rb"(?<=[\r\n])", pending)
        pending = pieces.pop()  # not yet ended
        for piece in pieces:
            if is_gloo_noise(piece):  # train.py leaves them out itself (training.native_output); a second net
                counter[0] += 1
                continue
            dst.write(_labelled(piece, label))
        dst.flush()
    if pending:
        dst.write(_labelled(pending, label))
        dst.flush()


def _labelled(piece: bytes, label: bytes) -> bytes:
    """``piece`` (one line, or a ``\r``-ended progress piece) with ``label`` in front unless it has it already."""
    if not label or piece.startswith(label) or not piece.strip():
        return piece
    return label + piece


def die_with_parent(parent_pid: int):
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets SIGKILL when the launcher dies (Linux
    ``prctl(PR_SET_PDEATHSIG)``; elsewhere nothing is set). If the launcher already died between fork and
    exec, the child kills itself at once."""

    def preexec() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # not Linux
            return
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


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


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def forward(procs: list[subprocess.Popen], sig: int) -> None:
    """Sends ``sig`` to every process still running (only our children)."""
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass


def on_stop_signal(procs: list[subprocess.Popen], received: list[int], grace_s: float):
    """The launcher's SIGTERM/SIGINT handler: the first signal is forwarded to every process as SIGTERM (JAX's
    preemption service there agrees on the step at which all of them save and stop) with one line on stderr;
    later ones are only recorded (a second SIGINT makes the main loop kill the processes)."""

    def handler(signum, frame) -> None:
        received.append(signum)
        if len(received) > 1:
            return
        forward(procs, signal.SIGTERM)
        name = signal.Signals(signum).name
        os.write(
            2,
            f"launch_local: {name} received; forwarded as SIGTERM to the {len(procs)} processes: they stop at "
            f"the same step and save a checkpoint (killed if still running after {grace_s:g} s"
            f"{'; Ctrl-C again kills them now' if signum == signal.SIGINT else ''})\n".encode(),
        )

    return handler


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
    ap.add_argument(
        "--stop-grace-s",
        type=float,
        default=120.0,
        help="after SIGTERM/SIGINT, seconds the processes get to save and exit before they are killed",
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
    if args.port is not None and port_in_use(args.port):
        print(
            "launch_local: "
            + port_taken_line(args.port, "choose another with --port P, or leave --port out to get a free one"),
            file=sys.stderr,
            flush=True,
        )
        return 2
    port = args.port or free_port()
    cmds = commands(args.num_processes, args.overrides, run_dir, port, args.cpu_devices, args.timeout_s)
    print(
        f"launch_local: {args.num_processes} processes"
        + (f" x {args.cpu_devices} CPU devices" if args.cpu_devices else "")
        + f", coordinator 127.0.0.1:{port}, run folder {run_dir} (process i>0 logs to train_process<i>.log)",
        file=sys.stderr,
        flush=True,
    )
    procs: list[subprocess.Popen] = []
    received: list[int] = []  # stop signals received, in order
    previous = {sig: signal.signal(sig, on_stop_signal(procs, received, args.stop_grace_s)) for sig in STOP_SIGNALS}
    try:
        for c in cmds:
            procs.append(
                subprocess.Popen(
                    c,
                    cwd=os.getcwd(),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,  # a terminal's Ctrl-C reaches them through the launcher only
                    preexec_fn=die_with_parent(os.getpid()),
                )
            )
            if received:  # a signal while starting: the rest are not started
                forward(procs, signal.SIGTERM)
                break
    except BaseException:
        for p in procs:
            p.kill()
        raise
    gloo_lines = [0]
    readers = [
        threading.Thread(
            target=forward_filtered, args=(src, dst, gloo_lines, f"[process {i}] ".encode() if i else b""), daemon=True
        )
        for i, p in enumerate(procs)
        for src, dst in ((p.stdout, sys.stdout.buffer), (p.stderr, sys.stderr.buffer))
    ]
    for r in readers:
        r.start()
    died: list[tuple[int, int]] = []  # (process, exit code) of the first failure that stopped the others
    try:
        stop_deadline = None
        while [p.poll() for p in procs].count(None):  # polls every process (any() would stop at the first)
            if received:
                stop_deadline = stop_deadline or time.monotonic() + args.stop_grace_s
                if any(p.returncode is not None and p.returncode < 0 for p in procs):
                    # one died of the signal (it came before JAX's handler was installed): the others cannot
                    # agree with it on a step any more
                    stop_deadline = min(stop_deadline, time.monotonic() + 10.0)
                if time.monotonic() > stop_deadline or len(received) > 1 and received[-1] == signal.SIGINT:
                    forward(procs, signal.SIGKILL)
                    break
            elif any(p.returncode not in (None, 0) for p in procs):
                died = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode not in (None, 0)]
                stop(procs, args.grace_s)
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    for sig, handler in previous.items():
        signal.signal(sig, handler)
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
        killed = [(i, c) for i, c in died if c < 0]  # ended by a signal: it could not say why itself
        survivor_said = any(c is not None and c >= 0 for c in codes)  # training.peers: a survivor named it
        if killed and not received and not survivor_said:
            i, c = killed[0]
            line = (
                f"process {i} of the job ended by {signal.Signals(-c).name} (killed from outside, e.g. out of "
                f"memory); the other processes were stopped; the same command continues from the newest checkpoint"
            )
            print(f"error: {line}", file=sys.stderr, flush=True)
            if codes[0] is not None and codes[0] < 0:  # process 0 was killed too: its summary says why
                summary = Path(run_dir) / "summary.json"
                summary.write_text(json.dumps({"status": "failed", "error": line}, indent=2) + "\n")
        code = failed[0][1]
        return code if 0 < code < 256 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
