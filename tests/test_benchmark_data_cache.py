"""The in-process benchmarks (``benchmarks/step_host_cost.py``, ``benchmarks/overhead.py --mode in-process``) read
MNIST where ``train.py`` keeps it. Whole processes: not in the unit tier."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "script",
    [
        ["benchmarks/step_host_cost.py", "--trials", "1", "--steps", "2"],
        ["benchmarks/overhead.py", "--mode", "in-process", "--devices", "1", "--pairs", "1", "--steps", "2"],
    ],
    ids=["step_host_cost", "overhead_in_process"],
)
def test_in_process_benchmarks_read_the_decoded_mnist_where_train_py_keeps_it(tmp_path, script):
    """The in-process benchmarks read MNIST's decoded cache from ``data.cache_dir`` (``$XDG_CACHE_HOME/dp_scaling``),
    where ``train.py`` writes it, not from a fixed ``~/.cache``. Here the cache exists only under ``$XDG_CACHE_HOME``
    (512 examples) and the TFDS folder holds no records, so a script that looked under ``$HOME/.cache`` would try to
    decode the TFDS records and fail."""
    tfds_dir = tmp_path / "tfds"
    (tfds_dir / "mnist" / "3.0.1").mkdir(parents=True)
    (tfds_dir / "mnist" / "3.0.1" / "dataset_info.json").write_text("{}")
    cache = tmp_path / "xdg" / "dp_scaling"
    cache.mkdir(parents=True)
    rng = np.random.default_rng(0)
    np.savez(
        cache / "mnist-3.0.1-train.npz",
        images=rng.integers(0, 256, (512, 28, 28, 1), dtype=np.uint8),
        labels=rng.integers(0, 10, 512).astype(np.int64),
    )
    (tmp_path / "home").mkdir()
    env = {
        **os.environ,
        "HOME": str(tmp_path / "home"),
        "XDG_CACHE_HOME": str(tmp_path / "xdg"),
        "TFDS_DATA_DIR": str(tfds_dir),
    }
    env.pop("XLA_FLAGS", None)  # the benchmark sets its own device count
    proc = subprocess.run([sys.executable, *script], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if "overhead.py" in script[0]:  # it names its data; random host data would mean it found no MNIST
        assert ", MNIST, " in proc.stdout, proc.stdout[-2000:]
