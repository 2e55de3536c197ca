"""Neighbourhood aggregations by name, and several at once (PyG's `aggr="..."` and `MultiAggregation`, as in PNA)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jinsum.formats import GroupCOO
from jinsum.nn._graph import aggregate, aggregate_extreme, row_sums

AGGREGATIONS = ("sum", "mean", "max", "min", "var", "std")


def aggregate_by(A: GroupCOO, x: jax.Array, aggr: str) -> jax.Array:
    """The aggregation `aggr` of the rows of `x` over each row's stored entries: `(M, F)` from `x` `(K, F)`.

    `"sum"`: `A @ x`; `"mean"`: that over `rowsum(A)`; `"max"` / `"min"`: a `max=` / `min=` (edge values ignored);
    `"var"`: `mean(x^2) - mean(x)^2`; `"std"`: its square root, clamped below at 1e-5 and 0 at that floor (PyG's,
    whose gradient at 0 is defined). Edge values act as multiplicities in sums and means (duplicate edges count
    twice, as in PyG); rows without entries aggregate 0.
    """
    if aggr not in AGGREGATIONS:
        raise ValueError(f"jinsum.nn: aggregation must be one of {AGGREGATIONS}, got {aggr!r}")
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


def multi_aggregate(A: GroupCOO, x: jax.Array, aggrs: Sequence[str]) -> jax.Array:
    """Several aggregations side by side (`MultiAggregation(mode="cat")`): `(M, len(aggrs) * F)`.

    Example:
      >>> h = jinsum.nn.multi_aggregate(A, x, ["mean", "max", "min", "std"])   # PNA's aggregators
    """
    return jnp.concatenate([aggregate_by(A, x, aggr) for aggr in aggrs], axis=-1)
