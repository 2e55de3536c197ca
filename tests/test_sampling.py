"""Neighbor sampling on the device: real neighbors only, no repeats without replacement, fanouts respected, uniform
(chi-square), reproducible per key, and one compile for a whole epoch of batches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

import jinsum
from jinsum.sampling import CSRGraph, hop_sizes, sample_neighbors
from jinsum.testing import CountingJit


def _graph(rng, num_nodes=60, num_edges=400):
    src, dst = rng.integers(0, num_nodes, num_edges), rng.integers(0, num_nodes, num_edges)
    dst[:80] = 0  # a hub: degree > every fanout
    dst[80:82] = 1  # degree 2 (< fanout), node 2.. may have none
    edges = np.stack([src, dst])
    edges = edges[:, ~np.isin(edges[1], [2, 3])]  # nodes 2 and 3 have no in-neighbors
    return edges, num_nodes


def _in_neighbors(edges, node):
    return edges[0, edges[1] == node]


def _original_tables(sample):
    """Each layer's neighbor table in original node ids (-1 padding), innermost first, with its destinations."""
    ids = np.asarray(sample.node_ids)
    out = []
    for A in reversed(sample.adjacencies):  # innermost first
        Ak, Av = np.asarray(A.Ak), np.asarray(A.Av)
        out.append((ids[: A.shape[0]], np.where(Av != 0, ids[Ak], -1)))
    return out


@pytest.mark.parametrize("replace", [False, True], ids=["without replacement", "with replacement"])
def test_samples_are_real_neighbors_within_the_fanouts(replace, rng):
    edges, n = _graph(rng)
    graph = CSRGraph.from_edge_index(edges, n)
    seeds = jnp.array([0, 1, 2, 5, 7, -1])
    sample = jax.jit(sample_neighbors, static_argnums=2, static_argnames="replace")(
        graph, seeds, (4, 3), jax.random.key(1), replace=replace)
    assert sample.sizes == tuple(reversed(hop_sizes(6, (4, 3))))
    ids = np.asarray(sample.node_ids)
    np.testing.assert_array_equal(ids[:6], [0, 1, 2, 5, 7, -1])
    real = ids[ids >= 0]
    assert len(np.unique(real)) == len(real)  # every node once
    for (dst, table), fanout in zip(_original_tables(sample), (4, 3)):
        for node, row in zip(dst, table):
            drawn = row[row >= 0]
            if node < 0:
                assert drawn.size == 0
                continue
            true = _in_neighbors(edges, node)
            assert np.isin(drawn, true).all()
            if replace:
                assert drawn.size == (fanout if true.size else 0)
            else:
                # without replacement: distinct edges (positions), so a multi-edge may repeat a node id only as often
                # as it has edges; a node of low degree keeps all its in-edges
                assert drawn.size == min(fanout, true.size)
                values, counts = np.unique(drawn, return_counts=True)
                assert all(c <= (true == v).sum() for v, c in zip(values, counts))


def test_same_key_same_batch_other_key_other_batch(rng):
    edges, n = _graph(rng)
    graph = CSRGraph.from_edge_index(edges, n)
    seeds = jnp.arange(10)
    sample = jax.jit(sample_neighbors, static_argnums=2)  # (one program: eagerly each of ~170 operations compiles)
    a = sample(graph, seeds, (5, 5), jax.random.key(3))
    b = sample(graph, seeds, (5, 5), jax.random.key(3))
    c = sample(graph, seeds, (5, 5), jax.random.key(4))
    np.testing.assert_array_equal(np.asarray(a.node_ids), np.asarray(b.node_ids))
    assert not np.array_equal(np.asarray(a.adjacencies[-1].Ak), np.asarray(c.adjacencies[-1].Ak))


@pytest.mark.parametrize("replace", [False, True], ids=["without replacement", "with replacement"])
def test_uniform_over_a_nodes_neighbors(replace):
    """A node of 12 in-neighbors, fanout 5, drawn 4,000 times: each neighbor's frequency is uniform (chi-square,
    fixed seed), and without replacement every draw holds 5 distinct ones."""
    degree, fanout, trials = 12, 5, 4000
    edges = np.stack([np.arange(1, degree + 1), np.zeros(degree, int)])
    graph = CSRGraph.from_edge_index(edges, degree + 1)
    draw = jax.jit(jax.vmap(lambda key: sample_neighbors(graph, jnp.zeros(1, jnp.int32), (fanout,), key,
                                                         replace=replace).adjacencies[0].Ak[0]))
    local = np.asarray(draw(jax.random.split(jax.random.key(0), trials)))
    ids_of = jax.jit(jax.vmap(lambda key: sample_neighbors(graph, jnp.zeros(1, jnp.int32), (fanout,), key,
                                                           replace=replace).node_ids))
    ids = np.asarray(ids_of(jax.random.split(jax.random.key(0), trials)))
    drawn = np.take_along_axis(ids, local, axis=1)
    if not replace:
        assert all(len(set(row)) == fanout for row in drawn)
    counts = np.bincount(drawn.ravel(), minlength=degree + 1)[1:]
    assert counts.sum() == trials * fanout
    p = scipy.stats.chisquare(counts).pvalue
    assert p > 1e-3, (counts, p)


@pytest.mark.parametrize("with_transpose", [False, True], ids=["atomic backward", "column order"])
def test_an_epoch_of_batches_compiles_once(with_transpose, rng):
    edges, n = _graph(rng)
    graph = CSRGraph.from_edge_index(edges, n)
    features = jnp.asarray(rng.normal(size=(n, 3)))

    @CountingJit
    def step(graph, seeds, key):
        sample = sample_neighbors(graph, seeds, (3, 2), key, with_transpose=with_transpose)
        assert all((A.transposed is not None) == with_transpose for A in sample.adjacencies)

        def loss(features):
            x = features[jnp.maximum(sample.node_ids, 0)]
            for A in sample.adjacencies:
                x = A @ x
            return x.sum()

        return jax.grad(loss)(features), sample

    order = rng.permutation(n)
    for i in range(100):
        seeds = np.resize(np.roll(order, i), 8)
        grad, sample = step(graph, seeds, jax.random.key(i))
    assert step.traces == 1
    # the last batch's gradient: each node's feature row counts the sampled paths from it to the seeds
    paths = np.ones((8, 1))
    for A in reversed(sample.adjacencies):
        paths = np.asarray(A.todense()).T @ paths
    expected = np.zeros((n, 1))
    np.add.at(expected, np.maximum(np.asarray(sample.node_ids), 0), paths * (np.asarray(sample.node_ids) >= 0)[:, None])
    np.testing.assert_allclose(np.asarray(grad)[:, :1], expected, rtol=1e-5)


def test_sample_feeds_sage_layers_like_pyg_mini_batches(rng):
    """A two-layer mean aggregation over the sample equals the same aggregation over the sampled edges, computed by
    hand in float64 on the original ids."""
    edges, n = _graph(rng)
    graph = CSRGraph.from_edge_index(edges, n)
    x = rng.normal(size=(n, 4))
    sample = jax.jit(lambda seeds, key: sample_neighbors(graph, seeds, (3, 2), key))(  # (eagerly: ~170 compiles)
        jnp.array([0, 1, 4]), jax.random.key(7))
    h = jnp.asarray(x)[jnp.maximum(sample.node_ids, 0)]
    for A in sample.adjacencies:
        counts = A @ jnp.ones((A.shape[1], 1))
        h = (A @ h) / jnp.maximum(counts, 1)
    expected = x[np.maximum(np.asarray(sample.node_ids), 0)]
    for A in sample.adjacencies:
        dense = np.asarray(A.todense())
        expected = dense @ expected / np.maximum(dense.sum(1, keepdims=True), 1)
    np.testing.assert_allclose(np.asarray(h), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("replace", [False, True])
def test_outer_sources_in_graph_ids_equal_the_gathered_sample(replace, rng):
    """`outer_sources="graph"`: the same draw, the outermost adjacency over the graph's ids (the first layer reads
    the feature table in place); the two-layer product and its gradient equal the PyG reading's."""
    edges, n = _graph(rng)
    graph = CSRGraph.from_edge_index(edges, n)
    x = jnp.asarray(rng.normal(size=(n, 4)))
    seeds, key = jnp.array([0, 1, 4, -1]), jax.random.key(5)
    local, direct = jax.jit(lambda seeds, key: (  # (one program: eagerly each of ~190 operations compiles)
        sample_neighbors(graph, seeds, (3, 2), key, replace=replace),
        sample_neighbors(graph, seeds, (3, 2), key, replace=replace, outer_sources="graph",
                         with_transpose=(False, True))))(seeds, key)
    assert direct.sizes == (n,) + local.sizes[1:] and direct.adjacencies[0].shape == (local.sizes[1], n)
    assert [A.transposed is not None for A in direct.adjacencies] == [False, True]
    np.testing.assert_array_equal(direct.node_ids, local.node_ids[: local.sizes[1]])

    def local_reading(x):
        h = x[jnp.maximum(local.node_ids, 0)]
        for A in local.adjacencies:
            h = A @ h
        return h

    def graph_reading(x):
        h = x
        for A in direct.adjacencies:
            h = A @ h
        return h

    np.testing.assert_allclose(graph_reading(x), local_reading(x), rtol=1e-12)
    probe = jnp.asarray(rng.normal(size=(4, 4)))
    grads = [jax.grad(lambda x, f=f: (f(x) * probe).sum())(x) for f in (graph_reading, local_reading)]
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-12, atol=1e-12)


def test_seeds_out_of_range_raise_eagerly_and_are_padding_under_jit(rng):
    edges, n = _graph(rng)
    graph = CSRGraph.from_edge_index(edges, n)
    seeds, key = np.array([0, 5, -1, n, 7]), jax.random.key(2)
    with pytest.raises(ValueError, match=rf"sample_neighbors: seeds\[3\] = {n} is out of range: expected a node id in "
                                         rf"\[0, num_nodes = {n}\), or a negative id \(-1\) for padding"):
        sample_neighbors(graph, seeds, (3, 2), key)
    # under jit (which cannot raise) the seed becomes padding, as documented
    traced = jax.jit(lambda s: sample_neighbors(graph, s, (3, 2), key))(seeds)
    padded = sample_neighbors(graph, np.where(seeds == n, -1, seeds), (3, 2), key)
    np.testing.assert_array_equal(np.asarray(traced.node_ids), np.asarray(padded.node_ids))
    assert np.asarray(traced.node_ids)[3] == -1
    # the range's ends: no error (five seeds, as above: the same eager operations, compiled once)
    sample_neighbors(graph, np.array([0, n - 1, -1, 5, 7]), (3, 2), key)


def test_bad_arguments():
    graph = CSRGraph.from_edge_index(np.array([[0], [1]]), 2)
    with pytest.raises(ValueError, match="seeds must be a 1-D integer array"):
        sample_neighbors(graph, jnp.zeros((2, 2), jnp.int32), (2,), jax.random.key(0))
    with pytest.raises(ValueError, match="fanout must be an int >= 0"):
        sample_neighbors(graph, jnp.zeros(2, jnp.int32), (-1,), jax.random.key(0))
    with pytest.raises(ValueError, match="one bool per layer"):
        sample_neighbors(graph, jnp.zeros(2, jnp.int32), (2, 2), jax.random.key(0), with_transpose=(True,))
    with pytest.raises(ValueError, match="outer_sources must be"):
        sample_neighbors(graph, jnp.zeros(2, jnp.int32), (2,), jax.random.key(0), outer_sources="global")
    with pytest.raises(ValueError, match=r"outside \[0, num_nodes = 2\)"):
        CSRGraph.from_edge_index(np.array([[0], [2]]), 2)
    assert isinstance(jinsum.sampling.NeighborSample, type)
