"""The augmentation spec from the data config (the augmentation itself is ``core.augment``, a pure function)."""

from __future__ import annotations

from typing import Optional

from core.augment import AUGMENT_SITE, AugmentSpec, augment_images

__all__ = ["AUGMENT_SITE", "AugmentSpec", "augment_images", "augment_spec"]


def augment_spec(augment: bool, crop_padding: int, flip: bool) -> Optional[AugmentSpec]:
    """The spec from ``data.augment``, ``data.crop_padding``, ``data.flip``; None when ``augment`` is false.

    Raises:
      ValueError: negative ``crop_padding`` (one line naming the value).
    """
    if crop_padding < 0:
        raise ValueError(
            f"data.crop_padding={crop_padding} must be >= 0 (pixels of padding on each side; 4 is the CIFAR-10 recipe)"
        )
    if not augment:
        return None
    return AugmentSpec(crop_padding=int(crop_padding), flip=bool(flip))
