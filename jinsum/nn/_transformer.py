"""Graph transformer convolution (Shi et al., 2021, "Masked label prediction"): dot-product attention over each
node's in-edges, one fused `jinsum.attention` chain."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

import jinsum
from jinsum.formats import GroupCOO
from jinsum.nn._dtypes import check_dtypes
from jinsum.nn._graph import expect_adjacency, node_features
from jinsum.nn._sizes import feature_pair, layer_sizes


class TransformerConv(nnx.Module):
    """`out_i = W_s x_i + sum_{j -> i} alpha_ij W_v x_j`, `alpha_ij = softmax_j((W_q x_i) . (W_k x_j) / sqrt(C))`
    per head (PyG's `TransformerConv`, without edge features).

    The attention over the stored edges is one `jinsum.attention` chain (scores, softmax, weighted sum; one
    generated kernel on CUDA and a FlashAttention-2-style backward). No self loops are added. With `beta`, the
    skip connection is gated: `beta_i = sigmoid(w . [o_i, r_i, o_i - r_i])`, `out_i = beta_i r_i + (1 - beta_i) o_i`.
    Nodes without in-edges aggregate 0.

    Shapes: `x` `(N, in_features)` or `(x_src, x_dst)`, `A` `(N_dst, N_src)` with `A[dst, src] != 0` for each edge
    -> `(N_dst, heads * out_features)` if `concat`, else `(N_dst, out_features)`. `A` may be a `jinsum.shard`
    partition (one node set), `x` then laid out by it.

    Example:
      >>> edge_index, x = np.array([[0, 1, 2, 3], [1, 2, 3, 0]]), jnp.ones((4, 16))   # a ring of 4 nodes
      >>> A = jinsum.graphs.adjacency(edge_index, num_nodes=4)
      >>> conv = jinsum.nn.TransformerConv(16, 8, heads=4, rngs=nnx.Rngs(0))
      >>> conv(x, A).shape                                                 # (N, heads * 8)
      (4, 32)
    """

    def __init__(self, in_features: int | tuple[int, int], out_features: int, *, heads: int = 1,
                 concat: bool = True, beta: bool = False, root_weight: bool = True, use_bias: bool = True,
                 dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        """Creates `lin_query`, `lin_key`, `lin_value` (with biases), `lin_skip` and `lin_beta`, as PyG names them.

        Args:
          in_features: feature size of the input; `(F_src, F_dst)` for a bipartite graph.
          out_features: feature size of each head.
          heads: number of attention heads `H`.
          concat: concatenate the heads' outputs (`H * out_features`), else average them.
          beta: gate the skip connection (`lin_beta`; with `root_weight`).
          root_weight: add the skip connection `W_s x_i` (`lin_skip`).
          use_bias: the skip connection's bias.
          dtype: the computation's dtype (features and weights are cast to it, as `nnx.Linear` casts them; the
            attention accumulates as its statements do, in float32 for bfloat16); None: JAX's promotion of the
            input and the parameters (`jinsum.nn._dtypes`).
          param_dtype: the parameters' dtype.
          rngs: initialises the parameters.
        """
        out_features, heads = layer_sizes("TransformerConv", out_features=out_features, heads=heads)
        check_dtypes("TransformerConv", dtype, param_dtype)
        in_src, in_dst = feature_pair("TransformerConv", in_features)
        in_dst = in_src if in_dst is None else in_dst
        self.heads, self.out_features, self.concat = heads, out_features, concat
        width = heads * out_features

        def linear(a, b, bias=True):
            return nnx.Linear(a, b, use_bias=bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

        self.lin_query = linear(in_dst, width)
        self.lin_key, self.lin_value = linear(in_src, width), linear(in_src, width)
        out_width = width if concat else out_features
        self.lin_skip = linear(in_dst, out_width, use_bias) if root_weight else None
        self.lin_beta = linear(3 * out_width, 1, False) if beta and root_weight else None

    def __call__(self, x: jax.Array | tuple[jax.Array, jax.Array], A: GroupCOO) -> jax.Array:
        """`x` `(N, in_features)` or `(x_src, x_dst)`, `A` a `GroupCOO` `(N_dst, N_src)` -> see the class."""
        x_src, x = node_features("TransformerConv", x)
        expect_adjacency("TransformerConv", A, x, in_features=self.lin_query.in_features, sources=x_src,
                         source_features=self.lin_key.in_features)
        H, C = self.heads, self.out_features
        q = self.lin_query(x).reshape(x.shape[0], H, C)
        k = self.lin_key(x_src).reshape(x_src.shape[0], H, C)
        v = self.lin_value(x_src).reshape(x_src.shape[0], H, C)
        attend = jinsum.shard.attention if isinstance(A, jinsum.shard.Partitioned) else jinsum.attention
        out = attend(q, k, v, A, scale=1 / math.sqrt(C))
        out = out.reshape(x.shape[0], H * C) if self.concat else out.mean(axis=1)
        if self.lin_skip is None:
            return out
        root = self.lin_skip(x)
        if self.lin_beta is None:
            return out + root
        gate = jax.nn.sigmoid(self.lin_beta(jnp.concatenate([out, root, out - root], axis=-1)))
        return gate * root + (1 - gate) * out
