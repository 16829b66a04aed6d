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
