"""Mixture of experts on jinsum (`jinsum.nn._routing`, `jinsum.nn._moe`): the routing built on the device against a
NumPy routing (top-k, weights, losses, capacity drops in token order), and the layer against a dense float64
reference that runs every expert on every token and masks by the routing; gradients by `check_grads`, any batch
shape, one compile for new inputs, bfloat16 within its tolerance."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import checkify
from jax.test_util import check_grads
from scipy.special import erf, logsumexp, softmax

import jinsum
from jinsum.nn._moe import gathered_product, routed_linear, routed_mlp
from jinsum.nn._moe_layer import MoE
from jinsum.nn._routing import expert_capacity, route_tokens
from jinsum.testing import CountingJit, assert_allclose, specs_in


@pytest.fixture
def x64():
    """Float64 on (float32 elsewhere): the comparisons test the sparse algebra, not rounding."""
    with jax.enable_x64(True):
        yield


def numpy_routing(logits, top_k, norm_topk=True, capacity_factor=None):
    """The routing in float64 NumPy, token by token: `(experts (T, k), weights (T, k), kept (T, k), gate (T, E),
    balance, z)`; `gate[t, e]` the combine weight of token t at expert e."""
    logits = np.asarray(logits, np.float64)
    T, E = logits.shape
    experts = np.argsort(-logits, axis=1, kind="stable")[:, :top_k]
    probabilities = softmax(logits, axis=1)
    chosen = np.take_along_axis(logits, experts, 1)
    weights = softmax(chosen, axis=1) if norm_topk else np.take_along_axis(probabilities, experts, 1)
    kept = np.ones(experts.shape, bool)
    if capacity_factor is not None:
        limit, load = math.ceil(capacity_factor * T * top_k / E), np.zeros(E, int)
        for t in range(T):  # first come, first served
            for j in range(top_k):
                kept[t, j] = load[experts[t, j]] < limit
                load[experts[t, j]] += 1
    weights = np.where(kept, weights, 0)
    gate = np.zeros((T, E))
    np.put_along_axis(gate, experts, weights, 1)
    selected = np.zeros((T, E))
    np.put_along_axis(selected, experts, 1, 1)
    balance = E * np.sum(selected.mean(0) * probabilities.mean(0))
    z = np.mean(logsumexp(logits, axis=1) ** 2)
    return experts, weights, kept, gate, balance, z


def distinct_logits(rng, T, E):
    """Logits whose order per token is clear (gaps > 0.05): the top-k does not flip under rounding or `check_grads`'
    perturbations."""
    return np.stack([rng.permutation(E) * 0.4 + rng.uniform(-0.1, 0.1, E) for _ in range(T)]) + rng.normal(
        size=(T, 1))


_route = jax.jit(route_tokens, static_argnames=("top_k", "norm_topk", "capacity_factor", "group_size"))


@pytest.mark.parametrize("top_k, norm_topk", [(1, False), (2, True), (2, False), (3, True)])
def test_routing_equals_numpy(top_k, norm_topk, x64, rng):
    T, E = 13, 5
    logits = distinct_logits(rng, T, E)
    routing = _route(jnp.asarray(logits), top_k=top_k, norm_topk=norm_topk)
    experts, weights, _, gate, balance, z = numpy_routing(logits, top_k, norm_topk)
    got = np.asarray(routing.experts)
    assert all(len(set(row)) == top_k for row in got)  # distinct experts per token
    np.testing.assert_array_equal(got, experts)
    np.testing.assert_allclose(np.asarray(routing.weights), weights, rtol=1e-12)
    if norm_topk:
        np.testing.assert_allclose(np.asarray(routing.weights).sum(1), 1, rtol=1e-12)
    else:  # the full softmax's probabilities of the selected experts
        np.testing.assert_allclose(np.asarray(routing.weights), np.take_along_axis(softmax(logits, 1), got, 1),
                                   rtol=1e-12)
    assert routing.combine.shape == (E, T) and routing.combine.nnz == T * top_k
    np.testing.assert_allclose(np.asarray(routing.combine.todense()), gate.T, rtol=1e-12)
    np.testing.assert_allclose(float(routing.balance_loss), balance, rtol=1e-12)
    np.testing.assert_allclose(float(routing.z_loss), z, rtol=1e-12)
    assert int(routing.dropped) == 0


def test_losses_at_a_uniform_router(x64):
    """Logits equal up to 1e-9, each token's order rotated by one: every probability 1/E and every expert in k of the
    E tokens' top-k, so the balance loss is at its floor, k under this normalisation, and the z-loss log(E)^2."""
    E, k = 4, 2
    logits = np.stack([np.roll(np.arange(E, 0, -1), t) for t in range(E)]) * 1e-9
    routing = route_tokens(jnp.asarray(logits), k)
    assert (np.bincount(np.asarray(routing.experts).ravel(), minlength=E) == k).all()
    np.testing.assert_allclose(float(routing.balance_loss), k, rtol=1e-6)
    np.testing.assert_allclose(float(routing.z_loss), np.log(E) ** 2, rtol=1e-6)


def test_capacity_drops_the_last_tokens_in_token_order(x64, rng):
    T, E, k, factor = 13, 5, 2, 1.0
    logits = distinct_logits(rng, T, E)
    logits[:, 0] += 10  # every token wants expert 0: it keeps ceil(13 * 2 / 5) = 6 and drops 7
    routing = _route(jnp.asarray(logits), top_k=k, capacity_factor=factor)
    experts, weights, kept, gate, balance, z = numpy_routing(logits, k, capacity_factor=factor)
    limit = expert_capacity(factor, T, k, E)
    assert limit == 6 and (~kept).sum() >= 7
    np.testing.assert_array_equal(np.asarray(routing.experts), experts)
    assert int(routing.dropped) == (~kept).sum()
    np.testing.assert_allclose(np.asarray(routing.weights), weights, rtol=1e-12)
    dense = np.asarray(routing.combine.todense())
    np.testing.assert_allclose(dense, gate.T, rtol=1e-12)
    np.testing.assert_array_equal(np.flatnonzero(dense[0]), np.arange(limit))  # expert 0: the first 6 tokens
    assert ((dense != 0).sum(1) <= limit).all()
    # The losses see the router, not the capacity.
    np.testing.assert_allclose(float(routing.balance_loss), balance, rtol=1e-12)
    np.testing.assert_allclose(float(routing.z_loss), z, rtol=1e-12)
    # A capacity no expert reaches drops nothing.
    assert int(_route(jnp.asarray(logits), top_k=k, capacity_factor=E / k).dropped) == 0


def test_routing_errors_say_what_was_expected():
    with pytest.raises(ValueError, match=r"logits of shape \(tokens, num_experts\), got int32\[4\]"):
        route_tokens(jnp.arange(4), 1)
    with pytest.raises(ValueError, match=r"top_k must be an int in \[1, num_experts = 3\], got 4"):
        route_tokens(jnp.zeros((2, 3)), 4)
    with pytest.raises(ValueError, match="capacity_factor must be positive"):
        route_tokens(jnp.zeros((2, 3)), 1, capacity_factor=0.0)
    with pytest.raises(ValueError, match="activation must be one of"):
        MoE(4, 4, 2, 1, activation="tanh", rngs=nnx.Rngs(0))
    moe = MoE(4, 3, 2, 1, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"expected x of shape \(tokens, 4\) or \(batch, length, 4\)"):
        moe(jnp.ones((3, 5)))
    routing = _route(jnp.zeros((3, 2)), top_k=1)  # (compiled: op by op, each operation compiles)
    with pytest.raises(ValueError, match=r"needs w_gate"):
        routed_mlp(jnp.ones((3, 4)), routing.combine, jnp.ones((2, 4, 3)), jnp.ones((2, 3, 4)))
    with pytest.raises(ValueError, match=r"\(num_experts, features\) = \(2, 4\), got \(2, 5, 3\)"):
        routed_linear(jnp.ones((3, 4)), routing.combine, jnp.ones((2, 5, 3)))


def test_routed_linear_is_a_grouped_product_and_a_combine(x64, rng):
    T, E, C, N = 9, 4, 3, 5
    x, w = rng.standard_normal((T, C)), rng.standard_normal((E, C, N))
    logits = distinct_logits(rng, T, E)
    gate = numpy_routing(logits, 2)[3]
    f = jax.jit(lambda x, w, logits: routed_linear(x, route_tokens(logits, 2).combine, w))
    expected = np.einsum("te,tc,ecn->tn", gate, x, w)
    np.testing.assert_allclose(np.asarray(f(*map(jnp.asarray, (x, w, logits)))), expected, rtol=1e-12, atol=1e-12)
    specs = specs_in(f, *map(jnp.asarray, (x, w, logits)))
    assert [str(s.statement) for s in specs] == ["H[g,p,h] += X[Ak[g,p],c] * W[Ai[g],c,h]",
                                                 "Y[Ak[g,p],n] += Av[g,p] * O[g,p,n]"]


def test_padding_slots_read_no_row_under_jit(x64, rng):
    """Inside `jit` a slot of value 0 (group padding) reads no token row: its product is 0, and the input's
    gradient adds nothing for it (its column is -1, not a stored entry's). Outside `jit`, where indices are
    checked on the host, padding keeps its column (any product: its value is 0); the layer's results agree."""
    T, E, C, N = 9, 4, 3, 5
    x, w = jnp.asarray(rng.standard_normal((T, C))), jnp.asarray(rng.standard_normal((E, C, N)))
    A = route_tokens(distinct_logits(rng, T, E), 2, group_size=4).combine
    padding = np.asarray(A.Av) == 0
    assert padding.any()
    rows = np.asarray(jax.jit(gathered_product)(A, x, w))
    expected = np.einsum("gpc,gcn->gpn", np.asarray(x)[np.asarray(A.Ak)], np.asarray(w)[np.asarray(A.Ai)])
    np.testing.assert_allclose(rows[~padding], expected[~padding], rtol=1e-12, atol=1e-12)
    assert not rows[padding].any()
    np.testing.assert_allclose(np.asarray(gathered_product(A, x, w)), expected, rtol=1e-12, atol=1e-12)
    grad = lambda x: jax.grad(lambda x: jnp.sum(routed_linear(x, A, w) ** 2))(x)  # noqa: E731
    np.testing.assert_allclose(np.asarray(jax.jit(grad)(x)), np.asarray(grad(x)), rtol=1e-12, atol=1e-12)


def test_check_indices_reports_nothing_on_a_routing(x64, rng):
    """Under `jinsum.check_indices` (checkify inside jit) padding keeps its column, which is in range: a valid
    routing reports no error, forward or backward, and gives the same results."""
    T, E, C, N = 9, 4, 3, 5
    x, w = jnp.asarray(rng.standard_normal((T, C))), jnp.asarray(rng.standard_normal((E, C, N)))
    logits = jnp.asarray(distinct_logits(rng, T, E))

    def value_and_grad(x, w, logits):
        return jax.value_and_grad(lambda x: jnp.sum(routed_linear(x, route_tokens(logits, 2).combine, w) ** 2))(x)

    expected = jax.jit(value_and_grad)(x, w, logits)
    with jinsum.check_indices(True):
        error, got = checkify.checkify(jax.jit(value_and_grad))(x, w, logits)
    error.throw()
    for a, b in zip(got, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# The layer


def numpy_moe(layer, x, activation="swiglu", norm_topk=True, capacity_factor=None):
    """`(y, aux_loss, gate)` in float64: every expert's MLP on every token, combined with the routing's gate."""
    params = {name: np.asarray(value, np.float64) for name, value in (
        ("router", layer.router.kernel[...]), ("up", layer.w_up[...]), ("down", layer.w_down[...]),
        *(() if layer.w_gate is None else (("gate", layer.w_gate[...]),)))}
    x = np.asarray(x, np.float64).reshape(-1, layer.in_features)
    _, _, _, gate, balance, z = numpy_routing(x @ params["router"], layer.top_k, norm_topk, capacity_factor)
    act = {"relu": lambda h: np.maximum(h, 0), "gelu": lambda h: 0.5 * h * (1 + erf(h / np.sqrt(2))),
           "swiglu": None}[activation]
    y = np.zeros_like(x)
    for e in range(layer.num_experts):
        up = x @ params["up"][e]
        hidden = act(up) if act else (x @ params["gate"][e]) / (1 + np.exp(-(x @ params["gate"][e]))) * up
        y += gate[:, e:e + 1] * (hidden @ params["down"][e])
    return y, 0.01 * balance + 0.001 * z, gate


def _layer(activation="swiglu", norm_topk=True, capacity_factor=None, param_dtype=jnp.float64, dtype=None,
           sizes=(7, 5, 5, 2), group_size=None):
    return MoE(*sizes, activation=activation, norm_topk=norm_topk, capacity_factor=capacity_factor, dtype=dtype,
               param_dtype=param_dtype, group_size=group_size, rngs=nnx.Rngs(1))


def _rig_router(layer, rng, tokens):
    """Inputs whose feature 0 is 1, and a router that adds +20 to expert 0's logit and -20 to the last expert's
    there: expert 0 takes every token, the last none."""
    x = rng.standard_normal((tokens, layer.in_features))
    x[:, 0] = 1
    kernel = np.asarray(layer.router.kernel[...]).copy()
    kernel[0, 0], kernel[0, -1] = 20, -20
    layer.router.kernel[...] = jnp.asarray(kernel, layer.router.kernel[...].dtype)
    return x


# (group_size 4: groups of 4 tokens of one expert, the last of each padded, as a kernel's row tile would be)
@pytest.mark.parametrize("activation, norm_topk, capacity_factor, rigged, group_size", [
    ("swiglu", True, None, False, None), ("gelu", False, None, False, 4), ("relu", True, None, True, None),
    ("swiglu", False, None, True, 4), ("swiglu", True, 1.0, True, None)], ids=str)
def test_layer_equals_every_expert_on_every_token_masked(activation, norm_topk, capacity_factor, rigged, group_size,
                                                          x64, rng):
    layer = _layer(activation, norm_topk, capacity_factor, group_size=group_size)
    x = _rig_router(layer, rng, 11) if rigged else rng.standard_normal((11, 7))
    y, aux, routing = nnx.jit(lambda layer, x: layer(x, return_routing=True))(layer, jnp.asarray(x))
    assert routing.combine.group_size == (group_size or routing.combine.group_size)
    expected, expected_aux, gate = numpy_moe(layer, x, activation, norm_topk, capacity_factor)
    if rigged:  # the cases the layer must not trip over: an expert with every token, one with none
        assert (gate[:, 0] > 0).all() == (capacity_factor is None) and (gate[:, -1] == 0).all()
    if capacity_factor is not None:
        # expert 0 keeps its first 5 of 11 tokens (and other experts may drop a few)
        assert int(routing.dropped) == 11 * 2 - (gate > 0).sum() >= 11 - expert_capacity(capacity_factor, 11, 2, 5)
    assert (layer.w_gate is None) == (activation != "swiglu")
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(float(aux), expected_aux, rtol=1e-12)


def test_gradients_of_input_experts_and_router(x64, rng):
    layer = _layer(sizes=(3, 2, 3, 2))
    graphdef = nnx.graphdef(layer)
    x = jnp.asarray(rng.standard_normal((5, 3)))
    logits = np.asarray(x) @ np.asarray(layer.router.kernel[...])
    gaps = np.diff(np.sort(logits, axis=1), axis=1)
    assert gaps.min() > 1e-2, "top-k must not flip under check_grads' perturbations"

    @jax.jit
    def apply(x, router, gate, up, down):
        params = nnx.State({"router": {"kernel": nnx.Param(router)}, "w_gate": nnx.Param(gate),
                            "w_up": nnx.Param(up), "w_down": nnx.Param(down)})
        return nnx.merge(graphdef, params)(x)

    weights = (layer.router.kernel[...], layer.w_gate[...], layer.w_up[...], layer.w_down[...])
    check_grads(apply, (x, *weights), order=1, modes=["rev"])


def test_batch_and_length_axes_are_tokens(rng):
    layer = _layer(param_dtype=jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 5, 7)), jnp.float32)
    forward = nnx.jit(lambda layer, x: layer(x))
    (y, aux), (flat, flat_aux) = forward(layer, x), forward(layer, x.reshape(10, 7))
    assert y.shape == (2, 5, 7)
    np.testing.assert_array_equal(np.asarray(y).reshape(10, 7), np.asarray(flat))
    assert float(aux) == float(flat_aux)


def test_new_inputs_compile_once_and_bind_the_statements(rng):
    layer = _layer(param_dtype=jnp.float32, capacity_factor=1.25)
    graphdef, state = nnx.split(layer)
    # (CountingJit, not `_cache_size()`: testing.py explains why the latter cannot count compiles in a full run)
    forward = CountingJit(lambda state, x: nnx.merge(graphdef, state)(x))
    for seed in range(3):
        forward(state, jnp.asarray(np.random.default_rng(seed).standard_normal((2, 6, 7)), jnp.float32))
    assert forward.traces == 1
    statements = [str(s.statement) for s in specs_in(lambda x: nnx.merge(graphdef, state)(x), jnp.ones((6, 7)))]
    assert statements == ["H[g,p,h] += X[Ak[g,p],c] * W[Ai[g],c,h]"] * 2 + [
        "O[g,p,n] += H[g,p,h] * W[Ai[g],h,n]", "Y[Ak[g,p],n] += Av[g,p] * O[g,p,n]"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=str)
def test_float32_and_bfloat16(dtype, rng):
    full = _layer(param_dtype=jnp.float32)
    half = _layer(param_dtype=jnp.float32, dtype=dtype)
    x = jnp.asarray(rng.standard_normal((12, 7)), jnp.float32)
    expected, expected_aux, _ = numpy_moe(full, x)
    with jax.default_matmul_precision("highest"):  # (float32 products: no TF32 on GPUs, as the reference)
        y, aux = nnx.jit(lambda layer, x: layer(x))(half, x)
    assert y.dtype == dtype and aux.dtype == jnp.float32  # the router (and its losses) stay float32
    assert_allclose(y, expected, dtype)
    assert_allclose(aux, expected_aux, np.float32)
    grads = nnx.jit(nnx.grad(lambda layer: jnp.sum(layer(x)[0].astype(jnp.float32)) + layer(x)[1]))(half)
    assert all(g.dtype == jnp.float32 and np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    assert np.abs(np.asarray(grads["router"]["kernel"][...])).max() > 0
