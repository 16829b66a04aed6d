"""A decoder-only transformer language model (GPT-2 style: Radford et al. 2019), in flax NNX.

Token embedding + learned position embedding -> ``depth`` pre-norm blocks (causal multi-head self-attention,
``models.attention``: XLA's or the splash kernel on TPU, then a GELU MLP of width ``mlp_ratio * width``) -> final
norm -> logits over the vocabulary (the token embedding transposed when ``tied_embeddings``, else its own
matrix). Everything computes in the dtype of the parameters it is given (the step casts them to the compute
dtype): the embedding lookup and the output layer read the table as it is.

Blocks are a Python list (``nnx.List``), not a scanned stack: every parameter is a plain array of the tree, so
the parallel modes (which act on param trees: replication, FSDP sharding by the largest divisible dimension)
treat it like the other models. ``remat`` wraps each block in ``jax.checkpoint`` with the named policy.

Initialisation (GPT-2): weights N(0, 0.02^2), the two residual output projections of each block
N(0, (0.02 / sqrt(2 * depth))^2), biases 0, norm scales 1; drawn with ``models.common`` initialisers, so the
parameters are bitwise the same for any device count (they are created once, then placed).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import causal_attention, resolve_attention
from models.common import normal, per_example_dropout, site_keys

REMAT_POLICIES = ("none", "full", "dots_saveable")
NORMS = ("layernorm", "rmsnorm")


@dataclasses.dataclass(frozen=True)
class GPTDims:
    """The dimensions of one GPT: vocabulary, context (training window, tokens), position table, width, depth,
    heads."""

    vocab_size: int
    context: int
    max_positions: int
    width: int
    depth: int
    heads: int
    mlp_ratio: int = 4
    vocab_multiple: int = 1  # the embedding has ``padded_vocab`` rows: vocab_size rounded up to a multiple of this

    @property
    def padded_vocab(self) -> int:
        """Rows of the token embedding (and output layer): ``vocab_size`` rounded up to ``vocab_multiple``."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple


# Size presets: (vocab_size, context, width, depth, heads). GPT-2 sizes from Radford et al. 2019 (vocabulary
# 50257, context 1024); "1b" is GPT-3 XL's shape (Brown et al. 2020, table 2.1: 24 layers, 2048 wide, 16 heads,
# context 2048), ~1.3B parameters with the GPT-2 vocabulary.
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (256, 128, 128, 4, 4),  # 0.84M parameters (byte vocabulary)
    "gpt2_small": (50257, 1024, 768, 12, 12),  # 124M
    "gpt2_medium": (50257, 1024, 1024, 24, 16),  # 355M
    "1b": (50257, 2048, 2048, 24, 16),  # 1.3B
}


def resolve_dims(
    size: str,
    *,
    vocab_size: Optional[int] = None,
    context: Optional[int] = None,
    max_positions: Optional[int] = None,
    width: Optional[int] = None,
    depth: Optional[int] = None,
    heads: Optional[int] = None,
    mlp_ratio: int = 4,
    vocab_multiple: int = 1,
) -> GPTDims:
    """The preset ``size`` with every given (non-None) dimension overriding it; ``max_positions`` None = the
    context.

    Raises:
      ValueError (one line): unknown size, a non-positive dimension, heads not dividing the width, or a context
        longer than the position table.
    """
    if size not in SIZES:
        raise ValueError(f"model.size={size!r} is unknown; choose one of {', '.join(SIZES)}")
    v, t, w, d, h = SIZES[size]
    dims = GPTDims(
        vocab_size=v if vocab_size is None else vocab_size,
        context=t if context is None else context,
        max_positions=(t if context is None else context) if max_positions is None else max_positions,
        width=w if width is None else width,
        depth=d if depth is None else depth,
        heads=h if heads is None else heads,
        mlp_ratio=mlp_ratio,
        vocab_multiple=vocab_multiple,
    )
    for key in ("vocab_size", "context", "max_positions", "width", "heads", "mlp_ratio", "vocab_multiple"):
        if getattr(dims, key) < 1:
            raise ValueError(f"model.{key}={getattr(dims, key)} is out of range; it must be >= 1")
    if dims.depth < 0:
        raise ValueError(f"model.depth={dims.depth} is out of range; it must be >= 0")
    if dims.width % dims.heads:
        divisors = [k for k in range(1, min(dims.width, 64) + 1) if dims.width % k == 0]
        raise ValueError(
            f"model.heads={dims.heads} does not divide model.width={dims.width}; choose heads among {divisors} "
            f"or a width that is a multiple of {dims.heads}"
        )
    if dims.context > dims.max_positions:
        raise ValueError(
            f"model.context={dims.context} is longer than the position table model.max_positions="
            f"{dims.max_positions}; lower model.context or raise model.max_positions to at least {dims.context}"
        )
    return dims


def param_count_of(dims: GPTDims, tied_embeddings: bool = True) -> int:
    """Parameters of a GPT of ``dims`` (LayerNorm: scale and bias; RMSNorm has no biases: subtract
    ``(2 * depth + 1) * width``). Per block: qkv ``d*3d + 3d``, output ``d*d + d``, MLP ``2*r*d*d + r*d + d``,
    two norms ``4d``; plus embeddings ``V*d + P*d``, the final norm ``2d`` and, untied, the head ``d*V``. ``V`` is
    the real vocabulary: the padding rows of ``vocab_multiple`` are not counted (they are ``(padded_vocab -
    vocab_size) * d`` more arrays elements, twice untied)."""
    d, r = dims.width, dims.mlp_ratio
    block = 3 * d * d + 3 * d + d * d + d + 2 * r * d * d + r * d + d + 4 * d
    head = 0 if tied_embeddings else d * dims.vocab_size
    return dims.depth * block + dims.vocab_size * d + dims.max_positions * d + 2 * d + head


def flops_per_token(param_count: int, depth: int, width: int, context: int) -> float:
    """Training FLOPs per token, forward + backward: ``6 N + 12 L d T`` (Chowdhery et al. 2022, "PaLM",
    appendix B: 6N for the matmuls of the N parameters, 12·L·d·T for the attention scores and their use over a
    context of T tokens; a multiply-add counts 2; no rematerialisation counted)."""
    return 6.0 * param_count + 12.0 * depth * width * context


def _norm(kind: str, width: int, rngs: nnx.Rngs) -> nnx.Module:
    if kind == "rmsnorm":
        return nnx.RMSNorm(width, epsilon=1e-6, rngs=rngs)
    return nnx.LayerNorm(width, epsilon=1e-6, rngs=rngs)


class Block(nnx.Module):
    """Pre-norm decoder block: ``x + drop(Wo attn(LN(x)))``, then ``x + drop(W2 gelu(W1 LN(x)))``; with
    ``attention_dropout`` the attention probabilities are dropped too. Dropout sites of the block's key: 0 after
    the attention's projection, 1 after the MLP, 2 the attention probabilities."""

    def __init__(
        self,
        dims: GPTDims,
        dropout: float,
        norm: str,
        attention: str,
        *,
        rngs: nnx.Rngs,
        attention_dropout: float = 0.0,
    ):
        d, r = dims.width, dims.mlp_ratio
        w_init, out_init = normal(0.02), normal(0.02 / math.sqrt(2 * max(1, dims.depth)))
        self.norm1 = _norm(norm, d, rngs)
        self.qkv = nnx.Linear(d, 3 * d, kernel_init=w_init, rngs=rngs)
        self.proj = nnx.Linear(d, d, kernel_init=out_init, rngs=rngs)
        self.norm2 = _norm(norm, d, rngs)
        self.fc1 = nnx.Linear(d, r * d, kernel_init=w_init, rngs=rngs)
        self.fc2 = nnx.Linear(r * d, d, kernel_init=out_init, rngs=rngs)
        self.heads, self.dropout, self.attention = dims.heads, dropout, attention
        self.attention_dropout = attention_dropout

    def __call__(self, x_BxTxD: jax.Array, keys_B: jax.Array | None) -> jax.Array:
        b, t, d = x_BxTxD.shape
        h = self.heads
        qkv = self.qkv(self.norm1(x_BxTxD)).reshape(b, t, 3, h, d // h)
        q_BxTxHxK, k_BxTxHxK, v_BxTxHxK = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        attention_keys = site_keys(keys_B, 2) if self.attention_dropout else None
        a = causal_attention(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, self.attention, self.attention_dropout, attention_keys)
        x_BxTxD = x_BxTxD + per_example_dropout(self.proj(a.reshape(b, t, d)), self.dropout, site_keys(keys_B, 0))
        m = jax.nn.gelu(self.fc1(self.norm2(x_BxTxD)))
        return x_BxTxD + per_example_dropout(self.fc2(m), self.dropout, site_keys(keys_B, 1))


class GPT(nnx.Module):
    """Decoder-only transformer: ``__call__(tokens_BxT int, dropout_keys_B=None) -> logits [B, T, vocab]`` in
    the params' dtype; position ``t`` of the logits predicts token ``t + 1``. ``features`` and
    ``output_weight`` are its two halves (the final hidden states and the output layer), for a loss fused with
    the output layer (``loss_chunk``).

    Args:
      dims: ``GPTDims`` (``resolve_dims`` checks them).
      dropout: rate after the embeddings and each residual branch (0 disables it; per-example keys).
      attention_dropout: rate of the dropout of the attention probabilities (None: ``dropout``, as nanoGPT;
        ``models.attention.dropout_attention``: XLA's attention written out; refused with the splash kernel).
      remat: none | full (``jax.checkpoint`` of each block, nothing saved) | dots_saveable
        (``jax.checkpoint_policies.dots_saveable``: matmul outputs kept, the rest recomputed).
      tied_embeddings: the output layer is the token embedding transposed (GPT-2); else its own matrix.
      norm: layernorm | rmsnorm.
      attention: auto | xla | splash (``models.attention.resolve_attention``: auto is splash on TPU).
      loss_chunk: 0, or tokens per chunk of the output layer fused with the cross-entropy (``core.xent``: the
        ``[B, T, vocab]`` logits are never held whole); read by the training step.
    Raises:
      ValueError (one line): bad dims, unknown remat policy, norm or attention, dropout outside [0, 1), a negative
        loss_chunk, or at call time an input longer than the position table.
    """

    def __init__(
        self,
        dims: GPTDims,
        *,
        dropout: float = 0.0,
        remat: str = "none",
        tied_embeddings: bool = True,
        norm: str = "layernorm",
        attention: str = "auto",
        loss_chunk: int = 0,
        attention_dropout: Optional[float] = None,
        rngs: nnx.Rngs,
    ):
        if remat not in REMAT_POLICIES:
            raise ValueError(f"model.remat={remat!r} is unknown; choose one of {', '.join(REMAT_POLICIES)}")
        if norm not in NORMS:
            raise ValueError(f"model.norm={norm!r} is unknown; choose one of {', '.join(NORMS)}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"model.dropout={dropout} must be in [0, 1)")
        attention_dropout = dropout if attention_dropout is None else attention_dropout
        if not 0.0 <= attention_dropout < 1.0:
            raise ValueError(f"model.attention_dropout={attention_dropout} must be in [0, 1) (null: model.dropout)")
        if loss_chunk < 0:
            raise ValueError(f"model.loss_chunk={loss_chunk} must be >= 0 (0: logits, then the loss)")
        d, v = dims.width, dims.padded_vocab
        self.embed = nnx.Embed(v, d, embedding_init=normal(0.02), rngs=rngs)
        self.pos_embed = nnx.Param(normal(0.01)(rngs.params(), (dims.max_positions, d)))
        kernel = resolve_attention(attention, dims.context, attention_dropout=attention_dropout)
        self.blocks = nnx.List(
            [
                Block(dims, dropout, norm, kernel, rngs=rngs, attention_dropout=attention_dropout)
                for _ in range(dims.depth)
            ]
        )
        self.norm = _norm(norm, d, rngs)
        self.head = None if tied_embeddings else nnx.Linear(d, v, use_bias=False, kernel_init=normal(0.02), rngs=rngs)
        self.dims, self.dropout, self.remat, self.attention, self.loss_chunk = dims, dropout, remat, kernel, loss_chunk
        self.attention_dropout = attention_dropout

    def _block(self, block: Block, x: jax.Array, keys: jax.Array | None) -> jax.Array:
        if self.remat == "none":
            return block(x, keys)
        graphdef, state = nnx.split(block)
        policy = jax.checkpoint_policies.dots_saveable if self.remat == "dots_saveable" else None

        def run(state, x, keys):
            return nnx.merge(graphdef, state)(x, keys)

        return jax.checkpoint(run, policy=policy)(state, x, keys)

    def features(self, tokens_BxT: jax.Array, dropout_keys_B: jax.Array | None = None) -> jax.Array:
        """The final hidden states ``[B, T, width]`` (after the last norm), in the params' dtype."""
        t = tokens_BxT.shape[1]
        if t > self.dims.max_positions:
            raise ValueError(
                f"an input of {t} tokens is longer than the position table (model.max_positions="
                f"{self.dims.max_positions}); use at most {self.dims.max_positions} tokens"
            )
        if self.dropout == 0.0 and self.attention_dropout == 0.0:
            dropout_keys_B = None
        # the table as given (nnx.Embed would promote it to the float32 it was created in)
        x_BxTxD = jnp.take(self.embed.embedding[...], tokens_BxT.astype(jnp.int32), axis=0)
        x_BxTxD = x_BxTxD + self.pos_embed[:t].astype(x_BxTxD.dtype)
        x_BxTxD = per_example_dropout(x_BxTxD, self.dropout, site_keys(dropout_keys_B, 0))
        for i, block in enumerate(self.blocks):
            x_BxTxD = self._block(block, x_BxTxD, site_keys(dropout_keys_B, i + 1))
        return self.norm(x_BxTxD)

    def output_weight(self) -> jax.Array:
        """The output layer ``[padded_vocab, width]``: the token embedding (tied) or the head's kernel transposed."""
        return self.embed.embedding[...] if self.head is None else self.head.kernel[...].T

    def __call__(self, tokens_BxT: jax.Array, dropout_keys_B: jax.Array | None = None) -> jax.Array:
        x_BxTxD = self.features(tokens_BxT, dropout_keys_B)
        logits = jnp.dot(x_BxTxD, self.output_weight().T)
        v = self.dims.vocab_size
        return logits if v == logits.shape[-1] else logits[..., :v]


def generate(model: GPT, prompt: list[int], num_tokens: int, *, temperature: float = 0.0, seed: int = 0) -> list[int]:
    """``num_tokens`` tokens continuing ``prompt`` (token ids), one forward pass per token over the last
    ``model.dims.context`` tokens (shorter windows are right-padded: causal attention never reads the padding).

    ``temperature`` 0: greedy (argmax); > 0: sampled from ``softmax(logits / temperature)`` with keys from
    ``seed``. Returns the new tokens only.

    Raises:
      ValueError: an empty prompt or a negative temperature.
    """
    if not prompt:
        raise ValueError("the prompt is empty; give at least one token")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy)")
    t = model.dims.context
    graphdef, state = nnx.split(model)

    @jax.jit
    def next_token(state, window_1xT, last, key):
        logits = nnx.merge(graphdef, state)(window_1xT)[0, last].astype(jnp.float32)
        if temperature == 0:
            return jnp.argmax(logits)
        return jax.random.categorical(key, logits / temperature)

    tokens, out = list(prompt), []
    key = jax.random.key(seed)
    for i in range(num_tokens):
        window = tokens[-t:]
        padded = jnp.asarray([window + [0] * (t - len(window))], jnp.int32)
        tok = int(next_token(state, padded, len(window) - 1, jax.random.fold_in(key, i)))
        tokens.append(tok)
        out.append(tok)
    return out
