"""The graph convolution of Morris et al. (2019, "Weisfeiler and Leman go neural"), PyG's `GraphConv`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jinsum.formats import GroupCOO
from jinsum.nn._graph import aggregate, aggregate_extreme, expect_adjacency, row_sums

AGGREGATIONS = ("add", "mean", "max")


class GraphConv(nnx.Module):
    """`out_i = W_1 x_i + W_2 aggr_{j -> i} e_ji x_j + b`, the edge values `e_ji` weighting the messages.

    `"add"`: one SpMM, `A @ x`; `"mean"`: that over the number of in-edges (a sorted segment count of the stored
    entries); `"max"`: `C[Ai[g],n] max= Av[g,p] * x[Ak[g,p],n]`, 0 for nodes without in-edges.

    Shapes: `x` `(N, in_features)`, `A` `(N, N)` with `A[dst, src] = weight` -> `(N, out_features)`.

    Example:
      >>> y = jinsum.nn.GraphConv(16, 32, aggr="mean", rngs=nnx.Rngs(0))(x, A)   # (N, 32)
    """

    def __init__(self, in_features: int, out_features: int, *, aggr: str = "add", use_bias: bool = True,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        """Creates `lin_rel` (`W_2`, with the bias `b`) and `lin_root` (`W_1`), as PyG names them."""
        if aggr not in AGGREGATIONS:
            raise ValueError(f"GraphConv: aggr must be one of {AGGREGATIONS}, got {aggr!r}")
        self.aggr = aggr
        self.lin_rel = nnx.Linear(in_features, out_features, use_bias=use_bias, param_dtype=param_dtype, rngs=rngs)
        self.lin_root = nnx.Linear(in_features, out_features, use_bias=False, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array, A: GroupCOO) -> jax.Array:
        """`x` `(N, in_features)`, `A` a `GroupCOO` `(N, N)` -> `(N, out_features)`."""
        expect_adjacency("GraphConv", A, x, in_features=self.lin_rel.in_features)
        if self.aggr == "max":
            messages = aggregate_extreme(A, x, "max", weighted=True)
        else:
            messages = aggregate(A, x)
            if self.aggr == "mean":
                count = row_sums(A.with_values((A.Av != 0).astype(x.dtype)))[:, None]
                messages = messages / jnp.maximum(count, 1)
        return self.lin_rel(messages) + self.lin_root(x)
