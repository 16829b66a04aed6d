"""Communication optimisations (issue 10): explicit reductions in a chosen dtype, int8 compression with error
feedback, XLA flag presets, and the comm_optimisations sweep preset.

Byte counts are exact, read from the lowered (StableHLO) and compiled (HLO) modules of the real train step
by ``measure.compiled.compiled_step_metrics``. MLP on 8 simulated devices: P = 203530 float32 parameters in
L = 4 arrays (784x256 + 256 + 256x10 + 10); the metric sums add one 8-byte float32 all-reduce (2 scalars).
"""

from __future__ import annotations

import csv
import json
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from jax.sharding import PartitionSpec as P

from data.pipeline import TrainSource
from parallel import ConfigError, make_mesh
from parallel.compress import QMAX, adapt_residual, init_residual, int8_mean, payload_bytes
from parallel.state import replica_divergence
from training.build import build, plan
from measure.compiled import compiled_step_metrics
from utils import REPO, make_cfg, max_abs_diff, quantisation_scales, random_dataset, run_steps

N = 8
P_PARAMS = 784 * 256 + 256 + 256 * 10 + 10  # 203530
L_LEAVES = 4
METRICS_BYTES = 8  # loss_sum + correct, float32, one all-reduce
AXES = ("data", "fsdp")


def ring_allreduce(s: float, n: int = N) -> float:
    return 2 * (n - 1) / n * s


def ring_gather(s: float, n: int = N) -> float:  # all-gather, all-to-all, reduce-scatter
    return (n - 1) / n * s


# ---------------------------------------------------------------------------------------------------------
# exact bytes of the real train step
# ---------------------------------------------------------------------------------------------------------
_DATA = random_dataset(512)


def step_comm(mode="jit_sharding", grad_reduce_dtype=None, compression="none", accum=1) -> dict:
    cfg = make_cfg(
        {
            "parallel": {"name": mode, "grad_reduce_dtype": grad_reduce_dtype, "grad_compression": compression},
            "train": {"accum_steps": accum},
        }
    )
    p = plan(cfg)
    exp = build(p)
    layout = exp.mode.batch_layout()
    batch = layout.place(
        TrainSource(_DATA, p.global_batch, 0).local_batch(0, layout.local_rows(p.global_batch)), p.global_batch
    )
    lowered = exp.steps.train.lower(exp.state, batch)
    return compiled_step_metrics(lowered, lowered.compile(), N)


F32_PAYLOAD = 4 * P_PARAMS + METRICS_BYTES  # 814128: float32 gradients + metric sums, one all-reduce
PADDED = N * -(-P_PARAMS // N)  # 203536: int8 buffer padded to a multiple of 8 devices (6 elements of padding)
SCALES = 4 * L_LEAVES  # one float32 scale per array, pmax-ed
INT8_PAYLOAD = 2 * PADDED + SCALES + METRICS_BYTES  # all-to-all + all-gather (int8) + scales + metric sums


@pytest.mark.unit
def test_bytes_implicit_reduction():
    m = step_comm()
    # jit_sharding's own reduction is inserted by GSPMD at compile time: invisible in the lowered module.
    assert m["comm/payload_bytes_per_step_lowered"] == 0
    assert m["comm/payload_bytes_per_step"] == F32_PAYLOAD == 814128


@pytest.mark.unit
def test_bytes_float32_explicit():
    m = step_comm(grad_reduce_dtype="float32")
    # explicit shard_map psum: lowered payload = the param bytes (+ the metric sums), one all-reduce.
    assert m["comm/payload_bytes_per_step_lowered"] == F32_PAYLOAD == 814128
    assert m["comm/payload_bytes_per_step"] == F32_PAYLOAD
    assert m["comm/bytes_per_step"] == ring_allreduce(F32_PAYLOAD) == 1424724.0
    assert m["comm/count/all-reduce"] == 1


@pytest.mark.unit
def test_bytes_bfloat16_halves_lowered():
    m = step_comm(grad_reduce_dtype="bfloat16")
    # the lowered gradient payload halves; XLA:CPU promotes the bf16 all-reduce to float32 when compiling, so
    # the compiled module still moves float32 (a GPU keeps bf16: the lowered number predicts it).
    assert m["comm/payload_bytes_per_step_lowered"] == 2 * P_PARAMS + METRICS_BYTES == 407068
    assert m["comm/payload_bytes_per_step_lowered"] - METRICS_BYTES == (F32_PAYLOAD - METRICS_BYTES) // 2
    assert m["comm/payload_bytes_per_step"] == F32_PAYLOAD
    assert m["comm/collectives"] == ["all-reduce f32 814128B n=8"]


def test_bytes_int8_half_payload_quarter_ring():
    m = step_comm(compression="int8")
    assert PADDED == 203536
    # payload = half of the float32 gradient payload + padding (1 byte each, twice) + scales (+ metric sums)
    assert INT8_PAYLOAD == (4 * P_PARAMS) // 2 + 2 * (PADDED - P_PARAMS) + SCALES + METRICS_BYTES == 407096
    for key in ("comm/payload_bytes_per_step", "comm/payload_bytes_per_step_lowered"):
        assert m[key] == INT8_PAYLOAD  # int8 is not promoted by XLA:CPU: compiled == lowered
    # ring bytes = (n-1)/n padded (all-to-all) + (n-1)/n padded (all-gather) + 2(n-1)/n (scales + metrics)
    ring = 2 * ring_gather(PADDED) + ring_allreduce(SCALES) + ring_allreduce(METRICS_BYTES)
    assert m["comm/bytes_per_step"] == ring == 356230.0
    # = a quarter of the float32 gradient all-reduce's ring bytes + padding + scales (+ the same metric sums)
    quarter = ring_allreduce(4 * P_PARAMS) / 4
    assert ring == quarter + 2 * ring_gather(PADDED - P_PARAMS) + ring_allreduce(SCALES) + ring_allreduce(8)
    assert sorted(m["comm/collectives"]) == sorted(
        [
            f"all-to-all s8 {PADDED}B n=8",
            f"all-gather s8 {PADDED}B n=8",
            f"all-reduce f32 {SCALES}B n=8",
            "all-reduce f32 8B n=8",
        ]
    )
    g = payload_bytes(P_PARAMS, L_LEAVES, N)  # the formula of parallel.compress
    assert g["payload"] + METRICS_BYTES == INT8_PAYLOAD and g["ring"] + ring_allreduce(8) == ring


@pytest.mark.parametrize("mode,accum", [("shard_map", 4), ("pmap", 2)])
def test_int8_bytes_other_modes(mode, accum):
    m = step_comm(mode=mode, compression="int8", accum=accum)
    assert m["comm/payload_bytes_per_step"] == INT8_PAYLOAD
    assert m["comm/payload_bytes_per_step_lowered"] == INT8_PAYLOAD
    assert m["comm/in_loop_count"] == 0  # one exchange per optimizer step, after the microbatch loop


# ---------------------------------------------------------------------------------------------------------
# the int8 mean itself
# ---------------------------------------------------------------------------------------------------------
MESH = make_mesh(jax.devices(), (N, 1))


def _int8_fn(with_residual: bool):
    """jit(shard_map) of int8_mean on rows ``x[d]`` of device d; returns (mean, residual rows, scales)."""

    def f(x, res):
        tree = {"a": x[0]}
        r = jax.tree.map(lambda v: v[0], res) if with_residual else None
        mean, new = int8_mean(tree, AXES, r)
        scales = quantisation_scales(tree, AXES, r)
        new = jax.tree.map(lambda v: v[None], new) if with_residual else res
        return mean["a"], new, scales

    return jax.jit(
        jax.shard_map(f, mesh=MESH, in_specs=(P(AXES), P(AXES)), out_specs=(P(), P(AXES), P()), check_vma=False)
    )


def _zeros(shape):
    return jax.tree.map(jnp.asarray, init_residual({"a": np.zeros(shape, np.float32)}, N))


@pytest.mark.unit
def test_no_overflow_8_devices_holding_100():
    x = jnp.full((N, 5), 100.0, jnp.float32)  # 8 x 127 = 1016 would wrap around in an int8 sum
    mean, _, scales = _int8_fn(False)(x, _zeros((5,)))
    step = 100.0 / QMAX
    np.testing.assert_allclose(float(scales[0]), step, rtol=1e-6)
    assert np.all(np.abs(np.asarray(mean) - 100.0) <= step)
    np.testing.assert_allclose(np.asarray(mean), 100.0, rtol=1e-5)  # in fact exact up to float rounding

    # the naive alternative wraps: an int8 psum of 8 x 127
    wrap = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v[0], AXES), mesh=MESH, in_specs=P(AXES), out_specs=P()))
    assert int(wrap(jnp.full((N, 1), 127, jnp.int8))[0]) == (8 * 127 + 128) % 256 - 128 == -8


@pytest.mark.unit
def test_int8_mean_within_one_step_without_feedback():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(N, 1001)).astype(np.float32) * rng.uniform(0.1, 10, size=(N, 1)).astype(np.float32)
    mean, _, scales = _int8_fn(False)(jnp.asarray(x), _zeros((1001,)))
    s = float(scales[0])
    assert s == pytest.approx(np.abs(x).max() / QMAX, rel=1e-6)
    err = np.abs(np.asarray(mean, np.float64) - x.astype(np.float64).mean(0))
    assert err.max() <= s * (1 + 1e-5)  # s/2 (phase 1, averaged) + s/2 (re-quantisation)


@pytest.mark.unit
def test_error_feedback_sum_of_10_gradients():
    """sum_t transmitted_t = sum_t mean_t - mean_d(worker residual_T) - server residual_T, so the error of the
    sum is within one quantisation step s_T of the last step; without feedback it grows with t."""
    rng = np.random.default_rng(2)
    T, size = 10, 203  # 203 elements: padded to 208 on 8 devices
    grads = rng.normal(size=(T, N, size)).astype(np.float32)
    grads[:, :, 0] = 5.0  # a large element fixes the scale at 5/127 ...
    grads[:, :, 1] = 0.3 * 5.0 / QMAX  # ... and a small constant one rounds to 0 without feedback
    fn, fn_plain = _int8_fn(True), _int8_fn(False)
    res = _zeros((size,))
    sent = np.zeros(size, np.float64)
    sent_plain = np.zeros(size, np.float64)
    for t in range(T):
        mean, res, scales = fn(jnp.asarray(grads[t]), res)
        sent += np.asarray(mean, np.float64)
        sent_plain += np.asarray(fn_plain(jnp.asarray(grads[t]), _zeros((size,)))[0], np.float64)
    true = grads.astype(np.float64).mean(1).sum(0)
    worker = np.asarray(res["worker"], np.float64)[:, :size].mean(0)
    server = np.asarray(res["server"], np.float64).reshape(-1)[:size]
    np.testing.assert_allclose(sent, true - worker - server, atol=1e-5)  # the telescoping identity
    s_last = float(scales[0])
    err = np.abs(sent - true)
    assert err.max() <= s_last * (1 + 1e-4)
    assert abs(sent_plain[1] - true[1]) == pytest.approx(T * 0.3 * 5.0 / QMAX, rel=1e-4)  # 3 steps x 0.3 lost
    assert abs(sent_plain[1] - true[1]) > 2.5 * s_last > err[1]


@pytest.mark.unit
def test_nonfinite_step_returns_nan_and_keeps_residual():
    fn = _int8_fn(True)
    res = jax.tree.map(lambda v: v + 0.25, _zeros((16,)))
    x = np.ones((N, 16), np.float32)
    x[3, 5] = np.inf
    mean, new, _ = fn(jnp.asarray(x), res)
    assert np.all(np.isnan(np.asarray(mean)))
    assert max_abs_diff(new, res) == 0.0


# ---------------------------------------------------------------------------------------------------------
# the residual in the train state
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["jit_sharding", "pmap"])
def test_int8_training_matches_reference_and_residual_is_per_device(mode):
    data = random_dataset(1024)
    sgd = {"optim": {"name": "sgd", "lr": 0.1}}
    ref_losses, ref_state, _, _ = run_steps(make_cfg(sgd, mesh__devices=1), data, 4)
    losses, state, exp, initial = run_steps(
        make_cfg({**sgd, "parallel": {"name": mode, "grad_compression": "int8"}}), data, 4
    )
    assert initial.mode_state["worker"].shape == (N, 203536)
    assert initial.mode_state["server"].shape == (N, 203536 // N)
    assert max_abs_diff(initial.mode_state, jax.tree.map(np.zeros_like, initial.mode_state)) == 0.0
    # quantisation error is small: same losses to 1e-4, params to 1e-4 (SGD, lr 0.1, 4 steps)
    assert np.max(np.abs(losses - ref_losses)) < 1e-4
    assert max_abs_diff(state.params, ref_state.params) < 1e-4
    # the residual differs between devices (one row each) and stays out of the replica check
    worker = state.mode_state["worker"]
    assert worker.shape == (N, 203536) and np.abs(worker[0] - worker[1]).max() > 0
    placed = exp.state.mode_state["worker"]
    rows = sorted(s.index[0].start for s in placed.addressable_shards)
    assert rows == list(range(N)) and all(s.data.shape == (1, 203536) for s in placed.addressable_shards)
    if mode != "pmap":  # pmap's outputs carry its own P('data') over the same 8 devices
        assert placed.sharding.spec == P(AXES)
    assert replica_divergence((exp.state.params, exp.state.opt_state)) == 0.0


@pytest.mark.unit
def test_adapt_residual_resets_on_other_device_count(caplog):
    params = {"w": np.zeros((10, 3), np.float32), "b": np.zeros(3, np.float32)}  # 33 elements
    saved = {k: v + 1.0 for k, v in init_residual(params, 8).items()}  # worker [8, 40], server [8, 5]
    same = adapt_residual(saved, params, 8)
    assert max_abs_diff(same, saved) == 0.0
    with caplog.at_level(logging.WARNING, logger="parallel.compress"):
        other = adapt_residual(saved, params, 4)
    assert other["worker"].shape == (4, 36) and other["server"].shape == (4, 9)
    assert not other["worker"].any() and not other["server"].any()
    assert "resets it to zero" in caplog.text
    assert adapt_residual(None, params, 2)["worker"].shape == (2, 34)


# ---------------------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize(
    "parallel,expected",
    [
        (
            {"name": "fsdp", "grad_compression": "int8"},
            "parallel.grad_compression=int8 is not implemented for parallel=fsdp; use parallel=pmap, jit_sharding, "
            "shard_map, or parallel.grad_compression=none",
        ),
        (
            {"grad_compression": "int8", "grad_reduce_dtype": "bfloat16"},
            "parallel.grad_compression=int8 replaces the gradient reduction, so parallel.grad_reduce_dtype=bfloat16 "
            "would be ignored; set parallel.grad_reduce_dtype=null",
        ),
    ],
)
def test_bad_options_are_config_errors(parallel, expected):
    with pytest.raises(ConfigError) as e:
        plan(make_cfg({"parallel": parallel}))
    assert str(e.value) == expected


@pytest.mark.unit
@pytest.mark.parametrize(
    "parallel,expected",
    [
        (
            {"grad_compression": "int4"},
            "parallel.grad_compression=int4 is not a valid choice; choose one of none, int8",
        ),
        (
            {"grad_reduce_dtype": "float16"},
            "parallel.grad_reduce_dtype=float16 is not a valid choice; choose one of float32, bfloat16",
        ),
    ],
)
def test_unknown_choices_are_refused_by_the_schema(parallel, expected):
    """The schema's Enum fields refuse them before plan() (its own checks stay for callers without a config)."""
    from conf.schema import ConfigInputError
    from parallel.base import reduce_dtype

    with pytest.raises(ConfigInputError) as e:
        make_cfg({"parallel": parallel})
    assert str(e.value) == expected
    with pytest.raises(ConfigError, match="grad_reduce_dtype='float16' is unknown; choose null, float32 or bfloat16"):
        reduce_dtype("float16")


# ---------------------------------------------------------------------------------------------------------
# XLA flag presets
# ---------------------------------------------------------------------------------------------------------
def _preset(name: str) -> dict:
    return yaml.safe_load((REPO / "conf" / "xla" / f"{name}.yaml").read_text())


def test_xla_presets_parse():
    """Every flag of every preset is known to the installed jaxlib (an unknown flag aborts the backend)."""
    assert _preset("default") == {"name": "default", "flags": []}
    flags = _preset("gpu_overlap")["flags"]
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
    text = (REPO / "conf" / "xla" / "gpu_overlap.yaml").read_text().splitlines()
    for flag in flags:  # each flag is commented (the line above it is a comment)
        i = next(k for k, line in enumerate(text) if line.strip() == f"- {flag}")
        assert text[i - 1].strip().startswith(("#", "- --xla")), flag
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", "import jax; print(len(jax.devices()))"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    bad = {**env, "XLA_FLAGS": "--xla_gpu_enable_async_collectives=true"}  # removed from XLA: aborts
    out = subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices()"], env=bad, capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0 and "Unknown flag" in out.stderr


def test_xla_preset_applied_and_logged(tmp_path):

    from conf.schema import XlaConfig, from_dict

    preset = _preset("gpu_overlap")
    cfg = from_dict({"xla": preset})
    assert isinstance(cfg.xla, XlaConfig) and cfg.xla.flags == preset["flags"]
    script = (
        "import logging, os, sys; sys.path.insert(0, '.'); logging.basicConfig(level=logging.INFO);"
        "from conf.schema import from_dict; from training.runtime import "
        "setup_runtime; import yaml; p = yaml.safe_load(open('conf/xla/gpu_overlap.yaml'));"
        "setup_runtime(from_dict({'xla': p}));"
        "import jax; jax.devices(); print('XLA_FLAGS=' + os.environ['XLA_FLAGS'])"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env={**env, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"XLA_FLAGS={' '.join(preset['flags'])}" in out.stdout
    assert f"XLA flags (xla=gpu_overlap): {' '.join(preset['flags'])}" in out.stderr


# ---------------------------------------------------------------------------------------------------------
# the sweep preset (CPU, real MNIST when available, else synthetic data) and the report
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_comm_optimisations_sweep_runs_and_reports(tmp_path):
    from sweeps.comm_optimisations import VARIANTS

    out = tmp_path / "comm"
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_CACHE_DIR": str(tmp_path),
        "WANDB_CONFIG_DIR": str(tmp_path),
        "WANDB_DATA_DIR": str(tmp_path),
    }
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "sweeps.comm_optimisations",
            "--out",
            str(out),
            "--",
            "data=synthetic",
            "train.steps=8",
            "train.log_every=4",
            "wandb.mode=disabled",
            "checkpoint.enabled=false",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summaries = {v: json.loads((out / v / "summary.json").read_text()) for v in VARIANTS}
    assert all(s["status"] == "ok" for s in summaries.values())
    lowered = {v: s["comm/payload_bytes_per_step_lowered"] for v, s in summaries.items()}
    assert lowered == {"none": 0, "bf16_reduce": 407068, "int8_ef": 407096, "accum4": 0}  # none: GSPMD's own
    payload = {v: s["comm/payload_bytes_per_step"] for v, s in summaries.items()}
    assert payload["none"] == 814128 == payload["accum4"]
    assert summaries["int8_ef"]["comm/bytes_per_step"] == 356230.0
    assert summaries["accum4"]["train/global_batch"] == 4 * summaries["none"]["train/global_batch"]
    table = {r["variant"]: r for r in csv.DictReader((out / "comm_optimisations.csv").open())}
    assert float(table["bf16_reduce"]["GPU payload/step vs none"]) == 407068 / 814128
    assert float(table["int8_ef"]["ring bytes/step vs none"]) == 356230 / 1424724
    assert float(table["accum4"]["ring bytes/example vs none"]) == 0.25
    assert "int8_ef" in (out / "comm_optimisations.md").read_text()
    assert (out / "scaling.md").is_file() and "int8" in (out / "scaling.md").read_text()


@pytest.mark.slow
def test_mnist_accuracy_bf16_reduce_and_int8_match_uncompressed(tmp_path):
    """The main job (``python train.py`` defaults: MLP, MNIST, Adam, 8 devices, seed 0; 3 epochs to bound the
    time) ends within 0.005 eval/accuracy of the uncompressed run with bf16 reduction and with int8 + error
    feedback."""
    from utils import SHARED_TFDS, run_train

    if not (SHARED_TFDS / "mnist").is_dir():
        pytest.skip(f"MNIST (TFDS) not prepared at {SHARED_TFDS}")
    acc = {}
    for name, extra in {
        "none": [],
        "bf16": ["parallel.grad_reduce_dtype=bfloat16"],
        "int8": ["parallel.grad_compression=int8"],
    }.items():
        r = run_train(
            tmp_path / name, "train.epochs=3", "wandb.mode=disabled", "checkpoint.enabled=false", *extra, timeout=1200
        )
        assert r.returncode == 0, r.stderr[-3000:]
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["train/steps"] == 3 * 234
        acc[name] = summary["eval/accuracy"]
    print("eval/accuracy after 3 epochs:", acc)
    assert acc["none"] > 0.9
    assert abs(acc["bf16"] - acc["none"]) <= 0.005, acc
    assert abs(acc["int8"] - acc["none"]) <= 0.005, acc
