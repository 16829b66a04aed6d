"""ResNet-18 for small images (CIFAR-style stem) with GroupNorm."""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from models.common import HE_NORMAL_FAN_OUT, LECUN_NORMAL

# He-normal on fan_out, as torchvision initialises ResNet convolutions.
_CONV_INIT = HE_NORMAL_FAN_OUT
_MAX_GROUPS = 32


def _group_norm(channels: int, rngs: nnx.Rngs, *, zero_scale: bool = False) -> nnx.GroupNorm:
    """GroupNorm with 32 groups (Wu & He), or fewer when ``channels`` is not a multiple of 32."""
    scale_init = nnx.initializers.zeros if zero_scale else nnx.initializers.ones
    return nnx.GroupNorm(
        channels, num_groups=math.gcd(_MAX_GROUPS, channels), epsilon=1e-5, scale_init=scale_init, rngs=rngs
    )


class BasicBlock(nnx.Module):
    """conv3x3(stride) GN relu conv3x3 GN (+ shortcut) relu; projection shortcut (1x1 conv + GN) when the
    shape changes. The last GN scale starts at zero so every block starts as the identity (Goyal et al.)."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(
            in_ch, out_ch, (3, 3), strides=stride, padding=1, use_bias=False, kernel_init=_CONV_INIT, rngs=rngs
        )
        self.norm1 = _group_norm(out_ch, rngs)
        self.conv2 = nnx.Conv(out_ch, out_ch, (3, 3), padding=1, use_bias=False, kernel_init=_CONV_INIT, rngs=rngs)
        self.norm2 = _group_norm(out_ch, rngs, zero_scale=True)
        if stride != 1 or in_ch != out_ch:
            self.proj = nnx.Conv(
                in_ch, out_ch, (1, 1), strides=stride, use_bias=False, kernel_init=_CONV_INIT, rngs=rngs
            )
            self.proj_norm = _group_norm(out_ch, rngs)
        else:
            self.proj = None
            self.proj_norm = None

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.relu(self.norm1(self.conv1(x)))
        h = self.norm2(self.conv2(h))
        shortcut = x if self.proj is None else self.proj_norm(self.proj(x))
        return jax.nn.relu(h + shortcut)


class ResNet18(nnx.Module):
    """ResNet-18: stem, four stages of two basic blocks (widths w, 2w, 4w, 8w; strides 1, 2, 2, 2), global
    average pool, dense.

    The stem is the small-image one used for CIFAR (a 3x3 stride-1 convolution, no max-pool), so 32x32
    inputs reach the last stage at 4x4 and 28x28 ones at 4x4 too (28 -> 14 -> 7 -> 4 with SAME-style
    padding).

    GroupNorm replaces BatchNorm. BatchNorm normalises with statistics over the batch, so in data-parallel
    training the result depends on how the batch is split over devices unless the statistics are combined
    across devices (a cross-device mean/variance every layer), and it also carries running averages
    (non-parameter state) that the modes would have to keep in sync. GroupNorm's statistics are per example
    (over spatial positions and a group of channels), so there are no batch statistics, nothing to combine
    across devices, and no state besides ``nnx.Param``: the output for an example is independent of the
    batch it is in and of how that batch is sharded, which the mode-equivalence tests (pmap / jit sharding /
    shard_map / fsdp, any device count, microbatching) require. Statistics are computed in float32 inside
    the norm; the output keeps the compute dtype.

    Args:
      image_shape: (H, W, C) of one example.
      num_classes: number of output logits.
      width: channels of the first stage (ResNet-18 proper: 64).
      rngs: ``nnx.Rngs`` with a ``params`` stream.

    Raises:
      ValueError: bad image shape or width.
    """

    stages = (2, 2, 2, 2)

    def __init__(self, image_shape: Sequence[int], num_classes: int, *, width: int = 64, rngs: nnx.Rngs):
        if len(image_shape) != 3:
            raise ValueError(f"data.image_shape={list(image_shape)} must be [H, W, C]")
        if width < 1:
            raise ValueError(f"model.width={width} must be positive")
        c = image_shape[-1]
        self.stem = nnx.Conv(c, width, (3, 3), padding=1, use_bias=False, kernel_init=_CONV_INIT, rngs=rngs)
        self.stem_norm = _group_norm(width, rngs)
        blocks = []
        in_ch = width
        for i, n in enumerate(self.stages):
            out_ch = width * 2**i
            for j in range(n):
                blocks.append(BasicBlock(in_ch, out_ch, 2 if (i > 0 and j == 0) else 1, rngs=rngs))
                in_ch = out_ch
        self.blocks = nnx.List(blocks)
        self.head = nnx.Linear(in_ch, num_classes, kernel_init=LECUN_NORMAL, rngs=rngs)

    def __call__(self, x_BxHxWxC: jax.Array, dropout_keys_B: jax.Array | None = None) -> jax.Array:
        """Logits ``[B, num_classes]`` in the compute dtype. ``dropout_keys_B`` is accepted and ignored."""
        del dropout_keys_B  # no dropout in this model
        h = jax.nn.relu(self.stem_norm(self.stem(x_BxHxWxC)))
        for block in self.blocks:
            h = block(h)
        h_BxC = jnp.mean(h, axis=(1, 2))
        return self.head(h_BxC)


def flops_per_example(image_shape: Sequence[int], num_classes: int, width: int = 64) -> float:
    """Counted training FLOPs of one example, forward + backward: ``6 x`` the multiply-adds of the convolutions
    and the dense layer of ``ResNet18(image_shape, num_classes, width=width)``.

    A ``k x k`` convolution from ``c_in`` to ``c_out`` channels with an ``h x w`` output does ``h w k^2 c_in c_out``
    multiply-adds, its zero padding included, as ResNet's FLOP counts are made (He et al. 2016, "Deep Residual
    Learning for Image Recognition", table 1: multiply-adds of the convolutions and the fully connected layer;
    norms, activations and pooling not counted); a multiply-add is 2 FLOPs and the backward pass twice the forward
    (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", section 2.1). Width 64 on 32x32x3, 10 classes:
    0.556 G multiply-adds forward, 3.33 GFLOPs per example trained. XLA's count (``models.cost``) leaves out the
    taps on the padding and adds the elementwise work, so it differs.
    """
    h, w, c = image_shape
    macs = h * w * 9 * c * width  # the stem: 3x3, stride 1, padding 1
    c_in = width
    for i, blocks in enumerate(ResNet18.stages):
        c_out = width * 2**i
        for j in range(blocks):
            if i > 0 and j == 0:  # 3x3 stride 2 with padding 1 (and the 1x1 projection): ceil(n / 2)
                h, w = -(-h // 2), -(-w // 2)
            macs += h * w * 9 * (c_in * c_out + c_out * c_out)
            if c_in != c_out or (i > 0 and j == 0):
                macs += h * w * c_in * c_out  # the 1x1 projection shortcut
            c_in = c_out
    macs += c_in * num_classes
    return 6.0 * macs
