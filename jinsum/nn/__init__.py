"""Flax NNX graph and attention layers whose sparse work is indirect Einsums (needs `pip install 'jinsum[nn]'`).

Graphs are `jinsum.GroupCOO` adjacencies `A[dst, src] = weight`, built once on the host and passed to every call:

    A = jinsum.graphs.adjacency(edge_index, num_nodes=N)      # edge_index (2, E): sources, destinations
    conv = jinsum.nn.GCNConv(F, 64, rngs=nnx.Rngs(0))
    y = nnx.jit(lambda conv, x, A: conv(x, A))(conv, x, A)

Layers (PyG's names and semantics): `GCNConv`, `SGConv`, `APPNP`, `SAGEConv` (mean, sum, max, ... or several),
`GINConv` (SpMM; also on a `BlockGroupCOO`), `GINEConv` (edge features, on an `edge_list`), `GraphConv`,
`EdgeConv` (`max=`), `GATConv` (SDDMM, edge softmax, multi-head SpMM; on an `edge_list`: edge features and
attention weights), `GATv2Conv` (edge by edge, on an `edge_list`), `TransformerConv` (the same fused attention as
GAT), `RGCNConv` on a `RelationalGraph`, and `BlockSparseAttention` on a `block_pattern` or on masks of packed
documents built on the device (`sequence_mask`, `block_mask`). SAGE, GraphConv and
TransformerConv take a bipartite `(x_src, x_dst)` with `adjacency(edge_index, (N_src, N_dst))`. Many small graphs
(batched by `GraphLoader` or `batch_graphs`): `global_add_pool` / `global_mean_pool` / `global_max_pool` /
`AttentionalAggregation`. `DynamicEdgeConv` (DGCNN: EdgeConv over a kNN graph that each call rebuilds from its
input, tiled, never an `(N, N)` distance matrix).
Sparse weights: `SparseLinear` (a linear layer over a fixed element or block pattern, learned values;
`random_pattern`). Typed and routed weights: `HeteroLinear` (PyG's: one matrix per node or edge type), `MoE` (a
mixture of experts: `route_tokens` builds the routing on the device, `routed_mlp` / `routed_linear` run the
experts as statements over it, `expert_parallel_mlp` with the experts split over a mesh axis). Recommendation:
`EmbeddingBag` (torch's: sum, mean or max over bags of ids, the bags built on the device by `bags`;
`embedding_bag` on a table or on only the rows a batch touches, `sparse_adagrad` to update those). Serving:
`PagedKVCache` (keys and values in pages of a shared pool, allocated and freed on the device; `attend` runs
`jinsum.paged_attention` over it).
The graph layers, the pools, the aggregations and `embedding_bag` take integer features (counts, one-hot codes),
cast to float as `nnx.Linear` casts them; zero nodes or edges give the empty result or the self loops alone.
Several devices: GCN, SGConv, APPNP, SAGE, GIN, GraphConv, EdgeConv, GAT, TransformerConv and RGCN (on a
`relational_adjacency`) take a `jinsum.shard.partition` of the adjacency; GINE, GATv2 and GAT with edge features a
partition of an `edge_adjacency` (the edges one by one, their features in its values).

The graph data the layers read (`adjacency`, `gcn_norm`, `edge_list` / `EdgeList`, `edge_adjacency`,
`relational_graph` / `RelationalGraph` / `relational_adjacency`, `GraphLoader` / `GraphBatch` / `GraphBudget`,
`batch_graphs`, `knn` / `knn_graph` / `radius` / `radius_graph`, `bags` / `Bags`) is `jinsum.graphs`', which needs
no Flax; it is re-exported here.
"""

from jinsum.graphs import Bags as Bags
from jinsum.graphs import EdgeList as EdgeList
from jinsum.graphs import GraphBatch as GraphBatch
from jinsum.graphs import GraphBudget as GraphBudget
from jinsum.graphs import GraphLoader as GraphLoader
from jinsum.graphs import RelationalGraph as RelationalGraph
from jinsum.graphs import adjacency as adjacency
from jinsum.graphs import bags as bags
from jinsum.graphs import batch_graphs as batch_graphs
from jinsum.graphs import edge_adjacency as edge_adjacency
from jinsum.graphs import edge_list as edge_list
from jinsum.graphs import gcn_norm as gcn_norm
from jinsum.graphs import knn as knn
from jinsum.graphs import knn_graph as knn_graph
from jinsum.graphs import radius as radius
from jinsum.graphs import radius_graph as radius_graph
from jinsum.graphs import relational_adjacency as relational_adjacency
from jinsum.graphs import relational_graph as relational_graph
from jinsum.nn._aggregation import aggregate_by as aggregate_by
from jinsum.nn._aggregation import multi_aggregate as multi_aggregate
from jinsum.nn._attention import BlockSparseAttention as BlockSparseAttention
from jinsum.nn._attention import block_mask as block_mask
from jinsum.nn._attention import block_pattern as block_pattern
from jinsum.nn._attention import block_sparse_attention as block_sparse_attention
from jinsum.nn._attention import sequence_mask as sequence_mask
from jinsum.nn._dynamic_edge_conv import DynamicEdgeConv as DynamicEdgeConv
from jinsum.nn._edge_conv import EdgeConv as EdgeConv
from jinsum.nn._embedding_bag import EmbeddingBag as EmbeddingBag
from jinsum.nn._embedding_bag import embedding_bag as embedding_bag
from jinsum.nn._expert_parallel import expert_parallel_mlp as expert_parallel_mlp
from jinsum.nn._gat import GATConv as GATConv
from jinsum.nn._gatv2 import GATv2Conv as GATv2Conv
from jinsum.nn._gcn import APPNP as APPNP
from jinsum.nn._gcn import GCNConv as GCNConv
from jinsum.nn._gcn import SGConv as SGConv
from jinsum.nn._gin import GINConv as GINConv
from jinsum.nn._gine import GINEConv as GINEConv
from jinsum.nn._graph_conv import GraphConv as GraphConv
from jinsum.nn._hetero_linear import HeteroLinear as HeteroLinear
from jinsum.nn._moe_layer import MoE as MoE
from jinsum.nn._moe import routed_linear as routed_linear
from jinsum.nn._moe import routed_mlp as routed_mlp
from jinsum.nn._paged_kv_cache import PagedKVCache as PagedKVCache
from jinsum.nn._pool import AttentionalAggregation as AttentionalAggregation
from jinsum.nn._pool import global_add_pool as global_add_pool
from jinsum.nn._pool import global_max_pool as global_max_pool
from jinsum.nn._pool import global_mean_pool as global_mean_pool
from jinsum.nn._rgcn import RGCNConv as RGCNConv
from jinsum.nn._routing import Routing as Routing
from jinsum.nn._routing import route_tokens as route_tokens
from jinsum.nn._sage import SAGEConv as SAGEConv
from jinsum.nn._sparse_adagrad import sparse_adagrad as sparse_adagrad
from jinsum.nn._sparse_linear import SparseLinear as SparseLinear
from jinsum.nn._sparse_linear import SparsityPattern as SparsityPattern
from jinsum.nn._sparse_linear import random_pattern as random_pattern
from jinsum.nn._transformer import TransformerConv as TransformerConv
