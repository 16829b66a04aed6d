"""The cluster commands of the README against a real SLURM cluster on this machine (``scripts/slurm_cluster.sh``:
slurmctld and two slurmd, nodes n1 and n2, partitions ``debug`` and ``urgent``, no accounting).

``.ci/run`` starts the cluster before pytest and stops it after. Elsewhere, a machine without it (no root, no
packages) skips these tests with the reason; under ``CI=true`` a cluster that is not up fails them.

Every job is 2 tasks x 2 simulated CPU devices training the MLP on synthetic data with SGD; an uninterrupted
1-process run of the same global batch on 4 devices is the reference every job must end equal to.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from utils import REPO

pytestmark = pytest.mark.slurm

STEPS = 300
SMALL = [
    "data=synthetic",
    "optim=sgd",
    "train.global_batch=64",
    "train.log_every=10",
    "checkpoint.every=0",
    "wandb.mode=disabled",
]
TASK = [*SMALL, "runtime.cpu_devices=2", f"train.steps={STEPS}"]
CLUSTER_VARS = ("SLURM_", "SRUN_", "SBATCH_", "SUBMITIT_", "OMPI_", "PMI_", "JAX_COORDINATOR", "JAX_NUM_CPU_DEVICES")
JOB_TIMEOUT_S = 240.0
STOP_LINE = re.compile(
    r"^(?:0: )?error: stopped by SIGTERM \(preemption, all processes\) after step (\d+) of (\d+); checkpoint saved in "
    r"(\S+); (.*)$",
    re.M,
)


def cluster_problem() -> str | None:
    """None when the cluster answers with both nodes up, else why not."""
    try:
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"no SLURM cluster here ({e}); start one (as root) with: bash scripts/slurm_cluster.sh start"
    states = dict(line.split() for line in r.stdout.splitlines() if len(line.split()) == 2)
    if (
        r.returncode != 0
        or sorted(states) != ["n1", "n2"]
        or any(s.startswith(("down", "drain")) for s in states.values())
    ):
        return f"the SLURM cluster of scripts/slurm_cluster.sh is not up ({(r.stdout + r.stderr).strip()!r})"
    return None


JOB_NAME = "dp-scaling-test"  # every job a test submits: cancelled when the test ends, whatever happened


@pytest.fixture
def cluster():
    problem = cluster_problem()
    if problem is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but {problem}")
        pytest.skip(problem)
    yield
    for proc in Path("/proc").iterdir():  # a sweep's launching process a failed test left
        try:
            if proc.name.isdigit() and f"hydra.launcher.name={JOB_NAME}".encode() in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
            continue
    subprocess.run(["scancel", f"--name={JOB_NAME}", "--signal=KILL"], capture_output=True, timeout=60)
    wait_for(
        lambda: (
            not subprocess.run(
                ["squeue", "-h", f"--name={JOB_NAME}"], capture_output=True, text=True, timeout=60
            ).stdout.strip()
        ),
        60,
        "the test's jobs to end",
    )


def job_env(**extra: str) -> dict:
    """The jobs' environment: this Python first on PATH, no cluster variables of the test's own, no W&B."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLUSTER_VARS)}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(WANDB_MODE="disabled", PYTHONUNBUFFERED="1", **extra)
    return env


def sbatch(tmp: Path, run_dir: Path, overrides: list[str], *options: str, env: dict | None = None) -> str:
    """Submits ``scripts/sbatch_example.sh`` as the README does; returns the job id."""
    r = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"--job-name={JOB_NAME}",
            f"--output={tmp}/slurm-%j.out",
            f"--export=ALL,RUN_DIR={run_dir}",
            *options,
            "scripts/sbatch_example.sh",
            *overrides,
        ],
        cwd=REPO,
        env=env or job_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def listed(job: str) -> bool:
    r = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=60)
    return bool(r.stdout.strip())


def job_fields(job: str) -> dict:
    r = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=60)
    return dict(f.split("=", 1) for f in r.stdout.split() if "=" in f)


def wait_job(job: str, timeout_s: float = JOB_TIMEOUT_S) -> dict:
    """Waits until SLURM no longer lists ``job`` (cancelled after ``timeout_s``); returns its ``scontrol`` fields."""
    deadline = time.monotonic() + timeout_s
    while listed(job):
        if time.monotonic() > deadline:
            subprocess.run(["scancel", "--signal=KILL", job], timeout=60)
            raise AssertionError(f"job {job} still listed after {timeout_s} s")
        time.sleep(0.5)
    return job_fields(job)


def logged_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return max([json.loads(line)["step"] for line in lines if line.strip()] or [0])


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s} s"
        time.sleep(0.2)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def product_lines(text: str) -> list[str]:
    """The ``error:``/``warning:``/``distributed:`` lines of a job's output, without srun's task label."""
    lines = [re.sub(r"^\d+: ", "", line) for line in text.splitlines()]
    return [line for line in lines if line.startswith(("error:", "warning:", "distributed:"))]


def assert_one_voice(text: str) -> None:
    """Every line of the product appears once per job, no gloo connection line, no traceback."""
    lines = product_lines(text)
    assert len(lines) == len(set(lines)), lines
    assert len([line for line in lines if line.startswith("distributed:")]) <= 1, lines
    assert "[Gloo]" not in text and "Traceback" not in text, text[-3000:]
    assert not re.search(r"^(\d+: )?(\d+ *)+$|connected peer ranks", text, re.M), text[-3000:]  # gloo's pieces


def reference_run(tmp: Path, steps: int) -> dict:
    """The uninterrupted 1-process run of the same global batch on 4 devices: its ``summary.json``."""
    run_dir = tmp / "run"
    r = subprocess.run(
        [
            sys.executable,
            "train.py",
            *SMALL,
            "runtime.cpu_devices=4",
            f"train.steps={steps}",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return summary(run_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory.mktemp("reference"), STEPS)


def assert_equals_reference(result: dict, reference: dict) -> None:
    """Two processes x 2 devices train as one process with 4 (same data, same mean gradients)."""
    assert (result["status"], result["train/steps"], result["process_count"]) == ("ok", reference["train/steps"], 2)
    for key in ("train/loss", "eval/loss", "eval/accuracy"):
        assert abs(result[key] - reference[key]) <= 1e-5, (key, result[key], reference[key])


def pid_of_task(run_dir: Path, task: int) -> int:
    """The ``train.py`` process (or submitit's job process) of SLURM task ``task`` whose command line names
    ``run_dir`` (a submitit job's: its sweep folder)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ours = b"train.py" in cmdline or b"submitit.core._submit" in cmdline
        if ours and str(run_dir).encode() in cmdline and f"SLURM_PROCID={task}".encode() in environ:
            return int(proc.name)
    raise AssertionError(f"no train.py process of task {task} for {run_dir}")


# ---- sbatch ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "layout",
    [["--nodes=2", "--ntasks-per-node=1"], ["--nodes=1", "--ntasks-per-node=2"]],
    ids=["two_nodes", "one_node"],
)
def test_sbatch_runs_as_one_process_of_all_devices(cluster, reference, tmp_path, layout):
    run_dir = tmp_path / "run"
    job = sbatch(tmp_path, run_dir, TASK, *layout)
    fields = wait_job(job)
    out = (tmp_path / f"slurm-{job}.out").read_text()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), out[-3000:]
    assert_equals_reference(summary(run_dir), reference)
    assert_one_voice(out)
    assert product_lines(out)[0].startswith("distributed: coordinator=n1:") and "process_id=0 num_processes=2" in out
    assert (run_dir / "train_process1.log").exists()  # task 1 logs to its own file
    nodes = fields["NodeList"]
    assert nodes == ("n[1-2]" if "--nodes=2" in layout else "n1")


# ---- stops and how they continue -----------------------------------------------------------------------------
def stop_line(out: str, total: int = STEPS) -> tuple[int, str, str]:
    """``(step, checkpoint, what follows)`` of the one stop line of a job's output."""
    stops = STOP_LINE.findall(out)
    assert len(stops) == 1, out[-3000:]
    step, steps, saved, rest = stops[0]
    assert int(steps) == total and 0 < int(step) < total
    return int(step), saved, rest


def continue_as_said(tmp_path: Path, rest: str) -> list[str]:
    """The overrides the stop line says to add to the same command."""
    m = re.match(r"continue with the same command and (checkpoint\.dir=\S+) \(or checkpoint\.resume=\S+\)$", rest)
    assert m, rest
    return [m.group(1)]


@pytest.mark.parametrize("how", [["--signal=TERM"], []], ids=["scancel_term", "scancel"])
def test_scancel_stops_at_one_step_and_resubmitting_as_said_continues(cluster, reference, tmp_path, how):
    """With W&B offline (what a user without an API key gets): its process must not take the stop's SIGTERM away
    from JAX's preemption handler (W&B's own service, a Go program, dies of the job's SIGTERM: one warning)."""
    run_dir = tmp_path / "run"
    wandb = job_env(WANDB_DIR=str(tmp_path / "wandb"))
    job = sbatch(tmp_path, run_dir, [*TASK, "wandb.mode=offline"], env=wandb)
    wait_for(lambda: logged_step(run_dir) >= 20 or not listed(job), 120, "step 20")
    t0 = time.monotonic()
    subprocess.run(["scancel", *how, job], check=True, timeout=60)
    wait_job(job)
    stopped_s = time.monotonic() - t0
    out = (tmp_path / f"slurm-{job}.out").read_text()
    step, saved, rest = stop_line(out)
    assert stopped_s < 60, stopped_s
    assert_one_voice(out)
    assert summary(run_dir)["status"] == "stopped"
    again = continue_as_said(tmp_path, rest)
    run2 = tmp_path / "run2"
    job2 = sbatch(tmp_path, run2, [*TASK, *again])
    fields = wait_job(job2)
    out2 = (tmp_path / f"slurm-{job2}.out").read_text()
    assert fields["JobState"] == "COMPLETED", out2[-3000:]
    result = summary(run2)
    assert result["checkpoint/resumed_step"] == step
    assert_equals_reference(result, reference)
    print(f"scancel {how}: stopped {stopped_s:.1f} s after the signal at step {step}")


def test_time_limit_signal_stops_and_resubmitting_as_said_continues(cluster, tmp_path):
    """--time=2 --signal=TERM@60: slurmctld sends the signal at its first periodic check (every 30 s) from 30 s before
    it is due, so 30 to 60 s after the job starts: after the step's launch (a signal sent before it is lost: --time=1
    lost it when the check came within the job's first second). The stop lands in the steps (a checkpoint; the line's
    checkpoint.dir) or, on a machine so loaded that the start-up outlasts 30 s, in the start-up (nothing saved; the
    same command). 4,000 steps outlast the signal: 21.7 ms a step on a quiet machine, 17.9 under CI."""
    steps = 4000
    task = [*SMALL, "runtime.cpu_devices=2", f"train.steps={steps}"]
    run_dir = tmp_path / "run"
    job = sbatch(tmp_path, run_dir, task, "--time=2", "--signal=TERM@60")
    wait_job(job, 200)
    out = (tmp_path / f"slurm-{job}.out").read_text()
    assert_one_voice(out)
    if STOP_LINE.search(out):
        step, saved, rest = stop_line(out, steps)
        again = continue_as_said(tmp_path, rest)
    else:
        errors = [line for line in product_lines(out) if line.startswith("error:")]
        assert len(errors) == 1 and "stopped by SIGTERM during the start-up" in errors[0], out[-3000:]
        step, again = None, []
    run2 = tmp_path / "run2"
    job2 = sbatch(tmp_path, run2, [*task, *again])
    assert wait_job(job2)["JobState"] == "COMPLETED"
    result = summary(run2)
    assert result.get("checkpoint/resumed_step") == step
    assert_equals_reference(result, reference_run(tmp_path / "reference", steps))
    print(f"time limit: stopped at step {step} of {steps}")


def test_preemption_requeues_the_job_and_it_continues_by_itself(cluster, reference, tmp_path):
    """A job of the urgent partition preempts the debug partition's job (PreemptMode=REQUEUE, GraceTime): the tasks
    save at one step, the line says SLURM requeues it, and the same job id continues from that step to the end."""
    run_dir = tmp_path / "run"
    job = sbatch(tmp_path, run_dir, TASK)
    wait_for(lambda: logged_step(run_dir) >= 20, 120, "step 20")
    t0 = time.monotonic()
    subprocess.run(
        [
            "sbatch",
            "-p",
            "urgent",
            "-N2",
            "--exclusive",
            f"--job-name={JOB_NAME}",
            f"--output={tmp_path}/urgent.out",
            "--wrap",
            "sleep 2",
        ],
        check=True,
        timeout=60,
        capture_output=True,
    )
    fields = wait_job(job, JOB_TIMEOUT_S)
    took_s = time.monotonic() - t0
    out = (tmp_path / f"slurm-{job}.out").read_text()
    step, saved, rest = stop_line(out)
    assert rest == f"SLURM preempted the job and requeues it (job {job}): it continues from this checkpoint by itself"
    assert (fields["JobState"], fields["Restarts"]) == ("COMPLETED", "1"), out[-3000:]
    result = summary(run_dir)
    assert result["checkpoint/resumed_step"] == step
    assert_equals_reference(result, reference)
    assert_one_voice(out.split("SLURM preempted the job")[0])  # each start of the job: one voice
    print(f"preemption: requeued and finished {took_s:.1f} s after the urgent job was submitted")


def test_scontrol_requeue_continues_from_the_saved_step(cluster, reference, tmp_path):
    run_dir = tmp_path / "run"
    job = sbatch(tmp_path, run_dir, TASK)
    wait_for(lambda: logged_step(run_dir) >= 20, 120, "step 20")
    subprocess.run(["scontrol", "requeue", job], check=True, timeout=60)
    fields = wait_job(job)
    out = (tmp_path / f"slurm-{job}.out").read_text()
    step, saved, rest = stop_line(out)
    assert rest == f"SLURM requeued the job (job {job}): it continues from this checkpoint by itself"
    assert (fields["JobState"], fields["Restarts"]) == ("COMPLETED", "1"), out[-3000:]
    result = summary(run_dir)
    assert result["checkpoint/resumed_step"] == step
    assert_equals_reference(result, reference)


# ---- a task's death --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", [0, 1])
def test_a_dead_task_stops_the_others_at_once_in_one_line(cluster, tmp_path, task):
    """The survivor says the line. Once in about 15 kills on a loaded machine the survivor's C++ code ends it first,
    and the job is run again once: gloo receives the dead process's last bytes mid-collective and aborts the process
    (``gloo::EnforceNotMet``) before any Python runs; or, when process 0 (the host of JAX's coordination service)
    died, JAX's coordination client in the survivor ends it (exit 1, after its ``Polled an error from coordination
    service``) in the millisecond between its summary.json, which holds the line, and the line."""
    for attempt in range(2):
        run_dir = tmp_path / f"run{attempt}" / "run"
        run_dir.parent.mkdir()
        job = sbatch(run_dir.parent, run_dir, [*SMALL, "runtime.cpu_devices=2", "train.steps=100000"])
        wait_for(lambda: logged_step(run_dir) >= 20, 120, "step 20")
        victim = pid_of_task(run_dir, task)
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        wait_job(job, 120)
        took_s = time.monotonic() - t0
        out = (run_dir.parent / f"slurm-{job}.out").read_text()
        said = any(line.startswith("error:") for line in product_lines(out))
        saved = (run_dir / "summary.json").is_file() and "died without a word" in summary(run_dir).get("error", "")
        agent = "Polled an error from coordination service" in out and not said and saved
        if "gloo::EnforceNotMet" not in out and not agent:
            break
    node = "n1" if task == 0 else "n2"
    deaths = [line for line in product_lines(out) if line.startswith("error:")]
    assert deaths == [
        f"error: process {task} of 2 (SLURM task {task} on node {node}) died without a word (killed from outside, "
        f"e.g. out of memory, or crashed); the job cannot go on without it and every other process stopped; continue "
        f"with the same command and checkpoint.dir={run_dir}/checkpoints (its newest checkpoint)"
    ], out[-3000:]
    survivor = 1 - task
    assert re.search(rf"task {survivor}: Exited with exit code 1", out), out[-3000:]  # its own status, not Killed
    assert took_s < 60, took_s
    result = summary(run_dir)
    assert (result["status"], result["error"]) == ("failed", deaths[0].removeprefix("error: "))
    assert_one_voice(out)
    print(f"task {task} killed: the job ended {took_s:.1f} s later")


# ---- the submitit launcher -----------------------------------------------------------------------------------
def start_sweep(sweep_dir: Path, overrides: list[str]) -> subprocess.Popen:
    """The README's submitit command (2 nodes) in ``sweep_dir``, started; its output together on ``stdout``."""
    return subprocess.Popen(
        [
            sys.executable,
            "train.py",
            "-m",
            "hydra/launcher=submitit_slurm",
            "hydra.launcher.nodes=2",
            f"hydra.launcher.name={JOB_NAME}",
            f"hydra.sweep.dir={sweep_dir}",
            *overrides,
        ],
        cwd=REPO,
        env=job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def submitit(sweep_dir: Path, overrides: list[str], timeout_s: float = 400) -> tuple[int, str]:
    """The README's submitit command run to its end: ``(exit status, output)``."""
    proc = start_sweep(sweep_dir, overrides)
    out, _ = proc.communicate(timeout=timeout_s)
    return proc.returncode, out


def submitit_job(sweep_dir: Path) -> str:
    """The SLURM job id of the sweep's only job (its ``.submitit/<id>`` folder: ``12``, or ``12_0`` in an array)."""
    (job,) = [p.name for p in (sweep_dir / ".submitit").iterdir() if p.is_dir()]
    return job


def job_logs(sweep_dir: Path) -> list[str]:
    """Each SLURM job's output: all of its ``.submitit/<job id>/*_log.{out,err}`` together."""
    return [
        "".join(p.read_text() for p in sorted(job.glob("*_log.*")))
        for job in sorted((sweep_dir / ".submitit").glob("*"))
        if job.is_dir()
    ]


def test_submitit_runs_a_sweep_of_multi_process_jobs(cluster, reference, tmp_path):
    """The README's submitit command on a CPU-only cluster: auto resources (no GPU request), every job 2 tasks."""
    sweep_dir = tmp_path / "sweep"
    code, out = submitit(sweep_dir, [*TASK, "train.seed=0,1"])
    assert code == 0, out[-3000:]
    assert "1 task(s) per node, 0 GPU(s) per node, 4 CPU(s) per task" in out
    assert_equals_reference(summary(sweep_dir / "0"), reference)
    other = summary(sweep_dir / "1")
    assert (other["status"], other["process_count"]) == ("ok", 2) and other["train/loss"] != reference["train/loss"]
    for logs in job_logs(sweep_dir):
        assert_one_voice(logs)


def test_a_stopped_submitit_job_continues_when_the_sweep_is_resumed_as_said(cluster, reference, tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = start_sweep(sweep_dir, TASK)
    wait_for(lambda: logged_step(sweep_dir / "0") >= 20, 120, "step 20")
    job = submitit_job(sweep_dir)
    subprocess.run(["scancel", "--signal=TERM", job], check=True, timeout=60)
    out, _ = proc.communicate(timeout=180)
    (logs,) = job_logs(sweep_dir)
    stops = [line for line in product_lines(logs) if line.startswith("error: stopped")]
    assert len(stops) == 1, logs[-3000:]
    m = re.search(
        r"after step (\d+) of .*resume the sweep with the same command and (hydra\.sweep\.dir=\S+) \(this "
        r"job continues from it\)",
        stops[0],
    )
    assert m, stops[0]
    step = int(m.group(1))
    code, out = submitit(sweep_dir, TASK)
    assert code == 0, out[-3000:]
    result = summary(sweep_dir / "0")
    assert result["checkpoint/resumed_step"] == step
    assert_equals_reference(result, reference)


def test_submitit_job_whose_task_died_ends_the_sweep_in_bounded_time(cluster, tmp_path):
    """No accounting on this cluster (sacct fails): the launcher follows the job with squeue/scontrol and returns
    soon after SLURM stops listing it, with one line naming it; the job's summary says which task died."""
    sweep_dir = tmp_path / "sweep"
    proc = start_sweep(sweep_dir, [*SMALL, "runtime.cpu_devices=2", "train.steps=100000"])
    run_dir = sweep_dir / "0"
    wait_for(lambda: logged_step(run_dir) >= 20, 120, "step 20")
    job = submitit_job(sweep_dir)
    os.kill(pid_of_task(sweep_dir, 1), signal.SIGKILL)
    wait_for(lambda: not listed(job), 120, f"job {job} to end")
    gone = time.monotonic()
    out, _ = proc.communicate(timeout=180)
    returned_s = time.monotonic() - gone
    assert proc.returncode == 1 and returned_s < 120, (returned_s, out[-3000:])
    assert len(re.findall(rf"submitit_slurm: job #0 \(SLURM job {job}, \w+\) ended without a result", out)) == 1, out
    result = summary(run_dir)
    assert result["status"] == "failed" and result["error"].startswith(
        "process 1 of 2 (SLURM task 1 on node n2) died without a word"
    )
    assert "Traceback" not in out
    for logs in job_logs(sweep_dir):
        assert_one_voice(logs)
    print(f"submitit: the launcher returned {returned_s:.1f} s after SLURM stopped listing the job")
