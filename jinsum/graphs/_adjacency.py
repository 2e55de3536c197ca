"""A graph's adjacency from its edge index (PyG's `edge_index`): a `jinsum.GroupCOO` `A` with `A[dst, src] = weight`,
so `A @ X` sums the features of each node's sources into it. Built once on the host, or inside `jit` with a fixed
capacity for a graph that changes every step; the layers of `jinsum.nn` take it as an argument of every call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp

from jinsum.formats import GroupCOO
from jinsum.formats._convert import check_edge_index, check_int


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
        With a concrete `edge_index`, more distinct edges than that is a `ValueError` naming the capacity needed
        (self loops aside, as this argument counts them), and so is a node index past `N`; traced (inside
        `jit`), the edges past the capacity are not kept and `A.overflow` is True, and an edge past `N` is left
        out, as `GroupCOO.from_edge_index` documents.

    Returns:
      A `GroupCOO` with `A[dst, src] = weight`, carrying its entries in column order (`A.with_transpose()`), so
      that the gradients of the aggregations with respect to node features run the forward SpMM's kernel over the
      transpose (no atomic addition per edge) and the backward of `GATConv`'s attention over each node's out-edges
      sorts nothing in a jitted step.

    Example:
      >>> A = jinsum.graphs.adjacency(np.array([[0, 1, 1], [1, 2, 0]]), num_nodes=3)
      >>> print(A.todense().astype(int))   # A[1, 0], A[2, 1], A[0, 1] are 1
      [[0 1 0]
       [1 0 0]
       [0 1 0]]
    """
    where = "jinsum.graphs.adjacency"
    if isinstance(num_nodes, tuple):
        if len(num_nodes) != 2:
            raise ValueError(f"{where}: num_nodes must be an int N or a pair (N_src, N_dst), got {num_nodes!r}")
        num_nodes = tuple(check_int(where, f"num_nodes[{i}]", n) for i, n in enumerate(num_nodes))
        if self_loops:
            raise ValueError(f"{where}: a bipartite graph (num_nodes={num_nodes}) has no self loops")
    else:
        num_nodes = check_int(where, "num_nodes", num_nodes)
    if capacity is not None:
        return _adjacency_on_device(edge_index, num_nodes, values, group_size, self_loops, capacity)
    shape = num_nodes[::-1] if isinstance(num_nodes, tuple) else (num_nodes, num_nodes)  # (N_dst, N_src)
    A = GroupCOO._from_edges_on_host(where, edge_index, values, shape, group_size, None)
    if self_loops:
        csr = A.to_scipy()
        missing = (csr.diagonal() == 0).astype(csr.dtype)
        A = GroupCOO.from_scipy(csr + sp.diags(missing), group_size=group_size, dtype=A.dtype)
    return A.with_transpose()


def gcn_norm(edge_index, num_nodes: int, *, values=None, improved: bool = False, add_self_loops: bool = True,
             group_size: int | None = None) -> GroupCOO:
    """GCN's normalised adjacency `D^-1/2 (A + I) D^-1/2` of a static graph, computed once on the host (PyG's
    `gcn_norm`, as its `GCNConv(cached=True)` keeps it): `GCNConv(..., normalize=False, add_self_loops=False)` on
    it runs one SpMM a layer and sums no degrees in the step. Self loops as PyG adds them: weight 1 (2 with
    `improved`) for every node whose own loop is absent or weighs 0, an existing one kept; `D` the weighted
    in-degree of `A + I`, nodes of degree 0 scaled by 0. `jinsum.nn.GCNConv` normalises on its own otherwise, and
    counts an existing self loop of weight `w` as `w + 1`.

    Example:
      >>> edge_index, x = np.array([[0, 1, 2, 3], [1, 2, 3, 0]]), jnp.ones((4, 16))   # a ring of 4 nodes
      >>> A_hat = jinsum.graphs.gcn_norm(edge_index, 4)                                   # once
      >>> conv = jinsum.nn.GCNConv(16, 32, normalize=False, add_self_loops=False, rngs=nnx.Rngs(0))
      >>> conv(x, A_hat).shape                                       # PyG's GCNConv(16, 32)(x, edge_index)
      (4, 32)
    """
    where = "jinsum.graphs.gcn_norm"
    num_nodes = check_int(where, "num_nodes", num_nodes)
    if values is not None and np.ndim(values) != 1:
        raise ValueError(f"{where}: values must be edge weights of shape (E,), got shape {np.shape(values)}")
    A = GroupCOO._from_edges_on_host(where, edge_index, values, (num_nodes, num_nodes), group_size, None)
    csr = A.to_scipy().astype(np.float64)
    if add_self_loops:
        csr = csr + sp.diags((csr.diagonal() == 0) * (2.0 if improved else 1.0))
    degree = np.asarray(csr.sum(axis=1)).ravel()
    with np.errstate(divide="ignore", invalid="ignore"):  # PyG's deg^-1/2 with inf -> 0; NaN and negative stay NaN
        scale = np.where(degree == 0, 0.0, degree ** -0.5)
    csr = csr.tocoo()
    normalised = sp.csr_matrix((scale[csr.row] * csr.data * scale[csr.col], (csr.row, csr.col)), shape=csr.shape)
    return GroupCOO.from_scipy(normalised.astype(A.dtype), group_size=group_size).with_transpose()


def _adjacency_on_device(edge_index, num_nodes, values, group_size, self_loops: bool, capacity: int) -> GroupCOO:
    """`adjacency` inside `jit`: the device builder, with PyG's remaining self loops as more edges (a node's own
    nonzero self loop kept, a weight-1 loop added where it has none; edges of weight 0 dropped)."""
    if not self_loops:
        return GroupCOO.from_edge_index(edge_index, values, num_nodes=num_nodes, capacity=capacity,
                                        group_size=group_size)
    where = "jinsum.graphs.adjacency"
    capacity = check_int(where, "capacity", capacity)
    check_edge_index(where, edge_index)
    edge_index = jnp.asarray(edge_index)
    if values is not None and jnp.shape(values) != edge_index.shape[1:]:
        raise ValueError(f"{where}: values must have shape (E,) with E = {edge_index.shape[1]} edges (one weight per "
                         f"edge, with self_loops), got {jnp.shape(values)}")
    edges, weights = _with_self_loops(edge_index, None if values is None else jnp.asarray(values), num_nodes)
    # The self loops take N entries beyond the caller's capacity; the errors name the capacity the caller passes.
    return GroupCOO._from_edges_on_device(where, edges, weights, (num_nodes, num_nodes), capacity + num_nodes,
                                          group_size, None, self_loops=num_nodes)


# One compiled program (eagerly each of its operations compiled alone for every new size).
@functools.partial(jax.jit, static_argnums=2)
def _with_self_loops(edge_index, values, num_nodes: int):
    """The edges and weights (default ones) of `_adjacency_on_device` with PyG's remaining self loops: edges of
    weight 0 and padding become padding (-1), and ``N`` loop edges follow, padding where a node has its own nonzero
    loop."""
    weights = jnp.ones(edge_index.shape[1], jnp.float32) if values is None else values
    src, dst = edge_index
    kept = (weights != 0) & (src >= 0) & (dst >= 0)
    own_loop = kept & (src == dst)
    has_loop = jnp.zeros(num_nodes, bool).at[jnp.where(own_loop, src, num_nodes)].set(True, mode="drop")
    nodes = jnp.arange(num_nodes, dtype=edge_index.dtype)
    loops = jnp.where(has_loop, -1, nodes)
    edges = jnp.concatenate([jnp.where(kept, edge_index, -1), jnp.stack([loops, loops])], axis=1)
    return edges, jnp.concatenate([weights, jnp.ones(num_nodes, weights.dtype)])
