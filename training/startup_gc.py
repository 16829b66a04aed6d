"""Python's cyclic garbage collector during a run's start-up: off while the modules are imported, then frozen.

Importing jax, flax, Hydra and the repository and composing the config leave many objects that the collector
tracks, nearly all of them alive for the whole run; with the collector on, every full collection walks them all,
also inside the training windows. Python's documented idiom (the ``gc.freeze`` docs: "call gc.disable() early
... gc.freeze() ...") is used: ``pause`` at the entry point's first line, ``resume`` once its imports (and
Hydra's composition) are done, which moves every object alive then into the permanent generation that
collections skip and turns the collector back on. The cost: the start-up's garbage not yet collected (Hydra's
composition nodes; no arrays) is kept for the life of the process (docs/internals.md, "The garbage collector
during start-up").

Only ``train.py`` run as the program pauses (not inside an IPython session's ``%run``, whose objects would be
frozen): a library user or a test keeps the collector as it is (``resume`` does nothing unless ``pause`` was
called), and ``train.py`` releases the pause however it ends. A sweep (``-m``) gives the pause up when it starts
(``release``): its process runs as long as its jobs, so it keeps the collector as Python sets it.
"""

from __future__ import annotations

import gc

_paused = False


def pause() -> None:
    """Turns the cyclic collector off until ``resume`` (reference counting still frees everything not in a cycle)."""
    global _paused
    gc.disable()
    _paused = True


def resume() -> None:
    """After ``pause``: freezes every object alive now (``gc.freeze``) and turns the collector back on. Otherwise
    does nothing. Called by ``train.py`` once its imports are done."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()


def release() -> None:
    """After ``pause``: turns the collector back on without freezing anything. Otherwise does nothing. Called when
    a sweep starts (``training.sweep_summary``: a sweep's process runs as long as its jobs, or runs them all itself
    with Hydra's default launcher, so it keeps the collector as Python sets it) and when ``train.py`` ends."""
    global _paused
    if _paused:
        _paused = False
        gc.enable()
