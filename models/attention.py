"""Causal multi-head attention for the GPT: XLA's (``jax.nn.dot_product_attention``) or the Pallas splash
attention kernel on TPU, which never materialises the ``[B, H, T, T]`` scores.

Attention dropout (``model.attention_dropout``, nanoGPT's dropout of the attention probabilities) needs the
probabilities themselves, so where it is active (a training step with a rate > 0) the attention is written out:
float32 scores, the causal mask, softmax, per-example dropout of the probabilities (``models.common``), then the
probabilities times the values in the compute dtype (``dropout_attention``). The splash kernel keeps no
probabilities: ``resolve_attention`` refuses ``splash`` with attention dropout, and ``auto`` takes XLA's then.

Splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``, the kernel MaxText uses) is a
``pallas_call``: XLA's sharding propagation cannot split it, so where the model runs under GSPMD on a mesh of
several devices (``jit_sharding``'s step and every mode's evaluation step) the mode declares the batch split
(``core.layout.batch_split``) and the kernel runs per device under ``shard_map``. Inside an explicit per-device region
(``shard_map``, ``pmap``) nothing is declared and the kernel sees the local batch. Off TPU it runs in Pallas'
interpret mode (slow; for tests).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from core.layout import current_batch_split
from models.common import per_example_dropout

ATTENTIONS = ("auto", "xla", "splash")
SPLASH_BLOCK = 512  # largest block of queries/keys per kernel step (MaxText's default sa_block_* sizes)
SPLASH_MIN_BLOCK = 128  # the TPU's lane width: a context must be a multiple of it
# auto picks splash from this context on: below it XLA's attention was the faster on a TPU, above it splash
# (docs/performance.md, "Accelerator")
SPLASH_AUTO_MIN_CONTEXT = 512


def resolve_attention(kind: str, context: int, platform: Optional[str] = None, attention_dropout: float = 0.0) -> str:
    """The kernel ``kind`` names for a model of ``context`` tokens on ``platform`` (None: JAX's default backend):
    ``auto`` is ``splash`` on TPU for a context of at least 512 that is a multiple of 128 and no attention dropout,
    else ``xla``.

    Raises:
      ValueError (one line): an unknown kind, or ``splash`` with a context that is not a multiple of 128 or with
        attention dropout (the kernel never holds the probabilities it would drop).
    """
    if kind not in ATTENTIONS:
        raise ValueError(f"model.attention={kind!r} is unknown; choose one of {', '.join(ATTENTIONS)}")
    platform = platform or jax.default_backend()
    if kind == "auto":
        long = context >= SPLASH_AUTO_MIN_CONTEXT and context % SPLASH_MIN_BLOCK == 0
        return "splash" if platform == "tpu" and long and not attention_dropout else "xla"
    if kind == "splash" and attention_dropout:
        raise ValueError(
            f"model.attention=splash cannot drop attention probabilities (model.attention_dropout={attention_dropout}: "
            f"the kernel never holds them); set model.attention_dropout=0 to keep the kernel, or model.attention=auto "
            f"(XLA's attention, written out with the dropout)"
        )
    if kind == "splash" and context % SPLASH_MIN_BLOCK:
        raise ValueError(
            f"model.attention=splash needs model.context to be a multiple of {SPLASH_MIN_BLOCK}, got {context}; "
            f"use model.attention=xla or a context of {max(1, round(context / SPLASH_MIN_BLOCK)) * SPLASH_MIN_BLOCK}"
        )
    return kind


def _block(context: int) -> int:
    """The largest of 512, 256, 128 that divides ``context``."""
    return next(b for b in (SPLASH_BLOCK, 256, SPLASH_MIN_BLOCK) if context % b == 0)


@functools.lru_cache(maxsize=None)
def _splash_kernel(context: int, heads: int, interpret: bool):
    """The splash kernel of a causal mask over ``context`` tokens for ``heads`` heads: ``[H, T, K] x 3 -> [H, T, K]``
    (the queries already scaled by ``1/sqrt(K)``)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    b = _block(context)
    sizes = splash.BlockSizes(
        block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b, block_kv_dkv_compute=b,
        block_q_dq=b, block_kv_dq=b,
    )  # fmt: skip
    mask = masks.MultiHeadMask([masks.CausalMask((context, context)) for _ in range(heads)])
    with jax.ensure_compile_time_eval():  # the kernel's mask tables are constants, not values of the trace
        return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def _splash_local(q_BxTxHxK: jax.Array, k_BxTxHxK: jax.Array, v_BxTxHxK: jax.Array) -> jax.Array:
    b, t, h, d = q_BxTxHxK.shape
    kernel = _splash_kernel(t, h, jax.default_backend() != "tpu")
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # [B, H, T, K]: the kernel's layout
    q = heads_first(q_BxTxHxK * jnp.asarray(1.0 / math.sqrt(d), q_BxTxHxK.dtype))
    out = jax.vmap(kernel)(q, heads_first(k_BxTxHxK), heads_first(v_BxTxHxK))
    return heads_first(out)


def dropout_attention(
    q_BxTxHxK: jax.Array, k_BxTxHxK: jax.Array, v_BxTxHxK: jax.Array, rate: float, keys_B: Optional[jax.Array]
) -> jax.Array:
    """Causal attention written out, with dropout on the probabilities: scores ``q k^T / sqrt(K)`` in float32 (the
    products of the inputs' dtype accumulated in float32), the causal mask, softmax in float32, per-example inverted
    dropout of the ``[H, T, T]`` probabilities of each example (``keys_B``: one key per example, None or ``rate`` 0:
    none), then the probabilities cast to the inputs' dtype times the values. ``[B, T, H, K]`` in and out."""
    t, d = q_BxTxHxK.shape[1], q_BxTxHxK.shape[-1]
    precision = jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if q_BxTxHxK.dtype == jnp.bfloat16 else None
    s_BxHxTxT = jnp.einsum(
        "bqhd,bkhd->bhqk", q_BxTxHxK, k_BxTxHxK, precision=precision, preferred_element_type=jnp.float32
    )
    s_BxHxTxT = s_BxHxTxT * jnp.float32(1.0 / math.sqrt(d))
    causal_TxT = jnp.tril(jnp.ones((t, t), bool))
    s_BxHxTxT = jnp.where(causal_TxT, s_BxHxTxT, jnp.finfo(jnp.float32).min)
    p_BxHxTxT = per_example_dropout(jax.nn.softmax(s_BxHxTxT, axis=-1), rate, keys_B)
    return jnp.einsum("bhqk,bkhd->bqhd", p_BxHxTxT.astype(v_BxTxHxK.dtype), v_BxTxHxK)


def causal_attention(
    q_BxTxHxK: jax.Array,
    k_BxTxHxK: jax.Array,
    v_BxTxHxK: jax.Array,
    kind: str,
    dropout_rate: float = 0.0,
    keys_B: Optional[jax.Array] = None,
) -> jax.Array:
    """Causal softmax attention ``softmax(q k^T / sqrt(K)) v`` per head, ``[B, T, H, K]`` in and out (the inputs'
    dtype; softmax statistics in float32 in both kernels).

    ``kind``: ``xla`` (``jax.nn.dot_product_attention``) or ``splash`` (``resolve_attention`` picks); an input
    whose length is not a multiple of 128 takes XLA's in either case. ``dropout_rate`` > 0 with per-example
    ``keys_B`` (a training step): ``dropout_attention`` (XLA's, written out; ``resolve_attention`` never pairs
    splash with a rate).
    """
    if dropout_rate > 0 and keys_B is not None:
        return dropout_attention(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, dropout_rate, keys_B)
    if kind == "xla" or q_BxTxHxK.shape[1] % SPLASH_MIN_BLOCK:
        return jax.nn.dot_product_attention(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, is_causal=True)
    split = current_batch_split()
    if split is None:
        return _splash_local(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK)
    mesh, axes = split
    spec = P(axes)
    return jax.shard_map(_splash_local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)(
        q_BxTxHxK, k_BxTxHxK, v_BxTxHxK
    )
