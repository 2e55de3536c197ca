"""Block masks built on the device from a `mask_mod`: which (query block, key block) pairs attend, and how.

`block_mask(mask_mod, L, S, block)` evaluates `mask_mod(b, h, q_idx, kv_idx)` over every `bm x bk` tile (one fused
XLA reduction over broadcast iotas, nothing of size `L x S` kept; `jinsum.sequence_mask`, which knows its rule's
structure, classifies from per-block summaries instead, through the same builder) and classifies each block as
empty, full (every element attends: the kernels read and evaluate nothing) or partial (the kernels evaluate
`mask_mod` in registers). The attending blocks, in row-major order, are packed into `capacity` slots (a running
count and a scatter): shapes depend on `capacity` alone, so new document boundaries in the next batch run the same
compiled program, and more attending blocks than slots never go silently missing: built eagerly (concrete inputs)
that is an error naming the capacity needed; traced (inside `jit`) it raises the `overflow` flag (a `checkify` error
under `jinsum.check_indices`), and an eager `jinsum.attention` refuses a mask whose flag is set. It runs inside
`jit` or on concrete arrays alike: one builder, no host path beside it.

A mask that differs per batch element or per head (`batch=B`, `heads=H`) lays the batch elements and heads along
the block rows, so that one block pattern serves them all: `jinsum.attention` then lays `q`, `k` and `v` out the
same way (the batch along the sequence; heads too when the mask has them) and the kernels see one long sequence
whose blocks never cross from one batch element (head) to another.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jinsum._lang import _elementwise
from jinsum.formats._convert import capacity_overflow, check_int


@jax.tree_util.register_pytree_node_class
class BlockMask:
    """The blocks of an `L x S` attention mask that attend, with one flag each; built by `block_mask`.

    Block rows number `(b * heads + h) * ceil(L / bm) + i` over the batch elements and heads the mask depends on
    (one of each when it depends on neither), block columns `j` over `ceil(S / bk)`.

    Attributes:
      Ai: int32 `(capacity,)` block row of each slot, non-decreasing (padding slots repeat the last row).
      Ak: int32 `(capacity, 1)` block column of each slot.
      flags: int8 `(capacity, 1)`: 2 if every element of the block attends, 1 if some may (`mask_mod` decides),
        0 for a padding slot.
      overflow: bool scalar: more blocks attend than `capacity` holds (those past it were dropped). Only a mask
        built under tracing can have it set (an eager build raises instead); `jinsum.attention` outside `jit`
        refuses such a mask.
      captures: the arrays `mask_mod` closes over (document ids, lengths), kernel operands.
      shape: `(L, S)`; block: `(bm, bk)`; batch, heads: what the mask depends on (None: the same for all).
      mask_mod: the traced `mask_mod`, in the coordinates of the laid-out sequence (`Elementwise`).
      reads: which of `b` and `h` the user's `mask_mod` depends on (`jinsum.attention` refuses a mask that reads one
        it was not built per, for inputs where it takes more than one value).
    """

    __slots__ = ("Ai", "Ak", "flags", "overflow", "captures", "shape", "block", "batch", "heads", "mask_mod", "reads")

    def __init__(self, Ai, Ak, flags, overflow, captures, *, shape, block, batch, heads, mask_mod, reads):
        self.Ai, self.Ak, self.flags, self.overflow, self.captures = Ai, Ak, flags, overflow, tuple(captures)
        self.shape, self.block, self.batch, self.heads, self.mask_mod = shape, block, batch, heads, mask_mod
        self.reads = reads

    def tree_flatten(self):
        return ((self.Ai, self.Ak, self.flags, self.overflow, self.captures),
                (self.shape, self.block, self.batch, self.heads, self.mask_mod, self.reads))

    @classmethod
    def tree_unflatten(cls, aux, children):
        shape, block, batch, heads, mask_mod, reads = aux
        return cls(*children, shape=shape, block=block, batch=batch, heads=heads, mask_mod=mask_mod, reads=reads)

    @property
    def capacity(self) -> int:
        return self.Ai.shape[0]

    @property
    def grid(self) -> tuple[int, int]:
        """Block rows and block columns of one batch element and head: `(ceil(L / bm), ceil(S / bk))`."""
        (length, keys), (bm, bk) = self.shape, self.block
        return -(-length // bm), -(-keys // bk)

    @property
    def laid_out(self) -> bool:
        """The batch elements or heads lie along the block rows (the mask depends on them)."""
        return self.batch is not None or self.heads is not None

    def __repr__(self) -> str:
        (length, keys), (bm, bk) = self.shape, self.block
        per = [f"{n}={v}" for n, v in (("batch", self.batch), ("heads", self.heads)) if v is not None]
        return (f"BlockMask({length} x {keys}, blocks {bm} x {bk}, capacity {self.capacity}"
                f"{', ' + ', '.join(per) if per else ''}, mask_mod={self.mask_mod.name})")

    def to_dense(self) -> jax.Array:
        """The block flags as a dense `(rows, ceil(S / bk))` int8 grid (tests, plots)."""
        rows = max(1, self.batch or 1) * max(1, self.heads or 1) * self.grid[0]
        return _dense(self.Ai, self.Ak, self.flags, (rows, self.grid[1]))


@functools.partial(jax.jit, static_argnums=3)
def _dense(Ai, Ak, flags, shape: tuple[int, int]) -> jax.Array:
    """`BlockMask.to_dense`, one compiled program."""
    return jnp.zeros(shape, jnp.int8).at[Ai, Ak[:, 0]].max(flags[:, 0])


def block_mask(mask_mod: Callable, L: int, S: int, block: int | tuple[int, int] = 128, *, batch: int | None = None,
               heads: int | None = None, capacity: int | None = None) -> BlockMask:
    """The block mask of `mask_mod(b, h, q_idx, kv_idx) -> bool` for `L` queries and `S` keys, built with
    `jax.numpy` (inside `jit` or not): FlexAttention's `create_block_mask`.

    Args:
      mask_mod: True where query `q_idx` attends to key `kv_idx` (batch element `b`, head `h`). It may close over
        arrays (document ids `doc[q_idx] == doc[kv_idx]`, per-sequence lengths); they may be traced.
      L, S: queries and keys.
      block: `bm` (square blocks) or `(bm, bk)`; 128 suits the kernels.
      batch: the batch size, if the mask depends on `b` (one mask per batch element); None: one mask for every
        batch element, so `mask_mod` must not depend on `b` (`jinsum.attention` refuses such a mask for a batch
        of more than one: the blocks of element 0 would serve all).
      heads: the number of query heads, if the mask depends on `h` (one mask per head); None: one mask for every
        head, so `mask_mod` must not depend on `h` (refused likewise for more than one head; dependence is read
        off the traced function: `w[h]` counts even where `w` is the same for every head). A mask per head of a
        batched `q` needs `batch` too. A mask
        per batch element or head carries the causal rule itself (`q_idx >= kv_idx` in `mask_mod`).
      capacity: slots for attending blocks; defaults to every block (never overflows). A tighter one makes
        the kernels' grids smaller (a causal mask needs about half). If more blocks attend than it holds, those
        past it (in row-major order) are dropped: built eagerly (`mask_mod`'s arrays concrete) that raises a
        `ValueError` naming the capacity needed; traced (inside `jit`), the mask's `overflow` flag says so, a
        `checkify` error under `jinsum.check_indices`.

    Returns:
      A `BlockMask` to pass as the pattern of `jinsum.attention` (or of `jinsum.nn.BlockSparseAttention`), which
      then applies `mask_mod` too.

    Example:
      >>> @jax.jit
      ... def step(q, k, v, doc):                               # doc: (L,) document id of every position
      ...     L = q.shape[0]
      ...     mask = jinsum.block_mask(lambda b, h, i, j: (doc[i] == doc[j]) & (i >= j), L, L, 64)
      ...     return jinsum.attention(q, k, v, mask)
      >>> q = k = v = jnp.ones((256, 2, 16))
      >>> step(q, k, v, jnp.repeat(jnp.arange(2), 128)).shape               # two documents of 128
      (256, 2, 16)
    """
    return build(mask_mod, L, S, block, batch=batch, heads=heads, capacity=capacity)


def build(mask_mod: Callable, L: int, S: int, block: int | tuple[int, int], *, batch: int | None = None,
          heads: int | None = None, capacity: int | None = None, classify: Callable | None = None,
          where: str = "jinsum.block_mask") -> BlockMask:
    """The one builder of block masks: `block_mask`'s, with the classification given or not.

    `classify(grid)`, given `grid = (nb, nh, lb, sb)`, returns the flags `(nb * nh * lb, sb)` (any integer dtype:
    2 full, 1 partial, 0 empty, rows laid out as `BlockMask` numbers them) from what it knows of `mask_mod`'s
    structure (`jinsum.sequence_mask`: per-block summaries of document ids and the position rules), with no
    pass over the elements. A block it calls full must be full (the kernels evaluate nothing there: positions
    past `L`, `S` included, so an edge block is never full); one it calls partial may attend nowhere (the kernels
    evaluate `mask_mod` there), at the cost of a slot. Without it every element of every block is evaluated.
    `where` names the function the user called, in errors.
    """
    L, S = check_int(where, "L", L, minimum=1), check_int(where, "S", S, minimum=1)
    bm, bk = _block_shape(where, block)
    shared = "(or None: the same mask for all)"
    batch = None if batch is None else check_int(where, f"batch {shared}", batch, minimum=1)
    heads = None if heads is None else check_int(where, f"heads {shared}", heads, minimum=1)
    lb, sb = -(-L // bm), -(-S // bk)
    nb, nh = batch or 1, heads or 1
    rows = nb * nh * lb
    capacity = rows * sb if capacity is None else check_int(where, "capacity (or None for every block)", capacity,
                                                            minimum=1)
    user, captured = _elementwise.trace(mask_mod, "mask_mod", where)
    if classify is None:
        flags = _every_element(user, captured, (L, S), (bm, bk), (nb, nh, lb, sb))
    else:
        flags = jnp.asarray(classify((nb, nh, lb, sb)))
        if flags.shape != (rows, sb):
            raise ValueError(f"{where}: classify must return flags of shape {(rows, sb)}, got {flags.shape}")
    Ai, Ak, flags, needed = _packed(flags, capacity)
    overflow = capacity_overflow(
        needed, capacity, eager=lambda needed: f"{where}: {needed} blocks attend but capacity = {capacity} holds only "
        f"{capacity}; pass capacity >= {needed} (or None for every block)",
        traced=f"{where}: more attending blocks than capacity = {capacity}; those past it were dropped (raise the "
        "capacity)")
    return _made(mask_mod, user, captured, Ai, Ak, flags, overflow, (L, S), (bm, bk), batch=batch, heads=heads,
                 where=where)


# One compiled program (eagerly, each of its operations compiled alone: several times slower for a new shape).
@functools.partial(jax.jit, static_argnums=1)
def _packed(flags: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The attending blocks of the flags grid `(rows, sb)` in row-major order, packed into `capacity` slots: block
    `e` goes to slot `cumsum(attends)[e] - 1` (one running count, one scatter; slots past the capacity are
    dropped). Returns the slots' block rows `(capacity,)`, block columns and flags `(capacity, 1)`, and how many
    blocks attend."""
    sb = flags.shape[1]
    flags = flags.astype(jnp.int8).reshape(-1)
    attends = flags != 0
    count = jnp.cumsum(attends, dtype=jnp.int32)
    slot = jnp.where(attends, count - 1, capacity)
    position = jnp.full(capacity, flags.shape[0] - 1, jnp.int32).at[slot].set(
        jnp.arange(flags.shape[0], dtype=jnp.int32), mode="drop")
    used = jnp.arange(capacity) < count[-1]
    return (position // sb, jnp.where(used, position % sb, 0)[:, None], jnp.where(used, flags[position], 0)[:, None],
            count[-1])


def from_blocks(mask_mod: Callable, Ai: jax.Array, Ak: jax.Array, flags: jax.Array, shape: tuple[int, int],
                block: tuple[int, int], *, where: str) -> BlockMask:
    """The block mask of blocks a caller lays out itself, classified by what it knows (`jinsum.paged_attention`:
    each query block's slots are its sequence's pages): `Ai` `(capacity,)` non-decreasing block rows, `Ak`
    `(capacity,)` block columns, `flags` `(capacity,)` 2 full, 1 partial (`mask_mod` decides), 0 a padding slot.
    The same for every batch element and head."""
    user, captured = _elementwise.trace(mask_mod, "mask_mod", where)
    return _made(mask_mod, user, captured, *_slots(Ai, Ak, flags), jnp.asarray(False), shape, block, batch=None,
                 heads=None, where=where)


@jax.jit  # (one compiled program outside `jit`)
def _slots(Ai, Ak, flags) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`from_blocks`' slots as a `BlockMask` holds them: int32 block rows `(capacity,)`, int32 block columns and
    int8 flags `(capacity, 1)`."""
    return Ai.astype(jnp.int32), Ak.astype(jnp.int32)[:, None], flags.astype(jnp.int8)[:, None]


def _made(mask_mod, user, captured, Ai, Ak, flags, overflow, shape, block, *, batch, heads, where) -> BlockMask:
    """The `BlockMask` of classified slots (`Ak`, `flags` `(capacity, 1)`): `user` and `captured` are `mask_mod`
    traced as written, and it is traced again in the coordinates of the laid-out sequence."""
    (L, S), (bm, bk) = shape, block
    laid_out = _laid_out(mask_mod, (L, S), (bm, bk), (-(-L // bm), -(-S // bk)), batch, heads)
    traced, _ = _elementwise.trace(laid_out, "mask_mod", where)
    return BlockMask(Ai, Ak, flags, overflow, captured, shape=(L, S), block=(bm, bk), batch=batch,
                     heads=heads, mask_mod=traced, reads=_elementwise.arguments_read(user) & {"b", "h"})


def _block_shape(where: str, block) -> tuple[int, int]:
    """`block`, an int `bm` (square blocks) or a pair `(bm, bk)`, as a pair of positive Python ints; NumPy
    integers count, bools and floats do not. `where` names the function the user called, in errors."""
    if isinstance(block, (tuple, list)):
        if len(block) != 2:
            raise ValueError(f"{where}: block must be an int bm (square blocks) or a pair (bm, bk), got {block!r}")
        return check_int(where, "block[0]", block[0], minimum=1), check_int(where, "block[1]", block[1], minimum=1)
    try:
        size = check_int(where, "block", block, minimum=1)
    except TypeError:
        raise TypeError(f"{where}: block must be an int bm (square blocks) or a pair (bm, bk), got "
                        f"{block!r}") from None
    return size, size


# One compiled program; `user` is static: traced functions that are equal hash equal, and its captures are operands.
@functools.partial(jax.jit, static_argnums=(0, 2, 3, 4))
def _every_element(user, captured, shape, block, grid) -> jax.Array:
    """The flags `(nb * nh * lb, sb)` of every tile, evaluating the traced `mask_mod` on every element: one fused
    reduction over broadcast iotas `(batch, head, block row, block column, m, k)`, nothing of size `L x S` kept."""
    (L, S), (bm, bk), (nb, nh, lb, sb) = shape, block, grid
    b = jnp.arange(nb, dtype=jnp.int32).reshape(nb, 1, 1, 1, 1, 1)
    h = jnp.arange(nh, dtype=jnp.int32).reshape(1, nh, 1, 1, 1, 1)
    q = (jnp.arange(lb, dtype=jnp.int32).reshape(1, 1, lb, 1, 1, 1) * bm
         + jnp.arange(bm, dtype=jnp.int32).reshape(1, 1, 1, 1, bm, 1))
    kv = (jnp.arange(sb, dtype=jnp.int32).reshape(1, 1, 1, sb, 1, 1) * bk
          + jnp.arange(bk, dtype=jnp.int32).reshape(1, 1, 1, 1, 1, bk))
    allowed = user(captured, b, h, q, kv) & (q < L) & (kv < S)
    full, some = allowed.all(axis=(4, 5)), allowed.any(axis=(4, 5))
    return jnp.where(full, 2, jnp.where(some, 1, 0)).astype(jnp.int8).reshape(nb * nh * lb, sb)


def _laid_out(fn: Callable, shape, block, grid, batch, heads) -> Callable:
    """`fn` in the coordinates of the kernels' sequence: positions within the padded batch elements and heads
    laid along it, and positions past `L` or `S` masked."""
    (length, keys), (bm, bk), (lb, sb) = shape, block, grid
    rows, cols = lb * bm, sb * bk  # padded positions per batch element and head

    def laid_out(b, h, q_idx, kv_idx):
        if batch is not None or heads is not None:
            segment = q_idx // rows
            h = segment % (heads or 1) if heads is not None else h
            b = segment // (heads or 1) if batch is not None else b
            q_idx, kv_idx = q_idx % rows, kv_idx % cols
        return fn(b, h, q_idx, kv_idx) & (q_idx < length) & (kv_idx < keys)
    laid_out.__name__ = getattr(fn, "__name__", "mask_mod")
    return laid_out
