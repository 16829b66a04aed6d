"""Runs a script (train.py or a bare script) with JAX's compile events and a Python profile recorded:

    python benchmarks/device/trace_startup.py TAG SCRIPT [ARGS...]

Writes $OUT/TAG.events.json (each jax.monitoring duration event: name, end time since process start in s,
duration in s) and $OUT/TAG.prof.txt (cProfile's top 60 by cumulative time).
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

    def on_duration(name: str, secs: float, **_kw) -> None:
        events.append((name, round(time.time() - T0, 3), round(secs, 4)))

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
    for name, _, secs in events:
        total[name] = total.get(name, 0.0) + secs
    print(f"TRACE {tag}: " + json.dumps({k: round(v, 3) for k, v in sorted(total.items())}), flush=True)
