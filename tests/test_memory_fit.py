"""A model too large for the memory it may use (measure/memory.py): one ``error:`` line with the state's bytes, the
limit and where it comes from, and only the ways out that fit by those figures; before the build when the state
alone cannot fit (not after 40 s of building and a 22-line traceback), and for an allocation of a step that fails."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
import types

import jax
import pytest

from core.errors import TrainingError
from measure import address_space, memory
from measure.address_space import stack_bytes
from training import process
from utils import REPO, make_cfg


@pytest.mark.unit
def test_a_state_that_cannot_fit_is_one_line_before_anything_is_built(monkeypatch):
    """8 simulated CPU devices each hold a copy of the replicated state in this process, and its build takes as much
    again (the initialisation's temporaries): above a (fake) limit of 10 MB, the line gives the bytes and the ways out
    that fit by them (2 devices, a smaller model), and the state is never created."""
    from parallel.base import ParallelMode
    from training.build import build, plan

    init_state = ParallelMode.init_state
    monkeypatch.setattr(memory, "memory_limit", lambda device: (10_000_000, "a test limit"))
    monkeypatch.setattr(ParallelMode, "init_state", lambda *a, **k: pytest.fail("the state was built"))
    p = plan(make_cfg({"data": {"name": "synthetic"}, "wandb": {"mode": "disabled"}}))
    with pytest.raises(TrainingError) as e:
        build(p)
    assert str(e.value) == (
        "the model's parameters and optimizer state (203,530 params) take 2.44 MB per device, 19.54 MB for the 8 "
        "simulated CPU devices of this process, twice that while it is built, above the 10.00 MB free under a test "
        "limit; ways out: mesh.devices=2 (a copy of 2.44 MB each); a smaller model (at most about 52,082 params, "
        "built and with their gradients); a smaller batch, model.remat, model.loss_chunk or bf16 shrink only the "
        "activations, not this state"
    )
    monkeypatch.setattr(memory, "memory_limit", lambda device: (39_000_000, "a test limit"))
    with pytest.raises(TrainingError, match="twice that while it is built, above the 39.00 MB free"):
        build(plan(make_cfg({"data": {"name": "synthetic"}, "wandb": {"mode": "disabled"}})))
    monkeypatch.setattr(memory, "memory_limit", lambda device: (40_000_000, "a test limit"))
    monkeypatch.setattr(ParallelMode, "init_state", init_state)  # twice 19.54 MB fit in 40 MB: built
    assert build(plan(make_cfg({"data": {"name": "synthetic"}, "wandb": {"mode": "disabled"}}))).state is not None


@pytest.mark.unit
def test_the_ways_out_of_a_state_too_large_work_when_followed(monkeypatch):
    """A device count is offered only when it divides the global batch into its microbatches (training.build.plan
    refuses any other) and its copies fit while they are built (twice 2.44 MB a copy here: more than a copy and its
    gradients of 0.81 MB); SGD only when its state and the gradients fit (6.51 MB each for 8 devices: 13.02 MB).
    Following the offered count builds the run under the same limit."""
    from parallel.base import ParallelMode
    from training.build import build, plan

    def ways(limit_bytes: int, **train) -> list[str]:
        monkeypatch.setattr(memory, "memory_limit", lambda device: (limit_bytes, "a test limit"))
        cfg = make_cfg({"data": {"name": "synthetic"}, "wandb": {"mode": "disabled"}, "train": train})
        with pytest.raises(TrainingError) as e:
            build(plan(cfg))
        return str(e.value).split("; ways out: ")[1].split("; ")[:-2]

    monkeypatch.setattr(ParallelMode, "init_state", lambda *a, **k: pytest.fail("the state was built"))
    # 15 MB hold 3 copies of 4.88 MB (a state being built): 256 is not divisible by 3, 24 is, not into 3 x 3
    sgd = "optim=sgd (no moments: 6.51 MB and as much for the gradients)"
    assert ways(10_000_000) == ["mesh.devices=2 (a copy of 2.44 MB each)"]
    assert ways(15_000_000) == ["mesh.devices=2 (a copy of 2.44 MB each)", sgd]
    assert ways(15_000_000, global_batch=24) == ["mesh.devices=3 (a copy of 2.44 MB each)", sgd]
    assert ways(15_000_000, global_batch=24, accum_steps=3) == ["mesh.devices=2 (a copy of 2.44 MB each)", sgd]
    assert ways(13_100_000) == [
        "mesh.devices=2 (a copy of 2.44 MB each)",
        "optim=sgd (no moments: 6.51 MB and as much for the gradients)",
    ]
    assert ways(13_000_000) == ["mesh.devices=2 (a copy of 2.44 MB each)"]  # 13.02 MB for SGD: not offered
    monkeypatch.undo()
    monkeypatch.setattr(memory, "memory_limit", lambda device: (10_000_000, "a test limit"))
    cfg = make_cfg({"data": {"name": "synthetic"}, "wandb": {"mode": "disabled"}, "mesh": {"devices": 2}})
    assert build(plan(cfg)).state is not None


def train_under_rlimit_as(limit_bytes: int, run_dir, *overrides: str) -> subprocess.CompletedProcess:
    """``python train.py`` under a real ``RLIMIT_AS`` of ``limit_bytes`` (bash's ``ulimit -v``: no fork of this
    multithreaded process with a ``preexec_fn``)."""
    train = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", "wandb.mode=disabled", *overrides]
    limit = f'ulimit -v {limit_bytes // 1024} && exec "$@"'
    return subprocess.run(["bash", "-c", limit, "bash", *train], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_a_gpt_too_large_under_rlimit_as_stops_at_once_in_one_line(tmp_path):
    """GPT-2 small (124M params, 1.49 GB of fp32 state with Adam) replicated on 8 simulated CPU devices under
    ``ulimit -v`` 4 GB: one line in seconds naming RLIMIT_AS, and only the ways out that fit (one device, a smaller
    model); not SGD (its 3.98 GB does not fit either). Before: 40 s of building, then a 22-line traceback."""
    t0 = time.perf_counter()
    proc = train_under_rlimit_as(
        4_000_000_000, tmp_path / "run", "model=gpt", "model.size=gpt2_small", "data=synthetic", "train.steps=2"
    )
    took_s = time.perf_counter() - t0
    assert proc.returncode == 1, proc.stderr[-3000:]
    (line,) = proc.stderr.splitlines()
    head = (
        "error: the model's parameters and optimizer state (124,439,808 params) take 1.49 GB per device, 11.95 GB for "
        "the 8 simulated CPU devices of this process, twice that while it is built, above the "
    )
    assert line.startswith(head), line
    assert " GB free under RLIMIT_AS (ulimit -v) of 4.00 GB, " in line
    ways = line.split("; ways out: ")[1].split("; ")
    assert ways[0] == "mesh.devices=1 (a copy of 1.49 GB each)" and ways[1].startswith(
        "a smaller model (at most about "
    )
    # or a limit with room for the state while it is built (twice its bytes: it stays mapped) and what comes later
    taken = re.search(r", ([\d.]+) ([MG])B of it taken by the process", line)
    taken = float(taken[1]) * (1e9 if taken[2] == "G" else 1e6)
    state = 8 * 124_439_808 * 4 * 3  # Adam: params and two moments, float32, on 8 devices
    later = state // 8 + 16 * stack_bytes()  # the threads to come and a copy of the state to save
    needed = (taken + 2 * state + later) * 1.1 + 16 * 2**20  # with 10% to spare
    if not beyond_the_machine(ways[2], needed / 1.1 - taken):
        kib = int(re.fullmatch(r"more address space: ulimit -v (\d+) or more", ways[2])[1])
        assert -6_000_000 <= kib * 1024 - needed <= 10_240_000 + 6_000_000, (kib, needed)  # rounded up; taken to 5 MB
    assert (
        ways[3] == "a smaller batch, model.remat, model.loss_chunk or bf16 shrink only the activations, not this state"
    )
    assert len(ways) == 4 and took_s < 60, (ways, took_s)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == line.removeprefix("error: ")


@pytest.mark.unit
def test_an_allocation_that_fails_in_a_step_is_one_line_with_the_ways_that_fit(monkeypatch):
    """The state fits, a step's allocation does not: XLA's words, the state's bytes beside the limit, and the ways
    out sized by the failed allocation against the room left (here 4 times: accumulation in 4 microbatches; bf16,
    remat and loss chunks halve at most, so they are not offered); an allocation up to twice the room offers them;
    another XLA error is not reworded."""
    from training.build import state_init_fn
    from training.run import disk_full_as_error

    monkeypatch.setattr(process, "phase", "steps")  # (in-process runs of other tests leave it at "end")
    cfg = make_cfg({"model": {"name": "gpt"}, "data": {"name": "synthetic"}, "mesh": {"devices": 1}})
    monkeypatch.setattr(memory, "memory_limit", lambda device: (1_010_000_000, "a test limit"))
    graphdef, init_fn = state_init_fn(cfg, __import__("optax").adam(1e-3))
    devices = jax.devices()[:1]
    memory.check_state_fits(
        cfg,
        init_fn,
        lambda abstract: jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(devices[0]), abstract),
        devices,
    )
    held = memory._figures["held"]
    room = 1_010_000_000 - held
    cpu = memory._figures["device"]
    memory._figures["device"] = types.SimpleNamespace(platform="tpu")  # the activation levers: accelerators only

    def failing(n_bytes: int) -> str:
        with pytest.raises(TrainingError) as e, disk_full_as_error(REPO):
            raise jax.errors.JaxRuntimeError(f"RESOURCE_EXHAUSTED: Out of memory allocating {n_bytes} bytes.")
        return str(e.value)

    said = failing(int(3.5 * room))
    assert said == (
        f"out of memory (RESOURCE_EXHAUSTED: Out of memory allocating {int(3.5 * room)} bytes.); the state takes "
        f"{memory.gb(held)} per device ({memory.gb(held)} in all) of the 1.01 GB free under a test limit: the step "
        f"needs about 3.5 times the {memory.gb(room)} left beside it; ways out: train.accum_steps=4 (the same global "
        f"batch in 4 microbatches)"
    )
    assert failing(int(1.5 * room)).endswith(
        "ways out: train.accum_steps=2 (the same global batch in 2 microbatches); model.remat=full; "
        "model.loss_chunk=1024; precision=bf16"
    )
    # below the room: still halved, by a count above the current one (accum_steps=1 would change nothing)
    assert "ways out: train.accum_steps=2 (the same global batch in 2 microbatches); " in failing(int(0.7 * room))
    with pytest.raises(jax.errors.JaxRuntimeError), disk_full_as_error(REPO):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")
    with pytest.raises(RuntimeError, match="^dictionary changed"), disk_full_as_error(REPO):
        raise RuntimeError("dictionary changed size during iteration")  # not memory: its traceback goes on
    with pytest.raises(TrainingError) as thread, disk_full_as_error(REPO):  # a thread's stack under ulimit -v
        raise RuntimeError("can't start new thread")
    assert str(thread.value) == (  # no size, before the step was compiled: not the step's (nor accumulation's)
        "out of memory (can't start new thread) before the training step was compiled (building the state of "
        f"{memory.gb(held)}, reading the data), under a test limit; ways out: a smaller model, or a machine with "
        "more memory"
    )
    memory._figures.update(step_temporaries=room // 2, micro=256)  # the step compiled: its temporaries half the room
    with pytest.raises(TrainingError) as thread, disk_full_as_error(REPO):
        raise RuntimeError("can't start new thread")
    assert str(thread.value).startswith("out of memory (can't start new thread); the state takes ")
    assert ": the step needs more than the " in str(thread.value)  # no size known: no "about N times"
    monkeypatch.setattr(process, "phase", "end")  # every step ran: orbax's thread of the final save, say
    with pytest.raises(TrainingError) as end, disk_full_as_error(REPO):
        raise RuntimeError("can't start new thread")
    assert str(end.value) == (
        "out of memory (can't start new thread) after the training steps, while saving or evaluating; every step "
        "ran: with more memory the same command finishes from the newest checkpoint (or says the run is complete)"
    )
    monkeypatch.setattr(process, "phase", "steps")
    memory._figures["params"], params = room // 2, memory._figures["params"]  # gradients of half the room: the
    # step's 1.5x is not activations, so remat and bf16 (which adds bf16 copies of the weights) would not help
    assert failing(int(1.5 * room)).endswith("ways out: train.accum_steps=2 (the same global batch in 2 microbatches)")
    memory._figures["params"] = params
    cfg.model.context = 4  # 256 x 4 = 1,024 tokens per microbatch: one chunk of 1,024 would only pad them
    assert failing(int(1.5 * room)).endswith("; model.remat=full; precision=bf16")
    memory._figures["device"] = cpu  # on the CPU remat and the chunked loss did not lower the peak, bf16 raised it
    assert failing(int(1.5 * room)).endswith("ways out: train.accum_steps=2 (the same global batch in 2 microbatches)")
    cfg.model.context = None
    cfg.train.accum_steps = 2  # 128 examples per device: 2 x 3 = 6 microbatches do not divide them, 8 do
    assert "ways out: train.accum_steps=8 (the same global batch in 8 microbatches)" in failing(int(2.5 * room))
    # after the build the state's bytes are taken: the limit now leaves the same room beside it
    monkeypatch.setattr(memory, "memory_limit", lambda device: (1_010_000_000 - held, "a test limit"))
    memory.check_step_fits(held + room)  # a compiled step that fits: nothing to say
    memory.check_step_fits(None)  # no memory analysis
    with pytest.raises(TrainingError) as e:
        memory.check_step_fits(held + int(3.5 * room))
    assert str(e.value) == (
        f"out of memory: the compiled step needs {memory.gb(held + int(3.5 * room))} per device; the state takes "
        f"{memory.gb(held)} per device ({memory.gb(held)} in all) of the 1.01 GB free under a test limit: the step "
        f"needs about 3.5 times the {memory.gb(room)} left beside it; ways out: train.accum_steps=8 (the same global "
        f"batch in 8 microbatches)"
    )
    # the process grew by half the room since the state's check (compiled code, the runtime's threads): the same
    # step no longer fits, judged by what is free now, not by the figure from before the compilation
    monkeypatch.setattr(memory, "memory_limit", lambda device: (1_010_000_000 - held - room // 2, "a test limit"))
    with pytest.raises(TrainingError, match=r"needs about 2\.0 times the .* ways out: train.accum_steps=4 "):
        memory.check_step_fits(held + room)
    # more free now than before the state was built (another process ended): the figure stays the earlier one
    monkeypatch.setattr(memory, "memory_limit", lambda device: (5_000_000_000, "a test limit"))
    memory.check_step_fits(held + room // 4)
    assert memory._figures["free"] == 1_010_000_000 - room // 2


@pytest.mark.unit
def test_a_step_too_large_for_every_simulated_device_offers_fewer_devices(monkeypatch):
    """The MLP's state (2.44 MB, Adam) on 8 simulated devices in 30 MB: a step needing 50 MB per device beside it
    cannot fit by accumulation alone (32 examples per device, 38 times the room); 4 devices, each with a copy of
    the state and its gradients, leave room for the activations of 32 microbatches (7, 6, 5 do not divide 256)."""
    from training.build import state_init_fn
    from training.run import disk_full_as_error

    monkeypatch.setattr(process, "phase", "steps")
    cfg = make_cfg({"data": {"name": "synthetic"}})
    monkeypatch.setattr(memory, "memory_limit", lambda device: (40_000_000, "a test limit"))  # built: twice 19.54 MB
    graphdef, init_fn = state_init_fn(cfg, __import__("optax").adam(1e-3))
    devices = jax.devices()
    replicated = jax.sharding.NamedSharding(jax.sharding.Mesh(devices, ("data",)), jax.sharding.PartitionSpec())
    memory.check_state_fits(cfg, init_fn, lambda abstract: jax.tree.map(lambda _: replicated, abstract), devices)
    memory._figures["free"] = 30_000_000  # for the steps
    with pytest.raises(TrainingError) as e, disk_full_as_error(REPO):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 50000000 bytes.")
    assert str(e.value).endswith(
        ": the step needs about 38.2 times the 10.46 MB left beside it; ways out: mesh.devices=4 "
        "train.accum_steps=32 (a copy of the state on each of 4 devices)"
    ), str(e.value)
    # FSDP on simulated devices: 1/8 of the state each, the same bytes in all, so fewer devices would not shrink it;
    # 0.5 MB beside 2.44 MB leave less than the gradients' 0.81 MB: only a smaller model, with its size
    f = memory._figures
    f.update(per_device=f["total"] // 8, held=f["total"], free=f["total"] + 500_000)
    with pytest.raises(TrainingError) as e, disk_full_as_error(REPO):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 50000000 bytes.")
    assert str(e.value).endswith(
        "leaving less than its gradients need; ways out: a smaller model (at most about 183,897 params with their "
        "gradients)"
    ), str(e.value)
    f.update(per_device=f["total"], held=8 * f["total"], free=8 * f["total"] + 500_000)  # replicated: 8 copies
    # replicated: fewer copies leave room for the activations in more microbatches
    with pytest.raises(TrainingError, match=r"params with their gradients\); mesh.devices=4 train.accum_steps=64 \("):
        with disk_full_as_error(REPO):
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 50000000 bytes.")


def beyond_the_machine(way: str, beyond: float) -> bool:
    """Whether ``way`` (the line's last) is a machine with more memory, as it must be where ``beyond`` (bytes the
    process needs beyond what it holds) exceeds the machine's free memory (``MemAvailable``; either within 10%)."""
    machine = address_space.meminfo("MemAvailable", "/proc/meminfo")
    said = re.fullmatch(
        r"a machine with more memory \(about ([\d.]+) GB more than the process holds, ([\d.]+) GB free\)", way
    )
    if abs(beyond - machine) > 0.1 * machine:
        assert bool(said) == (beyond > machine), (way, beyond, machine)
    return bool(said)


def assert_limit_offered_fits(line: str) -> None:
    """The ``ulimit -v`` a line offers holds what the process had taken and all the step needs beside its state,
    with 10% to spare."""
    n_bytes = lambda m: float(m[1]) * (1e9 if m[2] == "G" else 1e6)  # noqa: E731
    needed = n_bytes(re.search(r": ([\d.]+) ([MG])B; the state takes", line))
    taken = n_bytes(re.search(r", ([\d.]+) ([MG])B of it taken by the process", line))
    if beyond_the_machine(line.rsplit("; ", 1)[1], needed):
        return
    kib = int(re.search(r"; more address space: ulimit -v (\d+) or more$", line)[1])
    # with 10% to spare, rounded up to 10,000 KiB; the figures of the line to 5 MB each (GB with two decimals)
    offered = (needed + taken) * 1.1 + 16 * 2**20
    assert -11_000_000 <= kib * 1024 - offered <= 10_240_000 + 11_000_000, (kib, needed, taken)


GPT_2048 = ("model=gpt", "model.size=tiny", "model.depth=1", "model.width=32", "model.heads=2", "model.context=2048")


def test_a_compiled_step_too_large_for_the_simulated_devices_stops_before_it_runs(tmp_path):
    """GPT with 2048 tokens of context: its 8.30 MB of state fit in ``ulimit -v`` 4 GB, but the compiled step needs
    3.34 GB per device, 26.69 GB for the 8 simulated CPU devices of this process, and under RLIMIT_AS the CPU
    runtime's own buffers as much again (53.38 GB): one line after compiling, sized for all of them (accumulation in
    32 microbatches, about 17 times the room), with no line of XLA's own and no metrics. Before: a step whose allocation
    failed, XLA's ``allocate of <9> failed.`` on stderr, then ``train.accum_steps=1`` offered (the current value; 0.8
    times the room: one device's allocation)."""
    proc = train_under_rlimit_as(4_000_000_000, tmp_path / "run", *GPT_2048, "data=synthetic", "train.steps=2")
    assert proc.returncode == 1, proc.stderr[-3000:]
    (line,) = proc.stderr.splitlines()
    assert line.startswith(
        "error: out of memory: the compiled step needs 3.34 GB per device, 26.69 GB for the 8 simulated CPU devices "
        "of this process, and the CPU runtime's own buffers (YNNPACK's, threads') about as much again in address "
        "space, and 135.26 MB for threads to come and a copy of the state to save: 53.51 GB; the state takes 1.04 MB "
        "per device (8.30 MB in all) of the "
    ), line
    assert "; ways out: train.accum_steps=32 (the same global batch in 32 microbatches); " in line
    assert_limit_offered_fits(line)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == line.removeprefix("error: ")


def test_a_step_whose_compiled_peak_fits_but_not_the_cpu_runtime_beside_it_stops_before_it_runs(tmp_path):
    """The same GPT under ``ulimit -v`` 6 GB at ``train.accum_steps=8``: the compiled peak (423.57 MB per device,
    3.39 GB for 8) fits the 4.4 GB free, but the step needs 5.6 GB of address space (VmPeak less VmSize before it,
    measured without a limit: YNNPACK's intermediates beside XLA's buffers). One line, sized with the runtime's
    share, offers 16 microbatches (which train in 3.4 GB: the slow test below). Before: the check passed, YNNPACK's
    ``allocate of <28> failed.`` lines, then an all-reduce's rendezvous timeout aborted the process in C++ (exit 134,
    no summary.json)."""
    proc = train_under_rlimit_as(6_000_000_000, tmp_path / "run", *GPT_2048, "data=synthetic", "train.accum_steps=8")
    assert proc.returncode == 1, proc.stderr[-3000:]
    (line,) = proc.stderr.splitlines()
    assert line.startswith(
        "error: out of memory: the compiled step needs 423.57 MB per device, 3.39 GB for the 8 simulated CPU devices "
        "of this process, and the CPU runtime's own buffers (YNNPACK's, threads') about as much again in address "
        "space, and 135.26 MB for threads to come and a copy of the state to save: 6.90 GB; "
    ), line
    assert "; ways out: train.accum_steps=16 (the same global batch in 16 microbatches); more address" in line, line
    assert_limit_offered_fits(line)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == line.removeprefix("error: ")


@pytest.mark.slow
def test_the_accumulation_offered_under_rlimit_as_trains(tmp_path):
    """Following the line of the test above (and of the run at ``train.accum_steps=1``, which offers the same 16)
    under the same ``ulimit -v`` 6 GB trains: a finite loss, status ok (about 2 minutes on 2 busy cores)."""
    run = tmp_path / "run"
    proc = train_under_rlimit_as(
        6_000_000_000, run, *GPT_2048, "data=synthetic", "train.accum_steps=16", "train.steps=1"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and 5.0 < summary["train/loss"] < 6.0, summary


@pytest.mark.unit
def test_under_rlimit_as_the_cpu_runtime_counts_beside_the_compiled_peak(monkeypatch):
    """Under RLIMIT_AS (and only there) a CPU step's temporaries count twice against the room: a peak of 0.6 times
    the room fits under another limit, not under RLIMIT_AS (1.2 times); the state itself (already allocated) does not
    count twice; a GPT's extra is bounded by its attention scores. A YNNPACK operation that failed is out of memory
    under RLIMIT_AS (its allocations are its own and unnamed), another error under it without one."""
    from training.run import disk_full_as_error

    cfg = make_cfg({"model": {"name": "gpt"}, "data": {"name": "synthetic"}, "mesh": {"devices": 1}})
    devices = jax.devices()[:1]
    limit = 1_010_000_000
    memory._figures.clear()
    memory._figures.update(per_device=10_000_000, held=10_000_000, params=1_000_000, copies=1, cfg=cfg, n=1)
    memory._figures.update(total=10_000_000, n_params=250_000)
    memory._figures.update(device=devices[0], free=limit, source="a test limit")
    room = limit - 10_000_000
    monkeypatch.setattr(memory, "memory_limit", lambda device: (room, "the free memory (MemAvailable ...)"))
    memory.check_step_fits(10_000_000 + int(0.6 * room))  # fits: XLA's figure alone
    as_limit = "RLIMIT_AS (ulimit -v) of 1.01 GB, 0.10 GB of it taken by the process"
    monkeypatch.setattr(memory, "memory_limit", lambda device: (room, as_limit))
    # and beside them the threads still to come (16 stacks) and a copy of the state to save
    later = memory.LATER_THREADS * stack_bytes() + 10_000_000
    with pytest.raises(TrainingError) as e:
        memory.check_step_fits(10_000_000 + int(0.6 * room))
    assert memory.later_bytes() == later
    said = f"about as much again in address space, and {memory.gb(later)} for threads to come and a copy of the state"
    assert f"{said} to save: {memory.gb(10_000_000 + 2 * int(0.6 * room) + later)}; " in str(e.value)
    times = (2 * int(0.6 * room) + later) / room
    assert f"the step needs about {times:.1f} times the 1.00 GB left beside it; ways out: train.accum_steps=2 " in str(
        e.value
    )
    memory.check_step_fits(10_000_000 + int(0.49 * (room - later)))  # twice 0.49 of what the later ones leave fits
    # a GPT: the runtime's share is at most 4 times one layer's attention scores (256 examples x 4 heads x 128^2 x
    # 4 bytes: 67.11 MB), not as much again as the temporaries (context 128 took 1.00 times the compiled peak)
    from models.gpt import resolve_dims

    memory.check_step_fits(10_000_000 + int(0.55 * room), resolve_dims("tiny"))  # 0.55 + 0.27 + later: fits
    with pytest.raises(TrainingError) as e:
        memory.check_step_fits(10_000_000 + int(0.8 * room), resolve_dims("tiny"))
    assert "(YNNPACK's, threads') about 268.44 MB more in address space, and " in str(e.value)
    memory._figures["free"] = limit

    ynn = "INTERNAL: YNNPACK operation failed: ..."
    monkeypatch.setattr(memory.resource, "getrlimit", lambda which: (6_000_000_000, memory.resource.RLIM_INFINITY))
    with pytest.raises(TrainingError, match=r"^out of memory \(INTERNAL: YNNPACK operation failed"):
        with disk_full_as_error(REPO):
            raise jax.errors.JaxRuntimeError(ynn)
    with pytest.raises(TrainingError, match=r"^out of memory \(error return without exception set\)"):
        with disk_full_as_error(REPO):  # C code (here under jax.vmap's tracing) whose allocation failed, unsaid
            raise SystemError("error return without exception set")
    inf = memory.resource.RLIM_INFINITY
    monkeypatch.setattr(memory.resource, "getrlimit", lambda which: (inf, inf))
    with pytest.raises(jax.errors.JaxRuntimeError), disk_full_as_error(REPO):
        raise jax.errors.JaxRuntimeError(ynn)
    with pytest.raises(SystemError), disk_full_as_error(REPO):  # without a limit: a bug, its traceback
        raise SystemError("error return without exception set")


@pytest.mark.unit
def test_under_rlimit_as_malloc_arenas_are_capped(monkeypatch):
    """Under RLIMIT_AS, and only there, glibc's arenas (64 MiB of address space each) are capped at 2 with
    ``mallopt(M_ARENA_MAX, 2)``; a MALLOC_ARENA_MAX of the user's is kept; not glibc: nothing."""
    calls = []

    class Libc:
        def mallopt(self, option: int, value: int) -> int:
            calls.append((option, value))
            return 1

    monkeypatch.setattr(address_space.ctypes, "CDLL", lambda name: Libc())
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    inf = address_space.resource.RLIM_INFINITY
    monkeypatch.setattr(address_space.resource, "getrlimit", lambda which: (inf, inf))
    assert address_space.limit_malloc_arenas() is None and calls == []
    monkeypatch.setattr(address_space.resource, "getrlimit", lambda which: (6_000_000_000, inf))
    assert address_space.limit_malloc_arenas() == 2 and calls == [(-3, 131072), (-8, 2)]
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert address_space.limit_malloc_arenas() is None and calls == [(-3, 131072), (-8, 2)]
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    monkeypatch.setattr(address_space.ctypes, "CDLL", lambda name: object())  # no mallopt (not glibc)
    assert address_space.limit_malloc_arenas() is None


@pytest.mark.unit
def test_too_little_address_space_for_the_runtime_is_one_line_before_jax(monkeypatch):
    """Under RLIMIT_AS JAX's CPU runtime needs its libraries, compiler and a stack per thread (2 per simulated device,
    1 per core): below that it aborted in C++ (exit 134). The line gives the limit to set and the fewer devices that
    fit and divide the global batch (7, 6 and 5 do not divide 256)."""
    monkeypatch.delitem(sys.modules, "jaxlib")  # as before the import (the check returns once the runtime is in)
    monkeypatch.setattr(address_space, "limit_malloc_arenas", lambda: None)
    monkeypatch.setattr(address_space, "meminfo", lambda key, path: 166_000_000)
    monkeypatch.setattr(address_space.os, "sched_getaffinity", lambda pid: {0, 1})
    stack = 8 << 20
    limits = {address_space.resource.RLIMIT_STACK: (stack, stack)}
    monkeypatch.setattr(address_space.resource, "getrlimit", lambda which: limits[which])
    cfg = make_cfg({"data": {"name": "synthetic"}})
    need = 166_000_000 + 660_000_000 + stack * (2 * 8 + 2)  # 0.977 GB
    limits[address_space.resource.RLIMIT_AS] = (need, need)
    address_space.check_runtime_fits(cfg)  # fits: nothing to say
    limits[address_space.resource.RLIMIT_AS] = (need - 1, need)
    with pytest.raises(TrainingError) as e:
        address_space.check_runtime_fits(cfg)
    assert str(e.value) == (
        "out of memory: JAX's CPU runtime with 8 simulated device(s) needs about 976.99 MB of address space (its "
        "libraries, compiler and threads), above the RLIMIT_AS (ulimit -v) of 976.99 MB; set ulimit -v 980000 or more, "
        "or fewer simulated devices: runtime.cpu_devices=4"
    )
    cfg.mesh.devices = 8
    with pytest.raises(TrainingError, match=r"runtime.cpu_devices=4 mesh.devices=4$"):
        address_space.check_runtime_fits(cfg)
    monkeypatch.setitem(sys.modules, "jaxlib", types.ModuleType("jaxlib"))  # a sweep's next job: already running
    address_space.check_runtime_fits(cfg)


def test_too_little_address_space_stops_train_py_in_one_line(tmp_path):
    """``ulimit -v`` 0.5 GB: one line before JAX is imported (before: exit 134 from a thread XLA could not start, or
    at 0.3 GB a traceback from jaxlib's import), exit 1, summary.json failed, nothing else written."""
    proc = train_under_rlimit_as(500_000_000, tmp_path / "run", "data=synthetic")
    assert proc.returncode == 1, proc.stderr[-3000:]
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: out of memory: JAX's CPU runtime with 8 simulated device(s) needs about "), line
    assert "above the RLIMIT_AS (ulimit -v) of 500.00 MB; set ulimit -v " in line, line
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".hydra", ".lock", "summary.json", "train.log"]


class FakeEval:
    """A jitted evaluation step: lowered and compiled on demand (counted), with XLA's memory analysis."""

    def __init__(self, temp_bytes: int):
        self.temp_bytes, self.compiled = temp_bytes, 0

    def lower(self, params, batch):
        return self

    def compile(self):
        self.compiled += 1
        return self

    def memory_analysis(self):
        return types.SimpleNamespace(temp_size_in_bytes=self.temp_bytes)


@pytest.mark.unit
def test_an_evaluation_too_large_is_one_line_offering_a_batch_that_fits(monkeypatch):
    """The evaluation's batch (``train.eval_batch``, not divided by ``train.accum_steps``) is checked after the
    training step: compiled only where the step's temporaries per example, times its examples per device, might not
    fit; then its compiled peak decides, and the line offers the largest ``train.eval_batch`` (a multiple of the
    device count) that fits. Before: the tiny GPT under ``ulimit -v`` 1.5 GB at ``train.accum_steps=16`` trained,
    then its evaluation (55 windows per device) aborted in C++."""
    cfg = make_cfg({"data": {"name": "synthetic"}, "mesh": {"devices": 8}})
    memory._figures.clear()
    memory._figures.update(per_device=1_000_000, held=8_000_000, params=300_000, copies=8, cfg=cfg, n=8)
    memory._figures.update(total=1_000_000, n_params=75_000, device=jax.devices()[0])
    memory._figures.update(free=108_000_000, source="a test limit", step_temporaries=1_000_000, micro=32)

    evals = types.SimpleNamespace(batches=["batch"], batch_size=256)  # 32 examples per device: as the step's
    fits = FakeEval(1_000_000)
    assert memory.check_eval_fits(fits, None, evals) is fits and fits.compiled == 0  # not compiled here
    evals.batch_size = 8_000  # 1,000 per device: 31 times the step's temporaries might not fit in 100 MB
    assert memory.check_eval_fits(fits, None, evals) is fits and fits.compiled == 1  # compiled: 1 MB fits
    large = FakeEval(25_000_000)  # 200 MB for the 8 devices: twice the 100 MB beside the state
    with pytest.raises(TrainingError) as e:
        memory.check_eval_fits(large, None, evals)
    assert str(e.value) == (
        "out of memory: the compiled evaluation step needs 26.00 MB per device, 208.00 MB for the 8 simulated CPU "
        "devices of this process; the state takes 1.00 MB per device (8.00 MB in all) of the 108.00 MB free under a "
        "test limit: ways out: train.eval_batch=3632 (it needs about 2.0 times the room)"  # half, 10% to spare
    )
    evals.batch_size, large.temp_bytes = 3_632, 25_000_000 * 3_632 // 8_000  # followed: temporaries as the batch
    assert memory.check_eval_fits(large, None, evals) is large


@pytest.mark.unit
def test_a_failure_without_a_size_offers_no_accumulation_that_would_not_shrink_it(monkeypatch):
    """An allocation without a size (Python's MemoryError) after a step whose compiled temporaries are a tenth of the
    room or less: more microbatches would not shrink what ran out (before: each run offered twice the current
    accumulation, again and again); under RLIMIT_AS a higher limit is offered."""
    from training.run import disk_full_as_error

    monkeypatch.setattr(process, "phase", "steps")
    cfg = make_cfg({"data": {"name": "synthetic"}, "mesh": {"devices": 1}})
    memory._figures.clear()
    memory._figures.update(per_device=10_000_000, held=10_000_000, params=3_000_000, copies=1, cfg=cfg, n=1)
    memory._figures.update(total=10_000_000, n_params=750_000, device=jax.devices()[0], micro=256)
    memory._figures.update(free=110_000_000, source="a test limit", step_temporaries=4_000_000)

    def line() -> str:
        with pytest.raises(TrainingError) as e, disk_full_as_error(REPO):
            raise MemoryError("Unable to allocate 766. KiB for an array with shape (1000, 28, 28, 1)")
        return str(e.value)

    assert line().endswith(
        "the step needs more than the 100.00 MB left beside it; ways out: a smaller model, or a "
        "machine with more memory"
    )
    memory._figures["step_temporaries"] = 6_000_000  # twice 6 MB: more than a tenth of the room
    assert line().endswith("ways out: train.accum_steps=2 (the same global batch in 2 microbatches)")
    memory._figures["source"] = "RLIMIT_AS (ulimit -v) of 6.00 GB, 5.89 GB of it taken by the process"
    monkeypatch.setattr(memory.resource, "getrlimit", lambda which: (6_000_000_000, memory.resource.RLIM_INFINITY))
    assert line().endswith("; more address space: more than ulimit -v 5859375")


@pytest.mark.slow
def test_an_evaluation_that_cannot_fit_is_one_line_and_the_batch_it_offers_trains(tmp_path):
    """The tiny GPT on Tiny Shakespeare under ``ulimit -v`` 1.5 GB at ``train.accum_steps=16``: the training step
    fits, the evaluation of 55 windows per device does not (before: it ran after the steps and aborted in C++). One
    line at start-up, before any step, then the ``train.eval_batch`` it offers trains (about 3 minutes)."""
    tiny = ("model=gpt", "model.size=tiny", "data=tiny_shakespeare", "train.accum_steps=16", "train.steps=2")
    proc = train_under_rlimit_as(1_536_000_000, tmp_path / "run", *tiny)
    assert proc.returncode == 1, proc.stderr[-3000:]
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: out of memory: the compiled evaluation step needs 118.44 MB per device, "), line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    batch = int(re.search(r": ways out: train\.eval_batch=(\d+) \(", line)[1])
    assert 8 <= batch < 440 and batch % 8 == 0, line  # 435 windows padded to 440: smaller, on 8 devices
    proc = train_under_rlimit_as(1_536_000_000, tmp_path / "again", *tiny, f"train.eval_batch={batch}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "again" / "summary.json").read_text())
    assert summary["status"] == "ok" and math.isfinite(summary["eval/loss"]), summary


def one_device_with_100_mb_of_room(monkeypatch) -> None:
    """The figures of a state of 10 MB on one device under a test limit of 110 MB (100 MB beside the state)."""
    cfg = make_cfg({"data": {"name": "synthetic"}, "mesh": {"devices": 1}})
    memory._figures.clear()
    memory._figures.update(per_device=10_000_000, held=10_000_000, params=3_000_000, copies=1, cfg=cfg, n=1)
    memory._figures.update(total=10_000_000, n_params=750_000, device=jax.devices()[0], free=110_000_000)
    memory._figures.update(source="a test limit")
    monkeypatch.setattr(memory, "memory_limit", lambda device: (100_000_000, "a test limit"))


@pytest.mark.unit
def test_accumulation_is_offered_only_where_its_compiled_step_fits(monkeypatch):
    """Before it offers ``train.accum_steps=K``, the check after compiling compiles the step at K (``peak_at``):
    where the peak shrinks with the microbatch, the first K that fits (2 falls short, 4 fits); where it does not
    (weights, gradients and the optimizer's buffers: a CNN under FSDP went 50.07 -> 44.76 -> 61.45 MB per device at
    1, 4, 16 microbatches), none: each run had offered twice the last count. Two compiles at most."""
    one_device_with_100_mb_of_room(monkeypatch)
    compiled: list[int] = []

    def line(temporaries_at) -> str:
        compiled.clear()
        peak_at = lambda k: compiled.append(k) or 10_000_000 + temporaries_at(k)  # noqa: E731
        with pytest.raises(TrainingError) as e:
            memory.check_step_fits(10_000_000 + temporaries_at(1), None, peak_at)
        return str(e.value)

    # 200 MB at 1, 100 MB at 2 (110 MB with 10% to spare: above the 100 MB room), 50 MB at 4
    assert line(lambda k: 200_000_000 // k).endswith(
        "ways out: train.accum_steps=4 (the same global batch in 4 microbatches)"
    )
    assert compiled == [2, 4]
    assert line(lambda k: 200_000_000).endswith("ways out: a smaller model, or a machine with more memory")
    assert compiled == [2, 8]  # 220 MB with 10% to spare at 2: 2.2 times the room, so at least 6 (8 divides 256)
    memory.check_step_fits(10_000_000 + 50_000_000, None, lambda k: pytest.fail("compiled for a step that fits"))
    assert memory._figures["peak_at"] is None  # an allocation failing later in a step compiles nothing


@pytest.mark.unit
def test_each_offer_of_the_step_fits_the_evaluation_too(monkeypatch):
    """The accumulation a step's line offers comes with the ``train.eval_batch`` that fits where the evaluation would
    not fit beside the state with 10% to spare (before: the ViT under ``ulimit -v`` 1.5 GB was offered
    ``train.accum_steps=4``, whose step fitted, and the evaluation's check then asked for a smaller batch in a second
    line); none where it fits; no offer where no evaluation batch fits."""
    one_device_with_100_mb_of_room(monkeypatch)
    evals = types.SimpleNamespace(batches=["batch"], batch_size=1000)

    def line(eval_temporaries: int) -> str:
        evaluation = (FakeEval(eval_temporaries), None, evals)
        with pytest.raises(TrainingError) as e:  # 200 MB at 1 microbatch, 50 MB at 4: fits the 100 MB room
            memory.check_step_fits(210_000_000, None, lambda k: 10_000_000 + 200_000_000 // k, evaluation)
        assert evaluation[0].compiled == 1  # 1,000 examples by the step's 0.78 MB each might not fit: compiled
        return str(e.value)

    accumulation = "train.accum_steps=4 (the same global batch in 4 microbatches)"
    assert line(10_000_000).endswith(f"ways out: {accumulation}")
    # 95 MB fits the room, not with 10% to spare: 1000 x 100 / 1.1 / 95 = 956 examples do
    assert line(95_000_000).endswith(f"ways out: {accumulation.replace(' (', ' train.eval_batch=956 (')}")
    memory._figures.update(free=10_000_000)  # no room at all: neither the step nor any evaluation batch
    monkeypatch.setattr(memory, "memory_limit", lambda device: (0, "a test limit"))
    with pytest.raises(TrainingError, match="ways out: a smaller model"):
        memory.check_step_fits(210_000_000, None, lambda k: 10_000_000, (FakeEval(95_000_000), None, evals))


@pytest.mark.unit
def test_no_higher_ulimit_is_offered_beyond_the_machines_free_memory(monkeypatch):
    """Under RLIMIT_AS the line offers the ``ulimit -v`` that would fit only where the machine has that much free
    (MemAvailable, a cgroup's ``memory.max``); beyond it, a machine with more memory (before: GPT-2 small on one
    simulated device under ``ulimit -v`` 6 GB was offered ``ulimit -v 247780000`` on a machine of 24 GB)."""
    cfg = make_cfg({"data": {"name": "synthetic"}, "mesh": {"devices": 1}})
    soft = 2_000_000_000
    monkeypatch.setattr(memory.resource, "getrlimit", lambda which: (soft, memory.resource.RLIM_INFINITY))
    monkeypatch.setattr(memory, "meminfo", lambda key, path: 1_000_000_000)  # the process's VmSize
    memory._figures.clear()
    memory._figures.update(per_device=10_000_000, held=10_000_000, params=3_000_000, copies=1, cfg=cfg, n=1)
    memory._figures.update(total=10_000_000, n_params=750_000, device=jax.devices()[0], free=1_000_000_000)
    memory._figures.update(source="RLIMIT_AS (ulimit -v) of 2.00 GB, 1.00 GB of it taken by the process")
    shortfall = 500_000_000  # 1.5 GB beyond the process's 1 GB: a limit of 2.5 GB, with 10% to spare
    monkeypatch.setattr(memory, "_machine_free", lambda: 2_000_000_000)
    assert memory._ways([], shortfall) == "ways out: more address space: ulimit -v 2710000 or more"
    monkeypatch.setattr(memory, "_machine_free", lambda: 1_400_000_000)
    assert memory._ways([], shortfall) == (
        "ways out: a machine with more memory (about 1.50 GB more than the process holds, 1.40 GB free)"
    )


@pytest.mark.unit
def test_evaluate_offers_only_what_evaluating_a_checkpoint_can_change():
    """``python -m evaluate`` restores a checkpoint's state (its model and optimizer are given) and runs only its
    evaluation: its lines offer fewer devices, a smaller ``train.eval_batch`` or more memory, not another model,
    ``optim=sgd``, a training batch or an accumulation (before: the same ways as training)."""
    cfg = make_cfg({"data": {"name": "synthetic"}, "mesh": {"devices": 8}})
    memory._figures.clear()
    memory._figures.update(per_device=100_000_000, held=800_000_000, params=33_000_000, copies=8, cfg=cfg, n=8)
    memory._figures.update(total=100_000_000, n_params=8_250_000, device=jax.devices()[0])
    memory._figures.update(free=600_000_000, source="a test limit")
    state = (cfg, 100_000_000, 33_000_000, 800_000_000, 600_000_000, 8, 8_250_000, True, 8)
    training = memory._state_ways(*state)
    assert "; optim=sgd (" in training and "; a smaller model (" in training, training
    step = memory._step_line("out of memory (test)", 1_000_000_000)
    with memory.checkpoint_evaluation():
        assert memory._state_ways(*state) == "ways out: mesh.devices=2 (a copy of 100.00 MB each)"
        assert memory._step_line("out of memory (test)", 1_000_000_000).endswith(
            ": ways out: a smaller train.eval_batch"
        )
    assert memory._step_line("out of memory (test)", 1_000_000_000) == step  # and training's lines after it


@pytest.mark.unit
def test_evaluate_says_a_state_too_large_or_an_allocation_that_failed_in_one_line(monkeypatch, capsys):
    """``python -m evaluate`` builds the run's state as train.py does: a state too large for the limit (its line) and
    an allocation that fails are one ``error:`` line and exit 1 (before: a 26-line traceback); another error is not
    reworded."""
    import evaluate

    memory._figures.clear()
    for raised, said in (
        (TrainingError("the model's parameters and optimizer state ... take 1.49 GB"), "the model's parameters"),
        (
            MemoryError("Unable to allocate 766. KiB"),
            "out of memory (Unable to allocate 766. KiB); use a smaller "
            "train.eval_batch, or a machine with more memory",
        ),  # (not the training batch)
    ):
        monkeypatch.setattr(
            evaluate, "evaluate_checkpoint", lambda *a, raised=raised, **k: (_ for _ in ()).throw(raised)
        )
        assert evaluate.main(["/nowhere"]) == 1
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"error: {said}"), line
    monkeypatch.setattr(evaluate, "evaluate_checkpoint", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("bug")))
    with pytest.raises(RuntimeError, match="^bug$"):
        evaluate.main(["/nowhere"])
