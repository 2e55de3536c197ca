"""Sparse products over several devices with JAX's own machinery: a square `GroupCOO` (or `BlockGroupCOO`) split by
rows over a mesh axis (`partition`), node features laid out on the same split, and products that run the ordinary
statements on each device's part inside `jax.shard_map`, exchanging only the rows of the dense operand a part reads.

    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    P = jinsum.shard.partition(A, mesh)                  # on the host, once
    x = P.shard_rows(features)                           # (D * R, F), row-sharded
    y = jax.jit(lambda P, x: P @ x)(P, x)                # row-sharded like x; P.unshard_rows(y) == A @ features

`jinsum.nn` layers (GCN, SGConv, APPNP, SAGE, GIN, GraphConv, EdgeConv, GAT, TransformerConv, RGCN) take a
`Partitioned` where they take an adjacency.
"""

from jinsum.shard._communication import communication as communication
from jinsum.shard._ops import attention as attention
from jinsum.shard._ops import einsum as einsum
from jinsum.shard._ops import matmul as matmul
from jinsum.shard._ops import per_part as per_part
from jinsum.shard._ops import row_sums as row_sums
from jinsum.shard._partition import EXCHANGES as EXCHANGES
from jinsum.shard._partition import SPLITS as SPLITS
from jinsum.shard._partition import HaloPlan as HaloPlan
from jinsum.shard._partition import Layout as Layout
from jinsum.shard._partition import Partitioned as Partitioned
from jinsum.shard._partition import partition as partition
