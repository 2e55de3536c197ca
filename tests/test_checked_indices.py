"""`jinsum.check_indices`: index arrays checked under jit with `jax.experimental.checkify`, so a corrupt index inside
a jitted model is found by name, position and bound (concrete arrays are checked on the host regardless)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jinsum

SPMM = "C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]"
Ai = jnp.array([0, 0, 2], jnp.int32)
Av = jnp.arange(1.0, 7.0).reshape(3, 2)
B = jnp.arange(20.0).reshape(5, 4)
Ak = jnp.array([[0, 1], [2, 3], [4, 4]], jnp.int32)


def _spmm(Ak, Ai=Ai, Av=Av):
    return jinsum.einsum(SPMM, C=jnp.zeros((3, 4)), Ai=Ai, Ak=Ak, Av=Av, B=B, sorted_indices=("Ai",))


@pytest.fixture(autouse=True)
def checked():
    with jinsum.check_indices(True):
        yield


def test_an_out_of_range_index_under_jit_is_named_with_its_position_and_bound():
    spmm = checkify.checkify(jax.jit(_spmm))
    error, _ = spmm(Ak.at[2, 0].set(9))
    with pytest.raises(checkify.JaxRuntimeError, match=r"index array Ak holds 9 at position \(2, 0\), out of range "
                                                       r"for dimension 0 of B \(shape \(5, 4\)\) in B\[Ak\[g,p\],n\]; "
                                                       r"every index there must lie in \[0, 5\)"):
        error.throw()
    error, _ = spmm(Ak.at[0, 1].set(-1))
    assert "holds -1 at position (0, 1)" in error.get()


def test_in_range_indices_pass_and_give_the_unchecked_result():
    error, out = checkify.checkify(jax.jit(_spmm))(Ak)
    assert error.get() is None
    with jinsum.check_indices(False):
        np.testing.assert_array_equal(out, jax.jit(_spmm)(Ak))


def test_a_declared_sorted_index_that_decreases():
    error, _ = checkify.checkify(jax.jit(lambda Ai: _spmm(Ak, Ai=Ai)))(jnp.array([0, 2, 1], jnp.int32))
    assert error.get().startswith("jinsum: Ai is declared sorted, but Ai[1] = 2 > Ai[2] = 1")


def test_a_format_built_inside_jit_and_the_backward_are_checked():
    def loss(Av, Ak):
        A = jinsum.GroupCOO(Ai, Ak, Av, (3, 5))  # traced arrays: the constructor cannot check their values
        return jnp.sum(A @ B)

    grad = checkify.checkify(jax.jit(jax.grad(loss)))
    error, _ = grad(Av, Ak.at[1, 1].set(5))
    assert "index array Ak holds 5 at position (1, 1)" in error.get()
    error, g = grad(Av, Ak)
    assert error.get() is None
    np.testing.assert_allclose(g, np.asarray(B).sum(1)[np.asarray(Ak)])


def test_without_checkify_the_checks_cannot_be_staged():
    with pytest.raises(ValueError, match="checkify"):
        jax.jit(_spmm)(Ak)


def test_the_switch_is_part_of_the_jit_key():
    spmm = jax.jit(_spmm)
    with jinsum.check_indices(False):
        spmm(Ak.at[2, 0].set(9))  # unchecked: the write is dropped, no error
    with pytest.raises(ValueError, match="checkify"):
        spmm(Ak)  # checked again: traced anew, with checks that need checkify


def test_attention_is_checked_where_it_is_bound():
    # The chain's index arrays are checked when jinsum.attention binds it (its lowerings hold no check, which
    # checkify could not stage there): a block pattern's column past the keys is named; a good one passes.
    q = jnp.ones((32, 2, 16))
    pattern = jinsum.BlockGroupCOO.from_dense(np.tril(np.ones((32, 32), np.float32)), block_shape=(16, 16))
    attend = checkify.checkify(jax.jit(lambda q, Ak: jinsum.attention(
        q, q, q, jinsum.BlockGroupCOO(pattern.Ai, Ak, pattern.Av, pattern.shape))))
    error, out = attend(q, pattern.Ak)
    error.throw()
    np.testing.assert_allclose(out, jinsum.attention(q, q, q, pattern), atol=1e-6)
    error, _ = attend(q, pattern.Ak.at[-1, 0].set(7))
    with pytest.raises(checkify.JaxRuntimeError, match=r"index array Ak holds 7 at position"):
        error.throw()
