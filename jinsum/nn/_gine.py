"""GIN with edge features (Hu et al., 2020, "Strategies for pre-training GNNs"): per-edge messages summed per node."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jinsum.nn._edges import edges_of, expect_edges
from jinsum.nn._dtypes import check_dtypes, promote
from jinsum.nn._sizes import layer_sizes
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
      >>> edge_index, x = np.array([[0, 1, 2, 3], [1, 2, 3, 0]]), jnp.ones((4, 16))   # a ring of 4 nodes
      >>> edges, edge_attr = jinsum.graphs.edge_list(edge_index, num_nodes=4), jnp.ones((4, 4))   # edge_attr (E, 4)
      >>> mlp = nnx.Linear(16, 32, rngs=nnx.Rngs(0))
      >>> conv = jinsum.nn.GINEConv(mlp, edge_dim=4, in_features=16, rngs=nnx.Rngs(1))
      >>> conv(x, edges, edge_attr).shape
      (4, 32)
      >>> P = jinsum.shard.partition(jinsum.graphs.edge_adjacency(edge_index, 4, edge_attr),
      ...                            jax.make_mesh((jax.device_count(),), ("x",)))
      >>> P.unshard_rows(conv(P.shard_rows(x), P)).shape              # the same, over the devices of the mesh
      (4, 32)
    """

    def __init__(self, mlp: nnx.Module, *, eps: float = 0.0, train_eps: bool = False, edge_dim: int | None = None,
                 in_features: int | None = None, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        """Wraps `mlp`, creates `eps` and, with `edge_dim`, the edge features' projection `lin`.

        Args:
          mlp: applied to the summed messages (any callable module, e.g. an `nnx.Sequential`); it computes by its
            own `dtype` (build it with the layer's for one dtype throughout).
          eps: the initial weight of a node's own features, `1 + eps`.
          train_eps: make `eps` a learned `nnx.Param`; otherwise it is a constant.
          edge_dim: project the edge features by `lin` (`edge_dim -> in_features`, with bias; needs `in_features`
            and `rngs`); None: the edge features have the nodes' width and are added as they are.
          in_features: the node features' width (with `edge_dim`).
          dtype: the computation's dtype (node and edge features, `eps` and `lin`'s weights are cast to it, as
            `nnx.Linear` casts them; the sums accumulate as their statements do, in float32 for bfloat16); None:
            JAX's promotion of the inputs and the parameters (`jinsum.nn._dtypes`).
          param_dtype: the parameters' dtype (`eps` when it is learned, `lin`).
          rngs: initialises `lin`.
        """
        if not callable(mlp):
            raise TypeError(f"GINEConv: mlp must be callable (a module such as nnx.Sequential), got "
                            f"{type(mlp).__name__}")
        if edge_dim is not None and (in_features is None or rngs is None):
            raise ValueError("GINEConv: edge_dim needs in_features (the node features' width, which the edge "
                             "features are projected to) and rngs")
        if edge_dim is not None:
            edge_dim, in_features = layer_sizes("GINEConv", edge_dim=edge_dim, in_features=in_features)
        check_dtypes("GINEConv", dtype, param_dtype)
        self.mlp, self.dtype = mlp, dtype
        self.eps = nnx.Param(jnp.asarray(eps, param_dtype)) if train_eps else eps
        self.lin = (nnx.Linear(edge_dim, in_features, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                    if edge_dim is not None else None)

    def __call__(self, x: jax.Array, edges, edge_attr: jax.Array | None = None) -> jax.Array:
        """`x` `(N, F)`; `edges` an `EdgeList` with `edge_attr` `(E, edge_dim or F)`, or an `edge_adjacency` (or its
        partition) -> `mlp(...)` of `(N, F)`."""
        if self.lin is None:  # (edge features of the nodes' width)
            in_features, edge_dim = None, jnp.shape(x)[-1] if jnp.ndim(x) else None
        else:
            in_features, edge_dim = self.lin.out_features, self.lin.in_features
        expect_edges("GINEConv", x, edges, edge_attr, in_features, edge_dim)
        eps = self.eps[...] if isinstance(self.eps, nnx.Param) else self.eps
        x, eps, *_ = promote(self.dtype, x, eps, *(() if self.lin is None else (self.lin.kernel[...],)))
        lin = () if self.lin is None else nnx.split(self.lin)

        def summed(part, x_src, *lin_state, out=None):
            view = edges_of("GINEConv", part, edge_attr)
            features = view.attr if not lin_state else nnx.merge(lin[0], *lin_state)(view.attr)
            if self.dtype is not None:  # (None: the edge features promote with the nodes' in the sum)
                features = features.astype(self.dtype)
            return view.sum_into(jax.nn.relu(view.gather(x_src) + features), out)

        if isinstance(edges, Partitioned):
            messages = per_part(summed, edges, columns=(x,), replicated=lin[1:])
        else:
            messages = summed(edges, x, *lin[1:])
        return self.mlp((1 + eps) * x + messages)
