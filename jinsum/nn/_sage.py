"""GraphSAGE convolution (Hamilton et al., 2017) on a sparse adjacency: mean, sum, max, ... or several aggregations."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jinsum.formats import BlockGroupCOO, GroupCOO
from jinsum.nn._aggregation import AGGREGATIONS, multi_aggregate
from jinsum.nn._dtypes import check_dtypes, promote
from jinsum.nn._graph import aggregate, expect_adjacency, node_features, row_sums, transform_first
from jinsum.nn._sizes import feature_pair, layer_sizes


class SAGEConv(nnx.Module):
    """`out_i = W_l aggr_{j -> i} x_j + W_r x_i + b`, optionally L2-normalised (PyG's `SAGEConv`).

    Aggregations over each node's in-edges:

    - `"mean"` (the default), weighted by the edge values: `(A @ x)_i / deg_i` with `deg = rowsum(A)` (the number of
      in-edges for an unweighted graph), one sorted segment sum `D[Ai[g]] += Av[g,p]` and one SpMM;
    - `"sum"`: `(A @ x)_i`, weighted by the edge values;
    - `"max"`: the elementwise maximum of the in-neighbours' features, `C[Ai[g],n] max= x[Ak[g,p],n]` (edge values
      ignored); its gradient goes to each output element's first maximal neighbour;
    - `"min"`, `"var"`, `"std"`, or a list of aggregations concatenated (PNA's `["mean", "max", "min", "std"]`;
      `jinsum.nn.multi_aggregate`).

    Nodes without in-edges aggregate 0. Sums and means commute with `W_l`, so they run in whichever order does fewer
    multiply-adds: on a square graph, the SpMM on the narrower of `x` and `x W_l`; on a sampled bipartite layer
    (many more sources than destinations) usually the SpMM first. The maximum takes `x` (or its projection).

    Shapes: `x` `(N, in_features)`, `A` `(N, N)` with `A[dst, src] = weight` -> `(N, out_features)`; bipartite:
    `x = (x_src, x_dst)`, `in_features = (F_src, F_dst)` and `A` `(N_dst, N_src)` -> `(N_dst, out_features)`.

    Example:
      >>> edge_index, x = np.array([[0, 1, 2, 3], [1, 2, 3, 0]]), jnp.ones((4, 16))   # a ring of 4 nodes
      >>> A = jinsum.graphs.adjacency(edge_index, num_nodes=4)
      >>> sage = jinsum.nn.SAGEConv(16, 32, aggr="max", rngs=nnx.Rngs(0))
      >>> sage(x, A).shape
      (4, 32)
    """

    def __init__(self, in_features: int | tuple[int, int], out_features: int, *, aggr: str = "mean",
                 normalize: bool = False, project: bool = False, use_bias: bool = True, root_weight: bool = True,
                 dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        """Creates the parameters.

        Args:
          in_features, out_features: feature sizes of the input (of the sources and the destinations, for a
            bipartite graph) and the output.
          aggr: `"mean"`, `"sum"`, `"max"`, `"min"`, `"var"`, `"std"` over each node's in-edges, or a list of them.
          normalize: L2-normalise each output row (as `torch.nn.functional.normalize`, eps 1e-12).
          project: first replace the neighbours' features by `ReLU(W_p x + b_p)` (a learned `in -> in` layer).
          use_bias: add a learned bias `b`.
          root_weight: add the node's own transformed features `W_r x_i`.
          dtype: the computation's dtype (features, weights and the adjacency's values are cast to it, as
            `nnx.Linear` casts them; sparse products accumulate as their statements do, in float32 for bfloat16);
            None: JAX's promotion of the input and the parameters (`jinsum.nn._dtypes`).
          param_dtype: the parameters' dtype.
          rngs: initialises the weights.
        """
        check_dtypes("SAGEConv", dtype, param_dtype)
        aggrs = [aggr] if isinstance(aggr, str) else list(aggr)
        if not aggrs or any(a not in AGGREGATIONS for a in aggrs):
            raise ValueError(f"SAGEConv: aggr must be one of {AGGREGATIONS} or a list of them, got {aggr!r}")
        self.aggrs, self.normalize = tuple(aggrs), normalize
        in_src, in_dst = feature_pair("SAGEConv", in_features)
        in_dst = in_src if in_dst is None else in_dst
        (out_features,) = layer_sizes("SAGEConv", out_features=out_features)
        self.in_features = (in_src, in_dst)
        linear = functools.partial(nnx.Linear, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.dtype = dtype
        self.project = linear(in_src, in_src) if project else None
        self.lin_neighbors = linear(len(aggrs) * in_src, out_features, use_bias=False)
        self.lin_root = linear(in_dst, out_features, use_bias=False) if root_weight else None
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None

    def __call__(self, x: jax.Array | tuple[jax.Array, jax.Array], A: GroupCOO | BlockGroupCOO) -> jax.Array:
        """`x` `(N, in_features)` or `(x_src, x_dst)`, `A` a `GroupCOO` (or, for mean and sum, a `BlockGroupCOO`)
        `(N_dst, N_src)` -> `(N_dst, out_features)`."""
        linear = self.aggrs in (("mean",), ("sum",))  # (these commute with W_l and take a block format too)
        formats = (GroupCOO, BlockGroupCOO) if linear else (GroupCOO,)
        x_src, x = node_features("SAGEConv", x)
        expect_adjacency("SAGEConv", A, x, formats, self.in_features[1], sources=x_src,
                         source_features=self.in_features[0])
        x_src, x, _ = promote(self.dtype, x_src, x, self.lin_neighbors.kernel[...])
        neighbors = x_src if self.project is None else jax.nn.relu(self.project(x_src))
        if not linear:
            out = self.lin_neighbors(multi_aggregate(A, neighbors, self.aggrs))
        else:
            scale = 1
            if self.aggrs == ("mean",):
                deg = row_sums(A, jnp.promote_types(x.dtype, jnp.float32))[:, None]
                scale = (1 / jnp.where(deg != 0, deg, 1)).astype(x.dtype)
            if transform_first(A, self.lin_neighbors.in_features, self.lin_neighbors.out_features):
                out = aggregate(A, self.lin_neighbors(neighbors)) * scale
            else:
                out = self.lin_neighbors(aggregate(A, neighbors) * scale)
        if self.lin_root is not None:
            out = out + self.lin_root(x)
        out = out if self.bias is None else out + self.bias[...].astype(out.dtype)
        if self.normalize:
            out = out / jnp.maximum(jnp.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
        return out
