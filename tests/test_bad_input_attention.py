"""Bad and edge inputs of attention, as a new user passes them (issue 56's sweep): `jinsum.attention`, `block_mask`,
`sequence_mask`, `block_pattern` and `BlockSparseAttention`. Each gets the right answer (against float64 NumPy; an
empty result where one makes sense) or an error from the function the user called, naming the argument, what it got
and what it needs, before JAX's internals see the input. The XLA lowering only (no Triton interpreter)."""

import jax
import numpy as np
import pytest
from flax import nnx

import jinsum
import jinsum.nn as jnn
from jinsum import BlockGroupCOO, GroupCOO

ONES = np.ones((8, 8), np.float32)

# --- Zero sizes: empty results; a head size of 0 is an error ----------------------------------------------------------

@pytest.mark.parametrize("shapes, pattern", [
    (((4, 0, 8),) * 3, GroupCOO.from_dense(np.eye(4, dtype=np.float32))),  # the sweep's: no heads
    (((8, 0, 4),) * 3, BlockGroupCOO.from_dense(ONES, block_shape=(4, 4))),
    (((8, 2, 4), (8, 2, 4), (8, 2, 0)), BlockGroupCOO.from_dense(ONES, block_shape=(4, 4))),  # no value features
    (((0, 8, 2, 4),) * 3, BlockGroupCOO.from_dense(ONES, block_shape=(4, 4))),  # a batch of 0
])
def test_attention_with_nothing_to_compute_is_empty(shapes, pattern):
    """No heads, value features or batch elements: nothing to compute, so an empty `(..., L, H, E)` result (as for no
    queries), and empty gradients."""
    q, k, v = (np.ones(shape, np.float32) for shape in shapes)
    out, lse = jinsum.attention(q, k, v, pattern, return_lse=True)
    assert out.shape == (*q.shape[:-1], v.shape[-1]) and out.dtype == np.float32 and lse.shape == q.shape[:-1]
    grads = jax.grad(lambda q, k, v: jinsum.attention(q, k, v, pattern).sum(), argnums=(0, 1, 2))(q, k, v)
    assert [g.shape for g in grads] == list(shapes)


def test_attention_refuses_a_head_size_of_0():
    """The scores would all be 0 and the default scale `1 / sqrt(D)` is undefined: an error, not a division by zero."""
    q = np.ones((4, 2, 0), np.float32)
    with pytest.raises(ValueError, match=r"^jinsum.attention: q and k have head size D = 0: .* pass q and k with D >= "
                                         r"1; got q \(4, 2, 0\), k \(4, 2, 0\), v \(4, 2, 8\)"):
        jinsum.attention(q, q, np.ones((4, 2, 8), np.float32), GroupCOO.from_dense(np.eye(4, dtype=np.float32)))


def test_attention_refuses_keys_without_heads_for_queries_with_heads():
    q, k = np.ones((4, 2, 8), np.float32), np.ones((4, 0, 8), np.float32)
    with pytest.raises(ValueError, match=r"^jinsum.attention: .* k's heads must divide q's .*got q \(4, 2, 8\), k "
                                         r"\(4, 0, 8\)"):
        jinsum.attention(q, k, k, GroupCOO.from_dense(np.eye(4, dtype=np.float32)))


# --- scale ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scale, error, message", [
    ("0.5", TypeError, r"scale must be a real Python or NumPy number .*, or None for 1 / sqrt\(D\); got str '0.5'"),
    (True, TypeError, "scale must be a real Python or NumPy number .* got bool True"),
    (np.array([0.5]), TypeError, r"scale must be a real .* got an array of shape \(1,\)"),
    (float("inf"), ValueError, "scale must be finite, got inf"),
])
def test_attention_scale_must_be_a_real_number(scale, error, message):
    q = np.ones((2, 1, 4), np.float32)
    with pytest.raises(error, match="^jinsum.attention: " + message):
        jinsum.attention(q, q, q, GroupCOO.from_dense(np.eye(2, dtype=np.float32)), scale=scale)


def test_attention_scale_is_a_number_known_when_traced(rng):
    """A traced scale is refused by name (it is compiled into the kernels); a NumPy number is a number."""
    q, k, v = (rng.standard_normal((4, 1, 4)).astype(np.float32) for _ in range(3))
    pattern = GroupCOO.from_dense(np.ones((4, 4), np.float32))
    with pytest.raises(TypeError, match="^jinsum.attention: scale must be a real Python or NumPy number .*not a traced "
                                        "array"):
        jax.jit(lambda s: jinsum.attention(q, k, v, pattern, scale=s))(0.5)
    scores = np.einsum("id,jd->ij", q[:, 0].astype(np.float64), k[:, 0]) * 0.25
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    expected = ((weights / weights.sum(-1, keepdims=True)) @ v[:, 0])[:, None]
    np.testing.assert_allclose(jinsum.attention(q, k, v, pattern, scale=np.float32(0.25)), expected, rtol=2e-5,
                               atol=2e-6)


# --- block_mask and sequence_mask sizes -------------------------------------------------------------------------------

def causal(b, h, i, j):
    return i >= j


def test_block_mask_takes_numpy_integers():
    expected = jinsum.block_mask(causal, 8, 8, 4)
    for args in [(np.int64(8), np.int64(8), np.int64(4)), (8, 8, (np.int64(4), np.int32(4)))]:
        mask = jinsum.block_mask(causal, *args, capacity=np.int64(4))
        assert mask.shape == (8, 8) and mask.block == (4, 4) and type(mask.shape[0]) is int
        np.testing.assert_array_equal(mask.to_dense(), expected.to_dense())
    assert jinsum.block_mask(causal, 8, 8, 4, batch=np.int64(2), heads=np.int32(3)).to_dense().shape == (12, 2)


@pytest.mark.parametrize("block, error, message", [
    ((4,), ValueError, r"block must be an int bm \(square blocks\) or a pair \(bm, bk\), got \(4,\)"),
    (2.5, TypeError, r"block must be an int bm \(square blocks\) or a pair \(bm, bk\), got 2.5"),
    (None, TypeError, r"block must be an int bm \(square blocks\) or a pair \(bm, bk\), got None"),
    ((4, 0), ValueError, r"block\[1\] must be an int >= 1, got 0"),
    ((4, 2.0), TypeError, r"block\[1\] must be an int, got 2.0"),
])
def test_block_mask_block_is_an_int_or_a_pair(block, error, message):
    with pytest.raises(error, match="^jinsum.block_mask: " + message):
        jinsum.block_mask(causal, 8, 8, block)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(L=8.0), TypeError, "L must be an int, got 8.0"),
    (dict(S=0), ValueError, "S must be an int >= 1, got 0"),
    (dict(batch=True), TypeError, r"batch \(or None: the same mask for all\) must be an int, got True"),
    (dict(heads=0), ValueError, r"heads \(or None: the same mask for all\) must be an int >= 1, got 0"),
    (dict(capacity=2.0), TypeError, r"capacity \(or None for every block\) must be an int, got 2.0"),
])
def test_block_mask_sizes(kwargs, error, message):
    with pytest.raises(error, match="^jinsum.block_mask: " + message):
        jinsum.block_mask(causal, **{"L": 8, "S": 8, "block": 4, **kwargs})


def test_sequence_mask_takes_numpy_integers():
    expected = jinsum.sequence_mask(8, 4, causal=True, window=3)
    for length, block, window in [(np.int64(8), 4, 3), (8, np.int64(4), 3), (8, 4, np.int64(3))]:
        mask = jinsum.sequence_mask(length, block, causal=True, window=window)
        assert mask.shape == (8, 8) and mask.block == (4, 4)
        np.testing.assert_array_equal(mask.to_dense(), expected.to_dense())


# --- block_pattern ----------------------------------------------------------------------------------------------------

BLOCK_PATTERN_ERRORS = [
    ((10, 2.5), {}, TypeError, "block must be an int, got 2.5"),
    ((16.0, 4), {}, TypeError, "seq_len must be an int, got 16.0"),
    ((16, 4), dict(global_blocks=None), TypeError, "global_blocks must be an int, got None"),
    ((16, 4), dict(local_blocks=1.5), TypeError, "local_blocks must be an int, got 1.5"),
    ((16, 4), dict(random_blocks=2.5), TypeError, "random_blocks must be an int, got 2.5"),
    ((16, 4), dict(random_blocks=1, seed=-1), ValueError, "seed must be an int >= 0, got -1"),
    ((16, 0), {}, ValueError, "block must be an int >= 1, got 0"),
    ((10, 4), {}, ValueError, "seq_len must be a multiple of block, got seq_len = 10, block = 4"),
]


def test_block_pattern_takes_ints_only():
    """A float or None is refused by name (1.5 local blocks ran as 1, 2.5 random ones as 2); NumPy integers count."""
    for args, kwargs, error, message in BLOCK_PATTERN_ERRORS:
        with pytest.raises(error, match="^jinsum.block_pattern: " + message):
            jinsum.block_pattern(*args, **kwargs)
    pattern = jinsum.block_pattern(np.int64(16), np.int64(4), local_blocks=np.int64(0), global_blocks=np.int32(1),
                                random_blocks=np.int64(1), seed=np.int64(3))
    expected = jinsum.block_pattern(16, 4, local_blocks=0, global_blocks=1, random_blocks=1, seed=3)
    np.testing.assert_array_equal(pattern.todense(), expected.todense())


# --- BlockSparseAttention ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, kwargs, error, message", [
    ((8, 2), dict(block=0), ValueError, "block must be an int >= 1, got 0"),
    ((8, 2), dict(block=2.5), TypeError, "block must be an int, got 2.5"),
    ((8, 2), dict(dropout=1.5), ValueError, r"dropout must be in \[0, 1\), got 1.5"),
    ((8, 2), dict(dropout="0.1"), ValueError, r"dropout must be in \[0, 1\), got '0.1'"),
    ((8, 0), {}, ValueError, "num_heads must be an int >= 1, got 0"),
    ((8, 2.5), {}, TypeError, "num_heads must be an int, got 2.5"),
    ((8, 2), dict(window=0), ValueError, r"window \(or None\) must be an int >= 1, got 0"),
    ((8, 2), dict(out_features=0), ValueError, r"out_features \(or None\) must be an int >= 1, got 0"),
    ((8, 2), dict(num_kv_heads=1.0), TypeError, r"num_kv_heads \(or None\) must be an int, got 1.0"),
    ((3, 4), {}, ValueError, r"head_dim must be >= 1, got in_features // num_heads = 3 // 4 = 0; pass head_dim"),
])
def test_block_sparse_attention_checks_its_arguments_when_built(args, kwargs, error, message):
    """At construction (not at the first call, naming sequence_mask or jinsum.attention), by the module's name."""
    with pytest.raises(error, match="^BlockSparseAttention: " + message):
        jnn.BlockSparseAttention(*args, **kwargs, rngs=nnx.Rngs(0))


def test_block_sparse_attention_takes_numpy_integers():
    layer = jnn.BlockSparseAttention(np.int64(8), np.int64(2), num_kv_heads=np.int64(1), out_features=np.int64(6),
                                     window=np.int64(4), block=np.int64(4), rngs=nnx.Rngs(0))
    assert layer(np.ones((8, 8), np.float32)).shape == (8, 6)


def test_block_sparse_attention_checks_x_and_document_ids():
    layer = jnn.BlockSparseAttention(8, 2, block=4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"^BlockSparseAttention: expected x \(L, 8\) or \(B, L, 8\) \(in_features = "
                                         r"8\), got \(8, 5\)"):
        layer(np.ones((8, 5), np.float32))
    with pytest.raises(ValueError, match=r"^BlockSparseAttention: document_ids must be \(8,\) for x of shape \(8, 8\), "
                                         r"got \(2, 8\)"):
        layer(np.ones((8, 8), np.float32), document_ids=np.zeros((2, 8), np.int32))


@pytest.mark.parametrize("shape", [(0, 8), (3, 0, 8)])
def test_block_sparse_attention_of_no_positions_is_empty(shape):
    """No positions, so nothing attends: an empty output (there is no mask to build: sequence_mask needs a position),
    under jit too, with empty gradients."""
    layer = jnn.BlockSparseAttention(8, 2, block=4, out_features=6, causal=True, rngs=nnx.Rngs(0))
    x = np.ones(shape, np.float32)
    assert layer(x).shape == (*shape[:-1], 6)
    assert nnx.jit(lambda m, x: m(x))(layer, x).shape == (*shape[:-1], 6)
    assert jax.grad(lambda x: layer(x).sum())(x).shape == shape
