"""W&B's start on a background thread (training/report.py, ``Reporter``) and background imports
(training/background_imports.py), with a stand-in ``wandb`` module that records what is called, on which
thread, in which order."""

from __future__ import annotations

import json
import sys
import threading
import types

import pytest

from training.background_imports import import_in_background
from training.report import Reporter

pytestmark = pytest.mark.unit


class FakeRun:
    def __init__(self, calls, run_dir):
        self.calls, self.id, self.group = calls, "fake0001", "g"
        self.dir = str(run_dir / "wandb" / "offline-run-x-fake0001" / "files")
        self.summary = {}
        self.config = types.SimpleNamespace(update=lambda d, **kw: calls.append(("config", d)))

    def log(self, data, step=None, commit=None):
        self.calls.append(("log", step, dict(data), threading.current_thread().name))

    def finish(self, exit_code=0):
        self.calls.append(("finish", exit_code, threading.current_thread().name))


@pytest.fixture
def fake_wandb(monkeypatch, tmp_path):
    """A ``wandb`` module whose ``init`` waits for ``release`` (a slow W&B start) and records every call."""
    calls: list = []
    release = threading.Event()
    fail = {"init": None}

    def init(mode, settings, **kwargs):
        release.wait(10)
        calls.append(("init", mode, kwargs["project"], threading.current_thread().name))
        if fail["init"]:
            raise fail["init"]
        return FakeRun(calls, tmp_path)

    module = types.ModuleType("wandb")
    module.init, module.Settings = init, lambda **kw: kw
    monkeypatch.setitem(sys.modules, "wandb", module)
    return types.SimpleNamespace(calls=calls, release=release, fail=fail)


def start(reporter: Reporter) -> None:
    reporter.start_wandb("offline", "proj", None, None, "jit-fp32", [], {"a": 1}, init_timeout_s=5)


def test_wandb_starts_in_the_background_and_gets_every_record_in_order(fake_wandb, tmp_path):
    main = threading.current_thread().name
    r = Reporter(tmp_path)
    start(r)  # returns while wandb.init is still waiting
    r.log([{"step": 0, "perf/x": 1.0}])
    r.log([{"step": s, "train/loss": 1.0 / s, "note": "text is left out"} for s in (1, 2)])
    assert fake_wandb.calls == []  # held: the training thread did not wait for W&B
    assert [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    fake_wandb.release.set()
    assert r.wandb_run_id == "fake0001"  # waits for the start, then logs the held records
    assert [c[1] for c in fake_wandb.calls if c[0] == "log"] == [0, 1, 2]
    r.log([{"step": 3, "train/loss": 0.25}])  # after the start: logged at once
    assert fake_wandb.calls[-1] == ("log", 3, {"train/loss": 0.25}, main)
    r.summary({"status": "ok", "eval/accuracy": 0.5})
    assert json.loads((tmp_path / "summary.json").read_text())["wandb/run_id"] == "fake0001"
    r.close(exit_code=0)
    kinds = [c[0] for c in fake_wandb.calls]
    assert kinds == ["init", "log", "log", "log", "log", "log", "finish"]  # 4 records, the summary's commit
    assert fake_wandb.calls[2][2] == {"train/loss": 1.0}
    assert fake_wandb.calls[0][-1] != main and all(c[-1] == main for c in fake_wandb.calls[1:])


def test_failed_wandb_start_fails_the_run_at_its_next_log(fake_wandb, tmp_path):
    fake_wandb.fail["init"] = RuntimeError("no space left for the W&B run")
    r = Reporter(tmp_path)
    start(r)
    r.log([{"step": 0, "perf/x": 1.0}])  # still starting: held
    fake_wandb.release.set()
    r._wandb_start.exception()  # the start has failed
    with pytest.raises(RuntimeError, match="no space left"):
        r.log([{"step": 1, "train/loss": 1.0}])
    r.log([{"step": 2, "train/loss": 1.0}])  # raised once; metrics.jsonl goes on
    assert r.wandb_run_id is None
    r.summary({"status": "failed", "error": "RuntimeError: no space left for the W&B run"})
    r.close(exit_code=1)
    assert "wandb/run_id" not in json.loads((tmp_path / "summary.json").read_text())
    assert [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert [c[0] for c in fake_wandb.calls] == ["init"]


def test_failed_start_seen_first_at_the_end_is_a_warning(fake_wandb, tmp_path, capsys):
    fake_wandb.fail["init"] = RuntimeError("W&B broke")
    fake_wandb.release.set()
    r = Reporter(tmp_path)
    start(r)
    r.summary({"status": "ok"})  # the run's files are complete
    r.close()
    assert json.loads((tmp_path / "summary.json").read_text()) == {"status": "ok"}
    assert "warning: W&B did not start (RuntimeError: W&B broke); no W&B run" in capsys.readouterr().err


def test_background_import_gives_the_module_once():
    future = import_in_background("json")
    assert future.result() is json
    mod = import_in_background("colorsys").result()
    assert mod is sys.modules["colorsys"] and import_in_background("colorsys").result() is mod
