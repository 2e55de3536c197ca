"""`HeteroLinear` against PyG's in float64 with its weights copied in (outputs and every gradient), against a NumPy
loop over the rows, by `check_grads`; one compile for every type vector, bfloat16 computation, initialisation, and the
errors for a bad type vector (eager, under `jit`, under `jinsum.check_indices`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import checkify
from jax.test_util import check_grads

import jinsum
from jinsum.nn._hetero_linear import HeteroLinear
from jinsum.testing import assert_allclose

torch = pytest.importorskip("torch")
pyg = pytest.importorskip("torch_geometric.nn", reason="the parity tests need torch_geometric (the test extra)")

# (rows, in, out, types, the types drawn): unsorted rows with a type that has none, one type, sizes off any tile,
# more types than rows.
CASES = {
    "unsorted, type 2 empty": (23, 5, 4, 5, [0, 1, 3, 4]),
    "one type": (9, 3, 6, 1, [0]),
    "odd sizes": (37, 7, 11, 3, [0, 1, 2]),
    "more types than rows": (4, 2, 3, 9, [8, 1, 5]),
}


def _inputs(case, rng):
    rows, in_features, _, _, drawn = CASES[case]
    return rng.standard_normal((rows, in_features)), rng.choice(drawn, rows)


def _layer(case, bias):
    _, in_features, out_features, types, _ = CASES[case]
    return HeteroLinear(in_features, out_features, types, bias=bias, param_dtype=jnp.float64, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_pyg_and_a_numpy_loop(case, bias, rng):
    """Outputs (jitted) against a NumPy loop over the rows; outputs and the gradients of a random linear functional
    for x, weight and bias against PyG's layer with the same parameters (its weight has our layout, (types, in,
    out))."""
    with jax.enable_x64(True):
        x, types = _inputs(case, rng)
        _, in_features, out_features, num_types, _ = CASES[case]
        torch.manual_seed(0)
        theirs = pyg.HeteroLinear(in_features, out_features, num_types, bias=bias).double()
        ours = _layer(case, bias)
        ours.weight[...] = jnp.asarray(theirs.weight.detach().numpy())
        if bias:
            ours.bias[...] = jnp.asarray(theirs.bias.detach().numpy())

        x_torch = torch.tensor(x, requires_grad=True)
        expected = theirs(x_torch, torch.from_numpy(types))
        probe = rng.standard_normal(expected.shape)
        (expected * torch.from_numpy(probe)).sum().backward()

        graphdef, params = nnx.split(ours)

        def apply(params, x, types):
            return nnx.merge(graphdef, params)(x, types)

        def loss(params, x):
            return (apply(params, x, types) * probe).sum()

        # (the output, of traced types, and the gradients, of concrete types, in one compiled program, not one each)
        out, (grad_params, grad_x) = jax.jit(lambda params, x, t: (apply(params, x, t),
                                                                   jax.grad(loss, argnums=(0, 1))(params, x)))(
            params, jnp.asarray(x), types)
        tight = {"rtol": 1e-12, "atol": 1e-12}
        weight, bias_rows = theirs.weight.detach().numpy(), np.zeros((num_types, out_features))
        if bias:
            bias_rows = theirs.bias.detach().numpy()
        np.testing.assert_allclose(out, np.stack([x[i] @ weight[t] + bias_rows[t] for i, t in enumerate(types)]),
                                   **tight)
        np.testing.assert_allclose(out, expected.detach().numpy(), **tight)
        np.testing.assert_allclose(grad_x, x_torch.grad.numpy(), **tight)
        np.testing.assert_allclose(grad_params["weight"][...], theirs.weight.grad.numpy(), **tight)
        if bias:
            np.testing.assert_allclose(grad_params["bias"][...], theirs.bias.grad.numpy(), **tight)


def test_gradients_by_finite_differences(rng):
    """x, weight and bias, forward and reverse mode."""
    with jax.enable_x64(True):
        x, types = _inputs("unsorted, type 2 empty", rng)
        graphdef, params = nnx.split(_layer("unsorted, type 2 empty", bias=True))

        def apply(x, weight, bias):
            return nnx.merge(graphdef, nnx.State({"weight": weight, "bias": bias}))(x, types)

        check_grads(jax.jit(apply), (jnp.asarray(x), params["weight"][...], params["bias"][...]), order=1,
                    modes=["fwd", "rev"])


def test_one_compile_for_every_type_vector(rng):
    """The grouping by type happens on the device: shapes depend only on N and num_types."""
    layer, x = HeteroLinear(5, 4, 3, rngs=nnx.Rngs(0)), jnp.asarray(rng.standard_normal((20, 5)), jnp.float32)
    traces = []

    @jax.jit
    def apply(x, types):
        traces.append(1)
        return layer(x, types)

    for types in (np.zeros(20, np.int32), rng.integers(0, 3, 20).astype(np.int32), np.full(20, 2, np.int32)):
        expected = np.einsum("ic,ico->io", np.asarray(x), np.asarray(layer.weight[...])[types])
        assert_allclose(apply(x, types), expected + np.asarray(layer.bias[...])[types], jnp.float32)
    assert len(traces) == 1


def test_bfloat16_computation_with_float32_parameters(rng):
    """bfloat16 outputs within bfloat16's tolerance of the float32 layer, float32 parameter gradients close to it."""
    x, types = jnp.asarray(rng.standard_normal((23, 5)), jnp.float32), rng.integers(0, 4, 23)
    full = HeteroLinear(5, 6, 4, rngs=nnx.Rngs(0))
    half = HeteroLinear(5, 6, 4, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    apply = nnx.jit(lambda layer: layer(x, types))
    out = apply(half)
    assert out.dtype == jnp.bfloat16 and half.weight[...].dtype == jnp.float32
    assert_allclose(out, apply(full), jnp.bfloat16)

    def loss(layer):
        return jnp.sum(jnp.tanh(layer(x, types).astype(jnp.float32)))

    grads_half, grads_full = map(nnx.jit(nnx.grad(loss)), (half, full))
    for g_half, g_full in zip(jax.tree.leaves(grads_half), jax.tree.leaves(grads_full)):
        assert g_half.dtype == jnp.float32
        assert_allclose(g_half, g_full, jnp.bfloat16)


def test_bfloat16_bias_gradient_sums_many_rows_in_float32(rng):
    """bfloat16 parameters: the bias's gradient sums each type's many rows in float32, not one by one in bfloat16
    (where adding the 4,000th row of a type changes nothing: the benchmark's 77,000 rows lost half the sum)."""
    rows = 4096
    types = np.zeros(rows, np.int32)
    types[::8] = 1
    layer = HeteroLinear(4, 3, 2, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.standard_normal((rows, 4)), jnp.bfloat16)
    dy = rng.uniform(0.5, 1.5, (rows, 3)).astype(np.float32)  # (positive: a sum that grows to thousands)
    # (compiled: op by op, each operation compiles; the types concrete in it, as eagerly)
    grads = nnx.jit(nnx.grad(lambda layer: jnp.sum(layer(x, types).astype(jnp.float32) * dy)))(layer)
    expected = np.stack([dy[types == t].sum(0) for t in range(2)])
    assert_allclose(np.asarray(grads["bias"][...], np.float64) / expected, np.ones_like(expected), jnp.bfloat16)


def test_initialisation_is_pygs():
    """Weight and bias uniform in +-1/sqrt(in_features) (PyG's kaiming_uniform with a = sqrt(5), and its bias)."""
    layer = HeteroLinear(16, 300, 4, rngs=nnx.Rngs(0))
    assert layer.weight[...].shape == (4, 16, 300) and layer.bias[...].shape == (4, 300)
    for values in (np.asarray(layer.weight[...]), np.asarray(layer.bias[...])):
        assert 0.24 < np.abs(values).max() <= 0.25
        np.testing.assert_allclose(values.std(), 0.25 / np.sqrt(3), rtol=0.05)  # U(-b, b): std b / sqrt(3)
    assert HeteroLinear(16, 3, 2, bias=False, rngs=nnx.Rngs(0)).bias is None


def test_bad_inputs_name_what_they_got():
    layer, x = HeteroLinear(5, 4, 3, rngs=nnx.Rngs(0)), jnp.ones((6, 5))
    types = np.array([0, 1, 2, 0, 1, 2])
    with pytest.raises(ValueError, match=r"expected type_vec an integer array of shape \(N,\) = \(6,\), one type per "
                                         r"row of x \(6, 5\), got int\d+\[5\]"):
        layer(x, types[:5])
    with pytest.raises(ValueError, match=r"shape \(N,\) = \(6,\).* got float32\[6\]"):
        layer(x, types.astype(np.float32))
    with pytest.raises(ValueError, match=r"expected x of shape \(N, in_features = 5\), got \(6, 4\)"):
        layer(x[:, :4], types)
    for position, value in ((4, 3), (1, -1)):
        bad = types.copy()
        bad[position] = value
        with pytest.raises(ValueError, match=rf"type_vec\[{position}\] = {value} is out of range for num_types = 3; "
                                             r"every type must lie in \[0, 3\)"):
            layer(x, bad)
    with pytest.raises(ValueError, match=r"num_types must be a positive int, got 0"):
        HeteroLinear(5, 4, 0, rngs=nnx.Rngs(0))


def test_out_of_range_types_under_jit():
    """As jinsum's out-of-range reads: the row reads no weight and no bias (zeros); a checkify error under
    `jinsum.check_indices`."""
    layer, x = HeteroLinear(5, 4, 3, rngs=nnx.Rngs(0)), jnp.ones((6, 5))
    types = np.array([0, 1, 7, 0, -1, 2], np.int32)
    out = np.asarray(jax.jit(lambda types: layer(x, types))(types))
    rows = np.asarray(x)  # (the reference in NumPy, not op by op)
    np.testing.assert_array_equal(out[np.array([2, 4])], 0)
    valid = np.array([0, 1, 3, 5])
    weight, bias = np.asarray(layer.weight[...]), np.asarray(layer.bias[...])
    assert_allclose(out[valid], np.einsum("ic,ico->io", rows[valid], weight[types[valid]]) + bias[types[valid]],
                    jnp.float32)
    with jinsum.check_indices(True):
        error, _ = checkify.checkify(jax.jit(lambda types: layer(x, types)))(types)
        with pytest.raises(checkify.JaxRuntimeError, match=r"type_vec holds a type outside \[0, num_types = 3\)"):
            error.throw()
