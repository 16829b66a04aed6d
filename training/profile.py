"""Profiler window and the measured communication ratio (placeholder: filled in by the measurement work)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class Profiler:
    """Records a ``jax.profiler`` trace of steps ``[start_step, start_step + num_steps)`` into ``out_dir``.

    ``after_step(done, last_output)`` is called after every dispatched step; ``result()`` returns the
    ``comm/ratio_measured*`` keys once the window has been recorded (empty dict when disabled).
    """

    def __init__(self, enabled: bool, start_step: int, num_steps: int, out_dir: Path, platform: str):
        self.enabled = enabled

    def after_step(self, done: int, last_output: Any) -> None:
        return None

    def result(self) -> dict[str, Any]:
        return {}
