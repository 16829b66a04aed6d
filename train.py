"""Entry point: compose the Hydra config, build the experiment, run it. No mode-specific code here.

    python train.py parallel=jit_sharding precision=bf16     # one experiment
    python train.py -m mesh.devices=1,2,4,8                  # a sweep (see sweeps/)
"""

from __future__ import annotations

import atexit
import gc
import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from conf.schema import UnknownKeyError, register, to_typed
from training.console_lines import quiet_known_noise
from training.paths import absolute_paths
from training.runtime import setup_runtime

register()
log = logging.getLogger("train")
# At exit, after every other exit handler (W&B, orbax and JAX register theirs later, so theirs run first): the
# objects still alive move to the GC's permanent generation, so the interpreter's shutdown collections do not
# walk the millions of objects of jax/flax/wandb (~0.7 s of exit on 2 CPU cores; outputs are closed by then).
atexit.register(gc.freeze)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    quiet_known_noise()  # the TPU probe and TFDS's OpenCV notice (README "Output")
    try:
        typed = absolute_paths(to_typed(cfg), Path(hydra.utils.get_original_cwd()))  # hydra.job.chdir=true safe
    except UnknownKeyError as e:  # e.g. +optim.learning_rate=0.5: stop at start with one line
        print(f"train.py: {e}", file=sys.stderr)
        sys.exit(1)
    startup = setup_runtime(typed)  # before anything touches devices: simulated CPU devices, XLA flags, jax.distributed

    from training.app import run_and_report  # imports jax-dependent modules after the runtime is set up

    ok = run_and_report(typed, Path(hc.runtime.output_dir), startup)
    if not ok and hc.mode != RunMode.MULTIRUN:
        sys.exit(1)  # in a sweep the failure is recorded in the job's summary.json and the sweep goes on


if __name__ == "__main__":
    main()
