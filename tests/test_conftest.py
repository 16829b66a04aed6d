"""The test set-up of tests/conftest.py that the other tests rely on (the ``unit`` marker's no-process rule is
tested in tests/test_layers.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHILD = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
# python -c IGNORING -m pytest ...: starts Python with SIGINT ignored, as `cmd &` in a script and nohup do (no
# preexec_fn: this process runs JAX's threads)
IGNORING = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def test_tests_and_the_processes_they_start_get_the_default_sigint_handler():
    """Within the suite a Ctrl-C raises KeyboardInterrupt, in the test process and in a Python process it starts."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True"]


def test_a_suite_started_with_sigint_ignored_still_gives_its_children_the_default():
    """`cmd &` in a script and nohup start pytest with SIGINT ignored, which its children would inherit (the tests
    that send train.py a Ctrl-C then saw it finish): the test above passes there too."""
    probe = subprocess.run([sys.executable, "-c", IGNORING, "-c", CHILD], capture_output=True, text=True)
    assert probe.stdout.split() == ["False"]  # what a background start gives a plain child
    node = f"{Path(__file__).name}::test_tests_and_the_processes_they_start_get_the_default_sigint_handler"
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            IGNORING,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            f"tests/{node}",
        ],
        cwd=REPO,
        env={**os.environ, "PYTEST_ADDOPTS": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "1 passed" in res.stdout
