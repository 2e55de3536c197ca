"""Flax NNX layers whose sparse work is indirect Einsums (needs `pip install 'jinsum[nn]'`), with PyG's and Flax's
conventions: every layer takes `dtype=` (the computation's) and, where it has parameters, `param_dtype=`.

Graphs are `jinsum.GroupCOO` adjacencies `A[dst, src] = weight` from `jinsum.graphs` (which needs no Flax), built once
on the host and passed to every call:

    A = jinsum.graphs.adjacency(edge_index, num_nodes=N)      # edge_index (2, E): sources, destinations
    conv = jinsum.nn.GCNConv(F, 64, rngs=nnx.Rngs(0))
    y = nnx.jit(lambda conv, x, A: conv(x, A))(conv, x, A)

Graph layers (PyG's names and semantics): `GCNConv`, `SGConv`, `APPNP`, `SAGEConv`, `GINConv`, `GINEConv`,
`GraphConv`, `EdgeConv`, `DynamicEdgeConv`, `GATConv`, `GATv2Conv`, `TransformerConv`, `RGCNConv`; pooling and
aggregation: `global_add_pool`, `global_mean_pool`, `global_max_pool`, `AttentionalAggregation`, `aggregate_by`,
`multi_aggregate`. Attention: `BlockSparseAttention` (over `jinsum.block_pattern`, `jinsum.block_mask` or
`jinsum.sequence_mask` patterns; `generate` serves it over a `PagedKVCache`). Sparse weights: `SparseLinear`
(`random_pattern`, `SparsityPattern`). Typed and routed weights: `HeteroLinear`, `MoE` (`route_tokens`, `Routing`,
`routed_mlp`, `routed_linear`, `expert_parallel_mlp`). Recommendation: `EmbeddingBag`, `embedding_bag`,
`sparse_adagrad`. Several devices: the graph layers take a `jinsum.shard.partition` of their adjacency.
"""

from jinsum.nn._aggregation import aggregate_by as aggregate_by
from jinsum.nn._aggregation import multi_aggregate as multi_aggregate
from jinsum.nn._attention import BlockSparseAttention as BlockSparseAttention
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
