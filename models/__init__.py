"""Model zoo: flax NNX modules built from typed hyper-parameters (never the whole config)."""

from __future__ import annotations

import math
from typing import Sequence

from flax import nnx


def build_model(
    name: str,
    image_shape: Sequence[int],
    num_classes: int,
    *,
    seed: int,
    hidden: int = 256,
    activation: str = "tanh",
    dropout: float = 0.0,
    init_std: float = 0.01,
    width: int = 32,
    depth: int = 4,
    patch: int = 4,
    heads: int = 4,
    mlp_ratio: int = 4,
    **gpt: object,
) -> nnx.Module:
    """Creates a model with parameters drawn from ``seed`` (on the default device, once).

    Args:
      name: mlp | cnn | resnet | vit | gpt.
      image_shape: (H, W, C) of one example.
      num_classes: number of logits.
      seed: seed of the parameter initialiser; the same seed gives bitwise the same parameters whatever
        the device count or layout, since they are created once and then placed.
      gpt: for ``name="gpt"``: ``size`` and the dimension overrides of ``models.gpt.resolve_dims``
        (``vocab_size``, ``context``, ``max_positions``; ``width``, ``depth``, ``heads``, ``mlp_ratio`` are the
        named arguments, None = the preset's), ``vocab_multiple`` and ``remat``, ``tied_embeddings``, ``norm``,
        ``attention``, ``loss_chunk``; ``image_shape`` and
        ``num_classes`` are not used.
    Returns:
      An ``nnx.Module`` whose ``__call__(x_BxHxWxC, dropout_keys_B=None)`` returns logits ``[B, classes]``
      (gpt: ``__call__(tokens_BxT, dropout_keys_B=None)`` returns logits ``[B, T, vocab_size]``).
    Raises:
      ValueError: unknown model name or bad hyper-parameters.
    """
    rngs = nnx.Rngs(params=seed)
    if name == "mlp":
        from models.mlp import MLP

        return MLP(
            math.prod(image_shape),
            hidden,
            num_classes,
            activation=activation,
            dropout=dropout,
            init_std=init_std,
            rngs=rngs,
        )
    if name == "cnn":
        from models.cnn import CNN

        return CNN(image_shape, num_classes, width=width, dropout=dropout, rngs=rngs)
    if name == "resnet":
        from models.resnet import ResNet18

        return ResNet18(image_shape, num_classes, width=width, rngs=rngs)
    if name == "vit":
        from models.vit import ViT

        return ViT(
            image_shape,
            num_classes,
            width=width,
            depth=depth,
            patch=patch,
            heads=heads,
            mlp_ratio=mlp_ratio,
            dropout=dropout,
            rngs=rngs,
        )
    if name == "gpt":
        from models.gpt import GPT, resolve_dims

        dims = resolve_dims(
            str(gpt.pop("size", "tiny")),
            vocab_size=gpt.pop("vocab_size", None),  # type: ignore[arg-type]
            context=gpt.pop("context", None),  # type: ignore[arg-type]
            max_positions=gpt.pop("max_positions", None),  # type: ignore[arg-type]
            vocab_multiple=int(gpt.pop("vocab_multiple", 1)),  # type: ignore[call-overload]
            width=width,
            depth=depth,
            heads=heads,
            mlp_ratio=mlp_ratio,
        )
        return GPT(dims, dropout=dropout, rngs=rngs, **gpt)  # type: ignore[arg-type]
    if gpt:
        raise ValueError(f"model.name={name!r} does not take {', '.join(gpt)}")
    raise ValueError(f"model.name={name!r} is unknown; choose one of mlp, cnn, resnet, vit, gpt")
