"""FSDP (ZeRO-3 style, Rajbhandari et al. 2020; PyTorch FSDP): parameters and optimizer state sharded, each
layer's weights gathered where they are used and freed after.

Sharding rules are data (as big_vision's ``(regex, spec)`` lists): ``parallel.fsdp_rules``, a list of
``[regex, dim]`` tried in order before ``DEFAULT_RULES``; the first rule whose regex is found
(``re.search``) in a state leaf's path (``params/blocks/0/fc1/kernel``; the optimizer state's copy of a
parameter ends in the same path, so one rule covers both) and whose ``dim`` fits decides: ``dim`` an integer
(negative counts from the end) splits that dimension, when the ``fsdp`` axis size divides it (else the next
rule is tried; a dimension the array does not have is an error); ``null`` replicates; ``"largest"`` splits the
largest dimension the axis size divides (the first on ties), or replicates when none does. The default list is
that last rule alone. Arrays smaller than ``parallel.min_shard_bytes`` stay replicated whatever the rules say.
The state is created directly in that layout (``ParallelMode.init_state``), so no device ever holds the whole
model.

The step runs inside ``shard_map``; the model is built from the parameter SHARDS (``gathered_model``):

* every sharded leaf is gathered by ``gather_leaf``, a ``custom_vjp``: all-gather over ``fsdp`` in the compute
  dtype in the forward pass (bf16 under ``precision=bf16``: half the bytes), and in the backward pass a
  ``psum_scatter`` (reduce-scatter; XLA:CPU never creates one by itself) of the cotangent in
  ``parallel.grad_reduce_dtype`` (float32 when null). So each device's gradient is a SHARD as soon as it is
  produced; no full-size gradient lives through the backward pass;
* the layers in a Python list of modules (``nnx.List``, e.g. a transformer's blocks) are each wrapped in
  ``jax.checkpoint`` with their gather inside: a block's weights are gathered just before it runs and freed
  after, and gathered again in the backward pass (recomputed, not kept as residuals). The other leaves
  (embeddings, head, norms outside the list) are gathered once per microbatch and kept for the backward pass;
* with ``accum_steps`` K > 1 the gathers and reduce-scatters happen per microbatch (the microbatch loop is
  unrolled, so each is a separate collective of the compiled step): K times the bytes of K = 1, but the
  accumulated gradient is a shard. One big batch equals K microbatches up to float32 summation order;
* after the backward pass: ``psum`` over ``data`` of the sharded gradient sums (hybrid sharding on a 2-D
  mesh), ``psum`` over every axis of the replicated leaves' gradients and the metric sums.

Bytes per optimizer step (payload S of ``comm/payload_bytes_per_step``), with ``c`` the compute itemsize / 4
and ``r`` the reduce itemsize / 4, S_list the float32 bytes of the sharded leaves inside block lists and
S_rest those of the other sharded leaves:
all-gather = K * c * (2 * S_list + S_rest); reduce-scatter = K * r * (S_list + S_rest); all-reduce = the
replicated leaves' bytes + the 8 B of metric sums (and the ``data``-axis psum when that axis has > 1 device).

The optimizer update runs outside ``shard_map`` on the sharded gradients, params and optimizer state
(elementwise, so each device updates only its shard; the global gradient norm is one scalar all-reduce).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from core.errors import ConfigError
from core.step import TrainState
from parallel.base import BATCH_AXES, ParallelMode
from parallel.reduce import psum_mean, reduce_dtype

FSDP = "fsdp"
REPLICATED = -1  # the dimension code of a replicated leaf


def shard_dim(shape, itemsize: int, fsdp_size: int, min_shard_bytes: int):
    """The dimension of an array of ``shape`` to split over ``fsdp_size`` devices, or None (replicate).

    The largest dimension divisible by ``fsdp_size`` (the first on ties); None when the axis has one device,
    no dimension fits, or the array has fewer than ``min_shard_bytes`` bytes.
    """
    if fsdp_size == 1 or math.prod(shape) * itemsize < min_shard_bytes:
        return None
    fits = [d for d, n in enumerate(shape) if n % fsdp_size == 0 and n > 0]
    return max(fits, key=lambda d: (shape[d], -d)) if fits else None


LARGEST = "largest"
# (regex on the leaf's path, dimension): the fallback every rule list ends with
DEFAULT_RULES: tuple[tuple[str, Any], ...] = ((r".*", LARGEST),)


def check_rules(rules) -> list[tuple[str, Any]]:
    """``parallel.fsdp_rules`` as ``[(regex, dim)]``.

    Raises:
      ConfigError: a rule that is not a pair, a regex that does not compile, or a dim that is not an integer,
        null or "largest".
    """
    out = []
    for i, rule in enumerate(rules or ()):
        pair = isinstance(rule, Sequence) and not isinstance(rule, str)
        text = f"parallel.fsdp_rules[{i}]={list(rule) if pair else rule!r}"
        if not pair or len(rule) != 2 or not isinstance(rule[0], str):
            raise ConfigError(f"{text} must be a pair [regex, dim], e.g. ['fc1/kernel$', 1]")
        regex, dim = rule
        try:
            re.compile(regex)
        except re.error as e:
            raise ConfigError(
                f"{text}: the regex does not compile ({e}); write it in Python's re syntax, with a literal ( ) [ ] . "
                f"+ * ? escaped by a backslash, e.g. ['fc1/kernel$', 1]"
            ) from None
        if not (dim is None or dim == LARGEST or (isinstance(dim, int) and not isinstance(dim, bool))):
            raise ConfigError(f"{text}: dim must be an integer, null (replicate) or 'largest'")
        out.append((regex, dim))
    return out


def rule_dim(path: str, shape, itemsize: int, fsdp_size: int, min_shard_bytes: int, rules) -> Optional[int]:
    """The dimension of the array at ``path`` (``shape``) to split over ``fsdp_size`` devices, or None
    (replicate): the first of ``rules`` (then ``DEFAULT_RULES``) that matches ``path`` and fits (module
    docstring).

    Raises:
      ConfigError: a rule tried on this array names a dimension it does not have (on any device count: a rule
        that cannot apply is a mistake in the rules, not a reason to try the next one).
    """
    if math.prod(shape) * itemsize < min_shard_bytes:
        return None
    for i, (regex, dim) in enumerate((*rules, *DEFAULT_RULES)):
        if not re.search(regex, path):
            continue
        if dim is None:
            return None
        if dim == LARGEST:
            return shard_dim(shape, itemsize, fsdp_size, 0)
        if not -len(shape) <= dim < len(shape):
            raise ConfigError(out_of_range(i, regex, dim, path, shape))
        if fsdp_size > 1 and shape[dim] % fsdp_size == 0 and shape[dim] > 0:
            return dim % len(shape)
    return None


def unmatched_rules(rules, paths: Sequence[str], shown: int = 4) -> list[str]:
    """One line per rule of ``rules`` whose regex is found in none of ``paths`` (the state's leaves): such a rule does
    nothing, most likely a typo; the line names it and the first ``shown`` parameter paths its regex is searched in."""
    params = [p for p in paths if p.startswith("params/")] or list(paths)
    more = f" ... ({len(params)} in all)" if len(params) > shown else ""
    return [
        f"parallel.fsdp_rules[{i}]=[{regex!r}, {dim}] matches no array of this model, so it does nothing; its regex "
        f"is searched in paths such as {', '.join(params[:shown])}{more}"
        for i, (regex, dim) in enumerate(rules)
        if not any(re.search(regex, p) for p in paths)
    ]


def out_of_range(i: int, regex: str, dim: int, path: str, shape) -> str:
    """The one-line error of rule ``i`` whose ``dim`` does not exist in the array at ``path`` it matches."""
    n = len(shape)
    has = f"{n} dimension{'s' if n != 1 else ''}" if n else "no dimension (a scalar)"
    fix = f"a dim from {-n} to {n - 1}, " if n else ""
    return (
        f"parallel.fsdp_rules[{i}]=[{regex!r}, {dim}] matches {path} of shape {list(shape)}, which has {has}: "
        f"there is no dimension {dim}; give {fix}null (replicate) or 'largest', or narrow the regex to the arrays "
        f"that have a dimension {dim} (their optimizer moments too)"
    )


def path_name(path) -> str:
    """``params/blocks/0/fc1/kernel``: a pytree path's keys joined by '/' (what the rules' regexes search)."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def spec_for(shape, dim) -> P:
    """The ``PartitionSpec`` splitting dimension ``dim`` over ``fsdp`` (None: replicated)."""
    return P() if dim is None else P(*([None] * dim + [FSDP]))


def dims_of(specs):
    """The tree of sharded dimensions (``REPLICATED``: none) of a tree of ``PartitionSpec``s."""
    return jax.tree.map(
        lambda s: list(s).index(FSDP) if FSDP in tuple(s) else REPLICATED, specs, is_leaf=lambda x: isinstance(x, P)
    )


def gather_leaf(x: jax.Array, dim: int, compute_dtype, reduce_dtype_) -> jax.Array:
    """Inside ``shard_map``: the full array of shard ``x`` (all-gather over ``fsdp`` along ``dim``), in
    ``compute_dtype``; its gradient is the reduce-scatter of the cotangent in ``reduce_dtype_``, back in
    ``x``'s dtype. ``dim == REPLICATED``: ``x`` only cast (the gradient stays local)."""
    if dim == REPLICATED:
        return x.astype(compute_dtype)
    return _gather(dim, jnp.dtype(compute_dtype), jnp.dtype(reduce_dtype_), x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _gather(dim, compute_dtype, reduce_dtype_, x):
    return jax.lax.all_gather(x.astype(compute_dtype), FSDP, axis=dim, tiled=True)


def _gather_fwd(dim, compute_dtype, reduce_dtype_, x):
    return _gather(dim, compute_dtype, reduce_dtype_, x), jnp.zeros((0,), x.dtype)  # residual: x's dtype only


def _gather_bwd(dim, compute_dtype, reduce_dtype_, res, g):
    g = jax.lax.psum_scatter(g.astype(reduce_dtype_), FSDP, scatter_dimension=dim, tiled=True)
    return (g.astype(res.dtype),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def block_lists(tree, path=()) -> list[tuple]:
    """Paths (tuples of keys) of the nodes of a pure-dict param tree that hold a list of layers: a dict whose
    keys are the integers 0..L-1 (how ``nnx.to_pure_dict`` writes an ``nnx.List`` of modules), each a dict."""
    if not isinstance(tree, dict):
        return []
    if tree and all(isinstance(k, int) for k in tree) and all(isinstance(v, dict) for v in tree.values()):
        return [path]
    return [p for k, v in tree.items() for p in block_lists(v, path + (k,))]


def _at(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _module_at(module, path):
    for k in path:
        module = module[k] if isinstance(k, int) else getattr(module, k)
    return module


def _regather(x: jax.Array, dim: int, compute_dtype) -> jax.Array:
    """``gather_leaf``'s forward value written another way (an untiled all-gather of ``x`` with a new leading axis,
    moved to ``dim``): the same bytes, but a different HLO, so that XLA:CPU, which drops optimization barriers
    before common-subexpression elimination, cannot merge the backward pass's gather with the forward pass's and
    keep every layer's gathered weights alive in between."""
    if dim == REPLICATED:
        return x.astype(compute_dtype)
    parts = jax.lax.all_gather(x.astype(compute_dtype), FSDP, axis=0, tiled=False)  # [n, *x.shape]
    parts = jnp.moveaxis(parts, 0, dim)
    return parts.reshape(*x.shape[:dim], -1, *x.shape[dim + 1 :])


def _after(shards, tree):
    """``shards`` made to depend on ``tree`` (``x + 0 * t``, with ``t`` one element of ``tree``'s first
    floating-point leaf; ``x`` unchanged for finite ``t``), so that a gather of them cannot be scheduled before
    ``tree`` exists: the scheduler would otherwise be free to gather every layer at the start of the step."""
    floats = [t for t in jax.tree.leaves(tree) if jnp.issubdtype(t.dtype, jnp.floating) and t.size]
    if not floats:
        return shards
    t = floats[0].reshape(-1)[0]
    return jax.tree.map(lambda x: x + (t * 0).astype(x.dtype), shards)


class _GatheredLayer:
    """Stands in for one layer of a list: on call, gathers the layer's shards, builds the layer and runs it.

    A ``custom_vjp`` over the layer: the forward pass keeps only the shards and the layer's inputs; the backward
    pass gathers the weights again (``_regather``), recomputes the layer, takes its gradient and reduce-scatters
    the weight gradients (``psum_scatter`` in the reduce dtype). So a layer's full weights and full weight
    gradients exist only while that layer runs."""

    def __init__(self, graphdef, shards, dims, compute_dtype, reduce_dtype_):
        self.graphdef, self.shards, self.dims = graphdef, shards, dims
        self.compute_dtype, self.reduce_dtype = compute_dtype, reduce_dtype_

    def __call__(self, *args, **kwargs):
        leaves, treedef = jax.tree.flatten((args, kwargs))
        is_array = [isinstance(x, (jax.Array, np.ndarray)) for x in leaves]
        dims, compute, reduce_ = self.dims, self.compute_dtype, self.reduce_dtype

        def apply(full, arrays):
            it = iter(arrays)
            a, kw = jax.tree.unflatten(treedef, [next(it) if arr else x for x, arr in zip(leaves, is_array)])
            return nnx.merge(self.graphdef, full)(*a, **kw)

        @jax.custom_vjp
        def run(shards, arrays):
            shards = _after(shards, arrays)
            return apply(jax.tree.map(lambda x, d: gather_leaf(x, d, compute, reduce_), shards, dims), arrays)

        def run_fwd(shards, arrays):
            return run(shards, arrays), (shards, arrays)

        def run_bwd(res, ct):
            shards, arrays = res
            full = jax.tree.map(lambda x, d: _regather(x, d, compute), _after(shards, ct), dims)
            _, vjp = jax.vjp(apply, full, arrays)
            g_full, g_arrays = vjp(ct)

            def scatter(g, x, d):
                if d != REPLICATED:
                    g = jax.lax.psum_scatter(g.astype(reduce_), FSDP, scatter_dimension=d, tiled=True)
                return g.astype(x.dtype)

            return jax.tree.map(scatter, g_full, shards, dims), g_arrays

        run.defvjp(run_fwd, run_bwd)
        return run(self.shards, [x for x, arr in zip(leaves, is_array) if arr])


def gathered_model(graphdef, shards, compute_dtype, *, dims, reduce_dtype_):
    """The model built from parameter shards (inside ``shard_map``), gathering each layer where it is used.

    Works for any flax NNX model whose param tree is a nested dict: every list of layers (``block_lists``)
    whose layer has a sharded leaf is replaced, layer by layer, by a ``_GatheredLayer``; all other leaves are
    gathered up front (``gather_leaf``). ``dims``: the tree of sharded dimensions (``REPLICATED`` for replicated
    leaves); ``reduce_dtype_``: the dtype of the gradients' reduce-scatter.
    """
    gather = functools.partial(gather_leaf, compute_dtype=compute_dtype, reduce_dtype_=reduce_dtype_)
    lists = [p for p in block_lists(shards) if any(d != REPLICATED for d in jax.tree.leaves(_at(dims, p)))]
    per_layer = set(lists)

    def eager(tree, dim_tree, path=()):
        if path in per_layer:
            return tree  # shards stay as they are: the layer gathers them when it runs
        if isinstance(tree, dict):
            return {k: eager(v, dim_tree[k], path + (k,)) for k, v in tree.items()}
        return gather(tree, dim_tree)

    model = nnx.merge(graphdef, eager(shards, dims))
    for path in lists:
        layers = _module_at(model, path)
        for i in range(len(layers)):
            layer_graphdef, _ = nnx.split(layers[i])
            layers[i] = _GatheredLayer(
                layer_graphdef, _at(shards, path)[i], _at(dims, path)[i], compute_dtype, reduce_dtype_
            )
    return model


class Fsdp(ParallelMode):
    name = "fsdp"
    default_mesh_shape = (1, -1)
    allows_fsdp_axis = True
    compressions = ("none",)  # int8 is not implemented for sharded parameters

    def __init__(self, mesh, *, fsdp_rules=(), **kwargs):
        super().__init__(mesh, **kwargs)
        self.rules = check_rules(fsdp_rules)  # tried before DEFAULT_RULES

    def setting_warnings(self, abstract_state):
        leaves = jax.tree_util.tree_flatten_with_path(abstract_state.replace(mode_state=None))[0]
        return unmatched_rules(self.rules, [path_name(path) for path, _ in leaves])

    def _dim(self, path, x):
        shape, itemsize = np.shape(x), np.dtype(x.dtype).itemsize
        return rule_dim(path_name(path), shape, itemsize, self.mesh.shape[FSDP], self.min_shard_bytes, self.rules)

    def param_specs(self, params):
        """Specs of ``params`` (or of a whole state) by the sharding rules. A bare params tree is read with the
        paths it has inside the state (``params/...``), so both give the same specs."""
        prefix = () if isinstance(params, TrainState) else (jax.tree_util.GetAttrKey("params"),)
        return jax.tree_util.tree_map_with_path(lambda p, x: spec_for(np.shape(x), self._dim(prefix + p, x)), params)

    def param_dims(self, params):
        """The tree of sharded dimensions of ``params`` (``REPLICATED``: not sharded)."""
        return dims_of(self.param_specs(params))

    def sharded_and_replicated_bytes(self, params) -> tuple[int, int]:
        """Bytes of the params that are sharded and that stay replicated (float32)."""
        sharded = replicated = 0
        for x, dim in zip(jax.tree.leaves(params), jax.tree.leaves(self.param_dims(params))):
            nbytes = math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize
            if dim == REPLICATED:
                replicated += nbytes
            else:
                sharded += nbytes
        return sharded, replicated

    def per_layer_bytes(self, params) -> int:
        """float32 bytes of the sharded leaves gathered layer by layer (inside a list of layers); the other
        sharded leaves are gathered once per microbatch (see the module docstring's byte formula)."""
        dims = self.param_dims(params)
        total = 0
        for path in block_lists(params):
            for x, d in zip(jax.tree.leaves(_at(params, path)), jax.tree.leaves(_at(dims, path))):
                if d != REPLICATED:
                    total += math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize
        return total

    def local(self, local, specs):
        # the model is built from the parameter shards, gathered layer by layer (microbatch loop unrolled)
        materialize = functools.partial(
            gathered_model, dims=dims_of(specs), reduce_dtype_=reduce_dtype(self.grad_reduce_dtype)
        )
        return dataclasses.replace(local, materialize=materialize, unroll=True)

    def reduce(self, grad_sums, sums, scale, mode_state, specs):
        # sharded leaves: already reduce-scattered over fsdp in the backward pass, summed over data here;
        # replicated leaves: summed over every axis
        axes = jax.tree.map(lambda d: "data" if d != REPLICATED else BATCH_AXES, dims_of(specs))
        dtype = reduce_dtype(self.grad_reduce_dtype)
        return (*psum_mean(grad_sums, sums, BATCH_AXES, dtype, self.global_batch, grad_axes=axes), mode_state)
