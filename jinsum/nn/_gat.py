"""Graph attention (Velickovic et al., 2018) on a sparse adjacency: scores, edge softmax and aggregation as one
fused `jinsum.attention` chain."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

import jinsum
from jinsum.formats import GroupCOO
from jinsum.graphs import EdgeList
from jinsum.nn._dropout import dropout_seed
from jinsum.nn._dtypes import check_dtypes
from jinsum.nn._edges import (SoftmaxSums, attend, edges_of, expect_edges, feature_sums_over, is_edge_adjacency,
                              mean_features)
from jinsum.nn._graph import expect_adjacency, node_features
from jinsum.nn._sizes import feature_pair, layer_sizes
from jinsum.shard import Partitioned, per_part


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

    Edge by edge: given an `EdgeList` (`jinsum.graphs.edge_list`) or an `edge_adjacency` instead of `A`, the layer
    computes each edge's score and the softmax sums (a `max=` per node for the shift, sorted segment sums), which
    also take edge features (`edge_dim`: `alpha_ij` gains `a_edge . W_e e_ij`; a self loop's features are the mean
    of the node's in-edges', PyG's `fill_value="mean"`). On an `EdgeList` it returns the attention weights
    (`return_attention_weights`: per edge `(E, heads)` in the edge index's order, 0 for stored self loops, and per
    node `(N, heads)` for the added ones; PyG returns them as one list with the self loops appended). An
    `edge_adjacency` can be partitioned (`jinsum.shard`): each device attends over its local edges, then its remote
    ones. No attention dropout on that path.

    Example:
      >>> edge_index, x = np.array([[0, 1, 2, 3], [1, 2, 3, 0]]), jnp.ones((4, 16))   # a ring of 4 nodes
      >>> A = jinsum.graphs.adjacency(edge_index, num_nodes=4)
      >>> gat = jinsum.nn.GATConv(16, 8, heads=4, dropout=0.6, rngs=nnx.Rngs(0))
      >>> gat(x, A).shape                     # (N, heads * 8); gat.eval() turns the attention dropout off
      (4, 32)
    """

    def __init__(self, in_features: int | tuple[int, int], out_features: int, *, heads: int = 1, concat: bool = True,
                 negative_slope: float = 0.2, dropout: float = 0.0, add_self_loops: bool = True,
                 edge_dim: int | None = None, use_bias: bool = True, dtype=None, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        """Creates the parameters.

        Args:
          in_features: feature size of the input; `(F_src, F_dst)` for a bipartite graph (then `x = (x_src, x_dst)`,
            `A` `(N_dst, N_src)` and no self loops).
          out_features: feature size of each head.
          heads: number of attention heads `H`.
          concat: concatenate the heads' outputs (`H * out_features`), else average them.
          negative_slope: slope of the LeakyReLU on the scores.
          dropout: dropout rate on the attention weights, while the module is not in `eval()` mode (draws from
            the `dropout` stream of `rngs`, else its default stream).
          add_self_loops: every node attends to itself (stored self loops are replaced).
          edge_dim: width of the edge features that enter the scores (edge by edge: an `EdgeList` or an
            `edge_adjacency`).
          use_bias: add a learned bias to the output.
          dtype: the computation's dtype (features, weights and edge features are cast to it, as `nnx.Linear`
            casts them; sparse products accumulate as their statements do, in float32 for bfloat16); None: JAX's
            promotion of the input and the parameters (`jinsum.nn._dtypes`).
          param_dtype: the parameters' dtype.
          rngs: initialises the parameters and seeds the dropout.
        """
        out_features, heads = layer_sizes("GATConv", out_features=out_features, heads=heads)
        check_dtypes("GATConv", dtype, param_dtype)
        in_src, in_dst = feature_pair("GATConv", in_features)
        if edge_dim is not None:
            (edge_dim,) = layer_sizes("GATConv", edge_dim=edge_dim)
        if not 0 <= dropout < 1:
            raise ValueError(f"GATConv: dropout must be in [0, 1), got {dropout}")
        self.heads, self.out_features, self.concat = heads, out_features, concat
        self.negative_slope, self.add_self_loops = negative_slope, add_self_loops
        linear = functools.partial(nnx.Linear, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.linear = linear(in_src, heads * out_features)
        # A bipartite layer transforms the destinations by their own weight (PyG's lin_dst; lin_src is `linear`).
        self.lin_dst = linear(in_dst, heads * out_features) if in_dst is not None else None
        init = nnx.initializers.glorot_uniform()
        self.att_src = nnx.Param(init(rngs.params(), (heads, out_features), param_dtype))
        self.att_dst = nnx.Param(init(rngs.params(), (heads, out_features), param_dtype))
        self.lin_edge = linear(edge_dim, heads * out_features) if edge_dim is not None else None
        self.att_edge = (nnx.Param(init(rngs.params(), (heads, out_features), param_dtype)) if edge_dim is not None
                         else None)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)  # holds the rate, the train/eval switch and the stream
        width = heads * out_features if concat else out_features
        self.bias = nnx.Param(jnp.zeros((width,), param_dtype)) if use_bias else None

    def __call__(self, x: jax.Array | tuple[jax.Array, jax.Array], A: GroupCOO | EdgeList,
                 edge_attr: jax.Array | None = None, *, return_attention_weights: bool = False):
        """`x` `(N, in_features)`, `A` a `GroupCOO` `(N, N)` or an `EdgeList` -> `(N, heads * out_features)` or
        `(N, out_features)`; with `return_attention_weights` (an `EdgeList`), also `(per edge, per node)`."""
        if (self.lin_dst is not None) != isinstance(x, (tuple, list)):
            raise ValueError("GATConv: a layer built with in_features=(F_src, F_dst) takes x = (x_src, x_dst), "
                             "and only it")
        if isinstance(A, EdgeList) or is_edge_adjacency(A):
            return self._edge_by_edge(x, A, edge_attr, return_attention_weights)
        if edge_attr is not None or return_attention_weights or self.lin_edge is not None:
            raise TypeError("GATConv: edge features and attention weights need the edges one by one: pass "
                            "jinsum.graphs.edge_list(edge_index, num_nodes) or "
                            "jinsum.graphs.edge_adjacency(edge_index, "
                            "num_nodes, edge_attr) instead of the adjacency")
        x_src, x = node_features("GATConv", x)
        if self.lin_dst is not None and self.add_self_loops:
            raise ValueError("GATConv: a bipartite graph has no self loops; build the layer with add_self_loops=False")
        expect_adjacency("GATConv", A, x, sources=x_src, source_features=self.linear.in_features,
                         in_features=None if self.lin_dst is None else self.lin_dst.in_features)
        h = self.linear(x_src).reshape(x_src.shape[0], self.heads, self.out_features)
        h_dst = h if self.lin_dst is None else self.lin_dst(x).reshape(x.shape[0], self.heads, self.out_features)
        s_src = jnp.einsum("nhf,hf->nh", h, self.att_src[...].astype(h.dtype))
        s_dst = jnp.einsum("nhf,hf->nh", h_dst, self.att_dst[...].astype(h.dtype))
        slope = self.negative_slope
        rate, seed = dropout_seed(self.dropout)
        queries = jnp.stack([s_dst, jnp.ones_like(s_dst)], -1)  # (queries . keys = s_dst + s_src)
        keys = jnp.stack([jnp.ones_like(s_src), s_src], -1)
        attend = jinsum.shard.attention if isinstance(A, jinsum.shard.Partitioned) else jinsum.attention
        out = attend(queries, keys, h, A, scale=1.0, score_mod=lambda s, b, head, i, j: jax.nn.leaky_relu(s, slope),
                     self_loops=self.add_self_loops, dropout=rate, seed=seed)
        return self._finish(out)

    def _finish(self, out: jax.Array) -> jax.Array:
        out = out.reshape(out.shape[0], self.heads * self.out_features) if self.concat else out.mean(axis=1)
        return out if self.bias is None else out + self.bias[...].astype(out.dtype)

    def _edge_by_edge(self, x, edges, edge_attr, return_attention_weights: bool):
        """On an `EdgeList` (with `edge_attr` if the layer has `edge_dim`), or an `edge_adjacency` (or its
        partition) carrying the edge features."""
        if self.lin_dst is not None or isinstance(x, (tuple, list)):
            raise ValueError("GATConv: edges one by one are of one node set: expected x (N, F) and a layer with one "
                             "in_features")
        expect_edges("GATConv", x, edges, edge_attr, self.linear.in_features,
                     None if self.lin_edge is None else self.lin_edge.in_features)
        if return_attention_weights and not isinstance(edges, EdgeList):
            raise NotImplementedError("GATConv: attention weights come in the edge index's order from an EdgeList "
                                      "(jinsum.graphs.edge_list), not from an edge_adjacency")
        if self.dropout.rate > 0 and not self.dropout.deterministic:
            raise NotImplementedError("GATConv: attention dropout runs in the fused path (pass the adjacency, "
                                      "a GroupCOO); on edges one by one, set dropout=0 or call .eval()")
        n, H, C = x.shape[0], self.heads, self.out_features
        h = self.linear(x).reshape(n, H, C)
        s_src = jnp.einsum("nhf,hf->nh", h, self.att_src[...].astype(h.dtype))
        s_dst = jnp.einsum("nhf,hf->nh", h, self.att_dst[...].astype(h.dtype))
        edge_layer = () if self.lin_edge is None else nnx.split(self.lin_edge)
        params = () if self.lin_edge is None else (self.att_edge[...].astype(h.dtype), *edge_layer[1:])

        def edge_score(features, att_edge, *edge_state):
            projected = nnx.merge(edge_layer[0], *edge_state)(features).reshape(features.shape[0], H, C)
            return jnp.einsum("ehf,hf->eh", projected, att_edge)

        def scores_of(view, s_src, s_dst, params, local: bool):
            scores = view.gather(s_src) + view.gather(s_dst, at="dst")
            if params:
                scores = scores + edge_score(view.attr, *params)
            scores = jax.nn.leaky_relu(scores, self.negative_slope)
            if self.add_self_loops and local:  # (stored self loops are replaced by one per node)
                scores = jnp.where((view.src == view.dst)[:, None], -jnp.inf, scores)
            return scores

        initial, own = (), None  # (the self loops' sums, where the layer adds them)
        if self.add_self_loops:
            own = s_src + s_dst
            if params:
                own = own + edge_score(mean_features(feature_sums_over("GATConv", edges, edge_attr)), *params)
            own = jax.nn.leaky_relu(own, self.negative_slope)
            initial = tuple(SoftmaxSums.own(own, h))

        def attend_part(part, s_dst, *rest, out=None):
            start, (h, s_src, *params) = rest[:len(initial)], rest[len(initial):]
            view = edges_of("GATConv", part, edge_attr)
            scores = scores_of(view, s_src, s_dst, params, local=out is None)  # (the first part is the local one)
            return attend(view, scores, h, out if out is not None else SoftmaxSums(*start) if start else None)

        if isinstance(edges, Partitioned):
            sums = per_part(attend_part, edges, rows=(s_dst, *initial), columns=(h, s_src), replicated=params)
        else:
            sums = attend_part(edges, s_dst, *initial, h, s_src, *params)
        sums = SoftmaxSums(*sums)
        out = self._finish(sums.result())
        if not return_attention_weights:
            return out
        view = edges_of("GATConv", edges, edge_attr)
        weights = sums.weights(scores_of(view, s_src, s_dst, params, local=True), view.dst)
        return out, (jnp.zeros_like(weights).at[edges.order].set(weights), None if own is None else sums.weights(own))
