"""Start-up of train.py against the bare GPT script, with JAX's compile events (trace, lowering, backend compile
or cache retrieval) of each process, on the device:

    bash benchmarks/device/run.sh benchmarks/device/startup_pairs.py char gpt2_small              # cold, warm1, warm2
    ROUNDS="warm3 warm4" bash benchmarks/device/run.sh benchmarks/device/startup_pairs.py char     # more warm pairs

A round named ``cold*`` empties both compilation caches first; the others reuse them (a warm machine keeps /tmp).
Per run it prints ``TRACE <workload>_<who>_<round>: {event: total s}``, ``TRACE_BY_FUNCTION`` (the same totals
per function the events name: ``train_step``, ``init_fn``, ``eval_sums`` (traced at the first evaluation, after
the start-up), the model's abstract evaluation ``<lambda>`` ...) and ``SUMMARY``/``BARE`` lines with
train.py's ``perf/startup*`` and the bare script's timings (its ``first_step`` is seconds from its start to its first
step's end). QUICK=1: the CPU smoke sizes. Workloads: ``benchmarks/accelerator.py``'s WORKLOADS. The trace:
``benchmarks/device/trace_startup.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from accelerator import QUICK, WORKLOADS, bare_args, train_args  # noqa: E402

TRACE = str(REPO / "benchmarks/device/trace_startup.py")


def main() -> None:
    for name in sys.argv[1:]:
        model, batch, steps, window = (QUICK if os.environ.get("QUICK") else WORKLOADS)[name]
        ct, cb = Path(f"/tmp/startup_cache_train_{name}"), Path(f"/tmp/startup_cache_bare_{name}")
        for rnd in os.environ.get("ROUNDS", "cold warm1 warm2").split():
            if rnd.startswith("cold"):
                shutil.rmtree(ct, ignore_errors=True)
                shutil.rmtree(cb, ignore_errors=True)
            rd, tj = Path(f"/tmp/startup_run_{name}_{rnd}"), Path(f"/tmp/startup_bare_{name}_{rnd}.json")
            train = [*train_args(model, batch, steps, window, {}), f"hydra.run.dir={rd}"]
            subprocess.run(
                [
                    sys.executable,
                    TRACE,
                    f"{name}_train_{rnd}",
                    "train.py",
                    *train,
                    f"runtime.compilation_cache_dir={ct}",
                ],
                cwd=REPO,
                check=True,
            )
            s = json.loads((rd / "summary.json").read_text())
            keep = {k: v for k, v in s.items() if k.startswith("perf/startup") or k == "perf/compile_time_s"}
            print(f"SUMMARY {name} {rnd} {json.dumps(keep)}", flush=True)
            bare = [*bare_args(model, batch, steps, window, {}), f"--timings={tj}", f"--compilation-cache={cb}"]
            subprocess.run(
                [sys.executable, TRACE, f"{name}_bare_{rnd}", "benchmarks/bare_gpt.py", *bare], cwd=REPO, check=True
            )
            b = json.loads(tj.read_text())
            print(
                f"BARE {name} {rnd} {json.dumps({k: v for k, v in b.items() if not isinstance(v, list)})}", flush=True
            )


if __name__ == "__main__":
    main()
