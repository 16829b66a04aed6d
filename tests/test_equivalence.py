"""Every parallel mode and device count computes the same training run as one device."""

from __future__ import annotations

import numpy as np
import pytest

from utils import make_cfg, max_abs_diff, random_dataset, run_steps

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
    ref_losses, ref_state, _, ref_init = reference(opt)
    cfg = make_cfg({"mesh": {"shape": shape}}, parallel__name=mode, mesh__devices=devices, optim__name=opt,
                   optim__lr=LR[opt])
    losses, state, exp, init = run_steps(cfg, DATA, STEPS)
    # identical initial parameters, bitwise, for every mode and device count
    assert max_abs_diff(init.params, ref_init.params) == 0.0
    assert exp.mode.num_devices == devices
    assert np.max(np.abs(losses - ref_losses)) <= TOL[opt]
    assert max_abs_diff(state.params, ref_state.params) <= TOL[opt]
    assert max_abs_diff(state.opt_state, ref_state.opt_state) <= TOL[opt]
    # replicas stay bitwise identical
    assert exp.mode.replica_divergence((exp.state.params, exp.state.opt_state)) == 0.0
    assert int(state.step) == STEPS


def test_losses_actually_change():
    """Guards the test above against comparing two runs that do nothing."""
    losses, state, _, init = reference("sgd")
    assert losses[0] - losses[-1] > 0.01
    assert max_abs_diff(state.params, init.params) > 1e-3
