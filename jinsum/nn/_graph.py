"""Graph adjacency in the layers: checking it at a call, and the sparse sums on it.

A graph is a `jinsum.GroupCOO` `A` with `A[dst, src] = weight` (`jinsum.graphs.adjacency` builds it, once, outside
`jit`), so `A @ X` sums the features of each node's sources into it; layers take it as an argument of every call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jinsum
from jinsum.formats import BlockGroupCOO, GroupCOO
from jinsum.shard import Partitioned, matmul, per_part
from jinsum.shard import row_sums as partitioned_row_sums


def node_features(layer: str, x) -> tuple[jax.Array, jax.Array]:
    """`(x_src, x_dst)`: a layer's input, node features `(N, F)` or a bipartite pair `(x_src, x_dst)`."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"{layer}: a bipartite input is a pair (x_src, x_dst), got {len(x)} arrays")
        return x[0], x[1]
    return x, x


def expect_adjacency(layer: str, A, x, formats=(GroupCOO,), in_features: int | None = None, *, sources=None,
                     source_features: int | None = None) -> None:
    """Raises a clear error unless `A` is an adjacency in one of `formats` from the rows of `sources` (default: `x`,
    a square adjacency) to the `N` rows of `x`, and `x` / `sources` have `in_features` / `source_features` columns
    (where given)."""
    bipartite = sources is not None and sources is not x
    if isinstance(A, Partitioned) and A.format in formats:
        return _expect_partitioned(layer, A, x, in_features, bipartite)
    for name, features, width in (("", x, in_features), ("source " if bipartite else "", sources, source_features)):
        if features is not None and (features.ndim != 2 or width is not None and features.shape[1] != width):
            expected = "(N, F)" if width is None else f"(N, {width}) (the layer's in_features)"
            raise ValueError(f"{layer}: expected {name}node features of shape {expected}, got "
                             f"{tuple(features.shape)}")
    if not isinstance(A, formats):
        names = " or ".join(f"jinsum.{f.__name__}" for f in formats)
        got = (f"an array {jnp.dtype(A.dtype).name}{list(A.shape)}" if isinstance(A, (jax.Array, np.ndarray))
               else repr(A))
        raise TypeError(
            f"{layer}: expected the adjacency as a {names}, got {got}. Convert an edge index (2, E) once, outside "
            "the jitted step, with `A = jinsum.graphs.adjacency(edge_index, num_nodes)` and pass A to every call")
    if bipartite:
        if len(A.shape) != 2 or A.shape != (x.shape[0], sources.shape[0]):
            raise ValueError(f"{layer}: expected a bipartite adjacency of shape (N_dst, N_src) = "
                             f"{(x.shape[0], sources.shape[0])} with scalar entries, got {A!r}; build it with "
                             "jinsum.graphs.adjacency(edge_index, (N_src, N_dst))")
    elif len(A.shape) != 2 or A.shape[0] != A.shape[1] or A.shape[1] != x.shape[0]:
        raise ValueError(
            f"{layer}: expected a square (N, N) adjacency with scalar entries over the N = {x.shape[0]} rows of the "
            f"node features {tuple(x.shape)}, got {A!r}; build it with jinsum.graphs.adjacency(edge_index, N)")


def floating_features(x, *like) -> jax.Array:
    """`x` as it is where floating; integer (or boolean) features (counts, one-hot codes) cast to the float type of
    JAX's promotion with `like`, a layer's parameters (as `nnx.Linear` promotes them), or without, the default
    float. The layers take integer node features as PyG's and `nnx.Linear` do, and cast them before any sparse
    product (whose values must be floating)."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return x
    return x.astype(jnp.result_type(x.dtype, *(like or (float,))))


def _expect_partitioned(layer: str, A: Partitioned, x, in_features: int | None, bipartite: bool) -> None:
    rows = A.padded_rows
    if bipartite:
        raise NotImplementedError(f"{layer}: a partitioned adjacency splits one set of nodes; bipartite inputs "
                                  "(x_src, x_dst) are not supported on it")
    if len(A.shape) != 2:
        raise ValueError(f"{layer}: expected an adjacency with scalar entries, got {A!r}")
    if x.ndim != 2 or x.shape[0] != rows or (in_features is not None and x.shape[1] != in_features):
        width = "F" if in_features is None else in_features
        raise ValueError(f"{layer}: expected node features laid out by the partition, ({rows}, {width}) = "
                         f"{A.num_parts} devices x {rows // A.num_parts} rows (A.shard_rows(x)), got "
                         f"{tuple(x.shape)}")


def row_sums(A: GroupCOO | BlockGroupCOO, dtype=None) -> jax.Array:
    """`A.sum(axis=1)` as an indirect Einsum over the stored entries: `(M, *A.dense_shape)`.

    One sorted segment sum of `Av` over the rows `Ai` (for a `BlockGroupCOO`, over the block rows, then the
    block rows are unfolded to matrix rows). `dtype` defaults to `A.dtype`.

    Example:
      >>> deg = row_sums(A)            # in-degrees (weighted) of an adjacency A[dst, src]
    """
    if isinstance(A, Partitioned):
        return partitioned_row_sums(A, dtype)
    A = A.astype(A.dtype if dtype is None else dtype)
    if isinstance(A, BlockGroupCOO):
        (bm, _), rows = A.block_shape, A.num_block_rows
        sums = jinsum.einsum("D[Ai[g],m] += Av[g,m,k,p]", D=jax.ShapeDtypeStruct((rows, bm), A.dtype), A=A)
        return sums.reshape(-1)[: A.shape[0]]
    dense = "".join(f",d{i}" for i in range(len(A.dense_shape)))
    zeros = jax.ShapeDtypeStruct((A.shape[0], *A.dense_shape), A.dtype)
    return jinsum.einsum(f"D[Ai[g]{dense}] += Av[g,p{dense}]", D=zeros, A=A)


def aggregate(A: GroupCOO | BlockGroupCOO, h: jax.Array) -> jax.Array:
    """`A @ h` (SpMM over the stored entries), with `A`'s values in `h`'s dtype: `(M, F)` from `h` `(K, F)`.

    An adjacency that carries its entries in column order (`jinsum.graphs.adjacency` builds it so) keeps them through
    the cast: the gradient with respect to `h` is then the forward SpMM's kernel over the transpose instead of an
    atomic addition per edge. On a `Partitioned` (`jinsum.shard`), `h` and the result are row-sharded."""
    if isinstance(A, Partitioned):
        return matmul(A, h)
    return jinsum.einsum("ik,kn->in", A.astype(h.dtype), h)


def transform_first(A, in_features: int, out_features: int) -> bool:
    """Whether a linear layer's `A (x W)` costs fewer multiply-adds than `(A x) W`: `N_src F_in F_out + nnz F_out`
    against `nnz F_in + N_dst F_in F_out`. On a square graph that is the narrower width: a GCN's first layer (128 ->
    256) aggregates its 128 input features, and as nothing differentiates the input its backward runs no SpMM. On a
    sampled bipartite layer, with many more sources than destinations, transforming every source first is many
    times the work, and its backward is an atomic scatter into all the sources (DESIGN.md, "Order a mean's product
    by multiply-adds")."""
    n_dst, n_src = A.shape[:2]
    if n_dst == n_src:
        return out_features < in_features
    nnz = A.nnz * (A.block_shape[0] * A.block_shape[1] if isinstance(A, BlockGroupCOO) else 1)
    transform_first = n_src * in_features * out_features + nnz * out_features
    return transform_first < nnz * in_features + n_dst * in_features * out_features


def aggregate_extreme(A: GroupCOO, h: jax.Array, reduction: str = "max", *, weighted: bool = False,
                      empty: float | None = 0.0, out: jax.Array | None = None) -> jax.Array:
    """The largest (`"max"`) or smallest (`"min"`) of the rows of `h` over each row's stored entries, times the
    entry's value if `weighted`: `(M, F)` from `h` `(K, F)`. Rows without entries hold `empty` (0, as PyG's max
    aggregation), or with `empty=None` the reduction's identity (-inf for max, +inf for min).

    One statement, `C[Ai[g],n] max= h[Ak[g,p],n]` (or `... max= Av[g,p] * h[Ak[g,p],n]`; group padding takes no
    part: a format binds its columns with the padding out of range); its gradient goes to each output element's
    first maximal entry. With `out`, its elements take part too (the statement's initial value)."""
    if isinstance(A, Partitioned):
        out = per_part(lambda part, h, out=None: aggregate_extreme(part, h, reduction, weighted=weighted, empty=None,
                                                                   out=out), A, columns=(h,))
    else:
        rows = jax.ShapeDtypeStruct((A.shape[0], h.shape[1]), h.dtype) if out is None else out
        weight = "Av[g,p] * " if weighted else ""
        out = jinsum.einsum(f"C[Ai[g],n] {reduction}= {weight}H[Ak[g,p],n]", A=A.astype(h.dtype), H=h, C=rows)
    if empty is None:
        return out
    return jnp.where(out == (-jnp.inf if reduction == "max" else jnp.inf), empty, out)
