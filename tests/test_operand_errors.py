"""Operands that do not fit the statement are reported before anything is traced, with a caret into the expression
where one token is to blame: missing, unused (typos), None, and formats passed where arrays are read."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp

import jinsum
from jinsum import ExpressionError

from _catalog import group_spmm

SPMM = "C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]"


@pytest.fixture
def A():
    return jinsum.GroupCOO.from_scipy(sp.random(6, 5, 0.4, format="csr", dtype=np.float32, random_state=0))


def _caret(error: ExpressionError) -> str:
    """The text of the expression above the caret line."""
    source, carets = str(error).splitlines()[1:3]
    start = carets.index("^")
    return source[start:start + carets.count("^")]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_missing_operand_is_named_with_a_caret(jit):
    call = lambda C, A: jinsum.einsum("C[i] += A[i] * Z[i]", C=C, A=A)  # noqa: E731
    with pytest.raises(ExpressionError, match=r"unknown operand 'Z': pass it by name.*got operands \['A', 'C'\]") \
            as info:
        (jax.jit(call) if jit else call)(jnp.zeros(3), jnp.ones(3))
    assert _caret(info.value) == "Z[i]"


def test_a_misspelt_operand_is_suggested():
    with pytest.raises(ExpressionError, match=r"unknown operand 'B'.*did you mean to pass b= as B=\?"):
        jinsum.einsum("C[i] += A[i] * B[i]", C=jnp.zeros(3), A=jnp.ones(3), b=jnp.ones(3))


def test_an_unused_operand_is_an_error_not_silently_dropped():
    ops = dict(C=jnp.zeros(3), A=jnp.ones(3), B=jnp.ones(3), b=jnp.full(3, 2.0))
    with pytest.raises(ExpressionError, match=r"operand\(s\) b= \(did you mean B=\?\) do not appear in the "
                                              r"expression, whose operands are \['C', 'A', 'B'\]"):
        jinsum.einsum("C[i] += A[i] * B[i]", **ops)


def test_none_is_not_an_operand(rng):
    with pytest.raises(ExpressionError, match=r"operand B= is None"):
        jinsum.einsum(SPMM, **{**group_spmm(rng, np.float32), "B": None})


def test_a_format_where_the_expression_reads_an_array(A):
    with pytest.raises(ExpressionError, match=r"X= is a GroupCOO, which binds Xi, Xk and Xv .* name those in the "
                                              r"expression") as info:
        jinsum.einsum("C[i] += X[i] * B[i]", C=jnp.zeros(6), X=A, B=jnp.ones(6))
    assert _caret(info.value) == "X[i]"


def test_a_format_passed_under_the_name_of_its_row_indices(A):
    with pytest.raises(ExpressionError, match=r"Ai= is a GroupCOO, where the expression reads an array; pass the "
                                              r"format as A=") as info:
        jinsum.einsum(SPMM, C=jnp.zeros((6, 2)), Ai=A, Ak=A.Ak, Av=A.Av, B=jnp.ones((5, 2)))
    assert _caret(info.value) == "Ai[g]"


def test_a_format_none_of_whose_arrays_appear(A, rng):
    with pytest.raises(ExpressionError, match=r"format operand X= binds Xi, Xk and Xv, none of which appear"):
        jinsum.einsum(SPMM, X=A, **group_spmm(rng, np.float32))


def test_a_format_whose_statement_reads_some_of_its_arrays(A):
    """SDDMM reads a format's rows and columns, not its values: the unread part is not an unused operand."""
    X, Y = jnp.ones((6, 3)), jnp.ones((5, 3))
    S = jinsum.einsum("S[g,p] = X[Ai[g],d] * Y[Ak[g,p],d]", A=A, X=X, Y=Y)
    assert S.shape == A.Av.shape
    out = jinsum.einsum(SPMM, C=jax.ShapeDtypeStruct((6, 2), jnp.float32), A=A.with_transpose(), B=jnp.ones((5, 2)))
    np.testing.assert_allclose(out, A.todense() @ np.ones((5, 2)), rtol=1e-6)


def test_numpy_subscripts_take_operands_by_position():
    with pytest.raises(TypeError, match=r"take operands by position; got keyword operands \[.A.\]"):
        jinsum.einsum("ik,kn->in", A=jnp.ones((2, 2)))


def test_a_statement_that_lost_its_brackets_is_not_taken_for_numpy_subscripts():
    """Found by the mutation fuzzer: `]` or `=` without `[` is a malformed indirect statement (a caret error),
    not NumPy subscripts (a TypeError about keyword operands)."""
    with pytest.raises(ExpressionError, match=r"'Outv4' must be accessed with brackets"):
        jinsum.einsum("Outv4] += X0v4]", Out=np.zeros(3), X0=np.zeros(3))


def test_the_expression_must_be_a_string(A):
    with pytest.raises(TypeError, match="the expression must be a string, got int"):
        jinsum.einsum(3, A=A)


def test_matmul_takes_dense_operands_as_numpy_does(A):
    """Array-likes are converted and integer operands promoted to the product's floating type, as in `jnp.matmul`
    (they used to fail with an AttributeError and an error naming jinsum's internal operand `X1`)."""
    dense = np.asarray(A.todense())
    np.testing.assert_allclose(A @ ([[1.0, 2.0]] * 5), dense @ np.ones((5, 1)) @ [[1.0, 2.0]], rtol=1e-6)
    B = np.arange(15).reshape(5, 3)
    out = A @ B
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, dense @ B, rtol=1e-6)
    np.testing.assert_allclose(np.arange(6) @ A, np.arange(6) @ dense, rtol=1e-6)
