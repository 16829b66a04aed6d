"""A bare JAX training script: the reference that ``train.py``'s whole-process and steady-state cost is compared to.

It trains what ``python train.py`` trains by default, the way a short hand-written script would: the
784-256-10 tanh MLP (weights ~ N(0, 0.01^2), zero biases) as plain ``jnp`` code, ``optax.adam(1e-3)``,
global batch 256, 10 epochs of MNIST in the order of the repository's data pipeline (one permutation per
epoch drawn from ``default_rng([seed, epoch])``, the last partial batch dropped), params replicated and the
batch split over the devices with ``jax.jit`` shardings, master weights float32 and the matmuls in
``--precision``, then one evaluation over the whole test split. No config system, W&B, checkpoints, metric
files or progress bar: the loss is read back once per epoch.

With more than one device at most 2 steps are kept in flight (on the CPU backend, queueing many steps of
simulated-device collectives aborts the process); with one device nothing bounds the dispatch.

The data are the decoded arrays that the repository caches (``<cache>/mnist-3.0.1-{train,test}.npz``, written
by its first run), so both read the same bytes the same cheap way; ``--data`` points elsewhere.

    python benchmarks/bare_train.py [--devices 8] [--precision bf16] [--epochs 10] [--timings out.json]

``--on-device``: the training split is placed on the devices once (replicated, images as rows of 784 bytes) and
each step's jitted function takes the batch's 256 indices and gathers its rows itself, as a hand-written script
keeping the data on the chip would (the comparison for ``train.py``'s ``data.on_device``, the default on a GPU or
TPU; ``benchmarks/overhead.py --bare-on-device``). The same batches, so the same losses.

``--compilation-cache DIR``: JAX's persistent compilation cache, as ``train.py`` has one by default (a bare script
compiles every run; ``benchmarks/overhead.py --bare-cache`` compares with both warm).

``--timings``: writes seconds since the script started at each phase (imports, data, first step, each epoch,
train, eval, end), the start as ``t0_epoch_s``, ``steady_examples_per_s`` (epochs 2..N) and
``window_examples_per_s_median`` to a JSON file, for ``benchmarks/overhead.py``.
The windows are what ``train.py`` measures for ``perf/examples_per_s``: ``--window`` steps (its
``train.log_every``, 50) each ending with ``block_until_ready``, the first one (compilation) dropped, the median
of the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

T0 = time.time()


def default_data_dir() -> str:
    """The repository's default ``data.cache_dir`` (``$XDG_CACHE_HOME`` or ``~/.cache``, then ``dp_scaling``)."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dp_scaling")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=default_data_dir(), help="folder of mnist-3.0.1-{train,test}.npz")
    ap.add_argument("--timings", default=None, help="write phase times (s since start) to this JSON file")
    ap.add_argument("--window", type=int, default=50, help="steps per throughput window (train.py's train.log_every)")
    ap.add_argument("--compilation-cache", default=None, help="JAX's persistent compilation cache folder (off)")
    ap.add_argument("--on-device", action="store_true", help="the training split on the devices, gathered in the step")
    args = ap.parse_args()
    marks: dict[str, float] = {}

    def mark(name: str) -> None:
        marks[name] = time.time() - T0

    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    if args.compilation_cache:  # every program cached (JAX's 1 s threshold would skip these CPU compilations)
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mark("imports")
    with np.load(os.path.join(args.data, "mnist-3.0.1-train.npz")) as f:
        x_train, y_train = f["images"], f["labels"]
    with np.load(os.path.join(args.data, "mnist-3.0.1-test.npz")) as f:
        x_test, y_test = f["images"], f["labels"]
    mark("data")

    dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[args.precision]
    mesh = Mesh(np.array(jax.devices()[: args.devices]), ("data",))
    repl, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    k1, k2 = jax.random.split(jax.random.key(args.seed))
    params = {
        "w1": 0.01 * jax.random.normal(k1, (784, 256)),
        "b1": jnp.zeros(256),
        "w2": 0.01 * jax.random.normal(k2, (256, 10)),
        "b2": jnp.zeros(10),
    }
    tx = optax.adam(1e-3)
    params = jax.device_put(params, repl)
    opt_state = jax.device_put(tx.init(params), repl)

    def logits_fn(params, x):
        c = jax.tree.map(lambda a: a.astype(dtype), params)
        x = (x.astype(jnp.float32) / 255.0).reshape(x.shape[0], -1).astype(dtype)
        return (jnp.tanh(x @ c["w1"] + c["b1"]) @ c["w2"] + c["b2"]).astype(jnp.float32)

    def loss_fn(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits_fn(params, x), y).mean()

    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def eval_step(params, x, y):
        return (jnp.argmax(logits_fn(params, x), -1) == y).sum()

    step = jax.jit(
        train_step, in_shardings=(repl, repl, split, split), out_shardings=(repl, repl, repl), donate_argnums=(0, 1)
    )
    evaluate = jax.jit(eval_step, in_shardings=(repl, split, split), out_shardings=repl)
    if args.on_device:  # the split on the devices; each step sends its indices and gathers the rows itself
        x_all, y_all = jax.device_put((x_train.reshape(len(x_train), -1), y_train), repl)

        def indexed_step(params, opt_state, x_all, y_all, idx):
            return train_step(params, opt_state, x_all[idx], y_all[idx])

        step_on_device = jax.jit(
            indexed_step,
            in_shardings=(repl, repl, repl, repl, split),
            out_shardings=(repl, repl, repl),
            donate_argnums=(0, 1),
        )
    steps_per_epoch = len(y_train) // args.batch
    bound = 2 if args.devices > 1 else None
    in_flight: list = []
    first = True
    windows_s: list[float] = []  # wall time of each window of --window steps, ending with block_until_ready
    t_window, done = time.perf_counter(), 0
    for epoch in range(args.epochs):
        perm = np.random.default_rng([args.seed, epoch]).permutation(len(y_train))
        for i in range(steps_per_epoch):
            idx = perm[i * args.batch : (i + 1) * args.batch]
            if args.on_device:
                idx_d = jax.device_put(idx.astype(np.int32), split)
                params, opt_state, loss = step_on_device(params, opt_state, x_all, y_all, idx_d)
            else:
                x, y = jax.device_put((x_train[idx], y_train[idx]), split)
                params, opt_state, loss = step(params, opt_state, x, y)
            if first:
                mark("first_step")
                first = False
            if bound:
                in_flight.append(loss)
                if len(in_flight) > bound:
                    in_flight.pop(0).block_until_ready()
            done += 1
            if done % args.window == 0:
                loss.block_until_ready()
                now = time.perf_counter()
                windows_s.append(now - t_window)
                t_window = now
        print(f"epoch {epoch + 1}: loss {float(loss):.4f}", flush=True)  # float(): waits for the epoch
        mark(f"epoch_{epoch + 1}")
    jax.block_until_ready(params)
    mark("train")
    eval_batch = 1000
    correct = sum(
        int(evaluate(params, *jax.device_put((x_test[i : i + eval_batch], y_test[i : i + eval_batch]), split)))
        for i in range(0, len(y_test), eval_batch)
    )
    print(f"eval/accuracy={correct / len(y_test):.4f}", flush=True)
    mark("eval")
    if args.timings:
        mark("end")
        if args.epochs > 1:  # epochs 2..N: no compilation, one host sync per epoch
            marks["steady_examples_per_s"] = (
                (args.epochs - 1) * steps_per_epoch * args.batch / (marks[f"epoch_{args.epochs}"] - marks["epoch_1"])
            )
        if len(windows_s) > 1:  # as train.py's perf/examples_per_s: median of windows, the first one dropped
            marks["window_examples_per_s_median"] = statistics.median(
                args.window * args.batch / w for w in windows_s[1:]
            )
        marks["t0_epoch_s"] = T0
        with open(args.timings, "w") as f:
            json.dump(marks, f)


if __name__ == "__main__":
    sys.exit(main())
