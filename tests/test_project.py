"""Hardware profiles and the scaling projection (sweeps/projection.py, sweeps/project.py, measure/hardware.py)."""

from __future__ import annotations

import argparse
import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from measure.hardware import HardwareError, load_profile, profile_for_device_kind, profile_names, set_field
from sweeps import project as cli
from sweeps.projection import (
    Collective,
    Hardware,
    ProjectionError,
    all_reduce_time_s,
    collective_time_s,
    collectives_for,
    gather_time_s,
    overlay_projection,
    project,
)
from tests.utils import REPO, make_cfg

CUSTOM = [
    "--hardware",
    "custom",
    "--set",
    "devices_per_node=8",
    "--set",
    "intra_node_bytes_per_s=100e9",
    "--set",
    "inter_node_bytes_per_s=10e9",
    "--set",
    "latency_s=0",
]
HW = Hardware("custom", devices_per_node=8, intra_node_bytes_per_s=100e9, inter_node_bytes_per_s=10e9, latency_s=0.0)


def _csv(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


@pytest.mark.unit
def test_acceptance_command(tmp_path, capsys):
    """The issue's first acceptance command: S = 1e8 B; 8 devices: 2*7/8*1e8/1e11; 16: + 2*1/2*1.25e7/1e10."""
    rc = cli.main(
        [
            *CUSTOM,
            "--params",
            "25000000",
            "--grad-bytes-per-param",
            "4",
            "--flops-per-example",
            "1e9",
            "--per-device-batch",
            "32",
            "--step-time-s",
            "0.1",
            "--overlap",
            "0",
            "--devices",
            "1,8,16",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    rows = _csv(tmp_path / "projection.csv")
    assert [int(r["devices"]) for r in rows] == [1, 8, 16]
    assert [int(r["nodes"]) for r in rows] == [1, 1, 2]
    for row, step in zip(rows, (0.1, 0.10175, 0.103)):
        assert float(row["step_time_s"]) == pytest.approx(step, abs=1e-9)
        assert float(row["efficiency"]) == pytest.approx(0.1 / step, abs=1e-12)
        assert float(row["examples_per_s"]) == pytest.approx(int(row["devices"]) * 32 / step, rel=1e-12)
        assert float(row["payload_bytes"]) == 1e8
    assert float(rows[1]["comm_s"]) == pytest.approx(2 * 7 / 8 * 1e8 / 1e11, abs=1e-15)
    assert float(rows[2]["comm_s"]) == pytest.approx(2 * 7 / 8 * 1e8 / 1e11 + 2 * 0.5 * 1.25e7 / 1e10, abs=1e-15)
    md = (tmp_path / "projection.md").read_text()
    assert md.startswith("# Projection (model, not a measurement)") and "| allreduce | 16 | 2 |" in md
    assert (tmp_path / "projection.png").stat().st_size > 10_000


@pytest.mark.unit
def test_fsdp_formula_equals_all_reduce_bandwidth():
    """All-gather and reduce-scatter each (g-1)/g*S/B_intra + (m-1)/m*(S/g)/B_inter; together = one all-reduce."""
    s = 1e8
    assert gather_time_s(s, 16, HW) == pytest.approx(7 / 8 * 1e8 / 1e11 + 0.5 * 1.25e7 / 1e10, abs=1e-15)
    assert gather_time_s(s, 16, HW) == pytest.approx(1.5e-3, abs=1e-15)
    fsdp = collectives_for("fsdp", 25_000_000, 4)
    assert fsdp == [Collective("all-gather", 1e8), Collective("reduce-scatter", 1e8)]
    rows = project(fsdp, 0.1, 32, [1, 8, 16, 64], HW)
    assert [r["comm_s"] for r in rows] == pytest.approx(
        [0.0, 1.75e-3, 3e-3, 2 * 7 / 8 * 1e8 / 1e11 + 2 * 7 / 8 * 1.25e7 / 1e10], abs=1e-15
    )
    assert rows[3]["nodes"] == 8


@pytest.mark.unit
def test_latency_term():
    """a * (2(g-1) + 2(m-1)) per all-reduce, a * ((g-1) + (m-1)) per all-gather / reduce-scatter."""
    hw = Hardware("lat", 8, 100e9, 10e9, latency_s=1e-5)
    assert all_reduce_time_s(1e8, 16, hw) == pytest.approx(3e-3 + 1e-5 * (2 * 7 + 2 * 1), abs=1e-15)
    assert gather_time_s(1e8, 16, hw) == pytest.approx(1.5e-3 + 1e-5 * (7 + 1), abs=1e-15)
    assert all_reduce_time_s(0, 1024, hw) == pytest.approx(1e-5 * (2 * 7 + 2 * 127), abs=1e-15)
    assert all_reduce_time_s(1e8, 1, hw) == 0.0
    # NCCL's ring: one flat ring, 2(N-1) latency steps; the tree: 2((g-1) + log2 m) steps.
    assert collective_time_s("all-reduce", 0, 16, hw, "ring") == pytest.approx(1e-5 * 30, abs=1e-15)
    assert collective_time_s("all-reduce", 0, 1024, hw, "tree") == pytest.approx(1e-5 * 2 * (7 + 7), abs=1e-15)
    # ring bandwidth term: 2(N-1)/N * S / min(B_intra, g * B_inter) across nodes
    assert collective_time_s("all-reduce", 1e8, 16, HW, "ring") == pytest.approx(2 * 15 / 16 * 1e8 / 80e9)


@pytest.mark.unit
def test_overlap():
    """exposed = max(0, comm - overlap * compute); step = compute + exposed."""
    ar = collectives_for("allreduce", 25_000_000, 4)
    half, small = (project(ar, 0.1, 32, [16], HW, overlap=o)[0] for o in (0.5, 0.01))
    assert half["exposed_comm_s"] == 0.0 and half["step_time_s"] == 0.1 and half["efficiency"] == 1.0
    assert small["exposed_comm_s"] == pytest.approx(3e-3 - 1e-3, abs=1e-15)
    assert small["step_time_s"] == pytest.approx(0.102, abs=1e-15)
    with pytest.raises(ProjectionError, match="overlap"):
        project(ar, 0.1, 32, [16], HW, overlap=1.5)
    with pytest.raises(ProjectionError, match="not a multiple"):
        project(ar, 0.1, 32, [12], HW)


@pytest.mark.unit
def test_profiles_and_device_kind_lookup():
    assert {"a100_sxm", "h100_sxm", "h200_sxm", "tpu_v5e", "cpu", "none", "custom", "auto"} <= set(profile_names())
    h100 = load_profile("h100_sxm")
    assert (
        h100["peak_flops_per_s"],
        h100["devices_per_node"],
        h100["intra_node_bytes_per_s"],
        h100["inter_node_bytes_per_s"],
        h100["link_bytes_per_s"],
    ) == (989e12, 8, 450e9, 50e9, 450e9)
    for name in ("a100_sxm", "h100_sxm", "h200_sxm", "tpu_v5e", "cpu"):
        assert load_profile(name)["source"], name
    assert profile_for_device_kind("NVIDIA H100 80GB HBM3")["name"] == "h100_sxm"
    assert profile_for_device_kind("NVIDIA A100-SXM4-40GB")["name"] == "a100_sxm"
    assert profile_for_device_kind("TPU v5 lite")["name"] == "tpu_v5e"
    assert profile_for_device_kind("TPU v5")["name"] == "tpu_v5p"
    assert profile_for_device_kind("TPU v4")["name"] == "tpu_v4"
    assert profile_for_device_kind("cpu")["link_bytes_per_s"] is None
    assert profile_for_device_kind("some accelerator") is None
    from measure.compiled import lookup_link_bytes_per_s, lookup_peak_flops_per_s

    assert lookup_link_bytes_per_s("NVIDIA H200") == 450e9 and lookup_link_bytes_per_s("cpu") is None
    assert lookup_peak_flops_per_s("NVIDIA A100-SXM4-80GB", "float32") == 156e12
    assert lookup_peak_flops_per_s("NVIDIA A100-SXM4-80GB", "bfloat16") == 312e12
    assert set_field(h100, "intra_node_bytes_per_s", "1e11")["link_bytes_per_s"] == 1e11
    with pytest.raises(HardwareError, match="choices: a100_sxm, auto, cpu"):
        load_profile("h999")
    with pytest.raises(HardwareError, match="devices_per_node must be a positive integer"):
        set_field(h100, "devices_per_node", "2.5")


@pytest.mark.unit
def test_a_ratio_of_a_profiles_numbers_needs_the_device_it_describes():
    """comm/ratio_model and perf/mfu divide a profile's numbers by a time measured on the device that ran: only
    formed when the profile describes that device. A TPU v5e under hardware=auto (or tpu_v5e) keeps them; an H100
    profile on the CPU or on an A100 does not, nor tpu_v5p (pattern `tpu v5`) on a v5e; numbers set by hand
    (custom, auto without a match) describe the device that ran, except simulated CPU devices."""
    from measure.hardware import describes_device
    from training.run import ratio_line

    v5e, h100, a100 = "TPU v5 lite", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"
    assert describes_device("auto", [], v5e, "tpu") and describes_device("tpu_v5e", ["tpu v5 lite"], v5e, "tpu")
    assert describes_device("h100_sxm", ["h100"], h100, "gpu") and describes_device("auto", [], h100, "gpu")
    assert not describes_device("tpu_v5p", ["tpu v5p", "tpu v5"], v5e, "tpu")
    assert not describes_device("h100_sxm", ["h100"], a100, "gpu")
    assert not describes_device("h100_sxm", ["h100"], "cpu", "cpu") and not describes_device("auto", [], "cpu", "cpu")
    assert describes_device("custom", [], "AMD Instinct MI300X", "gpu") and describes_device("none", [], h100, "gpu")
    assert not describes_device("custom", ["mi300"], h100, "gpu") and describes_device(
        "custom", ["mi300"], "MI300X", "x"
    )
    assert not describes_device("custom", [], "cpu", "cpu")
    # the start-up line: why the ratios are absent, and the two ways to a ratio (measured, modelled for the target)
    assert ratio_line("h100_sxm", "h100_sxm", "cpu", False, 450e9, 989e12) == (
        "hardware=h100_sxm describes another device than the one that ran (cpu): comm/ratio_model and perf/mfu are "
        "not computed (its numbers over times measured here would mix two machines); the profiler "
        "(profile.enabled=true) measures comm/ratio_measured (not valid on simulated CPU devices), and "
        "python -m sweeps.project <run folder> --hardware h100_sxm --mfu 0.4 models both wholly for h100_sxm"
    )
    assert ratio_line("auto", "cpu", "cpu", False, None, None) == (
        "no link bandwidth known for cpu: comm/time_model_s and comm/ratio_model are not computed; "
        "the profiler (profile.enabled=true) measures comm/ratio_measured (on simulated CPU devices it is flagged not "
        "valid), and python -m sweeps.project <run folder> --hardware h100_sxm --mfu 0.4 models a target machine"
    )
    assert ratio_line("auto", "tpu_v5e", v5e, True, 2e11, 1.97e14) is None


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--hardware", "h999"],
            "error: unknown hardware profile 'h999'; choices: a100_sxm, auto, cpu, custom, h100_sxm",
        ),
        (
            ["--hardware", "custom", "--set", "devices_per_node=abc"],
            "error: --set devices_per_node=abc: devices_per_node must be a positive integer (or null)",
        ),
        (["--hardware", "h100_sxm", "--set", "bandwidth=1e9"], "error: unknown hardware field 'bandwidth'"),
        (["--hardware", "cpu"], "error: hardware profile 'cpu' has no devices_per_node, intra_node_bytes_per_s"),
    ],
)
def test_bad_input_is_one_line(tmp_path, args, message):
    """Unknown profile, bad --set, a profile without numbers: one line on stderr, exit 2, no traceback."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sweeps.project",
            *args,
            "--params",
            "1000",
            "--per-device-batch",
            "8",
            "--step-time-s",
            "0.1",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), proc.stderr
    assert not (tmp_path / "projection.csv").exists()


def _run_job(run_dir: Path, hardware: dict | None = None, **dotted) -> dict:
    """training.run.run_and_report in-process (W&B disabled, no checkpoints); returns summary.json."""
    from training.run import run_and_report

    cfg = make_cfg(
        {"hardware": hardware or {}},
        wandb__mode="disabled",
        checkpoint__enabled="false",
        data__name="synthetic",
        train__steps=2,
        train__log_every=1,
        **dotted,
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    assert run_and_report(cfg, run_dir)
    return json.loads((run_dir / "summary.json").read_text())


def _hydra_hardware(name: str) -> dict:
    """The ``hardware`` node that ``train.py hardware=<name>`` composes (Hydra, the real config group)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from conf.schema import register

    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"hardware={name}"])
    return OmegaConf.to_container(cfg.hardware, resolve=True)


@pytest.mark.unit
def test_run_folder_projection_matches_compiled_payload(tmp_path):
    """train with hardware=h100_sxm on the CPU records the profile and the H100 link's modelled time, but no ratio
    of the profile's numbers to the CPU's step time (comm/ratio_model, perf/mfu: they would mix two machines);
    sweeps.project on that run folder models both wholly for the H100, from the compiled step's collectives: its
    payload at 8 devices is the run's comm/payload_bytes_per_step."""
    hardware = _hydra_hardware("h100_sxm")
    assert hardware["link_bytes_per_s"] == 450e9 and hardware["name"] == "h100_sxm"
    summary = _run_job(tmp_path / "run", hardware=hardware, parallel__name="jit_sharding")
    assert summary["hardware/link_bytes_per_s"] == 450e9 and summary["hardware/profile"] == "h100_sxm"
    assert summary["comm/time_model_s"] == pytest.approx(summary["comm/bytes_per_step"] / 450e9, rel=1e-12)
    assert summary["hardware/matches_device"] is False
    assert "comm/ratio_model" not in summary and "perf/mfu" not in summary
    out = tmp_path / "projection"
    assert (
        cli.main(
            [
                str(tmp_path / "run"),
                "--hardware",
                "h100_sxm",
                "--mfu",
                "0.4",
                "--devices",
                "8,64,512",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = _csv(out / "projection.csv")
    assert [int(r["devices"]) for r in rows] == [8, 64, 512] and [int(r["nodes"]) for r in rows] == [1, 8, 64]
    payload = summary["comm/payload_bytes_per_step"]
    assert summary["comm/count/all-reduce"] == 1 and payload > 0
    assert float(rows[0]["payload_bytes"]) == payload
    hw = Hardware.from_profile(load_profile("h100_sxm"))
    for row in rows:
        assert float(row["comm_s"]) == pytest.approx(all_reduce_time_s(payload, int(row["devices"]), hw), rel=1e-12)
    compute = summary["perf/flops_per_step_per_device"] / (0.4 * 989e12)
    assert float(rows[0]["compute_s"]) == pytest.approx(compute, rel=1e-12)
    assert float(rows[0]["examples_per_s"]) == pytest.approx(
        8 * summary["train/global_batch"] / 8 / (compute + float(rows[0]["comm_s"])), rel=1e-12
    )
    # the modelled ratio, labelled: the H100's communication time over its modelled step, at the MFU given
    assert float(rows[0]["comm_ratio"]) == pytest.approx(float(rows[0]["comm_s"]) / float(rows[0]["step_time_s"]))
    assert (rows[0]["hardware"], rows[0]["assumed_mfu"], rows[0]["scaling"]) == ("h100_sxm", "0.4", "weak")


@pytest.mark.parametrize("parallel", ["jit_sharding", "fsdp"])
def test_payload_formula_against_compiled_step_at_2_4_8(tmp_path, parallel):
    """The projection keeps every collective's payload S for any N. Check against the step compiled at 2, 4 and 8
    simulated devices: jit_sharding has the same collectives (kind and bytes) at every N; under fsdp an array
    that N does not divide stays replicated (all-reduce instead of all-gather + reduce-scatter), which moves
    bytes between kinds but not the modelled bandwidth time (an all-reduce costs exactly an all-gather plus a
    reduce-scatter), so the latency-free comm time projected to 1024 devices is the same from every N."""
    hw = Hardware("nolat", 8, 450e9, 50e9, latency_s=0.0)
    by_n = {}
    for n in (2, 4, 8):
        summary = _run_job(tmp_path / str(n), parallel__name=parallel, mesh__devices=n, train__per_device_batch=8)
        assert summary["mesh/devices"] == n
        collectives = cli.collectives_from_summary(summary)
        assert sum(c.payload_bytes for c in collectives) == summary["comm/payload_bytes_per_step"]
        by_n[n] = collectives
    if parallel == "jit_sharding":
        assert sorted(by_n[2]) == sorted(by_n[4]) == sorted(by_n[8])
    comm = {n: project(c, 1.0, 8, [1024], hw)[0]["comm_s"] for n, c in by_n.items()}
    assert comm[2] == pytest.approx(comm[8], rel=1e-12) and comm[4] == pytest.approx(comm[8], rel=1e-12)


@pytest.mark.unit
def test_overlay_projection_draws_rows():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = project(collectives_for("allreduce", 25_000_000, 4), 0.1, 32, [1, 8, 16], HW)
    fig, ax = plt.subplots()
    line = overlay_projection(ax, rows, "efficiency", label="proj")
    assert list(line.get_xdata()) == [1, 8, 16]
    assert list(line.get_ydata()) == pytest.approx([1.0, 0.1 / 0.10175, 0.1 / 0.103])
    assert line.get_label() == "proj" and line.get_linestyle() == "--"
    plt.close(fig)


@pytest.mark.unit
def test_sweep_folder_summaries(tmp_path):
    """A sweep folder: one configuration per (mode, precision, model, batch...), the job with the most devices;
    collectives inside the accumulation loop count accum_steps times; failed jobs are skipped."""
    jobs = {
        "0": {
            "status": "ok",
            "parallel": "jit_sharding",
            "precision": "fp32",
            "model": "mlp",
            "mesh/devices": 4,
            "train/global_batch": 128,
            "train/accum_steps": 1,
            "train/per_device_batch": 32,
            "comm/collectives": ["all-reduce f32 1000B n=4"],
            "comm/payload_bytes_per_step": 1000,
        },
        "1": {
            "status": "ok",
            "parallel": "jit_sharding",
            "precision": "fp32",
            "model": "mlp",
            "mesh/devices": 8,
            "train/global_batch": 256,
            "train/accum_steps": 1,
            "train/per_device_batch": 32,
            "comm/collectives": ["all-reduce f32 1000B n=8"],
            "comm/payload_bytes_per_step": 1000,
        },
        "2": {
            "status": "ok",
            "parallel": "jit_sharding",
            "precision": "fp32",
            "model": "mlp",
            "mesh/devices": 8,
            "train/global_batch": 256,
            "train/accum_steps": 4,
            "train/per_device_batch": 32,
            "comm/collectives": ["all-reduce f32 1000B n=8 loop"],
            "comm/payload_bytes_per_step": 1000,
        },
        "3": {"status": "failed", "error": "x"},
    }
    for name, summary in jobs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    configs, skipped = cli.configurations(cli.load_summaries(tmp_path))
    assert skipped == []
    assert [(c["mesh/devices"], c["train/accum_steps"]) for c in configs] == [(8, 1), (8, 4)]
    assert cli.collectives_from_summary(configs[1]) == [Collective("all-reduce", 1000.0, 4)]
    out = tmp_path / "out"
    assert cli.main([str(tmp_path), *CUSTOM, "--step-time-s", "0.1", "--devices", "8,16", "--out", str(out)]) == 0
    rows = _csv(out / "projection.csv")
    assert [r["config"] for r in rows] == ["jit_sharding fp32 mlp batch/device=32"] * 2 + [
        "jit_sharding fp32 mlp batch/device=32 accum=4"
    ] * 2
    one = all_reduce_time_s(1000, 16, HW)
    assert float(rows[1]["comm_s"]) == pytest.approx(one) and float(rows[3]["comm_s"]) == pytest.approx(4 * one)
    assert float(rows[1]["examples_per_s"]) == pytest.approx(16 * 32 / (0.1 + one), rel=1e-12)


@pytest.mark.unit
def test_published_comparison_table_matches_docs():
    """docs/performance.md's published-vs-projected table is what benchmarks/projection_vs_published.py computes."""
    from benchmarks.projection_vs_published import rows

    table = rows()
    assert [(r["model"], r["devices"], r["published"]) for r in table] == [
        ("Inception V3", 128, 0.90),
        ("Inception V3", 512, 0.90),
        ("VGG-16", 128, 0.79),
        ("VGG-16", 512, 0.68),
        ("ResNet-50", 256, 0.90),
    ]
    assert [round(r["projected@0"], 2) for r in table] == [0.87, 0.86, 0.55, 0.54, 0.79]
    assert [r["projected@1"] for r in table] == [1.0] * 5
    assert [round(r["fitted_overlap"], 2) for r in table] == [0.04, 0.05, 0.55, 0.37, 0.17]
    doc = (REPO / "docs" / "performance.md").read_text()
    for r in table:
        line = (
            f"| {r['study']} | {r['model']} | {r['devices']} ({r['baseline']}) | {r['published']:.2f} | "
            f"{r['compute_s']:.3f} | {r['comm_s@0']:.3f} | {r['projected@0']:.2f} ({r['error@0']:+.0%}) |"
        )
        assert line in doc


@pytest.mark.unit
def test_report_draws_projection_from_csv(tmp_path):
    """`sweeps.report --projection projection.csv`: the CSV's rows reach the projection panel, one line per config."""
    from sweeps.report.cli import read_projection
    from sweeps.report.plots import plot_projection
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sweeps.report import ReportError

    csv_path = tmp_path / "projection.csv"
    head = "config,devices,examples_per_s,compute_s,comm_s,step_time_s,efficiency"
    csv_path.write_text(f"{head}\nfsdp,8,100.0,1,0,1,1\nfsdp,16,180.0,1,0.1,1.1,0.9\ndp,8,90.0,1,0,1,1\n")
    rows = read_projection(csv_path)
    assert rows[0] == {
        "label": "fsdp",
        "devices": 8,
        "examples_per_s": 100.0,
        "efficiency": 1.0,
        "comm_ratio": None,
        "below_step_floor": False,
        "hardware": None,
        "assumed_mfu": None,
        "assumed_step_time_s": None,
        "per_device_batch": None,
    }
    # a CSV with devices and examples/s that is no projection (a scaling.csv) is refused, not drawn as one
    scaling = tmp_path / "scaling.csv"
    scaling.write_text("devices,parallel,examples_per_s,speedup\n1,fsdp,100,1\n2,fsdp,180,1.8\n")
    with pytest.raises(ReportError, match=r"scaling.csv is not a projection.csv of sweeps.project \(no compute_s"):
        read_projection(scaling)
    fig, ax = plt.subplots()
    handles = plot_projection(ax, [], rows)
    labels = sorted(h.get_label() for h in handles)
    assert labels == ["dp", "fsdp"] and {h.get_linestyle() for h in handles} == {"--"}
    assert ax.get_xlim()[1] >= 16  # the x axis reaches the projected device counts
    plt.close(fig)


def _strong_sweep(root: Path, modes=("jit_sharding", "fsdp"), devices=(1, 2, 4, 8)) -> Path:
    """Summaries of a strong-scaling sweep (global batch 256): the 1-device jobs have no collective."""
    job = 0
    for mode in modes:
        for n in devices:
            kinds = ["all-reduce"] if mode == "jit_sharding" else ["all-gather", "reduce-scatter"]
            summary = {
                "status": "ok",
                "parallel": mode,
                "precision": "fp32",
                "model": "mlp",
                "mesh/devices": n,
                "train/scaling": "strong",
                "train/global_batch": 256,
                "train/per_device_batch": 256 // n,
                "train/accum_steps": 1,
                "comm/collectives": [f"{k} f32 1000B n={n}" for k in kinds] if n > 1 else [],
                "perf/flops_per_step_per_device": 1e9 / n,
            }
            (root / str(job)).mkdir(parents=True)
            (root / str(job) / "summary.json").write_text(json.dumps(summary))
            job += 1
    return root


@pytest.mark.unit
def test_sweep_projects_from_the_largest_job_never_a_one_device_one(tmp_path, capsys):
    """A strong-scaling sweep over 1, 2, 4, 8 devices is one configuration per mode, projected from its 8-device
    job; 1-device jobs (no collective) are never a source: no configuration projects 100% efficiency at 512."""
    root = _strong_sweep(tmp_path / "sweep")
    configs, skipped = cli.configurations(cli.load_summaries(root))
    assert [(c["parallel"], c["mesh/devices"]) for c in configs] == [("fsdp", 8), ("jit_sharding", 8)]
    assert skipped == []
    out = tmp_path / "out"
    args = [str(root), *CUSTOM, "--step-time-s", "0.001", "--devices", "8,64,512", "--out", str(out)]
    assert cli.main(args) == 0
    rows = _csv(out / "projection.csv")
    assert [(r["config"], r["run_devices"], r["devices"]) for r in rows] == [
        (f"{m} fp32 mlp batch/device=32", "8", d) for m in ("fsdp", "jit_sharding") for d in ("8", "64", "512")
    ]
    assert all(float(r["efficiency"]) < 1.0 for r in rows)
    one = all_reduce_time_s(1000, 512, HW)
    assert float(rows[5]["comm_s"]) == pytest.approx(one, rel=1e-12)
    assert float(rows[5]["efficiency"]) == pytest.approx(0.001 / (0.001 + one), rel=1e-12)
    # a configuration with only a 1-device job is skipped with a line; with nothing left, one error line
    only_one = _strong_sweep(tmp_path / "one", modes=("pmap",), devices=(1,))
    _strong_sweep(root / "extra", modes=("pmap",), devices=(1,))
    capsys.readouterr()
    assert cli.main(args) == 0
    assert "skipped pmap fp32 mlp batch/device=256: only 1-device jobs (no collective to scale)" in (
        capsys.readouterr().out
    )
    assert cli.main([str(only_one), *CUSTOM, "--step-time-s", "0.001", "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no job below" in err and "mesh.devices >= 2" in err


@pytest.mark.unit
def test_a_strong_sweep_projected_as_weak_scaling_says_so_in_plain_numbers(tmp_path, capsys, monkeypatch):
    """A strong-scaling sweep (global batch 256, largest job 8 devices) is projected as weak scaling at 32 examples
    per device: the console, projection.md and projection.png say so; projection.md's header and table have no
    e-notation (times with units, counts with thousands separators); the PNG's title names the hardware, the
    assumed MFU and the regime, not the profile's raw numbers."""
    from matplotlib.figure import Figure

    captured = {}
    original = Figure.savefig

    def keep(fig, *a, **k):
        captured["fig"] = fig
        return original(fig, *a, **k)

    monkeypatch.setattr(Figure, "savefig", keep)
    root = _strong_sweep(tmp_path / "sweep", modes=("jit_sharding",))
    out = tmp_path / "out"
    assert (
        cli.main([str(root), "--hardware", "h100_sxm", "--mfu", "0.4", "--devices", "8,64,512", "--out", str(out)]) == 0
    )
    note = (
        "The sweep ran strong scaling (global batch 256 fixed); projected as weak scaling at the per-device batch "
        "of its largest job (8 devices: 32 examples per device), held fixed at every projected device count."
    )
    assert note in capsys.readouterr().out
    md = (out / "projection.md").read_text()
    assert note in md
    assert "h100_sxm: 8 devices per node, links 450 GB/s within a node and 50 GB/s between nodes, 4 µs latency" in md
    assert not re.search(r"\de[+-]\d", md.split("Hardware sources")[0] + md.split("| config")[1]), md
    assert captured["fig"]._suptitle.get_text().replace("\n", " ") == (
        "Projected for h100_sxm at MFU 0.4 of 989 TFLOP/s peak: weak scaling, 32 examples per device (a model, not "
        "a measurement)"
    )
    assert "projected as weak scaling" in captured["fig"]._supxlabel.get_text().replace("\n", " ")
    assert cli.md_cell("compute_s", 1.401e-07) == "140 ns" and cli.md_cell("examples_per_s", 8633000.0) == "8,633,000"
    assert cli.md_cell("comm_ratio", 0.000123456) == "0.0001235" and cli.md_cell("payload_bytes", 814128.0) == "795 KiB"


@pytest.mark.unit
def test_console_percentages_and_time_units(tmp_path, capsys):
    """The console prints efficiency as a percentage with 3 significant digits (never 0.000) and every time in
    one format with its unit."""
    assert cli.format_percent(1.0) == "100%" and cli.format_percent(0.0002994) == "0.0299%"
    assert cli.format_percent(0.99712) == "99.7%"
    assert [cli.format_seconds(v) for v in (0.0, 5.4e-7, 2.27234e-4, 0.00455, 1.25)] == [
        "0 s",
        "540 ns",
        "227 µs",
        "4.55 ms",
        "1.25 s",
    ]
    assert [cli.format_count(v) for v in (950.0, 66892.0, 1.127e6, 2.428e11)] == ["950", "66.9k", "1.13M", "243G"]
    root = _strong_sweep(tmp_path / "sweep", modes=("jit_sharding",))
    args = [str(root), *CUSTOM, "--step-time-s", "1e-5", "--devices", "8,512", "--out", str(tmp_path / "o")]
    assert cli.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "jit_sharding fp32 mlp batch/device=32 (from the 8-device job):"
    # 8 devices: all-reduce of 1000 B = 2 * 7/8 * 1000 / 1e11 s = 17.5 ns; 512: + 2 * 63/64 * 125 / 1e10 s
    step8 = 1e-5 + 1.75e-8
    assert lines[1] == (
        f"  N=    8  step {cli.format_seconds(step8):>9}  comm   17.5 ns  {cli.format_count(8 * 32 / step8):>7} "
        f"examples/s  efficiency {cli.format_percent(1e-5 / step8):>8}"
    )
    assert "efficiency    99.8%" in lines[1] and "0.000" not in "\n".join(lines)
    assert " s " in lines[2] or "µs" in lines[2]


@pytest.mark.unit
def test_a_step_below_any_real_devices_floor_is_one_warning_not_tiny_efficiencies(tmp_path, capsys):
    """The quick-start MLP at --mfu 0.4 of an H100 computes a step in ~0.1 µs, far below what one step takes on any
    real device: one warning line instead of efficiencies like 0.03%; the files keep the model's numbers."""
    summary = _run_job(tmp_path / "run", parallel__name="jit_sharding")
    compute = summary["perf/flops_per_step_per_device"] / (0.4 * 989e12)
    assert compute < cli.STEP_FLOOR_S == 5e-6
    capsys.readouterr()  # the run's own lines
    out_dir = tmp_path / "projection"
    args = [str(tmp_path / "run"), "--hardware", "h100_sxm", "--mfu", "0.4", "--devices", "8,64", "--out", str(out_dir)]
    assert cli.main(args) == 0
    captured = capsys.readouterr()
    (config,) = {r["config"] for r in _csv(out_dir / "projection.csv")}
    assert captured.err.splitlines() == [cli.floor_warning(config, compute)]
    assert captured.err.startswith(f"warning: {config}: its step computes in {cli.format_seconds(compute)}, below ")
    lines = captured.out.splitlines()
    assert lines[0].startswith(config) and [line.split()[0] for line in lines[1:3]] == ["N=", "N="]
    assert "efficiency" not in captured.out and "%" not in captured.out and "examples/s" in lines[1]
    assert all(0 < float(r["efficiency"]) < 0.01 for r in _csv(out_dir / "projection.csv"))
    # explicit numbers: a measured step at the floor prints its efficiencies, one just below it warns
    explicit = ["--params", "1000", "--per-device-batch", "32", "--devices", "8", "--out", str(tmp_path / "e")]
    assert cli.main([*explicit, *CUSTOM, "--step-time-s", "5e-6"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "efficiency" in captured.out
    assert cli.main([*explicit, *CUSTOM, "--step-time-s", "4.9e-6"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [cli.floor_warning("allreduce", 4.9e-6)] and "efficiency" not in captured.out


@pytest.mark.unit
def test_projection_png_plain_ticks_and_percent(tmp_path):
    """projection.png: x ticks at the projected device counts, throughput ticks in plain decimals, efficiency
    in %; the PNG opens and its margins are blank (nothing cut)."""
    from matplotlib.figure import Figure
    from tests.test_report import assert_margins_blank, assert_png

    rows = [
        {"config": "allreduce", **r}
        for r in project(collectives_for("allreduce", 25_000_000, 4), 0.1, 32, [1, 8, 16, 64], HW)
    ]
    captured = {}
    original = Figure.savefig

    def keep(fig, *a, **k):
        captured["fig"] = fig
        return original(fig, *a, **k)

    import matplotlib.figure

    matplotlib.figure.Figure.savefig = keep
    try:
        path = cli.write_plot(rows, tmp_path / "projection.png", "header")
    finally:
        matplotlib.figure.Figure.savefig = original
    ax_t, ax_e = captured["fig"].axes
    assert [t.get_text() for t in ax_t.get_xticklabels()] == ["1", "8", "16", "64"]
    labels = [t.get_text() for t in ax_t.get_yticklabels()]
    assert labels and all("$" not in t and "e" not in t for t in labels), labels
    eff = [t.get_text() for t in ax_e.get_yticklabels()]
    assert eff and all(t.endswith("%") for t in eff) and "100%" in eff, eff
    assert_png(path)
    assert_margins_blank(path)


@pytest.mark.unit
def test_efficiencies_left_out_stay_out_of_the_png_and_md_and_are_flagged_in_the_csv(tmp_path, monkeypatch):
    """A configuration whose modelled step computes below any real device's floor: its speedup, efficiency, comm
    ratio and MFU are blank in projection.md, absent from projection.png (no efficiency line, no linear line, the
    panel says so), and kept in projection.csv with below_step_floor=true; the other configuration is drawn."""
    from matplotlib.figure import Figure

    big, tiny = 25_000_000, 1000
    args = argparse.Namespace(mfu=None, step_time_s=1e-3, hardware="custom")
    rows = [
        {"config": name, **r}
        for name, params, compute in (("big", big, 1e-3), ("tiny", tiny, 1e-7))
        for r in project(collectives_for("allreduce", params, 4), compute, 32, [8, 64], HW)
    ]
    rows = cli.annotate(rows, args, HW)
    assert [r["below_step_floor"] for r in rows] == [False, False, True, True]
    assert [r["per_device_batch"] for r in rows] == pytest.approx([32.0] * 4) and {r["scaling"] for r in rows} == {
        "weak"
    }
    csv_rows = _csv(cli.write_csv(rows, tmp_path / "projection.csv"))
    assert [r["below_step_floor"] for r in csv_rows] == ["false", "false", "true", "true"]
    assert all(float(r["efficiency"]) > 0 and float(r["comm_ratio"]) > 0 for r in csv_rows)  # kept, flagged
    md = cli.write_markdown(rows, tmp_path / "projection.md", "header", "src").read_text()
    table = [line.split(" | ") for line in md.splitlines() if line.startswith("| tiny")]
    cols = md.splitlines()[[i for i, line in enumerate(md.splitlines()) if line.startswith("| config")][0]]
    names = cols.strip("| ").split(" | ")
    for cells in table:  # every figure derived from its compute time: throughput and step time too
        for col in ("step time", "examples_per_s", "speedup", "efficiency", "comm_ratio", "mfu"):
            assert cells[names.index(col)].strip(" |") == "", (col, cells)
    assert "tiny: its step computes in 100 ns, below what a step takes on any real device" in md
    big_row = [line for line in md.splitlines() if line.startswith("| big")][0]
    assert f"{rows[0]['efficiency']:.4g}" in big_row
    captured = {}
    original = Figure.savefig

    def keep(fig, *a, **k):
        captured["fig"] = fig
        return original(fig, *a, **k)

    monkeypatch.setattr(Figure, "savefig", keep)
    cli.write_plot(rows, tmp_path / "projection.png", "header")
    ax_t, ax_e = captured["fig"].axes
    assert [line.get_label() for line in ax_e.get_lines()] == ["big"]
    assert [line.get_label() for line in ax_t.get_lines()] == ["big", "linear (no communication)"]  # no tiny
    left_out = (
        "Left out: 1 configuration(s) whose modelled step computes below ~5 µs, less than any real device takes: its "
        "throughput and efficiency would show the model's latency terms only (projection.csv keeps them, flagged)."
    )
    assert captured["fig"]._supxlabel.get_text().replace("\n", " ") == left_out
    assert captured["fig"]._suptitle.get_text() == "header"
    cli.write_plot(rows[2:], tmp_path / "tiny.png", "header")  # only the tiny configuration: the reason, no line
    (ax,) = captured["fig"].axes
    assert ax.get_lines() == [] and ax.texts[0].get_text().replace("\n", " ") == left_out


# ---- a language model: tokens are the unit of work --------------------------------------------------------
GPT2_SMALL = ["--params", "124439808", "--per-device-batch", "8", "--parallel", "allreduce"]
GPT2_FLOPS_PER_TOKEN = 6 * 124439808 + 12 * 12 * 768 * 1024  # 859,885,056 (PaLM appendix B)


@pytest.mark.unit
def test_explicit_tokens_columns_and_console(tmp_path, capsys):
    """--tokens-per-example T: tokens_per_s = examples_per_s x T exactly, flops_per_token as given;
    --flops-per-token F x T equals --flops-per-example F T; the console and plot read tokens/s."""
    common = [*GPT2_SMALL, "--hardware", "h100_sxm", "--mfu", "0.4", "--devices", "8,64,512,1024"]
    by_token = [*common, "--tokens-per-example", "1024", "--flops-per-token", str(GPT2_FLOPS_PER_TOKEN)]
    assert cli.main([*by_token, "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    by_example = [*common, "--tokens-per-example", "1024", "--flops-per-example", str(GPT2_FLOPS_PER_TOKEN * 1024)]
    assert cli.main([*by_example, "--out", str(tmp_path / "b")]) == 0
    a, b = _csv(tmp_path / "a" / "projection.csv"), _csv(tmp_path / "b" / "projection.csv")
    assert a == b
    assert list(a[0])[9:13] == ["examples_per_s", "tokens_per_example", "tokens_per_s", "flops_per_token"]
    for row in a:
        assert row["tokens_per_example"] == "1024" and float(row["flops_per_token"]) == GPT2_FLOPS_PER_TOKEN
        assert float(row["tokens_per_s"]) == float(row["examples_per_s"]) * 1024
        assert float(row["mfu"]) == pytest.approx(
            GPT2_FLOPS_PER_TOKEN * float(row["tokens_per_s"]) / int(row["devices"]) / 989e12, rel=1e-12
        )
    assert float(a[0]["compute_s"]) == GPT2_FLOPS_PER_TOKEN * 1024 * 8 / (0.4 * 989e12)
    assert "3.31M tokens/s  efficiency    89.9%  MFU 36%" in out and "examples/s" not in out
    assert "| tokens_per_s |" in (tmp_path / "a" / "projection.md").read_text()
    # without tokens: the examples columns only
    assert cli.main([*common, "--flops-per-example", "1e12", "--out", str(tmp_path / "c")]) == 0
    assert "tokens_per_s" not in _csv(tmp_path / "c" / "projection.csv")[0]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--flops-per-token", "1e9"], "error: --flops-per-token 1e+09 needs --tokens-per-example"),
        (
            ["--flops-per-token", "1e9", "--flops-per-example", "1e12", "--tokens-per-example", "1024"],
            "error: --flops-per-token 1e+09 and --flops-per-example 1e+12: give one of them",
        ),
        (["--tokens-per-example", "0"], "error: --tokens-per-example 0: must be a positive integer"),
        (
            ["--tokens-per-example", "1024", "--flops-per-token", "-1"],
            "error: --flops-per-token -1: must be a positive number",
        ),
        (
            ["--tokens-per-example", "1024", "--flops-per-token", "nan"],
            "error: --flops-per-token nan: must be a positive number",
        ),
    ],
)
def test_token_options_bad_input_is_one_line(tmp_path, capsys, args, message):
    rc = cli.main([*GPT2_SMALL, "--hardware", "h100_sxm", "--mfu", "0.4", *args, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith(message), err
    assert not (tmp_path / "projection.csv").exists()


def test_gpt_run_folder_projects_in_tokens(tmp_path, capsys):
    """A real 8-device GPT run: its folder projects with T = its model/context, tokens_per_s = examples_per_s x T,
    flops_per_token = the run's perf/flops_per_token (6N + 12 L d T), payload = its compiled payload."""
    summary = _run_job(
        tmp_path / "run",
        model__name="gpt",
        model__size="tiny",
        model__context=32,
        train__global_batch=16,
        parallel__name="jit_sharding",
    )
    assert summary["model/context"] == 32 and summary["train/tokens_per_example"] == 32
    assert cli.main([str(tmp_path / "run"), "--hardware", "h100_sxm", "--mfu", "0.4", "--devices", "8,64"]) == 0
    rows = _csv(tmp_path / "run" / "projection.csv")  # written into the run folder
    assert [r["config"] for r in rows] == ["jit_sharding fp32 gpt batch/device=2 context=32"] * 2
    for row in rows:
        assert float(row["tokens_per_s"]) == float(row["examples_per_s"]) * 32
        assert float(row["flops_per_token"]) == pytest.approx(summary["perf/flops_per_token"], rel=1e-12)
    assert float(rows[0]["payload_bytes"]) == summary["comm/payload_bytes_per_step"]
    assert "tokens/s" in capsys.readouterr().out
    # another T than the run's context is refused in one line, and the projection written above is kept
    before = (tmp_path / "run" / "projection.csv").read_text()
    args = [str(tmp_path / "run"), "--hardware", "h100_sxm", "--mfu", "0.4", "--tokens-per-example", "999"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tokens-per-example 999 does not match" in err and "context is 32" in err
    assert (tmp_path / "run" / "projection.csv").read_text() == before


@pytest.mark.unit
def test_a_checkpoint_folder_names_the_run_folder_to_pass(tmp_path):
    """sweeps.project given a run's checkpoint folder or one step of it: the kind it got and the run folder."""
    from utils import fake_sweep

    run = fake_sweep(tmp_path / "sweep", jobs=1) / "0"
    for given, kind in (
        (run / "checkpoints", "a run's checkpoint folder"),
        (run / "checkpoints" / "4", "a checkpoint step of a run"),
    ):
        with pytest.raises(cli.ProjectionError) as e:
            cli.load_summaries(given)
        assert str(e.value) == f"{given} is {kind}, not a run or sweep folder; pass the run folder {run}"
    assert [s["_job_dir"] for s in cli.load_summaries(run)] == [str(run)]
    (run / "summary.json").write_text('{"status": "ok", "train/lo')  # cut short: named, not skipped unseen
    with pytest.raises(cli.ProjectionError) as e:
        cli.load_summaries(run)
    assert str(e.value) == (
        f"no finished run (summary.json with status ok) below {run}: {run / 'summary.json'} (JSONDecodeError)"
    )


@pytest.mark.unit
def test_the_advice_for_one_device_jobs_is_a_command_that_works(tmp_path, capsys):
    """Only 1-device jobs: the line said "or give --params", which alone is refused (three more errors before a
    working command); it now gives the whole command with the run's parameters, batch and FLOPs, which runs."""
    import shlex

    root = _strong_sweep(tmp_path / "one", modes=("pmap",), devices=(1,))
    summary = json.loads((root / "0" / "summary.json").read_text())
    (root / "0" / "summary.json").write_text(json.dumps({**summary, "model/param_count": 21984}))
    assert cli.main([str(root), "--hardware", "h100_sxm", "--devices", "8,64", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    advised = err.strip().split("instead of the folder: ", 1)[1]
    assert advised == (
        "python -m sweeps.project --params 21984 --per-device-batch 256 --flops-per-example 3.90625e+06 --mfu 0.4 "
        "--hardware h100_sxm --devices 8,64"
    )
    argv = shlex.split(advised)[3:] + ["--out", str(tmp_path / "b")]
    assert cli.main(argv) == 0
    assert len(_csv(tmp_path / "b" / "projection.csv")) == 2


def test_wandb_without_an_api_key_logs_offline_to_the_jobs_project(tmp_path):
    """`sweeps.project --wandb` with no API key does what a run does: logs offline (into the output folder) and
    prints the `wandb sync` line; the run goes to the jobs' W&B project (their .hydra/config.yaml)."""
    import os

    from wandb_reader import read_run

    root = _strong_sweep(tmp_path / "sweep", modes=("jit_sharding",), devices=(1, 2))
    for job in root.iterdir():
        (job / ".hydra").mkdir()
        (job / ".hydra" / "config.yaml").write_text("wandb:\n  project: proj-z\n  entity: null\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), NETRC=str(tmp_path / "netrc"), WANDB_SILENT="true", PYTHONPATH=str(REPO))
    env.update({k: str(tmp_path / k.lower()) for k in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR")})
    out = tmp_path / "out"
    args = [str(root), *CUSTOM, "--step-time-s", "0.001", "--devices", "8,64", "--out", str(out), "--wandb"]
    res = subprocess.run(
        [sys.executable, "-m", "sweeps.project", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    assert f"W&B is offline: upload it later with: wandb sync {run_dir}" in res.stdout
    run = read_run(str(run_dir))
    assert run["run"].project == "proj-z" and run["run"].job_type == "projection"
