"""Next-token cross-entropy fused with the output layer, in chunks of tokens: the ``[N, V]`` logits of a large
vocabulary are never held whole (the chunked "fused linear cross-entropy" of Liger-Kernel, Hsu et al. 2024,
and levanter's blockwise loss).

``fused_token_xent`` computes, chunk by chunk, the logits ``x_c W^T`` (float32 accumulation), the loss, the
argmax and, in the same pass, the gradients ``dx_c = g_c W`` and ``dW += g_c^T x_c`` of the weighted loss sum
(``g_c = weights * (softmax - onehot)``): the backward pass only scales the saved gradients by the incoming
cotangent, so no logits are kept for it and no matmul is recomputed. ``token_xent`` is the forward alone
(evaluation). Columns ``>= valid_vocab`` (a vocabulary padded to a multiple of 128 for the matrix units) are
masked out of the softmax and the argmax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def _pad_rows(chunk: int, *arrays: jax.Array) -> tuple[int, list[jax.Array]]:
    """Rows padded with zeros to a multiple of ``chunk``; returns (padded row count, arrays reshaped to
    ``[chunks, chunk, ...]``)."""
    n = arrays[0].shape[0]
    padded = -(-n // chunk) * chunk
    out = [
        jnp.pad(a, [(0, padded - n)] + [(0, 0)] * (a.ndim - 1)).reshape(padded // chunk, chunk, *a.shape[1:])
        for a in arrays
    ]
    return padded, out


def _chunk_logits(x_CxD: jax.Array, w_VxD: jax.Array, valid_vocab: int) -> jax.Array:
    """float32 logits ``[C, V]`` of one chunk, the padded columns at -inf."""
    logits = jnp.dot(x_CxD, w_VxD.T, preferred_element_type=jnp.float32)
    if valid_vocab < w_VxD.shape[0]:
        logits = jnp.where(jnp.arange(w_VxD.shape[0]) < valid_vocab, logits, -jnp.inf)
    return logits


def _zeros_varying_as(shape, *like: jax.Array) -> jax.Array:
    """float32 zeros that vary over the mesh axes any of ``like`` varies over (inside ``shard_map`` with its
    varying-axes check a scan's carry must have its body's type; elsewhere plain zeros)."""
    axes = set().union(*(jax.typeof(a).manual_axis_type.varying for a in like))
    zeros = jnp.zeros(shape, jnp.float32)
    return jax.lax.pcast(zeros, tuple(sorted(axes)), to="varying") if axes else zeros


def _loss_correct(logits_CxV: jax.Array, labels_C: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(loss ``[C]``, correct ``[C]`` as float32 0/1, logsumexp ``[C]``) of float32 logits."""
    lse = jax.nn.logsumexp(logits_CxV, axis=-1)
    label_logit = jnp.take_along_axis(logits_CxV, labels_C[:, None], axis=-1)[:, 0]
    correct = (jnp.argmax(logits_CxV, axis=-1) == labels_C).astype(jnp.float32)
    return lse - label_logit, correct, lse


def token_xent(x_NxD: jax.Array, w_VxD: jax.Array, labels_N: jax.Array, chunk: int, valid_vocab: int):
    """Per-token cross-entropy (nats) and 0/1 accuracy, float32 ``[N]`` each, of the logits ``x W^T`` restricted to
    the first ``valid_vocab`` columns, computed ``chunk`` tokens at a time (no gradient: evaluation)."""
    n = x_NxD.shape[0]
    _, (xs, ys) = _pad_rows(chunk, x_NxD, labels_N)

    def body(_, xy):
        loss, correct, _ = _loss_correct(_chunk_logits(xy[0], w_VxD, valid_vocab), xy[1])
        return None, (loss, correct)

    _, (loss, correct) = jax.lax.scan(body, None, (xs, ys))
    return loss.reshape(-1)[:n], correct.reshape(-1)[:n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def fused_token_xent(x_NxD, w_VxD, labels_N, weights_N, chunk: int, valid_vocab: int):
    """``(sum_n weights_n * loss_n, loss_N, correct_N)`` of the tokens' cross-entropy over the logits ``x W^T``.

    Args:
      x_NxD: final hidden states, the compute dtype. w_VxD: the output layer (tied: the token embedding), same
        dtype, ``V`` rows of which the first ``valid_vocab`` are real tokens. labels_N: int32 next tokens.
      weights_N: float32 weight of each token's loss in the differentiated sum (mean over a batch: ``1/N``).
      chunk: tokens per chunk (the ``[chunk, V]`` float32 logits are the largest temporary).
    Returns:
      The weighted sum (float32 scalar, differentiable w.r.t. ``x`` and ``w``; ``weights`` get no gradient), and
      the per-token loss and 0/1 accuracy (float32 ``[N]``, not differentiable: their cotangents are ignored).
    """
    total, loss, correct, _ = _fused_forward(x_NxD, w_VxD, labels_N, weights_N, chunk, valid_vocab)
    return total, loss, correct


def _fused_forward(x_NxD, w_VxD, labels_N, weights_N, chunk, valid_vocab):
    n = x_NxD.shape[0]
    _, (xs, ys, ws) = _pad_rows(chunk, x_NxD, labels_N, weights_N)  # padded rows: weight 0, no gradient
    cols = jnp.arange(w_VxD.shape[0])

    def body(dw_VxD, xyw):
        x_c, y_c, w_c = xyw
        logits = _chunk_logits(x_c, w_VxD, valid_vocab)
        loss, correct, lse = _loss_correct(logits, y_c)
        # d(sum w * loss)/d logits = w * (softmax - onehot), float32, then the compute dtype for the matmuls
        g = (jnp.exp(logits - lse[:, None]) - (cols == y_c[:, None])) * w_c[:, None]
        g = g.astype(x_c.dtype)
        dx_c = jnp.dot(g, w_VxD, preferred_element_type=jnp.float32).astype(x_c.dtype)
        dw_VxD = dw_VxD + jnp.dot(g.T, x_c, preferred_element_type=jnp.float32)
        return dw_VxD, (loss, correct, dx_c)

    dw, (loss, correct, dx) = jax.lax.scan(body, _zeros_varying_as(w_VxD.shape, x_NxD, w_VxD), (xs, ys, ws))
    loss, correct, dx = loss.reshape(-1)[:n], correct.reshape(-1)[:n], dx.reshape(-1, x_NxD.shape[1])[:n]
    total = jnp.sum(loss * weights_N)
    return total, loss, correct, (dx, dw.astype(w_VxD.dtype), labels_N)


def _fused_fwd(x_NxD, w_VxD, labels_N, weights_N, chunk, valid_vocab):
    total, loss, correct, residuals = _fused_forward(x_NxD, w_VxD, labels_N, weights_N, chunk, valid_vocab)
    return (total, loss, correct), residuals


def _fused_bwd(chunk, valid_vocab, residuals, cotangents):
    dx, dw, labels = residuals
    g = cotangents[0]  # the per-token outputs' cotangents are ignored (documented: not differentiable)
    return (
        (dx * g.astype(dx.dtype)).astype(dx.dtype),
        (dw * g.astype(dw.dtype)).astype(dw.dtype),
        np.zeros(labels.shape, jax.dtypes.float0),
        None,  # the weights are constants of the step (the loss scale over the batch): no gradient
    )


fused_token_xent.defvjp(_fused_fwd, _fused_bwd)
