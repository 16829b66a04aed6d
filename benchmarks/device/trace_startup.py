"""Runs a script (train.py or a bare script) with JAX's compile events and a Python profile recorded:

    python benchmarks/device/trace_startup.py TAG SCRIPT [ARGS...]

Writes $OUT/TAG.events.json (each jax.monitoring duration event: name, end time since process start in s,
duration in s, the function it names or "") and $OUT/TAG.prof.txt (cProfile's top 60 by cumulative time).
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import runpy
import sys
import time
from pathlib import Path

tag, script, *args = sys.argv[1:]
out = Path(os.environ.get("OUT", "."))
events: list = []
T0 = time.time()


def hook() -> None:
    import jax.monitoring

    def on_duration(name: str, secs: float, fun_name: str = "", **_kw) -> None:
        events.append((name, round(time.time() - T0, 3), round(secs, 4), fun_name))

    jax.monitoring.register_event_duration_secs_listener(on_duration)


sys.argv = [script, *args]
sys.path.insert(0, str(Path(script).resolve().parent))
hook()
prof = cProfile.Profile() if os.environ.get("PROFILE") else None
try:
    if prof:
        prof.enable()
    runpy.run_path(script, run_name="__main__")
except SystemExit:
    pass
finally:
    (out / f"{tag}.events.json").write_text(json.dumps(events))
    if prof:
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(60)
        (out / f"{tag}.prof.txt").write_text(s.getvalue())
    total: dict = {}
    by_fun: dict = {}
    for name, _, secs, fun in events:
        total[name] = total.get(name, 0.0) + secs
        if fun:  # the trace, lowering and compile events name their function: which program took the time
            per = by_fun.setdefault(name.rsplit("/", 1)[-1], {})
            per[fun] = per.get(fun, 0.0) + secs
    print(f"TRACE {tag}: " + json.dumps({k: round(v, 3) for k, v in sorted(total.items())}), flush=True)
    rounded = {
        k: {f: round(v, 3) for f, v in sorted(d.items(), key=lambda i: -i[1]) if v >= 0.001} for k, d in by_fun.items()
    }
    print(f"TRACE_BY_FUNCTION {tag}: " + json.dumps(rounded), flush=True)
