"""Batches: one global permutation per epoch, each process takes its contiguous slice of every global batch.

The global batch of step ``s`` is a pure function of (seed, s): epoch ``e = s // steps_per_epoch`` draws
``permutation(N)`` from ``numpy.random.default_rng([seed, e])`` and the step takes the next ``global_batch``
indices (the final partial batch is dropped). Process ``p`` of ``P`` reads only rows
``[p*B/P, (p+1)*B/P)`` of that batch, so a batch's contents never depend on how many processes there are,
and the slices are assembled into one global ``jax.Array`` with ``jax.make_array_from_process_local_data``.
With ``data.on_device`` (``DeviceSource``) the whole split lives on the devices instead and the same global
batch is gathered there, in the same sharding.

Every batch is a dict: ``image`` uint8 ``[B, H, W, C]`` (scaled to [0, 1] float32 on the device, inside the
step), ``label`` int32 ``[B]``, ``index`` int32 ``[B]`` (global example index, used for per-example
randomness; training batches omit it when the sources are built with ``with_index=False``, i.e. when no
dropout, augmentation or index dump needs it) and, for evaluation, ``mask`` float32 ``[B]`` (1 for real
examples, 0 for padding).
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
from typing import Callable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from core.layout import Batch, BatchLayout
from data.sources import HostDataset


def epoch_permutation(seed: int, epoch: int, num_examples: int) -> np.ndarray:
    """The order of ``epoch``: int64 ``[num_examples]``, a permutation drawn from (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


class TrainSource:
    """Host-memory training data: global batch ``step`` -> this process's rows.

    ``with_index``: whether batches carry ``index`` (needed by dropout, augmentation and
    ``train.debug_dump_indices``); without it a step places 2 arrays instead of 3.
    """

    fingerprint: Optional[dict] = None  # what the split was read from (data.load), recorded with the checkpoints

    def __init__(self, dataset: HostDataset, global_batch: int, seed: int, with_index: bool = True):
        if global_batch > len(dataset):
            raise ValueError(f"train.global_batch={global_batch} exceeds the {len(dataset)} training examples")
        self.dataset, self.global_batch, self.seed = dataset, global_batch, seed
        self.with_index = with_index
        self.steps_per_epoch = len(dataset) // global_batch
        self._perm_epoch, self._perm = -1, None

    def global_indices(self, step: int) -> np.ndarray:
        """Example indices of the global batch of ``step``: int32 ``[global_batch]``."""
        epoch, pos = divmod(step, self.steps_per_epoch)
        if epoch != self._perm_epoch:
            self._perm, self._perm_epoch = epoch_permutation(self.seed, epoch, len(self.dataset)), epoch
        return self._perm[pos * self.global_batch : (pos + 1) * self.global_batch].astype(np.int32)

    def local_batch(self, step: int, rows: slice) -> Batch:
        idx = self.global_indices(step)[rows]
        batch = {"image": self.dataset.images[idx], "label": self.dataset.labels[idx]}
        if self.with_index:
            batch["index"] = idx
        return batch


class DeviceSource(TrainSource):
    """A ``TrainSource`` whose whole training split lives in device memory: each step's batch is gathered ON the
    devices, so the host neither gathers nor transfers a batch per step.

    The split (``image`` uint8 ``[N, H, W, C]``, ``label`` int32 ``[N]``) is placed once, replicated on every
    device of the mesh; each epoch's order (``epoch_permutation``, int32 ``[steps_per_epoch, global_batch]``)
    is placed once per epoch. The gather runs inside the train step (``feed`` and ``device_feeds``: one program
    per step, which finds its row from the state's step counter) or, where the mode cannot take it
    (``ParallelMode.fuses_feed``: pmap), as a jitted program of its own that returns the next position
    (``gather_program`` and ``device_batches``). Either way its output has the layout's sharding (each device
    gathers only its own rows) and the loop transfers nothing per step. Batches are the same as
    ``TrainSource``'s, value for value, in the same sharding: a run's results do not depend on where the split
    lives.

    Costs: ``split_bytes`` of device memory per device (``nbytes`` of images and labels), placed when the first
    batch is asked for (at start-up, in its ``data`` phase).
    """

    def _gather(self, layout: BatchLayout) -> Callable[[tuple, jax.Array, jax.Array], Batch]:
        """The traceable gather ``(split, order, row) -> batch``: the global batch of row ``row`` (int32 ``[]``) of
        the epoch's ``order``, from ``split`` = (images uint8 ``[N, H*W*C]``, labels int32 ``[N]``), in ``layout``'s
        shape and sharding (a sharding constraint: XLA partitions the gather so that each device gathers only its
        own rows, with no collective, ``tests/test_data.py``)."""
        image_shape, with_index = self.dataset.images.shape[1:], self.with_index

        def gather(split_, order, row):
            idx = jax.lax.dynamic_index_in_dim(order, row, keepdims=False)  # int32 [global_batch]
            batch = {"image": split_[0][idx].reshape((-1, *image_shape)), "label": split_[1][idx]}
            if with_index:
                batch["index"] = idx
            batch = {k: v.reshape(layout.reshape(v.shape)) for k, v in batch.items()}
            return jax.lax.with_sharding_constraint(batch, layout.sharding)

        return gather

    def gather_program(self, layout: BatchLayout):
        """The jitted step gather ``(split, order, pos) -> (batch, pos + 1)``: ``split`` = (images uint8 ``[N,
        H*W*C]``, labels int32 ``[N]``) replicated, ``order`` int32 ``[steps_per_epoch, global_batch]`` replicated,
        ``pos`` int32 ``[]``; ``batch`` in ``layout`` (its sharding and shape). XLA partitions it to the batch's
        sharding: each device gathers only its own rows, with no collective (``tests/test_data.py``). The path of
        a mode that cannot take the gather into its step (``ParallelMode.fuses_feed``: pmap)."""
        gather = self._gather(layout)
        return jax.jit(
            lambda split_, order, pos: (gather(split_, order, pos), pos + 1),
            out_shardings=(layout.sharding, layout.replicated),
        )

    def feed(self, layout: BatchLayout) -> DeviceFeed:
        """The gather as part of the train step (``ParallelMode.build(..., feed=)``): ``batch_at((split, order),
        step)`` gathers the global batch of optimizer step ``step`` (the state's int32 step counter, ``[]``) as
        row ``step % steps_per_epoch`` of ``order``, from ``split`` = (images uint8 ``[N, H*W*C]``, labels int32
        ``[N]``) and ``order`` int32 ``[steps_per_epoch, global_batch]``, both replicated, as ``device_feeds``
        hands them over; the batch has ``layout``'s shapes and sharding. The rule it rests on: the step counter
        of the state the step is called with is the step ``device_feeds`` yielded the arrays for (true of
        ``train.py``'s loop, which starts ``device_feeds`` at the restored step; a mismatch would silently pick
        another batch). One program per step instead of two: no gather to dispatch."""
        gather, spe = self._gather(layout), self.steps_per_epoch
        return DeviceFeed(
            batch_at=lambda arrays, step: gather(arrays[0], arrays[1], step % spe), sharding=layout.replicated
        )

    @property
    def split_bytes(self) -> int:
        """``split_bytes`` of the split: what it adds to each device's memory, before the device's own padding."""
        return split_bytes(self.dataset)

    def _placed(self, layout: BatchLayout, start_step: int, end_step: int) -> Iterator[tuple[tuple, jax.Array, int]]:
        """``(split, order, at)`` for each step of ``[start_step, end_step)``: the split (placed once, when the first
        step is asked for), the order of the step's epoch (placed once per epoch) and the step's row in it."""
        replicated = layout.replicated
        images, labels = self.dataset.images, self.dataset.labels
        # images as rows of H*W*C bytes, reshaped back to [B, H, W, C] once gathered: a TPU pads an array's minor
        # dimensions to its tiles, so [N, 28, 28, 1] would take more memory than [N, 784]
        with jax.transfer_guard("allow"):
            split = (_replicate(images.reshape(len(images), -1), replicated), _replicate(labels, replicated))
        spe, b = self.steps_per_epoch, self.global_batch
        epoch_now, order = -1, None
        for step in range(start_step, end_step):
            epoch, at = divmod(step, spe)
            if epoch != epoch_now:  # the pipeline's own explicit transfers, once per epoch, outside the loop's guard
                perm = epoch_permutation(self.seed, epoch, len(self.dataset))[: spe * b]
                with jax.transfer_guard("allow"):  # (train.transfer_guard guards the step, as the prefetch thread is)
                    order = _replicate(perm.astype(np.int32).reshape(spe, b), replicated)
                epoch_now = epoch
            yield split, order, at

    def device_feeds(
        self, layout: BatchLayout, start_step: int, end_step: int
    ) -> Iterator[tuple[tuple[jax.Array, jax.Array], jax.Array]]:
        """What a step built with ``feed`` takes in place of a batch, for steps ``[start_step, end_step)``:
        ``(split, order)``, replicated device arrays (``split`` = (images uint8 ``[N, H*W*C]``, labels int32
        ``[N]``), ``order`` int32 ``[steps_per_epoch, global_batch]`` of the step's epoch), the same objects for
        every step of an epoch: nothing is placed per step, and the step finds its row from its own step counter,
        which must be the step these arrays were yielded for. The split is placed at the first ``next()``, each
        epoch's order at its first step."""
        for split, order, _ in self._placed(layout, start_step, end_step):
            yield split, order

    def device_batches(self, layout: BatchLayout, start_step: int, end_step: int) -> Iterator[Batch]:
        """Device batches for steps ``[start_step, end_step)`` (the same values and sharding as
        ``train_batches`` of a ``TrainSource``), gathered on the devices by ``gather_program``, one program per
        step. The split is placed when the first batch is asked for."""
        fn, pos, epoch_order = self.gather_program(layout), None, None
        for split, order, at in self._placed(layout, start_step, end_step):
            if order is not epoch_order:  # a new epoch (or the first step): its position, placed once
                with jax.transfer_guard("allow"):
                    pos = _replicate(np.asarray(at, np.int32), layout.replicated)
                epoch_order = order
            batch, pos = fn(split, order, pos)
            yield batch


@dataclasses.dataclass(frozen=True)
class DeviceFeed:
    """A batch made inside the train step from device arrays (``DeviceSource.feed``): ``batch_at(arrays, step)``
    (traceable; ``arrays`` = ``((images uint8 [N, H*W*C], labels int32 [N]), order int32 [steps_per_epoch,
    global_batch])`` as ``DeviceSource.device_feeds`` yields them, ``step`` the state's int32 step counter
    ``[]``) returns the step's global batch dict in the mode's batch layout; ``sharding`` (replicated) is that of
    every array the step takes in place of a batch."""

    batch_at: Callable[[tuple, jax.Array], Batch]
    sharding: jax.sharding.Sharding


def split_bytes(dataset: HostDataset) -> int:
    """Bytes of a split's host arrays (images + labels): what ``DeviceSource`` places on every device (a device's
    layout may pad it slightly)."""
    return int(dataset.images.nbytes + dataset.labels.nbytes)


def split_fits_on_device(split_bytes: int, bytes_limit: Optional[int]) -> bool:
    """``data.on_device=null``: whether a training split of ``split_bytes`` goes to device memory: when it takes
    at most 1/8 of a device's ``bytes_limit`` (``Device.memory_stats()``: GPU, TPU); never where the backend
    reports no limit (None: the CPU backend, whose devices are the host's own cores, so a gather there is the
    same host work)."""
    return bool(bytes_limit) and split_bytes <= bytes_limit // 8


def _replicate(value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """``value`` on every device of ``sharding`` (replicated), also across processes (each process passes the
    same value; ``jax.make_array_from_callback``: as fast as one ``device_put`` with one process)."""
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


class SyntheticSource:
    """A synthetic training split of ``train_size`` random examples, generated ON the devices: never waits
    for the host.

    Example ``i`` (0 <= i < train_size) is uint8 ``image_shape`` pixels and an int32 label in
    ``[0, num_classes)``, drawn from ``fold_in(key(seed), i)``: a fixed dataset, whatever the device count.
    Step ``s`` reads examples ``[p*B, (p+1)*B)`` with ``p = s % steps_per_epoch`` (in order: shuffling
    random examples changes nothing), ``steps_per_epoch = train_size // B``.

    ``with_index``: as in ``TrainSource`` (the same batch structure, so the same compiled step serves both).

    Raises:
      ValueError: ``global_batch`` larger than ``train_size``.
    """

    fingerprint: Optional[dict] = None  # generated from the config: nothing beyond it to record

    def __init__(
        self,
        image_shape: Sequence[int],
        num_classes: int,
        train_size: int,
        global_batch: int,
        seed: int,
        with_index: bool = True,
    ):
        if global_batch > train_size:  # data.train_size is honoured
            raise ValueError(
                f"train.global_batch={global_batch} exceeds data.train_size={train_size} synthetic examples"
            )
        self.image_shape, self.num_classes = tuple(image_shape), num_classes
        self.global_batch, self.seed, self.train_size = global_batch, seed, train_size
        self.steps_per_epoch = train_size // global_batch
        self.with_index = with_index
        self._fn = None

    def device_batch(self, step: int, layout: BatchLayout) -> Batch:
        if self._fn is None:
            b, shape, classes, seed = self.global_batch, self.image_shape, self.num_classes, self.seed
            spe = self.steps_per_epoch

            def make(step_):
                index = (step_ % spe) * b + jnp.arange(b, dtype=jnp.int32)  # example i < train_size
                keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(index)
                image = jax.vmap(lambda k: _random_bytes(k, shape))(keys)
                label = jax.vmap(lambda k: jax.random.randint(jax.random.fold_in(k, 1), (), 0, classes, jnp.int32))(
                    keys
                )
                batch = {"image": image, "label": label, **({"index": index} if self.with_index else {})}
                return {k: v.reshape(layout.reshape(v.shape)) for k, v in batch.items()}

            self._fn = jax.jit(make, out_shardings=layout.sharding)
        # Explicit transfer of the step number (an implicit one fails under train.transfer_guard=disallow).
        step_arr = jax.device_put(np.int32(step), layout.replicated)
        return self._fn(step_arr)


def _random_bytes(key: jax.Array, shape: Sequence[int]) -> jax.Array:
    """uint8 ``shape`` of uniform random bytes: 32-bit words from ``jax.random.bits`` split into 4 bytes each
    (cheaper than ``randint(0, 256)`` per byte on XLA:CPU, so synthetic data costs the devices little)."""
    n = math.prod(shape)
    words = jax.random.bits(key, (-(-n // 4),), jnp.uint32)
    return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)[:n].reshape(shape)


def synthetic_eval(image_shape: Sequence[int], num_classes: int, size: int, seed: int) -> HostDataset:
    """A host-side synthetic test split (labels are random: accuracy ~ 1/num_classes)."""
    rng = np.random.default_rng([seed, 2**20])
    return HostDataset(
        images=rng.integers(0, 256, (size, *image_shape), dtype=np.uint8),
        labels=rng.integers(0, num_classes, size, dtype=np.int32),
    )


def train_batches(source, layout: BatchLayout, start_step: int, end_step: int, prefetch: int) -> Iterator[Batch]:
    """Device batches for steps ``[start_step, end_step)``, prepared ``prefetch`` batches ahead.

    Host sources are gathered and transferred in a background thread so host work overlaps device work
    (``prefetch`` >= 1), or inline, on the consumer's thread, when the consumer asks for the batch
    (``prefetch=0``: no second Python thread competing for the GIL and the CPU, as a bare script does it);
    the synthetic source is generated on the devices, and a ``DeviceSource``'s batches are gathered there
    (``prefetch`` does not apply to either). Raises ValueError for a negative ``prefetch``.
    """
    if prefetch < 0:
        raise ValueError(f"prefetch={prefetch}: must be >= 0")
    if isinstance(source, SyntheticSource):
        for step in range(start_step, end_step):
            yield source.device_batch(step, layout)
        return
    if isinstance(source, DeviceSource):
        yield from source.device_batches(layout, start_step, end_step)
        return
    rows = layout.local_rows(source.global_batch)

    def produce(step: int) -> Batch:
        return layout.place(source.local_batch(step, rows), source.global_batch)

    if prefetch == 0:
        for step in range(start_step, end_step):
            yield produce(step)
        return
    yield from _prefetch(produce, range(start_step, end_step), prefetch)


def _prefetch(produce: Callable[[int], Batch], steps: range, depth: int) -> Iterator[Batch]:
    """Runs ``produce(step)`` in a daemon thread, at most ``depth`` results ahead of the consumer."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    sentinel = object()

    def worker():
        try:
            for step in steps:
                if stop.is_set():
                    return
                q.put(produce(step))
        except BaseException as e:  # surfaced in the consumer
            q.put(e)
        q.put(sentinel)

    thread = threading.Thread(target=worker, daemon=True, name="batch-prefetch")
    thread.start()
    try:
        while True:
            item = q.get()
            if item is sentinel:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a worker waiting on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                thread.join(timeout=0.05)


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """The whole test split, padded and masked, placed on the devices once.

    ``batches``: list of device batches, each of ``batch_size`` examples (the last one padded);
    ``num_examples``: the exact denominator (e.g. 10,000 for MNIST).
    """

    batches: list
    batch_size: int
    num_examples: int


def eval_batch_size(requested: int, num_devices: int, process_count: int, num_examples: Optional[int] = None) -> int:
    """``train.eval_batch``, or the split's ``num_examples`` when that is smaller (one batch holds the whole split:
    no batch of mostly padding), padded up to a multiple of the device count (and of the process count)."""
    multiple = int(np.lcm(num_devices, process_count))
    rows = requested if num_examples is None else max(1, min(requested, num_examples))
    return -(-rows // multiple) * multiple


def make_eval_set(dataset: HostDataset, requested_batch: int, num_devices: int, layout: BatchLayout) -> EvalSet:
    """Pads the test split to whole batches (mask 0 on padding) and places every batch on the devices.

    Every process runs the same number of eval steps; each reads its contiguous rows of every batch.
    """
    n = len(dataset)
    b = eval_batch_size(requested_batch, num_devices, layout.process_count, n)
    num_batches = -(-n // b)
    rows = layout.local_rows(b)
    batches = []
    for i in range(num_batches):
        idx = np.arange(i * b, (i + 1) * b)[rows]
        mask = (idx < n).astype(np.float32)
        idx = np.minimum(idx, n - 1).astype(np.int32)
        local = {"image": dataset.images[idx], "label": dataset.labels[idx], "index": idx, "mask": mask}
        batches.append(layout.place(local, b))
    return EvalSet(batches=batches, batch_size=b, num_examples=n)
