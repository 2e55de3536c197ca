"""GIN with edge features (Hu et al., 2020, "Strategies for pre-training GNNs"): per-edge messages summed per node."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jinsum.graphs import EdgeList
from jinsum.nn._edges import edges_of, expect_edge_adjacency
from jinsum.shard import Partitioned, per_part


class GINEConv(nnx.Module):
    """`out_i = mlp((1 + eps) x_i + sum_{j -> i} ReLU(x_j + W_e e_ji + b_e))` (PyG's `GINEConv`).

    Messages depend on each edge's features, so they are made edge by edge: the sources' rows gathered,
    `M[e,n] = X[src[e],n]`, the features added and ReLU'd, then summed into their destinations, `C[dst[e],n] +=
    M[e,n]`, a sorted segment reduction. Duplicate edges are separate messages. Without `edge_dim`, the edge features
    must have the nodes' width.

    Shapes: `x` `(N, F)`; the graph either an `EdgeList` over `N` nodes with `edge_attr` `(E, edge_dim or F)` in the
    order of the edge index the list was built from, or an `edge_adjacency` carrying the features (or its
    `jinsum.shard` partition, `x` then laid out by it) -> whatever `mlp` makes of `(N, F)`.

    Example:
      >>> edges = jinsum.nn.edge_list(edge_index, num_nodes=N)
      >>> conv = jinsum.nn.GINEConv(mlp, edge_dim=4, in_features=16, rngs=nnx.Rngs(0))
      >>> y = conv(x, edges, edge_attr)                               # edge_attr (E, 4)
      >>> P = jinsum.shard.partition(jinsum.nn.edge_adjacency(edge_index, N, edge_attr), mesh)
      >>> y = conv(P.shard_rows(x), P)                                # the same, over the devices of the mesh
    """

    def __init__(self, mlp: nnx.Module, *, eps: float = 0.0, train_eps: bool = False, edge_dim: int | None = None,
                 in_features: int | None = None, param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        """Wraps `mlp`, creates `eps` and, with `edge_dim`, the edge features' projection `lin` (`edge_dim ->
        in_features`, with bias; needs `in_features` and `rngs`)."""
        if edge_dim is not None and (in_features is None or rngs is None):
            raise ValueError("GINEConv: edge_dim needs in_features (the node features' width, which the edge "
                             "features are projected to) and rngs")
        self.mlp = mlp
        self.eps = nnx.Param(jnp.asarray(eps, param_dtype)) if train_eps else eps
        self.lin = (nnx.Linear(edge_dim, in_features, param_dtype=param_dtype, rngs=rngs) if edge_dim is not None
                    else None)

    def __call__(self, x: jax.Array, edges, edge_attr: jax.Array | None = None) -> jax.Array:
        """`x` `(N, F)`; `edges` an `EdgeList` with `edge_attr` `(E, edge_dim or F)`, or an `edge_adjacency` (or its
        partition) -> `mlp(...)` of `(N, F)`."""
        width = x.shape[1] if self.lin is None else self.lin.in_features
        if isinstance(edges, EdgeList):
            if edge_attr is None or edges.num_nodes != x.shape[0] or edge_attr.shape != (edges.src.shape[0], width):
                raise ValueError(f"GINEConv: expected node features (N, F) over the {edges.num_nodes} nodes of the "
                                 f"edge list and edge features ({edges.src.shape[0]}, {width}), got {tuple(x.shape)} "
                                 f"and {None if edge_attr is None else tuple(edge_attr.shape)}")
        else:
            expect_edge_adjacency("GINEConv", edges, x, width)
        lin = () if self.lin is None else nnx.split(self.lin)

        def summed(part, x_src, *lin_state, out=None):
            view = edges_of("GINEConv", part, edge_attr)
            features = view.attr if not lin_state else nnx.merge(lin[0], *lin_state)(view.attr)
            return view.sum_into(jax.nn.relu(view.gather(x_src) + features), out)

        if isinstance(edges, Partitioned):
            messages = per_part(summed, edges, columns=(x,), replicated=lin[1:])
        else:
            messages = summed(edges, x, *lin[1:])
        eps = self.eps[...] if isinstance(self.eps, nnx.Param) else self.eps
        return self.mlp((1 + eps) * x + messages)
