"""`max=` and `min=`: the notation, both lowerings against brute-force float64 NumPy (`np.maximum.at`), every
generated kernel in Triton's interpreter (and its winners), derivatives at the winners (ties to the first term),
vmap, a format's padding, NaN, and deterministic mode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
import scipy.sparse as sp

import jinsum
from jinsum._frontend import _einsum
from jinsum._lowering import _xla
from jinsum._rules import _primitive
from jinsum._lang import ExpressionError, parse
from jinsum.testing import assert_allclose, check_vmap, kernel_specs_in, reference

from _catalog import EXTREMA as CASES
from _catalog import extreme_spmm
from conftest import ON_GPU

# XLA's lowering of a statement as one compiled program (op by op, each of its operations compiled alone)
_xla_evaluate = jax.jit(_xla.evaluate, static_argnames="spec")

M, K, N = 13, 11, 6  # extreme_spmm's
DTYPES = [np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16)]


def _prepare(case, operands, **flags):
    sorted_rows = tuple(n for n in ("Ai", "b") if n in operands)
    statement, arrays, options = _einsum.prepare(case.expression, operands, sorted_indices=sorted_rows)
    return statement, arrays, {**options, **flags}


def _winners_reference(case, operands) -> np.ndarray:
    """`Spec.winners` by brute force: per output element, `count - a` for the first assignment `a` (row-major over
    the reduced variables) whose product, rounded to the result's dtype, equals the result."""
    statement, arrays, flags = _prepare(case, operands)
    spec = _primitive.make_spec(statement, arrays, **flags)
    result = jinsum.einsum(case.expression, **operands)
    out = np.zeros(spec.lhs.shape, np.int64)
    names, extents = spec.reduced_variables, [spec.extent[v] for v in spec.reduced_variables]
    plain = [v for v in spec.loop_variables if v not in names]
    dtype = np.dtype(spec.lhs.dtype)
    for loop in np.ndindex(*[spec.extent[v] for v in plain]):
        for flat, assignment in enumerate(np.ndindex(*extents)):
            env = {**dict(zip(plain, loop)), **dict(zip(names, assignment))}
            value = np.prod([_at(f, operands, env) for f in statement.factors])
            target = tuple(_at(i, operands, env) if not hasattr(i, "name") else env[i.name]
                           for i in statement.lhs.indices)
            if out[target] == 0 and np.asarray(value, np.float32).astype(dtype) == np.asarray(result)[target]:
                out[target] = spec.term_count - flat
    return out


def _at(access, operands, env):
    index = tuple(env[i.name] if hasattr(i, "name") else _at(i, operands, env) for i in access.indices)
    return np.asarray(operands[access.tensor])[index].astype(np.float64 if operands[access.tensor].dtype.kind == "f"
                                                               else np.int64)


# --- the notation ----------------------------------------------------------------------------------------------

def test_reductions_parse_and_print():
    statement = parse("C[Ai[g],n]max=Av[g,p]*B[Ak[g,p],n]")
    assert (statement.reduction, statement.accumulate) == ("max", True)
    assert str(statement) == "C[Ai[g],n] max= Av[g,p] * B[Ak[g,p],n]"
    assert parse("C[i] min= A[i]").reduction == "min"
    assert parse("C[i] += A[i]") != parse("C[i] max= A[i]")
    assert parse("max[i] = min[i]").factors[0].tensor == "min"  # the operators need their '='


@pytest.mark.parametrize("text, message, caret", [
    ("C[i] -= A[i]", "'-=' is not an operator", "-"),
    ("C[i] max A[i]", "expected '=', '\\+=', 'max=' or 'min='", "max"),
    ("C[i] max= A[i,j] * B[i,k]", "max= over independent factors", "B[i,k]"),
    ("C[i] min= A[i,j] * B[j,k] * D[i,l]", "min= over independent factors", "D[i,l]"),
])
def test_reduction_errors_point_at_the_problem(text, message, caret):
    shapes = dict(C=(3,), A=(3, 4), B=(4, 5), D=(3, 2))
    operands = {n: np.zeros(s, np.float32) for n, s in shapes.items() if f"{n}[" in text}
    if "B[i,k]" in text:
        operands["B"] = np.zeros((3, 5), np.float32)
    with pytest.raises(ExpressionError, match=message) as info:
        jinsum.einsum(text, **operands)
    assert caret in str(info.value).splitlines()[1][str(info.value).splitlines()[2].index("^"):]


def test_shared_summed_variables_are_one_reduction():
    A, B = np.arange(12.0).reshape(3, 4) - 5, np.arange(20.0).reshape(4, 5) - 9
    out = jinsum.einsum("C[i,n] max= A[i,k] * B[k,n]", A=A, B=B)
    np.testing.assert_array_equal(out, (A[:, :, None] * B[None]).max(axis=1))


# --- values ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [*DTYPES, np.dtype(np.float64)], ids=str)
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_xla_lowering_matches_reference(case, dtype, rng):
    with jax.enable_x64(dtype == np.float64):
        operands = case.make(rng, dtype)
        actual = jinsum.einsum(case.expression, **operands)
        assert actual.dtype == dtype
        assert_allclose(actual, reference(case.expression, **operands), dtype)


def test_an_omitted_left_hand_side_starts_at_the_identity(rng):
    operands = {k: v for k, v in extreme_spmm(rng, np.float32).items() if k not in ("C", "Av")}
    rows = jax.ShapeDtypeStruct((M, N), np.float32)
    high = jinsum.einsum("C[Ai[g],n] max= B[Ak[g,p],n]", C=rows, **operands)
    low = jinsum.einsum("C[Ai[g],n] min= B[Ak[g,p],n]", C=rows, **operands)
    empty = np.setdiff1d(np.arange(M), operands["Ai"])
    assert empty.size and (np.asarray(high)[empty] == -np.inf).all() and (np.asarray(low)[empty] == np.inf).all()
    assert np.isfinite(np.asarray(high)[operands["Ai"]]).all()


def test_a_format_reduces_over_its_entries_only(rng):
    """Group padding (value 0) and explicit zeros take no part: with negative products, a padded 0 would
    otherwise win every row's maximum."""
    dense = np.where(rng.random((M, K)) < 0.3, rng.uniform(0.5, 2, (M, K)), 0)
    dense[3] = 0  # an empty row
    A = jinsum.GroupCOO.from_scipy(sp.csr_matrix(dense), group_size=3)
    assert (np.asarray(A.Av) == 0).any()  # there is padding
    B = -rng.uniform(1, 2, (K, N))
    out = jinsum.einsum("C[Ai[g],n] max= Av[g,p] * B[Ak[g,p],n]", A=A, B=B,
                        C=jax.ShapeDtypeStruct((M, N), np.float32))
    expected = np.where((dense != 0)[:, :, None], dense[:, :, None] * B[None], -np.inf).max(axis=1)
    assert_allclose(out, expected, np.float32)


def test_nan_terms_propagate(rng):
    operands = extreme_spmm(rng, np.float32)
    operands["B"][operands["Ak"][5, 1], 2] = np.nan
    row = operands["Ai"][5]
    out = np.asarray(jinsum.einsum("C[Ai[g],n] max= Av[g,p] * B[Ak[g,p],n]", **operands))
    assert np.isnan(out[row, 2]) and np.isnan(out).sum() == np.isnan(out[:, 2]).sum()


# --- kernels in the interpreter --------------------------------------------------------------------------------

@pytest.mark.skipif(ON_GPU, reason="the interpreter runs where no GPU is (test_gpu.py runs the kernels)")
@pytest.mark.parametrize("config", ["default", "stress", "owned", "split", "tile"])
@pytest.mark.parametrize("dtype", [*DTYPES, np.dtype(np.float64)], ids=str)
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_kernels_and_their_winners_match(case, dtype, config, rng):
    pytest.importorskip("torch")
    if dtype == np.float64 and config != "default":
        pytest.skip("float64 once, with the default plan")
    from jinsum.kernels import KernelConfig  # noqa: PLC0415 (after the importorskip above)

    config = dict(default=KernelConfig(), stress=KernelConfig(block=4, block_rows=2, window=3, num_stages=2),
                  owned=KernelConfig(schedule="owned", window=2), split=KernelConfig(schedule="split"),
                  tile=KernelConfig(schedule="tile", window=3))[config]
    with jax.enable_x64(dtype == np.float64):
        _check_kernel_and_winners(case, case.make(rng, dtype), dtype, config)


def _check_kernel_and_winners(case, operands, dtype, config):
    from jinsum._lowering._triton import interpret  # noqa: PLC0415 (only where torch was found)

    statement, arrays, flags = _prepare(case, operands)
    spec = _primitive.make_spec(statement, arrays, **flags)
    actual = interpret(spec, operands, config)
    assert actual.dtype == dtype
    assert_allclose(actual, reference(case.expression, **operands), dtype)
    if dtype == jnp.bfloat16:
        return  # (Triton 3.6's interpreter rounds float32 to bfloat16 toward zero, XLA and GPUs to nearest: the
        #          terms that equal a result differ; test_gpu.py compares the GPU's winners)
    result = {**operands, statement.lhs.tensor: actual}
    winners = _primitive.make_spec(statement, {**arrays, statement.lhs.tensor: actual}, **flags, winners=True)
    xla = _xla_evaluate(*(jnp.asarray(result[n]) for n in winners.names), spec=winners)
    np.testing.assert_array_equal(interpret(winners, result, config), xla)


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_winners_are_the_first_equal_terms(case):
    """Small integers: many ties, each resolved to the first assignment (row-major over the reduced variables)."""
    rng = np.random.default_rng(0)
    operands = {k: (np.round(2 * v).astype(np.float32) if v.dtype.kind == "f" else v)
                for k, v in case.make(rng, np.float32).items()}
    statement, arrays, flags = _prepare(case, operands)
    result = jinsum.einsum(case.expression, **operands)
    spec = _primitive.make_spec(statement, {**arrays, statement.lhs.tensor: result}, **flags, winners=True)
    actual = _xla_evaluate(*(result if n == spec.lhs.name else arrays[n] for n in spec.names), spec=spec)
    np.testing.assert_array_equal(actual, _winners_reference(case, operands))


# --- derivatives and vmap --------------------------------------------------------------------------------------

def _as_function(case, operands):
    statement, arrays, flags = _prepare(case, operands)

    def fn(*values):
        return _primitive.bind(statement, {**arrays, **dict(zip(case.differentiated, values))}, **flags)

    return fn, tuple(arrays[n] for n in case.differentiated)


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_grads_away_from_ties(case, rng):
    with jax.enable_x64(True):
        operands = case.make(rng, np.float64)
        fn, values = _as_function(case, operands)
        values = tuple(jnp.where(jnp.isinf(v), -5.0, v) for v in values)  # (finite differences of -inf)
        jax.test_util.check_grads(jax.jit(fn), values, order=2, modes=["fwd", "rev"], eps=1e-4)


def test_ties_send_the_whole_gradient_to_the_first_term():
    B = jnp.array([[1.0, 2.0], [1.0, 0.0], [3.0, 2.0]])
    Ak = jnp.array([[0, 1, 2]], jnp.int32)  # one group: row 0 takes the maximum of B's three rows

    def fn(B):
        return jinsum.einsum("C[Ai[g],n] max= B[Ak[g,p],n]", Ai=jnp.zeros(1, jnp.int32), Ak=Ak, B=B,
                             C=jax.ShapeDtypeStruct((1, 2), jnp.float32))

    np.testing.assert_array_equal(fn(B), [[3.0, 2.0]])
    np.testing.assert_array_equal(jax.grad(lambda B: fn(B).sum())(B), [[0, 1], [0, 0], [1, 0]])


def test_the_initial_value_keeps_its_gradient_where_it_stands():
    C = jnp.array([5.0, -5.0, 0.0])
    A = jnp.array([[1.0, 2.0], [1.0, -1.0], [0.0, -3.0]])  # row 2 ties with the initial value: the term wins
    grads = jax.grad(lambda C, A: jinsum.einsum("C[i] max= A[i,j]", C=C, A=A).sum(), argnums=(0, 1))(C, A)
    np.testing.assert_array_equal(grads[0], [1, 0, 0])
    np.testing.assert_array_equal(grads[1], [[0, 0], [1, 0], [1, 0]])


def test_vmap_equals_a_loop(rng):
    operands = extreme_spmm(rng, np.float32)
    expression = "C[Ai[g],n] max= Av[g,p] * B[Ak[g,p],n]"

    def fn(B, Ak):
        return jinsum.einsum(expression, **{**operands, "B": B, "Ak": Ak})

    Bs = jnp.stack([operands["B"], -operands["B"]])
    Aks = jnp.stack([operands["Ak"], operands["Ak"][::-1]])
    check_vmap(fn, (Bs, Aks), in_axes=(0, 0))
    check_vmap(fn, (operands["B"], Aks), in_axes=(None, 0), out_axes=1)
    grads = jax.vmap(jax.grad(lambda B: fn(B, operands["Ak"]).sum()))(Bs)
    for b in range(2):
        np.testing.assert_allclose(grads[b], jax.grad(lambda B: fn(B, operands["Ak"]).sum())(Bs[b]))


def test_deterministic_mode_leaves_extrema_as_written(rng):
    case = next(c for c in CASES if c.name == "scatter_max")
    operands, expression = case.make(rng, np.float32), case.expression

    def fn(B):
        return jinsum.einsum(expression, **{**operands, "B": B})

    with jinsum.deterministic(True):
        [spec] = kernel_specs_in(fn, operands["B"])
        assert str(spec.statement) == expression and spec.deterministic
        np.testing.assert_array_equal(fn(operands["B"]), jax.jit(fn)(operands["B"]))
        jax.grad(lambda B: fn(B)[operands["Ak"][0]].sum())(operands["B"])  # the scatter to the winners: rewritten
