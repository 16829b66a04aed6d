"""One run, top to bottom: ``run_and_report`` -> ``run``: ``prepare`` (plan, data, build, restore, compile) ->
start reporting -> ``train_loop`` (the steps, ``compiled(state, batch)``, built by ``parallel.base`` around
``core.step``, and the hooks that are due after each) -> ``finish`` (the summary)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import functools
import json
import logging
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import jax
import numpy as np
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from conf.schema import Config, as_dict
from core.errors import USER_ERRORS, ConfigError, Stopped, TrainingError, error_text
from data.load import TEXT_DATA, text_corpus, text_info
from data.pipeline import DeviceSource, SyntheticSource, make_eval_set, train_batches
from measure.compiled import (
    CacheEvents,
    compiled_step_metrics,
    hardware_profile,
    lookup_link_bytes_per_s,
    lookup_peak_flops_per_s,
    peak_bytes_per_device,
    state_bytes_per_device,
)
from measure.hardware import describes_device
from measure.memory import accumulation_peaks, check_eval_fits, check_step_fits, out_of_memory_as_error
from measure.profiler import Profiler, check_window, explain_ratio
from measure.rates import comm_time_model_s, perplexity, token_rates
from measure.throughput import STARTUP, JobClock, TargetTracker, WindowStats, in_multirun
from parallel.state import host_abstract, state_to_host
from training import checkpoint
from training.build import (
    Experiment,
    Plan,
    build,
    describe,
    gpt_dims,
    in_flight_bound,
    language_model_info,
    load_data,
    plan,
    static_info,
    total_steps,
    with_text_vocab,
)
from training.console import (
    console,
    figure,
    quiet_log_write_errors,
    startup_breakdown_line,
    startup_line,
    throughput_text,
)
from training.distributed import Startup, check_device_counts, dump_batch_indices
from training.hooks import (
    BestCheckpointHook,
    CheckpointHook,
    Evaluation,
    FinalEvaluation,
    Hook,
    LoopState,
    ProfilerHook,
    SyncCheck,
    WindowLog,
    evaluate,
    evaluate_pending,
    exploded_final,
)
from training import peers, process
from training.process import StopOnSignal, interrupted
from training.report import Reporter, start_reporting
from training.validate import check_run_folder

log = logging.getLogger(__name__)
_RATIO_REPORTED: set[tuple[str, str]] = set()  # (hardware, device kind) whose missing ratios were explained


def run_and_report(cfg: Config, run_dir: Path, startup: Optional[Startup] = None) -> bool:
    """Runs ``cfg`` in ``run_dir`` (``startup``: what ``setup_runtime`` returned); returns True on success. Bad input
    (``USER_ERRORS``) prints one line ``error: ...`` and writes a failed ``summary.json``; anything else is a bug
    and propagates with its traceback, after the summary and W&B are closed."""
    process.set_phase("start-up")  # for the line of a stop by a signal (training.process.stop_text)
    quiet_log_write_errors()  # train.log on a disk that fills: one warning line, not a traceback per line
    settings = None if startup is None else startup.settings  # process 0 reports (known before the backend is up)
    reporter = Reporter(run_dir, enabled=settings is None or settings.process_id == 0)
    try:
        jax.devices()  # the backend (started beside the imports by train.py): what is left of its start is `runtime`
        STARTUP.mark("runtime")
        reporter.enabled = jax.process_index() == 0
        if startup is not None:  # a bad multi-process setting or unequal device counts stop here
            startup.raise_error()
        if jax.process_count() > 1:
            check_device_counts()
            watch_peers(settings, run_dir, reporter, cfg)
        with disk_full_as_error(run_dir):
            summary = run(cfg, run_dir, reporter)
    except USER_ERRORS as e:
        line = str(e).splitlines()[0] if str(e) else type(e).__name__
        peers.await_peer_death(0.0)  # a dead peer's own line is the job's
        status = "stopped" if isinstance(e, Stopped) else "failed"  # saved and stopped on a signal
        peers.finished(status, line)
        _close_after_error(reporter, {**describe(cfg), "status": status, "error": line}, f"error: {line}")
        checkpoint.release_claim()  # a checkpoint folder this run made and never wrote goes now (a sweep's next job)
        return False
    except BaseException as e:
        # a signal (a Ctrl-C, or SIGTERM: training.process.stop_handler; or an error it caused, e.g. in a C
        # extension's import): train.py prints its line; or a bug
        if interrupted(e):
            values = {"status": "stopped", "error": process.stop_text()}
        else:
            peers.await_peer_death(PEER_ERROR_WAIT_S)  # a collective that failed because a peer died: its line
            values = {"status": "failed", "error": (f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)}
        peers.finished(values["status"])
        reporter.summary({**describe(cfg), **{k: v.splitlines()[0] for k, v in values.items()}})
        reporter.close(exit_code=1)
        raise
    if summary.get("checkpoint/already_complete"):
        console(
            f"already complete at step {summary.get('train/steps')}: eval/accuracy="
            f"{summary.get('eval/accuracy')} (checkpoint {summary.get('checkpoint/last_path')}); nothing to do"
        )
        if not keeps_summary(run_dir / "summary.json"):
            reporter.summary(summary)
        reporter.close(exit_code=0)
        peers.finished("ok")
        return True
    try:
        with disk_full_as_error(run_dir):
            reporter.summary(summary)
    except TrainingError as e:  # the run trained, but its summary.json does not fit on the disk
        peers.finished("failed", str(e))
        _close_after_error(reporter, {**summary, "status": "failed", "error": str(e)}, f"error: {e}")
        return False
    reporter.close(exit_code=0)
    peers.finished("ok")
    log.info(
        "eval/accuracy=%.4f eval/loss=%.4f %s wall=%s startup=%s; outputs in %s",
        summary["eval/accuracy"],
        summary["eval/loss"],
        throughput_text(summary),
        figure(summary.get("perf/wall_s"), ".1f", "s"),
        figure(summary.get("perf/startup_s"), ".1f", "s"),
        run_dir,
    )
    return True


PEER_ERROR_WAIT_S = 5.0  # an unexpected error of a multi-process run: this long for the watch to see a dead peer


def watch_peers(settings, run_dir: Path, reporter: Reporter, cfg: Config) -> None:
    """The processes of the job watch each other from here on (``training.peers``): one that dies stops the others
    at once, and process 0 (or the lowest survivor) says which, in one line and in ``summary.json``."""
    if settings is None:
        return
    peers.start(
        settings.process_id,
        settings.num_processes,
        settings.coordinator.rpartition(":")[0].strip("[]"),
        run_dir,
        process.resume_hint,
    )
    peers.on_death(lambda line: reporter.summary({**describe(cfg), "status": "failed", "error": line}))


DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # no space left, quota exceeded, file-size limit
NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)  # a folder made read-only (or immutable) under the run


@contextlib.contextmanager
def disk_full_as_error(run_dir: Path) -> Iterator[None]:
    """Raises TrainingError (one line) for an ``OSError`` of a full disk, or of a run folder that stopped taking
    writes, in the block: a file of the run in ``run_dir`` (metrics.jsonl, ...) that cannot be written; its traceback
    would say nothing more; and for memory that ran out (``measure.memory``). Other errors go on."""
    try:
        yield
    except (MemoryError, RuntimeError, SystemError) as e:  # XLA's JaxRuntimeError is a RuntimeError
        out_of_memory_as_error(e, after_steps=process.phase == "end")
        raise
    except OSError as e:
        if e.errno not in DISK_FULL + NOT_WRITABLE:
            raise
        if e.errno in NOT_WRITABLE:
            fix = f"make {Path(e.filename).parent if e.filename else run_dir} writable"
        elif e.errno == errno.EFBIG:
            fix = "raise the file-size limit (ulimit -f)"
        else:
            fix = f"free space on the disk of {e.filename or run_dir}"
        raise TrainingError(f"a write failed ({error_text(e)}); {fix}, then run the same command") from None


def _close_after_error(reporter: Reporter, summary: dict, said: str) -> None:
    """Writes a failed run's summary, says ``said`` (after a warning of its writing: an earlier summary kept), and
    closes its files and W&B run. A disk that cannot take them (the run's error may be that disk filling up) adds
    nothing beside the error line: it is logged, without a traceback."""
    try:
        reporter.summary(summary)
    except OSError as e:
        log.info("summary.json could not be written: %s", error_text(e))
    console(said)
    try:
        reporter.close(exit_code=1)
    except OSError as e:
        log.info("the run's files could not be closed: %s", error_text(e))


def run(cfg: Config, run_dir: Path, reporter: Reporter) -> dict[str, Any]:
    """Runs one experiment and returns its summary. Raises USER_ERRORS with one-line messages."""
    clock = JobClock.for_job(multirun=in_multirun())  # perf/wall_s, perf/startup_s (measure/throughput.py)
    prep = prepare(cfg, run_dir)
    if isinstance(prep, Finished):  # a rerun of a finished run: its summary, no training, no W&B
        return {**prep.summary, "checkpoint/already_complete": True}
    n_devices = prep.exp.mode.num_devices
    start_reporting(reporter, cfg, prep.info, n_devices, prep.restored, prep.start, prep.n_steps)
    loop = LoopState(state=prep.exp.state, clock=clock)
    stats = WindowStats(prep.plan.global_batch, n_devices)
    if prep.restored is not None:  # the summary's training values also when this run trains no step
        loop.last.update(checkpoint.history_values(run_dir / "metrics.jsonl", prep.start))
        if prep.start >= prep.n_steps:  # no step runs here (killed after its final save): the run's windows
            for elapsed_s, steps in checkpoint.history_windows(run_dir / "metrics.jsonl", prep.start):
                stats.add(elapsed_s, steps)
    target = TargetTracker(cfg.train.target_accuracy)
    params = prep.param_count()
    prep.info.setdefault("model/param_count", params)  # summary.json: the report names the model by its size
    log.info(
        "%s",
        startup_line(
            prep.info,
            accum_steps=cfg.train.accum_steps,
            model=cfg.model.name,
            param_count=params,
            dataset=cfg.data.name,
        ),
    )
    # log lines above the bar, never glued to it; processes > 0 have no bar (and the redirect would drop their
    # console handler's WARNING level)
    with logging_redirect_tqdm() if reporter.enabled else contextlib.nullcontext():
        bar = tqdm(
            total=prep.n_steps,
            initial=prep.start,
            disable=not reporter.enabled or not sys.stderr.isatty(),  # in a file: the window log lines only
            desc="train",
            unit="step",
            dynamic_ncols=True,
            mininterval=1.0,
        )
        hooks = make_hooks(prep, reporter, bar, stats, target)
        STARTUP.mark("reporting")  # the loop's first dispatch ends the start-up (perf/startup/*_s)
        process.raise_if_stopped()  # a signal before the steps: no step runs (StopOnSignal has the next ones)
        process.set_phase("steps")
        loop.clock.on_first_step = lambda: log.info(
            "%s", startup_breakdown_line(loop.clock.summary(), prep.info.get("perf/startup/compile_cache"))
        )
        loop = train_loop(
            prep.compiled,
            loop,
            prep.first,
            prep.batches,
            start=prep.start,
            n_steps=prep.n_steps,
            hooks=hooks,
            bound=in_flight_bound(n_devices, cfg.train.max_in_flight),
            transfer_guard=cfg.train.transfer_guard,
            bar=bar,
            first=lambda: evaluate_pending(hooks, loop, prep.restored, prep.n_steps, reporter),
        )
    process.set_phase("end")
    if loop.final is None:  # resumed at the last step: no step ran, so its final evaluation runs now
        next(h for h in hooks if isinstance(h, FinalEvaluation)).run(loop, prep.n_steps)
    return finish(prep, loop, hooks, stats, target)


# ---- before the first step -------------------------------------------------------------------------------------
@dataclasses.dataclass
class Prepared:
    """One run, ready for its first step: ``exp.state`` the initial (or restored) placed state, ``first`` the batch
    of step ``start`` (with ``exp.feed``: the device arrays the step gathers it from), ``batches`` the following
    ones, ``compiled`` the train step, ``info`` the run's static figures (summary keys)."""

    cfg: Config
    plan: Plan
    run_dir: Path
    exp: Experiment
    source: Any
    eval_set: Any
    n_steps: int
    start: int
    restored: Optional[checkpoint.Restored]
    ckpt_plan: checkpoint.CheckpointPlan
    first: Any
    batches: Iterator
    lowered: Any
    compiled: Any
    info: dict[str, Any]
    peak_flops_per_s: Optional[float]

    def param_count(self) -> int:
        """Trainable parameters: elements of every leaf of the params."""
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(host_abstract(self.exp.state).params))


@dataclasses.dataclass
class Finished:
    """A rerun of a run that already finished: the saved run's ``summary.json`` (nothing to train)."""

    summary: dict[str, Any]


def prepare(cfg: Config, run_dir: Path) -> Union[Prepared, Finished]:
    """Plan, data, build, restore, compile: the run up to its first step (``Finished`` without compiling when
    the checkpoint restored is the final one of a run that already finished). Raises USER_ERRORS (one line)."""
    cfg = checkpoint.inherit_settings(cfg, run_dir)  # the null settings a resumed run keeps from its checkpoint
    p = plan(cfg)  # every check that needs the devices but neither data nor compilation
    check_run_folder(run_dir, cfg.checkpoint)
    STARTUP.mark("config")  # perf/startup/*_s (measure.throughput.StartupPhases)
    ckpt_plan = checkpoint.prepare(cfg.checkpoint, run_dir, jax.process_count())  # the resume path exists
    process.set_resume_hint(None if ckpt_plan.directory is None else str(ckpt_plan.directory))
    checkpoint.check_keep_best(cfg, ckpt_plan)
    checkpoint.claim(ckpt_plan, run_dir, jax.process_count())  # before it is written: one another run writes, refused
    if ckpt_plan.directory is not None:  # orbax's import overlaps data, build and compile
        checkpoint.preload_orbax()
    STARTUP.mark("checkpoint")
    text = None
    if cfg.model.name == "gpt" and cfg.data.name in TEXT_DATA:  # the tokenizer fixes the model's vocabulary
        text = text_corpus(cfg.data, checkpoint.saved_tokenizer(ckpt_plan))
        resolved = with_text_vocab(cfg, text.tokenizer)
        if resolved is not cfg:
            cfg, p = resolved, plan(resolved)
    source, test = load_data(cfg, p, text)
    n_steps = total_steps(cfg, source.steps_per_epoch)
    window_error = check_window(cfg.profile.enabled, cfg.profile.start_step, cfg.profile.num_steps, n_steps)
    if window_error:  # with train.steps set, plan() already checked this; with train.epochs it needs the data
        raise ConfigError(window_error)
    STARTUP.mark("data")
    # the split on the devices: the train step gathers its own batches (one program per step), except under pmap
    # (fuses_feed) and with the debug dump of placed indices (it reads each step's batch)
    fuse = isinstance(source, DeviceSource) and not cfg.train.debug_dump_indices
    exp = build(p, feed_for=source.feed if fuse else None)
    layout = exp.mode.batch_layout()
    STARTUP.mark("build")
    eval_set = make_eval_set(test, cfg.train.eval_batch, exp.mode.num_devices, layout)
    STARTUP.mark("data")
    restored, start, finished = restore(cfg, p, exp, ckpt_plan, n_steps, source.steps_per_epoch, source.fingerprint)
    if text is not None:  # once the resume is allowed: a refused one writes nothing in the checkpoint's folder
        checkpoint.save_tokenizer(text.tokenizer, run_dir, ckpt_plan)
    if finished is not None:
        return Finished(finished)
    STARTUP.mark("checkpoint")
    info = static_info(cfg, p, exp, n_steps, source.steps_per_epoch)
    info.update(text_info(text, test) if text is not None else {})
    # batches made on the devices: the split in device memory (data.on_device) or synthetic data generated there
    info["data/on_device"] = isinstance(source, (DeviceSource, SyntheticSource))
    if isinstance(source, DeviceSource):
        info["data/on_device_bytes"] = source.split_bytes  # per device
        info["data/gather_in_step"] = exp.feed is not None
    first_step = min(start, n_steps - 1)  # a resumed run continues the data order at its step
    if exp.feed is not None:  # the step's own step counter picks its batch: the loop hands it the split's arrays
        batches = source.device_feeds(layout, first_step, n_steps)
    else:
        batches = train_batches(source, layout, first_step, n_steps, cfg.data.prefetch)
    if cfg.train.debug_dump_indices:  # debug aid: which examples each process placed, per step
        batches = dump_batch_indices(batches, run_dir / f"debug_indices_process{jax.process_index()}.jsonl", first_step)
    first = next(batches)
    STARTUP.mark("data")
    lowered, compiled, peak_flops = compile_step(cfg, p, exp, first, eval_set, info)
    process.raise_if_stopped()  # a signal during XLA's compilation (C++) that an interrupt did not end
    STARTUP.mark("compile")
    checkpoint.wait_for_orbax()  # no import beside the steps (it would take the interpreter lock from them)
    STARTUP.mark("checkpoint")
    return Prepared(
        cfg=cfg,
        plan=p,
        run_dir=run_dir,
        exp=exp,
        source=source,
        eval_set=eval_set,
        n_steps=n_steps,
        start=start,
        restored=restored,
        ckpt_plan=ckpt_plan,
        first=first,
        batches=batches,
        lowered=lowered,
        compiled=compiled,
        info=info,
        peak_flops_per_s=peak_flops,
    )


def restore(
    cfg: Config,
    p: Plan,
    exp: Experiment,
    ckpt_plan,
    n_steps: int,
    steps_per_epoch: int,
    data_fingerprint: Optional[dict] = None,
):
    """Restores the checkpoint the resume policy picks onto THIS run's layout, before compiling; returns ``(restored
    or None, first step, the saved run's summary when it already finished or None)``; warns when the data order or
    settings changed. Raises ConfigError for settings or training data (``data_fingerprint``) a resume refuses
    (``training.checkpoint.policy``, read from the metadata before anything is restored) or a checkpoint past this
    run's last step."""
    checkpoint.check_resume_settings(  # refused: one line, nothing moved
        ckpt_plan, as_dict(cfg), p.global_batch, data_fingerprint, cfg.checkpoint.allow_data_change
    )
    restored = checkpoint.resume(ckpt_plan, exp.mode, exp.state)
    if restored is None:
        return None, 0, None
    if restored.step > n_steps:
        raise ConfigError(
            f"checkpoint {restored.path} is at step {restored.step}, past this run's {n_steps} steps; raise "
            f"train.steps (or train.epochs) to reach step {restored.step}, or start afresh with "
            f"checkpoint.resume=never and a checkpoint.dir of its own"
        )
    if restored.step == n_steps:
        finished = checkpoint.finished_summary(restored.metadata.get("run_dir"), n_steps)
        if finished is not None:  # a rerun of a finished run: its summary, no training, no W&B
            return restored, restored.step, finished
    exp.state = restored.state
    for line in checkpoint.data_order_warnings(
        restored.metadata,
        global_batch=p.global_batch,
        seed=cfg.train.seed,
        steps_per_epoch=steps_per_epoch,
        data=cfg.data.name,
    ):
        log.warning(line)
    changes = checkpoint.config_changes(restored.metadata.get("config", {}), as_dict(cfg))
    if changes:
        log.warning(f"resuming {restored.path} with settings that differ from its run: {'; '.join(changes)}")
    return restored, restored.step, None


def compile_step(cfg: Config, p: Plan, exp: Experiment, first, eval_set, info: dict[str, Any]):
    """Compiles the train step for ``first``'s shapes (one line when its peak, or the evaluation's on ``eval_set``,
    cannot fit); adds compile time, ``comm/*``, ``mem/*``, ``perf/flops_*``, the modelled communication time to
    ``info``. Returns ``(lowered, compiled, peak FLOP/s or None)``; ``perf/startup/compile_cache``: hit, miss, off."""
    device = p.devices[0]
    t0 = time.perf_counter()
    lowered = exp.steps.train.lower(exp.state, first)
    with CacheEvents() as cache:
        compiled = lowered.compile()
    info["perf/compile_time_s"] = time.perf_counter() - t0
    info["perf/startup/compile_cache"] = cache.outcome()
    info.update(compiled_step_metrics(lowered, compiled, exp.mode.num_devices))
    dims, evaluation = gpt_dims(cfg) if exp.local.tokens else None, (exp.steps.eval, exp.state.params, eval_set)
    check_step_fits(info.get("mem/compiled_peak_bytes_per_device"), dims, accumulation_peaks(exp, first), evaluation)
    exp.steps.eval = check_eval_fits(*evaluation, dims)  # compiled where it may not fit
    if exp.local.tokens:  # the model FLOPs of MFU replace XLA's count, which includes rematerialised work
        if "perf/flops_per_step_per_device" in info:
            info["perf/flops_per_step_per_device_xla"] = info["perf/flops_per_step_per_device"]
        info.update(language_model_info(cfg, p, exp))
    info["mem/state_bytes_per_device"] = state_bytes_per_device(exp.state)
    detect = cfg.hardware.detect  # hardware=auto: the profile matching the device kind; a chosen profile: its own
    info["hardware/profile"] = hardware_profile(cfg.hardware, device.device_kind)  # null when none
    # a ratio of a profile's number to a time measured here (comm/ratio_model, perf/mfu) only for the device that ran
    matches = describes_device(cfg.hardware.name, cfg.hardware.device_kinds, device.device_kind, device.platform)
    info["hardware/matches_device"] = matches
    link = cfg.hardware.link_bytes_per_s or (lookup_link_bytes_per_s(device.device_kind) if detect else None)
    peak_flops = cfg.hardware.peak_flops_per_s or (
        lookup_peak_flops_per_s(device.device_kind, cfg.precision.compute_dtype) if detect else None
    )
    if link is not None:  # the modelled time alone is the target's: bytes / its link
        info["hardware/link_bytes_per_s"] = link
        info["comm/time_model_s"] = comm_time_model_s(info["comm/bytes_per_step"], link)
    reported = (cfg.hardware.name, device.device_kind)
    if reported not in _RATIO_REPORTED:  # once per process (a sweep's jobs share it)
        _RATIO_REPORTED.add(reported)
        line = ratio_line(cfg.hardware.name, info["hardware/profile"], device.device_kind, matches, link, peak_flops)
        if line:
            log.info("%s", line)
    return lowered, compiled, peak_flops if matches else None


def ratio_line(
    name: str,
    profile: Optional[str],
    device_kind: str,
    matches: bool,
    link: Optional[float],
    peak_flops: Optional[float],
) -> Optional[str]:
    """The start-up line saying why ``comm/ratio_model`` or ``perf/mfu`` is absent, and how to get a communication
    ratio instead (None when both are computed)."""
    measured = "the profiler (profile.enabled=true) measures comm/ratio_measured"
    target = (
        profile if profile and (link is not None or peak_flops is not None) else "h100_sxm"
    )  # a profile with numbers
    project = f"python -m sweeps.project <run folder> --hardware {target} --mfu 0.4"
    if not matches and (link is not None or peak_flops is not None):
        return (
            f"hardware={name} describes another device than the one that ran ({device_kind}): comm/ratio_model and "
            f"perf/mfu are not computed (its numbers over times measured here would mix two machines); {measured} "
            f"(not valid on simulated CPU devices), and {project} models both wholly for {target}"
        )
    if link is None:
        cpu = " (on simulated CPU devices it is flagged not valid)" if device_kind.lower() == "cpu" else ""
        return (
            f"no link bandwidth known for {device_kind}: comm/time_model_s and comm/ratio_model are not computed; "
            f"{measured}{cpu}, and {project} models a target machine"
        )
    return None


def make_hooks(prep: Prepared, reporter: Reporter, bar, stats: WindowStats, target: TargetTracker) -> list[Hook]:
    """The hooks of a run, in the order they act at a step (``training.hooks``); each says when it is due."""
    cfg, exp, n_steps, p = prep.cfg, prep.exp, prep.n_steps, prep.plan
    bytes_per_token = prep.info.get("data/eval_bytes_per_token")  # text: eval/bpb
    stop = StopOnSignal()  # a signal: the step (or evaluation) ends, a checkpoint is saved, the run stops
    stopped = lambda: stop.signal_name is not None  # noqa: E731
    evaluate_params = lambda params: evaluate(exp, params, prep.eval_set, bytes_per_token, stopped)  # noqa: E731
    profiler = Profiler(
        cfg.profile.enabled,
        cfg.profile.start_step,
        cfg.profile.num_steps,
        prep.run_dir / "profile",
        p.devices[0].platform,
        hlo_text=prep.compiled.as_text() if cfg.profile.enabled else None,
        num_devices=exp.mode.num_devices,
    )
    ckpts = checkpoint.RunCheckpoints(
        prep.ckpt_plan,
        cfg_dict=as_dict(cfg),
        mode=exp.mode,
        mesh_shape=p.mesh_shape,
        global_batch=p.global_batch,
        steps_per_epoch=prep.source.steps_per_epoch,
        n_steps=n_steps,
        run_dir=prep.run_dir,
        restored_step=None if prep.restored is None else prep.restored.step,
        data_fingerprint=prep.source.fingerprint,
    )
    saving = CheckpointHook(
        ckpts, stop.install(), n_steps, prep.ckpt_plan.directory, wandb_run_id=lambda: reporter.wandb_run_id
    )
    window = WindowLog(
        exp.mode,
        exp.updater,
        reporter,
        bar,
        every=cfg.train.log_every,
        n_steps=n_steps,
        global_batch=p.global_batch,
        info=prep.info,
        peak_flops_per_s=prep.peak_flops_per_s,
        saving=saving,
        stats=stats,
    )
    exploded_limit = None if cfg.train.allow_exploded_loss else cfg.data.num_classes
    # the checkpoint hook acts last: a non-finite loss (window log) or non-finite final metrics (final
    # evaluation) stop the run before a save
    return [
        ProfilerHook(profiler),  # the profile window's start and end
        SyncCheck(cfg.train.sync_every, n_steps, cfg.train.sync_strict),  # every train.sync_every steps
        Evaluation(evaluate_params, cfg.train.eval_every, n_steps, target),  # every train.eval_every steps
        window,  # every train.log_every steps and at every save
        FinalEvaluation(evaluate_params, n_steps, reporter, target, profiler, exploded_limit=exploded_limit),
        *best_checkpoint_hooks(prep, reporter),  # after each evaluation that improves checkpoint.keep_best
        saving,  # every checkpoint.every steps, at the last and after a signal
    ]


def best_checkpoint_hooks(prep: Prepared, reporter: Reporter) -> list[Hook]:
    """``[BestCheckpointHook]`` with ``checkpoint.keep_best`` (the best evaluated step kept in
    ``<checkpoint.dir>/best``), else ``[]``."""
    if prep.ckpt_plan.best_directory is None:
        return []
    cfg, exp, p = prep.cfg, prep.exp, prep.plan
    best = checkpoint.BestCheckpoint(
        prep.ckpt_plan,
        resumed=prep.restored is not None,
        cfg_dict=as_dict(cfg),
        mode=exp.mode,
        mesh_shape=p.mesh_shape,
        global_batch=p.global_batch,
        steps_per_epoch=prep.source.steps_per_epoch,
        n_steps=prep.n_steps,
        run_dir=prep.run_dir,
        data_fingerprint=prep.source.fingerprint,  # a resume from best/ judges the data by it, as from a periodic step
    )
    return [BestCheckpointHook(best, cfg.train.eval_every, prep.n_steps, wandb_run_id=lambda: reporter.wandb_run_id)]


# ---- the steps -------------------------------------------------------------------------------------------------
def train_loop(
    compiled,
    loop: LoopState,
    first_batch,
    batches,
    *,
    start: int,
    n_steps: int,
    hooks: Sequence[Hook],
    bound: Optional[int],
    transfer_guard: str,
    bar=None,
    first: Optional[Callable[[], None]] = None,
) -> LoopState:
    """Runs steps ``start + 1 .. n_steps`` from ``loop.state``; returns ``loop`` with the final state. Marks the
    first dispatch on ``loop.clock``; closes every hook when it ends (also on errors).

    ``compiled``: the train step ``(state, batch) -> (state, metrics)`` (with the gather inside it, the batch is the
    split's device arrays, ``Experiment.feed``); ``first_batch`` the placed batch of step ``start``, ``batches`` the
    following ones. ``bound``: with more than one device, after dispatching step t wait for step t - ``bound``
    (the CPU backend aborts with too many simulated-device collectives in flight); None: never wait.
    ``transfer_guard``: ``jax.transfer_guard`` level around the dispatch (``allow``, JAX's default, sets none).
    ``first``: called before the first step (a resumed run's pending evaluation, ``hooks.evaluate_pending``)."""
    in_flight: collections.deque = collections.deque()
    batch = first_batch
    # "allow" is JAX's default: no guard context per step (it costs host time in every step)
    guard = (
        contextlib.nullcontext if transfer_guard == "allow" else functools.partial(jax.transfer_guard, transfer_guard)
    )
    error: Optional[BaseException] = None
    try:
        if first is not None:
            first()
        for step in range(start, n_steps):
            with guard():
                if step > start:
                    batch = next(batches)
                loop.state, loop.metrics = compiled(loop.state, batch)
                if step == start:
                    loop.clock.first_step()
                loop.timer.steps += 1
                loop.window_records.append((step + 1, loop.metrics))
                if bound is not None:
                    in_flight.append(loop.metrics)
                    if len(in_flight) > bound:
                        jax.block_until_ready(in_flight.popleft())
            if bar is not None:
                bar.update(1)
            run_hooks(hooks, loop, step + 1)
    except BaseException as e:
        error = e
        raise
    finally:
        if bar is not None:
            bar.close()
        close_hooks(hooks, error)
    return loop


def run_hooks(hooks: Sequence[Hook], loop: LoopState, step: int) -> None:
    """Asks every hook (every step, in order) whether it is due, each after the earlier ones ran (a signal during an
    evaluation makes this step's save due); pauses the timer once around the due ones."""
    loop.logged_this_step = False
    paused = False
    for hook in hooks:
        if hook.due(step):
            if not paused:
                loop.timer.pause(loop.metrics)
                paused = True
            hook.run(loop, step)
    if paused:
        loop.timer.resume()
    if loop.extra and not loop.logged_this_step:
        # eval / sync values are attached to the next logged record of this step
        last_step, item = loop.window_records[-1]
        loop.window_records[-1] = (last_step, (item, loop.extra))
        loop.extra = {}


def close_hooks(hooks: Sequence[Hook], error: Optional[BaseException]) -> None:
    """Closes every hook, in order, also when one of them raises. With ``error`` None (the loop ended well) the
    first close error is raised once all are closed; otherwise ``error`` stays the run's error and each close
    error is one ``warning:`` line. A ``KeyboardInterrupt`` or ``SystemExit`` from a ``close`` propagates at once."""
    failures: list[tuple[Hook, BaseException]] = []
    for hook in hooks:
        try:
            hook.close()
        except Exception as e:  # every hook is closed; the error is re-raised or reported below
            failures.append((hook, e))
    if not failures:
        return
    if error is None:
        for hook, e in failures[1:]:
            log.warning(f"closing {type(hook).__name__} also failed: {error_text(e)}")
        raise failures[0][1]
    for hook, e in failures:
        log.warning(f"closing {type(hook).__name__} failed after the run's error: {error_text(e)}")


# ---- after the last step ---------------------------------------------------------------------------------------
def finish(
    prep: Prepared, loop: LoopState, hooks: list[Hook], stats: WindowStats, target: TargetTracker
) -> dict[str, Any]:
    """The run's summary: static figures, the last training record, the final evaluation, the hooks'
    summaries (profile, checkpoints), steady-state throughput, time to target and the job's wall clock."""
    extra: dict[str, Any] = {}
    for hook in hooks:
        extra.update(hook.summary())
    step_times = [elapsed_s / steps for steps, elapsed_s in loop.windows]
    summary = {
        **prep.info,
        **{k: v for k, v in loop.last.items() if k != "step"},
        **loop.final,
        **extra,
        "status": "ok",
        "perf/step_time_s_median": statistics.median(step_times)
        if step_times
        else loop.last.get("perf/step_time_s_median"),
    }
    summary.update(
        {
            **stats.summary(
                prep.info.get("comm/time_model_s") if prep.info.get("hardware/matches_device") else None,
                prep.info.get("perf/flops_per_step_per_device"),
                prep.peak_flops_per_s,
            ),
            **target.summary(),
        }
    )
    if stats.warning():
        console(stats.warning())
    exploded = exploded_final(loop.last, loop.final, prep.info.get("model/vocab_size", prep.cfg.data.num_classes))
    if exploded:
        console(exploded)
    summary.update(token_rates(summary))
    if prep.exp.local.tokens and prep.cfg.train.sample_tokens > 0:
        summary["sample/text"] = final_sample(prep, loop)
        unit = "bytes" if getattr(getattr(prep.source, "tokenizer", None), "name", "bytes") == "bytes" else "tokens"
        console(f"sample (greedy, {prep.cfg.train.sample_tokens} {unit} after a newline):\n{summary['sample/text']}")
    if prep.exp.local.tokens and "train/loss" in summary:
        summary["train/perplexity"] = perplexity(summary["train/loss"])
        if prep.info.get("data/train_bytes_per_token"):  # the training split's mean bytes per token
            summary["train/bpb"] = summary["train/loss"] / math.log(2) / prep.info["data/train_bytes_per_token"]
    explain_ratio(summary)
    peak = peak_bytes_per_device()
    if peak is not None:
        summary["mem/peak_bytes_per_device"] = peak
    summary.update(loop.clock.summary())
    return summary


def final_sample(prep: Prepared, loop: LoopState) -> str:
    """``train.sample_tokens`` tokens generated greedily by the trained GPT after a newline
    (``models.gpt.generate``), decoded by the run's tokenizer (bytes when it has none)."""
    from flax import nnx

    from data.tokens import ByteTokenizer
    from models.gpt import generate

    tokenizer = getattr(prep.source, "tokenizer", None) or ByteTokenizer()
    params = state_to_host(loop.state).params
    model = nnx.merge(prep.exp.graphdef, jax.tree.map(jax.numpy.asarray, params))
    prompt = [int(i) for i in tokenizer.encode("\n")]
    tokens = generate(model, prompt, prep.cfg.train.sample_tokens)  # type: ignore[arg-type]
    return tokenizer.decode(tokens)


def keeps_summary(path: Path) -> bool:
    """Whether ``path`` already holds a successful run's summary (a rerun of a finished run leaves it)."""
    try:
        return json.loads(path.read_text()).get("status") == "ok"
    except (OSError, ValueError):
        return False
