"""Who owns a run folder: the run holding its lock, ``<run folder>/.lock`` (``fcntl.flock``, an advisory lock the
kernel releases when the process ends, however it ends: a crash or ``kill -9`` leaves nothing stuck).

The lock is taken when Hydra opens the job's log file (``RunLog``, the ``file`` handler of ``hydra.job_logging``
in ``conf/config.yaml``): after Hydra made the folder and before it writes anything there (``.hydra/``, the log),
so a second run started in a folder in use stops with one line, exit code 1, and changes nothing of the first
run. A run folder or log file that cannot be written is one line too (not logging's traceback).

A single run holds the lock alone (``LOCK_EX``). The processes of one multi-process run share the folder: when
the config or the environment says the run may have several processes (``distributed.*`` set, or a SLURM,
Open MPI, Kubernetes or TPU job of more than one task: ``maybe_multi``), each process takes it shared
(``LOCK_SH``), and only with the processes of its own job (``job_identity``: the SLURM job, or the coordinator;
the first process writes it into the lock file); ``settle`` then holds it alone once the run turns out to be a
single process. Standard library
only: Hydra imports this module while it configures logging.

A ``checkpoint.dir`` outside the run folder is claimed the same way before the run writes there
(``claim_checkpoints``): two runs saving into one checkpoint folder would replace each other's steps.
"""

from __future__ import annotations

import atexit
import datetime
import errno
import fcntl
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Optional

LOCK_NAME = ".lock"
FOLDER_KEYS = "hydra.run.dir (hydra.sweep.dir with -m)"
# environment variables that say how many processes a cluster job has (those JAX's cluster detection reads)
_TASK_COUNTS = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
_MULTI_MARKERS = ("JOB_COMPLETION_INDEX", "TPU_WORKER_HOSTNAMES", "MEGASCALE_NUM_SLICES")

_held: Optional[tuple[Path, int, bool]] = None  # (folder, file descriptor, shared) of the lock this process holds
_unlockable_said: set[Path] = set()


class RunFolderError(Exception):
    """The run folder is in use by another run, or cannot be written; the message is one line with the fix."""


def maybe_multi(distributed: Optional[Mapping[str, Any]], environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process may be one of several of a run (they then share the folder), from the ``distributed``
    settings (``conf.schema.DistributedConfig`` as a dict) and the environment, before JAX is imported:
    ``enabled=false`` never; ``enabled=true`` or any of ``coordinator``/``num_processes``/``process_id`` set always;
    else a cluster job of more than one task (SLURM, Open MPI; a Kubernetes indexed job, a TPU slice)."""
    d = dict(distributed or {})
    if d.get("enabled") is False:
        return False
    if d.get("enabled") is True or any(d.get(k) is not None for k in ("coordinator", "num_processes", "process_id")):
        return True
    for name in _TASK_COUNTS:
        try:
            if int(environ.get(name, "1")) > 1:
                return True
        except ValueError:
            continue
    return any(environ.get(name) for name in _MULTI_MARKERS)


def job_identity(distributed: Optional[Mapping[str, Any]], environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """What names the multi-process job this process belongs to, the same on all its processes and no other job's:
    ``slurm job <id>`` (``SLURM_JOB_ID``; a requeued job keeps its id, and its earlier processes are gone), else
    ``coordinator <host:port>`` (``distributed.coordinator``), else None (nothing tells: the folder is shared with
    any process that takes it shared)."""
    if environ.get("SLURM_JOB_ID"):
        return f"slurm job {environ['SLURM_JOB_ID']}"
    coordinator = dict(distributed or {}).get("coordinator")
    return f"coordinator {coordinator}" if coordinator else None


def _holder_job(fd: int) -> Optional[str]:
    """The job the lock file names (its ``job ...`` line), or None."""
    try:
        text = os.pread(fd, 400, 0).decode("utf-8", "replace")
    except OSError:
        return None
    jobs = [line[4:].strip() for line in text.splitlines() if line.startswith("job ")]
    return jobs[0] if jobs else None


SHARE_WAIT_S = 2.0  # a process of the same job may hold the lock alone for a moment (the first, writing its text)


def _share(fd: int, job: Optional[str]) -> None:
    """Takes the lock shared for a process of job ``job``: the first process (it gets the lock alone) writes the
    job's name into the lock file first; a later one shares it only with the same job. Raises ``BlockingIOError``
    when another run holds it alone (after ``SHARE_WAIT_S``) or another job shares it."""
    if job is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass
        else:  # the first: its job's name, then shared
            _write_holder(fd, job=job)
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return
    deadline = time.monotonic() + (SHARE_WAIT_S if job is not None else 0.0)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    held_by = _holder_job(fd)
    if job is not None and held_by is not None and held_by != job:
        fcntl.flock(fd, fcntl.LOCK_UN)
        raise BlockingIOError(errno.EWOULDBLOCK, f"held by {held_by}")


def _holder(fd: int) -> str:
    """What the lock file says of the run holding it (``process P on host H since T``), or ``another process`` (also
    when it names a process of this host that has ended: the text of a run folder another run's checkpoints lock,
    ``claim_checkpoints``)."""
    try:
        text = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    words = text.split()
    if len(words) > 4 and words[1].isdigit() and words[4] == socket.gethostname() and not _alive(int(words[1])):
        return "another process"
    return text.splitlines()[0] if text else "another process"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        pass
    return True


def _in_use_line(folder: Path, holder: str) -> str:
    return (
        f"the run folder {folder} is in use by another run ({holder}); give this run another folder with "
        f"{FOLDER_KEYS}, or wait until that run ends"
    )


def claim(folder: Path, shared: bool = False, job: Optional[str] = None) -> None:
    """Takes the lock of run folder ``folder`` for this process (shared with the other processes of job ``job``, or
    alone), releasing the one it held for an earlier folder (the previous job of a sweep run in this process); again
    for the same folder, nothing.

    Raises:
      RunFolderError: another run holds the lock (the line names it), or the lock file cannot be created (the folder
        cannot be written). A file system without locks (some network ones) only warns, once per folder.
    """
    global _held
    folder = Path(folder).absolute()
    if _held is not None:
        if _held[0] == folder:
            return
        release()
    fd = _lock(
        folder,
        shared,
        in_use=lambda holder: _in_use_line(folder, holder),
        unwritable=lambda why: (
            f"the run folder {folder} cannot be written ({why}); set {FOLDER_KEYS} to a folder you can write"
        ),
        job=job if shared else None,
    )
    if fd is not None:
        _held = (folder, fd, shared)
        _write_holder(fd, job=job if shared else None)


def _lock(folder: Path, shared: bool, in_use, unwritable, job: Optional[str] = None) -> Optional[int]:
    """Locks ``<folder>/.lock`` (created when missing) shared (with the processes of job ``job``: ``_share``) or
    alone; returns its file descriptor, or None on a file system without locks (one warning per folder). Raises
    RunFolderError with ``in_use(holder)`` when another run holds it, ``unwritable(why)`` when the lock file cannot
    be created."""
    path = folder / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        try:  # another user's lock file in a folder this run can write: a lock needs no write access to it
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC) if isinstance(e, PermissionError) else -1
        except OSError:
            fd = -1
        if fd < 0:
            raise RunFolderError(unwritable(f"{e.strerror or type(e).__name__}: {path}")) from None
    try:
        if shared:
            _share(fd, job)
        else:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _holder(fd) if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
        os.close(fd)
        if holder is not None:
            raise RunFolderError(in_use(holder)) from None
        if folder not in _unlockable_said:  # ENOLCK, EOPNOTSUPP ...: the file system has no locks
            _unlockable_said.add(folder)
            print(
                f"warning: {folder} cannot be locked ({e.strerror or type(e).__name__}): a second run started "
                f"with it would not be refused",
                file=sys.stderr,
                flush=True,
            )
        return None
    return fd


def _write_holder(fd: int, run_dir: Optional[Path] = None, job: Optional[str] = None) -> None:
    since = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    of = "" if run_dir is None else f", run folder {run_dir}"
    text = f"process {os.getpid()} on host {socket.gethostname()} since {since}{of}\n" + (f"job {job}\n" if job else "")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, text.encode(), 0)
    except OSError:  # only informs a refused run
        pass


# ---- the checkpoint folder -------------------------------------------------------------------------------------
_checkpoints: Optional[tuple[Path, int, bool]] = None  # (locked folder, file descriptor, made by this process)


def enclosing_run(directory: Path, levels: int = 3) -> Optional[Path]:
    """The run folder (it holds Hydra's ``.hydra/``) that is ``directory`` or holds it within ``levels`` levels."""
    for folder in (directory, *list(directory.parents)[:levels]):
        if (folder / ".hydra").is_dir():
            return folder
    return None


def claim_checkpoints(directory: Path, run_dir: Path, shared: bool = False) -> None:
    """Takes, for this process, the lock that says which run writes checkpoint folder ``directory``: nothing when it
    lies in run folder ``run_dir`` (whose lock covers it); the lock of another run folder holding it (a resume with
    ``checkpoint.dir=<old run>/checkpoints``; its ``.lock`` text is left as it is); else ``<directory>/.lock`` (the
    folder is made when missing). The processes of one multi-process run share it (``shared``). Releases the one
    held for an earlier job's folder. Readers take none (``python -m evaluate``, ``python -m sample``,
    ``checkpoint.resume=``).

    Raises:
      RunFolderError: another run holds it (the line names the process and its run folder), or the folder cannot be
        made.
    """
    global _checkpoints
    directory, run_dir = Path(directory).absolute(), Path(run_dir).absolute()
    owner = enclosing_run(directory)
    if owner == run_dir or run_dir in directory.parents or directory == run_dir:
        return
    folder = owner or directory
    if _checkpoints is not None:
        if _checkpoints[0] == folder:
            return
        release_checkpoints()
    key = f"checkpoint.dir={directory}"
    made = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = _lock(
            folder,
            shared,
            in_use=lambda holder: (
                f"{key} is in use by another run ({holder}); give this run another checkpoint.dir, "
                f"or wait until that run ends"
            ),
            unwritable=lambda why: f"{key} cannot be written ({why}); choose a folder you can write to",
        )
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise RunFolderError(f"{key} cannot be written ({why}); choose a folder you can write to") from None
    if fd is not None:
        if not _release_at_exit:
            _release_at_exit.append(atexit.register(release_checkpoints))  # an unused folder it made goes
        _checkpoints = (folder, fd, made)
        if owner is None:  # another run's folder keeps its own .lock text: nothing of that run changes
            _write_holder(fd, run_dir)


_release_at_exit: list = []  # release_checkpoints, once registered


def release_checkpoints() -> None:
    """Releases the checkpoint folder's lock this process holds; a folder it made that holds nothing else (the run
    saved no checkpoint) is removed with its lock file. Nothing when none is held."""
    global _checkpoints
    if _checkpoints is None:
        return
    folder, fd, made = _checkpoints
    _checkpoints = None
    try:
        if made and os.listdir(folder) == [LOCK_NAME]:
            os.unlink(folder / LOCK_NAME)
            os.rmdir(folder)
    except OSError:
        pass
    os.close(fd)


def settle(multi: bool) -> None:
    """Once the run knows whether it has several processes (after ``jax.distributed``): a single process holds the
    lock alone; a process of a multi-process run holds it shared. Nothing when no lock is held.

    Raises:
      RunFolderError: a single process took the lock shared and another run shares it (the line names it).
    """
    global _held
    if _held is None or _held[2] == multi:
        return
    folder, fd, _ = _held
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if multi else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            return
        holder = _holder(fd)
        release()
        raise RunFolderError(_in_use_line(folder, holder)) from None
    _held = (folder, fd, multi)
    if not multi:
        _write_holder(fd)


def release() -> None:
    """Releases the lock this process holds (closing its file releases it); nothing when none is held."""
    global _held
    if _held is not None:
        os.close(_held[1])
        _held = None


def held() -> Optional[Path]:
    """The run folder whose lock this process holds, or None."""
    return None if _held is None else _held[0]


def refuse(error: RunFolderError) -> None:
    """Prints ``error: <line>`` and exits with code 1 (``SystemExit``: it passes logging's and Hydra's handlers of
    ``Exception``, which would print a traceback instead)."""
    print(f"error: {error}", file=sys.stderr, flush=True)
    raise SystemExit(1)


class RunLog(logging.FileHandler):
    """Hydra's log file handler (``hydra.job_logging.handlers.file``): claims the run folder (``claim``: shared when
    ``maybe_multi(distributed)``), then opens the file. A folder in use, or a folder or log file that cannot be
    written, prints one ``error:`` line and exits 1 before Hydra writes anything there."""

    def __init__(
        self,
        filename: str,
        mode: str = "a",
        encoding: Optional[str] = None,
        delay: bool = False,
        errors: Optional[str] = None,
        distributed: Optional[Mapping[str, Any]] = None,
    ):
        try:
            claim(Path(filename).parent, shared=maybe_multi(distributed), job=job_identity(distributed))
        except RunFolderError as e:
            refuse(e)
        try:
            super().__init__(filename, mode, encoding, delay, errors)
        except OSError as e:
            refuse(
                RunFolderError(
                    f"the log file {filename} cannot be written ({e.strerror or type(e).__name__}); set "
                    f"{FOLDER_KEYS} to a folder you can write"
                )
            )


def running_holder(folder: Path) -> Optional[str]:
    """What runs in ``folder`` now (``process P on host H since T``, from its ``.lock``), or None when no process
    holds the folder's lock. Looks without locking (a lock taken to look could refuse a run starting that instant):
    this host's ``/proc/locks`` lists the lock file's inode while a process holds it; without it (not Linux), the
    process named in the file is asked whether it runs. A lock held from another host is not seen: a process of
    another host is reported as running."""
    path = Path(folder) / LOCK_NAME
    try:
        text = path.read_text(errors="replace").strip().splitlines()
        st = path.stat()
    except OSError:
        return None
    holder = text[0] if text else "another process"
    words = holder.split()
    here = len(words) > 4 and words[0] == "process" and words[1].isdigit() and words[4] == socket.gethostname()
    if len(words) > 4 and words[0] == "process" and not here:
        return holder  # another host's process: its lock is not visible here
    try:
        with open("/proc/locks") as f:
            locks = f.read().splitlines()
    except OSError:
        return holder if here and _alive(int(words[1])) else None
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"  # /proc/locks: MAJOR:MINOR:INODE
    for line in locks:
        fields = line.split()
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == where:
            return holder
    return None
