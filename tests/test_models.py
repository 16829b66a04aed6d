"""Model zoo contract: shapes/dtypes, Param-only state, seeding, per-example dropout, sizes, FLOPs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from models.cost import flops_per_example, param_count

NUM_CLASSES = 10
SHAPES = [(28, 28, 1), (32, 32, 3)]
# Small hyper-parameters keep compilation fast on 2 CPU cores.
SMALL = {
    "mlp": dict(hidden=16),
    "cnn": dict(width=4),
    "resnet": dict(width=8),
    "vit": dict(width=16, depth=1, patch=4, heads=2, mlp_ratio=2),
}
DROPOUT_MODELS = ["mlp", "cnn", "vit"]


@functools.lru_cache(maxsize=None)
def _model(name: str, shape: tuple, seed: int = 0, dropout: float = 0.0) -> nnx.Module:
    return models.build_model(name, shape, NUM_CLASSES, seed=seed, dropout=dropout, **SMALL[name])


@functools.lru_cache(maxsize=None)
def _apply(name: str, shape: tuple, dropout: float = 0.0):
    """The training code's functional use: split to Params, cast, merge, call (jitted)."""
    graphdef, params = nnx.split(_model(name, shape, dropout=dropout), nnx.Param)

    @jax.jit
    def apply(params, x, keys):
        params_c = jax.tree.map(lambda p: p.astype(x.dtype), params)
        return nnx.merge(graphdef, params_c)(x, keys)

    return params, apply


def _images(shape, b=4, seed=0, dtype=jnp.float32):
    return jax.random.uniform(jax.random.key(seed), (b, *shape), jnp.float32).astype(dtype)


def _params(model):
    return jax.tree.leaves(nnx.state(model, nnx.Param))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(SMALL))
def test_output_shape_dtype_finite(name, shape):
    params, apply = _apply(name, shape)
    for dtype in (jnp.float32, jnp.bfloat16):
        out = apply(params, _images(shape, dtype=dtype), None)
        assert out.shape == (4, NUM_CLASSES)
        assert out.dtype == dtype
        assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
    # float16 and eval_shape: abstract evaluation only (no compilation).
    out = jax.eval_shape(apply, params, jax.ShapeDtypeStruct((2, *shape), jnp.float16), None)
    assert out.shape == (2, NUM_CLASSES) and out.dtype == jnp.float16


@pytest.mark.unit
@pytest.mark.parametrize("name", list(SMALL))
def test_state_is_only_params(name):
    model = models.build_model(name, (28, 28, 1), NUM_CLASSES, seed=0, dropout=0.1, **SMALL[name])
    _, params, rest = nnx.split(model, nnx.Param, ...)
    assert jax.tree.leaves(params)
    assert not jax.tree.leaves(rest), f"non-Param state in {name}: {rest}"
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))


@pytest.mark.unit
@pytest.mark.parametrize("name", list(SMALL))
def test_seed_determines_params(name):
    a, b, c = (models.build_model(name, (28, 28, 1), NUM_CLASSES, seed=s, **SMALL[name]) for s in (3, 3, 4))
    pa, pb, pc = _params(a), _params(b), _params(c)
    assert all(np.array_equal(x, y) for x, y in zip(pa, pb, strict=True))
    assert any(not np.array_equal(x, y) for x, y in zip(pa, pc, strict=True) if np.any(x != 0))


@pytest.mark.unit
@pytest.mark.parametrize("name", list(SMALL))
def test_examples_independent_of_batch(name):
    """No batch statistics: an example's logits do not depend on the rest of its batch."""
    shape = (28, 28, 1)
    params, apply = _apply(name, shape)
    x = _images(shape, b=4)
    full = apply(params, x, None)
    swapped = apply(params, jnp.concatenate([x[2:], _images(shape, b=2, seed=1)]), None)
    np.testing.assert_allclose(full[2:], swapped[:2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", DROPOUT_MODELS)
def test_per_example_dropout(name):
    shape = (28, 28, 1)
    params, apply = _apply(name, shape, dropout=0.5)
    x = jnp.broadcast_to(_images(shape, b=1), (4, *shape))  # four identical images
    keys = jax.random.split(jax.random.key(7), 4)
    out1, out2 = apply(params, x, keys), apply(params, x, keys)
    np.testing.assert_array_equal(out1, out2)  # same keys -> same output
    for i in range(1, 4):  # identical images, different keys -> different outputs
        assert not np.allclose(out1[0], out1[i])
    # An example's mask depends only on its own key, not on its position in the batch.
    out_rev = apply(params, x, keys[::-1])
    np.testing.assert_allclose(out_rev[::-1], out1, rtol=1e-6, atol=1e-6)
    # Dropout changes the output: compare with the same parameters (same seed) without dropout.
    params0, apply0 = _apply(name, shape)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params0), strict=True))
    det = apply0(params0, x, None)
    assert not np.allclose(det[0], out1[0])


@pytest.mark.unit
def test_resnet_accepts_dropout_keys():
    params, apply = _apply("resnet", (28, 28, 1))
    out = jax.eval_shape(
        apply, params, jax.ShapeDtypeStruct((4, 28, 28, 1), jnp.float32), jax.random.split(jax.random.key(0), 4)
    )
    assert out.shape == (4, NUM_CLASSES)


def _abstract_model(name, shape, **kw):
    """The model with abstract (shape-only) parameters: nothing is drawn or compiled."""
    return nnx.eval_shape(lambda: models.build_model(name, shape, 10, seed=0, **kw))


@pytest.mark.unit
def test_mlp_param_count():
    model = _abstract_model("mlp", (28, 28, 1), hidden=256)
    assert param_count(model) == 784 * 256 + 256 + 256 * 10 + 10 == 203530


@pytest.mark.unit
def test_cnn_param_count_default_width():
    model = _abstract_model("cnn", (28, 28, 1), width=32)
    conv1 = 3 * 3 * 1 * 32 + 32
    conv2 = 3 * 3 * 32 * 64 + 64
    flat = 12 * 12 * 64  # 28 -(3x3 VALID)-> 26 -> 24 -(pool 2)-> 12
    dense = flat * 128 + 128
    out = 128 * 10 + 10
    assert param_count(model) == conv1 + conv2 + dense + out == 1_199_882


@pytest.mark.unit
def test_resnet_layout():
    model = _model("resnet", (32, 32, 3))
    assert len(model.blocks) == 8
    widths = [b.conv2.out_features for b in model.blocks]
    assert widths == [8, 8, 16, 16, 32, 32, 64, 64]
    assert model.stem.kernel_size == (3, 3) and model.stem.strides in (1, (1, 1))


@pytest.mark.unit
def test_vit_rejects_bad_patch():
    with pytest.raises(ValueError, match=r"(?s)(?=.*\b5\b)(?=.*\b28\b)"):
        models.build_model("vit", (28, 28, 1), 10, seed=0, width=16, depth=1, patch=5, heads=2)


@pytest.mark.unit
def test_vit_rejects_width_not_divisible_by_heads():
    with pytest.raises(ValueError, match="heads"):
        models.build_model("vit", (28, 28, 1), 10, seed=0, width=10, depth=1, patch=4, heads=4)


@pytest.mark.unit
def test_flops_per_example_mlp():
    model = _abstract_model("mlp", (28, 28, 1), hidden=256)  # only shapes are needed
    flops = flops_per_example(model, (28, 28, 1))
    # Matmuls (2 FLOPs per multiply-add): forward + weight gradients of both layers + input gradient of
    # the second one (the first layer's input gradient is not needed).
    matmul = 2 * (2 * 784 * 256 + 3 * 256 * 10)
    assert matmul <= flops <= 1.1 * matmul


@pytest.mark.unit
def test_flat_initialisers_match_stock():
    """The flat-drawn initialisers (fast to compile on CPU) give bitwise the stock initialisers' values."""
    from models.cnn import HE_NORMAL_FAN_OUT, LECUN_NORMAL, XAVIER_UNIFORM, normal

    key = jax.random.key(5)
    cases = [
        (LECUN_NORMAL, nnx.initializers.lecun_normal(), (6, 5)),
        (XAVIER_UNIFORM, nnx.initializers.xavier_uniform(), (6, 5)),
        (HE_NORMAL_FAN_OUT, nnx.initializers.variance_scaling(2.0, "fan_out", "normal"), (6, 5)),
        (normal(0.02), nnx.initializers.normal(0.02), (6, 5)),
    ]
    for ours, stock, shape in cases:
        np.testing.assert_array_equal(ours(key, shape, jnp.float32), stock(key, shape, jnp.float32))
