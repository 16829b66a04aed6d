"""Entry point: compose the Hydra config, type it, set up the process, run. No mode-specific code here.

    python train.py parallel=jit_sharding precision=bf16     # one experiment
    python train.py -m mesh.devices=1,2,4,8                  # a sweep (see sweeps/)

Bad input, a signal or a run folder in use stops the run with one line (``training/entry.py``); the run itself:
``training/run.py``."""

from __future__ import annotations

import sys

from training import process  # the standard library only: its guards go up before Hydra and JAX are imported

if __name__ == "__main__":
    process.guard_start()  # a signal: one line and a stopped summary (once the run folder exists); no GC meanwhile

import hydra
from omegaconf import DictConfig

from training import entry


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    """One job: its config typed, the process set up, the run; exit status 1 when it failed (a sweep goes on)."""
    with entry.job(cfg) as job:  # None: the job ended at its start; a signal before the run: summary.json stopped
        if job is not None:
            job.ok = job.run_and_report(job.config, job.run_dir, job.startup)


if __name__ == "__main__":
    entry.cli(main, sys.argv[1:])
