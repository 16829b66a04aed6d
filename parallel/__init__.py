"""Parallel modes behind one interface (``parallel.base.ParallelMode``): one module per mode.

Imported lazily (PEP 562) so that ``conf.schema`` can read ``parallel.options`` without importing jax."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from parallel.base import ConfigError, ParallelMode, make_mesh, resolve_mesh_shape

_FROM_BASE = ("ConfigError", "ParallelMode", "make_mesh", "resolve_mesh_shape")


def _modes() -> dict[str, type[ParallelMode]]:
    from parallel.fsdp import Fsdp
    from parallel.jit_sharding import JitSharding, ShardMap
    from parallel.pmap import Pmap

    return {m.name: m for m in (Pmap, JitSharding, ShardMap, Fsdp)}


def mode_class(name: str) -> type[ParallelMode]:
    """The mode called ``name``. Raises ConfigError listing the known modes."""
    from parallel.base import ConfigError

    modes = _modes()
    if name not in modes:
        raise ConfigError(f"parallel.name={name!r} is unknown; choose one of {', '.join(modes)}")
    return modes[name]


def __getattr__(name: str) -> Any:
    if name in _FROM_BASE:
        return getattr(importlib.import_module("parallel.base"), name)
    if name == "MODES":
        return _modes()
    raise AttributeError(f"module 'parallel' has no attribute {name!r}")


__all__ = ["ConfigError", "MODES", "ParallelMode", "make_mesh", "mode_class", "resolve_mesh_shape"]
