"""The loop's pieces without a model: the in-flight bound, hooks called in order with one timer pause, extras
carried to the next logged record, the final evaluation ahead of the final save, and the size of the loop's
functions."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

import training.build
import training.run
from core.errors import ConfigError, TrainingError
from measure.throughput import TargetTracker
from training.hooks import FinalEvaluation, Hook, LoopState
from training.build import in_flight_bound
from training.run import run_hooks, train_loop

pytestmark = pytest.mark.unit  # all in-process and quick: make test-unit runs them

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
    loop_modules = [REPO / "training" / f"{n}.py" for n in ("run", "hooks", "build", "process")]
    checkpoint_modules = sorted((REPO / "training" / "checkpoint").glob("*.py"))
    assert len(checkpoint_modules) >= 5
    longest = {}
    for path in loop_modules + checkpoint_modules:
        tree = ast.parse(path.read_text())
        lengths = [n.end_lineno - n.lineno + 1 for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
        longest[str(path.relative_to(REPO))] = max(lengths, default=0)
    assert max(longest.values()) <= 80, longest


class Count:
    """A train state stand-in: ``params`` is the step count."""

    def __init__(self, params):
        self.params = params


class FakeStep:
    """A compiled step stand-in: the state counts steps, metrics are a token naming the step."""

    def __call__(self, state, batch):
        return Count(state.params + 1), f"out{state.params + 1}"


def run_fake_loop(monkeypatch, bound, n_steps=5, hooks=()):
    waited: list = []
    monkeypatch.setattr(training.run.jax, "block_until_ready", lambda x: waited.append(x) or x)
    loop = LoopState(state=Count(0), timer=CountingTimer())
    train_loop(
        FakeStep(),
        loop,
        "b0",
        iter(["b"] * n_steps),
        start=0,
        n_steps=n_steps,
        hooks=list(hooks),
        bound=bound,
        transfer_guard="allow",
    )
    return loop, waited


def test_loop_waits_on_older_steps_only_when_bounded(monkeypatch):
    # several devices (bound 2): after dispatching step t the loop waits for step t-2's output
    loop, waited = run_fake_loop(monkeypatch, in_flight_bound(8, 2))
    assert loop.state.params == 5 and waited == ["out1", "out2", "out3"]
    # one device: no host round trip per step
    loop, waited = run_fake_loop(monkeypatch, in_flight_bound(1, 2))
    assert loop.state.params == 5 and waited == []


class Saves(Hook):
    """Records the steps a checkpoint hook would save (every step)."""

    def __init__(self):
        self.saved: list[int] = []

    def due(self, step):
        return True

    def run(self, loop, step):
        self.saved.append(step)


class Records:
    enabled = True

    def __init__(self):
        self.records: list[dict] = []

    def log(self, records):
        self.records += records


class NoProfile:
    def result(self):
        return {"profile/dir": "x", "profile/step_time_s": 0.5}


def test_nonfinite_final_evaluation_stops_before_the_final_save(monkeypatch):
    reporter, saves = Records(), Saves()
    final = FinalEvaluation(
        lambda params: {"eval/loss": float("inf"), "eval/accuracy": 0.1}, 3, reporter, TargetTracker(None), NoProfile()
    )
    with pytest.raises(TrainingError, match="the run diverged: final eval/loss=inf is not finite"):
        run_fake_loop(monkeypatch, None, n_steps=3, hooks=[final, saves])
    assert saves.saved == [1, 2]  # the periodic saves stay; the final one is never written
    (record,) = reporter.records  # written before the error, with the profile's numbers
    assert record["step"] == 3 and math.isinf(record["eval/loss"]) and record["profile/step_time_s"] == 0.5
    assert "profile/dir" not in record


def test_finite_final_evaluation_is_kept_and_the_final_save_follows(monkeypatch):
    reporter, saves, target = Records(), Saves(), TargetTracker(0.5)
    final = FinalEvaluation(lambda params: {"eval/loss": 0.3, "eval/accuracy": 0.9}, 3, reporter, target, NoProfile())
    loop, _ = run_fake_loop(monkeypatch, None, n_steps=3, hooks=[final, saves])
    assert saves.saved == [1, 2, 3] and loop.final == {"eval/loss": 0.3, "eval/accuracy": 0.9}
    assert target.summary()["train/steps_to_target"] == 3


class Closing(Hook):
    """Raises ``on_run`` at step ``at`` and ``on_close`` from ``close``; records that it was closed."""

    def __init__(self, closed: list, name: str, *, at=None, on_run=None, on_close=None):
        self.closed, self.name, self.at, self.on_run, self.on_close = closed, name, at, on_run, on_close

    def due(self, step):
        return step == self.at

    def run(self, loop, step):
        raise self.on_run

    def close(self):
        self.closed.append(self.name)
        if self.on_close is not None:
            raise self.on_close


def test_a_failing_close_neither_hides_the_runs_error_nor_skips_the_other_hooks(monkeypatch, capsys):
    """The run's error (here a SIGTERM stop) stays the error; a hook's close that fails after it is one ``warning:``
    line, and every later hook is still closed (its signal handlers released, its last save awaited)."""
    closed: list = []
    stop = TrainingError("stopped by SIGTERM after step 2 of 5; checkpoint saved in ckpt/2")
    hooks = [
        Closing(closed, "first", at=2, on_run=stop, on_close=OSError(28, "No space left on device")),
        Closing(closed, "second"),
    ]
    with pytest.raises(TrainingError, match="stopped by SIGTERM after step 2"):
        run_fake_loop(monkeypatch, None, hooks=hooks)
    assert closed == ["first", "second"]
    err = capsys.readouterr().err
    assert "warning: closing Closing failed after the run's error: OSError: [Errno 28] No space left on device" in err


def test_a_failing_close_is_raised_after_every_hook_is_closed(monkeypatch, capsys):
    """Without an error in flight the first close error is the run's error, raised once every hook is closed; a
    second one is a ``warning:`` line."""
    closed: list = []
    hooks = [
        Closing(closed, "first", on_close=OSError(28, "No space left on device")),
        Closing(closed, "second", on_close=RuntimeError("profiler trace not written")),
        Closing(closed, "third"),
    ]
    with pytest.raises(OSError, match="No space left"):
        run_fake_loop(monkeypatch, None, hooks=hooks)
    assert closed == ["first", "second", "third"]
    assert "warning: closing Closing also failed: RuntimeError: profiler trace not written" in capsys.readouterr().err


class FakeDevice:
    def __init__(self, platform):
        self.platform = platform


def test_steps_in_flight_are_bounded_on_cpu_devices_only():
    """More than ``CPU_MAX_IN_FLIGHT`` steps in flight is refused for several CPU devices (XLA:CPU's collectives
    stalled until a timeout aborted the process), allowed for one CPU device and for any GPU or TPU count."""
    cpu8, gpu8 = [FakeDevice("cpu")] * 8, [FakeDevice("gpu")] * 8
    training.build.check_in_flight(training.build.CPU_MAX_IN_FLIGHT, cpu8)
    training.build.check_in_flight(64, cpu8[:1])
    training.build.check_in_flight(64, gpu8)
    with pytest.raises(
        ConfigError, match=r"^train.max_in_flight=9 with 8 CPU devices: .* use train.max_in_flight=8 or less$"
    ):
        training.build.check_in_flight(9, cpu8)


def test_a_ctrl_c_while_closing_stops_at_once(monkeypatch):
    """A ``KeyboardInterrupt`` from a hook's close propagates at once (a user who presses Ctrl-C while the run
    waits for its last save does not wait for the other hooks too)."""
    closed: list = []
    hooks = [Closing(closed, "first", on_close=KeyboardInterrupt()), Closing(closed, "second")]
    with pytest.raises(KeyboardInterrupt):
        run_fake_loop(monkeypatch, None, hooks=hooks)
    assert closed == ["first"]
