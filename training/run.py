"""One experiment: prepare (``training.prepare``), start reporting, run the loop with its hooks
(``training.loop``, ``training.hooks``: the final evaluation is the last step's hook, before the final
checkpoint), summarise."""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import sys
import statistics
from pathlib import Path
from typing import Any, Optional

import jax
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from conf.schema import Config, as_dict
from core.errors import USER_ERRORS, ConfigError, DataError, TrainingError  # noqa: F401  (re-exported)
from measure.compiled import peak_bytes_per_device
from measure.profiler import Profiler, explain_ratio
from measure.rates import token_rates
from measure.throughput import STARTUP, JobClock, TargetTracker, WindowStats, in_multirun
from training import checkpoint
from training.build import Experiment
from training.console_lines import startup_breakdown_line, startup_line
from training.distributed import process_layout
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
    flush_window,  # noqa: F401
)  # noqa: F401  (flush_window re-exported)
from training.loop import in_flight_bound, train_loop
from training.outcome import exploded_final
from training.prepare import (
    Finished,
    Prepared,
    batches_need_index,  # noqa: F401
    describe,  # noqa: F401  (re-exported)
    prepare,
)
from training.report import Reporter, console, resolve_wandb_mode
from training.signals import StopOnSignal


log = logging.getLogger(__name__)


def perplexity(loss_nats: float) -> float:
    """``exp(loss)`` of a mean per-token loss in nats (inf when it overflows)."""
    return math.exp(loss_nats) if loss_nats < 700 else math.inf


def evaluate(exp: Experiment, params, eval_set, bytes_per_token: Optional[float] = None) -> dict[str, float]:
    """Loss and accuracy over the whole test split (padded, masked: the denominator is exact); for a language
    model on text also ``eval/bpb``, bits per byte: the loss (nats per token) / ln 2 / ``bytes_per_token`` (of the
    evaluated target tokens, ``data.text.TextEvalSet``), comparable across tokenizers.

    Dispatches under the training loop's in-flight bound (``train.max_in_flight`` with more than one device):
    an unbounded queue of simulated-device collectives aborts the process on the CPU backend."""
    totals = None
    bound = in_flight_bound(exp.mode.num_devices, exp.plan.cfg.train.max_in_flight)
    in_flight: collections.deque = collections.deque()
    for batch in eval_set.batches:
        sums = exp.steps.eval(params, batch)
        totals = sums if totals is None else jax.tree.map(lambda a, b: a + b, totals, sums)
        if bound is not None:
            in_flight.append(totals)
            if len(in_flight) > bound:
                jax.block_until_ready(in_flight.popleft())
    host = exp.mode.metrics_to_host(totals)
    count = float(host["count"])
    assert count == eval_set.num_examples, (count, eval_set.num_examples)
    out = {"eval/loss": float(host["loss_sum"]) / count, "eval/accuracy": float(host["correct"]) / count}
    if exp.local.tokens:  # language model: loss in nats per token, perplexity = exp(loss)
        out["eval/perplexity"] = perplexity(out["eval/loss"])
        if bytes_per_token:
            out["eval/bpb"] = out["eval/loss"] / math.log(2) / bytes_per_token
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


def start_reporting(prep: Prepared, reporter: Reporter) -> None:
    """Starts W&B (resuming the saved run's id) and writes the step-0 record, or continues the saved run's
    ``metrics.jsonl`` history when resuming."""
    cfg, info, restored, n = prep.cfg, prep.info, prep.restored, prep.exp.mode.num_devices
    wandb_cfg = {
        **as_dict(cfg),
        "process_count": jax.process_count(),
        "process_layout": process_layout(),  # devices of every process
        "resolved": {k: v for k, v in info.items() if not isinstance(v, list)},
    }
    reporter.start_wandb(
        resolve_wandb_mode(cfg.wandb.mode),
        cfg.wandb.project,
        cfg.wandb.entity,
        wandb_group(cfg),
        job_type=f"{cfg.parallel.name}-{cfg.precision.name}",
        tags=list(cfg.wandb.tags) + [cfg.parallel.name, cfg.precision.name, f"devices={n}"],
        config=wandb_cfg,
        init_timeout_s=cfg.wandb.init_timeout_s,
        process_priority=cfg.wandb.process_priority,
        previous_run_id=None if restored is None else restored.metadata.get("wandb_run_id"),
    )
    if restored is None:
        reporter.start_metrics()  # a restart without a checkpoint: the earlier history is set aside, not repeated
        reporter.log(
            [
                {
                    "step": 0,
                    **{
                        k: v
                        for k, v in info.items()
                        if k.startswith(("comm/", "mem/", "perf/")) and not isinstance(v, (list, str))
                    },
                }
            ]
        )
    else:  # metrics.jsonl continues the saved run's history (records after the checkpoint dropped)
        previous = restored.metadata.get("run_dir")
        reporter.continue_metrics(Path(previous) / "metrics.jsonl" if previous else None, prep.start, prep.n_steps)
        info.update({"checkpoint/resumed_from": str(restored.path), "checkpoint/resumed_step": prep.start})


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
    )
    return [BestCheckpointHook(best, cfg.train.eval_every, prep.n_steps, wandb_run_id=lambda: reporter.wandb_run_id)]


def make_hooks(prep: Prepared, reporter: Reporter, bar, stats: WindowStats, target: TargetTracker) -> list[Hook]:
    """The hooks of a run, in the order they act at a step (``training.hooks``)."""
    cfg, exp, n_steps, p = prep.cfg, prep.exp, prep.n_steps, prep.plan
    bytes_per_token = prep.info.get("data/eval_bytes_per_token")
    evaluate_params = lambda params: evaluate(exp, params, prep.eval_set, bytes_per_token)  # noqa: E731
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
    )
    saving = CheckpointHook(
        ckpts,
        StopOnSignal().install(),
        n_steps,
        prep.ckpt_plan.directory,
        wandb_run_id=lambda: reporter.wandb_run_id,
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
    best = best_checkpoint_hooks(prep, reporter)
    # the checkpoint hook acts last: a non-finite loss (window log) or non-finite final metrics (final
    # evaluation) stop the run before a save
    hooks: list[Hook] = [
        ProfilerHook(profiler),
        SyncCheck(exp.mode, cfg.train.sync_every, n_steps, cfg.train.sync_strict),
        Evaluation(evaluate_params, cfg.train.eval_every, n_steps, target),
        window,
        FinalEvaluation(
            evaluate_params,
            n_steps,
            reporter,
            target,
            profiler,
            exploded_limit=None if cfg.train.allow_exploded_loss else cfg.data.num_classes,
        ),
        *best,
        saving,
    ]
    return hooks


def run(cfg: Config, run_dir: Path, reporter: Reporter) -> dict[str, Any]:
    """Runs one experiment and returns its summary. Raises USER_ERRORS with one-line messages."""
    clock = JobClock.for_job(multirun=in_multirun())  # perf/wall_s, perf/startup_s (measure/throughput.py)
    prep = prepare(cfg, run_dir)
    if isinstance(prep, Finished):  # a rerun of a finished run: its summary, no training, no W&B
        return {**prep.summary, "checkpoint/already_complete": True}
    start_reporting(prep, reporter)
    loop = LoopState(state=prep.exp.state, clock=clock)
    if prep.restored is not None:  # the summary's training values also when this run trains no step
        loop.last.update(checkpoint.history_values(run_dir / "metrics.jsonl", prep.start))
    stats = WindowStats(prep.plan.global_batch, prep.exp.mode.num_devices)
    if prep.restored is not None and prep.start >= prep.n_steps:  # no step runs here (killed after its final
        for elapsed_s, steps in checkpoint.history_windows(
            run_dir / "metrics.jsonl", prep.start
        ):  # save): the run's windows
            stats.add(elapsed_s, steps)
    target = TargetTracker(cfg.train.target_accuracy)
    log.info(
        "%s",
        startup_line(
            prep.info,
            accum_steps=cfg.train.accum_steps,
            model=cfg.model.name,
            param_count=prep.param_count(),
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
            bound=in_flight_bound(prep.exp.mode.num_devices, cfg.train.max_in_flight),
            transfer_guard=cfg.train.transfer_guard,
            bar=bar,
        )
    if loop.final is None:  # resumed at the last step: no step ran, so its final evaluation runs now
        next(h for h in hooks if isinstance(h, FinalEvaluation)).run(loop, prep.n_steps)
    return finish(prep, loop, hooks, stats, target)


def final_sample(prep: Prepared, loop: LoopState) -> str:
    """``train.sample_tokens`` tokens generated greedily by the trained GPT after a newline
    (``models.gpt.generate``), decoded by the run's tokenizer (bytes when it has none)."""
    from flax import nnx

    from data.tokens import ByteTokenizer
    from models.gpt import generate

    tokenizer = getattr(prep.source, "tokenizer", None) or ByteTokenizer()
    params = prep.exp.mode.state_to_host(loop.state).params
    model = nnx.merge(prep.exp.graphdef, jax.tree.map(jax.numpy.asarray, params))
    prompt = [int(i) for i in tokenizer.encode("\n")]
    tokens = generate(model, prompt, prep.cfg.train.sample_tokens)  # type: ignore[arg-type]
    return tokenizer.decode(tokens)


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
                prep.info.get("comm/time_model_s"),
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
