"""Property test: random well-formed indirect Einsums agree with the brute-force reference, and so do their grads.

Each example draws a statement (1-3 factors of rank 1-3, indirections nested up to two deep, `+=` or `=` with
unique targets), extents including 0 and 1, and in-range index arrays.
"""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import jinsum
from jinsum.testing import assert_allclose, reference


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
