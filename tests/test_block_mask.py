"""`jinsum.block_mask` (block masks built with jax.numpy from a `mask_mod`, inside `jit` or not) and grouped-query
attention: the block flags against a brute-force NumPy classification of the dense mask, device-built against
host-built patterns, one compile for new document boundaries, the capacity's overflow flag, attention through a
`BlockMask` (shared, per batch element, per head) and with fewer key/value heads against a dense float64 NumPy
reference, derivatives, the generated kernels in Triton's interpreter, and the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from jax.test_util import check_grads

import jinsum
import jinsum.nn
from jinsum import _attention
from jinsum.kernels import ChainConfig
from jinsum.testing import CountingJit, assert_allclose
from jinsum.testing import dense_attention as reference

from test_attention import _id, block_pattern, check_chain_kernels, graph_pattern, interpreted

# --- masks, a brute-force block classification and a dense float64 reference --------------------------------------


def documents(rng, length, longest=16):
    """Sorted document ids `(length,)` of random lengths (2 to `longest`), with a document of length 1 early on."""
    lengths = list(rng.integers(2, longest + 1, size=length))
    lengths.insert(int(rng.integers(1, 3)), 1)
    return np.repeat(np.arange(len(lengths)), lengths)[:length].astype(np.int32)


def long_documents(rng, length):
    """Documents with one of 40 positions first (full blocks below the diagonal), then `documents`."""
    return np.concatenate([np.zeros(40, np.int32), documents(rng, length - 40) + 1]).astype(np.int32)


def grid(n, m):
    """Query and key positions `(n, m)` as NumPy integer grids."""
    return np.indices((n, m))


def classify(allowed, bm, bk):
    """The flags grid of a dense `(L, S)` boolean mask by brute force: 2 where every element of the `bm x bk` block
    attends, 1 where some do, 0 where none; positions past `L`, `S` never attend (so edge blocks are at most 1)."""
    length, keys = allowed.shape
    lb, sb = -(-length // bm), -(-keys // bk)
    padded = np.zeros((lb * bm, sb * bk), bool)
    padded[:length, :keys] = allowed
    tiles = padded.reshape(lb, bm, sb, bk)
    return np.where(tiles.all(axis=(1, 3)), 2, np.where(tiles.any(axis=(1, 3)), 1, 0)).astype(np.int8)


def classify_laid_out(allowed, bm, bk):
    """Flags of a `(B, H, L, S)` mask laid out as the block mask lays it: block row `(b * H + h) * lb + i`."""
    return np.concatenate([classify(allowed[b, h], bm, bk) for b in range(allowed.shape[0])
                           for h in range(allowed.shape[1])])


def qkv(rng, length, keys, heads=2, kv_heads=None, batch=None, dim=8, value_dim=4, dtype=np.float64):
    lead = () if batch is None else (batch,)
    kv_heads = kv_heads or heads
    return (rng.standard_normal((*lead, length, heads, dim)).astype(dtype),
            rng.standard_normal((*lead, keys, kv_heads, dim)).astype(dtype),
            rng.standard_normal((*lead, keys, kv_heads, value_dim)).astype(dtype))


def alibi(s, b, h, i, j):
    """ALiBi per head and a shift per batch element: wrong coordinates (laid out, not the element's) show."""
    return s - 0.1 * (h + 1) * jnp.abs(i - j).astype(s.dtype) + 0.05 * b


def alibi_bias(batch, heads, length, keys):
    b, h, i, j = np.meshgrid(np.arange(batch), np.arange(heads), np.arange(length), np.arange(keys), indexing="ij")
    return -0.1 * (h + 1) * np.abs(i - j) + 0.05 * b


def built(mask_mod, *args, **kwargs):
    """`jinsum.block_mask` built inside `jit` (one compile; eagerly every op compiles on its own)."""
    return jax.jit(lambda: jinsum.block_mask(mask_mod, *args, **kwargs))()


# --- the flags -----------------------------------------------------------------------------------------------------


def _check_slots(mask, expected):
    """The block mask's slots hold exactly the nonzero blocks of the `expected` flags grid, in row-major order,
    then padding slots (flag 0, block column 0, non-decreasing block rows)."""
    Ai, Ak, flags = np.asarray(mask.Ai), np.asarray(mask.Ak)[:, 0], np.asarray(mask.flags)[:, 0]
    rows, cols = np.nonzero(expected)
    n = len(rows)
    assert mask.Ak.shape == mask.flags.shape == (mask.capacity, 1) and mask.Ai.shape == (mask.capacity,)
    assert mask.flags.dtype == jnp.int8
    np.testing.assert_array_equal(Ai[:n], rows)
    np.testing.assert_array_equal(Ak[:n], cols)
    np.testing.assert_array_equal(flags[:n], expected[rows, cols])
    assert (flags[n:] == 0).all() and (Ak[n:] == 0).all()
    assert (np.diff(Ai) >= 0).all() and (Ai < expected.shape[0]).all()
    np.testing.assert_array_equal(np.asarray(mask.to_dense()), expected)


MASK_CASES = {
    # name: (L, S, block, kind of mask (`_mask`))
    "document_causal": (80, 80, 16, "doc"),
    "document_causal_ragged": (70, 70, 16, "doc"),  # L, S not multiples of the block
    "sliding_window": (75, 75, 8, "window"),
    "rectangular_blocks": (50, 75, (8, 16), "diagonal"),  # bm != bk, L != S
    "rectangular_blocks_tall": (45, 60, (16, 4), "window"),
}


def _mask(rng, kind, length, keys):
    i, j = grid(length, keys)
    if kind == "doc":
        doc = long_documents(rng, length)
        d = jnp.asarray(doc)
        return (lambda b, h, q, kv: (d[q] == d[kv]) & (q >= kv)), (doc[:, None] == doc[None]) & (i >= j), doc
    if kind == "window":
        return (lambda b, h, q, kv: (q - kv < 20) & (kv - q < 10)), (i - j < 20) & (j - i < 10), None
    # a band along the rectangle's diagonal
    band = 25 * length
    return (lambda b, h, q, kv: jnp.abs(q * keys - kv * length) < band), np.abs(i * keys - j * length) < band, None


@pytest.mark.parametrize("name", list(MASK_CASES))
def test_flags_equal_a_brute_force_classification(name, rng):
    length, keys, block, kind = MASK_CASES[name]
    bm, bk = (block, block) if isinstance(block, int) else block
    mask_mod, allowed, _ = _mask(rng, kind, length, keys)
    mask = built(mask_mod, length, keys, block)
    expected = classify(allowed, bm, bk)
    assert {0, 1, 2} <= set(np.unique(expected).tolist())  # every kind of block
    assert mask.shape == (length, keys) and mask.block == (bm, bk) and mask.grid == expected.shape
    assert mask.capacity == expected.size and not bool(mask.overflow)
    _check_slots(mask, expected)
    if length % bm:  # edge blocks overhang the mask: never full (the kernels must mask past L, S)
        assert (expected[-1] != 2).all()
    if keys % bk:
        assert (expected[:, -1] != 2).all()


def test_flags_per_batch_element_and_head_are_laid_out_along_the_block_rows(rng):
    B, H, L, S, bm, bk = 2, 3, 37, 45, 8, 16
    docs = np.stack([documents(rng, S, longest=30) for _ in range(B)])
    windows = np.array([4, 9, 40])
    d, w = jnp.asarray(docs), jnp.asarray(windows)
    i, j = grid(L, S)
    allowed = np.stack([np.stack([(docs[b][i] == docs[b][j]) & (i - j <= windows[h]) for h in range(H)])
                        for b in range(B)])
    mask_mod = lambda b, h, q, kv: (d[b, q] == d[b, kv]) & (q - kv <= w[h])  # noqa: E731
    for batch, heads, expected in ((B, H, allowed), (B, None, allowed[:, :1]), (None, H, allowed[:1]),
                                   (None, None, allowed[:1, :1])):
        mask = built(mask_mod, L, S, (bm, bk), batch=batch, heads=heads)
        assert mask.laid_out == (batch is not None or heads is not None)
        _check_slots(mask, classify_laid_out(expected, bm, bk))
    assert jinsum.block_mask is jinsum.block_mask


def test_built_inside_jit_equals_built_eagerly_and_from_dense(rng):
    L, S, block = 70, 62, (16, 8)
    doc = documents(rng, max(L, S))
    i, j = grid(L, S)
    allowed = (doc[:L, None] == doc[None, :S]) & (i >= j - 5)

    def build(doc):
        return jinsum.block_mask(lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv - 5), L, S, block)

    eager = build(jnp.asarray(doc))
    traced = jax.jit(lambda doc: build(doc).to_dense())(doc)
    np.testing.assert_array_equal(np.asarray(traced), np.asarray(eager.to_dense()))
    whole = jax.jit(build)(doc)  # the BlockMask itself as a jit output
    for name in ("Ai", "Ak", "flags", "overflow"):
        np.testing.assert_array_equal(np.asarray(getattr(whole, name)), np.asarray(getattr(eager, name)),
                                      err_msg=name)
    host = jinsum.BlockGroupCOO.from_dense(allowed.astype(np.float32), block_shape=block)
    Av = np.asarray(host.Av)
    stored = {(int(host.Ai[g]), int(host.Ak[g, p])) for g in range(Av.shape[0]) for p in range(Av.shape[-1])
              if Av[g, ..., p].any()}
    assert stored == set(zip(*map(np.ndarray.tolist, np.nonzero(np.asarray(traced)))))
    np.testing.assert_array_equal(np.asarray(traced), classify(allowed, *block))


def test_new_document_boundaries_reuse_the_compiled_program(rng):
    L, H = 64, 2
    q, k, v = qkv(rng, L, L, heads=H, dtype=np.float32)

    @CountingJit
    def step(doc, q, k, v):
        mask = jinsum.block_mask(lambda b, h, i, j: (doc[i] == doc[j]) & (i >= j), L, L, 16, capacity=10)
        return jinsum.attention(q, k, v, mask), mask.overflow

    i, j = grid(L, L)
    for _ in range(2):
        doc = documents(rng, L)
        out, overflow = step(doc, q, k, v)
        assert not bool(overflow)
        assert_allclose(out, reference(q, k, v, (doc[:, None] == doc[None]) & (i >= j))[0], np.float32)
    assert step.traces == 1


# --- capacity -------------------------------------------------------------------------------------------------------


def test_capacity_overflow_flag_and_the_dropped_blocks(rng):
    L = 48
    i, j = grid(L, L)
    causal = lambda b, h, q, kv: q >= kv  # noqa: E731
    needed = 6  # 3 x 3 blocks of 16, lower triangle
    assert not bool(built(causal, L, L, 16, capacity=needed).overflow)
    assert not bool(built(causal, L, L, 16, capacity=needed + 3).overflow)
    small = built(causal, L, L, 16, capacity=4)
    assert bool(small.overflow) and small.capacity == 4
    expected = classify(i >= j, 16, 16)
    kept = np.zeros_like(expected)  # the first 4 attending blocks in row-major order
    rows, cols = np.nonzero(expected)
    kept[rows[:4], cols[:4]] = expected[rows[:4], cols[:4]]
    np.testing.assert_array_equal(np.asarray(small.to_dense()), kept)
    # attention sees the kept blocks only
    with jax.enable_x64(True):
        q, k, v = qkv(rng, L, L)
        within = np.kron(kept != 0, np.ones((16, 16), bool)) & (i >= j)
        out = jax.jit(jinsum.attention)(q, k, v, small)
    assert_allclose(out, reference(q, k, v, within)[0], np.float64)


def test_eager_overflow_raises_with_the_capacity_needed():
    L = 48
    causal = lambda b, h, q, kv: q >= kv  # noqa: E731
    with pytest.raises(ValueError, match=r"jinsum.block_mask: 6 blocks attend but capacity = 4 holds only 4; pass "
                                         r"capacity >= 6 \(or None for every block\)"):
        jinsum.block_mask(causal, L, L, 16, capacity=4)
    per_head = lambda b, h, q, kv: q >= kv + 16 * h  # noqa: E731  (6 and 3 blocks)
    with pytest.raises(ValueError, match="9 blocks attend .* capacity >= 9"):
        jinsum.block_mask(per_head, L, L, 16, heads=2, capacity=8)
    exact = jinsum.block_mask(causal, L, L, 16, capacity=6)  # an exact fit
    assert not bool(exact.overflow)
    np.testing.assert_array_equal(np.asarray(exact.to_dense()), classify(np.greater_equal(*grid(L, L)), 16, 16))
    # under jit the same build returns the flag, as before
    assert bool(built(causal, L, L, 16, capacity=4).overflow)


def test_eager_attention_refuses_an_overflowed_mask(rng):
    """A mask built under jit and returned carries a concrete flag: attention outside jit refuses it, inside jit
    (the flag traced) it reads the kept blocks as before."""
    L = 48
    q, k, v = qkv(rng, L, L, dtype=np.float32)
    causal = lambda b, h, q, kv: q >= kv  # noqa: E731
    small = built(causal, L, L, 16, capacity=4)
    with pytest.raises(ValueError, match=r"the block mask overflowed: more blocks attend than its capacity = 4 "
                                         r"holds.*rebuild it with a larger capacity"):
        jinsum.attention(q, k, v, small)
    jax.jit(jinsum.attention)(q, k, v, small)
    i, j = grid(L, L)
    assert_allclose(jinsum.attention(q, k, v, built(causal, L, L, 16, capacity=6)),
                    reference(q, k, v, i >= j)[0], np.float32)


def test_overflow_is_a_checkify_error_under_check_indices(rng):
    L = 48

    def build(doc, capacity):
        mask = jinsum.block_mask(lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv), L, L, 16, capacity=capacity)
        return mask.to_dense(), mask.overflow

    one_document = np.zeros(L, np.int32)  # 6 attending blocks
    with jinsum.check_indices(True):
        checked = checkify.checkify(jax.jit(build, static_argnums=1))
        error, _ = checked(one_document, 5)
        with pytest.raises(checkify.JaxRuntimeError, match="more attending blocks than capacity = 5"):
            error.throw()
        error, _ = checked(one_document, 6)
        assert error.get() is None
        error, _ = checked(np.repeat(np.arange(3), 16).astype(np.int32), 3)  # 3 documents of a block: 3 blocks
        assert error.get() is None
        with pytest.raises(ValueError, match="6 blocks attend but capacity = 5"):  # concrete: raised at once
            build(jnp.asarray(one_document), 5)
    with jinsum.check_indices(False):  # unchecked: the flag alone says so
        flags, overflow = jax.jit(build, static_argnums=1)(one_document, 5)
        assert bool(overflow) and np.count_nonzero(np.asarray(flags)) == 5


# --- attention through a block mask against dense float64 -----------------------------------------------------------

ATTENTION_CASES = [
    dict(),
    dict(block=(16, 8), L=70, S=70),
    dict(batch=2),  # one mask shared by the batch
    dict(per_batch=True),
    dict(per_batch=True, block=(16, 8), key_mask=True, L=40),  # rows != cols of the laid-out sequence
    dict(per_head=True),
    dict(per_head=True, key_mask=True, batch=1),
    dict(per_batch=True, per_head=True, score_mod=True),
    dict(per_batch=True, score_mod=True, key_mask=True),
    dict(per_head=True, score_mod=True, kv_heads=1),
    dict(batch=2, score_mod=True, key_mask=True),
    dict(per_batch=True, per_head=True, kv_heads=1, key_mask=True, L=40, S=56),
]


def _attention_case(rng, case, dtype=np.float64):
    """`(q, k, v, mask, kwargs, allowed (B, H, L, S), bias or None)` of one case: documents, a causal rule and a
    window per head (`per_head`) or a shift of the window per batch element (`per_batch`), rows with nothing to
    attend to (query positions 5 mod 11, and whole documents when key padding removes them). With `causal_flag`
    the mask leaves the causal rule to `attention(..., causal=True)`."""
    L, S = case.get("L", 48), case.get("S", case.get("L", 48))
    per_batch, per_head = case.get("per_batch", False), case.get("per_head", False)
    B = 2 if per_batch else case.get("batch")
    H = case.get("H", 4 if case.get("kv_heads") == 2 else 3)
    q, k, v = qkv(rng, L, S, heads=H, kv_heads=case.get("kv_heads"), batch=B, dim=case.get("dim", 8), dtype=dtype)
    causal_in_mask = not case.get("causal_flag")
    nb = B or 1
    docs = np.stack([documents(rng, max(L, S)) for _ in range(nb if per_batch else 1)])
    docs = np.broadcast_to(docs, (nb, max(L, S)))
    windows = np.array([5, 12, 30, 100])[:H] if per_head else np.full(H, 100)
    shift = np.arange(nb) * 7 if per_batch else np.zeros(nb, int)
    d, w, sh = jnp.asarray(docs), jnp.asarray(windows), jnp.asarray(shift)
    b_, h_, i_, j_ = np.meshgrid(np.arange(nb), np.arange(H), np.arange(L), np.arange(S), indexing="ij")
    allowed = ((docs[b_, i_] == docs[b_, j_]) & (i_ >= j_) & (i_ - j_ <= windows[h_] + shift[b_])
               & (i_ % 11 != 5))

    d0 = d[0]

    def mask_mod(b, h, q_idx, kv_idx):  # (reading b and h only where the mask is built per batch element, head)
        same = (d[b, q_idx] == d[b, kv_idx]) if per_batch else (d0[q_idx] == d0[kv_idx])
        window = (w[h] if per_head else int(windows[0])) + (sh[b] if per_batch else 0)
        allowed = same & (q_idx - kv_idx <= window) & (q_idx % 11 != 5)
        return allowed & (q_idx >= kv_idx) if causal_in_mask else allowed

    mask = built(mask_mod, L, S, case.get("block", 16), batch=B if per_batch else None,
                 heads=H if per_head else None)
    kwargs = {} if causal_in_mask else dict(causal=True)
    if case.get("key_mask"):
        key_mask = rng.random((nb, S)) < 0.8
        key_mask[0, docs[0, :S] == docs[0, 20]] = False  # a whole document of keys gone: its queries attend to none
        kwargs["key_padding_mask"] = key_mask if B is not None else key_mask[0]
        allowed = allowed & key_mask[:, None, None, :]
    bias = None
    if case.get("score_mod"):
        kwargs["score_mod"] = alibi
        bias = alibi_bias(nb, H, L, S)
    if B is None:
        allowed, bias = allowed[0], None if bias is None else bias[0]
    return q, k, v, mask, kwargs, allowed, bias


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=_id)
def test_attention_through_a_block_mask_matches_dense_float64(case, rng):
    with jax.enable_x64(True):
        q, k, v, mask, kwargs, allowed, bias = _attention_case(rng, case)
        out, lse = jax.jit(lambda q, k, v, mask: jinsum.attention(q, k, v, mask, return_lse=True, **kwargs))(
            q, k, v, mask)
    expected, expected_lse = reference(q, k, v, allowed, bias=bias)
    assert out.shape == expected.shape and lse.shape == expected_lse.shape
    assert_allclose(out, expected, np.float64)
    assert_allclose(lse, expected_lse, np.float64)
    empty = ~np.asarray(allowed).any(-1)  # (B?, H, L): queries with nothing to attend to
    empty = np.moveaxis(np.broadcast_to(empty, expected.shape[:-3] + (q.shape[-2], q.shape[-3])), -2, -1)
    assert empty.any()
    assert (np.asarray(out)[empty] == 0).all() and np.isinf(np.asarray(lse)[empty]).all()


def test_jitted_attention_through_a_block_mask_built_outside_jit(rng):
    case = dict(per_batch=True, per_head=True, score_mod=True)
    q, k, v, mask, kwargs, allowed, bias = _attention_case(rng, case, np.float32)
    f = jax.jit(lambda mask, q, k, v: jinsum.attention(q, k, v, mask, **kwargs))
    assert_allclose(f(mask, q, k, v), reference(q, k, v, allowed, bias=bias)[0], np.float32)


def test_score_mod_capturing_per_head_slopes_through_a_laid_out_mask(rng):
    """ALiBi slopes captured by `score_mod` are read at each element's own head (heads laid out along the
    sequence) and get gradients, against jax.numpy on the dense scores in float64."""
    B, L, H = 2, 40, 3
    with jax.enable_x64(True):
        q, k, v = qkv(rng, L, L, heads=H, batch=B)
        windows = jnp.asarray([3, 9, 30])
        mask = built(lambda b, h, i, j: (i - j <= windows[h] + 5 * b) & (i >= j), L, L, 16, batch=B, heads=H)
        i, j = grid(L, L)
        allowed = np.stack([np.stack([(i - j <= [3, 9, 30][h] + 5 * b) & (i >= j) for h in range(H)])
                            for b in range(B)])
        weights = rng.standard_normal((B, L, H, 4))

        def fused(slopes):
            score_mod = lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j).astype(s.dtype)  # noqa: E731
            return jnp.sum(jinsum.attention(q, k, v, mask, score_mod=score_mod) * weights)

        def dense(slopes):
            s = jnp.einsum("blhd,bshd->bhls", q, k) / np.sqrt(8) - slopes[None, :, None, None] * np.abs(i - j)
            p = jax.nn.softmax(jnp.where(allowed, s, -jnp.inf), axis=-1)
            return jnp.sum(jnp.einsum("bhls,bshe->blhe", p, v) * weights)

        slopes = jnp.asarray([0.1, 0.25, 0.5])
        value, grad = jax.jit(jax.value_and_grad(fused))(slopes)
        expected, expected_grad = jax.jit(jax.value_and_grad(dense))(slopes)  # (eagerly: every op compiled alone)
    assert_allclose(value, expected, np.float64)
    assert_allclose(grad, expected_grad, np.float64)


@pytest.mark.parametrize("case", [dict(per_batch=True, per_head=True, score_mod=True, key_mask=True),
                                  dict(per_head=True, kv_heads=2, key_mask=True, batch=1, L=32)], ids=_id)
def test_gradients_through_a_block_mask(case, rng):
    with jax.enable_x64(True):
        q, k, v, mask, kwargs, _, _ = _attention_case(rng, case)

        def f(q, k, v):
            out, lse = jinsum.attention(q, k, v, mask, return_lse=True, **kwargs)
            return out, jnp.where(jnp.isfinite(lse), lse, 0)

        check_grads(jax.jit(f), (q, k, v), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


# --- grouped-query attention ----------------------------------------------------------------------------------------


def _gqa_pattern(rng, fmt):
    if fmt == "block":
        pattern = block_pattern(rng, length=48, keys=41, block=16, density=0.5)
        return pattern, np.asarray(pattern.todense()) != 0, dict(causal=True)
    pattern, allowed = graph_pattern(rng, 40, 33)
    return pattern, allowed, {}


@pytest.mark.parametrize("fmt,kv_heads,batch", [("block", 1, None), ("block", 2, 2), ("graph", 1, 2),
                                               ("graph", 2, None)])
def test_grouped_query_attention_equals_repeated_keys_and_values(fmt, kv_heads, batch, rng):
    H = 4
    group = H // kv_heads
    with jax.enable_x64(True):
        pattern, allowed, kwargs = _gqa_pattern(rng, fmt)
        L, S = pattern.shape[:2]
        q, k, v = qkv(rng, L, S, heads=H, kv_heads=kv_heads, batch=batch)
        repeat = lambda x: jnp.repeat(x, group, axis=-2)  # noqa: E731
        weights = rng.standard_normal(q.shape[:-1] + v.shape[-1:])  # (the output's shape)

        def f(q, k, v):
            return jinsum.attention(q, k, v, pattern, **kwargs)

        grad = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * weights), argnums=(0, 1, 2))
        # Grouped and repeated, output and gradients, in one compiled program
        out, repeated, grads, rep_grads = jax.jit(lambda q, k, v: (f(q, k, v), f(q, repeat(k), repeat(v)),
                                                                   grad(q, k, v), grad(q, repeat(k), repeat(v))))(
            q, k, v)
    i, j = grid(L, S)
    dense = allowed & (i >= j) if kwargs.get("causal") else allowed
    assert_allclose(out, reference(q, k, v, dense)[0], np.float64)
    assert_allclose(out, repeated, np.float64)
    assert_allclose(grads[0], rep_grads[0], np.float64, err_msg="dQ")
    for name, g, rep in zip("KV", grads[1:], rep_grads[1:]):
        summed = np.asarray(rep).reshape(*rep.shape[:-2], kv_heads, group, rep.shape[-1]).sum(-2)
        assert g.shape == summed.shape
        assert_allclose(g, summed, np.float64, err_msg=f"d{name}")


def test_grouped_query_gradients_check(rng):
    with jax.enable_x64(True):
        pattern, _, kwargs = _gqa_pattern(rng, "block")
        q, k, v = qkv(rng, *pattern.shape, heads=4, kv_heads=2)
        f = jax.jit(lambda q, k, v: jinsum.attention(q, k, v, pattern, **kwargs))
        check_grads(f, (q, k, v), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


def test_grouped_query_attention_with_per_head_pattern_values(rng):
    """A GroupCOO with one value per query head, `(L, S, H)`, and fewer key/value heads: query head h must read
    the pattern's head h, not its key/value head's."""
    H, kv_heads = 4, 2
    with jax.enable_x64(True):
        pattern, allowed = graph_pattern(rng, 30, 30, heads=H)
        q, k, v = qkv(rng, 30, 30, heads=H, kv_heads=kv_heads)
        out = jax.jit(jinsum.attention)(q, k, v, pattern)
    assert_allclose(out, reference(q, k, v, np.moveaxis(allowed, -1, 0))[0], np.float64)


# --- the generated kernels, in Triton's interpreter ----------------------------------------------------------------


def _compare_kernels(rng, q, k, v, pattern, kwargs, config, dtype, dense=None):
    """The interpreted forward and backward kernels against the unfused reference lowering (and, if `dense` =
    `(allowed, bias)`, the forward laid back out against the dense reference)."""
    chain, arrays, unpad = _attention.build_chain(q, k, v, pattern, **kwargs)
    assert chain.differentiable == ("Q", "K", "V")
    fused_out, finite = check_chain_kernels(chain, arrays, config, dtype, rng)
    assert not finite.all()
    if dense is not None:
        assert_allclose(unpad(jnp.asarray(fused_out)), reference(q, k, v, dense[0], bias=dense[1])[0], dtype,
                        err_msg="laid back out")


@interpreted
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda d: np.dtype(d).name)
def test_kernels_with_a_document_causal_block_mask(dtype, rng):
    pytest.importorskip("torch")
    L = 54
    doc = long_documents(rng, L)
    d = jnp.asarray(doc)
    mask = built(lambda b, h, i, j: (d[i] == d[j]) & (i >= j) & (i != 7), L, L, 16)
    flags = np.asarray(mask.to_dense())
    assert (flags == 2).any() and (flags == 1).any() and (flags == 0).any()
    q, k, v = qkv(rng, L, L, dim=16, dtype=dtype)
    i, j = grid(L, L)
    _compare_kernels(rng, q, k, v, mask, {}, ChainConfig(), dtype,
                     dense=((doc[:, None] == doc[None]) & (i >= j) & (i != 7), None))


@interpreted
def test_kernels_with_grouped_query_heads_dropout_and_small_chunks(rng):
    pytest.importorskip("torch")
    pattern = block_pattern(rng, length=48, keys=41, block=16, partial=False)
    q, k, v = qkv(rng, *pattern.shape, heads=4, kv_heads=2, dim=16, dtype=np.float32)
    _compare_kernels(rng, q, k, v, pattern, dict(causal=True, dropout=0.2, seed=5), ChainConfig(chunk=2), np.float32)


@interpreted
@pytest.mark.parametrize("case", [dict(per_batch=True, score_mod=True, key_mask=True, H=2),
                                  dict(per_head=True, kv_heads=2, H=4, batch=1)], ids=_id)
def test_kernels_with_a_laid_out_block_mask(case, rng):
    pytest.importorskip("torch")
    q, k, v, mask, kwargs, allowed, bias = _attention_case(rng, {**case, "L": 32, "dim": 16}, np.float32)
    _compare_kernels(rng, q, k, v, mask, kwargs, ChainConfig(), np.float32, dense=(allowed, bias))


# --- errors ---------------------------------------------------------------------------------------------------------


def test_mismatches_are_refused_clearly(rng):
    L = 32
    per_batch = built(lambda b, h, i, j: i >= j + b, L, L, 16, batch=2)
    q, k, v = qkv(rng, L, L, heads=4, batch=3)
    with pytest.raises(ValueError, match=r"one mask per batch element for a batch of 2 .* but got q of shape "
                                         r"\(3, 32, 4, 8\); pass q, k and v with a leading batch axis of 2"):
        jinsum.attention(q, k, v, per_batch)
    per_head = built(lambda b, h, i, j: i >= j + h, L, L, 16, heads=2)
    with pytest.raises(ValueError, match=r"built for heads=2, but got q of shape \(32, 4, 8\) .*with 4 heads; "
                                         "build it with heads=4"):
        jinsum.attention(q[0], k[0], v[0], per_head)
    causal = built(lambda b, h, i, j: i >= j, L, L, 16)
    with pytest.raises(ValueError, match="k's heads must divide q's"):
        jinsum.attention(q, k[..., :3, :], v[..., :3, :], causal)
    with pytest.raises(ValueError, match="the block mask carries its mask_mod"):
        jinsum.attention(q[0], k[0], v[0], causal, mask_mod=lambda b, h, i, j: i != j)
    with pytest.raises(ValueError, match=r"pattern must be \(L, S\) = \(32, 32\)"):
        jinsum.attention(q[0], k[0], v[0], built(lambda b, h, i, j: i >= j, L, L + 1, 16))
    for bad in (dict(block=0), dict(capacity=0), dict(batch=0)):
        with pytest.raises(ValueError, match="jinsum.block_mask: .* must be"):
            jinsum.block_mask(lambda b, h, i, j: i >= j, L, L, **{"block": 16, **bad})
    with pytest.raises(TypeError, match="must return one boolean"):
        jinsum.block_mask(lambda b, h, i, j: i - j, L, L, 16)


# --- the causal flag with a laid-out mask ----------------------------------------------------------------------


@pytest.mark.parametrize("case", [dict(per_batch=True, block=(8, 16), L=40), dict(per_head=True, kv_heads=2)], ids=_id)
def test_causal_flag_with_a_laid_out_block_mask_is_refused(case, rng):
    """Positions in the laid-out sequence are not the queries' and keys' own (segments may differ in length and
    number), so the causal rule belongs in the mask itself."""
    q, k, v, mask, kwargs, _, _ = _attention_case(rng, {**case, "causal_flag": True})
    assert kwargs["causal"]
    with pytest.raises(ValueError, match="put the causal rule into its mask_mod"):
        jinsum.attention(q, k, v, mask, **kwargs)
