"""Is the input pipeline a bottleneck? examples/s with MNIST from the host / examples/s with on-device data.

A: ``data=mnist``: the repository's host pipeline: the decoded split in host memory (``data.sources``
   cache), one global permutation per epoch, this process's rows gathered and placed on the devices
   (``BatchLayout.place``) in the background prefetch thread (``data.prefetch`` batches ahead).
B: ``data=synthetic``: the same-shaped batches generated ON the devices (``SyntheticSource``), so the
   host never touches the data.

Both feed the SAME compiled training step (same model, mesh, precision, global batch: the batches have the
same shapes, dtypes and sharding), dispatched like ``training.run`` (at most ``train.max_in_flight`` = 2
steps in flight). They run in one process, interleaved A B A B ... over ``--pairs`` pairs of ``--steps``
steps each; the script prints each pair's ratio (examples/s of A / examples/s of B) and the median.
Goal for the MLP: median >= 0.98. CPU timings are noisy when the machine is shared: the load average is
printed before and after.

    TFDS_DATA_DIR=../shared/tensorflow_datasets python benchmarks/input_pipeline.py \\
        [--devices 8] [--pairs 7] [--steps 200] [--model mlp] [--width 32] [--precision fp32|bf16] \\
        [--parallel jit_sharding] [--batch 256] [--augment]
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
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--model", default="mlp", choices=["mlp", "cnn", "resnet", "vit"])
    ap.add_argument("--width", type=int, default=None, help="model.width (cnn/resnet/vit)")
    ap.add_argument("--parallel", default="jit_sharding", choices=["pmap", "jit_sharding", "shard_map", "fsdp"])
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--augment", action="store_true", help="data.augment=true (random crop, both sides)")
    args = ap.parse_args()
    if args.pairs < 1 or args.steps < 1:
        ap.error(f"--pairs={args.pairs} and --steps={args.steps} must be positive")

    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import collections

    from conf.schema import from_dict
    from data.pipeline import SyntheticSource, TrainSource, train_batches
    from data.sources import load_tfds_split, resolve_data_dir
    from training.build import build, plan
    from training.build import batches_need_index

    data_dir = resolve_data_dir(None)
    if not data_dir or not os.path.isdir(os.path.join(data_dir, "mnist")):
        sys.exit(
            "error: MNIST not found; set TFDS_DATA_DIR to the folder holding TFDS's mnist/ "
            "(e.g. ../shared/tensorflow_datasets)"
        )
    cfg = from_dict(
        {
            "mesh": {"devices": args.devices},
            "train": {"global_batch": args.batch},
            "parallel": {"name": args.parallel},
            "model": {"name": args.model, **({"width": args.width} if args.width else {})},
            "data": {"augment": args.augment},
            "precision": {
                "name": args.precision,
                "compute_dtype": {"fp32": "float32", "bf16": "bfloat16"}[args.precision],
            },
        }
    )
    train = load_tfds_split("mnist", "train", data_dir, cfg.data.cache_dir)

    p = plan(cfg)
    exp = build(p)
    layout = exp.mode.batch_layout()
    with_index = batches_need_index(cfg)  # as train.py: batches carry `index` only when something needs it
    mnist = TrainSource(train, p.global_batch, cfg.train.seed, with_index=with_index)
    synthetic = SyntheticSource(
        tuple(train.images.shape[1:]),
        cfg.data.num_classes,
        len(train),
        p.global_batch,
        cfg.train.seed,
        with_index=with_index,
    )
    first = next(train_batches(mnist, layout, 0, 1, 1))
    step = exp.steps.train.lower(exp.state, first).compile()
    carry = {"state": exp.state}

    def trial(source, start: int, n: int) -> float:
        """Seconds per step of ``n`` steps from ``start`` (the pipeline's batches, the bounded dispatch)."""
        batches = train_batches(source, layout, start, start + n, cfg.data.prefetch)
        state, in_flight = carry["state"], collections.deque()
        t0 = time.perf_counter()
        for batch in batches:
            state, metrics = step(state, batch)
            in_flight.append(metrics)
            if len(in_flight) > cfg.train.max_in_flight:
                jax.block_until_ready(in_flight.popleft())
        jax.block_until_ready(state)
        dt = time.perf_counter() - t0
        carry["state"] = state
        return dt / n

    trial(mnist, 0, 20), trial(synthetic, 0, 20)  # warm up: the synthetic generator compiles here
    load_before = os.getloadavg()
    print(
        f"input_pipeline: model={args.model}{f' width={args.width}' if args.width else ''}, "
        f"parallel={args.parallel}, {args.devices} devices, global batch {p.global_batch}, {args.precision}, "
        f"augment={args.augment}, batch arrays {sorted(first)}, {args.steps} steps per trial, "
        f"platform {jax.devices()[0].platform}, "
        f"{os.cpu_count()} CPUs, load average {load_before[0]:.1f}"
    )
    ratios = []
    for i in range(args.pairs):
        start = 20 + i * args.steps
        a = trial(mnist, start, args.steps)
        b = trial(synthetic, start, args.steps)
        ratios.append(b / a)  # examples/s ratio = (B/s_a) / (B/s_b) = s_b / s_a
        print(
            f"pair {i}: mnist {p.global_batch / a:9.0f} ex/s ({a * 1e3:.3f} ms/step)  "
            f"synthetic {p.global_batch / b:9.0f} ex/s ({b * 1e3:.3f} ms/step)  ratio {b / a:.3f}"
        )
    med = statistics.median(ratios)
    load_after = os.getloadavg()
    print(
        f"median ratio (mnist ex/s / synthetic ex/s): {med:.3f}  (goal >= 0.98: "
        f"{'met' if med >= 0.98 else 'NOT met'}); load average {load_before[0]:.1f} -> {load_after[0]:.1f}"
    )


if __name__ == "__main__":
    main()
