"""The graph convolution of Morris et al. (2019, "Weisfeiler and Leman go neural"), PyG's `GraphConv`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jinsum.formats import GroupCOO
from jinsum.nn._dtypes import check_dtypes, promote
from jinsum.nn._graph import aggregate, aggregate_extreme, expect_adjacency, node_features, row_sums, transform_first
from jinsum.nn._sizes import feature_pair, layer_sizes

AGGREGATIONS = ("add", "mean", "max")


class GraphConv(nnx.Module):
    """`out_i = W_1 x_i + W_2 aggr_{j -> i} e_ji x_j + b`, the edge values `e_ji` weighting the messages.

    `"add"`: one SpMM, `A @ x`; `"mean"`: that over the number of in-edges (a sorted segment count of the stored
    entries); `"max"`: `C[Ai[g],n] max= Av[g,p] * x[Ak[g,p],n]`, 0 for nodes without in-edges.

    Shapes: `x` `(N, in_features)`, `A` `(N, N)` with `A[dst, src] = weight` -> `(N, out_features)`; bipartite:
    `x = (x_src, x_dst)`, `in_features = (F_src, F_dst)` and `A` `(N_dst, N_src)` -> `(N_dst, out_features)`.

    Example:
      >>> edge_index, x = np.array([[0, 1, 2, 3], [1, 2, 3, 0]]), jnp.ones((4, 16))   # a ring of 4 nodes
      >>> A = jinsum.graphs.adjacency(edge_index, num_nodes=4)
      >>> jinsum.nn.GraphConv(16, 32, aggr="mean", rngs=nnx.Rngs(0))(x, A).shape
      (4, 32)
    """

    def __init__(self, in_features: int | tuple[int, int], out_features: int, *, aggr: str = "add",
                 use_bias: bool = True, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        """Creates `lin_rel` (`W_2`, with the bias `b`) and `lin_root` (`W_1`), as PyG names them.

        Args:
          in_features: feature size of the input; `(F_src, F_dst)` for a bipartite graph.
          out_features: feature size of the output.
          aggr: `"add"`, `"mean"` or `"max"` over each node's in-edges.
          use_bias: add a learned bias `b`.
          dtype: the computation's dtype (features, weights and the adjacency's values are cast to it, as
            `nnx.Linear` casts them; sparse products accumulate as their statements do, in float32 for bfloat16);
            None: JAX's promotion of the input and the parameters (`jinsum.nn._dtypes`).
          param_dtype: the parameters' dtype.
          rngs: initialises the weights.
        """
        if aggr not in AGGREGATIONS:
            raise ValueError(f"GraphConv: aggr must be one of {AGGREGATIONS}, got {aggr!r}")
        check_dtypes("GraphConv", dtype, param_dtype)
        self.aggr = aggr
        in_src, in_dst = feature_pair("GraphConv", in_features)
        in_dst = in_src if in_dst is None else in_dst
        (out_features,) = layer_sizes("GraphConv", out_features=out_features)
        self.lin_rel = nnx.Linear(in_src, out_features, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                                  rngs=rngs)
        self.lin_root = nnx.Linear(in_dst, out_features, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                                   rngs=rngs)

    def __call__(self, x: jax.Array | tuple[jax.Array, jax.Array], A: GroupCOO) -> jax.Array:
        """`x` `(N, in_features)` or `(x_src, x_dst)`, `A` a `GroupCOO` `(N_dst, N_src)` -> `(N_dst, out_features)`."""
        x_src, x = node_features("GraphConv", x)
        expect_adjacency("GraphConv", A, x, in_features=self.lin_root.in_features, sources=x_src,
                         source_features=self.lin_rel.in_features)
        x_src, x, kernel = promote(self.lin_rel.dtype, x_src, x, self.lin_rel.kernel[...])
        if self.aggr == "max":
            return self.lin_rel(aggregate_extreme(A, x_src, "max", weighted=True)) + self.lin_root(x)
        # A sum or a mean commutes with `W_2`: it runs on the narrower side (the bias after it).
        first = transform_first(A, self.lin_rel.in_features, self.lin_rel.out_features)
        messages = aggregate(A, x_src @ kernel if first else x_src)
        if self.aggr == "mean":  # (counts in float32 at least: exact where bfloat16 would not be)
            count = row_sums(A.with_values((A.Av != 0).astype(jnp.promote_types(x.dtype, jnp.float32))))[:, None]
            messages = messages / jnp.maximum(count, 1).astype(messages.dtype)
        out = messages if first else messages @ kernel
        if self.lin_rel.bias is not None:
            out = out + self.lin_rel.bias[...].astype(out.dtype)
        return out + self.lin_root(x)
