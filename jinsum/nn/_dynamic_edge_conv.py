"""DGCNN's dynamic edge convolution (Wang et al., 2019): EdgeConv over each point's k nearest neighbours in feature
space, the graph recomputed from the features at every call, inside `jit`."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

import jinsum
from jinsum.formats import GroupCOO
from jinsum.formats._convert import check_int
from jinsum.graphs import knn
from jinsum.nn._edge_conv import edge_messages, largest_message
from jinsum.nn._dtypes import check_dtypes, promote
from jinsum.nn._graph import floating_features, row_sums

AGGREGATIONS = ("max", "mean", "sum", "add")


class DynamicEdgeConv(nnx.Module):
    """`out_i = aggr_{j in kNN(i)} h([x_i, x_j - x_i])` (PyG's `DynamicEdgeConv`): the `k` nearest neighbours of
    each point by Euclidean distance between the input features, within its batch element, the point itself among
    them (at distance 0, as PyG's kNN).

    Each call builds the graph from `x`: `jinsum.graphs.knn` (tiled, static shapes: one compile for every input of one
    shape) read as a fixed-fanout `GroupCOO.from_neighbors` (no sort), then `EdgeConv`'s messages `h` on the
    `(N, k, 2F)` edge slots and their maximum (`C[Ai[g],n] max= M[g,p,n]`, the gradient to each element's first
    maximal edge), sum or mean over each point's neighbours. Gradients reach `h`'s parameters and `x` through the
    messages; the choice of neighbours is not differentiated (as in PyG). A point whose element has fewer than `k`
    points has fewer neighbours (a mean divides by their number); a padding point (negative `batch`) has none and
    outputs 0. `h` sees the slots of missing neighbours too (their messages are then dropped), which matters only
    to an `h` that mixes rows, such as batch normalisation.

    Shapes: `x` `(N, F)`, `batch` `(N,)` -> `(N, F')`, `F'` the width of `h`'s output.

    Example:
      >>> rngs = nnx.Rngs(0)
      >>> mlp = nnx.Sequential(nnx.Linear(6, 64, rngs=rngs), nnx.relu, nnx.Linear(64, 64, rngs=rngs))
      >>> conv = jinsum.nn.DynamicEdgeConv(mlp, k=3)
      >>> pos, batch = jax.random.normal(jax.random.key(0), (8, 3)), jnp.repeat(jnp.arange(2), 4)   # two clouds
      >>> nnx.jit(lambda conv, pos, batch: conv(pos, batch))(conv, pos, batch).shape   # pos (N, 3), batch (N,)
      (8, 64)
    """

    def __init__(self, nn: Callable[[jax.Array], jax.Array], k: int, aggr: str = "max", *, dtype=None):
        """Wraps the message function (the layer has no parameters of its own).

        Args:
          nn: the message function `h`, from `(..., 2 F)` to `(..., F')` (an MLP, e.g. `nnx.Sequential`); it
            computes by its own `dtype` (build it with the layer's for one dtype throughout).
          k: neighbours per point, the point itself included.
          aggr: `"max"`, `"mean"` or `"sum"` (`"add"`) over each point's neighbours.
          dtype: the dtype of the layer's own arithmetic: the features are cast to it before the edge features
            `[x_i, x_j - x_i]`, and `nn`'s messages before the aggregation (which accumulates as its statement
            does, in float32 for bfloat16). The kNN search reads the features as given, so that a lower
            precision does not change the neighbours. None: the features' dtype (integer features cast to
            float32, as `nnx.Linear` casts them) and the messages as `nn` makes them (`jinsum.nn._dtypes`).
        """
        where = "jinsum.nn.DynamicEdgeConv"
        if aggr not in AGGREGATIONS:
            raise ValueError(f"{where}: aggr must be one of {AGGREGATIONS}, got {aggr!r}")
        check_dtypes(where, dtype)
        self.nn, self.k, self.aggr, self.dtype = nn, check_int(where, "k", k, minimum=1), aggr, dtype

    def __call__(self, x: jax.Array, batch: jax.Array | None = None) -> jax.Array:
        """`x` `(N, F)` (the first layer's: positions), `batch` `(N,)` each point's batch element (negative: a
        padding point; None: one element) -> `(N, F')`. Integer features are cast to the default float."""
        x = floating_features(x)
        if x.ndim != 2:
            raise ValueError(f"jinsum.nn.DynamicEdgeConv: expected node features (N, F), got shape {tuple(x.shape)}")
        neighbors = knn(jax.lax.stop_gradient(x), self.k, batch, loop=True)
        (x,) = promote(self.dtype, x)
        A = GroupCOO.from_neighbors(neighbors, num_sources=x.shape[0], dtype=x.dtype)
        if self.aggr == "max":
            out = largest_message(A, x, x, self.nn, dtype=self.dtype)
            return jnp.where(out == -jnp.inf, 0, out)
        messages = edge_messages(A, x, x, self.nn, padding=0, dtype=self.dtype)
        out = jinsum.einsum("C[Ai[g],n] += M[g,p,n]", A=A, M=messages,
                            C=jax.ShapeDtypeStruct((x.shape[0], messages.shape[-1]), messages.dtype))
        if self.aggr != "mean":
            return out
        degree = row_sums(A)[:, None]
        return out / jnp.where(degree != 0, degree, 1)
