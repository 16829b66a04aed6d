"""Tests of sweeps.report on synthetic multirun folders (no JAX, no network)."""

from __future__ import annotations

import csv
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from sweeps import report
from sweeps.report import build_rows, load_summaries, write_report

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
EPS = {  # examples/s per device count
    "jit_sharding": {1: 1000.0, 2: 1800.0, 4: 3000.0, 8: 4000.0},
    "fsdp": {1: 800.0, 2: 1520.0, 4: 2400.0, 8: 3200.0},
}
PAYLOAD = 6_000_000  # gradient bytes per step


def ok_summary(mode: str, devices: int, eps: float, **extra) -> dict:
    """A successful job summary with the canonical keys of train.py."""
    gb = 256
    summary = {
        "status": "ok",
        "parallel": mode,
        "precision": "fp32",
        "platform": "cpu",
        "device_kind": "cpu",
        "process_count": 1,
        "mesh/devices": devices,
        "mesh/shape": [devices],
        "train/global_batch": gb,
        "train/per_device_batch": gb // devices,
        "train/accum_steps": 1,
        "train/scaling": "strong",
        "train/steps": 20,
        "train/loss": 0.5,
        "eval/loss": 0.6,
        "eval/accuracy": 0.875,
        "perf/step_time_s": gb / eps,
        "perf/examples_per_s": eps,
        "perf/examples_per_s_per_device": eps / devices,
        "comm/payload_bytes_per_step": PAYLOAD,
        "comm/bytes_per_step": 2 * (devices - 1) / devices * PAYLOAD,
        "comm/ratio_model": 0.1 * (devices - 1),
        "mem/state_bytes_per_device": 3 * PAYLOAD // (devices if mode == "fsdp" else 1),
        "mem/temp_bytes_per_device": 4 * 2**20 // devices,
        "parallel/grad_reduce_dtype": "fp32",
    }
    summary.update(extra)
    return summary


def write_job(root: Path, job: int, summary: dict | None, overrides: list[str] = ()) -> Path:
    job_dir = root / str(job)
    (job_dir / ".hydra").mkdir(parents=True)
    (job_dir / ".hydra" / "overrides.yaml").write_text(
        "".join(f"- {o}\n" for o in overrides)
    )
    if summary is not None:
        (job_dir / "summary.json").write_text(json.dumps(summary))
    return job_dir


def make_sweep(root: Path, fail: tuple[str, int] | None = None) -> Path:
    """Jobs 0..7: jit_sharding and fsdp at 1, 2, 4, 8 devices (Hydra multirun order)."""
    job = 0
    for mode in ("jit_sharding", "fsdp"):
        for devices in (1, 2, 4, 8):
            overrides = [f"mesh.devices={devices}", f"parallel={mode}"]
            if fail == (mode, devices):
                summary = {"status": "failed",
                           "error": "XlaRuntimeError: RESOURCE_EXHAUSTED:\nout of memory"}
            else:
                summary = ok_summary(mode, devices, EPS[mode][devices])
            write_job(root, job, summary, overrides)
            job += 1
    return root


def read_csv(path: Path) -> list[dict]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert len(data) > 5000, path
    assert data[:8] == PNG_MAGIC, path
    width, height = struct.unpack(">II", data[16:24])  # IHDR
    assert width > 400 and height > 300, (path, width, height)
    import matplotlib.image

    assert matplotlib.image.imread(str(path)).ndim == 3  # decodes


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + ([full_env["PYTHONPATH"]] if full_env.get("PYTHONPATH") else [])
    )
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "sweeps.report", *args],
        cwd=REPO, env=full_env, capture_output=True, text=True, timeout=300,
    )


# ---------------------------------------------------------------------------
def test_strong_scaling_exact_speedup_and_efficiency(tmp_path):
    root = make_sweep(tmp_path / "multirun" / "12-00-00")
    paths = write_report(root)

    assert set(paths) == {"csv", "md", "throughput", "efficiency", "comm", "memory"}
    assert paths["csv"] == root / "scaling.csv"
    rows = read_csv(paths["csv"])
    assert len(rows) == 8
    assert list(rows[0])[:17] == report.COLUMNS[:17]
    assert report.COLUMNS[:17] == [
        "mode", "precision", "accum", "scaling", "devices", "global batch", "examples/s",
        "speedup vs 1 device", "scaling efficiency", "comm bytes/step (ring model, per device)",
        "comm payload bytes/step", "comm ratio", "comm ratio source", "state bytes/device",
        "temp bytes/device", "eval accuracy", "status",
    ]
    # sorted by mode then devices
    assert [(r["mode"], r["devices"]) for r in rows] == [
        (m, str(d)) for m in ("fsdp", "jit_sharding") for d in (1, 2, 4, 8)
    ]
    by = {(r["mode"], int(r["devices"])): r for r in rows}
    expected = {
        "jit_sharding": {1: ("1", "1"), 2: ("1.8", "0.9"), 4: ("3", "0.75"), 8: ("4", "0.5")},
        "fsdp": {1: ("1", "1"), 2: ("1.9", "0.95"), 4: ("3", "0.75"), 8: ("4", "0.5")},
    }
    for mode, per_dev in expected.items():
        for devices, (speedup, eff) in per_dev.items():
            row = by[(mode, devices)]
            assert row["speedup vs 1 device"] == speedup, (mode, devices)
            assert row["scaling efficiency"] == eff, (mode, devices)
            assert float(row["scaling efficiency"]) == float(speedup) / devices
            assert row["status"] == "ok"
    row = by[("jit_sharding", 2)]
    assert row["examples/s"] == "1800"
    assert row["comm bytes/step (ring model, per device)"] == str(PAYLOAD)  # 2*(2-1)/2 * P
    assert row["comm payload bytes/step"] == str(PAYLOAD)
    assert row["comm ratio"] == "0.1" and row["comm ratio source"] == "model"
    assert row["state bytes/device"] == str(3 * PAYLOAD)
    assert row["eval accuracy"] == "0.875"
    assert by[("fsdp", 8)]["state bytes/device"] == str(3 * PAYLOAD // 8)

    md = paths["md"].read_text()
    assert md.startswith("# Scaling report")
    assert "Platform(s): cpu" in md and "Device kind(s): cpu" in md
    assert "WARNING" in md and "CPU-simulated" in md and "do NOT predict" in md
    assert md.count("| jit_sharding |") == 4 and md.count("| fsdp |") == 4
    for name in ("throughput", "efficiency", "comm", "memory"):
        assert paths[name] == root / f"{name}.png"
        assert_png(paths[name])
        assert f"({name}.png)" in md


def test_build_rows_api_and_no_baseline(tmp_path):
    summaries = [ok_summary("fsdp", d, 100.0 * d) for d in (2, 4)]  # no 1-device job
    summaries += [ok_summary("jit_sharding", d, 100.0 * d) for d in (1, 2)]
    rows = build_rows(summaries)
    assert [r["mode"] for r in rows] == ["fsdp", "fsdp", "jit_sharding", "jit_sharding"]
    assert all(r["speedup vs 1 device"] is None for r in rows[:2])
    assert all(r["scaling efficiency"] is None for r in rows[:2])
    assert rows[3]["speedup vs 1 device"] == 2.0 and rows[3]["scaling efficiency"] == 1.0


def test_gpu_platform_has_no_cpu_warning(tmp_path):
    root = tmp_path / "mr"
    for i, d in enumerate((1, 2)):
        write_job(root, i, ok_summary("jit_sharding", d, 10.0 * d, platform="gpu",
                                      device_kind="NVIDIA H100 80GB HBM3"))
    md = write_report(root, tmp_path / "out")["md"].read_text()
    assert "Platform(s): gpu" in md and "NVIDIA H100 80GB HBM3" in md
    assert "WARNING" not in md


def test_failed_job_is_marked_and_rest_reported(tmp_path):
    root = make_sweep(tmp_path / "mr", fail=("fsdp", 4))
    out = tmp_path / "report"
    paths = write_report(root, out)
    assert paths["csv"].parent == out and not (root / "scaling.csv").exists()
    rows = read_csv(paths["csv"])
    assert len(rows) == 8
    failed = [r for r in rows if r["status"] != "ok"]
    assert len(failed) == 1
    bad = failed[0]
    # mode and device count come from .hydra/overrides.yaml
    assert bad["mode"] == "fsdp" and bad["devices"] == "4" and bad["job"] == "6"
    assert bad["status"] == "failed: XlaRuntimeError: RESOURCE_EXHAUSTED: out of memory"
    for column in ("examples/s", "speedup vs 1 device", "scaling efficiency", "comm ratio",
                   "comm bytes/step (ring model, per device)", "state bytes/device",
                   "eval accuracy"):
        assert bad[column] == "", column
    by = {(r["mode"], r["devices"]): r for r in rows if r["status"] == "ok"}
    assert len(by) == 7
    assert by[("fsdp", "8")]["speedup vs 1 device"] == "4"
    assert by[("fsdp", "8")]["scaling efficiency"] == "0.5"
    assert by[("jit_sharding", "4")]["scaling efficiency"] == "0.75"
    md = paths["md"].read_text()
    assert "7 ok, 1 failed" in md and "failed: XlaRuntimeError" in md
    for name in ("throughput", "efficiency", "comm", "memory"):
        assert_png(paths[name])


def test_failed_one_device_job_leaves_group_blank(tmp_path):
    root = make_sweep(tmp_path / "mr", fail=("jit_sharding", 1))
    rows = read_csv(write_report(root)["csv"])
    jit = [r for r in rows if r["mode"] == "jit_sharding" and r["status"] == "ok"]
    assert len(jit) == 3
    assert all(r["speedup vs 1 device"] == "" and r["scaling efficiency"] == "" for r in jit)
    fsdp = [r for r in rows if r["mode"] == "fsdp"]
    assert [r["scaling efficiency"] for r in fsdp] == ["1", "0.95", "0.75", "0.5"]


def test_unreadable_summary_is_a_failed_row(tmp_path):
    root = tmp_path / "mr"
    write_job(root, 0, ok_summary("fsdp", 1, 10.0))
    job = write_job(root, 1, None, ["mesh.devices=2", "parallel=fsdp", "precision=bf16"])
    (job / "summary.json").write_text("{not json")
    rows = build_rows(load_summaries(root))
    bad = [r for r in rows if not r["_ok"]]
    assert len(bad) == 1 and bad[0]["status"].startswith("failed: unreadable summary.json")
    assert bad[0]["devices"] == 2 and bad[0]["precision"] == "bf16"


def test_weak_scaling_grouping():
    summaries = []
    # strong: global batch 128 fixed
    for d, eps in ((1, 100.0), (2, 150.0), (4, 200.0)):
        summaries.append(ok_summary("fsdp", d, eps, **{
            "train/global_batch": 128, "train/per_device_batch": 128 // d}))
    # weak: per-device batch 32 fixed (global grows), its own 1-device baseline
    for d, eps in ((1, 40.0), (2, 76.0), (4, 140.0)):
        summaries.append(ok_summary("fsdp", d, eps, **{
            "train/scaling": "weak", "train/global_batch": 32 * d,
            "train/per_device_batch": 32}))
    # weak with another per-device batch and no 1-device job: no baseline
    summaries.append(ok_summary("fsdp", 2, 500.0, **{
        "train/scaling": "weak", "train/global_batch": 128, "train/per_device_batch": 64}))
    rows = build_rows(summaries)
    assert len(rows) == 7
    got = {(r["scaling"], r["per-device batch"], r["devices"]):
           (r["speedup vs 1 device"], r["scaling efficiency"]) for r in rows}
    assert got[("strong", 64, 2)] == (1.5, 0.75)
    assert got[("strong", 32, 4)] == (2.0, 0.5)
    assert got[("weak", 32, 1)] == (1.0, 1.0)
    assert got[("weak", 32, 2)] == (1.9, 0.95)
    assert got[("weak", 32, 4)] == (3.5, 0.875)
    assert got[("weak", 64, 2)] == (None, None)
    # sorted by mode, precision, accum, scaling, then devices
    assert [(r["scaling"], r["devices"]) for r in rows][:3] == [
        ("strong", 1), ("strong", 2), ("strong", 4)]


def test_comm_ratio_source_measured_only_if_valid():
    base = ok_summary("fsdp", 2, 10.0)
    del base["comm/ratio_model"]
    valid = dict(base, **{"comm/ratio_measured": 0.25, "comm/ratio_measured_valid": True})
    invalid = dict(base, **{"comm/ratio_measured": 0.75, "comm/ratio_measured_valid": False,
                            "train/global_batch": 512})
    rows = build_rows([valid, invalid])
    got = {r["global batch"]: (r["comm ratio"], r["comm ratio source"]) for r in rows}
    assert got == {256: (0.25, "measured"), 512: (None, None)}


def test_load_summaries_skips_output_and_wandb_dirs(tmp_path):
    root = make_sweep(tmp_path / "mr")
    stray = root / "0" / "wandb" / "offline-run-x" / "files"
    stray.mkdir(parents=True)
    (stray / "summary.json").write_text(json.dumps(ok_summary("fsdp", 1, 1.0)))
    out = root / "report"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps(ok_summary("fsdp", 1, 1.0)))
    summaries = load_summaries(root, exclude=[out])
    assert len(summaries) == 8
    assert [s["_job"] for s in summaries] == [str(i) for i in range(8)]
    assert all(Path(s["_job_dir"]).is_dir() for s in summaries)
    assert len(read_csv(write_report(root, out)["csv"])) == 8


def test_infer_group(tmp_path):
    assert report.infer_group([{"wandb/group": "g-1"}, {}], tmp_path / "x") == "g-1"
    assert report.infer_group([{}], tmp_path / "sweep-42") == "sweep-42"


# ---------------------------------------------------------------------------
def test_cli_writes_report(tmp_path):
    root = make_sweep(tmp_path / "mr")
    res = cli(str(root), "--out", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "out" / "scaling.csv").is_file()
    assert "scaling.md" in res.stdout


@pytest.mark.parametrize("kind", ["missing", "empty"])
def test_cli_errors_are_one_line(tmp_path, kind):
    folder = tmp_path / "nope"
    if kind == "empty":
        (folder / "0" / ".hydra").mkdir(parents=True)
    res = cli(str(folder))
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr and str(folder) in lines[0]
    expected = "does not exist" if kind == "missing" else "no summary.json"
    assert expected in lines[0]


def test_cli_wandb_offline(tmp_path):
    root = make_sweep(tmp_path / "sweep-7", fail=("fsdp", 8))
    wdir = tmp_path / "wb"
    wdir.mkdir()
    env = {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(wdir),
        "WANDB_CACHE_DIR": str(wdir / "cache"),
        "WANDB_CONFIG_DIR": str(wdir / "config"),
        "WANDB_DATA_DIR": str(wdir / "data"),
        "WANDB_ARTIFACT_DIR": str(wdir / "artifacts"),
        "WANDB_PROJECT": "scaling-test",
        "WANDB_SILENT": "true",
        "WANDB_API_KEY": "",
    }
    res = cli(str(root), "--out", str(tmp_path / "out"), "--wandb", env=env)
    assert res.returncode == 0, res.stderr
    sync_files = list(wdir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(sync_files) == 1, list(wdir.rglob("*"))
    sync = sync_files[0]
    assert re.fullmatch(r"run-[a-z0-9]+\.wandb", sync.name)
    assert f"wandb_sync_file: {sync}" in res.stdout
    data = sync.read_bytes()
    assert len(data) > 1000
    # protobuf strings are stored verbatim in the leveldb-style log
    for needle in (b"scaling_report", b"sweep-7", b"scaling_table", b"scaling-test"):
        assert needle in data, needle
    run_dir = sync.parent
    assert list(run_dir.rglob("*.png")), "wandb.Image media not written"
    assert list(run_dir.rglob("scaling_table*.table.json")), "wandb.Table not written"
