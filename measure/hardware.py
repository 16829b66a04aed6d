"""Hardware profiles: the numbers of ``conf/hardware/<name>.yaml`` as plain dicts.

A profile describes one target machine (see each file's ``source`` for the documents the numbers come from):

* ``peak_flops_per_s``: dense bf16 peak of one device (FLOP/s), the denominator of MFU;
  ``peak_flops_per_s_float32``: the dense float32 (TF32 on NVIDIA) peak, used for float32 runs found by device kind;
* ``devices_per_node``: devices that share the fast intra-node fabric (NVLink/NVSwitch; an ICI pod on TPU);
* ``intra_node_bytes_per_s`` / ``inter_node_bytes_per_s``: bandwidth per device, one direction (bytes/s);
* ``latency_s``: latency of one collective step (s);
* ``link_bytes_per_s``: the bandwidth of ``comm/ratio_model`` (= ``intra_node_bytes_per_s`` in every profile);
* ``device_kinds``: lower-case substrings of ``jax.Device.device_kind`` that select the profile by default.

The same files are Hydra's config group ``hardware`` for ``train.py`` (``hardware=h100_sxm``) and the
``--hardware`` choices of ``python -m sweeps.project``; this module reads them with OmegaConf only, so it
imports neither JAX nor Hydra.
"""

from __future__ import annotations

import functools

from pathlib import Path
from typing import Any, Optional, cast

from omegaconf import OmegaConf

PROFILE_DIR = Path(__file__).resolve().parent.parent / "conf" / "hardware"

# Numeric fields of a profile (all optional; null = unknown) and their types.
NUMERIC_FIELDS: dict[str, type] = {
    "peak_flops_per_s": float,
    "peak_flops_per_s_float32": float,
    "devices_per_node": int,
    "intra_node_bytes_per_s": float,
    "inter_node_bytes_per_s": float,
    "latency_s": float,
    "link_bytes_per_s": float,
}


class HardwareError(ValueError):
    """A profile name, field or value that cannot be used; the message is one line naming the fix."""


def profile_names(profile_dir: Path = PROFILE_DIR) -> list[str]:
    """Sorted names of the profiles (``conf/hardware/*.yaml`` without the suffix)."""
    return sorted(p.stem for p in profile_dir.glob("*.yaml"))


def load_profile(name: str, profile_dir: Path = PROFILE_DIR) -> dict[str, Any]:
    """The profile ``name`` as a dict with every key of :data:`NUMERIC_FIELDS` (None when unset) plus
    ``name``, ``source`` and ``device_kinds``; interpolations (``link_bytes_per_s``) are resolved.

    Raises :class:`HardwareError` (listing the choices) when there is no ``conf/hardware/<name>.yaml``.
    """
    path = profile_dir / f"{name}.yaml"
    if not name or "/" in name or not path.is_file():
        raise HardwareError(f"unknown hardware profile {name!r}; choices: {', '.join(profile_names(profile_dir))}")
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    out: dict[str, Any] = {"name": name, "source": "", "device_kinds": []}
    out.update({key: None for key in NUMERIC_FIELDS})
    out.update(cast(dict[str, Any], raw) or {})  # a profile file is a mapping
    return out


def set_field(profile: dict[str, Any], key: str, value: str) -> dict[str, Any]:
    """A copy of ``profile`` with ``key`` set from the text ``value`` (``"100e9"``, ``"8"``, ``"null"``).

    Setting ``intra_node_bytes_per_s`` also sets ``link_bytes_per_s`` (the profiles tie them together).
    Raises :class:`HardwareError` for an unknown key or a value that is not a positive number.
    """
    if key not in NUMERIC_FIELDS:
        raise HardwareError(
            f"unknown hardware field {key!r} in --set {key}={value}; fields: {', '.join(NUMERIC_FIELDS)}"
        )
    out = dict(profile)
    if value.strip().lower() in ("null", "none"):
        parsed: Optional[float] = None
    else:
        try:
            number = float(value)
        except ValueError:
            number = float("nan")
        kind = NUMERIC_FIELDS[key]
        ok = number == number and number >= 0 and (kind is float or number == int(number))
        if key != "latency_s" and ok:
            ok = number > 0
        if not ok:
            what = (
                "a positive integer"
                if kind is int
                else ("a number >= 0" if key == "latency_s" else "a positive number")
            )
            raise HardwareError(f"--set {key}={value}: {key} must be {what} (or null)")
        parsed = int(number) if kind is int else number
    out[key] = parsed
    if key == "intra_node_bytes_per_s":
        out["link_bytes_per_s"] = parsed
    return out


def profile_for_device_kind(device_kind: str, profile_dir: Path = PROFILE_DIR) -> Optional[dict[str, Any]]:
    """The profile whose ``device_kinds`` has a substring of ``device_kind`` (case-insensitive), or None.

    The longest matching substring wins (so ``"gh200"`` beats a shorter pattern). E.g. ``"NVIDIA H100 80GB
    HBM3"`` -> ``h100_sxm``, ``"TPU v5 lite"`` -> ``tpu_v5e``, ``"cpu"`` -> ``cpu`` (whose numbers are null).
    """
    profile = _profile_for_device_kind(device_kind.lower(), profile_dir)
    return None if profile is None else dict(profile)


@functools.lru_cache(maxsize=None)
def _profile_for_device_kind(kind: str, profile_dir: Path) -> Optional[dict[str, Any]]:
    """``profile_for_device_kind``, read once per process (a run asks three times; each reads every profile)."""
    best: tuple[int, Optional[dict[str, Any]]] = (0, None)
    for name in profile_names(profile_dir):
        profile = load_profile(name, profile_dir)
        for pattern in profile.get("device_kinds") or []:
            if pattern.lower() in kind and len(pattern) > best[0]:
                best = (len(pattern), profile)
    return best[1]


def describes_device(name: str, device_kinds: Optional[list[str]], device_kind: str, platform: str) -> bool:
    """Whether the numbers of hardware profile ``name`` (a ``conf/hardware`` name; ``auto`` for the detected one)
    describe the device that ran (``jax.Device.device_kind`` and ``platform``). Only then may a ratio of a profile's
    number to a time measured on that device (``comm/ratio_model``, ``perf/mfu``) be formed.

    * CPU (simulated devices): never; they have no interconnect and no accelerator peak (``conf/hardware/cpu.yaml``).
    * A profile of a device (``h100_sxm``, ``tpu_v5e``, ...): when it is the profile the device kind selects
      (``profile_for_device_kind``: the longest pattern, so ``tpu_v5p``'s ``tpu v5`` does not claim a v5e).
    * ``auto``, ``custom``, ``none``: numbers of the detected profile or given by hand for this device; with
      ``device_kinds`` (e.g. ``hardware.device_kinds=[mi300]``) only on a matching device.
    """
    if platform.lower() == "cpu":
        return False
    found = profile_for_device_kind(device_kind)
    if found is not None and found["name"] == name:
        return True
    if name in profile_names() and load_profile(name)["device_kinds"]:
        return False  # another device's profile
    kinds = [k.lower() for k in device_kinds or []]
    return not kinds or any(k in device_kind.lower() for k in kinds)
