"""Graph attention (Velickovic et al., 2018) on a sparse adjacency: SDDMM scores, edge softmax, multi-head SpMM."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import jinsum
from jinsum.formats import GroupCOO
from jinsum.nn._graph import expect_adjacency, row_sums


class GATConv(nnx.Module):
    """Multi-head graph attention: `out_i = sum_j alpha_ij W x_j` per head, `alpha` a softmax over `i`'s in-edges.

    With `h = x W` split into heads `(N, H, F)`, the score of edge `j -> i` is
    `e_ij = LeakyReLU(a_dst . h_i + a_src . h_j)`. Every step is sparse over the stored edges only:

    1. scores, one SDDMM per layer call: with per-head `X_i = [s_dst_i, 1]` and `Y_j = [1, s_src_j]`,
       `E[g,p,h] = X[Ai[g],h,t] * Y[Ak[g,p],h,t]` sums over `t` to `s_dst_i + s_src_j`;
    2. edge softmax per destination, stable: the row maximum is a `jax.ops.segment_max` over the sorted rows
       `Ai` (of each group's maximum), `P = exp(E - max)` is 0 on padding slots, and the row sums are one sorted
       segment sum `D[Ai[g],h] += P[g,p,h]`;
    3. aggregation, one multi-head SpMM `C[Ai[g],h,f] += P[g,p,h] * h[Ak[g,p],h,f]`, divided by the row sums
       afterwards (per node rather than per edge: fewer divisions, same result, also after dropout).

    The adjacency's values only say which entries are edges (nonzero); their weights and multiplicities are
    ignored. With `add_self_loops`, stored self loops are dropped and every node attends to itself once, as
    PyG does; the self-loop terms are dense per-node vectors, so the adjacency is never rebuilt. Without self
    loops, a node with no in-edges outputs the bias only.

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
        self.heads, self.out_features, self.concat = heads, out_features, concat
        self.negative_slope, self.add_self_loops = negative_slope, add_self_loops
        self.linear = nnx.Linear(in_features, heads * out_features, use_bias=False, param_dtype=param_dtype,
                                 rngs=rngs)
        init = nnx.initializers.glorot_uniform()
        self.att_src = nnx.Param(init(rngs.params(), (heads, out_features), param_dtype))
        self.att_dst = nnx.Param(init(rngs.params(), (heads, out_features), param_dtype))
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        width = heads * out_features if concat else out_features
        self.bias = nnx.Param(jnp.zeros((width,), param_dtype)) if use_bias else None

    def __call__(self, x: jax.Array, A: GroupCOO) -> jax.Array:
        """`x` `(N, in_features)`, `A` a `GroupCOO` `(N, N)` -> `(N, heads * out_features)` or `(N, out_features)`."""
        expect_adjacency("GATConv", A, x)
        n = x.shape[0]
        h = self.linear(x).reshape(n, self.heads, self.out_features)
        s_src = jnp.einsum("nhf,hf->nh", h, self.att_src[...])
        s_dst = jnp.einsum("nhf,hf->nh", h, self.att_dst[...])
        ones = jnp.ones_like(s_src)
        scores = jinsum.einsum("E[g,p,h] = X[Ai[g],h,t] * Y[Ak[g,p],h,t]", A=A,
                               X=jnp.stack([s_dst, ones], -1), Y=jnp.stack([ones, s_src], -1))
        scores = jax.nn.leaky_relu(scores, self.negative_slope)
        edge = A.Av != 0  # padding slots hold 0
        if self.add_self_loops:
            edge = edge & (A.Ak != A.Ai[:, None])
            self_scores = jax.nn.leaky_relu(s_dst + s_src, self.negative_slope)
        edge = edge[..., None]

        # The shift only keeps exp() in range; it cancels in the softmax, so it carries no gradient.
        group_max = jnp.max(jnp.where(edge, scores, -jnp.inf), axis=1)
        row_max = jax.ops.segment_max(group_max, A.Ai, num_segments=n, indices_are_sorted=True)
        if self.add_self_loops:
            row_max = jnp.maximum(row_max, self_scores)
        row_max = jax.lax.stop_gradient(row_max)
        # Masking the exponent (not its result) keeps padding slots at exactly 0 with zero gradient.
        weights = jnp.exp(jnp.where(edge, scores - row_max[A.Ai][:, None], -jnp.inf))
        totals = row_sums(A.with_values(weights))
        out = jinsum.einsum("ikh,khf->ihf", A.with_values(self.dropout(weights)), h)
        if self.add_self_loops:
            self_weights = jnp.exp(self_scores - row_max)
            totals = totals + self_weights
            out = out + self.dropout(self_weights)[..., None] * h
        out = out / jnp.where(totals > 0, totals, 1)[..., None]

        out = out.reshape(n, -1) if self.concat else out.mean(axis=1)
        return out if self.bias is None else out + self.bias[...]
