"""Runs a Python script and, at its exit, writes the CPU seconds of its threads to a JSON file (Linux: ``/proc``).

    python benchmarks/cpu_probe.py OUT.json SCRIPT [ARGS...]

The script runs as ``__main__`` (``runpy.run_path``, its folder first on ``sys.path``), as ``python SCRIPT ARGS``
would run it. Recorded (``benchmarks/cpu_budget.py`` reads it): ``process_s`` (user + system CPU of the whole
process, ``os.times``), ``main_s`` (the main thread), ``native_s`` (threads alive at exit that Python's
``threading`` did not start, by their OS name: XLA's compute pool ``tf_XLAEigen``, tensorstore's ``ts_pool_worker``,
and ``python`` for threads the XLA runtime starts in C++ under the process's own name), ``python_threads_s``
(threads started by ``threading``, by name with trailing numbers dropped, whether they ended before the exit or
not; a thread's CPU is ``time.thread_time`` around its ``run``), and ``exit_code``.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import re
import runpy
import sys
import threading
import time

_python_s: collections.Counter = collections.Counter()
_alive: dict[int, str] = {}  # native id -> name of the threading threads now running
_real_run = threading.Thread.run


def _name(thread: threading.Thread) -> str:
    """``async_save_3`` -> ``async_save``, ``Thread-10 (_target)`` -> ``Thread (_target)``."""
    return re.sub(r"[-_ ]?\d+", "", thread.name)


def _run(self: threading.Thread) -> None:
    native, c0 = threading.get_native_id(), time.thread_time()
    _alive[native] = _name(self)
    try:
        _real_run(self)
    finally:
        _alive.pop(native, None)
        _python_s[_name(self)] += time.thread_time() - c0


def _thread_cpu_s(tid: str) -> tuple[str, float]:
    """(OS name, user + system CPU seconds) of thread ``tid`` of this process."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2 :].split()
    return stat[stat.index("(") + 1 : stat.rindex(")")], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _write(path: str, exit_code: list) -> None:
    main_id = threading.main_thread().native_id
    native: collections.Counter = collections.Counter()
    python = collections.Counter(_python_s)
    main_s = time.thread_time()  # atexit handlers run on the main thread
    for tid in os.listdir("/proc/self/task"):
        try:
            name, cpu_s = _thread_cpu_s(tid)
        except OSError:  # ended meanwhile
            continue
        if int(tid) == main_id:
            continue
        if int(tid) in _alive:
            python[_alive[int(tid)]] += cpu_s
        else:
            native[name] += cpu_s
    t = os.times()
    with open(path, "w") as f:
        json.dump(
            {
                "process_s": t.user + t.system,
                "main_s": main_s,
                "native_s": dict(native),
                "python_threads_s": dict(python),
                "exit_code": exit_code[0],
            },
            f,
        )


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit("usage: python benchmarks/cpu_probe.py OUT.json SCRIPT [ARGS...]")
    out, script = sys.argv[1], os.path.abspath(sys.argv[2])
    sys.argv = [script, *sys.argv[3:]]
    sys.path[0] = os.path.dirname(script)  # the script's folder instead of this one, as `python SCRIPT` has it
    threading.Thread.run = _run  # type: ignore[method-assign]
    exit_code = [0]
    atexit.register(_write, out, exit_code)  # registered first: runs after the script's own exit handlers
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        exit_code[0] = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        raise


if __name__ == "__main__":
    main()
