"""``train.py``'s guards between the command line and the run (the first ones, before its imports:
``training.process.guard_start``); a SIGTERM or Ctrl-C at any moment: one line, ``summary.json`` status ``stopped``.

- ``cli``: Hydra composes with ``HYDRA_FULL_ERROR`` set (unless the user set it; the job unsets it: the run's own
  errors get Hydra's usual report), so that it raises what it refuses before the job (an unknown group option or
  key, two run flags, a run folder it cannot create), worded in one line, exit 1 (``conf.errors.command_line_error``).
- ``job``: the typed config (a key the chosen model or mode lacks, a value of the wrong type, outside its choices or
  range: one line, exit 1, ``summary.json`` failed), JAX's runtime, the run folder settled (one another run uses:
  refused before anything is written there), W&B's process and JAX's backend started beside the run's imports."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import os
import sys
from pathlib import Path
from typing import Callable, Iterator, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from conf.errors import command_line_error, multirun_flag_first, quote_numeric_options
from conf.schema import OPTION_SCHEMAS, Config, ConfigInputError, register, to_typed
from core.errors import TrainingError
from measure.address_space import check_runtime_fits, import_failure_line
from measure.throughput import STARTUP
from tracking import run_folder
from training import process
from training.console import absolute_paths, console, quiet_known_noise
from training.distributed import Startup
from training.report import prestart_wandb, write_json, write_summary
from training.runtime import setup_runtime, start_backend, without_ipython_probe

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
RAISE_FLAG, RAISE_MARK = "HYDRA_FULL_ERROR", "DP_SCALING_REWORDS_HYDRA_ERRORS"  # the mark: cli set it


@dataclasses.dataclass
class Job:
    """A job ready to run: ``run_and_report(config, run_dir, startup)`` (``training.run``), its result in ``ok``."""

    config: Config
    run_dir: Path
    startup: Startup
    run_and_report: Callable[[Config, Path, Optional[Startup]], bool]
    ok: bool = True


@contextlib.contextmanager
def job(cfg: DictConfig) -> Iterator[Optional[Job]]:
    """The job of Hydra's ``cfg`` started, or None when it ended at its start (a stopped sweep, a bad config in a
    sweep); after the block, exit 1 for a job not ``ok`` outside a sweep (its ``summary.json`` says why)."""
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    with process.interrupt_as_keyboard():  # a Ctrl-C in a C extension's import is an ImportError: Hydra would report it
        try:
            started = start(cfg, hc, run_dir)
        except (KeyboardInterrupt, Exception) as e:  # a signal before the run (which writes its own summary)
            if process.interrupted(e) and process.speaks():  # process 0 writes the job's summary
                write_summary(run_dir, {"status": "stopped", "error": process.stop_text()})
            raise
        yield started
    if started is not None and not started.ok and hc.mode != RunMode.MULTIRUN:
        sys.exit(1)


def start(cfg: DictConfig, hc, run_dir: Path) -> Optional[Job]:
    """The job up to its run (``job``); exits 1 for a bad config (but in a sweep: None) or a run folder in use."""
    process.set_sweep_dir(str(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else None)  # a stop's line: resume it
    process.STARTING.release()  # a signal held during the imports and the composition: KeyboardInterrupt now
    STARTUP.mark("config")  # Hydra: arguments, composition, run folder, logging
    if os.environ.pop(RAISE_MARK, None):
        os.environ.pop(RAISE_FLAG, None)  # errors of the run itself: Hydra's usual report
    quiet_known_noise()  # the TPU probe and TFDS's OpenCV notice (training.console.KNOWN_NOISE)
    if stopped := process.sweep_stopped():  # the sweep received SIGTERM/SIGINT: no new job starts (sweeps/callback.py)
        write_json(run_dir / "summary.json", {"status": "skipped", "error": process.NOT_STARTED + stopped})
        return None
    try:
        typed = absolute_paths(to_typed(cfg), Path(hydra.utils.get_original_cwd()))  # hydra.job.chdir=true safe
        if typed.distributed.process_id is not None:  # one voice per job from here on (training.process.speaks)
            process.set_rank(typed.distributed.process_id)
        STARTUP.mark("config")
        check_runtime_fits(typed)  # under ulimit -v: a C++ abort otherwise
        with process.HeldSigint():  # a Ctrl-C inside jaxlib's initialisation can abort the process
            import jax  # noqa: F401  (importing JAX starts no backend: setup_runtime still sets the device count)
    except (ConfigInputError, TrainingError, ImportError) as e:  # e.g. optim.lr=-1: stop at start with one line
        line = import_failure_line(e) if isinstance(e, ImportError) else str(e)
        if line is None:
            raise
        if process.speaks():  # process 0 writes the job's summary (an earlier run's is kept: its warning first)
            write_summary(run_dir, {"status": "failed", "error": line})
        console(f"error: {line}")  # once per job: every process of a multi-process job gets the same config
        if hc.mode != RunMode.MULTIRUN:
            sys.exit(1)
        return None  # in a sweep the failure is recorded and the sweep goes on (it exits 1 at the end)
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
    return Job(typed, run_dir, startup, run_and_report)


def cli(main: Callable[[], None], argv: list[str]) -> None:
    """Runs Hydra's ``main`` on the command line ``argv``; an error Hydra raises before the job starts becomes one
    ``error:`` line and exit code 1 (``conf.errors.command_line_error``). The collector is back on at the end."""
    register()  # the config's schema, for Hydra's composition
    STARTUP.mark("imports")  # perf/startup/*_s: each phase ends at a mark (measure/throughput.py, StartupPhases)
    # last at exit (W&B, orbax, JAX register theirs later; outputs closed by then): what is alive moves to the
    # permanent generation, so the interpreter's shutdown collections do not walk the objects of jax/flax/wandb
    atexit.register(gc.freeze)
    sys.argv = [sys.argv[0], *quote_numeric_options(multirun_flag_first(argv), CONF_DIR)]  # accum=4 -> accum='4'
    if RAISE_FLAG not in os.environ:
        os.environ[RAISE_FLAG] = os.environ[RAISE_MARK] = "1"
    process.STARTING.hold()  # (held since guard_start, when run as a script) until the job releases it
    try:
        with process.interrupt_as_keyboard():  # a Ctrl-C (e.g. in a sweep job's composition) that became another error
            main()
    except Exception as e:
        line = command_line_error(e, argv, Config, OPTION_SCHEMAS) if os.environ.get(RAISE_MARK) else None
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        sys.exit(1)
    finally:  # the collector back on however the run ended (a run stopped before its imports were done)
        process.release_gc()
        process.STARTING.release()  # no job ran (an error, --cfg, --help): a Ctrl-C held meanwhile raises now
