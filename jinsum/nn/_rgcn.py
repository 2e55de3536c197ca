"""Relational graph convolution (Schlichtkrull et al., 2018): one indirect Einsum over typed edges."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import jinsum
from jinsum.graphs import RelationalGraph
from jinsum.nn._dtypes import check_dtypes, compute_dtype
from jinsum.nn._hetero_linear import rows_by_type
from jinsum.nn._moe import combined
from jinsum.nn._sizes import layer_sizes
from jinsum.shard import Partitioned, per_part


class RGCNConv(nnx.Module):
    """`out_i = x_i W_0 + sum_r sum_{j in N_r(i)} x_j W_r / c_{i,r} + b`, over typed edges (`c_{i,r} = 1` with
    `aggr="add"`).

    All messages of all relations are one indirect Einsum with the relation as an index, on node features
    transformed by every relation first (`H = x W_r`, one dense product): `O[dst[e],f] += norm[e] *
    H[src[e],rel[e],f]` (a sorted segment sum, edges being sorted by destination). With `num_bases`
    (`W_r = sum_b comp[r,b] V_b`), `H` holds `x V_b` and the statement is
    `O[dst[e],f] += norm[e] * comp[rel[e],b] * H[src[e],b,f]`. `H` has `N x R x out_features` (or bases) entries.

    With many relations (fewer edges than `N x R`, each relation its own weight), transforming every node by every
    relation would cost more than transforming each edge's source by its relation: the edges are grouped by
    relation (as `HeteroLinear` groups rows by type) and each group's sources multiplied by its relation's weight,
    `M[g,p,f] += X[src[Ak[g,p]],c] * W[Ai[g],c,f]` (a grouped product: Tensor Core tiles on GPUs; PyG's
    `segment_matmul` path), then summed into the destinations: `N x R` fewer rows, no `N x R x out` array.

    Shapes: `x` `(N, in_features)`, `graph` a `RelationalGraph` over `N` nodes -> `(N, out_features)`.

    Example:
      >>> src, dst, rel = np.array([0, 1, 2, 3]), np.array([1, 2, 3, 0]), np.array([0, 2, 1, 2])
      >>> g = jinsum.graphs.relational_graph(src, dst, rel, num_nodes=4, num_relations=3)
      >>> conv = jinsum.nn.RGCNConv(16, 32, num_relations=3, num_bases=2, rngs=nnx.Rngs(0))
      >>> conv(jnp.ones((4, 16)), g).shape
      (4, 32)
    """

    def __init__(self, in_features: int, out_features: int, *, num_relations: int, num_bases: int | None = None,
                 num_blocks: int | None = None, aggr: str = "mean", root_weight: bool = True, use_bias: bool = True,
                 dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        """Creates the parameters.

        Args:
          in_features, out_features: feature sizes of the input and the output.
          num_relations: `R`, the number of edge types.
          num_bases: share `num_bases` basis matrices among the relations; `None` gives each its own weight.
          num_blocks: make each relation's weight block-diagonal, `num_blocks` blocks of `(in_features / num_blocks,
            out_features / num_blocks)` (PyG's block-diagonal decomposition; not with `num_bases`).
          aggr: `"mean"` (PyG's default: each relation's messages averaged, `1 / c_{i,r}`) or `"add"` (summed).
          root_weight: add the node's own transformed features `x_i W_0`.
          use_bias: add a learned bias `b`.
          dtype: the computation's dtype (features, weights, the edges' norms and the adjacency's values are cast
            to it, as `nnx.Linear` casts them; sparse products accumulate as their statements do, in float32 for
            bfloat16); None: JAX's promotion of the input and the parameters (`jinsum.nn._dtypes`).
          param_dtype: the parameters' dtype.
          rngs: initialises the weights.
        """
        check_dtypes("RGCNConv", dtype, param_dtype)
        if aggr not in ("mean", "add"):
            raise ValueError(f"RGCNConv: aggr must be 'mean' or 'add', got {aggr!r}")
        in_features, out_features, num_relations = layer_sizes(
            "RGCNConv", in_features=in_features, out_features=out_features, num_relations=num_relations)
        if num_bases is not None:
            (num_bases,) = layer_sizes("RGCNConv", num_bases=num_bases)
        if num_blocks is not None:
            (num_blocks,) = layer_sizes("RGCNConv", num_blocks=num_blocks)
        self.in_features, self.num_relations, self.aggr, self.dtype = in_features, num_relations, aggr, dtype
        # Fan-in is the input features (axis -2) of every relation or basis weight.
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        if num_bases is not None and num_blocks is not None:
            raise ValueError("RGCNConv: num_bases and num_blocks are two decompositions of the weights; pick one")
        if num_blocks is not None and (in_features % num_blocks or out_features % num_blocks):
            raise ValueError(f"RGCNConv: num_blocks = {num_blocks} must divide in_features = {in_features} and "
                             f"out_features = {out_features}")
        self.num_blocks = num_blocks
        if num_blocks is not None:
            shape = (num_relations, num_blocks, in_features // num_blocks, out_features // num_blocks)
            self.weight = nnx.Param(init(rngs.params(), shape, param_dtype))
            self.comp = None
        elif num_bases is None:
            self.weight = nnx.Param(init(rngs.params(), (num_relations, in_features, out_features), param_dtype))
            self.comp = None
        else:
            self.weight = nnx.Param(init(rngs.params(), (num_bases, in_features, out_features), param_dtype))
            self.comp = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (num_relations, num_bases),
                                                                  param_dtype))
        self.root = (nnx.Linear(in_features, out_features, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                                rngs=rngs) if root_weight else None)
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None

    def __call__(self, x: jax.Array, graph: RelationalGraph | Partitioned) -> jax.Array:
        """`x` `(N, in_features)`, `graph` a `RelationalGraph` -> `(N, out_features)`; or, on several devices, `x`
        laid out by `graph`, a partitioned `relational_adjacency`."""
        if jnp.ndim(x) != 2 or jnp.shape(x)[1] != self.in_features:
            raise ValueError(f"RGCNConv: expected node features x of shape (N, {self.in_features}) (the layer's "
                             f"in_features), got {jnp.shape(x)}")
        if isinstance(graph, Partitioned):
            out = self._partitioned(x, graph)
        else:
            out = self._messages(x, graph)
        if self.root is not None:
            out = out + self.root(x)
        return out if self.bias is None else out + self.bias[...].astype(out.dtype)

    def _messages(self, x: jax.Array, graph: RelationalGraph) -> jax.Array:
        if not isinstance(graph, RelationalGraph):
            raise TypeError(f"RGCNConv: expected a jinsum.graphs.RelationalGraph, got {type(graph).__name__}. Build it "
                            "once, outside the jitted step, with jinsum.graphs.relational_graph(src, dst, rel, "
                            "num_nodes, num_relations)")
        if graph.num_nodes != x.shape[0] or graph.num_relations != self.num_relations:
            raise ValueError(f"RGCNConv: expected a graph over the N = {x.shape[0]} rows of x {tuple(x.shape)} "
                             f"with num_relations = {self.num_relations}, got num_nodes = {graph.num_nodes} and "
                             f"num_relations = {graph.num_relations}")
        norm = graph.norm if self.aggr == "mean" else jnp.ones_like(graph.norm)
        if self.comp is None and self.num_blocks is None and graph.src.shape[0] < x.shape[0] * self.num_relations:
            return self._messages_by_edge(x, graph, norm)
        H, dtype = self._transform(x, self.weight[...])
        zeros = jax.ShapeDtypeStruct((x.shape[0], H.shape[-1]), dtype)
        edges = dict(R=graph.dst, C=graph.src, T=graph.rel, N=norm.astype(dtype), H=H)
        if self.comp is None:
            return jinsum.einsum("O[R[e],f] += N[e] * H[C[e],T[e],f]", sorted_indices=("R",), O=zeros, **edges)
        # W_r = sum_b comp[r,b] V_b: H holds x V_b, and each edge weighs the bases by its relation's comp
        return jinsum.einsum("O[R[e],f] += N[e] * Comp[T[e],b] * H[C[e],b,f]", sorted_indices=("R",), O=zeros,
                             Comp=self.comp[...].astype(dtype), **edges)

    def _messages_by_edge(self, x: jax.Array, graph: RelationalGraph, norm: jax.Array) -> jax.Array:
        """Each edge's source by its relation's weight, the edges grouped by relation (the class docstring)."""
        weight = self.weight[...]
        dtype = compute_dtype(self.dtype, x, weight)
        by_relation = rows_by_type(graph.rel, self.num_relations).astype(dtype)  # (R, E): the edges of each relation
        messages = jinsum.einsum("M[g,p,f] += X[C[Ak[g,p]],c] * W[Ai[g],c,f]", A=by_relation, C=graph.src,
                                 X=x.astype(dtype), W=weight.astype(dtype),
                                 M=jax.ShapeDtypeStruct((*by_relation.Ak.shape, weight.shape[-1]), dtype))
        per_edge = combined(by_relation, messages, jax.ShapeDtypeStruct((graph.src.shape[0], weight.shape[-1]), dtype))
        return jinsum.einsum("O[R[e],f] += N[e] * M[e,f]", sorted_indices=("R",), R=graph.dst, N=norm.astype(dtype),
                             M=per_edge, O=jax.ShapeDtypeStruct((x.shape[0], weight.shape[-1]), dtype))

    def _transform(self, x: jax.Array, weight: jax.Array) -> tuple[jax.Array, jnp.dtype]:
        """`H` `(N, R or bases, out_features)`: every node by every relation (or basis) in one dense product, so
        that each edge gathers a single row of H. Edge by edge, `X[C[e],c] * W[T[e],c,f]` would cost c times more
        work and, on the XLA lowering, gather a whole weight matrix per edge."""
        dtype = compute_dtype(self.dtype, x, weight)
        if self.num_blocks is None:
            return jnp.einsum("nc,rcf->nrf", x.astype(dtype), weight.astype(dtype)), dtype
        # each block by its block of the weight (sizes spelt out: -1 is ambiguous for 0 nodes)
        blocks = x.astype(dtype).reshape(x.shape[0], self.num_blocks, weight.shape[2])
        H = jnp.einsum("nbc,rbcf->nrbf", blocks, weight.astype(dtype))
        return H.reshape(x.shape[0], self.num_relations, self.num_blocks * weight.shape[3]), dtype

    def _partitioned(self, x: jax.Array, A: Partitioned) -> jax.Array:
        """The messages over a partitioned `relational_adjacency` (`A[dst, src, rel]` = edges of the type): the
        devices exchange rows of `x` (narrower than `H`) and transform what they read; the means' counts
        `c_{i,r}` are row sums of `A`, taken over both parts of each device before the messages."""
        if A.dense_shape != (self.num_relations,):
            raise ValueError(f"RGCNConv: expected a partitioned relational_adjacency with {self.num_relations} "
                             f"relations (shape (N, N, {self.num_relations})), got {A!r}")
        dtype = compute_dtype(self.dtype, x, self.weight[...])
        wide = jnp.promote_types(dtype, jnp.float32)  # (counts in float32 at least: exact where bfloat16 is not)

        def counts(part, out=None):
            zeros = jax.ShapeDtypeStruct((part.shape[0], self.num_relations), wide) if out is None else out
            return jinsum.einsum("C[Ai[g],r] += Av[g,p,r]", C=zeros, A=part.astype(wide))

        if self.aggr == "mean":
            c = per_part(counts, A)
            scale = (1 / jnp.where(c > 0, c, 1)).astype(dtype)
        else:
            scale = jnp.ones((x.shape[0], self.num_relations), dtype)
        comp = () if self.comp is None else (self.comp[...].astype(dtype),)

        def messages(part, scale, x, weight, *comp, out=None):
            H, _ = self._transform(x, weight)
            zeros = jax.ShapeDtypeStruct((part.shape[0], H.shape[-1]), dtype) if out is None else out
            arrays = dict(O=zeros, A=part.astype(dtype), S=scale, H=H)
            if not comp:
                return jinsum.einsum("O[Ai[g],f] += Av[g,p,r] * S[Ai[g],r] * H[Ak[g,p],r,f]", **arrays)
            return jinsum.einsum("O[Ai[g],f] += Av[g,p,r] * S[Ai[g],r] * Comp[r,b] * H[Ak[g,p],b,f]",
                                 Comp=comp[0], **arrays)

        return per_part(messages, A, rows=(scale,), columns=(x,), replicated=(self.weight[...], *comp))
