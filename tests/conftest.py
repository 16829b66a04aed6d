"""Test set-up: 8 simulated CPU devices, forced before jax is first imported; shared fixtures."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
# JAX's persistent compilation cache (runtime.compilation_cache_dir defaults to this variable): one temporary
# folder for the session and the train.py processes it starts, removed at exit; never the user's cache.
COMPILATION_CACHE = tempfile.mkdtemp(prefix="dp_scaling_test_jax_cache_")
os.environ["JAX_COMPILATION_CACHE_DIR"] = COMPILATION_CACHE
atexit.register(shutil.rmtree, COMPILATION_CACHE, True)
os.environ.setdefault("WANDB_SILENT", "true")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_TFDS = os.path.join(os.path.dirname(REPO), "shared", "tensorflow_datasets")


def pytest_configure(config):
    assert len(jax.devices()) == 8, "tests need 8 simulated CPU devices (set before jax is imported)"


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
