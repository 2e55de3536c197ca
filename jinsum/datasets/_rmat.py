"""R-MAT random graphs (Chakrabarti, Zhan & Faloutsos, SDM 2004), the skewed graphs of sparse benchmarks."""

from __future__ import annotations

import numpy as np

from jinsum.formats._convert import check_int

_CHUNK = 1 << 16


def rmat(
    scale: int, edge_factor: int = 16, *, a: float = 0.57, b: float = 0.19, c: float = 0.19, seed: int = 0,
    undirected: bool = False,
) -> np.ndarray:
    """The directed edges of an R-MAT graph with ``2**scale`` nodes.

    The recipe: draw ``edge_factor * 2**scale`` edges independently. Each edge picks its ``(source,
    destination)`` cell of the ``2**scale x 2**scale`` adjacency matrix one bit level at a time, from the
    most significant: at every level it falls into the top-left quadrant with probability ``a``, top-right
    ``b``, bottom-left ``c`` and bottom-right ``d = 1 - a - b - c``; "bottom" sets the source bit and "right"
    the destination bit. Duplicate draws are then merged (so there are fewer than ``edge_factor * 2**scale``
    edges); self loops are kept; node labels are not permuted (node 0 is the largest hub), and there is no
    per-level noise. The defaults are the Graph500 parameters: scale 17 gives about 1.94M edges, scale 20
    about 16.1M.

    Vectorised over edges (loops run over the ``scale`` levels and over chunks of draws, never single edges), so
    the benchmark graphs are quick to draw (DESIGN.md, "Host-side builders are vectorised").

    Args:
      scale: ``log2`` of the number of nodes, ``0 <= scale <= 62``.
      edge_factor: draws per node (positive).
      a, b, c: quadrant probabilities (non-negative, ``a + b + c <= 1``).
      seed: seed of the ``numpy.random.default_rng`` generator; equal seeds give equal graphs.
      undirected: the graph made undirected, as GNN benchmarks use it: self loops dropped, every edge in both
        directions, once (scale 17: about 3.7M edges).

    Returns:
      int ``(2, E)`` edges sorted by (source, destination), without duplicates; row 0 holds sources and row 1
      destinations. int32 when the node ids fit (``scale <= 31``), else int64.
    """
    scale = check_int("rmat", "scale", scale, 0)
    edge_factor = check_int("rmat", "edge_factor", edge_factor, 1)
    if scale > 62:
        raise ValueError(f"rmat: scale must be at most 62 so that (source, destination) fits an int64 key, got {scale}")
    if min(a, b, c) < 0 or a + b + c > 1:
        raise ValueError(
            f"rmat: a, b, c must be non-negative probabilities with a + b + c <= 1 (d = 1 - a - b - c), got "
            f"a={a}, b={b}, c={c}"
        )
    rng = np.random.default_rng(seed)
    num_draws = edge_factor << scale
    key = np.empty(num_draws, np.int64)
    # Chunks of draws keep the per-level temporaries in cache: about 3x faster than whole-array passes.
    for start in range(0, num_draws, _CHUNK):
        size = min(_CHUNK, num_draws - start)
        src = np.zeros(size, np.int64)
        dst = np.zeros(size, np.int64)
        for _ in range(scale):
            u = rng.random(size)
            # Quadrants in order a | b | c | d along [0, 1): the bottom ones (c, d) set the source bit, the right
            # ones (b, d) the destination bit.
            down = u >= a + b
            right = (u >= a) & ~down | (u >= a + b + c)
            src <<= 1
            src |= down
            dst <<= 1
            dst |= right
        key[start : start + size] = (src << scale) | dst
    # Sorting the combined key orders by (source, destination) and brings duplicates together. np.sort plus a
    # mask rather than np.unique, which is two orders of magnitude slower on the 1.7e7 keys of scale 20.
    if undirected:
        src, dst = key >> scale, key & ((1 << scale) - 1)
        loops = src == dst
        key = np.concatenate([key[~loops], (dst[~loops] << scale) | src[~loops]])
    key.sort()
    key = key[np.concatenate([[True], key[1:] != key[:-1]])]
    dtype = np.int32 if scale <= 31 else np.int64
    return np.stack([key >> scale, key & ((1 << scale) - 1)]).astype(dtype)
