"""The hand-written `@triton.jit` kernel of `jinsum.graphs.knn`: the `k` nearest neighbours of every point.

Launched by `jinsum._lowering._knn` (jax-triton on CUDA, Triton's interpreter in tests), which computes each row
block's column range `[starts[r], ends[r])` from the batch vector first. One program owns `BLOCK_M` points (rows)
and walks the columns of its range `BLOCK_N` at a time, as FlashAttention walks keys:

- **Layout.** Tiles are `(BLOCK_N, BLOCK_M)`, columns by rows, rows the fast axis: Triton's default layout then
  gives each row to one thread (`BLOCK_M = 32 num_warps`) or a few lanes of one warp (`BLOCK_M` 8 or 16 with one
  warp; with `tl.dot`, its layout: a row over 4 lanes), so the per-row minima and maxima of the merge stay within
  a warp: its loop has no shared memory and no barrier (only the column loads of each tile change layout).
- **Distances** in float32 whatever the input's precision, computed as the XLA path computes them: for small `D`
  (`DIRECT`) as a sum of squared differences, one coordinate at a time (no cancellation; equal points at
  bit-equal distances, so their ties go by index on any machine); for wider points `|x|^2 + |y|^2 - 2 x.y`
  through `tl.dot` in full float32 (`input_precision="ieee"`: TF32 would reorder close neighbours), clamped at 0.
  That form's rounding depends on how the product is computed (in the interpreter: NumPy's BLAS, whose kernel
  depends on the CPU), so distances within a few ulps of `|x|^2 + |y|^2` of each other, coincident points
  included, may be ordered either way (`jinsum.graphs.knn` documents it).
- **Keys.** A candidate is one int64, `bits(distance) << 32 | column`: the bits of a non-negative float order as
  the floats do, so the smallest key is the nearest point and, among equal distances, the lowest index (the XLA
  path's tie rule), whatever order the columns come in. Other elements, the point itself (unless `LOOP`), padding
  points and columns past the range get `NONE`, which no slot ever takes.
- **Merge** into a running top-k of `(KP, BLOCK_M)` keys in registers (`KP`: a power of two >= `K`; the first `K`
  slots start as distinct empty keys, the others as -1, never the worst): while some row's smallest tile key
  beats that row's largest kept key, it replaces it (rows with nothing to take keep theirs). A tile that beats
  no row costs one minimum per row, and late in a long scan nearly every tile is such a tile. At the end the
  kept keys leave smallest first (`K` rounds of a row minimum).

Output: int32 `(N, K)`, nearest first, `-1` where a point has fewer than `K` neighbours (keys still empty, or at
an infinite distance).
"""

import triton
import triton.language as tl

# Distances' float32 bits in the high word: +inf's bits, then keys no candidate reaches.
INF_KEY = tl.constexpr(0x7F800000 << 32)
EMPTY_KEY = tl.constexpr((0x7F800000 << 32) | 0x7FFFFF00)  # + slot: above any candidate at +inf (index < 2^31 - 256)
NONE = tl.constexpr(0x7FFFFFFFFFFFFFFF)  # masked candidates: above every empty slot


@triton.jit
def _squared_distances(pos, rows, cols, row_in, col_in, D: tl.constexpr, DIRECT: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """`(BLOCK_N, BLOCK_M)` float32 squared distances between the columns' and the rows' points (`pos` row-major
    `(N, D)`; `rows`, `cols` already in the address width)."""
    if DIRECT:
        d = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for c in tl.static_range(D):
            x = tl.load(pos + rows * D + c, mask=row_in, other=0.0).to(tl.float32)
            y = tl.load(pos + cols * D + c, mask=col_in, other=0.0).to(tl.float32)
            diff = y[:, None] - x[None, :]
            d += diff * diff
    else:
        dot = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        x2 = tl.zeros((BLOCK_M,), tl.float32)
        y2 = tl.zeros((BLOCK_N,), tl.float32)
        for c0 in range(0, D, BLOCK_D):
            dims = c0 + tl.arange(0, BLOCK_D)
            x = tl.load(pos + rows[:, None] * D + dims[None, :], mask=row_in[:, None] & (dims < D)[None, :],
                        other=0.0).to(tl.float32)
            y = tl.load(pos + cols[:, None] * D + dims[None, :], mask=col_in[:, None] & (dims < D)[None, :],
                        other=0.0).to(tl.float32)
            x2 += tl.sum(x * x, axis=1)
            y2 += tl.sum(y * y, axis=1)
            dot += tl.dot(y, tl.trans(x), input_precision="ieee")
        d = (y2[:, None] + x2[None, :]) - 2.0 * dot
    return d


@triton.jit
def knn_kernel(pos, batch, starts, ends, n, out,
               D: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, LOOP: tl.constexpr, DIRECT: tl.constexpr,
               WIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program `r`: rows `[r BLOCK_M, (r + 1) BLOCK_M)` against the columns `[starts[r], ends[r])`.

    `pos` `(n, D)` float, `batch` `(n,)` int32 (negative: a padding point), `out` `(n, K)` int32. `WIDE`: element
    offsets in int64 (`n * max(D, K)` past int32)."""
    r = tl.program_id(0)
    rows = r * BLOCK_M + tl.arange(0, BLOCK_M)
    row_in = rows < n
    rows_at = rows.to(tl.int64) if WIDE else rows
    b_row = tl.load(batch + rows, mask=row_in, other=-1)
    start = tl.load(starts + r)
    end = tl.load(ends + r)
    slots = tl.arange(0, KP)

    kept = tl.where(slots < K, EMPTY_KEY + slots.to(tl.int64), -1)
    kept = tl.broadcast_to(kept[:, None], (KP, BLOCK_M))
    # Per-row values stay (1, BLOCK_M), in the tiles' layout (1-D ones would change layout in the loop).
    worst = tl.max(kept, axis=0, keep_dims=True)

    for c0 in range(start, end, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        col_in = cols < end
        cols_at = cols.to(tl.int64) if WIDE else cols
        b_col = tl.load(batch + cols, mask=col_in, other=-2)
        d = _squared_distances(pos, rows_at, cols_at, row_in, col_in, D, DIRECT, BLOCK_M, BLOCK_N, BLOCK_D)
        # Negative (cancellation in the expanded form) and -0.0 read as +0.0; bits of floats >= 0 order as floats.
        bits = tl.maximum(d.to(tl.int32, bitcast=True), 0)
        ok = (b_col[:, None] == b_row[None, :]) & (b_row >= 0)[None, :]
        if not LOOP:
            ok &= cols[:, None] != rows[None, :]
        keys = tl.where(ok, (bits.to(tl.int64) << 32) | cols.to(tl.int64)[:, None], NONE)
        best = tl.min(keys, axis=0, keep_dims=True)
        while tl.max((best < worst).to(tl.int32)) > 0:
            kept = tl.where((kept == worst) & (best < worst), best, kept)
            keys = tl.where(keys == best, NONE, keys)
            worst = tl.max(kept, axis=0, keep_dims=True)
            best = tl.min(keys, axis=0, keep_dims=True)

    kept = tl.where(slots[:, None] < K, kept, NONE)
    for s in range(K):
        nearest = tl.min(kept, axis=0, keep_dims=True)
        kept = tl.where(kept == nearest, NONE, kept)
        found = nearest < INF_KEY
        tl.store(out + rows_at[None, :] * K + s, tl.where(found, nearest.to(tl.int32), -1), mask=row_in[None, :])
