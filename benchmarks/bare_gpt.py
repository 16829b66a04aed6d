"""A bare JAX language-model script: the yardstick ``python train.py model=gpt data=tiny_shakespeare`` is compared to.

It trains what ``train.py model=gpt size=tiny data=tiny_shakespeare`` trains, the way a short hand-written
script would, with no import from the repository: the same GPT-2-style decoder (models/gpt.py: token + learned
position embeddings, ``depth`` pre-LayerNorm blocks with causal multi-head attention through
``jax.nn.dot_product_attention`` and a GELU MLP of 4x the width, a final LayerNorm, the output layer tied to
the token embedding) as plain ``jnp`` functions of a dict of arrays, with the same initial distributions
(weights N(0, 0.02^2), the two residual output projections N(0, (0.02 / sqrt(2 depth))^2), position table
N(0, 0.01^2), biases 0, norm scales 1; the draws themselves differ from the repository's), ``optax.adam(1e-3)``,
the same global batch and the same windows (byte tokens of the first 90% of the characters of Tiny Shakespeare,
step ``s`` taking ``B`` windows of ``T + 1`` bytes at offsets drawn from ``numpy.random.default_rng([seed, s])``),
params replicated and the batch split over the devices with ``jax.jit`` shardings, float32 master weights and the
forward/backward pass in ``--precision``; then one evaluation over every non-overlapping window of the
validation split (the next 5% of the characters), padded to a multiple of the device count. No config system,
W&B, checkpoints, metric files or progress bar: the loss is read back at each window's end.

``tests/test_bare_gpt.py`` checks that it computes what the repository computes: the same parameter count and
shapes, and, from the repository's initial parameters, the same loss and the same parameters after 3 Adam
steps on the repository's batches (float32, 1 device: losses to 1e-5 relative, parameters to 1e-5 relative or
2e-5 absolute, Adam steps being 1e-3).

With more than one device at most 2 steps are kept in flight (on the CPU backend, queueing many steps of
simulated-device collectives aborts the process); with one device nothing bounds the dispatch.

    python benchmarks/bare_gpt.py [--devices 8] [--precision bf16] [--steps 30] [--batch 8] [--timings out.json]

``--compilation-cache DIR``: JAX's persistent compilation cache, as ``train.py`` has one by default (a bare script
compiles every run; ``benchmarks/overhead.py --bare-cache`` compares with both warm).

``--timings``: as ``benchmarks/bare_train.py``: seconds since the script started at each phase (imports, data,
first step, train, eval, end), ``window_examples_per_s_median`` (windows of ``--window`` steps, i.e.
``train.log_every``, each ending with ``block_until_ready``, the first one dropped, the median of the rest) and
``window_tokens_per_s_median`` (x the context) to a JSON file, for ``benchmarks/overhead.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

T0 = time.time()

# size tiny (models/gpt.py SIZES): vocabulary (bytes), context, width, depth, heads; MLP 4x the width
VOCAB, CONTEXT, WIDTH, DEPTH, HEADS, MLP_RATIO = 256, 128, 128, 4, 4, 4
EPS = 1e-6  # LayerNorm epsilon (models/gpt.py)


def default_corpus() -> str:
    """``../shared/data/tiny_shakespeare/input.txt`` beside the repository (where ``data/text.py`` looks first)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(os.path.dirname(os.path.dirname(here)), "shared", "data", "tiny_shakespeare", "input.txt")


def splits(path: str):
    """(train, validation) int32 byte tokens: the first ``int(0.9 n)`` characters, then the next
    ``int(0.5 (n - int(0.9 n)))`` (TFDS ``tiny_shakespeare``'s cut)."""
    import numpy as np

    with open(path, encoding="utf-8") as f:
        text = f.read()
    i = int(len(text) * 0.9)
    j = i + int((len(text) - i) * 0.5)
    tok = lambda s: np.frombuffer(s.encode("utf-8"), np.uint8).astype(np.int32)
    return tok(text[:i]), tok(text[i:j])


def init_params(key, depth: int = DEPTH, width: int = WIDTH, vocab: int = VOCAB, context: int = CONTEXT):
    """The GPT's parameters, float32, in the layout of the repository's ``nnx.to_pure_dict`` (blocks a list)."""
    import jax
    import jax.numpy as jnp

    d, r = width, MLP_RATIO
    std, out_std = 0.02, 0.02 / math.sqrt(2 * max(1, depth))
    keys = iter(jax.random.split(key, 2 + 4 * depth))
    normal = lambda s, shape: s * jax.random.normal(next(keys), shape, jnp.float32)
    norm = lambda: {"scale": jnp.ones(d), "bias": jnp.zeros(d)}
    linear = lambda s, n_in, n_out: {"kernel": normal(s, (n_in, n_out)), "bias": jnp.zeros(n_out)}
    return {
        "embed": {"embedding": normal(std, (vocab, d))},
        "pos_embed": normal(0.01, (context, d)),
        "blocks": [
            {
                "norm1": norm(),
                "qkv": linear(std, d, 3 * d),
                "proj": linear(out_std, d, d),
                "norm2": norm(),
                "fc1": linear(std, d, r * d),
                "fc2": linear(out_std, r * d, d),
            }
            for _ in range(depth)
        ],
        "norm": norm(),
    }


def layer_norm(p, x):
    """LayerNorm over the last axis, statistics in float32 (as flax: var = E[x^2] - E[x]^2, clipped at 0)."""
    import jax
    import jax.numpy as jnp

    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.maximum(0.0, (x32 * x32).mean(-1, keepdims=True) - mean * mean)
    y = (x32 - mean) * (jax.lax.rsqrt(var + EPS) * p["scale"]) + p["bias"]
    return y.astype(x.dtype)


def logits_fn(params, tokens, dtype, heads: int = HEADS):
    """float32 logits ``[B, T, vocab]`` of int32 tokens ``[B, T]``, computed in ``dtype``."""
    import jax
    import jax.numpy as jnp

    p = jax.tree.map(lambda a: a.astype(dtype), params)
    b, t = tokens.shape

    def linear(q, x):  # x @ kernel + bias, contracting x's last axis (as flax's Linear writes it)
        return jax.lax.dot_general(x, q["kernel"], (((x.ndim - 1,), (0,)), ((), ()))) + q["bias"]

    x = jnp.take(p["embed"]["embedding"], tokens, axis=0) + p["pos_embed"][:t]
    for blk in p["blocks"]:
        d = x.shape[-1]
        qkv = linear(blk["qkv"], layer_norm(blk["norm1"], x)).reshape(b, t, 3, heads, -1)
        a = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True)
        x = x + linear(blk["proj"], a.reshape(b, t, d))
        x = x + linear(blk["fc2"], jax.nn.gelu(linear(blk["fc1"], layer_norm(blk["norm2"], x))))
    x = layer_norm(p["norm"], x)
    return jnp.dot(x, p["embed"]["embedding"].T).astype(jnp.float32)


def loss_fn(params, x, y, dtype):
    """Mean next-token cross-entropy (nats per token) over the batch, float32."""
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits_fn(params, x, dtype), y).mean()


def make_train_step(tx, dtype):
    """``(params, opt_state, x, y) -> (params, opt_state, loss)``: one Adam step on the mean loss (not jitted)."""
    import jax
    import optax

    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y, dtype)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def batch_of(tokens, seed: int, step: int, batch: int, context: int = CONTEXT):
    """(inputs, targets) int32 ``[batch, context]``: windows of ``context + 1`` tokens at offsets drawn from
    ``default_rng([seed, step])`` (the repository's ``data.text.WindowSource``)."""
    import numpy as np

    starts = np.random.default_rng([seed, step]).integers(0, len(tokens) - context, size=batch)
    w = tokens[starts[:, None] + np.arange(context + 1)]
    return w[:, :-1], w[:, 1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8, help="global batch (windows of 128 tokens)")
    ap.add_argument("--eval-batch", type=int, default=1000, help="windows per evaluation batch (train.eval_batch)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=default_corpus(), help="Tiny Shakespeare's input.txt")
    ap.add_argument("--timings", default=None, help="write phase times (s since start) to this JSON file")
    ap.add_argument("--window", type=int, default=5, help="steps per throughput window (train.log_every)")
    ap.add_argument("--compilation-cache", default=None, help="JAX's persistent compilation cache folder (off)")
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
    train, valid = splits(args.data)
    mark("data")

    dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[args.precision]
    mesh = Mesh(np.array(jax.devices()[: args.devices]), ("data",))
    repl, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    tx = optax.adam(1e-3)
    params = jax.device_put(init_params(jax.random.key(args.seed)), repl)
    opt_state = jax.device_put(tx.init(params), repl)

    def eval_step(params, x, y, mask):
        per_window = optax.softmax_cross_entropy_with_integer_labels(logits_fn(params, x, dtype), y).mean(-1)
        return (per_window * mask).sum()

    step = jax.jit(
        make_train_step(tx, dtype),
        in_shardings=(repl, repl, split, split),
        out_shardings=(repl, repl, repl),
        donate_argnums=(0, 1),
    )
    evaluate = jax.jit(eval_step, in_shardings=(repl, split, split, split), out_shardings=repl)
    bound = 2 if args.devices > 1 else None
    in_flight: list = []
    windows_s: list[float] = []
    t_window = time.perf_counter()
    for s in range(args.steps):
        x, y = jax.device_put(batch_of(train, args.seed, s, args.batch), split)
        params, opt_state, loss = step(params, opt_state, x, y)
        if s == 0:
            mark("first_step")
        if bound:
            in_flight.append(loss)
            if len(in_flight) > bound:
                in_flight.pop(0).block_until_ready()
        if (s + 1) % args.window == 0:
            loss.block_until_ready()
            now = time.perf_counter()
            windows_s.append(now - t_window)
            t_window = now
            print(f"step {s + 1}: loss {float(loss):.4f}", flush=True)
    jax.block_until_ready(params)
    mark("train")
    # every non-overlapping validation window once, padded to a multiple of the device count and masked
    n = (len(valid) - 1) // CONTEXT
    vx, vy = valid[: n * CONTEXT].reshape(n, CONTEXT), valid[1 : n * CONTEXT + 1].reshape(n, CONTEXT)
    total = 0.0
    for i in range(0, n, args.eval_batch):
        bx, by = vx[i : i + args.eval_batch], vy[i : i + args.eval_batch]
        pad = -len(bx) % args.devices
        mask = np.concatenate([np.ones(len(bx), np.float32), np.zeros(pad, np.float32)])
        bx, by = (np.concatenate([a, np.zeros((pad, CONTEXT), np.int32)]) for a in (bx, by))
        total += float(evaluate(params, *jax.device_put((bx, by, mask), split)))
    print(f"eval/loss={total / n:.4f}", flush=True)
    mark("eval")
    if args.timings:
        mark("end")
        if len(windows_s) > 1:  # as train.py's perf/examples_per_s: median of windows, the first one dropped
            eps = statistics.median(args.window * args.batch / w for w in windows_s[1:])
            marks["window_examples_per_s_median"] = eps
            marks["window_tokens_per_s_median"] = eps * CONTEXT
        marks["final_train_loss"] = float(loss)
        marks["eval_loss"] = total / n
        marks["t0_epoch_s"] = T0
        with open(args.timings, "w") as f:
            json.dump(marks, f)


if __name__ == "__main__":
    sys.exit(main())
