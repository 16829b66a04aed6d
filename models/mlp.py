"""The reference MLP: flatten -> Linear(hidden) -> activation -> [dropout] -> Linear(classes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.common import normal, per_example_dropout

ACTIVATIONS = {"tanh": jnp.tanh, "relu": jax.nn.relu, "gelu": jax.nn.gelu, "sigmoid": jax.nn.sigmoid}


class MLP(nnx.Module):
    """784 -> hidden -> 10 perceptron (the reference model of the user's JAX data-parallel notes).

    Weights are drawn from N(0, init_std^2) (init_std=0.01 as in the reference), biases are zero. The
    initialiser is ``models.common.normal``: bitwise the values of ``nnx.initializers.normal(init_std)``
    for the same key, but drawn flat, which compiles much faster on XLA:CPU (``models.common``).

    Args:
      in_features: flattened image size (784 for 28x28x1).
      hidden: width of the hidden layer.
      num_classes: number of output logits.
      activation: one of ``ACTIVATIONS``.
      dropout: dropout rate after the activation (0 disables it).
      init_std: standard deviation of the weight initialiser.
      rngs: ``nnx.Rngs`` for parameter initialisation.

    Raises:
      ValueError: unknown activation or a dropout rate outside [0, 1).
    """

    def __init__(
        self,
        in_features: int,
        hidden: int,
        num_classes: int,
        *,
        activation: str = "tanh",
        dropout: float = 0.0,
        init_std: float = 0.01,
        rngs: nnx.Rngs,
    ):
        if activation not in ACTIVATIONS:
            raise ValueError(f"model.activation={activation!r} is unknown; choose one of {sorted(ACTIVATIONS)}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"model.dropout={dropout} must be in [0, 1)")
        init = normal(init_std)
        self.hidden = nnx.Linear(in_features, hidden, kernel_init=init, bias_init=nnx.initializers.zeros, rngs=rngs)
        self.out = nnx.Linear(hidden, num_classes, kernel_init=init, bias_init=nnx.initializers.zeros, rngs=rngs)
        self.activation = activation
        self.dropout = dropout

    def __call__(self, x_BxHxWxC: jax.Array, dropout_keys_B: jax.Array | None = None) -> jax.Array:
        """Logits ``[B, num_classes]`` in the dtype of the inputs/params (the caller casts to float32).

        ``dropout_keys_B``: one PRNG key per example (shape ``[B]``, typed keys) or None (no dropout).
        """
        x_BxD = x_BxHxWxC.reshape(x_BxHxWxC.shape[0], -1)
        h_BxH = ACTIVATIONS[self.activation](self.hidden(x_BxD))
        h_BxH = per_example_dropout(h_BxH, self.dropout, dropout_keys_B)
        return self.out(h_BxH)
