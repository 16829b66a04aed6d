"""Imports on one background thread, so that a library a run needs only later (orbax, for its first checkpoint)
loads while it trains.

All background imports of a process run on the same single thread, in the order asked: two background threads
never import at once (a concurrent circular import across threads would hand one of them a partially initialised
module; with one thread only the training thread can race it, and it imports nothing new while it trains).
"""

from __future__ import annotations

import importlib
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from types import ModuleType
from typing import Optional

_POOL: Optional[ThreadPoolExecutor] = None
_FUTURES: dict[str, Future] = {}


def import_in_background(name: str) -> "Future[ModuleType]":
    """Starts ``importlib.import_module(name)`` on the background import thread (once per name and process) and
    returns its future; ``.result()`` is the module (or raises the import's error). A module already imported
    gives a finished future."""
    global _POOL
    module = sys.modules.get(name)
    if module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False):
        done: Future = Future()
        done.set_result(module)
        return done
    if name in _FUTURES:
        return _FUTURES[name]
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="imports")
    _FUTURES[name] = _POOL.submit(importlib.import_module, name)
    return _FUTURES[name]
