"""Scaling report of a Hydra multirun of ``train.py``.

    python train.py -m train.seed=0,1,2 mesh.devices=1,2,4,8 parallel=jit_sharding,fsdp
    python -m sweeps.report multirun/<date>/<time> [--out DIR] [--wandb]

Split by reason to change: ``collect`` (summaries -> job records), ``aggregate`` (repeats, intervals,
speedup), ``tables`` (CSV, Markdown), ``plots`` (figures), ``wandb_log`` (W&B), ``cli`` (entry point).
Never imports JAX; matplotlib draws headless (Agg), wandb only with ``--wandb``.
"""

from sweeps.report.aggregate import COLUMNS, aggregate
from sweeps.report.cli import main, write_report
from sweeps.report.collect import ReportError, collect, job_record, load_summaries
from sweeps.report.wandb_log import infer_group

__all__ = [
    "COLUMNS",
    "ReportError",
    "aggregate",
    "collect",
    "infer_group",
    "job_record",
    "load_summaries",
    "main",
    "write_report",
]
