"""``benchmarks/cpu_probe.py`` attributes a process's CPU to its threads; ``cpu_budget.py`` sums it into rows."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.cpu_budget import ROWS, budget
from tests.utils import REPO

SCRIPT = """
import sys, threading, time

def burn(seconds):
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        pass

worker = threading.Thread(target=burn, args=(0.3,), name="batch-prefetch")
worker.start()
worker.join()
for i in range(2):  # numbered names are counted under one name
    t = threading.Thread(target=burn, args=(0.1,), name=f"async_save_{i}")
    t.start()
    t.join()
burn(0.2)  # the main thread
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("code", [0, 3])
def test_probe_attributes_cpu_to_threads(tmp_path, code):
    """Threads' CPU by name (numbers dropped), the main thread's, the process's; the script's exit code kept."""
    script, out = tmp_path / "burn.py", tmp_path / "probe.json"
    script.write_text(SCRIPT)
    res = subprocess.run(
        [sys.executable, "benchmarks/cpu_probe.py", str(out), str(script), str(code)], cwd=REPO, capture_output=True
    )
    assert res.returncode == code, res.stderr
    record = json.loads(out.read_text())
    assert record["exit_code"] == code
    threads = record["python_threads_s"]
    assert set(threads) == {"batch-prefetch", "async_save"}
    assert threads["batch-prefetch"] == pytest.approx(0.3, abs=0.05)
    assert threads["async_save"] == pytest.approx(0.2, abs=0.05)
    assert record["main_s"] >= 0.2
    assert record["process_s"] >= record["main_s"] + 0.5 - 0.05
    rows = budget(record, tree_s=record["process_s"] + 0.25)
    assert list(rows) == list(ROWS)
    assert rows["batch-prefetch"] == threads["batch-prefetch"]
    assert rows["other Python"] == threads["async_save"]
    assert rows["exit + children"] == pytest.approx(0.25)
    parts = sum(rows[k] for k in ROWS[3:])
    assert parts == pytest.approx(rows["process"])  # the rows below "process" add up to it
