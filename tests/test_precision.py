"""Mixed precision, loss scaling, learning-rate schedule and per-example randomness."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from data.pipeline import TrainSource
from core.precision import init_loss_scale, update_loss_scale
from core.step import example_keys
from parallel.state import metrics_to_host, state_to_host
from utils import make_cfg, max_abs_diff, mode_grads, random_dataset, run_steps

DATA = random_dataset(2048)
MODES = ("pmap", "jit_sharding", "shard_map", "fsdp")


@pytest.mark.parametrize("precision", [("bf16", "bfloat16", "none"), ("fp16", "float16", "dynamic")])
@pytest.mark.parametrize("mode", MODES)
def test_master_params_and_optimizer_state_stay_float32(mode, precision):
    name, dtype, scaling = precision
    cfg = make_cfg(
        parallel__name=mode, precision__name=name, precision__compute_dtype=dtype, precision__loss_scale=scaling
    )
    losses, state, _, _ = run_steps(cfg, DATA, 3)
    assert np.all(np.isfinite(losses))
    leaves = jax.tree.leaves((state.params, state.opt_state))
    float_leaves = [x for x in leaves if np.issubdtype(np.asarray(x).dtype, np.floating)]
    assert len(float_leaves) == 2 * 4 + 4  # params (4) + Adam mu (4) + nu (4)
    assert all(np.asarray(x).dtype == np.float32 for x in float_leaves)


@pytest.mark.unit
def test_bf16_tracks_fp32():
    l32, _, _, _ = run_steps(make_cfg(), DATA, 10)
    l16, _, _, _ = run_steps(make_cfg(precision__name="bf16", precision__compute_dtype="bfloat16"), DATA, 10)
    assert np.max(np.abs(l32 - l16)) < 0.02
    assert np.max(np.abs(l32 - l16)) > 0  # really computed in bf16


@pytest.mark.unit
def test_fp16_infinite_gradient_is_skipped_and_scale_halves():
    cfg = make_cfg(precision__name="fp16", precision__compute_dtype="float16", precision__loss_scale="dynamic")
    _, _, exp, _ = run_steps(cfg, DATA, 0)
    layout, gb = exp.mode.batch_layout(), exp.plan.global_batch
    src = TrainSource(DATA, gb, 0)

    def poisoned(state, batch):
        grads, sums = mode_grads(exp.mode, exp.local, state.params, batch, state.step, state.loss_scale.scale)
        grads = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.inf), grads)
        return exp.updater(state, grads, sums)

    poisoned_step = jax.jit(poisoned)
    state = exp.state
    for step in range(10):
        batch = layout.place(src.local_batch(step, layout.local_rows(gb)), gb)
        before = state_to_host(state)
        state, metrics = (poisoned_step if step == 3 else exp.steps.train)(state, batch)
        after = state_to_host(state)
        m = metrics_to_host(metrics)
        if step == 3:
            assert max_abs_diff(after.params, before.params) == 0.0  # bit for bit
            assert max_abs_diff(after.opt_state, before.opt_state) == 0.0
            assert float(after.loss_scale.scale) == float(before.loss_scale.scale) / 2 == 2.0**14
            assert int(m["precision/skipped_steps"]) == 1
        else:
            assert np.isfinite(m["train/loss"])
            assert max_abs_diff(after.params, before.params) > 0
    assert int(state.loss_scale.skipped) == 1
    assert int(state.step) == 10


@pytest.mark.unit
def test_dynamic_loss_scale_rules():
    s = init_loss_scale("dynamic", 2.0**15)
    s = update_loss_scale(s, jnp.array(False), "dynamic", 3)
    assert float(s.scale) == 2.0**14 and int(s.skipped) == 1 and int(s.good_steps) == 0
    for _ in range(3):
        s = update_loss_scale(s, jnp.array(True), "dynamic", 3)
    assert float(s.scale) == 2.0**15 and int(s.good_steps) == 0
    tiny = update_loss_scale(init_loss_scale("dynamic", 1.0), jnp.array(False), "dynamic", 3)
    assert float(tiny.scale) == 1.0  # never below 1
    static = update_loss_scale(init_loss_scale("static", 8.0), jnp.array(False), "static", 3)
    assert float(static.scale) == 8.0 and int(static.skipped) == 1
    assert float(init_loss_scale("none", 2.0**15).scale) == 1.0


@pytest.mark.unit
def test_linear_lr_scaling_with_warmup():
    cfg = make_cfg(optim__lr_scaling="linear", train__global_batch=1024, optim__warmup_steps=2)
    _, _, exp, _ = run_steps(cfg, random_dataset(4096), 0)
    layout, gb = exp.mode.batch_layout(), exp.plan.global_batch
    src = TrainSource(random_dataset(4096), gb, 0)
    state, records = exp.state, []
    for step in range(4):
        state, m = exp.steps.train(state, layout.place(src.local_batch(step, layout.local_rows(gb)), gb))
        records.append({"step": step + 1, **{k: float(v) for k, v in metrics_to_host(m).items()}})
    assert "optim/lr" not in records[0]  # a pure function of the step: added on the host, once per window
    assert exp.updater.complete(records) is None
    peak = 1e-3 * 1024 / 256
    np.testing.assert_allclose([r["optim/lr"] for r in records], [0.0, peak / 2, peak, peak], rtol=1e-6)


@pytest.mark.unit
def test_cosine_schedule_uses_decay_steps():
    from core.optim import make_schedule

    sched = make_schedule(1.0, "cosine", 10, 100)
    np.testing.assert_allclose([float(sched(i)) for i in (0, 5, 10, 60, 110)], [0.0, 0.5, 1.0, 0.5, 0.0], atol=1e-6)


# ---- dropout: per-example keys from (seed, step, global example index) ----------------------------------


def test_dropout_is_independent_of_device_count_and_reproducible():
    cfg1 = make_cfg(model__dropout=0.1, mesh__devices=1)
    cfg8 = make_cfg(model__dropout=0.1, mesh__devices=8)
    l1, _, _, _ = run_steps(cfg1, DATA, 20)
    l8, _, _, _ = run_steps(cfg8, DATA, 20)
    l8b, _, _, _ = run_steps(cfg8, DATA, 20)
    l0, _, _, _ = run_steps(make_cfg(), DATA, 20)
    assert np.max(np.abs(l1 - l8)) <= 5e-5
    assert np.array_equal(l8, l8b)  # rerun: identical
    assert np.max(np.abs(l8 - l0)) > 1e-4  # dropout really changes the run


@pytest.mark.unit
def test_identical_images_get_different_masks():
    from models import build_model

    model = build_model("mlp", (28, 28, 1), 10, seed=0, dropout=0.5)
    x = jnp.ones((2, 28, 28, 1))
    keys = example_keys(0, jnp.int32(0), jnp.array([5, 6], jnp.int32))
    out = model(x, keys)
    assert not np.allclose(out[0], out[1])
    same = model(x, example_keys(0, jnp.int32(0), jnp.array([5, 5], jnp.int32)))
    np.testing.assert_array_equal(same[0], same[1])


@pytest.mark.unit
@pytest.mark.parametrize("mode", MODES)
def test_gradient_reductions_are_float32_under_fp16(mode):
    """XLA:CPU keeps f16 collectives as f16 (it only promotes bf16), so fp16 shows the reduction dtype."""
    from measure.hlo_text import parse_hlo_collectives

    cfg = make_cfg(
        parallel__name=mode, precision__name="fp16", precision__compute_dtype="float16", precision__loss_scale="dynamic"
    )
    _, _, exp, _ = run_steps(cfg, DATA, 0)
    layout, gb = exp.mode.batch_layout(), exp.plan.global_batch
    batch = layout.place(TrainSource(DATA, gb, 0).local_batch(0, layout.local_rows(gb)), gb)
    colls = parse_hlo_collectives(exp.steps.train.lower(exp.state, batch).compile().as_text(), 8)
    reductions = [c for c in colls if c.kind in ("all-reduce", "reduce-scatter")]
    assert reductions and all(c.dtype == "f32" for c in reductions), [(c.kind, c.dtype) for c in reductions]
    assert sum(c.payload_bytes for c in reductions) >= 203530 * 4  # every gradient byte, in float32


@pytest.mark.unit
@pytest.mark.parametrize("model", ["mlp", "cnn", "resnet", "vit", "gpt"])
def test_bf16_matmuls_and_convolutions_compute_in_bf16(model):
    """Under precision=bf16 no matmul or convolution of the train step takes two float32 operands: the model
    really computes in bf16 (a layer that promotes back to float32, as flax's ``nnx.Embed`` does with the dtype
    it was created in, made the whole GPT compute in float32). Mixed float32 x bf16 products are XLA attention's
    own backward pass (``jax.nn.dot_product_attention``)."""
    import re

    from training.build import build, plan

    gpt = model == "gpt"
    cfg = make_cfg(
        {"model": {"name": model, **({"context": 32} if gpt else {})}, "data": {"name": "synthetic"}},
        mesh__devices=1,
        train__global_batch=4,
        precision__name="bf16",
        precision__compute_dtype="bfloat16",
    )
    exp = build(plan(cfg))
    if gpt:
        batch = {"image": np.zeros((4, 32), np.int32), "label": np.zeros((4, 32), np.int32)}
    else:
        batch = {"image": np.zeros((4, *cfg.data.image_shape), np.uint8), "label": np.zeros(4, np.int32)}
    batch["index"] = np.arange(4, dtype=np.int32)
    text = exp.steps.train.lower(exp.state, exp.mode.batch_layout().place(batch, 4)).as_text()
    ops = re.findall(r"stablehlo\.(?:dot_general|convolution)[^\n]*?: \(tensor<([^>]*)>, tensor<([^>]*)>\)", text)
    assert len(ops) >= 3
    both_f32 = [(a, b) for a, b in ops if a.endswith("f32") and b.endswith("f32")]
    assert both_f32 == []
    assert sum(a.endswith("bf16") and b.endswith("bf16") for a, b in ops) >= len(ops) // 2
