"""What dropping the attention probabilities costs: the train step of ``+experiment=nanogpt_char``'s model.

In one process, the repository's compiled train step (``training.build``) of the GPT 6 x 384, 6 heads, context
256, bf16, AdamW, dropout 0.2 on one device, with ``model.attention_dropout=0`` (dropout at the residual sites
only: ``jax.nn.dot_product_attention``) against ``model.attention_dropout`` null (0.2 on the probabilities too:
the attention written out, ``models.attention.dropout_attention``), in ``--rounds`` interleaved rounds of
``--steps`` steps each on one pre-placed batch of ``--batch`` windows; the first round is dropped (warm-up) and the
median step time of the rest is printed with every round's, and their ratio. Also the compiled steps' temporary
memory (XLA's memory analysis). On a CPU the ratio says what the extra work costs there; a TPU's differs.

    python benchmarks/attention_dropout.py [--batch 8] [--rounds 7] [--steps 3] [--devices 1]
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
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    import numpy as np

    from conf.schema import from_dict
    from training.build import build, plan

    def make(attention_dropout):
        model = {"name": "gpt", "depth": 6, "width": 384, "heads": 6, "context": args.context, "dropout": 0.2}
        if attention_dropout is not None:
            model["attention_dropout"] = attention_dropout
        cfg = from_dict(
            {
                "model": model,
                "data": {"name": "synthetic"},
                "precision": {"name": "bf16", "compute_dtype": "bfloat16"},
                "optim": {"weight_decay": 0.1},
                "mesh": {"devices": 1},
                "train": {"global_batch": args.batch},
            }
        )
        exp = build(plan(cfg))
        x = np.random.default_rng(0).integers(0, 256, (args.batch, args.context)).astype(np.int32)
        batch = exp.mode.batch_layout().place(
            {"image": x, "label": x, "index": np.arange(args.batch, dtype=np.int32)}, args.batch
        )
        compiled = exp.steps.train.lower(exp.state, batch).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        state, metrics = compiled(exp.state, batch)
        jax.block_until_ready(metrics)
        return {"step": compiled, "state": state, "batch": batch, "temp": temp, "times": []}

    cases = {"attention_dropout=0 (residual sites only)": make(0.0), "attention_dropout=null (0.2)": make(None)}
    for _ in range(args.rounds):
        for case in cases.values():
            t0 = time.perf_counter()
            state = case["state"]
            for _ in range(args.steps):
                state, metrics = case["step"](state, case["batch"])
            jax.block_until_ready(metrics)
            case["times"].append((time.perf_counter() - t0) / args.steps)
            case["state"] = state
    print(
        f"GPT 6 x 384, 6 heads, context {args.context}, batch {args.batch}, bf16, dropout 0.2, 1 "
        f"{jax.devices()[0].platform} device; {args.rounds} interleaved rounds of {args.steps} steps, the first dropped"
    )
    medians = []
    for name, case in cases.items():
        median = statistics.median(case["times"][1:])
        medians.append(median)
        rounds = ", ".join(f"{t:.3f}" for t in case["times"])
        print(f"{name}: median step {median:.3f} s; temporaries {case['temp'] / 2**20:.0f} MiB; rounds [{rounds}]")
    print(f"step time with / without attention dropout: {medians[1] / medians[0]:.2f}")


if __name__ == "__main__":
    main()
