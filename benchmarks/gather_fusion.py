"""What one program per step saves with the training split on the devices (``data.on_device``).

In one process, 1 device, the main job's MNIST MLP (batch 256, fp32, Adam), three ways to run a step whose batch
is gathered on the device from the split kept there:

- ``bare``: ``benchmarks/bare_train.py --on-device``: the batch's 256 indices sent each step (``device_put``)
  and one jitted step that gathers its rows (one transfer + one dispatch per step);
- ``two programs``: ``train.py``'s path before the gather went into the step (pmap's still):
  ``DeviceSource.gather_program`` (the order and position already on the device, the gather returns the next
  position), then the repository's AOT-compiled train step (two dispatches per step);
- ``fused``: ``train.py``'s path now: the same gather inside the same train step, ONE program ``(state, (split,
  order)) -> (state, metrics)`` that finds its row from the state's step counter (``training.build.build(...,
  feed_for=DeviceSource.feed)``; one dispatch per step, nothing sent).

``--trials`` interleaved trials (order rotating) of ``--steps`` steps each, after a warm-up. Printed per way: wall
time per step (dispatch every step, then wait for the last: median and min over the trials) and the main
thread's CPU time per step (``time.thread_time``), and the losses after the same steps of each repository way
(equal: the fused program computes what the two programs do).

    python benchmarks/gather_fusion.py [--trials 9] [--steps 500]

Needs MNIST prepared (``TFDS_DATA_DIR``) or its decoded cache.
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
    ap.add_argument("--trials", type=int, default=9)
    ap.add_argument("--steps", type=int, default=500)
    args = ap.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from conf.schema import from_dict
    from data.pipeline import DeviceSource, _replicate, epoch_permutation
    from data.sources import load_tfds_split
    from training.build import build, plan
    from training.prepare import batches_need_index

    cfg = from_dict({"mesh": {"devices": 1}, "train": {"global_batch": 256}})
    train = load_tfds_split("mnist", "train", os.environ.get("TFDS_DATA_DIR"), cfg.data.cache_dir)
    exp = build(plan(cfg))
    layout = exp.mode.batch_layout()
    source = DeviceSource(train, 256, 0, with_index=batches_need_index(cfg))
    spe = source.steps_per_epoch
    repl, split_sh = layout.replicated, NamedSharding(exp.mode.mesh, P(("data", "fsdp")))
    split = (_replicate(train.images.reshape(len(train.images), -1), repl), _replicate(train.labels, repl))
    perm = epoch_permutation(0, 0, len(train))[: spe * 256]
    order = _replicate(perm.astype(np.int32).reshape(spe, 256), repl)
    gather = source.gather_program(layout)
    batch0, _ = gather(split, order, _replicate(np.asarray(0, np.int32), repl))
    step_repo = exp.steps.train.lower(exp.state, batch0).compile()
    fused = build(plan(cfg), feed_for=source.feed)  # train.py's step with data.on_device: the gather inside
    split_order = (split, order)  # what the loop hands the fused step each step of an epoch
    step_fused = fused.steps.train.lower(fused.state, split_order).compile()

    tx = optax.adam(1e-3)
    k1, k2 = jax.random.split(jax.random.key(0))
    params = jax.device_put(
        {
            "w1": 0.01 * jax.random.normal(k1, (784, 256)),
            "b1": jnp.zeros(256),
            "w2": 0.01 * jax.random.normal(k2, (256, 10)),
            "b2": jnp.zeros(10),
        },
        repl,
    )

    def bare_step(params, opt_state, x_all, y_all, idx):
        def loss_fn(p):
            x = (x_all[idx].astype(jnp.float32) / 255.0).reshape(idx.shape[0], -1)
            logits = jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
            return optax.softmax_cross_entropy_with_integer_labels(logits, y_all[idx]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step_bare = jax.jit(
        bare_step,
        in_shardings=(repl, repl, repl, repl, split_sh),
        out_shardings=(repl, repl, repl),
        donate_argnums=(0, 1),
    )
    state = {
        "bare": [params, tx.init(params), 0],
        "two programs": [exp.state, None, 0],
        "fused": [fused.state, None, 0],
    }

    def run(name: str, n: int) -> tuple[float, float]:
        s = state[name]
        t0, c0 = time.perf_counter(), time.thread_time()
        if name == "bare":
            p, o, at = s
            for i in range(at, at + n):
                idx = jax.device_put(perm[(i % spe) * 256 : (i % spe + 1) * 256].astype(np.int32), split_sh)
                p, o, last = step_bare(p, o, *split, idx)
            s[:] = [p, o, at + n]
        else:
            st, at = s[0], s[2]
            pos = _replicate(np.asarray(at % spe, np.int32), repl)
            for i in range(n):
                if name == "fused":  # the step finds its row from its own step counter
                    st, last = step_fused(st, split_order)
                else:
                    if (at + i) % spe == 0 and i:
                        pos = _replicate(np.asarray(0, np.int32), repl)
                    batch, pos = gather(split, order, pos)
                    st, last = step_repo(st, batch)
            s[:] = [st, last, at + n]
        cpu = time.thread_time() - c0
        jax.block_until_ready(last)
        return (time.perf_counter() - t0) / n, cpu / n

    for name in state:
        run(name, 20)
    print(
        f"gather_fusion: {jax.devices()[0].device_kind}, 1 device, MNIST MLP, batch 256, fp32, {args.trials} "
        f"interleaved trials of {args.steps} steps, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    names = list(state)
    results: dict[str, list] = {name: [] for name in names}
    for t in range(args.trials):
        for name in names[t % len(names) :] + names[: t % len(names)]:
            results[name].append(run(name, args.steps))
    bare_wall = statistics.median(r[0] for r in results["bare"])
    for name, rs in results.items():
        wall, cpu = [r[0] * 1e6 for r in rs], [r[1] * 1e6 for r in rs]
        print(
            f"  {name:<13} wall per step: median {statistics.median(wall):7.1f} us, min {min(wall):7.1f} us; "
            f"main-thread CPU per step: median {statistics.median(cpu):6.1f} us; "
            f"steps/s vs bare: {bare_wall / statistics.median(r[0] for r in rs):.3f}"
        )
    same = state["two programs"][2] == state["fused"][2]
    losses = {n: float(state[n][1]["train/loss"]) for n in ("two programs", "fused")}
    print(f"  after {state['fused'][2]} steps each (same steps: {same}): train/loss {losses}")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
