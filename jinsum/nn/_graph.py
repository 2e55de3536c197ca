"""Graph adjacency for the layers: building it on the host, checking it at a call, and the sparse sums on it.

A graph is a `jinsum.GroupCOO` `A` with `A[dst, src] = weight`, so `A @ X` sums the features of each node's
sources into it. It is built once, outside `jit`, by `adjacency`; layers take it as an argument of every call.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp

import jinsum
from jinsum.formats import BlockGroupCOO, GroupCOO
from jinsum.formats._convert import check_edge_index
from jinsum.shard import Partitioned, matmul, per_part
from jinsum.shard import row_sums as partitioned_row_sums


def adjacency(edge_index, num_nodes: int | tuple[int, int], *, values=None, group_size: int | None = None,
              self_loops: bool = False, capacity: int | None = None) -> GroupCOO:
    """The `(N, N)` adjacency of a graph given as an edge index, for the layers of `jinsum.nn`; `(N_dst, N_src)`
    for a bipartite graph, `num_nodes=(N_src, N_dst)` (PyG's `size`).

    Without a capacity it runs on the host (NumPy): call it once, outside the jitted training step, and pass the
    result to every layer call. With `capacity=C` it runs inside `jit` on a graph that changes every step (padding
    edges marked by a negative index), its shapes fixed by `C` (`GroupCOO.from_edge_index(..., capacity=C)`; check
    `A.overflow`); self loops then take `N` more entries of their own.

    Args:
      edge_index: int `(2, E)`, row 0 the sources and row 1 the destinations (the PyG convention).
      num_nodes: `N`.
      values: `(E,)` edge weights; defaults to ones. Duplicate edges are summed.
      group_size: entries per group of the `GroupCOO`; defaults to `jinsum.default_group_size`.
      self_loops: add an edge `i -> i` of weight 1 for every node whose self loop is absent or weighs 0 (like
        PyG's `add_remaining_self_loops`); other edges of weight 0 are dropped. `GCNConv` and `GATConv` add
        their own self loops by default, without this.
      capacity: the most distinct edges (self loops aside) of a graph built inside `jit`; None: on the host.

    Returns:
      A `GroupCOO` with `A[dst, src] = weight`, carrying its entries in column order (`A.with_transpose()`), so
      that the gradients of the aggregations with respect to node features run the forward SpMM's kernel over the
      transpose (no atomic addition per edge) and the backward of `GATConv`'s attention over each node's out-edges
      sorts nothing in a jitted step.

    Example:
      >>> A = jinsum.nn.adjacency(np.array([[0, 1, 1], [1, 2, 0]]), num_nodes=3)
      >>> A.todense()   # A[1, 0], A[2, 1], A[0, 1] are 1
    """
    if capacity is not None:
        return _adjacency_on_device(edge_index, num_nodes, values, group_size, self_loops, capacity)
    if isinstance(num_nodes, tuple):
        return _bipartite_adjacency(edge_index, num_nodes, values, group_size, self_loops)
    A = GroupCOO.from_edge_index(edge_index, values, num_nodes=num_nodes, group_size=group_size)
    if self_loops:
        csr = A.to_scipy()
        missing = (csr.diagonal() == 0).astype(csr.dtype)
        A = GroupCOO.from_scipy(csr + sp.diags(missing), group_size=group_size, dtype=A.dtype)
    return A.with_transpose()


def _adjacency_on_device(edge_index, num_nodes, values, group_size, self_loops: bool, capacity: int) -> GroupCOO:
    """`adjacency` inside `jit`: the device builder, with PyG's remaining self loops as more edges (a node's own
    nonzero self loop kept, a weight-1 loop added where it has none; edges of weight 0 dropped)."""
    if not self_loops:
        return GroupCOO.from_edge_index(edge_index, values, num_nodes=num_nodes, capacity=capacity,
                                        group_size=group_size)
    if isinstance(num_nodes, tuple):
        raise ValueError(f"jinsum.nn.adjacency: a bipartite graph (num_nodes={num_nodes}) has no self loops")
    check_edge_index("jinsum.nn.adjacency", edge_index)
    edge_index = jnp.asarray(edge_index)
    weights = jnp.ones(edge_index.shape[1], jnp.float32) if values is None else jnp.asarray(values)
    src, dst = edge_index
    kept = (weights != 0) & (src >= 0) & (dst >= 0)
    own_loop = kept & (src == dst)
    has_loop = jnp.zeros(num_nodes, bool).at[jnp.where(own_loop, src, num_nodes)].set(True, mode="drop")
    nodes = jnp.arange(num_nodes, dtype=edge_index.dtype)
    loops = jnp.where(has_loop, -1, nodes)
    edges = jnp.concatenate([jnp.where(kept, edge_index, -1), jnp.stack([loops, loops])], axis=1)
    weights = jnp.concatenate([weights, jnp.ones(num_nodes, weights.dtype)])
    return GroupCOO.from_edge_index(edges, weights, num_nodes=num_nodes, capacity=capacity + num_nodes,
                                    group_size=group_size)


def _bipartite_adjacency(edge_index, num_nodes: tuple[int, int], values, group_size, self_loops) -> GroupCOO:
    """`(N_dst, N_src)` adjacency of a bipartite graph: `A[dst, src] = weight`, duplicate edges summed."""
    if self_loops:
        raise ValueError(f"jinsum.nn.adjacency: a bipartite graph (num_nodes={num_nodes}) has no self loops")
    num_src, num_dst = num_nodes
    edge_index = np.asarray(edge_index)
    bounds = np.array([[num_src], [num_dst]])
    if edge_index.ndim != 2 or edge_index.shape[0] != 2 or ((edge_index < 0) | (edge_index >= bounds)).any():
        raise ValueError(f"jinsum.nn.adjacency: expected an edge index (2, E) of sources < {num_src} and destinations "
                         f"< {num_dst}, got shape {edge_index.shape}")
    weights = np.ones(edge_index.shape[1], np.float32) if values is None else np.asarray(values)
    csr = sp.coo_matrix((weights, (edge_index[1], edge_index[0])), shape=(num_dst, num_src)).tocsr()
    return GroupCOO.from_scipy(csr, group_size=group_size).with_transpose()


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
      >>> edges = jinsum.nn.edge_list(edge_index, num_nodes=N)
      >>> y = jinsum.nn.GINEConv(mlp)(x, edges, edge_attr)       # edge_attr (E, F) in edge_index's order
    """
    edge_index = np.asarray(edge_index)
    check_edge_index("jinsum.nn.edge_list", edge_index, num_nodes)
    order = np.argsort(edge_index[1], kind="stable")
    src, dst = edge_index[:, order].astype(np.int32)
    return EdgeList(jnp.asarray(src), jnp.asarray(dst), jnp.asarray(order.astype(np.int32)), int(num_nodes))


def node_features(layer: str, x) -> tuple[jax.Array, jax.Array]:
    """`(x_src, x_dst)`: a layer's input, node features `(N, F)` or a bipartite pair `(x_src, x_dst)`."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"{layer}: a bipartite input is a pair (x_src, x_dst), got {len(x)} arrays")
        return x[0], x[1]
    return x, x


def expect_adjacency(layer: str, A, x, formats=(GroupCOO,), in_features: int | None = None, *, sources=None,
                     source_features: int | None = None) -> None:
    """Raises a clear error unless `A` is an adjacency in one of `formats` from the rows of `sources` (default: `x`,
    a square adjacency) to the `N` rows of `x`, and `x` / `sources` have `in_features` / `source_features` columns
    (where given)."""
    bipartite = sources is not None and sources is not x
    if isinstance(A, Partitioned) and A.format in formats:
        return _expect_partitioned(layer, A, x, in_features, bipartite)
    for name, features, width in (("", x, in_features), ("source " if bipartite else "", sources, source_features)):
        if features is not None and width is not None and (features.ndim != 2 or features.shape[1] != width):
            raise ValueError(f"{layer}: expected {name}node features of shape (N, {width}) (the layer's "
                             f"in_features), got {tuple(features.shape)}")
    if not isinstance(A, formats):
        names = " or ".join(f"jinsum.{f.__name__}" for f in formats)
        got = (f"an array {jnp.dtype(A.dtype).name}{list(A.shape)}" if isinstance(A, (jax.Array, np.ndarray))
               else repr(A))
        raise TypeError(
            f"{layer}: expected the adjacency as a {names}, got {got}. Convert an edge index (2, E) once, outside "
            "the jitted step, with `A = jinsum.nn.adjacency(edge_index, num_nodes)` and pass A to every call")
    if bipartite:
        if len(A.shape) != 2 or A.shape != (x.shape[0], sources.shape[0]):
            raise ValueError(f"{layer}: expected a bipartite adjacency of shape (N_dst, N_src) = "
                             f"{(x.shape[0], sources.shape[0])} with scalar entries, got {A!r}; build it with "
                             "jinsum.nn.adjacency(edge_index, (N_src, N_dst))")
    elif len(A.shape) != 2 or A.shape[0] != A.shape[1] or A.shape[1] != x.shape[0]:
        raise ValueError(
            f"{layer}: expected a square (N, N) adjacency with scalar entries over the N = {x.shape[0]} rows of the "
            f"node features {tuple(x.shape)}, got {A!r}; build it with jinsum.nn.adjacency(edge_index, N)")


def _expect_partitioned(layer: str, A: Partitioned, x, in_features: int | None, bipartite: bool) -> None:
    rows = A.padded_rows
    if bipartite:
        raise NotImplementedError(f"{layer}: a partitioned adjacency splits one set of nodes; bipartite inputs "
                                  "(x_src, x_dst) are not supported on it")
    if len(A.shape) != 2:
        raise ValueError(f"{layer}: expected an adjacency with scalar entries, got {A!r}")
    if x.ndim != 2 or x.shape[0] != rows or (in_features is not None and x.shape[1] != in_features):
        width = "F" if in_features is None else in_features
        raise ValueError(f"{layer}: expected node features laid out by the partition, ({rows}, {width}) = "
                         f"{A.num_parts} devices x {rows // A.num_parts} rows (A.shard_rows(x)), got "
                         f"{tuple(x.shape)}")


def row_sums(A: GroupCOO | BlockGroupCOO, dtype=None) -> jax.Array:
    """`A.sum(axis=1)` as an indirect Einsum over the stored entries: `(M, *A.dense_shape)`.

    One sorted segment sum of `Av` over the rows `Ai` (for a `BlockGroupCOO`, over the block rows, then the
    block rows are unfolded to matrix rows). `dtype` defaults to `A.dtype`.

    Example:
      >>> deg = row_sums(A)            # in-degrees (weighted) of an adjacency A[dst, src]
    """
    if isinstance(A, Partitioned):
        return partitioned_row_sums(A, dtype)
    A = A.astype(A.dtype if dtype is None else dtype)
    if isinstance(A, BlockGroupCOO):
        (bm, _), rows = A.block_shape, A.num_block_rows
        sums = jinsum.einsum("D[Ai[g],m] += Av[g,m,k,p]", D=jax.ShapeDtypeStruct((rows, bm), A.dtype), A=A)
        return sums.reshape(-1)[: A.shape[0]]
    dense = "".join(f",d{i}" for i in range(len(A.dense_shape)))
    zeros = jax.ShapeDtypeStruct((A.shape[0], *A.dense_shape), A.dtype)
    return jinsum.einsum(f"D[Ai[g]{dense}] += Av[g,p{dense}]", D=zeros, A=A)


def aggregate(A: GroupCOO | BlockGroupCOO, h: jax.Array) -> jax.Array:
    """`A @ h` (SpMM over the stored entries), with `A`'s values in `h`'s dtype: `(M, F)` from `h` `(K, F)`.

    An adjacency that carries its entries in column order (`jinsum.nn.adjacency` builds it so) keeps them through
    the cast: the gradient with respect to `h` is then the forward SpMM's kernel over the transpose instead of an
    atomic addition per edge. On a `Partitioned` (`jinsum.shard`), `h` and the result are row-sharded."""
    if isinstance(A, Partitioned):
        return matmul(A, h)
    return jinsum.einsum("ik,kn->in", A.astype(h.dtype), h)


def aggregate_extreme(A: GroupCOO, h: jax.Array, reduction: str = "max", *, weighted: bool = False,
                      empty: float | None = 0.0, out: jax.Array | None = None) -> jax.Array:
    """The largest (`"max"`) or smallest (`"min"`) of the rows of `h` over each row's stored entries, times the
    entry's value if `weighted`: `(M, F)` from `h` `(K, F)`. Rows without entries hold `empty` (0, as PyG's max
    aggregation), or with `empty=None` the reduction's identity (-inf for max, +inf for min).

    One statement, `C[Ai[g],n] max= h[Ak[g,p],n]` (or `... max= Av[g,p] * h[Ak[g,p],n]`; group padding takes no
    part: a format binds its columns with the padding out of range); its gradient goes to each output element's
    first maximal entry. With `out`, its elements take part too (the statement's initial value)."""
    if isinstance(A, Partitioned):
        out = per_part(lambda part, h, out=None: aggregate_extreme(part, h, reduction, weighted=weighted, empty=None,
                                                                   out=out), A, columns=(h,))
    else:
        rows = jax.ShapeDtypeStruct((A.shape[0], h.shape[1]), h.dtype) if out is None else out
        weight = "Av[g,p] * " if weighted else ""
        out = jinsum.einsum(f"C[Ai[g],n] {reduction}= {weight}H[Ak[g,p],n]", A=A.astype(h.dtype), H=h, C=rows)
    if empty is None:
        return out
    return jnp.where(out == (-jnp.inf if reduction == "max" else jnp.inf), empty, out)
