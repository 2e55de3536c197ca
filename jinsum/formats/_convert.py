"""Host-side helpers shared by :class:`GroupCOO` and :class:`BlockGroupCOO`.

Two kinds of helpers live here:

* validation of the constructor arguments both formats have in common (the group index arrays ``Ai`` and
  ``Ak``, the logical shape, ``nnz``, the group size);
* vectorised NumPy conversions. Every source format (SciPy, dense, BCOO, edge lists) is first brought to a
  *canonical CSR* triple ``(indptr, indices, data)`` -- rows in order, columns increasing within a row, no
  duplicates, ``data`` of shape ``(nnz, *trailing)`` -- and :func:`groups_from_csr` turns that into the group
  arrays. :class:`BlockGroupCOO` builds a canonical CSR of its *blocks* with :func:`blocks_from_csr` and reuses
  the same routine.

Nothing here runs a Python loop over rows or entries: a conversion is a few whole-array passes (an unsorted edge
list adds one stable argsort); measured in DESIGN.md, "Host-side builders are vectorised".
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp
from jax.experimental import checkify
from jax.experimental import sparse as jsparse

from jinsum import _config
from jinsum.formats._build import default_group_size, groups_from_rows

_INT32_MAX = np.iinfo(np.int32).max


# ----------------------------------------------------------------------------------------------------------
# Index dtype.


def index_dtype(*dims: int) -> np.dtype:
    """int32, unless a dimension exceeds ``2**31 - 1`` (then int64, which needs ``jax_enable_x64``)."""
    return np.dtype(np.int64 if max(dims, default=0) > _INT32_MAX else np.int32)


def value_dtype(fmt: str, source_dtype, dtype) -> np.dtype:
    """The value dtype of a converted matrix.

    ``dtype`` when given (it must be floating); else the source's dtype when that is floating; else float32,
    so that integer or boolean adjacency matrices convert without ceremony. Complex values are refused: a cast
    would drop their imaginary parts.
    """
    if jnp.issubdtype(np.dtype(source_dtype), jnp.complexfloating):
        raise TypeError(f"{fmt}: complex values are not supported, got {np.dtype(source_dtype)} (a cast to a real "
                        "dtype would drop the imaginary parts); convert the real and imaginary parts separately")
    if dtype is not None:
        dtype = np.dtype(dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"{fmt}: dtype must be a floating dtype (float16, bfloat16, float32, float64), got {dtype}"
            )
        return dtype
    source_dtype = np.dtype(source_dtype)
    return source_dtype if jnp.issubdtype(source_dtype, jnp.floating) else np.dtype(np.float32)


# ----------------------------------------------------------------------------------------------------------
# Host and device arrays.


def as_jax_array(x) -> jax.Array:
    """``x`` as a JAX array; JAX arrays and tracers pass through unchanged.

    ``jax.device_put`` rather than ``jnp.asarray``: in JAX 0.10 the latter compiles a copy for every new shape
    (a compile per shape: DESIGN.md, "Host-side builders are vectorised"), while ``device_put`` only transfers.
    Both canonicalise dtypes the same way (int64 becomes int32 without ``jax_enable_x64``).
    """
    return x if isinstance(x, jax.Array) else jax.device_put(np.asarray(x))


def is_concrete(x) -> bool:
    """Whether ``x`` holds values we can read on the host (NumPy or a non-tracer JAX array)."""
    return not isinstance(x, jax.core.Tracer)


def capacity_overflow(count, capacity: int, *, eager: Callable[[int], str], traced: str) -> jax.Array:
    """The ``overflow`` flag of a build into ``capacity`` slots that ``count`` entries asked for: a concrete count past
    the capacity raises ``ValueError(eager(count))``; a traced one sets the flag, checked by ``checkify`` (message
    ``traced``) under ``jinsum.check_indices``."""
    if is_concrete(count) and count > capacity:
        raise ValueError(eager(int(count)))
    overflow = count > capacity
    if _config.check_indices.value:
        checkify.check(~overflow, traced)
    return overflow


def check_not_overflowed(where: str, matrix) -> None:
    """Refuses a format whose ``overflow`` flag is concrete and set: one built for a capacity under tracing
    (``GroupCOO.from_edge_index`` or ``BlockGroupCOO.from_block_mask`` with ``capacity=``, inside ``jit``) and
    returned, whose entries past the capacity were dropped. An eager build raises instead, so only such a format can
    carry the flag; a traced flag (the call itself inside ``jit``) is not read, and no flag (None) is a host build."""
    overflow = getattr(matrix, "overflow", None)
    if overflow is None or not is_concrete(overflow) or not np.any(np.asarray(overflow)):
        return
    kind = type(matrix).__name__
    entries, builders = (("blocks", "BlockGroupCOO.from_block_mask") if kind == "BlockGroupCOO" else
                         ("distinct entries", "GroupCOO.from_edge_index or jinsum.graphs.adjacency"))
    raise ValueError(f"{where}: the {kind} overflowed: it was built under jit with room for {matrix.nnz} "
                     f"{entries}, more were given, and those past it were dropped (its overflow flag is set); "
                     f"rebuild it with a larger capacity ({builders} called outside jit names the capacity needed)")


def host_array(where: str, x) -> np.ndarray:
    """``np.asarray(x)``, with a clear error for tracers: host conversions cannot run under ``jit``."""
    if not is_concrete(x):
        raise TypeError(f"{where} runs on the host and needs concrete arrays, got a tracer; call it outside jit")
    return np.asarray(x)


# ----------------------------------------------------------------------------------------------------------
# Validation shared by the two constructors.


def check_shape(fmt: str, name: str, shape, ndim: int | None = None) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative Python ints (``ndim`` of them, when given)."""
    try:
        shape = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise TypeError(f"{fmt}: {name} must be a tuple of ints, got {shape!r}") from None
    if ndim is not None and len(shape) != ndim:
        raise ValueError(f"{fmt}: {name} must have {ndim} entries, got {shape}")
    if any(d < 0 for d in shape):
        raise ValueError(f"{fmt}: {name} must be non-negative, got {shape}")
    return shape


def block_grid(shape: tuple[int, int], block_shape: tuple[int, int]) -> tuple[int, int]:
    """The block grid ``(ceil(M / bm), ceil(K / bk))``: edge blocks overhang a shape that is not a multiple."""
    return -(-shape[0] // block_shape[0]), -(-shape[1] // block_shape[1])


def check_block_shape(fmt: str, block_shape) -> tuple[int, int]:
    """``block_shape`` as two positive Python ints."""
    block_shape = check_shape(fmt, "block_shape", block_shape, ndim=2)
    if min(block_shape) < 1:
        raise ValueError(f"{fmt}: block_shape must be positive, got {block_shape}")
    return block_shape


def check_int(fmt: str, name: str, value, minimum: int = 0) -> int:
    """``value`` as a Python int, at least ``minimum`` (a bool is not an int here)."""
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{fmt}: {name} must be an int, got {value!r}") from None
    if value < minimum:
        raise ValueError(f"{fmt}: {name} must be an int >= {minimum}, got {value}")
    return value


def check_group_size(fmt: str, group_size, row_lengths) -> int:
    """``group_size`` as a positive int, or :func:`default_group_size` of ``row_lengths`` when None."""
    if group_size is None:
        return default_group_size(row_lengths)
    return check_int(fmt, "group_size (or None for automatic)", group_size, minimum=1)


def check_nnz(fmt: str, nnz, capacity: int, what: str) -> int:
    """``nnz`` as an int in ``[0, capacity]``; None means ``capacity`` (every slot counts)."""
    if nnz is None:
        return capacity
    nnz = check_int(fmt, "nnz", nnz)
    if nnz > capacity:
        raise ValueError(
            f"{fmt}: nnz counts the stored {what} excluding group padding, so it must be at most G*P = "
            f"{capacity}; got {nnz}"
        )
    return nnz


def check_edge_index(where: str, edge_index, num_nodes: int | None = None) -> None:
    """An integer ``(2, E)`` edge index (sources, destinations); with ``num_nodes``, its values (when concrete) in
    ``[0, num_nodes)``."""
    if jnp.ndim(edge_index) != 2 or jnp.shape(edge_index)[0] != 2 or not jnp.issubdtype(
            jnp.result_type(edge_index), jnp.integer):
        raise ValueError(f"{where}: edge_index must be an integer array of shape (2, E) (sources, destinations), "
                         f"got {jnp.result_type(edge_index)}{list(jnp.shape(edge_index))}")
    if num_nodes is not None and is_concrete(edge_index) and np.size(edge_index):
        low, high = int(np.min(edge_index)), int(np.max(edge_index))
        if low < 0 or high >= num_nodes:
            raise ValueError(f"{where}: edge_index holds node ids in [{low}, {high}], outside [0, num_nodes = "
                             f"{num_nodes})")


def check_floating(fmt: str, Av) -> None:
    if not jnp.issubdtype(Av.dtype, jnp.floating):
        raise TypeError(
            f"{fmt}: Av must have a floating dtype (float16, bfloat16, float32, float64), got {Av.dtype}; "
            f"cast it with Av.astype(jnp.float32)"
        )


def check_group_indices(
    fmt: str, Ai, Ak, grid: tuple[int, int], units: tuple[str, str]
) -> tuple[jax.Array, jax.Array]:
    """Validates the group index arrays and returns them as JAX arrays.

    Static checks (always): ``Ai`` is 1-D ``(G,)``, ``Ak`` is 2-D ``(G, P)``, both of one integer dtype wide
    enough for ``grid``. Value checks (only for concrete arrays; skipped under tracing):
    ``0 <= Ai < grid[0]``, ``Ai`` non-decreasing, ``0 <= Ak < grid[1]``.

    Args:
      fmt: the class name, for messages.
      Ai, Ak: the index arrays, any array-like.
      grid: ``(rows, columns)`` the indices address (block rows and block columns for the block format).
      units: what ``grid`` counts, for messages: ``("rows", "columns")`` or ``("block rows", "block columns")``.
    """
    for name, x, ndim, layout in (("Ai", Ai, 1, "(G,)"), ("Ak", Ak, 2, "(G, P)")):
        dtype = jnp.result_type(x)
        if not jnp.issubdtype(dtype, jnp.integer):
            raise TypeError(f"{fmt}: {name} must have an integer dtype, got {dtype}; cast it with .astype(jnp.int32)")
        if jnp.ndim(x) != ndim:
            raise ValueError(f"{fmt}: {name} must be {ndim}-D with shape {layout}, got shape {jnp.shape(x)}")
    if jnp.shape(Ak)[0] != jnp.shape(Ai)[0]:
        raise ValueError(
            f"{fmt}: Ak must have shape (G, P) with G = {jnp.shape(Ai)[0]} to match Ai {jnp.shape(Ai)}, "
            f"got {jnp.shape(Ak)}"
        )
    # Read concrete values on the host before the conversion to JAX, which may narrow int64 to int32.
    host = {name: np.asarray(x) for name, x in (("Ai", Ai), ("Ak", Ak)) if is_concrete(x)}
    for name, bound, what in (("Ai", grid[0], units[0]), ("Ak", grid[1], units[1])):
        bad = np.flatnonzero((host[name] < 0) | (host[name] >= bound)) if name in host else ()
        if len(bad):
            pos = np.unravel_index(bad[0], host[name].shape)
            raise ValueError(
                f"{fmt}: {name}[{', '.join(map(str, pos))}] = {host[name][pos]} is out of range: expected "
                f"0 <= {name} < {bound} (the number of {what})"
            )
    bad = np.flatnonzero(host["Ai"][1:] < host["Ai"][:-1]) if "Ai" in host else ()
    if len(bad):
        g, ai = int(bad[0]) + 1, host["Ai"]
        raise ValueError(
            f"{fmt}: Ai must be sorted non-decreasing ({units[0]} in order, a row's groups consecutive), got "
            f"Ai[{g - 1}] = {ai[g - 1]} > Ai[{g}] = {ai[g]}; the from_* constructors build sorted groups"
        )
    Ai, Ak = as_jax_array(Ai), as_jax_array(Ak)
    if Ai.dtype != Ak.dtype:
        raise TypeError(f"{fmt}: Ai and Ak must have the same integer dtype, got {Ai.dtype} and {Ak.dtype}")
    if max(grid) - 1 > jnp.iinfo(Ai.dtype).max:
        raise ValueError(
            f"{fmt}: index dtype {Ai.dtype} cannot hold indices up to {max(grid) - 1}; enable "
            f"jax.config.update('jax_enable_x64', True) and pass int64 indices"
        )
    return Ai, Ak


# ----------------------------------------------------------------------------------------------------------
# Canonical CSR from each source format.


def _rows_to_indptr(rows: np.ndarray, num_rows: int) -> np.ndarray:
    """CSR ``indptr`` (int64, ``(num_rows + 1,)``) of sorted row indices."""
    indptr = np.zeros(num_rows + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=num_rows), out=indptr[1:])
    return indptr


def _sort_unique(rows: np.ndarray, cols: np.ndarray, shape: tuple[int, int]):
    """Stable-sorts entries by ``(row, col)`` and finds the runs of equal coordinates.

    Returns ``(order, starts, urows, ucols)``: ``order`` sorts the entries, ``starts`` indexes the first sorted
    entry of each distinct coordinate, ``urows``/``ucols`` are the distinct coordinates in order.
    """
    num_rows, num_cols = shape
    if num_rows * num_cols > np.iinfo(np.int64).max:
        raise ValueError(
            f"cannot convert a matrix of shape {shape}: M * K must be below 2**63 so that (row, column) pairs fit "
            f"one int64 sort key"
        )
    # One int64 key sorts by (row, col) in a single argsort, about twice as fast as np.lexsort. A stable sort
    # keeps duplicates in input order, so sums are deterministic; on already sorted input it is linear.
    key = rows.astype(np.int64) * num_cols + cols
    order = np.argsort(key, kind="stable")
    key = key[order]
    starts = np.flatnonzero(np.concatenate([[True], key[1:] != key[:-1]])) if key.size else np.zeros(0, np.int64)
    ukey = key[starts]
    return order, starts, ukey // max(num_cols, 1), ukey % max(num_cols, 1)


def csr_from_coo(rows, cols, data, shape: tuple[int, int]):
    """Canonical CSR of COO entries, summing duplicates.

    Args:
      rows, cols: int arrays ``(n,)``, in range (the callers check).
      data: array ``(n, *trailing)``.
      shape: ``(M, K)``.

    Returns:
      ``(indptr (M + 1,), indices (nnz,), data (nnz, *trailing))``, ``data`` in the input's dtype. Sums run in
      at least float32 and round once at the end: float16 and bfloat16 would otherwise round at every addition.
    """
    data = np.asarray(data)
    order, starts, urows, ucols = _sort_unique(np.asarray(rows), np.asarray(cols), shape)
    if starts.size:
        summed = np.add.reduceat(data[order], starts, axis=0, dtype=np.promote_types(data.dtype, np.float32))
    else:
        summed = data[:0]
    return _rows_to_indptr(urows, shape[0]), ucols, summed.astype(data.dtype, copy=False)


def _canonical(mat):
    """A CSR or BSR matrix with sorted indices and no duplicates (explicit zeros kept, as SciPy does)."""
    if mat.has_canonical_format:
        return mat
    # tocsr() returns CSR input itself: copy rather than sort the caller's matrix in place.
    mat = mat.copy()
    mat.sum_duplicates()
    return mat


def _check_scipy(fmt: str, mat) -> None:
    if not sp.issparse(mat):
        raise TypeError(
            f"{fmt}.from_scipy: expected a scipy.sparse matrix or array, got {type(mat).__name__}; "
            f"use {fmt}.from_dense for dense arrays"
        )
    if mat.ndim != 2:
        raise ValueError(f"{fmt}.from_scipy: expected a 2-D sparse matrix, got shape {mat.shape}")


def csr_from_scipy(fmt: str, mat):
    """Canonical CSR ``(indptr, indices, data)`` of any SciPy sparse matrix or array.

    Duplicates are summed; explicit zeros stay stored entries (SciPy counts them in ``nnz`` too).
    """
    _check_scipy(fmt, mat)
    csr = _canonical(mat.tocsr())
    return csr.indptr, csr.indices, csr.data


def blocks_from_scipy(fmt: str, mat, block_shape: tuple[int, int]):
    """Canonical CSR of the blocks of any SciPy sparse matrix: ``(indptr, indices, blocks (nb, bm, bk))``.

    A BSR matrix whose blocksize is ``block_shape`` gives its blocks as they are (zeros inside included);
    anything else goes through :func:`blocks_from_csr`.
    """
    _check_scipy(fmt, mat)
    if mat.format == "bsr" and tuple(mat.blocksize) == block_shape:
        bsr = _canonical(mat)
        return bsr.indptr, bsr.indices, bsr.data
    return blocks_from_csr(*csr_from_scipy(fmt, mat), mat.shape, block_shape)


def to_scipy_csr(rows, cols, data, shape: tuple[int, int]) -> sp.csr_matrix:
    """SciPy CSR of COO slots: duplicates summed, zero-valued entries dropped.

    float16 and bfloat16 values are upcast to float32, which SciPy supports.
    """
    data = data.astype(np.promote_types(data.dtype, np.float32), copy=False)
    csr = sp.coo_matrix((data, (rows, cols)), shape=shape).tocsr()
    csr.eliminate_zeros()
    return csr


def csr_from_dense(fmt: str, x):
    """Canonical CSR of a dense ``(M, K, *trailing)`` array: an entry is stored iff it is nonzero (in any
    trailing position). Returns ``(indptr, indices, data (nnz, *trailing))``."""
    x = host_array(f"{fmt}.from_dense", x)
    if x.ndim < 2:
        raise ValueError(f"{fmt}.from_dense: expected an array of shape (M, K, *dense), got shape {x.shape}")
    mask = (x != 0).reshape(*x.shape[:2], math.prod(x.shape[2:])).any(axis=-1)
    # np.nonzero walks in row-major order, so the coordinates are already canonical.
    rows, cols = np.nonzero(mask)
    return _rows_to_indptr(rows, x.shape[0]), cols, x[rows, cols]


def csr_from_bcoo(fmt: str, mat):
    """Canonical CSR of a concrete BCOO with no batch dimensions: ``(shape, indptr, indices, data)``.

    ``data`` has shape ``(nnz, *mat.shape[2:])`` (BCOO's dense dimensions). Out-of-bounds indices, which BCOO
    uses as padding, are dropped; duplicates are summed.
    """
    if not isinstance(mat, jsparse.BCOO):
        raise TypeError(f"{fmt}.from_bcoo: expected a jax.experimental.sparse.BCOO, got {type(mat).__name__}")
    if mat.n_batch:
        raise ValueError(
            f"{fmt}.from_bcoo: expected a BCOO without batch dimensions (n_batch=0), got n_batch={mat.n_batch}; "
            f"convert each batch element separately, or use mat.update_layout(n_batch=0)"
        )
    if mat.n_sparse != 2:
        raise ValueError(f"{fmt}.from_bcoo: expected 2 sparse dimensions (a matrix), got n_sparse={mat.n_sparse}")
    indices, data = host_array(f"{fmt}.from_bcoo", mat.indices), host_array(f"{fmt}.from_bcoo", mat.data)
    shape = tuple(mat.shape)
    keep = np.all(indices < np.asarray(shape[:2]), axis=1)
    return (shape, *csr_from_coo(indices[keep, 0], indices[keep, 1], data[keep], shape[:2]))


# ----------------------------------------------------------------------------------------------------------
# Canonical CSR -> groups.


def groups_from_csr(indptr, indices, data, group_size: int, dtype, num_cols: int):
    """Groups of a canonical CSR, exactly as many as its rows need: every converter ends here, in the builder the
    device path shares (`jinsum.formats._build.groups_from_rows`).

    A row with ``L`` entries becomes ``ceil(L / P)`` consecutive groups; its last group is padded with value 0 at
    its first entry's column.

    Args:
      indptr: ``(M + 1,)``; indices: ``(nnz,)`` columns; data: ``(nnz, *trailing)``.
      group_size: ``P``.
      dtype: value dtype of ``Av`` (the cast happens in the scatter).
      num_cols: ``K``, for the index dtype.

    Returns:
      NumPy ``Ai (G,)``, ``Ak (G, P)``, ``Av (G, P, *trailing)``.
    """
    indptr = np.asarray(indptr, np.int64)
    num_rows = indptr.size - 1
    lengths = np.diff(indptr)
    num_groups = int((-(-lengths // group_size)).sum())
    rows = np.repeat(np.arange(num_rows, dtype=np.int32 if num_rows < np.iinfo(np.int32).max else np.int64),
                     lengths)
    Ai, Ak, Av, _ = groups_from_rows(np, rows, np.asarray(indices), np.asarray(data), num_rows=num_rows,
                                     group_size=group_size, num_groups=num_groups, dtype=dtype,
                                     index_dtype=index_dtype(num_rows, num_cols), num_columns=num_cols)
    return Ai, Ak, Av


def blocks_from_csr(indptr, indices, data, shape: tuple[int, int], block_shape: tuple[int, int]):
    """Canonical CSR of the ``bm x bk`` blocks of a canonical element CSR.

    A block is stored iff it holds a stored entry. Returns ``(indptr (Mb + 1,), indices (nb,),
    blocks (nb, bm, bk))`` over the block grid ``Mb x Kb = ceil(M / bm) x ceil(K / bk)``; block entries beyond
    the logical shape are zero.
    """
    (bm, bk), data = block_shape, np.asarray(data)
    grid = block_grid(shape, block_shape)
    rows = np.repeat(np.arange(shape[0], dtype=np.int64), np.diff(indptr))
    cols = np.asarray(indices, np.int64)
    order, starts, brows, bcols = _sort_unique(rows // bm, cols // bk, grid)
    block_of = np.repeat(np.arange(starts.size), np.diff(np.append(starts, order.size)))
    blocks = np.zeros((starts.size, bm, bk), data.dtype)
    # Canonical input has distinct coordinates, so plain assignment (no accumulation) is exact.
    rows, cols = rows[order], cols[order]
    blocks[block_of, rows % bm, cols % bk] = data[order]
    return _rows_to_indptr(brows, grid[0]), bcols, blocks
