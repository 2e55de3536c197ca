"""`jinsum.paged_attention`: attention of new query tokens over a paged key/value cache (serving a model).

A paged cache stores each sequence's keys and values in fixed-size pages scattered through one pool:
key `j` of sequence `b` is `k_pages[page_table[b, j // page_size], j % page_size]`. The query tokens of a batch
of sequences come packed end to end (`query_starts`), so one call serves decoding (a token per sequence),
prefill (a whole prompt) and chunked prefill (a piece of a prompt after a cached prefix) alike; every length is
traced, so one compile serves every batch of the same shapes.

This module checks the arguments (before tracing where it can) and computes the attention with XLA: a loop over
logical pages, each step gathering the page of every query token's sequence and folding its scores into an online
softmax, so memory stays at one page per token whatever the lengths. Pages past a sequence's length (and, under
`causal` and `window`, those no query of it can see) are not read.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jinsum import _config
from jinsum._attention._api import scale_value
from jinsum.formats._convert import is_concrete

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
      `(T, Hq, E)` in the dtype of `q`; a sequence with no keys (`kv_lengths == 0`) gets zeros.

    Errors: shapes and dtypes are checked before tracing. Outside `jit`, a page index outside `[0, P)` in an
    entry that is read, a length past the table's capacity, fewer cached tokens than new ones or decreasing
    `query_starts` raise `ValueError`, naming the sequence and the value. Under `jit` the same conditions are
    `checkify` checks where `jinsum.check_indices` is on; without it, keys of a page index out of range count
    as masked out (never read out of bounds) and lengths are clipped to the table's capacity.

    Example:
      >>> out = jinsum.paged_attention(q, cache.k_pages, cache.v_pages, cache.page_table[ids], cache.lengths[ids])
    """
    q, k_pages, v_pages = (jnp.asarray(x) for x in (q, k_pages, v_pages))
    page_table, kv_lengths = jnp.asarray(page_table), jnp.asarray(kv_lengths)
    _check_shapes(q, k_pages, v_pages, page_table, kv_lengths, query_starts, window, score_mod)
    scale = scale_value(scale, q.shape[-1], WHERE)
    batch = page_table.shape[0]
    starts = (jnp.arange(batch + 1, dtype=jnp.int32) if query_starts is None
              else jnp.asarray(query_starts).astype(jnp.int32))
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
        starts = jnp.asarray(query_starts)
        if starts.shape != (batch + 1,) or not jnp.issubdtype(starts.dtype, jnp.integer):
            raise ValueError(f"{WHERE}: query_starts must be integers (B + 1,) = ({batch + 1},), offsets of each "
                             f"sequence's tokens in q; got {shape(starts)}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1):
        raise ValueError(f"{WHERE}: window must be a positive int (positions a token sees, its own included), or "
                         f"None; got {window!r}")
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"{WHERE}: score_mod must be a function f(score, b, h, q_idx, kv_idx), got {score_mod!r}")


def _check_values(page_table, kv_lengths, starts, num_pages: int, page_size: int) -> None:
    """The index arrays against what they address: an error naming the sequence where they are concrete, `checkify`
    checks under `jinsum.check_indices` where they are traced."""
    capacity = page_table.shape[1] * page_size
    q_len = starts[1:] - starts[:-1]
    if all(is_concrete(x) for x in (page_table, kv_lengths, starts)):
        table, lengths, first, counts = (np.asarray(x) for x in (page_table, kv_lengths, starts, q_len))
        if first[0] < 0 or (counts < 0).any():
            raise ValueError(f"{WHERE}: query_starts must be non-decreasing offsets from 0 or more; got "
                             f"{first.tolist()}")
        for b in range(len(lengths)):
            if not 0 <= lengths[b] <= capacity:
                raise ValueError(f"{WHERE}: kv_lengths[{b}] = {lengths[b]} is outside [0, {capacity}], the tokens "
                                 f"{page_table.shape[1]} pages of {page_size} hold")
            if counts[b] > lengths[b] > 0:
                raise ValueError(f"{WHERE}: sequence {b} has {counts[b]} new tokens but kv_lengths[{b}] = "
                                 f"{lengths[b]}: the cache must hold the new tokens too (append them first)")
            read = table[b, :-(-lengths[b] // page_size)]
            bad = np.flatnonzero((read < 0) | (read >= num_pages))
            if bad.size:
                raise ValueError(f"{WHERE}: page_table[{b}, {bad[0]}] = {read[bad[0]]} is outside [0, {num_pages}) "
                                 f"(the pages of k_pages), and sequence {b}'s {lengths[b]} tokens read it")
    elif _config.check_indices.value:
        checkify.check(jnp.all((kv_lengths >= 0) & (kv_lengths <= capacity)),
                       f"{WHERE}: kv_lengths holds a length outside [0, {capacity}], the tokens the table's pages hold")
        checkify.check(jnp.all(q_len >= 0) & (starts[0] >= 0), f"{WHERE}: query_starts must be non-decreasing "
                       "offsets from 0 or more")
        checkify.check(jnp.all((q_len <= kv_lengths) | (kv_lengths == 0)), f"{WHERE}: a sequence has more new "
                       "tokens than kv_lengths: the cache must hold the new tokens too")
        read = jnp.arange(page_table.shape[1]) * page_size < kv_lengths[:, None]
        checkify.check(jnp.all(~read | ((page_table >= 0) & (page_table < num_pages))),
                       f"{WHERE}: page_table holds a page outside [0, {num_pages}) in an entry that is read")


# --- the computation ----------------------------------------------------------------------------------------------

def _attend(q, k_pages, v_pages, page_table, kv_lengths, starts, *, causal, scale, window, score_mod):
    """The attention, a loop over logical pages with an online softmax (float32, or float64 for float64 inputs)."""
    tokens, hq, dim = q.shape
    num_pages, page_size, hkv, _ = k_pages.shape
    batch, max_pages = page_table.shape
    group = hq // hkv
    dtype = jnp.promote_types(jnp.promote_types(q.dtype, k_pages.dtype), jnp.float32)
    kv_lengths = jnp.clip(kv_lengths, 0, max_pages * page_size)

    # Each token's sequence, and its position in it (`sequence == batch`: padding past the last sequence).
    t = jnp.arange(tokens, dtype=jnp.int32)
    sequence = jnp.searchsorted(starts[1:], t, side="right").astype(jnp.int32)
    real = (t >= starts[0]) & (sequence < batch)
    sequence = jnp.minimum(sequence, batch - 1)
    q_len = starts[1:] - starts[:-1]
    position = kv_lengths[sequence] - q_len[sequence] + (t - starts[sequence])
    length = jnp.where(real, kv_lengths[sequence], 0)
    # The keys a token sees: [lowest, highest].
    highest = jnp.minimum(position, length - 1) if causal else length - 1
    lowest = jnp.maximum(position - window + 1, 0) if window is not None else jnp.zeros_like(position)
    first_page = jnp.min(jnp.where(real & (highest >= lowest), lowest, max_pages * page_size)) // page_size
    last_page = jnp.max(jnp.where(real, highest, -1)) // page_size  # (floor of -1 is -1: no page)

    queries = q.astype(dtype).reshape(tokens, hkv, group, dim) * jnp.asarray(scale, dtype)
    head = (jnp.arange(hkv)[:, None] * group + jnp.arange(group)[None, :])[None, :, :, None]
    modify = None if score_mod is None else jnp.vectorize(score_mod)

    def page_step(p, carry):
        running_max, total, acc = carry
        page = page_table[sequence, p]
        in_range = (page >= 0) & (page < num_pages)
        page = jnp.clip(page, 0, num_pages - 1)
        key = p * page_size + jnp.arange(page_size, dtype=jnp.int32)[None, :]  # (1, page_size)
        seen = in_range[:, None] & (key >= lowest[:, None]) & (key <= highest[:, None])  # (T, page_size)
        keys = k_pages[page].astype(dtype)  # (T, page_size, Hkv, D)
        values = jnp.where(seen[:, :, None, None], v_pages[page].astype(dtype), 0)
        scores = jnp.einsum("thgd,tshd->thgs", queries, keys, precision=jax.lax.Precision.HIGHEST)
        if modify is not None:
            scores = modify(scores, sequence[:, None, None, None], head, position[:, None, None, None],
                            key[:, None, None, :]).astype(dtype)
        scores = jnp.where(seen[:, None, None, :], scores, -jnp.inf)
        new_max = jnp.maximum(running_max, scores.max(-1))
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0)
        weights = jnp.exp(scores - safe_max[..., None])
        rescale = jnp.exp(running_max - safe_max)  # (0 where nothing was seen yet)
        total = total * rescale + weights.sum(-1)
        acc = acc * rescale[..., None] + jnp.einsum("thgs,tshe->thge", weights, values,
                                                    precision=jax.lax.Precision.HIGHEST)
        return new_max, total, acc

    def step(carry, p):
        carry = jax.lax.cond((p >= first_page) & (p <= last_page), lambda c: page_step(p, c), lambda c: c, carry)
        return carry, None

    values_dim = v_pages.shape[-1]
    start = (jnp.full((tokens, hkv, group), -jnp.inf, dtype), jnp.zeros((tokens, hkv, group), dtype),
             jnp.zeros((tokens, hkv, group, values_dim), dtype))
    _, total, acc = jax.lax.scan(step, start, jnp.arange(max_pages, dtype=jnp.int32))[0]
    out = jnp.where(total[..., None] > 0, acc / jnp.where(total > 0, total, 1)[..., None], 0)
    return out.reshape(tokens, hq, values_dim).astype(q.dtype)
