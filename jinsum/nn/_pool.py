"""Graph-level readouts of many small graphs batched as one (`jinsum.graphs`: `GraphLoader`, `batch_graphs`), over
the node -> graph vector: `global_add_pool`, `global_mean_pool`, `global_max_pool` and `AttentionalAggregation` as
indirect Einsums (sorted segment reductions that leave out padding nodes, numbered `num_graphs`)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jinsum
from jinsum.nn._dtypes import check_dtypes, promote
from jinsum.nn._graph import floating_features


def global_add_pool(x: jax.Array, batch: jax.Array, num_graphs: int) -> jax.Array:
    """Per graph, the sum of its nodes' rows: `P[b[i],n] += X[i,n]`, a sorted segment reduction (`batch` sorted,
    as `batch_graphs` and `GraphBatch.node_graph` make it; `num_graphs` marks a padding node, left out).
    `(num_graphs, F)` from `x` `(N, F)` (integer features cast to the default float)."""
    x, batch = _checked("jinsum.nn.global_add_pool", x, batch, num_graphs)
    return _pool("+=", x, batch, num_graphs)[:-1]


def global_mean_pool(x: jax.Array, batch: jax.Array, num_graphs: int) -> jax.Array:
    """Per graph, the mean of its nodes' rows (0 for a graph without nodes): the sum over the node count."""
    x, batch = _checked("jinsum.nn.global_mean_pool", x, batch, num_graphs)
    counts = _pool("+=", jnp.ones((x.shape[0], 1), x.dtype), batch, num_graphs)
    return (_pool("+=", x, batch, num_graphs) / jnp.maximum(counts, 1))[:-1]


def global_max_pool(x: jax.Array, batch: jax.Array, num_graphs: int) -> jax.Array:
    """Per graph, the elementwise maximum of its nodes' rows: `P[b[i],n] max= X[i,n]` (0 for a graph without
    nodes, as PyG); the gradient goes to each element's first maximal node."""
    x, batch = _checked("jinsum.nn.global_max_pool", x, batch, num_graphs)
    out = _pool("max=", x, batch, num_graphs)[:-1]
    return jnp.where(out == -jnp.inf, 0, out)


class AttentionalAggregation(nnx.Module):
    """Per graph, a sum of its nodes' rows weighted by a softmax over its nodes of a learned gate (Li et al., 2016;
    PyG's `AttentionalAggregation`): `out_b = sum_{i in b} softmax_b(gate_nn(x))_i * nn(x)_i`.

    The softmax is three pools: the largest gate per graph (`max=`), the sum of the shifted exponentials (`+=`)
    and the weighted sum (`+=`), each a sorted segment reduction over `batch`. Padding nodes (`num_graphs` in
    `batch`) take no part.

    Example:
      >>> gate = nnx.Linear(64, 1, rngs=nnx.Rngs(0))
      >>> pool = jinsum.nn.AttentionalAggregation(gate)
      >>> h, batch = jnp.ones((5, 64)), jnp.array([0, 0, 0, 1, 1])   # node rows, each node's graph (sorted)
      >>> pool(h, batch, 2).shape                                    # (num_graphs, 64)
      (2, 64)
    """

    def __init__(self, gate_nn: Callable[[jax.Array], jax.Array], nn: Callable[[jax.Array], jax.Array] | None = None,
                 *, dtype=None):
        """Wraps the gate and the transform (the layer has no parameters of its own).

        Args:
          gate_nn: maps `(N, F)` to `(N, 1)` (one weight per node) or `(N, F')` (one per channel, the width of
            `nn`'s output). It computes by its own `dtype`, as `nn` does (build them with the layer's for one
            dtype throughout).
          nn: transforms the rows before the sum (None: the rows as they are).
          dtype: the dtype of the layer's own arithmetic, the softmax and the weighted sum (the gates and the rows
            are cast to it; the pools accumulate as their statements do, in float32 for bfloat16); None: JAX's
            promotion of the gates and the rows (`jinsum.nn._dtypes`).
        """
        check_dtypes("AttentionalAggregation", dtype)
        self.gate_nn, self.nn, self.dtype = gate_nn, nn, dtype

    def __call__(self, x: jax.Array, batch: jax.Array, num_graphs: int) -> jax.Array:
        """`x` `(N, F)`, `batch` `(N,)` sorted -> `(num_graphs, F')`."""
        x, batch = _checked("AttentionalAggregation", x, batch, num_graphs)
        gate, x = promote(self.dtype, self.gate_nn(x), x if self.nn is None else self.nn(x))
        if gate.ndim != 2 or gate.shape[0] != x.shape[0] or gate.shape[1] not in (1, x.shape[1]):
            raise ValueError(f"AttentionalAggregation: gate_nn must give (N, 1) or (N, {x.shape[1]}), got "
                             f"{tuple(gate.shape)}")
        largest = jax.lax.stop_gradient(_pool("max=", gate, batch, num_graphs))  # (PyG's detached shift)
        weight = jnp.exp(gate - largest[batch])
        weight = weight / (_pool("+=", weight, batch, num_graphs)[batch] + 1e-16)
        return _pool("+=", weight * x, batch, num_graphs)[:-1]


def _checked(where: str, x, batch, num_graphs: int) -> tuple[jax.Array, jax.Array]:
    """`(x, batch)` of a pool after its checks: node features `(N, F)` (integer ones cast to the default float) and
    a sorted integer graph id per node `(N,)`, in `[0, num_graphs]` where concrete."""
    x = floating_features(x)
    if x.ndim != 2 or jnp.shape(batch) != (x.shape[0],):
        raise ValueError(f"{where}: expected node features (N, F) and a batch vector (N,), got "
                         f"{tuple(x.shape)} and {tuple(jnp.shape(batch))}")
    if not jnp.issubdtype(jnp.result_type(batch), jnp.integer):
        raise ValueError(f"{where}: batch must be an integer array (N,), each node's graph id, got "
                         f"{jnp.result_type(batch)}{list(jnp.shape(batch))}")
    if not isinstance(num_graphs, (int, np.integer)) or num_graphs < 0:
        raise TypeError(f"{where}: num_graphs must be a Python int (the output's static size), got {num_graphs!r}")
    if isinstance(batch, jax.core.Tracer):
        return x, batch
    batch = np.asarray(batch)
    if (np.diff(batch) < 0).any() or (batch.size and (batch.min() < 0 or batch.max() > num_graphs)):
        raise ValueError(f"{where}: batch must be sorted, graph by graph (as batch_graphs numbers the nodes), with "
                         f"graph ids in [0, num_graphs = {num_graphs}) and num_graphs for padding nodes; got ids "
                         f"from {batch.min()} to {batch.max()}")
    return x, jnp.asarray(batch)


def _pool(op: str, x: jax.Array, batch: jax.Array, num_graphs: int) -> jax.Array:
    """`P[b[i],n] op X[i,n]` over `num_graphs + 1` rows (`_checked` arguments): the last one collects the padding
    nodes."""
    pooled = jax.ShapeDtypeStruct((int(num_graphs) + 1, x.shape[1]), x.dtype)
    return jinsum.einsum(f"P[b[i],n] {op} X[i,n]", P=pooled, b=batch, X=x, sorted_indices=("b",))
