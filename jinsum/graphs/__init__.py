"""Graph data for the layers of `jinsum.nn`, without Flax: adjacencies, batches and loaders, graphs computed from
data and embedding bags, all built into `jinsum.formats` (PyG's `data/` and `loader/`, kept apart from `nn/`).

    A = jinsum.graphs.adjacency(edge_index, num_nodes=N)       # edge_index (2, E): sources, destinations
    for batch in jinsum.graphs.GraphLoader(molecules, batch_size=128, shuffle=True):
        A = batch.adjacency()                                   # padded to one budget: one compile

Adjacencies: `adjacency` (on the host, or inside `jit` with a `capacity`; bipartite with `(N_src, N_dst)`),
`gcn_norm` (GCN's normalised adjacency of a static graph, computed once: PyG's `gcn_norm` / `cached=True`), the
edges one by one (`edge_list` -> `EdgeList`, `edge_adjacency` with edge features in its values), typed edges
(`relational_graph` -> `RelationalGraph`, `relational_adjacency`). Many small graphs: `GraphLoader` (padded
mini-batches of a fixed `GraphBudget`, each a `GraphBatch` whose adjacency is built on the device) or `batch_graphs`
(one batch, on the host). Graphs from data inside `jit`: `knn` (a fixed-fanout table) and `knn_graph` (PyG's edge
index), `radius` / `radius_graph` (the first points within `r`, with a count that reports a cut). Embedding bags:
`bags` (torch's `EmbeddingBag` inputs as a `Bags` matrix, built on the device). Sub-graphs sampled on the device
are `jinsum.sampling`'s.
"""

from jinsum.graphs._adjacency import adjacency as adjacency
from jinsum.graphs._adjacency import gcn_norm as gcn_norm
from jinsum.graphs._bags import Bags as Bags
from jinsum.graphs._bags import bags as bags
from jinsum.graphs._batch import GraphBatch as GraphBatch
from jinsum.graphs._batch import GraphBudget as GraphBudget
from jinsum.graphs._batch import GraphLoader as GraphLoader
from jinsum.graphs._batch import batch_graphs as batch_graphs
from jinsum.graphs._edge_list import EdgeList as EdgeList
from jinsum.graphs._edge_list import edge_adjacency as edge_adjacency
from jinsum.graphs._edge_list import edge_list as edge_list
from jinsum.graphs._point_graphs import knn as knn
from jinsum.graphs._point_graphs import knn_graph as knn_graph
from jinsum.graphs._point_graphs import radius as radius
from jinsum.graphs._point_graphs import radius_graph as radius_graph
from jinsum.graphs._relational import RelationalGraph as RelationalGraph
from jinsum.graphs._relational import relational_adjacency as relational_adjacency
from jinsum.graphs._relational import relational_graph as relational_graph
