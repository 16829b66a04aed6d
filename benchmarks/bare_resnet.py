"""A bare JAX ResNet-18 script: the yardstick ``python train.py model=resnet data=synthetic`` is compared to.

It trains what ``train.py model=resnet data=synthetic data.image_shape=[32,32,3]`` trains, the way a short
hand-written script would, with no import from the repository. The model follows the flax examples' ResNet
(``examples/imagenet/models.py``: ``ResNetBlock`` of two 3x3 convolutions, the first strided, the last norm's
scale starting at zero, a 1x1 projection with its norm when the shape changes; ``ResNet`` of stages of
``stage_sizes`` blocks, ``ResNet18 = stage_sizes [2, 2, 2, 2]``) as plain ``jnp`` functions of a dict of arrays,
with the repository's choices (models/resnet.py): the small-image stem (a 3x3 stride-1 convolution and its norm,
no max-pool), GroupNorm (32 groups, or gcd(32, channels); epsilon 1e-5, statistics in float32) in place of
BatchNorm, convolutions without bias with padding 1, stage widths ``width x (1, 2, 4, 8)``, global average pool,
a dense head. Initial distributions as the repository's: convolutions He-normal on fan-out, the head LeCun
truncated normal, biases 0, norm scales 1 (0 for each block's last norm); the draws themselves differ.

Training: ``optax.adam(1e-3)``, the mean softmax cross-entropy of float32 logits, float32 master weights, the
forward/backward pass in ``--precision`` (the params cast inside the differentiated function, the uint8 pixels
divided by 255 in float32 then cast), params replicated and the batch split over the devices with ``jax.jit``
shardings. Data: ``data=synthetic``'s examples, generated on the devices by a jitted function of the step (example
``i`` from ``fold_in(key(seed), i)``: uniform random bytes, a label from ``fold_in(., 1)``; step ``s`` takes
examples ``[p B, (p + 1) B)``, ``p = s mod (train_size // B)``), so both programs train on the same bytes. No
config system, W&B, checkpoints, evaluation, metric files or progress bar: the loss is read back at each window's
end.

``tests/test_bare_image.py`` checks that it computes what the repository computes: the same parameter shapes and
count, the same batches, and from the repository's initial parameters the same loss and parameters over 3 Adam
steps (float32 and bfloat16, 1 device).

    python benchmarks/bare_resnet.py [--width 64] [--image-shape 32,32,3] [--devices 1] [--precision bf16]
        [--batch 256] [--steps 60] [--window 10] [--timings out.json] [--profile DIR]

``--timings``: seconds since the script started at each phase (imports, first step, train, end),
``window_examples_per_s_median`` (windows of ``--window`` steps, i.e. ``train.log_every``, each ending with
``block_until_ready``, the first one dropped, the median of the rest), the parameter count and the device's peak
memory, to a JSON file, for ``benchmarks/accelerator.py``. ``--compilation-cache DIR``: JAX's persistent
compilation cache, as ``train.py`` has one by default.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

T0 = time.time()

WIDTH = 64
STAGE_SIZES = (2, 2, 2, 2)  # ResNet-18
IMAGE_SHAPE = (32, 32, 3)
CLASSES = 10
MAX_GROUPS = 32
GN_EPS = 1e-5
TRUNC_STD = 0.87962566103423978  # std of a standard normal truncated to (-2, 2)


def init_params(key, width: int = WIDTH, image_shape=IMAGE_SHAPE, classes: int = CLASSES, stage_sizes=STAGE_SIZES):
    """The ResNet's float32 parameters in the layout of the repository's ``nnx.to_pure_dict`` (blocks a list):
    ``stem`` / ``conv1`` / ``conv2`` / ``proj`` kernels ``[k, k, in, out]``, norms ``{scale, bias}``, ``head``
    ``{kernel [in, classes], bias}``."""
    import jax
    import jax.numpy as jnp

    keys = iter(jax.random.split(key, 2 + 3 * sum(stage_sizes)))

    def conv(k: int, c_in: int, c_out: int):  # He normal on fan_out (torchvision's ResNet init)
        std = math.sqrt(2.0 / (k * k * c_out))
        return {"kernel": std * jax.random.normal(next(keys), (k, k, c_in, c_out), jnp.float32)}

    def norm(c: int, scale: float = 1.0):
        return {"scale": jnp.full((c,), scale, jnp.float32), "bias": jnp.zeros((c,), jnp.float32)}

    params = {"stem": conv(3, image_shape[-1], width), "stem_norm": norm(width), "blocks": []}
    c_in = width
    for i, n in enumerate(stage_sizes):
        c_out = width * 2**i
        for j in range(n):
            stride = 2 if i > 0 and j == 0 else 1
            block = {"conv1": conv(3, c_in, c_out), "norm1": norm(c_out)}
            block.update(conv2=conv(3, c_out, c_out), norm2=norm(c_out, 0.0))  # each block starts as the identity
            if stride != 1 or c_in != c_out:
                block.update(proj=conv(1, c_in, c_out), proj_norm=norm(c_out))
            params["blocks"].append(block)
            c_in = c_out
    std = math.sqrt(1.0 / c_in) / TRUNC_STD  # LeCun normal, truncated (flax's default kernel init)
    kernel = std * jax.random.truncated_normal(next(keys), -2.0, 2.0, (c_in, classes), jnp.float32)
    params["head"] = {"kernel": kernel, "bias": jnp.zeros((classes,), jnp.float32)}
    return params


def conv(x, kernel, strides: int = 1, padding: int = 1):
    """NHWC convolution of ``x`` with an HWIO ``kernel``, symmetric zero ``padding``, no bias."""
    import jax

    pad = ((padding, padding), (padding, padding))
    return jax.lax.conv_general_dilated(x, kernel, (strides, strides), pad, dimension_numbers=("NHWC", "HWIO", "NHWC"))


def group_norm(p, x):
    """GroupNorm of NHWC ``x`` over (H, W, channels of a group), statistics in float32 (as flax: var = E[x^2] -
    E[x]^2, clipped at 0); the output in ``x``'s dtype."""
    import jax
    import jax.numpy as jnp

    b, h, w, c = x.shape
    g = math.gcd(MAX_GROUPS, c)
    x32 = x.astype(jnp.float32)
    grouped = x32.reshape(b, h, w, g, c // g)
    mean = grouped.mean((1, 2, 4))
    var = jnp.maximum(0.0, (grouped * grouped).mean((1, 2, 4)) - mean * mean)
    mean = jnp.repeat(mean, c // g, axis=1)[:, None, None, :]
    var = jnp.repeat(var, c // g, axis=1)[:, None, None, :]
    y = (x32 - mean) * (jax.lax.rsqrt(var + GN_EPS) * p["scale"]) + p["bias"]
    return y.astype(x.dtype)


def resnet_block(p, x, strides: int):
    """flax's ``ResNetBlock``: conv3x3(strides) GN relu conv3x3 GN, plus the shortcut (1x1 conv(strides) + GN when
    the shape changes), relu."""
    import jax

    residual = x
    y = jax.nn.relu(group_norm(p["norm1"], conv(x, p["conv1"]["kernel"], strides)))
    y = group_norm(p["norm2"], conv(y, p["conv2"]["kernel"]))
    if "proj" in p:
        residual = group_norm(p["proj_norm"], conv(x, p["proj"]["kernel"], strides, padding=0))
    return jax.nn.relu(residual + y)


def resnet(params, x, stage_sizes=STAGE_SIZES):
    """flax's ``ResNet``: the stem, ``stage_sizes`` blocks per stage (the first of each later stage strided), the
    mean over the spatial positions, the dense head. ``x`` ``[B, H, W, C]`` -> logits ``[B, classes]``, in ``x``'s
    dtype (the params already in it)."""
    import jax
    import jax.numpy as jnp

    x = jax.nn.relu(group_norm(params["stem_norm"], conv(x, params["stem"]["kernel"])))
    blocks = iter(params["blocks"])
    for i, n in enumerate(stage_sizes):
        for j in range(n):
            x = resnet_block(next(blocks), x, 2 if i > 0 and j == 0 else 1)
    x = jnp.mean(x, axis=(1, 2))
    head = params["head"]
    return jax.lax.dot_general(x, head["kernel"], (((1,), (0,)), ((), ()))) + head["bias"]


def loss_fn(params, image, label, dtype, stage_sizes=STAGE_SIZES):
    """Mean softmax cross-entropy (float32) of uint8 images ``[B, H, W, C]`` and int32 labels ``[B]``, the
    forward pass in ``dtype``."""
    import jax
    import jax.numpy as jnp
    import optax

    p = jax.tree.map(lambda a: a.astype(dtype), params)
    x = (image.astype(jnp.float32) / 255.0).astype(dtype)
    logits = resnet(p, x, stage_sizes).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, label).mean()


def make_train_step(tx, dtype, stage_sizes=STAGE_SIZES):
    """``(params, opt_state, image, label) -> (params, opt_state, loss)``: one optimizer step on the mean loss (not
    jitted)."""
    import jax
    import optax

    def train_step(params, opt_state, image, label):
        loss, grads = jax.value_and_grad(loss_fn)(params, image, label, dtype, stage_sizes)
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


def param_count(width: int = WIDTH, image_shape=IMAGE_SHAPE, classes: int = CLASSES, stage_sizes=STAGE_SIZES) -> int:
    """Parameters of the model (convolution kernels, norm scales and biases, the head)."""
    c_in, total = width, 9 * image_shape[-1] * width + 2 * width
    for i, n in enumerate(stage_sizes):
        c_out = width * 2**i
        for j in range(n):
            total += 9 * c_in * c_out + 9 * c_out * c_out + 4 * c_out
            if c_in != c_out or (i > 0 and j == 0):
                total += c_in * c_out + 2 * c_out
            c_in = c_out
    return total + c_in * classes + classes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=WIDTH, help="channels of the first stage (model.width)")
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
    if len(image_shape) != 3 or args.batch % args.devices or args.batch > args.train_size:
        raise SystemExit(
            f"error: --image-shape {args.image_shape} must be H,W,C and --batch {args.batch} a multiple of "
            f"--devices {args.devices}, at most --train-size {args.train_size}"
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
    params = jax.device_put(init_params(jax.random.key(args.seed), args.width, image_shape, args.classes), repl)
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
        marks["param_count"] = param_count(args.width, image_shape, args.classes)
        marks["dims"] = {"width": args.width, "image_shape": list(image_shape), "classes": args.classes}
        stats = getattr(jax.devices()[0], "memory_stats", lambda: None)() or {}
        marks["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
        marks["device_kind"] = jax.devices()[0].device_kind
        marks["t0_epoch_s"] = T0
        with open(args.timings, "w") as f:
            json.dump(marks, f)


if __name__ == "__main__":
    sys.exit(main())
