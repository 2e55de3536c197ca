"""`jinsum.attention`'s `mask_mod`, and `score_mod` / `mask_mod` closing over arrays (document ids, prefix lengths,
relative-position bias tables, ALiBi slopes): the reference lowering against a dense float64 NumPy evaluation of
the same masks (written independently, with NumPy on the whole grid), derivatives (also with respect to a captured
table), jit and vmap, the generated kernels in Triton's interpreter, and the errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp
from jax.test_util import check_grads

import jinsum
from jinsum import _attention
from jinsum.kernels import ChainConfig, make_chain_plan
from jinsum.testing import CountingJit, assert_allclose
from jinsum.testing import dense_attention as reference

from test_attention import _id, _pieces, _qkv, block_pattern, check_chain_kernels, graph_pattern, interpreted

# --- patterns, masks and a dense float64 reference -----------------------------------------------------------------


def graph(rng, nodes=48, keys=None, density=0.35):
    """A denser random graph than `graph_pattern` (so that a mask on top still leaves work): an empty row, stored
    zeros. Returns the pattern and where it allows attention, `(nodes, keys)` booleans."""
    keys = keys or nodes
    dense = rng.random((nodes, keys)) < density
    dense[2] = False
    csr = sp.csr_matrix(dense.astype(float))
    csr.data = (rng.random(csr.nnz) < 0.9).astype(float)
    pattern = jinsum.GroupCOO.from_scipy(csr, group_size=4)
    return pattern, np.asarray(pattern.todense()) != 0


def make_pattern(rng, fmt, length, keys):
    """`(pattern, allowed)`, `allowed` the pattern's nonzeros as `(L, S)` booleans."""
    if fmt == "block":
        pattern = block_pattern(rng, length=length, keys=keys, block=16, density=0.6)
        return pattern, np.asarray(pattern.todense()) != 0
    return graph(rng, length, keys)


def documents(rng, length):
    """Document ids `(length,)` of sorted documents of random lengths, one of them of length 1."""
    lengths = list(rng.integers(2, 13, size=length))
    lengths.insert(int(rng.integers(1, 3)), 1)  # early, so that it is not cut off
    doc = np.repeat(np.arange(len(lengths)), lengths)[:length].astype(np.int32)
    assert (np.bincount(doc) == 1).any() and doc.max() >= 2
    return doc


def grid(batch, heads, length, keys):
    """`b, h, i, j` as NumPy integers of shape `(B, H, L, S)`."""
    return np.meshgrid(np.arange(batch), np.arange(heads), np.arange(length), np.arange(keys), indexing="ij")


# Each case: `(rng, B, L, S) -> (mask_mod, allowed(b, h, i, j) in NumPy, attention keyword arguments)`, with the
# batch size B (None: q of shape (L, H, D)) and whether it needs L == S.

def _document(rng, batch, length, keys):
    doc = documents(rng, length)
    ids = jnp.asarray(doc)
    return (lambda b, h, i, j: ids[i] == ids[j]), (lambda b, h, i, j: doc[i] == doc[j]), {}


def _document_causal_key_padding(rng, batch, length, keys):
    mask_mod, allowed, _ = _document(rng, batch, length, keys)
    key_mask = rng.random((batch, keys) if batch else (keys,)) < 0.8
    return mask_mod, allowed, dict(causal=True, key_padding_mask=key_mask)


def _sliding_window(rng, batch, length, keys):
    width = 6
    return (lambda b, h, i, j: jnp.abs(i - j) <= width), (lambda b, h, i, j: np.abs(i - j) <= width), {}


def _causal_window(rng, batch, length, keys):
    width = 9
    return ((lambda b, h, i, j: (i >= j) & (i - j < width)),
            (lambda b, h, i, j: (i >= j) & (i - j < width)), {})


def _window_and_causal(rng, batch, length, keys):
    width = 9
    return ((lambda b, h, i, j: jnp.abs(i - j) < width),
            (lambda b, h, i, j: np.abs(i - j) < width), dict(causal=True))


def _prefix_lm(rng, batch, length, keys):
    prefix = rng.integers(1, keys // 2, batch).astype(np.int32)
    prefix[0] = 1  # the smallest prefix: causal but for key 0
    captured = jnp.asarray(prefix)

    def mask_mod(b, h, i, j):
        return (j < captured[b]) | (i >= j)
    return mask_mod, (lambda b, h, i, j: (j < prefix[b]) | (i >= j)), {}


def _prefix_lm_key_padding(rng, batch, length, keys):
    mask_mod, allowed, _ = _prefix_lm(rng, batch, length, keys)
    return mask_mod, allowed, dict(key_padding_mask=rng.random((batch, keys)) < 0.75)


def _per_batch_documents(rng, batch, length, keys):
    doc = np.stack([documents(rng, length) for _ in range(batch)])
    ids = jnp.asarray(doc)
    return (lambda b, h, i, j: ids[b, i] == ids[b, j]), (lambda b, h, i, j: doc[b, i] == doc[b, j]), {}


def _per_batch_stride(rng, batch, length, keys):
    """Uses `b` without any capture."""
    return ((lambda b, h, i, j: (j + b) % 3 != 0), (lambda b, h, i, j: (j + b) % 3 != 0), {})


def _per_head_window(rng, batch, length, keys):
    widths = np.array([2, 11], np.int32)
    captured = jnp.asarray(widths)
    return ((lambda b, h, i, j: jnp.abs(i - j) <= captured[h]),
            (lambda b, h, i, j: np.abs(i - j) <= widths[h]), {})


def _per_head_and_batch_causal(rng, batch, length, keys):
    """Head 0 attends to every third key, head 1 to keys of the same parity as the batch index; causal."""
    return ((lambda b, h, i, j: jnp.where(h == 0, j % 3 == 0, (j + b) % 2 == 0)),
            (lambda b, h, i, j: np.where(h == 0, j % 3 == 0, (j + b) % 2 == 0)), dict(causal=True))


MASK_CASES = {  # name: (builder, batch, square)
    "document": (_document, None, True),
    "document_causal_key_padding": (_document_causal_key_padding, None, True),
    "document_batched_causal_key_padding": (_document_causal_key_padding, 2, True),
    "sliding_window": (_sliding_window, None, False),
    "causal_window": (_causal_window, 2, False),
    "window_and_causal": (_window_and_causal, None, True),
    "prefix_lm": (_prefix_lm, 3, True),
    "prefix_lm_key_padding": (_prefix_lm_key_padding, 2, True),
    "per_batch_documents": (_per_batch_documents, 3, True),
    "per_batch_stride": (_per_batch_stride, 3, False),
    "per_head_window": (_per_head_window, None, False),
    "per_head_and_batch_causal": (_per_head_and_batch_causal, 2, True),
}
SIZES = {"block": (72, 72), "graph": (48, 48)}
RECTANGULAR = {"block": (80, 71), "graph": (48, 37)}


def mask_case(rng, fmt, name, dtype=np.float64):
    """`(q, k, v, pattern), kwargs, allowed`: inputs, `attention`'s keyword arguments and every mask together in
    NumPy, `(B, H, L, S)` booleans."""
    builder, batch, square = MASK_CASES[name]
    length, keys = SIZES[fmt] if square else RECTANGULAR[fmt]
    pattern, in_pattern = make_pattern(rng, fmt, length, keys)
    q, k, v = _qkv(rng, length, keys, batch=batch, dtype=dtype)
    mask_mod, numpy_mask, kwargs = builder(rng, batch, length, keys)
    b, h, i, j = grid(batch or 1, q.shape[-2], length, keys)
    allowed = in_pattern[None, None] & numpy_mask(b, h, i, j)
    # The mask must matter: it removes some of the pattern's entries and keeps others.
    assert (in_pattern[None, None] & ~allowed).any() and allowed.any()
    if kwargs.get("causal"):
        allowed = allowed & (i >= j)
    if kwargs.get("key_padding_mask") is not None:
        allowed = allowed & np.asarray(kwargs["key_padding_mask"]).reshape(-1, 1, 1, keys)
    return (q, k, v, pattern), dict(mask_mod=mask_mod, **kwargs), allowed


# --- mask_mod against dense float64 -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MASK_CASES))
@pytest.mark.parametrize("fmt", ["block", "graph"])
def test_mask_mod_matches_dense_float64(fmt, name, rng):
    with jax.enable_x64(True):
        (q, k, v, pattern), kwargs, allowed = mask_case(rng, fmt, name)
        call = functools.partial(jinsum.attention, pattern=pattern, return_lse=True, **kwargs)
        # One compiled program (eagerly every operation compiles alone), the pattern concrete inside it as outside;
        # but for a block pattern's key padding mask, whose blocks are classified on the host only where it is
        # concrete: eagerly.
        if not (fmt == "block" and "key_padding_mask" in kwargs):
            call = jax.jit(call)
        actual, actual_lse = call(q, k, v)
    out, lse = reference(q, k, v, allowed)
    assert actual.dtype == np.float64
    assert_allclose(actual, out, np.float64)
    np.testing.assert_allclose(np.asarray(actual_lse), lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fmt", ["block", "graph"])
def test_mask_mod_and_score_mod_with_captures_in_float32(fmt, rng):
    """The default precision, with a relative-position bias table and a document mask, jitted."""
    (q, k, v, pattern), kwargs, allowed = mask_case(rng, fmt, "document_causal_key_padding", np.float32)
    length, keys = pattern.shape[:2]
    table = rng.standard_normal((2, length + keys - 1)).astype(np.float32)
    bias_table = jnp.asarray(table)
    out = jax.jit(lambda q, k, v: jinsum.attention(
        q, k, v, pattern, score_mod=lambda s, b, h, i, j: s + bias_table[h, i - j + keys - 1], **kwargs))(q, k, v)
    _, h, i, j = grid(1, 2, length, keys)
    assert_allclose(out, reference(q, k, v, allowed, bias=table[h, i - j + keys - 1])[0], np.float32)


def test_mask_mod_with_per_head_pattern_values(rng):
    """A graph pattern with one value per head, a per-head mask_mod and a per-head captured bias."""
    with jax.enable_x64(True):
        pattern, in_pattern = graph_pattern(rng, 40, heads=2)
        q, k, v = _qkv(rng, 40, 40, dtype=np.float64)
        doc = documents(rng, 40)
        ids, slopes = jnp.asarray(doc), jnp.asarray([0.25, 1.5])
        out, lse = jinsum.attention(
            q, k, v, pattern, return_lse=True, mask_mod=lambda b, h, i, j: (ids[i] == ids[j]) | (h == 1),
            score_mod=lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j).astype(s.dtype))
    _, h, i, j = grid(1, 2, 40, 40)
    allowed = in_pattern.transpose(2, 0, 1)[None] & ((doc[i] == doc[j]) | (h == 1))
    expected, expected_lse = reference(q, k, v, allowed, bias=-np.array([0.25, 1.5])[h] * np.abs(i - j))
    assert_allclose(out, expected, np.float64)
    np.testing.assert_allclose(np.asarray(lse), expected_lse, rtol=1e-12, atol=1e-12)


# --- rows with nothing to attend to -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["block", "graph"])
def test_rows_the_mask_empties_give_zero_and_finite_gradients(fmt, rng):
    length, keys = SIZES[fmt]
    pattern, in_pattern = make_pattern(rng, fmt, length, keys)
    q, k, v = _qkv(rng, length, keys)
    doc = documents(rng, length)
    ids = jnp.asarray(doc)
    table = jnp.asarray(rng.standard_normal((2, length + keys - 1)), jnp.float32)

    def mask_mod(b, h, i, j):  # rows 3, 10, 17, ... attend to nothing; head 1 nothing after query 20
        return (ids[i] == ids[j]) & (i % 7 != 3) & ((h == 0) | (i < 20))

    def loss(q, k, v, table):
        out, lse = jinsum.attention(q, k, v, pattern, return_lse=True, causal=True, mask_mod=mask_mod,
                                    score_mod=lambda s, b, h, i, j: s + table[h, i - j + keys - 1])
        return jnp.sum(out ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0)), (out, lse)

    _, h, i, j = grid(1, 2, length, keys)
    allowed = (in_pattern & (doc[:, None] == doc[None, :]) & (i >= j) & (i % 7 != 3) & ((h == 0) | (i < 20)))[0]
    empty = ~allowed.any(-1).T  # (L, H)
    # Rows the mask empties, not only those the pattern does; and rows that stay.
    assert (empty & in_pattern.any(-1)[:, None]).sum() > 5 and (~empty).sum() > 5
    grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, table)
    out, lse = np.asarray(out), np.asarray(lse)
    assert not np.isnan(out).any()
    assert np.all(out[empty] == 0) and np.all(np.isposinf(lse[empty])) and np.isfinite(lse[~empty]).all()
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert np.all(np.asarray(grads[0])[empty] == 0)
    assert np.abs(np.asarray(grads[3])).max() > 0
    assert_allclose(out, reference(q, k, v, allowed[None], bias=np.asarray(table)[h, i - j + keys - 1])[0],
                    np.float32)


def test_a_mask_that_allows_nothing(rng):
    pattern, _ = make_pattern(rng, "block", 40, 40)
    q, k, v = _qkv(rng, 40, 40)
    f = jax.jit(lambda q, k, v: jinsum.attention(q, k, v, pattern, mask_mod=lambda b, h, i, j: i < 0,
                                                 return_lse=True))
    out, lse = f(q, k, v)
    assert np.all(np.asarray(out) == 0) and np.all(np.isposinf(np.asarray(lse)))
    grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)[0]), argnums=(0, 1, 2)))(q, k, v)
    assert all(np.all(np.asarray(g) == 0) for g in grads)


# --- derivatives ----------------------------------------------------------------------------------------------------


def _relative_bias(rng, length, keys, heads):
    """`bias[h, q - kv + S - 1]`, and a gain per head multiplying the score: two captured tables."""
    table = rng.standard_normal((heads, length + keys - 1))
    gain = 1 + 0.3 * rng.standard_normal(heads)

    def score_mod(s, b, h, i, j, table, gain):
        return s * gain[h] + table[h, i - j + keys - 1]
    return (table, gain), score_mod


def _alibi(rng, length, keys, heads):
    slopes = 2.0 ** -rng.uniform(0, 4, heads)

    def score_mod(s, b, h, i, j, slopes):
        return s - slopes[h] * jnp.abs(i - j).astype(s.dtype)
    return (slopes,), score_mod


def _soft_bias(rng, length, keys, heads):
    """A capture read twice and used nonlinearly (its partials differ per read)."""
    table = rng.standard_normal((heads, keys))

    def score_mod(s, b, h, i, j, table):
        return 4.0 * jnp.tanh((s + table[h, j] * table[h, i % keys]) / 4.0)
    return (table,), score_mod


@pytest.mark.parametrize("fmt,batch,bias", [("block", None, _relative_bias), ("graph", 2, _relative_bias),
                                            ("block", 2, _alibi), ("graph", None, _soft_bias)], ids=_id)
def test_gradients_with_respect_to_q_k_v_and_captured_tables(fmt, batch, bias, rng):
    """Forward and reverse mode against finite differences, with a document mask, causal and key padding."""
    with jax.enable_x64(True):
        length, keys = {"block": (40, 40), "graph": (32, 32)}[fmt]
        pattern, _ = make_pattern(rng, fmt, length, keys)
        q, k, v = _qkv(rng, length, keys, batch=batch, dtype=np.float64)
        tables, score_mod = bias(rng, length, keys, 2)
        ids = jnp.asarray(documents(rng, length))
        key_mask = rng.random(keys) < 0.85

        def f(q, k, v, *tables):
            out, lse = jinsum.attention(q, k, v, pattern, return_lse=True, causal=True, key_padding_mask=key_mask,
                                        mask_mod=lambda b, h, i, j: (ids[i] == ids[j]) | (j < 2),
                                        score_mod=lambda s, b, h, i, j: score_mod(s, b, h, i, j, *tables))
            return out, jnp.where(jnp.isfinite(lse), lse, 0)

        check_grads(jax.jit(f), (q, k, v, *tables), order=1, modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)


def test_the_table_gradient_equals_the_dense_one(rng):
    """`jax.grad` with respect to a relative-position bias table against the gradient of a dense JAX float64
    attention (`softmax` over masked scores)."""
    with jax.enable_x64(True):
        length, keys = SIZES["block"]
        pattern, in_pattern = make_pattern(rng, "block", length, keys)
        q, k, v = _qkv(rng, length, keys, dtype=np.float64)
        doc = documents(rng, length)
        ids = jnp.asarray(doc)
        table = jnp.asarray(rng.standard_normal((2, length + keys - 1)))
        d_out = rng.standard_normal((length, 2, 8))
        _, h, i, j = grid(1, 2, length, keys)
        allowed = (in_pattern & (doc[:, None] == doc[None, :]) & (i >= j))[0]

        def sparse(table):
            return jnp.sum(d_out * jinsum.attention(q, k, v, pattern, causal=True,
                                                    mask_mod=lambda b, h, i, j: ids[i] == ids[j],
                                                    score_mod=lambda s, b, h, i, j: s + table[h, i - j + keys - 1]))

        def dense(table):
            s = jnp.einsum("lhd,shd->hls", q, k) / 4 + table[h[0], i[0] - j[0] + keys - 1]
            rows = allowed.any(-1, keepdims=True)
            s = jnp.where(rows, jnp.where(allowed, s, -jnp.inf), 0)  # no NaN, even in the gradient
            w = jnp.where(allowed, jax.nn.softmax(s, -1), 0)
            return jnp.sum(d_out * jnp.einsum("hls,she->lhe", w, v))

        (value, grad), (expected_value, expected_grad) = (jax.jit(jax.value_and_grad(f))(table)
                                                          for f in (sparse, dense))
        np.testing.assert_allclose(float(value), float(expected_value), rtol=1e-12)
        assert np.abs(np.asarray(expected_grad)).max() > 0.1
        np.testing.assert_allclose(np.asarray(grad), np.asarray(expected_grad), rtol=1e-9, atol=1e-12)


def test_an_array_captured_by_mask_mod_gets_a_zero_gradient(rng):
    """Masks are piecewise constant: a floating array the mask reads has a zero gradient, not an error."""
    pattern, _ = make_pattern(rng, "graph", 48, 48)
    q, k, v = _qkv(rng, 48, 48)
    thresholds = jnp.asarray([3.5, 12.5])

    def loss(thresholds, q):
        return jnp.sum(jinsum.attention(q, k, v, pattern,
                                        mask_mod=lambda b, h, i, j: jnp.abs(i - j).astype(jnp.float32) < thresholds[h]))

    d_thresholds, d_q = jax.grad(loss, argnums=(0, 1))(thresholds, q)
    assert np.all(np.asarray(d_thresholds) == 0) and np.abs(np.asarray(d_q)).max() > 0


# --- jit and vmap -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["block", "graph"])
def test_jit_with_document_ids_as_an_argument_compiles_once(fmt, rng):
    length, keys = SIZES[fmt]
    pattern, in_pattern = make_pattern(rng, fmt, length, keys)
    q, k, v = _qkv(rng, length, keys)
    table = rng.standard_normal((2, length + keys - 1)).astype(np.float32)

    @CountingJit
    def f(q, k, v, doc, table):
        return jinsum.attention(q, k, v, pattern, causal=True, mask_mod=lambda b, h, i, j: doc[i] == doc[j],
                                score_mod=lambda s, b, h, i, j: s + table[h, i - j + keys - 1])

    _, h, i, j = grid(1, 2, length, keys)
    results = []
    for _ in range(2):
        doc = documents(rng, length)
        out = f(q, k, v, doc, table)
        allowed = in_pattern & (doc[:, None] == doc[None, :]) & (i >= j)
        assert_allclose(out, reference(q, k, v, allowed, bias=table[h, i - j + keys - 1])[0], np.float32)
        results.append(np.asarray(out))
        table = table * 0.5
    assert f.traces == 1
    assert not np.array_equal(*results)


@pytest.mark.parametrize("fmt", ["block", "graph"])
def test_vmap_over_values_with_captures_equals_a_loop(fmt, rng):
    length, keys = SIZES[fmt]
    pattern, _ = make_pattern(rng, fmt, length, keys)
    q, k, v = _qkv(rng, length, keys)
    stacked = [np.stack([x * (b + 1) for b in range(3)]) for x in (q, k, v)]
    ids = jnp.asarray(documents(rng, length))
    table = jnp.asarray(rng.standard_normal((2, length + keys - 1)), jnp.float32)

    def f(q, k, v, table=table):
        return jinsum.attention(q, k, v, pattern, causal=True, mask_mod=lambda b, h, i, j: ids[i] == ids[j],
                                score_mod=lambda s, b, h, i, j: s + table[h, i - j + keys - 1])

    batched = jax.jit(jax.vmap(f))(*stacked)
    for b in range(3):
        assert_allclose(batched[b], jax.jit(f)(*(x[b] for x in stacked)), np.float32, err_msg=f"batch {b}")

    def loss(q, k, v, table):
        return jnp.sum(f(q, k, v, table) ** 2)

    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(0, 0, 0, None)))(*stacked, table)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    looped = [grad(*(x[b] for x in stacked), table) for b in range(3)]
    for b in range(3):
        for name, g, expected in zip("qkv", grads, looped[b]):
            assert_allclose(g[b], expected, np.float32, err_msg=f"d{name} batch {b}")
    # The gradient of a sum over the batch, with respect to the (unbatched) captured table: the sum of the batch's.
    total = jax.jit(jax.grad(lambda table: jnp.sum(jax.vmap(loss, in_axes=(0, 0, 0, None))(*stacked, table))))(table)
    assert_allclose(total, sum(np.asarray(g[3], np.float64) for g in looped), np.float32)


def test_per_example_gradients_of_a_captured_table(rng):
    pattern, _ = graph_pattern(rng, 16)
    q, k, v = _qkv(rng, 16, 16)
    stacked = [np.stack([x * (b + 1) for b in range(3)]) for x in (q, k, v)]
    table = jnp.asarray(rng.standard_normal((2, 31)), jnp.float32)

    def loss(q, k, v, table):
        return jnp.sum(jinsum.attention(q, k, v, pattern,
                                        score_mod=lambda s, b, h, i, j: s + table[h, i - j + 15]) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=3))
    batched = jax.jit(jax.vmap(grad, in_axes=(0, 0, 0, None)))(*stacked, table)  # ValueError: Expected cotangent...
    for b in range(3):
        assert_allclose(batched[b], grad(*(x[b] for x in stacked), table), np.float32)


@pytest.mark.parametrize("fmt", ["block", "graph"])
def test_vmap_over_captured_document_ids_equals_a_loop(fmt, rng):
    length, keys = SIZES[fmt]
    pattern, in_pattern = make_pattern(rng, fmt, length, keys)
    q, k, v = _qkv(rng, length, keys)
    docs = np.stack([documents(rng, length) for _ in range(3)])

    def f(doc, q):
        doc = jnp.asarray(doc)
        return jinsum.attention(q, k, v, pattern, mask_mod=lambda b, h, i, j: doc[i] == doc[j])

    batched = jax.jit(jax.vmap(f, in_axes=(0, None)))(docs, q)
    for b in range(3):
        allowed = in_pattern & (docs[b][:, None] == docs[b][None, :])
        assert_allclose(batched[b], reference(q, k, v, allowed)[0], np.float32, err_msg=f"batch {b}")
    # Both batched: the documents and the queries.
    both = jax.jit(jax.vmap(f))(docs, np.stack([q, -q, 2 * q]))
    for b, scale in enumerate((1, -1, 2)):
        assert_allclose(both[b], jax.jit(f)(docs[b], scale * q), np.float32, err_msg=f"batch {b}")


# --- the generated kernels, in Triton's interpreter --------------------------------------------------------------


def _kernel_case(rng, fmt, case, dtype):
    """`(chain, arrays)` for `case`: a document mask (per batch with `batch`) or a prefix-LM mask, a score_mod of
    captured tables (`score`: a relative-position bias table by default), causal and key padding as asked."""
    batch, heads, dim = case.get("batch"), case.get("heads", 2), case.get("dim", 16)
    length, keys = case["size"]
    if fmt == "block":
        pattern, _ = make_pattern(rng, fmt, length, keys)
    else:  # sparser than `graph` (the interpreter's time grows with the entries), with a hub row and a hub key
        pattern, _ = graph_pattern(rng, length, keys, hubs=True)
    q, k, v = _qkv(rng, length, keys, heads=heads, batch=batch, dim=dim, dtype=dtype)
    if case.get("prefix_lm"):
        prefix = jnp.asarray(rng.integers(1, keys // 2, batch or 1), jnp.int32)

        def mask_mod(b, h, i, j):
            return (j < prefix[b]) | (i >= j)
    elif batch:
        ids = jnp.asarray(np.stack([documents(rng, length) for _ in range(batch)]))

        def mask_mod(b, h, i, j):
            return (ids[b, i] == ids[b, j]) & (jnp.abs(i - j) <= 6 + 20 * h)
    else:
        ids = jnp.asarray(documents(rng, length))

        def mask_mod(b, h, i, j):
            return ids[i] == ids[j]
    slopes = jnp.asarray(2.0 ** -rng.uniform(0, 3, heads), jnp.float32)
    table = jnp.asarray(rng.standard_normal((heads, length + keys - 1)), jnp.float32)
    soft = jnp.asarray(rng.standard_normal((heads, keys)), jnp.float32)
    terms = {  # what each capture's index varies along decides how its gradient is summed in a tile
        "table": lambda s, b, h, i, j: table[h, i - j + keys - 1],  # both tile axes
        "alibi": lambda s, b, h, i, j: -slopes[h] * jnp.abs(i - j).astype(jnp.float32),  # neither
        "soft": lambda s, b, h, i, j: 0.5 * jnp.tanh(s + soft[h, j] * soft[h, i % keys]),  # two reads, nonlinear
    }
    chosen = case.get("score", ("table",))

    def score_mod(s, b, h, i, j):
        return s + sum(terms[name](s, b, h, i, j) for name in chosen)
    key_mask = rng.random((batch, keys) if batch else (keys,)) < 0.8 if case.get("key_mask") else None
    return _attention.build_chain(q, k, v, pattern, mask_mod=mask_mod, score_mod=score_mod,
                                  causal=case.get("causal", False), key_padding_mask=key_mask)[:2]


KERNEL_CASES = [  # (with float32 and float16)
    ("block", dict(size=(56, 56), causal=True), ChainConfig(chunk=2)),  # a padded last block: clamped reads
    # rank-2 scores: the dkdv kernel adds dQ (and the captured table's gradient) atomically; per-batch documents
    ("graph", dict(size=(20, 20), dim=2, batch=2, key_mask=True), ChainConfig(entries=4, chunk=4)),
]
FLOAT32_KERNEL_CASES = [
    ("graph", dict(size=(20, 20), causal=True, score=("soft", "table")), ChainConfig(entries=4, chunk=8)),
    ("block", dict(size=(48, 48), prefix_lm=True, score=("alibi", "soft"), batch=2, key_mask=True),
     ChainConfig(chunk=3)),
    ("graph", dict(size=(20, 20), dim=2, prefix_lm=True, score=("alibi",), heads=3), ChainConfig()),
]


@interpreted
@pytest.mark.parametrize("fmt,case,config,dtype",
                         [(*c, d) for c in KERNEL_CASES for d in (np.float32, np.float16)]
                         + [(*c, np.float32) for c in FLOAT32_KERNEL_CASES],
                         ids=lambda x: np.dtype(x).name if isinstance(x, type) else _id(x))
def test_fused_kernels_with_masks_and_captures_match_the_reference(fmt, case, config, dtype, rng):
    pytest.importorskip("torch")
    chain, arrays = _kernel_case(rng, fmt, case, dtype)
    assert chain.mask_captures and chain.score_captures and len(chain.differentiable) == 3 + len(chain.score_captures)
    if case.get("dim") == 2:
        assert make_chain_plan(chain, "dkdv", config).dq_in_dkdv
    # A forced chunk cuts the graph's hub row and hub key into pieces (the block cases' rows and keys are short)
    assert _pieces(chain, arrays, config) == (fmt == "graph" and config.chunk > 0,) * 2
    _, finite = check_chain_kernels(chain, arrays, config, dtype, rng, nonzero=True)
    assert finite.any() and not finite.all()


# --- errors -------------------------------------------------------------------------------------------------------


def test_bad_mask_mods_are_refused_clearly(rng):
    pattern, _ = make_pattern(rng, "block", 40, 40)
    q, k, v = _qkv(rng, 40, 40)
    doc = jnp.asarray(documents(rng, 40))

    def run(**kwargs):
        return jinsum.attention(q, k, v, pattern, **kwargs)

    with pytest.raises(TypeError, match=r"mask_mod <lambda> must return one boolean per call .*got int32\[\]"):
        run(mask_mod=lambda b, h, i, j: i - j)
    with pytest.raises(TypeError, match=r"mask_mod <lambda> must return one boolean per call .*got float32\[\]"):
        run(mask_mod=lambda b, h, i, j: doc[i].astype(jnp.float32))
    with pytest.raises(TypeError, match=r"mask_mod mask must return one boolean per call .*got bool\[40\]"):
        def mask(b, h, i, j):
            return doc == doc[i]
        run(mask_mod=mask)
    with pytest.raises(TypeError, match="mask_mod must be a function"):
        run(mask_mod=np.ones((40, 40), bool))
    with pytest.raises(TypeError, match=r"must take \(b, h, q_idx, kv_idx\) scalars"):
        run(mask_mod=lambda s, b, h, i, j: i >= j)
    with pytest.raises(TypeError, match="mask_mod <lambda> uses a captured array in reduce_sum"):
        run(mask_mod=lambda b, h, i, j: doc.sum() > i)
    with pytest.raises(TypeError, match="score_mod <lambda> uses a captured array in reduce_max"):
        run(score_mod=lambda s, b, h, i, j: s + doc.max())
    with pytest.raises(TypeError, match="mask_mod <lambda> reads a slice of a captured array"):
        run(mask_mod=lambda b, h, i, j: jax.lax.dynamic_slice(doc, (i,), (2,)).sum() > 0)
    with pytest.raises(TypeError, match="score_mod <lambda> reads a slice of a captured array"):
        run(score_mod=lambda s, b, h, i, j: s + jax.lax.dynamic_slice(doc, (i,), (2,))[1])
    graph_, _ = make_pattern(rng, "graph", 40, 40)
    with pytest.raises(ValueError, match="mask_mod and self_loops cannot be combined"):
        jinsum.attention(q, k, v, graph_, mask_mod=lambda b, h, i, j: doc[i] == doc[j], self_loops=True)


@pytest.mark.parametrize("read", ["constant_index", "traced_scalar"])
def test_captures_read_at_a_constant_index_or_as_traced_scalars(read, rng):
    pattern, in_pattern = make_pattern(rng, "block", 40, 40)
    q, k, v = _qkv(rng, 40, 40)
    if read == "constant_index":
        windows = jnp.asarray([5, 9])
        out = jinsum.attention(q, k, v, pattern, mask_mod=lambda b, h, i, j: jnp.abs(i - j) <= windows[0])
    else:
        out = jax.jit(lambda w: jinsum.attention(q, k, v, pattern,
                                                 mask_mod=lambda b, h, i, j: jnp.abs(i - j) <= w))(jnp.int32(5))
    i, j = np.meshgrid(np.arange(40), np.arange(40), indexing="ij")
    assert_allclose(out, reference(q, k, v, in_pattern & (np.abs(i - j) <= 5))[0], np.float32)
