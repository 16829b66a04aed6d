"""What the compiled step returns, and the host half of the metrics (issue 2: the step holds only training
work; ``benchmarks/overhead.py`` measures the rest).

The gradient-norm checks use plain SGD (no momentum): its update is ``-lr * grad``, so the exact global mean
gradient of every step can be read back from the parameters, independently of the code that logs the norm.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from data.pipeline import TrainSource
from parallel.state import metrics_to_host, state_to_host
from training.build import build, plan
from utils import make_cfg, random_dataset

pytestmark = pytest.mark.unit  # all in-process and quick: make test-unit runs them

DATA = random_dataset(1024)
LR = 0.1


def _experiment(cfg):
    """(the built experiment, ``step -> the placed batch of that step`` from ``DATA``)."""
    p = plan(cfg)
    exp = build(p)
    layout, src = exp.mode.batch_layout(), TrainSource(DATA, p.global_batch, cfg.train.seed, with_index=False)
    rows = layout.local_rows(p.global_batch)
    return exp, lambda step: layout.place(src.local_batch(step, rows), p.global_batch)


def _steps(cfg, n):
    """Runs ``n`` steps; returns (host records as the step returned them, exact grad norms from SGD, exp)."""
    exp, batch = _experiment(cfg)
    state, records, norms = exp.state, [], []
    for step in range(n):
        before = state_to_host(state).params
        state, m = exp.steps.train(state, batch(step))
        after = state_to_host(state).params
        records.append({"step": step + 1, **{k: float(v) for k, v in metrics_to_host(m).items()}})
        grads = jax.tree.map(lambda a, b: (np.float64(a) - np.float64(b)) / LR, before, after)
        norms.append(math.sqrt(sum(float(np.sum(g * g)) for g in jax.tree.leaves(grads))))
    return records, norms, exp


@pytest.mark.parametrize("mode", ["jit_sharding", "pmap", "fsdp"])
def test_grad_norm_every_n_is_the_exact_norm_on_those_steps_only(mode):
    cfg = make_cfg(
        parallel__name=mode, optim__name="sgd", optim__lr=LR, train__grad_norm_every=3, train__global_batch=64
    )
    records, norms, exp = _steps(cfg, 6)
    assert all("optim/grad_norm" in r for r in records)  # the step returns a placeholder on the other steps
    assert [r["optim/grad_norm"] for r in records if r["step"] % 3] == [0.0, 0.0, 0.0, 0.0]
    assert exp.updater.complete(records) is None
    logged = {r["step"]: r["optim/grad_norm"] for r in records if "optim/grad_norm" in r}
    assert sorted(logged) == [3, 6]  # placeholders dropped on the host
    for step, value in logged.items():
        assert value == pytest.approx(norms[step - 1], rel=2e-4)
        assert value > 0.0


def test_default_step_returns_only_device_metrics_and_has_no_norm_pass():
    cfg = make_cfg(train__global_batch=64)
    records, _, exp = _steps(cfg, 2)
    assert set(records[0]) == {"step", "train/loss", "train/accuracy"}
    exp.updater.complete(records)
    assert set(records[0]) == {"step", "train/loss", "train/accuracy", "optim/lr"}
    assert records[1]["optim/lr"] == pytest.approx(1e-3)
    batch = {"image": np.zeros((64, 28, 28, 1), np.uint8), "label": np.zeros(64, np.int32)}
    hlo = exp.steps.train.lower(exp.state, exp.mode.batch_layout().place(batch, 64)).compile().as_text()
    assert "conditional" not in hlo
    # a constant learning rate goes to optax as a number: no schedule count in the optimizer state
    assert len(jax.tree.leaves(exp.state.opt_state)) == 1 + 2 * len(jax.tree.leaves(exp.state.params))


def test_fp16_loss_scaling_reports_norm_and_scale_every_step():
    cfg = make_cfg(
        precision__name="fp16",
        precision__compute_dtype="float16",
        precision__loss_scale="dynamic",
        optim__name="sgd",
        optim__lr=LR,
        train__global_batch=64,
    )
    records, norms, exp = _steps(cfg, 3)
    assert exp.updater.complete(records) is None
    for r, norm in zip(records, norms):
        assert r["optim/grad_norm"] == pytest.approx(norm, rel=2e-3)
        assert r["precision/loss_scale"] == 2.0**15 and r["precision/skipped_steps"] == 0.0


def test_complete_names_the_first_non_finite_step():
    exp = build(plan(make_cfg(train__grad_norm_every=1, mesh__devices=1)))
    rec = lambda step, loss, norm: {"step": step, "train/loss": loss, "train/accuracy": 0.5, "optim/grad_norm": norm}
    assert exp.updater.complete([rec(1, 1.0, 2.0), rec(2, float("nan"), 2.0), rec(3, float("inf"), 2.0)])["step"] == 2
    assert exp.updater.complete([rec(1, 1.0, 2.0), rec(2, 1.0, float("inf"))])["step"] == 2
    scaled = build(
        plan(
            make_cfg(
                precision__name="fp16",
                precision__compute_dtype="float16",
                precision__loss_scale="dynamic",
                mesh__devices=1,
            )
        )
    )
    # with loss scaling a non-finite gradient is an overflow: the step was skipped, training goes on
    assert scaled.updater.complete([rec(1, 1.0, float("inf"))]) is None
    assert scaled.updater.complete([rec(1, float("nan"), 1.0)])["step"] == 1


def test_logged_lr_follows_warmup_and_cosine_on_the_host():
    cfg = make_cfg(optim__schedule="cosine", optim__warmup_steps=2, optim__decay_steps=4, mesh__devices=1)
    exp = build(plan(cfg))
    records = [{"step": s, "train/loss": 1.0, "train/accuracy": 0.0} for s in range(1, 8)]
    assert exp.updater.complete(records) is None
    # lr of the step that starts at count s-1: warmup 0, .5, then cosine from 1e-3 to 0 over 4 steps
    expected = [
        0.0,
        5e-4,
        1e-3,
        1e-3 * (1 + math.cos(math.pi / 4)) / 2,
        5e-4,
        1e-3 * (1 + math.cos(3 * math.pi / 4)) / 2,
        0.0,
    ]
    np.testing.assert_allclose([r["optim/lr"] for r in records], expected, rtol=1e-5, atol=1e-9)


def test_logged_lr_does_not_advance_on_steps_skipped_by_loss_scaling():
    """A skipped fp16 step leaves the optimizer's count (and so its rate) where it was."""
    cfg = make_cfg(
        precision__name="fp16",
        precision__compute_dtype="float16",
        precision__loss_scale="dynamic",
        optim__warmup_steps=4,
        mesh__devices=1,
    )
    exp = build(plan(cfg))
    rec = lambda step, norm, skipped: {
        "step": step,
        "train/loss": 1.0,
        "train/accuracy": 0.0,
        "optim/grad_norm": norm,
        "precision/skipped_steps": skipped,
    }
    records = [rec(1, 1.0, 0), rec(2, float("inf"), 1), rec(3, 1.0, 1), rec(4, float("nan"), 2), rec(5, 1.0, 2)]
    assert exp.updater.complete(records) is None  # overflows are skips, not errors
    # warmup: lr(count) = count / 4 * 1e-3; counts used: 0, 1 (skipped), 1, 2 (skipped), 2
    np.testing.assert_allclose([r["optim/lr"] for r in records], [0.0, 2.5e-4, 2.5e-4, 5e-4, 5e-4], rtol=1e-6)


def _window(cfg, n):
    """The device metrics of ``n`` steps (a logging window as ``training.run.train_loop`` collects it) and the
    experiment."""
    exp, batch = _experiment(cfg)
    state, window = exp.state, []
    for step in range(n):
        state, m = exp.steps.train(state, batch(step))
        window.append(jax.block_until_ready(m))  # one step in flight (queued simulated collectives abort XLA:CPU)
    return window, exp


def _equal_bitwise(a, b) -> bool:
    """Same tree, and every leaf the same type, dtype, shape and bytes (-0.0 is not 0.0; a NaN's payload counts)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        type(x) is type(y) and x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
        for x, y in zip(la, lb)
    )


@pytest.mark.parametrize(
    "mode, precision",
    [("jit_sharding", "fp32"), ("pmap", "fp32"), ("fsdp", "bf16"), ("shard_map", "fp32"), ("jit_sharding", "fp16")],
)
def test_window_is_stacked_on_the_device_and_equals_a_copy_per_step(mode, precision):
    """A logging window's metrics come to the host stacked (``parallel.base.window_to_host``): bitwise the values
    and dtypes of a ``device_get`` per step, for windows of 8, 50, 64, 65 and 70 steps (two chunks), with ONE
    compiled stacking program for every length; windows of 1 and 7 steps are copied array by array, equal too."""
    from parallel.state import WINDOW_MIN_STACK_STEPS, _stack_steps, window_to_host

    overrides = {"precision__name": precision}
    if precision == "fp16":
        overrides.update(precision__compute_dtype="float16", precision__loss_scale="dynamic")
    cfg = make_cfg(parallel__name=mode, optim__name="sgd", optim__lr=LR, train__global_batch=64, **overrides)
    window, exp = _window(cfg, 70)
    per_step = [jax.device_get(m) for m in window]
    compiled_before = _stack_steps._cache_size()
    for n in (1, 7, 8, 50, 64, 65, 70):
        stacked = window_to_host(window[:n])
        assert (stacked is not None) == (n >= WINDOW_MIN_STACK_STEPS)  # shorter windows: a copy per array
        host = metrics_to_host(window[:n])
        assert len(host) == n
        assert all(_equal_bitwise(h, s) for h, s in zip(host, per_step[:n]))
    assert _stack_steps._cache_size() - compiled_before <= 1
    names = set(window[0])
    assert {"train/loss", "train/accuracy"} <= names
    if precision == "fp16":
        assert {"precision/loss_scale", "precision/skipped_steps"} <= names


def test_stacking_keeps_every_bit_of_every_dtype_at_chunk_boundaries():
    """bfloat16 subnormals and NaN payloads, float32 -0.0 and NaN payloads, ints, bools and vectors come back
    bitwise, for windows of the shortest stacked length and ending at, before and after the 64-step chunk
    boundaries."""
    import ml_dtypes

    from parallel.state import window_to_host

    bf16 = np.array([0x0001, 0x8001, 0x7F81, 0xFFC1, 0x3F80], np.uint16).view(ml_dtypes.bfloat16)
    f32 = np.array([0x80000000, 0x7FC00001, 0xFF800001, 0x00000001, 0x3F800000], np.uint32).view(np.float32)
    window = [
        {
            "bf16": jax.numpy.asarray(bf16[i % 5]),
            "f32": jax.numpy.asarray(f32[i % 5]),
            "f16": jax.numpy.float16(i / 7),
            "i32": jax.numpy.int32(i),
            "flag": jax.numpy.bool_(i % 2),
            "vector": jax.numpy.arange(3.0) + i,
        }
        for i in range(129)
    ]
    per_step = [jax.device_get(m) for m in window]
    for n in (8, 63, 64, 65, 128, 129):
        host = window_to_host(window[:n])
        assert host is not None and len(host) == n
        assert all(_equal_bitwise(h, s) for h, s in zip(host, per_step[:n]))


def test_unlike_windows_fall_back_to_a_copy_per_array():
    """Windows shorter than ``WINDOW_MIN_STACK_STEPS``, and steps whose metrics differ in structure, dtype, kind or
    devices, are copied as they are, with the same values."""
    from parallel.state import window_to_host

    window, exp = _window(make_cfg(train__global_batch=64), 3)
    extra = {**window[0], "more": window[0]["train/loss"]}
    as_int = {k: v.astype(np.int32) for k, v in window[1].items()}
    numpy_leaf = {k: np.asarray(v) for k, v in window[2].items()}
    d0, d1 = jax.devices()[:2]
    one_device = {k: jax.device_put(v, d0) for k, v in window[0].items()}
    other_device = {k: jax.device_put(v, d1) for k, v in window[0].items()}
    two_devices = {"a": jax.device_put(window[0]["train/loss"], d0), "b": jax.device_put(window[0]["train/loss"], d1)}
    complex_leaf = {"c": jax.numpy.complex64(1 + 2j)}
    short = [window[0]] * 7  # alike, but shorter than WINDOW_MIN_STACK_STEPS
    for unlike in (
        short,
        [window[0]] * 8 + [extra],
        [window[0]] * 8 + [as_int],
        [window[0]] * 8 + [numpy_leaf],
        [numpy_leaf] * 8,
        [one_device] * 8 + [other_device],
        [two_devices] * 8,
        [complex_leaf] * 8,
        [],
    ):
        assert window_to_host(unlike) is None
        host = metrics_to_host(unlike)
        assert len(host) == len(unlike)
        assert all(_equal_bitwise(h, jax.device_get(m)) for h, m in zip(host, unlike))
