"""The XLA lowering on the expression catalog against the float64 brute-force reference and jax.experimental.sparse."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

import jinsum
from jinsum.testing import assert_allclose, reference, specs_in

from _catalog import CATALOG, group_spmm

DTYPES = [np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float64)]


def _run(expression, operands, jit=True):
    call = lambda ops: jinsum.einsum(expression, **ops)  # noqa: E731
    return (jax.jit(call) if jit else call)(operands)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CATALOG, ids=repr)
def test_catalog_matches_float64_reference(case, dtype, rng):
    with jax.enable_x64(dtype == np.float64):
        operands = case.make(rng, dtype)
        actual = _run(case.expression, operands)
        assert actual.dtype == dtype
        assert_allclose(actual, reference(case.expression, **operands), dtype)


@pytest.mark.parametrize("case", CATALOG, ids=repr)
def test_catalog_eager_equals_jit(case, rng):
    operands = case.make(rng, np.float32)
    np.testing.assert_allclose(_run(case.expression, operands, jit=False), _run(case.expression, operands),
                               rtol=1e-6, atol=1e-6)


def _bcoo(Ai, Ak, Av, shape):
    rows = np.repeat(Ai, Ak.shape[1])
    return sparse.BCOO((jnp.asarray(Av.reshape(-1)), jnp.asarray(np.stack([rows, Ak.reshape(-1)], 1))), shape=shape)


def test_group_spmm_matches_bcoo_matmul(rng):
    ops = group_spmm(rng, np.float32, M=40, K=30, N=16, G=60, P=4)
    expected = ops["C"] + _bcoo(ops["Ai"], ops["Ak"], ops["Av"], (40, 30)) @ ops["B"]
    assert_allclose(_run("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", ops), expected, np.float32)


def test_coo_spmm_matches_bcoo_matmul(rng):
    E, M, K = 50, 12, 9
    R, Col = rng.integers(0, M, E).astype(np.int32), rng.integers(0, K, E).astype(np.int32)
    V, B = rng.standard_normal(E).astype(np.float32), rng.standard_normal((K, 7)).astype(np.float32)
    A = sparse.BCOO((jnp.asarray(V), jnp.asarray(np.stack([R, Col], 1))), shape=(M, K))
    out = jinsum.einsum("C[R[e],n] += V[e] * B[Col[e],n]", C=jnp.zeros((M, 7)), R=R, Col=Col, V=V, B=B)
    assert_allclose(out, A @ B, np.float32)


def test_sddmm_matches_bcoo_dot_general_sampled(rng):
    ops = group_spmm(rng, np.float32, M=20, K=15, G=25, P=3)
    X, Y = rng.standard_normal((20, 8)).astype(np.float32), rng.standard_normal((15, 8)).astype(np.float32)
    indices = jnp.asarray(np.stack([np.repeat(ops["Ai"], 3), ops["Ak"].reshape(-1)], 1))
    expected = sparse.bcoo_dot_general_sampled(X, Y, indices, dimension_numbers=(([1], [1]), ([], [])))
    S = jinsum.einsum("S[g,p] = X[Ai[g],d] * Y[Ak[g,p],d]", Ai=ops["Ai"], Ak=ops["Ak"], X=X, Y=Y)
    assert_allclose(S.reshape(-1), expected, np.float32)


def test_lhs_may_be_omitted_when_its_extents_are_known(rng):
    W, Idx = rng.standard_normal((10, 4)).astype(np.float32), rng.integers(0, 10, (6, 3)).astype(np.int32)
    out = jinsum.einsum("O[b,d] += W[Idx[b,p],d]", W=W, Idx=Idx)
    np.testing.assert_allclose(out, W[Idx].sum(1), rtol=1e-6)
    with pytest.raises(jinsum.ExpressionError, match=r"pass C=\.\.\., the array to write into") as info:
        jinsum.einsum("C[Ai[g],n] += B[g,n]", Ai=np.zeros(3, np.int32), B=np.ones((3, 2), np.float32))
    assert str(info.value).splitlines()[-1].strip() == "^^^^^"


def test_lhs_given_as_a_shape_starts_from_zeros(rng):
    operands = group_spmm(rng, np.float32)
    C = operands.pop("C")
    expression = "C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]"
    shape = jax.ShapeDtypeStruct(C.shape, C.dtype)
    out = jinsum.einsum(expression, C=shape, **operands)
    assert out.dtype == C.dtype
    assert_allclose(out, reference(expression, C=np.zeros_like(C), **operands), np.float32)
    [spec] = specs_in(lambda ops: jinsum.einsum(expression, C=shape, **ops), operands)
    assert spec.zero_lhs  # kernels need not read it
    [spec] = specs_in(lambda ops: jinsum.einsum(expression, C=C, **ops), operands)
    assert not spec.zero_lhs


def test_set_overwrites_only_its_targets(rng):
    C = rng.standard_normal((6, 2)).astype(np.float32)
    X = rng.standard_normal((3, 2)).astype(np.float32)
    P = np.array([4, 0, 2], np.int32)
    out = np.asarray(jinsum.einsum("C[P[i],n] = X[i,n]", C=C, P=P, X=X))
    np.testing.assert_array_equal(out[P], X)
    np.testing.assert_array_equal(out[[1, 3, 5]], C[[1, 3, 5]])


def test_mixed_value_dtypes_write_in_the_lhs_dtype(rng):
    ops = group_spmm(rng, np.float32)
    ops["B"] = ops["B"].astype(jnp.bfloat16)
    out = _run("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", ops)
    assert out.dtype == np.float32
    assert_allclose(out, reference("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", **ops), jnp.bfloat16)


def test_out_of_range_indices_are_reported_before_tracing(rng):
    ops = group_spmm(rng, np.float32, K=5)
    ops["Ak"][3, 1] = 5
    with pytest.raises(ValueError, match=r"index array Ak holds 5 at position \(3, 1\), out of range for dimension 0 "
                                         r"of B \(shape \(5, 6\)\) in B\[Ak\[g,p\],n\]; every index there must lie "
                                         r"in \[0, 5\)"):
        jinsum.einsum("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", **ops)
    ops["Ak"][3, 1] = -1
    with pytest.raises(ValueError, match="holds -1"):
        jinsum.einsum("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", **ops)


def test_out_of_range_indices_under_jit_read_zero_and_drop_writes():
    C, B = jnp.zeros((3, 2)), jnp.ones((4, 2))
    Ai, Ak, Av = jnp.array([0, 7], jnp.int32), jnp.array([[1, -1], [9, 2]], jnp.int32), jnp.ones((2, 2))
    out = jax.jit(lambda Ai, Ak: jinsum.einsum("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", C=C, Ai=Ai, Ak=Ak, Av=Av,
                                               B=B))(Ai, Ak)
    np.testing.assert_array_equal(out, [[1, 1], [0, 0], [0, 0]])


def test_indirect_notation_rejects_positional_operands():
    with pytest.raises(TypeError, match="takes operands by name"):
        jinsum.einsum("C[i] += A[i]", np.ones(3))


def test_jaxpr_shows_one_primitive_with_the_expression(rng):
    ops = group_spmm(rng, np.float32)
    jaxpr = jax.make_jaxpr(lambda o: jinsum.einsum("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", **o))(ops)
    assert "jinsum[spec=Spec('C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]')]" in str(jaxpr).replace("\n", "")
