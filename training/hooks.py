"""What the loop does between steps, one small object per concern.

A hook says when it is due (``due(step)``, ``step`` = optimizer steps done so far) and acts (``run(loop,
step)``). The loop asks every hook once per step, in order, and, when any is due, pauses its step timer ONCE
(waiting for the last step's output), runs the due hooks in order, and resumes. ``close()`` runs when the loop
ends (also on errors) and ``summary()`` adds keys to the run's summary.

Order matters and is the list's order: values a hook adds to ``loop.extra`` (sync check, evaluation) go on the
record the window log writes at that step; the checkpoint hook runs after the window is logged (a non-finite
loss stops the run first). A hook that reads what an earlier one produced (e.g. a target-accuracy check
reading ``loop.extra["eval/accuracy"]`` after ``Evaluation``) is placed after it; one that needs per-window
throughput reads ``loop.windows`` (``(steps, elapsed_s)`` of each logged window, appended by ``WindowLog``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Optional

import jax

from core.errors import TrainingError
from measure.profiler import Profiler
from measure.rates import window_perf
from training import checkpoint
from training.signals import StopOnSignal

log = logging.getLogger(__name__)


class StepTimer:
    """Wall time of the steps of a logging window, excluding pauses (hooks: eval, sync checks, logging)."""

    def __init__(self):
        self.elapsed_s, self.steps, self._t0 = 0.0, 0, time.perf_counter()

    def pause(self, last_output) -> None:
        jax.block_until_ready(last_output)
        self.elapsed_s += time.perf_counter() - self._t0

    def resume(self) -> None:
        self._t0 = time.perf_counter()

    def take(self) -> tuple[float, int]:
        out = (self.elapsed_s, self.steps)
        self.elapsed_s, self.steps = 0.0, 0
        return out


@dataclasses.dataclass
class LoopState:
    """What the hooks see and share: the current state and last step's metrics, the window's device metrics,
    the extras of this step, the last logged record, and per-window timings."""

    state: Any
    metrics: Any = None
    window_records: list = dataclasses.field(default_factory=list)  # (step, device metrics | (metrics, extra))
    extra: dict = dataclasses.field(default_factory=dict)
    last: dict = dataclasses.field(default_factory=dict)
    windows: list = dataclasses.field(default_factory=list)  # (steps, elapsed_s) of each logged window
    timer: StepTimer = dataclasses.field(default_factory=StepTimer)
    logged_this_step: bool = False


class Hook:
    """Base class: never due, nothing to close, nothing to summarise."""

    def due(self, step: int) -> bool:
        return False

    def run(self, loop: LoopState, step: int) -> None:
        pass

    def close(self) -> None:
        pass

    def summary(self) -> dict[str, Any]:
        return {}


class ProfilerHook(Hook):
    """Starts/stops the ``jax.profiler`` window (``measure.profiler.Profiler``); its result goes in the summary."""

    def __init__(self, profiler: Profiler):
        self.profiler = profiler

    def due(self, step: int) -> bool:
        return self.profiler.acts_at(step)

    def run(self, loop: LoopState, step: int) -> None:
        self.profiler.after_step(step, loop.metrics)

    def close(self) -> None:
        self.profiler.close()

    def summary(self) -> dict[str, Any]:
        return self.profiler.result()


class SyncCheck(Hook):
    """Every ``every`` steps and at the last: the max difference between replicas (must be 0.0)."""

    def __init__(self, mode, every: int, n_steps: int, strict: bool):
        self.mode, self.every, self.n_steps, self.strict = mode, every, n_steps, strict

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.n_steps

    def run(self, loop: LoopState, step: int) -> None:
        divergence = self.mode.replica_divergence((loop.state.params, loop.state.opt_state))
        loop.extra["sync/max_replica_divergence"] = divergence
        if divergence != 0.0:
            msg = f"replicas diverged at step {step}: max |difference| = {divergence:g}"
            if self.strict:
                raise TrainingError(msg + " (train.sync_strict=true)")
            log.warning(msg)


class Evaluation(Hook):
    """Every ``every`` steps (not at the last: the run's final evaluation follows the loop)."""

    def __init__(self, evaluate, every: Optional[int], n_steps: int):
        self.evaluate, self.every, self.n_steps = evaluate, every, n_steps

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0 and step != self.n_steps

    def run(self, loop: LoopState, step: int) -> None:
        loop.extra.update(self.evaluate(loop.state.params))


class CheckpointHook(Hook):
    """Periodic and final saves, and stop-on-signal: a signal makes the step a save and then stops the run.

    ``due`` must be asked every step (``StopOnSignal.requested`` takes part in the preemption sync of a
    multi-process job); it answers the same for repeated calls at one step (the window log asks it too).
    """

    def __init__(self, ckpts: checkpoint.RunCheckpoints, stop: StopOnSignal, n_steps: int, directory,
                 wandb_run_id):
        self.ckpts, self.stop, self.n_steps, self.directory = ckpts, stop, n_steps, directory
        self.wandb_run_id = wandb_run_id  # () -> Optional[str]
        self.saving, self._asked = False, None

    def due(self, step: int) -> bool:
        """Whether the state after ``step`` is saved (asks ``StopOnSignal.requested`` once per step)."""
        if self._asked != step:
            self._asked = step
            self.saving = self.ckpts.saves_at(step) | self.stop.requested(step)  # `|`: requested() every step
        return self.saving

    def run(self, loop: LoopState, step: int) -> None:
        reason = "final" if step == self.n_steps else ("signal" if self.stop.signal_name else "periodic")
        try:
            saved = self.ckpts.save(loop.state, step, self.wandb_run_id(), reason)
        except checkpoint.NonFiniteError as e:
            raise TrainingError(str(e)) from None
        if self.stop.signal_name is not None and step < self.n_steps:
            where = (f"checkpoint saved in {saved}; continue with the same command and "
                     f"checkpoint.dir={self.directory} (or checkpoint.resume={saved})"
                     if saved else "no checkpoint written (checkpoint.enabled=false)")
            raise TrainingError(f"stopped by {self.stop.signal_name} after step {step} of {self.n_steps}; {where}")

    def close(self) -> None:
        self.stop.uninstall()
        self.ckpts.close()  # waits for the last asynchronous save

    def summary(self) -> dict[str, Any]:
        return self.ckpts.summary()


class WindowLog(Hook):
    """Every ``every`` steps, at the last, and whenever a checkpoint is saved: the window's records to the
    reporter, with its step time, throughput, MFU and modelled comm ratio on the last record."""

    def __init__(self, mode, updater, reporter, bar, *, every: int, n_steps: int, global_batch: int,
                 info: dict, peak_flops_per_s: Optional[float], saving: CheckpointHook):
        self.mode, self.updater, self.reporter, self.bar = mode, updater, reporter, bar
        self.every, self.n_steps, self.global_batch = every, n_steps, global_batch
        self.info, self.peak_flops_per_s, self.saving = info, peak_flops_per_s, saving

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.n_steps or self.saving.due(step)

    def run(self, loop: LoopState, step: int) -> None:
        elapsed_s, steps = loop.timer.take()
        loop.windows.append((steps, elapsed_s))
        perf = window_perf(elapsed_s / steps, self.global_batch, self.mode.num_devices, self.info,
                           self.peak_flops_per_s)
        records = flush_window(self.mode, self.updater, loop.window_records, perf, loop.extra)
        loop.window_records, loop.extra, loop.logged_this_step = [], {}, True
        loop.last.update(records[-1])
        self.reporter.log(records)
        self.bar.set_postfix(loss=f"{loop.last['train/loss']:.4f}", ex_s=f"{perf['perf/examples_per_s']:.0f}")


def flush_window(mode, updater, window_records, perf: dict, extra: dict) -> list[dict]:
    """Device metrics of a window -> one host record per step (``updater.complete`` adds the host-side
    metrics); perf and extras go on the last record.

    Raises:
      TrainingError: a step's loss or gradients were not finite (names the first bad step).
    """
    records = []
    for step, item in window_records:
        metrics, more = item if isinstance(item, tuple) else (item, {})
        host = {k: float(v) for k, v in mode.metrics_to_host(metrics).items()}
        records.append({"step": step, **host, **more})
    bad = updater.complete(records)
    if bad is not None:
        raise TrainingError(f"non-finite loss or gradient at step {bad['step']} (loss={bad['train/loss']}); "
                            f"lower optim.lr, enable optim.clip_grad_norm, or use precision=fp32")
    records[-1].update(perf)
    records[-1].update(extra)
    return records
