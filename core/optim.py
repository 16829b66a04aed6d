"""Optimizer and learning-rate schedule (optax)."""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax

SCHEDULES = ("constant", "cosine")
WEIGHT_DECAY_MASKS = ("all", "matrices")


def effective_lr(lr: float, lr_scaling: str, global_batch: int, base_batch: int) -> float:
    """Peak learning rate. ``lr_scaling='linear'``: lr * global_batch / base_batch (Goyal et al. 2017,
    "Accurate, Large Minibatch SGD", the linear scaling rule); ``'none'``: lr.

    Raises:
      ValueError: unknown scaling rule.
    """
    if lr_scaling == "none":
        return lr
    if lr_scaling == "linear":
        return lr * global_batch / base_batch
    raise ValueError(f"optim.lr_scaling={lr_scaling!r} is unknown; choose none or linear")


def make_schedule(
    peak_lr: float, schedule: str, warmup_steps: int, decay_steps: int, min_lr: float = 0.0
) -> optax.Schedule:
    """Linear warmup from 0 to ``peak_lr`` over ``warmup_steps``, then constant or cosine decay to ``min_lr`` over
    ``decay_steps`` (its own key, never derived from the run length, so a resumed run keeps its schedule), then
    ``min_lr`` (nanoGPT's shape: it decays to lr/10).

    The cosine part is ``peak_lr * c + min_lr * (1 - c)``, ``c = 0.5 * (1 + cos(pi * t / decay_steps))`` with ``t``
    clipped at ``decay_steps``, so it starts at ``peak_lr`` and from ``decay_steps`` on is ``min_lr``, exactly (as
    float32); with ``min_lr=0`` it is ``optax.cosine_decay_schedule``'s value bit for bit (runs made before
    ``min_lr`` existed are unchanged).

    Raises:
      ValueError: unknown schedule, cosine without decay_steps, ``min_lr`` outside [0, peak_lr], or ``min_lr`` > 0
        with the constant schedule (it never decays).
    """
    if not (math.isfinite(min_lr) and 0 <= min_lr):
        raise ValueError(f"optim.min_lr={min_lr} is out of range; it must be a finite value >= 0")
    if schedule == "constant":
        if min_lr > 0:
            raise ValueError(
                f"optim.min_lr={min_lr} is the floor of a decaying schedule, but optim.schedule=constant never decays; "
                f"set optim.schedule=cosine (with optim.decay_steps) or optim.min_lr=0"
            )
        main = optax.constant_schedule(peak_lr)
    elif schedule == "cosine":
        if decay_steps <= 0:
            raise ValueError(f"optim.schedule=cosine needs optim.decay_steps > 0 (got {decay_steps})")
        if min_lr > peak_lr:
            raise ValueError(
                f"optim.min_lr={min_lr} is above the peak learning rate {peak_lr:g} (optim.lr, after "
                f"optim.lr_scaling); lower optim.min_lr (nanoGPT: lr/10)"
            )
        main = (
            optax.cosine_decay_schedule(peak_lr, decay_steps)
            if min_lr == 0
            else _cosine_to(peak_lr, min_lr, decay_steps)
        )
    else:
        raise ValueError(f"optim.schedule={schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    if warmup_steps <= 0:
        return main
    warmup = optax.linear_schedule(0.0, peak_lr, warmup_steps)
    return optax.join_schedules([warmup, main], [warmup_steps])


def _cosine_to(peak_lr: float, min_lr: float, decay_steps: int) -> optax.Schedule:
    """Cosine decay from ``peak_lr`` to ``min_lr`` over ``decay_steps``, then ``min_lr`` (the cosine term computed
    as ``optax.cosine_decay_schedule`` computes it: it is exactly 0 from ``decay_steps`` on)."""

    def schedule(count):
        t = jnp.minimum(count, float(decay_steps))
        cosine = 0.5 * (1 + jnp.cos(jnp.pi * t / float(decay_steps)))
        return peak_lr * cosine + min_lr * (1 - cosine)  # exactly peak_lr at 0 and min_lr from decay_steps on

    return schedule


def decay_mask(kind: Optional[str]):
    """The ``mask`` of ``optax.adamw`` for ``optim.weight_decay_mask``: ``all`` -> None (every parameter is decayed);
    ``matrices`` (also None: the default of a new run) -> a function of the params marking the tensors of 2 or more
    dimensions (kernels and embeddings; not biases or norm scales: nanoGPT's rule).

    Raises:
      ValueError: an unknown kind.
    """
    if kind == "all":
        return None
    if kind not in (None, "matrices"):
        raise ValueError(f"optim.weight_decay_mask={kind!r} is unknown; choose one of {', '.join(WEIGHT_DECAY_MASKS)}")

    def matrices(params: Any) -> Any:
        return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)

    return matrices


def make_optimizer(
    name: str,
    schedule: optax.ScalarOrSchedule,
    *,
    momentum: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mask: Optional[str] = None,
    clip_grad_norm: Optional[float] = None,
) -> optax.GradientTransformation:
    """adam | adamw | sgd with the given schedule (or constant rate), optionally clipped by global norm first.
    ``weight_decay_mask``: which parameters AdamW decays (``decay_mask``; None: matrices).

    Raises:
      ValueError: unknown optimizer name or weight-decay mask.
    """
    if name == "adam":
        mask = decay_mask(weight_decay_mask)
        tx = (
            optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=mask)
            if weight_decay
            else optax.adam(schedule, b1=b1, b2=b2, eps=eps)
        )
    elif name == "sgd":
        tx = optax.sgd(schedule, momentum=momentum or None)
    else:
        raise ValueError(f"optim.name={name!r} is unknown; choose adam or sgd")
    if clip_grad_norm:
        tx = optax.chain(optax.clip_by_global_norm(clip_grad_norm), tx)
    return tx
