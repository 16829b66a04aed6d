"""``benchmarks/accelerator.py --quick``: every part runs on the CPU in one command and records what the TPU run
records (train.py against the bare script, the start-up step by step, the levers, the state's creation, the remat
x batch table, the two steps' profiles; the image models' steps against their bare scripts), and ``--report`` turns
the records into one table, as the device machine runs them (no ``tensorflow_datasets``). The figures themselves
come from a TPU (docs/performance.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from utils import REPO

# Imported at start by every Python process whose path holds its folder: tensorflow_datasets cannot be imported, as
# on the device machine (benchmarks/device/prepare.sh does not carry it)
NO_TFDS = """import sys


class NoTensorflowDatasets:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "tensorflow_datasets":
            raise ImportError(f"{name} is not installed here (tests/test_benchmark_accelerator.py)")
        return None


sys.meta_path.insert(0, NoTensorflowDatasets())
"""


def device_like_env(tmp_path) -> dict:
    """The environment of a device machine's run: the CPU backend, no ``tensorflow_datasets`` (a ``sitecustomize``
    on ``PYTHONPATH`` refuses it in this process and every one it starts), and a ``TFDS_DATA_DIR`` holding no
    prepared data set (the carried copy of MNIST is not where a TFDS name resolves)."""
    site = tmp_path / "no_tfds"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_TFDS)
    (tmp_path / "empty_tfds").mkdir()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TFDS_DATA_DIR": str(tmp_path / "empty_tfds")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.pop("JAX_NUM_CPU_DEVICES", None)
    return env


def test_startup_part_runs_without_tensorflow_datasets(tmp_path):
    """``--part startup`` (its quick mode) where ``tensorflow_datasets`` cannot be imported and no TFDS data set is
    prepared, as on the device machine: the GPT's start-up reads text, so nothing may need TFDS (the chip's run of
    ``--part startup --workloads gpt2_small`` ended in its ImportError)."""
    env = device_like_env(tmp_path)
    blocked = subprocess.run(
        [sys.executable, "-c", "import tensorflow_datasets"], env=env, capture_output=True, text=True
    )  # fmt: skip
    assert blocked.returncode == 1 and "is not installed here" in blocked.stderr  # the guard works
    out = tmp_path / "records.jsonl"
    r = subprocess.run(
        [sys.executable, "benchmarks/accelerator.py", "--quick", "--part", "startup", f"--record={out}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(x["part"], x["workload"], x["cold"]) for x in recs] == [
        ("startup", "char", True),
        ("startup", "char", False),
    ]
    assert all(x["step_compile_s"] >= 0 and x["state_bytes"] > 0 for x in recs)


def test_quick_runs_every_part_and_reports(tmp_path):
    out = tmp_path / "records.jsonl"
    r = subprocess.run(
        [sys.executable, "benchmarks/accelerator.py", "--quick", f"--record={out}"],
        cwd=REPO, env=device_like_env(tmp_path), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    parts = {
        p: [x for x in recs if x["part"] == p] for p in ("steps", "startup", "levers", "init", "memory", "profile")
    }
    (steps,) = parts["steps"]
    assert steps["workload"] == "char" and steps["dropout"] == 0.2 and steps["attention"] == "xla"
    assert len(steps["ratio"]) == 1 and steps["ratio"][0] > 0
    assert steps["train_tokens_per_s"][0] > 0 and steps["bare_tokens_per_s"][0] > 0
    (start,) = steps["startup"]
    assert start["cold"] and start["train_first_step_s"] > 0 and start["bare_first_step_s"] > 0
    assert {"imports", "build", "compile"} <= set(start["phases"])
    who = {(x["who"], json.dumps(x["extra"], sort_keys=True), x["keys"]) for x in parts["levers"]}
    assert ("product", '{"attention": "auto", "dropout": 0.2}', None) in who
    assert ("bare", '{"attention": "xla", "dropout": 0.2}', "per_step") in who
    assert all(x["tokens_per_s"] > 0 and x["compiled_peak_bytes"] > 0 for x in parts["levers"])
    assert {x["where"] for x in parts["init"]} == {"eager", "jit"}
    assert [x["cold"] for x in parts["startup"]] == [True, False]  # one process with an empty cache, one warm
    for x in parts["startup"]:
        assert x["workload"] == "char" and x["state_bytes"] > 0 and x["total_s"] > 0
        assert all(x[k] >= 0 for k in ("backend_s", "host_init_compile_s", "eager_init_s", "build_s", "step_compile_s"))
    assert [(x["remat"], x["batch"], x["loss_chunk"], x["fits"]) for x in parts["memory"]] == [
        ("none", 4, 0, True),
        ("full", 8, 64, True),
    ]
    (profile,) = parts["profile"]
    for side in ("product", "bare"):  # device time per step by kind of op, from a jax.profiler trace of each step
        ops = profile[side]
        assert ops["total_s"] > 0 and ops["categories"]["matmul"] > 0 and len(ops["top"]) >= 5
        assert abs(sum(ops["categories"].values()) - ops["total_s"]) < 1e-9
    assert "| char | 0.2 | xla |" in r.stdout  # the combined table
    report = subprocess.run(
        [sys.executable, "benchmarks/accelerator.py", "--report", str(out)], cwd=REPO, capture_output=True, text=True
    )
    assert report.returncode == 0 and "| char | 0.2 | xla |" in report.stdout


def test_quick_steps_of_the_image_models(tmp_path):
    """``--part steps`` of the image workloads in quick mode (a ResNet-18 of width 8 and a ViT of 32 x 2, bf16, on
    the CPU, as the device machine runs them: no ``tensorflow_datasets``): ``train.py model=resnet|vit
    data=synthetic`` against ``bare_resnet.py`` / ``bare_vit.py``: examples/s of both, the counted FLOPs per example
    of the MFU, the start-up, and the image table; an unknown workload is one line."""
    from models.resnet import flops_per_example as resnet_flops
    from models.vit import flops_per_example as vit_flops

    out = tmp_path / "records.jsonl"
    cmd = [sys.executable, "benchmarks/accelerator.py", "--quick", "--part", "steps", f"--record={out}"]
    r = subprocess.run(
        [*cmd, "--workloads", "resnet18_b256,vit_s_b256"],
        cwd=REPO, env=device_like_env(tmp_path), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    recs = {x["workload"]: x for x in map(json.loads, out.read_text().splitlines())}
    assert set(recs) == {"resnet18_b256", "vit_s_b256"}
    counted = {
        "resnet18_b256": resnet_flops((32, 32, 3), 10, 8),
        "vit_s_b256": vit_flops((32, 32, 3), 10, width=32, depth=2, patch=4, mlp_ratio=4),
    }
    for name, rec in recs.items():
        assert rec["part"] == "steps" and rec["global_batch"] == 16 and rec["dropout"] == 0.0
        assert rec["flops_per_example"] == counted[name]
        assert rec["train_examples_per_s"][0] > 0 and rec["bare_examples_per_s"][0] > 0 and len(rec["ratio"]) == 1
        assert rec["mfu_train"] is None  # no peak FLOP/s known for a CPU
        (start,) = rec["startup"]
        assert start["cold"] and start["train_first_step_s"] > 0 and start["bare_first_step_s"] > 0
    assert "| resnet18_b256 | 16 |" in r.stdout and "| vit_s_b256 | 16 |" in r.stdout
    unknown = subprocess.run([*cmd, "--workloads", "resnet50"], cwd=REPO, capture_output=True, text=True)
    assert unknown.returncode == 1 and "--workloads resnet50 unknown" in unknown.stderr


HLO = """HloModule jit_train_step, entry_computation_layout={()->f32[]}

%fused_dot (p0: f32[4,4], p1: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  %p1 = f32[4,4]{1,0} parameter(1)
  ROOT %dot.1 = f32[4,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  %fusion.7 = f32[4,4]{1,0} fusion(f32[4,4]{1,0} %a, f32[4,4]{1,0} %a), kind=kOutput, calls=%fused_dot
  ROOT %copy.2 = f32[4,4]{1,0} copy(f32[4,4]{1,0} %fusion.7)
}
"""


@pytest.mark.unit
def test_device_time_by_op_reads_cpu_and_tpu_traces():
    """A CPU/GPU trace names the op in ``args.hlo_op`` (other modules' ops are left out); a TPU trace names it in
    the event with XLA's ``hlo_category`` (used only for ops the HLO text does not hold). Durations in us, over 2
    steps."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from accelerator import device_time_by_op

    cpu = [
        {"ph": "X", "dur": 300.0, "args": {"hlo_op": "fusion.7", "hlo_module": "jit_train_step"}},
        {"ph": "X", "dur": 100.0, "args": {"hlo_op": "copy.2", "hlo_module": "jit_train_step"}},
        {"ph": "X", "dur": 900.0, "args": {"hlo_op": "fusion.7", "hlo_module": "jit_eval_sums"}},
        {"ph": "X", "dur": 50.0, "args": {}},
        {"ph": "M", "dur": 50.0, "args": {"hlo_op": "copy.2"}},
    ]
    got = device_time_by_op(cpu, HLO, steps=2)
    assert got["categories"] == pytest.approx({"matmul": 150e-6, "copy/layout": 50e-6}, rel=1e-12)
    assert [t[:2] for t in got["top"]] == [["fusion.7", "matmul"], ["copy.2", "copy/layout"]]
    tpu = [
        {"ph": "X", "name": "fusion.7", "dur": 300.0, "args": {"hlo_category": "convolution fusion"}},
        {"ph": "X", "name": "copy.2", "dur": 100.0, "args": {"hlo_category": "data formatting"}},
        {"ph": "X", "name": "all-reduce.3", "dur": 40.0, "args": {"hlo_category": "all-reduce"}},
        {"ph": "X", "name": "0", "dur": 1000.0, "args": {"device_duration_ps": "1"}},  # a step marker
    ]
    got = device_time_by_op(tpu, HLO, steps=2)
    assert got["categories"] == pytest.approx({"matmul": 150e-6, "copy/layout": 50e-6, "all-reduce": 20e-6}, rel=1e-12)
    assert abs(got["total_s"] - 220e-6) < 1e-15
