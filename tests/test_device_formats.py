"""Formats built on the device (inside `jit`, for a static capacity) against the host converters and float64 SciPy:
same products and gradients, padding that changes nothing, overflow reported and nothing else lost."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp
from jax.experimental import checkify
from jax.test_util import check_grads

import jinsum
import jinsum.graphs
import jinsum.nn
from jinsum.formats._build import CONTENDED_ROW_LENGTH, capacity_group_size, group_bound, row_lengths
from jinsum.testing import CountingJit


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def _edges(rng, num_src, num_dst, num_edges, *, hubs=False, duplicates=False):
    src = rng.integers(0, num_src, num_edges)
    dst = rng.integers(0, num_dst, num_edges)
    if hubs and num_edges:
        dst[: num_edges // 2] = 0  # one row holds half the entries
    if duplicates and num_edges > 1:
        src[1::2], dst[1::2] = src[::2][: num_edges // 2], dst[::2][: num_edges // 2]
    return np.stack([src, dst])


def _reference(edge_index, values, shape):
    """float64 SciPy matrix of the valid edges (duplicates summed)."""
    keep = (edge_index >= 0).all(axis=0)
    return sp.coo_matrix((values[keep], (edge_index[1, keep], edge_index[0, keep])), shape=shape).toarray()


def _pad(edge_index, values, extra, rng):
    """Padding columns (-1) scattered among the edges."""
    total = edge_index.shape[1] + extra
    at = np.sort(rng.choice(total, edge_index.shape[1], replace=False))
    padded, padded_values = -np.ones((2, total), edge_index.dtype), np.zeros(total)
    padded[:, at], padded_values[at] = edge_index, values
    return padded, padded_values


CASES = {  # name: (num_src, num_dst, edges, hubs, duplicates, padding)
    "random": (37, 29, 150, False, False, 20),
    "square": (40, 40, 200, False, False, 0),
    "hub row": (30, 25, 160, True, False, 7),
    "duplicates": (12, 10, 80, False, True, 5),
    "empty graph": (9, 7, 0, False, False, 6),
    "all padding": (9, 7, 0, False, False, 0),
    "one row": (50, 1, 40, False, False, 3),
}


@pytest.mark.parametrize("case", CASES)
def test_device_format_equals_host_format_and_scipy(case, rng):
    num_src, num_dst, num_edges, hubs, duplicates, padding = CASES[case]
    edges = _edges(rng, num_src, num_dst, num_edges, hubs=hubs, duplicates=duplicates)
    values = rng.normal(size=num_edges)
    padded, padded_values = _pad(edges, values, padding, rng)
    expected = _reference(edges, values, (num_dst, num_src))
    capacity = max(num_edges, 1)

    build = jax.jit(lambda e, v: jinsum.GroupCOO.from_edge_index(e, v, num_nodes=(num_src, num_dst),
                                                                 capacity=capacity))
    A = build(padded, padded_values)
    assert not A.overflow and A.nnz == capacity
    np.testing.assert_allclose(np.asarray(A.todense()), expected, rtol=1e-12, atol=1e-12)
    P = capacity_group_size(capacity, num_dst)
    assert A.Ak.shape == (group_bound(capacity, num_dst, P), P)

    x = rng.normal(size=(num_src, 3))
    np.testing.assert_allclose(np.asarray(jax.jit(lambda A, x: A @ x)(A, x)), expected @ x, rtol=1e-10, atol=1e-10)
    if num_edges:  # the host converter, same group size: the stored slots agree exactly
        host = jinsum.GroupCOO.from_edge_index(edges, values, num_nodes=(num_src, num_dst), group_size=P)
        G = host.num_groups
        np.testing.assert_array_equal(np.asarray(A.Ai[:G]), np.asarray(host.Ai))
        np.testing.assert_array_equal(np.asarray(A.Ak[:G]), np.asarray(host.Ak))
        np.testing.assert_allclose(np.asarray(A.Av[:G]), np.asarray(host.Av), rtol=1e-12)
        assert not np.asarray(A.Av[G:]).any()  # padding groups hold zeros


@pytest.mark.parametrize("case", ["random", "hub row", "duplicates", "one row"])
def test_device_column_order_gives_the_host_gradients(case, rng):
    """The transpose over the device-built column order, checked against float64 and the host-built format."""
    num_src, num_dst, num_edges, hubs, duplicates, padding = CASES[case]
    edges = _edges(rng, num_src, num_dst, num_edges, hubs=hubs, duplicates=duplicates)
    values = rng.normal(size=num_edges)
    padded, padded_values = _pad(edges, values, padding, rng)
    A = jinsum.GroupCOO.from_edge_index(padded, padded_values, num_nodes=(num_src, num_dst), capacity=num_edges)
    assert A.transposed is not None
    T = A.transposed
    perm, starts = np.asarray(T.perm), np.asarray(T.starts)
    cols = np.asarray(A.Ak).reshape(-1)[perm[:starts[-1]]]
    assert (np.diff(cols) >= 0).all() and starts[-1] == len(set(map(tuple, edges.T)))
    np.testing.assert_array_equal(np.diff(starts), np.bincount(cols, minlength=num_src))

    dense = _reference(edges, values, (num_dst, num_src))
    x, cotangent = rng.normal(size=(num_src, 4)), rng.normal(size=(num_dst, 4))
    grad = jax.jit(jax.grad(lambda x, A: jnp.vdot(A @ x, cotangent)))(x, A)
    np.testing.assert_allclose(np.asarray(grad), dense.T @ cotangent, rtol=1e-10, atol=1e-10)
    # Gradient with respect to the values, through with_values (which keeps the column order).
    def loss(v):
        return jnp.vdot(A.with_values(v) @ x, cotangent)
    assert A.with_values(A.Av * 2).transposed is T
    check_grads(loss, (A.Av,), order=1, modes=("rev",))


def test_capacity_exactly_full_and_overflowed(rng):
    edges = _edges(rng, 20, 20, 60)
    distinct = np.unique(edges.T, axis=0)
    num = len(distinct)
    full = jinsum.GroupCOO.from_edge_index(edges, num_nodes=20, capacity=num)
    assert not full.overflow
    np.testing.assert_allclose(np.asarray(full.todense()), _reference(edges, np.ones(60), (20, 20)))

    # Eagerly an overflow is an error naming the capacity needed; under jit, the flag.
    with pytest.raises(ValueError, match=rf"GroupCOO.from_edge_index: {num} distinct edges but capacity = {num - 5} "
                                         rf"holds only {num - 5}; pass capacity >= {num} \(or None"):
        jinsum.GroupCOO.from_edge_index(edges, num_nodes=20, capacity=num - 5)
    short = jax.jit(lambda e: jinsum.GroupCOO.from_edge_index(e, num_nodes=20, capacity=num - 5))(edges)
    assert short.overflow
    # Exactly the first distinct entries in row-major order are kept; nothing else is lost or added.
    kept = np.asarray(short.todense())
    order = np.lexsort((distinct[:, 0], distinct[:, 1]))
    expected = np.zeros((20, 20))
    for s, d in distinct[order][: num - 5]:
        expected[d, s] = ((edges[0] == s) & (edges[1] == d)).sum()
    np.testing.assert_allclose(kept, expected)


def test_overflow_and_bad_indices_are_checkify_errors(rng):
    edges = np.array([[0, 1, 2, 3], [1, 2, 3, 0]])

    def build(e, capacity):
        return jinsum.GroupCOO.from_edge_index(e, num_nodes=4, capacity=capacity).Av.sum()

    with jinsum.check_indices(True):
        error, _ = checkify.checkify(jax.jit(build, static_argnums=1))(edges, 3)
        with pytest.raises(checkify.JaxRuntimeError, match="more distinct edges than capacity = 3"):
            error.throw()
        error, _ = checkify.checkify(jax.jit(build, static_argnums=1))(np.array([[0, 7], [1, 2]]), 4)
        with pytest.raises(checkify.JaxRuntimeError, match="past num_nodes"):
            error.throw()
        error, _ = checkify.checkify(jax.jit(build, static_argnums=1))(edges, 4)
        error.throw()  # nothing to report


def test_out_of_range_node_ids_raise_eagerly_and_are_left_out_under_jit():
    """An eager build names the first edge past the node counts (padding columns, any index negative, pass); under
    jit that edge is left out, as before (a checkify error under check_indices)."""
    edges = np.array([[0, 1, -1, 7, 2], [1, 9, 12, 2, 3]])  # edge 2 is padding; edge 1 is the first out of range
    with pytest.raises(ValueError, match=r"GroupCOO.from_edge_index: edge_index\[1, 1\] = 9 is out of range: "
                                         r"expected 0 <= node < num_nodes = 4 \(destinations\), or a negative index"):
        jinsum.GroupCOO.from_edge_index(edges, num_nodes=4, capacity=5)
    with pytest.raises(ValueError, match=r"edge_index\[0, 3\] = 7 is out of range: expected 0 <= node < num_nodes "
                                         r"= 6 \(sources\)"):  # bipartite (N_src 6, N_dst 10): edge 1 now fits
        jinsum.GroupCOO.from_edge_index(edges, num_nodes=(6, 10), capacity=5)
    fits = jinsum.GroupCOO.from_edge_index(edges, num_nodes=(8, 10), capacity=4)  # every node id in range, exactly
    np.testing.assert_allclose(np.asarray(fits.todense()), _reference(edges, np.ones(5), (10, 8)))
    traced = jax.jit(lambda e: jinsum.GroupCOO.from_edge_index(e, num_nodes=4, capacity=5))(edges)
    assert not traced.overflow
    np.testing.assert_allclose(np.asarray(traced.todense()), _reference(edges[:, [0, 4]], np.ones(2), (4, 4)))


def test_one_compile_for_many_graphs(rng):
    build = CountingJit(lambda e, x: jinsum.GroupCOO.from_edge_index(e, num_nodes=30, capacity=100) @ x)
    x = rng.normal(size=(30, 2))
    for _ in range(10):
        n = int(rng.integers(0, 100))
        edges, _ = _pad(_edges(rng, 30, 30, n), np.ones(n), 100 - n, rng)
        out = build(edges, x)
        np.testing.assert_allclose(np.asarray(out), _reference(edges, np.ones(100), (30, 30)) @ x, atol=1e-12)
    assert build.traces == 1


def test_from_neighbors_is_the_fixed_fanout_table(rng):
    neighbors = rng.integers(-1, 15, (9, 4))
    neighbors[3] = -1  # a row with no neighbor
    values = rng.normal(size=(9, 4))
    A = jax.jit(lambda n, v: jinsum.GroupCOO.from_neighbors(n, v, num_sources=15))(neighbors, values)
    expected = np.zeros((9, 15))
    for i, j in zip(*np.nonzero(neighbors >= 0)):
        expected[i, neighbors[i, j]] += values[i, j]
    np.testing.assert_allclose(np.asarray(A.todense()), expected)
    x, cotangent = rng.normal(size=(15, 3)), rng.normal(size=(9, 3))
    grad = jax.grad(lambda x: jnp.vdot(A @ x, cotangent))(x)
    np.testing.assert_allclose(np.asarray(grad), expected.T @ cotangent, rtol=1e-10)
    # max= ignores padding slots: a row of no neighbors holds -inf, as an empty row does
    out = jinsum.einsum("C[Ai[g],n] max= B[Ak[g,p],n]", A=A, B=x, C=jax.ShapeDtypeStruct((9, 3), x.dtype))
    assert np.isneginf(np.asarray(out[3])).all()


def _padding_columns(A, stored):
    """Where `A`'s padding slots point, as the builders place them: each at its group's first stored column, every
    slot of a group with none stored at column ``g mod K``."""
    Ak, stored = np.asarray(A.Ak), np.asarray(stored)
    first = np.take_along_axis(Ak, stored.argmax(axis=1)[:, None], axis=1)[:, 0]
    fill = np.where(stored.any(axis=1), first, np.arange(Ak.shape[0]) % A.shape[1])
    return np.where(stored, Ak, fill[:, None])


def test_padding_is_spread_over_columns(rng):
    """Padding never all points at one column, whose row would take every zero a gradient adds through `Ak`,
    atomically, one after another: the fanout table's padding, a CSR's padded groups and spare groups (the
    positions past ``indptr[M]``) and the device builder's (edges into a capacity) each point at their group's
    first column, or spread by group where the group has none; the products are unchanged."""
    neighbors = rng.integers(-1, 40, (30, 5))
    neighbors[3], neighbors[7, :3] = -1, -1  # an empty row; a row whose stored slots come after padding
    A = jax.jit(lambda n: jinsum.GroupCOO.from_neighbors(n, num_sources=40, with_transpose=False))(neighbors)
    np.testing.assert_array_equal(np.asarray(A.Ak), _padding_columns(A, neighbors >= 0))
    assert np.asarray(A.Ak)[3, 0] == 3 and (np.asarray(A.Ak)[7, :3] == neighbors[7, 3]).all()

    lengths = rng.integers(0, 6, 12)
    lengths[4] = 0
    indptr = np.concatenate([[0], np.cumsum(lengths)])
    indices = rng.integers(0, 9, int(indptr[-1]) + 17)  # 17 positions past the last row: spare groups
    indices[2] = -1  # a padding entry inside a row
    B = jax.jit(lambda p, i: jinsum.GroupCOO.from_csr(p, i, num_columns=9, group_size=2, with_transpose=False))(
        indptr, indices)
    stored = np.asarray(B.Av) != 0
    assert (~stored.any(axis=1)).sum() > 1  # spare groups, which now sit at distinct columns
    np.testing.assert_array_equal(np.asarray(B.Ak), _padding_columns(B, stored))
    expected = np.zeros((12, 9))
    for row in range(12):
        for position in range(indptr[row], indptr[row + 1]):
            if indices[position] >= 0:
                expected[row, indices[position]] += 1
    np.testing.assert_allclose(np.asarray(B.todense()), expected)
    x, cotangent = rng.normal(size=(9, 3)), rng.normal(size=(12, 3))
    grad = jax.grad(lambda x: jnp.vdot(B @ x, cotangent))(x)
    np.testing.assert_allclose(np.asarray(grad), expected.T @ cotangent, rtol=1e-10)

    edges = _edges(rng, 9, 12, 30, hubs=True, duplicates=True)
    edges[:, -6:] = -1  # padding edges
    C = jax.jit(lambda e: jinsum.GroupCOO.from_edge_index(e, num_nodes=(9, 12), capacity=40, group_size=4))(edges)
    np.testing.assert_array_equal(np.asarray(C.Ak), _padding_columns(C, np.asarray(C.Av) != 0))
    np.testing.assert_allclose(np.asarray(C.todense()), _reference(edges, np.ones(30), (12, 9)))
def test_with_transpose_under_jit_equals_host(rng):
    A = jinsum.GroupCOO.from_edge_index(_edges(rng, 25, 25, 90), num_nodes=25)
    host = A.with_transpose().transposed
    traced = jax.jit(lambda A: A.with_transpose().transposed)(A)
    count = int(host.starts[-1])
    np.testing.assert_array_equal(np.asarray(traced.perm[:count]), np.asarray(host.perm))
    np.testing.assert_array_equal(np.asarray(traced.starts), np.asarray(host.starts))


def test_with_values_keeps_the_column_order(rng):
    A = jinsum.GroupCOO.from_edge_index(_edges(rng, 10, 10, 30), num_nodes=10).with_transpose()
    assert A.with_values(A.Av * 3).transposed is A.transposed
    assert A.with_values(jnp.stack([A.Av, A.Av], -1)).transposed is A.transposed  # a dense axis: same slots


def test_device_builder_rejects_bad_arguments_before_tracing():
    with pytest.raises(ValueError, match=r"edge_index must be an integer array of shape \(2, E\)"):
        jinsum.GroupCOO.from_edge_index(np.zeros((3, 4), np.int32), num_nodes=4, capacity=4)
    with pytest.raises(ValueError, match=r"values must have shape \(E, \*dense_shape\) with E = 4"):
        jinsum.GroupCOO.from_edge_index(np.zeros((2, 4), np.int32), np.ones(3), num_nodes=4, capacity=4)
    with pytest.raises(TypeError, match="capacity must be an int"):
        jinsum.GroupCOO.from_edge_index(np.zeros((2, 4), np.int32), num_nodes=4, capacity=4.5)
    with pytest.raises(ValueError, match="out of range"):
        jinsum.GroupCOO.from_edge_index(np.array([[0, -1], [1, 1]]), num_nodes=4)


# --- block masks ------------------------------------------------------------------------------------------------------

def _block_mask(rng, grid, density=0.4):
    mask = rng.random(grid) < density
    mask[1] = False  # an empty block row
    mask[-1] = True  # a full one (a hub)
    return mask


def test_block_mask_built_in_jit_equals_the_host_build(rng):
    mask, block = _block_mask(rng, (7, 5)), (4, 3)
    host = jinsum.BlockGroupCOO.from_block_mask(mask, block_shape=block)
    build = CountingJit(lambda m: jinsum.BlockGroupCOO.from_block_mask(m, block_shape=block, capacity=35))
    A = build(mask)
    dense = np.kron(mask, np.ones(block))
    np.testing.assert_array_equal(np.asarray(host.todense()), dense)
    np.testing.assert_array_equal(np.asarray(A.todense()), dense)
    assert not A.overflow and A.Ak.shape == (35, 1)
    x, cotangent = rng.normal(size=(15, 6)), rng.normal(size=(28, 6))
    np.testing.assert_allclose(np.asarray(jax.jit(lambda A, x: A @ x)(A, x)), dense @ x, rtol=1e-12)
    grad = jax.jit(jax.grad(lambda x, A: jnp.vdot(A @ x, cotangent)))(x, A)  # over the device-built column order
    np.testing.assert_allclose(np.asarray(grad), dense.T @ cotangent, rtol=1e-10)
    host_order = host.with_transpose().transposed
    count = int(host_order.starts[-1])
    np.testing.assert_array_equal(np.asarray(A.transposed.starts), np.asarray(host_order.starts))
    assert sorted(np.asarray(A.Ak).reshape(-1)[np.asarray(A.transposed.perm[:count])]) == sorted(
        np.asarray(host.Ak).reshape(-1)[np.asarray(host_order.perm)])
    for _ in range(3):
        build(_block_mask(rng, (7, 5)))
    assert build.traces == 1


def test_block_mask_overflow_keeps_the_first_blocks(rng):
    mask = _block_mask(rng, (6, 6))
    stored = int(mask.sum())
    # Eagerly an overflow is an error naming the capacity needed; an exact fit is not; under jit, the flag.
    with pytest.raises(ValueError, match=rf"BlockGroupCOO.from_block_mask: {stored} blocks are stored but capacity = "
                                         rf"{stored - 3} holds only {stored - 3}; pass capacity >= {stored} \(or None"):
        jinsum.BlockGroupCOO.from_block_mask(mask, block_shape=(2, 2), capacity=stored - 3)
    exact = jinsum.BlockGroupCOO.from_block_mask(mask, block_shape=(2, 2), capacity=stored)
    assert not exact.overflow
    np.testing.assert_array_equal(np.asarray(exact.todense()), np.kron(mask, np.ones((2, 2))))
    short = jax.jit(lambda m: jinsum.BlockGroupCOO.from_block_mask(m, block_shape=(2, 2), capacity=stored - 3))(mask)
    assert short.overflow
    kept = np.zeros(mask.size, bool)
    kept[np.flatnonzero(mask)[: stored - 3]] = True  # row-major order
    np.testing.assert_array_equal(np.asarray(short.todense()), np.kron(kept.reshape(mask.shape), np.ones((2, 2))))
    with jinsum.check_indices(True):
        error, _ = checkify.checkify(jax.jit(lambda m: jinsum.BlockGroupCOO.from_block_mask(
            m, block_shape=(2, 2), capacity=3).Av.sum()))(mask)
        with pytest.raises(checkify.JaxRuntimeError, match="more stored blocks than capacity = 3"):
            error.throw()


def test_attention_over_a_block_mask_built_in_jit(rng):
    """The attention chain reads a device-built pattern (its column order lists every slot, the stored first)."""
    mask, block = _block_mask(rng, (4, 4), 0.5), (8, 8)
    q, k, v = (jnp.asarray(rng.normal(size=(32, 2, 16))) for _ in range(3))
    host = jinsum.BlockGroupCOO.from_block_mask(mask, block_shape=block).with_transpose()

    def loss(q, k, v, pattern):
        return jnp.sum(jinsum.attention(q, k, v, pattern) ** 2)

    expected = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, host)
    got = jax.jit(lambda q, k, v, m: jax.grad(loss, argnums=(0, 1, 2))(
        q, k, v, jinsum.BlockGroupCOO.from_block_mask(m, block_shape=block, capacity=16)))(q, k, v, mask)
    for a, b in zip(got, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-9, atol=1e-9)


def test_eager_products_and_attention_refuse_an_overflowed_format(rng):
    """A format built for a capacity under jit and returned carries a concrete overflow flag: einsum (either notation),
    `@` and attention outside jit refuse it; inside jit (the flag traced) they read the kept entries as before."""
    edges = _edges(rng, 8, 8, 30)
    num = len(np.unique(edges.T, axis=0))
    graph = jax.jit(lambda e: jinsum.GroupCOO.from_edge_index(e, num_nodes=8, capacity=num - 2))(edges)
    mask = _block_mask(rng, (4, 4), 0.5)
    blocks = jax.jit(lambda m: jinsum.BlockGroupCOO.from_block_mask(m, block_shape=(8, 8), capacity=3))(mask)
    assert graph.overflow and blocks.overflow
    refused = (r"jinsum: the {} overflowed: it was built under jit with room for {} {}, .* dropped .* rebuild it "
               r"with a larger capacity \({}")
    for A, x, message in ((graph, rng.normal(size=(8, 3)), refused.format("GroupCOO", num - 2, "distinct entries",
                                                                          "GroupCOO.from_edge_index")),
                          (blocks, rng.normal(size=(32, 3)), refused.format("BlockGroupCOO", 3, "blocks",
                                                                            "BlockGroupCOO.from_block_mask"))):
        with pytest.raises(ValueError, match=message):
            A @ x
        with pytest.raises(ValueError, match=message):
            x.T @ A
        with pytest.raises(ValueError, match=message):
            jinsum.einsum("ik,kn->in", A, x)
        np.testing.assert_allclose(np.asarray(jax.jit(lambda A, x: A @ x)(A, x)), np.asarray(A.todense()) @ x,
                                   rtol=1e-12)
    with pytest.raises(ValueError, match=refused.format("GroupCOO", num - 2, "distinct entries", "GroupCOO")):
        jinsum.einsum("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", A=graph, B=np.ones((8, 2)))
    with pytest.raises(ValueError, match=refused.format("GroupCOO", num - 2, "distinct entries", "GroupCOO")):
        jinsum.einsum("C[Ai[g],n] max= B[Ak[g,p],n]", A=graph, B=np.ones((8, 2)),
                      C=jax.ShapeDtypeStruct((8, 2), np.float64))

    q, k, v = (jnp.asarray(rng.normal(size=(32, 2, 16))) for _ in range(3))
    with pytest.raises(ValueError, match="jinsum.attention: the BlockGroupCOO overflowed"):
        jinsum.attention(q, k, v, blocks)
    jax.jit(jinsum.attention)(q, k, v, blocks)
    with pytest.raises(ValueError, match="jinsum.attention: the GroupCOO overflowed"):
        jinsum.attention(q[:8], k[:8], v[:8], graph)
    jax.jit(jinsum.attention)(q[:8], k[:8], v[:8], graph)
    # a format of the same build that fits (flag concrete and False) is taken outside jit
    fits = jax.jit(lambda e: jinsum.GroupCOO.from_edge_index(e, num_nodes=8, capacity=num))(edges)
    x = rng.normal(size=(8, 3))
    np.testing.assert_allclose(np.asarray(fits @ x), _reference(edges, np.ones(30), (8, 8)) @ x, rtol=1e-12)
    jinsum.attention(q[:8], k[:8], v[:8], fits)


def test_block_mask_rejects_bad_arguments():
    with pytest.raises(ValueError, match="block_mask must be 2-D"):
        jinsum.BlockGroupCOO.from_block_mask(np.ones(4), block_shape=(2, 2))
    with pytest.raises(ValueError, match=r"block_mask has shape \(2, 2\), but shape \(9, 4\)"):
        jinsum.BlockGroupCOO.from_block_mask(np.ones((2, 2)), block_shape=(2, 2), shape=(9, 4))


@pytest.mark.parametrize("self_loops", [False, True], ids=["as given", "remaining self loops"])
def test_nn_adjacency_with_a_capacity_equals_the_host_one(self_loops, rng):
    """`jinsum.graphs.adjacency(..., capacity=C)` inside jit: the host's matrix (self loops added where absent or of
    weight 0, other zero-weight edges dropped, as PyG's add_remaining_self_loops), and a layer's output and
    gradient over it."""
    from flax import nnx  # noqa: PLC0415

    n = 20
    edges = _edges(rng, n, n, 70)
    edges[:, :3] = [[4, 5, 6], [4, 5, 6]]  # self loops: 4 weighted 2, 5 weighted 0, 6 weighted 1
    weights = rng.uniform(0.5, 1.5, 70)
    weights[:3] = [2.0, 0.0, 1.0]
    weights[10] = 0.0  # a zero-weight edge: dropped
    host = jinsum.graphs.adjacency(edges, n, values=weights, self_loops=self_loops)
    padded, padded_weights = _pad(edges, weights, 9, rng)
    device = jax.jit(lambda e, w: jinsum.graphs.adjacency(e, n, values=w, self_loops=self_loops, capacity=70))(
        padded, padded_weights)
    assert not device.overflow
    np.testing.assert_allclose(np.asarray(device.todense()), np.asarray(host.todense()), rtol=1e-12)

    conv = jinsum.nn.SAGEConv(5, 3, rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.normal(size=(n, 5)))
    loss = lambda x, A: jnp.sum(jnp.sin(conv(x, A)))  # noqa: E731
    np.testing.assert_allclose(np.asarray(jax.grad(loss)(x, device)), np.asarray(jax.grad(loss)(x, host)),
                               rtol=1e-10, atol=1e-12)


def test_adjacency_with_self_loops_names_the_capacity_the_caller_passes(rng):
    """With self loops the builder holds C + N entries; the eager error and the checkify message name C, the
    capacity the caller passes (self loops aside), and explain the N more."""
    n = 12
    edges = _edges(rng, n, n, 40)
    edges[:, :2] = [[3, 5], [3, 5]]  # two own self loops: they take the self loops' entries, not the capacity's
    distinct = {(s, d) for s, d in edges.T if s != d}
    num = len(distinct)
    with pytest.raises(ValueError, match=rf"jinsum.graphs.adjacency: {num} distinct edges \(self loops aside\) but "
                                         rf"capacity = {num - 1} holds only {num - 1}; pass capacity >= {num} \(or "
                                         rf"None to build on the host\); the {n} self loops take {n} entries of their "
                                         rf"own beyond it \({num - 1 + n} in all\)"):
        jinsum.graphs.adjacency(edges, n, self_loops=True, capacity=num - 1)
    exact = jinsum.graphs.adjacency(edges, n, self_loops=True, capacity=num)  # exact fit
    assert not exact.overflow
    np.testing.assert_allclose(np.asarray(exact.todense()),
                               np.asarray(jinsum.graphs.adjacency(edges, n, self_loops=True).todense()))
    with pytest.raises(ValueError, match=r"jinsum.graphs.adjacency: edge_index\[1, 4\] = 12 is out of range"):
        bad = edges.copy()
        bad[1, 4] = n
        jinsum.graphs.adjacency(bad, n, self_loops=True, capacity=num)

    def build(e, capacity):
        return jinsum.graphs.adjacency(e, n, self_loops=True, capacity=capacity)

    assert jax.jit(build, static_argnums=1)(edges, num - 1).overflow  # under jit: the flag, as before
    with jinsum.check_indices(True):
        error, _ = checkify.checkify(jax.jit(lambda e: build(e, num - 1).Av.sum()))(edges)
        with pytest.raises(checkify.JaxRuntimeError,
                           match=rf"jinsum.graphs.adjacency: more distinct edges \(self loops aside\) than capacity = "
                                 rf"{num - 1}; .* the {n} self loops take {n} entries of their own beyond it"):
            error.throw()
        error, _ = checkify.checkify(jax.jit(lambda e: build(e, num).Av.sum()))(edges)
        error.throw()  # an exact fit: nothing to report


@pytest.mark.parametrize("entries_per_row", [0.5, 3, CONTENDED_ROW_LENGTH, 4 * CONTENDED_ROW_LENGTH])
def test_row_lengths_of_sorted_rows(entries_per_row, rng):
    """The device's row lengths (a histogram where rows are short, each row's first position where they are long)
    equal NumPy's count, with empty rows (the first, the last, runs between) and entries of the dropped row."""
    num_rows = 12
    rows = np.sort(rng.choice([1, 2, 5, 6, 7, 9, num_rows], int(entries_per_row * num_rows)))
    expected = np.bincount(rows, minlength=num_rows + 1)[:num_rows]
    for dtype in (jnp.int32, jnp.int64):
        with jax.enable_x64(dtype == jnp.int64):
            np.testing.assert_array_equal(jax.jit(row_lengths, static_argnums=(0, 2))(jnp, jnp.asarray(rows, dtype),
                                                                                       num_rows), expected)
