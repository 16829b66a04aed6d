"""``benchmarks/bare_resnet.py`` and ``benchmarks/bare_vit.py`` compute what ``train.py model=resnet|vit
data=synthetic data.image_shape=[32,32,3]`` computes, and the counted FLOPs of their MFU are the models'.

The accelerator benchmark compares the repository with these bare scripts, so the two must train the same model
on the same batches: the same parameter shapes, count and initial distributions, the same synthetic bytes, from the
repository's initial parameters the same loss at every step and the same parameters after 3 Adam steps (float32),
and in bfloat16 the same loss and the same matmuls and convolutions (shapes and dtypes) in the gradient
computation. Small widths and depths, the code of the real sizes."""

from __future__ import annotations

import importlib.util
import math
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.extend.core import ClosedJaxpr, Jaxpr

from core.step import to_float_image
from models import build_model
from models.resnet import flops_per_example as resnet_flops
from models.vit import flops_per_example as vit_flops
from training.build import build, load_data, plan
from utils import REPO, make_cfg

IMAGE_SHAPE, CLASSES, BATCH, STEPS, LR = (32, 32, 3), 10, 8, 3, 1e-3
# small sizes of the benchmarked workloads (ResNet-18 width 64; ViT 384 x 12, 6 heads): every layer kind kept
MODELS = {
    "resnet": {"name": "resnet", "width": 8},
    "vit": {"name": "vit", "width": 48, "depth": 2, "heads": 3, "patch": 4, "mlp_ratio": 4},
}
BF16 = {"name": "bf16", "compute_dtype": "bfloat16", "loss_scale": "none"}


def bare_module(name: str):
    script = {"resnet": "bare_resnet", "vit": "bare_vit"}[name]
    spec = importlib.util.spec_from_file_location(script, str(REPO / "benchmarks" / f"{script}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def as_bare_layout(tree):
    """The repository's pure-dict params (blocks keyed 0..L-1) in the bare scripts' layout (blocks a list)."""
    blocks = tree["blocks"]
    return {**tree, "blocks": [blocks[i] for i in range(len(blocks))]}


def bare_init(bare, name: str, key):
    m = MODELS[name]
    if name == "resnet":
        return bare.init_params(key, m["width"], IMAGE_SHAPE, CLASSES)
    return bare.init_params(key, m["width"], m["depth"], m["heads"], m["patch"], m["mlp_ratio"], IMAGE_SHAPE, CLASSES)


def bare_count(bare, name: str) -> int:
    m = MODELS[name]
    if name == "resnet":
        return bare.param_count(m["width"], IMAGE_SHAPE, CLASSES)
    return bare.param_count(m["width"], m["depth"], m["patch"], m["mlp_ratio"], IMAGE_SHAPE, CLASSES)


def product_model(name: str, **override):
    kw = {**{k: v for k, v in MODELS[name].items() if k != "name"}, **override}
    return build_model(name, IMAGE_SHAPE, CLASSES, seed=0, **kw)


def experiment(name: str, precision: dict):
    """(config, built experiment, synthetic training source) of ``train.py model=<name> data=synthetic
    data.image_shape=[32,32,3]`` on 1 device, global batch ``BATCH``."""
    cfg = make_cfg(
        {
            "model": MODELS[name],
            "data": {"name": "synthetic", "image_shape": list(IMAGE_SHAPE), "num_classes": CLASSES},
            "precision": precision,
        },
        mesh__devices=1,
        train__global_batch=BATCH,
    )
    p = plan(cfg)
    exp = build(p)
    source, _ = load_data(cfg, p)
    return cfg, exp, source


def sub_jaxprs(eqn):
    for v in eqn.params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(x, ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, Jaxpr):
                yield x


def matmul_eqns(jaxpr: Jaxpr):
    """Every ``dot_general`` and ``conv_general_dilated`` of ``jaxpr`` and the jaxprs inside it."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
            yield eqn
        for sub in sub_jaxprs(eqn):
            yield from matmul_eqns(sub)


def all_eqns(jaxpr: Jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in sub_jaxprs(eqn):
            yield from all_eqns(sub)


def transcendentals(closed: ClosedJaxpr) -> Counter:
    """How many of each transcendental op (the softmaxes' exp and log, the norms' rsqrt, GELU's tanh) ``closed``
    holds, by result dtype: where the loss, softmaxes, norms and activations compute."""
    names = ("exp", "log", "log1p", "rsqrt", "tanh", "logistic", "erf")
    return Counter(
        (e.primitive.name, str(e.outvars[0].aval.dtype)) for e in all_eqns(closed.jaxpr) if e.primitive.name in names
    )


def matmul_signatures(closed: ClosedJaxpr) -> Counter:
    """How many matmuls/convolutions of each (kind, operand and result shapes and dtypes) ``closed`` holds."""
    return Counter(
        (e.primitive.name, tuple((tuple(v.aval.shape), str(v.aval.dtype)) for v in (*e.invars, *e.outvars)))
        for e in matmul_eqns(closed.jaxpr)
    )


def matmul_flops(closed: ClosedJaxpr) -> int:
    """2 x the multiply-adds of the matmuls and convolutions of ``closed`` (a convolution's taps on its padding
    included; no grouped convolutions)."""
    total = 0
    for e in matmul_eqns(closed.jaxpr):
        lhs, rhs = (v.aval.shape for v in e.invars[:2])
        out = math.prod(e.outvars[0].aval.shape)
        if e.primitive.name == "dot_general":
            (contract, _), _ = e.params["dimension_numbers"]
            total += 2 * out * math.prod(lhs[d] for d in contract)
        else:
            assert e.params["feature_group_count"] == 1
            total += 2 * out * math.prod(rhs[d] for d in e.params["dimension_numbers"].rhs_spec[1:])
    return total


@pytest.mark.unit
@pytest.mark.parametrize("name", ["resnet", "vit"])
def test_bare_image_model_has_the_repository_parameters(name):
    """Same tree, shapes and count; the same initial distributions: every constant leaf equal (biases, norms, the
    zero-initialised last norm of a block, the class token), every drawn leaf within 20% of the repository's
    standard deviation, and bounded the same way (uniform: max |x| = sqrt(3) std; truncated at 2 standard normal
    deviations: 2.27 std; a normal draw of 500 values or more exceeds 2.35 std)."""
    bare = bare_module(name)
    own = jax.device_get(bare_init(bare, name, jax.random.key(1)))
    repo = as_bare_layout(jax.device_get(nnx.to_pure_dict(nnx.state(product_model(name), nnx.Param))))
    assert jax.tree.map(np.shape, own) == jax.tree.map(np.shape, repo)
    n = sum(x.size for x in jax.tree.leaves(repo))
    assert sum(x.size for x in jax.tree.leaves(own)) == bare_count(bare, name) == n
    assert n == {"resnet": 176_402, "vit": 62_650}[name]
    checked = bounded = 0
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(repo), jax.tree.leaves(own), jax.tree.leaves(repo)):
        where = jax.tree_util.keystr(path[0])
        if np.all(b == b.flat[0]):
            np.testing.assert_array_equal(a, b, err_msg=where)
            continue
        assert b.size >= 100 and abs(a.std() / b.std() - 1) < 0.2, (where, a.std(), b.std())
        bound_a, bound_b = np.abs(a).max() / a.std(), np.abs(b).max() / b.std()
        if b.size >= 500:
            assert (bound_a < 2.35) == (bound_b < 2.35), (where, bound_a, bound_b)
            checked += 1
        if b.size >= 500 and bound_b < 2.35:
            assert abs(bound_a / bound_b - 1) < 0.1, (where, bound_a, bound_b)
            bounded += 1
    assert checked >= 3 and bounded >= 1  # the bound check saw drawn leaves of both kinds


@pytest.mark.unit
@pytest.mark.parametrize("name", ["resnet", "vit"])
def test_bare_image_steps_are_the_repository_steps(name):
    """From the repository's initial parameters, on the repository's synthetic batches (the bare script's own
    generator gives the same bytes), 3 Adam steps of the bare script give the repository's loss at each step
    (measured: within 1e-7, relative) and its parameters after them (measured: within 4e-7 for the ResNet, 5e-6 for
    the ViT, the key bias aside), float32."""
    bare = bare_module(name)
    cfg, exp, source = experiment(name, {})
    layout = exp.mode.batch_layout()
    params = as_bare_layout(jax.device_get(exp.state.params))
    tx = optax.adam(LR)
    step = jax.jit(bare.make_train_step(tx, jnp.float32))
    make = jax.jit(bare.synthetic_batch_fn(BATCH, IMAGE_SHAPE, CLASSES, 0, cfg.data.train_size))
    opt_state, state, losses = tx.init(params), exp.state, []
    for s in range(STEPS):
        batch = source.device_batch(s, layout)
        image, label = make(jnp.int32(s))
        np.testing.assert_array_equal(np.asarray(image), np.asarray(batch["image"]))
        np.testing.assert_array_equal(np.asarray(label), np.asarray(batch["label"]))
        state, metrics = exp.steps.train(state, batch)
        params, opt_state, loss = step(params, opt_state, image, label)
        losses.append(float(loss))
        np.testing.assert_allclose(float(loss), float(metrics["train/loss"]), rtol=1e-6)
    assert len(set(losses)) == STEPS and losses[-1] < losses[0]  # three batches; it trains
    final = as_bare_layout(jax.device_get(state.params))
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(final), jax.tree.leaves(params), jax.tree.leaves(final)):
        where = jax.tree_util.keystr(path[0])
        # the attention's key bias has a zero gradient in exact arithmetic (softmax ignores a constant per query):
        # Adam turns its float32 noise into steps of up to the learning rate, different in the two programs
        atol = STEPS * LR if where.endswith("['key']['bias']") else 2e-5
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=atol, err_msg=where)


@pytest.mark.unit
@pytest.mark.parametrize("name", ["resnet", "vit"])
def test_bare_image_bf16_loss_and_matmuls_are_the_repository_ones(name):
    """bfloat16 (``precision=bf16``: float32 master weights, bfloat16 forward and backward, float32 logits and
    loss): on the repository's first batch from its initial parameters the bare loss is the repository's within
    2e-3 (measured 7.6e-4 for the ResNet, 0 for the ViT; both 0 with ``--xla_allow_excess_precision=false``: XLA
    keeps some bfloat16 intermediates in float32, differently in the two programs), the gradients are float32
    and as large (global norms within 2%), and the gradient computations hold the same matmuls and convolutions:
    the same operand and result shapes and dtypes, the same number of each, none of two float32 operands; and the
    same transcendental ops in the same dtypes (the loss's log-softmax and the norms in float32, GELU's tanh in
    bfloat16)."""
    bare = bare_module(name)
    _, exp, source = experiment(name, BF16)
    params = jax.device_get(exp.state.params)
    batch = source.device_batch(0, exp.mode.batch_layout())
    image, label = batch["image"], batch["label"]

    def repo_grads(p):
        sums, metrics = exp.local(p, {"image": image, "label": label}, jnp.int32(0), jnp.float32(1.0))
        return metrics["loss_sum"] / BATCH, jax.tree.map(lambda g: g / BATCH, sums)

    def bare_grads(p):
        return jax.value_and_grad(bare.loss_fn)(as_bare_layout(p), image, label, jnp.bfloat16)

    want_loss, want = jax.jit(repo_grads)(params)
    got_loss, got = jax.jit(bare_grads)(params)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=2e-3)
    assert {x.dtype for x in jax.tree.leaves(got)} == {jnp.dtype(jnp.float32)}
    assert abs(float(optax.global_norm(got)) / float(optax.global_norm(want)) - 1) < 0.02
    repo_jaxpr, bare_jaxpr = jax.make_jaxpr(repo_grads)(params), jax.make_jaxpr(bare_grads)(params)
    repo_mm = matmul_signatures(repo_jaxpr)
    assert matmul_signatures(bare_jaxpr) == repo_mm
    assert transcendentals(bare_jaxpr) == transcendentals(repo_jaxpr)
    assert transcendentals(repo_jaxpr)[("log", "float32")] == 1  # the loss's log-sum-exp, in float32
    # none has two float32 operands (attention's backward multiplies float32 probabilities' cotangents by
    # bfloat16 values inside jax.nn.dot_product_attention, in both programs)
    assert all("bfloat16" in (sig[0][1], sig[1][1]) for _, sig in repo_mm)


@pytest.mark.unit
def test_counted_flops_are_the_models_matmuls():
    """``models.resnet.flops_per_example`` and ``models.vit.flops_per_example`` (the MFU of the accelerator
    benchmark's image workloads) are 3 x 2 x the multiply-adds of every convolution and matmul of the model's
    forward pass, counted from its jaxpr (padding taps included), at the small sizes and at the benchmarked
    ones (ResNet-18 width 64: 0.5554 G multiply-adds; the ViT 384 x 12: 1.4203 G)."""
    cases = [
        ("resnet", {"width": 8}, lambda: resnet_flops(IMAGE_SHAPE, CLASSES, 8)),
        ("resnet", {"width": 64}, lambda: resnet_flops(IMAGE_SHAPE, CLASSES, 64)),
        ("vit", {}, lambda: vit_flops(IMAGE_SHAPE, CLASSES, width=48, depth=2, patch=4, mlp_ratio=4)),
        ("vit", {"width": 384, "depth": 12, "heads": 6}, lambda: vit_flops(IMAGE_SHAPE, CLASSES, width=384, depth=12)),
    ]
    for name, override, counted in cases:
        model = nnx.eval_shape(lambda: product_model(name, **override))
        graphdef, state = nnx.split(model)
        forward = lambda s, x: nnx.merge(graphdef, s)(to_float_image(x, jnp.float32))
        x = jax.ShapeDtypeStruct((1, *IMAGE_SHAPE), jnp.uint8)
        assert counted() == 3 * matmul_flops(jax.make_jaxpr(forward)(state, x)), (name, override)
    assert resnet_flops(IMAGE_SHAPE, CLASSES, 64) == 6 * 555_422_720
    assert vit_flops(IMAGE_SHAPE, CLASSES, width=384, depth=12) == 6 * 1_420_309_248
