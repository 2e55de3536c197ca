"""Grouped products (a mixture of experts' projections, HeteroLinear) on a CUDA GPU against float64 NumPy: on sm_90
their Hopper form (`jinsum.kernels.hopper.grouped_rows`, Gluon, which has no interpreter), elsewhere the Triton form.
Run with `pytest -m gpu`; skipped without a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jinsum
from jinsum.kernels import is_hopper
from jinsum.nn import route_tokens, routed_linear

from conftest import ON_GPU

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")]

GATHERED = "H[g,p,h] += X[Ak[g,p],c] * W[Ai[g],c,h]"
IN_ORDER = "O[g,p,n] += H[g,p,h] * W[Ai[g],h,n]"
SCATTER = "dX[Ak[g,p],c] += dH[g,p,h] * W[Ai[g],c,h]"
SUMS = "dW[Ai[g],c,h] += X[Ak[g,p],c] * dH[g,p,h]"
TOLERANCE = {"bfloat16": 2e-2, "float16": 2e-3}


def _routing(tokens, experts, top_k, rows, rng, all_to=None, empty_group=False):
    """(Ai, Ak): each token's `top_k` distinct experts (or every token to `all_to`), an expert's tokens cut into
    groups of `rows` slots, the last one padded with -1; optionally a group of padding only."""
    if all_to is not None:
        chosen = np.full((tokens, 1), all_to)
    else:
        chosen = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    ai, ak = [], []
    for e in range(experts):
        mine = np.flatnonzero((chosen == e).any(axis=1))
        for start in range(0, len(mine), rows):
            slots = np.full(rows, -1)
            slots[:len(mine[start:start + rows])] = mine[start:start + rows]
            ai.append(e)
            ak.append(slots)
        if empty_group and e == experts // 2:
            ai.append(e)
            ak.append(np.full(rows, -1))
    return np.asarray(ai, np.int32), np.asarray(ak, np.int32).reshape(-1, rows)


def _reference(x, w, ai, ak):
    """float64 `H[g,p] = x[ak[g,p]] @ w[ai[g]]`, 0 for padding (slots out of range)."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    present = (ak >= 0) & (ak < x.shape[0])
    rows = np.where(present[..., None], x[np.where(present, ak, 0)], 0.0)
    return np.einsum("gpc,gch->gph", rows, w[ai])


def _close(got, want, dtype):
    got = np.asarray(got, np.float64)
    scale = max(np.abs(want).max(), 1e-30)
    assert np.abs(got - want).max() / scale < TOLERANCE[np.dtype(dtype).name], np.abs(got - want).max() / scale


def _runs_hopper_form(fn, *args, has_form=True):
    """On sm_90, `fn` runs a grouped product or sum in the Hopper form where it has the form, elsewhere not."""
    source = jinsum.triton_source(fn, *args)
    hopper = "grouped_rows(" in source or "grouped_sums(" in source
    assert hopper == (is_hopper() and has_form), source[:2000]


CASES = {
    "top2-of-4-column-tail": dict(tokens=1000, experts=4, top_k=2, rows=128, c=256, n=384),
    "64-rows-empty-group": dict(tokens=700, experts=3, top_k=1, rows=64, c=128, n=200, empty_group=True),
    "one-expert-holds-every-token": dict(tokens=515, experts=4, top_k=1, rows=128, c=192, n=256, all_to=2),
    "128-experts-top8": dict(tokens=1024, experts=128, top_k=8, rows=64, c=128, n=64),
    "five-tokens": dict(tokens=5, experts=2, top_k=1, rows=128, c=64, n=136),
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_grouped_products_against_float64(case, dtype):
    options = dict(CASES[case])
    c, n = options.pop("c"), options.pop("n")
    rng = np.random.default_rng(0)
    ai, ak = _routing(rng=rng, **options)
    experts = options["experts"]
    x = jnp.asarray(rng.standard_normal((options["tokens"], c)), dtype)
    w = jnp.asarray(rng.standard_normal((experts, c, n)) / np.sqrt(c), dtype)
    ak_jit = jnp.asarray(ak)
    if case == "top2-of-4-column-tail":
        ak_jit = ak_jit.at[0, 5].set(options["tokens"] + 3)  # a slot out of range reads zeros
        ak = np.asarray(ak_jit)

    def gathered(x, w, ak):
        return jinsum.einsum(GATHERED, Ak=ak, Ai=ai, X=x, W=w, sorted_indices=("Ai",),
                             H=jax.ShapeDtypeStruct((*ak.shape, n), x.dtype))

    _runs_hopper_form(gathered, x, w, ak_jit)
    want = _reference(x, w, ai, ak)
    _close(jax.jit(gathered)(x, w, ak_jit), want, dtype)

    rows = jnp.asarray(rng.standard_normal((*ak.shape, c)), dtype)  # the rows in grouped order

    def in_order(rows, w):
        return jinsum.einsum(IN_ORDER, H=rows, Ai=ai, W=w, sorted_indices=("Ai",),
                             O=jax.ShapeDtypeStruct((*ak.shape, n), rows.dtype))

    _runs_hopper_form(in_order, rows, w)
    want = np.einsum("gpc,gch->gph", np.asarray(rows, np.float64), np.asarray(w, np.float64)[ai])
    _close(jax.jit(in_order)(rows, w), want, dtype)

    # The input gradient of the gathered product: each entry's products by the transposed matrix, added into its
    # token's row (the products stored in grouped order first: the Hopper form, the matrices transposed)
    dh = jnp.asarray(rng.standard_normal((*ak.shape, n)), dtype)

    def input_gradient(dh, w, ak):
        return jinsum.einsum(SCATTER, Ak=ak, Ai=ai, dH=dh, W=w, sorted_indices=("Ai",),
                             dX=jax.ShapeDtypeStruct((options["tokens"], c), dh.dtype))

    _runs_hopper_form(input_gradient, dh, w, ak_jit, has_form=n % 64 == 0)  # (its products' reduction is n)
    present = (ak >= 0) & (ak < options["tokens"])
    products = np.einsum("gph,gch->gpc", np.asarray(dh, np.float64), np.asarray(w, np.float64)[ai])
    want = np.zeros((options["tokens"], c))
    np.add.at(want, ak[present], products[present])
    _close(jax.jit(input_gradient)(dh, w, ak_jit), want, dtype)

    # The weight gradient: each expert's sum over its groups' rows (the rows gathered first, then summed per
    # expert in the Hopper form where c is a multiple of 128); experts without groups get zeros
    def weight_gradient(x, dh, ak):
        return jinsum.einsum(SUMS, Ak=ak, Ai=ai, X=x, dH=dh, sorted_indices=("Ai",),
                             dW=jax.ShapeDtypeStruct((experts, c, n), x.dtype))

    _runs_hopper_form(weight_gradient, x, dh, ak_jit, has_form=c % 128 == 0)
    rows = np.where(present[..., None], np.asarray(x, np.float64)[np.where(present, ak, 0)], 0.0)
    want = np.zeros((experts, c, n))
    np.add.at(want, ai, np.einsum("gpc,gph->gch", rows, np.asarray(dh, np.float64)))
    _close(jax.jit(weight_gradient)(x, dh, ak_jit), want, dtype)


def test_a_grouped_product_with_an_epilogue_applies_it_in_the_kernel():
    """HeteroLinear's form: each group's bias added to its rows' products (a captured array)."""
    rng = np.random.default_rng(1)
    ai, ak = _routing(900, 5, 1, 128, rng)
    x = jnp.asarray(rng.standard_normal((900, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((5, 128, 320)) / 11, jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal((len(ai), 320)), jnp.float32)

    def product(x, w, bias):
        return jinsum.einsum(GATHERED, Ak=ak, Ai=ai, X=x, W=w, sorted_indices=("Ai",),
                             H=jax.ShapeDtypeStruct((*ak.shape, 320), x.dtype),
                             epilogue=lambda v, g, p, h: jnp.tanh(v + bias[g, h]))

    _runs_hopper_form(product, x, w, bias)
    want = np.tanh(_reference(x, w, ai, ak) + np.asarray(bias, np.float64)[:, None, :])
    _close(jax.jit(product)(x, w, bias), want, jnp.bfloat16)


def test_routed_linear_gradients_against_float64():
    """A mixture of single matrices: the forward's grouped product (the Hopper form on sm_90) and the backward's
    statements, against float64 gradients of the same routing."""
    rng = np.random.default_rng(2)
    tokens, experts, c, n = 2048, 8, 256, 192
    x = jnp.asarray(rng.standard_normal((tokens, c)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((experts, c, n)) / 16, jnp.bfloat16)
    logits = jnp.asarray(rng.standard_normal((tokens, experts)), jnp.float32)
    combine = route_tokens(logits, 2).combine.astype(jnp.bfloat16)  # (bf16 weights: a bf16 product)
    dy = jnp.asarray(rng.standard_normal((tokens, n)), jnp.bfloat16)

    @jax.jit
    def grads(x, w, dy):
        y, pullback = jax.vjp(lambda x, w: routed_linear(x, combine, w), x, w)
        return (y, *pullback(dy))

    _runs_hopper_form(lambda x, w: routed_linear(x, combine, w), x, w)
    weights = np.zeros((tokens, experts))
    dense = np.asarray(combine.todense(), np.float64)  # (experts, tokens)
    weights[:] = dense.T
    x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
    y = np.einsum("te,tc,ecn->tn", weights, x64, w64)
    dx = np.einsum("te,tn,ecn->tc", weights, dy64, w64)
    dw = np.einsum("te,tc,tn->ecn", weights, x64, dy64)
    for got, want in zip(grads(x, w, dy), (y, dx, dw)):
        _close(got, want, jnp.bfloat16)
