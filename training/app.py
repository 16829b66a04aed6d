"""Runs one experiment with its reporting, turning user errors into one line and a failed summary."""

from __future__ import annotations

import logging
from pathlib import Path

import jax

from conf.schema import Config
from training.distributed import check_device_counts, raise_startup_error
from training.report import Reporter, console
from training.run import USER_ERRORS, describe, run

log = logging.getLogger(__name__)


def run_and_report(cfg: Config, run_dir: Path) -> bool:
    """Runs ``cfg`` in ``run_dir``; returns True on success.

    Bad input (config, data, a non-finite loss) prints one line ``error: ...`` on stderr and writes
    ``summary.json`` with ``status: failed`` and the error; anything else is a bug and propagates with its
    traceback (after the summary and W&B are closed).
    """
    reporter = Reporter(run_dir, enabled=jax.process_index() == 0)
    try:
        # --- distributed (issue 7): a bad multi-process setting or unequal device counts stop here ---
        raise_startup_error()
        if jax.process_count() > 1:
            check_device_counts()
        # --- end distributed ---
        summary = run(cfg, run_dir, reporter)
    except USER_ERRORS as e:
        line = str(e).splitlines()[0] if str(e) else type(e).__name__
        console(f"error: {line}")
        reporter.summary({**describe(cfg), "status": "failed", "error": line})
        reporter.close(exit_code=1)
        return False
    except BaseException as e:
        reporter.summary({**describe(cfg), "status": "failed", "error": f"{type(e).__name__}: {e}".splitlines()[0]})
        reporter.close(exit_code=1)
        raise
    if summary.get("checkpoint/already_complete"):
        console(f"already complete at step {summary.get('train/steps')}: eval/accuracy="
                f"{summary.get('eval/accuracy')} (checkpoint {summary.get('checkpoint/last_path')}); nothing to do")
        if not keeps_summary(run_dir / "summary.json"):
            reporter.summary(summary)
        reporter.close(exit_code=0)
        return True
    reporter.summary(summary)
    reporter.close(exit_code=0)
    rate = summary.get("perf/examples_per_s")
    log.info("eval/accuracy=%.4f eval/loss=%.4f%s; outputs in %s", summary["eval/accuracy"], summary["eval/loss"],
             (f" examples/s={rate:.0f}" + (f" (timed by process {jax.process_index()} of {jax.process_count()}; "
                                           f"summary.json has process 0's)" if jax.process_count() > 1 else ""))
             if isinstance(rate, (int, float)) else "", run_dir)
    return True


def keeps_summary(path: Path) -> bool:
    """Whether ``path`` already holds a successful run's summary (a rerun of a finished run leaves it)."""
    import json

    try:
        return json.loads(path.read_text()).get("status") == "ok"
    except (OSError, ValueError):
        return False
