"""`jinsum.paged_attention` and `jinsum.nn.PagedKVCache` against float64 NumPy that gathers each sequence's pages into
contiguous keys and values: decoding and ragged prefill over shuffled page tables, lengths of 1, of a page and not a
multiple of it, a sequence of length 0, grouped and multi-query heads, causal, windowed and not, a `score_mod`;
one compile for batches of other lengths; the cache's pages taken, written, released and reused (against a model
of what each sequence holds); bad input and overflow, eager and under `jit`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import checkify

import jinsum
import jinsum.nn as jnn


def reference(q, k_pages, v_pages, table, lengths, starts, *, causal=True, window=None, scale=None, score_mod=None):
    """Each token's attention over its sequence's keys, gathered into contiguous arrays, in float64."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    tokens, heads, dim = q.shape
    _, page, kv_heads, _ = k_pages.shape
    group = heads // kv_heads
    scale = 1 / np.sqrt(dim) if scale is None else scale
    out = np.zeros((tokens, heads, v_pages.shape[-1]))
    for b, length in enumerate(lengths):
        new = starts[b + 1] - starts[b]
        pages = table[b, :-(-length // page)]
        keys = k_pages[pages].reshape(-1, kv_heads, dim)[:length]
        values = v_pages[pages].reshape(-1, kv_heads, v_pages.shape[-1])[:length]
        for i in range(new):
            t, position, j = starts[b] + i, length - new + i, np.arange(length)
            seen = np.ones(length, bool)
            if causal:
                seen &= j <= position
            if window is not None:
                seen &= position - j < window
            if not seen.any():
                continue
            for h in range(heads):
                scores = keys[:, h // group] @ q[t, h] * scale
                if score_mod is not None:
                    scores = np.array([score_mod(s, b, h, position, kv) for s, kv in zip(scores, j)], np.float64)
                weights = np.exp(scores[seen] - scores[seen].max())
                out[t, h] = weights / weights.sum() @ values[seen, h // group]
    return out


def paged(rng, lengths, page, kv_heads, dim, *, spare_pages=3, dtype=np.float32, max_pages=None):
    """Pools with every sequence's pages at shuffled places (the rest, and unused table entries, garbage)."""
    need = [-(-n // page) for n in lengths]
    max_pages = max_pages or max(max(need), 1)
    num_pages = sum(need) + spare_pages
    k_pages = rng.standard_normal((num_pages, page, kv_heads, dim)).astype(dtype)
    v_pages = rng.standard_normal((num_pages, page, kv_heads, dim)).astype(dtype)
    table = rng.integers(-5, 10 * num_pages, (len(lengths), max_pages)).astype(np.int32)  # (garbage where unread)
    order = iter(rng.permutation(num_pages))
    for b, n in enumerate(need):
        table[b, :n] = [next(order) for _ in range(n)]
    return k_pages, v_pages, table, np.asarray(lengths, np.int32)


TOLERANCE = {np.float32: 2e-5, jnp.bfloat16: 3e-2, np.float16: 4e-3}


@pytest.mark.parametrize("dtype,heads,kv_heads", [(np.float32, 8, 2), (np.float32, 4, 1), (np.float32, 3, 3),
                                                  (jnp.bfloat16, 8, 2), (np.float16, 4, 1)])
def test_decoding_against_float64(dtype, heads, kv_heads, rng):
    # A token per sequence: lengths of 1, of exactly a page, not a multiple of it, 0, and one page short of full.
    page, dim = 4, 16
    lengths = [1, 4, 7, 0, 12, 9]
    k_pages, v_pages, table, lengths = paged(rng, lengths, page, kv_heads, dim, dtype=dtype)
    q = rng.standard_normal((len(lengths), heads, dim)).astype(dtype)
    out = jinsum.paged_attention(q, k_pages, v_pages, table, lengths)
    starts = np.arange(len(lengths) + 1)
    expected = reference(q, k_pages, v_pages, table, lengths, starts)
    assert out.dtype == q.dtype and out.shape == q.shape
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=TOLERANCE[dtype], rtol=0)
    assert not np.asarray(out, np.float32)[3].any()  # (no keys: zeros)


@pytest.mark.parametrize("causal,window", [(True, None), (True, 3), (False, None), (False, 5)])
def test_ragged_prefill_with_cached_prefixes(causal, window, rng):
    # Sequences with new tokens after a cached prefix, a whole prompt, a single token, none; padding tokens at the end.
    page, dim, heads, kv_heads = 4, 8, 4, 2
    lengths, new = [11, 6, 1, 5, 8], [3, 6, 1, 0, 8]
    k_pages, v_pages, table, lengths = paged(rng, lengths, page, kv_heads, dim, max_pages=4)
    starts = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    q = rng.standard_normal((starts[-1] + 3, heads, dim)).astype(np.float32)
    out = jinsum.paged_attention(q, k_pages, v_pages, table, lengths, query_starts=starts, causal=causal,
                                 window=window)
    expected = reference(q, k_pages, v_pages, table, lengths, starts, causal=causal, window=window)
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=0)
    assert not np.asarray(out)[starts[-1]:].any()  # (padding tokens)


def test_score_mod_and_scale(rng):
    k_pages, v_pages, table, lengths = paged(rng, [9, 3], 4, 1, 8)
    starts = np.array([0, 2, 5], np.int32)
    q = rng.standard_normal((5, 2, 8)).astype(np.float32)
    slopes = np.array([0.5, -1.0], np.float32)  # (ALiBi-like, per head: a JAX array inside the score_mod)

    def soft_cap(score, b, h, q_idx, kv_idx):
        return 3.0 * jnp.tanh(score / 3.0) + jnp.asarray(slopes)[h] * (q_idx - kv_idx) + 0.25 * b

    def soft_cap_np(score, b, h, q_idx, kv_idx):
        return 3.0 * np.tanh(score / 3.0) + slopes[h] * (q_idx - kv_idx) + 0.25 * b

    out = jinsum.paged_attention(q, k_pages, v_pages, table, lengths, query_starts=starts, scale=0.3,
                                 score_mod=soft_cap)
    expected = reference(q, k_pages, v_pages, table, lengths, starts, scale=0.3, score_mod=soft_cap_np)
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=0)


def test_one_compile_for_every_batch_of_the_same_shapes(rng):
    page, dim = 4, 8
    k_pages, v_pages, table, lengths = paged(rng, [13, 2, 8], page, 2, dim, spare_pages=8, max_pages=4)
    f = jax.jit(lambda q, starts, table, lengths: jinsum.paged_attention(q, k_pages, v_pages, table, lengths,
                                                                         query_starts=starts))
    q = rng.standard_normal((12, 4, dim)).astype(np.float32)
    for new, lengths in (([3, 2, 4], [13, 2, 8]), ([1, 1, 1], [5, 16, 1]), ([6, 0, 5], [7, 0, 5])):
        starts = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
        valid_table = table.copy()
        valid_table[:, :] = np.arange(table.size).reshape(table.shape) % k_pages.shape[0]
        out = f(q, starts, valid_table, np.asarray(lengths, np.int32))
        expected = reference(q, k_pages, v_pages, valid_table, lengths, starts)
        np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=0)
    assert f._cache_size() == 1


def test_bad_input_is_named(rng):
    k_pages, v_pages, table, lengths = paged(rng, [5, 3], 4, 2, 8)
    q = np.zeros((2, 4, 8), np.float32)
    call = jinsum.paged_attention
    with pytest.raises(ValueError, match=r"page_table\[1, 0\] = 99 is outside \[0, 6\)"):
        bad = table.copy()
        bad[1, 0] = 99
        call(q, k_pages, v_pages, bad, lengths)
    with pytest.raises(ValueError, match=r"kv_lengths\[0\] = 9 is outside \[0, 8\]"):
        call(q, k_pages, v_pages, table, np.array([9, 3], np.int32))
    with pytest.raises(ValueError, match="sequence 1 has 2 new tokens but kv_lengths"):
        call(np.zeros((3, 4, 8), np.float32), k_pages, v_pages, table, np.array([5, 1], np.int32),
             query_starts=np.array([0, 1, 3], np.int32))
    with pytest.raises(ValueError, match="Hkv = 3 of k_pages must divide the query heads Hq = 4"):
        call(q, k_pages[:, :, :1].repeat(3, 2), v_pages[:, :, :1].repeat(3, 2), table, lengths)
    with pytest.raises(ValueError, match="T = 3 must equal B = 2"):
        call(np.zeros((3, 4, 8), np.float32), k_pages, v_pages, table, lengths)
    with pytest.raises(ValueError, match=r"query_starts must be integers \(B \+ 1,\) = \(3,\)"):
        call(q, k_pages, v_pages, table, lengths, query_starts=np.array([0, 2], np.int32))
    with pytest.raises(TypeError, match="page_table must be integers"):
        call(q, k_pages, v_pages, table.astype(np.float32), lengths)
    with pytest.raises(ValueError, match="window must be a positive int"):
        call(q, k_pages, v_pages, table, lengths, window=0)
    with pytest.raises(ValueError, match="page 1 is logical page 0 of sequence 0 and logical page 1 of sequence 1"):
        shared = table.copy()
        shared[0, 0], shared[1, 1] = 1, 1
        call(q, k_pages, v_pages, shared, np.array([5, 6], np.int32))
    with pytest.raises(ValueError, match="the head size D of q"):
        call(np.zeros((2, 4, 6), np.float32), k_pages, v_pages, table, lengths)


def test_out_of_range_pages_under_jit(rng):
    k_pages, v_pages, table, lengths = paged(rng, [5, 3], 4, 2, 8)
    q = rng.standard_normal((2, 4, 8)).astype(np.float32)
    bad = table.copy()
    bad[0, 1] = 1000  # (read: sequence 0's second page)
    f = jax.jit(lambda table: jinsum.paged_attention(q, k_pages, v_pages, table, lengths))
    out = np.asarray(f(bad))  # unchecked: that page's keys count as masked out, nothing read out of bounds
    assert np.isfinite(out).all()
    masked = reference(q, k_pages, v_pages, table, np.array([4, 3]), np.array([0, 1, 2]), causal=False)
    np.testing.assert_allclose(out[0], masked[0], atol=2e-5, rtol=0)
    with jinsum.check_indices(True):
        checked = checkify.checkify(jax.jit(lambda table: jinsum.paged_attention(q, k_pages, v_pages, table,
                                                                                 lengths)))
        error, _ = checked(bad)
        with pytest.raises(checkify.JaxRuntimeError, match="page_table holds a page outside"):
            error.throw()
        error, _ = checked(table)
        error.throw()  # (garbage in the entries that are not read is no error)


# --- the cache ------------------------------------------------------------------------------------------------------

class Model:
    """What each sequence slot holds, token by token, in NumPy."""

    def __init__(self, slots: int):
        self.keys = {s: [] for s in range(slots)}
        self.values = {s: [] for s in range(slots)}

    def append(self, k, v, starts, ids):
        for i, s in enumerate(ids):
            if s >= 0:
                self.keys[s] += list(k[starts[i]:starts[i + 1]])
                self.values[s] += list(v[starts[i]:starts[i + 1]])

    def release(self, ids):
        for s in ids:
            if s >= 0:
                self.keys[s], self.values[s] = [], []


def check_cache(cache: jnn.PagedKVCache, model: Model) -> None:
    """Every slot's pages hold what was written to it; no page is both free and held, or held twice."""
    table, lengths = np.asarray(cache.page_table), np.asarray(cache.lengths)
    held = []
    for s, keys in model.keys.items():
        assert lengths[s] == len(keys)
        pages = table[s, :-(-len(keys) // cache.page_size)]
        held += list(pages)
        stored_k = np.asarray(cache.k_pages, np.float32)[pages].reshape(-1, *cache.k_pages.shape[2:])[:len(keys)]
        stored_v = np.asarray(cache.v_pages, np.float32)[pages].reshape(-1, *cache.v_pages.shape[2:])[:len(keys)]
        np.testing.assert_array_equal(stored_k, np.asarray(keys, np.float32).reshape(stored_k.shape))
        np.testing.assert_array_equal(stored_v, np.asarray(model.values[s], np.float32).reshape(stored_v.shape))
    free = list(np.asarray(cache.free_pages)[:int(cache.num_free)])
    assert sorted(held + free) == list(range(cache.k_pages.shape[0]))


def tokens(rng, n, kv_heads=2, dim=4):
    return (rng.standard_normal((n, kv_heads, dim)).astype(np.float32),
            rng.standard_normal((n, kv_heads, dim)).astype(np.float32))


def test_cache_appends_releases_and_reuses_pages(rng):
    cache = jnn.PagedKVCache.create(12, 4, 2, 4, max_sequences=5, max_pages_per_sequence=4, dtype=jnp.float32)
    model = Model(5)
    append = jax.jit(lambda cache, k, v, starts, ids: cache.append(k, v, starts, ids))
    release = jax.jit(lambda cache, ids: cache.release(ids))
    steps = [("append", [0, 5, 9, 10], [3, 0, 4]), ("append", [0, 1, 2, 3], [3, 0, 4]),  # prefill, then decode
             ("release", [0, -1]), ("append", [0, 7, 7, 8], [1, -1, 4]),  # a new sequence takes the freed pages
             ("release", [4, 3]), ("append", [0, 16, 16, 16], [2, 0, 3])]
    for step in steps:
        if step[0] == "append":
            starts, ids = np.asarray(step[1], np.int32), np.asarray(step[2], np.int32)
            k, v = tokens(rng, 16)
            cache = append(cache, k, v, starts, ids)
            model.append(k, v, starts, ids)
        else:
            cache = release(cache, np.asarray(step[1], np.int32))
            model.release(step[1])
        check_cache(cache, model)
        assert not bool(cache.overflow)
    assert append._cache_size() == 1 and release._cache_size() == 1
    # Attention over the cache equals attention over what the model says each sequence holds.
    q = rng.standard_normal((3, 4, 4)).astype(np.float32)
    ids = np.array([2, 0, 3], np.int32)
    out = cache.attend(q, ids)
    expected = reference(q, cache.k_pages, cache.v_pages, np.asarray(cache.page_table)[ids],
                         np.asarray(cache.lengths)[ids], np.arange(4))
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=0)


def test_cache_overflow(rng):
    cache = jnn.PagedKVCache.create(4, 4, 2, 4, max_sequences=3, max_pages_per_sequence=3, dtype=jnp.float32)
    k, v = tokens(rng, 14)
    with pytest.raises(ValueError, match=r"sequence_ids\[0\] = 1 would hold 13 tokens, past the 3 pages of 4"):
        cache.append(k, v, np.array([0, 13], np.int32), np.array([1], np.int32))
    with pytest.raises(ValueError, match=r"sequence_ids\[1\] = 2 needs 2 more pages, and 1 are free"):
        cache.append(k, v, np.array([0, 9, 14], np.int32), np.array([0, 2], np.int32))  # 3 + 2 pages of 4
    with pytest.raises(ValueError, match="sequence_ids must be distinct"):
        cache.append(k[:2], v[:2], None, np.array([1, 1], np.int32))
    # Under jit: the sequences that fit are written, the others left as they were, and the flag set.
    append = jax.jit(lambda cache, starts, ids: cache.append(k, v, starts, ids))
    after = append(cache, np.array([0, 9, 14], np.int32), np.array([0, 2], np.int32))
    assert bool(after.overflow) and np.asarray(after.lengths).tolist() == [9, 0, 0] and int(after.num_free) == 1
    model = Model(3)
    model.append(k, v, [0, 9], [0])
    check_cache(after, model)
    with jinsum.check_indices(True):
        error, _ = checkify.checkify(append)(cache, np.array([0, 9, 14], np.int32), np.array([0, 2], np.int32))
        with pytest.raises(checkify.JaxRuntimeError, match="does not fit the cache"):
            error.throw()


def test_cache_in_a_decoding_loop(rng):
    # The cache is a pytree: a scan of decoding steps, each appending a token to every sequence and attending.
    cache = jnn.PagedKVCache.create(16, 4, 1, 8, max_sequences=2, max_pages_per_sequence=8, dtype=jnp.float32)
    k, v = tokens(rng, 10, kv_heads=1, dim=8)
    cache = cache.append(k, v, np.array([0, 3, 10], np.int32), np.array([0, 1], np.int32))
    ids = jnp.array([0, 1], jnp.int32)
    steps_k, steps_v = tokens(rng, 10, kv_heads=1, dim=8)
    queries = rng.standard_normal((5, 2, 2, 8)).astype(np.float32)

    def step(cache, inputs):
        k, v, q = inputs
        cache = cache.append(k, v, None, ids)
        return cache, cache.attend(q, ids)

    cache, outs = jax.jit(lambda c: jax.lax.scan(step, c, (steps_k.reshape(5, 2, 1, 8), steps_v.reshape(5, 2, 1, 8),
                                                            queries)))(cache)
    assert np.asarray(cache.lengths).tolist() == [8, 12]
    table = np.asarray(cache.page_table)
    for s in range(5):
        lengths = np.array([3 + s + 1, 7 + s + 1], np.int32)
        expected = reference(queries[s], cache.k_pages, cache.v_pages, table, lengths, np.arange(3))
        np.testing.assert_allclose(np.asarray(outs[s]), expected, atol=2e-5, rtol=0)


@settings(max_examples=10, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 9), min_size=3, max_size=3)), min_size=1,
                max_size=6), st.integers(0, 2**31 - 1))
def test_cache_operations_keep_what_each_sequence_holds(operations, seed):
    rng = np.random.default_rng(seed)
    cache = jnn.PagedKVCache.create(10, 3, 2, 4, max_sequences=3, max_pages_per_sequence=4, dtype=jnp.float32)
    model = Model(3)
    for is_release, counts in operations:
        if is_release:
            ids = [s for s, n in enumerate(counts) if n % 3 == 0]
            cache = _release(cache, np.asarray(ids + [-1] * (3 - len(ids)), np.int32))
            model.release(ids)
            continue
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        k, v = tokens(rng, 27)
        fits = all(len(model.keys[s]) + n <= 12 for s, n in enumerate(counts))
        pages = sum(-(-(len(model.keys[s]) + n) // 3) - -(-len(model.keys[s]) // 3) for s, n in enumerate(counts))
        free = int(cache.num_free)
        cache = _append(cache, k, v, starts, np.arange(3, dtype=np.int32))
        if fits and pages <= free:
            model.append(k, v, starts, [0, 1, 2])
            assert not bool(cache.overflow)
        else:
            assert bool(cache.overflow)  # (which sequences of the batch were still written: test_cache_overflow)
            return
        check_cache(cache, model)


_append = jax.jit(lambda cache, k, v, starts, ids: cache.append(k, v, starts, ids))
_release = jax.jit(lambda cache, ids: cache.release(ids))


def test_attention_layer_generates_what_it_trains(rng):
    # BlockSparseAttention.generate over a paged cache (a prefill of two prompts in one call, then a token at a time)
    # gives the outputs of the layer's own call on the whole sequences (causal, windowed, grouped heads).
    from flax import nnx  # noqa: PLC0415

    attn = jnn.BlockSparseAttention(16, 4, num_kv_heads=2, causal=True, window=5, block=8, rngs=nnx.Rngs(0))
    x = rng.standard_normal((2, 11, 16)).astype(np.float32)
    expected = np.asarray(attn(x))
    cache = jnn.PagedKVCache.create(16, 4, 2, 4, max_sequences=3, max_pages_per_sequence=3, dtype=jnp.float32)
    generate = jax.jit(lambda x, cache, ids, starts: attn.generate(x, cache, ids, starts))
    prompt = np.concatenate([x[0, :7], x[1, :3], np.zeros((2, 16), np.float32)])  # (two tokens of padding)
    out, cache = generate(prompt, cache, np.array([2, 0], np.int32), np.array([0, 7, 10], np.int32))
    np.testing.assert_allclose(np.asarray(out)[:7], expected[0, :7], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(out)[7:10], expected[1, :3], atol=1e-5, rtol=0)
    for t in range(3, 11):  # sequence 1 catches up, sequence 0 decodes alongside while it has tokens left
        ids = np.array([2 if t + 4 < 11 else -1, 0], np.int32)
        token = np.stack([x[0, min(t + 4, 10)], x[1, t]])
        out, cache = generate(token, cache, ids, np.array([0, 1, 2], np.int32))
        if ids[0] >= 0:
            np.testing.assert_allclose(np.asarray(out)[0], expected[0, t + 4], atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(out)[1], expected[1, t], atol=1e-5, rtol=0)
    assert np.asarray(cache.lengths).tolist() == [11, 0, 11]
    assert generate._cache_size() == 2  # (one for the prefill's shapes, one for every decoding step)


def test_sequences_sharing_a_prefix_page(rng):
    # Two sequences whose first page is one physical page (a shared prompt prefix), each decoding a token.
    k_pages, v_pages, table, lengths = paged(rng, [7, 6], 4, 2, 8)
    table[1, 0] = table[0, 0]
    q = rng.standard_normal((2, 4, 8)).astype(np.float32)
    out = jinsum.paged_attention(q, k_pages, v_pages, table, lengths)
    expected = reference(q, k_pages, v_pages, table, lengths, np.arange(3))
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=0)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the interpreter runs where no GPU is")
@pytest.mark.parametrize("page,new,config", [
    (16, (1, 1, 1), {}), (4, (9, 1, 5), {}),
    (16, (1, 1, 1), dict(chunk=2)),  # a row's pieces (flash-decoding)
    (16, (100, 1, 5), {}),  # a prompt of 100 tokens: query blocks of 128 rows
])
def test_generated_kernels_in_the_interpreter(page, new, config, rng):
    # The chain's kernels the CUDA lowering launches for pages (key blocks of a page, query blocks of 16 to 128 rows
    # of tokens x grouped heads, key tiles of several pages) in Triton's interpreter (float16: it has no bfloat16)
    # against float64: decoding, and prefill after cached prefixes, causal with a window.
    pytest.importorskip("torch")
    from jinsum._attention import _api, _chain_triton, _paged  # noqa: PLC0415
    from jinsum._attention._chain_route import route_chain  # noqa: PLC0415
    from jinsum.kernels import ChainConfig  # noqa: PLC0415

    k_pages, v_pages, table, lengths = paged(rng, [37 + max(new), 6, 19], page, 2, 16, dtype=np.float16)
    starts = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    q = rng.standard_normal((starts[-1], 8, 16)).astype(np.float16)
    inputs = tuple(map(jnp.asarray, (q, k_pages, v_pages, table, lengths, starts)))

    def laid_out(*inputs):
        return _paged.laid_out(*inputs, causal=True, window=6, score_mod=None)

    # The layout in one compiled program (eagerly every operation compiled alone); its mask comes out concrete.
    queries, keys, values, mask = jax.jit(lambda *inputs: laid_out(*inputs)[:4])(*inputs)
    chain, arrays, unpad = _api.build_chain(queries, keys, values, mask)
    assert route_chain(chain, ChainConfig(**config)).plan("forward").config.span == 64 // page  # (pages a tile)
    rows = unpad(jnp.asarray(_chain_triton.interpret_forward(chain, arrays, ChainConfig(**config))[0]))
    out = jax.jit(lambda rows, *inputs: laid_out(*inputs)[5](rows))(rows, *inputs)
    expected = reference(q, k_pages, v_pages, table, lengths, starts, window=6)
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=4e-3, rtol=0)


def test_gradients_and_vmap(rng):
    # Differentiable in q and both pools (the chain's backward; float64 against finite differences), and vmap over
    # several query sets sharing one cache equals a loop.
    from jax.test_util import check_grads  # noqa: PLC0415

    with jax.enable_x64(True):
        k_pages, v_pages, table, lengths = paged(rng, [7, 3], 4, 1, 4, dtype=np.float64)
        starts = np.array([0, 2, 3], np.int32)
        q = rng.standard_normal((3, 2, 4))

        def f(q, k_pages, v_pages):
            return jinsum.paged_attention(q, k_pages, v_pages, table, lengths, query_starts=starts, window=5)

        check_grads(jax.jit(f), (q, k_pages, v_pages), order=1, modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)
        queries = rng.standard_normal((3, 3, 2, 4))
        batched = jax.vmap(f, in_axes=(0, None, None))(queries, k_pages, v_pages)
        np.testing.assert_allclose(batched, np.stack([f(x, k_pages, v_pages) for x in queries]), atol=1e-12)
