"""Measurement (issue 5): exact communication bytes and state memory of the compiled step, the profiler's
measured ratio, and a training loop that makes no implicit host<->device transfer between logging windows.

Numbers for the default MLP (28*28 -> 256 -> 10, float32): 784*256 + 256 + 256*10 + 10 = 203530 parameters =
814120 bytes. Under fsdp on mesh [1, 8] the arrays with a dimension divisible by 8 are sharded (kernel 784x256
= 802816 B, bias 256 = 1024 B, kernel 256x10 = 10240 B: 814080 B) and the output bias (10 floats = 40 B)
stays replicated.
"""

from __future__ import annotations

import functools
import json
import math
import sys

import jax
import numpy as np
import pytest

from data.pipeline import TrainSource
from parallel.state import state_to_host
from training.build import build, plan
from measure.hlo_text import parse_hlo_collectives
from measure.compiled import compiled_step_metrics, state_bytes_per_device
from measure.profiler import collective_time_from_events, measured_ratio
from core.step import METRIC_SUM_BYTES
from utils import SHARED_TFDS, make_cfg, random_dataset

PARAM_BYTES = 203530 * 4  # 814120
SHARDED_BYTES = (784 * 256 + 256 + 256 * 10) * 4  # 814080: the fsdp-sharded arrays
REPLICATED_BYTES = 10 * 4  # 40: the output bias, not divisible by 8
N_SHARDED_LEAVES = 3
DP_MODES = ("pmap", "jit_sharding", "shard_map")
DATA = random_dataset(512)


@functools.lru_cache(maxsize=None)
def built(mode: str, accum_steps: int = 1, grad_norm_every=None):
    """The MLP experiment on 8 devices, global batch 256 (state placed, nothing compiled)."""
    return build(
        plan(
            make_cfg(
                {"train": {"grad_norm_every": grad_norm_every}},
                parallel__name=mode,
                data__name="synthetic",
                train__accum_steps=accum_steps,
            )
        )
    )


@functools.lru_cache(maxsize=None)
def compiled(mode: str, accum_steps: int = 1, grad_norm_every=None):
    """(experiment, compiled_step_metrics, collectives) of the MLP step on 8 devices, global batch 256."""
    exp = built(mode, accum_steps, grad_norm_every)
    p = exp.plan
    layout = exp.mode.batch_layout()
    batch = layout.place(
        TrainSource(DATA, p.global_batch, 0).local_batch(0, layout.local_rows(p.global_batch)), p.global_batch
    )
    lowered = exp.steps.train.lower(exp.state, batch)
    comp = lowered.compile()
    return exp, compiled_step_metrics(lowered, comp, 8), parse_hlo_collectives(comp.as_text(), num_devices=8)


def payload_by_kind(collectives) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in collectives:
        out[c.kind] = out.get(c.kind, 0) + c.payload_bytes
    return out


def scalar_leaf_bytes(state) -> int:
    """Bytes of the 0-d leaves of the state (step, optimizer count, loss-scale state ...): replicated."""
    return sum(np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state) if np.ndim(x) == 0)


@pytest.mark.unit
def test_mlp_sizes():
    exp = built("fsdp")
    params = state_to_host(exp.state).params
    assert sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)) == PARAM_BYTES
    assert exp.mode.sharded_and_replicated_bytes(params) == (SHARDED_BYTES, REPLICATED_BYTES)
    assert METRIC_SUM_BYTES == 8


@pytest.mark.parametrize("accum_steps", [1, 4])
@pytest.mark.parametrize("mode", DP_MODES)
def test_data_parallel_bytes_exact(mode, accum_steps):
    """One all-reduce of every gradient plus the 2 metric sums, once per step, outside any loop."""
    exp, m, collectives = compiled(mode, accum_steps)
    assert exp.mode.num_devices == 8 and exp.plan.mesh_shape == (8, 1)
    payload = PARAM_BYTES + METRIC_SUM_BYTES  # 814128
    assert m["comm/payload_bytes_per_step"] == payload
    assert m["comm/bytes_per_step"] == 2 * 7 / 8 * payload  # 1424724.0
    # the walk over the lowered module: pmap's and shard_map's psums are there; GSPMD adds jit_sharding's later
    assert m["comm/payload_bytes_per_step_lowered"] == (0 if mode == "jit_sharding" else payload)
    assert payload_by_kind(collectives) == {"all-reduce": payload}
    assert all(c.group_size == 8 for c in collectives)
    assert m["comm/in_loop_count"] == 0
    assert m["comm/count/all-gather"] == m["comm/count/reduce-scatter"] == m["comm/count/all-to-all"] == 0


@pytest.mark.unit
@pytest.mark.parametrize("accum_steps,grad_norm_every", [(1, None), (4, None), (1, 1)])
def test_fsdp_bytes_exact(accum_steps, grad_norm_every):
    """fsdp [1,8]: all-gather and reduce-scatter of the sharded arrays; all-reduce of the replicated bias and
    the 2 metric sums (48 B) and, with the gradient norm on (``train.grad_norm_every``), one float32 partial sum
    of squares per sharded gradient leaf (optax.global_norm over sharded gradients: 3 x 4 B more).

    With K microbatches each microbatch's gradient is reduce-scattered as it is produced (K reduce-scatters per
    array, no full-size gradient is accumulated), while the MLP's weights (no list of layers) are gathered once
    per step: the K microbatches' gathers are the same computation and XLA keeps one. The lowered module writes
    the (unrolled) microbatch loop's body once: the first microbatch + one body = 2 x (gather + scatter)."""
    exp, m, collectives = compiled("fsdp", accum_steps, grad_norm_every)
    assert exp.plan.mesh_shape == (1, 8)
    k = accum_steps
    by_kind = payload_by_kind(collectives)
    norm_bytes = 4 * N_SHARDED_LEAVES if grad_norm_every else 0
    all_reduce = REPLICATED_BYTES + METRIC_SUM_BYTES + norm_bytes  # 48 (60 with the norm)
    assert by_kind == {"all-gather": SHARDED_BYTES, "reduce-scatter": k * SHARDED_BYTES, "all-reduce": all_reduce}
    assert m["comm/count/all-gather"] == N_SHARDED_LEAVES
    assert m["comm/count/reduce-scatter"] == k * N_SHARDED_LEAVES
    assert m["comm/payload_bytes_per_step"] == (1 + k) * SHARDED_BYTES + all_reduce  # 1628208 (1628220); K=4: 4070448
    # the walk over the lowered module: the explicit gathers, scatters and 48 B of all-reduce (1628208); the
    # norm's partial sums over sharded gradients are added by GSPMD at compile time
    lowered_copies = min(k, 2)  # K > 1: the first microbatch and the loop body
    assert m["comm/payload_bytes_per_step_lowered"] == (
        lowered_copies * 2 * SHARDED_BYTES + REPLICATED_BYTES + METRIC_SUM_BYTES
    )
    assert m["comm/bytes_per_step"] == 7 / 8 * (1 + k) * SHARDED_BYTES + 2 * 7 / 8 * all_reduce  # 1424724.0 (K=1)
    assert m["comm/in_loop_count"] == 0  # K=4: the microbatch loop is unrolled, every collective is counted


@pytest.mark.unit
def test_state_bytes_per_device_exact():
    """params + Adam mu + nu: fsdp holds 1/8 of the sharded arrays and all of the replicated ones."""
    exp = built("fsdp")
    scalars = scalar_leaf_bytes(exp.state)
    assert scalars == 20  # step, Adam count (int32), loss scale, good steps, skipped steps (5 x 4 B)
    expected = 3 * (SHARDED_BYTES // 8 + REPLICATED_BYTES) + scalars
    assert state_bytes_per_device(exp.state) == expected == 305420
    for mode in DP_MODES:  # replicated (pmap: one row of the stacked state per device)
        exp = built(mode)
        assert state_bytes_per_device(exp.state) == 3 * PARAM_BYTES + scalars == 2442380, mode


# ---- the profiler's measured ratio -----------------------------------------------------------------------


def _x(name, ts, dur, **args):
    return {"ph": "X", "pid": 1, "tid": 1, "ts": ts, "dur": dur, "name": name, "args": args}


@pytest.mark.unit
def test_collective_time_cpu_layout():
    """CPU backend: ops carry device_ordinal; overlapping collective intervals count once; other modules,
    host events and no-op collectives (not in the step's list) are ignored."""
    ev = [
        _x("psum.3", 0, 10, hlo_op="psum.3", hlo_module="jit_train_step", device_ordinal="0"),
        _x(
            "all-reduce-done.1", 5, 10, hlo_op="all-reduce-done.1", hlo_module="jit_train_step", device_ordinal="0"
        ),  # overlaps psum.3: union [0, 15)
        _x("fusion", 20, 50, hlo_op="fusion", hlo_module="jit_train_step", device_ordinal="0"),
        _x("all-reduce.7", 100, 40, hlo_op="all-reduce.7", hlo_module="jit_train_step", device_ordinal="1"),
        _x("all-reduce.9", 0, 1000, hlo_op="all-reduce.9", hlo_module="jit_eval", device_ordinal="1"),
        _x("Rendezvous", 0, 1000),  # host bookkeeping: no hlo_op
    ]
    stats = collective_time_from_events(
        ev, module="jit_train_step", collective_names={"psum.3": "all-reduce", "all-reduce.7": "all-reduce"}
    )
    assert stats["devices"] == 2 and stats["op_events"] == 4 and stats["collective_events"] == 3
    assert stats["collective_s"] == {"ordinal:0": pytest.approx(15e-6), "ordinal:1": pytest.approx(40e-6)}
    out = measured_ratio(
        ev,
        num_steps=1,
        step_time_s=100e-6,
        platform="cpu",
        module="jit_train_step",
        collective_names={"psum.3": "all-reduce", "all-reduce.7": "all-reduce"},
    )
    assert out["comm/time_measured_s"] == pytest.approx(27.5e-6)
    assert out["comm/ratio_measured"] == pytest.approx(0.275)
    assert out["comm/ratio_measured_valid"] is False
    # all-reduce.9 of another module and a no-op all-reduce (not a known collective) are not counted
    noop = [_x("all-reduce.2", 0, 10, hlo_op="all-reduce.2", hlo_module="jit_train_step", device_ordinal="0")]
    assert collective_time_from_events(noop, "jit_train_step", {"psum.3": "all-reduce"})["collective_events"] == 0


@pytest.mark.unit
def test_collective_time_gpu_layout():
    """GPU/TPU: one process per device; NCCL kernels count; host processes are ignored; valid off CPU."""
    meta = [
        {"ph": "M", "pid": p, "name": "process_name", "args": {"name": n}}
        for p, n in ((1, "/host:CPU"), (2, "/device:GPU:0"), (3, "/device:GPU:1"))
    ]
    ev = meta + [
        {**_x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 0, 30), "pid": 2},
        {**_x("fusion.1", 30, 70, hlo_op="fusion.1", hlo_module="jit_train_step"), "pid": 2},
        {**_x("all-gather-start.2", 0, 20, hlo_op="all-gather-start.2", hlo_module="jit_train_step"), "pid": 3},
        {**_x("fusion.1", 20, 80, hlo_op="fusion.1", hlo_module="jit_train_step"), "pid": 3},
        {**_x("all-reduce", 0, 100, hlo_op="all-reduce"), "pid": 1},  # host side: ignored
    ]
    out = measured_ratio(ev, num_steps=2, step_time_s=50e-6, platform="gpu", module="jit_train_step")
    assert out["profile/devices_in_trace"] == 2
    assert out["comm/time_measured_s"] == pytest.approx((30e-6 + 20e-6) / 2 / 2)
    assert out["comm/ratio_measured"] == pytest.approx(0.25)
    assert out["comm/ratio_measured_valid"] is True
    assert measured_ratio(meta, 1, 1.0, "gpu")["comm/ratio_measured_valid"] is False  # no op events


def _run(tmp_path, **dotted):
    """training.run.run in-process (W&B disabled, no checkpoints). Returns the summary."""
    from training.report import Reporter
    from training.run import run

    cfg = make_cfg(**{"wandb__mode": "disabled", "checkpoint__enabled": "false", **dotted})
    reporter = Reporter(tmp_path)
    try:
        return run(cfg, tmp_path, reporter)
    finally:
        reporter.close()


@pytest.mark.unit
def test_profile_window_on_cpu(tmp_path):
    """A real trace of steps 3-5 (jit_sharding, 8 devices): one gradient all-reduce per step and device."""
    s = _run(
        tmp_path,
        data__name="synthetic",
        parallel__name="jit_sharding",
        train__steps=6,
        train__log_every=3,
        profile__enabled="true",
        profile__start_step=2,
        profile__num_steps=3,
        hardware__link_bytes_per_s=450e9,
    )
    assert (tmp_path / "profile" / "plugins" / "profile").is_dir()
    assert s["profile/trace_file"].endswith("perfetto_trace.json.gz")
    assert s["profile/devices_in_trace"] == 8
    assert s["comm/count/all-reduce"] == 1
    assert s["profile/collective_events"] == 3 * 8 * 1  # steps x devices x collectives of the step
    assert 0 < s["comm/ratio_measured"] <= 1.0 + 1e-6
    assert s["comm/ratio_measured_valid"] is False  # CPU: rendezvous waiting, not link time
    # a link bandwidth set by hand models the link's time, but simulated CPU devices are not that machine: no ratio
    # of it to a step time measured here, in the summary or in any window record
    assert s["comm/time_model_s"] == pytest.approx(s["comm/bytes_per_step"] / 450e9)
    assert s["hardware/matches_device"] is False and "comm/ratio_model" not in s and "perf/mfu" not in s
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["comm/ratio_measured"] == s["comm/ratio_measured"]
    assert not any("comm/ratio_model" in r or "perf/mfu" in r for r in records)


@pytest.mark.unit
def test_profile_window_must_fit(tmp_path):
    """A window past the last step is one clear line, raised before anything is written."""
    from parallel import ConfigError

    with pytest.raises(ConfigError, match=r"profile.start_step=10 \+ profile.num_steps=5 > 8 training steps"):
        _run(tmp_path, data__name="synthetic", train__steps=8, profile__enabled="true")
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "profile").exists()


# ---- no implicit transfers in the loop -------------------------------------------------------------------


@pytest.mark.unit
def test_transfer_guard_catches_implicit_transfers():
    """The control: under "disallow" an implicit host->device transfer into a jitted step raises."""
    f = jax.jit(lambda x: x + 1)
    with jax.transfer_guard("disallow"):
        f(jax.device_put(np.ones(3, np.float32)))  # explicit: allowed
        with pytest.raises(Exception, match="Disallowed host-to-device transfer"):
            f(np.ones(3, np.float32))


@pytest.mark.parametrize(
    "mode,data", [("pmap", "synthetic"), ("jit_sharding", "synthetic"), ("shard_map", "synthetic"), ("fsdp", "mnist")]
)
def test_loop_runs_under_transfer_guard_disallow(tmp_path, monkeypatch, mode, data):
    """Dispatch between logging windows makes no implicit transfer (windows, syncs and evals included)."""
    if data == "mnist":
        if not SHARED_TFDS.exists():
            pytest.fail(f"MNIST is expected at {SHARED_TFDS}")
        monkeypatch.setenv("TFDS_DATA_DIR", str(SHARED_TFDS))
    s = _run(
        tmp_path,
        data__name=data,
        parallel__name=mode,
        train__steps=9,
        train__log_every=4,
        train__sync_every=3,
        train__eval_every=5,
        train__transfer_guard="disallow",
    )
    assert s["status"] == "ok" and s["train/steps"] == 9 and s["mesh/devices"] == 8
    assert s["sync/max_replica_divergence"] == 0.0 and math.isfinite(s["train/loss"])


# ---- benchmarks/gpu_check.sh -----------------------------------------------------------------------------


@pytest.mark.slow
def test_gpu_check_script_runs_small_on_cpu(tmp_path):
    """The GPU check's small size on CPU: ResNet-18 (width 8) in bf16, 1 device; MFU and peak memory n/a."""
    import os
    import re
    import subprocess

    from utils import REPO

    env = {
        **os.environ,
        "GPU_CHECK_DIR": str(tmp_path / "run"),
        "GPU_CHECK_SIZE": "small",
        "WANDB_MODE": "offline",
        "PYTHON": sys.executable,
    }
    env.pop("WANDB_API_KEY", None)
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        env[var] = str(tmp_path / ".wandb_aux")
    res = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (s["status"], s["model"], s["precision"], s["mesh/devices"], s["train/steps"]) == (
        "ok",
        "resnet",
        "bf16",
        1,
        6,
    )
    m = re.search(r"gpu_check: examples/s=([0-9.e+]+) ", out)
    assert m and float(m.group(1)) == pytest.approx(s["perf/examples_per_s"], rel=1e-3)
    assert "MFU=n/a (no peak FLOP/s known for this device)" in out
    assert "peak memory/device=n/a (no memory statistics)" in out
    assert s["comm/ratio_measured_valid"] is False and (tmp_path / "run" / "profile").is_dir()
