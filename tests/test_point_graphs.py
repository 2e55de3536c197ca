"""Graphs computed from data (`jinsum.nn.knn`, `knn_graph`) against brute-force float64 NumPy, inside `jit`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jinsum
import jinsum.nn as jnn


def _brute_force(pos, k, batch, loop):
    """Each point's k nearest (ties: lower index) among its element's points, -1 padded."""
    d = ((pos[:, None, :] - pos[None, :, :]) ** 2).sum(-1)
    d[batch[:, None] != batch[None, :]] = np.inf
    d[batch < 0] = np.inf
    if not loop:
        np.fill_diagonal(d, np.inf)
    order = np.argsort(d, axis=1, kind="stable")[:, :k]
    found = np.take_along_axis(d, order, axis=1)
    return np.where(np.isfinite(found), order, -1)


# Elements of 9, 2 (fewer than k: padded rows) and 14 points, and 3 padding points (batch -1); blocks of 5 and 64
# (several row and column blocks with padding, and one block).
@pytest.mark.parametrize("block_size", [5, 64])
@pytest.mark.parametrize("loop", [False, True])
def test_knn_equals_brute_force(rng, block_size, loop):
    batch = np.repeat([0, 1, 2, -1], [9, 2, 14, 3])
    pos = rng.standard_normal((batch.size, 3))
    k = 4
    expected = _brute_force(pos, k, batch, loop)
    found = jax.jit(lambda p, b: jnn.knn(p, k, b, loop, block_size=block_size))(pos, batch)
    np.testing.assert_array_equal(found, expected)
    assert (found[batch == 1][:, 2 - (not loop):] == -1).all() and (found[batch == -1] == -1).all()


def test_knn_graph_reads_like_pyg_and_feeds_an_adjacency(rng):
    pos = rng.standard_normal((30, 8))
    k = 5
    edge_index = np.asarray(jax.jit(lambda p: jnn.knn_graph(p, k, block_size=7))(pos))
    neighbors = _brute_force(pos, k, np.zeros(30, int), False)
    np.testing.assert_array_equal(edge_index[0], neighbors.reshape(-1))  # sources: the neighbours
    np.testing.assert_array_equal(edge_index[1], np.repeat(np.arange(30), k))  # targets: the centres
    x = rng.standard_normal((30, 2))
    A = jax.jit(lambda e: jnn.adjacency(e, 30, capacity=30 * k))(edge_index)
    B = jinsum.GroupCOO.from_neighbors(neighbors, num_sources=30)
    expected = x[neighbors].sum(1)
    np.testing.assert_allclose(A @ x, expected, rtol=1e-5, atol=1e-6)  # (float32 edge values)
    np.testing.assert_allclose(B @ x, expected, rtol=1e-5, atol=1e-6)


def test_new_positions_do_not_recompile(rng):
    step = jax.jit(lambda p: jnn.knn_graph(p, 3, block_size=16))
    for _ in range(5):
        step(rng.standard_normal((40, 3)))
    assert step._cache_size() == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"pos must be a floating array \(N, D\)"):
        jnn.knn(jnp.zeros(5), 2)
    with pytest.raises(ValueError, match=r"batch must be an integer array of shape \(5,\)"):
        jnn.knn(jnp.zeros((5, 2)), 2, batch=jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        jnn.knn(jnp.zeros((5, 2)), 0)
    assert jnn.knn(jnp.zeros((0, 2)), 3).shape == (0, 3)
