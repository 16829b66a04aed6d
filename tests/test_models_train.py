"""Every model trains in every parallel mode on 8 devices, in fp32 and bf16, and cnn passes the mode-equivalence
test (1 vs 8 devices) of tests/test_equivalence.py. Small widths, few steps and small batches keep it fast;
the costlier models' cases (resnet, vit) are marked slow.

References are single-device runs of the same config (fp32, SGD: Adam would hide gradient-scale bugs), so
every 8-device run must reproduce the reference's losses and parameters, not merely run.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from flax import nnx

from parallel.state import replica_divergence
from utils import assert_matches_reference, make_cfg, max_abs_diff, random_dataset, run_steps

MODES = ("pmap", "jit_sharding", "shard_map", "fsdp")
SMALL = {
    "mlp": dict(hidden=16),
    "cnn": dict(width=4),
    "resnet": dict(width=4),
    "vit": dict(width=16, depth=1, patch=7, heads=2, mlp_ratio=2),
}
SLOW = {"resnet", "vit"}
STEPS = 3
BATCH = 32  # 4 examples per device
DATA = random_dataset(512, seed=4)

_reference: dict = {}


def _cfg(model: str, **dotted):
    model_kw = {f"model__{k}": v for k, v in SMALL[model].items()}
    return make_cfg(
        model__name=model, optim__name="sgd", optim__lr=0.1, train__global_batch=BATCH, **model_kw, **dotted
    )


def _reference_run(model: str):
    """(losses, host state) of the fp32 single-device run: the yardstick of every mode and precision."""
    if model not in _reference:
        losses, state, _, init = run_steps(_cfg(model, mesh__devices=1), DATA, STEPS)
        _reference[model] = (losses, state, init)
    return _reference[model]


CASES = [
    pytest.param(
        model, mode, precision, id=f"{model}-{mode}-{precision}", marks=[pytest.mark.slow] if model in SLOW else []
    )
    for model in SMALL
    for mode in MODES
    for precision in ("fp32", "bf16")
]


@pytest.mark.parametrize("model,mode,precision", CASES)
def test_model_trains_in_every_mode_and_precision(model, mode, precision):
    ref_losses, ref_state, ref_init = _reference_run(model)
    dtype = {"fp32": "float32", "bf16": "bfloat16"}[precision]
    losses, state, exp, init = run_steps(
        _cfg(model, parallel__name=mode, mesh__devices=8, precision__name=precision, precision__compute_dtype=dtype),
        DATA,
        STEPS,
    )
    assert exp.mode.num_devices == 8 and int(state.step) == STEPS
    assert max_abs_diff(init.params, ref_init.params) == 0.0  # same initial parameters, bitwise
    assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves(state.params))  # fp32 master weights
    assert replica_divergence((exp.state.params, exp.state.opt_state)) == 0.0
    assert max_abs_diff(state.params, init.params) > 1e-4  # it trained
    if precision == "fp32":  # the single-device run, reproduced
        assert np.max(np.abs(losses - ref_losses)) <= 1e-5
        assert max_abs_diff(state.params, ref_state.params) <= 1e-5
    else:  # bf16 compute (8-bit mantissa): the same function and the same updates, to bf16 precision
        assert np.max(np.abs(losses - ref_losses)) <= 0.02 * max(1.0, float(np.max(ref_losses)))
        assert _relative_update_error(state.params, ref_state.params, init.params) <= 0.1


def _relative_update_error(params, ref_params, init_params) -> float:
    """||(params - init) - (ref - init)|| / ||ref - init|| over all leaves (L2): how far an update strays."""
    flat = lambda tree: np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])
    update, ref_update = flat(params) - flat(init_params), flat(ref_params) - flat(init_params)
    return float(np.linalg.norm(update - ref_update) / np.linalg.norm(ref_update))


# ---- the mode-equivalence test of tests/test_equivalence.py, for cnn ---------------------------------------

EQ_STEPS = 12
EQ_DATA = random_dataset(1024, seed=0)
TOL = {"sgd": 1e-6, "adam": 5e-5}
LR = {"sgd": 0.1, "adam": 1e-3}
_eq_reference: dict = {}


def _eq_cfg(opt: str, **dotted):
    return make_cfg(
        model__name="cnn", model__width=4, optim__name=opt, optim__lr=LR[opt], train__global_batch=64, **dotted
    )


def _eq_reference_run(opt: str):
    if opt not in _eq_reference:
        _eq_reference[opt] = run_steps(_eq_cfg(opt, mesh__devices=1), EQ_DATA, EQ_STEPS)
    return _eq_reference[opt]


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("mode", MODES)
def test_cnn_mode_matches_single_device(mode, opt):
    run = run_steps(_eq_cfg(opt, parallel__name=mode, mesh__devices=8), EQ_DATA, EQ_STEPS)
    assert_matches_reference(run, _eq_reference_run(opt), TOL[opt], 8, EQ_STEPS)


@pytest.mark.unit
def test_cnn_equivalence_reference_actually_trains():
    """Guards the test above against comparing two runs that do nothing."""
    losses, state, _, init = _eq_reference_run("sgd")
    assert losses[0] - losses[-1] > 0.01
    assert max_abs_diff(state.params, init.params) > 1e-3


# ---- initialisers ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape,hidden,seed", [((28, 28, 1), 256, 0), ((32, 32, 3), 16, 3)])
def test_mlp_initial_params_are_bitwise_the_stock_initialiser(shape, hidden, seed, monkeypatch):
    """models.mlp uses the fast flat-drawn ``models.common.normal``; the values equal flax's stock normal."""
    import models
    import models.mlp as mlp

    fast = jax.tree.leaves(nnx.state(models.build_model("mlp", shape, 10, seed=seed, hidden=hidden), nnx.Param))
    monkeypatch.setattr(mlp, "normal", lambda stddev: nnx.initializers.normal(stddev=stddev))
    stock = jax.tree.leaves(nnx.state(models.build_model("mlp", shape, 10, seed=seed, hidden=hidden), nnx.Param))
    assert [a.shape for a in fast] == [(hidden,), (math.prod(shape), hidden), (10,), (hidden, 10)]
    assert all(np.array_equal(a, b) for a, b in zip(fast, stock, strict=True))
    assert float(np.std(fast[1])) == pytest.approx(0.01, rel=0.05)  # N(0, 0.01^2) kernel
