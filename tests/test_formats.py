"""GroupCOO and BlockGroupCOO against independent SciPy / NumPy references.

References are built with SciPy (``coo_matrix(...).tocsr()`` sums duplicates and keeps explicit zeros) and with
plain Python loops over rows (the expected group arrays), never with the converters under test.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import sparse as jsparse

from jinsum.formats import BlockGroupCOO, GroupCOO, default_group_size

SETTINGS = settings(max_examples=20, deadline=None)
FLOAT_DTYPES = [np.float16, jnp.bfloat16, np.float32, np.float64]
# Small halves and integers: exact in every float dtype, and in every sum of a few of them.
VALUES = [-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 3.0]


@pytest.fixture(autouse=True, scope="module")
def _x64():
    # float64 values must survive the conversion to JAX for the exact comparisons.
    with jax.enable_x64(True):
        yield


# -- references --------------------------------------------------------------------------------------------


@st.composite
def coo_entries(draw, max_dim=9, max_nnz=30):
    """``(shape, rows, cols, vals)`` with duplicates, explicit zeros, empty rows, and 0-row/0-column shapes."""
    m, k = draw(st.integers(0, max_dim)), draw(st.integers(0, max_dim))
    n = draw(st.integers(0, max_nnz)) if m and k else 0
    rows = draw(st.lists(st.integers(0, max(m - 1, 0)), min_size=n, max_size=n))
    cols = draw(st.lists(st.integers(0, max(k - 1, 0)), min_size=n, max_size=n))
    vals = draw(st.lists(st.sampled_from(VALUES), min_size=n, max_size=n))
    return (m, k), np.array(rows, np.int64), np.array(cols, np.int64), np.array(vals, np.float64)


def reference_csr(shape, rows, cols, vals):
    """SciPy's canonical CSR: duplicates summed, explicit zeros kept, columns sorted."""
    ref = sp.coo_matrix((vals, (rows, cols)), shape=shape).tocsr()
    ref.sum_duplicates()
    return ref


def as_scipy(fmt, shape, rows, cols, vals):
    """The entries in SciPy format ``fmt``, duplicates *not* summed where the format allows it."""
    coo = sp.coo_matrix((vals, (rows, cols)), shape=shape)
    if fmt == "coo":
        return coo
    if fmt == "csr_unsorted":
        # A non-canonical CSR built by hand: duplicates and unsorted columns within rows.
        order = np.argsort(rows, kind="stable")
        indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=shape[0]))])
        return sp.csr_matrix((vals[order], cols[order], indptr), shape=shape)
    return getattr(coo, f"to{fmt}")()


def expected_groups(indptr, indices, data, group_size):
    """The group arrays by a loop over rows: ``Ai (G,)``, ``Ak (G, P)``, ``Av (G, P, *trailing)``."""
    trailing = np.shape(data)[1:]
    Ai, Ak, Av = [], [], []
    for row in range(len(indptr) - 1):
        for start in range(indptr[row], indptr[row + 1], group_size):
            stop = min(start + group_size, indptr[row + 1])
            pad = group_size - (stop - start)
            Ai.append(row)
            Ak.append(list(indices[start:stop]) + [indices[start]] * pad)  # (padding at the group's first column)
            Av.append(np.concatenate([np.asarray(data[start:stop], np.float64), np.zeros((pad, *trailing))]))
    return (
        np.array(Ai, np.int64),
        np.array(Ak, np.int64).reshape(-1, group_size),
        np.array(Av, np.float64).reshape(-1, group_size, *trailing),
    )


def check_groups(A, indptr, indices, data):
    """A's arrays equal the loop reference built from the canonical CSR of its matrix."""
    Ai, Ak, Av = expected_groups(indptr, indices, data, A.group_size)
    np.testing.assert_array_equal(np.asarray(A.Ai), Ai)
    np.testing.assert_array_equal(np.asarray(A.Ak), Ak)
    np.testing.assert_array_equal(np.asarray(A.Av, np.float64), Av)
    assert A.nnz == indptr[-1]
    assert A.index_dtype == jnp.int32


def to_f64(x):
    return np.asarray(x).astype(np.float64)


# One compilation per shape instead of one per operation: eager JAX compiles every op for every new shape, and
# the property tests see many shapes.
dense_of = jax.jit(lambda A: A.todense())
bcoo_of = jax.jit(lambda A: A.to_bcoo())


def bcoo_dense(mat):
    """The dense array of a BCOO by NumPy: in-bounds entries summed, out-of-bounds (padding) entries ignored."""
    indices, data = np.asarray(mat.indices), to_f64(mat.data)
    out = np.zeros(mat.shape)
    inside = np.all(indices < np.array(mat.shape[:2]), axis=1)
    np.add.at(out, (indices[inside, 0], indices[inside, 1]), data[inside])
    return out


# -- GroupCOO: construction ------------------------------------------------------------------------------


@SETTINGS
@given(
    entries=coo_entries(),
    fmt=st.sampled_from(["coo", "csr", "csr_unsorted", "csc", "lil", "bsr"]),
    group_size=st.one_of(st.none(), st.integers(1, 5)),
)
def test_from_scipy_matches_scipy(entries, fmt, group_size):
    shape, rows, cols, vals = entries
    mat = as_scipy(fmt, shape, rows, cols, vals)
    before = (mat.copy(), np.array(getattr(mat, "indices", [])))
    A = GroupCOO.from_scipy(mat, group_size=group_size)
    # The reference goes through SciPy's own CSR of the same matrix (for BSR that includes zeros inside blocks).
    ref = mat.tocsr(copy=True)
    ref.sum_duplicates()
    if group_size is None:
        assert A.group_size == default_group_size(np.diff(ref.indptr))
    check_groups(A, ref.indptr, ref.indices, ref.data)
    assert A.shape == shape and A.dtype == np.float64
    np.testing.assert_array_equal(np.asarray(dense_of(A)), ref.toarray())
    # to_scipy drops stored zeros (padding, explicit zeros, cancelled duplicates).
    ref.eliminate_zeros()
    out = A.to_scipy()
    assert out.format == "csr" and out.nnz == ref.nnz
    np.testing.assert_array_equal(out.toarray(), ref.toarray())
    # The caller's matrix is never sorted or summed in place.
    assert (mat != before[0]).nnz == 0
    np.testing.assert_array_equal(getattr(mat, "indices", []), before[1])


def test_from_scipy_sums_duplicates_and_keeps_explicit_zeros():
    rows, cols = np.array([0, 0, 0, 2, 2]), np.array([3, 1, 3, 0, 2])
    vals = np.array([1.0, 0.0, 2.0, 1.0, -1.0])
    A = GroupCOO.from_scipy(sp.coo_matrix((vals, (rows, cols)), shape=(3, 4)), group_size=2)
    # Stored: (0,1)=0 explicit, (0,3)=1+2, (2,0)=1, (2,2)=-1. Row 1 is empty and has no groups.
    assert A.nnz == 4
    np.testing.assert_array_equal(np.asarray(A.Ai), [0, 2])
    np.testing.assert_array_equal(np.asarray(A.Ak), [[1, 3], [0, 2]])
    np.testing.assert_array_equal(np.asarray(A.Av), [[0.0, 3.0], [1.0, -1.0]])
    assert A.to_scipy().nnz == 3


def test_from_bsr_keeps_the_zeros_inside_blocks():
    # SciPy counts every element of a stored BSR block in nnz; so does GroupCOO.
    bsr = sp.bsr_matrix(np.array([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]), blocksize=(2, 2))
    A = GroupCOO.from_scipy(bsr, group_size=2)
    assert A.nnz == bsr.nnz == 4
    np.testing.assert_array_equal(np.asarray(A.Ai), [0, 1])
    np.testing.assert_array_equal(np.asarray(A.Ak), [[0, 1], [0, 1]])
    assert A.to_scipy().nnz == 1


@pytest.mark.parametrize("shape", [(0, 0), (0, 5), (4, 0), (6, 3)])
def test_empty_matrices(shape):
    A = GroupCOO.from_scipy(sp.csr_matrix(shape))
    assert (A.nnz, A.num_groups, A.group_size) == (0, 0, 1)
    assert A.todense().shape == shape and not np.asarray(A.todense()).any()
    assert A.to_scipy().shape == shape and A.to_scipy().nnz == 0
    assert A.to_bcoo().shape == shape and A.to_bcoo().nse == 0


@SETTINGS
@given(entries=coo_entries(), group_size=st.one_of(st.none(), st.integers(1, 4)))
def test_dense_round_trip(entries, group_size):
    ref = reference_csr(*entries)
    ref.eliminate_zeros()
    x = ref.toarray()
    A = GroupCOO.from_dense(x, group_size=group_size)
    check_groups(A, ref.indptr, ref.indices, ref.data)
    np.testing.assert_array_equal(np.asarray(dense_of(A)), x)
    # A concrete JAX array converts the same way.
    B = GroupCOO.from_dense(jnp.asarray(x), group_size=group_size)
    np.testing.assert_array_equal(np.asarray(B.Ak), np.asarray(A.Ak))
    np.testing.assert_array_equal(np.asarray(B.Av), np.asarray(A.Av))


def test_from_dense_with_trailing_dense_dims():
    rng = np.random.default_rng(0)
    x = rng.choice(VALUES, size=(5, 6, 3)) * (rng.random((5, 6, 1)) < 0.4)
    x[1, 2] = [0.0, 0.0, 2.0]  # stored: nonzero in one head
    A = GroupCOO.from_dense(x, group_size=2)
    mask = (x != 0).any(-1)
    assert A.nnz == mask.sum() and A.shape == (5, 6, 3) and A.dense_shape == (3,)
    rows, cols = np.nonzero(mask)
    indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=5))])
    check_groups(A, indptr, cols, x[rows, cols])
    np.testing.assert_array_equal(np.asarray(A.todense()), x)
    np.testing.assert_array_equal(np.asarray(A.to_bcoo().todense()), x)


@SETTINGS
@given(entries=coo_entries(), n_dense=st.sampled_from([0, 1]), padding=st.integers(0, 3))
def test_bcoo_round_trip(entries, n_dense, padding):
    shape, rows, cols, vals = entries
    # BCOO pads with out-of-bounds indices (as sum_duplicates does); from_bcoo must drop those entries.
    indices = np.concatenate([np.stack([rows, cols], -1), np.tile(np.array(shape), (padding, 1))])
    vals = np.concatenate([vals, np.full(padding, 7.0)])
    data = vals if n_dense == 0 else np.stack([vals, 2 * vals], axis=-1)
    mat = jsparse.BCOO((data, indices), shape=shape + data.shape[1:])
    dense = bcoo_dense(mat)
    A = GroupCOO.from_bcoo(mat, group_size=2)
    assert A.shape == tuple(mat.shape) and A.dense_shape == data.shape[1:]
    np.testing.assert_array_equal(np.asarray(dense_of(A)), dense)
    # nnz counts distinct in-bounds coordinates, like SciPy's canonical CSR.
    assert A.nnz == reference_csr(shape, rows, cols, vals[: len(rows)]).nnz
    back = bcoo_of(A)
    assert back.nse == A.num_groups * A.group_size and back.n_dense == n_dense
    np.testing.assert_array_equal(bcoo_dense(back), dense)


@SETTINGS
@given(entries=coo_entries(), heads=st.sampled_from([None, 2]))
def test_from_edge_index_matches_scipy(entries, heads):
    (m, k), src, dst, vals = entries
    n = max(m, k)  # sources < m, destinations < k
    edge_index = np.stack([src, dst])
    values = None if heads is None else np.stack([vals * (h + 1) for h in range(heads)], -1)
    A = GroupCOO.from_edge_index(edge_index, values, num_nodes=n)
    for h in range(heads or 1):
        v = np.ones_like(vals) if heads is None else values[:, h]
        # A[dst, src]: the transpose of the (source, destination) adjacency.
        ref = sp.coo_matrix((v, (dst, src)), shape=(n, n)).toarray()
        dense = np.asarray(dense_of(A))
        np.testing.assert_array_equal(dense if heads is None else dense[..., h], ref)
    assert A.nnz == reference_csr((n, n), dst, src, vals).nnz
    assert A.dtype == (np.float32 if heads is None else np.float64)


def test_from_edge_index_aggregates_sources_into_destinations():
    # Edges 0->2 and 1->2 (twice): node 2 sums its sources' features.
    A = GroupCOO.from_edge_index(np.array([[0, 1, 1], [2, 2, 2]]), num_nodes=3)
    x = jnp.array([[1.0], [10.0], [100.0]])
    np.testing.assert_array_equal(np.asarray(A.todense() @ x), [[0.0], [0.0], [21.0]])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_value_dtypes(dtype):
    rng = np.random.default_rng(1)
    x = rng.choice(VALUES, size=(7, 5)) * (rng.random((7, 5)) < 0.5)
    for A in (
        GroupCOO.from_scipy(sp.csr_matrix(x), dtype=dtype),
        GroupCOO.from_dense(x.astype(dtype)),
        GroupCOO.from_dense(jnp.asarray(x, dtype)),
        GroupCOO.from_edge_index(np.array([[1, 2], [0, 0]]), np.array([0.5, 3.0], dtype), num_nodes=7),
    ):
        assert A.dtype == dtype
        assert A.todense().dtype == dtype
    A = GroupCOO.from_dense(x.astype(dtype))
    np.testing.assert_array_equal(to_f64(A.todense()), x)
    # SciPy has no 16-bit floats: to_scipy upcasts to float32.
    assert A.to_scipy().dtype == np.promote_types(np.dtype(dtype), np.float32)
    np.testing.assert_array_equal(A.to_scipy().toarray(), x)
    B = A.with_values(jnp.asarray(A.Av, np.float32))
    assert B.dtype == np.float32 and B.shape == A.shape


def test_integer_sources_default_to_float32():
    A = GroupCOO.from_scipy(sp.csr_matrix(np.eye(3, dtype=np.int64)))
    assert A.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(A.todense()), np.eye(3))


# -- default_group_size -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lengths, expected",
    [
        ([], 1),
        ([0, 0, 0], 1),
        ([1] * 10, 1),  # P = 2 would double the storage
        ([4, 8], 4),  # 12 slots at P = 4 (ratio 1); 16 > 15 at P = 8
        ([3, 5], 2),  # 10 slots at P = 2 (exactly 1.25 x 8); 12 at P = 4
        ([32] * 4, 32),
        ([64, 0, 96], 32),
        ([33], 8),  # padded 64 (P=32), 48 (P=16) > 41.25; 40 (P=8) fits
        ([4] * 9 + [1], 4),  # 40 slots for 37 entries at P = 4; 72 at P = 8
        ([5, 5, 5, 5], 2),  # 24 slots for 20 entries (1.2); P = 4 needs 32 (1.6)
    ],
)
def test_default_group_size_crafted(lengths, expected):
    assert default_group_size(np.array(lengths, np.int64)) == expected


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 80), max_size=20))
def test_default_group_size_is_the_largest_within_the_bound(lengths):
    lengths = np.array(lengths, np.int64)
    p = default_group_size(lengths)
    nnz = lengths.sum()

    def padded(q):
        return sum(math.ceil(n / q) * q for n in lengths.tolist())

    assert p in (1, 2, 4, 8, 16, 32)
    if nnz:
        assert padded(p) <= 1.25 * nnz
        assert p == 32 or padded(2 * p) > 1.25 * nnz
        # "Largest": no larger candidate qualifies either (the padding is not monotone in P in general).
        assert all(padded(q) > 1.25 * nnz for q in (1, 2, 4, 8, 16, 32) if q > p)
    else:
        assert p == 1


def test_default_group_size_rejects_non_integer_lengths():
    with pytest.raises(ValueError, match=r"row_lengths must be a 1-D integer array"):
        default_group_size(np.array([1.5, 2.0]))


# -- GroupCOO: JAX integration ----------------------------------------------------------------------------


def small_group_coo():
    x = np.array([[0.0, 1.0, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0], [3.0, 0.0, 4.0, 5.0]])
    return GroupCOO.from_dense(x, group_size=2), x


def test_pytree_flatten_unflatten_and_jit():
    A, x = small_group_coo()
    leaves, treedef = jax.tree_util.tree_flatten(A)
    assert len(leaves) == 3 and leaves[0] is A.Ai and leaves[2] is A.Av
    B = jax.tree_util.tree_unflatten(treedef, leaves)
    assert repr(B) == repr(A) and B.nnz == A.nnz
    # Unflattening must not validate: JAX builds pytrees of placeholders.
    C = jax.tree_util.tree_map(lambda _: object(), A)
    assert C.shape == A.shape
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda A: A.todense())(A)), x)


def test_transposed_index_lists_the_nonzero_entries_by_column():
    rng = np.random.default_rng(3)
    dense = (rng.random((30, 17, 2)) < 0.2) * rng.integers(1, 4, (30, 17, 2))
    dense[:, 5] = 0  # an empty column
    dense[4, :, 0] = 0  # entries nonzero in one dense dimension only
    A = GroupCOO.from_dense(dense, group_size=3)
    A = A.with_values(A.Av.at[0, 0].set(0.0))  # a stored zero: not listed
    assert A.transposed is None
    T = A.with_transpose()
    assert "transposed" in repr(T) and T.transposed.perm.dtype == A.index_dtype
    perm, starts = np.asarray(T.transposed.perm), np.asarray(T.transposed.starts)
    rows = np.repeat(np.asarray(A.Ai), A.group_size)[perm]
    cols = np.asarray(A.Ak).reshape(-1)[perm]
    values = np.asarray(A.Av).reshape(-1, 2)
    np.testing.assert_array_equal(np.sort(perm), np.flatnonzero((values != 0).any(axis=1)))
    assert starts.shape == (18,) and starts[0] == 0 and starts[-1] == perm.size
    for k in range(17):  # column k's entries, by row
        segment = slice(starts[k], starts[k + 1])
        assert np.all(cols[segment] == k) and np.all(np.diff(rows[segment]) >= 0)
    # A pytree leaf pair: through jit and tree_map; new values (always on the same slots) keep it, so the gradient
    # through them keeps its atomic-free backward.
    leaves = jax.tree_util.tree_leaves(T)
    assert len(leaves) == 8 and leaves[3] is T.transposed.perm
    same = jax.jit(lambda A: A)(T)
    np.testing.assert_array_equal(np.asarray(same.transposed.starts), starts)
    assert T.with_values(T.Av * 2).transposed is T.transposed
    half = T.astype(jnp.float16)  # a cast keeps zeros zero: the index stays
    assert half.dtype == jnp.float16 and half.transposed is T.transposed
    # Inside jit it is built on the device (static sizes: every slot listed, the stored ones first).
    traced = jax.jit(lambda A: A.with_transpose())(A).transposed
    np.testing.assert_array_equal(np.asarray(traced.starts), starts)
    np.testing.assert_array_equal(np.asarray(traced.perm[:perm.size]), perm)


@settings(max_examples=60, deadline=None)
@given(coo_entries(), st.integers(1, 5))
def test_transposed_index_is_the_csc_order_of_the_nonzero_entries(entries, group_size):
    """Any matrix (empty rows and columns, duplicates, explicit zeros, 0-sized): walking the transposed index gives
    the nonzero entries column by column, each once, as SciPy's CSC of the same matrix."""
    shape, rows, cols, vals = entries
    A = GroupCOO.from_scipy(sp.coo_matrix((vals, (rows, cols)), shape=shape), group_size=group_size)
    T = A.with_transpose().transposed
    perm, starts = np.asarray(T.perm), np.asarray(T.starts)
    values = np.asarray(A.Av).reshape(-1)[perm]
    expected = reference_csr(shape, rows, cols, vals).tocsc()
    expected.eliminate_zeros()
    np.testing.assert_array_equal(starts, expected.indptr)
    np.testing.assert_array_equal(np.repeat(np.asarray(A.Ai), A.group_size)[perm], expected.indices)
    # The grouped transpose holds the same entries: as a GroupCOO of A^T with slots for values, it is CSC's.
    slots = np.asarray(T.slots)
    grouped = GroupCOO(T.columns, T.rows, np.where(slots >= 0, np.asarray(A.Av).reshape(-1)[slots], 0),
                       (shape[1], shape[0]))
    np.testing.assert_allclose(grouped.to_scipy().toarray(), expected.T.toarray())
    rows = np.asarray(T.rows)  # (a padding slot reads its group's first row)
    assert np.all(np.diff(np.asarray(T.columns)) >= 0) and np.all(rows == np.where(slots < 0, rows[:, :1], rows))
    np.testing.assert_allclose(values, expected.data)


def test_repr_and_properties():
    A, _ = small_group_coo()
    assert repr(A) == "GroupCOO(float64[3, 4], nnz=5, groups=3 x 2)"
    assert (A.ndim, A.num_groups, A.group_size, A.dense_shape) == (2, 3, 2, ())
    seen = []
    jax.jit(lambda A: seen.append(repr(A)) or A.Av)(A)
    assert seen == [repr(A)]


def test_grad_and_vmap_through_values():
    A, _ = small_group_coo()
    w = jnp.arange(12.0).reshape(3, 4)
    grad = jax.grad(lambda Av: jnp.sum(A.with_values(Av).todense() * w))(A.Av)
    # d/dAv[g, p] = w[Ai[g], Ak[g, p]], padding slots included.
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(w)[np.asarray(A.Ai)[:, None], np.asarray(A.Ak)])
    batched = jax.vmap(lambda Av: A.with_values(Av).todense())(jnp.stack([A.Av, 2 * A.Av]))
    np.testing.assert_array_equal(np.asarray(batched[1]), 2 * np.asarray(A.todense()))


def test_with_values_adds_dense_dims():
    A, x = small_group_coo()
    heads = jnp.stack([A.Av, -A.Av], axis=-1).astype(jnp.float32)
    B = A.with_values(heads)
    assert B.shape == (3, 4, 2) and B.dtype == jnp.float32 and B.nnz == A.nnz
    np.testing.assert_array_equal(np.asarray(B.todense()), np.stack([x, -x], -1))


def test_constructor_skips_value_checks_under_jit():
    A, x = small_group_coo()

    def rebuild(Ai, Ak, Av):
        return GroupCOO(Ai, Ak, Av, A.shape, nnz=A.nnz).todense()

    np.testing.assert_array_equal(np.asarray(jax.jit(rebuild)(A.Ai, A.Ak, A.Av)), x)
    # Unsorted, out-of-range values are not (and cannot be) checked on tracers.
    jax.jit(rebuild)(A.Ai[::-1], A.Ak + 100, A.Av)


def test_constructor_accepts_its_own_arrays():
    A, x = small_group_coo()
    B = GroupCOO(np.asarray(A.Ai), np.asarray(A.Ak), np.asarray(A.Av), (3, 4))
    assert B.nnz == 6  # G * P without the nnz argument
    np.testing.assert_array_equal(np.asarray(B.todense()), x)


# -- GroupCOO: validation messages ------------------------------------------------------------------------

Ai0 = np.array([0, 1, 1], np.int32)
Ak0 = np.array([[0, 1], [2, 0], [3, 3]], np.int32)
Av0 = np.ones((3, 2), np.float32)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(shape=(4,)), ValueError, r"shape must be \(M, K, \*dense_shape\), got \(4,\)"),
        (dict(shape=(4, -1)), ValueError, r"shape must be non-negative, got \(4, -1\)"),
        (dict(shape=(4, 4.5)), TypeError, r"shape must be a tuple of ints"),
        (dict(Ai=Ai0.astype(np.float32)), TypeError, r"Ai must have an integer dtype, got float32"),
        (dict(Ai=Ai0[None]), ValueError, r"Ai must be 1-D with shape \(G,\), got shape \(1, 3\)"),
        (dict(Ak=Ak0[0]), ValueError, r"Ak must be 2-D with shape \(G, P\), got shape \(2,\)"),
        (dict(Ak=Ak0[:2]), ValueError, r"Ak must have shape \(G, P\) with G = 3 to match Ai \(3,\), got \(2, 2\)"),
        (dict(Ak=Ak0.astype(np.int16)), TypeError, r"Ai and Ak must have the same integer dtype, got int32 and int16"),
        (dict(Av=Av0.astype(np.int32)), TypeError, r"Av must have a floating dtype .* got int32"),
        (
            dict(Av=Av0[:, :1]),
            ValueError,
            r"Av must have shape \(G, P, \*dense_shape\) with \(G, P\) = \(3, 2\).*got \(3, 1\)",
        ),
        (
            dict(Av=Av0[..., None]),
            ValueError,
            r"shape must be \(M, K, \*dense_shape\) with dense_shape = Av.shape\[2:\] = \(1,\), got \(4, 4\)",
        ),
        (
            dict(Ai=np.array([0, 1, 4], np.int32)),
            ValueError,
            r"Ai\[2\] = 4 is out of range: expected 0 <= Ai < 4 \(the number of rows\)",
        ),
        (dict(Ai=np.array([-1, 0, 0], np.int32)), ValueError, r"Ai\[0\] = -1 is out of range"),
        (
            dict(Ai=np.array([0, 2, 1], np.int32)),
            ValueError,
            r"Ai must be sorted non-decreasing .* Ai\[1\] = 2 > Ai\[2\] = 1",
        ),
        (
            dict(Ak=np.array([[0, 1], [2, 0], [3, 4]], np.int32)),
            ValueError,
            r"Ak\[2, 1\] = 4 is out of range: expected 0 <= Ak < 4 \(the number of columns\)",
        ),
        (
            dict(nnz=7),
            ValueError,
            r"nnz counts the stored entries excluding group padding, so it must be at most G\*P = 6; got 7",
        ),
        (dict(nnz=-1), ValueError, r"nnz must be an int >= 0, got -1"),
        (dict(nnz=2.0), TypeError, r"nnz must be an int, got 2.0"),
        (dict(shape=(2**31 + 1, 4)), ValueError, r"index dtype int32 cannot hold indices up to 2147483648"),
    ],
)
def test_group_coo_validation(kwargs, error, match):
    args = dict(Ai=Ai0, Ak=Ak0, Av=Av0, shape=(4, 4)) | kwargs
    nnz = args.pop("nnz", None)
    with pytest.raises(error, match=f"^GroupCOO: {match}"):
        GroupCOO(**args, nnz=nnz)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (
            lambda: GroupCOO.from_scipy(np.eye(3)),
            TypeError,
            r"from_scipy: expected a scipy.sparse matrix or array, got ndarray; use GroupCOO.from_dense",
        ),
        (
            lambda: GroupCOO.from_scipy(sp.eye(3), group_size=0),
            ValueError,
            r"group_size \(or None for automatic\) must be an int >= 1, got 0",
        ),
        (
            lambda: GroupCOO.from_scipy(sp.eye(3), dtype=np.int32),
            ValueError,
            r"from_scipy: dtype must be a floating dtype .* got int32",
        ),
        (
            lambda: GroupCOO.from_dense(np.ones(3)),
            ValueError,
            r"from_dense: expected an array of shape \(M, K, \*dense\), got shape \(3,\)",
        ),
        (
            lambda: jax.jit(GroupCOO.from_dense)(jnp.ones((2, 2))),
            TypeError,
            r"from_dense runs on the host and needs concrete arrays, got a tracer",
        ),
        (lambda: GroupCOO.from_bcoo(sp.eye(3)), TypeError, r"from_bcoo: expected a jax.experimental.sparse.BCOO, got"),
        (
            lambda: GroupCOO.from_bcoo(jsparse.BCOO((np.ones((1, 2)), np.zeros((1, 2, 2), int)), shape=(1, 3, 3))),
            ValueError,
            r"from_bcoo: expected a BCOO without batch dimensions \(n_batch=0\), got n_batch=1",
        ),
        (
            lambda: GroupCOO.from_edge_index(np.zeros((3, 4), int), num_nodes=5),
            ValueError,
            r"from_edge_index: edge_index must be an integer array of shape \(2, E\)",
        ),
        (
            lambda: GroupCOO.from_edge_index(np.array([[0, 1], [5, 0]]), num_nodes=5),
            ValueError,
            r"from_edge_index: edge_index\[1, 0\] = 5 is out of range: expected 0 <= node < num_nodes = 5",
        ),
        (
            lambda: GroupCOO.from_edge_index(np.array([[0], [1]]), np.ones(2), num_nodes=5),
            ValueError,
            r"from_edge_index: values must have shape \(E, \*dense_shape\) with E = 1",
        ),
        (
            lambda: GroupCOO.from_edge_index(np.array([[0], [1]]), num_nodes=-2),
            ValueError,
            r"from_edge_index: num_nodes must be an int >= 0, got -2",
        ),
        (
            lambda: GroupCOO.from_dense(np.ones((2, 2, 2))).to_scipy(),
            ValueError,
            r"to_scipy: SciPy matrices are 2-D, but this GroupCOO has dense_shape \(2,\)",
        ),
        (
            lambda: small_group_coo()[0].with_values(jnp.ones((3, 3))),
            ValueError,
            r"Av must have shape \(G, P, \*dense_shape\) with \(G, P\) = \(3, 2\)",
        ),
    ],
)
def test_group_coo_converter_errors(call, error, match):
    with pytest.raises(error, match=f"^GroupCOO[.:] ?{match}"):
        call()


# -- BlockGroupCOO --------------------------------------------------------------------------------------------


def expected_block_groups(dense, stored, block_shape, group_size):
    """The block group arrays by a loop over block rows; ``stored`` is the set of stored block coordinates."""
    (bm, bk), (m, k) = block_shape, dense.shape
    grid = (-(-m // bm), -(-k // bk))
    padded = np.zeros((grid[0] * bm, grid[1] * bk))
    padded[:m, :k] = dense
    Ai, Ak, Av = [], [], []
    for br in range(grid[0]):
        bcols = sorted(c for r, c in stored if r == br)
        for start in range(0, len(bcols), group_size):
            chunk = bcols[start : start + group_size]
            blocks = [padded[br * bm : (br + 1) * bm, c * bk : (c + 1) * bk] for c in chunk]
            blocks += [np.zeros((bm, bk))] * (group_size - len(chunk))
            Ai.append(br)
            Ak.append(chunk + chunk[:1] * (group_size - len(chunk)))  # (padding at the group's first column)
            Av.append(np.stack(blocks, axis=-1))
    return (
        np.array(Ai, np.int64),
        np.array(Ak, np.int64).reshape(-1, group_size),
        np.array(Av, np.float64).reshape(-1, bm, bk, group_size),
    )


def check_block_groups(B, dense, stored):
    Ai, Ak, Av = expected_block_groups(dense, stored, B.block_shape, B.group_size)
    np.testing.assert_array_equal(np.asarray(B.Ai), Ai)
    np.testing.assert_array_equal(np.asarray(B.Ak), Ak)
    np.testing.assert_array_equal(to_f64(B.Av), Av)
    assert B.nnz == len(stored)
    np.testing.assert_array_equal(to_f64(dense_of(B)), dense)
    np.testing.assert_array_equal(B.to_scipy().toarray(), dense)
    np.testing.assert_array_equal(bcoo_dense(bcoo_of(B)), dense)


block_shapes = st.tuples(st.integers(1, 4), st.integers(1, 4))


@SETTINGS
@given(
    entries=coo_entries(),
    fmt=st.sampled_from(["coo", "csr", "csr_unsorted", "csc"]),
    block_shape=block_shapes,
    group_size=st.one_of(st.none(), st.integers(1, 3)),
)
def test_block_from_scipy_matches_scipy(entries, fmt, block_shape, group_size):
    shape, rows, cols, vals = entries
    B = BlockGroupCOO.from_scipy(as_scipy(fmt, shape, rows, cols, vals), block_shape=block_shape, group_size=group_size)
    ref = reference_csr(shape, rows, cols, vals)
    coo = ref.tocoo()
    # A block is stored iff it holds a stored entry -- explicit zeros included.
    stored = set(zip((coo.row // block_shape[0]).tolist(), (coo.col // block_shape[1]).tolist()))
    assert B.shape == shape and B.block_shape == block_shape
    assert B.num_block_rows == -(-shape[0] // block_shape[0])
    check_block_groups(B, ref.toarray(), stored)
    if group_size is None:
        assert B.group_size == 1  # block formats default to one block per group


@SETTINGS
@given(entries=coo_entries(), block_shape=block_shapes)
def test_block_dense_and_bcoo_round_trips(entries, block_shape):
    ref = reference_csr(*entries)
    ref.eliminate_zeros()
    x = ref.toarray()
    nonzero = ref.tocoo()
    stored = set(zip((nonzero.row // block_shape[0]).tolist(), (nonzero.col // block_shape[1]).tolist()))
    check_block_groups(BlockGroupCOO.from_dense(x, block_shape=block_shape, group_size=2), x, stored)
    # Duplicates and explicit zeros in the BCOO: a block is stored iff it holds a stored entry.
    shape, rows, cols, vals = entries
    mat = jsparse.BCOO((vals, np.stack([rows, cols], -1)), shape=shape)
    coo = reference_csr(*entries).tocoo()
    stored = set(zip((coo.row // block_shape[0]).tolist(), (coo.col // block_shape[1]).tolist()))
    check_block_groups(BlockGroupCOO.from_bcoo(mat, block_shape=block_shape, group_size=2), bcoo_dense(mat), stored)


def test_block_edge_blocks_and_bcoo_matmul():
    # 5 x 7 with 2 x 3 blocks: a 3 x 3 grid whose last block row and column overhang the matrix.
    x = np.zeros((5, 7))
    x[4, 6], x[0, 0], x[3, 4] = 1.0, 2.0, 3.0
    B = BlockGroupCOO.from_dense(x, block_shape=(2, 3), group_size=2)
    assert repr(B) == "BlockGroupCOO(float64[5, 7], blocks=2 x 3, nnz=3 blocks, groups=3 x 2)"
    np.testing.assert_array_equal(np.asarray(B.Ai), [0, 1, 2])
    np.testing.assert_array_equal(np.asarray(B.Ak), [[0, 0], [1, 1], [2, 2]])  # (padding: the group's first)
    np.testing.assert_array_equal(to_f64(B.Av[2, :, :, 0]), [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # The element BCOO has out-of-bounds coordinates for the overhang, which BCOO treats as padding.
    v = jnp.arange(7.0)
    np.testing.assert_array_equal(np.asarray(B.to_bcoo() @ v), x @ np.arange(7.0))


def test_block_from_bsr_uses_its_blocks():
    blocks = np.zeros((3, 2, 2))
    blocks[0] = [[1.0, 0.0], [0.0, 2.0]]  # blocks[1] stays all zero: stored explicitly
    blocks[2] = [[0.0, 3.0], [4.0, 0.0]]
    bsr = sp.bsr_matrix((blocks, np.array([2, 0, 1]), np.array([0, 2, 3])), shape=(4, 6))
    B = BlockGroupCOO.from_scipy(bsr, block_shape=(2, 2), group_size=2)
    assert B.nnz == 3
    np.testing.assert_array_equal(np.asarray(B.Ak), [[0, 2], [1, 1]])
    check_block_groups(B, bsr.toarray(), {(0, 2), (0, 0), (1, 1)})
    # Another block shape goes through the element entries (BSR stores the zeros inside its blocks as entries).
    C = BlockGroupCOO.from_scipy(bsr, block_shape=(1, 3))
    check_block_groups(C, bsr.toarray(), {(r, c) for r in range(4) for c in range(2)})


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_block_value_dtypes(dtype):
    rng = np.random.default_rng(2)
    x = rng.choice(VALUES, size=(6, 5)) * (rng.random((6, 5)) < 0.3)
    for B in (
        BlockGroupCOO.from_scipy(sp.csr_matrix(x), block_shape=(2, 2), dtype=dtype),
        BlockGroupCOO.from_dense(x.astype(dtype), block_shape=(2, 2)),
        BlockGroupCOO.from_bcoo(
            jsparse.BCOO((x[x != 0].astype(dtype), np.argwhere(x)), shape=x.shape), block_shape=(2, 2)
        ),
    ):
        assert B.dtype == dtype and B.todense().dtype == dtype
        np.testing.assert_array_equal(to_f64(B.todense()), x)
        assert B.to_scipy().dtype == np.promote_types(np.dtype(dtype), np.float32)


def test_block_jax_integration():
    x = np.arange(1.0, 37.0).reshape(6, 6) * (np.arange(36).reshape(6, 6) % 5 == 0)
    B = BlockGroupCOO.from_dense(x, block_shape=(3, 2))
    leaves, treedef = jax.tree_util.tree_flatten(B)
    assert len(leaves) == 3
    assert repr(jax.tree_util.tree_unflatten(treedef, leaves)) == repr(B)
    # The nonzero blocks in block-column order (a TransposedIndex, as GroupCOO's): a pytree child, kept by astype
    # and with_values.
    T = B.with_transpose()
    assert "transposed" in repr(T) and len(jax.tree_util.tree_leaves(T)) == 8
    assert T.astype(jnp.float16).transposed is T.transposed and T.with_values(T.Av).transposed is T.transposed
    nonzero = np.flatnonzero(np.asarray(B.Av != 0).any(axis=(1, 2)).reshape(-1))
    assert sorted(np.asarray(T.transposed.perm)) == list(nonzero)
    assert np.all(np.diff(np.asarray(B.Ak).reshape(-1)[np.asarray(T.transposed.perm)]) >= 0)
    assert jax.tree_util.tree_map(lambda _: object(), B).block_shape == (3, 2)
    seen = []
    dense = jax.jit(lambda B: seen.append(repr(B)) or B.todense())(B)
    assert seen == [repr(B)]
    np.testing.assert_array_equal(np.asarray(dense), x)
    w = jnp.arange(36.0).reshape(6, 6)
    grad = jax.grad(lambda Av: jnp.sum(B.with_values(Av).todense() * w))(B.Av)
    # d/dAv[g, m, k, p] = w[Ai[g] * 3 + m, Ak[g, p] * 2 + k].
    Ai, Ak = np.asarray(B.Ai), np.asarray(B.Ak)
    rows = Ai[:, None, None, None] * 3 + np.arange(3)[:, None, None]
    cols = Ak[:, None, None, :] * 2 + np.arange(2)[:, None]
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(w)[rows, cols])
    half = B.with_values(B.Av.astype(jnp.float16) / 2)
    assert half.dtype == jnp.float16 and half.nnz == B.nnz
    np.testing.assert_array_equal(to_f64(half.todense()), x / 2)


BAi = np.array([0, 2], np.int32)
BAk = np.array([[0, 1], [1, 0]], np.int32)
BAv = np.ones((2, 2, 3, 2), np.float32)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(shape=(5, 6, 1)), ValueError, r"shape must have 2 entries, got \(5, 6, 1\)"),
        (dict(Av=BAv[..., 0]), ValueError, r"Av must be 4-D with shape \(G, bm, bk, P\) and a positive block shape"),
        (dict(Av=BAv[:, :0]), ValueError, r"Av must be 4-D .* got \(2, 0, 3, 2\)"),
        (
            dict(Av=BAv[:, :, :, :1]),
            ValueError,
            r"Av must have shape \(G, bm, bk, P\) = \(2, 2, 3, 2\) to match Ak \(2, 2\)",
        ),
        (dict(Av=BAv.astype(np.int8)), TypeError, r"Av must have a floating dtype"),
        (
            dict(Ai=np.array([0, 3], np.int32)),
            ValueError,
            r"Ai\[1\] = 3 is out of range: expected 0 <= Ai < 3 \(the number of block rows\)",
        ),
        (
            dict(Ak=np.array([[0, 1], [2, 0]], np.int32)),
            ValueError,
            r"Ak\[1, 0\] = 2 is out of range: expected 0 <= Ak < 2 \(the number of block columns\)",
        ),
        (dict(Ai=np.array([2, 0], np.int32)), ValueError, r"Ai must be sorted non-decreasing \(block rows in order"),
        (
            dict(nnz=5),
            ValueError,
            r"nnz counts the stored blocks excluding group padding, so it must be at most G\*P = 4",
        ),
    ],
)
def test_block_group_coo_validation(kwargs, error, match):
    args = dict(Ai=BAi, Ak=BAk, Av=BAv, shape=(5, 6)) | kwargs
    nnz = args.pop("nnz", None)
    with pytest.raises(error, match=f"^BlockGroupCOO: {match}"):
        BlockGroupCOO(**args, nnz=nnz)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (
            lambda: BlockGroupCOO.from_scipy(sp.eye(4), block_shape=(2, 0)),
            ValueError,
            r"block_shape must be positive, got \(2, 0\)",
        ),
        (lambda: BlockGroupCOO.from_scipy(sp.eye(4), block_shape=(2,)), ValueError, r"block_shape must have 2 entries"),
        (
            lambda: BlockGroupCOO.from_dense(np.ones((2, 2, 2)), block_shape=(1, 1)),
            ValueError,
            r"from_dense: expected a 2-D array \(M, K\), got shape \(2, 2, 2\)",
        ),
        (
            lambda: BlockGroupCOO.from_bcoo(
                jsparse.BCOO((np.ones((1, 2)), np.zeros((1, 2), int)), shape=(2, 2, 2)), block_shape=(1, 1)
            ),
            ValueError,
            r"from_bcoo: blocks hold scalars, so the BCOO must have no dense dimensions",
        ),
        (
            lambda: BlockGroupCOO.from_dense(np.eye(4), block_shape=(2, 2)).with_values(jnp.ones((2, 2, 2, 2))),
            ValueError,
            r"Av must have shape \(G, bm, bk, P\) = \(2, 2, 2, 1\)",
        ),
    ],
)
def test_block_group_coo_converter_errors(call, error, match):
    with pytest.raises(error, match=f"^BlockGroupCOO[.:] ?{match}"):
        call()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=300), st.integers(0, 3))
def test_host_argsort_is_numpys_stable_argsort(keys, spare_bins):
    """The host builders' counting sort (SciPy's CSR -> CSC) orders equal keys as they came, like NumPy's stable
    sort, with unused bins and empty input."""
    from jinsum.formats._build import host_argsort  # noqa: PLC0415

    key = np.asarray(keys, np.int64)
    bins = (int(key.max()) + 1 if key.size else 1) + spare_bins
    np.testing.assert_array_equal(host_argsort(key, bins), np.argsort(key, kind="stable"))
