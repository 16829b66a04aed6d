"""Whether a finished run's final numbers are usable: a diverged run must not report success."""

from __future__ import annotations

import math
from typing import Optional

# The final values a run reports as its result; any of them non-finite means the run diverged.
FINAL_KEYS = ("train/loss", "train/accuracy", "eval/loss", "eval/accuracy")


def nonfinite_final(last_train: dict, final_eval: dict) -> Optional[str]:
    """One-line error naming every non-finite final metric, or None when all are finite.

    Args:
      last_train: the last logged training record (``train/loss``, ``train/accuracy`` ...; may be empty when a
        resumed run trained no step).
      final_eval: the final evaluation (``eval/loss``, ``eval/accuracy``), Python floats.
    """
    values = {
        **{k: last_train[k] for k in FINAL_KEYS if k in last_train},
        **{k: final_eval[k] for k in FINAL_KEYS if k in final_eval},
    }
    bad = {k: v for k, v in values.items() if isinstance(v, (int, float)) and not math.isfinite(v)}
    if not bad:
        return None
    which = ", ".join(f"{k}={v}" for k, v in sorted(bad.items()))
    return (
        f"the run diverged: final {which} is not finite; lower optim.lr, enable optim.clip_grad_norm, "
        f"or, under bf16/fp16, use precision=fp32"
    )


# A final loss this many times the loss of a uniform guess (ln C) has exploded (see ``exploded_final``).
EXPLODED_LOSS_FACTOR = 10.0


def exploded_final(last_train: dict, final_eval: dict, num_classes: int) -> Optional[str]:
    """One-line warning when a final loss is finite but has exploded, else None.

    The reference is the cross-entropy of a uniform guess over ``num_classes`` classes, ln C (2.303 for 10
    classes; an initialised classifier starts near it, and a healthy run ends below it). A final
    ``train/loss`` or ``eval/loss`` above ``EXPLODED_LOSS_FACTOR`` x ln C is reported: far above what a run
    that is still recovering from a high learning rate ends at. The run fails with this line
    (``train.allow_exploded_loss=false``, the default: ``training.hooks.FinalEvaluation``, before the final
    checkpoint) or, when allowed, prints it as a warning and stays ``ok``.
    """
    limit = EXPLODED_LOSS_FACTOR * math.log(num_classes)
    values = {**{k: last_train.get(k) for k in ("train/loss",)}, **{k: final_eval.get(k) for k in ("eval/loss",)}}
    high = {k: v for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v) and v > limit}
    if not high:
        return None
    which = " and ".join(f"{k}={v:.4g}" for k, v in sorted(high.items(), reverse=True))
    return (
        f"warning: the loss exploded: final {which} {'are' if len(high) > 1 else 'is'} above "
        f"{EXPLODED_LOSS_FACTOR:g} x ln({num_classes}) = "
        f"{limit:.3g} (a uniform guess scores ln({num_classes})); lower optim.lr or enable optim.clip_grad_norm"
    )
