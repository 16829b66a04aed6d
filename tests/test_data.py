"""Input pipeline: epoch permutation, per-process slices, exact padded evaluation, TFDS loading and cache."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from data.pipeline import BatchLayout, TrainSource, eval_batch_size, make_eval_set
from core.errors import ConfigError
from data.sources import DataError, HostDataset, load_tfds_split
from parallel.state import host_abstract, place_state, state_to_host
from training.build import build, plan
from training.hooks import evaluate
from utils import SHARED_TFDS, make_cfg, random_dataset, run_steps


def mnist_or_random(split: str, tmp_cache) -> HostDataset:
    if SHARED_TFDS.exists():
        return load_tfds_split("mnist", split, str(SHARED_TFDS), str(tmp_cache))
    return random_dataset(60000 if split == "train" else 10000, seed=1)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    import os

    # the real cache (decoding 70,000 PNGs takes ~17 s; the cache is outside the repository)
    return os.path.expanduser("~/.cache/dp_scaling")


@pytest.mark.unit
def test_one_epoch_visits_59904_distinct_examples_and_repeats_with_the_seed():
    ds = HostDataset(np.zeros((60000, 1, 1, 1), np.uint8), np.zeros(60000, np.int32))
    src = TrainSource(ds, 256, seed=0)
    assert src.steps_per_epoch == 234
    epoch0 = np.concatenate([src.global_indices(s) for s in range(234)])
    assert epoch0.size == 59904 and np.unique(epoch0).size == 59904
    again = TrainSource(ds, 256, seed=0)
    assert np.array_equal(epoch0, np.concatenate([again.global_indices(s) for s in range(234)]))
    epoch1 = np.concatenate([src.global_indices(s) for s in range(234, 468)])
    assert np.unique(epoch1).size == 59904 and not np.array_equal(epoch0, epoch1)
    other_seed = TrainSource(ds, 256, seed=1)
    assert not np.array_equal(epoch0[:256], other_seed.global_indices(0))


@pytest.mark.unit
@pytest.mark.parametrize("processes", [1, 2, 4, 8])
def test_process_slices_make_up_the_global_batch(processes):
    ds = random_dataset(4096)
    src = TrainSource(ds, 256, seed=0)
    for step in (0, 7, 15):
        rows = [BatchLayout(None, tuple, p, processes).local_rows(256) for p in range(processes)]
        parts = [src.local_batch(step, r)["index"] for r in rows]
        assert all(p.size == 256 // processes for p in parts)
        assert np.array_equal(np.concatenate(parts), src.global_indices(step))  # contiguous, in order


@pytest.mark.unit
@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_prefetch_depth_changes_no_batch_and_zero_starts_no_thread(prefetch):
    import threading

    import jax

    from data.pipeline import train_batches

    ds = random_dataset(1024)
    src = TrainSource(ds, 64, seed=0)
    layout = BatchLayout(jax.sharding.SingleDeviceSharding(jax.devices()[0]), lambda shape: shape, 0, 1)
    before = {t.name for t in threading.enumerate()}
    it = train_batches(src, layout, 3, 9, prefetch)
    first = next(it)
    started = {t.name for t in threading.enumerate()} - before
    assert ("batch-prefetch" in started) == (prefetch > 0)
    got = [first, *it]
    assert len(got) == 6
    for step, batch in zip(range(3, 9), got):
        np.testing.assert_array_equal(np.asarray(batch["index"]), src.global_indices(step))
        np.testing.assert_array_equal(np.asarray(batch["image"]), ds.images[src.global_indices(step)])
    with pytest.raises(ValueError, match="prefetch=-1"):
        next(train_batches(src, layout, 0, 1, -1))


@pytest.mark.unit
def test_eval_batch_is_padded_to_a_multiple_of_the_devices():
    assert eval_batch_size(999, 8, 1) == 1000
    assert eval_batch_size(1000, 8, 1) == 1000
    assert eval_batch_size(768, 8, 2) == 768
    assert eval_batch_size(5, 8, 1) == 8


@pytest.mark.unit
def test_eval_batch_is_no_larger_than_the_split_padded_to_the_devices():
    # the Tiny Shakespeare validation split of size tiny: 435 windows of 128 bytes (train.eval_batch=1000)
    assert eval_batch_size(1000, 1, 1, 435) == 435
    assert eval_batch_size(1000, 8, 1, 435) == 440
    assert eval_batch_size(1000, 8, 2, 435) == 440
    assert eval_batch_size(1000, 8, 1, 10_000) == 1000  # MNIST: unchanged
    assert eval_batch_size(512, 8, 1, 513) == 512


@pytest.fixture(scope="module")
def trained_host_state(cache_dir):
    train = mnist_or_random("train", cache_dir)
    _, state, _, _ = run_steps(make_cfg(mesh__devices=1), train, 30)
    return state


@pytest.mark.parametrize("mode", ["jit_sharding", "pmap", "fsdp"])
def test_evaluation_is_exact_for_any_batch_and_device_count(mode, trained_host_state, cache_dir):
    test = mnist_or_random("test", cache_dir)
    results = {}
    for devices in (1, 8):
        exp = build(plan(make_cfg(parallel__name=mode, mesh__devices=devices)))
        state = place_state(exp.mode, trained_host_state)
        for eval_batch in (1000, 768, 999):
            es = make_eval_set(test, eval_batch, devices, exp.mode.batch_layout())
            assert es.num_examples == 10000
            results[(devices, eval_batch)] = evaluate(exp, state.params, es)
    ref = results[(1, 1000)]
    assert 0.5 < ref["eval/accuracy"] < 1.0
    for key, r in results.items():
        assert r["eval/accuracy"] == ref["eval/accuracy"], key  # exactly: the denominator is 10,000
        assert abs(r["eval/loss"] - ref["eval/loss"]) <= 1e-6, key


@pytest.mark.unit
def test_missing_dataset_is_one_line_with_the_ways_out(tmp_path):
    with pytest.raises(DataError) as err:
        load_tfds_split("mnist", "train", str(tmp_path / "nowhere"), str(tmp_path / "cache"))
    msg = str(err.value)
    assert "\n" not in msg and str(tmp_path / "nowhere") in msg
    assert "TFDS_DATA_DIR" in msg and "data=synthetic" in msg


@pytest.mark.unit
@pytest.mark.skipif(not SHARED_TFDS.exists(), reason="needs the prepared MNIST copy in ../shared")
def test_decoded_arrays_are_cached(tmp_path):
    first = load_tfds_split("mnist", "test", str(SHARED_TFDS), str(tmp_path))
    assert (tmp_path / "mnist-3.0.1-test.npz").exists()
    t0 = time.perf_counter()
    second = load_tfds_split("mnist", "test", str(SHARED_TFDS), str(tmp_path))
    assert time.perf_counter() - t0 < 2.0
    assert first.images.dtype == np.uint8 and first.images.shape == (10000, 28, 28, 1)
    assert np.array_equal(first.images, second.images) and np.array_equal(first.labels, second.labels)
    # canonical MNIST test label counts
    assert np.bincount(first.labels).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def _host_and_device_batches(mode: str, start: int, end: int, with_index: bool, global_batch: int = 64):
    import jax

    from data.pipeline import DeviceSource, train_batches

    ds = random_dataset(1000)  # 15 steps of 64 per epoch (40 examples dropped)
    exp = build(plan(make_cfg(parallel={"name": mode}, mesh__devices=8, train__global_batch=global_batch)))
    layout = exp.mode.batch_layout()
    host = list(train_batches(TrainSource(ds, global_batch, 3, with_index), layout, start, end, prefetch=0))
    device_source = DeviceSource(ds, global_batch, 3, with_index)
    # under the strictest guard (train.transfer_guard=disallow_explicit): the pipeline's own placements (the split,
    # each epoch's order) are allowed, and nothing else goes to the devices, per step or at an epoch boundary
    with jax.transfer_guard("disallow_explicit"):
        device = list(device_source.device_batches(layout, start, end))
    return host, device, device_source


@pytest.mark.unit
@pytest.mark.parametrize("mode", ["jit_sharding", "pmap", "fsdp"])
@pytest.mark.parametrize("with_index", [True, False])
def test_device_source_gathers_the_host_batches_value_for_value_in_their_sharding(mode, with_index):
    # from the middle of epoch 0 (a resumed run) across the epoch boundary at step 15 into epoch 1
    host, device, source = _host_and_device_batches(mode, 11, 19, with_index)
    assert len(host) == len(device) == 8
    assert source.split_bytes == 1000 * 28 * 28 + 1000 * 4
    for h, d in zip(host, device):
        assert sorted(h) == sorted(d) == sorted(["image", "label"] + (["index"] if with_index else []))
        for key in h:
            assert d[key].dtype == h[key].dtype and d[key].shape == h[key].shape
            assert d[key].sharding == h[key].sharding
            np.testing.assert_array_equal(np.asarray(d[key]), np.asarray(h[key]))


@pytest.mark.unit
@pytest.mark.parametrize("mode", ["jit_sharding", "pmap", "fsdp"])
def test_device_source_gather_is_partitioned_each_device_gathers_its_own_rows_with_no_collective(mode):
    import re

    import jax

    from data.pipeline import DeviceSource

    exp = build(plan(make_cfg(parallel={"name": mode}, mesh__devices=8, train__global_batch=64)))
    layout = exp.mode.batch_layout()
    source = DeviceSource(random_dataset(1000), 64, 0, with_index=False)
    split = (jax.ShapeDtypeStruct((1000, 784), np.uint8), jax.ShapeDtypeStruct((1000,), np.int32))
    order, pos = jax.ShapeDtypeStruct((15, 64), np.int32), jax.ShapeDtypeStruct((), np.int32)
    hlo = source.gather_program(layout).lower(split, order, pos).compile().as_text()
    assert not re.findall(r"all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute", hlo)
    gathers = re.findall(r"= u8\[([\d,]+)\]\S* gather\(", hlo)  # the image rows each device gathers
    assert gathers and all(shape.split(",")[0] == "8" for shape in gathers), gathers  # 64 / 8 devices


def _fed_and_host_steps(mode: str, optim: str, start: int, end: int, **dotted):
    """Steps ``[start, end)`` from the same state at step ``start``: the step built with the split's feed (the
    gather inside it, under the strictest transfer guard) and the step fed host batches. Returns (fed losses,
    host losses, fed host state, host host state, fed experiment, host experiment, (lowered, compiled) of the fed
    step, of the host step)."""
    import jax
    import jax.numpy as jnp

    from data.pipeline import DeviceSource, train_batches
    from training.build import batches_need_index

    ds = random_dataset(1000)  # 15 steps of 64 per epoch (40 examples dropped)
    cfg = make_cfg(parallel={"name": mode}, mesh__devices=8, train__global_batch=64, optim__name=optim, **dotted)
    source = DeviceSource(ds, 64, 3, with_index=batches_need_index(cfg))
    fed, host = build(plan(cfg), feed_for=source.feed), build(plan(cfg))
    out = {}
    for exp, feeding in ((fed, True), (host, False)):
        layout = exp.mode.batch_layout()
        state = exp.state.replace(step=jax.device_put(jnp.int32(start), exp.state.step.sharding))  # a resumed run
        if feeding:
            batches = source.device_feeds(layout, start, end)
        else:
            batches = train_batches(TrainSource(ds, 64, 3, source.with_index), layout, start, end, prefetch=0)
        first = next(batches)
        lowered = exp.steps.train.lower(state, first)
        compiled = lowered.compile()
        losses, batch = [], first
        with jax.transfer_guard("disallow_explicit" if feeding else "allow"):
            for step in range(start, end):
                if step > start:
                    batch = next(batches)
                state, metrics = compiled(state, batch)
                losses.append(metrics["train/loss"])
        out[feeding] = (np.asarray(jax.device_get(losses)), state_to_host(state), (lowered, compiled))
    return out[True][0], out[False][0], out[True][1], out[False][1], fed, host, out[True][2], out[False][2]


@pytest.mark.unit
@pytest.mark.parametrize("mode", ["jit_sharding", "fsdp", "shard_map"])
@pytest.mark.parametrize("optim", ["adam", "sgd"])
def test_step_with_the_gather_inside_trains_exactly_as_host_batches(mode, optim):
    import jax

    # from the middle of epoch 0 (a resumed run) across the epoch boundary at step 15 into epoch 1
    fed_losses, host_losses, fed_state, host_state, fed, host, _, _ = _fed_and_host_steps(mode, optim, 11, 19)
    assert fed.feed is not None and host.feed is None
    assert len(fed_losses) == 8 and np.all(np.diff(fed_losses[:4]) != 0)  # real, changing losses
    # exact: the same operations on the same values (an XLA release that fused them differently could, in
    # principle, reorder a float sum; then this would need a tolerance, not a different claim)
    np.testing.assert_array_equal(fed_losses, host_losses)
    for a, b in zip(jax.tree.leaves(fed_state), jax.tree.leaves(host_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(fed_state.step) == 19


@pytest.mark.unit
@pytest.mark.parametrize("keyed", [{"model__dropout": 0.5}, {"data__augment": "true"}])
def test_step_with_the_gather_inside_uses_the_example_index_for_per_example_keys(keyed):
    # dropout and augmentation draw per-example keys from the batch's index: the gathered index must be the host's
    fed_losses, host_losses, *_ = _fed_and_host_steps("jit_sharding", "adam", 13, 17, **keyed)
    np.testing.assert_array_equal(fed_losses, host_losses)


@pytest.mark.unit
@pytest.mark.parametrize("mode", ["jit_sharding", "fsdp", "shard_map"])
def test_step_with_the_gather_inside_communicates_exactly_what_the_step_on_host_batches_does(mode):
    import re

    from measure.compiled import compiled_step_metrics

    *_, fed, host, fed_compiled, host_compiled = _fed_and_host_steps(mode, "adam", 0, 1)
    metrics = [compiled_step_metrics(*program, 8) for program in (fed_compiled, host_compiled)]
    comm = [{k: v for k, v in m.items() if k.startswith("comm/")} for m in metrics]
    assert comm[0]["comm/bytes_per_step"] > 0 and comm[0]["comm/collectives"]
    assert comm[0] == comm[1]  # the same collectives, byte for byte: the gather adds none
    # and it is partitioned: each device gathers its own 8 of the 64 image rows (a replicated gather would add
    # no collective either, so the gathers' shapes are checked)
    gathers = re.findall(r"= u8\[([\d,]+)\]\S* gather\(", fed_compiled[1].as_text())
    assert gathers and all(shape.split(",")[0] == "8" for shape in gathers), gathers
    assert not re.findall(r"= u8\[([\d,]+)\]\S* gather\(", host_compiled[1].as_text())


@pytest.mark.unit
def test_pmap_keeps_the_gather_as_a_program_of_its_own():
    from data.pipeline import DeviceSource

    source = DeviceSource(random_dataset(1000), 64, 0, with_index=False)
    exp = build(plan(make_cfg(parallel={"name": "pmap"}, mesh__devices=8, train__global_batch=64)), source.feed)
    assert exp.feed is None and not exp.mode.fuses_feed
    with pytest.raises(ValueError, match="^parallel=pmap cannot gather its batches inside the train step$"):
        feed = source.feed(exp.mode.batch_layout())
        exp.mode.build(exp.local, exp.updater, host_abstract(exp.state), feed=feed)


def _run_on_random_data(run_dir, **dotted) -> dict:
    """``training.run.run`` in-process on 1,000 random MNIST-shaped examples (15 steps of 64 per epoch), 8
    devices, the split on the devices, W&B disabled; returns the summary."""
    from unittest import mock

    from training.report import Reporter
    from training.run import run

    settings = {"wandb__mode": "disabled", "checkpoint__enabled": "false", "train__log_every": 5, **dotted}
    cfg = make_cfg(data={"on_device": True}, mesh__devices=8, train__global_batch=64, **settings)
    run_dir.mkdir(parents=True, exist_ok=True)
    reporter = Reporter(run_dir)
    try:
        with mock.patch("data.load.load_tfds_split", return_value=random_dataset(1000)):
            return run(cfg, run_dir, reporter)
    finally:
        reporter.close()


def _losses(run_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


@pytest.mark.unit
def test_a_run_with_the_split_on_the_devices_says_where_the_gather_runs(tmp_path):
    def summary(name: str, **dotted) -> dict:
        return _run_on_random_data(tmp_path / name, train__steps=17, **dotted)  # across the epoch boundary at 15

    runs = {
        "in the step": summary("a", parallel__name="jit_sharding"),
        "pmap": summary("b", parallel__name="pmap"),  # the gather stays a program of its own
        "index dump": summary("c", parallel__name="jit_sharding", train__debug_dump_indices="true"),
        "host batches": summary("d", parallel__name="jit_sharding", data__on_device="false"),
    }
    assert [r["data/gather_in_step"] for r in list(runs.values())[:3]] == [True, False, False]
    assert "data/gather_in_step" not in runs["host batches"] and runs["host batches"]["data/on_device"] is False
    assert all(r["data/on_device"] for r in list(runs.values())[:3])
    dumped = [json.loads(line) for line in (tmp_path / "c" / "debug_indices_process0.jsonl").read_text().splitlines()]
    assert [d["step"] for d in dumped] == list(range(17)) and all(len(d["indices"]) == 64 for d in dumped)
    # the same training whichever way the batch is gathered (pmap reduces in another order: not compared)
    losses = {k: _losses(tmp_path / d) for k, d in (("in the step", "a"), ("index dump", "c"), ("host batches", "d"))}
    assert sorted(losses["in the step"]) == list(range(1, 18))
    assert losses["in the step"] == losses["index dump"] == losses["host batches"]


@pytest.mark.unit
def test_a_resumed_run_with_the_gather_in_the_step_continues_the_data_order(tmp_path):
    # 11 steps with a checkpoint, then resumed to 20 (across the epoch boundary at step 15): the same losses and
    # evaluation as 20 uninterrupted steps on host batches
    ckpt = {"checkpoint__enabled": "true", "checkpoint__dir": str(tmp_path / "ckpt")}
    first = _run_on_random_data(tmp_path / "first", train__steps=11, **ckpt)
    resumed = _run_on_random_data(tmp_path / "resumed", train__steps=20, **ckpt)
    straight = _run_on_random_data(tmp_path / "straight", train__steps=20, data__on_device="false")
    assert first["data/gather_in_step"] and resumed["data/gather_in_step"]
    assert (tmp_path / "ckpt" / "11").is_dir() and sorted(_losses(tmp_path / "resumed")) == list(range(1, 21))
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "straight")
    assert resumed["eval/loss"] == straight["eval/loss"] and resumed["eval/accuracy"] == straight["eval/accuracy"]


@pytest.mark.unit
def test_on_device_default_is_a_split_within_an_eighth_of_accelerator_memory_and_never_on_cpu():
    from unittest import mock

    from data.pipeline import DeviceSource, split_fits_on_device
    from training.build import device_bytes_limit, load_data

    assert split_fits_on_device(2 << 30, 16 << 30) and not split_fits_on_device((2 << 30) + 1, 16 << 30)
    assert not split_fits_on_device(1, None) and device_bytes_limit() is None  # the CPU backend reports none
    ds = random_dataset(512)
    split_bytes = ds.images.nbytes + ds.labels.nbytes
    with mock.patch("data.load.load_tfds_split", return_value=ds):
        for on_device, kind in ((None, TrainSource), (True, DeviceSource), (False, TrainSource)):
            chosen = {} if on_device is None else {"data": {"on_device": on_device}}  # None: the default
            cfg = make_cfg(chosen, mesh__devices=1, train__global_batch=64)
            assert cfg.data.on_device is on_device and type(load_data(cfg, plan(cfg))[0]) is kind
        for limit, kind in ((8 * split_bytes, DeviceSource), (8 * split_bytes - 8, TrainSource)):
            with mock.patch("training.build.device_bytes_limit", return_value=limit):
                cfg = make_cfg(mesh__devices=1, train__global_batch=64)
                assert type(load_data(cfg, plan(cfg))[0]) is kind
                cfg = make_cfg(data={"on_device": False}, mesh__devices=1, train__global_batch=64)
                assert type(load_data(cfg, plan(cfg))[0]) is TrainSource
        with mock.patch("training.build.device_bytes_limit", return_value=split_bytes - 1):
            cfg = make_cfg(data={"on_device": True}, mesh__devices=1, train__global_batch=64)
            too_big = rf"^data.on_device=true: the mnist training split takes {split_bytes} bytes .* or false"
            with pytest.raises(ConfigError, match=too_big):
                load_data(cfg, plan(cfg))


@pytest.mark.unit
def test_device_memory_figures_come_from_the_first_local_devices_statistics():
    from types import SimpleNamespace
    from unittest import mock

    from measure.compiled import peak_bytes_per_device
    from training.build import device_bytes_limit

    def device(stats):
        return [SimpleNamespace(memory_stats=stats)]

    with mock.patch("jax.local_devices", return_value=device(lambda: {"bytes_limit": 100, "peak_bytes_in_use": 7})):
        assert (device_bytes_limit(), peak_bytes_per_device()) == (100, 7)
    with mock.patch("jax.local_devices", return_value=device(lambda: {"bytes_limit": 0, "peak_bytes_in_use": 0})):
        assert (device_bytes_limit(), peak_bytes_per_device()) == (None, 0)  # a limit of 0: none known
    for stats in (lambda: None, lambda: {}, mock.Mock(side_effect=RuntimeError("no statistics"))):
        with mock.patch("jax.local_devices", return_value=device(stats)):
            assert (device_bytes_limit(), peak_bytes_per_device()) == (None, None)


@pytest.mark.unit
def test_on_device_default_with_several_processes_needs_every_process_to_fit():
    from unittest import mock

    from data.load import on_every_process

    assert on_every_process(True) and not on_every_process(False)  # one process: its own answer
    with mock.patch("jax.process_count", return_value=2):
        for answers, expected in (([1, 1], True), ([1, 0], False), ([0, 1], False), ([0, 0], False)):
            with mock.patch("jax.experimental.multihost_utils.process_allgather", return_value=np.array(answers)):
                assert on_every_process(True) is expected


@pytest.mark.unit
def test_startup_line_says_when_batches_are_made_on_the_devices():
    from training.console import startup_line

    info = {
        "process_count": 1,
        "mesh/devices": 1,
        "platform": "tpu",
        "device_kind": "TPU v5 lite",
        "parallel": "jit_sharding",
        "mesh/shape": [1, 1],
        "precision": "fp32",
        "train/global_batch": 256,
        "train/per_device_batch": 256,
        "train/steps": 2340,
    }
    kw = dict(accum_steps=1, model="mlp", param_count=203530, dataset="mnist")
    assert startup_line(info, **kw).endswith("mlp 203,530 params, data mnist")
    assert startup_line({**info, "data/on_device": False}, **kw).endswith("params, data mnist")
    assert startup_line({**info, "data/on_device": True}, **kw).endswith("params, data mnist on the devices")


@pytest.mark.unit
def test_a_sources_fingerprint_names_the_data_it_was_read_from(tmp_path):
    """What the checkpoints record (training.checkpoint.policy.data_change): a TFDS split's name, prepared version,
    split and size; nothing for synthetic data, whose config says it all."""
    from training.build import load_data

    cfg = make_cfg(data={"data_dir": str(SHARED_TFDS)}, mesh__devices=1, train__global_batch=64)
    assert load_data(cfg, plan(cfg))[0].fingerprint == {
        "kind": "tfds",
        "dataset": "mnist",
        "version": "3.0.1",
        "split": "train",
        "examples": 60000,
    }
    cfg = make_cfg(data={"name": "synthetic", "tfds_name": None}, mesh__devices=1, train__global_batch=64)
    assert load_data(cfg, plan(cfg))[0].fingerprint is None
