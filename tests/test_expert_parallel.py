"""Expert parallelism (`jinsum.nn._expert_parallel`) on the 4 CPU devices of the test run (conftest.py): experts and
tokens split over a mesh axis, rows sent to their experts' devices and back with `all_to_all`, against the same
layer on one device and a NumPy model of the per-destination capacity."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import checkify

import jinsum
from jinsum.nn._expert_parallel import _local_routing, destination_capacity, expert_parallel_mlp
from jinsum.nn._moe import routed_mlp
from jinsum.nn._moe_layer import MoE
from jinsum.nn._routing import route_tokens
from jinsum.testing import CountingJit

from test_moe import distinct_logits, numpy_moe

DEVICES = 4


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


@pytest.fixture
def mesh():
    if jax.device_count() < DEVICES:
        pytest.skip(f"needs {DEVICES} devices (XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES})")
    return jax.make_mesh((DEVICES,), ("x",))


def _operands(rng, T=32, E=8, C=6, H=5):
    """`(x, logits, w_up, w_gate, w_down)` in float64 (under `x64`), logits with clear top-k orders."""
    x, logits = rng.standard_normal((T, C)), distinct_logits(rng, T, E)
    w_up, w_gate = rng.standard_normal((E, C, H)), rng.standard_normal((E, C, H))
    w_down = rng.standard_normal((E, H, C))
    return tuple(map(jnp.asarray, (x, logits, w_up, w_gate, w_down)))


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_dropless_equals_one_device_and_its_gradients(top_k, mesh, x64, rng):
    """Without a capacity every pair reaches its expert: the output, the losses (the whole batch's, though each
    device routes its own tokens) and the gradients w.r.t. the input, every expert matrix and the logits equal the
    layer on one device."""
    x, logits, w_up, w_gate, w_down = _operands(rng)

    def sharded(x, logits, w_up, w_gate, w_down):
        y, routing = expert_parallel_mlp(x, logits, top_k, w_up, w_down, w_gate=w_gate, mesh=mesh, axis="x")
        return y, routing

    def single(x, logits, w_up, w_gate, w_down):
        routing = route_tokens(logits, top_k)
        return routed_mlp(x, routing.combine, w_up, w_down, w_gate=w_gate), routing

    cotangent = jnp.asarray(rng.standard_normal((x.shape[0], w_down.shape[-1])))

    def loss(f):
        def value(*args):
            y, routing = f(*args)
            return jnp.sum(y * cotangent) + routing.balance_loss + 0.1 * routing.z_loss
        return value

    def output_and_gradients(f):  # (one compiled program for both, not one each)
        return jax.jit(lambda *args: (f(*args), jax.grad(loss(f), argnums=(0, 1, 2, 3, 4))(*args)))

    ((y, routing), got), ((expected, reference), want) = (
        output_and_gradients(f)(x, logits, w_up, w_gate, w_down) for f in (sharded, single))
    assert y.shape == cotangent.shape
    np.testing.assert_allclose(np.asarray(y), np.asarray(expected), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(float(routing.balance_loss), float(reference.balance_loss), rtol=1e-12)
    np.testing.assert_allclose(float(routing.z_loss), float(reference.z_loss), rtol=1e-12)
    assert int(routing.dropped) == 0 and routing.combine is None
    np.testing.assert_array_equal(np.asarray(routing.experts), np.asarray(reference.experts))
    np.testing.assert_allclose(np.asarray(routing.weights), np.asarray(reference.weights), rtol=1e-12)

    for name, a, b in zip(("x", "logits", "w_up", "w_gate", "w_down"), got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-12, err_msg=name)


def _numpy_expert_parallel(x, logits, top_k, w_up, w_down, capacity):
    """The expert-parallel ReLU mixture in float64, pair by pair: device d's pairs bound to device j are kept in
    (token, rank) order while fewer than `capacity` were; returns `(y, dropped)`."""
    x, logits, w_up, w_down = (np.asarray(a, np.float64) for a in (x, logits, w_up, w_down))
    T, E = logits.shape
    local_tokens, local_experts = T // DEVICES, E // DEVICES
    y, dropped = np.zeros((T, w_down.shape[2])), 0
    for device in range(DEVICES):
        load = np.zeros(DEVICES, int)
        for t in range(device * local_tokens, (device + 1) * local_tokens):
            experts = np.argsort(-logits[t], kind="stable")[:top_k]
            weights = np.exp(logits[t, experts] - logits[t, experts].max())
            weights /= weights.sum()
            for e, w in zip(experts, weights):
                destination = e // local_experts
                if load[destination] < capacity:
                    y[t] += w * np.maximum(x[t] @ w_up[e], 0) @ w_down[e]
                else:
                    dropped += 1
                load[destination] += 1
    return y, dropped


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 2.0])
def test_capacity_drops_the_last_pairs_per_destination(capacity_factor, mesh, x64, rng):
    """With a capacity, each device sends each other at most `ceil(factor * T_local * k / D)` rows: the later
    pairs in token order are dropped (weight 0), counted over all devices, and add nothing."""
    x, logits, w_up, _, w_down = _operands(rng, T=64)
    capacity = destination_capacity(capacity_factor, 64 // DEVICES, 2, DEVICES)
    expected, dropped = _numpy_expert_parallel(x, logits, 2, w_up, w_down, capacity)
    y, routing = jax.jit(lambda *a: expert_parallel_mlp(*a[:2], 2, *a[2:], activation="relu", mesh=mesh, axis="x",
                                                        capacity_factor=capacity_factor))(x, logits, w_up, w_down)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-12, atol=1e-12)
    assert int(routing.dropped) == dropped == int(np.sum(np.asarray(routing.weights) == 0))
    assert (dropped > 0) == (capacity_factor < 2.0)


def test_layer_with_a_mesh_equals_the_layer_on_one_device(mesh, rng):
    """`MoE(..., mesh=, axis=)` computes what the same parameters compute on one device (float64 reference: every
    expert on every token), for a (batch, length, features) input, and compiles once for new inputs."""
    with jax.enable_x64(True):
        layer = MoE(7, 5, num_experts=8, top_k=2, param_dtype=jnp.float64, mesh=mesh, axis="x", rngs=nnx.Rngs(0))
        for w in (layer.w_gate, layer.w_up, layer.w_down):  # each device holds its experts' weights
            assert w[...].sharding.spec == jax.sharding.PartitionSpec("x")
            assert {s.data.shape[0] for s in w[...].addressable_shards} == {2}
        graphdef, state = nnx.split(layer)
        forward = CountingJit(lambda state, x: nnx.merge(graphdef, state)(x))  # (jitted: eagerly, 20x slower here)
        for seed in range(3):
            x = np.random.default_rng(seed).standard_normal((4, 8, 7)) if seed else rng.standard_normal((4, 8, 7))
            y, aux_loss = forward(state, jnp.asarray(x))
            expected, expected_aux, _ = numpy_moe(layer, x)
            np.testing.assert_allclose(np.asarray(y).reshape(-1, 7), expected, rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(float(aux_loss), expected_aux, rtol=1e-10)
        assert forward.traces == 1


def test_layer_with_a_mesh_takes_a_batch_the_devices_do_not_divide(mesh, rng):
    """A (batch, length, features) input whose batch the mesh axis does not divide (2 on 4 devices): the tokens come
    back from the experts split over the axis and are gathered before taking x's shape, as they were given (a reshape
    of the split tokens raised XLA's sharding error)."""
    layer = MoE(7, 5, num_experts=8, top_k=2, mesh=mesh, axis="x", rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.standard_normal((2, 8, 7)), jnp.float32)
    y, aux_loss = nnx.jit(lambda layer, x: layer(x))(layer, x)
    flat, flat_aux = nnx.jit(lambda layer, x: layer(x))(layer, x.reshape(16, 7))
    assert y.shape == (2, 8, 7)
    np.testing.assert_array_equal(np.asarray(y).reshape(16, 7), np.asarray(flat))
    assert float(aux_loss) == float(flat_aux)


def test_layer_gradients_with_the_tokens_split(mesh, x64, rng):
    """A data-parallel step holds its tokens split over the mesh: the layer's output and every parameter's gradient
    (the router's summed over the devices' tokens) equal the same parameters' on one device."""
    layers = [MoE(6, 5, num_experts=8, top_k=2, param_dtype=jnp.float64, rngs=nnx.Rngs(0), **kw)
              for kw in ({}, dict(mesh=mesh, axis="x"))]
    x, dy = jnp.asarray(rng.standard_normal((32, 6))), jnp.asarray(rng.standard_normal((32, 6)))
    tokens = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))

    def loss(params, graphdef, x, dy):
        y, aux_loss = nnx.merge(graphdef, params)(x)
        return jnp.sum(y * dy) + aux_loss

    (one, grads_one), (split, grads_split) = (
        jax.jit(jax.value_and_grad(loss), static_argnums=1)(nnx.state(layer), nnx.graphdef(layer), *inputs)
        for layer, inputs in zip(layers, ((x, dy), (jax.device_put(x, tokens), jax.device_put(dy, tokens)))))
    np.testing.assert_allclose(float(split), float(one), rtol=1e-12)
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(grads_one),
                                 jax.tree_util.tree_leaves_with_path(grads_split)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-10, atol=1e-12, err_msg=str(path))


def test_errors_name_the_mesh_and_the_sizes(mesh, rng):
    x, logits, w_up, _, w_down = _operands(rng, T=30)  # 30 tokens over 4 devices
    with pytest.raises(ValueError, match=r"the 8 experts and the 30 tokens must each split evenly over the 4 devices"):
        expert_parallel_mlp(x, logits, 2, w_up, w_down, activation="relu", mesh=mesh, axis="x")
    with pytest.raises(ValueError, match=r"axis 'y' is not an axis of the mesh"):
        expert_parallel_mlp(x, logits, 2, w_up, w_down, activation="relu", mesh=mesh, axis="y")
    with pytest.raises(ValueError, match="give both mesh and axis"):
        MoE(4, 4, 8, 2, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"MoE: the 6 experts must split evenly over the 4 devices of axis 'x'"):
        MoE(4, 4, 6, 2, mesh=mesh, axis="x", rngs=nnx.Rngs(0))


def test_empty_rows_go_to_an_expert_past_the_last():
    """The local routing of a received buffer: filled rows by their experts (value 1); the empty rows, and the
    builder's padding groups, on an expert past the last (value 0), so the kernels skip them; under
    `jinsum.check_indices` (which would report that expert) the empty rows are left out instead."""
    expert = jnp.asarray([1, -1, 0, 1, -1, -1, 2, -1], jnp.int32)
    A = jax.jit(lambda e: _local_routing(e, 3, jnp.float32))(expert)
    assert A.shape == (3, 8)
    Ai, Ak, Av = (np.asarray(a) for a in (A.Ai, A.Ak, A.Av))
    real = Ai < 3
    assert sorted(zip(Ai[:, None].repeat(Ak.shape[1], 1)[Av != 0], Ak[Av != 0])) == [(0, 2), (1, 0), (1, 3), (2, 6)]
    assert (Av[~real] == 0).all() and (~real).any() and (Ai[:-1] <= Ai[1:]).all()
    with jinsum.check_indices(True):
        error, checked = checkify.checkify(jax.jit(lambda e: _local_routing(e, 3, jnp.float32)))(expert)
    error.throw()
    assert (np.asarray(checked.Ai) < 3).all()
    np.testing.assert_array_equal(np.asarray(checked.todense()), np.asarray(A.todense()))
