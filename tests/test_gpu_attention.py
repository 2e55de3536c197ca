"""Fused attention chains through real generated kernels on a CUDA GPU: forward and backward against the unfused
chain (the XLA reference lowering on the same device), bf16/fp16/fp32, both pattern formats. Run with
`pytest -m gpu`; skipped elsewhere."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jinsum
import jinsum.nn as jnn
from jinsum import _attention
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
    assert "triton_kernel_call" in lowered
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
    pattern = jnn.block_pattern(4096, 128, local_blocks=1, global_blocks=1, random_blocks=2)
    q, k, v = (rng.standard_normal((4096, 4, 64)).astype(np.float32) for _ in range(3))
    expected = jax.jit(lambda q, k, v: jinsum.attention(q, k, v, pattern))(q, k, v)
    bf16 = jax.jit(lambda q, k, v: jinsum.attention(q, k, v, pattern))(*(x.astype(jnp.bfloat16) for x in (q, k, v)))
    assert_allclose(bf16, np.asarray(expected, np.float64), jnp.bfloat16)


def test_graph_attention_with_hub_rows_at_scale(rng):
    """A power-law graph whose hub rows span many pieces (atomics in the backward, a combine in the forward)."""
    rows = np.minimum(rng.zipf(1.6, 60_000), 3000) - 1
    cols = rng.integers(0, 3000, 60_000)
    A = jnn.adjacency(np.stack([cols, rows]), 3000)
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
    A = jnn.adjacency(np.stack([rng.integers(0, 1000, 20_000), rows]), 1000)
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

    assert "triton_kernel_call" in jax.jit(fused).lower(A, q, k, v, d_out).as_text()
    for name, a, b in zip(["out", "dq", "dk", "dv"], fused(A, q, k, v, d_out), reference):
        assert_allclose(a, np.asarray(b, np.float64), np.float32, err_msg=name)
