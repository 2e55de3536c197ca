"""Graphs with typed edges (PyG's `edge_type`), as `jinsum.nn.RGCNConv` reads them: a `RelationalGraph` (the edges
sorted by destination, each with its relation and the `1 / c_{dst,rel}` of a mean), or, to split them over devices,
a `relational_adjacency` (`A[dst, src, rel]`). Built on the host, once.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jinsum.formats import GroupCOO
from jinsum.formats._convert import as_jax_array, check_int, host_array


@dataclasses.dataclass(frozen=True)
class RelationalGraph:
    """A graph with typed edges, as `jinsum.nn.RGCNConv` reads it. Build it with `relational_graph`.

    A pytree: the arrays are its leaves (they pass through `jit` as arguments); the sizes are static.

    Attributes:
      src, dst, rel: int32 `(E,)`, the source, destination and relation of each edge, sorted by `dst` (the
        messages are then summed by a sorted segment reduction).
      norm: float `(E,)` (float64 where JAX's x64 mode is on), `1 / c_{dst,rel}`: one over the number of edges of
        the edge's relation into its destination, so each relation's messages are averaged.
      num_nodes, num_relations: `N` and `R`.
    """

    src: jax.Array
    dst: jax.Array
    rel: jax.Array
    norm: jax.Array
    num_nodes: int
    num_relations: int


jax.tree_util.register_dataclass(RelationalGraph, data_fields=["src", "dst", "rel", "norm"],
                                 meta_fields=["num_nodes", "num_relations"])


def relational_graph(src, dst, rel, num_nodes: int, num_relations: int) -> RelationalGraph:
    """Builds a `RelationalGraph` on the host (NumPy): checks the indices, sorts the edges, counts `c_{i,r}`.

    Call it once, outside the jitted step.

    Args:
      src, dst, rel: int `(E,)`: edge `e` goes from node `src[e]` to node `dst[e]` with relation `rel[e]`.
      num_nodes: `N`; every node index must lie in `[0, N)`.
      num_relations: `R`; every relation must lie in `[0, R)`.

    Example:
      >>> src, dst, rel = np.array([0, 1, 2, 2]), np.array([1, 2, 0, 1]), np.array([0, 1, 1, 0])
      >>> g = jinsum.graphs.relational_graph(src, dst, rel, num_nodes=3, num_relations=2)
    """
    where = "jinsum.graphs.relational_graph"
    num_nodes = check_int(where, "num_nodes", num_nodes)
    num_relations = check_int(where, "num_relations", num_relations, minimum=1)
    arrays = {"src": host_array(where, src), "dst": host_array(where, dst), "rel": host_array(where, rel)}
    for name, values in arrays.items():
        bound = num_relations if name == "rel" else num_nodes
        if values.shape != arrays["src"].shape or values.ndim != 1 or not np.issubdtype(values.dtype, np.integer):
            raise ValueError(f"{where}: src, dst and rel must be integer arrays of one shape (E,); got {name} "
                             f"{values.dtype}{list(values.shape)} and src {list(arrays['src'].shape)}")
        bad = np.flatnonzero((values < 0) | (values >= bound))
        if bad.size:
            raise ValueError(f"{where}: {name}[{bad[0]}] = {values[bad[0]]} is out of range: expected 0 <= {name} < "
                             f"{bound} ({'num_relations' if name == 'rel' else 'num_nodes'})")
    order = np.argsort(arrays["dst"], kind="stable")
    src, dst, rel = (arrays[name][order].astype(np.int32) for name in ("src", "dst", "rel"))
    pair = dst.astype(np.int64) * num_relations + rel
    count = np.bincount(pair, minlength=num_nodes * num_relations)[pair]
    return RelationalGraph(as_jax_array(src), as_jax_array(dst), as_jax_array(rel),
                           as_jax_array(1 / count), num_nodes, num_relations)


def relational_adjacency(graph: RelationalGraph) -> GroupCOO:
    """A `RelationalGraph` as a `GroupCOO` `(N, N, R)`: `A[dst, src, r]` the number of edges of type `r` from
    `src` to `dst`, for `jinsum.shard.partition` (`RGCNConv` takes the partition). Host side; it stores `R` values
    per (destination, source) pair, so it suits graphs of few relations.

    Example:
      >>> src, dst, rel = np.array([0, 1, 2, 2]), np.array([1, 2, 0, 1]), np.array([0, 1, 1, 0])
      >>> g = jinsum.graphs.relational_graph(src, dst, rel, num_nodes=3, num_relations=2)
      >>> A = jinsum.graphs.relational_adjacency(g)
      >>> A.shape                                                      # (N, N, R)
      (3, 3, 2)
      >>> P = jinsum.shard.partition(A, jax.make_mesh((jax.device_count(),), ("x",)))
      >>> conv = jinsum.nn.RGCNConv(8, 16, num_relations=2, rngs=nnx.Rngs(0))
      >>> P.unshard_rows(conv(P.shard_rows(jnp.ones((3, 8))), P)).shape
      (3, 16)
    """
    where = "jinsum.graphs.relational_adjacency"
    src, dst, rel = (host_array(where, a) for a in (graph.src, graph.dst, graph.rel))
    values = np.zeros((src.size, graph.num_relations), np.float32)
    values[np.arange(src.size), rel] = 1
    return GroupCOO.from_edge_index(np.stack([src, dst]), values, num_nodes=graph.num_nodes).with_transpose()
