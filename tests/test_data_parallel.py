"""Data-parallel mini-batch training (examples/minibatch_sage's `sampled_step(..., mesh=...)`) on every device (4
host devices in CI; on a GPU machine, its GPUs): each device samples its shard of the seeds from the replicated graph
and the gradients are summed over the devices, which must equal one device sampling the shards one after another with
the same keys, loss and updated parameters (with plain SGD: Adam's update hardly changes when every gradient is scaled
alike, and so would hide gradients summed twice); and several steps in one call equal as many calls."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jinsum.datasets import rmat
from jinsum.sampling import CSRGraph, sample_neighbors
from jinsum.testing import CountingJit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from minibatch_sage.main import JinsumSAGE, on_mesh, sampled_step  # noqa: E402

SIZES, FANOUTS = (16, 32, 4), (5, 3)
SAMPLING = dict(outer_sources="graph", with_transpose=(False, True))
SGD = optax.sgd(0.5)


@pytest.fixture(scope="module")
def task():
    edge_index, n = rmat(10, undirected=True, seed=0), 1 << 10
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(n, SIZES[0])).astype(np.float32))
    y = jnp.asarray(rng.integers(0, SIZES[-1], n).astype(np.int32))
    seeds = np.concatenate([rng.permutation(n)[:60], np.full(4, -1)]).astype(np.int32)  # the last shard padded
    return CSRGraph.from_edge_index(edge_index, n), x, y, jnp.asarray(seeds)


def _one_device_over_shards(graph, x, y, seeds, key, shards: int):
    """The reference: one model and SGD, the shards sampled in turn with `fold_in(key, d)`, one mean loss."""
    model = JinsumSAGE(SIZES, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, SGD, wrt=nnx.Param)

    def loss_fn(model):
        def shard(total, d):  # (a loop over the shards, not unrolled: one shard's program to compile)
            part = jax.lax.dynamic_slice_in_dim(seeds, d * (seeds.shape[0] // shards), seeds.shape[0] // shards)
            sample = sample_neighbors(graph, part, FANOUTS, jax.random.fold_in(key, d), **SAMPLING)
            losses = optax.softmax_cross_entropy_with_integer_labels(model(x, sample)[: part.shape[0]],
                                                                     y[jnp.maximum(part, 0)])
            return total + jnp.sum(jnp.where(part >= 0, losses, 0)), None

        total, _ = jax.lax.scan(shard, jnp.zeros((), x.dtype), jnp.arange(shards))
        return total / jnp.sum(seeds >= 0)

    loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model)  # (jitted: eager, the sampler dispatches op by op)
    optimizer.update(model, grads)
    return loss, model


def test_data_parallel_step_equals_one_device_over_the_shards(task):
    graph, x, y, seeds = task
    devices = jax.devices()  # (4 host devices in CI; on GPUs, every GPU)
    if len(devices) < 2 or seeds.shape[0] % len(devices):
        pytest.skip(f"needs 2 or more devices that divide the {seeds.shape[0]} seeds, got {len(devices)}")
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    key = jax.random.key(7)
    train, _, state = sampled_step(JinsumSAGE(SIZES, rngs=nnx.Rngs(0)), FANOUTS, tx=SGD, mesh=mesh, **SAMPLING)
    new_state, loss = train(state, graph, x, y, seeds, key)
    expected_loss, expected = _one_device_over_shards(graph, x, y, seeds, key, len(devices))
    np.testing.assert_allclose(float(loss), float(expected_loss), rtol=1e-5)
    trained = jax.tree.leaves(new_state[0])  # (the state of (model, optimizer): the model's first)
    reference = jax.tree.leaves(nnx.state(expected))
    assert len(trained) == len(reference)
    for a, b in zip(trained, reference):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    # The shards drew different neighbourhoods: not a single device's step over the whole batch with one key. (The
    # loss comes before the update, so plain SGD serves.)
    single, _, state1 = sampled_step(JinsumSAGE(SIZES, rngs=nnx.Rngs(0)), FANOUTS, tx=SGD, **SAMPLING)
    assert abs(float(single(state1, graph, x, y, seeds, key)[1]) - float(loss)) > 1e-6


def test_data_parallel_step_compiles_once(task):
    graph, x, y, seeds = task
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    train, _, state = sampled_step(JinsumSAGE(SIZES, rngs=nnx.Rngs(0)), FANOUTS, mesh=mesh, **SAMPLING)
    counted = CountingJit(lambda *args: train(*args))
    rng = np.random.default_rng(1)
    batches = [rng.permutation(x.shape[0])[: seeds.shape[0]].astype(np.int32) for _ in range(3)]
    graph, x, y, batches = on_mesh(mesh, graph, x, y, batches)  # (placed once, as the example and benchmark do)
    assert batches[0].sharding.spec == jax.sharding.PartitionSpec("data")
    for step, batch in enumerate(batches):  # new seeds and keys every step, as in training
        state, loss = counted(state, graph, x, y, batch, jax.random.key(step))
        assert np.isfinite(float(loss))
    assert counted.traces == 1


@pytest.mark.parametrize("data_parallel", [False, True])
def test_steps_in_one_call_equal_one_call_each(task, data_parallel):
    graph, x, y, seeds = task
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",)) if data_parallel else None
    if data_parallel and (len(jax.devices()) < 2 or seeds.shape[0] % len(jax.devices())):
        pytest.skip(f"needs 2 or more devices that divide the {seeds.shape[0]} seeds")
    rng = np.random.default_rng(2)
    batches = np.stack([rng.permutation(x.shape[0])[: seeds.shape[0]] for _ in range(3)]).astype(np.int32)
    keys = jax.random.split(jax.random.key(3), 3)
    one, _, state = sampled_step(JinsumSAGE(SIZES, rngs=nnx.Rngs(0)), FANOUTS, tx=SGD, mesh=mesh, **SAMPLING)
    many, _, _ = sampled_step(JinsumSAGE(SIZES, rngs=nnx.Rngs(0)), FANOUTS, tx=SGD, mesh=mesh, steps=3, **SAMPLING)
    expected_state, expected_losses = state, []
    for batch, key in zip(batches, keys):
        expected_state, loss = one(expected_state, graph, x, y, jnp.asarray(batch), key)
        expected_losses.append(float(loss))
    if mesh is not None:
        graph, x, y, [batches] = on_mesh(mesh, graph, x, y, [batches])
        assert batches.sharding.spec == jax.sharding.PartitionSpec(None, "data")  # (each step's seeds split)
    new_state, losses = many(state, graph, x, y, batches, keys)
    np.testing.assert_allclose(np.asarray(losses), expected_losses, rtol=1e-5)
    assert len(set(expected_losses)) == 3  # (three different steps, not one three times)
    for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(expected_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
