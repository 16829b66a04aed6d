"""Gradient accumulation: K microbatches per device, ONE reduction and ONE update per optimizer step."""

from __future__ import annotations

import numpy as np
import pytest

from measure.hlo_text import parse_hlo_collectives
from utils import full_hlo_parse, make_cfg, max_abs_diff, random_dataset, run_steps

DATA = random_dataset(4096)
MODES = ("pmap", "jit_sharding", "shard_map", "fsdp")
_ref: dict = {}


def reference(opt, steps):
    key = (opt, steps)
    if key not in _ref:
        _ref[key] = run_steps(
            make_cfg(optim__name=opt, optim__lr=0.1 if opt == "sgd" else 1e-3, mesh__devices=1), DATA, steps
        )
    return _ref[key]


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_one_sgd_step_equals_big_batch(mode, k):
    losses_ref, state_ref, _, _ = reference("sgd", 1)
    cfg = make_cfg(parallel__name=mode, train__accum_steps=k, optim__name="sgd", optim__lr=0.1)
    losses, state, exp, _ = run_steps(cfg, DATA, 1)
    assert exp.mode.num_devices == 8
    assert abs(losses[0] - losses_ref[0]) <= 1e-6
    assert max_abs_diff(state.params, state_ref.params) <= 1e-6


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_ten_adam_steps_equal_big_batch(mode, k):
    losses_ref, state_ref, _, _ = reference("adam", 10)
    cfg = make_cfg(parallel__name=mode, train__accum_steps=k)
    losses, state, _, _ = run_steps(cfg, DATA, 10)
    assert np.max(np.abs(losses - losses_ref)) <= 5e-5
    assert max_abs_diff(state.params, state_ref.params) <= 5e-5
    assert max_abs_diff(state.opt_state, state_ref.opt_state) <= 5e-5


def _compiled_collectives(mode, k, **kw):
    cfg = make_cfg(parallel__name=mode, train__accum_steps=k, optim__name="sgd", **kw)
    _, _, exp, _ = run_steps(cfg, DATA, 1)
    from data.pipeline import TrainSource

    layout = exp.mode.batch_layout()
    src = TrainSource(DATA, exp.plan.global_batch, 0)
    batch = layout.place(src.local_batch(0, layout.local_rows(exp.plan.global_batch)), exp.plan.global_batch)
    text = exp.steps.train.lower(exp.state, batch).compile().as_text()
    colls = parse_hlo_collectives(text, num_devices=8)
    assert colls == full_hlo_parse(text, num_devices=8)  # the pre-filter skips nothing that matters
    return colls, exp


@pytest.mark.parametrize("mode", MODES)
def test_k4_reduces_each_gradient_once_outside_the_loop(mode):
    colls, exp = _compiled_collectives(mode, 4)
    assert colls, "expected gradient collectives"
    assert [c for c in colls if c.in_loop] == []
    param_bytes = 203530 * 4
    reduce_kinds = [c for c in colls if c.kind in ("all-reduce", "reduce-scatter")]
    if mode == "fsdp":
        # sharded arrays: one reduce-scatter per microbatch (each microbatch's gradient is scattered as it is
        # produced, so no full-size gradient is accumulated), outside any loop (the loop is unrolled); one
        # gather (the 4 microbatches' gathers of these weights are one computation); replicated ones: all-reduce
        sharded, replicated = exp.mode.sharded_and_replicated_bytes(exp.state.params)
        assert sum(c.payload_bytes for c in colls if c.kind == "reduce-scatter") == 4 * sharded
        assert sum(c.payload_bytes for c in colls if c.kind == "all-gather") == sharded
        assert sharded + replicated == param_bytes
    else:
        assert all(c.kind == "all-reduce" for c in reduce_kinds)
        # every gradient byte reduced exactly once (+ 2 float32 metric sums)
        assert sum(c.payload_bytes for c in reduce_kinds) == param_bytes + 8


@pytest.mark.unit
def test_global_batch_must_divide_by_k_times_devices():
    from parallel import ConfigError
    from training.build import plan

    with pytest.raises(ConfigError, match=r"train.global_batch=256 .*mesh.devices=8 x train.accum_steps=3 = 24"):
        plan(make_cfg(train__accum_steps=3))
