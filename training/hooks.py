"""What the loop does between steps, one small object per concern.

A hook says when it is due (``due(step)``, ``step`` = optimizer steps done so far) and acts (``run(loop, step)``);
the loop pauses its step timer ONCE around the due hooks, runs them in the list's order (``training.run.make_hooks``:
profiler, sync check, evaluation, window log, final evaluation, checkpoint), and calls ``close()`` when it ends
(also on errors); ``summary()`` adds keys to the run's summary. Values a hook adds to ``loop.extra`` go on the
record the window log writes at that step. The checkpoint hook acts last, so a non-finite loss or non-finite final
metrics stop the run before a save: a diverged run leaves no final checkpoint."""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from typing import Any, Callable, Optional

import jax

from core.errors import Stopped, TrainingError, error_text
from measure.profiler import Profiler
from measure.rates import perplexity, window_perf
from measure.throughput import JobClock, TargetTracker, WindowStats
from parallel.state import metrics_to_host, replica_divergence
from training import checkpoint
from training.build import Experiment, in_flight_bound
from training.console import eval_line, window_line
from training.checkpoint.policy import NEW_RUN
from training.process import StopOnSignal, saved_stop_text

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
    the extras of this step, the last logged record, per-window timings, the job's clock (first step
    dispatched) and the final evaluation (None until it ran)."""

    state: Any
    metrics: Any = None
    window_records: list = dataclasses.field(default_factory=list)  # (step, device metrics | (metrics, extra))
    extra: dict = dataclasses.field(default_factory=dict)
    last: dict = dataclasses.field(default_factory=dict)
    windows: list = dataclasses.field(default_factory=list)  # (steps, elapsed_s) of each logged window
    timer: StepTimer = dataclasses.field(default_factory=StepTimer)
    clock: JobClock = dataclasses.field(default_factory=JobClock)
    final: Optional[dict] = None
    logged_this_step: bool = False
    evaluation: Optional[tuple[int, dict]] = None  # (step, metrics) of the newest evaluation (periodic or final)
    unevaluated: Optional[int] = None  # a step whose periodic evaluation a signal ended (its checkpoint says so)


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

    def __init__(self, every: int, n_steps: int, strict: bool):
        self.every, self.n_steps, self.strict = every, n_steps, strict

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.n_steps

    def run(self, loop: LoopState, step: int) -> None:
        divergence = replica_divergence((loop.state.params, loop.state.opt_state))
        loop.extra["sync/max_replica_divergence"] = divergence
        if divergence != 0.0:
            msg = f"replicas diverged at step {step}: max |difference| = {divergence:g}"
            if self.strict:
                raise TrainingError(msg + " (train.sync_strict=true)")
            log.warning(msg)


class Evaluation(Hook):
    """Every ``every`` steps (not at the last: ``FinalEvaluation`` does that one); each result goes to the
    target-accuracy tracker with the time since the first step was dispatched."""

    def __init__(self, evaluate, every: Optional[int], n_steps: int, target: TargetTracker):
        self.evaluate, self.every, self.n_steps, self.target = evaluate, every, n_steps, target

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0 and step != self.n_steps

    def run(self, loop: LoopState, step: int) -> None:
        try:
            loop.extra.update(self.evaluate(loop.state.params))
        except EvaluationStopped:  # a signal: the checkpoint hook saves this step (evaluation pending) and stops
            loop.unevaluated = step
            return
        loop.evaluation = (step, {k: v for k, v in loop.extra.items() if k.startswith("eval/")})
        log.info("%s", eval_line(step, self.n_steps, loop.evaluation[1]))  # train.log and the console
        self.target.observe(step, loop.extra["eval/accuracy"], loop.clock.since_first_step_s())


class FinalEvaluation(Hook):
    """At the last step, after the window is logged and before the final checkpoint: the final evaluation (to
    ``loop.final`` and the target tracker) and its record (with the profile's figures), then the divergence check.

    Raises (from ``run``), after the record is written: TrainingError for a non-finite final metric
    (``nonfinite_final``) or, with ``exploded_limit`` (the number of classes C), a final loss above 10 x ln C
    (``exploded_final``)."""

    def __init__(
        self,
        evaluate,
        n_steps: int,
        reporter,
        target: TargetTracker,
        profiler: Profiler,
        exploded_limit: Optional[int] = None,
    ):
        self.evaluate, self.n_steps, self.reporter = evaluate, n_steps, reporter
        self.target, self.profiler, self.exploded_limit = target, profiler, exploded_limit

    def due(self, step: int) -> bool:
        return step == self.n_steps

    def run(self, loop: LoopState, step: int) -> None:
        try:
            final = self.evaluate(loop.state.params)
        except EvaluationStopped:  # a signal: the final checkpoint is saved, the run stops (loop.final stays None)
            return
        self.target.observe(step, final["eval/accuracy"], loop.clock.since_first_step_s())
        loop.final = final
        loop.evaluation = (step, final)
        profiled = self.profiler.result()
        self.reporter.log([{"step": step, **final, **{k: v for k, v in profiled.items() if not isinstance(v, str)}}])
        diverged = nonfinite_final(loop.last, final)
        if diverged:
            raise TrainingError(diverged)
        exploded = exploded_final(loop.last, final, self.exploded_limit) if self.exploded_limit else None
        if exploded:
            raise TrainingError(exploded.removeprefix("warning: ") + " (train.allow_exploded_loss=true keeps the run)")


class CheckpointHook(Hook):
    """Periodic and final saves, and stop-on-signal: a signal makes the step a save, then stops the run. ``due``
    must be asked every step (it takes part in a multi-process job's preemption sync) and answers the same for
    repeated calls at one step."""

    def __init__(self, ckpts: checkpoint.RunCheckpoints, stop: StopOnSignal, n_steps: int, directory, wandb_run_id):
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
        """Saves the state after ``step``; after a signal's save, stops the run once that save is on disk. Raises
        TrainingError for a non-finite state, too many undeletable steps, a checkpoint that could not be written,
        or ``Stopped`` after a signal (its line says where the checkpoint is)."""
        reason = "final" if step == self.n_steps else ("signal" if self.stop.signal_name else "periodic")
        unevaluated = step == self.n_steps and loop.final is None  # a signal ended the final evaluation
        stopping = self.stop.signal_name is not None and (step < self.n_steps or unevaluated)
        stopped = f"stopped by {self.stop.signal_name} after step {step} of {self.n_steps}"
        stopped += " (before its final evaluation); " if unevaluated else "; "
        pending = {PENDING_EVALUATION: True} if loop.unevaluated == step else None  # resumed: evaluated first
        try:
            saved = self.ckpts.save(loop.state, step, self.wandb_run_id(), reason, extra=pending)
            if stopping:
                self.ckpts.wait()  # the line below names the checkpoint as saved: it must be on disk
        except (checkpoint.NonFiniteError, checkpoint.UndeletableError, checkpoint.CheckpointWriteError) as e:
            raise TrainingError((stopped if stopping else "") + str(e)) from None
        if stopping:
            raise Stopped(stopped + saved_stop_text(saved, self.directory))

    def close(self) -> None:
        """Waits for the last asynchronous save. Raises TrainingError when its background write failed."""
        self.stop.uninstall()
        try:
            self.ckpts.close()
        except checkpoint.CheckpointWriteError as e:
            raise TrainingError(str(e)) from None

    def summary(self) -> dict[str, Any]:
        return self.ckpts.summary()


# in a checkpoint's metadata: a signal ended its step's periodic evaluation, which the resumed run runs first
PENDING_EVALUATION = "pending_evaluation"


def evaluate_pending(hooks: list[Hook], loop: LoopState, restored, n_steps: int, reporter) -> None:
    """Before a resumed run's first step: the periodic evaluation of the restored step when a signal ended it
    (``restored.metadata[PENDING_EVALUATION]``), with its record at that step and the best-checkpoint comparison,
    as the stopped run would have done. Raises ``Stopped`` when a signal ends it again (the checkpoint stays
    pending)."""
    step = None if restored is None else restored.step
    if step is None or step >= n_steps or not restored.metadata.get(PENDING_EVALUATION):
        return  # nothing pending (at the last step the final evaluation runs anyway)
    for hook in hooks:
        if isinstance(hook, (Evaluation, BestCheckpointHook)) or (
            isinstance(hook, CheckpointHook) and loop.unevaluated == step
        ):
            hook.run(loop, step)  # the checkpoint hook, after a signal: raises Stopped
    reporter.log([{"step": step, **loop.evaluation[1]}])
    loop.extra = {}
    loop.timer.resume()  # the evaluation's time is not a step's


class BestCheckpointHook(Hook):
    """After each evaluation (every ``every`` steps and the final one, which comes first when both are due): the
    state is saved as the best checkpoint when the metric improved (``checkpoint.BestCheckpoint``). It acts after
    the final evaluation's checks (a non-finite run keeps its earlier best) and before the periodic and final
    saves."""

    def __init__(self, best: checkpoint.BestCheckpoint, every: Optional[int], n_steps: int, wandb_run_id):
        self.best, self.every, self.n_steps, self.wandb_run_id = best, every, n_steps, wandb_run_id

    def due(self, step: int) -> bool:
        return (bool(self.every) and step % self.every == 0) or step == self.n_steps

    def run(self, loop: LoopState, step: int) -> None:
        """Raises TrainingError: a non-finite state or a best checkpoint that could not be written."""
        if loop.evaluation is None or loop.evaluation[0] != step:
            return
        try:
            self.best.observe(loop.state, step, loop.evaluation[1], self.wandb_run_id())
        except (checkpoint.NonFiniteError, checkpoint.CheckpointWriteError) as e:
            raise TrainingError(str(e)) from None

    def close(self) -> None:
        try:
            self.best.close()
        except checkpoint.CheckpointWriteError as e:
            raise TrainingError(str(e)) from None

    def summary(self) -> dict[str, Any]:
        return self.best.summary()


class WindowLog(Hook):
    """Every ``every`` steps, at the last, and whenever a checkpoint is saved: the window's records to the
    reporter, with its step time, throughput, MFU and modelled comm ratio on the last record; the window's
    timing to ``stats`` (the run's steady-state throughput) and, on process 0, one ``train.log`` line."""

    def __init__(
        self,
        mode,
        updater,
        reporter,
        bar,
        *,
        every: int,
        n_steps: int,
        global_batch: int,
        info: dict,
        peak_flops_per_s: Optional[float],
        saving: CheckpointHook,
        stats: WindowStats,
    ):
        self.mode, self.updater, self.reporter, self.bar = mode, updater, reporter, bar
        self.every, self.n_steps, self.global_batch = every, n_steps, global_batch
        self.info, self.peak_flops_per_s, self.saving, self.stats = info, peak_flops_per_s, saving, stats

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.n_steps or self.saving.due(step)

    def run(self, loop: LoopState, step: int) -> None:
        elapsed_s, steps = loop.timer.take()
        loop.windows.append((steps, elapsed_s))
        self.stats.add(elapsed_s, steps)
        perf = window_perf(
            elapsed_s / steps, self.global_batch, self.mode.num_devices, self.info, self.peak_flops_per_s
        )
        try:
            records = flush_window(self.updater, loop.window_records, perf, loop.extra)
        except NonFiniteLoss as e:  # the window's steps up to the first bad one are recorded, then the run stops
            try:
                self.reporter.log(e.records)
            except Exception as log_error:  # e.g. a full disk: the non-finite loss stays the run's error
                log.warning(f"the failing window's records were not written: {error_text(log_error)}")
            raise
        loop.window_records, loop.extra, loop.logged_this_step = [], {}, True
        loop.last.update(records[-1])
        self.reporter.log(records)
        self.bar.set_postfix(loss=f"{loop.last['train/loss']:.4f}", ex_s=f"{perf['perf/examples_per_s']:.0f}")
        if self.reporter.enabled:  # process 0 (the others' figures are their own timings)
            log.info(
                "%s",
                window_line(
                    step,
                    self.n_steps,
                    loop.last["train/loss"],
                    perf["perf/examples_per_s"],
                    perf.get("perf/tokens_per_s"),
                ),
            )


class NonFiniteLoss(TrainingError):
    """A step's loss or gradients were not finite. ``records``: the window's host records up to and including the
    first bad step (without the window's perf and extras), which ``WindowLog`` writes before the run stops."""

    def __init__(self, message: str, records: list[dict]):
        super().__init__(message)
        self.records = records


def flush_window(updater, window_records, perf: dict, extra: dict) -> list[dict]:
    """Device metrics of a window -> one host record per step (``updater.complete`` adds the host-side metrics),
    perf and extras on the last. Raises NonFiniteLoss (a TrainingError) naming the first non-finite step."""
    items = [item if isinstance(item, tuple) else (item, {}) for _, item in window_records]
    hosts = metrics_to_host([metrics for metrics, _ in items])  # the window's metrics in one transfer
    records = [
        {"step": step, **{k: float(v) for k, v in host.items()}, **more}
        for (step, _), host, (_, more) in zip(window_records, hosts, items)
    ]
    bad = updater.complete(records)
    if bad is not None:
        raise NonFiniteLoss(
            f"non-finite loss or gradient at step {bad['step']} (loss={bad['train/loss']}); "
            f"lower optim.lr, enable optim.clip_grad_norm, or, under bf16/fp16, use precision=fp32, {NEW_RUN}",
            records[: next(i for i, record in enumerate(records) if record is bad) + 1],
        )
    records[-1].update(perf)
    records[-1].update(extra)
    return records


# ---- the evaluation and whether the final numbers are usable ------------------------------------------------
class EvaluationStopped(Exception):
    """A stop signal came during an evaluation, which ended between two batches (``evaluate``'s ``stopped``)."""


def evaluate(
    exp: Experiment,
    params,
    eval_set,
    bytes_per_token: Optional[float] = None,
    stopped: Optional[Callable[[], bool]] = None,
) -> dict[str, float]:
    """Loss and accuracy over the whole test split (padded, masked: the denominator is exact); for a language
    model on text also ``eval/bpb``, bits per byte: the loss (nats per token) / ln 2 / ``bytes_per_token`` (of the
    evaluated target tokens, ``data.text.TextEvalSet``), comparable across tokenizers.

    Dispatches under the training loop's in-flight bound (``train.max_in_flight`` with more than one device):
    an unbounded queue of simulated-device collectives aborts the process on the CPU backend. ``stopped`` is asked
    before each batch (a stop signal: ``StopOnSignal``); when it says True, raises ``EvaluationStopped``."""
    totals = None
    bound = in_flight_bound(exp.mode.num_devices, exp.plan.cfg.train.max_in_flight)
    in_flight: collections.deque = collections.deque()
    for batch in eval_set.batches:
        if stopped is not None and stopped():
            raise EvaluationStopped
        sums = exp.steps.eval(params, batch)
        totals = sums if totals is None else jax.tree.map(lambda a, b: a + b, totals, sums)
        if bound is not None:
            in_flight.append(totals)
            if len(in_flight) > bound:
                jax.block_until_ready(in_flight.popleft())
    host = metrics_to_host(totals)
    count = float(host["count"])
    assert count == eval_set.num_examples, (count, eval_set.num_examples)
    out = {"eval/loss": float(host["loss_sum"]) / count, "eval/accuracy": float(host["correct"]) / count}
    if exp.local.tokens:  # language model: loss in nats per token, perplexity = exp(loss)
        out["eval/perplexity"] = perplexity(out["eval/loss"])
        if bytes_per_token:
            out["eval/bpb"] = out["eval/loss"] / math.log(2) / bytes_per_token
    return out


# The final values a run reports as its result; any of them non-finite means the run diverged.
FINAL_KEYS = ("train/loss", "train/accuracy", "eval/loss", "eval/accuracy")


def nonfinite_final(last_train: dict, final_eval: dict) -> Optional[str]:
    """One-line error naming every non-finite final metric, or None when all are finite. ``last_train``: the last
    logged training record (empty when a resumed run trained no step); ``final_eval``: the final evaluation."""
    values = {
        **{k: last_train[k] for k in FINAL_KEYS if k in last_train},
        **{k: final_eval[k] for k in FINAL_KEYS if k in final_eval},
    }
    bad = {k: v for k, v in values.items() if isinstance(v, (int, float)) and not math.isfinite(v)}
    if not bad:
        return None
    which = ", ".join(f"{k}={v}" for k, v in sorted(bad.items()))
    return (
        f"the run diverged: final {which} is not finite; lower optim.lr, enable optim.clip_grad_norm, "
        f"or, under bf16/fp16, use precision=fp32, {NEW_RUN}"
    )


# A final loss this many times the loss of a uniform guess (ln C) has exploded (see ``exploded_final``).
EXPLODED_LOSS_FACTOR = 10.0


def exploded_final(last_train: dict, final_eval: dict, num_classes: int) -> Optional[str]:
    """One-line warning when a final ``train/loss`` or ``eval/loss`` is finite but above ``EXPLODED_LOSS_FACTOR``
    x ln C, the loss of a uniform guess over ``num_classes`` classes (far above where a run recovering from a high
    learning rate ends), else None. ``FinalEvaluation`` fails the run with it unless ``train.allow_exploded_loss``."""
    limit = EXPLODED_LOSS_FACTOR * math.log(num_classes)
    values = {**{k: last_train.get(k) for k in ("train/loss",)}, **{k: final_eval.get(k) for k in ("eval/loss",)}}
    high = {k: v for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v) and v > limit}
    if not high:
        return None
    which = " and ".join(f"{k}={v:.4g}" for k, v in sorted(high.items(), reverse=True))
    return (
        f"warning: the loss exploded: final {which} {'are' if len(high) > 1 else 'is'} above "
        f"{EXPLODED_LOSS_FACTOR:g} x ln({num_classes}) = "
        f"{limit:.3g} (a uniform guess scores ln({num_classes})); lower optim.lr or enable optim.clip_grad_norm "
        f"{NEW_RUN}"
    )
