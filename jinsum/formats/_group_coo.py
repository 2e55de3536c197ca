"""GroupCOO: a sparse matrix stored as groups of ``P`` nonzeros of one row (the Insum paper's format)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify
from jax.experimental import sparse as jsparse

from jinsum.formats._base import GroupedFormat
from jinsum import _config
from jinsum.formats._build import (capacity_group_size, device_groups, device_transposed, group_bound,
                                   groups_from_rows, rows_of_positions, spread_padding, transposed_from_slots)
from jinsum.formats._convert import (
    as_jax_array,
    check_edge_index,
    check_floating,
    check_group_indices,
    check_group_size,
    check_int,
    check_nnz,
    check_shape,
    csr_from_bcoo,
    csr_from_coo,
    csr_from_dense,
    csr_from_scipy,
    groups_from_csr,
    host_array,
    index_dtype,
    is_concrete,
    to_scipy_csr,
    value_dtype,
)

_FMT = "GroupCOO"


class TransposedIndex(NamedTuple):
    """A `GroupCOO`'s stored entries in column order, and the row-grouped index of its transpose.

    Work that runs over the columns needs the entries sorted by column: the backward of an SpMM with respect to
    its dense operand (`dB = A^T dC`, which then runs as the forward SpMM's kernel over the transpose instead of
    adding every entry's product atomically) and the backward of attention over its keys. Built once on the host
    by :meth:`GroupCOO.with_transpose`, it costs no sort in every call of a jitted step that takes the matrix as an
    argument (an argsort of a graph's millions of edges each step).

    Attributes:
      perm: int ``(T,)``, the flat slots ``g * P + p`` of the entries whose value was nonzero (anywhere in its
        dense dimensions) when the index was built, sorted by column (stably: by row within a column). Built on the
        device (static sizes), it lists the stored entries (explicit zeros too) and then every other slot.
      starts: int ``(K + 1,)``: column ``k``'s entries are ``perm[starts[k]:starts[k + 1]]``.
      columns, rows, slots: the same entries grouped as a `GroupCOO` of the transpose would be: group ``h`` of
        column ``columns[h]`` (``(H,)``, non-decreasing) holds ``Q`` entries, of rows ``rows[h]`` and flat slots
        ``slots[h]`` (``(H, Q)``), ``Q`` picked like a format's group size; padding has slot ``-1`` (and row 0).
    """

    perm: jax.Array
    starts: jax.Array
    columns: jax.Array
    rows: jax.Array
    slots: jax.Array


def transposed_index(where: str, Ai, Ak, nonzero: np.ndarray, shape: tuple[int, int], dtype,
                     group_size: int | None = None) -> TransposedIndex:
    """The slots of a grouped format (`Ai (G,)`, `Ak (G, P)`) where `nonzero` (bool `(G * P,)`) in column order, and
    grouped as the transpose of a `(rows, columns) = shape` grid (`group_size` entries per group, by default the
    format's rule); built on the host (`with_transpose`)."""
    Ai, Ak = host_array(where, Ai), host_array(where, Ak)
    found = transposed_from_slots(np, Ai, Ak, nonzero, num_columns=shape[1], group_size=group_size, num_groups=None,
                                  index_dtype=np.int64)
    return TransposedIndex(*(as_jax_array(x.astype(dtype, copy=False)) for x in found))


# One compiled program (eagerly, each of its operations compiled alone: several times slower for a new shape).
@functools.partial(jax.jit, static_argnums=3)
def _dense(Ai, Ak, Av, shape: tuple[int, ...]) -> jax.Array:
    """`GroupCOO.todense`: the slots' values added at their (row, column)."""
    return jnp.zeros(shape, Av.dtype).at[Ai[:, None], Ak].add(Av)


# The device builders' arrays as one compiled program each (static sizes, dtypes and flags); their checks stay
# outside, eager where the input is concrete. Called outside `jit`, op by op, a build compiled each of its operations
# for every new shape.
@functools.partial(jax.jit, static_argnames=("num_sources", "dtype", "index_dtype", "with_transpose"))
def _neighbor_groups(neighbors, values, *, num_sources: int, dtype, index_dtype, with_transpose: bool):
    """`GroupCOO.from_neighbors`'s ``(Ai, Ak, Av, transposed)`` (None without ``with_transpose``): one group of
    ``k`` per row, entries outside ``[0, num_sources)`` padding."""
    valid = (neighbors >= 0) & (neighbors < num_sources)
    Ai = jnp.arange(neighbors.shape[0], dtype=index_dtype)
    Ak = spread_padding(jnp, jnp.where(valid, neighbors, 0).astype(index_dtype), valid, num_sources)
    expand = valid.reshape(valid.shape + (1,) * (values.ndim - 2))
    Av = jnp.where(expand, values, 0).astype(dtype)
    transposed = None
    if with_transpose:
        transposed = TransposedIndex(*device_transposed(Ai, Ak, valid.reshape(-1), num_columns=num_sources,
                                                        index_dtype=index_dtype))
    return Ai, Ak, Av, transposed


@functools.partial(jax.jit, static_argnames=("num_columns", "group_size", "dtype", "index_dtype", "with_transpose"))
def _csr_groups(indptr, indices, values, *, num_columns: int, group_size: int, dtype, index_dtype,
                with_transpose: bool):
    """`GroupCOO.from_csr`'s ``(Ai, Ak, Av, transposed)`` (None without ``with_transpose``)."""
    num_rows, length = indptr.shape[0] - 1, indices.shape[0]
    rows = rows_of_positions(indptr, length, index_dtype)
    # Positions before indptr[0] stay in row 0 as padding (rows must not decrease); those from indptr[M] on are
    # in row M, which `groups_from_rows` drops.
    valid = (rows >= 0) & (indices >= 0) & (indices < num_columns)
    expand = valid.reshape(valid.shape + (1,) * (values.ndim - 1))
    Ai, Ak, Av, active = groups_from_rows(
        jnp, jnp.maximum(rows, 0), jnp.where(valid, indices, -1), jnp.where(expand, values, 0).astype(dtype),
        num_rows=num_rows, group_size=group_size, num_groups=group_bound(length, num_rows, group_size),
        dtype=dtype, index_dtype=index_dtype, num_columns=num_columns)
    transposed = None
    if with_transpose:  # (`active`: the slots of valid entries, whose columns were not -1)
        transposed = TransposedIndex(*device_transposed(Ai, Ak, active, num_columns=num_columns,
                                                        index_dtype=index_dtype))
    return Ai, Ak, Av, transposed


def _check_values(Av, groups: tuple[int, int]) -> None:
    """Static checks on ``Av`` against ``(G, P)``; shared by the constructor and :meth:`GroupCOO.with_values`."""
    check_floating(_FMT, Av)
    if Av.ndim < 2 or Av.shape[:2] != groups:
        raise ValueError(
            f"{_FMT}: Av must have shape (G, P, *dense_shape) with (G, P) = {groups} to match Ak, got {Av.shape}"
        )


def _check_edge_values(where: str, values, num_edges: int) -> None:
    if values.ndim < 1 or values.shape[0] != num_edges:
        raise ValueError(
            f"{where}: values must have shape (E, *dense_shape) with E = {num_edges} edges, got {values.shape}"
        )


def _check_csr(where: str, indptr, indices, num_columns: int, host) -> None:
    """`from_csr`'s index values: ``indptr`` non-decreasing within ``[0, len(indices)]`` and ``indices`` below
    ``num_columns`` (negative ones are padding). Concrete arrays (``host``: both as NumPy arrays, read before the
    conversion to JAX could narrow int64, else None) raise a ValueError naming the first bad position; traced ones
    are `checkify` checks under `jinsum.check_indices` (without it, a column past ``num_columns`` is left out and a
    bad ``indptr`` gives rows of the positions its running count reaches)."""
    length = indices.shape[0]
    if host is not None:
        host_indptr, host_indices = host
        for bad, problem in ((np.flatnonzero(host_indptr[1:] < host_indptr[:-1]) + 1, "below the one before it"),
                             (np.flatnonzero((host_indptr < 0) | (host_indptr > length)),
                              f"outside [0, len(indices) = {length}]")):
            if bad.size:
                raise ValueError(f"{where}: indptr[{bad[0]}] = {host_indptr[bad[0]]} is {problem}: indptr must be "
                                 f"non-decreasing row starts in [0, {length}], got {host_indptr.tolist()[:8]}"
                                 f"{'...' if host_indptr.size > 8 else ''}")
        bad = np.flatnonzero(host_indices >= num_columns)
        if bad.size:
            raise ValueError(f"{where}: indices[{bad[0]}] = {host_indices[bad[0]]} is out of range: expected a column "
                             f"< num_columns = {num_columns}, or a negative one (padding)")
    elif _config.check_indices.value:
        checkify.check(jnp.all(indptr[1:] >= indptr[:-1]) & (indptr[0] >= 0) & (indptr[-1] <= length),
                       f"{where}: indptr must be non-decreasing row starts in [0, len(indices) = {length}]")
        checkify.check(jnp.all(indices < num_columns), f"{where}: indices holds a column past num_columns = "
                       f"{num_columns}; negative ones mark padding")


@jax.tree_util.register_pytree_node_class
class GroupCOO(GroupedFormat):
    """A sparse ``M x K`` matrix (optionally with trailing dense dimensions) stored as groups.

    The nonzeros of each row are cut into groups of ``P`` consecutive entries (in increasing column order);
    group ``g`` belongs to row ``Ai[g]``, and its slot ``p`` holds column ``Ak[g, p]`` with value
    ``Av[g, p]``. A row with ``L`` nonzeros has ``ceil(L / P)`` consecutive groups, empty rows have none, and a
    row's last group is padded to ``P`` with value 0 (at the group's first column). The matrix is therefore::

        A[m, k] = sum over (g, p) with Ai[g] == m and Ak[g, p] == k of Av[g, p]

    Trailing dense dimensions (like BCOO's ``n_dense``) give each stored entry a small dense array of values,
    e.g. one per attention head: ``Av[g, p, h]`` is entry ``(Ai[g], Ak[g, p], h)``.

    Attributes:
      Ai: int ``(G,)``, the row of each group, sorted non-decreasing.
      Ak: int ``(G, P)``, the column of each slot (same dtype as ``Ai``; int32 unless a dimension exceeds
        ``2**31 - 1``).
      Av: floating ``(G, P, *dense_shape)``, the value of each slot.

      transposed: a :class:`TransposedIndex` of the entries in column order, or None: built on request by
        :meth:`with_transpose` (``jinsum.graphs.adjacency`` does), and by the device builders.
      overflow: for a format built on the device for a capacity (``from_edge_index(..., capacity=C)``), a boolean
        scalar array, True when the input held more entries than the capacity (the rest were not kept); None for
        a format built on the host. Only a build under tracing can set it (an eager one raises instead): check it
        outside ``jit``, or run under ``jinsum.check_indices`` and checkify. Outside ``jit``, ``jinsum.einsum``,
        ``@`` and ``jinsum.attention`` refuse a format whose flag is set.

    The class is a pytree with children ``(Ai, Ak, Av, transposed, overflow)`` and static ``(shape, nnz)``, so it passes
    through ``jit``, ``grad`` and ``vmap``. Build it from other formats with :meth:`from_scipy`, :meth:`from_dense`,
    :meth:`from_bcoo` or :meth:`from_edge_index`; they pick ``P`` with :func:`default_group_size` unless told.
    :meth:`from_validated` assembles one from arrays a builder has made consistent, without checking them.
    """

    __slots__ = ("Ai", "Ak", "Av", "transposed", "overflow", "_shape", "_nnz")

    def __init__(self, Ai, Ak, Av, shape, *, nnz: int | None = None):
        """Builds a GroupCOO from its arrays, validating them.

        Args:
          Ai: int ``(G,)`` rows of the groups, sorted.
          Ak: int ``(G, P)`` columns, same dtype as ``Ai``.
          Av: floating ``(G, P, *dense_shape)`` values.
          shape: ``(M, K, *dense_shape)``.
          nnz: the number of stored entries excluding group padding; defaults to ``G * P``.

        Shapes and dtypes are always checked; index values (``0 <= Ai < M`` and sorted, ``0 <= Ak < K``) are
        checked when the arrays are concrete, and not under tracing. Column order within a row and zero-valued
        padding are conventions the ``from_*`` converters keep; the matrix is well defined without them.
        """
        shape = check_shape(_FMT, "shape", shape)
        if len(shape) < 2:
            raise ValueError(f"{_FMT}: shape must be (M, K, *dense_shape), got {shape}")
        Ai, Ak = check_group_indices(_FMT, Ai, Ak, shape[:2], ("rows", "columns"))
        Av = as_jax_array(Av)
        _check_values(Av, Ak.shape)
        if shape[2:] != Av.shape[2:]:
            raise ValueError(
                f"{_FMT}: shape must be (M, K, *dense_shape) with dense_shape = Av.shape[2:] = {Av.shape[2:]}, "
                f"got {shape}"
            )
        self._set(Ai, Ak, Av, None, None, shape, check_nnz(_FMT, nnz, Ak.size, "entries"))

    @classmethod
    def from_validated(cls, *, Ai, Ak, Av, shape: tuple[int, ...], nnz: int, transposed: TransposedIndex | None = None,
                       overflow=None) -> GroupCOO:
        """A GroupCOO of arrays already consistent with each other, not checked: for builders whose arrays are right
        by construction (the device builders, :meth:`with_values`, ``jinsum.shard.partition``'s stacked parts).

        Args:
          Ai, Ak, Av, transposed, overflow: as the attributes.
          shape: ``(M, K, *dense_shape)``.
          nnz: the number of stored entries excluding group padding.
        """
        matrix = object.__new__(cls)
        matrix._set(Ai, Ak, Av, transposed, overflow, shape, nnz)
        return matrix

    def _set(self, Ai, Ak, Av, transposed, overflow, shape, nnz) -> None:
        self.Ai, self.Ak, self.Av, self.transposed, self.overflow = Ai, Ak, Av, transposed, overflow
        self._shape, self._nnz = shape, nnz

    # -- pytree ------------------------------------------------------------------------------------------

    def tree_flatten(self):
        return (self.Ai, self.Ak, self.Av, self.transposed, self.overflow), (self._shape, self._nnz)

    # -- properties --------------------------------------------------------------------------------------

    @property
    def dense_shape(self) -> tuple[int, ...]:
        """The trailing dense dimensions of each entry (``()`` for a plain matrix)."""
        return self._shape[2:]

    def __repr__(self) -> str:
        # Only static information, so it also works on tracers.
        dims = ", ".join(map(str, self._shape))
        transposed = ", transposed" if self.transposed is not None else ""
        return (
            f"{_FMT}({jnp.dtype(self.dtype).name}[{dims}], nnz={self._nnz}, "
            f"groups={self.num_groups} x {self.group_size}{transposed})"
        )

    # -- construction from other formats (host side, NumPy) ----------------------------------------------

    @classmethod
    def _from_csr(cls, shape, indptr, indices, data, group_size, dtype) -> GroupCOO:
        group_size = check_group_size(_FMT, group_size, np.diff(indptr))
        Ai, Ak, Av = groups_from_csr(indptr, indices, data, group_size, dtype, shape[1])
        return cls(Ai, Ak, Av, shape, nnz=len(indices))

    @classmethod
    def from_scipy(cls, mat, *, group_size: int | None = None, dtype=None) -> GroupCOO:
        """Converts any ``scipy.sparse`` matrix or array (COO, CSR, CSC, BSR, ...).

        Duplicate entries are summed; explicit zeros are kept as stored entries (and counted in ``nnz``, as
        SciPy does). ``group_size`` defaults to :func:`default_group_size`; ``dtype`` defaults to the
        matrix's dtype when floating, else float32.
        """
        indptr, indices, data = csr_from_scipy(_FMT, mat)
        dtype = value_dtype(f"{_FMT}.from_scipy", data.dtype, dtype)
        return cls._from_csr(mat.shape, indptr, indices, data, group_size, dtype)

    @classmethod
    def from_dense(cls, x, *, group_size: int | None = None, dtype=None) -> GroupCOO:
        """Converts a dense ``(M, K, *dense_shape)`` NumPy or concrete JAX array.

        Entry ``(m, k)`` is stored iff ``x[m, k]`` is nonzero (anywhere in its dense dimensions).
        """
        indptr, indices, data = csr_from_dense(_FMT, x)
        dtype = value_dtype(f"{_FMT}.from_dense", data.dtype, dtype)
        return cls._from_csr(np.shape(x), indptr, indices, data, group_size, dtype)

    @classmethod
    def from_bcoo(cls, mat, *, group_size: int | None = None, dtype=None) -> GroupCOO:
        """Converts a concrete ``jax.experimental.sparse.BCOO`` without batch dimensions.

        BCOO dense dimensions (``n_dense``) become :attr:`dense_shape`. Duplicates are summed; BCOO's
        out-of-bounds padding entries are dropped.
        """
        shape, indptr, indices, data = csr_from_bcoo(_FMT, mat)
        dtype = value_dtype(f"{_FMT}.from_bcoo", data.dtype, dtype)
        return cls._from_csr(shape, indptr, indices, data, group_size, dtype)

    @classmethod
    def from_edge_index(
        cls, edge_index, values=None, *, num_nodes: int | tuple[int, int], capacity: int | None = None,
        group_size: int | None = None, dtype=None
    ) -> GroupCOO:
        """The adjacency matrix of a graph given as an edge list, on the host or, with a capacity, inside ``jit``.

        Args:
          edge_index: int ``(2, E)``; row 0 holds sources and row 1 destinations (the PyG convention). With a
            capacity, a column with a negative index is padding.
          values: ``(E,)`` or ``(E, *dense_shape)`` edge values; defaults to ones.
          num_nodes: the number of nodes ``N``, for an ``N x N`` matrix; or ``(N_src, N_dst)`` (PyG's ``size``)
            for the ``N_dst x N_src`` matrix of a bipartite graph.
          capacity: None builds on the host from concrete arrays (NumPy; exact sizes, a new shape per graph).
            An int ``C`` builds with `jax.numpy` from concrete or traced arrays (inside ``jit``, ``vmap``,
            ``grad`` with respect to ``values``): the result holds at most ``C`` distinct entries, its shapes
            depend only on ``C``, the node counts and the group size, and it carries its entries in column order
            (`transposed`) and an ``overflow`` flag. More distinct entries than the capacity never go silently
            missing: with concrete ``edge_index`` that is a ``ValueError`` naming the capacity needed; traced
            (inside ``jit``), those past the capacity (in row-major order) are not kept and ``overflow`` is True
            (``jinsum.einsum``, ``@`` and ``jinsum.attention`` called outside ``jit`` refuse such a format). An
            index past the node counts is likewise a ``ValueError`` naming the edge with concrete ``edge_index``;
            traced, that edge is left out (no flag). Under ``jinsum.check_indices`` both are `checkify` errors
            when traced.
          group_size: defaults to :func:`default_group_size` on the host, and to the capacity's rule
            (``jinsum.formats.capacity_group_size``) on the device.
          dtype: defaults to the dtype of ``values`` when floating, else float32.

        Returns:
          ``A`` with ``A[dst, src] = value`` (duplicate edges summed), so that ``A @ X`` aggregates the features
          of each node's sources into it, as message passing does. Built for a capacity, ``A.nnz`` is the capacity
          (an upper bound), and its padding (slots past the entries) has value 0, so it changes no result.

        Example (a new sampled graph every step, one compile):
          >>> @jax.jit
          ... def step(edge_index, x):                       # edge_index (2, 8), padded with -1
          ...     A = jinsum.GroupCOO.from_edge_index(edge_index, num_nodes=4, capacity=8)
          ...     return A @ x, A.overflow
          >>> edge_index = jnp.array([[0, 1, 2, 3, -1, -1, -1, -1], [1, 2, 3, 0, -1, -1, -1, -1]])
          >>> y, overflow = step(edge_index, jnp.ones((4, 3)))
          >>> y.shape, bool(overflow)
          ((4, 3), False)
        """
        where = f"{_FMT}.from_edge_index"
        pair = tuple(num_nodes) if isinstance(num_nodes, (tuple, list)) else (num_nodes, num_nodes)
        if len(pair) != 2:
            raise ValueError(f"{where}: num_nodes must be an int or a pair (N_src, N_dst), got {num_nodes!r}")
        num_src, num_dst = (check_int(where, "num_nodes", n) for n in pair)
        if capacity is not None:
            return cls._from_edges_on_device(where, edge_index, values, (num_dst, num_src),
                                             check_int(where, "capacity", capacity), group_size, dtype)
        return cls._from_edges_on_host(where, edge_index, values, (num_dst, num_src), group_size, dtype)

    @classmethod
    def _from_edges_on_host(cls, where, edge_index, values, shape, group_size, dtype) -> GroupCOO:
        """`from_edge_index` without a capacity, its errors from `where` (the function the user called)."""
        num_dst, num_src = shape
        edge_index = host_array(where, edge_index)
        check_edge_index(where, edge_index)
        bounds = np.array([[num_src], [num_dst]])
        bad = np.argwhere((edge_index < 0) | (edge_index >= bounds))
        if bad.size:
            i, e = bad[0]
            raise ValueError(
                f"{where}: edge_index[{i}, {e}] = {edge_index[i, e]} is out of range: expected 0 <= node < "
                f"num_nodes = {int(bounds[i, 0])} ({'sources' if i == 0 else 'destinations'}); on the host there is "
                "no padding (with capacity=, negative indices mark padding)"
            )
        num_edges = edge_index.shape[1]
        values = np.ones(num_edges, np.float32) if values is None else host_array(where, values)
        _check_edge_values(where, values, num_edges)
        shape = (num_dst, num_src, *values.shape[1:])
        indptr, indices, data = csr_from_coo(edge_index[1], edge_index[0], values, shape[:2])
        return cls._from_csr(shape, indptr, indices, data, group_size, value_dtype(where, values.dtype, dtype))

    @classmethod
    def _from_edges_on_device(cls, where, edge_index, values, shape, capacity, group_size, dtype, *,
                              self_loops: int = 0) -> GroupCOO:
        """`from_edge_index` for a capacity. ``self_loops``: entries the caller added on top of its own capacity
        (``jinsum.graphs.adjacency``'s ``N`` self loops, each node's one); the errors then count them apart, so that
        they name the capacity that caller takes."""
        edge_index = as_jax_array(edge_index)
        check_edge_index(where, edge_index)
        if is_concrete(edge_index):  # eagerly an index past the node counts is an error, not a dropped edge
            host = np.asarray(edge_index)
            bounds = np.array([[shape[1]], [shape[0]]])
            bad = np.argwhere(((host >= bounds) & (host >= 0).all(axis=0)).T)  # (edge, row): the first edge first
            if bad.size:
                e, i = bad[0]
                raise ValueError(
                    f"{where}: edge_index[{i}, {e}] = {host[i, e]} is out of range: expected 0 <= node < num_nodes = "
                    f"{int(bounds[i, 0])} ({'sources' if i == 0 else 'destinations'}), or a negative index (a "
                    "padding column)")
        num_edges = edge_index.shape[1]
        values = jnp.ones(num_edges, jnp.float32) if values is None else as_jax_array(values)
        _check_edge_values(where, values, num_edges)
        dtype = value_dtype(where, values.dtype, dtype)
        group_size = (capacity_group_size(capacity, shape[0]) if group_size is None
                      else check_int(where, "group_size", group_size, minimum=1))
        index = index_dtype(*shape)
        Ai, Ak, Av, active, distinct, out_of_range = device_groups(
            edge_index[1], edge_index[0], values, shape=shape, capacity=capacity,
            group_size=group_size, dtype=dtype, index_dtype=index)
        # The caller's numbers: its capacity and its edges, the self loops it had added counted apart.
        asked, edges = capacity - self_loops, "distinct edges" + (" (self loops aside)" if self_loops else "")
        loops = (f"; the {self_loops} self loops take {self_loops} entries of their own beyond it ({capacity} in "
                 "all)" if self_loops else "")
        if is_concrete(distinct) and distinct > capacity:
            needed = int(distinct) - self_loops
            raise ValueError(f"{where}: {needed} {edges} but capacity = {asked} holds only {asked}; pass "
                             f"capacity >= {needed} (or None to build on the host){loops}")
        overflow = distinct > capacity
        if _config.check_indices.value:
            checkify.check(~out_of_range, f"{where}: edge_index holds a node index past num_nodes = "
                           f"(sources {shape[1]}, destinations {shape[0]}); negative indices mark padding")
            checkify.check(~overflow, f"{where}: more {edges} than capacity = {asked}; those past it were not kept "
                           f"(raise the capacity){loops}")
        transposed = TransposedIndex(*device_transposed(Ai, Ak, active, num_columns=shape[1], index_dtype=index))
        return cls.from_validated(Ai=Ai, Ak=Ak, Av=Av, shape=(*shape, *values.shape[1:]), nnz=capacity,
                                  transposed=transposed, overflow=overflow)

    @classmethod
    def from_neighbors(cls, neighbors, values=None, *, num_sources: int, dtype=None,
                       with_transpose: bool = True) -> GroupCOO:
        """The ``n x num_sources`` matrix of a fixed-fanout neighbor table, traceable (no sort for the forward).

        Row ``i`` holds the ``k`` sampled neighbors ``neighbors[i]`` (a negative entry is padding: a row with fewer
        neighbors than ``k``), each one group of size ``k``: ``Ai = arange(n)``, ``Ak = neighbors``. Repeated
        neighbors (sampling with replacement) stay separate entries, so they count as often as drawn. The result
        carries its entries in column order (``with_transpose``: one sort, on the device), and ``overflow`` False.

        Args:
          neighbors: int ``(n, k)``, source node ids, negative for padding; ``k = 0`` gives rows without entries.
            An id past ``num_sources`` is a ``ValueError`` naming it with concrete ``neighbors``; traced, that entry
            is left out, and under ``jinsum.check_indices`` it is a `checkify` error.
          values: ``(n, k)`` or ``(n, k, *dense_shape)``; defaults to ones.
          num_sources: the number of source nodes (columns).
          dtype: defaults to the dtype of ``values`` when floating, else float32.
          with_transpose: build the entries in column order, so the gradient with respect to the sources runs
            without atomics (deterministic mode needs it to avoid a sort per call); a small table's backward is
            about as fast adding atomically.
        """
        where = f"{_FMT}.from_neighbors"
        num_sources = check_int(where, "num_sources", num_sources)
        host = np.asarray(neighbors) if is_concrete(neighbors) else None  # (before a conversion narrows int64)
        neighbors = as_jax_array(neighbors)
        if neighbors.ndim != 2 or not jnp.issubdtype(neighbors.dtype, jnp.integer):
            raise ValueError(f"{where}: neighbors must be an integer array (rows, k) of source ids (negative: "
                             f"padding), got {neighbors.dtype}{list(neighbors.shape)}")
        bad = np.argwhere(host >= num_sources) if host is not None else ()
        if len(bad):  # eagerly a source past num_sources is an error, not a dropped entry (traced: checkify below)
            i, j = bad[0]
            raise ValueError(f"{where}: neighbors[{i}, {j}] = {host[i, j]} is out of range: expected a source id < "
                             f"num_sources = {num_sources}, or a negative one (padding)")
        values = jnp.ones(neighbors.shape, jnp.float32) if values is None else as_jax_array(values)
        if values.shape[:2] != neighbors.shape:
            raise ValueError(f"{where}: values must have shape {neighbors.shape} + dense_shape to match neighbors, "
                             f"got {values.shape}")
        dtype = value_dtype(where, values.dtype, dtype)
        if _config.check_indices.value:
            checkify.check(jnp.all(neighbors < num_sources), f"{where}: neighbors holds a source id past "
                           f"num_sources = {num_sources}; negative ids mark padding")
        Ai, Ak, Av, transposed = _neighbor_groups(
            neighbors, values, num_sources=num_sources, dtype=dtype,
            index_dtype=index_dtype(neighbors.shape[0], num_sources), with_transpose=bool(with_transpose))
        shape = (neighbors.shape[0], num_sources, *values.shape[2:])
        return cls.from_validated(Ai=Ai, Ak=Ak, Av=Av, shape=shape, nnz=Ak.size, transposed=transposed,
                                  overflow=jnp.zeros((), bool))

    @classmethod
    def from_csr(cls, indptr, indices, values=None, *, num_columns: int, group_size: int | None = None, dtype=None,
                 with_transpose: bool = True) -> GroupCOO:
        """The ``M x num_columns`` matrix of a CSR index (row ``r``: the columns ``indices[indptr[r]:indptr[r + 1]]``),
        traceable, with no sort: its shapes depend only on ``len(indptr)``, ``len(indices)`` and the group size.

        Every position of ``indices`` is a stored entry of its own, as in :meth:`from_neighbors`: repeated columns of
        a row stay separate entries (the host converters sum them). The result carries its entries in column order
        (``with_transpose``: one sort, on the device), and ``overflow`` False.

        Args:
          indptr: int ``(M + 1,)``, non-decreasing, in ``[0, L]``; positions outside ``[indptr[0], indptr[M])`` are
            left out.
          indices: int ``(L,)`` columns; a negative one is padding (a slot of value 0 in its row). Concrete
            ``indptr`` and ``indices`` that break these rules, or hold a column past ``num_columns``, are a
            ``ValueError`` naming the position; traced, a column past ``num_columns`` is left out, and under
            ``jinsum.check_indices`` either is a `checkify` error.
          values: ``(L,)`` or ``(L, *dense_shape)``; defaults to ones.
          num_columns: ``K``.
          group_size: defaults to the capacity's rule for ``L`` entries over ``M`` rows (`capacity_group_size`).
          dtype, with_transpose: as for :meth:`from_neighbors`.

        Example (torch's `EmbeddingBag` reading: bag ``b`` is ``ids[offsets[b]:offsets[b + 1]]``):
          >>> ids, offsets = jnp.array([4, 1, 4, 7]), jnp.array([0, 3])           # bags {4, 1, 4} and {7}
          >>> A = jinsum.GroupCOO.from_csr(jnp.append(offsets, len(ids)), ids, num_columns=10)
          >>> table = jnp.arange(10.0)[:, None] * jnp.ones(3)                     # (10, 3): row r holds r
          >>> print(A @ table)                                   # each bag's sum of its rows
          [[9. 9. 9.]
           [7. 7. 7.]]
        """
        where = f"{_FMT}.from_csr"
        num_columns = check_int(where, "num_columns", num_columns)
        host = (np.asarray(indptr), np.asarray(indices)) if is_concrete(indptr) and is_concrete(indices) else None
        indptr, indices = as_jax_array(indptr), as_jax_array(indices)
        for name, x, expected in (("indptr", indptr, "(M + 1,) of row starts"),
                                  ("indices", indices, "(L,) of columns")):
            if x.ndim != 1 or not jnp.issubdtype(x.dtype, jnp.integer) or (name == "indptr" and x.size == 0):
                raise ValueError(f"{where}: {name} must be an integer array {expected}, got {x.dtype}{list(x.shape)}")
        num_rows, length = indptr.shape[0] - 1, indices.shape[0]
        _check_csr(where, indptr, indices, num_columns, host)
        values = jnp.ones(length, jnp.float32) if values is None else as_jax_array(values)
        _check_edge_values(where, values, length)
        dtype = value_dtype(where, values.dtype, dtype)
        group_size = (capacity_group_size(length, num_rows) if group_size is None
                      else check_int(where, "group_size", group_size, minimum=1))
        Ai, Ak, Av, transposed = _csr_groups(
            indptr, indices, values, num_columns=num_columns, group_size=group_size, dtype=dtype,
            index_dtype=index_dtype(num_rows, num_columns, length), with_transpose=bool(with_transpose))
        shape = (num_rows, num_columns, *values.shape[1:])
        return cls.from_validated(Ai=Ai, Ak=Ak, Av=Av, shape=shape, nnz=length, transposed=transposed,
                                  overflow=jnp.zeros((), bool))

    # -- export ------------------------------------------------------------------------------------------

    def todense(self) -> jax.Array:
        """The dense ``(M, K, *dense_shape)`` array. Traceable and differentiable with respect to ``Av``."""
        return _dense(self.Ai, self.Ak, self.Av, self._shape)

    def to_bcoo(self) -> jsparse.BCOO:
        """A ``BCOO`` holding every one of the ``G * P`` slots, padding included.

        Padding slots are zero-valued entries (at columns that hold entries), so the matrix is equal, but the BCOO is
        not duplicate-free (``unique_indices=False``) and ``nse = G * P``. Keeping every slot makes this traceable;
        call ``.sum_duplicates()`` on the result to compact it outside ``jit``.
        """
        rows = jnp.broadcast_to(self.Ai[:, None], self.Ak.shape)
        indices = jnp.stack([rows, self.Ak], axis=-1).reshape(-1, 2)
        data = self.Av.reshape(-1, *self.dense_shape)
        return jsparse.BCOO((data, indices), shape=self._shape)

    def to_scipy(self):
        """A ``scipy.sparse.csr_matrix`` (host side; needs concrete arrays and no dense dimensions).

        Duplicates are summed and zero-valued entries are dropped -- group padding, and also stored explicit
        zeros, so ``to_scipy().nnz`` may be below :attr:`nnz`. float16 and bfloat16 become float32.
        """
        if self.dense_shape:
            raise ValueError(
                f"{_FMT}.to_scipy: SciPy matrices are 2-D, but this GroupCOO has dense_shape {self.dense_shape}; "
                f"convert one dense slice at a time with with_values(A.Av[..., i])"
            )
        where = f"{_FMT}.to_scipy"
        rows = np.repeat(host_array(where, self.Ai), self.group_size)
        return to_scipy_csr(rows, host_array(where, self.Ak).ravel(), host_array(where, self.Av).ravel(), self._shape)

    def with_values(self, Av) -> GroupCOO:
        """The same sparsity structure with new values.

        Args:
          Av: floating ``(G, P, *dense_shape)``, any floating dtype and any dense shape (e.g. per-head
            attention weights on a structure built with scalar values).

        Returns:
          A GroupCOO sharing ``Ai``, ``Ak`` and ``nnz``, with shape ``(M, K, *Av.shape[2:])``. Only shapes
          are checked, so this is cheap and works under ``jit``. The entries in column order (`transposed`) stay
          (the slots ``(G, P)`` are the same), so gradients through the new values keep their atomic-free backward;
          that index lists the entries that were stored (nonzero, for :meth:`with_transpose` on the host) when
          it was built, so slots outside it (group padding) must stay zero, as for any product.
        """
        Av = as_jax_array(Av)
        _check_values(Av, self.Ak.shape)
        return self._replace(Av=Av, shape=self._shape[:2] + Av.shape[2:])

    def astype(self, dtype) -> GroupCOO:
        """The same matrix with its values cast to the floating ``dtype``. A cast keeps zeros zero, so the transposed
        index stays."""
        Av = self.Av.astype(dtype)
        check_floating(_FMT, Av)
        return self._replace(Av=Av)

    def with_transpose(self) -> GroupCOO:
        """The same matrix carrying a :class:`TransposedIndex` (its entries in column order): built on the host from
        concrete arrays (exact sizes; once per matrix, outside ``jit``), or inside ``jit`` from traced ones
        (static sizes bounded by the slots, ``G * P``).

        The index lists the entries whose value is nonzero now (group padding is left out); it stays valid while
        the values keep their zeros, and :meth:`with_values` keeps it (learned values of a fixed structure).

        Example:
          >>> A = jinsum.GroupCOO.from_edge_index(np.array([[0, 1, 2, 3], [1, 2, 3, 0]]), num_nodes=4).with_transpose()
          >>> B = jnp.ones((4, 3))
          >>> jax.grad(lambda B: (A @ B).sum())(B).shape   # A^T dC over A.transposed: each row of dB written once
          (4, 3)
          >>> q = k = v = jnp.ones((4, 1, 8))
          >>> jinsum.attention(q, k, v, A).shape   # its backward over the keys reads A.transposed: no sort per call
          (4, 1, 8)
        """
        where = f"{_FMT}.with_transpose"
        if any(isinstance(x, jax.core.Tracer) for x in (self.Ai, self.Ak, self.Av)):
            # Under jit: the same builder with static sizes (every slot with a nonzero value counts).
            nonzero = (self.Av != 0).reshape(self.Ak.size, -1).any(axis=1)
            transposed = TransposedIndex(*device_transposed(self.Ai, self.Ak, nonzero, num_columns=self._shape[1],
                                                            index_dtype=self.index_dtype))
            return self._replace(transposed=transposed)
        values = host_array(where, self.Av)
        nonzero = (values != 0).reshape(self.Ak.size, int(np.prod(self.dense_shape))).any(axis=1)
        transposed = transposed_index(where, self.Ai, self.Ak, nonzero, self._shape[:2], self.index_dtype)
        return self._replace(transposed=transposed)
