"""Deterministic mode's form of a `+=` through index arrays: every target written by one program, its terms added
in a fixed order, no atomics (`jinsum.deterministic`).

Applied where the primitive is lowered (`_lowering`), so that JVP, transpose and vmap see the statement as the user
wrote it (a format's transpose keeps its column order) and only the kernels change: the statements below go to the
platform's lowering directly (`Kernel`), not back through the primitive. The statement is read over its
entries sorted by target (`_derive.sorted_scatter`; a sort only where the index array is not sorted already) and
becomes up to three sorted segment reductions:

    C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]
      C[Ai_sorted[h],n] += Av[g_at[h],p] * B[Ak[g_at[h],p],n]         the entries of rows of <= PIECE_ENTRIES
      pieces[piece_of[h],n] += Av[g_at[h],p] * B[Ak[g_at[h],p],n]     those of longer rows, cut into pieces
      C[piece_rows[q],n] += pieces[q,n]                                the pieces, summed per row

so that no program sums more than `2 * PIECE_ENTRIES` entries, nor more than a hub row's entries /
`PIECE_ENTRIES` pieces. Shapes are static, so each list is padded to its largest size with distinct targets past
the end of the output, which a segmented kernel drops without computing their terms.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from jinsum._rules import _derive
from jinsum._lang import Access, Spec, Statement, Var, statement_variables, tensor_names
from jinsum._rules._primitive import make_spec

Kernel = Callable[[Spec, Mapping[str, jax.Array]], jax.Array]  # a statement's evaluation (a kernel) on arrays

# Rows (runs of equal targets) longer than this many entries are summed in pieces of PIECE_ENTRIES to
# 2 * PIECE_ENTRIES - 1 entries; an entry is an assignment of the target's variables (a group of a `GroupCOO`).
PIECE_ENTRIES = 32


def rewritten(spec: Spec) -> bool:
    """Whether the lowering rewrites `spec`: a deterministic `+=` through index arrays (maxima and minima are exact
    in any order, and need not be)."""
    return (spec.deterministic and spec.statement.reduction == "sum" and spec.statement.accumulate and not spec.winners
            and any(isinstance(i, Access) for i in spec.statement.lhs.indices))


def evaluate(spec: Spec, arrays: Mapping[str, jax.Array], kernel: Kernel) -> jax.Array:
    """`spec` (a `rewritten` one) on `arrays` (by name), as sorted segment reductions run by `kernel`."""
    statement, lhs = spec.statement, spec.statement.lhs
    if not any(isinstance(i, Var) for i in lhs.indices):  # `L[K[e]] += ...`: give the kernels a lane variable
        return _with_unit_axis(spec, arrays, kernel)
    scatter = _derive.sorted_scatter(statement)
    if scatter is None:  # several indirections, or a batch axis beside one: the products first
        return _scatter_products(spec, arrays, kernel)
    short, sorting = scatter
    shape = tuple(spec.extent[v] for v in sorting.variables)
    targets = jnp.broadcast_to(_index_values(sorting.target, arrays, sorting.variables, shape), shape).reshape(-1)
    presorted = sorting.target.tensor in spec.sorted_indices and len(sorting.variables) == 1
    entries = jnp.arange(targets.size) if presorted else jnp.argsort(targets, stable=True)
    position = next(d for d, i in enumerate(lhs.indices) if i is sorting.target)
    runs = _Runs(targets if presorted else targets[entries], entries, count=spec.lhs.shape[position])

    def bind(statement, rows, at, operands, zero_lhs):
        [index] = [i.tensor for i in statement.lhs.indices if isinstance(i, Access)]
        coordinates = jnp.unravel_index(at, shape)
        operands = {**arrays, **operands, index: rows,
                    **{name: c.astype(jnp.int32) for name, c in zip(sorting.coordinates, coordinates)}}
        return _bind(statement, operands, {index}, spec, zero_lhs, kernel)

    out = bind(short, *runs.short, {}, spec.zero_lhs)
    if runs.size <= PIECE_ENTRIES:  # no row can be long
        return out
    taken = set(tensor_names(short))
    pieces_name, piece_of, piece_rows = (_derive.fresh_name(n, taken) for n in ("pieces", "piece_of", "piece_rows"))
    per_piece, per_row = _derive.in_pieces(short, pieces_name, piece_of, piece_rows)
    pieces_shape = list(spec.lhs.shape)
    pieces_shape[position] = runs.piece_count
    pieces = jnp.zeros(pieces_shape, jnp.promote_types(spec.lhs.dtype, jnp.float32))
    pieces = bind(per_piece, *runs.long, {pieces_name: pieces}, True)
    return _bind(per_row, {lhs.tensor: out, pieces_name: pieces, piece_rows: runs.piece_rows}, {piece_rows}, spec,
                 False, kernel)


class _Runs:
    """The sorted targets' runs, split into the entries of short rows and the pieces of long ones.

    Out-of-range targets are dropped (as the atomic write drops them). Each list is padded to a static length with
    distinct targets `count + 1, count + 2, ...`, out of range and in sorted order."""

    def __init__(self, targets: jax.Array, entries: jax.Array, count: int):
        size = targets.shape[0]
        index = jnp.arange(size)
        changes = targets[1:] != targets[:-1]
        starts = jnp.concatenate([jnp.ones(1, bool), changes])
        ends = jnp.concatenate([changes, jnp.ones(1, bool)])
        run_start = jax.lax.cummax(jnp.where(starts, index, 0))
        run_end = jax.lax.cummin(jnp.where(ends, index, size), reverse=True)
        length = run_end - run_start + 1
        kept = (targets >= 0) & (targets < count)
        long = kept & (length > PIECE_ENTRIES)
        short = kept & ~long
        # A long run's pieces: PIECE_ENTRIES entries each, the last one taking the remainder.
        within = jnp.minimum((index - run_start) // PIECE_ENTRIES, length // PIECE_ENTRIES - 1)
        new_piece = long & (starts | (within != jnp.concatenate([jnp.full(1, -1), within[:-1]])))
        piece = jnp.cumsum(new_piece) - 1
        self.size = size
        self.piece_count = max(1, size // PIECE_ENTRIES)  # each piece has at least PIECE_ENTRIES entries
        self.short = self._compact(short, targets, entries, count)
        self.long = self._compact(long, piece, entries, self.piece_count)
        padding = (count + 1 + jnp.arange(self.piece_count)).astype(jnp.int32)
        self.piece_rows = padding.at[jnp.where(new_piece, piece, self.piece_count)].set(
            targets.astype(jnp.int32), mode="drop")

    def _compact(self, selected, values, entries, bound) -> tuple[jax.Array, jax.Array]:
        """The selected positions' values and entries, in order, padded with `bound + 1, bound + 2, ...`."""
        slot = jnp.where(selected, jnp.cumsum(selected) - 1, self.size)
        padded = (bound + 1 + jnp.arange(self.size)).astype(jnp.int32)
        return (padded.at[slot].set(values.astype(jnp.int32), mode="drop"),
                jnp.zeros(self.size, jnp.int32).at[slot].set(entries.astype(jnp.int32), mode="drop"))


def _bind(statement: Statement, arrays: Mapping[str, jax.Array], sorted_indices, spec: Spec, zero_lhs: bool,
          kernel: Kernel) -> jax.Array:
    """Runs a statement derived from `spec`, in its mode, without its column order."""
    derived = make_spec(statement, arrays, **dict(spec.modes, sorted_indices=frozenset(sorted_indices)),
                        zero_lhs=zero_lhs)
    return kernel(derived, arrays)


def _with_unit_axis(spec: Spec, arrays: Mapping[str, jax.Array], kernel: Kernel) -> jax.Array:
    """`L[K[e],u] += P[e]` with `L` given a trailing unit axis: a left-hand side variable that is not the segments'
    (the kernels vectorise it; and the pieces' sum per row needs one)."""
    statement, lhs = spec.statement, spec.statement.lhs
    unit = Var(_derive.fresh_name("u", set(statement_variables(statement))))
    statement = dataclasses.replace(statement, lhs=dataclasses.replace(lhs, indices=(*lhs.indices, unit)))
    arrays = {**arrays, lhs.tensor: arrays[lhs.tensor][..., None]}
    widened = make_spec(statement, arrays, **spec.modes, zero_lhs=spec.zero_lhs)
    return evaluate(widened, arrays, kernel)[..., 0]


def _scatter_products(spec: Spec, arrays: Mapping[str, jax.Array], kernel: Kernel) -> jax.Array:
    """`products[loop variables] += factors`, then `L[K[e]] += P[e]` over the left-hand side as a vector `L`, the
    products as `P` and each one's flat target as `K` (-1, dropped, where a target is out of range)."""
    loop = spec.loop_variables
    shape = tuple(spec.extent[v] for v in loop)
    lhs, out = spec.statement.lhs, spec.lhs
    products = _derive.fresh_name("products", set(spec.names))
    products_dtype = jnp.promote_types(out.dtype, jnp.float32)  # (a 16-bit product array would round twice)
    terms = _bind(Statement(Access(products, tuple(Var(v) for v in loop)), True, spec.statement.factors),
                  {**arrays, products: jnp.zeros(shape, products_dtype)}, spec.sorted_indices, spec, True, kernel)
    targets = [jnp.broadcast_to(_index_values(i, arrays, loop, shape), shape) for i in lhs.indices]
    inside = functools.reduce(jnp.logical_and, [(t >= 0) & (t < n) for t, n in zip(targets, out.shape)])
    key = jnp.where(inside, jnp.ravel_multi_index(tuple(targets), out.shape, mode="clip"), -1)
    flat = dict(L=arrays[lhs.tensor].reshape(-1), K=key.reshape(-1).astype(jnp.int32), P=terms.reshape(-1))
    scatter = make_spec(Statement(Access("L", (Access("K", (Var("e"),)),)), True, (Access("P", (Var("e"),)),)),
                        flat, **dict(spec.modes, sorted_indices=frozenset()), zero_lhs=spec.zero_lhs)
    return evaluate(scatter, flat, kernel).reshape(out.shape)


def _index_values(index: Access | Var, arrays: Mapping[str, jax.Array], order: tuple[str, ...],
                  shape: tuple[int, ...]) -> jax.Array:
    """An index position's value at every assignment of the variables `order` (an array broadcastable to `shape`);
    out-of-range reads give 0, as in the statement."""
    if isinstance(index, Var):
        return jnp.arange(shape[order.index(index.name)]).reshape([-1 if v == index.name else 1 for v in order])
    positions = tuple(_index_values(i, arrays, order, shape) for i in index.indices)
    return arrays[index.tensor].at[positions].get(mode="fill", fill_value=0)
