"""One experiment: validate, load data, build, compile, train with bounded dispatch, evaluate, report.

The loop keeps at most ``train.max_in_flight`` (2) steps in flight: before dispatching step t+1 it waits on
step t-1's output (on the CPU backend, queueing ~32 steps of simulated-device collectives aborts the process).
Apart from that and the logging windows, it never synchronises with the host.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import statistics
import time
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from conf.schema import Config, as_dict
from measure.throughput import JobClock, TargetTracker, WindowStats, check_target_accuracy, in_multirun
from data.pipeline import SyntheticSource, TrainSource, make_eval_set, synthetic_eval, train_batches
from data.sources import DataError, load_tfds_split
from parallel import ConfigError
from training import checkpoint
from training.build import Experiment, Plan, build, plan
from training.distributed import dump_batch_indices, process_layout
from training.console_lines import startup_line, window_line
from training.outcome import nonfinite_final
from training.resume_policy import check_resume_settings, finished_summary, history_values
from training.validate import check_run_folder
from training.measure import (compiled_step_metrics, hardware_profile, lookup_link_bytes_per_s,
                              lookup_peak_flops_per_s, peak_bytes_per_device, state_bytes_per_device)
from training.profile import Profiler, check_window, explain_ratio
from training.report import Reporter, console, resolve_wandb_mode

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a non-finite loss); the message is one line."""


USER_ERRORS = (ConfigError, DataError, TrainingError)
TRANSFER_GUARDS = ("allow", "log", "disallow", "log_explicit", "disallow_explicit")  # jax.transfer_guard levels


def describe(cfg: Config) -> dict[str, Any]:
    """Summary keys known before anything is built (also written for failed runs)."""
    return {"parallel": cfg.parallel.name, "precision": cfg.precision.name, "model": cfg.model.name,
            "data": cfg.data.name, "mesh/devices_requested": cfg.mesh.devices,
            "train/accum_steps": cfg.train.accum_steps, "process_count": jax.process_count()}


def load_data(cfg: Config, p: Plan):
    """(train source, host test split). Raises DataError with one line when the dataset is missing."""
    d = cfg.data
    if d.name == "synthetic":
        # synthetic sizes and shape are checked before anything is generated
        if len(d.image_shape) != 3 or min(d.image_shape) <= 0 or d.num_classes < 2:
            raise ConfigError(f"data.image_shape={list(d.image_shape)} and data.num_classes={d.num_classes} must "
                              f"be [H, W, C] with positive sizes and at least 2 classes")
        if d.eval_size <= 0 or d.train_size < p.global_batch:
            raise ConfigError(f"data.train_size={d.train_size} and data.eval_size={d.eval_size}: the train split "
                              f"needs at least train.global_batch={p.global_batch} examples and the eval split one")
        train = SyntheticSource(d.image_shape, d.num_classes, d.train_size, p.global_batch, cfg.train.seed,
                                with_index=batches_need_index(cfg))
        return train, synthetic_eval(d.image_shape, d.num_classes, d.eval_size, cfg.train.seed)
    if not d.tfds_name:
        raise ConfigError(f"data={d.name} has no data.tfds_name; set it or use data=synthetic")
    train = load_tfds_split(d.tfds_name, "train", d.data_dir, d.cache_dir, download=d.download)
    test = load_tfds_split(d.tfds_name, "test", d.data_dir, d.cache_dir, download=d.download)
    if tuple(train.images.shape[1:]) != tuple(d.image_shape):
        raise ConfigError(f"data.image_shape={list(d.image_shape)} but {d.tfds_name} images are "
                          f"{list(train.images.shape[1:])}; fix data.image_shape")
    # labels must fit data.num_classes; the split must hold one global batch
    top = int(max(train.labels.max(initial=0), test.labels.max(initial=0)))
    if top >= d.num_classes:
        raise ConfigError(f"data.num_classes={d.num_classes} but {d.tfds_name} has label {top}; "
                          f"set data.num_classes={top + 1}")
    if len(train) < p.global_batch:
        raise ConfigError(f"train.global_batch={p.global_batch} exceeds the {len(train)} examples of "
                          f"{d.tfds_name}/train; lower train.global_batch")
    return TrainSource(train, p.global_batch, cfg.train.seed, with_index=batches_need_index(cfg)), test


def batches_need_index(cfg: Config) -> bool:
    """Whether training batches must carry ``index`` (without it a step places 2 arrays, not 3):
    per-example keys (dropout, augmentation) or the debug dump of placed indices need it."""
    return cfg.model.dropout > 0 or cfg.data.augment or cfg.train.debug_dump_indices


def evaluate(exp: Experiment, params, eval_set) -> dict[str, float]:
    """Loss and accuracy over the whole test split (padded, masked: the denominator is exact)."""
    totals = None
    for batch in eval_set.batches:
        sums = exp.steps.eval(params, batch)
        totals = sums if totals is None else jax.tree.map(lambda a, b: a + b, totals, sums)
    host = exp.mode.metrics_to_host(totals)
    count = float(host["count"])
    assert count == eval_set.num_examples, (count, eval_set.num_examples)
    return {"eval/loss": float(host["loss_sum"]) / count, "eval/accuracy": float(host["correct"]) / count}


class StepTimer:
    """Wall time of the steps of a logging window, excluding pauses (eval, sync checks, logging)."""

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


def wandb_group(cfg: Config) -> Optional[str]:
    """``wandb.group``, else, inside a Hydra multirun, the sweep's id (its folder), so a sweep is one group."""
    if cfg.wandb.group:
        return cfg.wandb.group
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN:
            return "sweep-" + Path(hc.sweep.dir).as_posix().strip("/").replace("/", "_")
    except Exception:  # not under Hydra (tests, library use)
        pass
    return None


def total_steps(cfg: Config, steps_per_epoch: int) -> int:
    return cfg.train.steps if cfg.train.steps is not None else cfg.train.epochs * steps_per_epoch


def run(cfg: Config, run_dir: Path, reporter: Reporter) -> dict[str, Any]:
    """Runs one experiment and returns its summary. Raises USER_ERRORS with one-line messages."""
    clock = JobClock.for_job(multirun=in_multirun())  # perf/wall_s, perf/startup_s (measure/throughput.py)
    p = plan(cfg)  # every check that needs neither data nor compilation
    check_run_folder(run_dir, cfg.checkpoint)
    ckpt_plan = checkpoint.prepare(cfg.checkpoint, run_dir, jax.process_count())  # resume path exists
    wandb_mode = resolve_wandb_mode(cfg.wandb.mode)
    source, test = load_data(cfg, p)
    exp = build(p)
    mode, layout = exp.mode, exp.mode.batch_layout()
    eval_set = make_eval_set(test, cfg.train.eval_batch, mode.num_devices, layout)
    n_steps = total_steps(cfg, source.steps_per_epoch)
    # measurement: checks before anything is written (profile window, transfer guard)
    window_error = check_window(cfg.profile.enabled, cfg.profile.start_step, cfg.profile.num_steps, n_steps)
    if window_error:
        raise ConfigError(window_error)
    if check_target_accuracy(cfg.train.target_accuracy):
        raise ConfigError(check_target_accuracy(cfg.train.target_accuracy))
    if cfg.train.transfer_guard not in TRANSFER_GUARDS:
        raise ConfigError(f"train.transfer_guard={cfg.train.transfer_guard!r} is unknown; "
                          f"choose one of {', '.join(TRANSFER_GUARDS)}")
    # checkpoints: restore onto THIS run's layout, before compiling and before W&B starts
    check_resume_settings(ckpt_plan, as_dict(cfg), p.global_batch)  # refused changes: one line, nothing moved
    restored = checkpoint.resume(ckpt_plan, mode, exp.state)
    start = 0
    if restored is not None:
        if restored.step > n_steps:
            raise ConfigError(f"checkpoint {restored.path} is at step {restored.step}, past this run's "
                              f"{n_steps} steps; raise train.steps/train.epochs or set checkpoint.resume=never")
        finished = finished_summary(restored.metadata.get("run_dir"), n_steps) if restored.step == n_steps else None
        if finished is not None:  # a rerun of a finished run: its summary, no training, no W&B
            return {**finished, "checkpoint/already_complete": True}
        exp.state, start = restored.state, restored.step
        for line in checkpoint.data_order_warnings(restored.metadata, global_batch=p.global_batch,
                                                   seed=cfg.train.seed, steps_per_epoch=source.steps_per_epoch,
                                                   data=cfg.data.name):
            checkpoint.warn(line)
        changes = checkpoint.config_changes(restored.metadata.get("config", {}), as_dict(cfg))
        if changes:
            checkpoint.warn(f"resuming {restored.path} with settings that differ from its run: {'; '.join(changes)}")
    device = p.devices[0]
    info: dict[str, Any] = {
        **describe(cfg), "platform": device.platform, "device_kind": device.device_kind,
        "process_count": jax.process_count(), "mesh/devices": mode.num_devices, "mesh/shape": list(p.mesh_shape),
        "train/global_batch": p.global_batch, "train/per_device_batch": p.per_device_batch,
        "train/scaling": p.scaling, "train/steps": n_steps, "train/steps_per_epoch": source.steps_per_epoch,
        "parallel/grad_reduce_dtype": cfg.parallel.grad_reduce_dtype, "optim/peak_lr": p.peak_lr,
        "parallel/grad_compression": cfg.parallel.grad_compression,  # sweeps.report groups by it
    }

    first_step = min(start, n_steps - 1)  # a resumed run continues the data order at its step
    batches = train_batches(source, layout, first_step, n_steps, cfg.data.prefetch)
    if cfg.train.debug_dump_indices:  # debug aid: which examples each process placed, per step
        batches = dump_batch_indices(batches, run_dir / f"debug_indices_process{jax.process_index()}.jsonl",
                                     first_step)
    first = next(batches)
    t0 = time.perf_counter()
    lowered = exp.steps.train.lower(exp.state, first)
    compiled = lowered.compile()
    info["perf/compile_time_s"] = time.perf_counter() - t0
    info.update(compiled_step_metrics(lowered, compiled, mode.num_devices))
    info["mem/state_bytes_per_device"] = state_bytes_per_device(exp.state)
    detect = cfg.hardware.detect  # hardware=auto: the profile matching the device kind; a chosen profile: its own
    info["hardware/profile"] = hardware_profile(cfg.hardware, device.device_kind)  # null when none
    link = cfg.hardware.link_bytes_per_s or (lookup_link_bytes_per_s(device.device_kind) if detect else None)
    peak_flops = cfg.hardware.peak_flops_per_s or (
        lookup_peak_flops_per_s(device.device_kind, cfg.precision.compute_dtype) if detect else None)
    if link is None:
        log.info("no link bandwidth known for %s: comm/time_model_s and comm/ratio_model are not computed "
                 "(set hardware.link_bytes_per_s to model a target)", device.device_kind)
    else:
        info["hardware/link_bytes_per_s"] = link
        info["comm/time_model_s"] = info["comm/bytes_per_step"] / link

    wandb_cfg = {**as_dict(cfg), "process_count": jax.process_count(),
                 "process_layout": process_layout(),  # devices of every process
                 "resolved": {k: v for k, v in info.items() if not isinstance(v, list)}}
    reporter.start_wandb(wandb_mode, cfg.wandb.project, cfg.wandb.entity, wandb_group(cfg),
                         job_type=f"{cfg.parallel.name}-{cfg.precision.name}",
                         tags=list(cfg.wandb.tags) + [cfg.parallel.name, cfg.precision.name,
                                                      f"devices={mode.num_devices}"],
                         config=wandb_cfg, init_timeout_s=cfg.wandb.init_timeout_s,
                         previous_run_id=None if restored is None else restored.metadata.get("wandb_run_id"))
    if restored is None:
        reporter.start_metrics()  # a restart without a checkpoint: the earlier history is set aside, not repeated
        reporter.log([{"step": 0, **{k: v for k, v in info.items() if k.startswith(("comm/", "mem/", "perf/"))
                                     and not isinstance(v, list)}}])
    else:  # metrics.jsonl continues the saved run's history (records after the checkpoint dropped)
        previous = restored.metadata.get("run_dir")
        reporter.continue_metrics(Path(previous) / "metrics.jsonl" if previous else None, start, n_steps)
        info.update({"checkpoint/resumed_from": str(restored.path), "checkpoint/resumed_step": start})

    state = exp.state
    last: dict[str, Any] = {}
    if restored is not None:  # the summary's training values also when this run trains no step (killed at the end)
        last.update(history_values(run_dir / "metrics.jsonl", start))
    window_records: list[tuple[int, Any]] = []
    in_flight: collections.deque = collections.deque()
    step_times: list[float] = []
    timer = StepTimer()
    stats, target = WindowStats(p.global_batch, mode.num_devices), TargetTracker(cfg.train.target_accuracy)
    profiler = Profiler(cfg.profile.enabled, cfg.profile.start_step, cfg.profile.num_steps, run_dir / "profile",
                        device.platform, hlo_text=compiled.as_text() if cfg.profile.enabled else None,
                        num_devices=mode.num_devices)
    log.info("%s", startup_line(info, accum_steps=cfg.train.accum_steps, model=cfg.model.name,
                                param_count=sum(int(np.prod(x.shape)) for x in
                                                jax.tree.leaves(checkpoint.host_abstract(exp.state).params)),
                                dataset=cfg.data.name))
    redirect = contextlib.ExitStack()
    redirect.enter_context(logging_redirect_tqdm())  # log lines above the bar, never glued to it
    bar = tqdm(total=n_steps, initial=start, disable=not reporter.enabled, desc="train", unit="step",
               dynamic_ncols=True, mininterval=1.0)
    # checkpoints: periodic/final saves; SIGTERM/SIGINT finish the step, save and stop
    ckpts = checkpoint.RunCheckpoints(ckpt_plan, cfg_dict=as_dict(cfg), mode=mode, mesh_shape=p.mesh_shape,
                                      global_batch=p.global_batch, steps_per_epoch=source.steps_per_epoch,
                                      n_steps=n_steps, run_dir=run_dir,
                                      restored_step=None if restored is None else restored.step)
    stop = checkpoint.StopOnSignal().install()
    try:
        batch = first
        for step in range(start, n_steps):
            # Dispatch only: under train.transfer_guard=disallow any implicit host<->device transfer here
            # raises (logging windows below are outside the guard and copy explicitly).
            with jax.transfer_guard(cfg.train.transfer_guard):
                if step > start:
                    batch = next(batches)
                state, metrics = compiled(state, batch)
                clock.first_step()
                timer.steps += 1
                window_records.append((step + 1, metrics))
                in_flight.append(metrics)
                if len(in_flight) > cfg.train.max_in_flight:
                    jax.block_until_ready(in_flight.popleft())
            bar.update(1)
            done = step + 1
            if profiler.acts_at(done):  # starting/stopping the trace is not step time
                timer.pause(metrics)
                profiler.after_step(done, metrics)
                timer.resume()
            extra: dict[str, Any] = {}
            if done % cfg.train.sync_every == 0 or done == n_steps:
                timer.pause(metrics)
                divergence = mode.replica_divergence((state.params, state.opt_state))
                extra["sync/max_replica_divergence"] = divergence
                if divergence != 0.0:
                    msg = f"replicas diverged at step {done}: max |difference| = {divergence:g}"
                    if cfg.train.sync_strict:
                        raise TrainingError(msg + " (train.sync_strict=true)")
                    log.warning(msg)
                timer.resume()
            if cfg.train.eval_every and done % cfg.train.eval_every == 0 and done != n_steps:
                timer.pause(metrics)
                extra.update(evaluate(exp, state.params, eval_set))
                target.observe(done, extra["eval/accuracy"], clock.since_first_step_s())
                timer.resume()
            saving = ckpts.saves_at(done) | stop.requested(done)  # `|`: requested() runs every step
            if done % cfg.train.log_every == 0 or done == n_steps or saving:
                timer.pause(metrics)
                elapsed_s, steps = timer.take()
                step_time_s = elapsed_s / steps
                step_times.append(step_time_s)
                stats.add(elapsed_s, steps)
                perf = {"perf/step_time_s": step_time_s, "perf/examples_per_s": p.global_batch / step_time_s,
                        "perf/examples_per_s_per_device": p.global_batch / step_time_s / mode.num_devices,
                        "mesh/devices": mode.num_devices}
                if "comm/time_model_s" in info:
                    perf["comm/ratio_model"] = info["comm/time_model_s"] / step_time_s
                if peak_flops and "perf/flops_per_step_per_device" in info:
                    perf["perf/mfu"] = info["perf/flops_per_step_per_device"] / step_time_s / peak_flops
                records = flush_window(mode, exp.updater, window_records, perf, extra)
                window_records = []
                last.update(records[-1])
                reporter.log(records)
                bar.set_postfix(loss=f"{last['train/loss']:.4f}", ex_s=f"{perf['perf/examples_per_s']:.0f}")
                if reporter.enabled:  # process 0 (the others' figures are their own timings)
                    log.info("%s", window_line(done, n_steps, last["train/loss"], perf["perf/examples_per_s"]))
                timer.resume()
            elif extra:
                # eval / sync values are attached to the next logged record of this step
                window_records[-1] = (done, (window_records[-1][1], extra))
            if saving:  # checkpoints: after the window is logged (a bad loss stops it first)
                timer.pause(metrics)
                reason = "final" if done == n_steps else ("signal" if stop.signal_name else "periodic")
                try:
                    saved = ckpts.save(state, done, reporter.wandb_info.get("wandb/run_id"), reason)
                except checkpoint.NonFiniteError as e:
                    raise TrainingError(str(e)) from None
                timer.resume()
                if stop.signal_name is not None and done < n_steps:
                    where = (f"checkpoint saved in {saved}; continue with the same command and "
                             f"checkpoint.dir={ckpt_plan.directory} (or checkpoint.resume={saved})"
                             if saved else "no checkpoint written (checkpoint.enabled=false)")
                    raise TrainingError(f"stopped by {stop.signal_name} after step {done} of {n_steps}; {where}")
    finally:
        redirect.close()
        bar.close()
        profiler.close()
        stop.uninstall()
        ckpts.close()  # waits for the last asynchronous save

    final = evaluate(exp, state.params, eval_set)
    target.observe(n_steps, final["eval/accuracy"], clock.since_first_step_s())
    profiled = profiler.result()
    reporter.log([{"step": n_steps, **final, **{k: v for k, v in profiled.items() if not isinstance(v, str)}}])
    diverged = nonfinite_final(last, final)  # after the record is written (strict JSON: null + "nonfinite")
    if diverged:
        raise TrainingError(diverged)
    summary = {**info, **{k: v for k, v in last.items() if k != "step"}, **final, **profiled, **ckpts.summary(),
               "status": "ok", "perf/step_time_s_median": statistics.median(step_times) if step_times
               else last.get("perf/step_time_s_median")}
    summary.update({**stats.summary(info.get("comm/time_model_s"), info.get("perf/flops_per_step_per_device"),
                                    peak_flops), **target.summary()})
    if stats.warning():
        console(stats.warning())
    explain_ratio(summary)
    peak = peak_bytes_per_device()
    if peak is not None:
        summary["mem/peak_bytes_per_device"] = peak
    summary.update(clock.summary())
    return summary


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
                            f"lower optim.lr, enable optim.clip_grad_norm, or, under bf16/fp16, use precision=fp32")
    records[-1].update(perf)
    records[-1].update(extra)
    return records
