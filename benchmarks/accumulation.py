"""Temporary memory of the compiled step vs the number of microbatches K (gradient accumulation).

For K = 1, 2, 4, 8 at the same global batch, prints ``compiled.memory_analysis().temp_size_in_bytes`` per
device for every parallel mode, in bf16 and fp32, and the ratio to K=1. Goal (issue): at global batch 16,384
with the MLP in bf16, K=4 needs at most 0.8 x the K=1 figure.

    python benchmarks/accumulation.py [--devices 8] [--global-batch 16384] [--modes shard_map,jit_sharding]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=16384)
    ap.add_argument("--modes", default="pmap,jit_sharding,shard_map,fsdp")
    ap.add_argument("--ks", default="1,2,4,8")
    args = ap.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)

    from conf.schema import from_dict
    from data.pipeline import SyntheticSource
    from training.build import build, plan

    ks = [int(k) for k in args.ks.split(",")]
    print(
        f"temp bytes per device of the compiled step; MLP 784-256-10, global batch {args.global_batch}, "
        f"{args.devices} devices, platform {jax.devices()[0].platform}"
    )
    print(f"{'mode':<13} {'precision':<9} " + " ".join(f"{'K=' + str(k):>16}" for k in ks))
    for precision, dtype in (("bf16", "bfloat16"), ("fp32", "float32")):
        for mode in args.modes.split(","):
            temps = []
            for k in ks:
                cfg = from_dict(
                    {
                        "parallel": {"name": mode},
                        "mesh": {"devices": args.devices},
                        "precision": {"name": precision, "compute_dtype": dtype},
                        "train": {"global_batch": args.global_batch, "accum_steps": k},
                    }
                )
                exp = build(plan(cfg))
                src = SyntheticSource((28, 28, 1), 10, 60000, args.global_batch, 0)
                batch = src.device_batch(0, exp.mode.batch_layout())
                compiled = exp.steps.train.lower(exp.state, batch).compile()
                temps.append(compiled.memory_analysis().temp_size_in_bytes)
            cells = [f"{t / 2**20:8.2f} MiB {t / temps[0]:4.2f}" for t in temps]
            print(f"{mode:<13} {precision:<9} " + " ".join(f"{c:>16}" for c in cells))
    print("each cell: temp MiB per device, ratio to K=1")


if __name__ == "__main__":
    main()
