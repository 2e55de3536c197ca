"""`jinsum.einsum`: the one entry point, for the indirect notation and for NumPy subscripts over sparse formats."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jinsum import _config
from jinsum._frontend import _format_rewrite
from jinsum._rules import _primitive
from jinsum._lang import (Access, ExpressionError, Statement, Var, _elementwise, check_operand_names,
                          epilogue_names, parse, tensor_names, walk)
from jinsum.formats import BlockGroupCOO, GroupCOO
from jinsum.formats._convert import block_grid

SPARSE_FORMATS = (GroupCOO, BlockGroupCOO)
# What an omitted left-hand side starts from: each reduction's identity (so rows that no term reaches keep it).
IDENTITIES = {"sum": 0, "max": -np.inf, "min": np.inf}


def einsum(expression: str, /, *operands, sorted_indices: Collection[str] = (), allow_tf32: bool | None = None,
           epilogue: Callable | None = None, **named):
    """Evaluates an indirect Einsum, or a NumPy-style einsum whose operands may be sparse formats.

    Indirect notation, operands by name::

        C = einsum("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", C=C, Ai=Ai, Ak=Ak, Av=Av, B=B)
        C = einsum("C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]", C=C, A=adj, B=B)   # adj: GroupCOO -> Ai, Ak, Av

    Index variables on the left (also inside an indirection there) are loop variables; those only on the right
    are summed. `+=` adds into the left-hand side array (duplicate targets accumulate); `=` sets the targets (a
    target hit twice gets one of the values; which one is undefined). The call is functional: it returns the
    updated array. To start from zeros, pass the left-hand side as a `jax.ShapeDtypeStruct` (kernels then
    neither materialise nor read it), or omit it when all its indices are plain variables.

    NumPy subscripts, operands by position, one of them a `GroupCOO`/`BlockGroupCOO`::

        C = einsum("ik,kn->in", adj, B)          # SpMM; also "ik,k->i", "mi,ik->mk", multi-head "ik,khn->ihn"
        S = einsum("ij,ik,jk->ij", adj, X, Y)    # SDDMM: the output takes adj's sparsity (a format is returned)

    Args:
      expression: the statement, e.g. `"C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]"`, or NumPy subscripts.
      *operands: operands of NumPy subscripts.
      sorted_indices: names of 1-D index arrays whose values are non-decreasing; writes through them are sorted
        segment reductions (no atomics on GPUs). A format's row indices (`Ai`) are always included.
      allow_tf32: float32 contractions may use TensorFloat-32 on GPUs (faster, ~1e-3 relative error); None (the
        default) follows `jax.default_matmul_precision` as `jnp.dot` does: TensorFloat-32 unless it is
        `"highest"` or `"float32"`. Without it, generated kernels keep float32's accuracy with three
        TensorFloat-32 products (Triton's `tf32x3`).
      epilogue: `epilogue(value, *position) -> value`, applied to every element of the result before it is stored
        (indirect notation): `value` is the element's result (float32; float64 for float64 results) and `position`
        its index along each dimension of the left-hand side (int32 scalars; `C[Ai[g],n]`: `(value, row, n)`).
        Written with `jax.numpy` on scalars, it may read arrays it closes over with integer scalar indices (a bias
        `b[n]`, a residual `h[row, n]`, a degree scale `s[row]`); those become operands, differentiated like the
        others. On GPUs the kernel applies it in registers where each output element has one writer (no extra
        pass over the output); elsewhere, and under differentiation, it is one element-wise pass after the
        statement. Example, a GCN layer's bias and activation::

            einsum("C[Ai[g],n] += Av[g,p] * H[Ak[g,p],n]", A=adj, H=h,
                   epilogue=lambda c, row, n: jax.nn.relu(c + bias[n]))
      **named: the tensors of the indirect notation. A format passed as `A=` binds `Ai`, `Ak` and `Av`.

    Returns:
      The new left-hand side array (or, for NumPy subscripts with sparse output, a format of the same structure).

    Raises:
      ExpressionError: the expression or the operands are malformed (the message points into the expression): also
        an operand the expression names but the call does not pass, one passed that the expression does not name
        (a typo would otherwise drop an array silently), and a format passed where the expression reads an array.
      ValueError: a concrete index array holds an out-of-range index. Under `jit`, indices cannot be checked: an
        out-of-range read gives 0 and an out-of-range write is dropped. A format operand is checked by its shape,
        traced or not: its rows (columns) must fit the dimension its `Ai` (`Ak`) address. Also a format whose
        `overflow` flag is concrete and set (built for a capacity under `jit` and returned, entries dropped);
        inside `jit` the flag is traced and not read.
    """
    if not isinstance(expression, str):
        raise TypeError(f"jinsum: the expression must be a string, got {type(expression).__name__}")
    if not any(c in expression for c in "[]="):  # NumPy subscripts (`ik,kn->in`) have no brackets and no `=`
        if named:
            raise TypeError(f"jinsum: NumPy-style subscripts {expression!r} take operands by position; got "
                            f"keyword operands {sorted(named)}")
        if epilogue is not None:
            raise TypeError(f"jinsum: an epilogue needs the indirect notation, whose left-hand side names the "
                            f"positions it receives; {expression!r} is NumPy subscripts")
        return _format_rewrite.numpy_einsum(expression, operands, allow_tf32=allow_tf32)
    if operands:
        raise TypeError("jinsum: the indirect notation takes operands by name, e.g. einsum(expr, C=C, B=B); got "
                        f"{len(operands)} positional operand(s)")
    statement, arrays, flags = prepare(expression, named, sorted_indices=sorted_indices, allow_tf32=allow_tf32)
    if epilogue is not None and arrays[statement.lhs.tensor].size:  # (an empty result has no element to apply it
        # to, and a capture sized by it, a bias per group of no groups, no element for the tracer to read)
        traced, captured = _elementwise.trace(epilogue, "epilogue", "jinsum.einsum", len(statement.lhs.indices))
        flags["epilogue"] = traced
        arrays.update(zip(epilogue_names(len(captured)), captured))
    return _primitive.bind(statement, arrays, **flags)


def prepare(expression: str, named: Mapping, *, sorted_indices: Collection[str] = (),
            allow_tf32: bool | None = None):
    """Parses, expands format operands, fills an omitted left-hand side and validates concrete index arrays.

    Returns `(statement, arrays, flags)` ready for `_primitive.bind(statement, arrays, **flags)`.
    """
    statement = parse(expression)
    arrays, extents, row_indices, orders = _expand_formats(named, entries_only=statement.reduction != "sum")
    _check_operand_names(statement, named, arrays)
    lhs = statement.lhs.tensor
    fill = lhs not in arrays or isinstance(arrays[lhs], jax.ShapeDtypeStruct)
    if lhs not in arrays:
        arrays[lhs] = _zeros_lhs(statement, arrays)
    if fill:  # the reduction's identity: zeros for a sum, which the kernels need not read
        arrays[lhs] = jnp.full(arrays[lhs].shape, IDENTITIES[statement.reduction], arrays[lhs].dtype)
    zero_lhs = fill and statement.reduction == "sum"
    arrays = {name: jnp.asarray(value) for name, value in arrays.items()}
    _check_index_values(statement, arrays, extents)
    _check_sorted(sorted_indices, arrays)
    # A format's entries in column order serve the derivatives (one format's: the primitive takes one order).
    return statement, arrays, dict(sorted_indices=frozenset(sorted_indices) | row_indices,
                                   allow_tf32=_config.tf32_allowed(allow_tf32),
                                   zero_lhs=zero_lhs, column_order=orders[0] if len(orders) == 1 else None)


def _expand_formats(named: Mapping, entries_only: bool = False) -> tuple[dict, dict, set[str], list]:
    """Replaces each format operand `A` by `Ai`, `Ak`, `Av` (and `A_columns`, `A_rows`, `A_slots` where it carries
    its entries in column order). With `entries_only` (a `max=` / `min=`), `Ak` is -1 at slots whose value is zero,
    so that group padding takes no part in the reduction.

    Returns the arrays, the extents of the formats' index arrays (`{"Ai": (M, "A= ...", "rows"), ...}`: their values
    lie below it, which the format's constructor checked), the names of row index arrays (sorted by the format's
    definition) and the column orders of the formats that carry one.
    """
    arrays, extents, rows, orders = {}, {}, set(), []
    for name, value in named.items():
        if not isinstance(value, SPARSE_FORMATS):
            arrays[name] = value
            continue
        parts = _format_rewrite.format_arrays(value, name)
        if entries_only:
            parts[name + "k"] = _entry_columns(value)
        clash = sorted(set(parts) & set(named))
        if clash:
            raise TypeError(f"jinsum: format operand {name}= expands to {sorted(parts)}, which clashes with the "
                            f"operand(s) {clash}; rename one of them")
        arrays.update(parts)
        grid = value.shape[:2] if isinstance(value, GroupCOO) else block_grid(value.shape, value.block_shape)
        units = ("rows", "columns") if isinstance(value, GroupCOO) else ("block rows", "block columns")
        what = f"{name}= (a {type(value).__name__} of shape {value.shape})"
        extents.update({name + "i": (grid[0], what, units[0]), name + "k": (grid[1], what, units[1])})
        rows.add(name + "i")
        if getattr(value, "transposed", None) is not None:
            order, entries = _format_rewrite.column_order(value, name)
            if not set(entries) & set(named):  # (names the user took: the derivatives do without the order)
                arrays.update(entries)
                orders.append(order)
    return arrays, extents, rows, orders


def _entry_columns(A: GroupCOO | BlockGroupCOO) -> jax.Array:
    """`A.Ak` with -1 (addressing nothing) at the slots whose values are all zero: group padding, and explicit zeros,
    which the formats' converters drop anyway."""
    values = jnp.moveaxis(A.Av, -1, 1) if isinstance(A, BlockGroupCOO) else A.Av  # (G, P, ...): a slot's values
    nonzero = (values != 0).reshape(*A.Ak.shape, math.prod(values.shape[2:])).any(axis=-1)
    return jnp.where(nonzero, A.Ak, -1).astype(A.Ak.dtype)


def _check_operand_names(statement: Statement, named: Mapping, arrays: Mapping) -> None:
    """Before anything is traced: every tensor of the statement is given (the left-hand side may be omitted), every
    operand appears, and formats are passed under a name whose arrays (`Ai`, `Ak`, `Av`) the statement reads."""
    names = tensor_names(statement)
    formats = {name: value for name, value in named.items() if isinstance(value, SPARSE_FORMATS)}
    for name, value in named.items():
        if value is None:
            raise ExpressionError(f"jinsum: operand {name}= is None; pass an array", statement.source)
        if name in formats and name in names:
            node = next(n for access in statement.accesses for n in walk(access) if n.tensor == name)
            stem = name[:-1]
            if {stem + "i", stem + "k", stem + "v"} & set(names) - {name}:
                raise ExpressionError(
                    f"jinsum: {name}= is a {type(value).__name__}, where the expression reads an array; pass the "
                    f"format as {stem}=, which binds {stem}i, {stem}k and {stem}v (its row indices, column indices "
                    "and values)", statement.source, node.span)
            raise ExpressionError(
                f"jinsum: {name}= is a {type(value).__name__}, which binds {name}i, {name}k and {name}v (its row "
                f"indices, column indices and values): name those in the expression, as in "
                f"C[{name}i[g],n] += {name}v[g,p] * B[{name}k[g,p],n], or use NumPy subscripts, "
                f"einsum('ik,kn->in', {name}, B)", statement.source, node.span)
    for name in formats:
        if not {name + "i", name + "k", name + "v"} & set(names):
            raise ExpressionError(f"jinsum: format operand {name}= binds {name}i, {name}k and {name}v, none of "
                                  f"which appear in the expression, whose operands are {list(names)}",
                                  statement.source)
    parts = set(arrays) - set(named)  # a format's arrays: those the statement does not read are not typos
    check_operand_names(statement, arrays, may_omit=(statement.lhs.tensor,), unused_ok=parts)


def _zeros_lhs(statement: Statement, arrays: Mapping) -> jax.Array:
    lhs = statement.lhs
    extents = {}
    for factor in statement.factors:
        for node in walk(factor):
            if node.tensor in arrays and len(np.shape(arrays[node.tensor])) == len(node.indices):
                for dim, index in enumerate(node.indices):
                    if isinstance(index, Var):
                        extents.setdefault(index.name, np.shape(arrays[node.tensor])[dim])
    unknown = [i for i in lhs.indices if not isinstance(i, Var) or i.name not in extents]
    if unknown:
        raise ExpressionError(
            f"jinsum: pass {lhs.tensor}=..., the array to write into: the size of its index {unknown[0]} cannot be "
            "inferred from the right-hand side", statement.source, unknown[0].span)
    dtype = jnp.result_type(*(arrays[f.tensor] for f in statement.factors if f.tensor in arrays))
    return jnp.zeros([extents[i.name] for i in lhs.indices], dtype)


def _check_index_values(statement: Statement, arrays: Mapping[str, jax.Array], extents: Mapping[str, tuple]) -> None:
    """On concrete index arrays, that every index is in range of the dimension it addresses; for a format's index
    arrays (`extents`), whose values its constructor checked against its own shape, traced or not, that the dimension
    holds the format's extent: a larger format would read past a dense operand (0) or write past the result (dropped),
    where `A @ B` and NumPy subscripts refuse mismatched shapes."""
    for access in statement.accesses:
        for node in walk(access):
            for dim, index in enumerate(node.indices):
                if not isinstance(index, Access) or node.tensor not in arrays:
                    continue
                bound = np.shape(arrays[node.tensor])[dim] if dim < np.ndim(arrays[node.tensor]) else None
                if index.tensor in extents:
                    extent, what, units = extents[index.tensor]
                    if bound is not None and extent > bound:
                        raise ValueError(
                            f"jinsum: {what} has {extent} {units}, addressed by {index.tensor} in {node}, but "
                            f"dimension {dim} of {node.tensor} (shape {np.shape(arrays[node.tensor])}) has only "
                            f"{bound}; pass {node.tensor} with at least {extent} along that dimension, or a format "
                            "whose shape matches")
                    continue
                values = arrays.get(index.tensor)
                if values is None or isinstance(values, jax.core.Tracer):
                    continue
                values = np.asarray(values)
                if bound is None or not np.issubdtype(values.dtype, np.integer) or values.size == 0:
                    continue  # the checker reports rank and dtype errors with a caret
                bad = (values < 0) | (values >= bound)
                if bad.any():
                    where = tuple(int(k) for k in np.argwhere(bad)[0])
                    raise ValueError(
                        f"jinsum: index array {index.tensor} holds {values[where]} at position {where}, out of range "
                        f"for dimension {dim} of {node.tensor} (shape {np.shape(arrays[node.tensor])}) in {node}; "
                        f"every index there must lie in [0, {bound})")


def _check_sorted(names: Collection[str], arrays: Mapping[str, jax.Array]) -> None:
    """On concrete arrays, that the ones claimed sorted are 1-D and non-decreasing."""
    for name in names:
        if name not in arrays:
            raise ValueError(f"jinsum: sorted_indices names {name!r}, which is not an operand")
        values = arrays[name]
        if isinstance(values, jax.core.Tracer):
            continue
        values = np.asarray(values)
        if values.ndim != 1 or (values.size > 1 and (np.diff(values) < 0).any()):
            raise ValueError(f"jinsum: sorted_indices claims {name} (shape {values.shape}) is sorted, but it is not a "
                             "non-decreasing 1-D array")

