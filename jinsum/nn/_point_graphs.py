"""Graphs computed from data inside `jit`: the `k` nearest neighbours of every point (PyG's `knn_graph`).

The result has a static shape, `(N, k)` neighbours, so a step that rebuilds the graph from new positions (DGCNN's
dynamic EdgeConv, kNN in an embedding space) compiles once. The distances are never an `(N, N)` array: rows go in
blocks (`lax.map`), and each row block scans the columns in blocks keeping a running top-k, so memory is
`O(block_size^2 + N k)`. A fixed-fanout table is already a format: `GroupCOO.from_neighbors(knn(...))` needs no
sort.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jinsum.formats._convert import check_int


def knn(pos, k: int, batch=None, loop: bool = False, *, block_size: int = 512) -> jax.Array:
    """The ``k`` nearest neighbours of every point, by Euclidean distance, within its batch element.

    Args:
      pos: float ``(N, D)`` positions (or features).
      k: neighbours per point.
      batch: int ``(N,)``, the batch element of each point (PyG's ``batch``); points only neighbour points of
        the same element, and a negative entry marks a padding point, which has no neighbours and is nobody's.
        None: one element.
      loop: a point may be its own neighbour (at distance 0, so it comes first).
      block_size: rows and columns per distance tile (memory ``block_size^2``).

    Returns:
      int32 ``(N, k)``: row ``i`` the neighbours of point ``i``, nearest first (ties: the lower index), ``-1``
      where its element has fewer than ``k`` other points (and on padding points).
    """
    where = "jinsum.nn.knn"
    k = check_int(where, "k", k, minimum=1)
    block_size = check_int(where, "block_size", block_size, minimum=1)
    pos = jnp.asarray(pos)
    if pos.ndim != 2 or not jnp.issubdtype(pos.dtype, jnp.floating):
        raise ValueError(f"{where}: pos must be a floating array (N, D), got {pos.dtype}{list(pos.shape)}")
    n = pos.shape[0]
    batch = jnp.zeros(n, jnp.int32) if batch is None else jnp.asarray(batch)
    if batch.shape != (n,) or not jnp.issubdtype(batch.dtype, jnp.integer):
        raise ValueError(f"{where}: batch must be an integer array of shape ({n},) (one element id per point), "
                         f"got {batch.dtype}{list(batch.shape)}")
    if n == 0:
        return jnp.zeros((0, k), jnp.int32)
    size = min(block_size, n)
    blocks = -(-n // size)
    padded = blocks * size
    pos = jnp.pad(pos, ((0, padded - n), (0, 0)))
    batch = jnp.pad(batch.astype(jnp.int32), (0, padded - n), constant_values=-1)
    squares = jnp.sum(pos * pos, axis=1)
    tiles = (pos.reshape(blocks, size, -1), batch.reshape(blocks, size), squares.reshape(blocks, size),
             jnp.arange(padded, dtype=jnp.int32).reshape(blocks, size))

    def rows(tile):
        x_i, b_i, s_i, i = tile

        def columns(best, tile):
            x_j, b_j, s_j, j = tile
            # |x_i - x_j|^2 through one product (full precision: TF32 would reorder close neighbours).
            d = s_i[:, None] + s_j[None, :] - 2 * jnp.matmul(x_i, x_j.T, precision=jax.lax.Precision.HIGHEST)
            same = (b_i[:, None] == b_j[None, :]) & (b_i[:, None] >= 0)
            if not loop:
                same &= i[:, None] != j[None, :]
            d = jnp.where(same, jnp.maximum(d, 0), jnp.inf)
            # The running best come first, so among equal distances the lower index (an earlier block) wins.
            distances = jnp.concatenate([best[0], d], axis=1)
            ids = jnp.concatenate([best[1], jnp.broadcast_to(j, d.shape)], axis=1)
            negated, at = jax.lax.top_k(-distances, k)
            return (-negated, jnp.take_along_axis(ids, at, axis=1)), None

        start = (jnp.full((size, k), jnp.inf, pos.dtype), jnp.full((size, k), -1, jnp.int32))
        (distance, ids), _ = jax.lax.scan(columns, start, tiles)
        return jnp.where(jnp.isfinite(distance), ids, -1)

    return jax.lax.map(rows, tiles).reshape(padded, k)[:n]


def knn_graph(pos, k: int, batch=None, loop: bool = False, *, block_size: int = 512) -> jax.Array:
    """PyG's (torch_cluster's) ``knn_graph`` inside `jit`: the int32 ``(2, N k)`` edge index from each point's
    ``k`` nearest neighbours (sources) to the point (target), grouped by target, nearest first; ``-1`` in both
    rows marks padding (a point with fewer than ``k`` neighbours in its element). See :func:`knn` for the
    arguments; ``jinsum.nn.adjacency(edge_index, N, capacity=N * k)`` reads it, or, without a sort,
    ``GroupCOO.from_neighbors(knn(pos, k), num_sources=N)``."""
    neighbors = knn(pos, k, batch, loop, block_size=block_size)
    targets = jnp.broadcast_to(jnp.arange(neighbors.shape[0], dtype=jnp.int32)[:, None], neighbors.shape)
    real = neighbors >= 0
    return jnp.stack([neighbors.reshape(-1), jnp.where(real, targets, -1).reshape(-1)])
