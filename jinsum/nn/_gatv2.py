"""GATv2 (Brody et al., 2022, "How attentive are graph attention networks?"): attention scores computed after the
nonlinearity, hence edge by edge."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jinsum.nn._dtypes import check_dtypes
from jinsum.nn._edges import SoftmaxSums, attend, edges_of, expect_edges, feature_sums_over, mean_features
from jinsum.nn._sizes import layer_sizes
from jinsum.shard import Partitioned, per_part


class GATv2Conv(nnx.Module):
    """`out_i = sum_j alpha_ij W_l x_j` per head, `alpha` a softmax over `i`'s in-edges (and itself) of
    `e_ij = a . LeakyReLU(W_l x_j + W_r x_i [+ W_e e_ji])` (PyG's `GATv2Conv`).

    The score is not a dot product of a source and a destination term (the LeakyReLU comes first), so it is
    computed edge by edge: the endpoints' rows gathered (`M[e,h,c] = XL[S[e],h,c]`), the scores, then the softmax
    sums (`jinsum.nn._edges.attend`: the shift a `max=` per node, the sums and the output sorted segment reductions).
    With `add_self_loops`, stored self loops are ignored and every node attends to itself once, its edge features
    (with `edge_dim`) the mean of its in-edges' (PyG's `fill_value="mean"`). On a partition each device attends over
    its local edges, then its remote ones, and merges the two sums.

    Shapes: `x` `(N, in_features)`; `edges` an `EdgeList` over `N` nodes with `edge_attr` `(E, edge_dim)` in the edge
    index's order (with `edge_dim`), or an `edge_adjacency` carrying the features (or its `jinsum.shard` partition,
    `x` then laid out by it) -> `(N, heads * out_features)` if `concat`, else `(N, out_features)`.

    Example:
      >>> edge_index, x = np.array([[0, 1, 2, 3], [1, 2, 3, 0]]), jnp.ones((4, 16))   # a ring of 4 nodes
      >>> edges = jinsum.graphs.edge_list(edge_index, num_nodes=4)
      >>> jinsum.nn.GATv2Conv(16, 8, heads=4, rngs=nnx.Rngs(0))(x, edges).shape   # (N, heads * 8)
      (4, 32)
    """

    def __init__(self, in_features: int, out_features: int, *, heads: int = 1, concat: bool = True,
                 negative_slope: float = 0.2, add_self_loops: bool = True, edge_dim: int | None = None,
                 share_weights: bool = False, use_bias: bool = True, dtype=None, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        """Creates `lin_l`, `lin_r` (the same layer with `share_weights`), `att`, `lin_edge` and `bias`.

        Args:
          in_features: feature size of the input.
          out_features: feature size of each head.
          heads: number of attention heads `H`.
          concat: concatenate the heads' outputs (`H * out_features`), else average them.
          negative_slope: slope of the LeakyReLU inside the scores.
          add_self_loops: every node attends to itself (stored self loops are replaced).
          edge_dim: width of the edge features that enter the scores (projected by `lin_edge`).
          share_weights: one layer for the sources and the destinations (`lin_r` is `lin_l`).
          use_bias: biases on `lin_l`, `lin_r` and the output.
          dtype: the computation's dtype (features, weights and edge features are cast to it, as `nnx.Linear`
            casts them; the softmax sums accumulate as their statements do, in float32 for bfloat16); None: JAX's
            promotion of the input and the parameters (`jinsum.nn._dtypes`).
          param_dtype: the parameters' dtype.
          rngs: initialises the parameters.
        """
        in_features, out_features, heads = layer_sizes("GATv2Conv", in_features=in_features,
                                                       out_features=out_features, heads=heads)
        if edge_dim is not None:
            (edge_dim,) = layer_sizes("GATv2Conv", edge_dim=edge_dim)
        check_dtypes("GATv2Conv", dtype, param_dtype)
        self.heads, self.out_features, self.concat = heads, out_features, concat
        self.negative_slope, self.add_self_loops = negative_slope, add_self_loops
        width = heads * out_features
        linear = functools.partial(nnx.Linear, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.lin_l = linear(in_features, width, use_bias=use_bias)
        self.lin_r = self.lin_l if share_weights else linear(in_features, width, use_bias=use_bias)
        self.att = nnx.Param(nnx.initializers.glorot_uniform()(rngs.params(), (heads, out_features), param_dtype))
        self.lin_edge = linear(edge_dim, width, use_bias=False) if edge_dim is not None else None
        self.bias = nnx.Param(jnp.zeros((width if concat else out_features,), param_dtype)) if use_bias else None

    def __call__(self, x: jax.Array, edges, edge_attr: jax.Array | None = None) -> jax.Array:
        """`x` `(N, in_features)`; `edges` an `EdgeList` (with `edge_attr` `(E, edge_dim)` if the layer has
        `edge_dim`), or an `edge_adjacency` carrying the features (or its partition) -> see the class."""
        H, C = self.att.shape
        expect_edges("GATv2Conv", x, edges, edge_attr, self.lin_l.in_features,
                     None if self.lin_edge is None else self.lin_edge.in_features)
        n = x.shape[0]
        left, right = self.lin_l(x).reshape(n, H, C), self.lin_r(x).reshape(n, H, C)
        att = self.att[...].astype(left.dtype)  # (the computation's dtype, which the linear maps chose)
        lin_edge = () if self.lin_edge is None else nnx.split(self.lin_edge)
        initial = ()  # (the self loops' sums, where the layer adds them)
        if self.add_self_loops:  # (stored self loops are replaced by one per node)
            own = left + right
            if self.lin_edge is not None:
                means = mean_features(feature_sums_over("GATv2Conv", edges, edge_attr))
                own = own + self.lin_edge(means).reshape(n, H, C)
            initial = tuple(SoftmaxSums.own(self._score(own, att), left))

        def attend_part(part, right, *rest, out=None):
            start, (left, att, *edge_state) = rest[:len(initial)], rest[len(initial):]
            view = edges_of("GATv2Conv", part, edge_attr)
            pairs = view.gather(left) + view.gather(right, at="dst")
            if edge_state:
                pairs = pairs + nnx.merge(lin_edge[0], *edge_state)(view.attr).reshape(view.attr.shape[0], H, C)
            scores = self._score(pairs, att)
            if self.add_self_loops and out is None:  # (the local part, or the whole graph: sources are own nodes)
                scores = jnp.where((view.src == view.dst)[:, None], -jnp.inf, scores)
            return attend(view, scores, left, out if out is not None else SoftmaxSums(*start) if start else None)

        replicated = (att, *lin_edge[1:])
        if isinstance(edges, Partitioned):
            sums = per_part(attend_part, edges, rows=(right, *initial), columns=(left,), replicated=replicated)
        else:
            sums = attend_part(edges, right, *initial, left, *replicated)
        out = SoftmaxSums(*sums).result()
        out = out.reshape(n, H * C) if self.concat else out.mean(axis=1)
        return out if self.bias is None else out + self.bias[...].astype(out.dtype)

    def _score(self, pairs: jax.Array, att: jax.Array) -> jax.Array:
        return (jax.nn.leaky_relu(pairs, self.negative_slope) * att).sum(-1)

