"""A `GroupCOO` split by output rows into one part per device of a mesh axis, and the plan of its halo exchange.

Every part holds about the same number of stored entries plus rows (the work of an SpMM over the part: one
gathered row of the dense operand per entry, one written row per row): either contiguous ranges of rows, or rows
dealt out by length (`split`). Node features follow the same split: the rows a device owns lie, in order, in its
block of `R = rows_per_part` rows of a `(D * R, ...)` array sharded along the axis (`shard_rows`), the tail of
each block zero padding.

Each part is stored as two matrices over the part's rows: `local`, whose columns are the device's own rows, and
`remote`, whose columns are the rows it receives from the others before each product, so that the product of the
local matrix can run while the rows are in flight. The rows travel one of two ways (`HaloPlan.exchange`):
- `"halo"`: at shift `k = 1 .. D-1` every device `s` sends device `(s + k) % D` exactly the rows that device reads
  from it (a `ppermute`); the remote columns index the received rows, shift after shift.
- `"all_gather"`: every device receives every block (an `all_gather`); the remote columns index that.
`partition` picks the one that moves fewer rows, unless told.

The halo exchange's rows move in pieces, each with a remote matrix of its own (`remote[m]`, its columns the rows
of piece `m`): shift after shift, each shift's rows cut into `chunks` pieces. A piece's product runs as soon as its
rows are in, while the next piece moves: with `D - 1` shifts the remote products (most of the work on 4 devices)
overlap the exchange too, not only the local one, and no piece is copied into one buffer of all received rows.
A piece's rows leave only once the product of the piece before last has run, so at most three pieces' buffers are
alive at once (sent and received rows: `3 / (2 * chunks)` of an exchange in one piece, on two devices).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import operator
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jinsum.formats import BlockGroupCOO, GroupCOO
from jinsum.formats._build import host_argsort, transposed_from_slots
from jinsum.formats._convert import check_int, check_not_overflowed, default_group_size, groups_from_csr, host_array
from jinsum.formats._group_coo import TransposedIndex

EXCHANGES = ("auto", "halo", "all_gather")
SPLITS = ("auto", "contiguous", "dealt")


@dataclasses.dataclass(frozen=True)
class HaloPlan:
    """How each device gets the rows of the dense operand its part reads from other devices (static, hashable).

    Attributes:
      exchange: `"halo"` (a `ppermute` per piece of only the rows read) or `"all_gather"` (every row).
      shift_rows: for `"halo"`, the rows sent at shift `k = 1 .. D-1` (each device's count padded to the largest).
      needed: for each device, the distinct rows of other devices its part reads (unpadded).
      rows_per_part: `R`, the rows of each device's block.
      chunks: for `"halo"`, the pieces each shift's rows move in (module docstring); 1 for `"all_gather"`.
    """

    exchange: str
    shift_rows: tuple[int, ...]
    needed: tuple[int, ...]
    rows_per_part: int
    chunks: int = 1

    @property
    def received_rows(self) -> int:
        """Rows each device receives per exchange, padding included (`"all_gather"`: the other `D - 1` blocks)."""
        if self.exchange == "halo":
            return sum(self.shift_rows)
        return len(self.needed) * self.rows_per_part - self.rows_per_part

    @property
    def pieces(self) -> tuple[tuple[int, int, int], ...]:
        """For `"halo"`, the pieces the rows move in, one per remote matrix: `(k, start, count)`, the rows of shift
        `k` at `start:start + count` of those sent (`Partitioned.send`: shift after shift, each shift's rows cut into
        `chunks` near-equal pieces)."""
        pieces, first = [], 0
        for k, rows in enumerate(self.shift_rows, start=1):
            cuts = [first + rows * c // self.chunks for c in range(self.chunks + 1)]
            pieces += [(k, lo, hi - lo) for lo, hi in zip(cuts[:-1], cuts[1:])]
            first += rows
        return tuple(pieces)

    @property
    def columns(self) -> tuple[int, ...]:
        """The columns of each remote matrix: the rows of its piece (`"all_gather"`: one matrix, all `D` blocks)."""
        if self.exchange == "all_gather":
            return (len(self.needed) * self.rows_per_part,)
        return tuple(count for _, _, count in self.pieces)

    def received_at(self) -> tuple[np.ndarray, np.ndarray]:
        """For each row received by the halo exchange, in the order sent (`Partitioned.send`), its piece (remote
        matrix) and its position among that piece's rows."""
        piece = np.empty(self.received_rows, np.int32)
        column = np.empty(self.received_rows, np.int64)
        for m, (_, start, count) in enumerate(self.pieces):
            piece[start:start + count] = m
            column[start:start + count] = np.arange(count)
        return piece, column


class Layout:
    """Which device owns each row (block of `block` rows, for a block format), and where (static: compared and
    hashed by identity, as it holds arrays).

    Block `b` lives on device `owner[b]` as its `local[b]`-th of `rows_per_part` blocks; a device's blocks keep
    their order (`local` increases with `b` on each device). Row `n` of a row-sharded `(D * R * block, ...)` array
    is then at `(owner[b] * R + local[b]) * block + n % block`, `b = n // block`.
    """

    __slots__ = ("owner", "local", "rows_per_part", "split", "block", "num_rows")

    def __init__(self, owner: np.ndarray, parts: int, split: str, block: int, num_rows: int):
        self.owner, self.split, self.local = owner, split, _ranks(owner, parts)
        self.rows_per_part = max(1, int(np.bincount(owner, minlength=parts).max()))
        self.block, self.num_rows = block, num_rows

    def rows_per_device(self, parts: int) -> list[int]:
        """The rows each device owns (blocks times their rows, the last block's padding included)."""
        return (np.bincount(self.owner, minlength=parts) * self.block).tolist()

    def positions(self) -> np.ndarray:
        """int `(N,)`: each row's position in the sharded `(D * R * block, ...)` arrays."""
        rows = np.arange(self.num_rows)
        blocks = rows // self.block
        return (self.owner[blocks].astype(np.int64) * self.rows_per_part + self.local[blocks]) * self.block + \
            rows % self.block


def _ranks(owner: np.ndarray, parts: int) -> np.ndarray:
    """Each row's rank among the rows of its device, in row order."""
    order = np.argsort(owner, kind="stable")
    counts = np.bincount(owner, minlength=parts)
    ranks = np.empty(owner.size, np.int32 if owner.size < np.iinfo(np.int32).max else np.int64)
    ranks[order] = np.arange(owner.size) - np.repeat(np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    return ranks


@jax.tree_util.register_pytree_node_class
class Partitioned:
    """A square sparse matrix split by rows over a mesh axis; build it with :func:`partition`.

    A pytree whose arrays all have a leading axis of one part per device (`local` is a `GroupCOO`, or a
    `BlockGroupCOO`, of stacked arrays, padded to equal shapes; `remote` a tuple of such, one per piece of the
    exchange; `send` holds, for the `"halo"` exchange, the local rows each device sends at each shift), so it is
    placed with `NamedSharding(mesh, P(axis))` and passes through `jit` and `grad`.
    Static: the mesh, the axis, the logical `shape`, the `Layout` and the `HaloPlan`.
    """

    __slots__ = ("local", "remote", "send", "mesh", "axis", "shape", "layout", "plan")

    def __init__(self, local: GroupCOO, remote: tuple[GroupCOO, ...], send, mesh: Mesh, axis: str,
                 shape: tuple[int, ...], layout: Layout, plan: HaloPlan):
        self.local, self.remote, self.send = local, remote, send
        self.mesh, self.axis, self.shape, self.layout, self.plan = mesh, axis, shape, layout, plan

    def tree_flatten(self):
        return (self.local, self.remote, self.send), (self.mesh, self.axis, self.shape, self.layout, self.plan)

    def __matmul__(self, x):
        """`A @ x` for row-sharded `x`: `jinsum.shard.matmul(A, x)`."""
        from jinsum.shard._ops import matmul  # noqa: PLC0415 (the products import this module)
        return matmul(self, x)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    @property
    def dtype(self):
        return self.local.dtype

    @property
    def dense_shape(self) -> tuple[int, ...]:
        return self.shape[2:]

    @property
    def num_parts(self) -> int:
        return self.mesh.shape[self.axis]

    @property
    def format(self) -> type:
        """`GroupCOO` or `BlockGroupCOO`: what each device's parts are."""
        return type(self.local)

    @property
    def padded_rows(self) -> int:
        """The rows of a row-sharded array laid out by the partition: `D * R` (times the block rows)."""
        return self.num_parts * self.layout.rows_per_part * self.layout.block

    @property
    def sharding(self) -> NamedSharding:
        """Where row-sharded arrays (node features, the parts) live: `NamedSharding(mesh, P(axis))`."""
        return NamedSharding(self.mesh, PartitionSpec(self.axis))

    def __repr__(self) -> str:
        dims = ", ".join(map(str, self.shape))
        return (f"Partitioned({jnp.dtype(self.dtype).name}[{dims}], {self.num_parts} parts of "
                f"{self.layout.rows_per_part} rows over axis {self.axis!r}, split={self.layout.split!r}, "
                f"exchange={self.plan.exchange!r}, "
                f"{'' if self.plan.chunks == 1 else f'in {self.plan.chunks} chunks, '}"
                f"{'' if self.layout.block == 1 else f'blocks of {self.layout.block} rows, '}"
                f"{self.plan.received_rows} rows received per device)")

    def astype(self, dtype) -> Partitioned:
        """The same partition with its values cast to the floating `dtype`."""
        return self.with_parts(self.local.astype(dtype), tuple(part.astype(dtype) for part in self.remote))

    def with_parts(self, local: GroupCOO, remote: tuple[GroupCOO, ...]) -> Partitioned:
        """The same partition over new stacked parts (the remote ones, one per piece of the exchange)."""
        return Partitioned(local, remote, self.send, self.mesh, self.axis, self.shape, self.layout,
                                   self.plan)

    def with_values(self, local_values, remote_values: tuple) -> Partitioned:
        """The same structure with new stacked values of the local and remote parts, `(D, *part.Av.shape)` (the
        remote ones a tuple, one per piece; a `GroupCOO`'s dense dimensions may change: the scores of an SDDMM, per
        head); like the formats' `with_values`, it drops the entries in column order."""
        remote_values = tuple(remote_values)
        if len(remote_values) != len(self.remote):
            raise ValueError(f"Partitioned.with_values: expected one values array per remote matrix (one per piece of "
                             f"the exchange: {len(self.remote)}), got {len(remote_values)}")
        shape = (*self.shape[:2], *local_values.shape[3:]) if self.format is GroupCOO else self.shape
        remote = tuple(_with_stacked_values(part, values) for part, values in zip(self.remote, remote_values))
        return Partitioned(_with_stacked_values(self.local, local_values), remote, self.send, self.mesh, self.axis,
                           shape, self.layout, self.plan)

    # -- node features in the partition's layout --------------------------------------------------------------

    def shard_rows(self, x) -> jax.Array:
        """`x` `(N, ...)` laid out as the partition's rows, `(D * R, ...)` (zeros in each block's padding), placed
        row-sharded on the mesh. Host arrays are placed directly; inside `jit` it is a scatter and a sharding
        constraint."""
        x = jnp.asarray(x) if isinstance(x, jax.core.Tracer) else np.asarray(x)
        if x.ndim < 1 or x.shape[0] != self.shape[0]:
            raise ValueError(f"Partitioned.shard_rows: expected an array of {self.shape[0]} rows (one per "
                             f"row of the matrix), got shape {tuple(x.shape)}")
        size = self.padded_rows
        if isinstance(x, np.ndarray):
            out = np.zeros((size, *x.shape[1:]), x.dtype)
            out[self.layout.positions()] = x
            return jax.device_put(out, self.sharding)
        out = jnp.zeros((size, *x.shape[1:]), x.dtype).at[self.layout.positions()].set(x)
        return jax.lax.with_sharding_constraint(out, self.sharding)

    def unshard_rows(self, y) -> jax.Array:
        """The inverse of `shard_rows`: `(N, ...)` in the matrix's row order from `(D * R, ...)`."""
        if y.ndim < 1 or y.shape[0] != self.padded_rows:
            raise ValueError(f"Partitioned.unshard_rows: expected the partition's {self.padded_rows} rows, got shape "
                             f"{tuple(y.shape)}")
        if not isinstance(y, jax.core.Tracer):
            return jnp.asarray(np.asarray(y)[self.layout.positions()])
        # On a mesh of explicit axes, the gathered rows' sharding must be named: replicated.
        return y.at[self.layout.positions()].get(out_sharding=NamedSharding(self.mesh, PartitionSpec()))

    @property
    def row_mask(self) -> jax.Array:
        """bool `(D * R,)`, row-sharded: True at the positions of real rows, False at padding (for losses)."""
        return self.shard_rows(np.ones(self.shape[0], bool))


def _with_stacked_values(part: GroupCOO | BlockGroupCOO, values) -> GroupCOO | BlockGroupCOO:
    """A stacked part (arrays with a leading axis of parts) with new stacked values and no entries in column order
    (`Partitioned.with_values`)."""
    kept = 3 if isinstance(part, GroupCOO) else values.ndim  # (dimensions that must stay)
    if values.shape[:kept] != part.Av.shape[:kept]:
        raise ValueError(f"Partitioned.with_values: expected values of shape {part.Av.shape[:kept]}, then "
                         f"any dense dimensions, got {tuple(values.shape)}")
    if isinstance(part, GroupCOO):
        return GroupCOO.from_validated(Ai=part.Ai, Ak=part.Ak, Av=values, shape=(*part.shape[:2], *values.shape[3:]),
                                       nnz=part.nnz)
    return BlockGroupCOO.from_validated(Ai=part.Ai, Ak=part.Ak, Av=values, shape=part.shape,
                                        block_shape=part.block_shape, nnz=part.nnz)


def partition(A: GroupCOO | BlockGroupCOO, mesh: Mesh, axis: str | None = None, *, split: str = "auto",
              exchange: str = "auto", chunks: int = 1) -> Partitioned:
    """Splits a square `GroupCOO` (`BlockGroupCOO`) by rows (block rows) into one part per device along `axis` of
    `mesh`, on the host.

    Call it once, outside `jit`, like building the matrix itself; lay node features out with
    `shard_rows` and read results back with `unshard_rows`. In a program of several processes (hosts), each
    process builds only the parts of its own devices.

    Args:
      A: a concrete square `GroupCOO` `(N, N, *dense_shape)` (an adjacency: rows and columns are the same nodes,
        so one split serves both), or a `BlockGroupCOO` of square blocks (split by block rows; the dense operands
        then move in blocks of rows). Zero-valued slots (group padding) are left out.
      mesh: the `jax.sharding.Mesh`.
      axis: the mesh axis to split over; may be omitted for a mesh of one axis.
      split: `"contiguous"`: ranges of rows of about equal entries + rows (keeps the locality of a well-ordered
        graph: fewer rows to exchange); `"dealt"`: rows sorted by length dealt out in turn (equal rows and
        entries whatever the order: a power-law graph's hubs are spread); `"auto"`: the one whose devices hold
        fewer rows, own and received.
      exchange: `"halo"`, `"all_gather"`, or `"auto"`: the one that moves fewer rows per product.
      chunks: cut each shift's rows of the halo exchange into this many pieces (module docstring): less memory
        for the rows in flight, for less overlap of the exchange with the products (the most on more than two
        devices, where each shift is a piece already; measured in DESIGN.md, "Several devices"). Needs the halo
        exchange (`"auto"` then picks it).

    Returns:
      A `Partitioned`, its arrays placed row-sharded on the mesh (`A.sharding`).

    Example:
      >>> mesh = jax.make_mesh((jax.device_count(),), ("x",))
      >>> A = jinsum.graphs.adjacency(np.array([[0, 1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 0]]), 8)
      >>> P = jinsum.shard.partition(A, mesh)
      >>> x = jnp.arange(32.0).reshape(8, 4)
      >>> y = P.unshard_rows(P @ P.shard_rows(x))
      >>> bool(jnp.array_equal(y, A @ x))
      True
    """
    chunks = _check_arguments(A, split, exchange, chunks)
    axis = _mesh_axis(mesh, axis)
    parts = mesh.shape[axis]
    entries = _entries(A)
    chosen = _chosen_split(A, entries, parts, split, exchange, chunks)
    # Every part's entries are located (cheap: the sizes all parts are padded to come from them); the parts this
    # process's devices hold are built (the sort, the groups and the transposed indices).
    here = _parts_here(mesh, axis)
    local, *remote = _stacked_matrices(A, chosen.plan, _entries_by_matrix(entries, chosen, here))
    arrays = (local, tuple(remote), _send_indices(chosen, here))
    sharding = NamedSharding(mesh, PartitionSpec(axis))
    return Partitioned(*_placed(arrays, here, parts, sharding), mesh, axis, A.shape, chosen.layout, chosen.plan)


# -- the arguments -------------------------------------------------------------------------------------------------

def _check_arguments(A, split: str, exchange: str, chunks) -> int:
    """`partition`'s arguments, before any work; returns `chunks` as a Python int."""
    where = "jinsum.shard.partition"
    if not isinstance(A, (GroupCOO, BlockGroupCOO)):
        raise TypeError(f"{where}: expected a jinsum.GroupCOO or BlockGroupCOO, got {A!r}")
    check_not_overflowed(where, A)  # (its parts would carry no flag: products over them would miss the entries)
    if A.shape[0] != A.shape[1]:
        raise ValueError(f"{where}: expected a square matrix (rows and columns the same nodes, split alike), got "
                         f"shape {A.shape}")
    if isinstance(A, BlockGroupCOO) and A.block_shape[0] != A.block_shape[1]:
        raise ValueError(f"{where}: expected square blocks (block rows and block columns split alike), got "
                         f"block_shape {A.block_shape}")
    if exchange not in EXCHANGES:
        raise ValueError(f"{where}: exchange must be one of {EXCHANGES}, got {exchange!r}")
    if split not in SPLITS:
        raise ValueError(f"{where}: split must be one of {SPLITS}, got {split!r}")
    chunks = check_int(where, "chunks", chunks, minimum=1)
    if chunks > 1 and exchange == "all_gather":
        raise ValueError(f"{where}: chunks={chunks} cuts the halo exchange's rows; the all_gather exchange moves "
                         "whole blocks. Use exchange='halo' (or 'auto'), or chunks=1")
    return chunks


def _mesh_axis(mesh, axis) -> str:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"jinsum.shard.partition: expected a jax.sharding.Mesh, got {mesh!r}; make one with "
                        "jax.make_mesh((jax.device_count(),), ('x',))")
    if axis is None:
        if len(mesh.axis_names) != 1:
            raise ValueError(f"jinsum.shard.partition: the mesh has axes {mesh.axis_names}; name the one to split "
                             "the rows over with axis=...")
        return mesh.axis_names[0]
    if axis not in mesh.axis_names:
        raise ValueError(f"jinsum.shard.partition: axis {axis!r} is not an axis of the mesh {mesh.axis_names}")
    return axis


def _parts_here(mesh: Mesh, axis: str) -> list[int]:
    """The parts (positions along `axis`) that this process's devices hold: the only ones it builds."""
    position = mesh.axis_names.index(axis)
    coordinate = {device.id: index[position] for index, device in np.ndenumerate(mesh.devices)}
    return sorted({coordinate[device.id] for device in mesh.local_devices})


class _Entries(NamedTuple):
    """Stored entries (blocks) in row order: rows, columns (block rows and columns for a block format), values
    (`(n, *dense_shape)`; `(n, bm, bk)` blocks)."""

    rows: np.ndarray
    cols: np.ndarray
    values: np.ndarray


def _entries(A: GroupCOO | BlockGroupCOO) -> _Entries:
    """The stored entries (blocks) of `A` whose value is nonzero, indices in the format's index dtype."""
    where = "jinsum.shard.partition"
    Ai, Ak, Av = (host_array(where, x) for x in (A.Ai, A.Ak, A.Av))
    if isinstance(A, BlockGroupCOO):  # (G, bm, bk, P) -> one (bm, bk) block per slot
        values = np.moveaxis(Av, 3, 1).reshape(Ak.size, *A.block_shape)
    else:
        values = Av.reshape(Ak.size, *A.dense_shape)
    keep = values.reshape(Ak.size, -1).any(axis=1) if Ak.size else np.zeros(0, bool)
    return _Entries(np.repeat(Ai, Ak.shape[1])[keep], Ak.reshape(-1)[keep], values[keep])


# -- the split: owners, layout, halo plan --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Split:
    """One way to split the rows: where each row lives, how the rows read from other devices move, `needed[d][s]`
    (the distinct rows of device `s` that part `d` reads, sorted; None for `s == d`) and `members[d]` (part `d`'s
    entries, in row order)."""

    layout: Layout
    plan: HaloPlan
    needed: list
    members: list

    @property
    def rows_held(self) -> int:
        """The rows each device holds, its own and those it receives: what `"auto"` splits minimise."""
        return self.layout.rows_per_part + self.plan.received_rows


def _chosen_split(A: GroupCOO | BlockGroupCOO, entries: _Entries, parts: int, split: str, exchange: str,
                  chunks: int) -> _Split:
    """The split asked for; for `"auto"`, of contiguous and dealt rows the one whose devices hold fewer rows."""
    block = A.block_shape[0] if isinstance(A, BlockGroupCOO) else 1
    lengths = np.bincount(entries.rows, minlength=-(-A.shape[0] // block))
    names = ("contiguous", "dealt") if split == "auto" else (split,)
    layouts = [Layout(_owners(lengths, parts, name), parts, name, block, A.shape[0]) for name in names]
    return min((_split_over(entries, layout, parts, exchange, chunks) for layout in layouts),
               key=operator.attrgetter("rows_held"))


def _owners(row_lengths: np.ndarray, parts: int, split: str) -> np.ndarray:
    """The device of each row: contiguous ranges of about equal `entries + rows`, or the rows dealt out."""
    if split == "contiguous":
        cost = np.cumsum(row_lengths.astype(np.int64) + 1)
        cuts = np.searchsorted(cost, (cost[-1] if cost.size else 0) * np.arange(1, parts) / parts, side="left")
        return np.searchsorted(cuts, np.arange(row_lengths.size), side="right").astype(np.int32)
    # Longest rows first, dealt 0, 1, ..., D-1, D-1, ..., 0, 0, 1, ...: equal rows (+-1) and near-equal entries.
    order = np.argsort(-row_lengths, kind="stable")
    turn = np.arange(row_lengths.size) % (2 * parts)
    owner = np.empty(row_lengths.size, np.int32)
    owner[order] = np.where(turn < parts, turn, 2 * parts - 1 - turn)
    return owner


def _split_over(entries: _Entries, layout: Layout, parts: int, exchange: str, chunks: int) -> _Split:
    """The split of `layout`: each part's entries, the rows it reads from the other devices, and the plan of moving
    them."""
    part_of_entry = layout.owner[entries.rows]
    members = _on_threads(functools.partial(_entries_of_part, part_of_entry), range(parts))
    needed = _rows_read(entries.cols, members, layout.owner, parts)
    return _Split(layout, _halo_plan(needed, layout.rows_per_part, exchange, chunks), needed, members)


def _entries_of_part(part_of_entry: np.ndarray, d: int) -> np.ndarray:
    """The entries of part `d`, in row order (a pass per part, not a sort)."""
    return np.flatnonzero(part_of_entry == d)


def _rows_read(cols: np.ndarray, members: list, owner: np.ndarray, parts: int) -> list:
    """`needed[d][s]`: the distinct rows of device `s` that part `d` reads, sorted (None for `s == d`)."""
    # seen[d][s, n]: part d reads row n of device s. A mask, not a sort; the slices of a part set their flags in one
    # mask at once (every write stores True).
    seen = [np.zeros((parts, owner.size), bool) for _ in range(parts)]
    _on_threads(functools.partial(_mark_read, seen, members, cols, owner), _slices(members))
    return [[np.flatnonzero(seen[d][s]) if s != d else None for s in range(parts)] for d in range(parts)]


def _mark_read(seen: list, members: list, cols: np.ndarray, owner: np.ndarray, job: tuple[int, int, int]) -> None:
    """Flags in `seen[d]` the rows that entries `lo:hi` of part `d` read (`job = (d, lo, hi)`)."""
    d, lo, hi = job
    read = cols[members[d][lo:hi]]
    seen[d][owner[read], read] = True


def _halo_plan(needed: list, rows_per_part: int, exchange: str, chunks: int) -> HaloPlan:
    """The plan of moving the rows each part reads from other devices (`needed`); `"auto"` picks the halo exchange
    when it moves fewer rows than gathering every block, or when asked for chunks."""
    parts = len(needed)
    shift_rows = tuple(max(needed[d][(d - k) % parts].size for d in range(parts)) for k in range(1, parts))
    counts = tuple(sum(n.size for n in row if n is not None) for row in needed)
    if exchange == "auto":
        exchange = "halo" if chunks > 1 or sum(shift_rows) < (parts - 1) * rows_per_part else "all_gather"
    halo = exchange == "halo"
    return HaloPlan(exchange, shift_rows if halo else (), counts, rows_per_part, chunks if halo else 1)


# -- each part's matrices: the local one, then a remote one per piece of the exchange ------------------------------

def _entries_by_matrix(entries: _Entries, split: _Split, here: list[int]) -> list[list[tuple]]:
    """Every part's entries sorted into its matrices: `[m][d]` is part `d`'s `(rows, columns, values)` of matrix `m`
    (0: local, 1 + k: the remote one of piece k), the columns those of the rows the matrix reads; values None unless
    the part is built `here`. Located in slices of each part's entries on threads, then joined."""
    parts, matrices = len(split.members), 1 + len(split.plan.columns)
    receiving = _on_threads(functools.partial(_received_positions, split), range(parts))
    by_piece = split.plan.received_at() if matrices > 2 else None
    slices = _slices(split.members)
    found = _on_threads(functools.partial(_located_slice, entries, split, receiving, by_piece, here), slices)
    joins = [(d, m, k) for d in range(parts) for m in range(matrices) for k in range(3)]
    joined = dict(zip(joins, _on_threads(_joined, [
        [located[m][k] for (part, _, _), located in zip(slices, found) if part == d] for d, m, k in joins])))
    return [[tuple(joined[d, m, k] for k in range(3)) for d in range(parts)] for m in range(matrices)]


def _received_positions(split: _Split, d: int) -> np.ndarray | None:
    """For the halo exchange: each row's position in the rows part `d` receives (-1: not received)."""
    if split.plan.exchange != "halo":
        return None
    parts, offsets = len(split.needed), _shift_offsets(split.plan)
    position = np.full(split.layout.owner.size, -1, np.int64)
    for s in range(parts):
        if s != d:
            needed = split.needed[d][s]
            position[needed] = offsets[(d - s) % parts - 1] + np.arange(needed.size)
    return position


def _located_slice(entries: _Entries, split: _Split, receiving: list, by_piece: tuple | None, here: list[int],
                   job: tuple[int, int, int]) -> list[tuple]:
    """Entries `lo:hi` of part `d` (`job = (d, lo, hi)`) as `(rows, columns, values)` of each of its matrices
    (values None unless the part is built `here`). `receiving[d]`: where the halo exchange puts each row (None: the
    all_gather's blocks); `by_piece`: each received row's piece and position in it (None: one remote matrix)."""
    d, lo, hi = job
    layout = split.layout
    part = split.members[d][lo:hi]
    r, c = layout.local[entries.rows[part]], entries.cols[part]
    owner = layout.owner[c]
    mine = owner == d
    theirs = ~mine
    remote_rows, remote_cols = r[theirs], _remote_columns(layout, receiving[d], owner[theirs], c[theirs])
    selected, positions = [mine, theirs], [(r[mine], layout.local[c[mine]]), (remote_rows, remote_cols)]
    if by_piece is not None:
        selected[1:], positions[1:] = _split_by_piece(by_piece, len(split.plan.columns), theirs, remote_rows,
                                                      remote_cols)
    values = entries.values[part] if d in here else None
    return [(*rc, None if values is None else values[w]) for rc, w in zip(positions, selected)]


def _remote_columns(layout: Layout, received: np.ndarray | None, owners: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """The columns of entries that read other devices' rows `cols` (of devices `owners`) in the rows the exchange
    delivers: the halo's received rows (`received`: each row's position), or every device's block gathered."""
    if received is not None:
        return received[cols]
    return owners.astype(np.int64) * layout.rows_per_part + layout.local[cols]


def _split_by_piece(by_piece: tuple, pieces: int, theirs: np.ndarray, rows: np.ndarray, cols: np.ndarray):
    """A slice's remote entries (`theirs`, with their `rows` and received `cols`) by piece of the exchange: for each
    piece, which of the slice's entries are in it, and their `(rows, columns)`, the columns now among the piece's
    rows."""
    piece_of, column_of = by_piece
    piece, column = piece_of[cols], column_of[cols]
    remote = np.flatnonzero(theirs)
    in_piece = [piece == m for m in range(pieces)]
    return [remote[w] for w in in_piece], [(rows[w], column[w]) for w in in_piece]


def _joined(arrays: list):
    """The arrays of a part's slices as one (no copy for one slice); None if they are None (values not built)."""
    if arrays[0] is None:
        return None
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


# -- the formats: each matrix's parts built, padded to equal shapes and stacked ------------------------------------

def _stacked_matrices(A: GroupCOO | BlockGroupCOO, plan: HaloPlan, by_matrix: list) -> list:
    """Each matrix's parts (`by_matrix[m][d]`, `_entries_by_matrix`) as formats like `A` stacked over the parts
    built here, the matrices built at once on threads."""
    R = plan.rows_per_part
    shapes = [(R, R)] + [(R, max(columns, 1)) for columns in plan.columns]
    return _on_threads(functools.partial(_stacked_matrix, A), shapes, by_matrix)


def _stacked_matrix(A: GroupCOO | BlockGroupCOO, shape: tuple[int, int], everyone: list):
    """One matrix of every part (`everyone[d] = (rows, columns, values)`), over a `shape` grid, stacked over the
    parts whose values were built; the sizes they are padded to come from every part's entries."""
    sizes = _Sizes.of([(rows, cols) for rows, cols, _ in everyone], shape)
    return _stack([part for part in everyone if part[2] is not None], sizes, shape, A)


@dataclasses.dataclass(frozen=True)
class _Sizes:
    """What every part of one kind (local or remote matrices) is padded to, computed from every part's entries, so
    that processes building different parts agree: the group size and the groups of the rows, the group size and
    the groups of the transposed index's columns, and the most entries of a part."""

    group_size: int
    groups: int
    column_group: int
    column_groups: int
    entries: int

    @classmethod
    def of(cls, everyone: list, shape: tuple[int, int]) -> _Sizes:
        """From the `(rows, columns)` of every part's entries, over a `shape` grid (`ceil(L / P)` groups a row)."""
        row_lengths = [np.bincount(r, minlength=shape[0]) for r, _ in everyone]
        column_lengths = [np.bincount(c, minlength=shape[1]) for _, c in everyone]
        group_size = default_group_size(np.concatenate(row_lengths))
        column_group = default_group_size(np.concatenate(column_lengths))
        return cls(group_size, _most_groups(row_lengths, group_size), column_group,
                   _most_groups(column_lengths, column_group), max(r.size for r, _ in everyone))


def _most_groups(lengths: list, group_size: int) -> int:
    """The most groups of `group_size` any part needs for lines (rows or columns) of `lengths[d]` entries."""
    return max(int((-(-length // group_size)).sum()) for length in lengths)


def _stack(parts: list, sizes: _Sizes, shape: tuple[int, int], A: GroupCOO | BlockGroupCOO
           ) -> GroupCOO | BlockGroupCOO:
    """Formats like `A` over a `shape` grid of (block) rows and columns, of the parts' entries `(rows, columns,
    values)`, with their transposed indices, padded to `sizes` (padding groups: last row, column 0, value 0) and
    stacked along a leading axis."""
    rows, cols = shape
    block = isinstance(A, BlockGroupCOO)
    groups, entries, column_groups = (max(1, n) for n in (sizes.groups, sizes.entries, sizes.column_groups))
    Ais, Aks, Avs, indices = zip(*_on_threads(functools.partial(_part_arrays, shape, sizes, block), parts))
    # (every array's copies at once, each on threads over the parts: a matrix's copies are long passes over memory)
    *index, Ai, Ak, Av = _on_threads(_padded_stack, [
        ([t.perm for t in indices], entries, 0, None),
        ([t.starts for t in indices], cols + 1, 0, None),
        ([t.columns for t in indices], column_groups, max(cols - 1, 0), None),
        ([t.rows for t in indices], column_groups, 0, None),
        ([t.slots for t in indices], column_groups, -1, None),
        (Ais, groups, rows - 1, np.int32), (Aks, groups, 0, np.int32), (Avs, groups, 0, None)])
    transposed = TransposedIndex(*index)
    if block:
        (bm, bk) = A.block_shape
        return BlockGroupCOO.from_validated(Ai=Ai, Ak=Ak, Av=Av, shape=(rows * bm, cols * bk),
                                            block_shape=A.block_shape, nnz=sizes.entries, transposed=transposed)
    return GroupCOO.from_validated(Ai=Ai, Ak=Ak, Av=Av, shape=(rows, cols, *A.dense_shape), nnz=sizes.entries,
                                   transposed=transposed)


def _part_arrays(shape: tuple[int, int], sizes: _Sizes, block: bool, part: tuple):
    """One part's `(Ai, Ak, Av, transposed index)` of its entries `(rows, columns, values)`, unpadded."""
    Ai, Ak, Av = _grouped(*part, shape, sizes.group_size, block)
    # (each slot: a value nonzero anywhere in its dense dimensions or block)
    nonzero = (Av != 0).any(axis=(1, 2) if block else tuple(range(2, Av.ndim))).reshape(-1)
    found = transposed_from_slots(np, Ai, Ak, nonzero, num_columns=shape[1], group_size=sizes.column_group,
                                  num_groups=None, index_dtype=np.int32)
    return Ai, Ak, Av, TransposedIndex(*found)


def _grouped(rows, cols, values, shape: tuple[int, int], group_size: int, block: bool):
    """`GroupCOO` (`BlockGroupCOO`, with `block`) arrays of COO entries (duplicates kept: a maximum over them must
    see each), sorted by row, then column."""
    later = rows[1:] > rows[:-1]
    if not (later | ((rows[1:] == rows[:-1]) & (cols[1:] >= cols[:-1]))).all():  # (a part of a graph in
        order = host_argsort(cols, max(shape[1], 1))                             # row-major order keeps it)
        order = order[host_argsort(rows[order], max(shape[0], 1))]
        cols, values = cols[order], values[order]
    indptr = np.zeros(shape[0] + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=shape[0]), out=indptr[1:])
    Ai, Ak, Av = groups_from_csr(indptr, cols, values, group_size, values.dtype, shape[1])
    return Ai, Ak, (np.moveaxis(Av, 1, 3) if block else Av)


def _padded_stack(job: tuple) -> np.ndarray:
    """The parts' arrays padded with `fill` to `size` and stacked (`job = (arrays, size, fill, dtype)`; dtype None:
    the arrays'), each part written once into the result, on threads."""
    arrays, size, fill, dtype = job
    first = np.asarray(arrays[0])
    out = np.empty((len(arrays), size, *first.shape[1:]), dtype or first.dtype)
    _on_threads(functools.partial(_write_padded, out, arrays, fill), range(len(arrays)))
    return out


def _write_padded(out: np.ndarray, arrays: list, fill, d: int) -> None:
    """Part `d`'s array into `out[d]`, the rest of it `fill`."""
    out[d, :len(arrays[d])] = arrays[d]
    out[d, len(arrays[d]):] = fill


# -- what each device sends, and placing the arrays ----------------------------------------------------------------

def _send_indices(split: _Split, here: list[int]) -> np.ndarray:
    """For the halo exchange, the local rows each device `here` sends, shift after shift, each shift's padded to the
    plan's count (a row of zeros for the all_gather exchange)."""
    plan, parts = split.plan, len(split.needed)
    offsets = _shift_offsets(plan)
    send = np.zeros((len(here), max(sum(plan.shift_rows), 1)), np.int32)
    for row, s in zip(send, here):
        for k in range(1, parts if plan.exchange == "halo" else 1):
            rows_sent = split.layout.local[split.needed[(s + k) % parts][s]]
            # Padding repeats the last row sent: the indices stay sorted (a cheaper gather, and its transpose).
            row[offsets[k - 1]:offsets[k]] = rows_sent[-1] if rows_sent.size else 0
            row[offsets[k - 1]:offsets[k - 1] + rows_sent.size] = rows_sent
    return send


def _shift_offsets(plan: HaloPlan) -> np.ndarray:
    """Where each shift's rows start among those sent, and where the last ends."""
    return np.concatenate([[0], np.cumsum(plan.shift_rows)]).astype(np.int64)


def _placed(tree, here: list[int], parts: int, sharding: NamedSharding):
    """Arrays stacked over the parts `here` as global arrays of all `parts` (the leading axis), each process giving
    its own devices their parts."""
    position = {d: k for k, d in enumerate(here)}
    return jax.tree.map(functools.partial(_placed_array, position, parts, sharding), tree)


def _placed_array(position: dict, parts: int, sharding: NamedSharding, stacked) -> jax.Array:
    """One array stacked over this process's parts (`position[d]`: where part `d` is) as a global array."""
    stacked = np.asarray(stacked)
    return jax.make_array_from_callback((parts, *stacked.shape[1:]), sharding,
                                        lambda index: stacked[position[index[0].start or 0]][None])


# -- work on threads -----------------------------------------------------------------------------------------------

def _on_threads(fn, *iterables) -> list:
    """`list(map(fn, *iterables))`, one thread per call (at most one per core): the parts of a partition are
    independent, and NumPy's and SciPy's loops release the GIL."""
    calls = len(iterables[0])
    with concurrent.futures.ThreadPoolExecutor(max(1, min(calls, os.cpu_count() or 1))) as pool:
        return list(pool.map(fn, *iterables))


def _slices(members: list, size: int = 1 << 22) -> list[tuple[int, int, int]]:
    """`(d, lo, hi)`: slices of about `size` of each part's entries (`members[d]`), the units of work shared out on
    threads: a part is a few large passes of gathers that would otherwise keep one core of many busy while the rest
    wait."""
    jobs = []
    for d, entries in enumerate(members):
        n = entries.size
        cuts = np.linspace(0, n, max(1, -(-n // size)) + 1).astype(np.int64).tolist()
        jobs += [(d, lo, hi) for lo, hi in zip(cuts[:-1], cuts[1:])]
    return jobs
