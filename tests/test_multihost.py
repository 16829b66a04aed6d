"""Many processes on jax.distributed (training/distributed.py, scripts/launch_local.py), on CPU over loopback.

The end-to-end tests start real ``train.py`` processes (each with 4 simulated CPU devices, gloo collectives
over 127.0.0.1) and compare them with one process holding all 8 devices: SGD, fp32, MNIST from
``TFDS_DATA_DIR`` (../shared/tensorflow_datasets), 20 steps of global batch 256.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conf.schema import DistributedConfig
from data.pipeline import epoch_permutation
from utils import REPO, SHARED_TFDS
from wandb_reader import read_run
from training import distributed

sys.path.insert(0, str(REPO / "scripts"))
import launch_local  # noqa: E402

STEPS = 20
GLOBAL_BATCH = 256
TRAIN = [
    "optim=sgd",
    "optim.lr=0.1",
    "precision=fp32",
    "data=mnist",
    f"train.steps={STEPS}",
    f"train.global_batch={GLOBAL_BATCH}",
    "train.log_every=5",
    "train.debug_dump_indices=true",
]
CLUSTER_VARS = ("SLURM_", "OMPI_", "PMI_", "JAX_COORDINATOR", "JAX_NUM_CPU_DEVICES", "JAX_PROCESS", "TPU_")


# ---- helpers ------------------------------------------------------------------------------------------
def clean_env(tmp: Path, **extra: str) -> dict:
    """The test's environment without cluster variables, offline W&B inside ``tmp``, MNIST from the shared copy."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLUSTER_VARS)}
    env.pop("WANDB_API_KEY", None)
    wb = tmp / "wandb_home"
    wb.mkdir(exist_ok=True)
    env.update(
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        PYTHONUNBUFFERED="1",
        TFDS_DATA_DIR=str(SHARED_TFDS),
        **{v: str(wb) for v in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR")},
    )
    env.update(extra)
    return env


def start(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    out = open(log, "w")
    return subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, log: Path, timeout: float) -> tuple[int, str]:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"{proc.args} still running after {timeout} s:\n{log.read_text()[-3000:]}")
    return proc.returncode, log.read_text()


def per_step(run_dir: Path, key: str) -> dict[int, float]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in recs if key in r}


def dumped(run_dir: Path, process: int) -> list[list[int]]:
    lines = (run_dir / f"debug_indices_process{process}.jsonl").read_text().splitlines()
    recs = [json.loads(line) for line in lines]
    assert [r["step"] for r in recs] == list(range(STEPS)) and {r["process_index"] for r in recs} == {process}
    return [r["indices"] for r in recs]


def free_port() -> int:
    return launch_local.free_port()


# ---- unit tests (no processes) ----------------------------------------------------------------------------
SLURM_ENV = {
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_NODELIST": "node[001-004],gpu7",
    "SLURM_NTASKS": "8",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
}


@pytest.fixture
def no_cluster(monkeypatch):
    for k in list(os.environ):
        if k.startswith(CLUSTER_VARS):
            monkeypatch.delenv(k)
    return monkeypatch


@pytest.mark.unit
def test_enabled_rules(no_cluster):
    assert distributed.detect_cluster() is None
    assert not distributed.wanted(DistributedConfig())
    assert distributed.wanted(DistributedConfig(coordinator="h:1"))  # a coordinator implies enabled
    assert distributed.wanted(DistributedConfig(process_id=0))
    assert distributed.wanted(DistributedConfig(enabled=True))
    assert not distributed.wanted(DistributedConfig(enabled=False, coordinator="h:1"))
    for k, v in SLURM_ENV.items():
        no_cluster.setenv(k, v)
    slurm = distributed.detect_cluster()
    assert slurm.__name__ == "SlurmCluster"
    assert distributed.wanted(DistributedConfig(), slurm)  # 8 tasks: auto-enabled
    assert not distributed.wanted(DistributedConfig(enabled=False), slurm)
    no_cluster.setenv("SLURM_NTASKS", "1")
    assert not distributed.wanted(DistributedConfig(), distributed.detect_cluster())  # one task: single process


@pytest.mark.unit
def test_resolve_from_slurm_environment(no_cluster):
    for k, v in SLURM_ENV.items():
        no_cluster.setenv(k, v)
    s = distributed.resolve(DistributedConfig(timeout_s=20), distributed.detect_cluster())
    # JAX's rule: first node of the step, port 61440 + job id % 4096 = 61440 + 576; one GPU per task
    assert s == distributed.Settings(
        coordinator="node001:62016",
        num_processes=8,
        process_id=5,
        timeout_s=20,
        source="SlurmCluster",
        local_device_ids=(1,),
    )
    assert s.line() == (
        "distributed: coordinator=node001:62016 process_id=5 num_processes=8 timeout_s=20 (SlurmCluster)"
    )
    no_cluster.setenv("JAX_COORDINATOR_PORT", "1234")
    explicit = distributed.resolve(DistributedConfig(process_id=0), distributed.detect_cluster())
    assert (explicit.coordinator, explicit.process_id, explicit.num_processes) == ("node001:1234", 0, 8)


@pytest.mark.unit
def test_resolve_errors_are_one_line(no_cluster):
    def error(**kw) -> str:
        with pytest.raises(distributed.DistributedError) as e:
            distributed.resolve(DistributedConfig(**kw))
        assert "\n" not in str(e.value)
        return str(e.value)

    assert error(coordinator="nohost") == (
        "distributed.coordinator='nohost' must be HOST:PORT (e.g. 10.0.0.1:12345) reachable from every process"
    )
    assert error(coordinator="h:1", num_processes=2, process_id=2) == (
        "distributed.process_id=2 with distributed.num_processes=2: the ids must be 0 .. 1, one per process"
    )
    assert error(coordinator="h:1", num_processes=2, process_id=0, timeout_s=0) == (
        "distributed.timeout_s=0 must be a positive number of seconds"
    )
    assert error(enabled=True, num_processes=2) == (
        "multi-process run requested (distributed.coordinator=None distributed.num_processes=2 "
        "distributed.process_id=None, distributed.enabled=True) but no SLURM/MPI/TPU environment was detected "
        "to fill in distributed.coordinator, distributed.process_id; set them (see scripts/launch_local.py) or "
        "use distributed.enabled=false"
    )


@pytest.mark.unit
def test_route_logging_writes_own_prefixed_file(tmp_path):
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    shared = tmp_path / "train.log"
    file_h = logging.FileHandler(shared)
    file_h.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
    stream = open(tmp_path / "console.txt", "w")
    console_h = logging.StreamHandler(stream)
    console_h.setFormatter(logging.Formatter("%(message)s"))
    root.handlers[:] = [file_h, console_h]
    root.setLevel(logging.INFO)
    try:
        distributed.route_logging(3)
        distributed.route_logging(3)  # idempotent: no second prefix, no second file
        logging.getLogger("x").info("hello")
        logging.getLogger("x").warning("careful")
    finally:
        for h in root.handlers:
            h.close()
        root.handlers[:], root.level = saved
        stream.close()
    assert shared.read_text() == ""  # the shared train.log gets nothing from process 3
    assert (tmp_path / "train_process3.log").read_text() == "[process 3] [x] hello\n[process 3] [x] careful\n"
    assert (tmp_path / "console.txt").read_text() == ""  # console: nothing (one voice per job: process 0's)


@pytest.mark.unit
def test_local_rows_follow_the_global_order():
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    index = np.arange(64, dtype=np.int32)
    flat = jax.device_put(index, NamedSharding(mesh, P("d")))
    np.testing.assert_array_equal(distributed.local_rows(flat), index)
    stacked = jax.device_put(index.reshape(8, 8), NamedSharding(mesh, P("d")))  # pmap layout [devices, per-device]
    np.testing.assert_array_equal(distributed.local_rows(stacked), index)
    replicated = jax.device_put(index, NamedSharding(mesh, P()))  # 8 copies of the same rows: taken once
    np.testing.assert_array_equal(distributed.local_rows(replicated), index)


@pytest.mark.unit
def test_launcher_command_lines():
    cmds = launch_local.commands(2, ["parallel=fsdp", "hydra.run.dir=ignored"], "/runs/a", 4321, 4, 20)
    common = [
        "parallel=fsdp",
        "hydra.run.dir=/runs/a",
        "distributed.coordinator=127.0.0.1:4321",
        "distributed.num_processes=2",
        "runtime.cpu_devices=4",
        "distributed.timeout_s=20",
        "checkpoint.dir=/runs/a/checkpoints",
    ]
    assert cmds == [
        [sys.executable, str(REPO / "train.py"), *common, "distributed.process_id=0"],
        [sys.executable, str(REPO / "train.py"), *common, "distributed.process_id=1", "hydra.output_subdir=null"],
    ]
    given = launch_local.commands(1, ["checkpoint.dir=/shared/ck"], "/runs/b", 1, None, None)
    assert given[0][2:] == [
        "checkpoint.dir=/shared/ck",
        "hydra.run.dir=/runs/b",
        "distributed.coordinator=127.0.0.1:1",
        "distributed.num_processes=1",
        "distributed.process_id=0",
    ]


@pytest.mark.unit
@pytest.mark.filterwarnings(r"ignore:(?s).*validated against ConfigStore schema")  # Hydra's note on the name
def test_submitit_slurm_preset():
    from hydra import compose, initialize_config_dir

    from conf.schema import register

    register()
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                "hydra/launcher=submitit_slurm",
                "hydra.launcher.nodes=2",
                "hydra.launcher.tasks_per_node=4",
                "hydra.launcher.partition=gpu",
            ],
            return_hydra_config=True,
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.dp_scaling_launchers.slurm.ClusterSlurmLauncher"
    assert (
        launcher.nodes,
        launcher.tasks_per_node,
        launcher.gpus_per_node,
        launcher.cpus_per_task,
        launcher.partition,
        launcher.timeout_min,
    ) == (2, 4, "auto", "auto", "gpu", 60)


@pytest.mark.unit
@pytest.mark.parametrize(
    "given, node, expected",
    [
        ({}, (4, 0), (1, None, 4)),  # CPU nodes: one task per node with all its CPUs, no GPU request
        ({}, (64, 8), (8, 8, 8)),  # GPU nodes: one task per GPU, a GPU each
        ({"tasks_per_node": 4}, (64, 8), (4, 4, 16)),
        ({"tasks_per_node": 2, "cpus_per_task": 3}, (4, 0), (2, None, 3)),
    ],
)
def test_submitit_slurm_auto_resources(given, node, expected):
    from hydra_plugins.dp_scaling_launchers.slurm import resolve_resources

    params = {"tasks_per_node": "auto", "gpus_per_node": "auto", "cpus_per_task": "auto", "partition": None, **given}
    out = resolve_resources(params, resources=lambda partition: node)
    assert (out["tasks_per_node"], out["gpus_per_node"], out["cpus_per_task"]) == expected


# ---- processes ------------------------------------------------------------------------------------------
def test_initialize_twice_is_a_no_op(tmp_path):
    """One process that is its own coordinator: the line is printed once, the second call returns the same."""
    coordinator = f"127.0.0.1:{free_port()}"
    code = (
        "import jax\n"
        "from conf.schema import DistributedConfig\n"
        "from training.distributed import initialize\n"
        f"cfg = DistributedConfig(coordinator='{coordinator}', num_processes=1, process_id=0, timeout_s=10)\n"
        "a = initialize(cfg); b = initialize(cfg)\n"
        "assert a.settings is b.settings is not None and a.error is None, (a, b)\n"
        "assert jax.distributed.is_initialized() and jax.process_count() == 1\n"
        "print('OK', jax.config.jax_cpu_collectives_implementation)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=clean_env(tmp_path), capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "OK gloo"
    assert [line for line in r.stderr.splitlines() if line.startswith("distributed:")] == [
        f"distributed: coordinator={coordinator} process_id=0 num_processes=1 timeout_s=10 (config)"
    ]


@pytest.mark.parametrize("timeout_s", [5, pytest.param(20, marks=pytest.mark.slow)])
def test_missing_peer_exits_non_zero(tmp_path, timeout_s):
    """Process 0 of 2 alone: prints the coordinator line, then JAX gives up after the timeout (never hangs)."""
    port = free_port()
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "train.py",
            f"hydra.run.dir={run_dir}",
            "runtime.cpu_devices=4",
            f"distributed.coordinator=127.0.0.1:{port}",
            "distributed.num_processes=2",
            "distributed.process_id=0",
            f"distributed.timeout_s={timeout_s}",
        ],
        cwd=REPO,
        env=clean_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = iter(proc.stderr.readline, "")
        first = next((line for line in lines if line.startswith("distributed:")), None)
        printed = time.monotonic()
        assert first == (
            f"distributed: coordinator=127.0.0.1:{port} process_id=0 num_processes=2 timeout_s={timeout_s} (config)\n"
        )
        proc.communicate(timeout=timeout_s + 30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    elapsed = time.monotonic() - printed
    assert proc.returncode != 0 and elapsed < timeout_s + 30, (proc.returncode, elapsed)
    assert not list(tmp_path.rglob("*.wandb")) and not (run_dir / "metrics.jsonl").exists()


def test_bad_coordinator_is_one_line_error(tmp_path):
    run_dir = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "train.py",
            f"hydra.run.dir={run_dir}",
            "runtime.cpu_devices=4",
            "distributed.coordinator=localhost",
            "distributed.num_processes=2",
            "distributed.process_id=0",
        ],
        cwd=REPO,
        env=clean_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
    )
    msg = "distributed.coordinator='localhost' must be HOST:PORT (e.g. 10.0.0.1:12345) reachable from every process"
    assert r.returncode == 1
    assert [line for line in r.stderr.splitlines() if line.startswith("error:")] == [f"error: {msg}"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["error"]) == ("failed", msg)
    assert not list(tmp_path.rglob("*.wandb")) and not (run_dir / "metrics.jsonl").exists()


def test_unequal_device_counts_stop_at_start(tmp_path):
    """4 devices on process 0, 2 on process 1: both stop with the same one line before anything is written."""
    port = free_port()
    run_dir = tmp_path / "run"
    procs, logs = [], []
    for pid, devices in ((0, 4), (1, 2)):
        logs.append(tmp_path / f"p{pid}.txt")
        procs.append(
            start(
                [
                    "train.py",
                    f"hydra.run.dir={run_dir}",
                    f"runtime.cpu_devices={devices}",
                    f"distributed.coordinator=127.0.0.1:{port}",
                    "distributed.num_processes=2",
                    f"distributed.process_id={pid}",
                    "distributed.timeout_s=60",
                ]
                + (["hydra.output_subdir=null"] if pid else []),
                clean_env(tmp_path),
                logs[-1],
            )
        )
    results = [finish(p, log, 240) for p, log in zip(procs, logs)]
    msg = (
        "processes see different local device counts: process 0: 4, process 1: 2; give every process the same "
        "number of devices (GPU: the same GPUs per task, e.g. SLURM --gpus-per-task; CPU: the same "
        "runtime.cpu_devices)"
    )
    assert [code for code, _ in results] == [1, 1]
    assert [line for line in results[0][1].splitlines() if line.startswith("error:")] == [f"error: {msg}"]
    assert json.loads((run_dir / "summary.json").read_text())["error"] == msg
    assert "[process 1] " in (run_dir / "train_process1.log").read_text()
    assert msg in (run_dir / "train_process1.log").read_text()
    assert not list(tmp_path.rglob("*.wandb")) and not (run_dir / "metrics.jsonl").exists()


def check_equivalence(tmp_path: Path, parallel: str, checkpoints: bool, extra: tuple = (), dump: bool = True) -> None:
    """2 processes x 4 devices (scripts/launch_local.py) == 1 process x 8 devices, run at the same time (both
    with the overrides ``extra``; ``dump``: with ``train.debug_dump_indices=true``, whose files are checked)."""
    one, two = tmp_path / "one", tmp_path / "two"
    train = TRAIN if dump else [o for o in TRAIN if not o.startswith("train.debug_dump_indices=")]
    env = clean_env(tmp_path)
    ckpt = [f"checkpoint.dir={tmp_path / 'shared_ckpt'}"] if checkpoints else ["checkpoint.enabled=false"]
    ref = start(
        [
            "train.py",
            f"hydra.run.dir={one}",
            "runtime.cpu_devices=8",
            f"parallel={parallel}",
            "checkpoint.enabled=false",
            *train,
            *extra,
        ],
        env,
        tmp_path / "one.txt",
    )
    multi = start(
        [
            str(REPO / "scripts" / "launch_local.py"),
            "-n",
            "2",
            "--cpu-devices",
            "4",
            "--timeout-s",
            "120",
            f"hydra.run.dir={two}",
            f"parallel={parallel}",
            *ckpt,
            *train,
            *extra,
        ],
        env,
        tmp_path / "two.txt",
    )
    code_one, out_one = finish(ref, tmp_path / "one.txt", 600)
    code_two, out_two = finish(multi, tmp_path / "two.txt", 600)
    assert code_one == 0, out_one[-3000:]
    assert code_two == 0, out_two[-3000:]
    check_outputs(tmp_path, checkpoints, dump)


def check_outputs(tmp_path: Path, checkpoints: bool, dump: bool = True) -> None:
    """The assertions of ``check_equivalence`` on its finished runs ``tmp_path/one`` and ``tmp_path/two`` (the
    placed indices only with ``dump``)."""
    one, two = tmp_path / "one", tmp_path / "two"

    # the loss trajectory and the evaluation
    loss_one, loss_two = per_step(one, "train/loss"), per_step(two, "train/loss")
    assert sorted(loss_two) == list(range(1, STEPS + 1)) == sorted(loss_one)
    worst = max(abs(loss_one[s] - loss_two[s]) for s in loss_one)
    assert worst <= 1e-5, worst
    s_one, s_two = (json.loads((d / "summary.json").read_text()) for d in (one, two))
    assert s_two["eval/accuracy"] == s_one["eval/accuracy"] and s_one["eval/accuracy"] > 0.3
    assert abs(s_two["eval/loss"] - s_one["eval/loss"]) <= 1e-5
    assert (s_one["process_count"], s_two["process_count"], s_two["mesh/devices"]) == (1, 2, 8)

    # the data: per step, process 0's rows then process 1's rows are exactly the global batch, no duplicates
    single, p0, p1 = (dumped(one, 0), dumped(two, 0), dumped(two, 1)) if dump else ({}, {}, {})
    perm = epoch_permutation(0, 0, 60000)  # MNIST train: 60,000 examples, seed 0, epoch 0
    for step in range(STEPS if dump else 0):
        assert len(p0[step]) == len(p1[step]) == GLOBAL_BATCH // 2
        union = p0[step] + p1[step]
        assert len(set(union)) == GLOBAL_BATCH
        assert union == single[step] == perm[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH].tolist()

    # reporting: one W&B run (process 0's) whose config says 2 processes of 4 devices
    runs = sorted({os.path.realpath(r) for r in glob.glob(str(tmp_path / "**" / "run-*.wandb"), recursive=True)})
    assert [Path(r).parent.parent.parent for r in runs] == [one, two]  # <run dir>/wandb/offline-run-*/run-*.wandb
    config = read_run(os.path.dirname(runs[1]))["config"]
    assert config["process_count"] == 2
    assert config["process_layout"] == {
        "process_index": 0,
        "process_count": 2,
        "devices_per_process": [4, 4],
        "local_devices": 4,
        "coordinator": config["process_layout"]["coordinator"],
    }
    assert config["process_layout"]["coordinator"].startswith("127.0.0.1:")
    # process 1 wrote only its own log (and the requested debug dump); Hydra's files are process 0's
    mine = sorted(p.name for p in two.iterdir() if "process1" in p.name)
    assert mine == ["debug_indices_process1.jsonl", "train_process1.log"][0 if dump else 1 :]
    log1 = (two / "train_process1.log").read_text().splitlines()
    assert log1 and all(line.startswith("[process 1] ") for line in log1)
    assert "[process 1]" not in (two / "train.log").read_text()
    assert "distributed.process_id=0" in (two / ".hydra" / "overrides.yaml").read_text()
    if checkpoints:
        assert sorted(p.name for p in (tmp_path / "shared_ckpt").iterdir() if p.name.isdigit()) == [str(STEPS)]


@pytest.mark.slow  # 91-130 s here (3 processes on 2 shared cores, load ~10); the acceptance test of issue 7
def test_two_processes_equal_one_process(tmp_path):
    check_equivalence(tmp_path, "jit_sharding", checkpoints=True)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["fsdp", "pmap"])
def test_two_processes_equal_one_process_other_modes(tmp_path, parallel):
    check_equivalence(tmp_path, parallel, checkpoints=True)


@pytest.mark.parametrize("dump", [False, True])
def test_two_processes_equal_one_process_with_the_split_on_the_devices(tmp_path, dump):
    # data.on_device=true: each process places the replicated split with make_array_from_callback (~11 s here);
    # the gather inside the train step, or (with the index dump, which reads each batch) a program of its own
    check_equivalence(tmp_path, "jit_sharding", checkpoints=False, extra=("data.on_device=true",), dump=dump)
    for run in ("one", "two"):
        summary = json.loads((tmp_path / run / "summary.json").read_text())
        assert summary["data/on_device"] is True and summary["data/on_device_bytes"] == 60000 * (784 + 4)
        assert summary["data/gather_in_step"] is (not dump)


@pytest.mark.slow
def test_slurm_environment_is_detected(tmp_path):
    """No distributed.* settings: two processes with SLURM's variables find each other on their own."""
    port = free_port()
    run_dir = tmp_path / "run"
    procs, logs = [], []
    for pid in (0, 1):
        env = clean_env(
            tmp_path,
            SLURM_JOB_ID="4242",
            SLURM_STEP_NODELIST="localhost",
            SLURM_NTASKS="2",
            SLURM_PROCID=str(pid),
            SLURM_LOCALID=str(pid),
            JAX_COORDINATOR_PORT=str(port),
        )
        logs.append(tmp_path / f"p{pid}.txt")
        procs.append(
            start(
                [
                    "train.py",
                    f"hydra.run.dir={run_dir}",
                    "runtime.cpu_devices=4",
                    "data=synthetic",
                    "train.steps=3",
                    "train.global_batch=64",
                    "optim=sgd",
                    f"checkpoint.dir={tmp_path / 'ckpt'}",
                    "distributed.timeout_s=60",
                ]
                + (["hydra.output_subdir=null"] if pid else []),
                env,
                logs[-1],
            )
        )
    results = [finish(p, log, 400) for p, log in zip(procs, logs)]
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    line = "distributed: coordinator=localhost:{port} process_id={pid} num_processes=2 timeout_s=60 (SlurmCluster)"
    assert line.format(port=port, pid=0) in results[0][1].splitlines()
    assert results[1][1] == ""  # one voice per job: process 1's line is in its own log
    assert line.format(port=port, pid=1) in (run_dir / "train_process1.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["process_count"], summary["mesh/devices"]) == ("ok", 2, 8)
