"""Neighbourhood aggregations by name, and several at once (PyG's `aggr="..."` and `MultiAggregation`, as in PNA)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jinsum.formats import GroupCOO
from jinsum.nn._graph import aggregate, aggregate_extreme, floating_features, row_sums
from jinsum.shard import Partitioned

AGGREGATIONS = ("sum", "mean", "max", "min", "var", "std")


def aggregate_by(A: GroupCOO, x: jax.Array, aggr: str) -> jax.Array:
    """The aggregation `aggr` of the rows of `x` over each row's stored entries: `(M, F)` from `x` `(K, F)`.

    `"sum"`: `A @ x`; `"mean"`: that over `rowsum(A)`; `"max"` / `"min"`: a `max=` / `min=` (edge values ignored);
    `"var"`: `mean(x^2) - mean(x)^2`; `"std"`: its square root, clamped below at 1e-5 and 0 at that floor (PyG's,
    whose gradient at 0 is defined). Edge values act as multiplicities in sums and means (duplicate edges count
    twice, as in PyG); rows without entries aggregate 0. Integer features are cast to the default float.
    """
    if aggr not in AGGREGATIONS:
        raise ValueError(f"jinsum.nn.aggregate_by: aggr must be one of {AGGREGATIONS}, got {aggr!r}")
    return _aggregate_by(*_checked("jinsum.nn.aggregate_by", A, x), aggr)


def _aggregate_by(A: GroupCOO, x: jax.Array, aggr: str) -> jax.Array:
    if aggr in ("max", "min"):
        return aggregate_extreme(A, x, aggr)
    if aggr == "sum":
        return aggregate(A, x)
    degree = row_sums(A, x.dtype)[:, None]
    mean = aggregate(A, x) / jnp.where(degree != 0, degree, 1)
    if aggr == "mean":
        return mean
    var = aggregate(A, x * x) / jnp.where(degree != 0, degree, 1) - mean * mean
    if aggr == "var":
        return var
    std = jnp.sqrt(jnp.maximum(var, 1e-5))
    return jnp.where(std <= jnp.sqrt(1e-5), 0, std)


def multi_aggregate(A: GroupCOO, x: jax.Array, aggrs: Sequence[str] | str) -> jax.Array:
    """Several aggregations side by side (`MultiAggregation(mode="cat")`): `(M, len(aggrs) * F)`; one name is a list
    of one, as `SAGEConv`'s `aggr` takes it.

    Example:
      >>> edge_index, x = np.array([[0, 1, 2, 3], [1, 2, 3, 0]]), jnp.ones((4, 16))   # a ring of 4 nodes
      >>> A = jinsum.graphs.adjacency(edge_index, num_nodes=4)
      >>> jinsum.nn.multi_aggregate(A, x, ["mean", "max", "min", "std"]).shape   # PNA's aggregators
      (4, 64)
    """
    names = [aggrs] if isinstance(aggrs, str) else list(aggrs)
    if not names or any(aggr not in AGGREGATIONS for aggr in names):
        raise ValueError(f"jinsum.nn.multi_aggregate: aggrs must name one or more of {AGGREGATIONS}, got {aggrs!r}")
    A, x = _checked("jinsum.nn.multi_aggregate", A, x)
    return jnp.concatenate([_aggregate_by(A, x, aggr) for aggr in names], axis=-1)


def _checked(where: str, A, x) -> tuple[GroupCOO, jax.Array]:
    """`(A, x)` after their checks: a `GroupCOO` (or a `jinsum.shard` partition of one) and features `(K, F)`,
    integer ones cast to the default float."""
    if not (isinstance(A, GroupCOO) or isinstance(A, Partitioned) and A.format is GroupCOO):
        got = type(A).__name__ if not hasattr(A, "shape") else f"{type(A).__name__} {list(A.shape)}"
        raise TypeError(f"{where}: A must be a jinsum.GroupCOO (jinsum.graphs.adjacency(edge_index, num_nodes)) or "
                        f"its jinsum.shard partition, got {got}")
    x = floating_features(x)
    if x.ndim != 2:
        raise ValueError(f"{where}: expected features x of shape (K, F), got {tuple(x.shape)}")
    return A, x
