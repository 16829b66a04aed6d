"""Preemption and launcher faults (scripts/launch_local.py, training/process.py, sweeps/callback.py,
training/runtime.py): every process stops together, saves once, says why, and
none is left behind.

The multi-process tests start real ``train.py`` processes (2 processes x 2 simulated CPU devices, synthetic
data, the MLP); every test has a bounded run time and checks that no process it started is still running.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from utils import REPO

sys.path.insert(0, str(REPO / "scripts"))
import launch_local  # noqa: E402

from hydra_plugins.dp_scaling_launchers.serial_local import descendants  # noqa: E402
from sweeps import callback  # noqa: E402
from training import process  # noqa: E402

CLUSTER_VARS = ("SLURM_", "OMPI_", "PMI_", "JAX_COORDINATOR", "JAX_NUM_CPU_DEVICES", "JAX_PROCESS", "TPU_")
SMALL = ["data=synthetic", "optim=sgd", "train.global_batch=64", "train.log_every=10", "wandb.mode=disabled"]


def env_for(tmp: Path) -> dict:
    """The test's environment: no cluster variables, no W&B account, unbuffered output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLUSTER_VARS)}
    env.pop("WANDB_API_KEY", None)
    env.update(WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    return env


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_for(predicate, timeout_s: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
            raise AssertionError(f"{what} not within {timeout_s} s\n{tail}")
        time.sleep(0.2)


def logged_step(run_dir: Path) -> int:
    """The last step in process 0's metrics.jsonl (0 before the first window)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return max([json.loads(line)["step"] for line in lines if line.strip()] or [0])


def ended(proc: subprocess.Popen, timeout_s: float, log: Path) -> int:
    """``proc``'s exit code; kills it (and fails) when it runs past ``timeout_s``."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for pid in descendants(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
        raise AssertionError(f"{proc.args} still running after {timeout_s} s:\n{log.read_text()[-3000:]}")


def assert_none_left(pids: list[int]) -> None:
    wait_for(lambda: not [p for p in pids if alive(p)], 10.0, f"the end of processes {pids}")


def start_launcher(tmp: Path, run_dir: Path, steps: int, log: Path, *launcher_args: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "launch_local.py"),
        *launcher_args,
        "-n",
        "2",
        "--cpu-devices",
        "2",
        "--timeout-s",
        "60",
        "--",
        *SMALL,
        f"train.steps={steps}",
        "checkpoint.every=0",
        f"hydra.run.dir={run_dir}",
    ]
    return subprocess.Popen(cmd, cwd=REPO, env=env_for(tmp), stdout=open(log, "w"), stderr=subprocess.STDOUT)


def train_children(proc: subprocess.Popen) -> list[int]:
    return [p for p in descendants(proc.pid) if b"train.py" in Path(f"/proc/{p}/cmdline").read_bytes()]


# ---- 2: SIGTERM to the launcher ----------------------------------------------------------------------------
@pytest.mark.parametrize("resume", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["stop", "resume"])
def test_sigterm_to_launcher_stops_every_process_at_one_step(tmp_path, resume):
    """SIGTERM to the launcher reaches both processes; they stop after the same step S, save ONE checkpoint
    (at S), process 0 says ``stopped by SIGTERM ... checkpoint saved`` once for the job (process 1 in its own log),
    both exit 1; the same command continues from S."""
    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    steps = 600 if resume else 2000  # the signal comes at step ~10-20; the resumed run trains the rest
    proc = start_launcher(tmp_path, run_dir, steps, log)
    wait_for(lambda: logged_step(run_dir) >= 10 or proc.poll() is not None, 150, "step 10", log)
    children = train_children(proc)
    assert len(children) == 2, children
    proc.send_signal(signal.SIGTERM)
    assert ended(proc, 90, log) == 1
    assert_none_left(children)
    out = log.read_text()
    stops = re.findall(
        r"^(\[process 1\] .*\[ERROR\] - )?error: stopped by SIGTERM \(preemption, all processes\) after step "
        rf"(\d+) of {steps}; checkpoint saved in (\S+);",
        out,
        re.M,
    )
    assert len(stops) == 1 and stops[0][0] == "", out[-3000:]  # one voice per job: process 0 says it
    (stop_step,) = {int(s[1]) for s in stops}  # one step for both processes
    assert 10 <= stop_step < steps
    assert {s[2] for s in stops} == {str(run_dir / "checkpoints" / str(stop_step))}
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [str(stop_step)]  # saved once
    assert "launch_local: SIGTERM received; forwarded as SIGTERM to the 2 processes" in out
    assert "launch_local: exit codes process 0: 1, process 1: 1" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["error"].startswith("stopped by SIGTERM")
    # process 1's console: none of the product's lines (its train_process1.log has them), JAX's C++ log labelled
    mine = [line for line in out.splitlines() if "[process 1]" in line]
    assert mine and not [line for line in mine if "] - " in line or "error:" in line or "warning:" in line]
    assert "error: stopped by SIGTERM" in (run_dir / "train_process1.log").read_text()
    assert re.search(r"^\[process 1\] W\d{4} .*preemption_notifier", out, re.M)
    if not resume:
        return
    # the same command continues from the saved step to the end
    log2 = tmp_path / "resume.log"
    proc = start_launcher(tmp_path, run_dir, steps, log2)
    assert ended(proc, 300, log2) == 0, log2.read_text()[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["checkpoint/resumed_step"], summary["train/steps"]) == ("ok", stop_step, steps)


# ---- 1: kill -9 of the launcher ------------------------------------------------------------------------------
@pytest.mark.slow  # ~25 s: two processes start and train
def test_killed_launcher_takes_its_processes_with_it(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    proc = start_launcher(tmp_path, run_dir, 100_000, log)
    wait_for(lambda: logged_step(run_dir) >= 10 or proc.poll() is not None, 150, "step 10", log)
    children = train_children(proc)
    assert len(children) == 2 and all(alive(p) for p in children), children
    proc.kill()
    proc.wait(timeout=10)
    assert_none_left(children)  # PR_SET_PDEATHSIG: killed with their launcher, not hanging on their peers


@pytest.mark.parametrize("victim", [1, 0])
def test_a_process_killed_from_outside_stops_the_job_in_one_line(tmp_path, victim):
    """kill -9 of one process (an out-of-memory kill): the survivor sees its connection close (training.peers) and
    stops at once, with one line naming the process and its host, no traceback (a gloo collective it was in fails
    first), and a failed summary.json (written by process 1 when process 0 is the one that died)."""
    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    proc = start_launcher(tmp_path, run_dir, 100_000, log, "--grace-s", "30")
    wait_for(lambda: logged_step(run_dir) >= 10 or proc.poll() is not None, 150, "step 10", log)
    children = train_children(proc)
    (one,) = [
        p for p in children if f"distributed.process_id={victim}".encode() in Path(f"/proc/{p}/cmdline").read_bytes()
    ]
    os.kill(one, signal.SIGKILL)
    t0 = time.monotonic()
    code = ended(proc, 60, log)
    out = log.read_text()
    assert code == 1 and time.monotonic() - t0 < 20, out[-3000:]  # not --grace-s, not JAX's heartbeat
    line = (
        f"error: process {victim} of 2 on host {socket.gethostname()} died without a word (killed from outside, e.g. "
        f"out of memory, or crashed); the job cannot go on without it and every other process stopped; continue "
        f"with the same command and checkpoint.dir={run_dir}/checkpoints (its newest checkpoint)"
    )
    errors = [line for line in out.splitlines() if "error:" in line]
    assert errors == [line if victim else f"[process 1] {line}"], out[-3000:]
    assert "Traceback" not in out and "JaxRuntimeError" not in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == line.removeprefix("error: ")
    assert (
        f"launch_local: exit codes process 0: {-9 if victim == 0 else 1}, process 1: {1 if victim == 0 else -9}" in out
    )
    assert_none_left(children)


# ---- 3: the coordinator port is taken ----------------------------------------------------------------------
@pytest.fixture
def taken_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.unit
def test_port_in_use(taken_port):
    assert process.port_in_use(taken_port)
    assert not process.port_in_use(launch_local.free_port())


def test_launcher_port_in_use_is_one_line(tmp_path, taken_port):
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "scripts/launch_local.py", "-n", "2", "--port", str(taken_port), "--", *SMALL],
        cwd=REPO,
        env=env_for(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and time.monotonic() - t0 < 30
    assert r.stderr.splitlines() == [
        f"launch_local: coordinator port {taken_port} is already in use on this machine (another program or an "
        f"earlier run listens there); choose another with --port P, or leave --port out to get a free one"
    ]
    assert not list(Path(tmp_path).glob("**/summary.json"))  # no process was started


def test_coordinator_port_in_use_given_by_hand(tmp_path, taken_port):
    """Process 0 with a taken ``distributed.coordinator`` port: one line at start, not a crash after the timeout."""
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    r = subprocess.run(
        [
            sys.executable,
            "train.py",
            *SMALL,
            f"hydra.run.dir={run_dir}",
            "runtime.cpu_devices=1",
            f"distributed.coordinator=127.0.0.1:{taken_port}",
            "distributed.num_processes=2",
            "distributed.process_id=0",
            "distributed.timeout_s=60",
        ],
        cwd=REPO,
        env=env_for(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    msg = (
        f"coordinator port {taken_port} is already in use on this machine (another program or an earlier run "
        f"listens there); choose another with distributed.coordinator=127.0.0.1:<free port> on every process "
        f"(scripts/launch_local.py picks a free one when --port is left out)"
    )
    assert r.returncode == 1 and time.monotonic() - t0 < 60  # not JAX's 60 s initialisation timeout
    assert [line for line in r.stderr.splitlines() if line.startswith("error:")] == [f"error: {msg}"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["error"]) == ("failed", msg)


# ---- 4: a sweep receives SIGTERM / SIGINT ------------------------------------------------------------------
@pytest.mark.unit
def test_stop_report_lines(tmp_path):
    outcomes = [
        (tmp_path / "0", None),
        (tmp_path / "1", "stopped by SIGTERM after step 30 of 400; checkpoint saved in x"),
        (tmp_path / "2", callback.NOT_STARTED + "SIGTERM"),
        (tmp_path / "3", "non-finite loss"),
    ]
    assert callback.stop_report(outcomes, "SIGTERM", 2, tmp_path) == [
        "sweep stopped by SIGTERM: 1 finished, 1 stopped, 3 never started, 1 failed (of 6 jobs)",
        f"  {tmp_path / '0'}: finished",
        f"  {tmp_path / '1'}: stopped",
        f"  {tmp_path / '2'}: never started",
        f"  {tmp_path / '3'}: failed",
        f"resume with the same command and hydra.sweep.dir={tmp_path} (finished jobs are not run again, stopped "
        f"ones continue from their checkpoint)",
    ]


@pytest.mark.slow  # ~60 s: a job stopped, then the sweep resumed (two jobs)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sweep_stops_on_signal_and_resumes(tmp_path, sig):
    sweep_dir, log, steps = tmp_path / "sweep", tmp_path / "sweep.log", 400
    cmd = [
        sys.executable,
        "train.py",
        "-m",
        *SMALL,
        f"train.steps={steps}",
        "checkpoint.every=0",
        "train.seed=1,2",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    env = env_for(tmp_path)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    wait_for(lambda: logged_step(sweep_dir / "0") >= 10 or proc.poll() is not None, 150, "step 10", log)
    children = descendants(proc.pid)
    proc.send_signal(sig)
    assert ended(proc, 90, log) == 1
    assert_none_left(children)
    out = log.read_text()
    name = signal.Signals(sig).name
    stop_step = int(re.search(rf"error: stopped by {name} after step (\d+) of {steps}", out)[1])
    assert sorted(p.name for p in (sweep_dir / "0" / "checkpoints").iterdir()) == [str(stop_step)]
    assert f"sweep stopped by {name}: 0 finished, 1 stopped, 1 never started (of 2 jobs)" in out
    assert f"  {sweep_dir / '1'}: never started" in out
    assert not (sweep_dir / "1" / "checkpoints").exists()  # job 1 never started training
    # the same command resumes: job 0 from its checkpoint, job 1 from the start
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    first, second = (json.loads((sweep_dir / j / "summary.json").read_text()) for j in ("0", "1"))
    assert (first["status"], first["checkpoint/resumed_step"], first["train/steps"]) == ("ok", stop_step, steps)
    assert (second["status"], second["train/steps"]) == ("ok", steps) and "checkpoint/resumed_step" not in second


_AT_FIRST_WINDOW = """
import os, signal, training.hooks as m
real = m.WindowLog.run
def run(self, loop, step):  # the first logged window of the sweep's first job
    if step == 10:
        os.kill(os.getpid(), signal.SIGTERM)
    return real(self, loop, step)
m.WindowLog.run = run
"""


def test_a_sweep_jobs_stop_line_says_to_resume_the_sweep(tmp_path):
    """A job of a sweep stopped by SIGTERM: its line says to resume the sweep in its folder (it said "continue with
    the same command and checkpoint.dir=<the job's checkpoints>", which for the sweep's command would put every job
    on that one folder); the sweep's own report follows."""
    from utils import train_probe_cmd

    sweep_dir = tmp_path / "sweep"
    args = ["-m", *SMALL, "train.steps=20", "checkpoint.every=0", "train.seed=1,2", f"hydra.sweep.dir={sweep_dir}"]
    cmd = train_probe_cmd(_AT_FIRST_WINDOW, "", *args)
    res = subprocess.run(cmd, cwd=REPO, env=env_for(tmp_path), capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stderr[-3000:]
    saved = sweep_dir / "0" / "checkpoints" / "10"
    line = (
        f"stopped by SIGTERM after step 10 of 20; checkpoint saved in {saved}; resume the sweep with the same command "
        f"and hydra.sweep.dir={sweep_dir} (this job continues from it)"
    )
    assert error_lines(res) == [f"error: {line}"] and "checkpoint.dir=" not in res.stdout + res.stderr
    assert json.loads((sweep_dir / "0" / "summary.json").read_text())["error"] == line
    assert "sweep stopped by SIGTERM: 0 finished, 1 stopped, 1 never started (of 2 jobs)" in res.stderr


@pytest.mark.unit
def test_stop_lines_of_a_sweep_job_resume_the_sweep(monkeypatch):
    """Every stop line of a job inside a sweep (start-up, a second signal during the steps, the end) says to resume
    the sweep in its folder; a single run's lines are unchanged."""
    for name in ("phase", "_resume_hint", "_sweep_dir"):
        monkeypatch.setattr(process, name, getattr(process, name))
    process.set_sweep_dir("/s")
    process.set_resume_hint("/s/0/checkpoints")
    again = "resume the sweep with the same command and hydra.sweep.dir=/s"
    process.set_phase("start-up")
    assert process.stop_text("SIGTERM").endswith(f"nothing trained or saved; {again}")
    process.set_phase("steps")
    assert process.stop_text("SIGTERM").endswith(
        f"(a second signal: it did not wait for a checkpoint); {again} (this job continues from its newest checkpoint)"
    )
    process.set_phase("end")
    assert process.stop_text("SIGTERM").endswith(f"while the run was ending; {again} (this job finishes from its "
                                                 "final checkpoint)")  # fmt: skip
    assert process.saved_stop_text("/s/0/checkpoints/4", "/s/0/checkpoints") == (
        f"checkpoint saved in /s/0/checkpoints/4; {again} (this job continues from it)"
    )
    process.set_sweep_dir(None)
    process.set_resume_hint("/r/checkpoints")
    assert process.saved_stop_text("/r/checkpoints/4", "/r/checkpoints") == (
        "checkpoint saved in /r/checkpoints/4; continue with the same command and checkpoint.dir=/r/checkpoints (or "
        "checkpoint.resume=/r/checkpoints/4)"
    )
    assert process.stop_text("SIGTERM") == STOP_AT_END.format(sig="SIGTERM")


# ---- 5: process i > 0 keeps its lines' levels ----------------------------------------------------------------
@pytest.mark.unit
def test_console_of_process_1_keeps_the_level(monkeypatch, caplog):
    from training import console

    monkeypatch.setattr(process, "_rank", 1)
    with caplog.at_level(logging.INFO, logger="training.console"):
        console.console("warning: only 1 logging window(s) measured")
        console.console("error: stopped by SIGTERM")
        console.console("already complete at step 20")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "warning: only 1 logging window(s) measured"),
        ("ERROR", "error: stopped by SIGTERM"),
        ("INFO", "already complete at step 20"),
    ]


@pytest.mark.unit
def test_launcher_labels_every_line_of_process_1(tmp_path):
    src = tmp_path / "src"
    src.write_bytes(
        b"W1202 02:05:05.269882 5207 preemption_notifier.cc:90] SIGTERM caught\n"
        b"[process 1] [2026-12-02 02:05:05][absl][WARNING] - already labelled\n"
        b"Traceback (most recent call last):\n  File x\n\n"
    )
    out, counter = tmp_path / "out", [0]
    with open(src, "rb") as s, open(out, "wb") as d:
        launch_local.forward_filtered(s, d, counter, b"[process 1] ")
    assert out.read_bytes() == (
        b"[process 1] W1202 02:05:05.269882 5207 preemption_notifier.cc:90] SIGTERM caught\n"
        b"[process 1] [2026-12-02 02:05:05][absl][WARNING] - already labelled\n"
        b"[process 1] Traceback (most recent call last):\n[process 1]   File x\n\n"
    )


# ---- 6: a damaged compilation cache entry ------------------------------------------------------------------
def test_damaged_compilation_cache_is_one_line(tmp_path):
    cache = tmp_path / "cache"
    cmd = [sys.executable, "train.py", *SMALL, "train.steps=4", f"runtime.compilation_cache_dir={cache}"]
    env = env_for(tmp_path)
    r = subprocess.run(cmd + [f"hydra.run.dir={tmp_path / 'a'}"], cwd=REPO, env=env, capture_output=True, timeout=300)
    assert r.returncode == 0
    entries = list(cache.glob("*-cache"))
    assert entries
    for entry in entries:  # truncated, as after a full disk
        entry.write_bytes(entry.read_bytes()[:100])
    r = subprocess.run(
        cmd + [f"hydra.run.dir={tmp_path / 'b'}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0
    assert "UserWarning" not in r.stderr and "warnings.warn" not in r.stderr
    lines = [line for line in r.stdout.splitlines() if "persistent compilation cache" in line]
    assert len(lines) == 1, lines  # the log, and the same words once on stderr (a product warning)
    said = [line for line in r.stderr.splitlines() if "persistent compilation cache" in line]
    assert said == ["warning: " + lines[0].split("[WARNING] - ", 1)[1]], r.stderr
    assert re.search(
        rf"\[WARNING\] - persistent compilation cache {re.escape(str(cache))}: error reading an entry \(jit_\w+: "
        r".*\); such programs are compiled again \(results unaffected\); delete the folder to rebuild it",
        lines[0],
    )
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["status"] == "ok"


@pytest.mark.unit
def test_cache_warnings_hook_passes_other_warnings(caplog):
    import warnings

    from training.runtime import CacheWarnings

    assert CacheWarnings.line("some other warning") is None
    CacheWarnings.reset("/c")
    seen = []
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="training.runtime"):
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *args, **kwargs: seen.append(str(message))
        CacheWarnings.install()
        for i in range(3):
            warnings.warn(f"Error reading persistent compilation cache entry for 'jit_f{i}': error: truncated")
        warnings.warn("an unrelated warning")
    assert CacheWarnings.count == 3 and seen == ["an unrelated warning"]
    assert [r.getMessage() for r in caplog.records] == [
        "persistent compilation cache /c: error reading an entry (jit_f0: error: truncated); such programs are "
        "compiled again (results unaffected); delete the folder to rebuild it, or set "
        "runtime.compilation_cache_dir=null (said once per run)"
    ]


# ---- SLURM: the time limit and preemption send SIGTERM to every task ---------------------------------------
@pytest.mark.unit
@pytest.mark.filterwarnings(r"ignore:(?s).*validated against ConfigStore schema")  # Hydra's note on the name
def test_slurm_paths_send_sigterm_before_the_time_limit(tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from submitit.slurm.slurm import _make_sbatch_string

    from conf.schema import register

    register()
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=submitit_slurm"], return_hydra_config=True)
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launcher["additional_parameters"] == {"signal": "TERM@120", "requeue": True}
    sbatch = _make_sbatch_string(
        command="python x.py",
        folder=str(tmp_path),
        signal_delay_s=launcher["signal_delay_s"],
        additional_parameters=launcher["additional_parameters"],
    )
    assert [line for line in sbatch.splitlines() if "--signal" in line or "--requeue" in line] == [
        "#SBATCH --requeue",
        "#SBATCH --signal=TERM@120",
    ]
    script = (REPO / "scripts" / "sbatch_example.sh").read_text()
    assert "#SBATCH --signal=TERM@120" in script and "#SBATCH --requeue" in script and "exec python train.py" in script


# ---- the launcher's output ----------------------------------------------------------------------------------
@pytest.mark.unit
def test_launch_local_leaves_out_gloo_connection_lines(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("launch_local", REPO / "scripts" / "launch_local.py")
    launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch)
    src = tmp_path / "src"
    src.write_bytes(
        b"start\n[Gloo] Rank 3 is connected to 3 peer ranks. Expected number of connected peer ranks is"
        b" : 3\ntrain: 50%\rtrain: 100%\nerror: real\n"
    )
    out, counter = tmp_path / "out", [0]
    with open(src, "rb") as s, open(out, "wb") as d:
        launch.forward_filtered(s, d, counter)
    assert out.read_bytes() == b"start\ntrain: 50%\rtrain: 100%\nerror: real\n" and counter == [1]


# ---- 7: SIGTERM or SIGINT outside the training steps (train.py, training/process.py) -------------------------
# Each probe sends the signal at one moment of a run (tests.utils.train_probe_cmd runs it before train.py).
_AT_COMPOSITION = """
import os, signal
from hydra._internal import config_loader_impl as m
real, sent = m.ConfigLoaderImpl.load_configuration, []
def composing(self, *args, **kwargs):
    if not sent:  # Hydra's first composition
        sent.append(1)
        os.kill(os.getpid(), signal.{sig})
    return real(self, *args, **kwargs)
m.ConfigLoaderImpl.load_configuration = composing
"""
_AT_RUNTIME = """
import os, signal, training.runtime as m
real = m.setup_runtime
def setup_runtime(*args, **kwargs):
    os.kill(os.getpid(), signal.{sig})
    return real(*args, **kwargs)
m.setup_runtime = setup_runtime
"""
# from another thread while the main thread is inside XLA's compilation (C++, no Python frame to interrupt)
_IN_COMPILATION = """
import os, signal, threading
from jax._src import stages
real = stages.Lowered.compile
def compile(self, *args, **kwargs):
    sender = threading.Thread(target=os.kill, args=(os.getpid(), signal.{sig}))
    sender.start()
    try:
        return real(self, *args, **kwargs)
    finally:
        sender.join()
stages.Lowered.compile = compile
"""
_AT_THE_END = """
import os, signal, measure.profiler as m
real = m.explain_ratio
def explain_ratio(*args, **kwargs):  # in training.run.finish, after the last step
    os.kill(os.getpid(), signal.{sig})
    return real(*args, **kwargs)
m.explain_ratio = explain_ratio
"""
_SIGINT_IGNORED = "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)  # as `cmd &` in a script starts it\n"
STOP_AT_START = (
    "stopped by {sig} during the start-up, before the first training step: nothing trained or saved; the same "
    "command starts the run again (from its newest checkpoint, if any)"
)
STOP_AT_END = (
    "stopped by {sig} after the training steps, while the run was ending; the same command finishes it from its "
    "final checkpoint (or says it is complete)"
)


def run_probe(tmp: Path, probe: str, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    from utils import train_probe_cmd

    cmd = train_probe_cmd(probe, "", *SMALL, "train.steps=20", f"hydra.run.dir={run_dir}", *extra)
    env = {**env_for(tmp), "HYDRA_FULL_ERROR": ""}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def error_lines(res: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (res.stdout + res.stderr).splitlines() if line.startswith("error:")]


@pytest.mark.parametrize(
    "sig, before",
    [
        (signal.SIGTERM, _AT_COMPOSITION),
        (signal.SIGTERM, _AT_RUNTIME),
        (signal.SIGTERM, _IN_COMPILATION),
        (signal.SIGINT, _SIGINT_IGNORED + _IN_COMPILATION),
        (signal.SIGHUP, _AT_RUNTIME),  # the terminal closed: it ended the run with no line and no summary
    ],
    ids=["composition", "runtime", "compilation", "compilation-sigint-ignored", "runtime-sighup"],
)
def test_signal_during_the_start_up_stops_with_one_line(tmp_path, sig, before):
    """SIGTERM (or SIGINT in a process started with it ignored, as a script's `cmd &` starts it) at a moment of
    the start-up: the run stops there, before its first step (one that comes inside XLA's compilation as soon as it
    returns), with one line, summary.json status stopped, no step, no checkpoint, and ends by that signal. Before:
    SIGTERM killed the process in milliseconds with nothing written; the ignored SIGINT trained to the end (exit 0)."""
    run_dir = tmp_path / "run"
    res = run_probe(tmp_path, before.format(sig=sig.name), run_dir, "runtime.compilation_cache_dir=null")
    assert res.returncode == -sig, (res.returncode, res.stderr[-3000:])
    said = "SIGINT (Ctrl-C)" if sig == signal.SIGINT else sig.name
    assert error_lines(res) == [f"error: {STOP_AT_START.format(sig=said)}"], res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["error"]) == ("stopped", STOP_AT_START.format(sig=said))
    assert sorted(p.name for p in run_dir.iterdir()) == [".hydra", ".lock", "summary.json", "train.log"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_at_the_end_stops_and_the_same_command_finishes(tmp_path, sig):
    """SIGTERM (or SIGHUP: the terminal closed) after the last step (while the summary is made): one line saying
    so, summary.json status stopped, exit by that signal; the final checkpoint is on disk and the same command
    finishes the run (exit 0, status ok)."""
    run_dir = tmp_path / "run"
    res = run_probe(tmp_path, _AT_THE_END.format(sig=sig.name), run_dir)
    assert res.returncode == -sig, res.stderr[-3000:]
    assert error_lines(res) == [f"error: {STOP_AT_END.format(sig=sig.name)}"] and "Traceback" not in res.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["error"]) == ("stopped", STOP_AT_END.format(sig=sig.name))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["20"]
    again = run_probe(tmp_path, "", run_dir)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["train/steps"]) == ("ok", 20)


# the evaluation number {n} (1: step 10's, train.eval_every=10; 2: the final one at step 20) takes 0.5 s a batch
# (10 batches of the synthetic test split) and gets SIGTERM as it asks for its second batch; at the exit the
# number of batches asked for after that one
_SLOW_EVALUATION = """
import dataclasses, os, signal, time, data.pipeline as m
real, counts = m.make_eval_set, {{"evaluations": 0, "after": None}}
class Slow(list):
    def __iter__(self):
        counts["evaluations"] += 1
        for i, batch in enumerate(list.__iter__(self)):
            if counts["evaluations"] == {n}:
                time.sleep(0.5)
                if i == 1:
                    os.kill(os.getpid(), signal.SIGTERM)
                    counts["after"] = 0
                elif counts["after"] is not None:
                    counts["after"] += 1
            yield batch
def make_eval_set(*args, **kwargs):
    eval_set = real(*args, **kwargs)
    return dataclasses.replace(eval_set, batches=Slow(eval_set.batches))
m.make_eval_set = make_eval_set
"""


@pytest.mark.parametrize("final", [False, True], ids=["periodic", "final"])
def test_sigterm_during_an_evaluation_stops_after_the_current_batch(tmp_path, final):
    """SIGTERM during an evaluation (every train.eval_every steps, or the final one) ends it after the current batch
    (it waited for the whole evaluation: 8 more batches here), saves the step's checkpoint and stops with one line
    and a stopped summary; after the final evaluation's stop the same command evaluates and finishes the run."""
    from utils import train_probe_cmd

    run_dir, step = tmp_path / "run", 20 if final else 10
    overrides = [*SMALL, "train.steps=20", "train.eval_every=10", f"hydra.run.dir={run_dir}"]
    cmd = train_probe_cmd(_SLOW_EVALUATION.format(n=2 if final else 1), "print('after:', counts['after'])", *overrides)
    res = subprocess.run(cmd, cwd=REPO, env=env_for(tmp_path), capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stderr[-3000:]
    assert "after: 0" in res.stdout.splitlines()  # no batch evaluated after the signal's
    ckpts = run_dir / "checkpoints"
    line = (
        f"stopped by SIGTERM after step {step} of 20{' (before its final evaluation)' if final else ''}; checkpoint "
        f"saved in {ckpts / str(step)}; continue with the same command and checkpoint.dir={ckpts} (or "
        f"checkpoint.resume={ckpts / str(step)})"
    )
    assert error_lines(res) == [f"error: {line}"] and "Traceback" not in res.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["error"]) == ("stopped", line)
    assert sorted(p.name for p in ckpts.iterdir()) == [str(step)]
    if final:
        again = run_probe(tmp_path, "", run_dir, "train.eval_every=10")
        assert again.returncode == 0, again.stderr[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert (summary["status"], summary["train/steps"]) == ("ok", 20) and 0 <= summary["eval/accuracy"] <= 1


def test_a_periodic_evaluation_a_signal_ended_runs_first_when_resumed(tmp_path):
    """SIGTERM during step 10's periodic evaluation: the checkpoint of step 10 records the evaluation as pending,
    and the same command evaluates step 10 before its first step (the record at step 10, the best-checkpoint
    comparison), so metrics.jsonl holds eval records at the uninterrupted run's steps 10 and 20, once each.
    Before: the resumed run started at step 11 and step 10 was never evaluated nor compared."""
    from utils import train_probe_cmd

    run_dir = tmp_path / "run"
    overrides = [
        *SMALL,
        "train.steps=20",
        "train.eval_every=10",
        "checkpoint.keep_best=eval/loss",
        f"hydra.run.dir={run_dir}",
    ]
    cmd = train_probe_cmd(_SLOW_EVALUATION.format(n=1), "", *overrides)
    res = subprocess.run(cmd, cwd=REPO, env=env_for(tmp_path), capture_output=True, text=True, timeout=300)
    assert res.returncode == 1 and error_lines(res)[0].startswith("error: stopped by SIGTERM after step 10 of 20")
    meta = json.loads((run_dir / "checkpoints" / "10" / "meta" / "metadata").read_text())
    assert meta["pending_evaluation"] is True
    again = run_probe(tmp_path, "", run_dir, "train.eval_every=10", "checkpoint.keep_best=eval/loss")
    assert again.returncode == 0, again.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval/loss"]) for r in records if "eval/loss" in r]
    assert [step for step, _ in evals] == [10, 20]
    assert re.search(rf"best eval/loss={evals[0][1]:.6g} at step 10 ->", (run_dir / "train.log").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    best = min(evals, key=lambda e: e[1])
    assert (summary["status"], summary["checkpoint/best_step"]) == ("ok", best[0])
    assert summary["checkpoint/best_value"] == pytest.approx(best[1], rel=1e-6)


_TWO_CTRL_C = """
import os, signal, time, training.report as report, training.validate as validate
real = validate.check_run_folder
def check_run_folder(*args, **kwargs):  # in training.run.prepare: the first Ctrl-C
    os.kill(os.getpid(), signal.SIGINT)
    return real(*args, **kwargs)
validate.check_run_folder = check_run_folder
def close(self, *args, **kwargs):  # the stop closes the reporter: a second Ctrl-C while it would wait a minute
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(120)
report.Reporter.close = close
"""


def test_a_second_ctrl_c_ends_at_once(tmp_path):
    """A Ctrl-C at the start-up stops the run; a second one while the stop is still closing the run ends the
    process at once (not after the minute the close would take), with the one line and the stopped summary."""
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    res = run_probe(tmp_path, _TWO_CTRL_C, run_dir)
    assert time.monotonic() - t0 < 60
    assert res.returncode == -signal.SIGINT, res.stderr[-3000:]
    assert error_lines(res) == [f"error: {STOP_AT_START.format(sig='SIGINT (Ctrl-C)')}"]
    assert "Traceback" not in res.stderr
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "stopped"


@pytest.mark.unit
def test_held_signals_raise_when_released_and_a_second_one_at_once(monkeypatch):
    """While held (jaxlib's initialisation, Hydra's composition), a SIGTERM that stop_handler handles is recorded
    and raised as KeyboardInterrupt on release; a second signal while held raises at once; the handlers are
    back afterwards. stop_text names the signal received first."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(process, "_stop", None)  # this process's first signal is the test's
    monkeypatch.setattr(process, "phase", "start-up")  # (in-process runs of other tests set it)
    try:
        for sig in saved:
            signal.signal(sig, process.stop_handler)
        held = process.HeldSigint()
        held.hold()
        signal.raise_signal(signal.SIGTERM)  # recorded, nothing raised
        assert held.received and process.stop_signal() == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)  # the second: at once
        assert {signal.getsignal(sig) for sig in saved} == {process.stop_handler}
        assert process.stop_text().startswith("stopped by SIGTERM during the start-up")
        with pytest.raises(KeyboardInterrupt):
            with process.HeldSigint():
                signal.raise_signal(signal.SIGTERM)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@pytest.mark.unit
def test_a_second_ctrl_c_during_a_save_silences_orbaxs_log(monkeypatch, capsys):
    """A second Ctrl-C during the steps (e.g. while a checkpoint's save is awaited) ends the run at once; orbax's
    "[absl][ERROR] ... Save Finalize thread ... failed." (logged as its wait is cut short, also from a background
    thread) no longer shows beside the stop's line: absl's logger says nothing more. A first signal keeps it."""
    import logging

    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.NOTSET)
    monkeypatch.setattr(process, "_USER_FULL_ERROR", False)
    handler = logging.StreamHandler()  # stderr, as Hydra's console handler
    absl.addHandler(handler)
    try:
        stop = process.StopOnSignal()
        stop._handle(signal.SIGINT, None)  # the first: save, then stop
        assert absl.isEnabledFor(logging.ERROR)
        with pytest.raises(KeyboardInterrupt):
            stop._handle(signal.SIGINT, None)  # the second: at once
        absl.error("[wait_until_finished] Save Finalize thread (save_finalize) failed.")
    finally:
        absl.removeHandler(handler)
        absl.setLevel(level)  # (setLevel: the loggers' cached levels are cleared too)
    assert "Save Finalize" not in capsys.readouterr().err


@pytest.mark.unit
def test_a_stop_during_the_steps_names_the_checkpoint_folder(monkeypatch):
    """A second Ctrl-C during the steps said "the same command continues from the newest checkpoint", false for a
    run whose folder is new on each launch, and "without saving" though earlier checkpoints exist: the line names
    the checkpoint folder to pass, or says nothing was saved."""
    from training import process

    monkeypatch.setattr(process, "phase", "steps")
    monkeypatch.setattr(process, "_resume_hint", process._resume_hint)
    process.set_resume_hint("/r/checkpoints")
    assert process.stop_text("SIGINT") == (
        "stopped at once by SIGINT (Ctrl-C) during the training steps (a second signal: it did not wait for a "
        "checkpoint); continue with the same command and checkpoint.dir=/r/checkpoints (its newest checkpoint)"
    )
    process.set_resume_hint(None)
    assert process.stop_text("SIGTERM").endswith("; nothing was saved (checkpoint.enabled=false): the same command "
                                                  "starts over")  # fmt: skip


@pytest.mark.unit
def test_a_burst_of_signals_names_the_first_in_the_line_and_the_summary(monkeypatch):
    """SIGTERM then SIGINT during the steps stops at once; a third signal while the run ends made the summary and
    the stderr line name different signals (the summary the default SIGINT, the line the third): both now name
    the first."""
    import signal

    from training import process

    monkeypatch.setattr(process, "_stop", None)
    monkeypatch.setattr(process, "phase", "steps")
    stop = process.StopOnSignal()
    stop._multi = False
    stop._handle(signal.SIGTERM, None)
    with pytest.raises(KeyboardInterrupt):
        stop._handle(signal.SIGINT, None)
    process._note_stop(signal.SIGHUP)  # a later signal, taken by the handler outside the steps
    assert process.stop_signal() == "SIGTERM"
    assert process.stop_text().startswith("stopped at once by SIGTERM during the training steps")
