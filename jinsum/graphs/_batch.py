"""Many small graphs as one block-diagonal graph: mini-batches with fixed budgets (jraph's `pad_with_graphs`, PyG's
`DataLoader`), one compile; or one batch on the host (`batch_graphs`, PyG's `Batch`).

Every padded batch has the same shapes: at most `budget.graphs` graphs, `budget.nodes` node rows and `budget.edges` edge
columns, the rest padding. The dataset is flattened once and kept on the device; the host only chooses each
batch's graph ids. The device gathers and pads the batch's arrays, then turns them into what the layers read: the
block-diagonal adjacency with its column order (`GraphBatch.adjacency`, `GroupCOO.from_csr`: no sort for the rows)
and the node -> graph vector (`GraphBatch.node_graph`).
Padding nodes belong to graph `budget.graphs`, one past the last, so the pools (which drop that id) and every
sorted segment reduction over the batch leave them out; padding edges are -1 and padding graphs are empty, with
`graph_mask` False so that losses leave them out. `batch_graphs` numbers the graphs' nodes one after another with no
padding: each call's shapes are its graphs', so it suits one fixed batch (a test set), not a training loop.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jinsum.formats import GroupCOO
from jinsum.formats._build import rows_of_positions
from jinsum.formats._convert import as_jax_array, check_int
from jinsum.graphs._adjacency import adjacency


# A batch's adjacency carries its column order (a sort of the batch's edges on the device, every step) only where
# some node of the dataset has more edges than this. The order lets a transpose (the gradient with respect to node
# features) sum a hub's entries in registers instead of adding them atomically one after another; without hubs
# the atomic addition costs little and the sort and the transpose's index are the step's overhead (benchmarks/README.md,
# "Batches of small graphs").
COLUMN_ORDER_DEGREE = 32


@dataclasses.dataclass(frozen=True)
class GraphBudget:
    """The fixed sizes of every padded batch: `graphs` graphs, `nodes` nodes and `edges` edges at most; and
    `max_degree`, the most edges into or out of one node of any graph, where known (None: not known).

    Choose them from a dataset with `GraphBudget.for_dataset`, or give them yourself (`GraphLoader` measures
    `max_degree` where the budget leaves it None).
    """

    nodes: int
    edges: int
    graphs: int
    max_degree: int | None = None

    def __post_init__(self):
        for name in ("nodes", "edges", "graphs"):
            check_int("jinsum.graphs.GraphBudget", name, getattr(self, name), minimum=1 if name == "graphs" else 0)
        if self.max_degree is not None:
            check_int("jinsum.graphs.GraphBudget", "max_degree", self.max_degree, minimum=0)

    @classmethod
    def for_dataset(cls, graphs: Sequence, batch_size: int, *, deviations: float = 3.0,
                    multiple: int = 64) -> GraphBudget:
        """Budgets that `batch_size` graphs drawn at random from `graphs` fill, with rare overflows.

        A batch's node count is a sum of `batch_size` draws: its mean is `batch_size` times the dataset's mean and
        its spread `sqrt(batch_size)` times the dataset's standard deviation. The budget is the mean plus
        `deviations` spreads (3: about one batch in 700 closes early), at least the largest graph, rounded up to a
        `multiple`; the same for edges. A batch that would pass a budget closes early and the graph opens the next
        one (`GraphLoader`): no graph is dropped, and no batch changes shape.
        """
        where = "jinsum.graphs.GraphBudget.for_dataset"
        batch_size = check_int(where, "batch_size", batch_size, minimum=1)
        multiple = check_int(where, "multiple", multiple, minimum=1)
        if not (isinstance(deviations, numbers.Real) and 0 <= deviations < math.inf):
            raise ValueError(f"{where}: deviations must be a finite number >= 0 (of standard deviations above the "
                             f"mean), got {deviations!r}")
        data = _FlatGraphs.of(graphs)
        budget = {}
        for name, counts in (("nodes", data.node_counts), ("edges", data.edge_counts)):
            spread = batch_size * counts.mean() + deviations * math.sqrt(batch_size) * counts.std()
            budget[name] = multiple * math.ceil(max(spread, counts.max(initial=0), 1) / multiple)
        return cls(budget["nodes"], budget["edges"], batch_size, data.max_degree())


@dataclasses.dataclass(frozen=True)
class GraphBatch:
    """A padded batch of graphs: a pytree of arrays whose shapes depend only on the `GraphBudget`.

    Fields (`G`, `N`, `E` the budgets): `x` `(N, F)` node features (zero padding); `edge_index` int32 `(2, E)`,
    each graph's own node ids (sources, destinations), its edges sorted by destination and then source (the
    loader sorts them once), -1 padding (`edges()` numbers them in the batch); `edge_attr` `(E, ...)` in that
    order, or None; `y` `(G, ...)` each graph's target or None; `n_node`, `n_edge` int32 `(G,)`,
    0 for padding graphs; `graph_mask` bool `(G,)`, True for the batch's graphs. Static: `budget`.

    Example:
      >>> @jax.jit
      ... def predict(model, batch):
      ...     A = batch.adjacency()                                   # built on the device
      ...     h = model(batch.x, A)                                   # (N, F)
      ...     return jinsum.nn.global_add_pool(h, batch.node_graph(), batch.budget.graphs)   # (G, F)
      >>> loader = jinsum.graphs.GraphLoader(jinsum.datasets.molecules(8, features=8), batch_size=4)
      >>> gin = jinsum.nn.GINConv(nnx.Linear(8, 16, rngs=nnx.Rngs(0)))
      >>> [predict(gin, batch).shape for batch in loader]
      [(4, 16), (4, 16)]
    """

    x: jax.Array
    edge_index: jax.Array
    edge_attr: jax.Array | None
    y: jax.Array | None
    n_node: jax.Array
    n_edge: jax.Array
    graph_mask: jax.Array
    budget: GraphBudget

    def node_graph(self) -> jax.Array:
        """int32 `(N,)`: each node's graph, sorted; `budget.graphs` for padding nodes (PyG's `batch`)."""
        return _owner(self.n_node, self.budget.nodes)

    def node_mask(self) -> jax.Array:
        """bool `(N,)`: True for the batch's nodes, False for padding."""
        return jnp.arange(self.budget.nodes) < jnp.sum(self.n_node)

    def edges(self) -> jax.Array:
        """int32 `(2, E)`: the edge index over the batch's nodes (graph `k`'s ids after those of graphs before it),
        -1 for padding edges."""
        return _edges(self.edge_index, self.n_node, self.n_edge, self.budget)

    def adjacency(self, values=None, *, self_loops: bool = False, group_size: int | None = None,
                  with_transpose: bool | None = None) -> GroupCOO:
        """The block-diagonal `(N, N)` adjacency of the batch, `A[dst, src] = value`, built on the device.

        The loader keeps each graph's edges in destination order, so the batch's edges are a CSR index already:
        `GroupCOO.from_csr` cuts them into groups without a sort, and sorts once for the column order (with
        `with_transpose`, which the gradients with respect to node features read; by default only where the
        budget's `max_degree` is unknown or above `COLUMN_ORDER_DEGREE`). `values`: `(E,)` edge weights in the
        batch's edge order (that of `edge_attr`), default ones. `self_loops=True` (PyG's remaining self loops) goes
        through `jinsum.graphs.adjacency(self.edges(), N, capacity=E, self_loops=True)` instead (with its column
        order).
        """
        if with_transpose is None:
            degree = self.budget.max_degree
            with_transpose = degree is None or degree > COLUMN_ORDER_DEGREE
        if self_loops:
            return adjacency(self.edges(), self.budget.nodes, values=values, group_size=group_size,
                             self_loops=True, capacity=self.budget.edges)
        indptr, src = _csr(self.edge_index, self.n_node, self.n_edge, self.budget)
        return GroupCOO.from_csr(indptr, src, values, num_columns=self.budget.nodes, group_size=group_size,
                                 with_transpose=with_transpose)


jax.tree_util.register_dataclass(
    GraphBatch, data_fields=["x", "edge_index", "edge_attr", "y", "n_node", "n_edge", "graph_mask"],
    meta_fields=["budget"])


# The batch's index arithmetic as compiled programs of static sizes: a batch's arrays may be concrete (a loader's
# batch read outside `jit`), where each operation would otherwise compile alone.
@functools.partial(jax.jit, static_argnums=1)
def _owner(counts: jax.Array, size: int) -> jax.Array:
    """For `size` rows dealt to segments of `counts` in order, each row's segment (`len(counts)` past the end)."""
    return rows_of_positions(jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts)]), size)


@functools.partial(jax.jit, static_argnums=3)
def _edges(edge_index: jax.Array, n_node: jax.Array, n_edge: jax.Array, budget: GraphBudget) -> jax.Array:
    """`GraphBatch.edges`."""
    first_node = jnp.cumsum(n_node) - n_node
    graph = _owner(n_edge, budget.edges)
    offset = jnp.concatenate([first_node, jnp.zeros(1, first_node.dtype)])[graph]
    return jnp.where(graph < budget.graphs, edge_index + offset, -1)


@functools.partial(jax.jit, static_argnums=3)
def _csr(edge_index: jax.Array, n_node: jax.Array, n_edge: jax.Array, budget: GraphBudget):
    """The batch's edges as a CSR index over its destinations, ``(indptr, sources)``: the loader keeps each graph's
    edges in destination order, so only the rows' starts are counted."""
    nodes = budget.nodes
    src, dst = _edges(edge_index, n_node, n_edge, budget)
    in_degree = jnp.zeros(nodes, jnp.int32).at[jnp.where(dst < 0, nodes, dst)].add(1, mode="drop")
    return jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(in_degree)]), src


class GraphLoader:
    """Padded mini-batches of a list of graphs, every batch one `GraphBatch` of the same shapes (PyG's
    `DataLoader`, jraph's budgets).

    A graph is anything with `x` (node features `(n, F)`) and `edge_index` (int `(2, e)` over its own nodes) and
    optionally `edge_attr` (`(e, ...)`) and `y` (its target), as attributes (a PyG `Data`) or keys (a dict). The
    dataset is flattened once and kept on the device (graph classification sets are small: ZINC's 250k molecules
    are some 100 MB); a batch is then one jitted gather on the device, and all the host sends is `G` graph ids, so
    the host's time per batch stays far below a training step's. Graphs are
    taken in order (shuffled per epoch with `shuffle=True`), `batch_size` at a time, and a batch closes early when
    the next graph would pass the node or edge budget; a graph larger than the budget on its own is an error.

    Example:
      >>> graphs = jinsum.datasets.molecules(20, features=8)                     # dicts of x, edge_index, y
      >>> loader = jinsum.graphs.GraphLoader(graphs, batch_size=8, shuffle=True)   # budget from the dataset
      >>> len(loader), loader.budget.graphs
      (3, 8)
      >>> for epoch in range(2):
      ...     for batch in loader:                  # the same shapes every batch: a jitted step compiles once
      ...         assert batch.x.shape == (loader.budget.nodes, 8)
    """

    def __init__(self, graphs: Sequence, batch_size: int, *, budget: GraphBudget | None = None,
                 shuffle: bool = False, seed: int = 0, drop_last: bool = False):
        """Flattens `graphs` and checks each against the budget.

        Args:
          graphs: the dataset, a sequence of graphs (see above), all with the same feature sizes.
          batch_size: graphs per batch at most.
          budget: the padded sizes; defaults to `GraphBudget.for_dataset(graphs, batch_size)`. Its `graphs` must
            be at least `batch_size`.
          shuffle: a new order of the graphs every epoch (every `iter`), from `seed`.
          drop_last: leave out an epoch's last batch when it holds fewer than `batch_size` graphs.
        """
        self.batch_size = check_int("jinsum.graphs.GraphLoader", "batch_size", batch_size, minimum=1)
        self.data = _FlatGraphs.of(graphs)
        self.budget = GraphBudget.for_dataset(self.data, batch_size) if budget is None else budget
        if self.budget.max_degree is None:
            self.budget = dataclasses.replace(self.budget, max_degree=self.data.max_degree())
        if self.budget.graphs < self.batch_size:
            raise ValueError(f"jinsum.graphs.GraphLoader: the budget holds {self.budget.graphs} graphs, fewer than "
                             f"batch_size = {self.batch_size}")
        for name, counts, limit in (("nodes", self.data.node_counts, self.budget.nodes),
                                    ("edges", self.data.edge_counts, self.budget.edges)):
            if counts.size and counts.max() > limit:
                k = int(np.argmax(counts))
                raise ValueError(f"jinsum.graphs.GraphLoader: graph {k} has {counts[k]} {name}, more than the budget "
                                 f"of {limit} {name} per batch ({self.budget}); raise the budget (a graph is "
                                 "never dropped)")
        self.shuffle, self.drop_last = shuffle, drop_last
        self._rng = np.random.default_rng(seed)
        self._on_device = None

    def __iter__(self) -> Iterator[GraphBatch]:
        if self._on_device is None:  # (here, not at construction: in the caller's `jax_enable_x64` setting)
            self._on_device = jax.device_put(self.data)
        count = len(self.data.node_counts)
        order = self._rng.permutation(count) if self.shuffle else np.arange(count)
        for ids in self._batches(order):
            if not (self.drop_last and len(ids) < self.batch_size):
                padded = np.full(self.budget.graphs, -1, np.int32)
                padded[: ids.size] = ids
                yield _gather(self._on_device, padded, self.budget)

    def __len__(self) -> int:
        return sum(1 for ids in self._batches(np.arange(len(self.data.node_counts)))
                   if not (self.drop_last and len(ids) < self.batch_size))

    def _batches(self, order: np.ndarray) -> Iterator[np.ndarray]:
        """Consecutive runs of `order`, each of at most `batch_size` graphs within the node and edge budgets."""
        nodes = np.cumsum(self.data.node_counts[order])
        edges = np.cumsum(self.data.edge_counts[order])
        start = 0
        while start < len(order):
            before_nodes = nodes[start - 1] if start else 0
            before_edges = edges[start - 1] if start else 0
            stop = min(start + self.batch_size,
                       np.searchsorted(nodes, before_nodes + self.budget.nodes, side="right"),
                       np.searchsorted(edges, before_edges + self.budget.edges, side="right"))
            yield order[start:stop]
            start = stop


def batch_graphs(edge_indices: Sequence, num_nodes: Sequence[int], *, group_size: int | None = None
                 ) -> tuple[GroupCOO, jax.Array]:
    """Many small graphs as one: their block-diagonal adjacency and each node's graph (PyG's `Batch`).

    Runs on the host: call it once per batch, outside the jitted step. Graph `k`'s nodes are numbered after those
    of graphs `0 .. k-1`, so a layer of `jinsum.nn` runs on all graphs at once and its pools (`global_add_pool`, ...)
    read each graph's rows.

    Args:
      edge_indices: per graph, an int `(2, E_k)` edge index (sources, destinations) over its own nodes.
      num_nodes: per graph, its number of nodes `N_k`.
      group_size: as for `jinsum.graphs.adjacency`.

    Returns:
      `(A, batch)`: the `(N, N)` adjacency (`jinsum.graphs.adjacency` of all edges, `N = sum N_k`) and int32 `(N,)`
      `batch`, node -> graph, sorted.

    Example:
      >>> e0, e1, e2 = np.array([[0], [1]]), np.array([[0, 1], [1, 0]]), np.array([[1, 2], [0, 1]])
      >>> A, batch = jinsum.graphs.batch_graphs([e0, e1, e2], [2, 2, 3])
      >>> batch
      Array([0, 0, 1, 1, 2, 2, 2], dtype=int32)
      >>> h = jinsum.nn.GINConv(nnx.Linear(4, 8, rngs=nnx.Rngs(0)))(jnp.ones((7, 4)), A)   # every graph at once
      >>> jinsum.nn.global_add_pool(h, batch, 3).shape
      (3, 8)
    """
    if len(edge_indices) != len(num_nodes):
        raise ValueError(f"batch_graphs: got {len(edge_indices)} edge indices but {len(num_nodes)} node counts")
    num_nodes = np.array([check_int("batch_graphs", f"num_nodes[{k}]", n) for k, n in enumerate(num_nodes)],
                         np.int64)
    offsets = np.concatenate([[0], np.cumsum(num_nodes)]).astype(np.int64)
    edges = []
    for k, (edge_index, n) in enumerate(zip(edge_indices, num_nodes)):
        edge_index = np.asarray(edge_index)
        if edge_index.ndim != 2 or edge_index.shape[0] != 2 or not (
                np.issubdtype(edge_index.dtype, np.integer) or edge_index.size == 0):
            raise ValueError(f"batch_graphs: graph {k}'s edge index must be an integer array of shape (2, E), got "
                             f"{edge_index.dtype}{list(edge_index.shape)}")
        if edge_index.size and (edge_index.min() < 0 or edge_index.max() >= n):
            raise ValueError(f"batch_graphs: graph {k} has {n} nodes but its edge index holds node "
                             f"{edge_index.max() if edge_index.max() >= n else edge_index.min()}")
        edges.append(edge_index.astype(np.int64) + offsets[k])
    batch = np.repeat(np.arange(len(num_nodes), dtype=np.int32), num_nodes)
    edge_index = np.concatenate(edges, axis=1) if edges else np.zeros((2, 0), np.int64)
    return adjacency(edge_index, int(offsets[-1]), group_size=group_size), as_jax_array(batch)


@dataclasses.dataclass(frozen=True)
class _FlatGraphs:
    """A dataset of graphs as flat arrays: nodes and edges of all graphs one after another, and their counts (a
    pytree); each field ends with one padding row (zeros; -1 for the edge index)."""

    x: np.ndarray
    edge_index: np.ndarray
    edge_attr: np.ndarray | None
    y: np.ndarray | None
    node_counts: np.ndarray
    edge_counts: np.ndarray

    @classmethod
    def of(cls, graphs: Sequence) -> _FlatGraphs:
        if isinstance(graphs, _FlatGraphs):
            return graphs
        if not len(graphs):
            raise ValueError("jinsum.graphs: expected a non-empty sequence of graphs")
        xs, edges, attrs, ys = [], [], [], []
        features = None
        for k, graph in enumerate(graphs):
            x, edge_index = _field(graph, "x"), _field(graph, "edge_index")
            if x is None or edge_index is None:
                raise ValueError(f"jinsum.graphs: graph {k} has no {'x' if x is None else 'edge_index'}; every graph "
                                 "needs node features x (n, F) and an edge index (2, e)")
            x, edge_index = _numpy(x), _numpy(edge_index)
            features = x.shape[1:] if features is None else features
            if x.ndim != 2 or x.shape[1:] != features:
                raise ValueError(f"jinsum.graphs: graph {k}'s node features have shape {x.shape}, expected (n, F) with "
                                 "the F of graph 0")
            if edge_index.ndim != 2 or edge_index.shape[0] != 2 or not (
                    np.issubdtype(edge_index.dtype, np.integer) or edge_index.size == 0):
                raise ValueError(f"jinsum.graphs: graph {k}'s edge_index must be an integer array of shape (2, e), "
                                 f"got {edge_index.dtype}{list(edge_index.shape)}")
            if edge_index.size and (edge_index.min() < 0 or edge_index.max() >= x.shape[0]):
                raise ValueError(f"jinsum.graphs: graph {k}'s edge_index holds node ids in [{edge_index.min()}, "
                                 f"{edge_index.max()}], outside its own {x.shape[0]} nodes")
            order = np.lexsort(edge_index)  # by destination (the last key), then source: a batch is a CSR index
            xs.append(x)
            edges.append(edge_index[:, order].astype(np.int32))
            attr = _field(graph, "edge_attr")
            if attr is not None:
                attr = _numpy(attr)
                if attr.ndim < 1 or attr.shape[0] != edge_index.shape[1]:
                    raise ValueError(f"jinsum.graphs: graph {k}'s edge_attr has shape {attr.shape}, expected one row "
                                     f"per edge: ({edge_index.shape[1]}, ...) for its {edge_index.shape[1]} edges")
                attr = attr[order]
            attrs.append(attr)
            y = _field(graph, "y")
            if y is not None:
                y = _numpy(y)
                if ys and ys[0] is not None and y.shape != ys[0].shape:
                    raise ValueError(f"jinsum.graphs: graph {k}'s y has shape {y.shape}, expected {ys[0].shape} as "
                                     "graph 0's (every graph's target has one shape)")
            ys.append(y)
        for name, values in (("edge_attr", attrs), ("y", ys)):
            if any(v is None for v in values) and any(v is not None for v in values):
                raise ValueError(f"jinsum.graphs: some graphs have {name} and some do not")
        def with_zero_row(arrays):  # (the row that padding gathers)
            return np.concatenate([*arrays, np.zeros((1, *arrays[0].shape[1:]), arrays[0].dtype)])

        return cls(with_zero_row(xs), np.concatenate([*edges, np.full((2, 1), -1, np.int32)], axis=1),
                   None if attrs[0] is None else with_zero_row(attrs),
                   None if ys[0] is None else with_zero_row([y[None] for y in ys]),
                   np.array([x.shape[0] for x in xs]), np.array([e.shape[1] for e in edges]))

    def max_degree(self) -> int:
        """The most edges into or out of one node of any graph (on the host: before the dataset moves)."""
        offsets = np.repeat(np.cumsum(self.node_counts) - self.node_counts, self.edge_counts)
        ends = np.asarray(self.edge_index)[:, :-1] + offsets  # (every graph's nodes numbered apart; no padding)
        return int(max((np.bincount(e).max(initial=0) for e in ends), default=0))


jax.tree_util.register_dataclass(
    _FlatGraphs, data_fields=["x", "edge_index", "edge_attr", "y", "node_counts", "edge_counts"], meta_fields=[])


@functools.partial(jax.jit, static_argnums=2)
def _gather(data: _FlatGraphs, ids: jax.Array, budget: GraphBudget) -> GraphBatch:
    """The graphs `ids` (int32 `(G,)`, -1 for padding graphs) of a flattened dataset as one padded `GraphBatch`:
    one gather per field, whose index sends padding rows to the zero row (or -1 column) that `of` appended."""
    graph = jnp.maximum(ids, 0)
    n_node = jnp.where(ids >= 0, data.node_counts[graph], 0).astype(jnp.int32)
    n_edge = jnp.where(ids >= 0, data.edge_counts[graph], 0).astype(jnp.int32)
    nodes = _rows(data.node_counts, graph, n_node, budget.nodes, padding=data.x.shape[0] - 1)
    edges = _rows(data.edge_counts, graph, n_edge, budget.edges, padding=data.edge_index.shape[1] - 1)
    last = jnp.where(ids >= 0, graph, -1)  # (y's zero row)
    return GraphBatch(data.x[nodes], data.edge_index[:, edges],
                      None if data.edge_attr is None else data.edge_attr[edges],
                      None if data.y is None else data.y[last], n_node, n_edge, ids >= 0, budget)


def _rows(counts: jax.Array, graph: jax.Array, taken: jax.Array, size: int, padding: int) -> jax.Array:
    """The rows of a flat array cut into segments of `counts` that segments `graph` fill, `taken[i]` rows of
    segment `graph[i]` one after another, then `padding` up to `size`."""
    starts = jnp.cumsum(counts) - counts
    owner = _owner(taken, size)
    first = jnp.cumsum(taken) - taken  # each segment's first row in the batch
    inside = owner < graph.shape[0]
    owner = jnp.minimum(owner, graph.shape[0] - 1)
    return jnp.where(inside, starts[graph[owner]] + jnp.arange(size) - first[owner], padding)


def _field(graph, name: str):
    """A graph's field, as an attribute (a PyG `Data`, a namedtuple) or a key (a dict); None where absent."""
    return graph.get(name) if isinstance(graph, Mapping) else getattr(graph, name, None)


def _numpy(array) -> np.ndarray:
    """NumPy, JAX or torch (on any device) as a NumPy array of the dtype JAX would make of it (float32 for float64
    without `jax_enable_x64`), so that each batch is converted once, here, not at every transfer."""
    array = np.asarray(array.detach().cpu() if hasattr(array, "detach") else array)
    return array.astype(jax.dtypes.canonicalize_dtype(array.dtype), copy=False)
