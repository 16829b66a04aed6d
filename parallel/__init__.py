"""Parallel modes behind one interface (``parallel.base.ParallelMode``): one module per mode."""

from __future__ import annotations

from parallel.base import ConfigError, ParallelMode, make_mesh, resolve_mesh_shape
from parallel.fsdp import Fsdp
from parallel.jit_sharding import JitSharding
from parallel.pmap import Pmap
from parallel.shard_map import ShardMap

MODES: dict[str, type[ParallelMode]] = {m.name: m for m in (Pmap, JitSharding, ShardMap, Fsdp)}


def mode_class(name: str) -> type[ParallelMode]:
    """The mode called ``name``. Raises ConfigError listing the known modes."""
    if name not in MODES:
        raise ConfigError(f"parallel.name={name!r} is unknown; choose one of {', '.join(MODES)}")
    return MODES[name]


__all__ = ["ConfigError", "MODES", "ParallelMode", "make_mesh", "mode_class", "resolve_mesh_shape"]
