"""The processes of a multi-process job watch each other: a process that dies stops the others at once, in one line.

JAX's runtime notices a dead peer only through its heartbeats (100 s, then an abort with a C++ stack trace), and a
survivor blocked in a collective waits for it; SLURM kills the survivors KillWait seconds after (30 s), with no line
from the run and no ``summary.json``. Here every process > 0 keeps one TCP connection to process 0 (the address is
published in JAX's coordination service), and each side says how its run ended before it exits:

* a connection that closes before its process said so means that process died (``kill -9``, out of memory, a
  crash): the kernel closes a dead process's sockets at once, and TCP keepalive (about 90 s) covers a dead host;
* process 0 then prints one line naming the process, its SLURM task and node (``death_line``), writes
  ``summary.json`` with status ``failed``, tells the other processes and exits with status 1; they exit with status
  1 too, silently (one voice per job);
* when process 0 itself died, the lowest surviving process says it and writes ``summary.json`` (the others wait
  ``SPEAKER_DELAY_S`` per rank and find it written);
* a process that failed with an error line (``finished(status='failed', line=...)``) has process 0 say it, unless
  process 0 stops on its own within ``OWN_END_GRACE_S`` (the same error on every process: its own line).

Standard library only; ``start`` runs after ``jax.distributed.initialize`` (``training.distributed``).
"""

from __future__ import annotations

import atexit
import logging
import os
import selectors
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from training.native_output import quiet_native_output, write_now

log = logging.getLogger(__name__)

KEY = "dp_scaling/peers"  # the coordination service key holding process 0's watch port
CONNECT_TIMEOUT_S = 60.0  # process i > 0: for process 0's port to be published, then to connect
OWN_END_GRACE_S = 5.0  # a peer failed or stopped: this long for this process's own end before it exits
SPEAKER_DELAY_S = 0.5  # process 0 died: process i waits (i - 1) times this before it checks who spoke
EXIT_CODE = 1
KEEPALIVE = (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 6))  # a dead host: ~90 s


def node_name() -> str:
    """This process's node: SLURM's name for it (``SLURMD_NODENAME``), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def who(process_id: int, num_processes: int, node: str) -> str:
    """``process 1 of 2 (SLURM task 1 on node n2)``, or ``process 1 of 2 on host vm`` outside SLURM."""
    if os.environ.get("SLURM_JOB_ID"):
        return f"process {process_id} of {num_processes} (SLURM task {process_id} on node {node})"
    return f"process {process_id} of {num_processes} on host {node}"


def death_line(process_id: int, num_processes: int, node: str, how: str, resume_hint: str) -> str:
    """The one line (without ``error: ``) of a job stopped because a process died (``how``: ``died``) or failed
    (``how``: ``failed: <its line>``)."""
    what = "died without a word (killed from outside, e.g. out of memory, or crashed)" if how == "died" else how
    return (
        f"{who(process_id, num_processes, node)} {what}; the job cannot go on without it and every other process "
        f"stopped; {resume_hint}"
    )


class _Watch:
    """One process's side: the connections, what each peer said, and what to do when one dies."""

    def __init__(self, process_id: int, num_processes: int, run_dir: Path, resume_hint: Callable[[], str]):
        self.process_id, self.num_processes, self.run_dir = process_id, num_processes, Path(run_dir)
        self.resume_hint = resume_hint
        self.node = node_name()
        self.ended = threading.Event()  # this process's run ended (finished): peers' exits change nothing
        self.peer_death = threading.Event()  # a peer died or failed: this process is exiting for it
        self.on_death: Optional[Callable[[str], None]] = None  # writes the summary (training.run)
        self.lock = threading.Lock()
        self.said_end = False
        self.conns: dict[int, socket.socket] = {}  # process 0: process id -> its connection
        self.server: Optional[socket.socket] = None  # process i > 0: the connection to process 0

    # ---- what this process says -------------------------------------------------------------------------
    def send(self, sock: socket.socket, text: str) -> None:
        try:
            sock.sendall((text.replace("\n", " ") + "\n").encode())
        except OSError:
            pass

    def finished(self, status: str, line: str = "") -> None:
        with self.lock:
            if self.said_end:
                return
            self.said_end = True
        self.ended.set()
        message = f"end {status} {line}".rstrip()
        for sock in [self.server, *self.conns.values()]:
            if sock is not None:
                self.send(sock, message)

    # ---- a peer's end -------------------------------------------------------------------------------------
    def peer_ended(self, process_id: int, node: str, status: str, line: str) -> None:
        """A peer said how its run ended. Only a failure with a line, or process 0's own failure or stop, matters
        while this process still runs."""
        if status == "ok" or self.ended.is_set():
            return
        if self.process_id == 0 and status == "failed" and line:
            threading.Thread(target=self._failed_peer, args=(process_id, node, line), daemon=True).start()
        elif process_id == 0 and status in ("failed", "stopped"):
            threading.Thread(target=self._follow_zero, args=(status,), daemon=True).start()

    def _failed_peer(self, process_id: int, node: str, line: str) -> None:
        if self.ended.wait(OWN_END_GRACE_S):  # the same error here: this process says its own line
            return
        self.stop_for(process_id, node, f"failed: {line}")

    def _follow_zero(self, status: str) -> None:
        if self.ended.wait(OWN_END_GRACE_S):
            return
        log.error("process 0 %s; this process stops too", status)
        self.exit()

    def peer_died(self, process_id: int, node: str) -> None:
        """A peer's connection closed before it said how its run ended."""
        if self.ended.is_set():
            return
        if self.process_id == 0 or process_id == 0:
            self.stop_for(process_id, node, "died")

    # ---- stopping for a peer ------------------------------------------------------------------------------
    def stop_for(self, process_id: int, node: str, how: str) -> None:
        with self.lock:
            if self.peer_death.is_set() or self.ended.is_set():
                return
            self.peer_death.set()
        line = death_line(process_id, self.num_processes, node, how, self.resume_hint())
        if self.process_id == 0:
            for pid, sock in self.conns.items():
                if pid != process_id:
                    self.send(sock, f"dead {process_id} {node}")
            self.speak(line)
        elif self.speaker_after_zero():
            self.speak(line)
        else:
            log.error("%s", line)
        self.exit()

    def speaker_after_zero(self) -> bool:
        """Process 0 died: whether this process is the lowest survivor (no lower one wrote the summary first)."""
        started = time.time()
        time.sleep(SPEAKER_DELAY_S * (self.process_id - 1))
        try:
            return (self.run_dir / "summary.json").stat().st_mtime < started - 1.0
        except OSError:
            return True

    def speak(self, line: str) -> None:
        """The summary first, then the line: JAX's runtime, which sees the same death through its coordination
        service, may end this process (``_exit(1)`` after its own log line) a moment later."""
        _to_log_files(f"error: {line}")  # the console gets the line once, below
        try:
            if self.on_death is not None and self.process_id == 0:
                self.on_death(line)
            else:
                from training.report import write_summary

                write_summary(self.run_dir, {"status": "failed", "error": line})
        except Exception as e:  # the line is said; a summary that cannot be written adds one log line
            log.error("summary.json not written: %s", e)
        write_now(f"error: {line}\n")

    def exit(self) -> None:
        quiet_native_output()  # what JAX's runtime still logs about the same death adds nothing
        for handler in logging.getLogger().handlers:
            try:
                handler.flush()
            except Exception:
                pass
        try:
            sys.stdout.flush()
        except Exception:
            pass
        os._exit(EXIT_CODE)


_watch: Optional[_Watch] = None


def _to_log_files(line: str) -> None:
    """``line`` at ERROR in the root logger's files only (``train.log``), not on its console."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "%s", (line,), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in KEEPALIVE:
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _serve(watch: _Watch, listener: socket.socket) -> None:
    """Process 0's thread: accepts the peers' connections and reads what they say."""
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    pending: dict[socket.socket, bytes] = {}
    names: dict[socket.socket, tuple[int, str]] = {}
    said_end: set[socket.socket] = set()
    while True:
        for key, _ in sel.select():
            sock = key.fileobj
            if sock is listener:
                conn, _ = listener.accept()
                _keepalive(conn)
                sel.register(conn, selectors.EVENT_READ)
                pending[conn] = b""
                watch.send(conn, f"hello 0 {watch.node}")
                continue
            try:
                data = sock.recv(4096)
            except OSError:
                data = b""
            if not data:
                sel.unregister(sock)
                if sock in names and sock not in said_end:
                    watch.peer_died(*names[sock])
                continue
            pending[sock] += data
            *lines, pending[sock] = pending[sock].split(b"\n")
            for raw in lines:
                word, _, rest = raw.decode(errors="replace").partition(" ")
                if word == "hello":
                    pid, _, node = rest.partition(" ")
                    names[sock] = (int(pid), node)
                    watch.conns[int(pid)] = sock
                elif word == "end" and sock in names:
                    said_end.add(sock)
                    status, _, line = rest.partition(" ")
                    watch.peer_ended(*names[sock], status, line)


def _follow(watch: _Watch, sock: socket.socket, zero_node: str) -> None:
    """Process i > 0's thread: reads what process 0 says; its connection closing first means it died."""
    buffer, said_end = b"", False
    while True:
        try:
            data = sock.recv(4096)
        except OSError:
            data = b""
        if not data:
            if not said_end:
                watch.peer_died(0, zero_node)
            return
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        for raw in lines:
            word, _, rest = raw.decode(errors="replace").partition(" ")
            if word == "hello":
                zero_node = rest.partition(" ")[2] or zero_node
            elif word == "end":
                said_end = True
                status, _, line = rest.partition(" ")
                watch.peer_ended(0, zero_node, status, line)
            elif word == "dead" and not watch.ended.is_set():
                watch.peer_death.set()
                log.error("process 0 stops the job: process %s died", rest)
                watch.exit()


def start(
    process_id: int, num_processes: int, coordinator_host: str, run_dir: Path, resume_hint: Callable[[], str]
) -> None:
    """Starts watching the job's other processes (call after ``jax.distributed.initialize``, on every process).

    Process 0 listens on a free port of every address and publishes it under ``KEY``; process i > 0 connects to
    ``coordinator_host`` on it. A failure to set this up is one log line: the job runs without the watch.
    """
    global _watch
    if num_processes < 2 or _watch is not None:
        return
    watch = _Watch(process_id, num_processes, run_dir, resume_hint)
    try:
        from core import compat

        client = compat.distributed_client()
        if client is None:
            raise RuntimeError("no coordination service client")
        if process_id == 0:
            listener = socket.create_server(("", 0), family=socket.AF_INET, backlog=max(16, num_processes))
            client.key_value_set(KEY, str(listener.getsockname()[1]))
            threading.Thread(target=_serve, args=(watch, listener), name="peers", daemon=True).start()
        else:
            port = int(client.blocking_key_value_get(KEY, int(CONNECT_TIMEOUT_S * 1000)))
            sock = socket.create_connection((coordinator_host, port), timeout=CONNECT_TIMEOUT_S)
            sock.settimeout(None)
            _keepalive(sock)
            watch.server = sock
            watch.send(sock, f"hello {process_id} {watch.node}")
            threading.Thread(target=_follow, args=(watch, sock, coordinator_host), name="peers", daemon=True).start()
    except Exception as e:  # the run goes on; a dead peer is then found by JAX's heartbeats
        log.warning("the processes cannot watch each other (%s): a dead process is found by JAX's heartbeat", e)
        return
    _watch = watch
    atexit.register(finished, "exit")


def on_death(callback: Optional[Callable[[str], None]]) -> None:
    """``callback(line)`` writes the run's ``summary.json`` when process 0 stops for a dead or failed peer."""
    if _watch is not None:
        _watch.on_death = callback


def finished(status: str = "ok", line: str = "") -> None:
    """This process's run ended (``status``: ok, stopped, failed, or exit at the process's exit): the peers no longer
    treat its exit as a death; a failure's ``line`` is said by process 0 (``peer_ended``). Once; then nothing."""
    if _watch is not None:
        _watch.finished(status, line)


def await_peer_death(timeout_s: float) -> bool:
    """After an error of a collective (a dead peer's connection reset it): waits up to ``timeout_s`` for the watch to
    see that peer's death. True: it did, and this process is exiting on the watch's thread (the caller waits); False:
    no peer died (or there is no watch), the error is the caller's to report."""
    if _watch is None:
        return False
    if _watch.peer_death.wait(timeout_s):
        while True:  # the watch's thread says the line, writes the summary and ends the process
            time.sleep(1.0)
    return False
