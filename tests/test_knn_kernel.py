"""The kNN kernel (`jinsum.kernels.knn_kernel`, launched by `jinsum._lowering._knn`) against brute force and the tiled
XLA path: in Triton's interpreter on CPU (small shapes; the interpreter is slow), and through real kernels on a GPU
(`pytest -m gpu`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jinsum
import jinsum.graphs as jg
from jinsum._lowering import _knn, _launch
from jinsum._lowering._knn import KnnConfig

from conftest import ON_GPU
from test_point_graphs import _assert_nearest_up_to, _brute_force, _product_rounding

interpreter = pytest.mark.skipif(ON_GPU, reason="the interpreter runs where no GPU is")


def on_gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")(test))


# Rows per program of 8 and 16 (a row over 4 and 2 lanes) and 32 (a lane per row); blocks of 16 for tl.dot, also
# where D is not a multiple of 16. Each with and without loops would double the interpreter's time for little.
CASES = {"3-default": (3, None, False), "3-default-loop": (3, None, True),
         "3-small": (3, KnnConfig(block_m=8, block_n=8), False),
         "3-lane-loop": (3, KnnConfig(block_m=32, block_n=16), True),
         "20-dot": (20, KnnConfig(block_m=16, block_n=16), False), "64-default-loop": (64, None, True),
         "5-dot": (5, KnnConfig(block_m=16, block_n=16, direct=False), False)}


def _cloud_batch():
    """Elements of 9, 2 (fewer than k), 14 and 1 point, padding points (-1) between and after them: 31 points, not
    a multiple of any block."""
    return np.repeat([0, 0, -1, 1, 2, -1, 2, 3, -1], [5, 4, 1, 2, 8, 2, 6, 1, 2]).astype(np.int32)


def _points(rng, n, dim, duplicates=True):
    pos = rng.standard_normal((n, dim)).astype(np.float32)
    if duplicates:  # coincident points: ties at distance 0, and equal distances from everyone else
        pos[[3, 8, 20]] = pos[0], pos[5], pos[19]
    return pos


def _xla(pos, k, batch, loop):
    """The tiled XLA path (this is a CPU: `jg.knn` takes it)."""
    return np.asarray(jax.jit(lambda p, b: jg.knn(p, k, b, loop, block_size=8))(pos, batch))


def _by_differences(dim, config) -> bool:
    return dim < _knn.DIFFERENCES_BELOW if config is None or config.direct is None else config.direct


@interpreter
@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_brute_force_and_xla(rng, case):
    """By differences, exactly the brute force's neighbours (coincident points in index order) on any CPU; by
    `tl.dot` (in the interpreter NumPy's matrix product, whose rounding depends on the BLAS build and the CPU), the
    promise of `jinsum.graphs.knn`: exact where rounding cannot reorder, as near elsewhere (the XLA path alike)."""
    dim, config, loop = CASES[case]
    batch = _cloud_batch()
    pos = _points(rng, batch.size, dim)
    k = 4
    found = _knn.interpret(pos, k, batch, loop, config)
    if _by_differences(dim, config):
        np.testing.assert_array_equal(found, _brute_force(pos, k, batch, loop))
    else:
        checked = _assert_nearest_up_to(_product_rounding(pos), found, pos, k, batch, loop)
        # Most indices are compared exactly: all but those of the three pairs of coincident points.
        assert checked.sum() >= 0.7 * (found >= 0).sum()
    xla = _xla(pos, k, batch, loop)
    if dim < _knn.DIFFERENCES_BELOW:
        np.testing.assert_array_equal(xla, _brute_force(pos, k, batch, loop))
    else:
        _assert_nearest_up_to(_product_rounding(pos), xla, pos, k, batch, loop)
    assert (found[batch == 1][:, 2 - (not loop):] == -1).all() and (found[batch < 0] == -1).all()


@interpreter
@pytest.mark.parametrize("dim", [3, 16])
def test_ties_on_a_grid_take_the_lower_index(rng, dim):
    """Integer coordinates: every distance is exact in float32 and many are equal."""
    batch = np.repeat([0, 1], [23, 18]).astype(np.int32)
    pos = rng.integers(0, 3, (batch.size, dim)).astype(np.float32)
    k = 7  # (KP = 8: one unused slot)
    found = _knn.interpret(pos, k, batch, False, KnnConfig(block_m=16, block_n=16))
    np.testing.assert_array_equal(found, _brute_force(pos.astype(np.float64), k, batch, False))
    np.testing.assert_array_equal(found, _xla(pos, k, batch, False))


@interpreter
def test_unsorted_batch_and_k_past_the_tile(rng):
    """Elements interleaved (no sorted ranges: every block scans all points), and k larger than a column tile."""
    batch = rng.integers(-1, 3, 37).astype(np.int32)
    pos = _points(rng, batch.size, 3)
    starts, ends = (np.asarray(a) for a in _knn.column_ranges(jnp.asarray(batch), 16))
    assert (starts == 0).all() and (ends == batch.size).all()
    found = _knn.interpret(pos, 20, batch, False, KnnConfig(block_m=16, block_n=32))
    np.testing.assert_array_equal(found, _brute_force(pos.astype(np.float64), 20, batch, False))


def test_column_ranges_cover_each_block_s_elements():
    batch = jnp.asarray(np.repeat([-1, 0, 1, -1, 1, 2, 3, -1], [3, 4, 5, 2, 3, 6, 1, 8]), jnp.int32)
    starts, ends = (np.asarray(a) for a in _knn.column_ranges(batch, 8))
    # Blocks [0, 8) hold elements 0..1, [8, 16) 1 (and padding), [16, 24) 1..3, [24, 32) padding only. An element's
    # range takes in the padding points after it: [7, 17) for element 1, [23, 32) for element 3.
    np.testing.assert_array_equal(starts, [3, 7, 7, 0])
    np.testing.assert_array_equal(ends, [17, 17, 32, 0])


@interpreter
def test_knn_through_the_kernel_path_jit_vmap_and_grad(rng):
    """`jg.knn` with the kernel path on CPU (`interpreted`): under jit, over a batch vector and vmapped over clouds
    (the vmap rule lays the clouds end to end), and inside a differentiated step."""
    k = 3
    clouds = rng.standard_normal((3, 13, 3)).astype(np.float32)
    cloud_batch = np.where(np.arange(13) < 10, 0, 1).astype(np.int32)
    cloud_batch[4] = -1
    with _launch.interpreted():
        vmapped = np.asarray(jax.jit(jax.vmap(lambda p: jg.knn(p, k)))(clouds))
        both = np.asarray(jax.jit(jax.vmap(lambda p, b: jg.knn(p, k, b)))(clouds, np.stack([cloud_batch] * 3)))
        lowered = jax.jit(lambda p: jg.knn(p, k)).lower(clouds[0]).as_text()

        def loss(p):
            neighbours = jg.knn(p, k)
            return jnp.sum((p[:, None, :] - p[neighbours]) ** 2)

        grad = jax.jit(jax.grad(loss))(clouds[0])
    assert "callback" in lowered  # (the interpreter's host callback stands in for the CUDA kernel)
    for c in range(3):
        np.testing.assert_array_equal(vmapped[c], _brute_force(clouds[c].astype(np.float64), k, np.zeros(13), False))
        np.testing.assert_array_equal(both[c], _brute_force(clouds[c].astype(np.float64), k, cloud_batch, False))
    np.testing.assert_allclose(grad, jax.jit(jax.grad(loss))(clouds[0]), rtol=1e-6)  # (the tiled path's)


# --- real kernels ---------------------------------------------------------------------------------------------------

def _both_paths(fn, *inputs):
    """`jax.jit(fn)(*inputs)` through the kernel and through the tiled XLA path (`jinsum.triton(False)`)."""
    found = np.asarray(jax.jit(fn)(*inputs))
    with jinsum.triton(False):
        expected = np.asarray(jax.jit(fn)(*inputs))
    return found, expected


@on_gpu
@pytest.mark.parametrize("dim", [3, 20, 64])
@pytest.mark.parametrize("loop", [False, True], ids=["no_loop", "loop"])
def test_gpu_kernel_equals_xla_on_a_grid(rng, dim, loop):
    """Integer coordinates (exact distances, many ties): the kernel and the tiled XLA path agree exactly, over a
    sorted batch vector of 24 clouds of 1-699 points with padding points, over the same unsorted, and vmapped."""
    batch = np.repeat(np.arange(24), rng.integers(1, 700, 24)).astype(np.int32)
    batch[rng.random(batch.size) < 0.02] = -1
    pos = rng.integers(-4, 5, (batch.size, dim)).astype(np.float32)
    k = 20

    def knn(p, b):
        return jg.knn(p, k, b, loop)

    assert _launch.KERNEL_NODE in jax.jit(knn).lower(pos, batch).as_text()
    np.testing.assert_array_equal(*_both_paths(knn, pos, batch))
    shuffled = rng.permutation(batch.size)
    np.testing.assert_array_equal(*_both_paths(knn, pos[shuffled], batch[shuffled]))
    clouds = rng.integers(-4, 5, (4, 1000, dim)).astype(np.float32)
    np.testing.assert_array_equal(*_both_paths(jax.vmap(lambda p: jg.knn(p, k, None, loop)), clouds))


@on_gpu
@pytest.mark.parametrize("dtype", [np.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
def test_gpu_kernel_half_precision_and_wide_k(rng, dtype):
    """Half-precision positions (read as stored, measured in float32, as the XLA path upcasts) and k = 100 (a
    running top-k of 128 slots)."""
    batch = np.repeat(np.arange(5), [300, 90, 1, 700, 257]).astype(np.int32)
    pos = rng.integers(-3, 4, (batch.size, 8)).astype(dtype)
    np.testing.assert_array_equal(*_both_paths(lambda p, b: jg.knn(p, 100, b), pos, batch))


@on_gpu
@pytest.mark.parametrize("dim", [3, 64])
def test_gpu_kernel_matches_xla_on_random_points(rng, dim):
    """16 clouds of 1,024 normal points and one cloud of 20,000: the same neighbours as the XLA path but for near
    ties in float32 (the two round their distances differently), and the same distances."""
    pos = rng.standard_normal((16 * 1024 + 20_000, dim)).astype(np.float32)
    batch = np.concatenate([np.repeat(np.arange(16), 1024), np.full(20_000, 16)]).astype(np.int32)
    k = 20
    found, expected = _both_paths(lambda p, b: jg.knn(p, k, b), pos, batch)
    assert (found >= 0).all()
    assert (found == expected).mean() > 0.99
    distance = ((pos[:, None, :].astype(np.float64) - pos[found]) ** 2).sum(-1)
    reference = ((pos[:, None, :].astype(np.float64) - pos[expected]) ** 2).sum(-1)
    np.testing.assert_allclose(distance, reference, rtol=1e-4, atol=1e-5)
    assert (np.diff(distance, axis=1) >= -1e-5 * (1 + distance[:, 1:])).all()  # nearest first


@on_gpu
@pytest.mark.parametrize("dim", [3, 64])
def test_gpu_coincident_points_keep_the_promise(rng, dim):
    """Clouds where one point in five is a copy of another point of its cloud, through the real kernel: below
    `DIFFERENCES_BELOW` coordinates exactly the brute force's neighbours (copies in index order); from there, the
    `tl.dot` form's promise (as near, exact wherever rounding cannot reorder)."""
    batch = np.repeat(np.arange(4), [150, 90, 1, 160]).astype(np.int32)
    pos = rng.standard_normal((batch.size, dim)).astype(np.float32)
    for cloud in range(4):
        members = np.flatnonzero(batch == cloud)
        copies = rng.choice(members, members.size // 5, replace=False)
        pos[copies] = pos[rng.choice(members, copies.size)]
    k = 16

    def knn(p, b):
        return jg.knn(p, k, b)

    assert _launch.KERNEL_NODE in jax.jit(knn).lower(pos, batch).as_text()
    found = np.asarray(jax.jit(knn)(pos, batch))
    if dim < _knn.DIFFERENCES_BELOW:
        np.testing.assert_array_equal(found, _brute_force(pos, k, batch, False))
    else:
        _assert_nearest_up_to(_product_rounding(pos), found, pos, k, batch, False)
