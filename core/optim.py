"""Optimizer and learning-rate schedule (optax)."""

from __future__ import annotations

from typing import Optional

import optax

SCHEDULES = ("constant", "cosine")


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


def make_schedule(peak_lr: float, schedule: str, warmup_steps: int, decay_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to ``peak_lr`` over ``warmup_steps``, then constant or cosine decay to 0 over
    ``decay_steps`` (its own key, never derived from the run length, so a resumed run keeps its schedule).

    Raises:
      ValueError: unknown schedule, or cosine without decay_steps.
    """
    if schedule == "constant":
        main = optax.constant_schedule(peak_lr)
    elif schedule == "cosine":
        if decay_steps <= 0:
            raise ValueError(f"optim.schedule=cosine needs optim.decay_steps > 0 (got {decay_steps})")
        main = optax.cosine_decay_schedule(peak_lr, decay_steps)
    else:
        raise ValueError(f"optim.schedule={schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    if warmup_steps <= 0:
        return main
    warmup = optax.linear_schedule(0.0, peak_lr, warmup_steps)
    return optax.join_schedules([warmup, main], [warmup_steps])


def make_optimizer(
    name: str,
    schedule: optax.ScalarOrSchedule,
    *,
    momentum: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    clip_grad_norm: Optional[float] = None,
) -> optax.GradientTransformation:
    """adam | adamw | sgd with the given schedule (or constant rate), optionally clipped by global norm first.

    Raises:
      ValueError: unknown optimizer name.
    """
    if name == "adam":
        tx = (
            optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
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
