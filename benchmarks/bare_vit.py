"""A bare JAX Vision Transformer script: the yardstick ``python train.py model=vit data=synthetic`` is compared to.

It trains what ``train.py model=vit model.width=384 model.depth=12 model.heads=6 data=synthetic
data.image_shape=[32,32,3]`` trains, the way a short hand-written script would, with no import from the
repository. The model follows big_vision's ViT (``big_vision/models/vit.py``: ``_Model`` embeds ``patch x patch``
patches with a strided convolution, adds learned position embeddings, prepends a class token (``pool_type='tok'``),
runs the ``Encoder`` of ``Encoder1DBlock`` s (pre-LayerNorm: ``x + MHDPA(LN(x))``, then ``x + MlpBlock(LN(x))``,
the MLP dense-gelu-dense) and its final norm, then pools the class token into the dense head) as plain ``jnp``
functions of a dict of arrays, with the repository's choices (models/vit.py): the position embedding spans the
class token too (added after it is prepended), LayerNorm epsilon 1e-6 (statistics in float32), attention through
``jax.nn.dot_product_attention`` (what flax's attention calls without dropout), the tanh-approximated GELU, no
dropout. Initial distributions as the repository's: the patch embedding LeCun truncated normal, the position
embedding N(0, 0.02^2), the class token 0, the attention projections Xavier-uniform over their flattened
``[width, width]`` matrices, the MLP and the head Xavier-uniform, biases 0, norm scales 1; the draws themselves
differ.

Training, data and timing as ``benchmarks/bare_resnet.py``: ``optax.adam(1e-3)``, the mean softmax cross-entropy
of float32 logits, float32 master weights, the forward/backward pass in ``--precision``, ``data=synthetic``'s
examples generated on the devices (the same bytes as the repository's), params replicated and the batch split with
``jax.jit`` shardings, windows of ``--window`` steps.

``tests/test_bare_image.py`` checks that it computes what the repository computes: the same parameter shapes and
count, the same batches, and from the repository's initial parameters the same loss and parameters over 3 Adam
steps (float32 and bfloat16, 1 device).

    python benchmarks/bare_vit.py [--width 384 --depth 12 --heads 6 --patch 4] [--image-shape 32,32,3]
        [--devices 1] [--precision bf16] [--batch 256] [--steps 60] [--window 10] [--timings out.json]

``--timings``, ``--compilation-cache``, ``--profile``: as ``benchmarks/bare_resnet.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

T0 = time.time()

WIDTH, DEPTH, HEADS, PATCH, MLP_RATIO = 384, 12, 6, 4, 4
IMAGE_SHAPE = (32, 32, 3)
CLASSES = 10
LN_EPS = 1e-6
TRUNC_STD = 0.87962566103423978  # std of a standard normal truncated to (-2, 2)


def init_params(
    key,
    width: int = WIDTH,
    depth: int = DEPTH,
    heads: int = HEADS,
    patch: int = PATCH,
    mlp_ratio: int = MLP_RATIO,
    image_shape=IMAGE_SHAPE,
    classes: int = CLASSES,
):
    """The ViT's float32 parameters in the layout of the repository's ``nnx.to_pure_dict`` (blocks a list): the
    attention's ``query`` / ``key`` / ``value`` kernels ``[width, heads, head_dim]`` (biases ``[heads, head_dim]``),
    ``out`` ``[heads, head_dim, width]``; the position embedding ``[1, patches + 1, width]``."""
    import jax
    import jax.numpy as jnp

    h, w, c = image_shape
    d, k = width, width // heads
    tokens = (h // patch) * (w // patch) + 1
    keys = iter(jax.random.split(key, 3 + 6 * depth))

    def xavier(n_in: int, n_out: int, shape=None):  # uniform, variance 2 / (fan_in + fan_out)
        limit = math.sqrt(6.0 / (n_in + n_out))
        flat = jax.random.uniform(next(keys), (n_in, n_out), jnp.float32, -limit, limit)
        return flat.reshape(shape or (n_in, n_out))

    def dense(n_in: int, n_out: int):
        return {"kernel": xavier(n_in, n_out), "bias": jnp.zeros((n_out,), jnp.float32)}

    def norm():
        return {"scale": jnp.ones((d,), jnp.float32), "bias": jnp.zeros((d,), jnp.float32)}

    def attention():
        qkv = {
            name: {"kernel": xavier(d, d, (d, heads, k)), "bias": jnp.zeros((heads, k), jnp.float32)}
            for name in ("query", "key", "value")
        }
        return {**qkv, "out": {"kernel": xavier(d, d, (heads, k, d)), "bias": jnp.zeros((d,), jnp.float32)}}

    std = math.sqrt(1.0 / (patch * patch * c)) / TRUNC_STD  # LeCun normal, truncated (flax's default kernel init)
    embed = std * jax.random.truncated_normal(next(keys), -2.0, 2.0, (patch, patch, c, d), jnp.float32)
    return {
        "patch_embed": {"kernel": embed, "bias": jnp.zeros((d,), jnp.float32)},
        "pos_embed": 0.02 * jax.random.normal(next(keys), (1, tokens, d), jnp.float32),
        "cls_token": jnp.zeros((1, 1, d), jnp.float32),
        "blocks": [
            {
                "norm1": norm(),
                "attn": attention(),
                "norm2": norm(),
                "fc1": dense(d, mlp_ratio * d),
                "fc2": dense(mlp_ratio * d, d),
            }
            for _ in range(depth)
        ],
        "norm": norm(),
        "head": dense(d, classes),
    }


def layer_norm(p, x):
    """LayerNorm over the last axis, statistics in float32 (as flax: var = E[x^2] - E[x]^2, clipped at 0)."""
    import jax
    import jax.numpy as jnp

    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.maximum(0.0, (x32 * x32).mean(-1, keepdims=True) - mean * mean)
    y = (x32 - mean) * (jax.lax.rsqrt(var + LN_EPS) * p["scale"]) + p["bias"]
    return y.astype(x.dtype)


def dense(p, x):
    """``x @ kernel + bias`` over ``x``'s last axis."""
    import jax

    return jax.lax.dot_general(x, p["kernel"], (((x.ndim - 1,), (0,)), ((), ()))) + p["bias"]


def attention(p, x):
    """Multi-head self-attention of ``[B, T, D]`` tokens (big_vision's ``MultiHeadDotProductAttention``): the
    query, key and value projections to ``[B, T, heads, head_dim]``, softmax(q k^T / sqrt(head_dim)) v, the output
    projection back to ``[B, T, D]``."""
    import jax

    q, k, v = (
        jax.lax.dot_general(x, p[n]["kernel"], (((2,), (0,)), ((), ()))) + p[n]["bias"]
        for n in ("query", "key", "value")
    )
    a = jax.nn.dot_product_attention(q, k, v)
    return jax.lax.dot_general(a, p["out"]["kernel"], (((2, 3), (0, 1)), ((), ()))) + p["out"]["bias"]


def mlp_block(p, x):
    """big_vision's ``MlpBlock``: dense, GELU (tanh approximation), dense."""
    import jax

    return dense(p["fc2"], jax.nn.gelu(dense(p["fc1"], x)))


def encoder_block(p, x):
    """big_vision's ``Encoder1DBlock``: ``x + attention(LN(x))``, then ``x + MLP(LN(x))``."""
    x = x + attention(p["attn"], layer_norm(p["norm1"], x))
    return x + mlp_block(p, layer_norm(p["norm2"], x))


def vit(params, x):
    """big_vision's ``_Model``: ``x`` ``[B, H, W, C]`` -> logits ``[B, classes]`` in ``x``'s dtype (the params
    already in it); the patch side is the embedding kernel's."""
    import jax
    import jax.numpy as jnp

    b = x.shape[0]
    kernel = params["patch_embed"]["kernel"]
    patch, d = kernel.shape[0], kernel.shape[-1]
    t = jax.lax.conv_general_dilated(x, kernel, (patch, patch), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    t = (t + params["patch_embed"]["bias"]).reshape(b, -1, d)
    t = jnp.concatenate([jnp.broadcast_to(params["cls_token"], (b, 1, d)), t], axis=1)
    t = t + params["pos_embed"]
    for blk in params["blocks"]:
        t = encoder_block(blk, t)
    t = layer_norm(params["norm"], t)
    return dense(params["head"], t[:, 0])


def loss_fn(params, image, label, dtype):
    """Mean softmax cross-entropy (float32) of uint8 images ``[B, H, W, C]`` and int32 labels ``[B]``, the
    forward pass in ``dtype``."""
    import jax
    import jax.numpy as jnp
    import optax

    p = jax.tree.map(lambda a: a.astype(dtype), params)
    x = (image.astype(jnp.float32) / 255.0).astype(dtype)
    return optax.softmax_cross_entropy_with_integer_labels(vit(p, x).astype(jnp.float32), label).mean()


def make_train_step(tx, dtype):
    """``(params, opt_state, image, label) -> (params, opt_state, loss)``: one optimizer step on the mean loss (not
    jitted)."""
    import jax
    import optax

    def train_step(params, opt_state, image, label):
        loss, grads = jax.value_and_grad(loss_fn)(params, image, label, dtype)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def synthetic_batch_fn(batch: int, image_shape, classes: int, seed: int, train_size: int):
    """``step -> (uint8 images [batch, *image_shape], int32 labels [batch])`` (not jitted): ``data=synthetic``'s
    examples of step ``step`` (an int32 scalar)."""
    import jax
    import jax.numpy as jnp

    steps_per_epoch = train_size // batch
    n = math.prod(image_shape)

    def pixels(key):  # uniform random bytes, four per 32-bit word
        words = jax.random.bits(key, (-(-n // 4),), jnp.uint32)
        return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)[:n].reshape(image_shape)

    def make(step):
        index = (step % steps_per_epoch) * batch + jnp.arange(batch, dtype=jnp.int32)
        keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(index)
        label = jax.vmap(lambda k: jax.random.randint(jax.random.fold_in(k, 1), (), 0, classes, jnp.int32))(keys)
        return jax.vmap(pixels)(keys), label

    return make


def param_count(
    width: int = WIDTH,
    depth: int = DEPTH,
    patch: int = PATCH,
    mlp_ratio: int = MLP_RATIO,
    image_shape=IMAGE_SHAPE,
    classes: int = CLASSES,
) -> int:
    """Parameters of the model: per block the four attention projections ``4 (d^2 + d)``, the MLP
    ``2 r d^2 + r d + d``, two norms ``4 d``; the patch embedding, position embedding, class token, final norm, head."""
    h, w, c = image_shape
    d, r = width, mlp_ratio
    tokens = (h // patch) * (w // patch) + 1
    block = 4 * (d * d + d) + 2 * r * d * d + r * d + d + 4 * d
    return depth * block + patch * patch * c * d + d + tokens * d + d + 2 * d + d * classes + classes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=WIDTH)
    ap.add_argument("--depth", type=int, default=DEPTH)
    ap.add_argument("--heads", type=int, default=HEADS)
    ap.add_argument("--patch", type=int, default=PATCH)
    ap.add_argument("--mlp-ratio", type=int, default=MLP_RATIO)
    ap.add_argument("--image-shape", default=",".join(map(str, IMAGE_SHAPE)), help="H,W,C (data.image_shape)")
    ap.add_argument("--classes", type=int, default=CLASSES, help="data.num_classes")
    ap.add_argument("--train-size", type=int, default=60000, help="synthetic training examples (data.train_size)")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=256, help="global batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timings", default=None, help="write phase times (s since start) to this JSON file")
    ap.add_argument("--window", type=int, default=10, help="steps per throughput window (train.log_every)")
    ap.add_argument("--compilation-cache", default=None, help="JAX's persistent compilation cache folder (off)")
    ap.add_argument("--profile", default=None, help="write a jax.profiler trace of steps [window, 2 window) here")
    args = ap.parse_args()
    image_shape = tuple(int(d) for d in args.image_shape.split(","))
    if len(image_shape) != 3 or image_shape[0] % args.patch or image_shape[1] % args.patch:
        raise SystemExit(f"error: --image-shape {args.image_shape} must be H,W,C with H and W multiples of --patch")
    if args.width % args.heads or args.batch % args.devices or args.batch > args.train_size:
        raise SystemExit(
            f"error: --width {args.width} must be a multiple of --heads {args.heads} and --batch {args.batch} a "
            f"multiple of --devices {args.devices}, at most --train-size {args.train_size}"
        )
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
    dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[args.precision]
    mesh = Mesh(np.array(jax.devices()[: args.devices]), ("data",))
    repl, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    tx = optax.adam(1e-3)
    dims = (args.width, args.depth, args.heads, args.patch, args.mlp_ratio)
    params = jax.device_put(init_params(jax.random.key(args.seed), *dims, image_shape, args.classes), repl)
    opt_state = jax.device_put(tx.init(params), repl)
    batch_of = jax.jit(
        synthetic_batch_fn(args.batch, image_shape, args.classes, args.seed, args.train_size), out_shardings=split
    )
    step = jax.jit(
        make_train_step(tx, dtype),
        in_shardings=(repl, repl, split, split),
        out_shardings=(repl, repl, repl),
        donate_argnums=(0, 1),
    )
    bound = 2 if args.devices > 1 else None
    in_flight: list = []
    windows_s: list[float] = []
    t_window = time.perf_counter()
    for s in range(args.steps):
        if args.profile and s == args.window:
            jax.profiler.start_trace(args.profile)
        image, label = batch_of(jax.device_put(np.int32(s), repl))
        params, opt_state, loss = step(params, opt_state, image, label)
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
    if len(windows_s) > 1:  # as train.py's perf/examples_per_s: median of windows, the first one dropped
        eps = statistics.median(args.window * args.batch / x for x in windows_s[1:])
        print(f"examples/s {eps:,.0f} (median of {len(windows_s) - 1} windows of {args.window} steps)", flush=True)
    if args.timings:
        mark("end")
        if len(windows_s) > 1:
            marks["window_examples_per_s_median"] = eps
            marks["window_examples_per_s_all"] = [args.window * args.batch / x for x in windows_s[1:]]
        marks["final_train_loss"] = float(loss)
        marks["param_count"] = param_count(
            args.width, args.depth, args.patch, args.mlp_ratio, image_shape, args.classes
        )
        marks["dims"] = dict(zip(("width", "depth", "heads", "patch", "mlp_ratio"), dims))
        stats = getattr(jax.devices()[0], "memory_stats", lambda: None)() or {}
        marks["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
        marks["device_kind"] = jax.devices()[0].device_kind
        marks["t0_epoch_s"] = T0
        with open(args.timings, "w") as f:
            json.dump(marks, f)


if __name__ == "__main__":
    sys.exit(main())
