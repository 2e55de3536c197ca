"""GATv2 (Brody et al., 2022, "How attentive are graph attention networks?"): attention scores computed after the
nonlinearity, hence edge by edge."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import jinsum
from jinsum.nn._graph import EdgeList, edge_softmax_aggregate, self_loop_features


class GATv2Conv(nnx.Module):
    """`out_i = sum_j alpha_ij W_l x_j` per head, `alpha` a softmax over `i`'s in-edges (and itself) of
    `e_ij = a . LeakyReLU(W_l x_j + W_r x_i [+ W_e e_ji])` (PyG's `GATv2Conv`).

    The score is not a dot product of a source and a destination term (the LeakyReLU comes first), so it is
    computed edge by edge on an `EdgeList`: the endpoints' rows gathered (`M[e,h,c] = XL[S[e],h,c]`), the scores,
    then `edge_softmax_aggregate` (the shift a `max=` per node, the sums and the output sorted segment
    reductions). With `add_self_loops`, stored self loops are ignored and every node attends to itself once, its
    edge features (with `edge_dim`) the mean of its in-edges' (PyG's `fill_value="mean"`).

    Shapes: `x` `(N, in_features)`, `edges` an `EdgeList` over `N` nodes, `edge_attr` `(E, edge_dim)` in the
    edge index's order (with `edge_dim`) -> `(N, heads * out_features)` if `concat`, else `(N, out_features)`.

    Example:
      >>> edges = jinsum.nn.edge_list(edge_index, num_nodes=N)
      >>> y = jinsum.nn.GATv2Conv(16, 8, heads=4, rngs=nnx.Rngs(0))(x, edges)   # (N, 32)
    """

    def __init__(self, in_features: int, out_features: int, *, heads: int = 1, concat: bool = True,
                 negative_slope: float = 0.2, add_self_loops: bool = True, edge_dim: int | None = None,
                 share_weights: bool = False, use_bias: bool = True, param_dtype=jnp.float32, rngs: nnx.Rngs):
        """Creates `lin_l`, `lin_r` (the same layer with `share_weights`), `att`, `lin_edge` and `bias`."""
        if heads < 1 or out_features < 1:
            raise ValueError(f"GATv2Conv: heads and out_features must be >= 1, got heads={heads}, "
                             f"out_features={out_features}")
        self.heads, self.out_features, self.concat = heads, out_features, concat
        self.negative_slope, self.add_self_loops = negative_slope, add_self_loops
        width = heads * out_features
        self.lin_l = nnx.Linear(in_features, width, use_bias=use_bias, param_dtype=param_dtype, rngs=rngs)
        self.lin_r = self.lin_l if share_weights else nnx.Linear(in_features, width, use_bias=use_bias,
                                                                 param_dtype=param_dtype, rngs=rngs)
        self.att = nnx.Param(nnx.initializers.glorot_uniform()(rngs.params(), (heads, out_features), param_dtype))
        self.lin_edge = (nnx.Linear(edge_dim, width, use_bias=False, param_dtype=param_dtype, rngs=rngs)
                         if edge_dim is not None else None)
        self.bias = nnx.Param(jnp.zeros((width if concat else out_features,), param_dtype)) if use_bias else None

    def __call__(self, x: jax.Array, edges: EdgeList, edge_attr: jax.Array | None = None) -> jax.Array:
        """`x` `(N, in_features)`, `edges` an `EdgeList`, `edge_attr` `(E, edge_dim)` with `edge_dim` -> see the
        class."""
        if not isinstance(edges, EdgeList) or edges.num_nodes != x.shape[0]:
            raise TypeError(f"GATv2Conv: expected the edges as a jinsum.nn.EdgeList over the {x.shape[0]} rows of x "
                            f"(jinsum.nn.edge_list(edge_index, num_nodes)), got {edges!r}")
        if (edge_attr is None) != (self.lin_edge is None):
            raise ValueError("GATv2Conv: pass edge_attr exactly when the layer was built with edge_dim")
        n, count, (H, C) = x.shape[0], edges.src.shape[0], self.att.shape
        left, right = self.lin_l(x).reshape(n, H, C), self.lin_r(x).reshape(n, H, C)

        def gather(table, index):
            return jinsum.einsum("M[e,h,c] = T[I[e],h,c]", M=jax.ShapeDtypeStruct((count, H, C), table.dtype),
                                 T=table, I=index)

        pairs = gather(left, edges.src) + gather(right, edges.dst)
        own = left + right
        if edge_attr is not None:
            attr = edge_attr[edges.order]
            pairs = pairs + self.lin_edge(attr).reshape(count, H, C)
            own = own + self.lin_edge(self_loop_features(edges, attr)).reshape(n, H, C)
        scores = self._score(pairs)
        if self.add_self_loops:  # (stored self loops are replaced by one per node)
            scores = jnp.where((edges.src == edges.dst)[:, None], -jnp.inf, scores)
        out, _, _ = edge_softmax_aggregate(edges, scores, left, self._score(own) if self.add_self_loops else None)
        out = out.reshape(n, H * C) if self.concat else out.mean(axis=1)
        return out if self.bias is None else out + self.bias[...]

    def _score(self, pairs: jax.Array) -> jax.Array:
        return (jax.nn.leaky_relu(pairs, self.negative_slope) * self.att[...]).sum(-1)
