"""Uniform neighbor sampling inside `jit` (GraphSAGE's mini-batches, PyG's `NeighborLoader`), with static shapes.

Every size is a worst case known before tracing: a batch of ``B`` seeds and fanouts ``(k_1, ..., k_L)`` reaches at
most ``n_1 = B (1 + k_1)`` nodes after one hop, ``n_2 = n_1 (1 + k_2)`` after two, and so on. Each hop keeps the
nodes it starts from as the first rows of the next (PyG's relabelling: ``x_dst = x_src[:n_dst]``), so a layer reads
its destinations' own features as a prefix. Unused rows are padding (node id -1), which the adjacencies never
reference with a nonzero value. Nothing depends on the data's shapes, so a jitted training step compiles once.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jinsum.formats import GroupCOO
from jinsum.formats._convert import as_jax_array, check_edge_index, check_int, host_array, is_concrete


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CSRGraph:
    """A graph kept on the device for sampling: each node's in-neighbors (the sources of its edges) as CSR.

    Build it once on the host with :meth:`from_edge_index`; it is a pytree (``indptr`` int32 ``(N + 1,)``,
    ``indices`` int32 ``(E,)``, ``num_nodes`` static), so a jitted step takes it as an argument.
    """

    indptr: jax.Array
    indices: jax.Array
    num_nodes: int = dataclasses.field(metadata={"static": True})

    @classmethod
    def from_edge_index(cls, edge_index, num_nodes: int) -> CSRGraph:
        """From an int ``(2, E)`` edge index (sources, destinations), on the host."""
        where = "CSRGraph.from_edge_index"
        num_nodes = check_int(where, "num_nodes", num_nodes)
        edge_index = host_array(where, edge_index)
        check_edge_index(where, edge_index, num_nodes)
        if edge_index.shape[1] > np.iinfo(np.int32).max:
            raise ValueError(f"{where}: {edge_index.shape[1]} edges do not fit int32 positions")
        src, dst = edge_index
        order = np.argsort(dst, kind="stable")
        indptr = np.zeros(num_nodes + 1, np.int64)
        np.cumsum(np.bincount(dst, minlength=num_nodes), out=indptr[1:])
        return cls(as_jax_array(indptr.astype(np.int32)), as_jax_array(src[order].astype(np.int32)), num_nodes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NeighborSample:
    """What :func:`sample_neighbors` returns.

    Attributes:
      node_ids: int32 ``(n_L,)``: the original ids of the sampled nodes, the seeds first, -1 for padding rows;
        gather features with ``x[jnp.maximum(node_ids, 0)]``. With ``outer_sources="graph"``, ``(n_{L-1},)``: the
        outermost layer's destinations (its sources are the graph's nodes themselves).
      adjacencies: one bipartite `GroupCOO` per layer, outermost hop first (the order a model applies them):
        ``adjacencies[i]`` is ``(n_{L-1-i}, n_{L-i})``, its destinations the first rows of its sources. Each is
        a fixed-fanout table (one group of ``k`` per destination). With ``outer_sources="graph"``,
        ``adjacencies[0]`` is ``(n_{L-1}, num_nodes)``.
      sizes: the static row counts ``(n_L, ..., n_1, B)``: layer ``i`` maps ``sizes[i]`` rows to ``sizes[i + 1]``
        (``sizes[0]`` is ``num_nodes`` with ``outer_sources="graph"``).
      num_nodes: the sampled graph's nodes, the rows of the feature table that :meth:`inputs` reads.
      outer_sources: how the outermost adjacency reads its sources (see :func:`sample_neighbors`).
    """

    node_ids: jax.Array
    adjacencies: tuple[GroupCOO, ...]
    sizes: tuple[int, ...] = dataclasses.field(metadata={"static": True})
    num_nodes: int = dataclasses.field(metadata={"static": True})
    outer_sources: str = dataclasses.field(default="sample", metadata={"static": True})

    def inputs(self, x) -> tuple[jax.Array, jax.Array]:
        """The outermost layer's ``(x_src, x_dst)`` from the graph's feature table ``x`` ``(num_nodes, ...)``:
        ``x[node_ids]`` and its first ``n_{L-1}`` rows, or, with ``outer_sources="graph"``, ``x`` itself and
        ``x[node_ids]``. Padding rows read node 0; no adjacency gives them a nonzero value. A table of another
        number of rows is a ``ValueError`` (a gather past its end would read its last row instead)."""
        if jnp.ndim(x) < 1 or jnp.shape(x)[0] != self.num_nodes:
            raise ValueError(f"NeighborSample.inputs: x must be the graph's feature table, one row per node "
                             f"(num_nodes = {self.num_nodes}, ...), got shape {tuple(jnp.shape(x))}")
        x = jnp.asarray(x)
        rows = x[jnp.maximum(self.node_ids, 0)]
        if self.outer_sources == "graph":
            return x, rows
        return rows, rows[: self.sizes[1]]


def sample_neighbors(graph: CSRGraph, seeds, fanouts, key, *, replace: bool = False,
                     with_transpose: bool | Sequence[bool] = False, outer_sources: str = "sample") -> NeighborSample:
    """Samples ``fanouts[0]`` in-neighbors of every seed, then ``fanouts[1]`` of every node reached, and so on.

    Uniform over each node's in-edges; without replacement a node with fewer in-edges than the fanout keeps all
    of them (Floyd's algorithm draws the others: every ``k``-subset equally likely). Traceable: shapes depend only
    on ``len(seeds)`` and the fanouts.

    Args:
      graph: the full graph, a :class:`CSRGraph` on the device.
      seeds: int ``(B,)`` node ids; -1 (any negative id) marks a padding seed (a short last batch). A seed past
        the graph's nodes is an error when ``seeds`` is concrete; traced (inside ``jit``, which cannot raise), it
        becomes a padding seed, as a negative one does.
      fanouts: the neighbors per node at each hop, ``(k_1, ..., k_L)``, a sequence of ints ``>= 0`` (a hop of 0
        adds no neighbors: its adjacency has no entries).
      key: a `jax.random` key (``jax.random.key(seed)``, or a legacy ``jax.random.PRNGKey(seed)``).
      replace: sample with replacement (a neighbor may repeat; its entries then count as often as drawn).
      with_transpose: give the adjacencies their entries in column order (`GroupCOO.from_neighbors`: one sort per
        layer, then a backward without atomics); one bool for every layer, or one per layer, outermost first.
        A sampled layer's backward adds into its sources atomically for less than the sort and the ordered sum
        cost (the table's padding spread over its rows; DESIGN.md), so the default leaves it out. Deterministic mode
        wants every layer that is differentiated through in column order (no sort per call); the outermost
        layer's sources are the input features, whose gradient nobody asks for: ``(False, True)`` for two.
      outer_sources: ``"sample"`` (the default, PyG's reading): the outermost adjacency maps the sample's ``n_L``
        nodes, whose features a model gathers as ``x[node_ids]``. ``"graph"``: it maps the graph's own node ids
        (``(n_{L-1}, num_nodes)``), so the first layer reads the whole feature table in place
        (``conv(sample.inputs(x), adjacencies[0])``), and the sample skips the last hop's relabelling (its largest
        sort) and never materialises an ``(n_L, F)`` copy of the input features.

    Returns:
      A :class:`NeighborSample`.
    """
    where = "sample_neighbors"
    if not isinstance(graph, CSRGraph):
        raise TypeError(f"{where}: graph must be a CSRGraph (CSRGraph.from_edge_index(edge_index, num_nodes)), got "
                        f"{type(graph).__name__}")
    fanouts = check_fanouts(where, fanouts)
    if outer_sources not in ("sample", "graph"):
        raise ValueError(f'{where}: outer_sources must be "sample" or "graph", got {outer_sources!r}')
    key_dtype = getattr(key, "dtype", None)
    if key_dtype is None or not (jax.dtypes.issubdtype(key_dtype, jax.dtypes.prng_key) or key_dtype == np.uint32):
        raise TypeError(f"{where}: key must be a jax.random key (jax.random.key(seed)), got {key!r}")
    transposes = ((bool(with_transpose),) * len(fanouts) if isinstance(with_transpose, (bool, np.bool_)) else
                  tuple(with_transpose) if isinstance(with_transpose, Sequence) else None)
    if transposes is None or len(transposes) != len(fanouts) or not all(isinstance(t, (bool, np.bool_))
                                                                         for t in transposes):
        raise ValueError(f"{where}: with_transpose must be a bool or one bool per layer ({len(fanouts)}, "
                         f"outermost first), got {with_transpose!r}")
    seeds = jnp.asarray(seeds)
    if seeds.ndim != 1 or not jnp.issubdtype(seeds.dtype, jnp.integer):
        raise ValueError(f"sample_neighbors: seeds must be a 1-D integer array of node ids, got "
                         f"{seeds.dtype}{list(seeds.shape)}")
    if is_concrete(seeds):
        host = np.asarray(seeds)
        past = np.flatnonzero(host >= graph.num_nodes)
        if past.size:
            raise ValueError(f"sample_neighbors: seeds[{past[0]}] = {host[past[0]]} is out of range: expected a node "
                             f"id in [0, num_nodes = {graph.num_nodes}), or a negative id (-1) for padding")
    nodes, neighbors = _hops(graph, seeds, key, fanouts=fanouts, replace=bool(replace), outer_sources=outer_sources)
    num_sources = hop_sizes(seeds.shape[0], fanouts)[1:]
    if outer_sources == "graph":
        num_sources = (*num_sources[:-1], graph.num_nodes)
    tables = [GroupCOO.from_neighbors(table, num_sources=sources, with_transpose=transpose)
              for table, sources, transpose in zip(neighbors, num_sources, reversed(transposes))]  # (innermost first)
    sizes = tuple(a.shape[1] for a in reversed(tables)) + (seeds.shape[0],)
    return NeighborSample(nodes, tuple(reversed(tables)), sizes, graph.num_nodes, outer_sources)


def check_fanouts(where: str, fanouts) -> tuple[int, ...]:
    """``fanouts`` as a tuple of Python ints ``>= 0``, one per hop, else a ``TypeError`` or ``ValueError`` from
    ``where``."""
    if np.ndim(fanouts) != 1:
        raise TypeError(f"{where}: fanouts must be a sequence of ints, the neighbors per node at each hop (e.g. "
                        f"(10, 5)), got {fanouts!r}")
    return tuple(check_int(where, "fanout", k) for k in fanouts)


def hop_sizes(batch_size: int, fanouts) -> tuple[int, ...]:
    """The static row counts of a sample, seeds first: ``(B, B (1 + k_1), ...)``."""
    fanouts = check_fanouts("hop_sizes", fanouts)
    sizes = [check_int("hop_sizes", "batch_size", batch_size)]
    for k in fanouts:
        sizes.append(sizes[-1] * (1 + k))
    return tuple(sizes)


# One compiled program (static fanouts and flags): eagerly each of its operations (some ~170 for two hops) compiled
# alone for every new batch size.
@functools.partial(jax.jit, static_argnames=("fanouts", "replace", "outer_sources"))
def _hops(graph: CSRGraph, seeds, key, *, fanouts: tuple[int, ...], replace: bool, outer_sources: str):
    """The draw of `sample_neighbors`: the last hop's nodes and each hop's neighbor table, innermost first, in the
    next hop's local ids (the last hop's in the graph's ids with ``outer_sources="graph"``). Seeds outside
    ``[0, num_nodes)`` are padding."""
    nodes = jnp.where((seeds >= 0) & (seeds < graph.num_nodes), seeds, -1).astype(jnp.int32)
    tables = []
    for hop, fanout in enumerate(fanouts):
        neighbors = _draw(graph, nodes, fanout, jax.random.fold_in(key, hop), replace)
        if hop == len(fanouts) - 1 and outer_sources == "graph":
            tables.append(neighbors)
            break
        nodes, local = _relabel(nodes, neighbors)
        tables.append(local)
    return nodes, tuple(tables)


def _draw(graph: CSRGraph, nodes, fanout: int, key, replace: bool):
    """``(n, fanout)`` sampled in-neighbors of ``nodes`` (original ids; -1 where a node has fewer, or is padding)."""
    if graph.indices.shape[0] == 0:  # a graph without edges (or nodes): every slot is padding
        return jnp.full((nodes.shape[0], fanout), -1, jnp.int32)
    real = nodes >= 0
    start = graph.indptr[jnp.maximum(nodes, 0)]
    degree = jnp.where(real, graph.indptr[jnp.maximum(nodes, 0) + 1] - start, 0)
    uniform = jax.random.uniform(key, (nodes.shape[0], fanout))
    if replace:
        position = jnp.minimum(jnp.floor(uniform * degree[:, None]).astype(jnp.int32), degree[:, None] - 1)
        present = degree[:, None] > 0
    else:
        position = _floyd(degree, uniform)
        present = position < degree[:, None]
    picked = graph.indices[jnp.clip(start[:, None] + position, 0, graph.indices.shape[0] - 1)]
    return jnp.where(present, picked, -1)


def _floyd(degree, uniform):
    """``k`` distinct positions in ``[0, degree)`` per row, each ``k``-subset equally likely (Floyd's algorithm:
    at step ``s``, draw ``t`` in ``[0, degree - k + s]``; take ``t``, or ``degree - k + s`` if ``t`` was taken).
    Rows with ``degree <= k`` take ``0, 1, ..., degree - 1`` and then ``degree`` (not present)."""
    n, k = uniform.shape
    chosen = jnp.zeros((n, k), jnp.int32)
    for s in range(k):
        top = degree - k + s  # inclusive upper end of this step's draw
        t = jnp.floor(uniform[:, s] * (top + 1)).astype(jnp.int32)
        t = jnp.minimum(t, top)
        taken = jnp.any((chosen[:, :s] == t[:, None]), axis=1) if s else jnp.zeros(n, bool)
        chosen = chosen.at[:, s].set(jnp.where(taken, top, t))
    small = degree[:, None] <= k
    return jnp.where(small, jnp.minimum(jnp.arange(k, dtype=jnp.int32), degree[:, None]), chosen)


def _relabel(nodes, neighbors):
    """The next hop's nodes (``nodes`` first, then each new neighbor once, in order of first appearance by id) and
    the neighbor table in their local ids (-1 for padding).

    One stable sort of the ``n (1 + k)`` candidates by node id: a node's first copy is its local id's owner;
    ``nodes`` keep their positions, new nodes are numbered after them.
    """
    n, k = neighbors.shape
    size = n * (1 + k)
    candidates = jnp.concatenate([nodes, neighbors.reshape(-1)])
    big = jnp.iinfo(jnp.int32).max
    node_key = jnp.where(candidates >= 0, candidates, big)
    position = jnp.arange(size, dtype=jnp.int32)
    # A stable sort on the id alone keeps each run in position order (one key: XLA's radix sort on GPUs).
    node_key, sorted_position = jax.lax.sort((node_key, position), num_keys=1, is_stable=True)
    real = node_key != big
    first = jnp.concatenate([jnp.ones(1, bool), node_key[1:] != node_key[:-1]]) & real
    # A run's owner is its first copy: frontier nodes (positions < n) keep their position as local id, new nodes
    # are numbered n, n + 1, ... in order of id. Every copy of the run reads its owner's id through the run index.
    is_new = first & (sorted_position >= n)
    new_rank = jnp.cumsum(is_new) - 1
    run = jnp.cumsum(first) - 1
    owner = jnp.where(sorted_position < n, sorted_position, n + new_rank)
    run_local = jnp.zeros(size, jnp.int32).at[jnp.where(first, run, size)].set(owner, mode="drop")
    local = jnp.full(size, -1, jnp.int32).at[sorted_position].set(jnp.where(real, run_local[run], -1))
    next_nodes = jnp.full(size, -1, jnp.int32).at[:n].set(nodes)
    next_nodes = next_nodes.at[jnp.where(is_new, n + new_rank, size)].set(node_key, mode="drop")
    return next_nodes, local[n:].reshape(n, k)
