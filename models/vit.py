"""A small Vision Transformer (Dosovitskiy et al.) for 28x28 / 32x32 images."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from models.common import LECUN_NORMAL, XAVIER_UNIFORM, normal, per_example_dropout, site_keys

_DENSE_INIT = XAVIER_UNIFORM
_POOLS = ("cls", "mean")


class EncoderBlock(nnx.Module):
    """Pre-LayerNorm transformer block: x + drop(MHA(LN(x))), then x + drop(MLP(LN(x))), MLP = dense gelu
    [dropout] dense."""

    def __init__(self, width: int, heads: int, mlp_ratio: int, dropout: float, *, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(width, epsilon=1e-6, rngs=rngs)
        # dropout_rate=0 and keep_rngs=False: the block stores no Rngs; dropout is done per example below.
        self.attn = nnx.MultiHeadAttention(
            heads,
            width,
            kernel_init=_DENSE_INIT,
            dropout_rate=0.0,
            deterministic=True,
            decode=False,
            keep_rngs=False,
            rngs=rngs,
        )
        self.norm2 = nnx.LayerNorm(width, epsilon=1e-6, rngs=rngs)
        self.fc1 = nnx.Linear(width, mlp_ratio * width, kernel_init=_DENSE_INIT, rngs=rngs)
        self.fc2 = nnx.Linear(mlp_ratio * width, width, kernel_init=_DENSE_INIT, rngs=rngs)
        self.dropout = dropout

    def __call__(self, x_BxNxD: jax.Array, keys_B: jax.Array | None) -> jax.Array:
        h = self.attn(self.norm1(x_BxNxD))
        x_BxNxD = x_BxNxD + per_example_dropout(h, self.dropout, site_keys(keys_B, 0))
        h = jax.nn.gelu(self.fc1(self.norm2(x_BxNxD)))
        h = per_example_dropout(h, self.dropout, site_keys(keys_B, 1))
        h = self.fc2(h)
        return x_BxNxD + per_example_dropout(h, self.dropout, site_keys(keys_B, 2))


class ViT(nnx.Module):
    """Patch embedding (a ``patch``x``patch`` convolution with stride ``patch``) + learned position
    embeddings (+ a CLS token when ``pool='cls'``) -> ``depth`` pre-LN encoder blocks -> LayerNorm -> pool
    (CLS token or mean over patch tokens) -> dense.

    Dropout (rate ``dropout``) follows the embedding, the attention output, the MLP hidden layer and the MLP
    output, each site with its own per-example keys; attention weights are not dropped.

    Args:
      image_shape: (H, W, C) of one example; H and W must be multiples of ``patch``.
      num_classes: number of output logits.
      width: token dimension; must be a multiple of ``heads``.
      depth: number of encoder blocks.
      patch: side of the square patches.
      heads: attention heads.
      mlp_ratio: hidden size of the MLP as a multiple of ``width``.
      dropout: dropout rate (0 disables it).
      pool: ``"cls"`` (a learned CLS token) or ``"mean"`` (mean of the patch tokens).
      rngs: ``nnx.Rngs`` with a ``params`` stream.

    Raises:
      ValueError: image sides not divisible by ``patch``, ``width`` not divisible by ``heads``, or another
        bad hyper-parameter.
    """

    def __init__(
        self,
        image_shape: Sequence[int],
        num_classes: int,
        *,
        width: int = 64,
        depth: int = 4,
        patch: int = 4,
        heads: int = 4,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        pool: str = "cls",
        rngs: nnx.Rngs,
    ):
        if len(image_shape) != 3:
            raise ValueError(f"data.image_shape={list(image_shape)} must be [H, W, C]")
        h, w, c = image_shape
        if patch < 1:
            raise ValueError(f"model.patch={patch} must be positive")
        if h % patch or w % patch:
            divisors = [p for p in range(1, min(h, w) + 1) if h % p == 0 and w % p == 0]
            raise ValueError(
                f"model.patch={patch} does not divide the image sides {h}x{w} (data.image_shape="
                f"{list(image_shape)}); set model.patch to a common divisor of {h} and {w}: "
                f"one of {divisors}"
            )
        if width < 1 or heads < 1 or width % heads:
            raise ValueError(f"model.width={width} must be a positive multiple of model.heads={heads}")
        if depth < 0 or mlp_ratio < 1:
            raise ValueError(f"model.depth={depth} must be >= 0 and model.mlp_ratio={mlp_ratio} >= 1")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"model.dropout={dropout} must be in [0, 1)")
        if pool not in _POOLS:
            raise ValueError(f"pool={pool!r} is unknown; choose one of {_POOLS}")
        self.patch_embed = nnx.Conv(
            c, width, (patch, patch), strides=patch, padding="VALID", kernel_init=LECUN_NORMAL, rngs=rngs
        )
        num_tokens = (h // patch) * (w // patch) + (1 if pool == "cls" else 0)
        self.pos_embed = nnx.Param(normal(0.02)(rngs.params(), (1, num_tokens, width)))
        self.cls_token = nnx.Param(jnp.zeros((1, 1, width))) if pool == "cls" else None
        self.blocks = nnx.List([EncoderBlock(width, heads, mlp_ratio, dropout, rngs=rngs) for _ in range(depth)])
        self.norm = nnx.LayerNorm(width, epsilon=1e-6, rngs=rngs)
        self.head = nnx.Linear(width, num_classes, kernel_init=_DENSE_INIT, rngs=rngs)
        self.dropout = dropout
        self.pool = pool

    def __call__(self, x_BxHxWxC: jax.Array, dropout_keys_B: jax.Array | None = None) -> jax.Array:
        """Logits ``[B, num_classes]`` in the compute dtype of the inputs/params.

        ``dropout_keys_B``: one typed PRNG key per example (shape ``[B]``), or None (no dropout).
        """
        if self.dropout == 0.0:
            dropout_keys_B = None  # no key derivation at all
        b = x_BxHxWxC.shape[0]
        t = self.patch_embed(x_BxHxWxC)
        t_BxNxD = t.reshape(b, -1, t.shape[-1])
        if self.cls_token is not None:
            cls = jnp.broadcast_to(self.cls_token[...].astype(t_BxNxD.dtype), (b, 1, t_BxNxD.shape[-1]))
            t_BxNxD = jnp.concatenate([cls, t_BxNxD], axis=1)
        t_BxNxD = t_BxNxD + self.pos_embed[...].astype(t_BxNxD.dtype)
        t_BxNxD = per_example_dropout(t_BxNxD, self.dropout, site_keys(dropout_keys_B, 0))
        for i, block in enumerate(self.blocks):
            t_BxNxD = block(t_BxNxD, site_keys(dropout_keys_B, i + 1))
        t_BxNxD = self.norm(t_BxNxD)
        pooled_BxD = t_BxNxD[:, 0] if self.cls_token is not None else jnp.mean(t_BxNxD, axis=1)
        return self.head(pooled_BxD)


def flops_per_example(
    image_shape: Sequence[int],
    num_classes: int,
    *,
    width: int = 64,
    depth: int = 4,
    patch: int = 4,
    mlp_ratio: int = 4,
    pool: str = "cls",
) -> float:
    """Counted training FLOPs of one example, forward + backward, of ``ViT(image_shape, num_classes, ...)``:
    ``6 x`` the multiply-adds of its matmuls over ``T`` tokens (the ``N`` patches, plus the CLS token with
    ``pool='cls'``), width ``d``, ``L`` blocks: the patch embedding ``N p^2 C d``, per block the query, key, value
    and output projections ``4 T d^2``, the MLP ``2 r T d^2`` and the attention scores and their use over the
    tokens ``2 T^2 d``, the head ``d x classes``; norms, softmax and activations not counted.

    Per token that is the transformer count of Chowdhery et al. 2022 ("PaLM", appendix B: ``6 N + 12 L d T``, a
    multiply-add 2 FLOPs, the backward pass twice the forward; as ``models.gpt.flops_per_token``) with the patch
    embedding and the head added. Width 384, 12 blocks, patch 4 on 32x32x3 (65 tokens), 10 classes: 8.52 GFLOPs.
    """
    h, w, c = image_shape
    n = (h // patch) * (w // patch)
    t = n + (1 if pool == "cls" else 0)
    macs = n * patch * patch * c * width
    macs += depth * ((4 + 2 * mlp_ratio) * t * width * width + 2 * t * t * width)
    macs += width * num_classes
    return 6.0 * macs
