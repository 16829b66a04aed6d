"""Parallel modes behind one interface (``parallel.base.ParallelMode``): one module per mode, looked up by name."""

from __future__ import annotations

from core.errors import ConfigError
from parallel.base import ParallelMode, make_mesh, resolve_mesh_shape
from parallel.fsdp import Fsdp
from parallel.jit_sharding import JitSharding, ShardMap
from parallel.pmap import Pmap

MODES: dict[str, type[ParallelMode]] = {m.name: m for m in (Pmap, JitSharding, ShardMap, Fsdp)}


def mode_class(name: str) -> type[ParallelMode]:
    """The mode called ``name``. Raises ConfigError listing the known modes."""
    if name not in MODES:
        raise ConfigError(f"parallel.name={name!r} is unknown; choose one of {', '.join(MODES)}")
    return MODES[name]


__all__ = ["MODES", "ParallelMode", "make_mesh", "mode_class", "resolve_mesh_shape"]
