"""Attention patterns that are not a `mask_mod`: BigBird/Longformer block layouts built on the host
(`block_pattern`, a `BlockGroupCOO` of whole blocks) and the block masks of packed documents and windows built on
the device from per-block summaries (`sequence_mask`, a `BlockMask` like `block_mask`'s, classified with no pass over
the elements).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp

from jinsum._attention import _block_mask
from jinsum._attention._block_mask import BlockMask
from jinsum.formats import BlockGroupCOO
from jinsum.formats._convert import as_jax_array, check_int


def block_pattern(seq_len: int, block: int, *, local_blocks: int = 1, global_blocks: int = 0,
                  random_blocks: int = 0, seed: int = 0, causal: bool = False) -> BlockGroupCOO:
    """A BigBird/Longformer-style `(seq_len, seq_len)` attention pattern of `block x block` blocks (host side).

    Block `(i, j)` (query block row `i`, key block column `j`) is stored when

    - `|i - j| <= local_blocks` (a band: the diagonal block and `local_blocks` neighbours on each side), or
    - `i < global_blocks` or `j < global_blocks` (global block rows attend everywhere, and are attended by all),
    - or it is one of `random_blocks` blocks drawn per block row among those not stored yet (seeded by `seed`).

    With `causal`, blocks above the diagonal are dropped (also before the random draw) and the diagonal
    blocks are lower triangular, so position `t` attends to positions `<= t` only. Stored values are 1 where
    attention is allowed and 0 elsewhere; each group holds one block (`group_size` 1).

    Args:
      seq_len: `L`, a multiple of `block`.
      block: the block size (square blocks).
      local_blocks, global_blocks, random_blocks: as above; non-negative.
      seed: seeds the random blocks.
      causal: mask out attention to later positions.

    Returns:
      A float32 `BlockGroupCOO` of shape `(L, L)` and block shape `(block, block)`.

    Example:
      >>> pattern = jinsum.block_pattern(1024, 64, local_blocks=1, global_blocks=1, random_blocks=2)
      >>> pattern.nnz                          # stored blocks, out of 16 * 16
      104
    """
    where = "jinsum.block_pattern"
    seq_len, block = check_int(where, "seq_len", seq_len, minimum=1), check_int(where, "block", block, minimum=1)
    if seq_len % block:
        raise ValueError(f"{where}: seq_len must be a multiple of block, got seq_len = {seq_len}, block = {block}; "
                         f"pad the sequence to a multiple of the block")
    local_blocks, global_blocks = check_int(where, "local_blocks", local_blocks), check_int(where, "global_blocks",
                                                                                             global_blocks)
    random_blocks, seed = check_int(where, "random_blocks", random_blocks), check_int(where, "seed", seed)
    n = seq_len // block
    i, j = np.indices((n, n))
    allowed = j <= i if causal else np.ones((n, n), bool)
    stored = ((np.abs(i - j) <= local_blocks) | (i < global_blocks) | (j < global_blocks)) & allowed
    rng = np.random.default_rng(seed)
    for row in range(n):
        candidates = np.flatnonzero(allowed[row] & ~stored[row])
        stored[row, rng.choice(candidates, min(random_blocks, len(candidates)), replace=False)] = True
    rows, cols = np.nonzero(stored)  # row-major: block rows in order, block columns increasing
    blocks = np.ones((len(rows), block, block), np.float32)
    if causal:
        blocks[rows == cols] = np.tril(np.ones((block, block), np.float32))
    indptr = np.concatenate([[0], np.cumsum(stored.sum(axis=1))])
    bsr = sp.bsr_matrix((blocks, cols, indptr), shape=(seq_len, seq_len), blocksize=(block, block))
    return BlockGroupCOO.from_scipy(bsr, block_shape=(block, block), group_size=1)


def sequence_mask(length: int, block: int, *, document_ids: jax.Array | None = None, causal: bool = False,
                  window: int | None = None) -> BlockMask:
    """The block mask of packed documents, built on the device: position `q` attends to `kv` in the same document
    (`document_ids`, `(L,)` or `(B, L)`: one mask per batch element), with `causal`, not after it, and with
    `window`, fewer than `window` positions before it (and after it, unless causal). The capacity is what the
    causal rule and the window allow, so the kernels launch no more programs than that.

    The blocks are classified from per-block summaries (each block's smallest and largest document id, the rules
    on the blocks' first and last positions), with no pass over the elements: exactly `jinsum.block_mask`'s
    classification for non-decreasing ids (packed documents); for others a pair of blocks whose id ranges overlap
    may be kept as partial where nothing attends (the kernels' `mask_mod` masks it), within the same capacity.

    Example:
      >>> doc = jnp.repeat(jnp.arange(4), 1024)                 # four packed documents of 1,024 positions
      >>> mask = jinsum.sequence_mask(4096, 128, document_ids=doc, causal=True, window=1024)
      >>> mask.shape, mask.block
      ((4096, 4096), (128, 128))
    """
    where = "jinsum.sequence_mask"
    length, block = check_int(where, "length", length, minimum=1), check_int(where, "block", block, minimum=1)
    window = None if window is None else check_int(where, "window (or None for no window)", window, minimum=1)
    docs = None if document_ids is None else as_jax_array(document_ids)
    if docs is not None and (docs.ndim not in (1, 2) or docs.shape[-1] != length
                             or not jnp.issubdtype(docs.dtype, jnp.integer)):
        raise ValueError(f"{where}: document_ids must be integers of shape ({length},) or (B, {length}), got "
                         f"{docs.dtype}{list(docs.shape)}")
    per_batch = docs is not None and docs.ndim == 2

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = q_idx >= 0
        if docs is not None:
            allowed &= (docs[b, q_idx] == docs[b, kv_idx]) if per_batch else (docs[q_idx] == docs[kv_idx])
        if causal:
            allowed &= q_idx >= kv_idx
        if window is not None:
            allowed &= (q_idx - kv_idx < window) & ((kv_idx - q_idx < window) if not causal else True)
        return allowed
    blocks = -(-length // block)
    if window is not None:
        per_row = min(blocks, window // block + 2) if causal else min(blocks, 2 * (window // block) + 3)
        capacity = blocks * per_row
    else:
        capacity = blocks * (blocks + 1) // 2 if causal else blocks * blocks
    batch = docs.shape[0] if per_batch else None
    classify = lambda grid: _sequence_flags(length, block, docs, causal, window)  # noqa: E731
    return _block_mask.build(mask_mod, length, length, block, batch=batch, capacity=capacity * (batch or 1),
                             classify=classify, where=where)


# One compiled program (eagerly, each of its operations compiled alone: several times slower for a new shape).
@functools.partial(jax.jit, static_argnums=(0, 1, 3, 4))
def _sequence_flags(length: int, block: int, docs: jax.Array | None, causal: bool, window: int | None) -> jax.Array:
    """`sequence_mask`'s block flags `(B * n, n)` (2 full, 1 partial, 0 empty; `n = ceil(length / block)`) from
    per-block summaries, `O(n^2)` work and no pass over the elements.

    The position rules bound `d = q - kv` to `[low, high]` (causal: `d >= 0`; window: `d < window`, and
    `d > -window` unless causal); the pairs of query block `i` and key block `j` (real positions only) cover every
    `d` in `[first q - last kv, last q - first kv]`, so their tests are exact. Documents: a pair of blocks is full
    iff both hold one and the same id, and may attend iff their `[min, max]` id intervals overlap. For ids that
    never decrease this is exact too (a document in both blocks covers every position between them, so the pair
    closest in position is in it); otherwise it may call partial a pair of blocks that attends nowhere (the
    kernels' `mask_mod` masks it), never more than the position rules allow, so never past `sequence_mask`'s
    capacity. A block that overhangs `length` is never full: the kernels evaluate nothing in a full block."""
    n = -(-length // block)
    first = jnp.arange(n, dtype=jnp.int32) * block
    last = jnp.minimum(first + block, length) - 1  # the last real position of each block
    lo, hi = first[:, None] - last[None, :], last[:, None] - first[None, :]  # d over a (query, key) block pair
    whole = first + block <= length
    full, some = whole[:, None] & whole[None, :], jnp.ones((n, n), bool)
    low = 0 if causal else None if window is None else 1 - window
    high = None if window is None else window - 1
    if low is not None:
        full, some = full & (lo >= low), some & (hi >= low)
    if high is not None:
        full, some = full & (hi <= high), some & (lo <= high)
    if docs is not None:
        ids = docs.reshape(-1, length)  # (B, length)
        ids = jnp.pad(ids, ((0, 0), (0, n * block - length)), mode="edge").reshape(len(ids), n, block)
        low_id, high_id = ids.min(-1), ids.max(-1)  # (B, n): the overhang repeats the last id, changing neither
        single = low_id == high_id
        full = full & single[:, :, None] & single[:, None, :] & (low_id[:, :, None] == low_id[:, None, :])
        some = some & (low_id[:, :, None] <= high_id[:, None, :]) & (low_id[:, None, :] <= high_id[:, :, None])
    flags = jnp.where(full, 2, jnp.where(some, 1, 0)).astype(jnp.int8)
    return flags.reshape(-1, n)  # (B * n, n): batch element b's block rows are b * n + i
