"""BlockGroupCOO: GroupCOO over dense ``bm x bk`` blocks (the Insum paper's block-sparse format)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import sparse as jsparse

from jinsum.formats._base import GroupedFormat
from jinsum.formats._build import device_groups, device_transposed
from jinsum.formats._convert import (
    as_jax_array,
    block_grid,
    capacity_overflow,
    blocks_from_csr,
    blocks_from_scipy,
    check_block_shape,
    check_floating,
    check_group_indices,
    check_group_size,
    check_int,
    check_nnz,
    check_shape,
    csr_from_bcoo,
    csr_from_dense,
    groups_from_csr,
    host_array,
    index_dtype,
    to_scipy_csr,
    value_dtype,
)
from jinsum.formats._group_coo import TransposedIndex, transposed_index

_FMT = "BlockGroupCOO"


def _element_coords(xp, Ai, Ak, block_shape):
    """Row and column of every element of every slot, each broadcast to ``Av``'s ``(G, bm, bk, P)``.

    ``xp`` is ``numpy`` (host export) or ``jax.numpy`` (traceable export).
    """
    (bm, bk), full = block_shape, (Ak.shape[0], *block_shape, Ak.shape[1])
    rows = Ai[:, None, None, None] * bm + xp.arange(bm)[:, None, None]
    cols = Ak[:, None, None, :] * bk + xp.arange(bk)[:, None]
    return xp.broadcast_to(rows, full), xp.broadcast_to(cols, full)


# One compiled program (eagerly, each of its operations compiled alone: several times slower for a new shape).
@functools.partial(jax.jit, static_argnums=(3, 4))
def _dense(Ai, Ak, Av, shape: tuple[int, int], block_shape: tuple[int, int]) -> jax.Array:
    """`BlockGroupCOO.todense`: the slots' blocks added at their block (row, column), edge blocks cropped."""
    (bm, bk), (mb, kb) = block_shape, block_grid(shape, block_shape)
    grid = jnp.zeros((mb, kb, bm, bk), Av.dtype).at[Ai[:, None], Ak].add(jnp.moveaxis(Av, -1, 1))
    return grid.transpose(0, 2, 1, 3).reshape(mb * bm, kb * bk)[: shape[0], : shape[1]]


# One compiled program (eagerly, each of its operations compiled alone: several times slower for a new shape).
@functools.partial(jax.jit, static_argnames=("capacity", "group_size", "dtype", "block_shape"))
def _device_blocks(block_mask, *, capacity: int, group_size: int, dtype, block_shape: tuple[int, int]):
    """`BlockGroupCOO.from_block_mask`'s arrays for a capacity: `(Ai, Ak, Av, transposed, stored)`, the first
    `capacity` nonzero blocks of `block_mask` in row-major order as all-ones blocks, and how many are nonzero."""
    grid = block_mask.shape
    block_mask = block_mask != 0
    rows, cols = jnp.nonzero(block_mask, size=capacity, fill_value=-1)
    index = index_dtype(*grid)
    Ai, Ak, Av, active, _, _ = device_groups(rows, cols, jnp.ones(capacity, dtype), shape=grid, capacity=capacity,
                                             group_size=group_size, dtype=dtype, index_dtype=index)
    blocks = jnp.broadcast_to(Av[:, None, None, :], (Av.shape[0], *block_shape, group_size))
    transposed = TransposedIndex(*device_transposed(Ai, Ak, active, num_columns=grid[1], index_dtype=index))
    return Ai, Ak, blocks, transposed, jnp.count_nonzero(block_mask)


def _check_values(Av, groups: tuple[int, int], block_shape: tuple[int, int]) -> None:
    """Floating ``Av`` of shape ``(G, bm, bk, P)``; shared by the constructor and
    :meth:`BlockGroupCOO.with_values`."""
    check_floating(_FMT, Av)
    expected = (groups[0], *block_shape, groups[1])
    if Av.shape != expected:
        raise ValueError(
            f"{_FMT}: Av must have shape (G, bm, bk, P) = {expected} to match Ak {groups} and block shape "
            f"{block_shape}, got {Av.shape}"
        )


@jax.tree_util.register_pytree_node_class
class BlockGroupCOO(GroupedFormat):
    """A sparse ``M x K`` matrix of dense ``bm x bk`` blocks, stored as groups of ``P`` blocks of one block row.

    It is :class:`GroupCOO` one level up: the matrix is a ``ceil(M / bm) x ceil(K / bk)`` grid of blocks, group
    ``g`` belongs to block row ``Ai[g]``, and its slot ``p`` holds the block at block column ``Ak[g, p]``, with
    element ``(m, k)`` of that block in ``Av[g, m, k, p]`` (the paper's layout: the slot axis last). So::

        A[Ai[g] * bm + m, Ak[g, p] * bk + k] += Av[g, m, k, p]

    A block row with ``L`` stored blocks has ``ceil(L / P)`` consecutive groups, in increasing block column
    order; the last is padded with all-zero blocks (at the group's first block column). ``M`` and ``K`` need not
    be multiples of ``bm`` and ``bk``: edge blocks overhang the logical shape and are zero beyond it (exports crop
    them).

    Attributes:
      Ai: int ``(G,)`` block row of each group, sorted non-decreasing.
      Ak: int ``(G, P)`` block column of each slot (same dtype as ``Ai``).
      Av: floating ``(G, bm, bk, P)`` the blocks.

      transposed: a :class:`TransposedIndex` of the nonzero blocks in block-column order, or None: built on request
        by :meth:`with_transpose`, kept by :meth:`with_values`.
      overflow: for a format built on the device for a capacity (:meth:`from_block_mask`), a boolean scalar array,
        True when more blocks were asked for than fit; None for one built on the host. Only a build under tracing
        can set it (an eager one raises instead); outside ``jit``, ``jinsum.einsum``, ``@`` and ``jinsum.attention``
        refuse a format whose flag is set.

    A pytree with children ``(Ai, Ak, Av, transposed, overflow)`` and static ``(shape, block_shape, nnz)``, where
    ``nnz`` counts the stored blocks excluding padding. :meth:`from_validated` assembles one from arrays a builder has
    made consistent, without checking them.
    """

    __slots__ = ("Ai", "Ak", "Av", "transposed", "overflow", "_shape", "_block_shape", "_nnz")

    def __init__(self, Ai, Ak, Av, shape, *, nnz: int | None = None):
        """Builds a BlockGroupCOO from its arrays, validating them.

        Args:
          Ai: int ``(G,)`` block rows, sorted.
          Ak: int ``(G, P)`` block columns, same dtype as ``Ai``.
          Av: floating ``(G, bm, bk, P)``; the block shape ``(bm, bk)`` is read from it.
          shape: the logical ``(M, K)``.
          nnz: stored blocks excluding padding; defaults to ``G * P``.

        Shapes and dtypes are always checked; index values (``0 <= Ai < ceil(M / bm)`` and sorted,
        ``0 <= Ak < ceil(K / bk)``) are checked when the arrays are concrete, and not under tracing.
        """
        shape = check_shape(_FMT, "shape", shape, ndim=2)
        Av = as_jax_array(Av)
        if Av.ndim != 4 or min(Av.shape[1:3]) < 1:
            raise ValueError(
                f"{_FMT}: Av must be 4-D with shape (G, bm, bk, P) and a positive block shape (bm, bk), "
                f"got {Av.shape}"
            )
        block_shape = Av.shape[1:3]
        Ai, Ak = check_group_indices(_FMT, Ai, Ak, block_grid(shape, block_shape), ("block rows", "block columns"))
        _check_values(Av, Ak.shape, block_shape)
        self._set(Ai, Ak, Av, None, None, shape, block_shape, check_nnz(_FMT, nnz, Ak.size, "blocks"))

    @classmethod
    def from_validated(cls, *, Ai, Ak, Av, shape: tuple[int, int], block_shape: tuple[int, int], nnz: int,
                       transposed: TransposedIndex | None = None, overflow=None) -> BlockGroupCOO:
        """A BlockGroupCOO of arrays already consistent with each other, not checked: for builders whose arrays are
        right by construction (:meth:`from_block_mask` with a capacity, :meth:`with_values`,
        ``jinsum.shard.partition``'s stacked parts).

        Args:
          Ai, Ak, Av, transposed, overflow: as the attributes.
          shape: the logical ``(M, K)``.
          block_shape: ``(bm, bk)``, given rather than read off ``Av``: stacked parts have a leading axis first.
          nnz: stored blocks excluding padding.
        """
        matrix = object.__new__(cls)
        matrix._set(Ai, Ak, Av, transposed, overflow, shape, block_shape, nnz)
        return matrix

    def _set(self, Ai, Ak, Av, transposed, overflow, shape, block_shape, nnz) -> None:
        self.Ai, self.Ak, self.Av, self.transposed, self.overflow = Ai, Ak, Av, transposed, overflow
        self._shape, self._block_shape, self._nnz = shape, block_shape, nnz

    # -- pytree ------------------------------------------------------------------------------------------

    def tree_flatten(self):
        return (self.Ai, self.Ak, self.Av, self.transposed, self.overflow), (self._shape, self._block_shape, self._nnz)

    # -- properties --------------------------------------------------------------------------------------

    @property
    def block_shape(self) -> tuple[int, int]:
        """``(bm, bk)``."""
        return self._block_shape

    @property
    def num_block_rows(self) -> int:
        """``ceil(M / bm)``."""
        return block_grid(self._shape, self._block_shape)[0]

    def __repr__(self) -> str:
        # Only static information, so it also works on tracers.
        (m, k), (bm, bk) = self._shape, self._block_shape
        transposed = ", transposed" if self.transposed is not None else ""
        return (
            f"{_FMT}({jnp.dtype(self.dtype).name}[{m}, {k}], blocks={bm} x {bk}, nnz={self._nnz} blocks, "
            f"groups={self.num_groups} x {self.group_size}{transposed})"
        )

    # -- construction from other formats (host side, NumPy) ----------------------------------------------

    @classmethod
    def _from_blocks(cls, shape, block_shape, indptr, indices, blocks, group_size, dtype) -> BlockGroupCOO:
        # Default 1: a padding slot costs a whole zero block, and with one block per group the kernels read each
        # block contiguously (block SpMM about twice as fast as with 4 blocks per group: benchmarks/README.md,
        # "Results: NVIDIA H100 80GB HBM3 (jax 0.11.2, triton 3.6.0, jax-triton 0.3.1, torch 2.11)").
        group_size = check_group_size(_FMT, 1 if group_size is None else group_size, np.diff(indptr))
        Ai, Ak, Av = groups_from_csr(indptr, indices, blocks, group_size, dtype, block_grid(shape, block_shape)[1])
        # groups_from_csr lays slots out as (G, P, bm, bk); the format keeps the slot axis last.
        return cls(Ai, Ak, np.moveaxis(Av, 1, -1), shape, nnz=len(indices))

    @classmethod
    def from_scipy(cls, mat, *, block_shape, group_size: int | None = None, dtype=None) -> BlockGroupCOO:
        """Converts any ``scipy.sparse`` matrix or array.

        A block is stored iff it contains a stored entry of ``mat`` (explicit zeros included; duplicates are
        summed). A BSR matrix whose ``blocksize`` equals ``block_shape`` contributes its blocks as they are.
        ``group_size`` defaults to 1 (one block per group); ``dtype`` to the
        matrix's dtype when floating, else float32.
        """
        block_shape = check_block_shape(_FMT, block_shape)
        indptr, indices, blocks = blocks_from_scipy(_FMT, mat, block_shape)
        dtype = value_dtype(f"{_FMT}.from_scipy", blocks.dtype, dtype)
        return cls._from_blocks(mat.shape, block_shape, indptr, indices, blocks, group_size, dtype)

    @classmethod
    def from_block_mask(cls, block_mask, *, block_shape, shape=None, capacity: int | None = None,
                        group_size: int | None = None, dtype=jnp.float32) -> BlockGroupCOO:
        """The block pattern of a mask over the block grid: an all-ones ``bm x bk`` block wherever ``block_mask``
        is nonzero (e.g. attention's (query block, key block) pairs that attend), on the host or inside ``jit``.

        Args:
          block_mask: ``(Mb, Kb)``, nonzero where a block is stored.
          block_shape: ``(bm, bk)``.
          shape: the logical ``(M, K)``; defaults to ``(Mb * bm, Kb * bk)``.
          capacity: None builds on the host from a concrete mask (exact sizes). An int ``C`` builds with
            `jax.numpy` from a concrete or traced mask: at most ``C`` blocks, shapes that depend only on ``C``, the
            blocks in column order (`transposed`) and an ``overflow`` flag. More nonzero blocks than ``C`` never go
            silently missing: with a concrete mask that is a ``ValueError`` naming the capacity needed; traced
            (inside ``jit``), the first ``C`` in row-major order are kept and ``overflow`` is True (a `checkify`
            error under ``jinsum.check_indices``), and ``jinsum.einsum``, ``@`` or ``jinsum.attention`` called
            outside ``jit`` refuse such a format.
          group_size: blocks per group; defaults to 1 (a padding slot costs a whole zero block).
          dtype: of the blocks.
        """
        where = f"{_FMT}.from_block_mask"
        block_shape = check_block_shape(_FMT, block_shape)
        if jnp.ndim(block_mask) != 2:
            raise ValueError(f"{where}: block_mask must be 2-D (block rows, block columns), got shape "
                             f"{jnp.shape(block_mask)}")
        grid = tuple(jnp.shape(block_mask))
        shape = check_shape(_FMT, "shape", (grid[0] * block_shape[0], grid[1] * block_shape[1]) if shape is None
                            else shape, ndim=2)
        if block_grid(shape, block_shape) != grid:
            raise ValueError(f"{where}: block_mask has shape {grid}, but shape {shape} in blocks {block_shape} is a "
                             f"grid of {block_grid(shape, block_shape)}")
        group_size = 1 if group_size is None else check_int(where, "group_size", group_size, minimum=1)
        if capacity is None:
            rows, cols = np.nonzero(host_array(where, block_mask))
            indptr = np.searchsorted(rows, np.arange(grid[0] + 1))
            blocks = np.ones((rows.size, *block_shape), dtype)
            return cls._from_blocks(shape, block_shape, indptr, cols, blocks, group_size, dtype)
        capacity = check_int(where, "capacity", capacity)
        Ai, Ak, Av, transposed, stored = _device_blocks(as_jax_array(block_mask), capacity=capacity,
                                                        group_size=group_size, dtype=dtype, block_shape=block_shape)
        overflow = capacity_overflow(
            stored, capacity, eager=lambda needed: f"{where}: {needed} blocks are stored but capacity = {capacity} "
            f"holds only {capacity}; pass capacity >= {needed} (or None to build on the host)",
            traced=f"{where}: more stored blocks than capacity = {capacity}; those past it were not kept (raise the "
            "capacity)")
        return cls.from_validated(Ai=Ai, Ak=Ak, Av=Av, shape=shape, block_shape=block_shape, nnz=capacity,
                                  transposed=transposed, overflow=overflow)

    @classmethod
    def from_dense(cls, x, *, block_shape, group_size: int | None = None, dtype=None) -> BlockGroupCOO:
        """Converts a dense 2-D NumPy or concrete JAX array; a block is stored iff it holds a nonzero."""
        if np.ndim(x) != 2:
            raise ValueError(f"{_FMT}.from_dense: expected a 2-D array (M, K), got shape {np.shape(x)}")
        block_shape, shape = check_block_shape(_FMT, block_shape), np.shape(x)
        blocks = blocks_from_csr(*csr_from_dense(_FMT, x), shape, block_shape)
        dtype = value_dtype(f"{_FMT}.from_dense", blocks[2].dtype, dtype)
        return cls._from_blocks(shape, block_shape, *blocks, group_size, dtype)

    @classmethod
    def from_bcoo(cls, mat, *, block_shape, group_size: int | None = None, dtype=None) -> BlockGroupCOO:
        """Converts a concrete 2-D ``jax.experimental.sparse.BCOO`` (no batch or dense dimensions).

        A block is stored iff it holds a stored entry; duplicates are summed, out-of-bounds padding dropped.
        """
        block_shape = check_block_shape(_FMT, block_shape)
        shape, *csr = csr_from_bcoo(_FMT, mat)
        if mat.n_dense:
            raise ValueError(
                f"{_FMT}.from_bcoo: blocks hold scalars, so the BCOO must have no dense dimensions, got shape "
                f"{mat.shape} with n_dense={mat.n_dense}; use GroupCOO.from_bcoo for dense dimensions"
            )
        blocks = blocks_from_csr(*csr, shape, block_shape)
        dtype = value_dtype(f"{_FMT}.from_bcoo", blocks[2].dtype, dtype)
        return cls._from_blocks(shape, block_shape, *blocks, group_size, dtype)

    # -- export ------------------------------------------------------------------------------------------

    def todense(self) -> jax.Array:
        """The dense ``(M, K)`` array (edge blocks cropped). Traceable and differentiable w.r.t. ``Av``."""
        return _dense(self.Ai, self.Ak, self.Av, self._shape, self._block_shape)

    def to_bcoo(self) -> jsparse.BCOO:
        """An element-level ``BCOO`` with all ``G * bm * bk * P`` slot elements, padding included.

        Padding blocks are zero-valued (so the matrix is equal, but ``unique_indices=False``); elements of edge
        blocks beyond the logical shape get out-of-bounds indices, which BCOO treats as padding. Traceable.
        """
        rows, cols = _element_coords(jnp, self.Ai, self.Ak, self._block_shape)
        indices = jnp.stack([rows.ravel(), cols.ravel()], axis=-1)
        return jsparse.BCOO((self.Av.ravel(), indices), shape=self._shape)

    def to_scipy(self):
        """A ``scipy.sparse.csr_matrix`` of the logical shape (host side; needs concrete arrays).

        CSR rather than BSR because BSR needs a shape that is a multiple of the block shape. Duplicates are
        summed and zero-valued entries dropped (padding, explicit zeros, and the zeros inside stored blocks).
        float16 and bfloat16 become float32.
        """
        where = f"{_FMT}.to_scipy"
        Ai, Ak = host_array(where, self.Ai), host_array(where, self.Ak)
        rows, cols = _element_coords(np, Ai, Ak, self._block_shape)
        inside = (rows < self._shape[0]) & (cols < self._shape[1])
        return to_scipy_csr(rows[inside], cols[inside], host_array(where, self.Av)[inside], self._shape)

    def astype(self, dtype) -> BlockGroupCOO:
        """The same matrix with its blocks cast to the floating ``dtype``. A cast keeps zeros zero, so the
        transposed index stays."""
        Av = self.Av.astype(dtype)
        check_floating(_FMT, Av)
        return self._replace(Av=Av)

    def with_values(self, Av) -> BlockGroupCOO:
        """The same block structure with new blocks ``Av`` of shape ``(G, bm, bk, P)``, any floating dtype.

        Only shapes are checked, so this is cheap and works under ``jit``. The transposed index stays: it lists the
        blocks that were stored (nonzero) when it was built, so blocks outside it must stay zero, as group padding.
        """
        Av = as_jax_array(Av)
        _check_values(Av, self.Ak.shape, self._block_shape)
        return self._replace(Av=Av)

    def with_transpose(self) -> BlockGroupCOO:
        """The same matrix carrying a :class:`TransposedIndex` of its nonzero blocks in block-column order, built
        here on the host (call it outside ``jit``, once per matrix): the gradient of ``A @ B`` with respect to
        ``B`` then runs as the forward block SpMM over the transpose (each block row of ``dB`` owned by one
        program, no atomics) instead of adding every block's product atomically."""
        where = f"{_FMT}.with_transpose"
        nonzero = (host_array(where, self.Av) != 0).any(axis=(1, 2)).reshape(-1)
        transposed = transposed_index(where, self.Ai, self.Ak, nonzero, block_grid(self._shape, self._block_shape),
                                      self.index_dtype)
        return self._replace(transposed=transposed)

