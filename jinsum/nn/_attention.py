"""Block-sparse multi-head attention: `jinsum.attention` over a block pattern, BigBird-style patterns, and masks
of packed documents built on the device.

The attention pattern is either a `jinsum.BlockMask` (`block_mask` / `sequence_mask`: the blocks a `mask_mod`
allows, built inside `jit` from data such as document ids; inside partial blocks the `mask_mod` decides, in
registers) or a `jinsum.BlockGroupCOO` of shape `(L, S)` (queries x keys) whose stored `bm x bk` blocks are the
ones computed; inside them, an element attends iff the pattern's value there is nonzero. So `block_pattern` makes
BigBird/Longformer layouts with whole blocks of ones, and causal masking is either a lower-triangular diagonal
block in the pattern or the `causal` rule.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp
from flax import nnx

import jinsum
from jinsum._attention import BlockMask
from jinsum._attention import _block_mask
from jinsum._attention import block_mask as block_mask  # re-exported: jinsum.nn.block_mask
from jinsum.formats import BlockGroupCOO
from jinsum.formats._convert import check_int
from jinsum.nn._dropout import dropout_seed
from jinsum.nn._dtypes import check_dtypes
from jinsum.nn._paged_kv_cache import PagedKVCache
from jinsum.nn._sizes import layer_sizes


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
      >>> pattern = jinsum.nn.block_pattern(1024, 64, local_blocks=1, global_blocks=1, random_blocks=2)
      >>> pattern.nnz                          # stored blocks, out of 16 * 16
    """
    where = "block_pattern"
    seq_len, block = layer_sizes(where, seq_len=seq_len, block=block)
    if seq_len % block:
        raise ValueError(f"{where}: seq_len must be a multiple of block, got seq_len = {seq_len}, block = {block}; "
                         f"pad the sequence to a multiple of the block")
    local_blocks, global_blocks, random_blocks, seed = layer_sizes(
        where, 0, local_blocks=local_blocks, global_blocks=global_blocks, random_blocks=random_blocks, seed=seed)
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


def block_sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, pattern: BlockGroupCOO | BlockMask, *,
                           scale: float | None = None, causal: bool = False, key_padding_mask: jax.Array | None = None,
                           score_mod=None, mask_mod=None, dropout: float = 0.0, seed=None) -> jax.Array:
    """Multi-head attention `softmax(q k^T * scale) v` computed only where `pattern` allows it.

    `jinsum.attention` over a block pattern: on CUDA one generated kernel walks each query block's stored key
    blocks with Tensor Core tiles and an online softmax (FlashAttention's), and the gradient is the
    FlashAttention-2 backward; elsewhere the same chain runs as unfused statements. An element attends iff the
    pattern allows it (a `BlockGroupCOO`'s nonzero values, or a `BlockMask`'s `mask_mod`), `mask_mod` holds and,
    with `causal`, its key position is not after its query position. A query with nothing to attend to gets 0.
    `L` and `S` need not be multiples of the block shape.

    Args:
      q: `(L, H, D)` queries, or `(B, L, H, D)` with a batch axis.
      k: `(S, H_kv, D)` keys (`(B, S, H_kv, D)`); `H_kv` divides `H` (grouped-query attention, read in place).
      v: `(S, H_kv, Dv)` values (`(B, S, H_kv, Dv)`).
      pattern: a `BlockMask` (`block_mask`, built on the device) or a `BlockGroupCOO` of shape `(L, S)` (e.g.
        `block_pattern`), shared by the batch unless the block mask was built per batch element.
      scale: multiplies the scores; defaults to `1 / sqrt(D)`.
      causal: query position `t` attends to key positions `<= t` only.
      key_padding_mask: booleans `(S,)` or `(B, S)`, True for the real keys.
      score_mod: `f(score, b, h, q_idx, kv_idx) -> score` (see `jinsum.attention`): soft caps, positional biases.
      mask_mod: `f(b, h, q_idx, kv_idx) -> bool` inside a `BlockGroupCOO`'s blocks (a `BlockMask` carries its
        own).
      dropout, seed: attention dropout at rate `dropout`, drawn from `seed` (an int or a `jax.random.key`).

    Returns:
      `(L, H, Dv)` (`(B, L, H, Dv)`).

    Example:
      >>> mask = jinsum.nn.block_mask(lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv), 4096, 4096, 128)
      >>> out = jinsum.nn.block_sparse_attention(q, k, v, mask)          # q: (4096, 16, 64), k, v: (4096, 4, 64)
    """
    if not isinstance(pattern, (BlockGroupCOO, BlockMask)):
        raise TypeError(f"block_sparse_attention: expected the pattern as a jinsum.BlockMask or jinsum.BlockGroupCOO, "
                        f"got {type(pattern).__name__}; build one with jinsum.nn.block_mask(mask_mod, L, S, block) "
                        "or jinsum.nn.block_pattern")
    return jinsum.attention(q, k, v, pattern, scale=scale, causal=causal, key_padding_mask=key_padding_mask,
                            score_mod=score_mod, mask_mod=mask_mod, dropout=dropout, seed=seed)


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
      >>> mask = jinsum.nn.sequence_mask(4096, 128, document_ids=doc, causal=True, window=1024)
    """
    where = "jinsum.nn.sequence_mask"
    length, block = layer_sizes(where, length=length, block=block)
    window = None if window is None else check_int(where, "window (or None for no window)", window, minimum=1)
    docs = None if document_ids is None else jnp.asarray(document_ids)
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


class BlockSparseAttention(nnx.Module):
    """Multi-head self-attention over a block-sparse pattern: projections around `block_sparse_attention`.

    `x` is projected to queries (`num_heads` heads of `head_dim`) and keys and values (`num_kv_heads` heads:
    grouped-query attention when fewer), attends through the pattern (one fused kernel on CUDA), and the
    concatenated heads are projected to `out_features`. The pattern is given (a `BlockGroupCOO` from
    `block_pattern`, a `BlockMask`), or built on the device at each call from the module's `causal` and `window`
    and the call's `document_ids` (`sequence_mask`): packed documents never attend to each other, and new
    document boundaries compile nothing.

    Shapes: `x` `(L, in_features)` or `(B, L, in_features)` -> `(L, out_features)` (`(B, L, out_features)`).
    Serving: `generate` runs the same projections over a `PagedKVCache`, for new tokens of many sequences at once.

    Example:
      >>> attn = jinsum.nn.BlockSparseAttention(256, num_heads=8, num_kv_heads=2, causal=True, window=512,
      ...                                       rngs=nnx.Rngs(0))
      >>> y = attn(x, document_ids=doc)                              # x: (8, 4096, 256), doc: (8, 4096)
      >>> pattern = jinsum.nn.block_pattern(512, 64, local_blocks=1, global_blocks=1)   # or a fixed pattern
      >>> y = attn(x[:, :512], pattern)
    """

    def __init__(self, in_features: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, out_features: int | None = None, causal: bool = False,
                 window: int | None = None, block: int = 128, dropout: float = 0.0, use_bias: bool = True,
                 dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        """Creates the parameters.

        Args:
          in_features: the embedding size of the input.
          num_heads: `H`, query heads.
          num_kv_heads: key and value heads, dividing `H` (grouped-query attention; 1: multi-query); defaults
            to `H`.
          head_dim: size of each head's queries, keys and values; defaults to `in_features // num_heads`.
          out_features: size of the output; defaults to `in_features`.
          causal: position `t` attends to positions `<= t` only.
          window: a sliding window: position `t` attends to fewer than `window` positions away (before it, when
            causal); None for none. Used when a call builds its own mask.
          block: block size of the masks a call builds.
          dropout: dropout rate on the attention weights while the module is not in `eval()` mode (draws from
            the `dropout` stream of `rngs`, else its default stream).
          use_bias: the projections have biases.
          dtype: the computation's dtype (the input and the projections' weights are cast to it, as
            `nnx.Linear` casts them; the attention accumulates as its statements do, in float32 for bfloat16);
            None: JAX's promotion of the input and the parameters (`jinsum.nn._dtypes`).
          param_dtype: the parameters' dtype.
          rngs: initialises the projections and seeds the dropout.
        """
        where = "BlockSparseAttention"  # every argument checked here, not at the first call
        check_dtypes(where, dtype, param_dtype)
        in_features, num_heads, block = layer_sizes(where, in_features=in_features, num_heads=num_heads, block=block)
        optional = dict(num_kv_heads=num_kv_heads, head_dim=head_dim, out_features=out_features, window=window)
        num_kv_heads, head_dim, out_features, window = (
            None if value is None else check_int(where, f"{name} (or None)", value, minimum=1)
            for name, value in optional.items())
        if head_dim is None and in_features < num_heads:
            raise ValueError(f"{where}: head_dim must be >= 1, got in_features // num_heads = {in_features} // "
                             f"{num_heads} = 0; pass head_dim explicitly")
        head_dim = in_features // num_heads if head_dim is None else head_dim
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"{where}: num_kv_heads must divide num_heads = {num_heads}, got {num_kv_heads}")
        if isinstance(dropout, (bool, np.bool_)) or not isinstance(dropout, numbers.Real) or not 0 <= dropout < 1:
            raise ValueError(f"{where}: dropout must be in [0, 1), got {dropout!r}")
        self.in_features, self.num_heads = in_features, num_heads
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.causal, self.window, self.block = causal, window, block
        self.qkv = nnx.Linear(in_features, (num_heads + 2 * num_kv_heads) * head_dim, use_bias=use_bias,
                              dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.out = nnx.Linear(num_heads * head_dim, in_features if out_features is None else out_features,
                              use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array, pattern: BlockGroupCOO | BlockMask | None = None, *,
                 key_padding_mask: jax.Array | None = None, document_ids: jax.Array | None = None) -> jax.Array:
        """`x` `(..., L, in_features)`; `pattern` `(L, L)` or None (build one from `causal`, `window` and
        `document_ids`, `(L,)` or `(..., L)` integers); `key_padding_mask` `(..., L)` booleans (True: a real
        position) -> `(..., L, out_features)`."""
        shape, width = np.shape(x), self.in_features
        if len(shape) not in (2, 3) or shape[-1] != width:
            raise ValueError(f"BlockSparseAttention: expected x (L, {width}) or (B, L, {width}) (in_features = "
                             f"{width}), got {shape}")
        length = shape[-2]
        docs = None if document_ids is None else jnp.asarray(document_ids)
        if docs is not None and docs.shape not in ((length,), shape[:-1]):
            expected = " or ".join(dict.fromkeys(map(str, ((length,), shape[:-1]))))
            raise ValueError(f"BlockSparseAttention: document_ids must be {expected} for x of shape {shape}, got "
                             f"{docs.shape}")
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv(x).reshape(*shape[:-1], heads + 2 * kv_heads, self.head_dim)
        q, k, v = jnp.split(qkv, [heads, heads + kv_heads], axis=-2)
        mask_mod = None
        if pattern is None and length:
            pattern = sequence_mask(length, self.block, document_ids=docs, causal=self.causal, window=self.window)
        elif pattern is not None and docs is not None:
            if isinstance(pattern, BlockMask):
                raise ValueError("BlockSparseAttention: a BlockMask carries its own mask; build it with the document "
                                 "ids (jinsum.nn.sequence_mask) instead of passing document_ids too")
            if docs.ndim == 1:
                mask_mod = lambda b, h, q, kv: docs[q] == docs[kv]  # noqa: E731
            else:  # one row of ids per batch element: the chain's `b` is x's batch axis
                mask_mod = lambda b, h, q, kv: docs[b, q] == docs[b, kv]  # noqa: E731
        if pattern is None:  # no positions (L = 0): nothing attends, and there is no mask to build
            out = jnp.zeros_like(q)
        else:
            rate, seed = dropout_seed(self.dropout)
            out = block_sparse_attention(q, k, v, pattern, causal=self.causal and not isinstance(pattern, BlockMask),
                                         key_padding_mask=key_padding_mask, mask_mod=mask_mod, dropout=rate,
                                         seed=seed)
        return self.out(out.reshape(*shape[:-1], heads * self.head_dim))

    def generate(self, x: jax.Array, cache: PagedKVCache, sequence_ids: jax.Array,
                 query_starts: jax.Array | None = None) -> tuple[jax.Array, PagedKVCache]:
        """Serving: the new tokens of several sequences, their keys and values appended to `cache` and their
        queries attending over each sequence's cached tokens (`jinsum.paged_attention`, with the module's
        `causal` and `window`), with the parameters `__call__` trains: a prompt (prefill), a piece of one after a
        cached prefix, or a token per sequence (decoding), in one call.

        Args:
          x: `(T, in_features)` the new tokens of the sequences, packed end to end.
          cache: this layer's `PagedKVCache` (`num_kv_heads` heads of `head_dim`).
          sequence_ids: `(n,)` each sequence's slot in the cache (negative: a padding entry).
          query_starts: `(n + 1,)` offsets of each sequence's tokens in `x`; None: one token each.

        Returns `(y (T, out_features), cache)` with the tokens appended.
        """
        shape, width = np.shape(x), self.in_features
        if len(shape) != 2 or shape[-1] != width:
            raise ValueError(f"BlockSparseAttention.generate: expected x (T, {width}), the new tokens packed end to "
                             f"end (in_features = {width}), got {shape}")
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv(x).reshape(shape[0], heads + 2 * kv_heads, self.head_dim)
        q, k, v = jnp.split(qkv, [heads, heads + kv_heads], axis=-2)
        cache = cache.append(k, v, query_starts, sequence_ids)
        out = cache.attend(q, sequence_ids, query_starts, causal=self.causal, window=self.window)
        return self.out(out.reshape(shape[0], heads * self.head_dim)), cache
