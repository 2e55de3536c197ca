"""The jinsum primitive and all its rules, in one ordered section (as in jax.experimental.sparse.bcoo).

One primitive, `jinsum_p`, parameterised by a checked `Spec`; its operands are the arrays of the statement in
`spec.names` order (the left-hand side first). Every rule derives new statements (see `_derive`) and binds them to
the same primitive, so derivatives and batched versions are indirect Einsums too and reach the same lowerings.
The lowerings (XLA everywhere, generated Triton kernels on CUDA) are registered by `_lowering`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from jinsum import _config
from jinsum._rules import _derive
from jinsum._rules._avals import varying
from jinsum._lang._elementwise import on_grid
from jinsum._lang import (WINNER_NONE, Access, ColumnOrder, Elementwise, Operand, Spec, Statement, check,
                          tensor_names, walk)


def make_spec(statement: Statement, arrays: Mapping[str, jax.Array], *,
              sorted_indices: frozenset[str] = frozenset(), allow_tf32: bool = False, zero_lhs: bool = False,
              column_order: ColumnOrder | None = None, deterministic: bool | None = None,
              winners: bool = False, by_columns: bool = False, epilogue: Elementwise | None = None) -> Spec:
    """Checks `statement` against `arrays` (name -> array; extra names ignored): the primitive's parameter.
    `zero_lhs` promises that the left-hand side array is all zeros; `column_order` names a format's entries in
    column order among `arrays`; `deterministic` defaults to the `jinsum_deterministic` option; `winners` asks a
    `max=` / `min=` where its results came from; `by_columns` marks a derivative in column order; `epilogue` is
    applied to every element of the result, its captured arrays in `arrays` under `Spec.epilogue_names` (see
    `Spec`)."""
    names = tensor_names(statement)
    operands = tuple(operand(n, arrays[n]) for n in names)
    if deterministic is None:
        deterministic = _config.deterministic.value
    return check(statement, operands, frozenset(sorted_indices), allow_tf32, zero_lhs, column_order, deterministic,
                 winners, by_columns, epilogue)


def operand(name: str, array) -> Operand:
    return Operand(name, tuple(np.shape(array)), np.dtype(array.dtype))


def bind(statement: Statement, arrays: Mapping[str, jax.Array], *, check_indices: bool = True,
         **flags) -> jax.Array:
    """Applies the primitive to `statement` on `arrays` (see `make_spec` for the flags). `check_indices=False`
    skips `jinsum.check_indices` (for derived index arrays that mark what is absent with -1)."""
    spec = make_spec(statement, arrays, **flags)
    if check_indices and _config.check_indices.value:
        check_index_arrays(spec, arrays)
    return jinsum_p.bind(*(arrays[n] for n in spec.arguments), spec=spec)


def check_index_arrays(spec: Spec, arrays: Mapping[str, jax.Array]) -> None:
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


jinsum_p = Primitive("jinsum")
jinsum_p.__doc__ = """The primitive every indirect Einsum binds: its parameter `spec` is the checked statement (a
`Spec`), its operands the statement's arrays in `spec.arguments` order. Its JVP, transpose and batching rules (this
module) derive statements and bind it again; its lowerings are registered by `jinsum._lowering`."""


# --- evaluation --------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1024)
def _compiled(spec: Spec):
    return jax.jit(functools.partial(jinsum_p.bind, spec=spec))


def _impl(*arrays, spec: Spec):
    # Eager calls compile the primitive alone, so they take the platform's lowering (Triton on CUDA) as under jit.
    return _compiled(spec)(*arrays)


def _abstract_eval(*avals, spec: Spec):
    order = () if spec.column_order is None else spec.column_order.operands
    captures = tuple(Operand(name, c.shape, np.dtype(c.dtype)) for name, c in zip(
        spec.epilogue_names, spec.epilogue.captures if spec.epilogue else ()))
    for aval, expected in zip(avals, spec.operands + order + captures, strict=True):
        if aval.shape != expected.shape or aval.dtype != expected.dtype:
            raise TypeError(f"jinsum: operand {expected.name} is {aval.str_short()}, but {spec!r} was checked for "
                            f"{expected.dtype}{list(expected.shape)}")
    return varying(spec.lhs.shape, spec.out_dtype, avals)


jinsum_p.def_impl(_impl)
jinsum_p.def_abstract_eval(_abstract_eval)


def apply_epilogue(spec: Spec, out: jax.Array, captures) -> jax.Array:
    """`spec.epilogue` applied to every element of the statement's result `out` (the value in float32, float64 for
    float64 results, and its position), in XLA: the lowerings' path where a kernel does not fuse it, and the
    derivative rules'."""
    value = out.astype(jnp.promote_types(out.dtype, jnp.float32))
    return jnp.broadcast_to(on_grid(spec.epilogue, tuple(captures), value), out.shape).astype(spec.out_dtype)


def split_epilogue(values, spec: Spec):
    """The primitive's operands (or their tangents, batch axes) -> (the statement's, the epilogue's captures)."""
    count = len(spec.epilogue_names)
    return values[:len(values) - count], values[len(values) - count:]


# --- forward-mode differentiation -----------------------------------------------------------------------------
# The statement is linear in its left-hand side and in each factor occurrence. Its tangent is a chain of
# statements on the tangent of the left-hand side: for `+=`, one `+=` term per factor with a tangent; for `=`, the
# first term sets (overwritten elements take the term's tangent) and the others add.

def _jvp(primals, tangents, *, spec: Spec):
    if spec.epilogue is not None:
        return _epilogue_jvp(primals, tangents, spec)
    out = jinsum_p.bind(*primals, spec=spec)
    if spec.winners:  # integers: no tangent
        return out, ad.Zero(jax.typeof(out).to_tangent_aval())
    statement = spec.statement
    env = dict(zip(spec.arguments, primals))
    tangent_of = dict(zip(spec.names, tangents))
    for name in spec.index_tensors:
        if type(tangent_of[name]) is not ad.Zero and tangent_of[name].dtype != jax.dtypes.float0:
            raise TypeError(f"jinsum: {name} is an index array; it cannot be differentiated")
    if statement.reduction != "sum":
        return out, _extremal_tangent(out, env, tangent_of, spec)

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
        tangent = bind(term, arrays, **spec.modes, zero_lhs=k == 0 and type(lhs_tangent) is ad.Zero,
                       column_order=spec.column_order)
    return out, tangent


# A `max=` / `min=` is differentiated at its winners: each output element's tangent is that of the first term
# (in the order of `Spec.winners`) whose product equals the result, or the initial value's where no term reaches it.
# So ties send the whole derivative to one term, and the derivative is exact away from ties. The tangent terms are
# gathers at the winners (`_derive.at_winners`), linear in the factors' tangents, so reverse mode transposes them
# into scatters to the winning entries like any other statement.

def _extremal_tangent(out, env, tangent_of, spec: Spec):
    statement = spec.statement
    lhs = statement.lhs.tensor
    terms = [i for i, f in enumerate(statement.factors) if type(tangent_of[f.tensor]) is not ad.Zero]
    lhs_tangent = tangent_of[lhs]
    if not terms and type(lhs_tangent) is ad.Zero:
        return lhs_tangent
    flags = spec.modes
    winners = bind(statement, {**env, lhs: out}, winners=True, **flags)
    none = winners == WINNER_NONE
    initial = ad.instantiate_zeros(lhs_tangent)
    if not terms:
        return jnp.where(none, initial, 0).astype(out.dtype)
    # Winner `count - a` -> the coordinates of assignment `a` over the reduced variables (row-major); -1 for none,
    # which reads 0 in the tangent terms (and drops their transposes' writes).
    taken = set(spec.names)
    remaining, coordinates = spec.term_count - winners, {}
    for v in reversed(spec.reduced_variables):
        name = _derive.fresh_name(f"{v}_winner", taken)
        taken.add(name)
        coordinates[v] = name
        env[name] = jnp.where(none, -1, remaining % spec.extent[v]).astype(jnp.int32)
        remaining = remaining // spec.extent[v]
    tangent = jnp.zeros(out.shape, out.dtype)
    for k, i in enumerate(terms):
        factor = statement.factors[i]
        name = _derive.fresh_name("d" + factor.tensor, taken)
        term = _derive.at_winners(statement, coordinates, name, i)
        tangent = bind(term, {**env, lhs: tangent, name: ad.instantiate_zeros(tangent_of[factor.tensor])},
                       check_indices=False, zero_lhs=k == 0, **flags)
    # (Where the initial value stands, the terms read nothing; without reduced variables they read anyway.)
    return jnp.where(none, initial, tangent).astype(out.dtype)


# An epilogue is differentiated as what it is, an element-wise function of the statement's result and of the
# arrays it captures: the result and its tangent come from the statement alone (so its kernel stores the result,
# which reverse mode keeps for the epilogue's derivative), then `jax.jvp` of the epilogue in XLA.

def _epilogue_jvp(primals, tangents, spec: Spec):
    statement_primals, captures = split_epilogue(primals, spec)
    statement_tangents, capture_tangents = split_epilogue(tangents, spec)
    out, out_tangent = _jvp(statement_primals, statement_tangents, spec=spec.without_epilogue)
    floating = [k for k, c in enumerate(captures) if jnp.issubdtype(c.dtype, jnp.floating)]

    def epilogue(out, *floats):
        held = list(captures)
        for k, x in zip(floating, floats):
            held[k] = x
        return apply_epilogue(spec, out, held)

    return jax.jvp(epilogue, (out, *(captures[k] for k in floating)),
                   (ad.instantiate_zeros(out_tangent), *(ad.instantiate_zeros(capture_tangents[k]) for k in floating)))


ad.primitive_jvps[jinsum_p] = _jvp


# --- transposition ----------------------------------------------------------------------------------------------
# Linear operands are the left-hand side and at most one factor tensor (occurring once); index arrays and the
# other factors are constants. The cotangent of a factor is the transposed statement (the factor and the output
# swap places); that of the left-hand side is the output cotangent, minus the elements `=` overwrote. A cotangent
# that scatters into a format's columns runs over its entries in column order when the format carries them.

def _transpose(cotangent, *args, spec: Spec):
    statement = spec.statement
    if statement.reduction != "sum" or spec.winners or spec.epilogue is not None:
        raise NotImplementedError(f"jinsum: {spec!r} is not linear in any operand; it cannot be transposed (its "
                                  "derivatives are taken at its winners, by the JVP rule)")
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
                             **dict(spec.modes, sorted_indices=sorted_indices), zero_lhs=True,
                             by_columns=bool(by_columns))
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
        return ad.Zero(varying(spec.lhs.shape, spec.lhs.dtype, [jax.typeof(cotangent)]))
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
    if spec.epilogue is not None:
        return _batch_epilogue(args, dims, spec)
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
    out = bind(statement, env, **dict(spec.modes, sorted_indices=spec.sorted_indices - set(batched)),
               zero_lhs=spec.zero_lhs, column_order=order,  # zeros, broadcast or batched, are zeros
               winners=spec.winners)
    return out, lhs_axis


def _batch_epilogue(args, dims, spec: Spec):
    """The statement batched, then the epilogue mapped over the batch (in XLA: a batch of captures is a batch of
    functions, which one kernel does not apply)."""
    statement_args, captures = split_epilogue(args, spec)
    statement_dims, capture_dims = split_epilogue(dims, spec)
    plain = spec.without_epilogue
    if all(d is None for d in statement_dims):
        out, axis = jinsum_p.bind(*statement_args, spec=plain), None
    else:
        out, axis = _batch(statement_args, statement_dims, spec=plain)
    applied = jax.vmap(lambda out, *captures: apply_epilogue(spec, out, captures), in_axes=(axis, *capture_dims),
                       out_axes=0 if axis is None else axis)
    return applied(out, *captures), 0 if axis is None else axis


batching.primitive_batchers[jinsum_p] = _batch
