"""gloo's connection lines left out of a multi-process run's output, also those its C++ code writes itself.

gloo (JAX's CPU collectives across processes) writes ``[Gloo] Rank 0 is connected to 1 peer ranks. Expected number
of connected peer ranks is : 1`` once per rank and communicator, straight to the process's stderr from C++, and two
threads' lines interleave word by word. They say nothing about the run. ``filter_native_output`` passes the
process's stdout and stderr (file descriptors 1 and 2) through pipes to a small process running this file, which
copies everything else on as it comes and exits when the last writer is gone: nothing is lost when the run's own
process ends, whatever ends it (even ``kill -9``), and SIGTERM/SIGINT/SIGHUP do not stop it.

Standard library only (``scripts/launch_local.py`` uses ``is_gloo_noise`` too).
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys

# the pieces of gloo's line; any mix of them (two threads' lines interleaved), digits and spaces is one of them
GLOO_PIECES = re.compile(
    rb"\[Gloo\] Rank|is connected to|peer ranks\.|Expected number of connected peer ranks is :|[\d\s]"
)
QUIET = b"\x00dp-scaling: quiet\n"  # quiet_native_output: nothing after it is copied on (the process is ending)
_started = False
_direct_stderr: int | None = None  # the process's stderr before the filter (filter_native_output)


GLOO_WORDS = (b"[Gloo] Rank", b"is connected to", b"peer ranks.", b"Expected number of connected")


def is_gloo_noise(piece: bytes) -> bool:
    """Whether ``piece`` (one line) is gloo's connection line, two of them interleaved, or a piece of one that two
    threads' writes cut off (``is connected to 3 peer ranks. ...`` without its start)."""
    return any(word in piece for word in GLOO_WORDS) and not GLOO_PIECES.sub(b"", piece)


def copy_filtered(sources: dict[int, int]) -> None:
    """Copies each readable fd of ``sources`` to its fd (``{read fd: write fd}``) until every one ends, leaving out
    gloo's connection lines and, right after one, a line of nothing but digits and spaces (the end of two lines
    interleaved: ``3`` or a newline), and everything after ``QUIET`` (``quiet_native_output``)."""
    sel = selectors.DefaultSelector()
    pending: dict[int, bytes] = {}
    dropped: dict[int, bool] = {}
    quiet = False
    for src in sources:
        sel.register(src, selectors.EVENT_READ)
        pending[src], dropped[src] = b"", False
    while sel.get_map():
        for key, _ in sel.select():
            src = key.fd
            chunk = os.read(src, 65536)
            dst = sources[src]
            if not chunk:
                sel.unregister(src)
                if pending[src]:
                    _write(dst, pending[src])
                continue
            if quiet or QUIET in pending[src] + chunk:  # the process is ending for a reason it has said
                if not quiet:
                    _write(dst, (pending[src] + chunk).split(QUIET)[0])
                quiet, pending[src] = True, b""
                continue
            pieces = re.split(rb"(?<=[\r\n])", pending[src] + chunk)
            pending[src] = pieces.pop()  # not yet ended
            out = []
            for piece in pieces:
                if is_gloo_noise(piece) or (dropped[src] and not GLOO_PIECES.sub(b"", piece)):
                    dropped[src] = True
                    continue
                dropped[src] = False
                out.append(piece)
            if out:
                _write(dst, b"".join(out))


def _write(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:  # the reader is gone (a closed terminal): nothing more to do with this stream
        pass


def quiet_native_output() -> None:
    """Nothing more of this process's output is copied on (``training.peers``: the process is ending for a peer's
    death, which it has said; JAX's runtime logs the same death in C++ lines of its own). Only with the filter."""
    if _started:
        try:
            os.write(2, QUIET)
        except OSError:
            pass


def write_now(text: str) -> None:
    """Writes ``text`` to the process's stderr past the filter: a line said just before the process ends for a
    peer's death (``training.peers``). SLURM kills a step's processes, the filter among them, as soon as one task
    has died, and what the filter had not yet copied on was lost with it."""
    try:
        os.write(_direct_stderr if _direct_stderr is not None else 2, text.encode())
    except OSError:
        pass


def filter_native_output() -> bool:
    """Sends this process's fds 1 and 2 through the filter (once per process; returns whether it runs). Python's
    ``sys.stdout``/``sys.stderr`` keep working unchanged: they write to the same fds. A failure to start the
    filter leaves the output as it is."""
    global _started, _direct_stderr
    if _started:
        return True
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        pipes = [os.pipe(), os.pipe()]  # (read, write) for stdout, stderr
        originals = [os.dup(1), os.dup(2)]
        stops = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}  # pending in the filter until it ignores them
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
        try:
            child = _start(pipes, originals)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    except OSError:
        return False
    for (r, w), fd in zip(pipes, (1, 2)):
        os.dup2(w, fd)
        os.close(w)
        os.close(r)
    os.close(originals[0])
    _direct_stderr = originals[1]  # write_now: past the filter
    child.returncode = 0  # never waited for: it outlives this process by the moments it takes to drain the pipes
    _started = True
    return True


def _start(pipes: list[tuple[int, int]], originals: list[int]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-S", os.path.abspath(__file__), *(str(r) for r, _ in pipes), *map(str, originals)],
        pass_fds=[r for r, _ in pipes] + originals,
        stdin=subprocess.DEVNULL,
        stdout=originals[0],
        stderr=originals[1],
        close_fds=True,
    )


if __name__ == "__main__":
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # a job's stop signal reaches every process
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
    read_out, read_err, write_out, write_err = map(int, sys.argv[1:5])
    copy_filtered({read_out: write_out, read_err: write_err})
