"""Tests of sweeps.report on synthetic multirun folders (no JAX, no network): repeats and intervals, the
scaling table, and the matplotlib figures themselves (scales, series, error bars, legend entries)."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sweeps import report
from sweeps.report import aggregate, load_summaries, write_report
from sweeps.report.aggregate import (
    MIN_REPEATS,
    log_ratio_interval,
    log_t_interval,
    throughput_interval,
    too_few_note,
)
from sweeps.report.collect import job_record
from sweeps.report.plots import (
    CPU_SUBTITLE,
    NO_TARGET_SENTENCE,
    make_figures,
    save,
)

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
EPS = {  # median examples/s per device count
    "jit_sharding": {1: 1000.0, 2: 1800.0, 4: 3000.0, 8: 4000.0},
    "fsdp": {1: 800.0, 2: 1520.0, 4: 2400.0, 8: 3200.0},
}
SPREAD = (0.9, 1.0, 1.2)  # seed s runs at SPREAD[s] x the median
PAYLOAD = 6_000_000  # gradient bytes per step


def ok_summary(mode: str, devices: int, eps: float, **extra) -> dict:
    """A successful job summary with the canonical keys of train.py."""
    gb = 256
    summary = {
        "status": "ok",
        "parallel": mode,
        "precision": "fp32",
        "model": "mlp",
        "model/param_count": 203530,
        "data": "synthetic",
        "platform": "cpu",
        "device_kind": "cpu",
        "process_count": 1,
        "mesh/devices": devices,
        "mesh/shape": [devices],
        "train/global_batch": gb,
        "train/per_device_batch": gb // devices,
        "train/accum_steps": 1,
        "train/scaling": "strong",
        "train/steps": 80,
        "train/loss": 0.5,
        "eval/loss": 0.6,
        "eval/accuracy": 0.875,
        "perf/step_time_s": gb / eps,
        "perf/examples_per_s": eps,
        "perf/examples_per_s_median": eps,
        "perf/examples_per_s_p25": 0.95 * eps,
        "perf/examples_per_s_p75": 1.05 * eps,
        "perf/examples_per_s_last_window": 1.3 * eps,
        "perf/windows_measured": 7,
        "perf/examples_per_s_per_device": eps / devices,
        "perf/wall_s": 10.0,
        "perf/startup_s": 4.0,
        "comm/payload_bytes_per_step": PAYLOAD * (2 if mode == "fsdp" else 1),
        "comm/bytes_per_step": 2 * (devices - 1) / devices * PAYLOAD,
        "comm/ratio_model": 0.1 * (devices - 1),
        "mem/state_bytes_per_device": 3 * PAYLOAD // (devices if mode == "fsdp" else 1),
        "mem/temp_bytes_per_device": 4 * 2**20 // devices,
        "parallel/grad_reduce_dtype": "fp32",
    }
    summary.update(extra)
    return summary


# a run on the device its hardware profile describes: its comm/ratio_model is shown (collect.profile_matches)
H100 = {
    "platform": "gpu",
    "device_kind": "NVIDIA H100 80GB HBM3",
    "hardware/profile": "h100_sxm",
    "hardware/matches_device": True,
    "hardware/link_bytes_per_s": 450e9,
}


def write_job(root: Path, job: int, summary: dict | None, overrides: list[str] = ()) -> Path:
    job_dir = root / str(job)
    (job_dir / ".hydra").mkdir(parents=True)
    (job_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if summary is not None:
        (job_dir / "summary.json").write_text(json.dumps(summary))
    return job_dir


def make_sweep(root: Path, fail: tuple[str, int, int] | None = None, seeds=(0, 1, 2), **extra) -> Path:
    """Jobs: jit_sharding and fsdp at 1, 2, 4, 8 devices x seeds (Hydra multirun order); ``fail`` =
    (mode, devices, seed) of a job that failed."""
    job = 0
    for mode in ("jit_sharding", "fsdp"):
        for devices in (1, 2, 4, 8):
            for seed in seeds:
                overrides = [f"mesh.devices={devices}", f"parallel={mode}", f"train.seed={seed}", "data=synthetic"]
                if fail == (mode, devices, seed):
                    summary = {"status": "failed", "error": "XlaRuntimeError: RESOURCE_EXHAUSTED:\nout of memory"}
                else:
                    summary = ok_summary(mode, devices, EPS[mode][devices] * SPREAD[seed % 3], **extra)
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
    """``python -m sweeps.report *args`` with this environment updated by ``env`` (a value None unsets its key)."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + ([full_env["PYTHONPATH"]] if full_env.get("PYTHONPATH") else [])
    )
    full_env.update(env or {})
    for key in [k for k, v in full_env.items() if v is None]:  # env={"X": None}: X unset
        del full_env[key]
    return subprocess.run(
        [sys.executable, "-m", "sweeps.report", *args],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def rows_of(root: Path) -> list[dict]:
    return aggregate([job_record(s) for s in load_summaries(root)])


def legend_texts(ax_or_fig) -> list[str]:
    legend = ax_or_fig.get_legend() if hasattr(ax_or_fig, "get_legend") else ax_or_fig.legends[0]
    return [t.get_text() for t in legend.get_texts()]


# ---- table ------------------------------------------------------------------------------------------------


T_975_DF2, T_975_DF4 = 4.302652729749462, 2.7764451051977987  # Student's t quantiles (tables)


def spread_interval(values: list[float]) -> tuple[float, float, float]:
    """(geometric mean, low, high) of 3 values by the textbook formula: exp(mean(log x) -/+ t(0.975, 2) s / sqrt 3)."""
    logs = [math.log(v) for v in values]
    mean = sum(logs) / 3
    s = math.sqrt(sum((x - mean) ** 2 for x in logs) / 2)
    half = T_975_DF2 * s / math.sqrt(3)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


@pytest.mark.unit
def test_repeats_aggregate_to_one_row_with_a_t_interval_on_the_log_scale(tmp_path):
    """3 seeds per configuration: one row each, the geometric mean of the jobs' medians with a 95% t-interval on
    the log scale; the speedup is a ratio of geometric means with Welch's interval; the 1-device reference of each
    series has speedup and efficiency 1 and no interval against itself."""
    root = make_sweep(tmp_path / "multirun" / "12-00-00")
    paths = write_report(root)
    # no target was set: no time_to_target.png (an empty figure), a sentence in scaling.md instead
    assert {"csv", "jobs_csv", "md", "throughput", "speedup", "efficiency", "comm", "memory"} == set(paths)
    assert not (root / "time_to_target.png").exists()
    rows = read_csv(paths["csv"])
    assert len(rows) == 8 and len(read_csv(paths["jobs_csv"])) == 24
    for column in (
        "devices",
        "parallel",
        "precision",
        "accum_steps",
        "scaling",
        "global_batch",
        "repeats",
        "examples_per_s",
        "examples_per_s_ci_low",
        "examples_per_s_ci_high",
        "speedup",
        "speedup_ci_low",
        "speedup_ci_high",
        "efficiency",
        "time_to_target_s",
        "steps_to_target",
        "comm_payload_bytes",
        "comm_ring_bytes",
        "state_bytes_per_device",
    ):
        assert column in rows[0], column
    assert [(r["parallel"], r["devices"]) for r in rows] == [
        (m, str(d)) for m in ("fsdp", "jit_sharding") for d in (1, 2, 4, 8)
    ]
    centre, low, high = spread_interval(list(SPREAD))  # 1.0262, [0.7398, 1.4236] x the configuration's figure
    # Welch: both sides have the same spread s, so df = 4 and the half width is t(0.975, 4) s sqrt(2 / 3)
    logs = [math.log(f) for f in SPREAD]
    s_log = math.sqrt(sum((x - sum(logs) / 3) ** 2 for x in logs) / 2)
    half = T_975_DF4 * s_log * math.sqrt(2 / 3)
    by = {(r["parallel"], int(r["devices"])): r for r in rows}
    for mode in EPS:
        for devices, eps in EPS[mode].items():
            r = by[(mode, devices)]
            assert (r["repeats"], r["failed"], r["interval"]) == ("3", "0", "t95")
            assert float(r["examples_per_s"]) == pytest.approx(centre * eps, rel=1e-12)
            assert float(r["examples_per_s_ci_low"]) == pytest.approx(low * eps, rel=1e-12)
            assert float(r["examples_per_s_ci_high"]) == pytest.approx(high * eps, rel=1e-12)
            ratio = eps / EPS[mode][1]
            assert float(r["speedup"]) == pytest.approx(ratio, rel=1e-12)
            assert float(r["efficiency"]) == pytest.approx(ratio / devices, rel=1e-12)
            if devices == 1:  # the reference: no interval against itself
                assert (r["speedup"], r["speedup_ci_low"], r["efficiency_ci_high"]) == ("1", "", "")
                continue
            assert float(r["speedup_ci_low"]) == pytest.approx(ratio * math.exp(-half), rel=1e-12)
            assert float(r["speedup_ci_high"]) == pytest.approx(ratio * math.exp(half), rel=1e-12)
            assert float(r["efficiency_ci_high"]) == pytest.approx(ratio * math.exp(half) / devices, rel=1e-12)
    r = by[("fsdp", 8)]
    assert r["comm_payload_bytes"] == str(2 * PAYLOAD) and r["comm_ring_bytes"] == str(int(1.75 * PAYLOAD))
    assert r["state_bytes_per_device"] == str(3 * PAYLOAD // 8) and r["eval_accuracy"] == "0.875"
    assert r["time_to_target_s"] == "" and r["few_windows"] == "0" and r["windows_measured_min"] == "7"
    assert r["comm_ratio"] == ""  # a CPU run's ratio of a link model to its step time is not shown
    md = paths["md"].read_text()
    assert md.startswith("# Scaling report") and "24 ok, 0 failed; 8 configuration(s)" in md
    assert "CPU-simulated" in md and "do NOT predict" in md
    assert "| examples/s [95% interval] |" in md and "| speedup [95% interval] |" in md and "| comm ratio |" not in md
    # 1,000 x 1.026 [0.7147, 1.473] (s = 0.1456, t(0.975, 2) = 4.303); speedup 1.8 x exp(+/- 0.330)
    # speedup and efficiency (with its interval, the speedup's / devices) to 3 significant digits, zeros kept
    assert (
        "| jit_sharding | fp32 | 1 | strong | 2 | 256 | 3 | 1,847 [1,286, 2,651] | 1.80 [1.29, 2.50] "
        "| 0.900 [0.647, 1.25] |" in md
    )
    assert "| jit_sharding | fp32 | 1 | strong | 1 | 256 | 3 | 1,026 [714.7, 1,473] | 1.00 | 1.00 |" in md
    assert "| efficiency [95% interval] |" in md
    assert "Model and data: mlp (203,530 parameters) on synthetic data (random labels: chance accuracy)" in md
    captions = {c.split(".png).* ")[0].split("(")[-1]: c for c in md.splitlines() if c.startswith("*Figure")}
    setup = (
        " Setup: mlp (203,530 parameters) on synthetic data (random labels: chance accuracy); fp32, global batch 256 "
        "(strong scaling), gradients reduced in fp32."
    )
    for name, caption in captions.items():  # the setup once, at the end; no settings repeated
        assert caption.endswith(setup) and caption.count("global batch 256") == 1 and "Settings" not in caption
    assert (
        "bars: the speedup's Welch 95% interval (as in speedup.png) divided by the device count"
        in (captions["efficiency"])
    )
    assert "log scale" not in captions["efficiency"] and "linear y axis" in captions["efficiency"]
    assert "the y axis is log scale" in captions["speedup"]
    assert "dotted: linear scaling from 1 device" in captions["throughput"]
    for i, name in enumerate(("throughput", "speedup", "efficiency", "comm", "memory"), start=1):
        assert paths[name] == root / f"{name}.png" and f"![{name}]({name}.png)" in md
        assert f"*Figure {i} ({name}.png).* " in md
        assert_png(paths[name])
    assert "time_to_target.png" not in md and NO_TARGET_SENTENCE in md
    assert "| config |" not in md and "| time to target (s) |" not in md  # blank in every row
    assert "Overrides every job shares: `data=synthetic`" in md  # the command's fragments: here, not in titles


@pytest.mark.unit
def test_throughput_interval_formula_and_too_few_repeats():
    """5 repeats: the t-interval of mean(log x) with 4 degrees of freedom, by hand; fewer than 3: the geometric
    mean and no interval; none: nothing."""
    values = [100.0, 90.0, 130.0, 110.0, 95.0]
    centre, low, high, kind = throughput_interval(values)
    logs = [math.log(v) for v in values]
    mean = sum(logs) / 5
    s = math.sqrt(sum((x - mean) ** 2 for x in logs) / 4)
    assert kind == "t95" and centre == pytest.approx(math.exp(mean), rel=1e-12)
    assert (low, high) == pytest.approx(
        (math.exp(mean - T_975_DF4 * s / math.sqrt(5)), math.exp(mean + T_975_DF4 * s / math.sqrt(5))), rel=1e-12
    )
    assert throughput_interval([3.0, 12.0]) == (pytest.approx(6.0), None, None, "none")
    assert throughput_interval([]) == (None, None, None, "none")
    assert MIN_REPEATS == 3


@pytest.mark.unit
def test_failed_repeat_and_failed_configuration(tmp_path):
    root = make_sweep(tmp_path / "mr", fail=("fsdp", 4, 2))
    write_job(root, 99, {"status": "failed", "error": "boom"}, ["mesh.devices=16", "parallel=fsdp"])
    rows = read_csv(write_report(root, tmp_path / "out")["csv"])
    by = {(r["parallel"], r["devices"]): r for r in rows}
    r = by[("fsdp", "4")]
    assert (r["repeats"], r["failed"]) == ("2", "1") and r["status"].startswith("ok (1 failed: failed: XlaRuntime")
    assert float(r["examples_per_s"]) == pytest.approx(math.sqrt(0.9 * 1.0) * EPS["fsdp"][4])  # geometric mean
    assert (r["interval"], r["examples_per_s_ci_low"], r["speedup_ci_low"]) == ("none", "", "")  # 2 repeats: none
    r = by[("fsdp", "16")]
    assert (r["repeats"], r["examples_per_s"], r["speedup"], r["status"]) == ("0", "", "", "failed: boom")


@pytest.mark.unit
def test_missing_one_device_configuration_leaves_speedup_blank(tmp_path):
    root = tmp_path / "mr"
    for i, d in enumerate((2, 4)):
        write_job(root, i, ok_summary("fsdp", d, 100.0 * d), [f"mesh.devices={d}"])
    rows = rows_of(root)
    assert [r["speedup"] for r in rows] == [None, None] and [r["efficiency"] for r in rows] == [None, None]


@pytest.mark.unit
def test_weak_and_strong_scaling_are_separate_series():
    summaries = []
    for d, eps in ((1, 100.0), (2, 150.0), (4, 200.0)):
        summaries.append(ok_summary("fsdp", d, eps, **{"train/global_batch": 128, "train/per_device_batch": 128 // d}))
    for d, eps in ((1, 40.0), (2, 76.0), (4, 140.0)):
        summaries.append(
            ok_summary(
                "fsdp", d, eps, **{"train/scaling": "weak", "train/global_batch": 32 * d, "train/per_device_batch": 32}
            )
        )
    rows = aggregate([job_record(s) for s in summaries])
    got = {(r["scaling"], r["devices"]): (r["speedup"], r["efficiency"]) for r in rows}
    assert got[("strong", 2)] == pytest.approx((1.5, 0.75)) and got[("strong", 4)] == pytest.approx((2.0, 0.5))
    assert got[("weak", 2)] == pytest.approx((1.9, 0.95)) and got[("weak", 4)] == pytest.approx((3.5, 0.875))


@pytest.mark.unit
def test_other_overrides_split_configurations_and_seed_does_not(tmp_path):
    """Jobs differing only in train.seed are repeats; any other override makes another configuration."""
    root = tmp_path / "mr"
    job = 0
    for scaling in ("none", "linear"):
        for seed in (0, 1):
            write_job(
                root,
                job,
                ok_summary("jit_sharding", 1, 10.0 + seed, **{"train/global_batch": 512}),
                ["+sweep=large_batch", f"optim.lr_scaling={scaling}", f"train.seed={seed}"],
            )
            job += 1
    rows = rows_of(root)
    assert [(r["config"], r["repeats"], r["examples_per_s"]) for r in rows] == [
        ("optim.lr_scaling=linear", 2, pytest.approx(math.sqrt(10.0 * 11.0))),
        ("optim.lr_scaling=none", 2, pytest.approx(math.sqrt(10.0 * 11.0))),
    ]


@pytest.mark.unit
def test_few_windows_are_flagged(tmp_path):
    root = make_sweep(tmp_path / "mr", seeds=(0,), **{"perf/windows_measured": 2})
    paths = write_report(root)
    rows = read_csv(paths["csv"])
    assert all(r["few_windows"] == "1" and r["windows_measured_min"] == "2" for r in rows)
    md = paths["md"].read_text()
    assert "8 configuration(s) have repeats with fewer than 5 measured logging windows" in md
    assert md.count(" * |") == 8


@pytest.mark.unit
def test_time_to_target_median_counts_never_reached_as_infinite():
    base = {"train/target_accuracy": 0.9}
    jobs = [
        ok_summary("fsdp", 1, 10.0, **base, **{"train/steps_to_target": s, "perf/time_to_target_s": t})
        for s, t in ((100, 5.0), (200, 9.0), (None, None))
    ]
    (row,) = aggregate([job_record(dict(j, _overrides=[f"train.seed={i}"])) for i, j in enumerate(jobs)])
    assert (row["steps_to_target"], row["time_to_target_s"], row["target_reached"]) == (200, 9.0, "2/3")
    jobs[1]["train/steps_to_target"] = jobs[1]["perf/time_to_target_s"] = None
    (row,) = aggregate([job_record(dict(j, _overrides=[f"train.seed={i}"])) for i, j in enumerate(jobs)])
    assert (row["steps_to_target"], row["time_to_target_s"], row["target_reached"]) == (None, None, "1/3")


@pytest.mark.unit
def test_gpu_platform_has_no_cpu_warning(tmp_path):
    root = tmp_path / "mr"
    for i, d in enumerate((1, 2)):
        write_job(
            root,
            i,
            ok_summary("jit_sharding", d, 10.0 * d, platform="gpu", device_kind="NVIDIA H100 80GB HBM3"),
            [f"mesh.devices={d}"],
        )
    paths = write_report(root, tmp_path / "out")
    md = paths["md"].read_text()
    assert "Platform(s): gpu" in md and "NVIDIA H100 80GB HBM3" in md and "WARNING" not in md
    figs = make_figures(rows_of(root))
    assert CPU_SUBTITLE not in figs["throughput"]._suptitle.get_text()


@pytest.mark.unit
def test_load_summaries_skips_output_and_wandb_dirs(tmp_path):
    root = make_sweep(tmp_path / "mr", seeds=(0,))
    stray = root / "0" / "wandb" / "offline-run-x" / "files"
    stray.mkdir(parents=True)
    (stray / "summary.json").write_text(json.dumps(ok_summary("fsdp", 1, 1.0)))
    out = root / "report"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps(ok_summary("fsdp", 1, 1.0)))
    summaries = load_summaries(root, exclude=[out])
    assert [s["_job"] for s in summaries] == [str(i) for i in range(8)]
    assert len(read_csv(write_report(root, out)["jobs_csv"])) == 8


# ---- figures ----------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_throughput_figure_log_log_error_bars_ideal_and_projection(tmp_path):
    rows = rows_of(make_sweep(tmp_path / "mr"))
    fig = make_figures(rows)["throughput"]
    (ax,) = fig.axes
    assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log")
    assert ax.get_xlabel() == "devices" and ax.get_ylabel() == "examples/s (global)"
    assert len(ax.containers) == 2  # one error-bar container per series
    fsdp = ax.containers[0]
    g = spread_interval(list(SPREAD))[0]  # every configuration: the geometric mean of its 3 repeats
    assert list(fsdp.lines[0].get_ydata()) == pytest.approx([g * EPS["fsdp"][d] for d in (1, 2, 4, 8)], rel=1e-12)
    # the two series' bars stand side by side around each device count (0.06 octave apart), not on top of each other
    xs = [list(c.lines[0].get_xdata()) for c in ax.containers]
    assert xs == [
        pytest.approx([d * 2**-0.03 for d in (1, 2, 4, 8)]),
        pytest.approx([d * 2**0.03 for d in (1, 2, 4, 8)]),
    ]
    assert legend_texts(ax) == ["fsdp", "jit_sharding", "ideal (linear from 1 device)"]
    ideal = [line for line in ax.get_lines() if line.get_gid() == "ideal"]
    assert len(ideal) == 2
    got = [y for line in sorted(ideal, key=lambda line: line.get_ydata()[0]) for y in line.get_ydata()]
    assert got == pytest.approx([g * EPS[m][1] * d for m in ("fsdp", "jit_sharding") for d in (1, 2, 4, 8)])
    assert CPU_SUBTITLE in fig._suptitle.get_text()
    assert "data=synthetic" not in fig._suptitle.get_text()  # command-line fragments stay in scaling.md


@pytest.mark.unit
def test_speedup_and_efficiency_figures(tmp_path):
    figs = make_figures(rows_of(make_sweep(tmp_path / "mr")))
    (ax,) = figs["speedup"].axes
    assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log") and len(ax.containers) == 2
    assert ax.get_ylabel() == "speedup vs 1 device (log scale)"  # plain ticks on a log axis: the label says so
    assert [t.get_text() for t in ax.get_yticklabels()] == ["1", "2", "4", "8"]  # plain decimals, not 2^k
    (diag,) = [line for line in ax.get_lines() if line.get_label() == "ideal (y = x)"]
    assert list(diag.get_xdata()) == list(diag.get_ydata()) == [1, 2, 4, 8]
    assert legend_texts(ax) == ["fsdp", "jit_sharding", "ideal (y = x)"]
    (ax,) = figs["efficiency"].axes
    # fsdp's 2-device interval reaches 0.95 x exp(0.330) = 1.321 (Welch, df 4): the axis goes to 1.05 x that (not
    # clipped at 1.1); the 1-device references have no bar
    assert ax.get_ylim() == pytest.approx((0.0, 1.39)) and ax.get_yscale() == "linear" and len(ax.containers) == 2
    assert ax.get_title() == ""
    (one,) = [line for line in ax.get_lines() if line.get_label() == "ideal (1.0)"]
    assert list(one.get_ydata()) == [1.0, 1.0]
    assert list(ax.containers[1].lines[0].get_ydata()) == pytest.approx([1.0, 0.9, 0.75, 0.5])


@pytest.mark.unit
def test_the_reference_carries_no_interval_against_itself(tmp_path):
    """A noisy 1-device series (0.68-1.46 x its figure: a min-max "efficiency interval" of 0.47-2.15 once widened
    every other bar): the 1-device row is the reference of its series, speedup and efficiency exactly 1 without a
    bar; its noise enters the other rows' speedup intervals (Welch) once, where it belongs."""
    root = make_sweep(tmp_path / "mr")
    for job, factor in ((0, 0.68), (2, 1.46)):  # jit_sharding, 1 device, seeds 0 and 2
        (root / str(job) / "summary.json").write_text(json.dumps(ok_summary("jit_sharding", 1, 1000.0 * factor)))
    rows = rows_of(root)
    (one,) = [r for r in rows if r["parallel"] == "jit_sharding" and r["devices"] == 1]
    assert (one["speedup"], one["efficiency"]) == (1.0, 1.0)
    assert [one[k] for k in ("speedup_ci_low", "speedup_ci_high", "efficiency_ci_low", "efficiency_ci_high")] == [
        None
    ] * 4
    assert one["examples_per_s_ci_low"] < 0.68 * 1000 < 1.46 * 1000 < one["examples_per_s_ci_high"]  # its own noise
    (two,) = [r for r in rows if r["parallel"] == "jit_sharding" and r["devices"] == 2]
    values = [1800.0 * f for f in SPREAD]
    _, low, high = (float(x) for x in log_ratio_interval(values, [680.0, 1000.0, 1460.0]))
    assert (two["speedup_ci_low"], two["speedup_ci_high"]) == pytest.approx((low, high), rel=1e-12)
    (ax,) = make_figures(rows)["efficiency"].axes
    eff = ax.containers[1]  # jit_sharding
    assert eff.lines[0].get_ydata()[0] == 1.0
    (bars,) = eff.lines[2]  # the error-bar segments: none of positive length at 1 device
    at_one = [seg for seg in bars.get_segments() if abs(math.log2(seg[0][0])) < 0.1]
    assert len(at_one) == 1 and at_one[0][0][1] == at_one[0][1][1] == 1.0  # a bar of no length
    assert ax.get_ylim()[1] >= max(r["efficiency_ci_high"] for r in rows if r["efficiency_ci_high"] is not None)


@pytest.mark.unit
def test_comm_figure_distinct_styles_and_one_hardware_per_ratio(tmp_path):
    """Bytes panels always; a comm-ratio panel only where the profile describes the device that ran (an H100 job
    with hardware=h100_sxm), never for CPU jobs whose summaries hold an H100 link model over a CPU step time (the
    mix older runs wrote); the title carries no tip (scaling.md's note says how to get a ratio)."""
    rows = rows_of(make_sweep(tmp_path / "mr", seeds=(0,), **{"hardware/profile": "h100_sxm"}))
    assert all(r["comm_ratio"] is None for r in rows)  # comm/ratio_model=0.1 x (devices - 1) in each CPU summary
    fig = make_figures(rows)["comm"]
    payload, ring = fig.axes
    title = fig._suptitle.get_text()
    assert title.splitlines() == [
        "Communication per optimizer step vs devices",
        "mlp (203,530 parameters) on synthetic data (random labels: chance accuracy)",  # broken at "; " only
        "fp32, global batch 256 (strong scaling), gradients reduced in fp32",
    ]
    # one unit in both byte panels (payload 5.72 MiB, ring up to 10 MiB: both in MiB, never KiB beside MiB)
    units = {t.get_text().split()[-1] for ax in (payload, ring) for t in ax.get_yticklabels() if t.get_text() != "0"}
    assert units == {"MiB"}, units
    assert CPU_SUBTITLE not in title  # bytes are exact anywhere
    assert payload.get_ylabel() == "payload / step" and "ring model" in ring.get_ylabel()
    lines = ring.get_lines()
    assert len(lines) == 2 and list(lines[0].get_ydata()) == list(lines[1].get_ydata())  # equal bytes ...
    assert lines[0].get_marker() != lines[1].get_marker()  # ... stay visible
    assert lines[0].get_linestyle() != lines[1].get_linestyle()
    assert [list(line.get_ydata()) for line in payload.get_lines()] == [[2 * PAYLOAD] * 4, [PAYLOAD] * 4]
    assert legend_texts(fig) == ["fsdp", "jit_sharding"]
    paths = write_report(tmp_path / "mr", tmp_path / "out")
    md = paths["md"].read_text()
    assert "No comm ratio: hardware=h100_sxm describes another device than the one that ran (cpu)" in md
    assert "python -m sweeps.project <sweep folder> --hardware h100_sxm --mfu 0.4" in md
    # an H100 run under its own profile: the ratio is shown, named by its profile
    with_link = make_figures(rows_of(make_sweep(tmp_path / "mr2", seeds=(0,), **H100)))["comm"]
    ratio = with_link.axes[2]
    assert ratio.get_title().startswith("comm ratio (model, h100_sxm)") and len(ratio.get_lines()) == 2
    assert [list(line.get_ydata()) for line in ratio.get_lines()][1] == pytest.approx([0.0, 0.1, 0.3, 0.7])
    # an older summary without hardware/matches_device: the profile is compared with the device kind
    old = ok_summary("jit_sharding", 2, 10.0, **{"hardware/profile": "h100_sxm"})
    assert job_record(old)["comm_ratio"] is None
    assert job_record(dict(old, **{**H100, "hardware/matches_device": None}))["comm_ratio"] == pytest.approx(0.1)
    a100 = dict(old, platform="gpu", device_kind="NVIDIA A100-SXM4-80GB")
    assert job_record(a100)["comm_ratio"] is None  # an A100 under the H100 profile


@pytest.mark.unit
def test_coinciding_series_in_comm_stay_visible(tmp_path):
    """pmap, jit_sharding and shard_map send the same bytes: their points are drawn side by side around each device
    count (values unchanged, in legend order, within a third of an octave), the panels' titles say so, and a
    series that coincides with none (fsdp's payload) keeps its x."""
    from sweeps.report.plots import SIDE_BY_SIDE, dodged_x

    root = tmp_path / "mr"
    job = 0
    for mode in ("pmap", "jit_sharding", "shard_map", "fsdp"):
        for d in (1, 2, 4, 8):
            write_job(root, job, ok_summary(mode, d, 100.0 * d, **H100), [f"mesh.devices={d}", f"parallel={mode}"])
            job += 1
    payload, ring, ratio = make_figures(rows_of(root))["comm"].axes
    assert legend_texts(payload.figure) == ["fsdp", "jit_sharding", "pmap", "shard_map"]
    fsdp, *same = payload.get_lines()
    assert list(fsdp.get_xdata()) == [1, 2, 4, 8] and fsdp.get_gid() is None
    assert [list(line.get_ydata()) for line in same] == [[PAYLOAD] * 4] * 3
    for i, d in enumerate((1, 2, 4, 8)):
        xs = [line.get_xdata()[i] for line in same]
        assert xs == sorted(xs) and len(set(xs)) == 3 and d / 2**0.34 < xs[0] < d < xs[2] < d * 2**0.34
        assert xs[1] == pytest.approx(d)
    assert all(line.get_gid() == "dodged" for line in same)
    for ax in (ring, ratio):  # here fsdp's values are equal too: four side by side
        xs = [line.get_xdata()[3] for line in ax.get_lines()]
        assert len(set(xs)) == 4 and xs == sorted(xs)
        assert len({tuple(line.get_ydata()) for line in ax.get_lines()}) == 1
    assert all(ax.get_title().endswith(f"({SIDE_BY_SIDE})") for ax in (payload, ring, ratio))
    # the rule itself: values within 1% of the largest coincide; the spread never exceeds 0.6 octave
    assert dodged_x([[(2, 100.0)], [(2, 50.0)]], 4.0) == ([[2.0], [2.0]], [False, False])
    ((a,), (b,)), shared = dodged_x([[(2, 100.0)], [(2, 99.5)]], 4.0)
    assert (a, b) == pytest.approx((2 * 2**-0.05, 2 * 2**0.05)) and shared == [True, True]
    many = [x for (x,) in dodged_x([[(8, 1.0)]] * 20, 40.0)[0]]
    assert many == sorted(many) and many[0] == pytest.approx(8 * 2**-0.3) and many[-1] == pytest.approx(8 * 2**0.3)


@pytest.mark.unit
def test_memory_and_time_to_target_figures(tmp_path):
    figs = make_figures(rows_of(make_sweep(tmp_path / "mr", seeds=(0,))))
    (ax,) = figs["memory"].axes
    fsdp, jit = ax.get_lines()
    assert list(fsdp.get_ydata()) == [3 * PAYLOAD // d for d in (1, 2, 4, 8)] and ax.get_xscale() == "log"
    assert legend_texts(figs["memory"]) == ["fsdp", "jit_sharding"]  # below the panel: flat lines stay visible
    # the title says what is plotted (not the working memory: activations are not in these bytes)
    assert figs["memory"]._suptitle.get_text().startswith("Parameters + optimizer state per device vs devices\n")
    assert "time_to_target" not in figs  # no target: no empty figure
    target = {"train/target_accuracy": 0.9, "train/steps_to_target": 100, "perf/time_to_target_s": 5.0}
    (ax,) = make_figures(rows_of(make_sweep(tmp_path / "mr2", seeds=(0,), **target)))["time_to_target"].axes
    assert len(ax.get_lines()) == 2 and list(ax.get_lines()[0].get_ydata()) == [5.0] * 4


@pytest.mark.unit
def test_batch_figure_per_recipe(tmp_path):
    root = tmp_path / "mr"
    job = 0
    for scaling in ("none", "linear"):
        for batch in (256, 512, 1024):
            write_job(
                root,
                job,
                ok_summary(
                    "jit_sharding",
                    1,
                    10.0,
                    **{
                        "train/global_batch": batch,
                        "eval/accuracy": 0.9 if scaling == "none" else 0.95,
                        "train/target_accuracy": 0.9,
                        "train/steps_to_target": 10,
                        "perf/time_to_target_s": 2.0,
                    },
                ),
                [f"optim.lr_scaling={scaling}", f"train.global_batch={batch}"],
            )
            job += 1
    fig = make_figures(rows_of(root))["batch"]
    acc, ttt = fig.axes
    assert acc.get_xscale() == "log" and len(acc.containers) == 2 and len(ttt.get_lines()) == 2
    assert legend_texts(fig) == ["optim.lr_scaling=linear", "optim.lr_scaling=none"]  # sorted configurations
    assert list(acc.containers[1].lines[0].get_xdata()) == [256, 512, 1024]
    assert list(acc.containers[1].lines[0].get_ydata()) == [0.9] * 3


# ---- CLI and W&B ------------------------------------------------------------------------------------------


@pytest.mark.unit
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
    root = make_sweep(tmp_path / "sweep-7", fail=("fsdp", 8, 0))
    wdir = tmp_path / "wb"
    wdir.mkdir()
    env = {  # no WANDB_MODE and no API key (none in the environment, no netrc): offline, as a run does
        "HOME": str(tmp_path),
        "NETRC": str(tmp_path / "netrc"),
        "WANDB_DIR": str(wdir),
        "WANDB_CACHE_DIR": str(wdir / "cache"),
        "WANDB_CONFIG_DIR": str(wdir / "config"),
        "WANDB_DATA_DIR": str(wdir / "data"),
        "WANDB_ARTIFACT_DIR": str(wdir / "artifacts"),
        "WANDB_PROJECT": "scaling-test",
        "WANDB_SILENT": "true",
        "WANDB_API_KEY": None,
    }
    res = cli(str(root), "--out", str(tmp_path / "out"), "--wandb", env={**env, "WANDB_MODE": None})
    assert res.returncode == 0, res.stderr
    sync_files = list(wdir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(sync_files) == 1, list(wdir.rglob("*"))
    sync = sync_files[0]
    assert re.fullmatch(r"run-[a-z0-9]+\.wandb", sync.name)
    assert f"wandb_sync_file: {sync}" in res.stdout
    # the marker sweeps.dashboard reads: the report's panels have a run
    marker = json.loads((tmp_path / "out" / "wandb_report_run.json").read_text())
    assert marker["wandb_group"] == "sweep-7" and sync.name == f"run-{marker['wandb_run_id']}.wandb"
    assert f"W&B is offline: upload the report's run later with: wandb sync {sync.parent}" in res.stderr.splitlines()
    data = sync.read_bytes()
    assert len(data) > 1000
    # protobuf strings are stored verbatim in the leveldb-style log
    for needle in (b"scaling_report", b"sweep-7", b"scaling_table", b"scaling-test"):
        assert needle in data, needle
    run_dir = sync.parent
    sys.path.insert(0, str(REPO / "tests"))
    from wandb_reader import read_run

    run = read_run(str(run_dir))
    assert run["run"].run_group == "sweep-7" and run["config"]["n_configurations"] == 8
    points = {h["scaling/devices"]: h for h in run["history"] if "scaling/devices" in h}
    assert sorted(points) == [1, 2, 4, 8]
    centre, low, _ = spread_interval(list(SPREAD))
    assert points[2]["scaling/examples_per_s/jit_sharding"] == pytest.approx(centre * EPS["jit_sharding"][2])
    assert points[2]["scaling/examples_per_s_ci_low/jit_sharding"] == pytest.approx(low * EPS["jit_sharding"][2])
    assert points[4]["scaling/speedup/fsdp"] == pytest.approx(3.0)
    images = {k.split("/")[1] for h in run["history"] for k in h if k.startswith("plots/") and k.endswith("/_type")}
    assert images == {"throughput", "speedup", "efficiency", "comm", "memory"}
    assert list(run_dir.rglob("*.png")), "wandb.Image media not written"
    assert list(run_dir.rglob("scaling_table*.table.json")), "wandb.Table not written"


# ---- readable figures: projection apart from measurements, human units, nothing clipped, no empty figure ----


def _projection_rows() -> list[dict]:
    """Projected rows as `read_projection` returns them, far above the measured examples/s (like an H100 model)."""
    return [
        {
            "label": f"{mode} fp32 mlp batch/device=32",
            "devices": d,
            "examples_per_s": scale * d,
            "efficiency": 0.9,
            "comm_ratio": 0.1,
            "below_step_floor": False,
            "hardware": "h100_sxm",
            "assumed_mfu": 0.4,
            "assumed_step_time_s": None,
            "per_device_batch": 32.0,
        }
        for mode, scale in (("fsdp", 1e6), ("jit_sharding", 4e6))
        for d in (8, 64, 512)
    ]


@pytest.mark.unit
def test_projection_is_its_own_panel_in_the_mode_colours(tmp_path):
    """`sweeps.report --projection`: measured (solid, left) and projected (dashed, right, own y axis) are told
    apart at a glance; each mode keeps one colour and marker in both; the measured y axis holds only the
    measured points; the legends name the modes once each (no 11-entry legend)."""
    rows = rows_of(make_sweep(tmp_path / "mr"))
    fig = make_figures(rows, projection_rows=_projection_rows())["throughput"]
    measured, projected = fig.axes
    # each panel names its regime; the projected one its hardware and assumed MFU
    assert measured.get_title().replace("\n", " ") == (
        "measured on devices simulated on one CPU (not accelerator timings): fp32, global batch 256 (strong "
        "scaling), gradients reduced in fp32"
    )
    assert projected.get_title().replace("\n", " ") == (
        "projected for h100_sxm at MFU 0.4 (a model): weak scaling, 32 examples per device (the per-device batch "
        "of the sweep's largest job)"
    )
    # the figure's title holds only what both panels share: no regime, no CPU label spanning the projection
    assert fig._suptitle.get_text().splitlines() == [
        "Throughput (examples/s) vs devices",
        "mlp (203,530 parameters) on synthetic data (random labels: chance accuracy)",
    ]
    assert legend_texts(measured) == ["fsdp", "jit_sharding", "ideal (linear from 1 device)"]
    assert legend_texts(projected) == ["fsdp fp32 mlp batch/device=32", "jit_sharding fp32 mlp batch/device=32"]
    colour = {}
    for container, mode in zip(measured.containers, ("fsdp", "jit_sharding")):
        line = container.lines[0]
        assert line.get_linestyle() == "-"
        colour[mode] = (line.get_color(), line.get_marker())
    assert colour["fsdp"] != colour["jit_sharding"]
    lines = [line for line in projected.get_lines() if line.get_gid() == "projection"]
    assert [(line.get_color(), line.get_marker()) for line in lines] == [colour["fsdp"], colour["jit_sharding"]]
    assert {line.get_linestyle() for line in lines} == {"--"}
    assert list(lines[1].get_ydata()) == [4e6 * d for d in (8, 64, 512)]
    low, high = measured.get_ylim()  # measured points readable: the projection does not stretch this axis
    values = [r[k] for r in rows for k in ("examples_per_s_ci_low", "examples_per_s_ci_high")]
    assert low <= min(values) and max(values) < high < 2 * max(EPS[m][1] * 8 for m in EPS)
    assert projected.get_ylim()[1] >= 4e6 * 512 and projected.get_xlim()[1] >= 512
    png = tmp_path / "throughput.png"
    save(fig, png)
    assert_png(png)
    assert_margins_blank(png)


def assert_margins_blank(path: Path) -> None:
    """Opens the PNG: its outer 2 pixels on every side are background (no title, legend or label cut)."""
    import matplotlib.image

    img = matplotlib.image.imread(str(path))[..., :3]
    for edge in (img[:2], img[-2:], img[:, :2], img[:, -2:]):
        assert edge.min() > 0.98, (path, float(edge.min()))


def assert_inside(fig) -> None:
    """Every title, legend and axes label lies within the figure (drawn with the Agg canvas)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    width, height = fig.bbox.width, fig.bbox.height
    artists = [fig._suptitle, *fig.legends] + [a for ax in fig.axes for a in (ax.get_legend(), ax.title)]
    for artist in [a for a in artists if a is not None and a.get_visible()]:
        bb = artist.get_window_extent(renderer)
        assert bb.x0 >= 0 and bb.y0 >= 0 and bb.x1 <= width and bb.y1 <= height, (artist, bb)
    for ax in fig.axes:
        bb = ax.get_tightbbox(renderer)
        assert bb.x0 >= 0 and bb.y0 >= 0 and bb.x1 <= width and bb.y1 <= height, (ax, bb)


@pytest.mark.unit
def test_figures_use_human_units_and_clip_nothing(tmp_path):
    """Every figure: byte axes in KiB/MiB from 0 (no 1e6 offset), throughput and speedup ticks in plain decimals,
    efficiency bars above 1.1 not clipped, every title and legend inside the figure, and each PNG opened."""
    no_link = {"comm/ratio_model": None}
    root = make_sweep(tmp_path / "mr", **no_link)
    # a fast 4th 2-device repeat (1.3 x): the efficiency interval reaches above 1.1
    overrides = ["mesh.devices=2", "parallel=jit_sharding", "train.seed=9", "data=synthetic"]  # a 4th repeat
    write_job(root, 99, ok_summary("jit_sharding", 2, 2 * 1.3 * 1000.0, **no_link), overrides)
    rows = rows_of(root)
    figs = make_figures(rows)
    assert set(figs) == {"throughput", "speedup", "efficiency", "comm", "memory"}
    for name, fig in figs.items():
        assert_inside(fig)
        png = save(fig, tmp_path / f"{name}.png")
        assert_png(png)
        assert_margins_blank(png)
        for ax in fig.axes:
            assert ax.yaxis.get_offset_text().get_text() == "", (name, ax.get_ylabel())
            labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
            assert labels and not any("$" in t or "e+" in t or "^" in t for t in labels), (name, labels)
    payload, ring = figs["comm"].axes
    for ax in (payload, ring, figs["memory"].axes[0]):
        labels = [t.get_text() for t in ax.get_yticklabels()]
        assert ax.get_ylim()[0] == 0 and all(t.endswith(("KiB", "MiB")) or t == "0 MiB" for t in labels), labels
        low_point = min(min(line.get_ydata()) for line in ax.get_lines())
        assert ax.get_ylim()[0] <= low_point <= ax.get_ylim()[1]
    assert [t.get_text() for t in figs["memory"].axes[0].get_yticklabels()] == [
        "0 MiB",
        "5 MiB",
        "10 MiB",
        "15 MiB",
    ]  # 3 x 6 MB = 17.2 MiB at most
    (thr,) = figs["throughput"].axes
    assert [t.get_text() for t in thr.get_yticklabels()] == ["500", "1k", "2k", "5k", "10k"]  # fsdp's 1-device low: 572
    (eff,) = figs["efficiency"].axes
    top = max(r["efficiency_ci_high"] for r in rows if r["efficiency_ci_high"] is not None and r["devices"] > 1)
    assert 1.1 < top == pytest.approx(1.3828, abs=1e-4) and eff.get_ylim()[1] >= top  # Welch, 4 against 3 repeats


@pytest.mark.unit
def test_number_formatting_helpers():
    from sweeps.report.plots import bytes_unit, human_number, nice_log_ticks

    assert [human_number(v) for v in (0.25, 1, 3, 40_000, 1_500_000, 2e9)] == ["0.25", "1", "3", "40k", "1.5M", "2G"]
    assert nice_log_ticks(30_000, 900_000) == [50_000.0, 100_000.0, 200_000.0, 500_000.0]
    assert nice_log_ticks(0.3, 1.2) == [0.3, 0.5, 0.7, 1.0]
    assert nice_log_ticks(8e5, 3e11) == [1e6, 1e7, 1e8, 1e9, 1e10, 1e11]  # 5 decades: powers of 10 only
    assert bytes_unit(1_600_000) == (2**20, "MiB") and bytes_unit(800) == (1, "B") and bytes_unit(3 * 2**30)[1] == "GiB"


@pytest.mark.unit
def test_one_runs_folder_is_refused_not_reported(tmp_path):
    """A run folder (it holds summary.json itself) is not a sweep: one ReportError naming it, nothing written."""
    (tmp_path / "summary.json").write_text(json.dumps({"status": "failed", "error": "x"}))
    with pytest.raises(report.ReportError, match="one run's folder"):
        load_summaries(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


@pytest.mark.unit
def test_scaling_table_throughput_in_plain_decimals():
    """scaling.md's examples/s: 4 significant digits in plain decimals, never e-notation (the plots' style)."""
    from sweeps.report.tables import plain_4

    assert [plain_4(x) for x in (62270.4, 1234567.0, 12.345, 0.5)] == ["62,270", "1,235,000", "12.35", "0.5"]


# ---- a token model (model=gpt): tokens are the unit of work -------------------------------------------------
GPT_KEYS = {"model": "gpt", "model/context": 128, "train/tokens_per_example": 128}


@pytest.mark.unit
def test_tokens_per_example_is_read_for_token_models_only():
    from sweeps.report.collect import tokens_per_example

    assert tokens_per_example(ok_summary("fsdp", 8, 1.0, **GPT_KEYS)) == 128
    # no model name, but train.py's token keys: model/context with perf/tokens_per_s
    assert tokens_per_example(ok_summary("fsdp", 8, 1.0, **{"model/context": 64, "perf/tokens_per_s": 6.4})) == 64
    assert tokens_per_example(ok_summary("fsdp", 8, 1.0, model="mlp")) is None
    assert tokens_per_example(ok_summary("fsdp", 8, 1.0, **{"model/context": 64})) is None  # no token figure


def test_token_model_sweep_reports_tokens_per_s(tmp_path):
    """A GPT sweep: scaling.csv's tokens_per_s columns are exactly examples/s x 128; scaling.md and the
    throughput plot are in tokens/s; speedup and efficiency are unchanged (no unit)."""
    root = make_sweep(tmp_path / "mr", **GPT_KEYS)
    paths = write_report(root)
    rows = read_csv(paths["csv"])
    assert len(rows) == 8
    for r in rows:
        assert r["tokens_per_example"] == "128"
        for key in ("", "_ci_low", "_ci_high", "_per_device"):
            assert float(r[f"tokens_per_s{key}"]) == float(r[f"examples_per_s{key}"]) * 128, (key, r)
    by = {(r["parallel"], int(r["devices"])): r for r in rows}
    g = spread_interval(list(SPREAD))
    assert float(by[("fsdp", 8)]["tokens_per_s"]) == pytest.approx(g[0] * 3200.0 * 128, rel=1e-12)
    assert float(by[("fsdp", 8)]["tokens_per_s_per_device"]) == pytest.approx(g[0] * 3200.0 * 128 / 8, rel=1e-12)
    assert float(by[("fsdp", 8)]["speedup"]) == pytest.approx(4.0)  # 3200 / 800 in either unit
    jobs = read_csv(paths["jobs_csv"])
    assert all(float(j["tokens_per_s"]) == float(j["examples_per_s"]) * 128 for j in jobs)
    md = paths["md"].read_text()
    assert "| tokens/s [95% interval] | tokens/s per device | tokens/example | speedup [95% interval] |" in md
    assert "examples/s [95% interval]" not in md
    assert "| 420,200 [292,700, 603,300] | 52,530 | 128 |" in md  # fsdp, 8 devices: 4 significant digits
    projection = [dict(p, tokens_per_s=p["examples_per_s"] * 128) for p in _projection_rows()]
    md = write_report(root, tmp_path / "with_projection", projection_rows=projection)["md"].read_text()
    assert "| configuration | devices | tokens/s (projected) | efficiency | comm ratio (projected) |" in md
    assert "| fsdp fp32 mlp batch/device=32 | 8 | 1,024,000,000 | 0.9 | 0.1 |" in md  # 8e6 examples/s x 128
    assert "tokens/s = examples/s x tokens/example" in md
    fig = make_figures(rows_of(root))["throughput"]
    (ax,) = fig.axes
    assert ax.get_ylabel() == "tokens/s (global)" and "Throughput (tokens/s) vs devices" in fig._suptitle.get_text()
    assert list(ax.containers[0].lines[0].get_ydata()) == pytest.approx(
        [g[0] * EPS["fsdp"][d] * 128 for d in (1, 2, 4, 8)], rel=1e-12
    )
    ideal = sorted(y for line in ax.get_lines() if line.get_gid() == "ideal" for y in line.get_ydata())
    assert ideal == pytest.approx(sorted(g[0] * EPS[m][1] * 128 * d for d in (1, 2, 4, 8) for m in EPS))


def test_image_sweep_has_no_token_figures(tmp_path):
    paths = write_report(make_sweep(tmp_path / "mr", model="mlp"))
    assert all(r["tokens_per_s"] == "" and r["tokens_per_example"] == "" for r in read_csv(paths["csv"]))
    md = paths["md"].read_text()
    assert "| examples/s [95% interval] |" in md and "tokens/s" not in md
    (ax,) = make_figures(rows_of(tmp_path / "mr"))["throughput"].axes
    assert ax.get_ylabel() == "examples/s (global)"


def test_sweep_mixing_token_and_image_models_is_refused(tmp_path):
    """Throughputs in examples of an image and in windows of T tokens cannot share a table: one line naming
    both, exit 2, nothing written."""
    root = make_sweep(tmp_path / "mr", seeds=(0,), model="mlp")
    for job, devices in ((8, 1), (9, 8)):
        write_job(root, job, ok_summary("fsdp", devices, 100.0, **GPT_KEYS), ["model=gpt", f"mesh.devices={devices}"])
    write_job(root, 10, {"status": "failed", "error": "x"}, ["model=gpt"])  # its model from the overrides
    res = cli(str(root))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "error: the sweep mixes a token model (model=gpt: job 8 9 10; throughput in tokens/s) with models "
        "measured in examples/s (model=mlp: job 0 1 2 ... (8 jobs)); report them separately: move one kind's job "
        "folders into another folder and run sweeps.report on each"
    ]
    assert not (root / "scaling.csv").exists() and not (root / "scaling.md").exists()


def test_token_sweep_projection_must_be_in_tokens(tmp_path):
    root = make_sweep(tmp_path / "mr", **GPT_KEYS)
    with pytest.raises(report.ReportError, match="no tokens_per_s column"):
        write_report(root, projection_rows=_projection_rows())
    projected = [{**p, "tokens_per_s": p["examples_per_s"] * 128} for p in _projection_rows()]
    fig = make_figures(rows_of(root), projection_rows=projected)["throughput"]
    _, ax_p = fig.axes
    assert ax_p.get_ylabel() == "tokens/s (global, projected)"
    lines = [line for line in ax_p.get_lines() if line.get_gid() == "projection"]
    assert list(lines[1].get_ydata()) == [4e6 * 128 * d for d in (8, 64, 512)]


def test_cli_token_sweep_with_its_projection_csv(tmp_path):
    """The GPT commands end to end: sweeps.project --tokens-per-example writes tokens_per_s; sweeps.report
    --projection of that CSV draws it in tokens/s beside the sweep; an examples-only CSV is refused."""
    from sweeps import project

    root = make_sweep(tmp_path / "mr", **GPT_KEYS)
    proj = tmp_path / "proj"
    base = ["--params", "830208", "--per-device-batch", "8", "--hardware", "h100_sxm", "--mfu", "0.4"]
    assert project.main([*base, "--flops-per-example", "1e9", "--tokens-per-example", "128", "--out", str(proj)]) == 0
    res = cli(str(root), "--out", str(tmp_path / "out"), "--projection", str(proj / "projection.csv"))
    assert res.returncode == 0, res.stderr
    assert project.main([*base, "--flops-per-example", "1e9", "--out", str(tmp_path / "plain")]) == 0
    res = cli(str(root), "--out", str(tmp_path / "out2"), "--projection", str(tmp_path / "plain" / "projection.csv"))
    assert res.returncode == 2 and "no tokens_per_s column" in res.stderr and res.stderr.count("\n") == 1


@pytest.mark.unit
def test_a_jobs_folder_or_checkpoints_name_the_sweep_to_pass(tmp_path, capsys):
    """sweeps.report given one job of a sweep, its checkpoint folder or one step: the kind it got and the sweep
    folder that holds it (which then reports); a lone run's checkpoints: what a sweep folder looks like."""
    from sweeps.report.cli import main
    from utils import fake_sweep

    sweep = fake_sweep(tmp_path / "sweep")
    for given, kind in (
        (sweep / "0", "one run's folder (it holds summary.json or .hydra/)"),
        (sweep / "0" / "checkpoints", "a run's checkpoint folder"),
        (sweep / "0" / "checkpoints" / "4", "a checkpoint step of a run"),
    ):
        assert main([str(given)]) == 2
        assert (
            capsys.readouterr().err.strip()
            == f"error: {given} is {kind}, not a sweep; pass the sweep it belongs to: {sweep}"
        )
    (fake_sweep(tmp_path / "lone", jobs=1) / "multirun.yaml").unlink()  # one run of its own, outside a sweep
    with pytest.raises(report.ReportError) as e:
        load_summaries(tmp_path / "lone" / "0" / "checkpoints")
    assert str(e.value).endswith("not a sweep; pass a sweep folder that holds jobs (e.g. multirun/<date>/<time>)")
    assert len(load_summaries(sweep)) == 2  # the folder the line names is the one to pass


@pytest.mark.parametrize("tool", ["sweeps.report", "sweeps/project.py"])
@pytest.mark.parametrize("sig, status, said", [("SIGINT", 130, "SIGINT (Ctrl-C)"), ("SIGTERM", 143, "SIGTERM")])
def test_a_signal_stops_the_tools_with_one_line(tool, sig, status, said):
    """SIGTERM ended ``python -m sweeps.report`` with no line and Ctrl-C printed a 49-line traceback (85 for
    ``sweeps.project``): both run under ``training.process.run_tool``. The tool is held inside its argument parsing
    (patched to wait) so the signal lands in its work, whatever the machine's speed."""
    import signal

    hold = (
        "import argparse, runpy, sys, time\n"
        "def held(self, *a, **k):\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(60)\n"
        "argparse.ArgumentParser.parse_args = held\n"
        f"sys.argv = [{tool!r}]\n"
        + (
            f"runpy.run_module({tool!r}, run_name='__main__')"
            if "/" not in tool
            else f"runpy.run_path({tool!r}, run_name='__main__')"
        )
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", hold], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode in (status, -getattr(signal, sig)), err[-3000:]
    assert err.splitlines() == [f"error: interrupted by {said} and stopped (HYDRA_FULL_ERROR=1 prints where)"]


# ---- intervals that mean what they say: coverage on simulated sweeps with known truths ----------------------

TRUE_EPS = {1: 1000.0, 2: 1800.0, 4: 3000.0, 8: 4000.0}  # a configuration's true typical examples/s per device count


def simulated_sweeps(rng, n: int, sweeps: int, noise: str) -> tuple[dict[int, np.ndarray], float]:
    """``sweeps`` sweeps of ``n`` repeats per device count, ``[sweeps, n]`` examples/s each, and the factor by which
    the true typical figure (exp E log x) differs from ``TRUE_EPS``. ``lognormal``: multiplicative noise of unequal
    spread (log sd 0.05, 0.10, 0.20, 0.15 at 1, 2, 4, 8 devices: the model the intervals assume, exactly);
    ``contaminated``: log sd 0.1 and one repeat in ten 20% slower (a busy neighbour), a skewed departure from it."""
    sigma = {1: 0.05, 2: 0.10, 4: 0.20, 8: 0.15} if noise == "lognormal" else dict.fromkeys(TRUE_EPS, 0.10)
    out = {}
    for d, eps in TRUE_EPS.items():
        logs = np.log(eps) + sigma[d] * rng.standard_normal((sweeps, n))
        if noise == "contaminated":
            logs += np.where(rng.random((sweeps, n)) < 0.1, np.log(0.8), 0.0)
        out[d] = np.exp(logs)
    return out, (0.8**0.1 if noise == "contaminated" else 1.0)


@pytest.mark.unit
@pytest.mark.parametrize("noise", ["lognormal", "contaminated"])
def test_95_percent_intervals_cover_the_truth_in_90_to_99_percent_of_1000_sweeps(noise):
    """At every repeat count where the report draws an interval (3 and more; 3, 4, 5, 10 here), the stated 95%
    intervals of a configuration's examples/s and of its speedup cover the true values in 90-99% of 1,000
    simulated sweeps, with the report's own interval functions (vectorised over the sweeps)."""
    rng = np.random.default_rng(60)
    for n in (3, 4, 5, 10):
        x, factor = simulated_sweeps(rng, n, 1000, noise)
        for d in TRUE_EPS:
            _, low, high = log_t_interval(x[d])
            truth = TRUE_EPS[d] * factor
            coverage = float(np.mean((low <= truth) & (truth <= high)))
            assert 0.90 <= coverage <= 0.99, (noise, n, d, "examples/s", coverage)
            if d == 1:
                continue
            _, low, high = log_ratio_interval(x[d], x[1])
            truth = TRUE_EPS[d] / TRUE_EPS[1]
            coverage = float(np.mean((low <= truth) & (truth <= high)))
            assert 0.90 <= coverage <= 0.99, (noise, n, d, "speedup", coverage)


@pytest.mark.unit
def test_the_report_uses_those_intervals_and_says_when_repeats_are_too_few(tmp_path, capsys):
    """One simulated sweep through the report: its rows carry exactly the vectorised functions' intervals; with 1
    or 2 repeats no interval is drawn (not even a min-max one) and the report says that 3 would do, naming the
    override; 3 repeats draw them."""
    x, _ = simulated_sweeps(np.random.default_rng(1), 3, 1, "lognormal")
    summaries = [
        dict(ok_summary("jit_sharding", d, float(x[d][0, seed])), _overrides=[f"train.seed={seed}"], _job=str(i))
        for i, (d, seed) in enumerate((d, seed) for d in TRUE_EPS for seed in range(3))
    ]
    rows = aggregate([job_record(s) for s in summaries])
    for row in rows:
        d = row["devices"]
        centre, low, high = log_t_interval(x[d][0])
        assert (row["examples_per_s"], row["examples_per_s_ci_low"], row["examples_per_s_ci_high"]) == pytest.approx(
            (centre, low, high), rel=1e-12
        )
        if d > 1:
            ratio, low, high = log_ratio_interval(x[d][0], x[1][0])
            assert (row["speedup"], row["speedup_ci_low"], row["speedup_ci_high"]) == pytest.approx(
                (ratio, low, high), rel=1e-12
            )
    assert too_few_note(rows) is None
    for repeats in (1, 2):
        few = aggregate([job_record(s) for s in summaries if int(s["_overrides"][0][-1]) < repeats])
        assert all(r["interval"] == "none" and r["examples_per_s_ci_low"] is None for r in few)
        assert all(r["speedup_ci_low"] is None and r["efficiency_ci_high"] is None for r in few)
        note = too_few_note(few)
        assert note == (
            f"4 of 4 configuration(s) have {repeats} repeat(s), too few for a 95% interval (nor one for a speedup "
            "against them): 3 repeats would do (train.seed=0,1,2)"
        )
    root = make_sweep(tmp_path / "mr", seeds=(0, 1))
    assert report.main([str(root), "--out", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "note: 8 of 8 configuration(s) have 2 repeat(s), too few for a 95% interval (nor one for a speedup against "
        "them): 3 repeats would do (train.seed=0,1,2)"
    ]
    md = (tmp_path / "out" / "scaling.md").read_text()
    assert "**8 of 8 configuration(s) have 2 repeat(s), too few for a 95% interval" in md
    assert "| 1,800 |" not in md and "[" not in md.split("| status |")[1].split("\n\n")[0]  # no interval in the table


# ---- incomplete inputs: unfinished jobs named, a CSV that is no projection refused ---------------------------

MULTIRUN_YAML = """hydra:
  sweeper:
    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper
    max_batch_size: null
    params: null
  overrides:
    task:
    - mesh.devices=1,2
    - train.seed=0,1,2
"""


@pytest.mark.unit
def test_a_sweep_still_running_names_its_unfinished_jobs(tmp_path, capsys):
    """While a sweep runs: the report covers the finished jobs and names the others (running, with the process
    that holds its folder; ended without a summary; not started because the sweep was stopped; not started yet,
    from multirun.yaml); with no job finished it is one line naming them, not "no summary.json found"."""
    from tracking import run_folder

    root = tmp_path / "sweep"
    root.mkdir()
    (root / "multirun.yaml").write_text(MULTIRUN_YAML)
    running = write_job(root, 0, None, ["mesh.devices=1", "train.seed=0"])
    run_folder.claim(running)  # job 0 runs: its folder's lock is held (here by this process)
    try:
        assert report.main([str(root)]) == 2
        err = capsys.readouterr().err
        holder = run_folder.running_holder(running)
        assert holder is not None and holder.startswith("process ")
        assert err == (
            f"error: no job of {root} has finished yet (running: 0 ({holder}); not started yet: 1, 2, 3, 4, 5); "
            "run the report when some have\n"
        )
        for seed in (1, 2):
            write_job(
                root, seed, ok_summary("jit_sharding", 1, 1000.0 + seed), ["mesh.devices=1", f"train.seed={seed}"]
            )
        write_job(root, 3, None, ["mesh.devices=2", "train.seed=0"])  # ended without writing a summary
        skipped = {"status": "skipped", "error": "not started: the sweep was stopped by SIGTERM"}
        write_job(root, 4, skipped, ["mesh.devices=2", "train.seed=1"])
        assert report.main([str(root), "--out", str(tmp_path / "out")]) == 0
        err = capsys.readouterr().err.splitlines()
    finally:
        run_folder.release()
    unfinished = (
        f"running: 0 ({holder}); no summary.json (it ended without one: see its train.log): 3; "
        "not started (the sweep was stopped): 4; not started yet: 5"
    )
    assert err[0] == f"warning: unfinished jobs are not in the report: {unfinished}"
    md = (tmp_path / "out" / "scaling.md").read_text()
    assert f"**Unfinished: 4 job(s) are not in this report:** {unfinished}" in md
    assert "Jobs: 2 ok, 0 failed; 1 configuration(s)" in md  # the skipped job is not counted as failed
    assert run_folder.running_holder(running) is None  # released: no longer running


@pytest.mark.unit
def test_projection_panel_and_section_name_hardware_mfu_and_regime(tmp_path):
    """--projection: the measured (strong scaling) and projected (weak scaling, a model) panels each say what they
    hold fixed, the projected one its hardware and MFU; scaling.md has the projection's section with its modelled
    comm ratio beside the measured table, and a caption saying the panels answer different questions."""
    root = make_sweep(tmp_path / "mr")
    projection = _projection_rows()
    projection[0]["below_step_floor"] = True
    paths = write_report(root, tmp_path / "out", projection_rows=projection, projection_source="p/projection.csv")
    md = paths["md"].read_text()
    assert "## Projection (a model, not a measurement)" in md
    assert (
        "Projected for h100_sxm at MFU 0.4 (a model): weak scaling, 32 examples per device (the per-device batch of "
        "the sweep's largest job), from `p/projection.csv`" in md
    )
    assert "| fsdp fp32 mlp batch/device=32 | 8 |  |  |  |" in md  # left out by sweeps.project: blank
    assert "| jit_sharding fp32 mlp batch/device=32 | 64 | 256,000,000 | 0.9 | 0.1 |" in md
    assert "The two panels answer different questions (strong against weak scaling)." in md
    assert "Right: projected for h100_sxm at MFU 0.4 (a model): weak scaling, 32 examples per device" in md


@pytest.mark.unit
def test_byte_columns_read_in_one_unit():
    """scaling.md's two comm columns in the unit of their largest value (as comm.png's panels): 814,128 B beside
    1,221,192 B is 0.776 MiB beside 1.16 MiB, never 795 KiB beside 1.16 MiB."""
    from sweeps.report.tables import byte_unit, format_bytes

    assert byte_unit(1_221_192) == "MiB" and byte_unit(814_128) == "KiB" and byte_unit(None) == "B"
    assert format_bytes(814_128, byte_unit(1_221_192)) == "0.776 MiB"
    assert format_bytes(814_128) == "795 KiB" and format_bytes(512) == "512 B" and format_bytes(None) == ""
