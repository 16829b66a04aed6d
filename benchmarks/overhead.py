"""Steady-state overhead of the repository's training step loop vs a minimal hand-written jit loop.

A: the repository's path: typed config -> ``training.build`` (mode, LocalGrads, Updater, donated state) ->
   the data pipeline (global permutation, per-process slice, ``make_array_from_process_local_data``,
   background prefetch) -> the AOT-compiled step, dispatched as ``train.py``'s loop does, with at most
   ``--repo-bound`` (``train.max_in_flight``, 2) steps in flight (0: unbounded).
B: a minimal loop written by hand: the same 784-256-10 tanh MLP as plain ``jnp`` code, ``optax.adam``,
   ``jax.jit`` with the same shardings (params replicated, batch split over the devices), the same host
   batches put on the devices with ``jax.device_put``; at most 2 steps in flight with several devices (on
   XLA:CPU a long queue of simulated-device collectives aborts the process), unbounded on one device, as a
   bare script would be (``benchmarks/bare_train.py``).

For each setup (``--setups``, default 1 device fp32 and 8 simulated devices bf16; one child process each, as
the device count is fixed per process) both run in one process, interleaved over ``--pairs`` pairs of
``--steps`` steps each, the order alternating (A B, B A, A B, ...) so that a slow drift of the shared machine
does not favour either side. Printed: each pair's examples/s and ratio (A / B), the median and the
interquartile range. Goal: median >= 0.98. On a shared 2-core machine single pairs range over +-15%: use many
short pairs.

    python benchmarks/overhead.py [--setups 1:fp32,8:bf16] [--pairs 21] [--steps 100] [--repo-bound 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setups", default="1:fp32,8:bf16", help="devices:precision, comma-separated")
    ap.add_argument("--devices", type=int, default=None, help="one setup in this process (with --precision)")
    ap.add_argument("--pairs", type=int, default=21)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument(
        "--repo-bound",
        type=int,
        default=None,
        help="A's steps in flight (default: train.max_in_flight of the schema; 0: unbounded)",
    )
    args = ap.parse_args()
    if args.devices is None:  # one child process per setup
        import subprocess

        for item in args.setups.split(","):
            devices, precision = item.split(":")
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                f"--devices={devices}",
                f"--precision={precision}",
                f"--pairs={args.pairs}",
                f"--steps={args.steps}",
                f"--batch={args.batch}",
            ]
            if args.repo_bound is not None:
                cmd.append(f"--repo-bound={args.repo_bound}")
            subprocess.run(cmd, check=True)
        return

    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import collections

    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from conf.schema import from_dict
    from data.pipeline import TrainSource, train_batches
    from data.sources import HostDataset, load_tfds_split
    from training.build import build, plan
    from training.run import batches_need_index

    tfds_dir = os.environ.get("TFDS_DATA_DIR")
    if tfds_dir and os.path.isdir(os.path.join(tfds_dir, "mnist")):
        train = load_tfds_split("mnist", "train", tfds_dir, os.path.expanduser("~/.cache/dp_scaling"))
        data_name = "MNIST"
    else:
        rng = np.random.default_rng(0)
        train = HostDataset(
            rng.integers(0, 256, (60000, 28, 28, 1), dtype=np.uint8), rng.integers(0, 10, 60000).astype(np.int32)
        )
        data_name = "random host data (set TFDS_DATA_DIR for MNIST)"
    dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[args.precision]
    cfg = from_dict(
        {
            "mesh": {"devices": args.devices},
            "train": {"global_batch": args.batch},
            "precision": {"name": args.precision, "compute_dtype": jnp.dtype(dtype).name},
        }
    )

    # ---- A: the repository -------------------------------------------------------------------------
    p = plan(cfg)
    exp = build(p)
    layout = exp.mode.batch_layout()
    source = TrainSource(train, p.global_batch, cfg.train.seed, with_index=batches_need_index(cfg))
    first = next(train_batches(source, layout, 0, 1, 2))
    step_a = exp.steps.train.lower(exp.state, first).compile()
    state_a = {"s": exp.state, "next": 0}
    bound_a = cfg.train.max_in_flight if args.repo_bound is None else args.repo_bound
    bound_b = 2 if args.devices > 1 else 0

    def run_a(n: int) -> float:
        batches = train_batches(source, layout, state_a["next"], state_a["next"] + n, cfg.data.prefetch)
        state, in_flight = state_a["s"], collections.deque()
        t0 = time.perf_counter()
        for batch in batches:
            state, metrics = step_a(state, batch)
            in_flight.append(metrics)
            if bound_a and len(in_flight) > bound_a:
                jax.block_until_ready(in_flight.popleft())
        jax.block_until_ready(state)
        dt = time.perf_counter() - t0
        state_a["s"], state_a["next"] = state, state_a["next"] + n
        return dt / n

    # ---- B: minimal hand-written loop ----------------------------------------------------------------
    mesh = exp.mode.mesh
    repl, data_sh = NamedSharding(mesh, P()), NamedSharding(mesh, P(("data", "fsdp")))
    key = jax.random.key(0)
    k1, k2 = jax.random.split(key)
    params = {
        "w1": 0.01 * jax.random.normal(k1, (784, 256)),
        "b1": jnp.zeros(256),
        "w2": 0.01 * jax.random.normal(k2, (256, 10)),
        "b2": jnp.zeros(10),
    }
    tx = optax.adam(1e-3)
    params = jax.device_put(params, repl)
    opt_state = jax.device_put(tx.init(params), repl)

    def loss_fn(params, x, y):
        c = jax.tree.map(lambda a: a.astype(dtype), params)
        x = (x.astype(jnp.float32) / 255.0).reshape(x.shape[0], -1).astype(dtype)
        logits = (jnp.tanh(x @ c["w1"] + c["b1"]) @ c["w2"] + c["b2"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step_b(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step_b = jax.jit(
        step_b, in_shardings=(repl, repl, data_sh, data_sh), out_shardings=(repl, repl, repl), donate_argnums=(0, 1)
    )
    state_b = {"p": params, "o": opt_state, "next": 0}

    def run_b(n: int) -> float:
        params, opt_state, in_flight = state_b["p"], state_b["o"], collections.deque()
        t0 = time.perf_counter()
        for s in range(state_b["next"], state_b["next"] + n):
            idx = source.global_indices(s)
            x = jax.device_put(train.images[idx], data_sh)
            y = jax.device_put(train.labels[idx], data_sh)
            params, opt_state, loss = step_b(params, opt_state, x, y)
            if bound_b:
                in_flight.append(loss)
                if len(in_flight) > bound_b:
                    jax.block_until_ready(in_flight.popleft())
        jax.block_until_ready(params)
        dt = time.perf_counter() - t0
        state_b.update(p=params, o=opt_state, next=state_b["next"] + n)
        return dt / n

    run_a(20), run_b(20)  # warm up (compile, caches)
    ratios = []
    print(
        f"overhead: {args.devices} device(s), global batch {args.batch}, {args.precision}, {data_name}, "
        f"{args.steps} steps per trial, platform {jax.devices()[0].platform}, steps in flight: repo "
        f"{bound_a or 'unbounded'}, hand-written {bound_b or 'unbounded'}, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    for i in range(args.pairs):
        if i % 2 == 0:
            a, b = run_a(args.steps), run_b(args.steps)
        else:
            b, a = run_b(args.steps), run_a(args.steps)
        ratios.append(b / a)  # examples/s ratio = inverse step-time ratio
        print(
            f"pair {i}: repo {args.batch / a:.0f} examples/s  hand-written {args.batch / b:.0f} examples/s  "
            f"ratio {b / a:.3f}",
            flush=True,
        )
    med = statistics.median(ratios)
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else (med, med, med)
    print(
        f"{args.devices} device(s) {args.precision}: median examples/s ratio (repo / hand-written) {med:.3f}, "
        f"interquartile range {q1:.3f}-{q3:.3f} (goal >= 0.98: {'met' if med >= 0.98 else 'NOT met'})",
        flush=True,
    )


if __name__ == "__main__":
    main()
