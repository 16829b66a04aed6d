"""Steady-state throughput, job wall clock and time to a target accuracy of one run (pure Python, no JAX).

Three small objects that a training loop feeds and that turn into ``summary.json`` keys (DESIGN.md, "Metric
definitions"):

- :class:`WindowStats`: one sample per logging window ``(elapsed_s, steps)``; the first window after
  compilation is not steady state and is dropped, the caller may drop others (``drop=True``). Time the loop
  spends in evaluation, checkpoint saves, sync checks and profiling is *excluded from the window it falls in*
  (the loop pauses its step timer around them), so such a window is kept, not dropped. Yields
  ``perf/examples_per_s_median|_p25|_p75``, ``perf/examples_per_s`` (= the median), ``perf/step_time_s``
  (median of the windows' step times), per-device figures and ``perf/windows_measured``.
- :class:`JobClock`: ``perf/wall_s`` (job start to the final summary) and ``perf/startup_s`` (job start to the
  first training step dispatched). Job start is the process start for a single run, and the job's own start
  (when the clock is created) when a launcher runs several jobs in one process (a Hydra multirun).
- :class:`StartupPhases` (one per process, ``STARTUP``): ``perf/startup_s`` split into consecutive phases
  (``perf/startup/<phase>_s``: imports, config, runtime, checkpoint, data, build, compile, reporting,
  first_step) that add up to it; the code marks the end of each phase with ``STARTUP.mark(phase)``.
- :class:`TargetTracker`: ``train/steps_to_target`` (first evaluated step with ``eval/accuracy >= target``)
  and ``perf/time_to_target_s`` (wall time from the first training step dispatched to the end of that
  evaluation: evaluation time *included*, startup and compilation excluded).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any, Callable

MIN_WINDOWS = 5  # fewer measured windows than this: a warning line and perf/few_windows=true
_IMPORT_EPOCH_S = time.time()  # fallback for the process start where /proc is unavailable


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` with linear interpolation between order statistics
    (numpy's default "linear" method, Hyndman & Fan type 7). Raises ValueError on an empty list."""
    if not values:
        raise ValueError("quantile of no values")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class WindowStats:
    """Throughput distribution over logging windows.

    Args:
      global_batch: examples per optimizer step (all devices).
      num_devices: devices of the mesh (for the per-device figures).
      skip_first: leading windows that are not steady state (1: the window right after compilation).
    """

    def __init__(self, global_batch: int, num_devices: int, skip_first: int = 1):
        self.global_batch, self.num_devices, self.skip_first = global_batch, num_devices, skip_first
        self.windows: list[tuple[float, int, bool]] = []  # (elapsed_s, steps, dropped)

    def add(self, elapsed_s: float, steps: int, drop: bool = False) -> dict[str, float]:
        """Records one window of ``steps`` optimizer steps that took ``elapsed_s`` seconds of step time;
        ``drop=True`` keeps it out of the statistics. Returns this window's own figures (for the log).

        Raises:
          ValueError: ``steps`` < 1 or ``elapsed_s`` <= 0.
        """
        if steps < 1 or not elapsed_s > 0:
            raise ValueError(f"a window needs steps >= 1 and elapsed_s > 0 (got {steps}, {elapsed_s})")
        drop = drop or len(self.windows) < self.skip_first
        self.windows.append((float(elapsed_s), int(steps), bool(drop)))
        step_time_s = elapsed_s / steps
        return {
            "perf/step_time_s": step_time_s,
            "perf/examples_per_s": self.global_batch / step_time_s,
            "perf/examples_per_s_per_device": self.global_batch / step_time_s / self.num_devices,
        }

    def _used(self) -> tuple[list[tuple[float, int, bool]], bool]:
        kept = [w for w in self.windows if not w[2]]
        if kept:
            return kept, False
        return list(self.windows), True  # nothing steady: fall back to every window, flagged

    @property
    def windows_measured(self) -> int:
        """Windows in the statistics (0 when only excluded windows exist)."""
        return sum(not w[2] for w in self.windows)

    def summary(
        self,
        time_model_s: float | None = None,
        flops_per_step_per_device: float | None = None,
        peak_flops_per_s: float | None = None,
    ) -> dict[str, Any]:
        """The ``perf/*`` keys (empty dict without any window).

        ``comm/ratio_model`` (= ``time_model_s`` / median step time) and ``perf/mfu`` (= FLOPs per step and
        device / median step time / peak FLOP/s) are recomputed from the median when their inputs are given.
        ``perf/examples_per_s_last_window`` is the final window's figure (what older reports used).
        """
        if not self.windows:
            return {}
        used, fallback = self._used()
        eps = [self.global_batch * steps / elapsed for elapsed, steps, _ in used]
        step_times = [elapsed / steps for elapsed, steps, _ in used]
        median = statistics.median(eps)
        step_time_s = statistics.median(step_times)
        last_elapsed, last_steps, _ = self.windows[-1]
        out: dict[str, Any] = {
            "perf/examples_per_s_median": median,
            "perf/examples_per_s_p25": quantile(eps, 0.25),
            "perf/examples_per_s_p75": quantile(eps, 0.75),
            "perf/examples_per_s": median,
            "perf/examples_per_s_per_device": median / self.num_devices,
            "perf/step_time_s": step_time_s,
            "perf/step_time_s_median": step_time_s,
            "perf/windows_measured": self.windows_measured,
            "perf/windows_total": len(self.windows),
            "perf/few_windows": self.windows_measured < MIN_WINDOWS,
            "perf/examples_per_s_last_window": self.global_batch * last_steps / last_elapsed,
        }
        if fallback:
            out["perf/includes_warmup_window"] = True
        if time_model_s is not None:
            out["comm/ratio_model"] = time_model_s / step_time_s
        if flops_per_step_per_device and peak_flops_per_s:
            out["perf/mfu"] = flops_per_step_per_device / step_time_s / peak_flops_per_s
        return out

    def warning(self) -> str | None:
        """One line when fewer than ``MIN_WINDOWS`` windows were measured, else None; with none measured (only
        the first window, after compilation) it says plainly that the run has no steady-state figure."""
        n = self.windows_measured
        if n >= MIN_WINDOWS:
            return None
        if n == 0:
            steps = sum(w[1] for w in self.windows)
            return (
                f"warning: no steady-state throughput: all {steps} step(s) ran in the first logging window, which "
                f"follows compilation and is not steady state; for a figure run at least {MIN_WINDOWS + 1} "
                f"windows (train.steps >= {MIN_WINDOWS + 1} x train.log_every)"
            )
        used = f"throughput is the median of {n} window{'s' if n != 1 else ''}"
        return (
            f"warning: only {n} logging window(s) measured after the first (need {MIN_WINDOWS}): {used}; "
            f"raise train.steps or lower train.log_every"
        )


def process_start_epoch_s() -> float:
    """Start of this process in ``time.time()`` seconds (from /proc, 10 ms resolution); where /proc is not
    readable, the time this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of proc(5): starttime, clock ticks after boot
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        age_s = uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")
        if 0 <= age_s < 7 * 86400:
            return time.time() - age_s
    except (OSError, ValueError, IndexError):
        pass
    return _IMPORT_EPOCH_S


def in_multirun() -> bool:
    """Whether this job runs inside a Hydra multirun (a launcher may run several jobs in one process)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    except Exception:  # noqa: BLE001 - not under Hydra
        return False


# The phases of a job's start-up, in the order they happen (``StartupPhases``; docs/metrics.md, "Start-up phases").
STARTUP_PHASES = (
    "imports",  # interpreter start, then Hydra, JAX, flax, optax and the repository's modules
    "config",  # Hydra composition, the typed config and every check that needs neither data nor devices
    "runtime",  # XLA flags, devices, the compilation cache, a multi-process join; the backend's start left
    # when the imports are in (it begins on a thread beside them: training.runtime.start_backend)
    "checkpoint",  # the checkpoint folder prepared, a checkpoint looked up and restored (orbax)
    "data",  # the dataset loaded (decoded-array cache or TFDS), the eval set placed, the first batch placed
    "build",  # model, optimizer, the placed train state
    "compile",  # the train step lowered and compiled (a persistent-cache hit or miss), its static measurements
    "reporting",  # wandb.init sent (tracking/wandb_process.py), metrics.jsonl, the step-0 record, start-up line, hooks
    "first_step",  # the first training step dispatched
)


class StartupPhases:
    """``perf/startup_s`` split into consecutive phases that add up to it.

    The code calls ``mark(phase)`` where a phase ends: the seconds since the previous mark (or since the
    origin, the job start) are added to ``phase`` (a phase may end several times: its pieces add up). So every
    second between the job start and the first step dispatched is in exactly one phase. ``origin`` is on the
    ``time.perf_counter`` scale; it is the process start until ``start`` sets another (a job of a multirun).
    """

    def __init__(self) -> None:
        self.origin: float | None = None
        self._last: float | None = None
        self.seconds: dict[str, float] = {}

    def start(self, origin: float) -> None:
        """Forgets every mark and counts from ``origin`` (``time.perf_counter`` seconds)."""
        self.origin = self._last = origin
        self.seconds = {}

    def ensure_started(self) -> float:
        """The origin; the process start (``process_start_epoch_s``) when nothing set one."""
        if self.origin is None:
            self.start(time.perf_counter() - (time.time() - process_start_epoch_s()))
        assert self.origin is not None
        return self.origin

    def mark(self, phase: str, now: float | None = None) -> None:
        """Ends a piece of ``phase`` (one of ``STARTUP_PHASES``) at ``now`` (``time.perf_counter``; None: now).

        Raises:
          ValueError: an unknown phase name.
        """
        if phase not in STARTUP_PHASES:
            raise ValueError(f"unknown start-up phase {phase!r}; one of {', '.join(STARTUP_PHASES)}")
        self.ensure_started()
        now = time.perf_counter() if now is None else now
        assert self._last is not None
        self.seconds[phase] = self.seconds.get(phase, 0.0) + max(0.0, now - self._last)
        self._last = max(self._last, now)

    def summary(self) -> dict[str, float]:
        """``perf/startup/<phase>_s`` for every phase in ``STARTUP_PHASES`` (0.0 for one never marked)."""
        return {f"perf/startup/{p}_s": self.seconds.get(p, 0.0) for p in STARTUP_PHASES}


STARTUP = StartupPhases()  # this process's start-up phases (a multirun job restarts them: ``JobClock.for_job``)


class JobClock:
    """Job start, first step dispatched and end, in seconds.

    Args:
      start_epoch_s: job start in ``time.time()`` seconds; None: now.
      phases: start-up phases to close with ``first_step`` (their ``perf/startup/*_s`` join the summary).
    """

    def __init__(self, start_epoch_s: float | None = None, phases: StartupPhases | None = None):
        now_epoch, now = time.time(), time.perf_counter()
        start_epoch_s = now_epoch if start_epoch_s is None else start_epoch_s
        self._start = now - (now_epoch - start_epoch_s)  # on the perf_counter scale
        self._first_step: float | None = None
        self.phases = phases
        self.on_first_step: Callable[[], None] | None = None  # called once, right after the first step's mark
        if phases is not None:
            self._start = phases.ensure_started()  # one origin: the phases add up to perf/startup_s

    @classmethod
    def for_job(cls, multirun: bool) -> JobClock:
        """Process start for a single run; now (the job's own start) when several jobs share a process.
        Either way the clock closes this process's ``STARTUP`` phases (a multirun job restarts them now)."""
        if multirun:
            STARTUP.start(time.perf_counter())
        return cls(None if multirun else process_start_epoch_s(), phases=STARTUP)

    def first_step(self) -> None:
        """Marks the first training step dispatched (later calls do nothing); it ends the ``first_step``
        start-up phase."""
        if self._first_step is None:
            self._first_step = time.perf_counter()
            if self.phases is not None:
                self.phases.mark("first_step", self._first_step)
            if self.on_first_step is not None:
                self.on_first_step()

    def since_first_step_s(self) -> float:
        """Seconds since the first step was dispatched (since job start if none was)."""
        return time.perf_counter() - (self._first_step if self._first_step is not None else self._start)

    def summary(self) -> dict[str, float]:
        """``perf/wall_s`` (job start to now) and ``perf/startup_s`` (job start to the first step), with its
        phases ``perf/startup/<phase>_s`` when the clock has them."""
        out = {"perf/wall_s": time.perf_counter() - self._start}
        if self._first_step is not None:
            out["perf/startup_s"] = self._first_step - self._start
            if self.phases is not None:
                out.update(self.phases.summary())
        return out


def check_target_accuracy(target: float | None) -> str | None:
    """One-line error for ``train.target_accuracy`` outside (0, 1], else None (null is allowed)."""
    if target is None or (0.0 < target <= 1.0):
        return None
    return f"train.target_accuracy={target} must be in (0, 1] (a fraction of correct answers) or null"


class TargetTracker:
    """First evaluation that reaches ``target`` accuracy (None: nothing tracked, no keys)."""

    def __init__(self, target: float | None):
        self.target = target
        self.step: int | None = None
        self.time_s: float | None = None

    def observe(self, step: int, accuracy: float, elapsed_s: float) -> bool:
        """Records an evaluation at optimizer ``step`` (``elapsed_s``: training time up to its end);
        returns True the first time ``accuracy >= target``."""
        if self.target is None or self.step is not None or not accuracy >= self.target:
            return False
        self.step, self.time_s = int(step), float(elapsed_s)
        return True

    def summary(self) -> dict[str, Any]:
        """``train/target_accuracy``, ``train/steps_to_target`` and ``perf/time_to_target_s`` (null if the
        target was never reached); empty without a target."""
        if self.target is None:
            return {}
        return {
            "train/target_accuracy": self.target,
            "train/steps_to_target": self.step,
            "perf/time_to_target_s": self.time_s,
        }
