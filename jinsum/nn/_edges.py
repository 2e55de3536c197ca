"""Edges one by one, for the layers whose messages depend on each edge (GINE, GATv2, GAT with edge features).

Such a layer reads its graph as `Edges`: sources, destinations (sorted), edge features and which entries are edges.
The two forms of `jinsum.graphs` give them: an `EdgeList` with its edge features in the caller's edge order, and an
`edge_adjacency` (a `GroupCOO` whose values carry a 1 and the edge's features), or one device's part of its
`jinsum.shard.partition`: a device then reads the edges of its local part and of its remote part (sources among the
rows it receives) as two `Edges`.

Attention over a node's in-edges may so come in pieces (self loop, local edges, remote edges): `SoftmaxSums` are the
running sums of one, shifted by the largest score seen, merged piece by piece (as FlashAttention merges key blocks).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

import jinsum
from jinsum.formats import GroupCOO
from jinsum.graphs import EdgeList


class Edges(NamedTuple):
    """Edges sorted by destination: `src`, `dst` int `(E,)`, `attr` `(E, D)` or None, `valid` bool `(E,)` or None (all
    are edges), into `num_nodes` destinations."""

    src: jax.Array
    dst: jax.Array
    attr: jax.Array | None
    valid: jax.Array | None
    num_nodes: int

    def gather(self, table: jax.Array, at: str = "src") -> jax.Array:
        """`table[src]` (or `table[dst]`): one row per edge, `(E, *table.shape[1:])`."""
        index = self.src if at == "src" else self.dst
        flat = table.reshape(table.shape[0], math.prod(table.shape[1:]))  # (not -1: a size-0 table has no width)
        rows = jinsum.einsum("M[e,n] = T[I[e],n]", M=jax.ShapeDtypeStruct((index.shape[0], flat.shape[1]), flat.dtype),
                             T=flat, I=index)
        return rows.reshape(index.shape[0], *table.shape[1:])

    def sum_into(self, messages: jax.Array, out: jax.Array | None = None) -> jax.Array:
        """`out[dst[e]] += messages[e]` over the edges (`valid` ones), a sorted segment sum: `(num_nodes, ...)`."""
        if self.valid is not None:
            messages = jnp.where(self.valid.reshape(-1, *[1] * (messages.ndim - 1)), messages, 0)
        flat = messages.reshape(messages.shape[0], math.prod(messages.shape[1:]))
        target = (jax.ShapeDtypeStruct((self.num_nodes, flat.shape[1]), flat.dtype) if out is None
                  else out.reshape(self.num_nodes, flat.shape[1]))
        summed = jinsum.einsum("C[D[e],n] += M[e,n]", C=target, D=self.dst, M=flat, sorted_indices=("D",))
        return summed.reshape(self.num_nodes, *messages.shape[1:])


def edges_of(layer: str, graph, edge_attr=None) -> Edges:
    """The `Edges` of an `EdgeList` and its features `edge_attr` (in the caller's edge order), or of an
    `edge_adjacency` (or one device's part of its partition), whose values carry the features."""
    if isinstance(graph, EdgeList):
        if edge_attr is not None and edge_attr.shape[0] != graph.src.shape[0]:
            raise ValueError(f"{layer}: expected edge features of {graph.src.shape[0]} edges (one row per edge of "
                             f"the edge index), got shape {tuple(edge_attr.shape)}")
        attr = None if edge_attr is None else edge_attr[graph.order]
        return Edges(graph.src, graph.dst, attr, None, graph.num_nodes)
    if edge_attr is not None:
        raise ValueError(f"{layer}: an edge_adjacency carries its edge features in its values; pass no edge_attr")
    G, P = graph.Ak.shape
    values = graph.Av.reshape(G * P, math.prod(graph.dense_shape))
    return Edges(graph.Ak.reshape(-1), jnp.repeat(graph.Ai, P, total_repeat_length=G * P),
                 values[:, 1:] if values.shape[1] > 1 else None, values[:, 0] != 0, graph.shape[0])


def expect_edges(layer: str, x, graph, edge_attr, in_features: int | None, edge_dim: int | None) -> None:
    """Raises a clear error unless `x` is node features `(N, in_features)` (any width where None) and `graph` an
    `EdgeList` over its `N` nodes with `edge_attr` `(E, edge_dim)`, given exactly when `edge_dim` is, or an
    `edge_adjacency` (or its partition) over the rows of `x` whose edges carry `edge_dim` (or 0) features."""
    if jnp.ndim(x) != 2 or in_features is not None and jnp.shape(x)[1] != in_features:
        expected = "(N, F)" if in_features is None else f"(N, {in_features}) (the layer's in_features)"
        raise ValueError(f"{layer}: expected node features x of shape {expected}, got {jnp.shape(x)}")
    if not isinstance(graph, EdgeList):
        return expect_edge_adjacency(layer, graph, x, edge_dim or 0)
    if graph.num_nodes != x.shape[0]:
        raise ValueError(f"{layer}: expected x (N, F) over the {graph.num_nodes} nodes of the edge list, got "
                         f"{tuple(x.shape)}")
    if edge_dim is None:
        if edge_attr is not None:
            raise ValueError(f"{layer}: got edge_attr, but the layer was built without edge_dim (pass edge_dim=D "
                             "to the constructor for edge features of width D)")
        return
    edges = graph.src.shape[0]
    if edge_attr is None or jnp.shape(edge_attr) != (edges, edge_dim):
        raise ValueError(f"{layer}: expected edge_attr of shape (E, edge_dim) = ({edges}, {edge_dim}), one row per "
                         f"edge of the edge index, got {None if edge_attr is None else jnp.shape(edge_attr)}")


def is_edge_adjacency(graph) -> bool:
    """A `GroupCOO` with one dense dimension, or a partition of one: what `edge_adjacency` makes."""
    if isinstance(graph, jinsum.shard.Partitioned):
        return graph.format is GroupCOO and len(graph.dense_shape) == 1
    return isinstance(graph, GroupCOO) and len(graph.dense_shape) == 1


def expect_edge_adjacency(layer: str, graph, x: jax.Array, width: int) -> None:
    """Raises a clear error unless `graph` is an `edge_adjacency` (or a partition of one) over the rows of `x` whose
    edges carry `width` features."""
    if not is_edge_adjacency(graph):
        raise TypeError(f"{layer}: expected the edges as a jinsum.graphs.EdgeList (jinsum.graphs.edge_list(edge_index, "
                        f"num_nodes)) or a jinsum.graphs.edge_adjacency (or its partition), got {graph!r}")
    rows = graph.padded_rows if isinstance(graph, jinsum.shard.Partitioned) else graph.shape[0]
    if graph.dense_shape != (1 + width,) or x.shape[0] != rows:
        raise ValueError(f"{layer}: expected an edge_adjacency whose edges carry {width} features (values of 1 + "
                         f"{width}) over the {rows} rows of x, got x {tuple(x.shape)} and {graph!r}")


class SoftmaxSums(NamedTuple):
    """The running sums of an attention over each node's in-edges: `shift` `(N, H)`, the largest score so far (-inf:
    none; no gradient, it cancels), `totals` `(N, H)` = sum of `exp(score - shift)`, `out` `(N, H, C)` = the same
    weights times the values. Pieces of a node's edges merge in any order; `result()` normalises."""

    shift: jax.Array
    totals: jax.Array
    out: jax.Array

    @classmethod
    def own(cls, scores: jax.Array, values: jax.Array) -> SoftmaxSums:
        """One self loop per node: `scores` `(N, H)`, `values` `(N, H, C)`."""
        shift = jax.lax.stop_gradient(scores)
        weights = jnp.exp(scores - shift)
        return cls(shift, weights, weights[..., None] * values)

    def result(self) -> jax.Array:
        """`(N, H, C)`: the softmax-weighted sums (0 for a node that attends to nothing)."""
        return self.out / jnp.where(self.totals > 0, self.totals, 1)[..., None]

    def weights(self, scores: jax.Array, dst: jax.Array | None = None) -> jax.Array:
        """The normalised weights of `scores` (`(E, H)` of edges into `dst`, or `(N, H)` of the nodes' self loops)
        under these sums."""
        shift, totals = (self.shift, self.totals) if dst is None else (self.shift[dst], self.totals[dst])
        return jnp.exp(scores - _finite(shift)) / jnp.where(totals > 0, totals, 1)


def _finite(shift):
    return jnp.where(jnp.isneginf(shift), 0, shift)


def attend(edges: Edges, scores: jax.Array, values: jax.Array, sums: SoftmaxSums | None = None) -> SoftmaxSums:
    """`sums` with the edges added: `scores` `(E, H)` (-inf, or not `valid`: the edge takes no part), `values` the
    sources' rows `(N_src, H, C)`.

    The shift is `Shift[D[e],h] max= S[e,h]`, the weights' sums `Z[D[e],h] += W[e,h]` and the output
    `O[D[e],h,c] += W[e,h] * V[S[e],h,c]`: sorted segment reductions; earlier sums are rescaled to the new shift."""
    n, heads = edges.num_nodes, scores.shape[1]
    if edges.valid is not None:
        scores = jnp.where(edges.valid[:, None], scores, -jnp.inf)
    largest = jinsum.einsum("Out[D[e],h] max= V[e,h]", Out=jnp.full((n, heads), -jnp.inf, scores.dtype), D=edges.dst,
                            V=jax.lax.stop_gradient(scores), sorted_indices=("D",))
    shift = largest if sums is None else jnp.maximum(sums.shift, largest)
    weights = jnp.exp(scores - _finite(shift)[edges.dst])
    totals = jinsum.einsum("Out[D[e],h] += V[e,h]", Out=jax.ShapeDtypeStruct((n, heads), weights.dtype), D=edges.dst,
                           V=weights, sorted_indices=("D",))
    out = jinsum.einsum("O[D[e],h,c] += W[e,h] * X[S[e],h,c]",
                        O=jax.ShapeDtypeStruct((n, *values.shape[1:]), values.dtype), D=edges.dst, W=weights,
                        X=values, S=edges.src, sorted_indices=("D",))
    if sums is not None:  # (earlier pieces, from their shift to the new one; nothing where they had no edge)
        scale = jnp.where(jnp.isneginf(sums.shift), 0, jnp.exp(sums.shift - _finite(shift)))
        totals, out = totals + sums.totals * scale, out + sums.out * scale[..., None]
    return SoftmaxSums(shift, totals, out)


def feature_sums(edges: Edges, *, drop_self_loops: bool, out: jax.Array | None = None) -> jax.Array:
    """`(N, 1 + D)`: per destination, the number of in-edges and the sum of their features, edges from the node itself
    left out with `drop_self_loops` (PyG's `fill_value="mean"`: a self loop's features are the mean of the node's
    other in-edges'); added into `out` if given."""
    kept = (edges.src != edges.dst) if drop_self_loops else jnp.ones(edges.src.shape, bool)
    kept = kept.astype(edges.attr.dtype)[:, None]
    return edges.sum_into(jnp.concatenate([kept, edges.attr * kept], axis=1), out)


def feature_sums_over(layer: str, graph, edge_attr=None) -> jax.Array:
    """`feature_sums` (self loops left out) over an `EdgeList` and its features, an `edge_adjacency`, or a partition
    of one (summed over each device's two parts; the first, local, is the one whose sources are the device's own
    nodes), for `layer`."""
    if isinstance(graph, jinsum.shard.Partitioned):
        return jinsum.shard.per_part(
            lambda part, out=None: feature_sums(edges_of(layer, part), drop_self_loops=out is None, out=out), graph)
    return feature_sums(edges_of(layer, graph, edge_attr), drop_self_loops=True)


def mean_features(sums: jax.Array) -> jax.Array:
    """The means of `feature_sums`: `(N, D)`, 0 for a node without in-edges."""
    return sums[:, 1:] / jnp.maximum(sums[:, :1], 1)
