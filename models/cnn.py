"""The classic MNIST convolutional network (the Keras / PyTorch MNIST example)."""

from __future__ import annotations

from typing import Sequence

import jax
from flax import nnx

# The initialisers and site_keys live in models.common; re-exported here for older imports.
from models.common import (
    HE_NORMAL_FAN_OUT,  # noqa: F401
    LECUN_NORMAL,
    XAVIER_UNIFORM,  # noqa: F401
    normal,  # noqa: F401
    per_example_dropout,
    site_keys,
    variance_scaling,  # noqa: F401
)


class CNN(nnx.Module):
    """conv3x3(width) relu -> conv3x3(2*width) relu -> maxpool 2x2 -> [dropout] -> dense 128 relu -> [dropout]
    -> dense num_classes.

    The convolutions use VALID padding as in the Keras/PyTorch example, so 28x28 -> 26 -> 24 -> pool 12
    (12*12*64 = 9216 features at width 32) and 32x32 -> 30 -> 28 -> pool 14. Default flax initialisers
    (LeCun-normal kernels, zero biases). The same ``dropout`` rate is used at both dropout sites (the
    Keras example uses 0.25 and 0.5), each site with its own per-example keys.

    Args:
      image_shape: (H, W, C) of one example; H and W must be at least 6.
      num_classes: number of output logits.
      width: channels of the first convolution (the second has ``2 * width``).
      dropout: dropout rate (0 disables it).
      rngs: ``nnx.Rngs`` with a ``params`` stream.

    Raises:
      ValueError: bad image shape, width or dropout rate.
    """

    def __init__(
        self, image_shape: Sequence[int], num_classes: int, *, width: int = 32, dropout: float = 0.0, rngs: nnx.Rngs
    ):
        if len(image_shape) != 3:
            raise ValueError(f"data.image_shape={list(image_shape)} must be [H, W, C]")
        h, w, c = image_shape
        if h < 6 or w < 6:
            raise ValueError(
                f"cnn needs images of at least 6x6 (two VALID 3x3 convolutions and a 2x2 pool); got {h}x{w}"
            )
        if width < 1:
            raise ValueError(f"model.width={width} must be positive")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"model.dropout={dropout} must be in [0, 1)")
        init = dict(kernel_init=LECUN_NORMAL, rngs=rngs)
        self.conv1 = nnx.Conv(c, width, (3, 3), padding="VALID", **init)
        self.conv2 = nnx.Conv(width, 2 * width, (3, 3), padding="VALID", **init)
        flat = ((h - 4) // 2) * ((w - 4) // 2) * 2 * width
        self.fc = nnx.Linear(flat, 128, **init)
        self.out = nnx.Linear(128, num_classes, **init)
        self.dropout = dropout

    def __call__(self, x_BxHxWxC: jax.Array, dropout_keys_B: jax.Array | None = None) -> jax.Array:
        """Logits ``[B, num_classes]`` in the compute dtype of the inputs/params.

        ``dropout_keys_B``: one typed PRNG key per example (shape ``[B]``), or None (no dropout).
        """
        if self.dropout == 0.0:
            dropout_keys_B = None  # no key derivation at all
        h = jax.nn.relu(self.conv1(x_BxHxWxC))
        h = jax.nn.relu(self.conv2(h))
        h = nnx.max_pool(h, window_shape=(2, 2), strides=(2, 2), padding="VALID")
        h = per_example_dropout(h, self.dropout, site_keys(dropout_keys_B, 0))
        h_BxD = h.reshape(h.shape[0], -1)
        h_Bx128 = jax.nn.relu(self.fc(h_BxD))
        h_Bx128 = per_example_dropout(h_Bx128, self.dropout, site_keys(dropout_keys_B, 1))
        return self.out(h_Bx128)
