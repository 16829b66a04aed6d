"""W&B in its own process (tracking/wandb_process.py): the same offline run as in-process W&B, its lifetime
(no run before ``init``, a crashed run when the training process dies, signals ignored), errors surfaced in the
training process, and a training run that never imports wandb."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tracking import wandb_process
from training.report import Reporter
from tracking.wandb_process import WandbProcess
from utils import modules_probe_cmd
from wandb_reader import assert_history_matches_metrics, offline_runs, read_run, records

REPO = Path(__file__).resolve().parents[1]
SETTINGS = dict(init_timeout=60.0, console="off", x_disable_stats=True, silent=True)


def init_kwargs(run_dir: Path, **extra) -> dict:
    return dict(project="p", entity=None, group="g", job_type="j", tags=["t"], config={"a": 1, "b": [1, 2]},
                dir=str(run_dir), reinit="finish_previous", **extra)  # fmt: skip


def exit_code(run_dir: str):
    (path,) = [os.path.join(run_dir, f) for f in os.listdir(run_dir) if f.endswith(".wandb")]
    exits = [r.exit.exit_code for r in records(path) if r.WhichOneof("record_type") == "exit"]
    return exits[-1] if exits else None


def test_the_w_and_b_process_writes_the_calls_it_is_sent(tmp_path, wandb_env):
    """init, log, config, summary and finish arrive in order: the offline run holds exactly what was sent, under
    the id ``init`` returned at once (before W&B started)."""
    proc = WandbProcess()
    run_id = proc.init("offline", init_kwargs(tmp_path), SETTINGS)
    assert len(run_id) == 8 and run_id.isalnum() and run_id == run_id.lower()
    for step in range(3):
        proc.log({"train/loss": 0.5 / (step + 1), "train/accuracy": step / 4}, step)
    proc.config_update({"resumed": {"step": 7}})
    proc.summary_update({"eval/accuracy": 0.75, "status": "ok"})
    started = proc.started()
    assert started["id"] == run_id and started["mode"] == "offline" and started["group"] == "g"
    assert proc.finish(0) == [] and proc.proc.returncode == 0
    (run_dir,) = offline_runs(tmp_path)
    assert os.path.realpath(started["dir"]) == os.path.realpath(run_dir) and run_dir.endswith(run_id)
    wb = read_run(run_dir)
    assert wb["run"].run_id == run_id and wb["run"].run_group == "g" and list(wb["run"].tags) == ["t"]
    rows = [(r["_step"], r["train/loss"], r["train/accuracy"]) for r in wb["history"]]
    assert rows == [(0, 0.5, 0.0), (1, 0.25, 0.25), (2, 0.5 / 3, 0.5)]
    assert wb["config"]["a"] == 1 and wb["config"]["b"] == [1, 2] and wb["config"]["resumed"] == {"step": 7}
    assert wb["summary"]["eval/accuracy"] == 0.75 and wb["summary"]["status"] == "ok"
    assert exit_code(run_dir) == 0


def test_a_process_that_gets_no_init_creates_nothing(tmp_path, wandb_env, monkeypatch):
    """``prestart`` then a run that stops before W&B (bad input): the process exits, no W&B folder anywhere."""
    monkeypatch.chdir(tmp_path)
    wandb_process.prestart()
    proc = wandb_process._prestarted
    assert proc is not None and proc.proc.poll() is None
    wandb_process.discard_prestarted()
    assert wandb_process.take_prestarted() is None and proc.proc.returncode == 0
    assert sorted(p.name for p in tmp_path.rglob("*") if "wandb" in p.name.lower() and p.is_dir()) == [
        "wandb_cache_dir",
        "wandb_config_dir",
        "wandb_data_dir",
        "wandb_dir",
    ]  # the fixture's empty folders only
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_end_of_input_without_finish_finishes_the_run_as_crashed(tmp_path, wandb_env):
    """The training process died (its end of the pipe closed): the records sent so far are kept, exit code 1."""
    proc = WandbProcess()
    proc.init("offline", init_kwargs(tmp_path), SETTINGS)
    proc.log({"train/loss": 1.0}, 0)
    proc.log({"train/loss": 0.5}, 1)
    proc.flush()  # (what the training process still held when it died would be lost)
    proc.close_input()
    assert proc.proc.wait(timeout=120) == 0
    (run_dir,) = offline_runs(tmp_path)
    assert [r["_step"] for r in read_run(run_dir)["history"]] == [0, 1]
    assert exit_code(run_dir) == 1


def test_the_w_and_b_process_is_started_with_sigint_and_sigterm_blocked(monkeypatch):
    """The W&B process inherits SIGINT, SIGTERM and SIGHUP blocked (a Ctrl-C during its own imports would print their
    traceback; it ignores them once it runs): blocked while it is started, the handlers never touched (one installed
    outside Python, JAX's preemption notifier, would be lost), and the mask is back afterwards, also when the start
    fails."""
    seen = {}

    def popen(*args, **kwargs):
        seen["mask"] = signal.pthread_sigmask(signal.SIG_BLOCK, set())
        seen["handlers"] = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
        raise OSError("no process started")

    monkeypatch.setattr(wandb_process.subprocess, "Popen", popen)
    handler = lambda signum, frame: None  # noqa: E731
    previous = signal.signal(signal.SIGTERM, handler)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    try:
        with pytest.raises(OSError, match="no process started"):
            WandbProcess()
        assert {signal.SIGINT, signal.SIGTERM, signal.SIGHUP} <= seen["mask"]
        assert seen["handlers"] == [signal.default_int_handler, handler]  # untouched
        assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == before
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_summary_is_written_when_a_ctrl_c_comes_while_w_and_b_starts(tmp_path, monkeypatch):
    """Writing summary.json waits for W&B's start (its run id goes in); a Ctrl-C in that wait still leaves the
    summary, without W&B's run, and the interrupt goes on."""

    def interrupted_wait(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(Reporter, "wandb_info", property(interrupted_wait))
    reporter = Reporter(tmp_path, enabled=True)
    with pytest.raises(KeyboardInterrupt):
        reporter.summary({"status": "ok", "eval/accuracy": 0.5})
    assert json.loads((tmp_path / "summary.json").read_text()) == {"status": "ok", "eval/accuracy": 0.5}


def test_sigint_and_sigterm_do_not_stop_the_w_and_b_process(tmp_path, wandb_env):
    """A Ctrl-C or a scheduler's SIGTERM reaches the whole process group: the W&B process stays until the
    training process finishes the run with its own exit code."""
    proc = WandbProcess()
    proc.init("offline", init_kwargs(tmp_path), SETTINGS)
    proc.log({"x": 1.0}, 0)
    proc.flush()
    assert proc.started() is not None
    proc.proc.send_signal(signal.SIGINT)
    proc.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert proc.proc.poll() is None
    proc.log({"x": 2.0}, 1)
    assert proc.finish(2) == []
    (run_dir,) = offline_runs(tmp_path)
    assert [r["x"] for r in read_run(run_dir)["history"]] == [1.0, 2.0] and exit_code(run_dir) == 2


def test_a_failed_init_is_one_warning_and_the_run_goes_on_without_w_and_b(tmp_path, wandb_env, caplog, capsys):
    """``wandb.init`` failing in the W&B process (here a setting W&B refuses; train.py refuses such a tag at start,
    a library user of Reporter meets W&B's error): one warning with W&B's message, no W&B run, every record in
    metrics.jsonl, ``wandb/error`` in the summary."""
    reporter = Reporter(tmp_path)
    reporter.start_wandb("offline", "p", None, None, "j", ["t" * 70], {}, init_timeout_s=60.0)
    assert reporter.wandb_run_id is not None
    reporter.log([{"step": 0, "x": 1.0}])
    info = reporter.wandb_info  # waits for the W&B process: init failed
    assert list(info) == ["wandb/error"] and info["wandb/error"].startswith("W&B init: ValidationError: ")
    assert "run_tags" in info["wandb/error"] and reporter.wandb_process is None
    reporter.log([{"step": 1, "x": 2.0}])
    reporter.summary({"status": "ok"})
    reporter.close(exit_code=0)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].startswith("W&B failed (W&B init: ValidationError: ")
    assert warnings[0].endswith("the run goes on without W&B: metrics.jsonl and summary.json keep every record")
    assert capsys.readouterr().err.splitlines() == [f"warning: {warnings[0]}"]  # on stderr too (it was the log only)
    assert offline_runs(tmp_path) == [] and not (tmp_path / "wandb").exists()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["status"] == "ok" and s["wandb/error"] == info["wandb/error"] and "wandb/run_id" not in s


def test_a_training_run_with_w_and_b_offline_never_imports_wandb(tmp_path):
    """A real run (synthetic data, 1 device, W&B offline): the training process's ``sys.modules`` has no wandb at
    exit, and the W&B run (written by the W&B process) holds every step of metrics.jsonl with its values, the
    summary of summary.json and the id the checkpoint recorded."""
    run_dir, modules = tmp_path / "run", tmp_path / "modules.json"
    env = {**os.environ, "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
    env.pop("WANDB_MODE", None)
    env.pop("WANDB_API_KEY", None)
    cmd = modules_probe_cmd(modules, f"hydra.run.dir={run_dir}", "data=synthetic", "train.steps=30",
                            "train.log_every=5", "runtime.cpu_devices=1", "wandb.mode=offline", "checkpoint.every=10",
                            f"checkpoint.dir={tmp_path / 'ckpt'}")  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wandb" not in json.loads(modules.read_text())
    s = json.loads((run_dir / "summary.json").read_text())
    (wb_dir,) = offline_runs(run_dir)
    assert os.path.realpath(s["wandb/run_dir"]) == os.path.realpath(wb_dir)
    assert assert_history_matches_metrics(wb_dir, run_dir / "metrics.jsonl") == list(range(31))
    wb = read_run(wb_dir)
    assert wb["run"].run_id == s["wandb/run_id"] and exit_code(wb_dir) == 0
    assert wb["summary"]["eval/accuracy"] == s["eval/accuracy"] and wb["summary"]["status"] == "ok"
    from training import checkpoint

    saved = checkpoint.read_metadata(tmp_path / "ckpt" / "30")
    assert saved["wandb_run_id"] == s["wandb/run_id"]
    assert "upload the run later with: wandb sync" in (run_dir / "train.log").read_text()


def test_a_w_and_b_process_that_dies_is_dropped_and_the_run_goes_on(tmp_path, wandb_env):
    """The W&B process killed mid-run (say by the OOM killer): the next records see it, one warning, no more W&B
    calls; the summary keeps the (incomplete) W&B run's id and folder and says ``wandb/error``."""
    reporter = Reporter(tmp_path)
    reporter.start_wandb("offline", "p", None, None, "j", [], {}, init_timeout_s=60.0)
    reporter.log([{"step": 0, "x": 1.0}])
    assert reporter.wandb_info["wandb/run_id"] == reporter.wandb_run_id
    child = reporter.wandb_process.proc
    child.kill()
    child.wait()
    step = 0
    while reporter.wandb_process is not None and step < 2000:  # until the pipe reports it (writes are buffered)
        step += 1
        reporter.log([{"step": step, "x": 1.0}])
    assert reporter.wandb_process is None
    reporter.log([{"step": step + 1, "x": 1.0}])
    reporter.summary({"status": "ok"})
    reporter.close(exit_code=0)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["wandb/run_id"] == reporter.wandb_run_id and s["wandb/run_dir"].endswith(reporter.wandb_run_id)
    assert s["wandb/error"] == "the W&B process exited with code -9 before it finished the W&B run"
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == step + 2


@pytest.mark.parametrize("victim", ["wandb_process.py", "wandb-core"])
def test_train_py_finishes_when_its_w_and_b_process_is_killed(tmp_path, victim):
    """``python train.py`` with W&B offline whose W&B process (or the wandb-core it started) is killed once training
    runs: exit 0, every step trained and in metrics.jsonl, ``status: ok`` and ``wandb/error`` in summary.json, one
    warning line and no traceback (W&B's own exit hook included)."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", "data=synthetic", "train.steps=3000",
           "train.log_every=50", "runtime.cpu_devices=1", "wandb.mode=offline", "checkpoint.enabled=false"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (run_dir / "metrics.jsonl").exists() or (run_dir / "metrics.jsonl").stat().st_size < 2000:
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)

    def children(pid: int) -> list[int]:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]

    (child,) = [c for c in children(proc.pid) if "wandb_process.py" in Path(f"/proc/{c}/cmdline").read_text()]
    if victim == "wandb-core":
        while not [c for c in children(child) if "wandb-core" in Path(f"/proc/{c}/cmdline").read_text()]:
            time.sleep(0.05)
        (child,) = [c for c in children(child) if "wandb-core" in Path(f"/proc/{c}/cmdline").read_text()]
    os.kill(child, signal.SIGKILL)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "ok" and s["train/steps"] == 3000
    if victim == "wandb_process.py":
        assert s["wandb/error"] == "the W&B process exited with code -9 before it finished the W&B run"
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1] == 3000
    warnings = [line for line in out.splitlines() if "W&B failed (" in line]
    assert len(warnings) == 1 and s["wandb/error"] in warnings[0], out[-3000:]
    assert "Traceback" not in out + err, err[-3000:]
    assert warnings[0].split(" - ", 1)[1] in (run_dir / "train.log").read_text()


def test_a_stopped_w_and_b_process_never_holds_up_the_training_thread(tmp_path, wandb_env):
    """The W&B process stopped (SIGSTOP; a starved one is alike): records far beyond the pipe's 64 KiB are held in
    the training process and every ``log`` returns at once; once it runs again, ``finish`` delivers all of them."""
    reporter = Reporter(tmp_path)
    reporter.start_wandb("offline", "p", None, None, "j", [], {}, init_timeout_s=60.0)
    assert reporter.wandb_info["wandb/run_id"] == reporter.wandb_run_id
    child = reporter.wandb_process.proc
    child.send_signal(signal.SIGSTOP)
    try:
        t0 = time.perf_counter()
        for step in range(2000):  # ~200 bytes each: ~400 KB
            reporter.log([{"step": step, "train/loss": 1.0 / (step + 1), "pad": 1.0}])
        assert time.perf_counter() - t0 < 10.0 and len(reporter.wandb_process._pending) > 65536
    finally:
        child.send_signal(signal.SIGCONT)
    reporter.summary({"status": "ok"})
    reporter.close(exit_code=0)
    (run_dir,) = offline_runs(tmp_path)
    assert assert_history_matches_metrics(run_dir, tmp_path / "metrics.jsonl") == list(range(2000))


def _wandb_core_pids(pid: int) -> list[int]:
    """The processes the W&B process ``pid`` started (wandb-core): its threads' children, read from /proc."""
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        out += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    return out


def _policies(pid: int) -> set:
    """Scheduling policies of every thread of ``pid`` and of every thread of its child processes (wandb-core)."""
    out = set()
    for p in [pid, *_wandb_core_pids(pid)]:
        for task in os.listdir(f"/proc/{p}/task"):
            out.add(os.sched_getscheduler(int(task)))
    return out


@pytest.mark.parametrize("priority, policy", [("normal", os.SCHED_OTHER), ("idle", os.SCHED_IDLE)])
def test_process_priority_applies_to_the_w_and_b_process_and_wandb_core(tmp_path, wandb_env, priority, policy):
    """``wandb.process_priority``: every thread of the W&B process and of the wandb-core it starts runs under the
    policy (SCHED_IDLE for ``idle``); a process prestarted at another priority is not used; an unknown priority
    is refused before a process starts."""
    with pytest.raises(ValueError, match="priority='low' is unknown; choose normal or idle"):
        WandbProcess("low")
    wandb_process.prestart("idle" if priority == "normal" else "normal")
    other = wandb_process._prestarted
    reporter = Reporter(tmp_path)
    reporter.start_wandb("offline", "p", None, None, "j", [], {}, init_timeout_s=60.0, process_priority=priority)
    assert other.proc.returncode == 0 and reporter.wandb_process is not other  # discarded, creating nothing
    assert reporter.wandb_info["wandb/run_id"] == reporter.wandb_run_id
    assert _policies(reporter.wandb_process.proc.pid) == {policy}
    reporter.close(exit_code=0)
    (run_dir,) = offline_runs(tmp_path)
    assert exit_code(run_dir) == 0


def _environ(pid: int) -> dict[str, str]:
    """The environment a process was started with (read once it is readable: empty while the exec is under way)."""
    for _ in range(500):
        items = [i for i in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in i]
        if items:
            return dict(item.decode().split("=", 1) for item in items)
        time.sleep(0.01)
    raise AssertionError(f"/proc/{pid}/environ stayed empty for 5 s")


def test_an_offline_w_and_b_process_is_offline_process_wide(tmp_path, wandb_env, monkeypatch):
    """For an offline run the W&B process runs with ``WANDB_MODE=offline`` (W&B's process-wide mode), whatever the
    user's environment says; a process prestarted for another mode is not used. The next test shows why."""
    monkeypatch.delenv("WANDB_MODE")
    proc = WandbProcess(mode="offline")
    assert _environ(proc.proc.pid).get("WANDB_MODE") == "offline"
    proc.discard()
    proc = WandbProcess(mode="online")  # never initialised: nothing is contacted
    assert "WANDB_MODE" not in _environ(proc.proc.pid)
    proc.discard()
    wandb_process.prestart("normal", "online")
    other = wandb_process._prestarted
    reporter = Reporter(tmp_path)
    reporter.start_wandb("offline", "p", None, None, "j", [], {}, init_timeout_s=60.0)
    assert (
        other.proc.returncode == 0 and reporter.wandb_process is not other and reporter.wandb_process.mode == "offline"
    )
    assert _environ(reporter.wandb_process.proc.pid).get("WANDB_MODE") == "offline"
    reporter.close(exit_code=0)
    (run_dir,) = offline_runs(tmp_path)
    assert exit_code(run_dir) == 0


@pytest.mark.parametrize("user_value, expected", [(None, "1"), ("3", "3")])
def test_wandb_core_runs_on_one_go_thread_unless_the_environment_says_otherwise(
    tmp_path, wandb_env, monkeypatch, user_value, expected
):
    """The W&B process starts wandb-core (Go) with ``GOMAXPROCS=1``; a ``GOMAXPROCS`` the user exported is kept.
    Read from wandb-core's own environment, once ``wandb.init`` has started it; the run is written as usual."""
    if user_value is None:
        monkeypatch.delenv("GOMAXPROCS", raising=False)
    else:
        monkeypatch.setenv("GOMAXPROCS", user_value)
    proc = WandbProcess(mode="offline")
    proc.init("offline", init_kwargs(tmp_path), SETTINGS)
    proc.log({"train/loss": 1.0}, 0)
    assert proc.started()["mode"] == "offline"
    (core,) = _wandb_core_pids(proc.proc.pid)
    assert Path(f"/proc/{core}/comm").read_text().strip() == "wandb-core"
    assert _environ(core).get("GOMAXPROCS") == expected
    assert "GOMAXPROCS" not in os.environ or os.environ["GOMAXPROCS"] == user_value  # this process: untouched
    assert proc.finish(0) == []
    (run_dir,) = offline_runs(tmp_path)
    assert [r["_step"] for r in read_run(run_dir)["history"]] == [0]


@pytest.mark.parametrize("process_wide", [False, True])
def test_w_and_b_analytics_is_off_only_when_the_process_wide_mode_is_offline(
    tmp_path, wandb_env, monkeypatch, process_wide
):
    """What the test above relies on (wandb 0.31): ``wandb.init(mode="offline")`` alone leaves W&B's own
    OpenTelemetry analytics on (a histogram per ``run.log``, exported to W&B's servers at exit); with
    ``WANDB_MODE=offline`` in the environment it is off."""
    if not process_wide:
        monkeypatch.delenv("WANDB_MODE")
    code = (
        "import wandb\n"
        "from wandb.analytics.opentelemetry import opentelemetry_proxy as p\n"
        f"run = wandb.init(mode='offline', dir={str(tmp_path)!r}, settings=wandb.Settings(silent=True))\n"
        "run.log({'x': 1.0})\n"
        "print('proxy', p.get_open_telemetry_proxy() is not None)\n"
        "run.finish()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True).stdout
    assert f"proxy {not process_wide}" in out
