"""Rates of a logging window from its step time and the compiled step's static figures."""

from __future__ import annotations

import math
from typing import Optional


def comm_time_model_s(comm_bytes_per_step: float, link_bytes_per_s: float) -> float:
    """Lower bound of a step's communication time [s]: ring-model bytes each device sends per step
    (``comm/bytes_per_step``) / per-direction link bandwidth [bytes/s]."""
    return comm_bytes_per_step / link_bytes_per_s


def comm_ratio_model(time_model_s: float, step_time_s: float) -> float:
    """``comm/ratio_model`` = modelled communication time / measured step time (both seconds)."""
    return time_model_s / step_time_s


def mfu(flops_per_step_per_device: float, step_time_s: float, peak_flops_per_s: float) -> float:
    """Model FLOP utilisation: FLOPs of one step on one device (``compiled.cost_analysis()``, a multiply-add
    counts 2) / step time [s] / the device's dense peak FLOP/s."""
    return flops_per_step_per_device / step_time_s / peak_flops_per_s


def window_perf(
    step_time_s: float, global_batch: int, num_devices: int, info: dict, peak_flops_per_s: Optional[float]
) -> dict[str, float]:
    """The ``perf/*`` (and ``comm/ratio_model``, ``perf/mfu`` where known) keys of one logging window.

    Args:
      step_time_s: mean wall time of the window's steps [s].
      global_batch: examples per optimizer step.
      num_devices: devices of the mesh.
      info: the run's static figures (``comm/time_model_s``, ``perf/flops_per_step_per_device`` when known;
        ``hardware/matches_device`` false: the profile is another device's, so no ``comm/ratio_model``).
      peak_flops_per_s: the device's dense peak FLOP/s, or None (no MFU).
    """
    perf = {
        "perf/step_time_s": step_time_s,
        "perf/examples_per_s": global_batch / step_time_s,
        "perf/examples_per_s_per_device": global_batch / step_time_s / num_devices,
        "mesh/devices": num_devices,
    }
    if "comm/time_model_s" in info and info.get("hardware/matches_device", True):
        perf["comm/ratio_model"] = comm_ratio_model(info["comm/time_model_s"], step_time_s)
    if peak_flops_per_s and "perf/flops_per_step_per_device" in info:
        perf["perf/mfu"] = mfu(info["perf/flops_per_step_per_device"], step_time_s, peak_flops_per_s)
    if "train/tokens_per_example" in info:
        perf.update(token_rates({**info, **perf}))
    return perf


def token_rates(figures: dict) -> dict[str, float]:
    """``perf/tokens_per_s*`` = the ``perf/examples_per_s*`` figures of ``figures`` times
    ``train/tokens_per_example`` (a language model's window length T: every example has T target tokens);
    empty when ``figures`` has no ``train/tokens_per_example``."""
    t = figures.get("train/tokens_per_example")
    if not t:
        return {}
    return {
        key.replace("examples_per_s", "tokens_per_s"): value * t
        for key, value in figures.items()
        if key.startswith("perf/examples_per_s") and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def perplexity(loss_nats: float) -> float:
    """``exp(loss)`` of a mean per-token loss in nats (inf when it overflows)."""
    return math.exp(loss_nats) if loss_nats < 700 else math.inf
