"""A graph's edges one by one, for the layers whose messages depend on each edge (GINE, GATv2, GAT with edge
features); duplicate edges stay separate messages, as in PyG. Two forms, both built on the host, once:
- an `EdgeList` (`edge_list`): sources and destinations sorted by destination, the edge features kept apart in the
  caller's edge order;
- an `edge_adjacency`: the edges as the entries of a `GroupCOO` `(N, N, 1 + D)` whose values carry a 1 (an edge, not
  group padding) and the edge's features. Being a format, it can be split over devices by `jinsum.shard.partition`,
  which moves each edge, with its features, to the device of its destination.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jinsum.formats import GroupCOO
from jinsum.formats._convert import (as_jax_array, check_edge_index, check_group_size, check_int, groups_from_csr,
                                     host_array)


@dataclasses.dataclass(frozen=True)
class EdgeList:
    """A graph's edges one by one, sorted by destination, for layers whose messages depend on per-edge features
    (duplicate edges stay separate messages, as in PyG). Build it with `edge_list`.

    A pytree: `src`, `dst` int32 `(E,)` (sorted by `dst`) and `order` (E,), the position in the caller's edge order
    of each sorted edge (edge features given in that order are read as `edge_attr[order]`); `num_nodes` is static.
    """

    src: jax.Array
    dst: jax.Array
    order: jax.Array
    num_nodes: int


jax.tree_util.register_dataclass(EdgeList, data_fields=["src", "dst", "order"], meta_fields=["num_nodes"])


def edge_list(edge_index, num_nodes: int) -> EdgeList:
    """`edge_index` (2, E) (sources, destinations) as an `EdgeList`, on the host: call it once, outside `jit`.

    Example:
      >>> edge_index = np.array([[0, 1, 2, 3], [1, 2, 3, 0]])
      >>> edges = jinsum.graphs.edge_list(edge_index, num_nodes=4)
      >>> x, edge_attr = jnp.ones((4, 16)), jnp.ones((4, 16))       # edge_attr (E, F) in edge_index's order
      >>> jinsum.nn.GINEConv(nnx.Linear(16, 32, rngs=nnx.Rngs(0)))(x, edges, edge_attr).shape
      (4, 32)
    """
    src, dst, order, num_nodes = _sorted_edges("jinsum.graphs.edge_list", edge_index, num_nodes)
    return EdgeList(as_jax_array(src), as_jax_array(dst), as_jax_array(order), num_nodes)


def _sorted_edges(where: str, edge_index, num_nodes) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """`(src, dst, order, num_nodes)` on the host after the checks: the edges sorted by destination, stably (int32
    `(E,)` each), `order` the position of each in the caller's edge index."""
    num_nodes = check_int(where, "num_nodes", num_nodes)
    edge_index = host_array(where, edge_index)
    check_edge_index(where, edge_index, num_nodes)
    order = np.argsort(edge_index[1], kind="stable")
    src, dst = edge_index[:, order].astype(np.int32)
    return src, dst, order.astype(np.int32), num_nodes


def edge_adjacency(edge_index, num_nodes: int, edge_attr=None, *, group_size: int | None = None) -> GroupCOO:
    """The edges one by one as the entries of a `GroupCOO` `(N, N, 1 + D)`: `A[dst, src, 0] = 1` marks an edge and
    `A[dst, src, 1:]` are its features (`edge_attr` `(E, D)`, in `edge_index`'s order); duplicate edges stay separate
    entries (separate messages). On the host, once.

    `GINEConv`, `GATv2Conv` and `GATConv` take it, or its `jinsum.shard.partition` (which moves each edge and its
    features to the device of its destination), in place of an `EdgeList` and edge features.

    Example:
      >>> edge_index, edge_attr = np.array([[0, 1, 2, 3], [1, 2, 3, 0]]), np.ones((4, 4), np.float32)   # (E, 4)
      >>> A = jinsum.graphs.edge_adjacency(edge_index, 4, edge_attr)
      >>> A.shape                                                         # (N, N, 1 + 4)
      (4, 4, 5)
      >>> P = jinsum.shard.partition(A, jax.make_mesh((jax.device_count(),), ("x",)))
      >>> conv = jinsum.nn.GINEConv(nnx.Linear(16, 32, rngs=nnx.Rngs(0)), edge_dim=4, in_features=16, rngs=nnx.Rngs(1))
      >>> P.unshard_rows(conv(P.shard_rows(jnp.ones((4, 16))), P)).shape
      (4, 32)
    """
    where = "jinsum.graphs.edge_adjacency"
    src, dst, order, num_nodes = _sorted_edges(where, edge_index, num_nodes)
    if edge_attr is None:
        features = np.zeros((order.size, 0), np.float32)
    else:
        features = np.asarray(edge_attr)
        if features.ndim != 2 or features.shape[0] != order.size or not np.issubdtype(features.dtype, np.floating):
            raise ValueError(f"{where}: expected floating edge features (E, D) = "
                             f"({order.size}, D), got {features.dtype}{list(features.shape)}")
        features = features[order]
    values = np.concatenate([np.ones((order.size, 1), features.dtype), features], axis=1)
    lengths = np.bincount(dst, minlength=num_nodes)
    indptr = np.concatenate([[0], np.cumsum(lengths)])
    group_size = check_group_size(where, group_size, lengths)
    Ai, Ak, Av = groups_from_csr(indptr, src, values, group_size, values.dtype, num_nodes)
    return GroupCOO(Ai, Ak, Av, (num_nodes, num_nodes, values.shape[1]), nnz=order.size)
