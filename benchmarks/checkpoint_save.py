"""What one checkpoint save costs, as ``train.py`` saves (host arrays in one process) against orbax's own
``jax.Array`` path (the placed state handed to orbax as it is).

For each setup (``--setups``: the main job's MLP on 1 and 8 devices, and GPT size tiny on 8) the state that
``train.py`` builds (``training.build``) is saved ``--saves`` times by each way in turn through the
repository's ``Saver`` (orbax ``CheckpointManager``, asynchronous, ``keep=3``), each save followed by
``wait``, the two ways alternating save by save (a drift of the shared machine favours neither), each way into
its own folder and with its own ``Saver`` (the first save of each, which creates its ``CheckpointManager`` and
compiles what it needs, timed apart). Printed per way: the first save's wall seconds and programs compiled,
then over the later saves the medians (min-max) of process CPU milliseconds per save (``time.process_time``:
every thread, orbax's own included: on 2 cores that CPU is taken from the training steps it runs beside),
wall milliseconds per save, and main-thread milliseconds inside ``save`` (what a training step waits for).

    python benchmarks/checkpoint_save.py [--saves 10] [--setups mlp:1,mlp:8,gpt:8]

Runs on 8 simulated CPU devices (a 1-device setup uses the first); needs no data (the state only).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT
MODELS = {"mlp": [], "gpt": ["model=gpt", "data=tiny_shakespeare"]}


def typed_config(model: str, devices: int):
    """The typed config of ``python train.py <model overrides> mesh.devices=<devices>`` (Hydra's compose API)."""
    from hydra import compose, initialize_config_dir

    from conf.schema import register, to_typed

    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*MODELS[model], f"mesh.devices={devices}", "wandb.mode=disabled"])
    return to_typed(cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--saves", type=int, default=10, help="timed saves per way after the first (default 10)")
    ap.add_argument("--setups", default="mlp:1,mlp:8,gpt:8", help="model:devices, comma-separated")
    args = ap.parse_args()
    if args.saves < 1:
        ap.error(f"--saves={args.saves} must be at least 1")
    setups = []
    for item in args.setups.split(","):
        model, _, devices = item.partition(":")
        if model not in MODELS or devices not in {str(n) for n in range(1, 9)}:
            ap.error(f"--setups item {item!r}: use model:devices with model in {sorted(MODELS)}, devices 1-8")
        if (model, int(devices)) in setups:
            ap.error(f"--setups item {item!r} is given twice; give each setup once")
        setups.append((model, int(devices)))

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from training.build import build, plan
    from training.checkpoint import store

    compiled: list[str] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration_s, **kw: compiled.append(event) if event == COMPILE_EVENT else None
    )
    as_placed = lambda state: state  # noqa: E731  (orbax gets the placed state)
    ways = {"host arrays (train.py)": store.host_form, "device arrays (orbax's path)": as_placed}
    print(
        f"checkpoint_save: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.saves} timed saves "
        f"per way after the first, alternating",
        flush=True,
    )
    real_host_form = store.host_form
    with tempfile.TemporaryDirectory(prefix="checkpoint_save_") as work:
        for model, devices in setups:
            exp = build(plan(typed_config(model, devices)))
            state_mb = sum(x.nbytes for x in jax.tree.leaves(store.host_form(exp.state))) / 1e6
            # the NaN guard's device program, compiled before timing: the device-array way runs it at every save,
            # the host-array way checks its host copy instead (on the CPU backend, Saver.save)
            store.finite_flags(exp.state)
            savers = {w: store.Saver(Path(work) / f"{model}{devices}" / str(i), keep=3) for i, w in enumerate(ways)}
            results: dict[str, dict[str, list[float]]] = {w: {"cpu": [], "wall": [], "main": []} for w in ways}
            first: dict[str, tuple[float, int]] = {}
            try:
                for i in range(args.saves + 1):
                    order = list(ways) if i % 2 == 0 else list(reversed(ways))
                    for way in order:
                        store.host_form = ways[way]  # Saver.save calls it (module global)
                        n0, c0, w0, t0 = len(compiled), time.process_time(), time.perf_counter(), time.thread_time()
                        savers[way].save(exp.state, i + 1, {"step": i + 1}, exp.mode)
                        t1 = time.thread_time()
                        savers[way].wait()
                        c1, w1 = time.process_time(), time.perf_counter()
                        if i == 0:
                            first[way] = (w1 - w0, len(compiled) - n0)
                        else:
                            r = results[way]
                            r["cpu"].append(1e3 * (c1 - c0))
                            r["wall"].append(1e3 * (w1 - w0))
                            r["main"].append(1e3 * (t1 - t0))
            finally:
                store.host_form = real_host_form
                for saver in savers.values():
                    saver.close()
            print(f"\n{model}, {devices} device(s), state {state_mb:.1f} MB:")
            for way in ways:
                r = results[way]
                fmt = lambda xs: f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"  # noqa: E731
                print(
                    f"  {way:30s} first save {first[way][0]:.3f} s, {first[way][1]} program(s) compiled; per later "
                    f"save, median (min-max) ms: CPU {fmt(r['cpu'])}, wall {fmt(r['wall'])}, main thread in save "
                    f"{fmt(r['main'])}",
                    flush=True,
                )
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
