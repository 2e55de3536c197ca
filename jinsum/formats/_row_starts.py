"""Row pointers of sorted rows, on the host (NumPy) or traced (jax.numpy): where each row's entries start in an
array of entries sorted by row, as launchers and work lists read them."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def row_starts(rows, count: int, xp):
    """Entry r: the first group whose (sorted) row is >= r, for r in 0..count. Rows out of range are skipped."""
    return count_below(rows, count + 1, xp)


def count_below(values, n: int, xp):
    """`searchsorted(values, arange(n), side="left")` for sorted integer `values`: how many are below each `i`.

    Traced, it is a histogram and a cumulative sum: `jnp.searchsorted`'s default is a while loop of
    `log2(len(values))` steps, each a few kernels and copies on a GPU, paid in every step that takes the pattern
    as an argument.
    """
    if xp is np:
        return np.searchsorted(values, np.arange(n), side="left").astype(np.int32)
    # Value v counts for every i > v: bin v + 1, the bins summed up to i (bins past n are dropped).
    bins = jnp.zeros(n, jnp.int32).at[jnp.maximum(values.astype(jnp.int32) + 1, 0)].add(1, mode="drop")
    return jnp.cumsum(bins, dtype=jnp.int32)
