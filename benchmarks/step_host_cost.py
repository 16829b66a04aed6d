"""Where a 1-device step of the main job (MNIST MLP, batch 256, fp32) costs more than a bare JAX step.

In one process, the repository's AOT-compiled train step (``training.build``: ``TrainState`` in, new state and
``{train/loss, train/accuracy}`` out) against a hand-written ``jax.jit`` step of the same MLP and
``optax.adam(1e-3)`` (params + optimizer state in, loss out; ``benchmarks/bare_train.py``'s step), and that bare
step with the repository's extra leaves (a step counter, three loss-scale scalars, two metric outputs), in
``--trials`` interleaved trials of ``--steps`` calls each on one pre-placed batch:

- dispatch: main-thread CPU time per call (``time.thread_time``: the host work of flattening, checking and
  enqueueing a call, hardly moved by other processes' load); median and min over the trials;
- device: wall time per step, dispatching and waiting for the last (the step's own cost; load moves it, so the
  min over the trials is printed beside the median);
- the compiled programs' XLA cost analysis (flops, bytes accessed);
- batch placement: main-thread CPU per batch, ``BatchLayout.place`` of ``TrainSource.local_batch`` (the
  prefetch thread's work) against the bare ``jax.device_put((images[idx], labels[idx]))``;
- a logging window's metrics to the host: main-thread CPU and wall time per 50-step window, three ways:
  ``parallel.state.metrics_to_host`` of the window's list (``training.hooks.flush_window``: the steps' metrics
  stacked on the device, ``parallel.state.window_to_host``), one ``jax.device_get`` of the list (a copy per
  metric and step, started together), and one call per step; the three results are checked bitwise equal.

    python benchmarks/step_host_cost.py [--trials 9] [--steps 100]

Needs MNIST prepared (``TFDS_DATA_DIR``) or its decoded cache.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WINDOW = 50  # steps per logging window (train.log_every)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=9)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from conf.schema import from_dict
    from data.pipeline import TrainSource, train_batches
    from data.sources import load_tfds_split, resolve_data_dir
    from parallel.state import metrics_to_host
    from training.build import batches_need_index, build, plan

    cfg = from_dict({"mesh": {"devices": 1}, "train": {"global_batch": 256}})
    # the decoded cache where train.py keeps it (data.cache_dir: $XDG_CACHE_HOME or ~/.cache, then dp_scaling)
    train = load_tfds_split("mnist", "train", resolve_data_dir(None), cfg.data.cache_dir)
    exp = build(plan(cfg))
    layout = exp.mode.batch_layout()
    source = TrainSource(train, 256, 0, with_index=batches_need_index(cfg))
    rows = layout.local_rows(256)
    batch = next(train_batches(source, layout, 0, 1, 2))
    step_repo = exp.steps.train.lower(exp.state, batch).compile()

    mesh = exp.mode.mesh
    repl, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(("data", "fsdp")))
    tx = optax.adam(1e-3)

    def fresh_params():
        k1, k2 = jax.random.split(jax.random.key(0))
        p = {
            "w1": 0.01 * jax.random.normal(k1, (784, 256)),
            "b1": jnp.zeros(256),
            "w2": 0.01 * jax.random.normal(k2, (256, 10)),
            "b2": jnp.zeros(10),
        }
        return jax.device_put(p, repl)

    def loss_fn(params, x, y):
        x = (x.astype(jnp.float32) / 255.0).reshape(x.shape[0], -1)
        logits = jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def bare(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def bare_extra(params, opt_state, extra, x, y):
        params, opt_state, loss = bare(params, opt_state, x, y)
        return params, opt_state, {"step": extra["step"] + 1, "scale": extra["scale"]}, {"loss": loss, "acc": loss}

    step_bare = jax.jit(bare, in_shardings=(repl, repl, split, split), donate_argnums=(0, 1))
    step_extra = jax.jit(bare_extra, in_shardings=(repl, repl, repl, split, split), donate_argnums=(0, 1, 2))
    x, y = batch["image"], batch["label"]
    state = {
        "repo": (exp.state,),
        "bare": (fresh_params(), None),
        "bare + repo's leaves": (fresh_params(), None, None),
    }
    state["bare"] = (state["bare"][0], tx.init(state["bare"][0]))
    p3 = state["bare + repo's leaves"][0]
    i32 = lambda: jnp.zeros((), jnp.int32)
    extra = {"step": i32(), "scale": (jnp.ones(()), i32(), i32())}
    state["bare + repo's leaves"] = (p3, tx.init(p3), jax.device_put(extra, repl))

    def call(name, s):
        if name == "repo":
            return step_repo(s[0], batch)[:1]
        if name == "bare":
            return step_bare(*s, x, y)[:2]
        return step_extra(*s, x, y)[:3]

    def trial(name, n):
        s = state[name]
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(n):
            s = call(name, s)
        cpu = time.thread_time() - c0
        jax.block_until_ready(s)
        wall = time.perf_counter() - t0
        state[name] = s
        return cpu / n, wall / n

    def place_repo(n):
        c0 = time.thread_time()
        for s in range(n):
            jax.block_until_ready(layout.place(source.local_batch(s, rows), 256))
        return (time.thread_time() - c0) / n, 0.0

    def place_bare(n):
        c0 = time.thread_time()
        for s in range(n):
            idx = source.global_indices(s)
            jax.block_until_ready(jax.device_put((train.images[idx], train.labels[idx]), split))
        return (time.thread_time() - c0) / n, 0.0

    def window_of_metrics():
        """The device metrics of 50 fresh steps (a logging window; fresh: a converted array keeps its copy)."""
        st, window = state["repo"][0], []
        for _ in range(WINDOW):
            st, m = step_repo(st, batch)
            window.append(m)
        state["repo"] = (st,)
        return jax.block_until_ready(window)

    ways = {
        "stacked": metrics_to_host,  # training.hooks.flush_window: the window's list in one call
        "one device_get": jax.device_get,  # the list's copies started together, one per metric and step
        "per step": lambda window: [metrics_to_host(m) for m in window],
    }

    def transfer(way: str):
        window = window_of_metrics()
        t0, c0 = time.perf_counter(), time.thread_time()
        host = ways[way](window)
        cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
        assert len(host) == WINDOW
        return cpu, wall

    runs = {name: (lambda n, name=name: trial(name, n)) for name in state}
    runs["placement: repo"], runs["placement: bare"] = place_repo, place_bare
    for way in ways:
        runs[f"window: {way}"] = lambda n, way=way: transfer(way)
    for run in runs.values():
        run(10)
    print(
        f"step_host_cost: 1 device, MNIST MLP, batch 256, fp32, {args.trials} interleaved trials of {args.steps} "
        f"calls, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    results: dict[str, list] = {name: [] for name in runs}
    names = list(runs)
    for i in range(args.trials):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            results[name].append(runs[name](args.steps))
    for name, rs in results.items():
        cpu = [r[0] * 1e6 for r in rs]
        if name.startswith("window"):
            wall = [r[1] * 1e6 for r in rs]
            print(
                f"  {name:<22} per {WINDOW}-step window of metrics to the host: main-thread CPU median "
                f"{statistics.median(cpu):.0f} us, min {min(cpu):.0f} us; wall median {statistics.median(wall):.0f} "
                f"us, min {min(wall):.0f} us"
            )
            continue
        line = f"  {name:<22} main-thread CPU per call: median {statistics.median(cpu):.0f} us, min {min(cpu):.0f} us"
        if not name.startswith("placement"):
            wall = [r[1] * 1e3 for r in rs]
            line += f"; wall per step: median {statistics.median(wall):.3f} ms, min {min(wall):.3f} ms"
        print(line)
    window = window_of_metrics()
    # every leaf's dtype and bytes (bitwise, not float equality)
    seen = {way: [{k: (v.dtype, v.tobytes()) for k, v in m.items()} for m in f(window)] for way, f in ways.items()}
    assert all(host == seen["per step"] for host in seen.values()), "the ways gave different metrics"
    print(f"  the {WINDOW} steps' metrics are equal all three ways")
    for name, compiled in (
        ("repo", step_repo),
        ("bare", step_bare.lower(state["bare"][0], state["bare"][1], x, y).compile()),
    ):
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        print(f"  {name:<22} XLA cost analysis: flops {cost['flops']:.4g}, bytes accessed {cost['bytes accessed']:.4g}")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
