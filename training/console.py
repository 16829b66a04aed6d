"""What a run prints and the paths it reads: one line per message on the console (``console``; a product logger's
warnings: ``training.process.WarningLines``), the start-up line, one line per logging window and the end line's
throughput, known harmless library noise silenced, and the user's paths made absolute (``absolute_paths``)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional

from conf.schema import Config
from core.errors import error_text
from training import process

log = logging.getLogger(__name__)

_error_said = False  # console printed an "error:" line: the process is stopping for it


def console(line: str) -> None:
    """One line on stderr (errors, warnings a user must see even with logging redirected). Processes other than 0
    log it instead, at the level the line starts with (``error``, ``warning``, else INFO): process 0 owns the
    console (``training.process.speaks``: one voice per job)."""
    global _error_said
    _error_said = _error_said or line.startswith("error")

    if not process.speaks():
        level = logging.ERROR if line.startswith("error") else logging.INFO
        log.log(logging.WARNING if line.startswith("warning") else level, "%s", line)
        return
    print(line, file=sys.stderr, flush=True)


_unwritable_logs: set[str] = set()  # log files a line could not be written to (reported once each)


def quiet_log_write_errors() -> None:
    """A log file of the root logger (Hydra's ``train.log``) that stops taking lines (a full disk) is one warning line,
    once, instead of logging's traceback for every line it cannot write; none after the run's ``error:`` line (the
    disk filling may be what stopped it). An error of the message itself (its format) is still logging's own report.
    Idempotent."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and not isinstance(handler.handleError, functools.partial):
            handler.handleError = functools.partial(_log_write_error, handler, handler.handleError)  # type: ignore[method-assign]


def _log_write_error(handler: logging.FileHandler, fallback, record: logging.LogRecord) -> None:
    error = sys.exc_info()[1]
    if not isinstance(error, OSError):
        fallback(record)
        return
    if handler.baseFilename not in _unwritable_logs and not _error_said:
        print(
            f"warning: cannot write the log {handler.baseFilename} ({error_text(error)}); lines it cannot take are "
            "lost (free space on its disk)",
            file=sys.stderr,
            flush=True,
        )
    _unwritable_logs.add(handler.baseFilename)


# (logger name, text in the message): messages that are expected and harmless on the machines this runs on.
KNOWN_NOISE = (
    # jax probes for a TPU at start; on machines without one it logs this at INFO (no effect on the run)
    ("jax._src.xla_bridge", "Unable to initialize backend 'tpu'"),
    # TFDS decodes PNGs with Pillow when OpenCV is absent; the decode happens once (then cached), so speed is moot
    ("absl", "OpenCV is not installed"),
    # TFDS looking for a dataset that is not prepared (also for a folder that does not exist); data/sources.py
    # then prepares it or stops with one line that says where it looked and what to do
    ("absl", "has no dataset_info.json"),
)


def _not_noise(record: logging.LogRecord) -> bool:  # a logger's filter sees the records of that logger only
    return not any(record.name == name and needle in record.getMessage() for name, needle in KNOWN_NOISE)


def _not_said(record: logging.LogRecord) -> bool:  # a tool's stderr handler: not what WarningLines prints itself
    return record.levelno != logging.WARNING or record.name.split(".")[0] not in process.PRODUCT_LOGGERS


def tool_logging() -> None:
    """Logging of a command-line tool (``python -m evaluate``, ``python -m sample``): warnings and errors on stderr as
    ``LEVEL logger: message``, each product warning once as ``warning: ...``, and ``quiet_known_noise``."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:  # basicConfig's (none when the root has handlers already)
        if type(handler) is logging.StreamHandler and _not_said not in handler.filters:
            handler.addFilter(_not_said)
    quiet_known_noise()


def quiet_known_noise() -> None:
    """Drops the ``KNOWN_NOISE`` messages (only those exact messages: every other warning stays), and the traceback
    of a Ctrl-C that orbax logs (``training.process.NoInterruptTraceback``: the stop's line says it). Idempotent."""
    try:  # absl must create its own logger class first (else orbax's filter in training.checkpoint sees the
        import absl.logging  # noqa: F401  wrong caller and its INFO chatter comes through)
    except ImportError:
        pass
    for name, _ in KNOWN_NOISE:
        logging.getLogger(name).addFilter(_not_noise)  # once: addFilter adds a filter already there no more
    absl_logger = logging.getLogger("absl")  # orbax logs through absl
    if not any(isinstance(f, process.NoInterruptTraceback) for f in absl_logger.filters):
        absl_logger.addFilter(process.NoInterruptTraceback())


def startup_line(info: dict[str, Any], *, accum_steps: int, model: str, param_count: int, dataset: str) -> str:
    """One line with what is about to run, e.g. ``start: 8 cpu devices (cpu), 1 process, jit_sharding mesh [8, 1],
    fp32, batch 256 global / 32 per device, accum 1, 20 steps, mlp 203,530 params, data mnist`` (``... on the
    devices`` when batches are made there), from the run's static ``info`` (``training.build.static_info``)."""
    procs, devices = info["process_count"], info["mesh/devices"]
    return (
        f"start: {devices} {info['platform']} device{'s' if devices != 1 else ''} ({info['device_kind']}), {procs} "
        f"process{'es' if procs > 1 else ''}, {info['parallel']} mesh {list(info['mesh/shape'])}, "
        f"{info['precision']}, batch {info['train/global_batch']} global / {info['train/per_device_batch']} "
        f"per device, accum {accum_steps}, {info['train/steps']} steps, {model} {param_count:,} params, "
        f"data {dataset}{' on the devices' if info.get('data/on_device') else ''}"
    )


def startup_breakdown_line(clock_summary: dict[str, Any], compile_cache: str | None = None) -> str:
    """The start-up time and its phases, written once the first step is dispatched, e.g. ``start-up 6.12 s:
    imports 2.31, config 0.42, ..., compile 0.48 (cache hit), reporting 0.40, first_step 0.01`` (seconds, from
    ``JobClock.summary()``; ``compile_cache``: hit, miss, off or None)."""
    prefix, suffix = "perf/startup/", "_s"
    parts = []
    for key, seconds in clock_summary.items():
        if key.startswith(prefix) and key.endswith(suffix):
            phase = key[len(prefix) : -len(suffix)]
            note = f" (cache {compile_cache})" if phase == "compile" and compile_cache else ""
            parts.append(f"{phase} {seconds:.2f}{note}")
    total = clock_summary.get("perf/startup_s")
    head = f"start-up {total:.2f} s" if isinstance(total, (int, float)) else "start-up"
    return f"{head}: {', '.join(parts)}" if parts else head


def eval_line(step: int, n_steps: int, metrics: dict[str, Any]) -> str:
    """One line per periodic evaluation for train.log and the console, e.g. ``eval at step 200/400:
    eval/loss=1.9876 eval/accuracy=0.4321`` (with ``eval/perplexity`` and ``eval/bpb`` when the model has them)."""
    formats = {"eval/loss": ".4f", "eval/accuracy": ".4f", "eval/perplexity": ".2f", "eval/bpb": ".4f"}
    values = " ".join(
        f"{k}={float(metrics[k]):{f}}" for k, f in formats.items() if isinstance(metrics.get(k), (int, float))
    )
    return f"eval at step {step}/{n_steps}: {values}"


def window_line(
    step: int, n_steps: int, loss: float, examples_per_s: float, tokens_per_s: Optional[float] = None
) -> str:
    """One line per logging window for train.log (and the console above the bar); a language model's
    (``tokens_per_s`` given) ends with its tokens/s."""
    tokens = f" tokens/s={tokens_per_s:.0f}" if tokens_per_s is not None else ""
    return f"step {step}/{n_steps} loss={loss:.4f} examples/s={examples_per_s:.0f}{tokens}"


def figure(value: Any, spec: str, unit: str = "") -> str:
    """``value`` formatted with ``spec`` (and ``unit``), or ``n/a`` when the run has no such figure (e.g.
    ``perf/startup_s`` of a run resumed at its final step, which dispatched no step): never ``nan``."""
    return format(value, spec) + unit if isinstance(value, (int, float)) and value == value else "n/a"


def throughput_text(summary: dict[str, Any]) -> str:
    """The end line's throughput: ``examples/s=13981 (median of 6 windows, p25-p75 13500-14200)``, ``... (1
    window)``, or, when no window after the first was measured (a run shorter than two logging windows),
    ``examples/s=n/a (no steady-state window: the run ended in its first logging window)``: never a median
    of 0 windows. A language model's (a summary with ``perf/tokens_per_s``) ends with ``tokens/s=...`` (the same
    windows' median)."""
    n, eps = summary.get("perf/windows_measured"), summary.get("perf/examples_per_s")
    if not isinstance(n, int) or not n or eps is None:
        return "examples/s=n/a (no steady-state window: the run ended in its first logging window)"
    tps = summary.get("perf/tokens_per_s")
    tokens = f" tokens/s={figure(tps, '.0f')}" if tps is not None else ""
    if n == 1:
        return f"examples/s={figure(eps, '.0f')} (1 window){tokens}"
    p25, p75 = (
        figure(summary.get("perf/examples_per_s_p25"), ".0f"),
        figure(summary.get("perf/examples_per_s_p75"), ".0f"),
    )
    return f"examples/s={figure(eps, '.0f')} (median of {n} windows, p25-p75 {p25}-{p75}){tokens}"


# ---- paths ----------------------------------------------------------------------------------------------------
# With hydra.job.chdir=true each job runs inside its own folder, where a relative checkpoint.dir or TFDS_DATA_DIR
# would be looked for; so every path a user gives is made absolute against the launch folder, once.
def absolute(path: Optional[str], base: Path) -> Optional[str]:
    """``path`` with ``~`` expanded and, when relative, joined to ``base``; None/empty stay as they are."""
    if not path:
        return path
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else Path(base) / p)


def absolute_paths(cfg: Config, base: Path, environ=os.environ) -> Config:
    """A copy of ``cfg`` whose ``checkpoint.dir``, ``checkpoint.resume`` (a path), ``data.data_dir``,
    ``data.cache_dir``, ``data.path`` and ``runtime.compilation_cache_dir`` are absolute against ``base`` (the
    launch folder; ``~`` expanded); a relative ``TFDS_DATA_DIR`` in ``environ`` is made absolute there too (in
    place)."""
    ck, d = cfg.checkpoint, cfg.data
    resume = ck.resume if ck.resume in ("auto", "never") else absolute(ck.resume, base)
    tfds_dir = environ.get("TFDS_DATA_DIR")
    if tfds_dir:
        environ["TFDS_DATA_DIR"] = absolute(tfds_dir, base)
    return dataclasses.replace(
        cfg,
        checkpoint=dataclasses.replace(ck, dir=absolute(ck.dir, base), resume=resume),
        data=dataclasses.replace(
            d, data_dir=absolute(d.data_dir, base), cache_dir=absolute(d.cache_dir, base), path=absolute(d.path, base)
        ),
        runtime=dataclasses.replace(
            cfg.runtime, compilation_cache_dir=absolute(cfg.runtime.compilation_cache_dir, base)
        ),
    )
