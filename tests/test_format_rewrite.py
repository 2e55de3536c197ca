"""Format-agnostic calls: NumPy subscripts (and `@`) over GroupCOO / BlockGroupCOO, against dense SciPy math."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp

import jinsum
from jinsum.testing import assert_allclose


def _matrix(rng, shape=(23, 17), density=0.2):
    A = sp.random(*shape, density=density, random_state=rng, format="csr", dtype=np.float64)
    keep = np.ones(shape[0])
    keep[3] = 0  # an empty row
    A = (sp.diags(keep) @ A).tocsr()
    A.eliminate_zeros()
    return A


@pytest.fixture(params=["group", "block"])
def sparse_pair(request, rng):
    """A random sparse matrix as a jinsum format (float32) and as a float64 dense reference."""
    A = _matrix(rng)
    if request.param == "group":
        fmt = jinsum.GroupCOO.from_scipy(A.astype(np.float32), group_size=4)
    else:
        fmt = jinsum.BlockGroupCOO.from_scipy(A.astype(np.float32), block_shape=(4, 3), group_size=2)
    return fmt, A.astype(np.float32).toarray().astype(np.float64)


def test_spmm_sparse_on_the_left(sparse_pair, rng):
    A, dense = sparse_pair
    B = rng.standard_normal((17, 6)).astype(np.float32)
    assert_allclose(jinsum.einsum("ik,kn->in", A, B), dense @ B, np.float32)
    assert_allclose(jax.jit(lambda A, B: A @ B)(A, B), dense @ B, np.float32)


def test_spmv_and_implicit_output(sparse_pair, rng):
    A, dense = sparse_pair
    v = rng.standard_normal(17).astype(np.float32)
    assert_allclose(jinsum.einsum("ik,k->i", A, v), dense @ v, np.float32)
    assert_allclose(jinsum.einsum("ik,k", A, v), dense @ v, np.float32)
    assert_allclose(A @ v, dense @ v, np.float32)


def test_spmm_sparse_on_the_right(sparse_pair, rng):
    A, dense = sparse_pair
    X = rng.standard_normal((5, 23)).astype(np.float32)
    assert_allclose(jinsum.einsum("mi,ik->mk", X, A), X @ dense, np.float32)
    assert_allclose(X @ A, X @ dense, np.float32)


def test_transposed_output(sparse_pair, rng):
    A, dense = sparse_pair
    B = rng.standard_normal((17, 6)).astype(np.float32)
    assert_allclose(jinsum.einsum("ik,kn->ni", A, B), (dense @ B).T, np.float32)


def test_multi_head_spmm_with_dense_head_axis(sparse_pair, rng):
    A, dense = sparse_pair
    B = rng.standard_normal((17, 3, 4)).astype(np.float32)
    assert_allclose(jinsum.einsum("ik,khn->ihn", A, B), np.einsum("ik,khn->ihn", dense, B), np.float32)


def test_sddmm_keeps_the_sparsity_of_the_mask(sparse_pair, rng):
    A, dense = sparse_pair
    X, Y = rng.standard_normal((23, 5)).astype(np.float32), rng.standard_normal((17, 5)).astype(np.float32)
    S = jinsum.einsum("ij,ik,jk->ij", A, X, Y)
    assert type(S) is type(A) and S.shape == A.shape
    np.testing.assert_array_equal(S.Ai, A.Ai)
    assert_allclose(S.todense(), dense * (X @ Y.T), np.float32)


def test_per_head_values_group_coo(rng):
    A = _matrix(rng, (11, 9))
    base = jinsum.GroupCOO.from_scipy(A.astype(np.float32))
    heads = rng.standard_normal((*base.Av.shape, 3)).astype(np.float32)
    A3 = base.with_values(heads)
    B = rng.standard_normal((9, 3, 4)).astype(np.float32)
    dense = np.asarray(A3.todense(), np.float64)  # (11, 9, 3)
    assert_allclose(jinsum.einsum("ikh,khn->ihn", A3, B), np.einsum("ikh,khn->ihn", dense, B), np.float32)


def test_grad_through_a_format(rng):
    A = jinsum.GroupCOO.from_scipy(_matrix(rng).astype(np.float32))
    B = rng.standard_normal((17, 6)).astype(np.float32)
    # allow_int: the format's index arrays are pytree leaves too; they get float0 (no) gradients.
    grad_A, grad_B = jax.grad(lambda A, B: jnp.sum((A @ B) ** 2), argnums=(0, 1), allow_int=True)(A, B)
    dense = np.asarray(A.todense())
    out = dense @ B
    assert_allclose(grad_B, 2 * dense.T @ out, np.float32)
    mask = (np.asarray(A.Av) != 0)
    expected_Av = np.where(mask, (2 * out @ B.T)[np.repeat(np.asarray(A.Ai)[:, None], A.group_size, 1),
                                                  np.asarray(A.Ak)], 0)
    assert_allclose(np.where(mask, grad_A.Av, 0), expected_Av, np.float32)


def test_format_operand_by_name_in_indirect_notation(rng):
    A = jinsum.GroupCOO.from_scipy(_matrix(rng).astype(np.float32))
    B = rng.standard_normal((17, 6)).astype(np.float32)
    C = jinsum.einsum("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", C=jnp.zeros((23, 6)), A=A, B=B)
    assert_allclose(C, np.asarray(A.todense()) @ B, np.float32)
    spec = jax.make_jaxpr(lambda A: jinsum.einsum("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", C=jnp.zeros((23, 6)),
                                                  A=A, B=B))(A).eqns[-1].params["spec"]
    assert spec.sorted_indices == {"Ai"} and spec.lhs_sorted_index == "Ai"


def test_dense_only_subscripts_fall_through_to_jnp(rng):
    X, Y = rng.standard_normal((3, 4)), rng.standard_normal((4, 5))
    # A float32 product (x64 is off) against float64: within float32's tolerance of the largest element, not element
    # by element. An element near 0 (one here is 7e-4, the sum of terms near 1) has a relative error set by the order
    # in which XLA's dot kernel, chosen per CPU, adds the terms: 0.55 to 0.83 of rtol=1e-4 over the possible orders.
    assert_allclose(jinsum.einsum("ij,jk->ik", X, Y), X @ Y, np.float32)


@pytest.mark.parametrize("subscripts, message", [
    ("ik,kn->in", "multiplies 2 sparse operands"),
    ("ii,in->in", "takes the diagonal"),
    ("...k,kn->in", "ellipses"),
    ("ik,kn,nm->im", "names 3 operand"),
    ("ik,kn->in", "has size"),
])
def test_unsupported_or_malformed_subscripts(subscripts, message, rng):
    A = jinsum.GroupCOO.from_scipy(_matrix(rng, (6, 6)).astype(np.float32))
    if message == "has size":
        operands = (A, np.ones((5, 2), np.float32))
    elif message == "multiplies 2 sparse operands":
        operands = (A, A)
    else:
        operands = (A, np.ones((6, 2), np.float32))
    with pytest.raises((ValueError, NotImplementedError), match=message):
        jinsum.einsum(subscripts, *operands)


def test_block_format_with_shape_not_a_multiple_of_the_block(rng):
    A = _matrix(rng, (10, 7), density=0.3)
    fmt = jinsum.BlockGroupCOO.from_scipy(A.astype(np.float32), block_shape=(4, 4))
    B = rng.standard_normal((7, 3)).astype(np.float32)
    assert_allclose(fmt @ B, A.toarray() @ B, np.float32)
