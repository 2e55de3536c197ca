"""The reference lowering, used on every platform: gather, contract, scatter, in plain XLA ops.

1. Each factor is read at every assignment of its own variables: a gather through its index arrays, with plain
   variables kept as slices (no copy) unless an indirection in the same access also uses them.
2. The factors are contracted with one `einsum` into the loop variables that occur on the right (the summed
   variables disappear here), accumulating in float32 for 16-bit inputs.
3. The result is added (`+=`) or set (`=`) into the left-hand side through its index arrays: one scatter, marked
   sorted when it goes through a sorted index array (a format's rows): a sorted segment reduction.

Out-of-range and negative indices never fault: a read through one gives 0 (an index array read there gives an
out-of-range index, so the outer access is out of range too), and a write through one is dropped. The Triton
lowering does the same.

`max=` and `min=` (`_extremal`) take the product at every assignment of all the variables, with the terms that
read out of range replaced by the reduction's identity (they take no part), and reduce it into the left-hand side
with one scatter-max or -min; their `winners` compare each term with the result at its target instead.
"""

from __future__ import annotations

import functools
import math
import operator
import string

import jax
import jax.numpy as jnp
from jax import lax

from jinsum._lang import Access, Spec, Var

Labelled = tuple[jax.Array, tuple[str, ...]]  # an array and the index variable of each of its axes


def evaluate(*arrays: jax.Array, spec: Spec, widen_halves: bool = False) -> jax.Array:
    """The value of the checked statement `spec` on `arrays` (in `spec.names` order). With `widen_halves`, 16-bit
    factors are cast to float32 before a contraction (the same products and sums: XLA's CPU dot has no
    half-precision inputs with a float32 result)."""
    env = dict(zip(spec.names, arrays))
    statement = spec.statement
    if statement.reduction != "sum":
        return _extremal(env, spec)
    terms = [_read(factor, env, spec) for factor in statement.factors]
    every = tuple(dict.fromkeys(v for _, axes in terms for v in axes))
    scatters = statement.accumulate and any(isinstance(i, Access) for i in statement.lhs.indices)
    summed = math.prod(spec.extent[v] for v in spec.summed_variables)
    matmul = sum(any(v in spec.summed_variables for v in axes) for _, axes in terms) > 1
    if (scatters and matmul and summed <= 16
            and math.prod(spec.extent[v] for v in every) <= max(a.size for a, _ in terms)):
        # Few summed terms per output element (SpMM over a group) and products no larger than the largest
        # gathered factor: multiply elementwise and let the scatter sum the summed variables too, as the
        # segment_sum idiom does. A contraction first would run tiny batched matrix products (slow on CPUs).
        # Where one factor alone carries the summed variables (a row sum, `D[Ai[g]] += Av[g,p]`), contracting
        # first is a plain reduction, and the scatter adds one value per group instead of one per entry, whose
        # atomics on a hub row's address serialise (a power-law graph's degrees: a few percent of a GraphSAGE
        # step; benchmarks/README.md, "GNN training steps (`benchmarks/training.py`)").
        accumulator = jnp.promote_types(jnp.result_type(*(a.dtype for a, _ in terms)), jnp.float32)
        product = math.prod(_align(array.astype(accumulator), axes, every) for array, axes in terms)
        product = jnp.broadcast_to(product, [spec.extent[v] for v in every])
        return _write(product, every, env, spec, summed=tuple(v for v in every if v in spec.summed_variables))
    out_axes = tuple(v for v in spec.loop_variables if v in every)
    if widen_halves:
        terms = [(array.astype(jnp.promote_types(array.dtype, jnp.float32)), axes) for array, axes in terms]
    return _write(_contract(terms, out_axes, spec), out_axes, env, spec)


def _extremal(env: dict[str, jax.Array], spec: Spec) -> jax.Array:
    """A `max=` / `min=`, or its winners (see `Spec.winners`)."""
    statement = spec.statement
    every = tuple(spec.extent)  # all the variables: the product at every assignment
    shape = [spec.extent[v] for v in every]
    terms = [_read(factor, env, spec) for factor in statement.factors]
    accumulator = jnp.promote_types(jnp.result_type(*(a.dtype for a, _ in terms)), jnp.float32)
    product = jnp.broadcast_to(math.prod(_align(a.astype(accumulator), axes, every) for a, axes in terms), shape)
    valid = jnp.broadcast_to(functools.reduce(operator.and_, (_align(m, axes, every) for m, axes in (
        _in_range(access, env, spec) for access in statement.accesses))), shape)
    target = env[statement.lhs.tensor]
    if spec.winners:
        result, axes = _read(statement.lhs, env, spec)
        wins = valid & (product.astype(target.dtype) == _align(result, axes, every))
        assignment = sum(lax.broadcasted_iota(jnp.int32, shape, every.index(v)) * stride
                         for v, stride in zip(spec.reduced_variables, _strides(spec)))
        values, target = jnp.where(wins, spec.term_count - assignment, 0), jnp.zeros(spec.lhs.shape, jnp.int32)
        reduce, combine = jnp.max, "max"
    else:
        identity = -jnp.inf if statement.reduction == "max" else jnp.inf
        values = jnp.where(valid, product, identity).astype(target.dtype)
        reduce, combine = (jnp.max, "max") if statement.reduction == "max" else (jnp.min, "min")
    summed = tuple(v for v in every if v in spec.summed_variables)
    indexer, target_axes = _indexer(statement.lhs, env, spec, extra=summed)
    if all(isinstance(i, slice) for i in indexer):  # the left-hand side addressed directly: reduce, then combine
        kept = tuple(v for v in every if v not in summed)
        values = _align(reduce(values, axis=tuple(every.index(v) for v in summed)), kept, target_axes)
        return getattr(jnp, "maximum" if combine == "max" else "minimum")(target, values).astype(target.dtype)
    scatter = target.at[indexer]
    return getattr(scatter, combine)(_align(values, every, target_axes), mode="drop",
                                     indices_are_sorted=spec.lhs_sorted_index is not None)


def _strides(spec: Spec) -> list[int]:
    """Row-major strides of the reduced variables (the flat numbering of a reduction's terms)."""
    extents = [spec.extent[v] for v in spec.reduced_variables]
    return [math.prod(extents[k + 1:]) for k in range(len(extents))]


def _in_range(access: Access, env: dict[str, jax.Array], spec: Spec) -> Labelled:
    """Where `access` reads (or writes) in range: every index its indirections give addresses its dimension (an
    index array read out of range gives an out-of-range index, so nested indirections need no more)."""
    shape = spec.operand[access.tensor].shape
    mask, axes = jnp.ones((), bool), ()
    for d, index in enumerate(access.indices):
        if isinstance(index, Access):
            positions, positions_axes = _read(index, env, spec)
            every = tuple(dict.fromkeys(axes + positions_axes))
            mask = _align(mask, axes, every) & _align((positions >= 0) & (positions < shape[d]), positions_axes, every)
            axes = every
    return mask, axes


def _read(access: Access, env: dict[str, jax.Array], spec: Spec) -> Labelled:
    indexer, axes = _indexer(access, env, spec)
    array = env[access.tensor]
    if all(isinstance(i, slice) for i in indexer):
        return array, axes
    # An index array read out of range yields an out-of-range index, so the access it feeds reads 0 / drops too.
    fill = jnp.iinfo(array.dtype).max if jnp.issubdtype(array.dtype, jnp.integer) else 0
    return array.at[indexer].get(mode="fill", fill_value=fill), axes


def _indexer(access: Access, env: dict[str, jax.Array], spec: Spec,
             extra: tuple[str, ...] = ()) -> tuple[tuple, tuple[str, ...]]:
    """The NumPy-style index for `access` and the variables labelling the axes of the indexed result.

    Indirect positions become integer arrays. A plain variable that an indirection in the same access also uses
    must be advanced-indexed too (an `arange`), so that both positions follow one axis instead of forming an
    outer product; other plain variables stay slices. `extra` variables (absent from the access) become axes of
    the advanced indices, so that a scatter adds every value along them into the same element.
    """
    shape = spec.operand[access.tensor].shape
    indirect = {d: _read(i, env, spec) for d, i in enumerate(access.indices) if isinstance(i, Access)}
    shared = {v for _, axes in indirect.values() for v in axes}
    advanced = [d for d, i in enumerate(access.indices) if isinstance(i, Access) or i.name in shared]
    if not advanced:
        return (slice(None),) * len(shape), tuple(i.name for i in access.indices)

    advanced_axes = tuple(dict.fromkeys(
        [v for d in advanced for v in (indirect[d][1] if d in indirect else (access.indices[d].name,))]
        + list(extra)))
    advanced_shape = [spec.extent[v] for v in advanced_axes]
    indexer = []
    for d, index in enumerate(access.indices):
        if d not in advanced:
            indexer.append(slice(None))
            continue
        if isinstance(index, Var):
            positions, axes = jnp.arange(spec.extent[index.name]), (index.name,)
        else:
            positions, axes = indirect[d]
            positions = jnp.where(positions < 0, shape[d], positions)  # negative is out of range, never wraps
        positions = _align(positions, axes, advanced_axes)
        indexer.append(jnp.broadcast_to(positions, advanced_shape) if extra else positions)

    sliced = [(d, i.name) for d, i in enumerate(access.indices) if d not in advanced]
    if advanced[-1] - advanced[0] + 1 == len(advanced):  # NumPy keeps adjacent advanced axes in place
        axes = (*(v for d, v in sliced if d < advanced[0]), *advanced_axes,
                *(v for d, v in sliced if d > advanced[-1]))
    else:
        axes = (*advanced_axes, *(v for _, v in sliced))
    return tuple(indexer), axes


def _align(array: jax.Array, axes: tuple[str, ...], target: tuple[str, ...]) -> jax.Array:
    """`array` with its axes reordered to follow `target`, and a unit axis for each variable it lacks."""
    present = [v for v in target if v in axes]
    array = jnp.transpose(array, [axes.index(v) for v in present])
    return lax.expand_dims(array, [k for k, v in enumerate(target) if v not in axes])


def _contract(terms: list[Labelled], out_axes: tuple[str, ...], spec: Spec) -> jax.Array:
    letters = dict(zip(dict.fromkeys(v for _, axes in terms for v in axes), string.ascii_letters))
    subscripts = ",".join("".join(letters[v] for v in axes) for _, axes in terms)
    subscripts += "->" + "".join(letters[v] for v in out_axes)
    dtype = jnp.result_type(*(array.dtype for array, _ in terms))
    return jnp.einsum(
        subscripts,
        *(array for array, _ in terms),
        precision=lax.Precision.DEFAULT if spec.allow_tf32 else lax.Precision.HIGHEST,
        preferred_element_type=jnp.promote_types(dtype, jnp.float32),
    )


def _write(values: jax.Array, axes: tuple[str, ...], env: dict[str, jax.Array], spec: Spec,
           summed: tuple[str, ...] = ()) -> jax.Array:
    """Adds or sets `values` (labelled by `axes`) into the left-hand side; `summed` variables are summed by the
    scatter itself (only for a left-hand side written through an index array)."""
    statement = spec.statement
    target = env[statement.lhs.tensor]
    indexer, target_axes = _indexer(statement.lhs, env, spec, extra=summed)
    values = _align(values, axes, target_axes)  # unit axes broadcast over variables only on the left
    if all(isinstance(i, slice) for i in indexer):
        if statement.accumulate:
            return (target + values).astype(target.dtype)
        return jnp.broadcast_to(values, target.shape).astype(target.dtype)
    values = values.astype(target.dtype)
    if statement.accumulate:
        return target.at[indexer].add(values, mode="drop", indices_are_sorted=spec.lhs_sorted_index is not None)
    return target.at[indexer].set(values, mode="drop")
