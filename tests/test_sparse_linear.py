"""`jinsum.nn.SparseLinear`: a linear layer over a fixed element or block pattern, against the dense layer with the
pattern's zeros in float64 NumPy (values, gradients by `check_grads`), its padding kept at zero through training,
mixed precision within bfloat16's tolerance, one compile for new inputs, and clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.test_util import check_grads

import jinsum.nn as jnn
from jinsum.testing import CountingJit, assert_allclose

# (in_features, out_features, block_shape, density): elements with padded groups (rows of unequal lengths), blocks
# of unequal sides, a pattern with empty output columns and a single stored block.
CASES = [(13, 9, None, 0.3), (12, 20, (4, 5), 0.4), (24, 16, (8, 4), 0.05), (7, 5, None, 1.0)]


@pytest.fixture
def x64():
    """Float64 on (float32 elsewhere): the comparisons test the sparse algebra, not rounding."""
    with jax.enable_x64(True):
        yield


def _layer(in_features, out_features, block_shape, density, dtype=None, param_dtype=jnp.float64, use_bias=True):
    pattern = jnn.random_pattern(in_features, out_features, density, block_shape=block_shape, seed=in_features)
    layer = jnn.SparseLinear(in_features, out_features, pattern, block_shape=block_shape, use_bias=use_bias,
                             dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0),
                             bias_init=nnx.initializers.normal(1.0))
    return layer, pattern


def _dense_weight(layer, pattern):
    """The layer's `W (in, out)` in float64: its initial draw, zero off the pattern (from the pattern, not from the
    layer's stored structure)."""
    full = pattern if layer.block_shape is None else np.kron(pattern, np.ones(layer.block_shape))
    init = nnx.nn.linear.default_kernel_init(nnx.Rngs(0).params(), (layer.in_features, layer.out_features),
                                             layer.kernel[...].dtype)
    return np.asarray(init, np.float64) * full


@pytest.mark.parametrize("case", CASES, ids=str)
def test_equals_the_dense_layer_with_the_patterns_zeros(case, x64, rng):
    layer, pattern = _layer(*case)
    W = _dense_weight(layer, pattern)
    x = rng.standard_normal((2, 3, case[0]))  # leading axes: any batch shape
    # (one compiled program, not op by op; the layer's arrays concrete in it, as eagerly)
    weight, out = jax.jit(lambda x: (layer.weight.todense(), layer(x)))(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(weight).T, W, rtol=1e-12, atol=0)
    expected = x @ W + np.asarray(layer.bias[...])
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_gradients_with_respect_to_input_and_values(case, x64, rng):
    layer, _ = _layer(*case, use_bias=False)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    x = jnp.asarray(rng.standard_normal((5, case[0])))

    @jax.jit  # (compiled once per derivative, not op by op at each of check_grads' points)
    def apply(kernel, x):
        return nnx.merge(graphdef, nnx.State({"kernel": nnx.Param(kernel)}), rest)(x)

    check_grads(apply, (params["kernel"][...], x), order=2, modes=["fwd", "rev"])


def test_padding_stays_zero_through_training(rng):
    """Group padding gets no gradient and no update (Adam with weight decay included): after training, the layer
    still equals the dense layer whose weight is the stored values where the pattern is set."""
    layer, pattern = _layer(13, 9, None, 0.3, param_dtype=jnp.float32)
    assert layer.active is not None, "this pattern must have padded groups"
    optimizer = nnx.Optimizer(layer, optax.adamw(0.05, weight_decay=0.1), wrt=nnx.Param)
    x, target = (jnp.asarray(rng.standard_normal(s).astype(np.float32)) for s in ((8, 13), (8, 9)))

    @nnx.jit
    def step(layer, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda layer: jnp.mean((layer(x) - target) ** 2))(layer)
        optimizer.update(layer, grads)
        return loss

    losses = [float(step(layer, optimizer, x)) for _ in range(20)]
    assert losses[-1] < 0.5 * losses[0]
    padding = np.asarray(layer.active[...]) == 0
    np.testing.assert_array_equal(np.asarray(layer.kernel[...])[padding], 0)
    W = np.asarray(layer.weight.todense()).T
    assert np.all(W[~pattern] == 0)
    assert_allclose(layer(x), np.asarray(x) @ W + np.asarray(layer.bias[...]), np.float32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=str)
@pytest.mark.parametrize("case", [*CASES[:2], (64, 64, (32, 32), 0.5)], ids=str)
def test_mixed_precision_within_half_precision_tolerance(case, dtype, rng):
    """(32 x 32 blocks: the XLA lowering contracts half-precision blocks, which XLA's CPU dot takes only widened.)"""
    full, _ = _layer(*case, param_dtype=jnp.float32)
    half, _ = _layer(*case, dtype=dtype, param_dtype=jnp.float32)
    x = jnp.asarray(rng.standard_normal((6, case[0])).astype(np.float32))
    y, expected = jax.jit(lambda x: (half(x), full(x)))(x)  # (compiled, not op by op; the layers' arrays concrete)
    assert y.dtype == dtype and half.kernel[...].dtype == jnp.float32
    assert_allclose(y, expected, dtype)
    grad = nnx.jit(nnx.grad(lambda layer: jnp.sum(layer(x).astype(jnp.float32))))
    g_half, g_full = grad(half), grad(full)
    assert g_half["kernel"][...].dtype == jnp.float32  # the gradient of float32 parameters stays float32
    assert_allclose(g_half["kernel"][...], g_full["kernel"][...], dtype)


def test_new_inputs_and_values_compile_once(rng):
    layer, _ = _layer(12, 20, (4, 5), 0.4, param_dtype=jnp.float32)
    graphdef, state = nnx.split(layer)
    forward = CountingJit(lambda state, x: nnx.merge(graphdef, state)(x))
    for seed in range(3):
        state = jax.tree.map(lambda v: v + seed if jnp.issubdtype(v.dtype, jnp.floating) else v, state)
        forward(state, jnp.asarray(np.random.default_rng(seed).standard_normal((4, 12)), jnp.float32))
    assert forward.traces == 1


def test_pattern_is_not_a_parameter(x64):
    layer, _ = _layer(12, 20, (4, 5), 0.4)
    assert set(nnx.state(layer, nnx.Param).keys()) == {"kernel", "bias"}
    assert jax.tree.leaves(nnx.state(layer, jnn.SparsityPattern))  # the index arrays live in the layer's state
    assert "SparseLinear" in repr(layer)


def test_errors_say_what_was_expected():
    rngs = nnx.Rngs(0)
    with pytest.raises(ValueError, match=r"pattern of shape \(in_features, out_features\) = \(4, 6\), got \(6, 4\)"):
        jnn.SparseLinear(4, 6, np.ones((6, 4)), rngs=rngs)
    with pytest.raises(ValueError, match=r"block grid .* = \(2, 3\), got \(4, 6\)"):
        jnn.SparseLinear(4, 6, np.ones((4, 6)), block_shape=(2, 2), rngs=rngs)
    with pytest.raises(ValueError, match=r"block_shape \(bi, bo\) = \(3, 2\) must divide"):
        jnn.SparseLinear(4, 6, np.ones((1, 3)), block_shape=(3, 2), rngs=rngs)
    with pytest.raises(ValueError, match="stores no entry"):
        jnn.SparseLinear(4, 6, np.zeros((4, 6)), rngs=rngs)
    with pytest.raises(TypeError, match="pattern must be concrete"):
        jax.jit(lambda p: jnn.SparseLinear(4, 6, p, rngs=nnx.Rngs(0)).kernel[...])(jnp.ones((4, 6)))
    layer = jnn.SparseLinear(4, 6, np.ones((4, 6)), rngs=rngs)
    with pytest.raises(ValueError, match=r"expected x of shape \(\.\.\., 4\) \(in_features\), got \(3, 5\)"):
        layer(jnp.ones((3, 5)))
    with pytest.raises(ValueError, match=r"density must be in \(0, 1\]"):
        jnn.random_pattern(4, 6, 0.0)
