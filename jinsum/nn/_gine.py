"""GIN with edge features (Hu et al., 2020, "Strategies for pre-training GNNs"): per-edge messages summed per node."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import jinsum
from jinsum.nn._graph import EdgeList


class GINEConv(nnx.Module):
    """`out_i = mlp((1 + eps) x_i + sum_{j -> i} ReLU(x_j + W_e e_ji + b_e))` (PyG's `GINEConv`).

    Messages depend on each edge's features, so they are made edge by edge: the sources' rows gathered,
    `M[e,n] = X[src[e],n]`, the features added and ReLU'd, then summed into their destinations, `C[dst[e],n] +=
    M[e,n]`, a sorted segment reduction (an `EdgeList` is sorted by destination). Duplicate edges are separate
    messages. Without `edge_dim`, the edge features must have the nodes' width.

    Shapes: `x` `(N, F)`, `edges` an `EdgeList` over `N` nodes, `edge_attr` `(E, edge_dim or F)` in the order of the
    edge index the list was built from -> whatever `mlp` makes of `(N, F)`.

    Example:
      >>> edges = jinsum.nn.edge_list(edge_index, num_nodes=N)
      >>> conv = jinsum.nn.GINEConv(mlp, edge_dim=4, in_features=16, rngs=nnx.Rngs(0))
      >>> y = conv(x, edges, edge_attr)                               # edge_attr (E, 4)
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

    def __call__(self, x: jax.Array, edges: EdgeList, edge_attr: jax.Array) -> jax.Array:
        """`x` `(N, F)`, `edges` an `EdgeList`, `edge_attr` `(E, edge_dim or F)` -> `mlp(...)` of `(N, F)`."""
        if not isinstance(edges, EdgeList):
            raise TypeError(f"GINEConv: expected the edges as a jinsum.nn.EdgeList, got {type(edges).__name__}; "
                            "build it once with jinsum.nn.edge_list(edge_index, num_nodes)")
        width = x.shape[1] if self.lin is None else self.lin.in_features
        if edges.num_nodes != x.shape[0] or edge_attr.shape != (edges.src.shape[0], width):
            raise ValueError(f"GINEConv: expected node features (N, F) over the {edges.num_nodes} nodes of the edge "
                             f"list and edge features ({edges.src.shape[0]}, {width}), got {tuple(x.shape)} and "
                             f"{tuple(edge_attr.shape)}")
        features = edge_attr[edges.order]
        if self.lin is not None:
            features = self.lin(features)
        count, width = edges.src.shape[0], x.shape[1]
        sources = jinsum.einsum("M[e,n] = X[S[e],n]", M=jax.ShapeDtypeStruct((count, width), x.dtype), X=x,
                                S=edges.src)
        messages = jax.nn.relu(sources + features)
        summed = jinsum.einsum("C[D[e],n] += M[e,n]", C=jax.ShapeDtypeStruct(x.shape, messages.dtype), D=edges.dst,
                               M=messages, sorted_indices=("D",))
        eps = self.eps[...] if isinstance(self.eps, nnx.Param) else self.eps
        return self.mlp((1 + eps) * x + summed)
