"""Entry point: compose the Hydra config, build the experiment, run it. No mode-specific code here.

    python train.py parallel=jit_sharding precision=bf16     # one experiment
    python train.py -m mesh.devices=1,2,4,8                  # a sweep (see sweeps/)

A config the schema refuses stops at start with one line on stderr (``error: ...``) and exit code 1: an
unknown group option, a misspelt key (with or without ``+``), a key the chosen model or mode does not have, a
value of the wrong type or outside its choices (``conf/schema.py: one_line``).
"""

from __future__ import annotations

import sys

from training import process
from training.process import interrupt_as_keyboard

if __name__ == "__main__":
    process.install_interrupt_hooks()  # a Ctrl-C outside the training steps: one line, no traceback
    if "IPython" not in sys.modules:
        # the collector off until the imports are done (training.process): only as the program itself (not in an
        # IPython session's %run, whose own objects would be frozen)
        process.pause_gc()

import atexit
import gc
import logging
import os
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from conf.schema import ConfigInputError, is_composition_error, one_line, quote_numeric_options, register, to_typed
from measure.throughput import STARTUP
from training.console import absolute_paths, quiet_known_noise
from training.report import prestart_wandb
from training.runtime import setup_runtime, start_backend, without_ipython_probe
from training.process import sweep_stopped
from training.sweep_summary import NOT_STARTED

register()
STARTUP.mark("imports")  # perf/startup/*_s: each phase ends at a mark (measure/throughput.py, StartupPhases)
log = logging.getLogger("train")
# At exit, after every other exit handler (W&B, orbax and JAX register theirs later, so theirs run first): the
# objects still alive move to the GC's permanent generation, so the interpreter's shutdown collections do not
# walk the millions of objects of jax/flax/wandb (outputs are closed by then).
atexit.register(gc.freeze)
CONF_DIR = Path(__file__).resolve().parent / "conf"
# cli() sets HYDRA_FULL_ERROR (unless the user did) so that Hydra raises composition errors, and marks that it
# did; the job unsets both, so errors of the run itself (also in launcher subprocesses) get Hydra's usual report.
_RAISE_FLAG, _RAISE_MARK = "HYDRA_FULL_ERROR", "DP_SCALING_REWORDS_HYDRA_ERRORS"


# A Ctrl-C during Hydra's composition is held until the job starts (training.process.HeldSigint)
_COMPOSING = process.HeldSigint()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    _COMPOSING.release()  # a Ctrl-C held during the composition: KeyboardInterrupt now
    STARTUP.mark("config")  # Hydra: arguments, composition, run folder, logging
    if os.environ.pop(_RAISE_MARK, None):
        os.environ.pop(_RAISE_FLAG, None)  # errors of the run itself: Hydra's usual report
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    quiet_known_noise()  # the TPU probe and TFDS's OpenCV notice (training.console.KNOWN_NOISE)
    if sweep_stopped():  # the sweep received SIGTERM/SIGINT: no new job starts (training/sweep_summary.py)
        from training.report import write_json

        write_json(run_dir / "summary.json", {"status": "skipped", "error": NOT_STARTED + sweep_stopped()})
        return
    try:
        typed = absolute_paths(to_typed(cfg), Path(hydra.utils.get_original_cwd()))  # hydra.job.chdir=true safe
    except ConfigInputError as e:  # e.g. +optim.learning_rate=0.5: stop at start with one line
        print(f"error: {e}", file=sys.stderr)
        from training.report import write_json

        write_json(run_dir / "summary.json", {"status": "failed", "error": str(e)})
        if hc.mode != RunMode.MULTIRUN:
            sys.exit(1)
        return  # in a sweep the failure is recorded and the sweep goes on (it exits 1 at the end)
    STARTUP.mark("config")
    with interrupt_as_keyboard():  # a Ctrl-C in a C extension's import is an ImportError: Hydra would report it
        with process.HeldSigint():  # a Ctrl-C inside jaxlib's initialisation can abort the process
            import jax  # noqa: F401  (importing JAX starts no backend: setup_runtime still sets the device count)

        STARTUP.mark("imports")
        # before anything touches devices: simulated CPU devices, XLA flags, jax.distributed
        startup = setup_runtime(typed)
        # W&B's own process imports wandb beside the imports below (on another core; training/wandb_process.py)
        prestart_wandb(typed.wandb.mode, typed.wandb.process_priority)
        # the accelerator opens (seconds on a TPU) beside the imports below; run_and_report waits for it
        start_backend()
        STARTUP.mark("runtime")

        with without_ipython_probe():  # flax.nnx would import IPython only to learn this is not a notebook
            from training.run import run_and_report  # imports jax-dependent modules after the runtime is set up

        process.resume_gc()  # the modules and the config are in: freeze them, the collector back on
        STARTUP.mark("imports")

        ok = run_and_report(typed, run_dir, startup)
    if not ok and hc.mode != RunMode.MULTIRUN:
        sys.exit(1)  # in a sweep the failure is recorded in the job's summary.json and the sweep goes on


def multirun_flag_first(argv: list[str]) -> list[str]:
    """``argv`` with ``-m``/``--multirun`` moved before the overrides: Hydra's argument parser refuses the flag
    after an override (``python train.py data=synthetic -m accum=1,2`` would print its usage and exit 2)."""
    flags = [a for a in argv if a in ("-m", "--multirun")]
    return flags + [a for a in argv if a not in ("-m", "--multirun")]


def cli(argv: list[str]) -> None:
    """Runs ``main`` on the command line ``argv``; composition errors become one line and exit code 1.

    Hydra prints its composition errors over many lines (search path, every option) and exits; with
    ``HYDRA_FULL_ERROR=1`` it raises them instead, so this sets it for the composition (unless the user did)
    and rewords the error with ``conf.schema.one_line``. ``accum=4`` is passed as ``accum='4'``: Hydra reads an
    unquoted number as an integer and refuses it as a group option.
    """
    sys.argv = [sys.argv[0], *quote_numeric_options(multirun_flag_first(argv), CONF_DIR)]
    if _RAISE_FLAG not in os.environ:
        os.environ[_RAISE_FLAG] = os.environ[_RAISE_MARK] = "1"
    _COMPOSING.hold()
    try:
        with interrupt_as_keyboard():  # a Ctrl-C (e.g. in a sweep job's composition) that became another error
            main()
    except Exception as e:
        if not os.environ.get(_RAISE_MARK):
            raise
        if is_composition_error(e):
            print(f"error: {one_line(e)}", file=sys.stderr)
        elif isinstance(e, ValueError) and str(e).startswith("Only one of --run, --multirun"):
            # Hydra's refusal of two run flags together, e.g. -m with --cfg (before any folder is made)
            sweep = any(a in ("-m", "--multirun") for a in argv)
            hint = "; drop -m (--multirun) and give one job's values, e.g. python train.py --cfg job mesh.devices=2"
            print(f"error: {e}{hint if sweep else ''}", file=sys.stderr)
        elif isinstance(e, OSError):  # before the job started: Hydra could not create the run (or sweep) folder
            print(
                f"error: cannot create the run folder: {e.strerror or e}: {e.filename}; set hydra.run.dir "
                "(hydra.sweep.dir with -m) to a folder you can write",
                file=sys.stderr,
            )
        else:
            raise
        sys.exit(1)
    finally:
        _COMPOSING.release()  # no job ran (an error, --cfg, --help): a Ctrl-C held meanwhile raises now


if __name__ == "__main__":
    try:
        cli(sys.argv[1:])
    finally:  # the collector back on however the run ended (a run stopped before its imports were done)
        process.release_gc()
