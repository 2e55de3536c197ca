"""The jinsum primitive and all its rules, in one ordered section (as in jax.experimental.sparse.bcoo).

One primitive, `jinsum_p`, parameterised by a checked `Spec`; its operands are the arrays of the statement in
`spec.names` order (the left-hand side first). Every rule derives new statements (see `_derive`) and binds them to
the same primitive, so derivatives and batched versions are indirect Einsums too and reach the same lowerings.
In deterministic mode `bind` rewrites `+=` through index arrays into sorted segment reductions first.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jinsum import _config, _derive, _lower_triton, _lower_xla
from jinsum._lang import (Access, ColumnOrder, Operand, Spec, Statement, Var, check, statement_variables,
                          tensor_names, walk)


def make_spec(statement: Statement, arrays: Mapping[str, jax.Array], *,
              sorted_indices: frozenset[str] = frozenset(), allow_tf32: bool = False, zero_lhs: bool = False,
              column_order: ColumnOrder | None = None, deterministic: bool | None = None) -> Spec:
    """Checks `statement` against `arrays` (name -> array; extra names ignored): the primitive's parameter.
    `zero_lhs` promises that the left-hand side array is all zeros; `column_order` names a format's entries in
    column order among `arrays`; `deterministic` defaults to the `jinsum_deterministic` option (see `Spec`)."""
    names = tensor_names(statement)
    operands = tuple(operand(n, arrays[n]) for n in names)
    if deterministic is None:
        deterministic = _config.deterministic.value
    return check(statement, operands, frozenset(sorted_indices), allow_tf32, zero_lhs, column_order, deterministic)


def operand(name: str, array) -> Operand:
    return Operand(name, tuple(np.shape(array)), np.dtype(array.dtype))


def bind(statement: Statement, arrays: Mapping[str, jax.Array], **flags) -> jax.Array:
    """Applies the primitive to `statement` on `arrays` (see `make_spec` for the flags). In deterministic mode a
    `+=` through index arrays is bound in a form whose kernel adds nothing atomically (`_bind_deterministic`)."""
    spec = make_spec(statement, arrays, **flags)
    if _config.check_indices.value:
        _check_indices(spec, arrays)
    if not binds_as_written(spec):
        return _bind_deterministic(spec, arrays, {**flags, "deterministic": True})
    return jinsum_p.bind(*(arrays[n] for n in spec.arguments), spec=spec)


def _check_indices(spec: Spec, arrays: Mapping[str, jax.Array]) -> None:
    """`checkify` checks that the traced index arrays lie in range of what they address, and that declared-sorted
    ones do not decrease (`jinsum.check_indices`; concrete arrays are checked on the host, before tracing)."""
    for access in spec.statement.accesses:
        for node in walk(access):
            for dim, index in enumerate(node.indices):
                values = arrays[index.tensor] if isinstance(index, Access) else None
                if not isinstance(values, jax.core.Tracer) or values.size == 0:
                    continue
                bound = spec.operand[node.tensor].shape[dim]
                bad = ((values < 0) | (values >= bound)).reshape(-1)
                first = jnp.argmax(bad)
                where = jnp.unravel_index(first, values.shape)
                checkify.check(
                    ~bad.any(), f"jinsum: index array {index.tensor} holds {{value}} at position "
                    f"({', '.join(f'{{p{d}}}' for d in range(values.ndim))}{',' * (values.ndim == 1)}), out of range "
                    f"for dimension {dim} of {node.tensor} (shape {spec.operand[node.tensor].shape}) in {node}; every "
                    f"index there must lie in [0, {bound})",
                    value=values.reshape(-1)[first], **{f"p{d}": p for d, p in enumerate(where)})
    for name in spec.sorted_indices:
        values = arrays[name]
        if isinstance(values, jax.core.Tracer) and values.size > 1:
            falls = values[1:] < values[:-1]
            first = jnp.argmax(falls)
            checkify.check(~falls.any(), f"jinsum: {name} is declared sorted, but {name}[{{i}}] = {{a}} > "
                           f"{name}[{{j}}] = {{b}}", i=first, a=values[first], j=first + 1, b=values[first + 1])


def binds_as_written(spec: Spec) -> bool:
    """False for a deterministic `+=` through index arrays, which `bind` rewrites (`_bind_deterministic`)."""
    return not (spec.deterministic and spec.statement.accumulate
                and any(isinstance(i, Access) for i in spec.statement.lhs.indices))


def _bind_deterministic(spec: Spec, arrays: Mapping[str, jax.Array], flags: dict) -> jax.Array:
    """A `+=` through index arrays as a sorted segment reduction, each target written by one program.

    Unsorted: over its entries sorted by target (`_derive.sorted_scatter`) where one index access addresses the
    left-hand side; otherwise (several indirections, a batch axis beside one) the products first, into an array
    over the loop variables, then those scattered into the left-hand side read as a vector, keyed by each target's
    flat position. Long rows are summed in pieces (`_bind_in_pieces`).
    """
    statement = spec.statement
    if spec.lhs_sorted_index is None:
        scatter = _derive.sorted_scatter(statement, spec.sorted_indices)
        if scatter is None:
            return _scatter_products(spec, arrays, flags)
        statement, sorting = scatter
        arrays = {**arrays, **_sort_entries(arrays, sorting, spec.extent)}
        flags = {**flags, "sorted_indices": frozenset(spec.sorted_indices) | {sorting.sorted_index}}
    spec = make_spec(statement, arrays, **flags)
    [var] = next(i for i in statement.lhs.indices if isinstance(i, Access)).indices
    if spec.extent[var.name] > PIECE_GROUPS:
        return _bind_in_pieces(spec, arrays, flags)
    return _bind_segments(statement, arrays, flags)


def _bind_segments(statement: Statement, arrays: Mapping[str, jax.Array], flags: dict) -> jax.Array:
    """A deterministic sorted segment reduction as it is. The planner vectorises a variable other than the
    segments' (`kernels._plan._lane_variable`); where the statement has no other (`L[K[h]] += P[h]`), the left-hand
    side gets a unit axis to vectorise."""
    lhs = statement.lhs
    unit = len(statement_variables(statement)) == 1
    if unit:
        var = Var(_derive.fresh_name("u", set(statement_variables(statement))))
        statement = dataclasses.replace(statement, lhs=dataclasses.replace(lhs, indices=(*lhs.indices, var)))
        arrays = {**arrays, lhs.tensor: arrays[lhs.tensor][..., None]}
    spec = make_spec(statement, arrays, **flags)
    out = jinsum_p.bind(*(arrays[n] for n in spec.arguments), spec=spec)
    return out[..., 0] if unit else out


# In deterministic mode a row is summed by one program; a long row (a hub) is cut into pieces of at most this many
# entries of the window variable (groups), summed per piece, then per row (`_bind_in_pieces`).
PIECE_GROUPS = 32


def _bind_in_pieces(spec: Spec, arrays: Mapping[str, jax.Array], flags: dict) -> jax.Array:
    """A sorted segment reduction in two sorted segment reductions (`_derive.in_pieces`), so that no program sums
    more than `PIECE_GROUPS` groups of a hub row, nor more than its groups / `PIECE_GROUPS` pieces: the partial
    sums cost a write and a read of an array about the size of the output (float32)."""
    statement = spec.statement
    position = next(d for d, i in enumerate(statement.lhs.indices) if isinstance(i, Access))
    count = spec.lhs.shape[position]
    # Out-of-range rows (dropped by the write) as -1 or `count`: at most count + 2 distinct rows, still sorted.
    rows = jnp.clip(arrays[spec.lhs_sorted_index], -1, count)
    groups = rows.shape[0]
    # Each group's place in its row's run, its piece within the row, and the pieces numbered in order.
    index = jnp.arange(groups)
    starts = jnp.concatenate([jnp.ones(1, bool), rows[1:] != rows[:-1]])
    run_start = jax.lax.cummax(jnp.where(starts, index, 0))
    piece = (index - run_start) // PIECE_GROUPS
    new_piece = starts | jnp.concatenate([jnp.ones(1, bool), piece[1:] != piece[:-1]])
    pieces = (jnp.cumsum(new_piece) - 1).astype(jnp.int32)
    # At most one short piece per row plus one per PIECE_GROUPS groups; unused pieces hold zeros and the row past
    # the end (dropped), which keeps the pieces' rows sorted.
    size = min(groups, count + 2 + groups // PIECE_GROUPS)
    piece_rows = jnp.full(size, count, rows.dtype).at[pieces].set(rows)
    taken, names = set(spec.names), []
    for base in ("pieces", "partial", "piece_rows"):
        names.append(_derive.fresh_name(base, taken))
        taken.add(names[-1])
    pieces_name, partial_name, piece_rows_name = names
    first, second = _derive.in_pieces(statement, *names)
    shape = list(spec.lhs.shape)
    shape[position] = size
    sorted_flags = {**flags, "sorted_indices": frozenset(spec.sorted_indices) | {pieces_name}}
    partial = _bind_segments(first, {**arrays, pieces_name: pieces,
                                     partial_name: jnp.zeros(shape, jnp.promote_types(spec.lhs.dtype, jnp.float32))},
                             {**sorted_flags, "zero_lhs": True, "column_order": None})
    return _bind_segments(second, {spec.lhs.name: arrays[spec.lhs.name], partial_name: partial,
                                   piece_rows_name: piece_rows},
                          {**flags, "sorted_indices": frozenset({piece_rows_name}), "column_order": None})


def _scatter_products(spec: Spec, arrays: Mapping[str, jax.Array], flags: dict) -> jax.Array:
    """`products[loop variables] += factors`, then `L[K[e]] += P[e]` over the left-hand side as a vector `L`, the
    products as `P` and each one's flat target as `K` (-1, dropped, where a target is out of range)."""
    loop = spec.loop_variables
    shape = tuple(spec.extent[v] for v in loop)
    lhs, out = spec.statement.lhs, spec.lhs
    products = _derive.fresh_name("products", set(spec.names))
    products_dtype = jnp.promote_types(out.dtype, jnp.float32)  # (a 16-bit product array would round twice)
    terms = bind(Statement(Access(products, tuple(Var(v) for v in loop)), True, spec.statement.factors),
                 {**arrays, products: jnp.zeros(shape, products_dtype)},
                 **{**flags, "zero_lhs": True, "column_order": None})
    targets = [jnp.broadcast_to(_index_values(i, arrays, loop, shape), shape) for i in lhs.indices]
    inside = functools.reduce(jnp.logical_and, [(t >= 0) & (t < n) for t, n in zip(targets, out.shape)])
    key = jnp.where(inside, jnp.ravel_multi_index(tuple(targets), out.shape, mode="clip"), -1)
    flat = bind(Statement(Access("L", (Access("K", (Var("e"),)),)), True, (Access("P", (Var("e"),)),)),
                dict(L=arrays[lhs.tensor].reshape(-1), K=key.reshape(-1).astype(jnp.int32), P=terms.reshape(-1)),
                deterministic=True, zero_lhs=spec.zero_lhs)
    return flat.reshape(out.shape)


def _sort_entries(arrays: Mapping[str, jax.Array], sorting: _derive.SortedScatter, extent: Mapping[str, int]
                  ) -> dict[str, jax.Array]:
    """The operands `sorted_scatter` adds: the target index's values over its variables, flattened and stably
    sorted, and the variables' values at each sorted entry."""
    shape = tuple(extent[v] for v in sorting.variables)
    flat = jnp.broadcast_to(_index_values(sorting.target, arrays, sorting.variables, shape), shape).reshape(-1)
    entries = jnp.argsort(flat, stable=True)
    coordinates = jnp.unravel_index(entries, shape)
    return {sorting.sorted_index: flat[entries],
            **{name: c.astype(jnp.int32) for name, c in zip(sorting.coordinates, coordinates)}}


def _index_values(index: Access | Var, arrays: Mapping[str, jax.Array], order: tuple[str, ...],
                  shape: tuple[int, ...]) -> jax.Array:
    """An index position's value at every assignment of the variables `order` (an array broadcastable to `shape`);
    out-of-range reads give 0, as in the statement."""
    if isinstance(index, Var):
        return jnp.arange(shape[order.index(index.name)]).reshape([-1 if v == index.name else 1 for v in order])
    positions = tuple(_index_values(i, arrays, order, shape) for i in index.indices)
    return arrays[index.tensor].at[positions].get(mode="fill", fill_value=0)


jinsum_p = Primitive("jinsum")


# --- evaluation --------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1024)
def _compiled(spec: Spec):
    return jax.jit(functools.partial(jinsum_p.bind, spec=spec))


def _impl(*arrays, spec: Spec):
    # Eager calls compile the primitive alone, so they take the platform's lowering (Triton on CUDA) as under jit.
    return _compiled(spec)(*arrays)


def _abstract_eval(*avals, spec: Spec):
    order = () if spec.column_order is None else spec.column_order.operands
    for aval, expected in zip(avals, spec.operands + order, strict=True):
        if aval.shape != expected.shape or aval.dtype != expected.dtype:
            raise TypeError(f"jinsum: operand {expected.name} is {aval.str_short()}, but {spec!r} was checked for "
                            f"{expected.dtype}{list(expected.shape)}")
    return jax.core.ShapedArray(spec.lhs.shape, spec.lhs.dtype)


jinsum_p.def_impl(_impl)
jinsum_p.def_abstract_eval(_abstract_eval)
# (Both lowerings read the statement's operands, `spec.names`; the column order's come after them.)
mlir.register_lowering(jinsum_p, mlir.lower_fun(_lower_xla.evaluate, multiple_results=False))
mlir.register_lowering(jinsum_p, mlir.lower_fun(_lower_triton.evaluate, multiple_results=False), platform="cuda")


# --- forward-mode differentiation -----------------------------------------------------------------------------
# The statement is linear in its left-hand side and in each factor occurrence. Its tangent is a chain of
# statements on the tangent of the left-hand side: for `+=`, one `+=` term per factor with a tangent; for `=`, the
# first term sets (overwritten elements take the term's tangent) and the others add.

def _jvp(primals, tangents, *, spec: Spec):
    out = jinsum_p.bind(*primals, spec=spec)
    statement = spec.statement
    env = dict(zip(spec.arguments, primals))
    tangent_of = dict(zip(spec.names, tangents))
    for name in spec.index_tensors:
        if type(tangent_of[name]) is not ad.Zero and tangent_of[name].dtype != jax.dtypes.float0:
            raise TypeError(f"jinsum: {name} is an index array; it cannot be differentiated")

    terms = [i for i, f in enumerate(statement.factors) if type(tangent_of[f.tensor]) is not ad.Zero]
    lhs_tangent = tangent_of[statement.lhs.tensor]
    if not terms:
        if statement.accumulate or type(lhs_tangent) is ad.Zero:
            return out, lhs_tangent
        terms = [0]  # `=` still overwrites: the unwritten-element mask comes from a zero-tangent term

    tangent = ad.instantiate_zeros(lhs_tangent)
    taken = set(spec.names)
    for k, i in enumerate(terms):
        factor = statement.factors[i]
        name = _derive.fresh_name("d" + factor.tensor, taken)
        term = _derive.replace_factor(statement, i, name, accumulate=statement.accumulate or k > 0)
        arrays = {**env, statement.lhs.tensor: tangent, name: ad.instantiate_zeros(tangent_of[factor.tensor])}
        tangent = bind(term, arrays, sorted_indices=spec.sorted_indices, allow_tf32=spec.allow_tf32,
                       deterministic=spec.deterministic,
                       zero_lhs=k == 0 and type(lhs_tangent) is ad.Zero, column_order=spec.column_order)
    return out, tangent


ad.primitive_jvps[jinsum_p] = _jvp


# --- transposition ----------------------------------------------------------------------------------------------
# Linear operands are the left-hand side and at most one factor tensor (occurring once); index arrays and the
# other factors are constants. The cotangent of a factor is the transposed statement (the factor and the output
# swap places); that of the left-hand side is the output cotangent, minus the elements `=` overwrote. A cotangent
# that scatters into a format's columns runs over its entries in column order when the format carries them.

def _transpose(cotangent, *args, spec: Spec):
    statement = spec.statement
    linear = [name for name, a in zip(spec.names, args) if ad.is_undefined_primal(a)]
    if type(cotangent) is ad.Zero:
        return [ad.Zero(a.aval) if ad.is_undefined_primal(a) else None for a in args]
    env = {name: a for name, a in zip(spec.arguments, args) if not ad.is_undefined_primal(a)}
    env[statement.lhs.tensor] = cotangent
    if len([name for name in linear if name != statement.lhs.tensor]) > 1:
        raise NotImplementedError(f"jinsum: {spec!r} is not linear in {linear}; cannot transpose")
    results = {}
    for name in linear:
        aval = spec.operand[name]
        if name == statement.lhs.tensor:
            results[name] = _unwritten(cotangent, env, spec)
            continue
        occurrences = [i for i, f in enumerate(statement.factors) if f.tensor == name]
        if len(occurrences) != 1:
            raise NotImplementedError(f"jinsum: {spec!r} is not linear in {name}; cannot transpose")
        derived, arrays, sorted_indices = _derive.transpose(statement, occurrences[0]), env, spec.sorted_indices
        by_columns = spec.column_order and _derive.by_columns(derived, spec.column_order)
        if by_columns:
            derived, gathers = by_columns
            arrays = {**env, **_at_entries(env, gathers, spec.column_order)}
            sorted_indices = frozenset({spec.column_order.columns.name})
        results[name] = bind(derived, {**arrays, name: jnp.zeros(aval.shape, aval.dtype)},
                             sorted_indices=sorted_indices, allow_tf32=spec.allow_tf32, zero_lhs=True,
                             deterministic=spec.deterministic)
    return [results.get(name) for name in spec.arguments]


def _at_entries(env, gathers, order: ColumnOrder) -> dict:
    """The operands of a `by_columns` statement read at the entries in column order (zero at padding)."""
    slots, group_size = env[order.slots.name], env[order.columns_index].shape[1]
    valid, slots = slots >= 0, jnp.maximum(slots, 0)
    arrays = {}
    for g in gathers:
        source = env[g.source]
        if g.slot_axis is None:
            read = source[slots // group_size]
        else:
            source = jnp.moveaxis(source, g.slot_axis, 1)
            read = source.reshape(-1, *source.shape[2:])[slots]
        arrays[g.name] = jnp.where(valid.reshape(valid.shape + (1,) * (read.ndim - 2)), read, 0).astype(read.dtype)
    return arrays


def _unwritten(cotangent, env, spec: Spec):
    statement = spec.statement
    if statement.accumulate:
        return cotangent
    if _derive.overwrites_everything(statement):
        return ad.Zero(jax.core.ShapedArray(spec.lhs.shape, spec.lhs.dtype))
    zeros_name = _derive.fresh_name("zeros", set(spec.names))
    mask = _derive.unwritten_mask(statement, zeros_name)
    zeros = jnp.zeros([spec.extent[v] for v in spec.loop_variables], spec.lhs.dtype)
    return bind(mask, {**env, zeros_name: zeros}, sorted_indices=spec.sorted_indices,
                deterministic=spec.deterministic)


ad.primitive_transposes[jinsum_p] = _transpose


# --- batching ---------------------------------------------------------------------------------------------------
# vmap adds one index variable: at the batched axis of every batched operand, and in the output. An unbatched
# left-hand side is broadcast with the new axis last. A batched index array is no longer 1-D, hence not sorted.

def _batch(args, dims, *, spec: Spec):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    lhs_name = spec.lhs.name
    batched = {name: d for name, d in zip(spec.names, dims) if d is not None and name != lhs_name}
    env = dict(zip(spec.arguments, args))
    order = spec.column_order
    if order is not None and (set(batched) & {order.values, order.rows_index, order.columns_index}
                              or any(d is not None for d in dims[len(spec.names):])):
        order = None  # a batch of patterns or values: entries in another order, or another set of them
    lhs_axis = dict(zip(spec.names, dims))[lhs_name]
    if lhs_axis is None:
        lhs_axis = len(spec.lhs.shape)
        env[lhs_name] = jnp.broadcast_to(env[lhs_name][..., None], (*spec.lhs.shape, size))
    statement, _ = _derive.batch(spec.statement, batched, lhs_axis)
    out = bind(statement, env, sorted_indices=spec.sorted_indices - set(batched), allow_tf32=spec.allow_tf32,
               zero_lhs=spec.zero_lhs, column_order=order,  # zeros, broadcast or batched, are zeros
               deterministic=spec.deterministic)
    return out, lhs_axis


batching.primitive_batchers[jinsum_p] = _batch
