"""The loop's pieces without a model: the in-flight bound, hooks called in order with one timer pause, extras
carried to the next logged record, and the size of the loop's functions."""

from __future__ import annotations

import ast
from pathlib import Path

from training.hooks import Hook, LoopState
from training.loop import in_flight_bound, run_hooks

REPO = Path(__file__).resolve().parents[1]


class CountingTimer:
    def __init__(self):
        self.pauses, self.resumes, self.steps = 0, 0, 0

    def pause(self, last_output):
        self.pauses += 1

    def resume(self):
        self.resumes += 1


class Every(Hook):
    def __init__(self, every, name, calls):
        self.every, self.name, self.calls = every, name, calls

    def due(self, step):
        return step % self.every == 0

    def run(self, loop, step):
        self.calls.append((self.name, step))
        loop.extra[self.name] = step


def test_in_flight_bound_applies_only_with_several_devices():
    assert in_flight_bound(1, 2) is None
    assert in_flight_bound(8, 2) == 2
    assert in_flight_bound(2, 5) == 5


def test_due_hooks_run_in_order_with_one_pause():
    calls: list = []
    loop = LoopState(state=None, timer=CountingTimer(), window_records=[(6, "m6")])
    hooks = [Every(2, "a", calls), Every(3, "b", calls), Every(5, "c", calls)]
    run_hooks(hooks, loop, 6)
    assert calls == [("a", 6), ("b", 6)]
    assert (loop.timer.pauses, loop.timer.resumes) == (1, 1)
    # nothing logged this step: the extras ride on the window's last record
    assert loop.window_records == [(6, ("m6", {"a": 6, "b": 6}))] and loop.extra == {}


def test_no_pause_when_no_hook_is_due():
    loop = LoopState(state=None, timer=CountingTimer(), window_records=[(7, "m7")])
    run_hooks([Every(2, "a", []), Every(3, "b", [])], loop, 7)
    assert (loop.timer.pauses, loop.timer.resumes) == (0, 0)
    assert loop.window_records == [(7, "m7")]


def test_loop_functions_are_short():
    longest = {}
    for name in ("run", "loop", "hooks", "prepare", "signals"):
        tree = ast.parse((REPO / "training" / f"{name}.py").read_text())
        longest[name] = max(n.end_lineno - n.lineno + 1 for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
    assert max(longest.values()) <= 80, longest
