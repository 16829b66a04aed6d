"""Test set-up: 8 simulated CPU devices, forced before jax is first imported; shared fixtures."""

import _posixsubprocess
import atexit
import os
import shutil
import signal
import subprocess
import tempfile

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
# JAX's persistent compilation cache (runtime.compilation_cache_dir defaults to this variable): one temporary
# folder for the session and the train.py processes it starts, removed at exit; never the user's cache.
COMPILATION_CACHE = tempfile.mkdtemp(prefix="dp_scaling_test_jax_cache_")
os.environ["JAX_COMPILATION_CACHE_DIR"] = COMPILATION_CACHE
atexit.register(shutil.rmtree, COMPILATION_CACHE, True)
os.environ.setdefault("WANDB_SILENT", "true")
# A suite started in the background (`cmd &` in a script, nohup) inherits SIGINT ignored, and an ignored signal
# stays ignored across exec in every process it starts: Python's own handler here, so that the tests that send a
# Ctrl-C to train.py (and the xdist workers) see what an interactive shell gives them.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_TFDS = os.path.join(os.path.dirname(REPO), "shared", "tensorflow_datasets")


def pytest_configure(config):
    assert len(jax.devices()) == 8, "tests need 8 simulated CPU devices (set before jax is imported)"


class UnitTestStartedProcess(RuntimeError):
    """Raised when a test marked ``unit`` (the ``make test-unit`` tier) starts a process."""


# Every way a Python process starts another: subprocess through its own reference to
# _posixsubprocess.fork_exec (or os.posix_spawn), multiprocessing's spawn/forkserver through
# _posixsubprocess.fork_exec, its fork through os.fork; os.system directly.
_PROCESS_STARTERS = [
    (subprocess, "_fork_exec"),
    (_posixsubprocess, "fork_exec"),
    (os, "fork"),
    (os, "forkpty"),
    (os, "system"),
    (os, "posix_spawn"),
    (os, "posix_spawnp"),
]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test marked ``unit`` runs (setup, call and teardown, module fixtures it first needs included) with
    every process starter replaced by one that raises :class:`UnitTestStartedProcess`: the quick tier's
    "in-process, no subprocesses" holds by construction, not by review."""
    if item.get_closest_marker("unit") is None:
        return (yield)

    def refuse(*args, **kwargs):
        raise UnitTestStartedProcess(
            f"{item.nodeid} is marked `unit` (make test-unit: in-process only) but started a process; "
            "drop its `unit` marker or test the code in-process"
        )

    saved = [(mod, name, getattr(mod, name)) for mod, name in _PROCESS_STARTERS if hasattr(mod, name)]
    for mod, name, _ in saved:
        setattr(mod, name, refuse)
    try:
        return (yield)
    finally:
        for mod, name, original in saved:
            setattr(mod, name, original)


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """Offline W&B with every W&B folder inside the test's temp folder."""
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        d = tmp_path / var.lower()
        d.mkdir()
        monkeypatch.setenv(var, str(d))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return tmp_path
