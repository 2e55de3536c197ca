"""`PagedKVCache`: a key/value cache in fixed-size pages, allocated and freed on the device (serving a model).

The cache is one pool of `num_pages` pages of `page_size` tokens for the keys and one for the values, a page table
naming the physical page of each logical page of each sequence slot, each slot's length, and a free list: a
stack of free page ids, the first `num_free` entries of `free_pages`. Appending tokens takes the pages they need
from the top of the stack and writes the keys and values into their slots; releasing a sequence pushes its pages
back. Every step is a `jit`-able array update (no host round trip), and a cache is a pytree: carry it through a
`jax.lax.scan` of decoding steps or return it from a jitted step.

Capacity is static and its overflow is reported, never silent: an append that would need more pages than are free,
or more tokens than a slot's `max_pages_per_sequence` hold, leaves those sequences unchanged and sets `overflow`;
outside `jit` it raises instead (naming the sequence, what it needs and what is free), and under `jit` it is a
`checkify` check where `jinsum.check_indices` is on.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

import jinsum
from jinsum import _config
from jinsum._attention._paged import token_sequences
from jinsum.formats._convert import as_jax_array, is_concrete

WHERE = "jinsum.nn.PagedKVCache"


@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """Keys and values of up to `max_sequences` sequences in pages of a shared pool (see the module's text).

    Fields (arrays, so the cache is a pytree):
      k_pages, v_pages: `(num_pages, page_size, kv_heads, head_dim)` the pools.
      page_table: `(max_sequences, max_pages_per_sequence)` int32, the page of each logical page; -1 where none.
      lengths: `(max_sequences,)` int32, the tokens cached for each sequence slot.
      free_pages: `(num_pages,)` int32, a stack: its first `num_free` entries are the free pages.
      num_free: `()` int32.
      overflow: `()` bool, set (and kept) by an append that did not fit.
    """

    k_pages: jax.Array
    v_pages: jax.Array
    page_table: jax.Array
    lengths: jax.Array
    free_pages: jax.Array
    num_free: jax.Array
    overflow: jax.Array

    @classmethod
    def create(cls, num_pages: int, page_size: int, kv_heads: int, head_dim: int, *, max_sequences: int,
               max_pages_per_sequence: int, dtype=jnp.bfloat16, value_dim: int | None = None) -> PagedKVCache:
        """An empty cache: every page free, every sequence slot of length 0. `value_dim`: the values' head size
        where it differs from the keys' `head_dim`."""
        sizes = {"num_pages": num_pages, "page_size": page_size, "kv_heads": kv_heads, "head_dim": head_dim,
                 "max_sequences": max_sequences, "max_pages_per_sequence": max_pages_per_sequence,
                 "value_dim": head_dim if value_dim is None else value_dim}
        for name, size in sizes.items():
            if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
                raise ValueError(f"{WHERE}.create: {name} must be a positive int, got {size!r}")
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"{WHERE}.create: dtype must be floating, got {jnp.dtype(dtype)}")
        return _empty(cls, (num_pages, page_size, kv_heads), head_dim, sizes["value_dim"],
                      (max_sequences, max_pages_per_sequence), jnp.dtype(dtype))

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]

    @property
    def max_sequences(self) -> int:
        return self.page_table.shape[0]

    @property
    def max_pages_per_sequence(self) -> int:
        return self.page_table.shape[1]

    def append(self, k: jax.Array, v: jax.Array, query_starts: jax.Array | None, sequence_ids: jax.Array
               ) -> PagedKVCache:
        """Writes new tokens' keys and values after each sequence's cached ones, taking free pages as needed.

        Args:
          k: `(T, kv_heads, head_dim)` keys of the new tokens of `n` sequences, packed end to end (as the queries
            of `jinsum.paged_attention`); tokens past `query_starts[n]` are padding and are not written.
          v: `(T, kv_heads, value_dim)` their values.
          query_starts: `(n + 1,)` non-decreasing offsets into `T`; None: one token per sequence (`T == n`).
          sequence_ids: `(n,)` the slot of each sequence, distinct; a negative id is a padding entry (its tokens are
            not written).

        Returns the cache with the tokens written and the lengths advanced; sequences that do not fit are left
        unchanged and `overflow` is set (an error outside `jit`).
        """
        k, v, sequence_ids = as_jax_array(k), as_jax_array(v), as_jax_array(sequence_ids)
        starts = self._starts(k, query_starts, sequence_ids, "append")
        for name, x, width, size in (("k", k, self.k_pages.shape[3], "head_dim"),
                                     ("v", v, self.v_pages.shape[3], "value_dim")):
            expected = (k.shape[0], self.k_pages.shape[2], width)
            if x.shape != expected:
                raise ValueError(f"{WHERE}.append: {name} must be (T, kv_heads, {size}) = {expected}, got "
                                 f"{x.dtype}{list(x.shape)}")
        self._check_ids(sequence_ids, "append")
        cache, refused, held, more, free = _appended(self, k, v, starts, sequence_ids)
        if is_concrete(refused):
            if np.asarray(refused).any():
                i = int(np.flatnonzero(np.asarray(refused))[0])
                max_pages, page_size = self.max_pages_per_sequence, self.page_size
                reason = (f"would hold {int(held[i])} tokens, past the {max_pages} pages of {page_size} a sequence "
                          "may have" if held[i] > max_pages * page_size else
                          f"needs {int(more[i])} more pages, and {int(free[i])} are free after the sequences before "
                          f"it (of {self.k_pages.shape[0]})")
                raise ValueError(f"{WHERE}.append: sequence_ids[{i}] = {int(sequence_ids[i])} {reason}; release "
                                 "finished sequences or create a larger cache")
        elif _config.check_indices.value:
            checkify.check(~jnp.any(refused), f"{WHERE}.append: a sequence does not fit the cache (its pages or the "
                           "free pages); release finished sequences or create a larger cache")
        return cache

    def release(self, sequence_ids: jax.Array) -> PagedKVCache:
        """Returns the pages of these sequence slots to the free list and empties the slots (negative ids are
        padding entries, skipped)."""
        sequence_ids = as_jax_array(sequence_ids)
        if sequence_ids.ndim != 1 or not jnp.issubdtype(sequence_ids.dtype, jnp.integer):
            raise TypeError(f"{WHERE}.release: sequence_ids must be integers (n,), got "
                            f"{sequence_ids.dtype}{list(sequence_ids.shape)}")
        self._check_ids(sequence_ids, "release")
        return _released(self, sequence_ids)

    def attend(self, q: jax.Array, sequence_ids: jax.Array, query_starts: jax.Array | None = None,
               **options) -> jax.Array:
        """`jinsum.paged_attention` of `q` (packed as for `append`, whose tokens it must follow) over these
        sequences' cached keys and values; `options` are its keywords (`causal`, `scale`, `window`,
        `score_mod`). A padding entry (negative id) attends to nothing: zeros."""
        page_table, lengths = _sequences(self, as_jax_array(sequence_ids))
        return jinsum.paged_attention(q, self.k_pages, self.v_pages, page_table, lengths, query_starts=query_starts,
                                      **options)

    def _starts(self, k, query_starts, sequence_ids, method: str) -> jax.Array:
        """The sequences' offsets into the packed tokens, checked against `sequence_ids`."""
        if sequence_ids.ndim != 1 or not jnp.issubdtype(sequence_ids.dtype, jnp.integer):
            raise TypeError(f"{WHERE}.{method}: sequence_ids must be integers (n,), got "
                            f"{sequence_ids.dtype}{list(sequence_ids.shape)}")
        n = sequence_ids.shape[0]
        if query_starts is None:
            if k.ndim < 1 or k.shape[0] != n:
                raise ValueError(f"{WHERE}.{method}: without query_starts each sequence has one token, so T = "
                                 f"{k.shape[0] if k.ndim else None} must equal len(sequence_ids) = {n}")
            return as_jax_array(np.arange(n + 1, dtype=np.int32))
        starts = as_jax_array(query_starts)
        if starts.shape != (n + 1,) or not jnp.issubdtype(starts.dtype, jnp.integer):
            raise ValueError(f"{WHERE}.{method}: query_starts must be integers (n + 1,) = ({n + 1},), offsets of the "
                             f"sequences' tokens; got {starts.dtype}{list(starts.shape)}")
        if is_concrete(starts):
            values = np.asarray(starts)
            if values[0] < 0 or (np.diff(values) < 0).any() or values[-1] > k.shape[0]:
                raise ValueError(f"{WHERE}.{method}: query_starts must be non-decreasing offsets in [0, T = "
                                 f"{k.shape[0]}], got {values.tolist()}")
        return starts.astype(jnp.int32)

    def _check_ids(self, sequence_ids, method: str) -> None:
        """Slots must be distinct (two entries for one slot would take its pages twice)."""
        if is_concrete(sequence_ids):
            ids = np.asarray(sequence_ids)
            ids = ids[ids >= 0]
            if (ids >= self.max_sequences).any():
                raise ValueError(f"{WHERE}.{method}: sequence id {int(ids.max())} is past the {self.max_sequences} "
                                 "slots of the cache (max_sequences)")
            if len(np.unique(ids)) != len(ids):
                raise ValueError(f"{WHERE}.{method}: sequence_ids must be distinct, got {np.asarray(sequence_ids)}")
        elif _config.check_indices.value:
            ids = jnp.sort(jnp.where(sequence_ids >= 0, sequence_ids, -1 - jnp.arange(sequence_ids.shape[0])))
            checkify.check(jnp.all(ids[1:] != ids[:-1]) & jnp.all(ids < self.max_sequences),
                           f"{WHERE}.{method}: sequence_ids must be distinct slots below max_sequences")


# The arrays of `create`, `append`, `release` and `attend`, each one compiled program (eagerly each of their
# operations would compile on its own); their checks stay outside, where the values may be concrete.
@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def _empty(cls, pool: tuple[int, int, int], head_dim: int, value_dim: int, table: tuple[int, int],
           dtype) -> PagedKVCache:
    """`create`'s empty cache of class `cls`: pools `(*pool, head_dim)` and `(*pool, value_dim)`, a page table of
    shape `table`."""
    num_pages = pool[0]
    return cls(k_pages=jnp.zeros((*pool, head_dim), dtype), v_pages=jnp.zeros((*pool, value_dim), dtype),
               page_table=jnp.full(table, -1, jnp.int32), lengths=jnp.zeros(table[:1], jnp.int32),
               free_pages=jnp.arange(num_pages, dtype=jnp.int32)[::-1], num_free=jnp.asarray(num_pages, jnp.int32),
               overflow=jnp.asarray(False))


@jax.jit
def _appended(cache: PagedKVCache, k, v, starts, sequence_ids):
    """`append`'s cache, and for its error: which sequences were refused, the tokens each would hold, the pages it
    needs more and those free after the sequences before it."""
    page_size, max_pages = cache.page_size, cache.max_pages_per_sequence
    slot_ok = (sequence_ids >= 0) & (sequence_ids < cache.max_sequences)
    slot = jnp.where(slot_ok, sequence_ids, cache.max_sequences)  # (past the table: dropped by the scatters)
    counts = starts[1:] - starts[:-1]
    old = jnp.where(slot_ok, cache.lengths[jnp.minimum(slot, cache.max_sequences - 1)], 0)
    new = old + counts
    have, need = -(-old // page_size), -(-new // page_size)
    fits_table = new <= max_pages * page_size
    extra = jnp.where(slot_ok & fits_table, need - have, 0)
    taken = jnp.cumsum(extra)  # pages taken through each sequence, in order
    fits_pool = (taken <= cache.num_free) | (extra == 0)
    accepted = slot_ok & fits_table & fits_pool
    extra = jnp.where(accepted, extra, 0)
    taken = jnp.cumsum(extra)

    # Sequence i's r-th new page is free_pages[num_free - taken[i] + r]: the stack's top, in order.
    logical = jnp.arange(max_pages, dtype=jnp.int32)[None, :]
    r = logical - have[:, None]
    gets = accepted[:, None] & (r >= 0) & (r < extra[:, None])
    page = cache.free_pages[jnp.clip(cache.num_free - taken[:, None] + r, 0, cache.free_pages.shape[0] - 1)]
    rows = cache.page_table[jnp.minimum(slot, cache.max_sequences - 1)]
    page_table = cache.page_table.at[slot].set(jnp.where(gets, page, rows), mode="drop")
    lengths = cache.lengths.at[slot].set(jnp.where(accepted, new, old), mode="drop")

    # Each token's page and slot in it (tokens of sequences not accepted, or past the last one: dropped).
    owner, index, written = token_sequences(starts, k.shape[0])
    written &= accepted[owner]
    position = old[owner] + index
    target = page_table[jnp.minimum(slot[owner], cache.max_sequences - 1),
                        jnp.clip(position // page_size, 0, max_pages - 1)]
    target = jnp.where(written, target, cache.k_pages.shape[0])
    appended = dataclasses.replace(
        cache, page_table=page_table, lengths=lengths, num_free=cache.num_free - extra.sum(dtype=jnp.int32),
        k_pages=cache.k_pages.at[target, position % page_size].set(k.astype(cache.k_pages.dtype), mode="drop"),
        v_pages=cache.v_pages.at[target, position % page_size].set(v.astype(cache.v_pages.dtype), mode="drop"),
        overflow=cache.overflow | jnp.any(slot_ok & ~accepted))
    refused = slot_ok & ~accepted
    return appended, refused, new, need - have, cache.num_free - taken


@jax.jit
def _released(cache: PagedKVCache, sequence_ids) -> PagedKVCache:
    """`release`'s cache."""
    slot_ok = (sequence_ids >= 0) & (sequence_ids < cache.max_sequences)
    slot = jnp.where(slot_ok, sequence_ids, cache.max_sequences)
    row = jnp.minimum(slot, cache.max_sequences - 1)
    held = jnp.where(slot_ok, -(-cache.lengths[row] // cache.page_size), 0)
    owned = jnp.arange(cache.max_pages_per_sequence)[None, :] < held[:, None]
    # Pushed in order onto the stack: the k-th returned page goes to free_pages[num_free + k].
    place = cache.num_free + jnp.cumsum(owned.ravel()).reshape(owned.shape) - 1
    place = jnp.where(owned, place, cache.free_pages.shape[0])
    return dataclasses.replace(
        cache, free_pages=cache.free_pages.at[place].set(cache.page_table[row], mode="drop"),
        num_free=cache.num_free + held.sum(dtype=jnp.int32),
        page_table=cache.page_table.at[slot].set(-1, mode="drop"),
        lengths=cache.lengths.at[slot].set(0, mode="drop"))


@jax.jit
def _sequences(cache: PagedKVCache, sequence_ids) -> tuple[jax.Array, jax.Array]:
    """`attend`'s page table rows and lengths of these sequence slots (a padding entry: no tokens)."""
    slot_ok = (sequence_ids >= 0) & (sequence_ids < cache.max_sequences)
    row = jnp.clip(sequence_ids, 0, cache.max_sequences - 1)
    return cache.page_table[row], jnp.where(slot_ok, cache.lengths[row], 0)


jax.tree_util.register_dataclass(PagedKVCache, data_fields=[f.name for f in dataclasses.fields(PagedKVCache)],
                                 meta_fields=[])
