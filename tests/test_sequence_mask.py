"""`jinsum.sequence_mask`'s block classification from per-block summaries (document id intervals, the causal and
window rules on block bounds) against `jinsum.block_mask`'s element-wise one and a brute-force NumPy one: the same
slots for sorted document ids, a superset with the same full blocks for unsorted ones, never past the capacity;
attention through it against the dense float64 reference, compiled once over new document ids."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jinsum
from jinsum.testing import CountingJit, assert_allclose
from jinsum.testing import dense_attention as reference

from test_block_mask import _check_slots, classify, qkv


def sorted_ids(rng, length):
    """Non-decreasing document ids: documents of 1 to `length` positions (some shorter than a block, some longer)."""
    lengths = rng.integers(1, rng.choice([3, 12, length + 1]) + 1, size=length)
    return np.repeat(np.arange(length), lengths)[:length].astype(np.int32)


def allowed(docs, length, causal, window):
    """Brute force `(B, L, L)`: the same document, with `causal` not after, with `window` fewer than `window` apart."""
    i, j = np.indices((length, length))
    keep = docs[:, :, None] == docs[:, None, :]
    if causal:
        keep &= i >= j
    if window is not None:
        keep &= (i - j < window) & ((j - i < window) | causal)
    return keep


def rule(docs, causal, window):
    """`sequence_mask`'s rule as a `mask_mod` per batch element, for `jinsum.block_mask` to classify element-wise."""
    def mask_mod(b, h, q, kv):
        keep = docs[b, q] == docs[b, kv]
        if causal:
            keep &= q >= kv
        if window is not None:
            keep &= (q - kv < window) & ((kv - q < window) | causal)
        return keep
    return mask_mod


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), length=st.integers(1, 90), block=st.sampled_from([4, 8, 16]),
       causal=st.booleans(), window=st.one_of(st.none(), st.integers(1, 40)), unsorted=st.booleans())
def test_classification_from_summaries_equals_the_element_wise_one(seed, length, block, causal, window, unsorted):
    """One batched build holds several id rows (one compile per example): all one document, every position its own,
    random sorted ones, and with `unsorted` rows of ids in no order: a superset with the same full blocks, within
    the capacity even when two documents alternate (every block then holds both, so every block the position rules
    allow is partial; the capacity counts what they allow)."""
    rng = np.random.default_rng(seed)
    rows = [np.zeros(length, np.int32), np.arange(length, dtype=np.int32)]
    rows += [sorted_ids(rng, length) for _ in range(4)]
    if unsorted:
        rows += [rng.integers(0, 3, length).astype(np.int32), rng.permutation(rows[-1]),
                 np.arange(length, dtype=np.int32) % 2]
    docs = np.stack(rows)
    B, n = len(docs), -(-length // block)

    @jax.jit
    def both(docs):
        fast = jinsum.sequence_mask(length, block, document_ids=docs, causal=causal, window=window)
        slow = jinsum.block_mask(rule(docs, causal, window), length, length, block, batch=B, capacity=fast.capacity)
        return fast, slow, fast.to_dense(), slow.to_dense()

    fast, slow, fast_grid, slow_grid = both(docs)
    fast_grid, slow_grid = np.asarray(fast_grid), np.asarray(slow_grid)
    expected = np.concatenate([classify(a, block, block) for a in allowed(docs, length, causal, window)])
    np.testing.assert_array_equal(slow_grid, expected)
    assert not bool(fast.overflow) and not bool(slow.overflow)
    # the position rules bound every block that may attend: the capacity holds them, even for unsorted ids
    assert np.count_nonzero(fast_grid) <= fast.capacity
    if not unsorted:
        for name in ("Ai", "Ak", "flags"):
            np.testing.assert_array_equal(np.asarray(getattr(fast, name)), np.asarray(getattr(slow, name)),
                                          err_msg=name)
        _check_slots(fast, expected)
        return
    sorted_rows = slice(0, (B - 3) * n)
    np.testing.assert_array_equal(fast_grid[sorted_rows], expected[sorted_rows])
    np.testing.assert_array_equal(fast_grid == 2, expected == 2)  # full blocks are full, and all are found
    assert ((expected != 0) <= (fast_grid != 0)).all()  # every block that attends is there (maybe as partial)
    _check_slots(fast, fast_grid)


@pytest.mark.parametrize("case", [dict(length=70, block=16, causal=True),  # not a multiple of the block
                                  dict(length=48, block=8, causal=True, window=13, batch=2, unsorted=True),
                                  dict(length=40, block=16, causal=False, window=9)],
                         ids=["causal-ragged", "batch-window-unsorted", "window-both-ways"])
def test_attention_through_it_matches_dense_float64_and_compiles_once(case, rng):
    length, block, causal, window = case["length"], case["block"], case["causal"], case.get("window")
    B = case.get("batch")

    def ids():
        rows = [sorted_ids(rng, length) for _ in range(B or 1)]
        if case.get("unsorted"):
            rows[-1] = rng.integers(0, 3, length).astype(np.int32)
        return np.stack(rows) if B else rows[0]

    @CountingJit
    def step(docs, q, k, v):
        mask = jinsum.sequence_mask(length, block, document_ids=docs, causal=causal, window=window)
        return jinsum.attention(q, k, v, mask)

    with jax.enable_x64(True):
        q, k, v = qkv(rng, length, length, heads=2, batch=B)
        for _ in range(2):
            docs = ids()
            out = step(jnp.asarray(docs), q, k, v)
            keep = allowed(docs.reshape(-1, length), length, causal, window)[:, None]  # (B, 1, L, L)
            assert_allclose(out, reference(q, k, v, keep if B else keep[0])[0], np.float64)
    assert step.traces == 1
