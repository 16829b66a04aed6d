"""Peak memory per device of the compiled train step: FSDP vs replicated data parallelism (jit_sharding).

For 1, 2, 4 and 8 devices, prints ``memory_analysis()`` of the compiled step per device: arguments (the state
and the batch) + temporaries (activations, gathered weights, gradients) = the peak, and FSDP's ratio to
jit_sharding. Default: a ViT wide enough that the parameters dominate (width 512, depth 8: 25.3M params),
global batch 16 examples at every device count, Adam (params + 2 moments = 3 x 4 B per param). ``--model gpt``:
the GPT (``model=gpt``, byte vocabulary 256, context 128, learned positions, tied embeddings) at the same width
and depth (25,416,704 params), 8 heads, global batch 16 windows of 128 random tokens.

    python benchmarks/fsdp_memory.py [--model vit|gpt] [--width 512] [--depth 8] [--global-batch 16] [--precision fp32]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def step_memory(
    mode: str,
    devices: int,
    *,
    width: int,
    depth: int,
    global_batch: int,
    precision: str = "fp32",
    accum_steps: int = 1,
    model: str = "vit",
) -> dict[str, int]:
    """``{"argument_bytes", "temp_bytes", "peak_bytes"}`` (bytes, ints) per device of the compiled train step of
    a ViT (``model=vit``, MNIST-shaped synthetic data) or a GPT (``model=gpt``, context 128, vocabulary 256,
    windows of random byte tokens) under ``mode`` on the first ``devices`` devices, from the compiled step's
    ``memory_analysis()`` (``measure.compiled.compiled_peak_bytes``)."""
    import numpy as np

    from conf.schema import from_dict
    from data.pipeline import SyntheticSource
    from data.text import WindowSource
    from measure.compiled import compiled_peak_bytes
    from training.build import build, plan

    dtype = {"fp32": "float32", "bf16": "bfloat16"}[precision]
    model_cfg = {"name": model, "width": width, "depth": depth, "heads": 8}
    if model == "gpt":
        model_cfg.update(size="tiny", context=128)
    cfg = from_dict(
        {
            "parallel": {"name": mode},
            "mesh": {"devices": devices},
            "model": model_cfg,
            "data": {"name": "synthetic"},
            "precision": {"name": precision, "compute_dtype": dtype},
            "train": {"global_batch": global_batch, "accum_steps": accum_steps},
        }
    )
    p = plan(cfg)
    exp = build(p)
    layout = exp.mode.batch_layout()
    if model == "gpt":
        tokens = np.random.default_rng(0).integers(0, 256, size=100_000).astype(np.int32)
        local = WindowSource(tokens, 128, global_batch, 0).local_batch(0, layout.local_rows(global_batch))
        batch = layout.place(local, global_batch)
    else:
        batch = SyntheticSource((28, 28, 1), 10, 60000, global_batch, 0).device_batch(0, layout)
    compiled = exp.steps.train.lower(exp.state, batch).compile()
    return compiled_peak_bytes(compiled)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="vit", choices=["vit", "gpt"])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--devices", default="1,2,4,8")
    args = ap.parse_args()

    import jax

    counts = [int(n) for n in args.devices.split(",")]
    jax.config.update("jax_num_cpu_devices", max(counts))
    print(
        f"peak bytes per device of the compiled step (arguments + temporaries), {args.model} width {args.width} depth "
        f"{args.depth}, global batch {args.global_batch}, {args.precision}, Adam, platform {jax.devices()[0].platform}"
    )
    print(f"{'devices':>7} {'jit_sharding MiB':>17} {'fsdp MiB':>9} {'(args + temp)':>22} {'fsdp / jit':>10}")
    for n in counts:
        kw = dict(width=args.width, depth=args.depth, global_batch=args.global_batch)
        kw.update(precision=args.precision, model=args.model)
        jit = step_memory("jit_sharding", n, **kw)
        fsdp = step_memory("fsdp", n, **kw)
        parts = f"{fsdp['argument_bytes'] / 2**20:.1f} + {fsdp['temp_bytes'] / 2**20:.1f}"
        print(
            f"{n:>7} {jit['peak_bytes'] / 2**20:>17.1f} {fsdp['peak_bytes'] / 2**20:>9.1f} {parts:>22} "
            f"{fsdp['peak_bytes'] / jit['peak_bytes']:>10.3f}"
        )


if __name__ == "__main__":
    main()
