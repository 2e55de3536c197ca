"""Graph attention (Velickovic et al., 2018) on a sparse adjacency: scores, edge softmax and aggregation as one
fused `jinsum.attention` chain."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import jinsum
from jinsum.formats import GroupCOO
from jinsum.nn._dropout import dropout_seed
from jinsum.nn._graph import expect_adjacency


class GATConv(nnx.Module):
    """Multi-head graph attention: `out_i = sum_j alpha_ij W x_j` per head, `alpha` a softmax over `i`'s in-edges.

    With `h = x W` split into heads `(N, H, F)`, the score of edge `j -> i` is
    `e_ij = LeakyReLU(a_dst . h_i + a_src . h_j)`. The whole layer's sparse work is one fused chain,
    `jinsum.attention` over the adjacency (a `GroupCOO`: one score per stored edge):

    - scores by the rank-2 trick: with per-head `X_i = [s_dst_i, 1]` and `Y_j = [1, s_src_j]`, the dot product
      `X_i . Y_j = s_dst_i + s_src_j`, and `score_mod` is the LeakyReLU;
    - a stable softmax over each node's in-edges, attention dropout, and the weighted sum of `h`;
    on CUDA one generated kernel (and its FlashAttention-2-style backward), elsewhere the unfused statements.

    The adjacency's values only say which entries are edges (nonzero); their weights and multiplicities are
    ignored. With `add_self_loops`, stored self loops are dropped and every node attends to itself once, as
    PyG does, without rebuilding the adjacency. Without self loops, a node with no in-edges outputs the bias only.

    Shapes: `x` `(N, in_features)`, `A` `(N, N)` with `A[dst, src] != 0` for each edge ->
    `(N, heads * out_features)` if `concat`, else `(N, out_features)` (the mean over heads).

    Example:
      >>> A = jinsum.nn.adjacency(edge_index, num_nodes=N)
      >>> gat = jinsum.nn.GATConv(16, 8, heads=4, dropout=0.6, rngs=nnx.Rngs(0))
      >>> y = gat(x, A)                       # (N, 32); gat.eval() turns the attention dropout off
    """

    def __init__(self, in_features: int, out_features: int, *, heads: int = 1, concat: bool = True,
                 negative_slope: float = 0.2, dropout: float = 0.0, add_self_loops: bool = True,
                 use_bias: bool = True, param_dtype=jnp.float32, rngs: nnx.Rngs):
        """Creates the parameters.

        Args:
          in_features: feature size of the input.
          out_features: feature size of each head.
          heads: number of attention heads `H`.
          concat: concatenate the heads' outputs (`H * out_features`), else average them.
          negative_slope: slope of the LeakyReLU on the scores.
          dropout: dropout rate on the attention weights, while the module is not in `eval()` mode (draws from
            the `dropout` stream of `rngs`, else its default stream).
          add_self_loops: every node attends to itself (stored self loops are replaced).
          use_bias: add a learned bias to the output.
          param_dtype: dtype of the parameters; the computation follows JAX's promotion of input and parameters.
          rngs: initialises the parameters and seeds the dropout.
        """
        if heads < 1 or out_features < 1:
            raise ValueError(f"GATConv: heads and out_features must be >= 1, got heads={heads}, "
                             f"out_features={out_features}")
        self.heads, self.out_features, self.concat = heads, out_features, concat
        self.negative_slope, self.add_self_loops = negative_slope, add_self_loops
        self.linear = nnx.Linear(in_features, heads * out_features, use_bias=False, param_dtype=param_dtype,
                                 rngs=rngs)
        init = nnx.initializers.glorot_uniform()
        self.att_src = nnx.Param(init(rngs.params(), (heads, out_features), param_dtype))
        self.att_dst = nnx.Param(init(rngs.params(), (heads, out_features), param_dtype))
        self.dropout = nnx.Dropout(dropout, rngs=rngs)  # holds the rate, the train/eval switch and the stream
        width = heads * out_features if concat else out_features
        self.bias = nnx.Param(jnp.zeros((width,), param_dtype)) if use_bias else None

    def __call__(self, x: jax.Array, A: GroupCOO) -> jax.Array:
        """`x` `(N, in_features)`, `A` a `GroupCOO` `(N, N)` -> `(N, heads * out_features)` or `(N, out_features)`."""
        expect_adjacency("GATConv", A, x, in_features=self.linear.in_features)
        n = x.shape[0]
        h = self.linear(x).reshape(n, self.heads, self.out_features)
        s_src = jnp.einsum("nhf,hf->nh", h, self.att_src[...])
        s_dst = jnp.einsum("nhf,hf->nh", h, self.att_dst[...])
        ones = jnp.ones_like(s_src)
        slope = self.negative_slope
        rate, seed = dropout_seed(self.dropout)
        out = jinsum.attention(jnp.stack([s_dst, ones], -1), jnp.stack([ones, s_src], -1), h, A, scale=1.0,
                               score_mod=lambda s, b, head, i, j: jax.nn.leaky_relu(s, slope),
                               self_loops=self.add_self_loops, dropout=rate, seed=seed)
        out = out.reshape(n, -1) if self.concat else out.mean(axis=1)
        return out if self.bias is None else out + self.bias[...]

