"""Graphs computed from data inside `jit`: the `k` nearest neighbours of every point (PyG's `knn_graph`), and the
points within a radius (torch_cluster's `radius_graph`).

The results have static shapes, `(N, k)` or `(N, max_num_neighbors)` neighbours, so a step that rebuilds the graph
from new positions (DGCNN's dynamic EdgeConv, kNN in an embedding space) compiles once. The distances are never an
`(N, N)` array: rows go in blocks (`lax.map`), and each row block scans the columns in blocks keeping a running
selection (the k nearest, or the first points within the radius), so memory is `O(block_size^2 + N k)`
(`O(block_size^2 D + N k)` below 16 coordinates, where distances are sums of squared differences). A fixed-fanout
table is already a format: `GroupCOO.from_neighbors(knn(...))` needs no sort.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jinsum._lowering import _knn
from jinsum.formats._convert import check_int


def knn(pos, k: int, batch=None, loop: bool = False, *, block_size: int = 512) -> jax.Array:
    """The ``k`` nearest neighbours of every point, by Euclidean distance, within its batch element.

    Args:
      pos: float ``(N, D)`` positions (or features).
      k: neighbours per point.
      batch: int ``(N,)``, the batch element of each point (PyG's ``batch``); points only neighbour points of
        the same element, and a negative entry marks a padding point, which has no neighbours and is nobody's.
        None: one element. Sorted, as PyG makes it (each element's points consecutive; padding points anywhere),
        the CUDA kernel scans only each point's own element; unsorted, it scans every point (same result).
      loop: a point may be its own neighbour (at distance 0, so it comes first).
      block_size: rows and columns per distance tile of the XLA path (memory ``block_size^2``, times ``D`` below 16
        coordinates).

    Returns:
      int32 ``(N, k)``: row ``i`` the neighbours of point ``i``, nearest first (ties: the lower index), ``-1``
      where its element has fewer than ``k`` other points (and on padding points).

    On CUDA, with jax-triton, float32 or half positions and ``k <= 128``, one Triton kernel computes it
    (`jinsum.kernels.knn_kernel`; ``JINSUM_TRITON=0`` turns it off), also under ``vmap``; elsewhere the tiled XLA
    path. Both measure distances in float32 (float64 for float64 positions), so half precision inputs are
    upcast.

    Ties and near-ties. With fewer than 16 coordinates the distances are sums of squared differences: equal
    points are at bit-equal distances from every point, so coincident points, like every exact tie, come in
    index order, on every platform. From 16 coordinates (feature spaces) they are
    ``|x_i|^2 + |x_j|^2 - 2 x_i . x_j``, one matrix product a tile, whose rounding error is a few units in the
    last place of ``|x_i|^2 + |x_j|^2`` and depends on how the product is computed (GPU, CPU, BLAS build):
    neighbours whose distances lie that close, coincident points included, may come in either order, and at the
    ``k``-th place either one may be kept.
    """
    where = "jinsum.graphs.knn"
    k = check_int(where, "k", k, minimum=1)
    block_size = check_int(where, "block_size", block_size, minimum=1)
    pos, batch = _points(where, pos, batch)
    n = pos.shape[0]
    if n == 0:
        return jnp.zeros((0, k), jnp.int32)

    def nearest(best, d, j):
        # The running best come first, so among equal distances the lower index (an earlier block) wins.
        distances = jnp.concatenate([best[0], d], axis=1)
        ids = jnp.concatenate([best[1], jnp.broadcast_to(j, d.shape)], axis=1)
        negated, at = jax.lax.top_k(-distances, k)
        return -negated, jnp.take_along_axis(ids, at, axis=1)

    def tiled(pos, batch):
        pos = pos.astype(jnp.promote_types(pos.dtype, jnp.float32))

        def start(rows):
            return jnp.full((rows, k), jnp.inf, pos.dtype), jnp.full((rows, k), -1, jnp.int32)

        distance, ids = _scan_tiles(pos, batch, loop, block_size, start, nearest)
        return jnp.where(jnp.isfinite(distance), ids, -1)

    batch = batch.astype(jnp.int32)
    if _knn.usable(pos.dtype, n, k):  # the Triton kernel on CUDA, `tiled` elsewhere
        return _knn.knn(pos, batch, k=k, loop=loop, reference=tiled)
    return tiled(pos, batch)


def _points(where: str, pos, batch) -> tuple[jax.Array, jax.Array]:
    """`(pos, batch)` checked: floating positions `(N, D)` and an integer element per point `(N,)` (None: zeros)."""
    pos = jnp.asarray(pos)
    if pos.ndim != 2 or not jnp.issubdtype(pos.dtype, jnp.floating):
        raise ValueError(f"{where}: pos must be a floating array (N, D), got {pos.dtype}{list(pos.shape)}")
    n = pos.shape[0]
    batch = jnp.zeros(n, jnp.int32) if batch is None else jnp.asarray(batch)
    if batch.shape != (n,) or not jnp.issubdtype(batch.dtype, jnp.integer):
        raise ValueError(f"{where}: batch must be an integer array of shape ({n},) (one element id per point), "
                         f"got {batch.dtype}{list(batch.shape)}")
    return pos, batch


def _scan_tiles(pos: jax.Array, batch: jax.Array, loop: bool, block_size: int, start, step):
    """Folds `step(carry, d, j) -> carry` over the column blocks of each block of rows, in index order, and returns
    every row's final carry, `(N, ...)` (`N > 0`).

    `d` `(S, S)` holds the squared distances from a row block's points to a column block's, `inf` for a pair in
    different elements, with a padding point (negative `batch`), or of a point and itself unless `loop`; `j` `(S,)`
    the column block's point ids (past `N` in the last block's padding, whose distances are `inf`). `start(S)` gives
    a row block's first carry, arrays of `S` rows. Memory: a few `(S, S)` tiles, never `(N, N)`.
    """
    n = pos.shape[0]
    size = min(block_size, n)
    blocks = -(-n // size)
    padded = blocks * size
    pos = jnp.pad(pos, ((0, padded - n), (0, 0)))
    batch = jnp.pad(batch.astype(jnp.int32), (0, padded - n), constant_values=-1)
    squares = jnp.sum(pos * pos, axis=1)
    tiles = (pos.reshape(blocks, size, -1), batch.reshape(blocks, size), squares.reshape(blocks, size),
             jnp.arange(padded, dtype=jnp.int32).reshape(blocks, size))
    differences = pos.shape[1] < _knn.DIFFERENCES_BELOW

    def rows(tile):
        x_i, b_i, s_i, i = tile

        def columns(carry, tile):
            x_j, b_j, s_j, j = tile
            if differences:  # (equal points at bit-equal distances: see `knn`)
                d = jnp.sum(jnp.square(x_i[:, None, :] - x_j[None, :, :]), axis=2)
            else:  # one product (full precision: TF32 would reorder close neighbours)
                d = s_i[:, None] + s_j[None, :] - 2 * jnp.matmul(x_i, x_j.T, precision=jax.lax.Precision.HIGHEST)
            same = (b_i[:, None] == b_j[None, :]) & (b_i[:, None] >= 0)
            itself = i[:, None] == j[None, :]
            if loop:  # (a point is at distance 0 from itself: a NaN point too, and without the product's rounding)
                d = jnp.where(itself, 0, d)
            else:
                same &= ~itself
            return step(carry, jnp.where(same, jnp.maximum(d, 0), jnp.inf), j), None

        return jax.lax.scan(columns, start(size), tiles)[0]

    return jax.tree.map(lambda a: a.reshape(padded, *a.shape[2:])[:n], jax.lax.map(rows, tiles))


def knn_graph(pos, k: int, batch=None, loop: bool = False, *, block_size: int = 512) -> jax.Array:
    """PyG's (torch_cluster's) ``knn_graph`` inside `jit`: the int32 ``(2, N k)`` edge index from each point's
    ``k`` nearest neighbours (sources) to the point (target), grouped by target, nearest first; ``-1`` in both
    rows marks padding (a point with fewer than ``k`` neighbours in its element). See :func:`knn` for the
    arguments; ``jinsum.graphs.adjacency(edge_index, N, capacity=N * k)`` reads it, or, without a sort,
    ``GroupCOO.from_neighbors(knn(pos, k), num_sources=N)``."""
    return _edge_index(knn(pos, k, batch, loop, block_size=block_size))


def _edge_index(neighbors: jax.Array) -> jax.Array:
    """A neighbour table `(N, k)` (`-1` padding) as PyG's edge index `(2, N k)`: the neighbours (sources) in row 0,
    their point (the target) in row 1, `-1` in both rows for padding."""
    targets = jnp.broadcast_to(jnp.arange(neighbors.shape[0], dtype=jnp.int32)[:, None], neighbors.shape)
    real = neighbors >= 0
    return jnp.stack([neighbors.reshape(-1), jnp.where(real, targets, -1).reshape(-1)])


def radius(pos, r, batch=None, max_num_neighbors: int = 32, loop: bool = False, *,
           block_size: int = 512) -> tuple[jax.Array, jax.Array]:
    """The points within distance ``r`` of every point, in its batch element: the first ``max_num_neighbors`` of
    them in index order (torch_cluster's ``radius`` on CUDA), and how many there are.

    A point ``j`` is within reach of ``i`` when ``|pos_j - pos_i|^2 < r^2`` (strictly, as torch_cluster), the
    squared distance measured as :func:`knn` measures it: from 16 coordinates as
    ``|pos_i|^2 + |pos_j|^2 - 2 pos_i . pos_j`` (one product a tile), where a pair within rounding of ``r``
    (relative to the squared norms) may go either way, so centre such positions near the origin.

    Args:
      pos: float ``(N, D)`` positions.
      r: the radius, a scalar (a traced one too: shapes do not depend on it).
      batch: int ``(N,)``, the batch element of each point; a negative entry marks a padding point, which has no
        neighbours and is nobody's. None: one element.
      max_num_neighbors: neighbours kept per point (the table's width).
      loop: a point is within reach of itself (``r > 0``).
      block_size: rows and columns per distance tile (memory ``block_size^2``, times ``D`` below 16 coordinates).

    Returns:
      ``(neighbors, count)``: int32 ``(N, max_num_neighbors)``, row ``i`` the lowest indices within reach of point
      ``i``, ascending, ``-1`` padded; and int32 ``(N,)``, the number of points within reach. Where ``count`` exceeds
      ``max_num_neighbors`` the row was cut: check ``jnp.any(count > max_num_neighbors)`` and raise the width, or
      accept the cut.

    Example:
      >>> pos = jnp.array([[0.0, 0.0], [0.1, 0.0], [1.0, 1.0]])
      >>> neighbors, count = jinsum.graphs.radius(pos, 0.2, max_num_neighbors=4)
      >>> print(neighbors, count)
      [[ 1 -1 -1 -1]
       [ 0 -1 -1 -1]
       [-1 -1 -1 -1]] [1 1 0]
      >>> A = jinsum.GroupCOO.from_neighbors(neighbors, num_sources=pos.shape[0])   # A[i, j] = 1 within reach
    """
    where = "jinsum.graphs.radius"
    width = check_int(where, "max_num_neighbors", max_num_neighbors, minimum=1)
    block_size = check_int(where, "block_size", block_size, minimum=1)
    pos, batch = _points(where, pos, batch)
    _check_radius(where, r)
    n = pos.shape[0]
    if n == 0:
        return jnp.zeros((0, width), jnp.int32), jnp.zeros(0, jnp.int32)
    bound = jnp.square(jnp.asarray(r, pos.dtype))
    beyond = jnp.iinfo(jnp.int32).max  # the key of a point out of reach: after every id

    def first_within(carry, d, j):
        first, count = carry
        within = d < bound
        # Keyed by their ids, the smallest keys are the first points found; the running ones precede this block's.
        keys = jnp.concatenate([first, jnp.where(within, j, beyond)], axis=1)
        return -jax.lax.top_k(-keys, width)[0], count + jnp.sum(within, axis=1, dtype=jnp.int32)

    def start(rows):
        return jnp.full((rows, width), beyond, jnp.int32), jnp.zeros(rows, jnp.int32)

    first, count = _scan_tiles(pos, batch, loop, block_size, start, first_within)
    return jnp.where(first != beyond, first, -1), count


def _check_radius(where: str, r) -> None:
    """`r` a real scalar, and `>= 0` where concrete (a NumPy or JAX scalar too: it is squared, so a negative one
    would act as its absolute value)."""
    value = r if isinstance(r, jax.core.Tracer) else np.asarray(r)
    if not (jnp.issubdtype(value.dtype, jnp.integer) or jnp.issubdtype(value.dtype, jnp.floating)):
        raise TypeError(f"{where}: r must be a real number (the radius), got {r!r}")
    if value.ndim != 0:
        raise ValueError(f"{where}: r must be a scalar radius, got shape {value.shape}")
    if not isinstance(value, jax.core.Tracer) and not value >= 0:
        raise ValueError(f"{where}: r must be a radius >= 0, got {value}")


def radius_graph(pos, r, batch=None, loop: bool = False, max_num_neighbors: int = 32, *,
                 block_size: int = 512) -> tuple[jax.Array, jax.Array]:
    """torch_cluster's (PyG's) ``radius_graph`` inside `jit`: ``(edge_index, overflow)``, the int32 ``(2, N M)``
    edge index (``M = max_num_neighbors``) from the points within ``r`` of each point (sources, row 0) to the point
    (target, row 1), grouped by target, ascending sources, ``-1`` in both rows for padding; and a boolean scalar,
    True when some point had more than ``M`` points within reach (its edges are then the ``M`` of lowest index).
    See :func:`radius` for the arguments (``max_num_neighbors`` comes after ``loop`` here, as in torch_cluster);
    ``jinsum.graphs.adjacency(edge_index, N, capacity=N * M)`` reads it, or, without a sort,
    ``GroupCOO.from_neighbors(radius(...)[0], num_sources=N)``."""
    neighbors, count = radius(pos, r, batch, max_num_neighbors, loop, block_size=block_size)
    return _edge_index(neighbors), jnp.any(count > neighbors.shape[1])
