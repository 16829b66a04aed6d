"""A bare JAX language-model script: the yardstick ``python train.py model=gpt`` is compared to.

It trains what ``train.py model=gpt data=tiny_shakespeare`` trains, the way a short hand-written script would,
with no import from the repository: the same GPT-2-style decoder (models/gpt.py: token + learned position
embeddings, ``depth`` pre-LayerNorm blocks with causal multi-head attention and a GELU MLP of 4x the width, a
final LayerNorm, the output layer tied to the token embedding) as plain ``jnp`` functions of a dict of arrays,
with the same initial distributions (weights N(0, 0.02^2), the two residual output projections
N(0, (0.02 / sqrt(2 depth))^2), position table N(0, 0.01^2), biases 0, norm scales 1; the draws themselves differ
from the repository's), ``optax.adam(1e-3)``, the same global batch and the same windows (byte tokens of the first
90% of the characters of Tiny Shakespeare, step ``s`` taking ``B`` windows of ``T + 1`` bytes at offsets drawn
from ``numpy.random.default_rng([seed, s])``), params replicated and the batch split over the devices with
``jax.jit`` shardings, float32 master weights and the forward/backward pass in ``--precision``; then one
evaluation over every non-overlapping window of the validation split (the next 5% of the characters), padded to
a multiple of the device count. No config system, W&B, checkpoints, metric files or progress bar: the loss is
read back at each window's end.

Whatever the repository adopts for speed, this script has too, in its own plain code, chosen by flags:
``--attention splash`` (the Pallas splash kernel on TPU, the queries scaled by 1/sqrt(head dim); interpreted off
TPU), ``--loss-chunk N`` (the output layer fused with the cross-entropy, N tokens at a time, the gradient
computed in the forward pass), ``--vocab-multiple M`` (the embedding padded to a multiple of M rows, the padded
logits masked), ``--remat`` (``jax.checkpoint`` of each block), ``--dropout`` with ``--dropout-keys``:
``per_example`` (the repository's scheme: example ``i`` of step ``s`` draws its masks from
``fold_in(fold_in(key(seed), s), i)``, one ``fold_in`` per dropout site, so masks do not depend on the device
count) or ``per_step`` (one key per step and site, the whole batch's mask in one draw); the attention
probabilities are dropped too (``--attention-dropout``, default ``--dropout``: the attention written out, float32
scores and softmax, site 2 of each block's key).

``tests/test_bare_gpt.py`` checks that it computes what the repository computes: the same parameter count and
shapes, and, from the repository's initial parameters, the same loss and the same parameters after 3 Adam
steps on the repository's batches (float32, 1 device), with dropout and the fused loss too.

With more than one device at most 2 steps are kept in flight (on the CPU backend, queueing many steps of
simulated-device collectives aborts the process); with one device nothing bounds the dispatch.

    python benchmarks/bare_gpt.py [--size gpt2_small] [--depth 6 --width 384 --heads 6 --context 256]
        [--devices 8] [--precision bf16] [--steps 30] [--batch 8] [--timings out.json] [--profile DIR]

``--compilation-cache DIR``: JAX's persistent compilation cache, as ``train.py`` has one by default.

``--timings``: seconds since the script started at each phase (imports, data, first step, train, eval, end),
``window_examples_per_s_median`` (windows of ``--window`` steps, i.e. ``train.log_every``, each ending with
``block_until_ready``, the first one dropped, the median of the rest), ``window_tokens_per_s_median`` (x the
context), the parameter count and the compiled step's memory, to a JSON file, for ``benchmarks/overhead.py``
and ``benchmarks/accelerator.py``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time

T0 = time.time()

# size presets (models/gpt.py SIZES): vocabulary, context, width, depth, heads; MLP 4x the width
SIZES = {
    "tiny": (256, 128, 128, 4, 4),
    "gpt2_small": (50257, 1024, 768, 12, 12),
    "gpt2_medium": (50257, 1024, 1024, 24, 16),
    "1b": (50257, 2048, 2048, 24, 16),
}
VOCAB, CONTEXT, WIDTH, DEPTH, HEADS = SIZES["tiny"]
MLP_RATIO = 4
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
    """The GPT's parameters, float32, in the layout of the repository's ``nnx.to_pure_dict`` (blocks a list);
    ``vocab``: rows of the embedding (padded, if padding)."""
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


@functools.lru_cache(maxsize=None)
def splash_kernel(t: int, heads: int):
    """The Pallas splash-attention kernel of a causal mask over ``t`` tokens (blocks of 512, 256 or 128)."""
    import jax
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    b = next(b for b in (512, 256, 128) if t % b == 0)
    sizes = sk.BlockSizes(b, b, b, b, b, b, b, b)
    mask = sm.MultiHeadMask([sm.CausalMask((t, t)) for _ in range(heads)])
    with jax.ensure_compile_time_eval():  # its mask tables are constants, not values of a trace
        return sk.make_splash_mha(
            mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=jax.default_backend() != "tpu"
        )


def attention(q, k, v, kind: str, rate: float = 0.0, key=None):
    """Causal attention of ``[B, T, H, K]`` queries, keys and values; with ``rate`` > 0 and dropout key(s)
    ``key`` the probabilities are dropped (written out: float32 scores and softmax, the probabilities cast back)."""
    import jax
    import jax.numpy as jnp

    if rate > 0 and key is not None:
        t, d = q.shape[1], q.shape[3]
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * jnp.float32(1 / math.sqrt(d))
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
        p = dropout(jax.nn.softmax(s, axis=-1), rate, key)
        return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v)
    if kind == "xla":
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    t, h, d = q.shape[1:]
    tr = lambda x: jnp.swapaxes(x, 1, 2)
    out = jax.vmap(splash_kernel(t, h))(tr(q * jnp.asarray(1 / math.sqrt(d), q.dtype)), tr(k), tr(v))
    return tr(out)


def dropout(x, rate: float, key):
    """Inverted dropout: one key per example (``key`` of shape ``[B]``) or one for the whole batch (a scalar key)."""
    import jax
    import jax.numpy as jnp

    if rate == 0.0 or key is None:
        return x
    if key.shape:
        keep = jax.vmap(lambda k: jax.random.bernoulli(k, 1.0 - rate, x.shape[1:]))(key)
    else:
        keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros_like(x))


def fold(key, i: int):
    """``fold_in(key, i)`` of a scalar key or of every key of a ``[B]`` array of keys."""
    import jax

    return jax.random.fold_in(key, i) if not key.shape else jax.vmap(lambda k: jax.random.fold_in(k, i))(key)


def features(
    params,
    tokens,
    dtype,
    heads: int = HEADS,
    *,
    kind: str = "xla",
    rate: float = 0.0,
    key=None,
    remat: str = "none",
    attn_rate=None,
):
    """Final hidden states ``[B, T, D]`` in ``dtype`` of int32 tokens ``[B, T]``; ``key``: dropout key(s);
    ``attn_rate``: dropout of the attention probabilities (None: ``rate``)."""
    import jax
    import jax.numpy as jnp

    p = jax.tree.map(lambda a: a.astype(dtype), params)
    b, t = tokens.shape
    attn_rate = rate if attn_rate is None else attn_rate
    key = key if rate > 0 or attn_rate > 0 else None

    def linear(q, x):  # x @ kernel + bias, contracting x's last axis (as flax's Linear writes it)
        return jax.lax.dot_general(x, q["kernel"], (((x.ndim - 1,), (0,)), ((), ()))) + q["bias"]

    def block(blk, x, bkey):
        d = x.shape[-1]
        qkv = linear(blk["qkv"], layer_norm(blk["norm1"], x)).reshape(b, t, 3, heads, -1)
        akey = None if bkey is None or not attn_rate else fold(bkey, 2)
        a = attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], kind, attn_rate, akey)
        x = x + dropout(linear(blk["proj"], a.reshape(b, t, d)), rate, None if bkey is None else fold(bkey, 0))
        m = jax.nn.gelu(linear(blk["fc1"], layer_norm(blk["norm2"], x)))
        return x + dropout(linear(blk["fc2"], m), rate, None if bkey is None else fold(bkey, 1))

    if remat != "none":
        policy = jax.checkpoint_policies.dots_saveable if remat == "dots_saveable" else None
        block = jax.checkpoint(block, policy=policy)
    x = jnp.take(p["embed"]["embedding"], tokens, axis=0) + p["pos_embed"][:t]
    x = dropout(x, rate, None if key is None else fold(key, 0))
    for i, blk in enumerate(p["blocks"]):
        x = block(blk, x, None if key is None else fold(key, i + 1))
    return layer_norm(p["norm"], x)


def logits_fn(params, tokens, dtype, heads: int = HEADS, vocab: int = VOCAB, **kw):
    """float32 logits ``[B, T, vocab]`` of int32 tokens ``[B, T]``, computed in ``dtype`` (the padded rows dropped)."""
    import jax.numpy as jnp

    x = features(params, tokens, dtype, heads, **kw)
    w = params["embed"]["embedding"].astype(dtype)
    return jnp.dot(x, w.T)[..., :vocab].astype(jnp.float32)


@functools.lru_cache(maxsize=None)
def fused_xent():
    """``f(x, w, y, chunk, vocab)``: the mean over the ``N`` rows of the next-token cross-entropy of the logits
    ``x W^T`` (``x`` ``[N, D]``, ``W`` ``[V, D]``, columns ``>= vocab`` masked), ``chunk`` rows at a time, its
    gradient computed in the forward pass (a ``jax.custom_vjp``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def forward(x, w, y, chunk, vocab):
        n = x.shape[0]
        pad = -n % chunk
        xs = jnp.pad(x, ((0, pad), (0, 0))).reshape(-1, chunk, x.shape[1])
        ys = jnp.pad(y, (0, pad)).reshape(-1, chunk)
        ws = jnp.pad(jnp.full((n,), 1.0 / n, jnp.float32), (0, pad)).reshape(-1, chunk)
        cols = jnp.arange(w.shape[0])

        def body(dw, c):
            xc, yc, wc = c
            z = jnp.dot(xc, w.T, preferred_element_type=jnp.float32)
            if vocab < w.shape[0]:
                z = jnp.where(cols < vocab, z, -jnp.inf)
            lse = jax.nn.logsumexp(z, axis=-1)
            loss = lse - jnp.take_along_axis(z, yc[:, None], axis=-1)[:, 0]
            g = ((jnp.exp(z - lse[:, None]) - (cols == yc[:, None])) * wc[:, None]).astype(xc.dtype)
            dx = jnp.dot(g, w, preferred_element_type=jnp.float32).astype(xc.dtype)
            return dw + jnp.dot(g.T, xc, preferred_element_type=jnp.float32), (jnp.sum(loss * wc), dx)

        dw, (sums, dx) = jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32), (xs, ys, ws))
        return jnp.sum(sums), (dx.reshape(-1, x.shape[1])[:n], dw.astype(w.dtype), y)

    def backward(chunk, vocab, res, g):
        dx, dw, y = res
        scaled = lambda a: (a * g.astype(a.dtype)).astype(a.dtype)
        return scaled(dx), scaled(dw), np.zeros(y.shape, jax.dtypes.float0)

    f = jax.custom_vjp(lambda x, w, y, chunk, vocab: forward(x, w, y, chunk, vocab)[0], nondiff_argnums=(3, 4))
    f.defvjp(forward, backward)
    return f


def loss_fn(params, x, y, dtype, heads: int = HEADS, vocab: int = VOCAB, loss_chunk: int = 0, **kw):
    """Mean next-token cross-entropy (nats per token) over the batch, float32."""
    import jax.numpy as jnp
    import optax

    if not loss_chunk:
        return optax.softmax_cross_entropy_with_integer_labels(
            logits_fn(params, x, dtype, heads, vocab, **kw), y
        ).mean()
    h = features(params, x, dtype, heads, **kw)
    w = params["embed"]["embedding"].astype(dtype)
    return fused_xent()(h.reshape(-1, h.shape[-1]), w, y.reshape(-1), loss_chunk, vocab).astype(jnp.float32)


def make_train_step(
    tx, dtype, heads: int = HEADS, vocab: int = VOCAB, seed: int = 0, dropout_keys: str = "per_example", **kw
):
    """``(params, opt_state, x, y, step, index) -> (params, opt_state, loss)``: one Adam step on the mean loss (not
    jitted); ``index``: int32 ``[B]`` global example indices (per-example dropout keys)."""
    import jax
    import optax

    def train_step(params, opt_state, x, y, step=0, index=None):
        key = None
        attn_rate = kw.get("attn_rate")
        if kw.get("rate", 0.0) > 0 or (attn_rate if attn_rate is not None else kw.get("rate", 0.0)) > 0:
            key = jax.random.fold_in(jax.random.key(seed), step)
            if dropout_keys == "per_example":
                key = jax.vmap(lambda i: jax.random.fold_in(key, i))(index)
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y, dtype, heads, vocab, key=key, **kw)
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


def param_count(vocab: int, context: int, width: int, depth: int) -> int:
    """Parameters of the model with a real vocabulary of ``vocab`` (the padding rows not counted)."""
    d, r = width, MLP_RATIO
    return depth * (4 * d * d + 2 * r * d * d + 9 * d + r * d) + vocab * d + context * d + 2 * d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES), help="preset dimensions (models/gpt.py SIZES)")
    for dim in ("vocab", "context", "width", "depth", "heads"):
        ap.add_argument(f"--{dim}", type=int, default=None, help=f"overrides the preset's {dim}")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8, help="global batch (windows of --context tokens)")
    ap.add_argument("--eval-batch", type=int, default=1000, help="windows per evaluation batch (train.eval_batch)")
    ap.add_argument("--no-eval", action="store_true", help="skip the final evaluation")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--attention",
        default="xla",
        choices=["auto", "xla", "splash"],
        help="auto: splash on TPU for a context of 512 or more, a multiple of 128 (models/attention.py)",
    )
    ap.add_argument(
        "--loss-chunk", type=int, default=0, help="tokens per chunk of the fused output layer + loss (0: off)"
    )
    ap.add_argument("--vocab-multiple", type=int, default=1, help="pad the embedding to a multiple of this many rows")
    ap.add_argument("--remat", default="none", choices=["none", "full", "dots_saveable"])
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument(
        "--attention-dropout", type=float, default=None, help="dropout of the attention probabilities (--dropout)"
    )
    ap.add_argument("--dropout-keys", default="per_example", choices=["per_example", "per_step"])
    ap.add_argument("--data", default=default_corpus(), help="Tiny Shakespeare's input.txt")
    ap.add_argument("--timings", default=None, help="write phase times (s since start) to this JSON file")
    ap.add_argument("--window", type=int, default=5, help="steps per throughput window (train.log_every)")
    ap.add_argument("--compilation-cache", default=None, help="JAX's persistent compilation cache folder (off)")
    ap.add_argument("--profile", default=None, help="write a jax.profiler trace of steps [window, 2 window) here")
    args = ap.parse_args()
    v, t, w, depth, h = (
        getattr(args, k) if getattr(args, k) is not None else p
        for k, p in zip(("vocab", "context", "width", "depth", "heads"), SIZES[args.size])
    )
    v_rows = -(-v // args.vocab_multiple) * args.vocab_multiple
    marks: dict = {}

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
    attn_rate = args.dropout if args.attention_dropout is None else args.attention_dropout
    if args.attention == "auto":  # (the splash kernel drops no probabilities: XLA's attention with that dropout)
        long = t >= 512 and t % 128 == 0
        args.attention = "splash" if jax.default_backend() == "tpu" and long and not attn_rate else "xla"
    if args.attention == "splash" and attn_rate:
        raise SystemExit("--attention splash cannot drop attention probabilities: give --attention-dropout 0")
    mesh = Mesh(np.array(jax.devices()[: args.devices]), ("data",))
    repl, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    if args.attention == "splash" and args.devices > 1:
        raise SystemExit("--attention splash runs on one device here (the kernel is not partitioned)")
    tx = optax.adam(1e-3)
    params = jax.device_put(init_params(jax.random.key(args.seed), depth, w, v_rows, t), repl)
    opt_state = jax.device_put(tx.init(params), repl)
    model = dict(kind=args.attention, rate=args.dropout, remat=args.remat, attn_rate=args.attention_dropout)

    def eval_step(params, x, y, mask):
        logits = logits_fn(params, x, dtype, h, v, kind=args.attention)
        return (optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(-1) * mask).sum()

    step = jax.jit(
        make_train_step(tx, dtype, h, v, args.seed, args.dropout_keys, loss_chunk=args.loss_chunk, **model),
        in_shardings=(repl, repl, split, split, None, split),
        out_shardings=(repl, repl, repl),
        donate_argnums=(0, 1),
    )
    evaluate = jax.jit(eval_step, in_shardings=(repl, split, split, split), out_shardings=repl)
    bound = 2 if args.devices > 1 else None
    in_flight: list = []
    windows_s: list[float] = []
    t_window = time.perf_counter()
    for s in range(args.steps):
        x, y = batch_of(train, args.seed, s, args.batch, t)
        index = np.arange(s * args.batch, (s + 1) * args.batch, dtype=np.int32)
        if args.profile and s == args.window:
            jax.profiler.start_trace(args.profile)
        params, opt_state, loss = step(
            params, opt_state, *jax.device_put((x, y), split), np.int32(s), jax.device_put(index, split)
        )
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
            if args.profile and s + 1 == 2 * args.window:
                jax.profiler.stop_trace()
    jax.block_until_ready(params)
    mark("train")
    total, n = float("nan"), 0
    if not args.no_eval:  # every non-overlapping validation window once, padded to the device count and masked
        n = (len(valid) - 1) // t
        vx, vy = valid[: n * t].reshape(n, t), valid[1 : n * t + 1].reshape(n, t)
        total = 0.0
        for i in range(0, n, args.eval_batch):
            bx, by = vx[i : i + args.eval_batch], vy[i : i + args.eval_batch]
            pad = -len(bx) % args.devices
            mask = np.concatenate([np.ones(len(bx), np.float32), np.zeros(pad, np.float32)])
            bx, by = (np.concatenate([a, np.zeros((pad, t), np.int32)]) for a in (bx, by))
            total += float(evaluate(params, *jax.device_put((bx, by, mask), split)))
        print(f"eval/loss={total / n:.4f}", flush=True)
    mark("eval")
    if args.timings:
        mark("end")
        if len(windows_s) > 1:  # as train.py's perf/examples_per_s: median of windows, the first one dropped
            eps = statistics.median(args.window * args.batch / x for x in windows_s[1:])
            marks["window_examples_per_s_median"] = eps
            marks["window_tokens_per_s_median"] = eps * t
            marks["window_tokens_per_s_all"] = [args.window * args.batch * t / x for x in windows_s[1:]]
        marks["final_train_loss"] = float(loss)
        marks["eval_loss"] = total / n if n else None
        marks["param_count"] = param_count(v, t, w, depth)
        marks["dims"] = {"vocab": v, "context": t, "width": w, "depth": depth, "heads": h, "rows": v_rows}
        stats = getattr(jax.devices()[0], "memory_stats", lambda: None)() or {}
        marks["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
        marks["device_kind"] = jax.devices()[0].device_kind
        marks["attention"] = args.attention
        marks["t0_epoch_s"] = T0
        with open(args.timings, "w") as f:
            json.dump(marks, f)


if __name__ == "__main__":
    sys.exit(main())
