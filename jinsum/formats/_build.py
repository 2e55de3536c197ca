"""The one builder of grouped formats, for the host and the device alike.

Every grouped format is built from entries sorted by row. The host converters (NumPy: exact sizes, any graph) and
the device builders (`jax.numpy` inside `jit`: sizes bounded by a static capacity, contents traced) call the same
functions here with `xp` set to `numpy` or `jax.numpy`, so the two paths cannot drift apart:

* :func:`groups_from_rows` cuts sorted entries into groups of ``P`` slots (`Ai`, `Ak`, `Av`);
* :func:`transposed_from_slots` orders a format's slots by column and groups them as its transpose (the
  `TransposedIndex` that makes backward passes atomic-free).

On the device the number of groups is a bound, :func:`group_bound`, that no input of the capacity exceeds; the
groups past the real ones are padding: the last row's id (so `Ai` stays sorted and in range), value 0, and columns
spread over the matrix (`spread_padding`). Padding never changes a product, a maximum (zero-valued slots are bound
out of range), or a gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse

_GROUP_SIZES = (32, 16, 8, 4, 2, 1)


def default_group_size(row_lengths) -> int:
    """The group size the converters pick when none is given.

    Among ``P`` in ``{1, 2, 4, 8, 16, 32}``, returns the largest whose padded storage
    ``sum(ceil(L / P) * P)`` over the row lengths ``L`` is at most ``1.25 * sum(L)``: larger groups give the
    kernels longer contiguous work per group, and the bound keeps the padding (zero-valued slots that are
    still loaded and multiplied) at most a quarter of the real entries. ``P = 1`` never pads, so it is
    returned when nothing larger qualifies, and for an empty matrix.

    Args:
      row_lengths: int array ``(M,)``, the number of stored entries of each row (of each block row, for
        :class:`BlockGroupCOO`: the number of stored blocks).

    Returns:
      The group size ``P`` as a Python int.

    Example: rows of lengths ``[4, 8]`` (``nnz = 12``) take 12 slots at ``P = 4`` and 16 at ``P = 8``
    (more than 15), so the answer is 4.
    """
    lengths = np.asarray(row_lengths)
    if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(
            f"default_group_size: row_lengths must be a 1-D integer array (stored entries per row), got "
            f"{lengths.dtype}{list(lengths.shape)}; pass e.g. np.diff(csr.indptr)"
        )
    negative = np.flatnonzero(lengths < 0)
    if negative.size:
        raise ValueError(f"default_group_size: row_lengths must be >= 0 (stored entries per row), got "
                         f"row_lengths[{negative[0]}] = {lengths[negative[0]]}")
    lengths = lengths.astype(np.int64)
    nnz = int(lengths.sum())
    if nnz == 0:
        # Every P pads nothing here; 1 is the natural choice for an empty matrix.
        return 1
    # 4 * padded <= 5 * nnz is padded <= 1.25 * nnz in exact integers. P = 1 always qualifies (no padding).
    return next(p for p in _GROUP_SIZES if 4 * p * int((-(-lengths // p)).sum()) <= 5 * nnz)


def group_bound(capacity: int, num_rows: int, group_size: int) -> int:
    """The most groups that ``capacity`` entries over ``num_rows`` rows can need.

    A row of ``L`` entries takes ``ceil(L / P)`` groups, at most ``(L + P - 1) / P``; summed over at most
    ``min(num_rows, capacity)`` non-empty rows that is ``(C + (P - 1) min(N, C)) / P``.
    """
    if num_rows == 0:
        return 0
    return (capacity + (group_size - 1) * min(num_rows, capacity)) // group_size


def capacity_group_size(capacity: int, num_rows: int) -> int:
    """The group size of a format built for a capacity (it must be static, so it cannot look at row lengths as
    `default_group_size` does): the largest ``P`` in ``{32, ..., 1}`` whose worst-case padding ``(P - 1) min(N, C)``
    is at most a quarter of ``C``, the bound `default_group_size` keeps on the host."""
    rows = min(num_rows, capacity)
    return next(p for p in _GROUP_SIZES if 4 * (p - 1) * rows <= capacity)


def _scatter(xp, target, index, values):
    """``target[index] = values``, dropping indices ``>= len(target)``."""
    if xp is np:
        if index.size and index.max() >= target.shape[0]:  # (on the host usually none is dropped: no copies then)
            keep = index < target.shape[0]
            index, values = index[keep], values[keep]
        target[index] = values
        return target
    return target.at[index].set(values.astype(target.dtype), mode="drop")


def _cummax(xp, x):
    return np.maximum.accumulate(x) if xp is np else jax.lax.cummax(x)


def rows_of_positions(indptr, length: int, dtype=jnp.int32):
    """Traceable: the row of each of ``length`` positions cut into rows at ``indptr`` (non-decreasing, ``(M + 1,)``),
    counted as the row starts at or before it: a histogram of the starts and a running sum, no search (on GPUs
    `jnp.searchsorted` is a loop that waits on the host). Positions before ``indptr[0]`` get -1, those from
    ``indptr[M]`` on get ``M``."""
    starts = jnp.zeros(length + 1, dtype).at[jnp.clip(indptr, 0, length)].add(1)
    return jnp.cumsum(starts[:length]) - 1


# Entries per row (on average) from which a histogram of rows on the device queues its atomic additions on a few
# counters: HeteroLinear's 262,144 rows of 16 types (16,384 a row) took far longer counted so than from the rows'
# first positions (benchmarks/README.md, "Mixtures of experts and grouped products (`moe.py`, `grouped_forms.py`,
# `hetero_linear.py`)").
# Below, the histogram is one kernel where the first positions take three (a batch of molecules' step builds its
# adjacency with ~2 entries a row). The threshold between is not measured.
CONTENDED_ROW_LENGTH = 64


def row_lengths(xp, rows, num_rows: int):
    """Entries per row of non-decreasing row ids in ``[0, num_rows]`` (``num_rows``: a dropped entry): a
    histogram, or on the device where rows are long (`CONTENDED_ROW_LENGTH`), from each row's first position
    (written by that position alone)."""
    length = rows.shape[0]
    if xp is np or length < CONTENDED_ROW_LENGTH * num_rows:
        counts = np.bincount(rows, minlength=num_rows + 1) if xp is np else jnp.bincount(rows, length=num_rows + 1)
        return counts[:num_rows]
    positions = jnp.arange(length, dtype=rows.dtype)
    first = jnp.concatenate([jnp.ones(min(length, 1), bool), rows[1:] != rows[:-1]])
    starts = jnp.full(num_rows + 1, length, rows.dtype).at[jnp.where(first, rows, num_rows + 1)].set(
        positions, mode="drop")
    starts = jax.lax.cummin(starts, reverse=True)  # a row without entries starts where the next one does
    return starts[1:] - starts[:-1]


def group_slots(xp, rows, *, num_rows: int, group_size: int, num_groups: int):
    """Where `groups_from_rows` puts each entry: its flat slot (``num_groups * P`` for a dropped one), and each
    row's first group and number of groups."""
    lengths = row_lengths(xp, rows, num_rows)
    groups = -(-lengths // group_size)
    first_group = xp.cumsum(groups) - groups
    # Entry i of row r: slot first_group[r] * P + (i - row_start[r]), one gather of the rows' shifts.
    shift = first_group * group_size - (xp.cumsum(lengths) - lengths)
    if xp is np and num_groups * group_size + rows.shape[0] < np.iinfo(np.int32).max:
        shift = shift.astype(np.int32)  # (half the bytes of every pass over the entries on the host)
    positions = xp.arange(rows.shape[0], dtype=shift.dtype)
    # (Without rows every entry is of row `num_rows`, dropped: there is no shift to read.)
    slot = shift[xp.minimum(rows, num_rows - 1)] + positions if num_rows else positions
    return xp.where(rows < num_rows, slot, num_groups * group_size), first_group, groups


def groups_from_rows(xp, rows, cols, data, *, num_rows: int, group_size: int, num_groups: int, dtype, index_dtype,
                     num_columns: int | None = None):
    """Groups of entries sorted by row.

    Entry ``j`` of row ``r`` goes to slot ``first_group[r] * P + j``: a row's entries fill its groups in the order
    given, and its last group is padded with value 0 at the columns `spread_padding` gives.

    Args:
      xp: `numpy` (host) or `jax.numpy` (traceable).
      rows: int ``(n,)``, non-decreasing; an entry of row ``num_rows`` (which sorts last) is dropped.
      cols: int ``(n,)`` columns (-1: a padding entry, placed like padding); data: ``(n, *trailing)`` values.
      num_rows: ``M``; group_size: ``P``.
      num_groups: ``G``: exactly the groups needed on the host, `group_bound` on the device (the groups past the
        real ones are padding of the last non-empty row).
      num_columns: ``K``, which groups of padding only spread their columns over; None leaves them at column 0
        (an index whose padding is only read, as a transpose's rows are).
      dtype, index_dtype: of the values and of the index arrays.

    Returns:
      ``Ai (G,)``, ``Ak (G, P)``, ``Av (G, P, *trailing)``, and bool ``(G * P,)``: the slots that hold an entry
      (not padding, nor a column of -1).
    """
    p = group_size
    slot, first_group, groups = group_slots(xp, rows, num_rows=num_rows, group_size=p, num_groups=num_groups)
    filled = _scatter(xp, xp.zeros(num_groups * p, index_dtype), slot, cols + 1).reshape(num_groups, p)  # 0: padding
    Ak = spread_padding(xp, filled - 1, filled > 0, 1 if num_columns is None else num_columns)
    Av = _scatter(xp, xp.zeros((num_groups * p, *data.shape[1:]), dtype), slot, data)
    # Each row's id at its first group, then a running maximum: the row of every group (padding groups after the
    # last real one take the last non-empty row's id).
    ids = xp.arange(num_rows, dtype=index_dtype)
    Ai = _scatter(xp, xp.zeros(num_groups, index_dtype), xp.where(groups > 0, first_group, num_groups), ids)
    return _cummax(xp, Ai), Ak, Av.reshape(num_groups, p, *data.shape[1:]), (filled > 0).reshape(-1)


def spread_padding(xp, Ak, stored, num_columns: int):
    """``Ak`` ``(G, P)`` with each padding slot (``~stored``) at its group's first stored column, and every slot of
    a group with none stored at column ``g mod num_columns``.

    Padding's value is 0, so any column in range gives the same products; where it points decides what it costs.
    At one shared column every zero that a gradient adds through ``Ak`` atomically queues on that one row: a
    batch of molecules' gradient nearly twice as slow, a padded fixed-fanout table's an order of magnitude
    (DESIGN.md, "Padding is data"). A group's own first column is a row the group reads anyway and adds to already.
    """
    if Ak.shape[1] == 0:  # groups of no slots (a fixed-fanout table of fanout 0): nothing to place
        return Ak
    first = xp.argmax(stored, axis=1)
    own = xp.take_along_axis(Ak, first[:, None], axis=1)[:, 0]
    spare = (xp.arange(Ak.shape[0]) % max(num_columns, 1)).astype(Ak.dtype)
    fill = xp.where(stored.any(axis=1), own, spare)
    return xp.where(stored, Ak, fill[:, None])


def transposed_from_slots(xp, Ai, Ak, active, *, num_columns: int, group_size: int | None, num_groups: int | None,
                          index_dtype):
    """A format's active slots in column order, and grouped as its transpose.

    Args:
      Ai, Ak: the format's ``(G,)`` and ``(G, P)`` index arrays.
      active: bool ``(G * P,)``: the slots to list (stored entries; not padding).
      num_columns: ``K``.
      group_size: ``Q``, the transpose's group size; None on the host picks `default_group_size` of the columns.
      num_groups: ``H``, the transpose's groups; None on the host takes exactly those needed.

    Returns:
      ``(perm, starts, columns, rows, slots)`` as a `TransposedIndex` holds them. On the host ``perm`` lists the
      active slots only; on the device all ``G * P`` slots, the inactive ones last (past ``starts[K]``).
    """
    p = Ak.shape[1]
    key = xp.where(active, Ak.reshape(-1), num_columns)
    perm = host_argsort(key, num_columns + 1) if xp is np else _argsort(key)
    key = key[perm]
    counts = row_lengths(xp, key, num_columns)
    starts = xp.concatenate([xp.zeros(1, counts.dtype), xp.cumsum(counts)])
    if group_size is None:
        group_size = default_group_size(np.asarray(counts))
    if num_groups is None:
        num_groups = int((-(-np.asarray(counts) // group_size)).sum())
    rows = Ai[perm // p]
    # The transpose in groups: the entries' rows as its columns, their slots (+ 1: padding becomes -1) as values.
    columns, rows, slots, _ = groups_from_rows(xp, key, rows, perm + 1, num_rows=num_columns, group_size=group_size,
                                            num_groups=num_groups, dtype=index_dtype, index_dtype=index_dtype)
    if xp is np:
        perm = perm[:int(starts[-1])]
    return perm, starts, columns, rows, slots - 1


# ----------------------------------------------------------------------------------------------------------
# The device path: entries in any order, with padding, into a capacity.


def unique_entries(rows, cols, values, *, shape: tuple[int, int], capacity: int):
    """Entries ``(rows, cols, values)`` in any order -> the first ``capacity`` distinct ones in row-major order,
    duplicates summed (as the host converters do), traceable.

    An entry with a negative row or column is padding, and one past ``shape`` is out of range: both are left out
    (`jinsum.check_indices` turns the latter into a `checkify` error). Returns ``(rows, cols, values, distinct,
    out_of_range)``, the first three of length ``capacity``, unused positions with row ``shape[0]``; ``distinct``
    counts the distinct entries given, so more than ``capacity`` of them is an overflow (those past the capacity in
    row-major order are not kept).
    """
    num_rows, num_cols = shape
    padding = (rows < 0) | (cols < 0)
    valid = ~padding & (rows < num_rows) & (cols < num_cols)
    out_of_range = jnp.any(~padding & ~valid)
    row_key = jnp.where(valid, rows, num_rows).astype(jnp.int32)
    col_key = jnp.where(valid, cols, 0).astype(jnp.int32)
    order = _row_major_order(row_key, col_key, shape)
    row_key, col_key = row_key[order], col_key[order]
    first = jnp.ones((1,), bool)
    new = jnp.concatenate([first, (row_key[1:] != row_key[:-1]) | (col_key[1:] != col_key[:-1])])
    new = new & (row_key < num_rows)
    position = jnp.cumsum(new) - 1
    distinct = position[-1] + 1 if rows.shape[0] else jnp.zeros((), position.dtype)
    target = jnp.where((row_key < num_rows) & (position < capacity), position, capacity)
    kept_rows = jnp.full(capacity, num_rows, jnp.int32).at[target].set(row_key, mode="drop")
    kept_cols = jnp.zeros(capacity, jnp.int32).at[target].set(col_key, mode="drop")
    accumulate = jnp.promote_types(values.dtype, jnp.float32)
    kept_values = jnp.zeros((capacity, *values.shape[1:]), accumulate).at[target].add(
        values[order].astype(accumulate), mode="drop")
    return kept_rows, kept_cols, kept_values.astype(values.dtype), distinct, out_of_range


def host_argsort(key: np.ndarray, bins: int) -> np.ndarray:
    """A stable argsort of integer keys in ``[0, bins)`` on the host, as a counting sort: SciPy's CSR -> CSC
    conversion of one row whose entries are the keys (linear in the entries, so faster than NumPy's stable sort
    on large key arrays: DESIGN.md, "Building a partition is sorting")."""
    n = key.shape[0]
    if n == 0 or bins <= 1:
        return np.arange(n)
    index = np.int32 if max(n, bins) < np.iinfo(np.int32).max else np.int64
    row = scipy.sparse.csr_matrix((np.arange(n, dtype=index), key.astype(index, copy=False),
                                   np.array([0, n], index)), shape=(1, bins))
    return row.tocsc().data


def _argsort(key):
    """A stable argsort as a sort of (key, iota): one key and one payload, the form XLA runs as a radix sort on
    GPUs (a sort with two keys runs as a comparison sort, several kernels of it)."""
    return jax.lax.sort((key, jnp.arange(key.shape[0], dtype=jnp.int32)), num_keys=1, is_stable=True)[1]


def _row_major_order(rows, cols, shape: tuple[int, int]):
    """The permutation sorting entries by (row, column), stably, for rows in ``[0, shape[0]]`` (``shape[0]``: a
    dropped entry): one key where ``row * K + col`` fits int32, else by column and then, stably, by row."""
    num_rows, num_cols = shape
    if (num_rows + 1) * max(num_cols, 1) <= int(jnp.iinfo(jnp.int32).max):
        return _argsort(rows * num_cols + cols)
    by_column = _argsort(cols)
    return by_column[_argsort(rows[by_column])]


# Compiled as one program (static sizes and dtypes): called outside `jit`, op by op, a build compiled each of its
# hundred-odd operations on first use (six times the one program's compile time for a small graph).
@functools.partial(jax.jit, static_argnames=("shape", "capacity", "group_size", "dtype", "index_dtype"))
def device_groups(rows, cols, values, *, shape: tuple[int, int], capacity: int, group_size: int, dtype,
                  index_dtype):
    """A grouped format's arrays from entries in any order, traceable: `unique_entries` then `groups_from_rows`
    into `group_bound` groups, the values cast to ``dtype`` first. Returns ``(Ai, Ak, Av, active, distinct,
    out_of_range)``, ``active`` the slots that hold an entry (``(G * P,)``)."""
    rows, cols, values, distinct, out_of_range = unique_entries(rows, cols, values.astype(dtype), shape=shape,
                                                                capacity=capacity)
    num_groups = group_bound(capacity, shape[0], group_size)
    Ai, Ak, Av, active = groups_from_rows(jnp, rows, cols, values, num_rows=shape[0], group_size=group_size,
                                          num_groups=num_groups, dtype=dtype, index_dtype=index_dtype,
                                          num_columns=shape[1])
    return Ai, Ak, Av, active, distinct, out_of_range


@functools.partial(jax.jit, static_argnames=("num_columns", "index_dtype"))
def device_transposed(Ai, Ak, active, *, num_columns: int, index_dtype):
    """`transposed_from_slots` with static sizes: every slot may be active, so the transpose's groups are bounded
    by `group_bound` of all ``G * P`` slots over ``num_columns`` rows."""
    slots = Ak.size
    group_size = capacity_group_size(slots, num_columns)
    return transposed_from_slots(jnp, Ai, Ak, active, num_columns=num_columns, group_size=group_size,
                                 num_groups=group_bound(slots, num_columns, group_size), index_dtype=index_dtype)
