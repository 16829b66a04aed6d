"""Runs one experiment with its reporting, turning user errors into one line and a failed summary."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import jax

from conf.schema import Config
from core.errors import USER_ERRORS
from measure.throughput import STARTUP
from training.console_lines import throughput_text
from training.distributed import Startup, check_device_counts
from training.interrupt import interrupted
from training.prepare import describe
from training.report import Reporter, console
from training.run import run

log = logging.getLogger(__name__)


def run_and_report(cfg: Config, run_dir: Path, startup: Optional[Startup] = None) -> bool:
    """Runs ``cfg`` in ``run_dir``; returns True on success. ``startup``: what ``setup_runtime`` returned
    (a bad multi-process setting in it is reported like any other bad input).

    Bad input (config, data, a non-finite loss) prints one line ``error: ...`` on stderr and writes
    ``summary.json`` with ``status: failed`` and the error; anything else is a bug and propagates with its
    traceback (after the summary and W&B are closed).
    """
    # the backend (started beside the imports by train.py: training.runtime.start_backend, else here); what is
    # left of its start is timed as the `runtime` start-up phase
    jax.devices()
    STARTUP.mark("runtime")
    reporter = Reporter(run_dir, enabled=jax.process_index() == 0)
    try:
        # a bad multi-process setting or unequal device counts stop here
        if startup is not None:
            startup.raise_error()
        if jax.process_count() > 1:
            check_device_counts()
        summary = run(cfg, run_dir, reporter)
    except USER_ERRORS as e:
        line = str(e).splitlines()[0] if str(e) else type(e).__name__
        console(f"error: {line}")
        reporter.summary({**describe(cfg), "status": "failed", "error": line})
        reporter.close(exit_code=1)
        return False
    except BaseException as e:
        if interrupted(e):  # a Ctrl-C (or an error it caused, e.g. in a C extension's import)
            error = "KeyboardInterrupt"
        else:
            error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        reporter.summary({**describe(cfg), "status": "failed", "error": error.splitlines()[0]})
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
        return True
    reporter.summary(summary)
    reporter.close(exit_code=0)
    log.info(
        "eval/accuracy=%.4f eval/loss=%.4f %s wall=%s startup=%s; outputs in %s",
        summary["eval/accuracy"],
        summary["eval/loss"],
        throughput_text(summary),
        _figure(summary.get("perf/wall_s"), ".1f", "s"),
        _figure(summary.get("perf/startup_s"), ".1f", "s"),
        run_dir,
    )
    return True


def _figure(value, spec: str, unit: str = "") -> str:
    """``value`` formatted with ``spec``, or ``n/a`` when the run has no such figure (e.g. ``perf/startup_s`` of a
    run resumed at its final step, which dispatched no step): the end line never prints ``nan``."""
    return format(value, spec) + unit if isinstance(value, (int, float)) and value == value else "n/a"


def keeps_summary(path: Path) -> bool:
    """Whether ``path`` already holds a successful run's summary (a rerun of a finished run leaves it)."""
    import json

    try:
        return json.loads(path.read_text()).get("status") == "ok"
    except (OSError, ValueError):
        return False
