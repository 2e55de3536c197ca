"""Graphs computed from data (`jinsum.graphs.knn`, `knn_graph`, `radius`, `radius_graph`) against brute-force float64
NumPy, inside `jit`; `DynamicEdgeConv` against PyG's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jinsum
import jinsum.graphs as jg
import jinsum.nn as jnn
from jinsum.testing import CountingJit


def _candidate_distances(pos, batch, loop):
    """`(N, N)` squared distances in float64 from each point to its candidates (its element's points, itself only
    if `loop`), `inf` to every other point."""
    pos = np.asarray(pos, np.float64)
    d = ((pos[:, None, :] - pos[None, :, :]) ** 2).sum(-1)
    d[batch[:, None] != batch[None, :]] = np.inf
    d[batch < 0] = np.inf
    if not loop:
        np.fill_diagonal(d, np.inf)
    return d


def _brute_force(pos, k, batch, loop):
    """Each point's k nearest (ties: lower index) among its element's points, -1 padded."""
    d = _candidate_distances(pos, batch, loop)
    order = np.argsort(d, axis=1, kind="stable")[:, :k]
    found = np.take_along_axis(d, order, axis=1)
    return np.where(np.isfinite(found), order, -1)


def _assert_nearest_up_to(atol, found, pos, k, batch, loop):
    """`found` are every point's `k` nearest neighbours, nearest first, for distances that may each be off by up to
    `atol` (the rounding of `|x|^2 + |y|^2 - 2 x.y`, which depends on the machine's matrix product): neighbours
    as near as the brute force's, each a candidate once, and the brute force's very index wherever no other
    candidate lies within `2 atol` of it (there rounding cannot reorder it)."""
    d = _candidate_distances(pos, batch, loop)
    expected = _brute_force(pos, k, batch, loop)
    real = expected >= 0
    np.testing.assert_array_equal(found >= 0, real)  # as many neighbours as there are candidates, up to k
    rows = np.arange(d.shape[0])[:, None]
    found_d, expected_d = d[rows, np.maximum(found, 0)], d[rows, np.maximum(expected, 0)]
    assert np.isfinite(found_d[real]).all(), "a neighbour that is no candidate (another element, or the point)"
    assert all(len(set(row[row >= 0])) == (row >= 0).sum() for row in found), "a neighbour found twice"
    np.testing.assert_allclose(found_d[real], expected_d[real], rtol=0, atol=2 * atol)
    with np.errstate(invalid="ignore"):  # (inf - inf where a row has fewer than k candidates: not alone)
        alone = (np.abs(d[:, None, :] - expected_d[:, :, None]) <= 2 * atol).sum(axis=2) == 1
    np.testing.assert_array_equal(found[real & alone], expected[real & alone])
    return real & alone


def _product_rounding(pos) -> float:
    """A bound on the float32 rounding error of `|x|^2 + |y|^2 - 2 x.y` over the points `pos` (D terms a sum)."""
    squares = (np.asarray(pos, np.float64) ** 2).sum(1)
    return 4 * (pos.shape[1] + 2) * np.finfo(np.float32).eps * 2 * squares.max()


# Elements of 9, 2 (fewer than k: padded rows) and 14 points, and 3 padding points (batch -1); blocks of 5 and 64
# (several row and column blocks with padding, and one block).
@pytest.mark.parametrize("block_size", [5, 64])
@pytest.mark.parametrize("loop", [False, True])
def test_knn_equals_brute_force(rng, block_size, loop):
    batch = np.repeat([0, 1, 2, -1], [9, 2, 14, 3])
    pos = rng.standard_normal((batch.size, 3))
    k = 4
    expected = _brute_force(pos, k, batch, loop)
    found = np.asarray(jax.jit(lambda p, b: jg.knn(p, k, b, loop, block_size=block_size))(pos, batch))
    np.testing.assert_array_equal(found, expected)
    assert (found[batch == 1][:, 2 - (not loop):] == -1).all() and (found[batch == -1] == -1).all()


def test_knn_graph_reads_like_pyg_and_feeds_an_adjacency(rng):
    pos = rng.standard_normal((30, 8))
    k = 5
    edge_index = np.asarray(jax.jit(lambda p: jg.knn_graph(p, k, block_size=7))(pos))
    neighbors = _brute_force(pos, k, np.zeros(30, int), False)
    np.testing.assert_array_equal(edge_index[0], neighbors.reshape(-1))  # sources: the neighbours
    np.testing.assert_array_equal(edge_index[1], np.repeat(np.arange(30), k))  # targets: the centres
    x = rng.standard_normal((30, 2))
    A = jax.jit(lambda e: jg.adjacency(e, 30, capacity=30 * k))(edge_index)
    B = jinsum.GroupCOO.from_neighbors(neighbors, num_sources=30)
    expected = x[neighbors].sum(1)
    np.testing.assert_allclose(A @ x, expected, rtol=1e-5, atol=1e-6)  # (float32 edge values)
    np.testing.assert_allclose(B @ x, expected, rtol=1e-5, atol=1e-6)


def test_new_positions_do_not_recompile(rng):
    step = CountingJit(lambda p: jg.knn_graph(p, 3, block_size=16))
    for _ in range(5):
        step(rng.standard_normal((40, 3)))
    assert step.traces == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"pos must be a floating array \(N, D\)"):
        jg.knn(jnp.zeros(5), 2)
    with pytest.raises(ValueError, match=r"batch must be an integer array of shape \(5,\)"):
        jg.knn(jnp.zeros((5, 2)), 2, batch=jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        jg.knn(jnp.zeros((5, 2)), 0)
    assert jg.knn(jnp.zeros((0, 2)), 3).shape == (0, 3)


def _brute_force_radius(pos, r, batch, loop, width):
    """Each point's first `width` points within `r` (strictly) in its element, -1 padded, and how many there are."""
    d = ((pos[:, None, :] - pos[None, :, :]) ** 2).sum(-1)
    within = (d < r * r) & (batch[:, None] == batch[None, :]) & (batch[:, None] >= 0)
    if not loop:
        np.fill_diagonal(within, False)
    neighbors = np.full((pos.shape[0], width), -1)
    for i, row in enumerate(within):
        found = np.flatnonzero(row)[:width]
        neighbors[i, : found.size] = found
    return neighbors, within.sum(1)


# Elements as for knn; r = 2 in 3-D reaches most of an element, so a width of 4 cuts rows of the larger elements
# (not those of the element of 2 points), and 14, the largest element's size, cuts none.
@pytest.mark.parametrize("block_size", [5, 64])
@pytest.mark.parametrize("loop", [False, True])
@pytest.mark.parametrize("width", [4, 14])
def test_radius_equals_brute_force(rng, block_size, loop, width):
    batch = np.repeat([0, 1, 2, -1], [9, 2, 14, 3])
    pos = rng.standard_normal((batch.size, 3))
    expected, count = _brute_force_radius(pos, 2.0, batch, loop, width)
    with jax.enable_x64(True):  # (both in one compiled program)
        (found, found_count), (edge_index, overflow) = jax.tree.map(np.asarray, jax.jit(lambda p, b: (
            jg.radius(p, 2.0, b, width, loop, block_size=block_size),
            jg.radius_graph(p, 2.0, b, loop, width, block_size=block_size)))(pos, batch))
    np.testing.assert_array_equal(found, expected)
    np.testing.assert_array_equal(found_count, count)
    assert (found[batch == -1] == -1).all() and (found_count[batch == -1] == 0).all()
    assert bool(overflow) == (count > width).any() == (width == 4)
    np.testing.assert_array_equal(edge_index[0], expected.reshape(-1))  # sources: the points within reach
    np.testing.assert_array_equal(edge_index[1], np.where(expected >= 0, np.arange(batch.size)[:, None], -1).ravel())


def test_radius_graph_feeds_an_adjacency(rng):
    pos = rng.standard_normal((30, 2))
    edge_index, overflow = jax.jit(lambda p: jg.radius_graph(p, 0.5, max_num_neighbors=30, block_size=8))(pos)
    neighbors, _ = _brute_force_radius(pos, 0.5, np.zeros(30, int), False, 30)
    A = jax.jit(lambda e: jg.adjacency(e, 30, capacity=30 * 30))(edge_index)
    dense = np.zeros((30, 30))
    for i, row in enumerate(neighbors):
        dense[i, row[row >= 0]] = 1
    np.testing.assert_array_equal(A.todense(), dense)
    assert not overflow and A.todense().sum() > 30


def test_radius_new_positions_and_radii_do_not_recompile(rng):
    step = CountingJit(lambda p, r: jg.radius_graph(p, r, max_num_neighbors=6, block_size=16))
    for r in (0.5, 1.0, 2.0):
        step(rng.standard_normal((40, 3)), r)
    assert step.traces == 1


def test_radius_bad_arguments_and_empty_input():
    with pytest.raises(ValueError, match=r"r must be a radius >= 0, got -1.0"):
        jg.radius(jnp.zeros((5, 2)), -1.0)
    with pytest.raises(ValueError, match=r"r must be a scalar radius, got shape \(2,\)"):
        jg.radius(jnp.zeros((5, 2)), jnp.ones(2))
    with pytest.raises(ValueError, match="max_num_neighbors must be an int >= 1"):
        jg.radius_graph(jnp.zeros((5, 2)), 1.0, max_num_neighbors=0)
    with pytest.raises(ValueError, match=r"pos must be a floating array \(N, D\)"):
        jg.radius(jnp.zeros((5, 2), jnp.int32), 1.0)
    with pytest.raises(ValueError, match=r"batch must be an integer array of shape \(5,\)"):
        jg.radius(jnp.zeros((5, 2)), 1.0, batch=jnp.zeros(5))
    neighbors, count = jg.radius(jnp.zeros((0, 2)), 1.0, max_num_neighbors=3)
    edge_index, overflow = jg.radius_graph(jnp.zeros((0, 2)), 1.0, max_num_neighbors=3)
    assert neighbors.shape == (0, 3) and count.shape == (0,) and edge_index.shape == (2, 0) and not overflow


@pytest.mark.parametrize("aggr", ["max", "mean", "add"])
def test_dynamic_edge_conv_equals_pyg(rng, aggr, monkeypatch):
    """PyG's `DynamicEdgeConv` (its kNN, pyg-lib's, replaced by the brute force with the point itself included, as
    pyg-lib's: `[targets, sources]`) on three clouds, one smaller than k; jinsum's on the same with two padding
    points appended: outputs and the gradients of a random linear functional with respect to x and the MLP."""
    import torch  # noqa: PLC0415

    pyg = pytest.importorskip("torch_geometric.nn")
    import torch_geometric.typing  # noqa: PLC0415
    from test_pyg_aggregation_parity import _copy_linear  # noqa: PLC0415

    def pyg_lib_knn(x, y, ptr_x, ptr_y, k, cosine, num_workers):
        clouds = np.repeat(np.arange(ptr_x.numel() - 1), np.diff(ptr_x.numpy()))
        neighbors = _brute_force(x.detach().numpy(), k, clouds, loop=True)
        targets = np.broadcast_to(np.arange(len(neighbors))[:, None], neighbors.shape)
        return torch.from_numpy(np.stack([targets[neighbors >= 0], neighbors[neighbors >= 0]]))

    monkeypatch.setattr(torch_geometric.typing, "WITH_KNN", True)
    monkeypatch.setattr(torch.ops.pyg, "knn", pyg_lib_knn, raising=False)
    k, features, hidden, out = 5, 3, 7, 4
    batch = np.repeat([0, 1, 2], [9, 3, 12])
    x = rng.standard_normal((batch.size, features))
    probe = rng.standard_normal((batch.size, out))
    torch.manual_seed(0)
    theirs = pyg.DynamicEdgeConv(torch.nn.Sequential(torch.nn.Linear(2 * features, hidden), torch.nn.Tanh(),
                                                     torch.nn.Linear(hidden, out)), k, aggr=aggr).double()
    x_torch = torch.tensor(x, requires_grad=True)
    expected = theirs(x_torch, torch.from_numpy(batch))
    (expected * torch.from_numpy(probe)).sum().backward()
    with jax.enable_x64(True):
        rngs = nnx.Rngs(0)
        mlp = nnx.Sequential(nnx.Linear(2 * features, hidden, param_dtype=jnp.float64, rngs=rngs), jnp.tanh,
                             nnx.Linear(hidden, out, param_dtype=jnp.float64, rngs=rngs))
        _copy_linear(mlp.layers[0], theirs.nn[0])
        _copy_linear(mlp.layers[2], theirs.nn[2])
        ours = jnn.DynamicEdgeConv(mlp, k, aggr="sum" if aggr == "add" else aggr)
        graphdef, params = nnx.split(ours)
        padded_x = np.concatenate([x, rng.standard_normal((2, features))])
        padded_batch = np.concatenate([batch, [-1, -1]])

        def loss(params, x):
            y = nnx.merge(graphdef, params)(x, padded_batch)
            return (y[: batch.size] * probe).sum(), y

        (_, y), (grad_params, grad_x) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
            params, padded_x)
    np.testing.assert_allclose(y[: batch.size], expected.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(y[batch.size:], 0)
    np.testing.assert_allclose(grad_x[: batch.size], x_torch.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(grad_x[batch.size:], 0)
    for ours_linear, their_linear in ((grad_params["nn"]["layers"][0], theirs.nn[0]),
                                      (grad_params["nn"]["layers"][2], theirs.nn[2])):
        np.testing.assert_allclose(ours_linear["kernel"][...], their_linear.weight.grad.numpy().T, rtol=1e-12,
                                   atol=1e-12)
        np.testing.assert_allclose(ours_linear["bias"][...], their_linear.bias.grad.numpy(), rtol=1e-12, atol=1e-12)


def test_dynamic_edge_conv_bad_arguments():
    with pytest.raises(ValueError, match=r"aggr must be one of \('max', 'mean', 'sum', 'add'\), got 'min'"):
        jnn.DynamicEdgeConv(jnp.tanh, 3, aggr="min")
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        jnn.DynamicEdgeConv(jnp.tanh, 0)
    with pytest.raises(ValueError, match=r"expected node features \(N, F\), got shape \(4,\)"):
        jnn.DynamicEdgeConv(jnp.tanh, 2)(jnp.zeros(4))


@pytest.mark.parametrize("loop", [False, True])
def test_knn_kernel_path_equals_brute_force_and_the_tiled_path(rng, loop):
    """The inputs of `test_knn_equals_brute_force` through the CUDA path's kernel (`jinsum.kernels.knn_kernel`; on
    a CPU in Triton's interpreter, `jinsum._lowering._launch.interpreted`), also in bfloat16 (both paths upcast)."""
    from conftest import ON_GPU  # noqa: PLC0415
    from jinsum._lowering import _launch  # noqa: PLC0415

    if ON_GPU:
        pytest.skip("the interpreter runs where no GPU is (on a GPU: tests/test_knn_kernel.py)")
    batch = np.repeat([0, 1, 2, -1], [9, 2, 14, 3])
    pos = rng.standard_normal((batch.size, 3)).astype(np.float32)
    k = 4

    def knn(p, b):
        return jg.knn(p, k, b, loop, block_size=5)

    with _launch.interpreted():
        found, half = jax.jit(knn)(pos, batch), jax.jit(knn)(pos.astype(jnp.bfloat16), batch)
    np.testing.assert_array_equal(found, _brute_force(pos.astype(np.float64), k, batch, loop))
    np.testing.assert_array_equal(found, jax.jit(knn)(pos, batch))
    np.testing.assert_array_equal(half, jax.jit(knn)(pos.astype(jnp.bfloat16), batch))
