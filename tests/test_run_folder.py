"""Who owns a run folder (tracking/run_folder.py): a second run started in a folder in use is refused in one line
before it writes anything there; a run killed with SIGKILL leaves no stuck lock; a folder or log file that cannot
be written is one line, not logging's traceback."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.utils import REPO
from tracking import run_folder

SMALL = ["data=synthetic", "optim=sgd", "train.global_batch=64", "wandb.mode=disabled"]
IN_USE = (
    "error: the run folder {folder} is in use by another run (process {pid} on host {host} since {since}); give this "
    "run another folder with hydra.run.dir (hydra.sweep.dir with -m), or wait until that run ends"
)


def train(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled", "HYDRA_FULL_ERROR": ""}
    return subprocess.run(
        [sys.executable, "train.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def complete_steps(ckpt: Path) -> list[int]:
    if not ckpt.is_dir():
        return []
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit() and (p / "meta").is_dir())


def test_second_run_in_a_folder_in_use_is_refused_and_a_killed_run_resumes(tmp_path):
    """Run A trains in a folder; run B started there (other settings) stops at once with one line naming A's
    process, exit 1, and changes nothing of A (.hydra/, summary.json, metrics, checkpoints; A goes on). After
    kill -9 of A, the same folder resumes from A's newest checkpoint (the kernel released A's lock)."""
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    a_args = [*SMALL, "train.steps=100000", "train.log_every=10", "checkpoint.every=20", f"hydra.run.dir={run_dir}"]
    log = tmp_path / "a.log"
    a = subprocess.Popen(
        [sys.executable, "train.py", *a_args],
        cwd=REPO,
        env={**os.environ, "WANDB_MODE": "disabled"},
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 150
        while not complete_steps(ckpt) and a.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert complete_steps(ckpt) and a.poll() is None, log.read_text()[-3000:]
        hydra_before = {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()}
        b = train(*SMALL, "train.steps=20", "train.seed=7", f"hydra.run.dir={run_dir}")
        assert b.returncode == 1, b.stderr[-3000:]
        lock_text = (run_dir / ".lock").read_text().strip()
        host_since = lock_text.split(" on host ", 1)[1]
        host, since = host_since.split(" since ")
        line = IN_USE.format(folder=run_dir, pid=a.pid, host=host, since=since)
        assert lock_text.startswith(f"process {a.pid} on host ")
        assert b.stderr.splitlines() == [line] and b.stdout == ""
        assert a.poll() is None  # A trains on
        assert {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()} == hydra_before
        assert not (run_dir / "summary.json").exists()  # B wrote no failed summary over A's run
        assert (run_dir / "train.log").read_text().count("] - start: ") == 1  # A's start line only
    finally:
        a.kill()
        a.wait()
    newest = complete_steps(ckpt)[-1]
    # the same folder after kill -9: resumes (train.steps shortened so the test ends soon; allowed on resume)
    c = train(*a_args, f"train.steps={newest + 20}")
    assert c.returncode == 0, c.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    resumed = (summary["status"], summary["checkpoint/resumed_step"], summary["train/steps"])
    assert resumed == ("ok", newest, newest + 20)


@pytest.mark.parametrize("blocked", ["train.log", ".lock"])
def test_run_folder_or_log_file_that_cannot_be_written_is_one_line(tmp_path, blocked):
    """A log file (or the lock file) that cannot be opened, here a folder in its place: one line naming it and the
    fix, exit 1, no traceback from logging's set-up, nothing else written in the folder."""
    run_dir = tmp_path / "run"
    (run_dir / blocked).mkdir(parents=True)
    res = train(*SMALL, f"hydra.run.dir={run_dir}")
    assert res.returncode == 1
    if blocked == "train.log":
        line = f"error: the log file {run_dir / 'train.log'} cannot be written (Is a directory); "
    else:
        line = f"error: the run folder {run_dir} cannot be written (Is a directory: {run_dir / '.lock'}); "
    assert res.stderr.splitlines() == [line + "set hydra.run.dir (hydra.sweep.dir with -m) to a folder you can write"]
    assert "Traceback" not in res.stdout + res.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == sorted({".lock", blocked})


# ---- in-process: the lock's rules ------------------------------------------------------------------------
@pytest.fixture
def folder(tmp_path):
    yield tmp_path
    run_folder.release()


def hold(folder: Path, how: int) -> int:
    """Another holder (another open file description, as another process has): its descriptor."""
    fd = os.open(folder / run_folder.LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    os.pwrite(fd, b"process 4242 on host h since 2026-01-01 00:00:00\n", 0)
    return fd


@pytest.mark.unit
def test_claim_refuses_a_folder_held_by_another_run(folder):
    other = hold(folder, fcntl.LOCK_EX)
    try:
        for shared in (False, True):
            with pytest.raises(run_folder.RunFolderError) as e:
                run_folder.claim(folder, shared=shared)
            assert str(e.value).startswith(
                f"the run folder {folder} is in use by another run (process 4242 on host h since 2026-01-01 00:00:00)"
            )
        assert run_folder.held() is None
    finally:
        os.close(other)  # the holder ends: its lock is gone
    run_folder.claim(folder)
    assert run_folder.held() == folder
    assert (folder / ".lock").read_text().startswith(f"process {os.getpid()} on host ")


@pytest.mark.unit
def test_processes_of_one_run_share_the_folder_and_a_single_run_holds_it_alone(folder):
    other = hold(folder, fcntl.LOCK_SH)  # a process of a multi-process run
    try:
        run_folder.claim(folder, shared=True)  # another process of it
        run_folder.settle(multi=True)
        assert run_folder.held() == folder
        with pytest.raises(run_folder.RunFolderError, match="is in use by another run"):
            run_folder.settle(multi=False)  # it turned out a single run: not while another shares the folder
        assert run_folder.held() is None
        with pytest.raises(run_folder.RunFolderError):
            run_folder.claim(folder, shared=False)
    finally:
        os.close(other)
    run_folder.claim(folder, shared=True)
    run_folder.settle(multi=False)  # alone now
    with pytest.raises(BlockingIOError):
        os.close(hold(folder, fcntl.LOCK_SH))


@pytest.mark.unit
def test_a_new_folder_releases_the_previous_one(folder):
    """A sweep's jobs in one process: each job's folder in turn, the previous one released."""
    first, second = folder / "0", folder / "1"
    first.mkdir()
    second.mkdir()
    run_folder.claim(first)
    run_folder.claim(first)  # again: nothing changes
    run_folder.claim(second)
    os.close(hold(first, fcntl.LOCK_EX))  # free again
    with pytest.raises(BlockingIOError):
        hold(second, fcntl.LOCK_EX)


@pytest.mark.unit
@pytest.mark.parametrize(
    "distributed, environ, multi",
    [
        (None, {}, False),
        ({"enabled": None, "coordinator": None, "num_processes": None, "process_id": None}, {}, False),
        ({"enabled": None, "num_processes": 2}, {}, True),
        ({"enabled": True}, {}, True),
        ({"enabled": False, "process_id": 1}, {"SLURM_NTASKS": "8"}, False),
        ({"enabled": None}, {"SLURM_NTASKS": "8"}, True),
        ({"enabled": None}, {"SLURM_NTASKS": "1", "OMPI_COMM_WORLD_SIZE": "x"}, False),
        ({"enabled": None}, {"OMPI_COMM_WORLD_SIZE": "4"}, True),
        ({"enabled": None}, {"JOB_COMPLETION_INDEX": "0"}, True),
    ],
)
def test_maybe_multi(distributed, environ, multi):
    assert run_folder.maybe_multi(distributed, environ) is multi


@pytest.mark.unit
def test_log_handler_says_one_line_for_a_folder_it_cannot_write(folder, monkeypatch, capsys):
    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(run_folder.os, "open", refused)
    with pytest.raises(SystemExit) as e:
        run_folder.RunLog(str(folder / "train.log"))
    monkeypatch.undo()
    assert e.value.code == 1
    assert capsys.readouterr().err == (
        f"error: the run folder {folder} cannot be written (Permission denied: {folder / '.lock'}); set "
        "hydra.run.dir (hydra.sweep.dir with -m) to a folder you can write\n"
    )
    assert not (folder / "train.log").exists()


@pytest.mark.unit
def test_another_users_lock_file_still_locks(folder, monkeypatch):
    """A lock file this process may only read (another user's run made it): locked read-only, still exclusive."""
    (folder / ".lock").write_text("process 1 on host h since 2026-01-01 00:00:00\n")
    real_open = os.open

    def no_write(path, flags, *args):
        if flags & (os.O_RDWR | os.O_WRONLY):
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, *args)

    monkeypatch.setattr(run_folder.os, "open", no_write)
    run_folder.claim(folder)
    monkeypatch.undo()
    assert run_folder.held() == folder
    with pytest.raises(BlockingIOError):
        os.close(hold(folder, fcntl.LOCK_SH))


def test_killed_holder_leaves_no_stuck_lock(tmp_path):
    """A process holding the lock killed with SIGKILL: the kernel releases it, the folder can be claimed."""
    code = (
        "import sys, time; sys.path.insert(0, '.'); from tracking import run_folder; "
        f"run_folder.claim({str(tmp_path)!r}); print('held', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(run_folder.RunFolderError, match=f"process {holder.pid} on host"):
            run_folder.claim(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    run_folder.claim(tmp_path)
    assert run_folder.held() == tmp_path
    run_folder.release()


# ---- the checkpoint folder: checkpoint.dir outside the run folder ----------------------------------------------
CKPT_IN_USE = (
    "checkpoint.dir={directory} is in use by another run (process 4242 on host h since 2026-01-01 00:00:00); give "
    "this run another checkpoint.dir, or wait until that run ends"
)


def test_second_run_saving_into_a_checkpoint_folder_in_use_is_refused(tmp_path):
    """Run A trained into checkpoint.dir (outside its run folder: .lock there is no step to orbax) and holds it (the
    test holds its lock as A's process would); run B with another run folder and the same checkpoint.dir stops
    before it writes there: one line naming A's process and run folder and the fix, exit 1, B's summary failed with
    that line, no metrics; nothing of A's checkpoints changes. Before: both wrote, both failed with "Directory not
    empty" and A's summary said failed."""
    shared, a_dir, b_dir = tmp_path / "ckpts", tmp_path / "a", tmp_path / "b"
    args = [*SMALL, "train.steps=20", "checkpoint.every=10", "checkpoint.keep=1", f"checkpoint.dir={shared}"]
    a = train(*args, f"hydra.run.dir={a_dir}")
    assert a.returncode == 0, a.stderr[-3000:]
    assert sorted(p.name for p in shared.iterdir()) == [".lock", "20"]  # orbax pruned step 10 beside the lock file
    assert f"run folder {a_dir}" in (shared / ".lock").read_text()
    before = {p: p.read_bytes() for p in shared.rglob("*") if p.is_file()}
    run_folder.claim_checkpoints(shared, a_dir)  # A runs again (or still runs)
    try:
        holder = (shared / ".lock").read_text().strip()
        assert holder.startswith(f"process {os.getpid()} on host ") and holder.endswith(f", run folder {a_dir}")
        b = train(*args, "train.steps=40", f"hydra.run.dir={b_dir}")
    finally:
        run_folder.release_checkpoints()
    line = (
        f"checkpoint.dir={shared} is in use by another run ({holder}); give this run another checkpoint.dir, or wait "
        "until that run ends"
    )
    assert b.returncode == 1 and b.stderr.splitlines() == [f"error: {line}"], b.stderr[-3000:]
    assert {p: p.read_bytes() for p in shared.rglob("*") if p.is_file() and p.name != ".lock"} == {
        p: v for p, v in before.items() if p.name != ".lock"
    }
    summary = json.loads((b_dir / "summary.json").read_text())
    assert (summary["status"], summary["error"]) == ("failed", line)
    assert not (b_dir / "metrics.jsonl").exists() and json.loads((a_dir / "summary.json").read_text())["status"] == "ok"


@pytest.fixture
def checkpoints(tmp_path):
    yield tmp_path
    run_folder.release_checkpoints()


@pytest.mark.unit
def test_claim_checkpoints_refuses_a_folder_held_by_another_run(checkpoints):
    """<checkpoint.dir>/.lock held by another run: refused alone or shared, naming it; free again: claimed."""
    directory, run_dir = checkpoints / "ckpts", checkpoints / "run"
    directory.mkdir()
    other = hold(directory, fcntl.LOCK_EX)
    try:
        for shared in (False, True):
            with pytest.raises(run_folder.RunFolderError) as e:
                run_folder.claim_checkpoints(directory, run_dir, shared=shared)
            assert str(e.value) == CKPT_IN_USE.format(directory=directory)
    finally:
        os.close(other)
    run_folder.claim_checkpoints(directory, run_dir)
    with pytest.raises(BlockingIOError):
        os.close(hold(directory, fcntl.LOCK_SH))


@pytest.mark.unit
def test_checkpoints_in_another_run_folder_take_that_run_folders_lock(checkpoints):
    """checkpoint.dir=<old run>/checkpoints (the README's resume after a crash) while that run still runs: refused
    by its run folder's lock; in this run's own folder no lock of its own (the run folder's covers it)."""
    old, run_dir = checkpoints / "old", checkpoints / "run"
    (old / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra").mkdir(parents=True)
    other = hold(old, fcntl.LOCK_EX)
    try:
        with pytest.raises(run_folder.RunFolderError) as e:
            run_folder.claim_checkpoints(old / "checkpoints", run_dir)
        assert str(e.value) == CKPT_IN_USE.format(directory=old / "checkpoints")
    finally:
        os.close(other)
    assert not (old / "checkpoints").exists()
    run_folder.claim_checkpoints(run_dir / "checkpoints", run_dir)
    assert not (run_dir / "checkpoints").exists() and not (run_dir / ".lock").exists()


@pytest.mark.unit
def test_processes_of_one_run_share_a_checkpoint_folder_and_an_unused_one_is_removed(checkpoints):
    """A process of a multi-process run shares the lock with the others; a folder the claim made and nobody saved
    into is removed with its lock file when released (a run refused later for bad input leaves nothing there)."""
    directory = checkpoints / "new" / "ckpts"
    run_folder.claim_checkpoints(directory, checkpoints / "run", shared=True)
    os.close(hold(directory, fcntl.LOCK_SH))  # another process of the run
    run_folder.release_checkpoints()
    assert not directory.exists() and (checkpoints / "new").is_dir()
    run_folder.claim_checkpoints(directory, checkpoints / "run")
    (directory / "10").mkdir()  # a step saved
    run_folder.release_checkpoints()
    assert sorted(p.name for p in directory.iterdir()) == [".lock", "10"]


@pytest.mark.unit
def test_a_resume_into_another_run_folders_checkpoints_leaves_its_lock_file_as_it_was(checkpoints):
    """checkpoint.dir=<old run>/checkpoints (the README's resume after a crash) takes the old run folder's lock:
    it rewrote that run's .lock text (also when the resume was then refused); now the old run's .lock bytes stay as
    they were, and a run refused while the resume holds it names no process of the old run that has ended."""
    import socket

    from training.run import run_and_report
    from utils import make_cfg

    old, new = checkpoints / "old", checkpoints / "new"
    (old / ".hydra").mkdir(parents=True)
    new.mkdir()

    def cfg(steps, seed=0, directory=None):
        return make_cfg(
            {
                "data": {"name": "synthetic", "eval_size": 500},
                "mesh": {"devices": 2},
                "wandb": {"mode": "disabled"},
                "checkpoint": {"dir": None if directory is None else str(directory), "every": 10},
                "train": {"steps": steps, "seed": seed, "log_every": 5, "eval_batch": 500},
            }
        )

    assert run_and_report(cfg(10), old)  # its own checkpoints/ (its run folder's lock covers them)
    text = f"process 4194305 on host {socket.gethostname()} since 2026-01-01 00:00:00\n".encode()  # ended
    (old / ".lock").write_bytes(text)
    assert run_and_report(cfg(20, directory=old / "checkpoints"), new)
    assert (old / ".lock").read_bytes() == text and (old / "checkpoints" / "20").is_dir()
    assert not run_and_report(cfg(30, seed=1, directory=old / "checkpoints"), new)  # refused: train.seed changed
    assert (old / ".lock").read_bytes() == text
    run_folder.release_checkpoints()
    other = os.open(old / ".lock", os.O_RDONLY)  # the resumed run holds it (another process)
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        with pytest.raises(run_folder.RunFolderError) as e:
            run_folder.claim_checkpoints(old / "checkpoints", checkpoints / "third")
        assert str(e.value) == (
            f"checkpoint.dir={old / 'checkpoints'} is in use by another run (another process); give this run another "
            "checkpoint.dir, or wait until that run ends"
        )
    finally:
        os.close(other)
    assert (old / ".lock").read_bytes() == text


# ---- a folder of another kind as hydra.run.dir ------------------------------------------------------------------
def _files(folder: Path) -> dict:
    """``path -> (modification time, bytes)`` of every file below ``folder``."""
    return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.rglob("*")) if p.is_file()}


def test_another_runs_checkpoint_folder_as_run_folder_is_refused_before_anything_is_written(tmp_path):
    """hydra.run.dir=<finished run>/checkpoints used to write a whole run (.hydra/, checkpoints/2/, ...) among the
    old run's steps, and evaluating the old run then read the new one's step; so did a folder inside its .hydra/,
    the run's folder, a step or its checkpoint folder (one named like a step, 1000, was then renamed 1000.corrupt by
    the old run's resume). Now one line names the old run, and nothing in its folder changes; a folder of its own
    (the fix) trains; a run folder found in a checkpoint folder is no damaged step: a resume leaves it where it is;
    continued with other overrides, the first run's Hydra files are kept beside."""
    old = tmp_path / "r9"
    assert train(*SMALL, "train.steps=2", f"hydra.run.dir={old}").returncode == 0
    before = _files(old)

    for given, says in [
        (old / "checkpoints", f"is the checkpoint folder of run {old} (it holds checkpoint steps 2)"),
        (old / "checkpoints" / "2", f"is checkpoint step 2 of run {old} (state/, meta/)"),
        (old / ".hydra", f"is Hydra's folder of run {old}"),
        (old / ".hydra" / "run", f"is inside {old / '.hydra'}, Hydra's folder of run {old}"),
        (old / "checkpoints" / "2" / "state", f"is inside checkpoint step 2 of run {old}"),
        (old / "checkpoints" / "1000", f"is inside the checkpoint folder of run {old}"),
        (old / "extra", f"is inside the folder of run {old}"),  # (before: a new run written inside the old one)
    ]:
        proc = train(*SMALL, "train.steps=2", f"hydra.run.dir={given}")
        assert proc.returncode == 1
        assert proc.stderr.splitlines() == [f"error: hydra.run.dir={given} {says}; give the run a folder of its own"], (
            proc.stderr[-3000:]
        )
    assert _files(old) == before
    assert sorted(p.name for p in (old / "checkpoints").iterdir()) == ["2"]  # no .hydra/, .lock, train.log

    own = train(*SMALL, "train.steps=2", f"hydra.run.dir={tmp_path / 'own'}")
    assert own.returncode == 0, own.stderr[-3000:]
    assert complete_steps(tmp_path / "own" / "checkpoints") == [2]

    user = old / "checkpoints" / "1000"  # a run folder put there by hand (or by an earlier version)
    (user / ".hydra").mkdir(parents=True)
    (user / "summary.json").write_text('{"status": "ok"}')
    resumed = train(*SMALL, "train.steps=4", f"hydra.run.dir={old}")
    assert resumed.returncode == 0 and "corrupt" not in resumed.stderr, resumed.stderr[-3000:]
    assert sorted(p.name for p in (old / "checkpoints").iterdir()) == ["1000", "2", "4"]
    # continued with another override: Hydra's files of the first run are kept beside the new ones (before: lost)
    (kept,) = (old / ".hydra").glob("overrides.previous-*.yaml")
    assert "train.steps=2" in kept.read_text() and "train.steps=4" in (old / ".hydra" / "overrides.yaml").read_text()
    warned = f"warning: {old / '.hydra'} held the Hydra files of an earlier run, rewritten for this one: the earlier"
    assert f"{warned} ones kept as config.previous-" in resumed.stderr, resumed.stderr[-3000:]
    assert sorted(p.name for p in user.iterdir()) == [".hydra", "summary.json"]


@pytest.mark.unit
def test_only_the_processes_of_one_job_share_a_run_folder(folder):
    """Two multi-process jobs given one run folder (two sbatch jobs with the same RUN_DIR): the second is refused,
    not mixed into the first one's files; a process of the first job shares it; the first process names its job."""
    other = hold(folder, fcntl.LOCK_SH)
    os.pwrite(other, b"process 4242 on host h since 2026-01-01 00:00:00\njob slurm job 1\n", 0)
    try:
        with pytest.raises(run_folder.RunFolderError) as e:
            run_folder.claim(folder, shared=True, job="slurm job 2")
        assert str(e.value).startswith(f"the run folder {folder} is in use by another run (process 4242 on host h")
        assert run_folder.held() is None
        run_folder.claim(folder, shared=True, job="slurm job 1")
        assert run_folder.held() == folder
    finally:
        run_folder.release()
        os.close(other)
    run_folder.claim(folder, shared=True, job="slurm job 3")  # the first of its job: writes its name
    assert (folder / ".lock").read_text().splitlines()[1] == "job slurm job 3"
    assert run_folder.job_identity({"coordinator": "h:1"}, {}) == "coordinator h:1"
    assert run_folder.job_identity({"coordinator": "h:1"}, {"SLURM_JOB_ID": "9"}) == "slurm job 9"


def test_another_runs_folder_as_checkpoint_dir_is_refused_before_anything_is_written(tmp_path):
    """checkpoint.dir=<another run's run folder> (summary.json, .hydra/) was taken: a step was written beside its
    checkpoints/; so was a folder inside it: one of its steps (its .lock was rewritten), its best/ (resumed from
    with a false warning), its .hydra/. Now one line names its checkpoint folder (which continues it) and nothing
    in the old folder changes."""
    old = tmp_path / "r9"
    assert train(*SMALL, "train.steps=2", "checkpoint.keep_best=eval/loss", f"hydra.run.dir={old}").returncode == 0
    before = _files(old)
    fix = f"give its checkpoint folder, checkpoint.dir={old / 'checkpoints'}, to continue it, or a folder of its own"
    inside = f"is inside the folder of another run, {old}, and not its checkpoint folder; {fix}"
    for k, (given, says) in enumerate(
        [
            (old, f"is the folder of another run (summary.json or .hydra/), not a checkpoint folder; {fix}"),
            (old / "checkpoints" / "2", inside),
            (old / "checkpoints" / "best", inside),
            (old / ".hydra", inside),
        ]
    ):
        proc = train(*SMALL, "train.steps=4", f"checkpoint.dir={given}", f"hydra.run.dir={tmp_path / f'new{k}'}")
        assert proc.returncode == 1
        assert proc.stderr.splitlines() == [f"error: checkpoint.dir={given} {says}"], proc.stderr[-3000:]
    assert _files(old) == before and sorted(p.name for p in old.iterdir()) == sorted(
        [".hydra", ".lock", "checkpoints", "metrics.jsonl", "summary.json", "train.log"]
    )
    assert sorted(p.name for p in (old / "checkpoints").iterdir()) == ["2", "best"]


@pytest.mark.unit
def test_a_sweep_folder_as_checkpoint_dir_is_refused_before_its_lock(tmp_path, capsys):
    """checkpoint.dir=<a sweep folder> took its jobs 0 and 1 for damaged steps ("move its step folders away", which
    would move the jobs) and left a .lock there; now one line names a job's checkpoint folder, which continues it,
    and nothing is written in the sweep folder."""
    from training.checkpoint.plan import prepare
    from conf.schema import CheckpointConfig
    from core.errors import ConfigError
    from training.run import run_and_report
    from utils import fake_sweep, make_cfg

    sweep, run = fake_sweep(tmp_path / "sweep"), tmp_path / "run"
    run.mkdir()
    before = _files(sweep)
    cfg = make_cfg({"data": {"name": "synthetic"}, "wandb": {"mode": "disabled"}, "checkpoint": {"dir": str(sweep)}})
    assert not run_and_report(cfg, run)
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: checkpoint.dir={sweep} is a sweep folder (jobs 0, 1), not a checkpoint folder; to continue a job "
        f"give its checkpoint folder, e.g. checkpoint.dir={sweep / '0'}/checkpoints, or a folder of its own"
    )
    assert _files(sweep) == before and not (sweep / ".lock").exists()
    with pytest.raises(ConfigError, match=f"is inside the folder of another run, {sweep / '0'}, and not its"):
        prepare(CheckpointConfig(dir=str(sweep / "0" / "checkpoints" / "4")), run)
    assert prepare(CheckpointConfig(dir=str(sweep / "0" / "checkpoints")), run).directory == sweep / "0" / "checkpoints"
    assert prepare(CheckpointConfig(dir=str(run / "ckpt")), run).directory == run / "ckpt"  # inside its own
    done = tmp_path / "done"  # a run without .hydra/ (run_and_report): the folder its summary names continues it
    done.mkdir()
    (done / "summary.json").write_text(json.dumps({"checkpoint/dir": str(done / "ckpt")}))
    assert prepare(CheckpointConfig(dir=str(done / "ckpt")), run).directory == done / "ckpt"
    from tracking.folders import not_own_folder  # a job's folder in a sweep's, a run's in a plain folder: theirs

    assert (
        not_own_folder(sweep / "2", "hydra.run.dir") is None
        and not_own_folder(tmp_path / "plain" / "a" / "b", "hydra.run.dir") is None
    )
    assert not_own_folder(run / "a" / "b", "hydra.run.dir") == (  # (run holds its summary.json: a run's folder)
        f"hydra.run.dir={run / 'a' / 'b'} is inside the folder of run {run}; give the run a folder of its own"
    )


@pytest.mark.unit
def test_a_refused_tokenizer_change_writes_nothing_in_the_checkpoint_folder(tmp_path):
    """Resuming a byte-level GPT run with data.tokenizer=bpe is refused, but the BPE tokenizer.json was written into
    the old run's checkpoint folder first; now the refusal comes before any write there."""
    from training.run import run_and_report
    from utils import make_cfg

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be, that is the question\n" * 400)
    ckpt = tmp_path / "ckpt"

    def gpt(run: str, tokenizer: str) -> bool:
        (tmp_path / run).mkdir()
        data = {"name": "text", "path": str(corpus), "cache_dir": str(tmp_path / "cache"), "tokenizer": tokenizer}
        cfg = make_cfg(
            {
                "model": {"name": "gpt", "size": "tiny", "depth": 1, "width": 32, "heads": 2, "context": 32},
                "data": {**data, "vocab_size": 300} if tokenizer == "bpe" else data,
                "mesh": {"devices": 1},
                "wandb": {"mode": "disabled"},
                "checkpoint": {"dir": str(ckpt), "every": 2},
                "train": {"steps": 4 if run == "old" else 6, "log_every": 2, "eval_batch": 64, "global_batch": 8},
            }
        )
        return run_and_report(cfg, tmp_path / run)

    assert gpt("old", "bytes")
    before = _files(ckpt)
    assert not gpt("new", "bpe")
    summary = json.loads((tmp_path / "new" / "summary.json").read_text())
    assert summary["status"] == "failed" and "data.tokenizer" in summary["error"], summary
    assert _files(ckpt) == before and not (ckpt / "tokenizer.json").exists()
