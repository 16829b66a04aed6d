"""Mode-specific properties: gradient scale, replica-sync check, mesh rules, shardings, config groups."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from data.pipeline import TrainSource
from parallel import ConfigError, resolve_mesh_shape
from parallel.fsdp import shard_dim
from parallel.state import replica_divergence
from training.build import build, plan
from utils import make_cfg, mode_grads, random_dataset

DATA = random_dataset(1024)


def global_grads(mode: str, devices: int):
    exp = build(plan(make_cfg(parallel__name=mode, mesh__devices=devices, optim__name="sgd")))
    layout, gb = exp.mode.batch_layout(), exp.plan.global_batch
    batch = layout.place(TrainSource(DATA, gb, 0).local_batch(0, layout.local_rows(gb)), gb)
    if mode == "pmap":
        fn = jax.pmap(  # the state is canonical (not stacked): mapped with in_axes=None, as the mode's step does
            lambda s, b: mode_grads(exp.mode, exp.local, s.params, b, s.step, s.loss_scale.scale)[0],
            axis_name="data",
            in_axes=(None, 0),
            devices=list(exp.mode.mesh.devices.flat),
        )
        return jax.tree.map(lambda x: np.asarray(x[0]), fn(exp.state, batch))
    fn = jax.jit(lambda s, b: mode_grads(exp.mode, exp.local, s.params, b, s.step, s.loss_scale.scale)[0])
    return jax.tree.map(np.asarray, fn(exp.state, batch))


@pytest.mark.parametrize("mode", ["shard_map", "pmap", "jit_sharding", "fsdp"])
def test_gradient_scale_matches_one_device(mode):
    """Catches the classic N-times gradient (psum of already-summed grads) and the 1/N one (double mean)."""
    g1 = global_grads(mode, 1)
    g8 = global_grads(mode, 8)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g8)):
        np.testing.assert_allclose(b, a, atol=1e-7, rtol=1e-5)
    norm = lambda g: np.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in jax.tree.leaves(g)))
    assert norm(g8) / norm(g1) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.unit
def test_pmean_of_a_replicated_gradient_under_check_vma_is_n_times_too_big():
    """Documents the pitfall our shard_map mode avoids (DESIGN.md): grad w.r.t. a replicated input is psum-ed."""
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("data",))
    w = jnp.ones(3)
    x = jnp.arange(8 * 3, dtype=jnp.float32).reshape(8, 3)

    def local_loss(w, x):
        return jnp.mean(x @ w)

    def naive(w, x):
        return jax.lax.pmean(jax.grad(local_loss)(w, x), "data")

    g = jax.shard_map(naive, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())(w, x)
    np.testing.assert_allclose(g, 8 * jnp.mean(x, axis=0))


@pytest.mark.unit
@pytest.mark.parametrize("mode", ["jit_sharding", "pmap", "fsdp"])
def test_sync_check_catches_a_perturbed_replica(mode):
    cfg = make_cfg({"mesh": {"shape": [2, 4]}} if mode == "fsdp" else {}, parallel__name=mode)
    exp = build(plan(cfg))
    assert replica_divergence(exp.state.params) == 0.0
    leaf = jax.tree.leaves(exp.state.params)[0]
    shards = [np.array(s.data) for s in leaf.addressable_shards]
    shards[3] = shards[3] + 0.25  # one device's copy drifts
    bad = jax.make_array_from_single_device_arrays(
        leaf.shape, leaf.sharding, [jax.device_put(x, s.device) for x, s in zip(shards, leaf.addressable_shards)]
    )
    assert replica_divergence([bad]) == pytest.approx(0.25)


@pytest.mark.unit
@pytest.mark.parametrize("devices,mode,shape", [(1, "jit_sharding", None), (8, "fsdp", [1, 8]), (8, "fsdp", [2, 4])])
def test_sync_check_copies_only_slices_held_more_than_once(monkeypatch, devices, mode, shape):
    """A slice this process holds once (one device; an fsdp shard on mesh [1,8]) has nothing to compare: the check
    copies none of it to the host (on one GPU that copy of the whole state was most of the check's cost); a
    replicated array on 8 devices is copied 8 times, and on mesh [2,4] every fsdp shard is held twice, so every
    shard is copied."""
    cfg = make_cfg({"mesh": {"shape": shape}} if shape else {}, parallel__name=mode, mesh__devices=devices)
    exp = build(plan(cfg))
    tree = (exp.state.params, exp.state.opt_state)
    leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    if shape == [2, 4]:  # every slice is held by 2 (sharded) or 8 (replicated) devices
        expected = [s.data.shape for x in leaves for s in x.addressable_shards]
    else:
        expected = [x.shape for x in leaves if x.sharding.is_fully_replicated] * (devices if devices > 1 else 0)
    Shard = type(leaves[0].addressable_shards[0])  # jax's own class (no private import)
    copied: list[tuple] = []  # the shape of every shard whose data the check reads (to copy it to the host)
    real = Shard.data

    def counting(self):
        data = real.fget(self)
        copied.append(data.shape)
        return data

    monkeypatch.setattr(Shard, "data", property(counting))
    assert replica_divergence(tree) == 0.0
    assert sorted(copied) == sorted(expected)
    if mode == "fsdp":  # most of the state is sharded
        assert any(not x.sharding.is_fully_replicated for x in leaves) and expected


@pytest.mark.unit
def test_sync_check_compares_values_where_bits_differ():
    """Copies that differ only in their bits (-0.0 against 0.0) have difference 0; a bfloat16 copy that differs
    by one step of its precision is measured in its own values; a copy that is NaN where another is a number has
    diverged (inf), however the other copies compare; NaN and inf held by every copy are equal."""
    exp = build(plan(make_cfg(parallel__name="jit_sharding")))
    devices = list(exp.mode.mesh.devices.flat)
    sharding = jax.sharding.NamedSharding(exp.mode.mesh, jax.sharding.PartitionSpec())

    def replicated(copies):
        return jax.make_array_from_single_device_arrays(
            copies[0].shape, sharding, [jax.device_put(c, d) for c, d in zip(copies, devices)]
        )

    zeros = [np.zeros(4, np.float32) for _ in devices]
    zeros[5] = -zeros[5]
    assert replica_divergence([replicated(zeros)]) == 0.0
    ones = [np.ones(3, jnp.bfloat16) for _ in devices]
    ones[2] = np.array([1.0, 1.0078125, 1.0], jnp.bfloat16)  # the next bfloat16 after 1
    assert replica_divergence([replicated(ones)]) == 0.0078125
    nan_one = [np.ones(3, np.float32) for _ in devices]
    nan_one[4] = np.array([1.0, np.nan, 1.0], np.float32)  # one device's copy is NaN where the others are 1
    assert replica_divergence([replicated(nan_one)]) == np.inf
    nan_first = [np.array([np.nan, 1.0, 5.0], np.float32) for _ in devices]
    nan_first[0] = np.array([1.0, 1.0, 1.0], np.float32)  # the first copy differs: NaN hides no real difference
    assert replica_divergence([replicated(nan_first)]) == np.inf
    nan_all = [np.array([np.nan, np.inf, 2.0], np.float32) for _ in devices]
    nan_all[6] = np.array([np.nan, np.inf, 2.5], np.float32)  # NaN and inf in every copy: only 2 against 2.5
    assert replica_divergence([replicated(nan_all)]) == 0.5
    # 0-d arrays (Adam's step count is one): a diverged copy is measured like any other
    count = [np.array(7, np.int32) for _ in devices]
    count[3] = np.array(8, np.int32)
    assert replica_divergence([replicated(count)]) == 1.0
    signed = [np.array(0.0, np.float32) for _ in devices]
    signed[1] = np.array(-0.0, np.float32)
    assert replica_divergence([replicated(signed)]) == 0.0
    nan_scalar = [np.array(1.0, np.float32) for _ in devices]
    nan_scalar[2] = np.array(np.nan, np.float32)
    assert replica_divergence([replicated(nan_scalar)]) == np.inf


@pytest.mark.unit
def test_mesh_shape_rules():
    assert resolve_mesh_shape(None, (-1, 1), 8, "jit_sharding") == (8, 1)
    assert resolve_mesh_shape(None, (1, -1), 8, "fsdp") == (1, 8)
    assert resolve_mesh_shape([2, -1], (1, -1), 8, "fsdp") == (2, 4)
    for bad in ([3, 3], [-1, -1], [0, 8], [2, 2, 2], [3, -1]):
        with pytest.raises(ConfigError):
            resolve_mesh_shape(bad, (-1, 1), 8, "fsdp")
    with pytest.raises(ConfigError, match=r"parallel=jit_sharding needs an fsdp axis of 1"):
        plan(make_cfg({"mesh": {"shape": [2, 4]}}))


@pytest.mark.unit
def test_fsdp_sharding_rule():
    assert shard_dim((784, 256), 4, 8, 0) == 0  # largest dimension divisible by 8
    assert shard_dim((256, 10), 4, 8, 0) == 0
    assert shard_dim((10,), 4, 8, 0) is None  # no dimension fits: replicated
    assert shard_dim((784, 256), 4, 1, 0) is None  # an fsdp axis of 1 shards nothing
    assert shard_dim((256,), 4, 8, 2048) is None  # 1 KiB < min_shard_bytes: replicated
    assert shard_dim((6, 16), 4, 8, 0) == 1


@pytest.mark.unit
def test_fsdp_state_bytes_per_device():
    exp = build(plan(make_cfg(parallel__name="fsdp")))
    sharded, replicated = exp.mode.sharded_and_replicated_bytes(exp.state.params)
    assert (sharded, replicated) == (814080, 40)  # everything but the 10-element output bias is sharded
    from measure.compiled import state_bytes_per_device

    scalars = sum(x.nbytes for x in jax.tree.leaves(exp.state) if x.ndim == 0)
    assert state_bytes_per_device(exp.state) == 3 * (sharded // 8 + replicated) + scalars


def test_every_config_group_option_composes():
    import os

    from hydra import compose, initialize_config_dir

    from conf.schema import register, to_typed

    register()
    conf_dir = os.path.join(os.path.dirname(os.path.dirname(__file__)), "conf")
    groups = {
        g: sorted(f[:-5] for f in os.listdir(os.path.join(conf_dir, g)) if f.endswith(".yaml"))
        for g in ("parallel", "precision", "model", "data", "optim", "mesh", "wandb", "xla")
    }
    with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
        for group, options in groups.items():
            assert options, group
            for option in options:
                cfg = to_typed(compose(config_name="config", overrides=[f"{group}={option}"]))
                if group in ("parallel", "precision", "model", "data", "optim"):
                    presets = {"sgd_momentum": "sgd"} if group == "optim" else {}  # SGD with momentum 0.9
                    assert getattr(cfg, group).name == presets.get(option, option)
