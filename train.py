"""Entry point: compose the Hydra config, type it, set up the process, run. No mode-specific code here.

    python train.py parallel=jit_sharding precision=bf16     # one experiment
    python train.py -m mesh.devices=1,2,4,8                  # a sweep (see sweeps/)

A config the schema refuses stops at start with one line on stderr (``error: ...``) and exit code 1: an unknown
group option, a misspelt key, a key the chosen model or mode does not have, a value of the wrong type, outside
its choices or out of its range (``conf/schema.py``, ``conf/errors.py``). A SIGTERM or Ctrl-C at any moment stops
the run with one line and ``summary.json`` status ``stopped`` (``training/process.py``); a run folder another run
is using is refused in one line before anything is written there (``tracking/run_folder.py``). The run itself:
``training/run.py``.
"""

from __future__ import annotations

import sys

from tracking import run_folder
from training import process

if __name__ == "__main__":
    process.install_interrupt_hooks(process.stop_line)  # a stop outside the training steps: one line, no traceback
    process.install_stop_handlers()  # SIGTERM as Ctrl-C: a stop with one line and a summary, from the start
    process.STARTING.hold()  # until the job has its run folder (main), where the stop writes summary.json
    if "IPython" not in sys.modules:  # not in an IPython session's %run, whose own objects would be frozen
        process.pause_gc()  # the collector off until the imports are done (training.process)

import atexit
import contextlib
import gc
import logging
import os
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from conf.errors import command_line_error, multirun_flag_first, quote_numeric_options
from conf.schema import OPTION_SCHEMAS, Config, ConfigInputError, register, to_typed
from measure.throughput import STARTUP
from sweeps.callback import NOT_STARTED
from training.console import absolute_paths, console, quiet_known_noise
from training.process import interrupt_as_keyboard, sweep_stopped
from training.report import prestart_wandb, write_json, write_summary
from training.runtime import setup_runtime, start_backend, without_ipython_probe

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
_COMPOSING = process.STARTING  # a signal during the imports and Hydra's composition is held until the job starts


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    with interrupt_as_keyboard():  # a Ctrl-C in a C extension's import is an ImportError: Hydra would report it
        with stopped_summary(run_dir):  # a signal before the run reports on its own: summary.json says stopped
            job = start_job(cfg, hc, run_dir)
        if job is None:
            return
        run_and_report, typed, startup = job
        ok = run_and_report(typed, run_dir, startup)
    if not ok and hc.mode != RunMode.MULTIRUN:
        sys.exit(1)  # in a sweep the failure is recorded in the job's summary.json and the sweep goes on


def start_job(cfg: DictConfig, hc, run_dir: Path):
    """The job up to its run: a held signal, the typed config, JAX's runtime, the run folder settled, the imports of
    the run. Returns ``(run_and_report, typed config, Startup)``, or None when the job ends here (a stopped sweep,
    a bad config in a sweep); exits 1 for a bad config or a run folder another run holds."""
    process.set_sweep_dir(str(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else None)  # a stop's line: resume it
    _COMPOSING.release()  # a signal held during the imports and the composition: KeyboardInterrupt now
    STARTUP.mark("config")  # Hydra: arguments, composition, run folder, logging
    if os.environ.pop(_RAISE_MARK, None):
        os.environ.pop(_RAISE_FLAG, None)  # errors of the run itself: Hydra's usual report
    quiet_known_noise()  # the TPU probe and TFDS's OpenCV notice (training.console.KNOWN_NOISE)
    if sweep_stopped():  # the sweep received SIGTERM/SIGINT: no new job starts (sweeps/callback.py)
        write_json(run_dir / "summary.json", {"status": "skipped", "error": NOT_STARTED + sweep_stopped()})
        return None
    try:
        typed = absolute_paths(to_typed(cfg), Path(hydra.utils.get_original_cwd()))  # hydra.job.chdir=true safe
    except ConfigInputError as e:  # e.g. +optim.learning_rate=0.5 or optim.lr=-1: stop at start with one line
        console(f"error: {e}")  # once per job: every process of a multi-process job gets the same config
        if process.speaks():  # process 0 writes the job's summary (an earlier run's is kept)
            write_summary(run_dir, {"status": "failed", "error": str(e)})
        if hc.mode != RunMode.MULTIRUN:
            sys.exit(1)
        return None  # in a sweep the failure is recorded and the sweep goes on (it exits 1 at the end)
    if typed.distributed.process_id is not None:  # one voice per job from here on (training.process.speaks)
        process.set_rank(typed.distributed.process_id)
    STARTUP.mark("config")
    with process.HeldSigint():  # a Ctrl-C inside jaxlib's initialisation can abort the process
        import jax  # noqa: F401  (importing JAX starts no backend: setup_runtime still sets the device count)
    STARTUP.mark("imports")
    startup = setup_runtime(typed)  # before anything touches devices: CPU devices, XLA flags, jax.distributed
    try:  # one process holds its run folder alone, those of a multi-process run share it (tracking.run_folder)
        run_folder.settle(multi=startup.settings is not None or startup.error is not None)
    except run_folder.RunFolderError as e:  # another run took the folder meanwhile: nothing of it is touched
        run_folder.refuse(e)
    prestart_wandb(typed.wandb.mode, typed.wandb.process_priority)  # W&B's process imports wandb meanwhile
    start_backend()  # the accelerator opens (seconds on a TPU) beside the imports below; the run waits for it
    STARTUP.mark("runtime")
    with without_ipython_probe():  # flax.nnx would import IPython only to learn this is not a notebook
        from training.run import run_and_report  # imports jax-dependent modules after the runtime is set up
    process.resume_gc()  # the modules and the config are in: freeze them, the collector back on
    STARTUP.mark("imports")
    return run_and_report, typed, startup


@contextlib.contextmanager
def stopped_summary(run_dir: Path):
    """A stop by a signal in the block (the job before its run, which writes its own summary): ``summary.json`` says
    status ``stopped`` and why (``training.process.stop_text``); the stop goes on."""
    try:
        yield
    except (KeyboardInterrupt, Exception) as e:
        if process.interrupted(e) and process.speaks():  # process 0 writes the job's summary
            write_summary(run_dir, {"status": "stopped", "error": process.stop_text()})
        raise


def cli(argv: list[str]) -> None:
    """Runs ``main`` on the command line ``argv``; an error Hydra raises before the job starts (a refused
    composition, two run flags, a run folder it cannot create) becomes one line and exit code 1.

    Hydra prints its composition errors over many lines; with ``HYDRA_FULL_ERROR=1`` it raises them instead, so this
    sets it for the composition (unless the user did) and rewords the error (``conf.errors.command_line_error``).
    """
    sys.argv = [sys.argv[0], *quote_numeric_options(multirun_flag_first(argv), CONF_DIR)]  # accum=4 -> accum='4'
    if _RAISE_FLAG not in os.environ:
        os.environ[_RAISE_FLAG] = os.environ[_RAISE_MARK] = "1"
    _COMPOSING.hold()
    try:
        with interrupt_as_keyboard():  # a Ctrl-C (e.g. in a sweep job's composition) that became another error
            main()
    except Exception as e:
        line = command_line_error(e, argv, Config, OPTION_SCHEMAS) if os.environ.get(_RAISE_MARK) else None
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        sys.exit(1)
    finally:
        _COMPOSING.release()  # no job ran (an error, --cfg, --help): a Ctrl-C held meanwhile raises now


if __name__ == "__main__":
    try:
        cli(sys.argv[1:])
    finally:  # the collector back on however the run ended (a run stopped before its imports were done)
        process.release_gc()
