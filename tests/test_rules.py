"""The primitive's rules: JVP, transpose (grad, vjp, hessian), batching (vmap), all under jit, against references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jinsum
from jinsum.testing import assert_allclose, check_vmap, specs_in

from _catalog import CATALOG, group_spmm


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def _as_function(case, operands):
    """The case as a function of its linear value operands (the others held fixed)."""
    def fn(*values):
        return jinsum.einsum(case.expression, **{**operands, **dict(zip(case.differentiated, values))})
    return fn, tuple(operands[name] for name in case.differentiated)


@pytest.mark.parametrize("case", CATALOG, ids=repr)
def test_check_grads_orders_1_and_2(case, rng):
    fn, values = _as_function(case, case.make(rng, np.float64))
    check_grads(jax.jit(fn), values, order=2, modes=("fwd", "rev"))


@pytest.mark.parametrize("case", CATALOG, ids=repr)
def test_vmap_over_each_value_operand_equals_a_loop(case, rng):
    """A batch of each value operand, along its first and after its last axis, against a loop over it (as
    `check_vmap` checks it; every batch and loop in one compiled program)."""
    fn, values = _as_function(case, case.make(rng, np.float64))
    batches = [(k, axis) for k, value in enumerate(values) for axis in (0, value.ndim)]

    @jax.jit
    def vmapped_and_looped(values):
        results = []
        for k, axis in batches:
            batched = jnp.stack([values[k] * (b + 1) + b for b in range(3)], axis=axis)
            in_axes = [None] * len(values)
            in_axes[k] = axis
            looped = [fn(*values[:k], jnp.take(batched, b, axis=axis), *values[k + 1:]) for b in range(3)]
            results.append((jax.vmap(fn, in_axes)(*values[:k], batched, *values[k + 1:]), jnp.stack(looped)))
        return results

    for (k, axis), (vmapped, looped) in zip(batches, vmapped_and_looped(values)):
        assert_allclose(vmapped, looped, np.float64, err_msg=f"vmap vs loop: {case.differentiated[k]}, axis {axis}")


@pytest.mark.parametrize("case", [c for c in CATALOG if c.name in ("group_spmm", "rgcn", "nested", "sddmm")],
                         ids=repr)
def test_vmap_over_an_index_array_and_values_together(case, rng):
    draws = [case.make(rng, np.float64) for _ in range(3)]
    index = next(n for n in ("Ak", "C", "P") if n in draws[0] and np.issubdtype(draws[0][n].dtype, np.integer))
    value = case.differentiated[-1]

    def fn(index_array, value_array):
        return jinsum.einsum(case.expression, **{**draws[0], index: index_array, value: value_array})

    args = (np.stack([d[index] for d in draws]), np.stack([d[value] for d in draws], axis=-1))
    check_vmap(jax.jit(fn), args, (0, value_array_axis := args[1].ndim - 1), out_axes=0)
    del value_array_axis


def test_nested_vmap(rng):
    ops = group_spmm(rng, np.float64)
    fn = lambda Av, B: jinsum.einsum("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", **{**ops, "Av": Av, "B": B})  # noqa
    Avs = np.stack([ops["Av"] * (b + 1) for b in range(2)])
    Bs = np.stack([ops["B"] - b for b in range(3)])
    out = jax.vmap(jax.vmap(fn, (None, 0)), (0, None))(Avs, Bs)
    expected = np.stack([np.stack([fn(a, b) for b in Bs]) for a in Avs])
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)


def test_grad_of_spmm_is_the_transposed_indirect_einsum(rng):
    ops = group_spmm(rng, np.float64)
    loss = lambda B: jinsum.einsum("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", **{**ops, "B": B}).sum()  # noqa
    jaxpr = str(jax.make_jaxpr(jax.grad(loss))(ops["B"]))
    assert "B[Ak[g,p],n] += Av[g,p] * C[Ai[g],n]" in jaxpr
    loss_av = lambda Av: jinsum.einsum("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", **{**ops, "Av": Av}).sum()  # noqa
    assert "Av[g,p] += B[Ak[g,p],n] * C[Ai[g],n]" in str(jax.make_jaxpr(jax.grad(loss_av))(ops["Av"]))


def test_derived_statements_into_fresh_zeros_say_so(rng):
    ops = group_spmm(rng, np.float64)
    A = jinsum.GroupCOO(ops["Ai"], ops["Ak"], ops["Av"], shape=(ops["C"].shape[0], ops["B"].shape[0]))
    specs = specs_in(jax.grad(lambda B: jnp.sum((A @ B) ** 2)), ops["B"])
    assert [(str(s.statement), s.zero_lhs) for s in specs] == [
        ("Out[Ai[_g],n] += Av[_g,_p] * X1[Ak[_g,_p],n]", True),  # A @ B writes into zeros it made
        ("dX1[Ak[_g,_p],n] += Av[_g,_p] * Out[Ai[_g],n]", True)]  # so does the transpose (the cotangent of B)
    tangents = specs_in(lambda B, dB: jax.jvp(lambda B: A @ B, (B,), (dB,)), ops["B"], ops["B"])
    assert [s.zero_lhs for s in tangents] == [True, True]  # the tangent chain starts from a zero tangent
    [spec] = specs_in(jax.vmap(lambda B: A @ B), np.stack([ops["B"]] * 2))
    assert spec.zero_lhs


def test_hessian_of_a_scalar_function_of_the_values(rng):
    ops = group_spmm(rng, np.float64, M=5, K=4, N=3, G=4, P=2)
    expression = "C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]"

    def loss(Av):
        return jnp.sum(jinsum.einsum(expression, **{**ops, "Av": Av}) ** 2)

    def dense_loss(Av):
        A = jnp.zeros((5, 4)).at[ops["Ai"][:, None], ops["Ak"]].add(Av)
        return jnp.sum((ops["C"] + A @ ops["B"]) ** 2)

    np.testing.assert_allclose(jax.jit(jax.hessian(loss))(ops["Av"]), jax.jit(jax.hessian(dense_loss))(ops["Av"]),
                               rtol=1e-10, atol=1e-10)


def test_vjp_and_linear_transpose(rng):
    ops = group_spmm(rng, np.float64)
    expression = "C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]"
    spmm = lambda B: jinsum.einsum(expression, **{**ops, "B": B, "C": jnp.zeros_like(ops["C"])})  # noqa
    A = np.zeros((13, 11))
    np.add.at(A, (np.repeat(ops["Ai"], 4), ops["Ak"].reshape(-1)), ops["Av"].reshape(-1))
    ct = rng.standard_normal(ops["C"].shape)
    _, vjp = jax.vjp(spmm, ops["B"])
    np.testing.assert_allclose(vjp(ct)[0], A.T @ ct, rtol=1e-12, atol=1e-12)
    (transposed,) = jax.linear_transpose(spmm, ops["B"])(ct)
    np.testing.assert_allclose(transposed, A.T @ ct, rtol=1e-12, atol=1e-12)


def test_set_passes_cotangent_only_to_unwritten_lhs_elements(rng):
    C, X = rng.standard_normal((6, 2)), rng.standard_normal((3, 2))
    P = np.array([4, 0, 2], np.int32)
    grad_C = jax.grad(lambda C: jnp.sum(jinsum.einsum("C[P[i],n] = X[i,n]", C=C, P=P, X=X) ** 2))(C)
    expected = 2 * C
    expected[P] = 0
    np.testing.assert_allclose(grad_C, expected)


def test_differentiating_an_index_array_is_an_error(rng):
    ops = group_spmm(rng, np.float64)
    fn = lambda Ak: jinsum.einsum("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", **{**ops, "Ak": Ak}).sum()  # noqa
    with pytest.raises(TypeError, match="int32"):
        jax.grad(fn)(ops["Ak"])
