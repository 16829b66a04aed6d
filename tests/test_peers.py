"""The pieces of a multi-process job's watch and output, in-process: gloo's lines left out (also two interleaved),
the filter's stop after a death, the death line, a preempted SLURM job's requeue decision, and two watches talking
over a real socket pair. The whole mechanism against real processes: tests/test_preemption.py (launch_local) and
tests/test_cluster.py (SLURM)."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from training import native_output, peers, slurm

GLOO = b"[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
# two threads' lines, interleaved word by word, as a 2-task SLURM job printed them
INTERLEAVED = (
    b"[Gloo] Rank 0[Gloo] Rank 0 is connected to  is connected to 11 peer ranks.  peer ranks. Expected number of "
    b"connected peer ranks is : Expected number of connected peer ranks is : 11\n"
)


@pytest.mark.unit
def test_gloo_lines_and_interleaved_ones_are_noise_and_nothing_else():
    assert native_output.is_gloo_noise(GLOO) and native_output.is_gloo_noise(INTERLEAVED)
    assert native_output.is_gloo_noise(
        b" is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\n"
    )
    assert not native_output.is_gloo_noise(b"[Gloo] Rank 0 lost its peer: connection reset\n")
    assert not native_output.is_gloo_noise(b"3\n")  # only right after a gloo line (copy_filtered)
    assert not native_output.is_gloo_noise(b"error: step 10 failed\n")


def _filtered(chunks: list[bytes]) -> bytes:
    read_in, write_in = os.pipe()
    read_out, write_out = os.pipe()
    copier = threading.Thread(target=native_output.copy_filtered, args=({read_in: write_out},))
    copier.start()
    for chunk in chunks:
        os.write(write_in, chunk)
    os.close(write_in)
    copier.join(10)
    os.close(write_out)
    with os.fdopen(read_out, "rb") as f:
        data = f.read()
    os.close(read_in)
    return data


@pytest.mark.unit
def test_the_filter_copies_everything_else_and_stops_after_quiet():
    out = _filtered(
        [b"start\n", GLOO[:20], GLOO[20:], INTERLEAVED, b"\n", b"3\n", b"train: 50%\rtrain: 100%\n", b"7\n"]
    )
    assert out == b"start\ntrain: 50%\rtrain: 100%\n7\n"
    out = _filtered([b"error: process 1 died\n", native_output.QUIET, b"F1207 client.h:80] Terminating process\n"])
    assert out == b"error: process 1 died\n"


@pytest.mark.unit
def test_death_line_names_the_process_its_task_and_node(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    line = peers.death_line(1, 2, "n2", "died", "continue with the same command and checkpoint.dir=/c")
    assert line == (
        "process 1 of 2 (SLURM task 1 on node n2) died without a word (killed from outside, e.g. out of memory, or "
        "crashed); the job cannot go on without it and every other process stopped; continue with the same command "
        "and checkpoint.dir=/c"
    )
    monkeypatch.delenv("SLURM_JOB_ID")
    assert peers.who(0, 4, "vm") == "process 0 of 4 on host vm"
    assert peers.death_line(3, 4, "h", "failed: error: x", "r").startswith("process 3 of 4 on host h failed: error: x;")


@pytest.mark.unit
@pytest.mark.parametrize(
    "env, fields, expected",
    [
        (
            {"SLURM_JOB_ID": "7"},
            {"PreemptTime": "2026-12-07T06:55:06", "Requeue": "1", "BatchFlag": "1"},
            ("7", "preempted"),
        ),
        (
            {"SLURM_JOB_ID": "7"},
            {"PreemptTime": "None", "Requeue": "1", "BatchFlag": "1", "Restarts": "1"},
            ("7", "requeued"),
        ),
        (
            {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"},
            {"PreemptTime": "None", "Requeue": "1", "BatchFlag": "1", "Restarts": "1"},
            None,
        ),
        (
            {"SLURM_JOB_ID": "7"},
            {"PreemptTime": "None", "Requeue": "1", "BatchFlag": "1", "Restarts": "0"},
            None,
        ),  # scancel
        ({"SLURM_JOB_ID": "7"}, {"PreemptTime": "2026-12-07T06:55:06", "Requeue": "0", "BatchFlag": "1"}, None),
        ({"SLURM_JOB_ID": "7", "SUBMITIT_EXECUTOR": "slurm"}, {"PreemptTime": "2026", "Requeue": "1"}, None),
        ({}, {}, None),
    ],
)
def test_a_job_comes_back_only_when_slurm_requeues_it_or_it_was_preempted(monkeypatch, env, fields, expected):
    monkeypatch.setattr(slurm, "job_fields", lambda job: fields)
    assert slurm.comes_back(env) == expected


@pytest.mark.unit
def test_process_0_says_a_peers_death_and_tells_the_others(tmp_path, monkeypatch):
    """Process 0's watch with two peers on socket pairs: peer 1 closes without saying how its run ended (it died):
    process 0 writes the summary, says the line once, tells peer 2 and ends the process (here: recorded)."""
    exits, said = [], []
    monkeypatch.setattr(peers._Watch, "exit", lambda self: exits.append(self.process_id))
    monkeypatch.setattr(os, "write", lambda fd, data: said.append((fd, data)) or len(data))
    watch = peers._Watch(0, 3, tmp_path, lambda: "resume as said")
    watch.node = "n1"
    summaries = []
    watch.on_death = summaries.append
    listener = socket.create_server(("127.0.0.1", 0))
    server = threading.Thread(target=peers._serve, args=(watch, listener), daemon=True)
    server.start()
    clients = [socket.create_connection(listener.getsockname()) for _ in range(2)]
    clients[0].sendall(b"hello 1 n2\n")
    clients[1].sendall(b"hello 2 n3\n")
    assert clients[1].recv(100).startswith(b"hello 0 n1")
    clients[0].recv(100)
    clients[1].settimeout(10)
    for _ in range(100):  # both peers' hellos read
        if len(watch.conns) == 2:
            break
        threading.Event().wait(0.05)
    clients[0].close()  # process 1 dies
    told = clients[1].recv(100)
    assert told == b"dead 1 n2\n"
    for _ in range(200):  # peer 2 is told first; the line, the summary and the exit come after it
        if exits:
            break
        threading.Event().wait(0.05)
    line = (
        "process 1 of 3 on host n2 died without a word (killed from outside, e.g. out of memory, or crashed); the job "
        "cannot go on without it and every other process stopped; resume as said"
    )
    assert summaries == [line] and said == [(2, f"error: {line}\n".encode())] and exits == [0]
    clients[1].close()
    listener.close()


@pytest.mark.unit
def test_a_peer_that_said_its_run_ended_is_not_a_death(tmp_path, monkeypatch):
    exits = []
    monkeypatch.setattr(peers._Watch, "exit", lambda self: exits.append(self.process_id))
    watch = peers._Watch(0, 2, tmp_path, lambda: "r")
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=peers._serve, args=(watch, listener), daemon=True).start()
    client = socket.create_connection(listener.getsockname())
    client.sendall(b"hello 1 n2\nend stopped\n")
    client.recv(100)
    client.close()
    threading.Event().wait(0.5)
    assert exits == [] and not watch.peer_death.is_set()
    listener.close()
