"""Formats built inside `jit` and sampled mini-batches through real generated kernels on a CUDA GPU, against the
host-built formats and float64. Run with `pytest -m gpu` on a machine with a GPU and jax-triton; skipped elsewhere.
(conftest sets `jinsum.small_terms` to 0, so every statement here is a kernel, not XLA's lowering.)"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp

import jinsum
from jinsum.sampling import CSRGraph, sample_neighbors

from conftest import ON_GPU

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def no_fallback():
    """Every statement must run in a generated kernel: a fallback to XLA fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", jinsum.FallbackWarning)
        yield


def _power_law_edges(rng, nodes, edges):
    """Edges with hub destinations and sources (the cases that split rows and columns across programs), 10% padding."""
    dst = np.minimum(rng.zipf(1.5, edges) - 1, nodes - 1)
    src = np.minimum(rng.zipf(1.5, edges) - 1, nodes - 1)
    index = np.stack([src, rng.permutation(dst)]).astype(np.int32)
    index[:, rng.random(edges) < 0.1] = -1
    return index


@pytest.mark.parametrize("features", [32, 128])
def test_device_built_spmm_and_gradient_in_kernels(features, rng):
    nodes, edges = 3000, 40000
    index = _power_law_edges(rng, nodes, edges)
    keep = (index >= 0).all(axis=0)
    dense = sp.coo_matrix((np.ones(keep.sum()), (index[1, keep], index[0, keep])), shape=(nodes, nodes)).toarray()
    x, cotangent = rng.normal(size=(nodes, features)), rng.normal(size=(nodes, features))

    @jax.jit
    def forward_and_grad(index, x):
        A = jinsum.GroupCOO.from_edge_index(index, num_nodes=nodes, capacity=edges)
        out, vjp = jax.vjp(lambda x: A @ x, x)
        return out, vjp(jnp.asarray(cotangent, x.dtype))[0], A.overflow

    out, grad, overflow = forward_and_grad(index, jnp.asarray(x, jnp.float32))
    assert not overflow
    np.testing.assert_allclose(np.asarray(out), dense @ x, rtol=2e-4, atol=2e-3)
    np.testing.assert_allclose(np.asarray(grad), dense.T @ cotangent, rtol=2e-4, atol=2e-3)


def test_sampled_two_layer_aggregation_in_kernels(rng):
    """A sampled batch's two-layer sum aggregation and its gradient: kernels against the XLA lowering (the same
    sample: the key fixes it), with and without the tables' column order."""
    nodes = 5000
    index = _power_law_edges(rng, nodes, 60000)
    index = index[:, (index >= 0).all(axis=0)]
    graph = CSRGraph.from_edge_index(index, nodes)
    features = jnp.asarray(rng.normal(size=(nodes, 64)), jnp.float32)
    seeds = jnp.asarray(rng.permutation(nodes)[:256], jnp.int32)

    def loss(features, with_transpose):
        sample = sample_neighbors(graph, seeds, (10, 5), jax.random.key(3), with_transpose=with_transpose)
        x = features[jnp.maximum(sample.node_ids, 0)]
        for A in sample.adjacencies:
            x = jnp.tanh(A @ x)
        return jnp.sum(x ** 2)

    for with_transpose in (False, True):
        value, grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)(features, with_transpose)
        with jinsum.triton(False):
            expected_value, expected_grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)(features,
                                                                                               with_transpose)
        np.testing.assert_allclose(float(value), float(expected_value), rtol=1e-4)
        np.testing.assert_allclose(np.asarray(grad), np.asarray(expected_grad), rtol=1e-3, atol=1e-4)
