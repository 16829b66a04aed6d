"""The private JAX APIs this project uses, in one place (pinned: jax 0.10.2; ``tests/test_layers.py`` checks
that each resolves). Each accessor returns None when the private module moved, and callers fall back."""

from __future__ import annotations

from types import ModuleType
from typing import Optional


def xla_bridge() -> Optional[ModuleType]:
    """``jax._src.xla_bridge`` (its ``_backends`` dict tells whether a backend started), or None."""
    try:
        from jax._src import xla_bridge as module
    except ImportError:
        return None
    return module


def clusters() -> Optional[ModuleType]:
    """``jax._src.clusters`` (JAX's cluster detectors: SLURM, Open MPI, Cloud TPU, GKE, Kubernetes), or None."""
    try:
        from jax._src import clusters as module
    except ImportError:
        return None
    return module


def cloud_tpu_init() -> Optional[ModuleType]:
    """``jax._src.cloud_tpu_init`` (tells whether this host is a Cloud TPU VM), or None."""
    try:
        from jax._src import cloud_tpu_init as module
    except ImportError:
        return None
    return module


def distributed_client():
    """JAX's coordination service client of this process (``jax._src.distributed.global_state.client``: its
    key-value store), or None (not initialised, or the private module moved)."""
    try:
        from jax._src.distributed import global_state
    except ImportError:
        return None
    return global_state.client


def backend_started() -> bool:
    """Whether a JAX backend has been initialised in this process (then device settings are fixed).

    When the private API moved this answers True, so settings are never changed under a live backend.
    """
    module = xla_bridge()
    try:
        return bool(module._backends) if module is not None else True
    except AttributeError:
        return True
