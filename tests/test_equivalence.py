"""Every parallel mode and device count computes the same training run as one device."""

from __future__ import annotations

import pytest

from utils import assert_matches_reference, make_cfg, max_abs_diff, random_dataset, run_steps

STEPS = 20
DATA = random_dataset(2048)
TOL = {"sgd": 1e-6, "adam": 5e-5}
LR = {"sgd": 0.1, "adam": 1e-3}

CASES = [(mode, n, None) for mode in ("pmap", "jit_sharding", "shard_map", "fsdp") for n in (1, 2, 4, 8)]
CASES += [("fsdp", 8, [1, 8]), ("fsdp", 8, [2, 4]), ("fsdp", 8, [4, 2])]

_reference: dict = {}


def reference(opt: str):
    if opt not in _reference:
        cfg = make_cfg(optim__name=opt, optim__lr=LR[opt], mesh__devices=1)
        _reference[opt] = run_steps(cfg, DATA, STEPS)
    return _reference[opt]


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("mode,devices,shape", CASES, ids=[f"{m}-{n}-{s}" for m, n, s in CASES])
def test_mode_matches_single_device(mode, devices, shape, opt):
    cfg = make_cfg(
        {"mesh": {"shape": shape}}, parallel__name=mode, mesh__devices=devices, optim__name=opt, optim__lr=LR[opt]
    )
    assert_matches_reference(run_steps(cfg, DATA, STEPS), reference(opt), TOL[opt], devices, STEPS)


@pytest.mark.unit
def test_losses_actually_change():
    """Guards the test above against comparing two runs that do nothing."""
    losses, state, _, init = reference("sgd")
    assert losses[0] - losses[-1] > 0.01
    assert max_abs_diff(state.params, init.params) > 1e-3
