"""Whether the run's state fits in the memory it may use, checked from its shapes before anything is allocated, and
one line for an out-of-memory error of the build, the compilation or a step, or for a compiled step whose peak
cannot fit (before it runs).

The limit is the tightest that applies, with where it comes from: on a GPU or TPU the device's ``bytes_limit``
(``Device.memory_stats()``, less what is in use); on the CPU, where every simulated device lives in this process's
memory, the least of ``RLIMIT_AS`` (``ulimit -v``, less the process's virtual size), the cgroup's ``memory.max``
(less its ``memory.current``) and the free memory (``MemAvailable`` of ``/proc/meminfo``). The ways out a line
offers are the ones that fit by these figures.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import re
import resource
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import jax
import numpy as np

from core.errors import TrainingError, first_line
from measure.compiled import compiled_peak_bytes
from measure.address_space import gb, meminfo, stack_bytes, ulimit_to_set, under_rlimit_as

# the figures of the last check (check_state_fits), for the line of an out-of-memory error that comes later
_figures: dict[str, Any] = {}
_evaluating_checkpoint = False  # inside checkpoint_evaluation: python -m evaluate


@contextlib.contextmanager
def checkpoint_evaluation() -> Iterator[None]:
    """Inside, the lines are those of ``python -m evaluate``: the state is a checkpoint's (its model and optimizer
    are given) and only its evaluation runs, so they offer neither another model or optimizer nor a training batch
    or accumulation, but a smaller ``train.eval_batch``, fewer devices or more memory."""
    global _evaluating_checkpoint
    _evaluating_checkpoint = True
    try:
        yield
    finally:
        _evaluating_checkpoint = False


# Under RLIMIT_AS the CPU runtime needs more address space than XLA's compiled peak: its YNNPACK fusions (dots with
# their elementwise neighbours) materialise intermediates that XLA's buffer assignment does not count, and threads,
# stacks and malloc's arenas come beside them. Measured on a GPT (docs/troubleshooting.md): 1.65 to 1.97 times the
# compiled peak of the 8 simulated devices; the step's temporaries count this many times. The factor is the
# attention's (YNNPACK's intermediates there are tokens x tokens per head, one layer at a time): for a GPT the extra
# is at most ATTENTION_COPIES times one layer's attention scores (float32; measured 2.1 to 3.5 times, at depth 1 and
# 4 alike), so that a short context (128 tokens: 1.00 times the compiled peak) is not asked twice its room.
CPU_RUNTIME_FACTOR = 2.0
ATTENTION_COPIES = 4
# on the CPU the state's build takes its bytes again beside it (the initialisation's temporaries: 2.1 times the state
# of the ResNet on 8 simulated devices, 2.0 times the tiny GPT's, in address space, measured under ulimit -v)
BUILD_COPIES = 2
# what a way out offers has this much to spare: the process's size after compiling varies from run to run (the ViT at
# 8 simulated devices under ulimit -v 1.5 GB: 1.07 to 1.20 GB), and the runtime's share with it
OFFER_MARGIN = 0.1
OFFER_SPARE_BYTES = 128 << 20  # and under ulimit -v this much (the process differs by config: docs/troubleshooting.md)
# threads started after the compilation (the steps', the evaluation's, the checkpoint's save): 6 to 7 measured on the
# tiny GPT at 8 simulated devices (116 to 129 MB of address space beside a 10 MB state), 12 on the ViT; a stack each
LATER_THREADS = 16


def _read_int(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _cgroup_limit() -> Optional[tuple[int, int]]:
    """(``memory.max``, ``memory.current``) of this process's cgroup (v2, else v1's ``memory.limit_in_bytes``), None
    when it sets none."""
    try:
        entries = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for entry in entries:
        _, controllers, rel = entry.split(":", 2)
        if controllers == "":  # v2
            folder = Path("/sys/fs/cgroup") / rel.lstrip("/")
            limit, used = _read_int(folder / "memory.max"), _read_int(folder / "memory.current")
        elif "memory" in controllers.split(","):
            folder = Path("/sys/fs/cgroup/memory") / rel.lstrip("/")
            limit, used = _read_int(folder / "memory.limit_in_bytes"), _read_int(folder / "memory.usage_in_bytes")
            limit = None if limit is not None and limit >= 1 << 60 else limit  # v1's "no limit"
        else:
            continue
        if limit is not None:
            return limit, used or 0
    return None


def host_memory_limit() -> Optional[tuple[int, str]]:
    """(bytes this process may still allocate, where the figure comes from) on the host: the least of ``RLIMIT_AS``
    less the virtual size, the cgroup's ``memory.max`` less its usage and ``MemAvailable``; None when none is known."""
    found = []
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY:
        used = meminfo("VmSize", "/proc/self/status") or 0
        found.append((soft - used, f"RLIMIT_AS (ulimit -v) of {gb(soft)}, {gb(used)} of it taken by the process"))
    cgroup = _cgroup_limit()
    if cgroup is not None:
        found.append((cgroup[0] - cgroup[1], f"the cgroup's memory.max of {gb(cgroup[0])}, {gb(cgroup[1])} used"))
    available = meminfo("MemAvailable", "/proc/meminfo")
    if available is not None:
        found.append((available, "the free memory (MemAvailable in /proc/meminfo)"))
    return min(found) if found else None


def _machine_free() -> Optional[int]:
    """Bytes this machine still has for the process whatever its ``RLIMIT_AS``: the least of the cgroup's
    ``memory.max`` less its usage and ``MemAvailable`` (what a higher ``ulimit -v`` cannot pass); None: unknown."""
    cgroup, available = _cgroup_limit(), meminfo("MemAvailable", "/proc/meminfo")
    found = [v for v in (cgroup and cgroup[0] - cgroup[1], available) if v is not None]
    return min(found) if found else None


def memory_limit(device) -> Optional[tuple[int, str]]:
    """(bytes free for the state of one ``device``'s process or device, where the figure comes from): a GPU's or
    TPU's ``bytes_limit`` less its bytes in use; on the CPU ``host_memory_limit``. None when unknown."""
    if device.platform == "cpu":
        return host_memory_limit()
    try:
        stats = device.memory_stats() or {}
    except Exception:  # a backend without statistics
        return None
    limit = stats.get("bytes_limit")
    if not limit:
        return None
    used = stats.get("bytes_in_use", 0)
    return limit - used, f"the bytes_limit of a {device.device_kind} ({gb(limit)}, memory_stats), {gb(used)} in use"


def state_bytes(abstract_state, shardings) -> tuple[int, int, int]:
    """(bytes of the whole state, bytes of its params, bytes its largest device holds) from the abstract state
    (``jax.eval_shape``) and its ``NamedSharding``s (a tree of the same structure)."""
    leaves, placed = jax.tree.leaves(abstract_state), jax.tree.leaves(shardings, is_leaf=lambda s: hasattr(s, "spec"))
    nbytes = lambda shape, dtype: int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize  # noqa: E731
    total = sum(nbytes(x.shape, x.dtype) for x in leaves)
    params = sum(nbytes(x.shape, x.dtype) for x in jax.tree.leaves(abstract_state.params))
    per_device = sum(nbytes(s.shard_shape(x.shape), x.dtype) for x, s in zip(leaves, placed))
    return total, params, per_device


def check_state_fits(cfg, init_fn: Callable, state_shardings: Callable, devices: list) -> None:
    """Raises TrainingError (one line: the state's bytes, the limit and where it comes from, the ways out that fit)
    when the parameters and optimizer state of ``init_fn`` (the run's state, not allocated: ``jax.eval_shape``)
    placed by ``state_shardings`` cannot fit on the mesh's ``devices`` (on the CPU: every local one in this process's
    memory). ``cfg``: the run's ``conf.schema.Config`` (the advice names its keys)."""
    abstract = jax.eval_shape(init_fn)
    total, params, per_device = state_bytes(abstract, state_shardings(abstract))
    first, n = devices[0], len(devices)
    cpu = first.platform == "cpu"
    copies = sum(d.process_index == jax.process_index() for d in devices) if cpu else 1
    found = memory_limit(first)
    _figures.clear()
    _figures.update(per_device=per_device, held=per_device * copies, params=params, copies=copies, cfg=cfg, n=n)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract.params))
    _figures.update(device=first, total=total, n_params=n_params)
    if found is None:
        return
    free, source = found
    _figures.update(free=free, source=source)
    build = BUILD_COPIES if cpu else 1
    if per_device * copies * build <= free:
        return
    where = f"{gb(per_device * copies)} for the {copies} simulated CPU devices of this process" if copies > 1 else ""
    where += f"{', ' if where else ''}twice that while it is built" if build > 1 else ""
    raise TrainingError(
        f"the model's parameters and optimizer state ({n_params:,} params) take {gb(per_device)} per device"
        f"{', ' + where if where else ''}, above the {gb(free)} free under {source}; "
        + _state_ways(cfg, total, params, per_device * copies, free, copies, n_params, cpu, n)
        + "; a smaller batch, model.remat, model.loss_chunk or bf16 shrink only the activations, not this state"
    )


def params_held_bytes(held: int, params: int, total: int) -> int:
    """Bytes of the params as this process holds them, of a state it holds ``held`` bytes of (``params`` of ``total``
    bytes in one copy): a copy per replica, a shard under FSDP; the size of their gradients, and of an SGD state."""
    return held * params // max(1, total)


def _state_ways(cfg, total: int, params: int, held: int, free: int, copies: int, n_params: int, cpu: bool, n: int):
    """The ways out that shrink the state enough, by the figures, with room for its gradients (as large as the params)
    beside it in a step: fewer simulated devices (each holds a copy; a count that divides the global batch into
    microbatches, as ``training.build.plan`` asks), ``parallel=fsdp`` on real devices, SGD without moments, a smaller
    model."""
    ways, t, grads = [], cfg.train, params_held_bytes(held, params, total)  # as large as an SGD state
    build = BUILD_COPIES if cpu else 1
    if cpu and copies == n > 1 and held >= copies * total * 0.99:  # replicated: a copy per device
        divides = lambda m: t.per_device_batch or (t.global_batch or 256) % (m * t.accum_steps) == 0  # noqa: E731
        fit = [m for m in range(1, free // max(build * total, total + params) + 1) if divides(m)]
        ways += [f"mesh.devices={fit[-1]} (a copy of {gb(total)} each)"] if fit else []
    if not cpu and n > 1 and cfg.parallel.name != "fsdp" and total / n <= free:
        ways.append(f"parallel=fsdp (about {gb(total / n)} per device on {n} devices)")
    if (
        cfg.optim.name == "adam" and 2 * grads <= free and not _evaluating_checkpoint
    ):  # (built: twice an SGD state, as large as the gradients)
        ways.append(f"optim=sgd (no moments: {gb(grads)} and as much for the gradients)")
    fits = int(n_params * free / max(build * held, held + grads))  # before any activations
    said = "built and with their gradients" if build * held > held + grads else "with their gradients"
    ways += [f"a smaller model (at most about {fits:,} params, {said})"] if fits and not _evaluating_checkpoint else []
    return _ways(ways, max(build * held, held + grads) + later_bytes() - free)  # (what the build took stays mapped)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation that failed: Python's ``MemoryError``, a thread whose stack could not be
    mapped ("can't start new thread", under ``ulimit -v``), XLA's RESOURCE_EXHAUSTED / "out of memory" (at build,
    compilation or a step), or, under ``ulimit -v``, a YNNPACK operation of the CPU runtime that failed (its
    allocations are its own: it says only ``INTERNAL: YNNPACK operation failed``) or a ``SystemError`` (C code whose
    allocation failed without saying so: "error return without exception set")."""
    text = str(error)
    return (
        isinstance(error, MemoryError)
        or (isinstance(error, SystemError) and under_rlimit_as())  # C code whose allocation failed, unsaid
        or text.startswith("can't start new thread")
        or (
            isinstance(error, jax.errors.JaxRuntimeError)
            and (
                "RESOURCE_EXHAUSTED" in text
                or "of memory" in text.lower()
                or ("YNNPACK operation failed" in text and under_rlimit_as())
            )
        )
    )


def out_of_memory_line(error: BaseException, after_steps: bool = False) -> str:
    """One line for an out-of-memory ``error`` once the state fitted: XLA's words, the state's bytes and the limit
    (from the last ``check_state_fits``), and the ways out that shrink what a step needs beside the state enough by
    these figures (the failed allocation, made by each simulated CPU device of the process, against the room the
    state leaves). ``after_steps``: every step ran (the error came saving or evaluating at the end): the way out is
    more memory, the same command continuing from the newest checkpoint."""
    said = f"out of memory ({first_line(error, 160)})"
    if after_steps:
        return (
            f"{said} after the training steps, while saving or evaluating; every step ran: with more memory the same "
            "command finishes from the newest checkpoint (or says the run is complete)"
        )
    asked = re.search(r"allocat\w* (\d+) bytes", str(error))
    f = _figures
    if asked is None and "free" in f and "step_temporaries" not in f:  # no size, before the step was compiled
        now = memory_limit(f["device"])
        fewer = f["copies"] > 1 and f["held"] > 1.01 * f["total"]  # replicated: a copy of the state per device
        ways = [f"fewer simulated devices (each holds a copy of the state's {gb(f['total'])})"] if fewer else []
        return (
            f"{said} before the training step was compiled (building the state of {gb(f['held'])}, reading the data)"
            + (f", under {now[1]}" if now else "")
            + "; "
            + _ways(ways, None)
        )
    return _step_line(said, int(asked.group(1)) * f.get("copies", 1) if asked else None)


def check_step_fits(
    peak_bytes: Optional[int],
    gpt_dims: Any = None,
    peak_at: Optional[Callable[[int], Optional[int]]] = None,
    evaluation: Optional[tuple] = None,
) -> None:
    """Raises TrainingError (one line, as ``out_of_memory_line``) when the compiled step's ``peak_bytes`` per device
    (``mem/compiled_peak_bytes_per_device``: state, batch and temporaries) on each of this process's devices exceed
    the memory free beside the state now (the process has grown since ``check_state_fits``: the state, the compiled
    program, the runtime's threads): before the step runs out of it. On the CPU under ``RLIMIT_AS`` the step's
    temporaries count ``CPU_RUNTIME_FACTOR`` times (the runtime's own buffers beside XLA's), for a GPT
    (``gpt_dims``: ``models.gpt.GPTDims``) at most ``ATTENTION_COPIES`` times one layer's attention scores more, and
    ``later_bytes`` come beside them. None (unknown): returns. ``peak_at``: ``train.accum_steps`` -> the compiled
    peak per device at that count (``accumulation_peaks``), to offer only an accumulation that fits; ``evaluation``:
    ``(eval_fn, params, eval_set)`` as ``check_eval_fits`` takes them, so that each offer also fits the evaluation
    (with the ``train.eval_batch`` that does), not only the step."""
    f = _figures
    if peak_bytes is None or "free" not in f:
        return
    f["gpt_dims"], f["evaluation"] = gpt_dims, evaluation
    _free_now()
    t = f["cfg"].train
    micro = (t.per_device_batch or (t.global_batch or 256) // f["n"]) // t.accum_steps
    f["step_temporaries"], f["micro"] = max(0, peak_bytes - f["per_device"]), micro
    needed = _needed(f["step_temporaries"], micro, gpt_dims)
    f["peak_at"] = peak_at if needed is not None else None  # (an allocation that fails in a step: nothing compiled)
    if needed is not None:
        raise TrainingError(
            _step_line(f"out of memory: the compiled step needs {_said(peak_bytes, needed)}", _beside(needed))
        )


def _free_now() -> None:
    """The memory free beside the state now (``_figures``' ``free``, ``source``): the state is allocated by now."""
    f = _figures
    now = memory_limit(f["device"])
    f["free"] = f["free"] if now is None else min(f["free"], now[0] + f["held"])
    f["source"] = f["source"] if now is None else now[1]


def accumulation_peaks(exp: Any, batch: Any) -> Callable[[int], Optional[int]]:
    """``k ->`` the compiled peak bytes per device of the train step of ``exp`` (``training.build.Experiment``) at
    ``train.accum_steps=k`` on ``batch`` (the same global batch): compiled, never run; None without XLA's analysis."""

    def peak(k: int) -> Optional[int]:
        mode = copy.copy(exp.mode)
        mode.accum_steps = k
        local = dataclasses.replace(exp.local, accum_steps=k)
        steps = mode.build(local, exp.updater, jax.eval_shape(lambda s: s, exp.state), feed=exp.feed)
        compiled = steps.train.lower(exp.state, batch).compile()
        return compiled_peak_bytes(compiled)["peak_bytes"] if compiled.memory_analysis() is not None else None

    return peak


def _under_rlimit_as(f: dict) -> bool:
    return f["device"].platform == "cpu" and f["source"].startswith("RLIMIT_AS")


def _spare() -> int:
    """What an offered way keeps to spare beyond ``OFFER_MARGIN``: ``OFFER_SPARE_BYTES`` under ``RLIMIT_AS`` (the
    process's size varies from run to run), else 0."""
    return OFFER_SPARE_BYTES if _under_rlimit_as(_figures) else 0


def later_bytes() -> int:
    """Address space that comes, under ``RLIMIT_AS``, after the compilation beyond XLA's figures: the stacks of the
    threads that the steps, the evaluation and the checkpoint's save start (``LATER_THREADS``) and a host copy of
    the state for the save. 0 under another limit or before ``check_state_fits``."""
    f = _figures
    return f["total"] + LATER_THREADS * stack_bytes() if "free" in f and _under_rlimit_as(f) else 0


def _needed(temporaries: int, micro: int, gpt_dims: Any, forward: bool = False) -> Optional[tuple[int, int, int]]:
    """(the temporaries' bytes per device, the CPU runtime's extra of them, ``later_bytes``) when a step of
    ``temporaries`` bytes per device (XLA's figure) and ``micro`` examples per device cannot fit beside the state on
    every device of this process with ``later_bytes`` beside; None when they fit. ``forward``: an evaluation step, whose
    runtime share is only a GPT's attention (a ViT's evaluation took XLA's figure, 381 MB for 8 devices)."""
    needed = _step_bytes(temporaries, micro, gpt_dims, forward)
    return None if _figures["held"] + _beside(needed) <= _figures["free"] else needed


def _step_bytes(temporaries: int, micro: int, gpt_dims: Any, forward: bool = False) -> tuple[int, int, int]:
    """``_needed``'s figures, whether they fit or not."""
    factor = CPU_RUNTIME_FACTOR if _under_rlimit_as(_figures) else 1.0
    extra = temporaries * (factor - 1) if not forward or gpt_dims is not None else 0
    if gpt_dims is not None and factor != 1.0:  # one layer's scores: microbatch x heads x context^2, float32
        extra = min(extra, ATTENTION_COPIES * micro * gpt_dims.heads * gpt_dims.context**2 * 4)
    return temporaries, int(extra), later_bytes()


def _said(peak_bytes: int, needed: tuple[int, int, int]) -> str:
    """What a compiled step of ``peak_bytes`` per device needs, in words, with the runtime's share (``_needed``)."""
    f, (temporaries, extra, later) = _figures, needed
    copies = f["copies"]
    said = f"{gb(peak_bytes)} per device" + (
        f", {gb(peak_bytes * copies)} for the {copies} simulated CPU devices of this process" if copies > 1 else ""
    )
    if extra:
        again = "about as much again" if extra == temporaries else f"about {gb(extra * copies)} more"
        said += f", and the CPU runtime's own buffers (YNNPACK's, threads') {again} in address space"
    if later:
        said += f", and {gb(later)} for threads to come and a copy of the state to save"
    if extra or later:
        said += f": {gb(f['held'] + _beside(needed))}"
    return said


def _beside(needed: tuple[int, int, int]) -> int:
    """The bytes a step (``_needed``) and what comes after it take beside the state, all of this process's devices
    together (the threads the steps start stay; measured beside a step, not after it)."""
    return (needed[0] + needed[1]) * _figures["copies"] + needed[2]


def check_eval_fits(eval_fn: Any, params, eval_set, gpt_dims: Any = None) -> Callable:
    """``eval_fn`` (the jitted evaluation step, ``(params, batch) -> sums``), or, where a batch of ``eval_set``
    (``data.pipeline.EvalSet``) might not fit beside the state (by the training step's figures, its temporaries per
    example times the evaluation's examples per device, the forward pass alone taking less; without a training step,
    as in ``python -m evaluate``, always), the step compiled for ``params`` and that batch after a check of its
    compiled peak, as ``check_step_fits`` does (raises TrainingError, one line offering a smaller
    ``train.eval_batch``). Call after ``check_state_fits`` (and ``check_step_fits`` when training)."""
    f = _figures
    if "free" not in f or not eval_set.batches:
        return eval_fn
    if "step_temporaries" not in f:  # no training step checked: the process has grown since (a restored state)
        _free_now()
    compiled, needed = _eval_needs(eval_fn, params, eval_set, gpt_dims, False)
    if needed is None:
        return compiled
    said = f"out of memory: the compiled evaluation step needs {_said(f['per_device'] + needed[0], needed)}"
    room, beside = f["free"] - f["held"], _beside(needed)
    smaller = _smaller_eval_batch(needed, eval_set.batch_size)
    ways = [f"train.eval_batch={smaller} (it needs about {_times(beside / max(1, room))} times the room)"]
    raise TrainingError(f"{said}; {_figures_said(f)}: " + _ways(ways if smaller else [], beside - room))


def _eval_needs(eval_fn: Any, params, eval_set, gpt_dims: Any, margin: bool) -> tuple[Any, Optional[tuple]]:
    """(the evaluation step: compiled where it was, the figures of ``_step_bytes`` of a batch of ``eval_set`` when it
    does not fit beside the state, with ``margin``: with what an offer keeps to spare, else None)."""
    f = _figures

    def fits(needed: tuple[int, int, int]) -> bool:
        spare = (needed[0] + needed[1]) * f["copies"] * OFFER_MARGIN + _spare() if margin else 0
        return f["held"] + _beside(needed) + spare <= f["free"]

    per_device = max(1, eval_set.batch_size // f["n"])
    if "step_temporaries" in f:  # the training step's temporaries per example: an upper bound, without compiling
        guess = _step_bytes(f["step_temporaries"] * per_device // max(1, f["micro"]), per_device, gpt_dims, True)
        if fits(guess):
            return eval_fn, None
    compiled = eval_fn.lower(params, eval_set.batches[0]).compile()
    analysis = compiled.memory_analysis()
    temporaries = getattr(analysis, "temp_size_in_bytes", None) if analysis is not None else None
    if temporaries is None:
        return compiled, None
    needed = _step_bytes(temporaries, per_device, gpt_dims, True)
    return compiled, (None if fits(needed) else needed)


def _smaller_eval_batch(needed: tuple[int, int, int], eval_batch: int) -> int:
    """The ``train.eval_batch`` (a multiple of the device count; 0: none) whose temporaries, as ``eval_batch``'s
    (``needed``) scaled, fit beside the state with ``OFFER_MARGIN`` and ``_spare`` to spare."""
    f = _figures
    scales = _beside(needed) - needed[2]  # the temporaries scale with the batch, not the threads and the save's copy
    fits = (f["free"] - f["held"] - needed[2] - _spare()) / (1 + OFFER_MARGIN)
    return int(eval_batch * fits / scales) // f["n"] * f["n"] if scales > 0 and fits > 0 else 0


def _eval_offer() -> tuple[Optional[str], int]:
    """For a line offering a smaller training step: ``("", 0)`` when the evaluation (``check_step_fits``'s
    ``evaluation``) fits beside the state with what an offer keeps to spare; else the ``train.eval_batch=N`` to add
    to each offer (None: no batch fits) and the bytes it falls short by."""
    f = _figures
    if f.get("evaluation") is None:
        return "", 0
    eval_fn, params, eval_set = f["evaluation"]
    _, needed = _eval_needs(eval_fn, params, eval_set, f.get("gpt_dims"), True)
    if needed is None:
        return "", 0
    smaller = _smaller_eval_batch(needed, eval_set.batch_size)
    return (f"train.eval_batch={smaller}" if smaller else None), _beside(needed) - (f["free"] - f["held"])


def _times(ratio: float) -> str:
    """``ratio`` to two significant digits below 1.1 (``1.03``: not ``1.0``), else to one decimal."""
    return f"{ratio:.2f}" if ratio < 1.1 else f"{ratio:.1f}"


def _figures_said(f: dict) -> str:
    return (
        f"the state takes {gb(f['per_device'])} per device ({gb(f['held'])} in all) of the {gb(f['free'])} free under "
        + f["source"]
    )


def _ways(ways: list[str], shortfall: Optional[int]) -> str:
    """ "ways out: ..." of ``ways`` and, under ``RLIMIT_AS``, the limit that leaves ``shortfall`` bytes more (None:
    unknown, any higher limit) or, where the machine has not that much free (``_machine_free``), a machine with more
    memory; a smaller model or a machine with more memory when there is no other."""
    f = _figures
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    beyond = None if shortfall is None else shortfall + soft - (meminfo("VmSize", "/proc/self/status") or 0)
    machine = _machine_free()
    if _under_rlimit_as(f) and beyond is not None and machine is not None and beyond > machine:  # no limit would do
        ways.append(f"a machine with more memory (about {gb(beyond)} more than the process holds, {gb(machine)} free)")
    elif _under_rlimit_as(f) and soft != resource.RLIM_INFINITY:
        more = ulimit_to_set(int((soft + max(0, shortfall)) * (1 + OFFER_MARGIN))) if shortfall is not None else None
        more = more or f"more than ulimit -v {soft // 1024}"
        ways.append(f"more address space: {more}")
    other = "a machine with more memory" if _evaluating_checkpoint else "a smaller model, or a machine with more memory"
    return "ways out: " + "; ".join(ways or [other])


def _step_line(said: str, beside: Optional[int]) -> str:
    """``said``, the state's figures and the ways out for a step that needs ``beside`` bytes (all the process's
    devices together; None: unknown) beside the state."""
    f = _figures
    batch = "train.eval_batch" if _evaluating_checkpoint else "train.global_batch"
    if "free" not in f:
        return f"{said}; use a smaller {batch}, or a machine with more memory"
    cfg, held, free, n = f["cfg"], f["held"], f["free"], f["n"]
    figures = _figures_said(f)
    room, gradients = free - held, params_held_bytes(held, f["params"], f["total"])
    shortfall = None if beside is None else beside - room
    if _evaluating_checkpoint:  # only the evaluation's batch is the user's to change
        return f"{said}; {figures}: " + _ways([f"a smaller {batch}"], shortfall)
    if room < gradients:  # not even the gradients fit beside the state
        fits = int(f["n_params"] * free / (held + gradients))
        ways = [f"a smaller model (at most about {fits:,} params with their gradients)"]
        if f["copies"] > 1 and held > 1.01 * f["total"]:  # replicated copies
            global_batch = None if cfg.train.per_device_batch else (cfg.train.global_batch or 256)
            ways += _fewer_devices(f, beside, global_batch, None) if beside is not None else ["fewer devices"]
        return f"{said}; {figures}, leaving less than its gradients need; " + _ways(ways, shortfall)
    # how many times too large; unknown (no size): at least twice, unless the compiled step's temporaries are a tenth
    # of the room or less (accumulation would not shrink what ran out)
    need = beside / room if beside is not None else 2.0
    later = later_bytes() if beside is not None else 0  # (the threads and the save's copy: not microbatched)
    shrinks = (beside - later) / (room - later) if beside is not None and room > later else need
    factor, model, train = max(2, math.ceil(shrinks)), cfg.model, cfg.train
    ways = []
    per_device = train.per_device_batch or (train.global_batch or 256) // n
    # accum_steps divides the per-device batch: the first at least factor times the current one, compiled to see that
    # it fits where the compiled step can be (its peak shrinks less than the microbatch: weights, gradients, buffers)
    counts = [k for k in range(train.accum_steps * factor, per_device + 1) if per_device % k == 0]
    accum = _fitting_accumulation(counts, per_device) if room > later else None
    if beside is None and f.get("step_temporaries", room) * f["copies"] * CPU_RUNTIME_FACTOR <= room / 10:
        accum = None
    if accum is not None:
        ways.append(f"train.accum_steps={accum} (the same global batch in {accum} microbatches)")
    if beside is not None and f["copies"] == n > 1 and f["held"] > 1.01 * f["total"]:  # fewer copies of the state
        ways += _fewer_devices(f, beside, None if train.per_device_batch else per_device * n, fewer_than=accum)
    evaluation, eval_short = _eval_offer() if beside is not None else ("", 0)  # each offer fits the evaluation too
    ways = [w.replace(" (", f" {evaluation} (", 1) if evaluation else w for w in ways if evaluation is not None]
    shortfall = None if shortfall is None else max(shortfall, eval_short)
    # each of these at least halves a transformer's activations on an accelerator: offered where activations are most
    # of what the step needs beside the state (more than 4x the gradients' bytes) and, for the chunked loss, a
    # microbatch holds more tokens than one chunk (a smaller one is padded up to it). Not on the CPU: there remat and
    # the chunked loss left XLA's compiled peak as it was and bf16 raised it (docs/troubleshooting.md)
    accelerator = getattr(f.get("device"), "platform", "cpu") != "cpu"
    if accelerator and need <= 2 and (beside is None or beside > 4 * gradients):
        context = getattr(model, "context", None)  # None: the size's own (not known here; taken as long enough)
        long = context is None or per_device // train.accum_steps * context > 1024
        ways += ["model.remat=full"] if getattr(model, "remat", None) == "none" else []
        ways += ["model.loss_chunk=1024"] if getattr(model, "loss_chunk", None) == 0 and long else []
        ways += ["precision=bf16"] if cfg.precision.name == "fp32" else []
    if f["copies"] == 1 and n > 1 and cfg.parallel.name != "fsdp" and need * room <= free - held / n:
        ways.append("parallel=fsdp")  # real devices: each keeps 1/n of the state
    size = f"about {need:.1f} times" if beside is not None else "more than"
    return f"{said}; {figures}: the step needs {size} the {gb(room)} left beside it; " + _ways(ways, shortfall)


def _fitting_accumulation(counts: list[int], per_device: int) -> Optional[int]:
    """The first of ``counts`` (``train.accum_steps``, ascending) whose compiled step fits beside the state with
    ``OFFER_MARGIN`` to spare, compiled by the step's ``peak_at`` (``check_step_fits``; at most two compiles: the
    first count, then the first at least as many times larger as it fell short); None when neither fits or the peak
    did not shrink. Without ``peak_at`` (an allocation that failed in a step): the first count, as estimated."""
    f = _figures
    peak_at = f.get("peak_at")
    if peak_at is None or not counts:
        return counts[0] if counts else None
    k, last = counts[0], None
    for _ in range(2):
        peak = peak_at(k)
        if peak is None:
            return k
        temporaries = int(max(0, peak - f["per_device"]) * (1 + OFFER_MARGIN))
        needed = _step_bytes(temporaries, per_device // k, f.get("gpt_dims"))
        if f["held"] + _beside(needed) + _spare() <= f["free"]:
            return k
        if last is not None and peak > 0.9 * last:  # accumulation does not shrink this step
            return None
        short = _beside(needed) / max(1, f["free"] - f["held"])
        last, k = peak, next((c for c in counts if c >= k * max(2, math.ceil(short))), counts[-1])
    return None


def _fewer_devices(f: dict, beside: int, global_batch: Optional[int], fewer_than: Optional[int]) -> list[str]:
    """``mesh.devices=M train.accum_steps=K`` for the most simulated devices M that fit a step needing ``beside``
    bytes (all devices together) beside the state: M copies of the state and of its gradients, and the activations
    of the same global batch, which shrink as K grows (the microbatch of each device is global/(M K)). [] when none,
    when K would not be below ``fewer_than`` (the accumulation that fits on every device), or with a
    ``per_device_batch`` (``global_batch`` None)."""
    accum, later = f["cfg"].train.accum_steps, later_bytes()
    activations = max(0, beside - later - params_held_bytes(f["held"], f["params"], f["total"]))
    for m in range(f["n"] - 1, 0, -1):
        left = f["free"] - later - m * (f["per_device"] + f["params"])  # m copies of the state and of its gradients
        left -= _spare()
        if global_batch is None or global_batch % m or left <= 0:
            continue
        k = next(
            (
                k
                for k in range(accum, global_batch // m + 1)
                if global_batch // m % k == 0 and activations * accum / k * (1 + OFFER_MARGIN) <= left
            ),
            None,
        )
        if k is not None and (fewer_than is None or k < fewer_than):
            return [f"mesh.devices={m} train.accum_steps={k} (a copy of the state on each of {m} devices)"]
    return []


def out_of_memory_as_error(error: BaseException, after_steps: bool = False) -> None:
    """Raises TrainingError (``out_of_memory_line``) when ``error`` is an out-of-memory error; else returns."""
    if is_out_of_memory(error):
        raise TrainingError(out_of_memory_line(error, after_steps)) from None
