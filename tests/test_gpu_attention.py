"""Fused attention chains through real generated kernels on a CUDA GPU: forward and backward against the unfused
chain (the XLA reference lowering on the same device), bf16/fp16/fp32, both pattern formats. Run with
`pytest -m gpu`; skipped elsewhere."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jinsum
import jinsum.graphs as jg
from jinsum import _attention
from jinsum._lowering._launch import KERNEL_NODE
from jinsum._attention import _chain_reference
from jinsum.testing import assert_allclose

from conftest import ON_GPU
from test_attention import _case, _id, alibi, leaky, softcap

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")]
DTYPES = [np.float32, jnp.bfloat16, np.float16]
CASES = [("block", dict()), ("block", dict(causal=True, score_mod=softcap, batch=2)),
         ("block", dict(key_mask=True, dropout=0.2)), ("graph", dict(score_mod=leaky, self_loops=True, dropout=0.3)),
         ("graph", dict(heads_in_pattern=True, causal=True, batch=2)), ("graph", dict(key_mask=True, score_mod=alibi))]


@pytest.fixture(autouse=True)
def no_fallback():
    with warnings.catch_warnings():
        warnings.simplefilter("error", jinsum.FallbackWarning)
        yield


def _fused_and_reference(q, k, v, pattern, kwargs, d_out):
    chain, arrays, unpad = _attention.build_chain(q, k, v, pattern, **kwargs)

    def fused(q, k, v):
        return jinsum.attention(q, k, v, pattern, **kwargs)

    def reference(q, k, v):
        shaped = {n: x.reshape(arrays[n].shape) if n in "QKV" else x for n, x in
                  {**arrays, "Q": _pad(q, arrays["Q"]), "K": _pad(k, arrays["K"]), "V": _pad(v, arrays["V"])}.items()}
        return unpad(_chain_reference.forward(chain, shaped)[0])

    results = []
    for fn in (fused, reference):
        results.append(jax.jit(lambda q, k, v, t, fn=fn: (fn(q, k, v), *jax.vjp(fn, q, k, v)[1](t)))(q, k, v, d_out))
    lowered = jax.jit(fused).lower(q, k, v).as_text()
    assert KERNEL_NODE in lowered
    return results


def _pad(x, like):
    """`x` `(..., T, H, D)` zero-padded to the blocked layout of `like` `(..., T', [b,] H, D)`."""
    rows = int(np.prod(like.shape[x.ndim - 3:-2]))
    pad = [(0, 0)] * x.ndim
    pad[x.ndim - 3] = (0, rows - x.shape[x.ndim - 3])
    return jnp.pad(x, pad)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fmt,case", CASES, ids=_id)
def test_fused_forward_and_backward_on_gpu(fmt, case, dtype, rng):
    (q, k, v, pattern), kwargs, _ = _case(rng, fmt, case, dtype)
    kwargs.update(dropout=case.get("dropout", 0.0), seed=5)
    d_out = rng.standard_normal(q.shape[:-1] + v.shape[-1:]).astype(dtype)
    fused, reference = _fused_and_reference(q, k, v, pattern, kwargs, d_out)
    for name, a, b in zip(["out", "dq", "dk", "dv"], fused, reference):
        assert a.dtype == dtype
        assert_allclose(a, np.asarray(b, np.float64), dtype, err_msg=name)


def test_bigbird_attention_at_scale(rng):
    """Blocks of 128, 64-wide heads, a global row of 32 blocks split into pieces: bf16 against float32."""
    pattern = jinsum.block_pattern(4096, 128, local_blocks=1, global_blocks=1, random_blocks=2)
    q, k, v = (rng.standard_normal((4096, 4, 64)).astype(np.float32) for _ in range(3))
    expected = jax.jit(lambda q, k, v: jinsum.attention(q, k, v, pattern))(q, k, v)
    bf16 = jax.jit(lambda q, k, v: jinsum.attention(q, k, v, pattern))(*(x.astype(jnp.bfloat16) for x in (q, k, v)))
    assert_allclose(bf16, np.asarray(expected, np.float64), jnp.bfloat16)


def test_graph_attention_with_hub_rows_at_scale(rng):
    """A power-law graph whose hub rows span many pieces (atomics in the backward, a combine in the forward)."""
    rows = np.minimum(rng.zipf(1.6, 60_000), 3000) - 1
    cols = rng.integers(0, 3000, 60_000)
    A = jg.adjacency(np.stack([cols, rows]), 3000)
    q, k, v = (rng.standard_normal((3000, 4, s)).astype(np.float32) for s in (2, 2, 64))
    kwargs = dict(score_mod=leaky, self_loops=True)
    d_out = rng.standard_normal((3000, 4, 64)).astype(np.float32)
    fused, reference = _fused_and_reference(q, k, v, A, kwargs, d_out)
    for name, a, b in zip(["out", "dq", "dk", "dv"], fused, reference):
        assert_allclose(a, np.asarray(b, np.float64), np.float32, err_msg=name)


@pytest.mark.parametrize("transposed", [True, False], ids=["transposed", "sorted-in-step"])
def test_graph_attention_with_the_pattern_as_an_argument(transposed, rng):
    """A pattern passed to the jitted function: its schedule is XLA ops (with the transposed index: no sort)."""
    rows = np.minimum(rng.zipf(1.6, 20_000), 1000) - 1
    A = jg.adjacency(np.stack([rng.integers(0, 1000, 20_000), rows]), 1000)
    if not transposed:
        A = A.with_values(A.Av)
    q, k, v = (rng.standard_normal((1000, 4, s)).astype(np.float32) for s in (2, 2, 64))
    d_out = rng.standard_normal((1000, 4, 64)).astype(np.float32)
    kwargs = dict(score_mod=leaky, self_loops=True)
    _, reference = _fused_and_reference(q, k, v, A, kwargs, d_out)

    @jax.jit
    def fused(A, q, k, v, t):
        out, vjp = jax.vjp(lambda q, k, v: jinsum.attention(q, k, v, A, **kwargs), q, k, v)
        return (out, *vjp(t))

    assert KERNEL_NODE in jax.jit(fused).lower(A, q, k, v, d_out).as_text()
    for name, a, b in zip(["out", "dq", "dk", "dv"], fused(A, q, k, v, d_out), reference):
        assert_allclose(a, np.asarray(b, np.float64), np.float32, err_msg=name)


# --- masks from data: mask_mod over captured arrays, block masks built on the device, GQA -----------------------

def _documents(rng, length, count):
    cuts = np.sort(rng.choice(np.arange(1, length), count - 1, replace=False))
    starts = np.zeros(length, np.int32)
    starts[cuts] = 1
    return jnp.asarray(np.cumsum(starts).astype(np.int32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 64), (8, 2, 128)], ids=["mha-64", "gqa-128"])
def test_document_mask_built_on_the_device(heads, kv_heads, dim, dtype, rng):
    """A causal document mask built inside jit (partial blocks evaluate the mask in registers), a captured
    relative-position bias table with its gradient, and grouped-query heads: against the unfused chain in
    float32 on the same device."""
    length = 1000  # not a multiple of the block
    doc = _documents(rng, length, 6)
    table = jnp.asarray(rng.standard_normal((heads, 2 * length)) * 0.1, jnp.float32)
    q = jnp.asarray(rng.standard_normal((length, heads, dim)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((length, kv_heads, dim)), dtype) for _ in range(2))
    d_out = jnp.asarray(rng.standard_normal((length, heads, dim)), dtype)

    def attend(q, k, v, table, doc):
        mask = jinsum.sequence_mask(length, 128, document_ids=doc, causal=True)
        return jinsum.attention(q, k, v, mask, score_mod=lambda s, b, h, i, j: s + table[h, i - j + length])

    def run(q, k, v, table, doc, t):
        out, vjp = jax.vjp(lambda q, k, v, table: attend(q, k, v, table, doc), q, k, v, table)
        return (out, *vjp(t))

    fused = jax.jit(run)
    assert KERNEL_NODE in fused.lower(q, k, v, table, doc, d_out).as_text()
    results = fused(q, k, v, table, doc, d_out)
    with jinsum.fuse(False):  # the unfused chain
        wide = [x.astype(jnp.float32) for x in (q, k, v)]
        expected = jax.jit(run)(*wide, table, doc, d_out.astype(jnp.float32))
    for name, a, b in zip(["out", "dq", "dk", "dv", "dtable"], results, expected):
        assert_allclose(a, np.asarray(b, np.float64), dtype if name != "dtable" else jnp.bfloat16, err_msg=name)
    # New document boundaries: the same compiled program (jax.jit(run) above shares the cache, in float32).
    size = fused._cache_size()
    fused(q, k, v, table, _documents(rng, length, 9), d_out)
    assert fused._cache_size() == size


def test_block_mask_per_batch_and_sliding_window_on_gpu(rng):
    """One document mask per batch element (laid out along the sequence) with a sliding window, bf16."""
    length, batch = 700, 3
    docs = jnp.stack([_documents(rng, length, n) for n in (2, 5, 9)])
    q, k, v = (jnp.asarray(rng.standard_normal((batch, length, 4, 64)), jnp.bfloat16) for _ in range(3))
    mask = jinsum.sequence_mask(length, 128, document_ids=docs, causal=True, window=200)
    out = jax.jit(lambda q, k, v: jinsum.attention(q, k, v, mask))(q, k, v)
    i, j = np.meshgrid(np.arange(length), np.arange(length), indexing="ij")
    d = np.asarray(docs)
    allowed = (d[:, :, None] == d[:, None, :]) & (i >= j) & (i - j < 200)
    wide = [np.asarray(x, np.float64) for x in (q, k, v)]
    s = np.einsum("blhd,bshd->bhls", wide[0], wide[1]) / 8.0
    s = np.where(allowed[:, None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    expected = np.einsum("bhls,bshe->blhe", w / w.sum(-1, keepdims=True), wide[2])
    assert_allclose(out, expected, jnp.bfloat16)


# --- the Hopper forms (sm_90: Gluon, warp-specialised): the forward and both backward kernels ----------------------

def _reference_attention(q, k, v, allowed, d_out):
    """Float64 attention of `q (B, L, H, D)` over `k, v (B, L, Hkv, D)` where `allowed (L, L)`, with its log-sum-exp
    and the gradients of `sum(out * d_out)`: (out, lse (B, L, H), dq, dk, dv)."""
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    group = q.shape[2] // k.shape[2]
    keys, values = (np.repeat(x, group, axis=2) for x in (k, v))
    scale = 1 / np.sqrt(q.shape[-1])
    s = np.where(allowed, np.einsum("blhd,bshd->bhls", q, keys) * scale, -np.inf)
    top = np.where(allowed.any(-1)[:, None], s.max(-1, keepdims=True), 0)
    w = np.exp(s - top)
    total = w.sum(-1, keepdims=True)
    p = w / np.where(total > 0, total, 1)
    out = np.einsum("bhls,bshe->blhe", p, values)
    lse = np.moveaxis(np.where(total[..., 0] > 0, np.log(total[..., 0]) + top[..., 0], np.inf), 1, 2)
    dp = np.einsum("blhe,bshe->bhls", d_out, values)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
    dq = np.einsum("bhls,bshd->blhd", ds, keys)
    dk = np.einsum("bhls,blhd->bshd", ds, q).reshape(*k.shape[:2], k.shape[2], group, -1).sum(3)
    dv = np.einsum("bhls,blhe->bshe", p, d_out).reshape(*v.shape[:2], v.shape[2], group, -1).sum(3)
    return out, lse, dq, dk, dv


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("length,heads,kv_heads,dim,batch", [(1000, 8, 2, 128, None), (384, 4, 4, 128, 2),
                                                             (2500, 4, 1, 128, None)],
                         ids=["gqa-odd", "mha-batch", "mqa-long"])
def test_hopper_forms_against_float64(length, heads, kv_heads, dim, batch, dtype, rng):
    """On sm_90 the forward and both backward kernels run in their Hopper forms (asserted by the kernels' names in
    the lowered program): causal documents, a query position that attends to nothing (its output 0, its
    log-sum-exp inf, its gradients 0), lengths off the block, grouped and multi-query heads, a batch; output,
    log-sum-exp and the gradients of a random cotangent against a float64 reference."""
    from jinsum.kernels import is_hopper  # noqa: PLC0415

    if not is_hopper():
        pytest.skip("the Hopper form runs on sm_90 only")
    lead = () if batch is None else (batch,)
    doc = _documents(rng, length, 4)
    q = jnp.asarray(rng.standard_normal((*lead, length, heads, dim)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((*lead, length, kv_heads, dim)), dtype) for _ in range(2))
    d_out = jnp.asarray(rng.standard_normal(q.shape), dtype)
    mask = jinsum.block_mask(lambda b, h, i, j: (doc[i] == doc[j]) & (i >= j) & (i != 5), length, length, 128)

    def attend(q, k, v):
        return jinsum.attention(q, k, v, mask, return_lse=True)

    def forward_and_gradients(q, k, v, d_out):
        (out, lse), pullback = jax.vjp(attend, q, k, v)
        return out, lse, *pullback((d_out, jnp.zeros_like(lse)))

    run = jax.jit(forward_and_gradients)
    lowered = run.lower(q, k, v, d_out).as_text()
    assert all(f"jinsum_attention_{kind}_hopper" in lowered for kind in ("forward", "dq", "dkdv"))
    out, lse, dq, dk, dv = run(q, k, v, d_out)
    d = np.asarray(doc)
    i, j = np.meshgrid(np.arange(length), np.arange(length), indexing="ij")
    allowed = (d[:, None] == d[None, :]) & (i >= j) & (i != 5)
    flat = [np.asarray(x, np.float64).reshape(-1, length, *x.shape[-2:]) for x in (q, k, v, d_out)]
    expected = _reference_attention(*flat[:3], allowed, flat[3])
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), expected):
        if name == "lse":
            np.testing.assert_allclose(np.asarray(got).reshape(want.shape), want, rtol=2e-3, atol=2e-3)
        else:
            assert_allclose(got, want.reshape(got.shape), dtype, err_msg=name)
    assert not np.asarray(out, np.float32)[..., 5, :, :].any()
    assert not np.asarray(dq, np.float32)[..., 5, :, :].any()


@pytest.mark.parametrize("dim", [64, 128])
def test_hopper_backward_with_long_rows_and_keys_in_pieces(dim, rng):
    """BigBird at 4,096 positions: its global block row and column (32 blocks) are cut into pieces whose partial
    gradients the Hopper forms keep for the sum kernels; grouped heads; against a float64 reference."""
    from jinsum.kernels import is_hopper  # noqa: PLC0415
    from jinsum.kernels._chain_plan import HOPPER_HEADS  # noqa: PLC0415

    if not is_hopper():
        pytest.skip("the Hopper form runs on sm_90 only")
    length = 4096
    pattern = jinsum.block_pattern(length, 128, local_blocks=1, global_blocks=1, random_blocks=2)
    q = jnp.asarray(rng.standard_normal((length, 4, dim)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((length, 2, dim)), jnp.bfloat16) for _ in range(2))
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)

    def forward_and_gradients(q, k, v, d_out):
        out, pullback = jax.vjp(lambda q, k, v: jinsum.attention(q, k, v, pattern), q, k, v)
        return out, *pullback(d_out)

    run = jax.jit(forward_and_gradients)
    lowered = run.lower(q, k, v, d_out).as_text()
    for kind in ("dq", "dkdv"):
        assert (f"jinsum_attention_{kind}_hopper" in lowered) == (dim in HOPPER_HEADS)
    allowed = np.asarray(pattern.todense()) != 0
    flat = [np.asarray(x, np.float64)[None] for x in (q, k, v, d_out)]
    out, lse, dq, dk, dv = _reference_attention(*flat[:3], allowed, flat[3])
    for name, got, want in zip(("out", "dq", "dk", "dv"), run(q, k, v, d_out), (out, dq, dk, dv)):
        assert_allclose(got, want[0], jnp.bfloat16, err_msg=name)


@pytest.mark.parametrize("page,heads,kv_heads,dim", [(16, 32, 8, 128), (64, 8, 1, 64)])
def test_paged_attention_on_the_gpu(page, heads, kv_heads, dim, rng):
    # jinsum.paged_attention's generated kernels (pages as key blocks: Triton form at 16, Hopper form at 64 where it
    # applies) against float64, bf16: decoding, then a ragged prefill after cached prefixes, windowed.
    from test_paged_attention import paged, reference  # noqa: PLC0415

    k_pages, v_pages, table, lengths = paged(rng, [300, 1, 64, 129, 0], page, kv_heads, dim, dtype=jnp.bfloat16)
    q = rng.standard_normal((5, heads, dim)).astype(jnp.bfloat16)
    out = jax.jit(jinsum.paged_attention)(q, k_pages, v_pages, table, lengths)
    expected = reference(q, k_pages, v_pages, table, lengths, np.arange(6))
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=3e-2, rtol=0)
    new = np.array([40, 1, 64, 7, 0], np.int32)
    starts = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    q = rng.standard_normal((starts[-1], heads, dim)).astype(jnp.bfloat16)
    out = jax.jit(lambda *a: jinsum.paged_attention(*a[:5], query_starts=a[5], window=100))(
        q, k_pages, v_pages, table, lengths, starts)
    expected = reference(q, k_pages, v_pages, table, lengths, starts, window=100)
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=3e-2, rtol=0)
