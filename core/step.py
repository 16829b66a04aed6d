"""The pure training step, shared by every parallel mode.

A step is split in two pure halves so that a parallel mode only decides *where* the gradient reduction
happens and which collectives it uses, never *what* is computed:

1. ``LocalGrads.__call__(params, batch, step, loss_scale)``: on whatever batch it is given (one device's
   shard, or the whole global batch under plain ``jit``), sums the per-example loss gradients over
   ``accum_steps`` microbatches in a ``lax.scan`` (no collectives inside). Returns ``(grad_sums, metric_sums)``.
2. ``Updater.__call__(state, grads, metric_sums)``: takes the *global mean* gradient (still multiplied by
   the loss scale), with loss scaling unscales it and checks it is finite, applies the optax update once
   (clipping included), updates the loss scale and returns the new state and the step's device metrics
   (``Updater.complete`` adds the host-side ones).

Mixed precision (Micikevicius et al., "Mixed Precision Training", ICLR 2018): float32 master parameters
and optimizer state; the forward and backward passes run in ``compute_dtype`` (the params are cast inside
the differentiated function, so the gradient w.r.t. the float32 params is float32); logits, loss and every
metric reduction are float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Any, Callable, Optional, Self

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct

from core.augment import AugmentSpec, augment_images
from core.precision import LossScaleState, update_loss_scale
from core.xent import fused_token_xent, token_xent

Metrics = dict[str, jax.Array]

# Metric sums reduced across devices in the same step as the gradients: 2 float32 scalars = 8 bytes.
# (The example count is static: the global batch.)
METRIC_SUM_KEYS = ("loss_sum", "correct")
METRIC_SUM_BYTES = 4 * len(METRIC_SUM_KEYS)


@struct.dataclass
class TrainState:
    """Everything that changes during training; a pytree of arrays.

    step: int32 ``[]`` optimizer steps taken. params: nested dict of float32 arrays (``nnx.to_pure_dict`` of
    the model's ``nnx.Param`` state). opt_state: optax state (float32). loss_scale: ``LossScaleState``.
    mode_state: None, or state the parallel mode owns (created by its ``init_state``, laid out, saved and
    restored by the mode, ``parallel.base``; it may differ between devices, so it is not part of the
    replica-sync check).
    """

    step: jax.Array
    params: Any
    opt_state: Any
    loss_scale: LossScaleState
    mode_state: Any = None  # the parallel mode's own state (parallel.base.ParallelMode.init_state)

    if TYPE_CHECKING:  # flax.struct.dataclass adds replace() at run time; declared here for the type checker

        def replace(self, **updates: Any) -> Self: ...


def create_state(params, tx: optax.GradientTransformation, loss_scale: LossScaleState) -> TrainState:
    """A fresh state: step 0, ``tx.init(params)``."""
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), loss_scale=loss_scale)


def to_float_image(image: jax.Array, dtype) -> jax.Array:
    """uint8 images -> [0, 1] in ``dtype`` (float inputs are only cast)."""
    if image.dtype == jnp.uint8:
        return (image.astype(jnp.float32) / 255.0).astype(dtype)
    return image.astype(dtype)


def example_keys(seed: int, step: jax.Array, index_B: jax.Array) -> jax.Array:
    """Typed PRNG keys ``[B]`` from (seed, step, global example index): independent of device count."""
    base = jax.random.fold_in(jax.random.key(seed), step)
    return jax.vmap(lambda i: jax.random.fold_in(base, i))(index_B)


@dataclasses.dataclass(frozen=True)
class LocalGrads:
    """Gradient sums over a local batch, accumulated over ``accum_steps`` microbatches.

    Attributes:
      graphdef: the model's ``nnx.GraphDef``.
      compute_dtype: dtype of the forward/backward pass (float32, bfloat16, float16).
      accum_steps: K, microbatches per optimizer step.
      seed: seed of the per-example randomness (dropout, augmentation).
      use_example_keys: whether the model needs per-example keys (dropout > 0).
      augment: ``core.augment.AugmentSpec`` (random crop/flip of the uint8 training images, on the
        device, each example keyed by (seed, step, global example index)), or None (no augmentation).
      materialize: None (the model is ``nnx.merge(graphdef, params cast to compute_dtype)``), or a function
        ``(graphdef, params, compute_dtype) -> nnx.Module`` that builds the model from params in another form
        (FSDP: parameter shards, gathered layer by layer where they are used; ``parallel.fsdp``).
      unroll: unroll the microbatch loop (``lax.scan(unroll=True)``): collectives inside a microbatch then
        appear once per microbatch in the compiled step, outside any loop (FSDP's per-microbatch gathers).
      manual_kernels: the model calls a kernel that cannot run under ``shard_map``'s varying-axes check (a Pallas
        kernel: splash attention); a mode then runs its per-device code without the check.
      tokens: a language model: ``image`` holds input tokens int32 ``[B, T]`` (passed to the model as they
        are) and ``label`` the next tokens int32 ``[B, T]``; the model returns logits ``[B, T, vocab]``. An
        example's loss is the mean over its T positions of the next-token cross-entropy (nats per token) and
        its "correct" the fraction of its positions whose argmax is the next token, so every reduction stays
        per example (all windows have T tokens: the mean over examples is the mean per token).
    """

    graphdef: Any
    compute_dtype: Any
    accum_steps: int
    seed: int
    use_example_keys: bool
    augment: Optional[AugmentSpec] = None
    materialize: Optional[Callable[[Any, Any, Any], Any]] = None
    unroll: bool = False
    tokens: bool = False
    manual_kernels: bool = False

    def model(self, params):
        """The ``nnx.Module`` computing in ``compute_dtype`` from ``params`` (see ``materialize``)."""
        if self.materialize is not None:
            return self.materialize(self.graphdef, params, self.compute_dtype)
        return nnx.merge(self.graphdef, jax.tree.map(lambda p: p.astype(self.compute_dtype), params))

    def logits(self, params, image, keys=None) -> jax.Array:
        """float32 logits ``[B, classes]`` (tokens: ``[B, T, vocab]``) computed in ``compute_dtype``."""
        model = self.model(params)
        x = image if self.tokens else to_float_image(image, self.compute_dtype)
        return model(x, keys).astype(jnp.float32)

    def per_example(self, logits, label) -> tuple[jax.Array, jax.Array]:
        """(loss, correct), float32 ``[B]``: cross-entropy and 0/1 accuracy; tokens: their means over the T
        positions of each example."""
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, label)
        correct = (jnp.argmax(logits, -1) == label).astype(jnp.float32)
        if self.tokens:
            return jnp.mean(loss, axis=-1), jnp.mean(correct, axis=-1)
        return loss, correct

    def losses(self, params, image, label, keys=None, weight=None):
        """``(objective, loss_B, correct_B)``: the per-example loss and 0/1 accuracy (float32 ``[B]``, as
        ``per_example``) and, when ``weight`` (float32 scalar) is given, the differentiable ``weight * sum(loss_B)``
        of a language model whose ``loss_chunk`` fuses the output layer with the loss (``core.xent``: its
        gradient is computed in the forward pass, chunk by chunk), else None (the caller differentiates through
        ``loss_B``)."""
        model = self.model(params)
        chunk = getattr(model, "loss_chunk", 0) if self.tokens else 0
        if not chunk:
            x = image if self.tokens else to_float_image(image, self.compute_dtype)
            return (None, *self.per_example(model(x, keys).astype(jnp.float32), label))
        x_BxTxD = model.features(image, keys)
        b, t, d = x_BxTxD.shape
        args = (x_BxTxD.reshape(b * t, d), model.output_weight(), label.reshape(b * t))
        if weight is None:
            objective, (loss, correct) = None, token_xent(*args, chunk, model.dims.vocab_size)
        else:
            weights = jnp.full((b * t,), weight / t, jnp.float32)
            objective, loss, correct = fused_token_xent(*args, weights, chunk, model.dims.vocab_size)
        return objective, loss.reshape(b, t).mean(-1), correct.reshape(b, t).mean(-1)

    def _micro(self, params, batch, step, scale):
        # per-example keys feed dropout and/or augmentation (independent fold_in sites)
        needs_keys = self.use_example_keys or self.augment is not None
        example_keys_B = example_keys(self.seed, step, batch["index"]) if needs_keys else None
        keys = example_keys_B if self.use_example_keys else None
        image = batch["image"]
        if self.augment is not None:
            assert example_keys_B is not None  # needs_keys holds whenever augment is set
            image = augment_images(image, example_keys_B, self.augment)

        def loss_fn(p):
            objective, per_example, correct_B = self.losses(p, image, batch["label"], keys, scale / n)
            loss_sum = jnp.sum(per_example)
            correct = jnp.sum(correct_B)
            # Differentiate the scaled *mean* so that gradient magnitudes inside the (possibly float16)
            # backward pass do not grow with the batch size; multiply back by n to return sums.
            return (loss_sum / n * scale if objective is None else objective), (loss_sum, correct)

        n = batch["label"].shape[0]
        grads, (loss_sum, correct) = jax.grad(loss_fn, has_aux=True)(params)
        grads = jax.tree.map(lambda g: g * jnp.float32(n), grads)
        return grads, {"loss_sum": loss_sum, "correct": correct}

    def __call__(self, params, batch, step, scale):
        """Returns ``(grad_sums, metric_sums)``: float32 pytrees, sums over every example of ``batch``.

        ``batch`` leaves have a leading batch axis B, divisible by ``accum_steps``. ``scale``: float32 loss
        scale (gradients come out multiplied by it).
        """
        k = self.accum_steps
        if k == 1:
            return self._micro(params, batch, step, scale)
        micro = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)
        # The first microbatch seeds the carry, so its type (shape, dtype and, under shard_map, which mesh
        # axes it varies over) is exactly the body's output type.
        first = self._micro(params, jax.tree.map(lambda x: x[0], micro), step, scale)

        def body(carry, mb):
            out = self._micro(params, mb, step, scale)
            return jax.tree.map(jnp.add, carry, out), None

        sums, _ = jax.lax.scan(body, first, jax.tree.map(lambda x: x[1:], micro), unroll=self.unroll)
        return sums

    def eval_sums(self, params, batch) -> Metrics:
        """Masked sums for evaluation (no dropout): ``loss_sum``, ``correct``, ``count`` (float32 scalars)."""
        mask = batch["mask"]
        _, per_example, correct = self.losses(params, batch["image"], batch["label"])
        return {"loss_sum": jnp.sum(per_example * mask), "correct": jnp.sum(correct * mask), "count": jnp.sum(mask)}


@dataclasses.dataclass(frozen=True)
class Updater:
    """The optimizer half of the step: ``__call__(state, grads, metric_sums) -> (state, metrics)``, and its host
    half ``complete(records)``.

    The compiled step returns only what must come from the devices: ``train/loss``, ``train/accuracy``,
    ``optim/grad_norm`` (when computed) and, with loss scaling, ``precision/loss_scale`` and
    ``precision/skipped_steps``. The learning rate is a pure function of the step, so ``complete`` adds
    ``optim/lr`` on the host once per logging window; finiteness is checked there from the loss (and the
    gradient norm). A step holds the training work, not its bookkeeping: every extra per-step output or
    reduction is a visible part of a small model's step (docs/performance.md).

    Attributes:
      tx: the optax transformation (clipping included).
      lr_schedule: step -> learning rate (``optim/lr`` of the step that starts at that count).
      loss_scaling: 'dynamic' | 'static' | 'none'.
      growth_interval: good steps before a dynamic scale doubles.
      grad_norm_every: 0 (the default: no gradient norm), or N: ``optim/grad_norm``, the global L2 norm of the
        unscaled mean gradient, is computed (under ``lax.cond``) on the steps whose count after the update is a
        multiple of N; 1 = every step. Loss scaling needs the norm every step (its finiteness decides a
        skip), so it forces 1. Off by default: it is a reduction over every gradient element.
    """

    tx: optax.GradientTransformation
    lr_schedule: Callable[[jax.Array], jax.Array]
    loss_scaling: str
    growth_interval: int
    grad_norm_every: int = 0

    @property
    def grad_norm_period(self) -> int:
        """The period actually used: 1 with loss scaling, else ``grad_norm_every`` (0: never)."""
        return 1 if self.loss_scaling != "none" else self.grad_norm_every

    def grad_norm_at(self, step: int) -> bool:
        """Whether the step that ends at count ``step`` (>= 1) computed ``optim/grad_norm``."""
        period = self.grad_norm_period
        return period > 0 and step % period == 0

    def __call__(self, state: TrainState, grads, sums: Metrics) -> tuple[TrainState, Metrics]:
        """``grads``: global-mean gradients times the loss scale (float32, the params' structure/sharding)."""
        scaling = self.loss_scaling != "none"
        if scaling:  # without loss scaling the scale is 1: no division pass
            scale = state.loss_scale.scale
            grads = jax.tree.map(lambda g: g / scale, grads)
        period = self.grad_norm_period
        grad_norm = None
        if period == 1:
            grad_norm = optax.global_norm(grads)
        elif period > 1:
            grad_norm = jax.lax.cond(
                (state.step + 1) % period == 0, optax.global_norm, lambda _: jnp.zeros((), jnp.float32), grads
            )
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        loss_scale = state.loss_scale
        if scaling:  # skip a non-finite step: params and optimizer state unchanged
            assert grad_norm is not None  # loss scaling forces grad_norm_period 1: the norm of every step
            finite = jnp.isfinite(grad_norm)
            keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
            params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
            loss_scale = update_loss_scale(state.loss_scale, finite, self.loss_scaling, self.growth_interval)
        metrics = {"train/loss": sums["loss_sum"] / sums["count"], "train/accuracy": sums["correct"] / sums["count"]}
        if grad_norm is not None:
            metrics["optim/grad_norm"] = grad_norm
        if scaling:
            metrics["precision/loss_scale"] = loss_scale.scale
            metrics["precision/skipped_steps"] = loss_scale.skipped
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, loss_scale=loss_scale)
        return new_state, metrics

    @staticmethod
    def _skipped_before(record: dict) -> int:
        """Steps skipped by loss scaling before this record's step (0 without loss scaling)."""
        skipped = int(record.get("precision/skipped_steps", 0))
        return skipped - (0 if math.isfinite(record.get("optim/grad_norm", 0.0)) else 1)

    def complete(self, records: list[dict]) -> Optional[dict]:
        """Host half of a window's per-step metrics, in place. Returns the first bad record, else None.

        ``records``: dicts of Python floats with ``step`` = optimizer steps done after that step (>= 1), as
        the compiled step returned them. Adds ``optim/lr`` = ``lr_schedule(step - 1 - skipped)``, the rate that
        step used (``skipped``: steps skipped by loss scaling before it, which did not advance the optimizer's
        count; one vectorised evaluation per window, on a CPU device) and drops the placeholder
        ``optim/grad_norm`` of the steps that did not compute it. A record is bad when its loss is not
        finite, or, without loss scaling, its computed gradient norm is not finite (with loss scaling a
        non-finite gradient is an overflow and the step was skipped instead).
        """
        if not records:
            return None
        # The optimizer's count (hence its learning rate) does not advance on a step skipped by loss scaling:
        # the step that ends at count s used lr_schedule(s - 1 - skipped before it). A step was skipped iff its
        # gradient norm is not finite (with loss scaling the norm is computed every step).
        steps = np.asarray([r["step"] - 1 - self._skipped_before(r) for r in records], np.int32)
        # padded to a power of two (>= 64) so windows of any length reuse a few compiled programs
        padded = np.pad(steps, (0, max(64, 1 << (len(steps) - 1).bit_length()) - len(steps)), mode="edge")
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            lrs = np.asarray(_batched(self.lr_schedule)(jnp.asarray(padded)), np.float64)[: len(steps)]
        bad = None
        for record, lr in zip(records, lrs):
            record["optim/lr"] = float(lr)
            if "optim/grad_norm" in record and not self.grad_norm_at(record["step"]):
                del record["optim/grad_norm"]
            norm_bad = self.loss_scaling == "none" and not math.isfinite(record.get("optim/grad_norm", 0.0))
            if bad is None and (not math.isfinite(record["train/loss"]) or norm_bad):
                bad = record
        return bad


@functools.lru_cache(maxsize=None)
def _batched(schedule: Callable[[jax.Array], jax.Array]):
    """``jit(vmap(schedule))``, one per schedule (a learning-rate schedule evaluated for a window of steps)."""
    return jax.jit(jax.vmap(schedule))


def global_mean(grad_sums, sums: Metrics, global_batch: int):
    """Global-sum gradients -> global-mean gradients; adds the (static) example ``count`` to the sums."""
    inv = 1.0 / global_batch
    return jax.tree.map(lambda g: g * inv, grad_sums), {**sums, "count": jnp.float32(global_batch)}
