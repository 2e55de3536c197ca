"""`jinsum.paged_attention`: attention of new query tokens over a paged key/value cache (serving a model).

A paged cache stores each sequence's keys and values in fixed-size pages scattered through one pool:
key `j` of sequence `b` is `k_pages[page_table[b, j // page_size], j % page_size]`. The query tokens of a batch
of sequences come packed end to end (`query_starts`), so one call serves decoding (a token per sequence),
prefill (a whole prompt) and chunked prefill (a piece of a prompt after a cached prefix) alike; every length is
traced, so one compile serves every batch of the same shapes.

This module checks the arguments (before tracing where it can) and writes the call as the attention chain
(`jinsum.attention`) over a block mask whose key blocks are the pages of the pool: the page table is the mask's
column index, so the chain's kernels (and, off CUDA, its unfused statements) read the pages in place. Pages past a
sequence's length, and under `causal` and `window` those none of a query block's tokens can see, are not read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jinsum import _config
from jinsum._attention import _block_mask
from jinsum._attention._api import attention, scale_value
from jinsum.formats._convert import as_jax_array, is_concrete
from jinsum.formats._row_starts import count_below

WHERE = "jinsum.paged_attention"


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                    kv_lengths: jax.Array, *, query_starts: jax.Array | None = None, causal: bool = True,
                    scale: float | None = None, window: int | None = None,
                    score_mod: Callable | None = None) -> jax.Array:
    """Softmax attention of packed query tokens over a paged key/value cache.

    Sequence `b`'s new tokens are `q[query_starts[b]:query_starts[b + 1]]`; they are the last `q_len[b]` of its
    `kv_lengths[b]` cached tokens (their keys and values already written, e.g. by `jinsum.nn.PagedKVCache.append`),
    so its `i`-th new token sits at position `kv_lengths[b] - q_len[b] + i`. Query head `h` reads key/value head
    `h // (Hq / Hkv)` (grouped-query and multi-query attention), never repeated.

    Args:
      q: `(T, Hq, D)` new query tokens of `B` sequences, packed end to end. Tokens past `query_starts[B]` are
        padding: their rows of the result are zeros.
      k_pages: `(P, page_size, Hkv, D)` the key pages of the cache; `Hkv` divides `Hq`.
      v_pages: `(P, page_size, Hkv, E)` the value pages.
      page_table: `(B, max_pages)` integers, the physical page of each logical page of each sequence. Only the
        entries of pages a sequence's tokens can see are read; the rest (free slots, -1) may hold anything.
      kv_lengths: `(B,)` integers, the tokens in the cache of each sequence, the new ones included, at most
        `max_pages * page_size`; 0 marks an empty entry (a padding row of a decoding batch), whose tokens get
        zeros.
      query_starts: `(B + 1,)` non-decreasing integer offsets into `T`; None: one query token per sequence
        (decoding, `T == B`).
      causal: a new token attends to the keys at or before its position. False: to all `kv_lengths[b]` keys.
      scale: multiplies `q . k`: a finite Python or NumPy number; defaults to `1 / sqrt(D)`.
      window: a sliding window: a token at position `i` attends to keys `j` with `i - j < window` (with `causal`,
        the last `window` positions, its own included). None: no window.
      score_mod: `f(score, b, h, q_idx, kv_idx) -> score` on scalars (FlexAttention's), with `b` the sequence,
        `h` the query head and `q_idx`, `kv_idx` positions in the sequence; arrays it reads with them are JAX
        arrays (`jnp.asarray(slopes)[h]`).

    Returns:
      `(T, Hq, E)` in the dtype of `q`; a sequence with no keys (`kv_lengths == 0`) gets zeros. Differentiable in
      `q`, `k_pages` and `v_pages`, and batched by `jax.vmap`, as `jinsum.attention` (which runs it) is.

    Errors: shapes and dtypes are checked before tracing. Outside `jit`, a page index outside `[0, P)` in an
    entry that is read, a length past the table's capacity, fewer cached tokens than new ones or decreasing
    `query_starts` raise `ValueError`, naming the sequence and the value. Under `jit` the same conditions are
    `checkify` checks where `jinsum.check_indices` is on; without it, keys of a page index out of range count
    as masked out (never read out of bounds) and lengths are clipped to the table's capacity.

    Example:
      >>> cache = jinsum.nn.PagedKVCache.create(8, 16, 2, 32, max_sequences=4, max_pages_per_sequence=2,
      ...                                       dtype=jnp.float32)      # pages of 16 tokens, 2 heads of 32
      >>> @jax.jit
      ... def decode(cache, q, k, v, ids):                           # a new token for each sequence of `ids`
      ...     cache = cache.append(k, v, None, ids)
      ...     return cache, jinsum.paged_attention(q, cache.k_pages, cache.v_pages, cache.page_table[ids],
      ...                                          cache.lengths[ids])
      >>> ids, kv = jnp.array([0, 2]), jnp.ones((2, 2, 32))          # sequences 0 and 2
      >>> q = jnp.ones((2, 4, 32))                                   # (T, Hq, D): 4 query heads over 2
      >>> cache, out = decode(cache, q, kv, kv, ids)
      >>> out.shape, cache.lengths
      ((2, 4, 32), Array([1, 0, 1, 0], dtype=int32))
    """
    q, k_pages, v_pages = (as_jax_array(x) for x in (q, k_pages, v_pages))
    page_table, kv_lengths = as_jax_array(page_table), as_jax_array(kv_lengths)
    _check_shapes(q, k_pages, v_pages, page_table, kv_lengths, query_starts, window, score_mod)
    scale = scale_value(scale, q.shape[-1], WHERE)
    batch = page_table.shape[0]
    starts = (as_jax_array(np.arange(batch + 1, dtype=np.int32)) if query_starts is None
              else as_jax_array(query_starts).astype(jnp.int32))
    page_table, kv_lengths = page_table.astype(jnp.int32), kv_lengths.astype(jnp.int32)
    _check_values(page_table, kv_lengths, starts, k_pages.shape[0], k_pages.shape[1])
    return _attend(q, k_pages, v_pages, page_table, kv_lengths, starts, causal=bool(causal), scale=scale,
                   window=window, score_mod=score_mod)


# --- the arguments -----------------------------------------------------------------------------------------------

def _check_shapes(q, k_pages, v_pages, page_table, kv_lengths, query_starts, window, score_mod) -> None:
    """Shapes, dtypes and static options, each error naming the operand and what it got."""
    def shape(x):
        return f"{x.dtype}{list(x.shape)}"

    if q.ndim != 3:
        raise ValueError(f"{WHERE}: q must be (T, Hq, D), the new tokens packed end to end; got {shape(q)}")
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        if x.ndim != 4:
            raise ValueError(f"{WHERE}: {name} must be (P, page_size, Hkv, D), pages of the cache; got {shape(x)}")
    for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{WHERE}: {name} must be floating, got {shape(x)}")
    if k_pages.shape[:3] != v_pages.shape[:3]:
        raise ValueError(f"{WHERE}: k_pages {shape(k_pages)} and v_pages {shape(v_pages)} must have the same "
                         "pages, page size and heads (P, page_size, Hkv)")
    if k_pages.shape[3] != q.shape[2]:
        raise ValueError(f"{WHERE}: the head size D of q {shape(q)} and k_pages {shape(k_pages)} must agree")
    hq, hkv = q.shape[1], k_pages.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{WHERE}: the kv heads Hkv = {hkv} of k_pages must divide the query heads Hq = {hq} of q "
                         "(grouped-query attention)")
    if q.shape[2] == 0:
        raise ValueError(f"{WHERE}: the head size D must be at least 1, got q {shape(q)}")
    for name, x, ndim in (("page_table", page_table, 2), ("kv_lengths", kv_lengths, 1)):
        if x.ndim != ndim or not jnp.issubdtype(x.dtype, jnp.integer):
            wanted = "(B, max_pages)" if ndim == 2 else "(B,)"
            raise TypeError(f"{WHERE}: {name} must be integers {wanted}, got {shape(x)}")
    batch = page_table.shape[0]
    if kv_lengths.shape != (batch,):
        raise ValueError(f"{WHERE}: kv_lengths {shape(kv_lengths)} must have one length per row of page_table "
                         f"{shape(page_table)}")
    if query_starts is None:
        if q.shape[0] != batch:
            raise ValueError(f"{WHERE}: without query_starts, q holds one token per sequence (decoding), so its T = "
                             f"{q.shape[0]} must equal B = {batch} (the rows of page_table); pass query_starts "
                             "(B + 1,) for several tokens per sequence")
    else:
        starts = as_jax_array(query_starts)
        if starts.shape != (batch + 1,) or not jnp.issubdtype(starts.dtype, jnp.integer):
            raise ValueError(f"{WHERE}: query_starts must be integers (B + 1,) = ({batch + 1},), offsets of each "
                             f"sequence's tokens in q; got {shape(starts)}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1):
        raise ValueError(f"{WHERE}: window must be a positive int (positions a token sees, its own included), or "
                         f"None; got {window!r}")
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"{WHERE}: score_mod must be a function f(score, b, h, q_idx, kv_idx), got {score_mod!r}")


def _check_values(page_table, kv_lengths, starts, num_pages: int, page_size: int) -> None:
    """The index arrays against what they address: an error naming the sequence and entry where they are concrete,
    `checkify` checks under `jinsum.check_indices` where they are traced."""
    capacity = page_table.shape[1] * page_size
    logical = np.arange(page_table.shape[1], dtype=np.int32)
    if all(is_concrete(x) for x in (page_table, kv_lengths, starts)):
        table, lengths, first = (np.asarray(x) for x in (page_table, kv_lengths, starts))
        counts = first[1:] - first[:-1]
        if first[0] < 0 or (counts < 0).any():
            raise ValueError(f"{WHERE}: query_starts must be non-decreasing offsets from 0 or more; got "
                             f"{first.tolist()}")
        for b in np.flatnonzero((lengths < 0) | (lengths > capacity))[:1]:
            raise ValueError(f"{WHERE}: kv_lengths[{b}] = {lengths[b]} is outside [0, {capacity}], the tokens "
                             f"{page_table.shape[1]} pages of {page_size} hold")
        for b in np.flatnonzero((counts > lengths) & (lengths > 0))[:1]:
            raise ValueError(f"{WHERE}: sequence {b} has {counts[b]} new tokens but kv_lengths[{b}] = "
                             f"{lengths[b]}: the cache must hold the new tokens too (append them first)")
        read = logical * page_size < lengths[:, None]
        for b, p in np.argwhere(read & ((table < 0) | (table >= num_pages)))[:1]:
            raise ValueError(f"{WHERE}: page_table[{b}, {p}] = {table[b, p]} is outside [0, {num_pages}) (the pages "
                             f"of k_pages), and sequence {b}'s {lengths[b]} tokens read it")
        at = np.asarray(logical_pages(page_table, read, num_pages))
        for b, p in np.argwhere(read & (at[np.clip(table, 0, num_pages - 1)] != logical))[:1]:
            other, at_other = np.argwhere(read & (table == table[b, p]) & (logical == at[table[b, p]]))[0]
            raise ValueError(f"{WHERE}: page {table[b, p]} is logical page {p} of sequence {b} and logical page "
                             f"{at_other} of sequence {other}; a page several sequences read (a shared prefix) "
                             "must sit at the same logical index in each")
    elif _config.check_indices.value:
        q_len, logical = starts[1:] - starts[:-1], jnp.asarray(logical)
        read = logical * page_size < kv_lengths[:, None]
        checkify.check(jnp.all((kv_lengths >= 0) & (kv_lengths <= capacity)),
                       f"{WHERE}: kv_lengths holds a length outside [0, {capacity}], the tokens the table's pages hold")
        checkify.check(jnp.all(q_len >= 0) & (starts[0] >= 0), f"{WHERE}: query_starts must be non-decreasing "
                       "offsets from 0 or more")
        checkify.check(jnp.all((q_len <= kv_lengths) | (kv_lengths == 0)), f"{WHERE}: a sequence has more new "
                       "tokens than kv_lengths: the cache must hold the new tokens too")
        checkify.check(jnp.all(~read | ((page_table >= 0) & (page_table < num_pages))),
                       f"{WHERE}: page_table holds a page outside [0, {num_pages}) in an entry that is read")
        at = logical_pages(page_table, read, num_pages)
        checkify.check(jnp.all(~read | (at[jnp.clip(page_table, 0, num_pages - 1)] == logical)),
                       f"{WHERE}: a page several sequences read sits at different logical indices (a shared "
                       "prefix must sit at the same logical index in each)")


@functools.partial(jax.jit, static_argnums=2)  # (one compiled program outside `jit`)
def logical_pages(page_table, read, num_pages: int) -> jax.Array:
    """Each physical page's logical index in the entries of `page_table` that `read` marks (the largest where
    several name it: the order of a scatter's writes is not fixed on GPUs), -1 for pages none reads."""
    return jnp.full(num_pages, -1, jnp.int32).at[jnp.where(read, page_table, num_pages)].max(
        jnp.broadcast_to(jnp.arange(page_table.shape[1], dtype=jnp.int32), page_table.shape), mode="drop")


def token_sequences(starts, tokens: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each of `tokens` packed tokens' sequence (`starts`: `(n + 1,)` offsets), its index in that sequence, and
    whether it is a sequence's at all (tokens past the last sequence are padding); the sequence clipped into range."""
    count = starts.shape[0] - 1
    t = jnp.arange(tokens, dtype=jnp.int32)
    sequence = _after(starts[1:], tokens)
    real = (t >= starts[0]) & (sequence < count)
    sequence = jnp.minimum(sequence, count - 1)
    return sequence, t - starts[sequence], real


def _after(bounds, n: int) -> jax.Array:
    """For each `i < n`, how many of the sorted `bounds` are at or below it (`searchsorted(bounds, i, "right")`) as
    a histogram and a sum: `jnp.searchsorted`'s default is a loop that waits on the host at every step."""
    return count_below(bounds.astype(jnp.int32), n + 1, jnp)[1:]


# --- the computation: the attention chain over the pages -------------------------------------------------------

def _attend(q, k_pages, v_pages, page_table, kv_lengths, starts, *, causal, scale, window, score_mod):
    """`jinsum.attention` over the pages (`laid_out`), its rows taken back to the tokens' heads."""
    queries, keys, values, mask, modify, back = laid_out(q, k_pages, v_pages, page_table, kv_lengths, starts,
                                                         causal=causal, window=window, score_mod=score_mod)
    return back(attention(queries, keys, values, mask, scale=scale, score_mod=modify))


def laid_out(q, k_pages, v_pages, page_table, kv_lengths, starts, *, causal, window, score_mod):
    """The paged call as the attention chain takes it: `(queries, keys, values, mask, score_mod, back)`, where
    `back` takes the chain's output rows to `(T, Hq, E)`. A block mask whose key blocks are pages.

    The keys are the pool itself, `(P * page_size, Hkv, D)` (a reshape: nothing is copied), so a key block is a
    page and a query block's slots are its sequence's pages, `Ak = page_table[sequence]`. The queries are laid out
    with the query heads of a kv head's group along the rows: row `(token, r)` of sequence `b` holds query head
    `h * group + r` of kv head `h`, so each page is read once per kv head for all the heads that share it, and
    each sequence's rows start a block of their own. A slot is full where every token of its query block sees the
    whole page, partial (masked in registers from the keys' positions) where some token sees some of it, empty
    (never read) elsewhere, past the sequence's length included."""
    tokens, heads, _ = q.shape
    num_pages, page_size, kv_heads, dim = k_pages.shape
    group = heads // kv_heads
    rows = _rows(q, page_table, kv_lengths, starts, page_size=page_size, num_pages=num_pages, kv_heads=kv_heads,
                 causal=causal, window=window)

    def key_position(kv_idx):
        return rows.logical[kv_idx // page_size] * page_size + kv_idx % page_size

    def mask_mod(b, h, q_idx, kv_idx):
        kv = key_position(kv_idx)
        seen = kv < rows.length[q_idx]
        if causal:
            seen &= kv <= rows.position[q_idx]
        if window is not None:
            seen &= rows.position[q_idx] - kv < window
        return seen

    def modify(score, b, h, q_idx, kv_idx):  # (the user's score_mod, in positions of the sequence)
        return score_mod(score, rows.sequence[q_idx], h * group + rows.head[q_idx], rows.position[q_idx],
                         key_position(kv_idx))

    bm = _query_block(tokens, group, page_table.shape[0])
    mask = _block_mask.from_blocks(mask_mod, rows.block_rows, rows.block_pages, rows.block_flags,
                                   (rows.queries.shape[0], num_pages * page_size), (bm, page_size), where=WHERE)

    return (rows.queries, k_pages.reshape(num_pages * page_size, kv_heads, dim),
            v_pages.reshape(num_pages * page_size, kv_heads, -1), mask, None if score_mod is None else modify,
            functools.partial(_back, token_rows=rows.token_rows, real_token=rows.real_token))


# One compiled program (outside `jit`, each of its operations would compile on its own).
@jax.jit
def _back(out, token_rows, real_token) -> jax.Array:
    """`laid_out`'s `back`: the chain's output rows `(rows, Hkv, E)` -> `(T, Hkv, group, E)` -> `(T, Hq, E)`, zeros
    for padding tokens."""
    tokens, group = token_rows.shape
    out = out[token_rows[:, None, :], jnp.arange(out.shape[1])[None, :, None]]
    return jnp.where(real_token[:, None, None, None], out, 0).reshape(tokens, out.shape[1] * group, -1)


def _query_block(tokens: int, group: int, batch: int) -> int:
    """The query rows of a block: 16 (Tensor Cores' least) for decoding, more for longer runs of rows."""
    rows_per_sequence = -(-tokens * group // max(batch, 1))
    return 16 if rows_per_sequence <= 16 else 64 if rows_per_sequence <= 64 else 128


class _Rows(NamedTuple):
    """The chain's query rows of a paged call (`laid_out`), and its block mask's entries."""
    queries: jax.Array  # (rows, Hkv, D): each row's query heads
    sequence: jax.Array  # (rows,) each row's sequence
    head: jax.Array  # (rows,) its query head within its kv head's group
    position: jax.Array  # (rows,) its token's position in the sequence (padding rows: far below 0)
    length: jax.Array  # (rows,) its sequence's keys (padding rows: 0)
    logical: jax.Array  # (P,) each physical page's logical index (`logical_pages`)
    block_rows: jax.Array  # (blocks * max_pages,) the mask's entries: query block,
    block_pages: jax.Array  # ... physical page,
    block_flags: jax.Array  # ... and flag (0 empty, 1 partial, 2 full)
    token_rows: jax.Array  # (T, group) the rows of each token's query heads
    real_token: jax.Array  # (T,) whether a token is a sequence's (not padding)


# One compiled program: called outside `jit`, each of its operations would compile on its own.
@functools.partial(jax.jit, static_argnames=("page_size", "num_pages", "kv_heads", "causal", "window"))
def _rows(q, page_table, kv_lengths, starts, *, page_size: int, num_pages: int, kv_heads: int, causal: bool,
          window: int | None) -> _Rows:
    """`laid_out`'s arrays."""
    tokens, heads, dim = q.shape
    batch, max_pages = page_table.shape
    group = heads // kv_heads
    bm = _query_block(tokens, group, batch)
    blocks = -(-tokens * group // bm) + batch  # each sequence's rows start a block: fewer than one padded each
    kv_lengths = jnp.clip(kv_lengths, 0, max_pages * page_size)
    new = starts[1:] - starts[:-1]
    own = -(-(new * group) // bm)  # blocks of each sequence
    first = jnp.cumsum(own) - own

    # Each query block's sequence, and each row's: row `within` of a sequence's blocks holds its token
    # `within // group`, query head `h * group + within % group` of kv head `h` (gathered: no scatter).
    i = jnp.arange(blocks, dtype=jnp.int32)
    owner = jnp.minimum(_after(jnp.cumsum(own), blocks), batch - 1)
    used = i < own.sum()
    within = (i - first[owner]) * bm
    r = jnp.arange(blocks * bm, dtype=jnp.int32)
    row_sequence = owner[r // bm]
    row_within = within[r // bm] + r % bm
    real_row = used[r // bm] & (row_within < new[row_sequence] * group)
    token = jnp.where(real_row, starts[row_sequence] + row_within // group, 0)
    row_head = row_within % group
    # (Each row's heads gathered from `q` in place: XLA ran a transpose first at a seventh of the HBM bandwidth.)
    queries = jnp.where(real_row[:, None, None], q.reshape(tokens, kv_heads, group, dim)[
        token[:, None], jnp.arange(kv_heads)[None, :], row_head[:, None]], 0)
    padding = jnp.iinfo(jnp.int32).min // 2
    row_position = jnp.where(real_row, kv_lengths[row_sequence] - new[row_sequence] + row_within // group, padding)
    row_length = jnp.where(real_row, kv_lengths[row_sequence], 0)

    # Each query block's first and last tokens' positions; each slot's page and flag.
    low = kv_lengths[owner] - new[owner] + within // group
    high = kv_lengths[owner] - new[owner] + jnp.minimum((within + bm - 1) // group, new[owner] - 1)
    length = kv_lengths[owner][:, None]
    key = jnp.arange(max_pages, dtype=jnp.int32)[None, :] * page_size  # (first key of each logical page)
    last_key = key + page_size - 1
    full = last_key < length
    some = key < length
    if causal:
        full &= last_key <= low[:, None]
        some &= key <= high[:, None]
    if window is not None:
        full &= key > high[:, None] - window
        some &= last_key > low[:, None] - window
    pages = page_table[owner]
    in_range = (pages >= 0) & (pages < num_pages)
    flags = jnp.where(used[:, None] & in_range & some, jnp.where(full, 2, 1), 0)
    # The logical page of each physical page that is read (a page read by several sequences must sit at the same
    # logical index in each: a shared prefix), for the keys' positions in the mask and in score_mod.
    logical = logical_pages(page_table, key < kv_lengths[:, None], num_pages)

    sequence, index, real = token_sequences(starts, tokens)
    token_rows = jnp.where(real, first[sequence] * bm + index * group, 0)[:, None] + jnp.arange(group, dtype=jnp.int32)
    return _Rows(queries, row_sequence, row_head, row_position, row_length, logical, jnp.repeat(i, max_pages),
                 jnp.where(flags > 0, pages, 0).reshape(-1), flags.reshape(-1), token_rows, real)
