"""GraphSAGE convolution with mean aggregation (Hamilton et al., 2017) on a sparse adjacency."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jinsum.formats import BlockGroupCOO, GroupCOO
from jinsum.nn._graph import aggregate, expect_adjacency, row_sums


class SAGEConv(nnx.Module):
    """`out_i = W_l mean_{j -> i} x_j + W_r x_i + b`.

    The mean is weighted by the edge values: `(A @ x)_i / deg_i` with `deg = rowsum(A)` (the number of in-edges
    for an unweighted graph), one sorted segment sum `D[Ai[g]] += Av[g,p]` and one SpMM. Nodes without
    in-edges aggregate 0. Because the mean commutes with `W_l`, the SpMM runs on whichever of `x` and `x W_l`
    is narrower.

    Shapes: `x` `(N, in_features)`, `A` `(N, N)` with `A[dst, src] = weight` -> `(N, out_features)`.

    Example:
      >>> A = jinsum.nn.adjacency(edge_index, num_nodes=N)
      >>> sage = jinsum.nn.SAGEConv(16, 32, rngs=nnx.Rngs(0))
      >>> y = sage(x, A)                                             # (N, 32)
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True, root_weight: bool = True,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        """Creates the parameters.

        Args:
          in_features, out_features: feature sizes of the input and the output.
          use_bias: add a learned bias `b`.
          root_weight: add the node's own transformed features `W_r x_i`.
          param_dtype: dtype of the parameters; the computation follows JAX's promotion of input and parameters.
          rngs: initialises the weights.
        """
        self.lin_neighbors = nnx.Linear(in_features, out_features, use_bias=False, param_dtype=param_dtype,
                                        rngs=rngs)
        self.lin_root = (nnx.Linear(in_features, out_features, use_bias=False, param_dtype=param_dtype, rngs=rngs)
                         if root_weight else None)
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None

    def __call__(self, x: jax.Array, A: GroupCOO | BlockGroupCOO) -> jax.Array:
        """`x` `(N, in_features)`, `A` a `GroupCOO` or `BlockGroupCOO` `(N, N)` -> `(N, out_features)`."""
        expect_adjacency("SAGEConv", A, x, (GroupCOO, BlockGroupCOO), self.lin_neighbors.in_features)
        deg = row_sums(A, x.dtype)[:, None]
        inv_deg = 1 / jnp.where(deg != 0, deg, 1)
        if self.lin_neighbors.out_features < self.lin_neighbors.in_features:
            out = aggregate(A, self.lin_neighbors(x)) * inv_deg
        else:
            out = self.lin_neighbors(aggregate(A, x) * inv_deg)
        if self.lin_root is not None:
            out = out + self.lin_root(x)
        return out if self.bias is None else out + self.bias[...]
