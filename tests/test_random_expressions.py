"""Property test: random well-formed indirect Einsums agree with the brute-force reference, and so do their grads.

Each example draws a statement (1-3 factors of rank 1-3, indirections nested up to two deep, `+=` (duplicate
targets add) or `=` with unique targets), extents including 0 and 1, and in-range index arrays; it runs on the XLA
lowering, in Triton's interpreter, in deterministic mode, under grad and vmap. Mutated statements must fail with
`ExpressionError` only.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jinsum
from jinsum import ExpressionError
from jinsum._frontend import _einsum
from jinsum._lowering import _triton
from jinsum._rules import _primitive
from jinsum.kernels import Fallback, KernelConfig, make_plan
from jinsum.testing import assert_allclose, kernel_specs_in, reference

from conftest import ON_GPU


class _Draw:
    """Builds one random statement and its operands from a NumPy generator."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.extents = {f"v{k}": int(rng.choice([0, 1, 2, 3, 4], p=[0.04, 0.16, 0.3, 0.3, 0.2])) for k in range(5)}
        self.operands = {}

    def name(self, prefix: str) -> str:
        return f"{prefix}{len(self.operands)}"

    def index_array(self, bound: int, depth: int) -> str:
        """An access yielding indices in [0, bound): an integer array over 1-2 variables, maybe itself indirect."""
        rank = int(self.rng.integers(1, 3))
        positions, shape = self.positions(rank, depth)
        name = self.name("I")
        self.operands[name] = self.rng.integers(0, max(bound, 1), shape).astype(np.int32)
        return f"{name}[{','.join(positions)}]"

    def positions(self, rank: int, depth: int, variables=None) -> tuple[list[str], list[int]]:
        variables = list(self.rng.permutation(list(self.extents))[:rank]) if variables is None else variables
        positions, shape = [], []
        for v in variables:
            if depth < 2 and self.rng.random() < 0.3:
                size = int(self.rng.integers(1, 5))
                positions.append(self.index_array(size, depth + 1))
                shape.append(size)
            else:
                positions.append(v)
                shape.append(self.extents[v])
        return positions, shape

    def value(self, rank: int, dtype) -> str:
        positions, shape = self.positions(rank, 0)
        name = self.name("X")
        self.operands[name] = self.rng.standard_normal(shape).astype(dtype)
        return f"{name}[{','.join(positions)}]"

    def statement(self, dtype) -> str:
        factors = [self.value(int(self.rng.integers(1, 4)), dtype) for _ in range(int(self.rng.integers(1, 4)))]
        on_right = sorted({v for v in self.extents if any(v in f for f in factors)})
        overwrite = self.rng.random() < 0.3
        if overwrite:  # unique targets: plain variables only
            lhs_vars = list(self.rng.permutation(on_right)[:int(self.rng.integers(1, min(3, len(on_right)) + 1))])
            positions, shape = lhs_vars, [self.extents[v] for v in lhs_vars]
        else:
            lhs_vars = list(self.rng.permutation(list(self.extents))[:int(self.rng.integers(1, 4))])
            positions, shape = self.positions(len(lhs_vars), 0, lhs_vars)
        self.operands["Out"] = self.rng.standard_normal(shape).astype(dtype)
        return f"Out[{','.join(positions)}] {'=' if overwrite else '+='} {' * '.join(factors)}"


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_statements_match_reference(seed):
    draw = _Draw(np.random.default_rng(seed))
    expression = draw.statement(np.float32)
    actual = jax.jit(lambda ops: jinsum.einsum(expression, **ops))(draw.operands)
    assert_allclose(actual, reference(expression, **draw.operands), np.float32, err_msg=expression)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_statements_grad_matches_reference_vjp(seed):
    """The gradient of <w, out> with respect to each value operand occurring once, against the reference: `out` is
    affine in such an operand, so each partial derivative is the reference at a unit input minus at zero."""
    with jax.enable_x64(True):
        draw = _Draw(np.random.default_rng(seed))
        expression = draw.statement(np.float64)
        operands = draw.operands
        weights = np.random.default_rng(seed + 1).standard_normal(operands["Out"].shape)
        values = [n for n, a in operands.items() if a.dtype == np.float64]

        def loss(vals):
            return jnp.vdot(weights, jinsum.einsum(expression, **{**operands, **vals}))

        grads = jax.jit(jax.grad(loss))({n: operands[n] for n in values})
        for name in values:
            if expression.count(f"{name}[") != 1:
                continue
            shape = operands[name].shape
            base = reference(expression, **{**operands, name: np.zeros(shape)})
            expected = np.empty(shape)
            for k in np.ndindex(shape):  # d<w, out>/dx_k: the (affine) reference at a unit input minus at zero
                unit = np.zeros(shape)
                unit[k] = 1
                expected[k] = np.vdot(weights, reference(expression, **{**operands, name: unit}) - base)
            assert_allclose(grads[name], expected.reshape(operands[name].shape), np.float64,
                            err_msg=f"d/d{name} of {expression}")


def _spec(expression, operands):
    statement, arrays, flags = _einsum.prepare(expression, operands)
    return _primitive.make_spec(statement, arrays, **flags), arrays


@pytest.mark.skipif(ON_GPU, reason="the interpreter runs where no GPU is")
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_statements_in_the_triton_interpreter(seed):
    """The generated kernel, default and stress configurations, against the float64 reference."""
    pytest.importorskip("torch")
    draw = _Draw(np.random.default_rng(seed))
    expression = draw.statement(np.float32)
    spec, arrays = _spec(expression, draw.operands)
    if isinstance(make_plan(spec), Fallback):
        return
    for config in (KernelConfig(), KernelConfig(block=2, block_rows=2, window=3, num_stages=2)):
        actual = _triton.interpret(spec, {n: np.asarray(a) for n, a in arrays.items()}, config)
        assert_allclose(actual, reference(expression, **draw.operands), np.float32, err_msg=f"{expression} {config}")


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_statements_deterministic_and_vmapped(seed):
    """Deterministic mode: the same values (XLA lowering), and no kernel of it or of its gradient adds atomically;
    vmap over a value operand equals a loop, in both modes."""
    draw = _Draw(np.random.default_rng(seed))
    expression = draw.statement(np.float32)
    operands = draw.operands
    values = [n for n, a in operands.items() if a.dtype == np.float32 and n != "Out"]
    with jinsum.deterministic(True):
        call = jax.jit(lambda ops: jinsum.einsum(expression, **ops))
        assert_allclose(call(operands), reference(expression, **operands), np.float32, err_msg=expression)
        loss = lambda vals: jnp.sum(jnp.sin(jinsum.einsum(expression, **{**operands, **vals})))  # noqa: E731
        for spec in kernel_specs_in(jax.grad(loss), {n: operands[n] for n in values}):
            plan = make_plan(spec)
            assert isinstance(plan, Fallback) or not plan.adds_atomically, str(spec.statement)
    name = values[-1]
    batched = np.stack([operands[name], -operands[name], 2 * operands[name]])

    def vmapped_and_looped(x):  # (check_vmap's two sides, compiled as one program)
        fn = lambda x: jinsum.einsum(expression, **{**operands, name: x})  # noqa: E731
        return jax.vmap(fn)(x), [fn(x[b]) for b in range(len(x))]

    for deterministic in (False, True):
        with jinsum.deterministic(deterministic):
            vmapped, looped = jax.jit(vmapped_and_looped)(batched)
        assert_allclose(vmapped, np.stack([np.asarray(y, np.float64) for y in looped]), np.float32,
                        err_msg=f"vmap vs loop: {expression} (deterministic: {deterministic})")


_MUTATION_ALPHABET = list("[],=+*-.0 ") + ["Out", "X0", "I1", "v0", "v1", "+=", "]]", "[["]


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), edits=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 200),
                                                               st.sampled_from(_MUTATION_ALPHABET)), min_size=1,
                                                     max_size=3))
def test_mutated_statements_raise_expression_errors_only(seed, edits):
    """A well-formed statement with a few characters deleted, inserted, replaced or swapped, and the original
    operands: it either still runs, or raises `ExpressionError` (with a rendered message), or a `ValueError` for
    an index out of range of what the mutation made it address — never another exception."""
    draw = _Draw(np.random.default_rng(seed))
    text = draw.statement(np.float32)
    for kind, at, token in edits:
        at = at % (len(text) + 1)
        if kind == 0:
            text = text[:at] + text[at + 1:]
        elif kind == 1:
            text = text[:at] + token + text[at:]
        elif kind == 2:
            text = text[:at] + token + text[at + len(token):]
        elif at + 1 < len(text):
            text = text[:at] + text[at + 1] + text[at] + text[at + 2:]
    try:
        jinsum.einsum(text, **draw.operands)
    except ExpressionError as error:
        assert str(error).startswith("jinsum: ") and error.message
    except ValueError as error:
        assert "out of range" in str(error), f"{text!r}: {error!r}"
