"""On-device data augmentation: random crop with zero padding and random horizontal flip, per example.

Applied inside the training step (``core.step.LocalGrads``), on the uint8 images of whatever batch the
device holds, before they are scaled to [0, 1]. Every example draws from its own key, derived from
(``train.seed``, optimizer step, global example index) by ``core.step.example_keys``, so the crops and
flips of an example never depend on the device count, the parallel mode, the microbatching or the process
count (``tests/test_datasets.py`` checks 1 vs 8 devices).

The recipe is the standard CIFAR-10 one (He et al., "Deep Residual Learning", 2016, Sec. 4.2: "4 pixels are
padded on each side, and a 32x32 crop is randomly sampled from the padded image or its horizontal flip"),
i.e. torchvision's ``RandomCrop(32, padding=4)`` (zero fill) + ``RandomHorizontalFlip()``. Evaluation images
are never augmented.
"""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp

# fold_in site that separates the augmentation keys from the dropout keys derived from the same per-example
# key (the models use the per-example key itself, or fold_in sites 0, 1, ..., depth + 1).
AUGMENT_SITE = 0x41554700  # "AUG\0"


@dataclasses.dataclass(frozen=True)
class AugmentSpec:
    """What to do to each training example.

    Attributes:
      crop_padding: pixels of zero padding on every side before a random crop back to the original
        ``H x W`` (0: no crop). Offsets are uniform in ``[0, 2 * crop_padding]`` on each axis.
      flip: mirror the width axis with probability 1/2.
    """

    crop_padding: int
    flip: bool


def augment_images(image_BxHxWxC: jax.Array, keys_B: jax.Array, spec: AugmentSpec) -> jax.Array:
    """Randomly crops (after zero padding) and flips every example with its own key.

    Args:
      image_BxHxWxC: images of any dtype (uint8 in training), leading batch axis.
      keys_B: typed PRNG keys ``[B]``, one per example (``core.step.example_keys``).
      spec: what to apply.
    Returns:
      Array of the same shape and dtype. Example ``b`` depends only on ``image[b]`` and ``keys_B[b]``.
    """
    _, h, w, c = image_BxHxWxC.shape
    p = spec.crop_padding

    def one(img_HxWxC, key):
        k_crop, k_flip = jax.random.split(jax.random.fold_in(key, AUGMENT_SITE))
        if p > 0:
            padded = jnp.pad(img_HxWxC, ((p, p), (p, p), (0, 0)))
            dy, dx = jax.random.randint(k_crop, (2,), 0, 2 * p + 1, jnp.int32)
            img_HxWxC = jax.lax.dynamic_slice(padded, (dy, dx, jnp.int32(0)), (h, w, c))
        if spec.flip:
            img_HxWxC = jnp.where(jax.random.bernoulli(k_flip), img_HxWxC[:, ::-1, :], img_HxWxC)
        return img_HxWxC

    return jax.vmap(one)(image_BxHxWxC, keys_B)
