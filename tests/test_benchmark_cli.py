"""The CPU mode of the benchmarks whose figures docs/performance.md cites and no other test runs: each command
runs at a tiny size and prints its table. Whole processes: not in the unit tier."""

from __future__ import annotations

import os
import subprocess
import sys

from utils import REPO, SHARED_TFDS


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if SHARED_TFDS.exists():
        env.setdefault("TFDS_DATA_DIR", str(SHARED_TFDS))
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_accumulation_benchmark_prints_temporaries_per_k():
    res = _run("benchmarks/accumulation.py", "--devices", "2", "--global-batch", "64", "--modes", "jit_sharding,fsdp")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "K=1" in res.stdout and "K=8" in res.stdout
    rows = [line.split() for line in res.stdout.splitlines() if line.split()[:1] in (["jit_sharding"], ["fsdp"])]
    assert len(rows) == 4  # two modes x bf16, fp32
    assert all(row[4] == "1.00" for row in rows), rows  # K=1 (value, unit, ratio) is its own reference


def test_input_pipeline_benchmark_prints_the_median_ratio():
    res = _run("benchmarks/input_pipeline.py", "--devices", "2", "--pairs", "1", "--steps", "5")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "median ratio (mnist ex/s / synthetic ex/s)" in res.stdout
