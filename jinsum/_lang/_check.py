"""`Statement` + operand shapes and dtypes -> `Spec`: the checked, hashable description of one indirect Einsum.

A `Spec` is the only parameter of the jinsum primitive. It fixes the operand order, every index variable's extent,
and which operands are index arrays. Checking is cached on (statement, shapes, dtypes, flags), so a jitted step
that calls `einsum` with the same expression and shapes pays for it once.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Collection

import numpy as np
import jax.numpy as jnp

from jinsum._lang._ast import (
    Access,
    Statement,
    Var,
    index_tensor_names,
    statement_variables,
    tensor_names,
    variables,
    walk,
)
from jinsum._lang._elementwise import Elementwise
from jinsum._lang._errors import ExpressionError

VALUE_DTYPES = tuple(np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))


@dataclasses.dataclass(frozen=True)
class Operand:
    """A named array as the checker sees it: only its shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class ColumnOrder:
    """A format's stored entries in column order (a `GroupCOO.transposed`), passed to the primitive after the
    statement's operands: a transpose that scatters into the format's columns uses it to write each column once
    (`_derive.by_columns`) instead of adding every entry atomically.

    Attributes:
      values, rows_index, columns_index: the format's arrays in the statement (`Av[g,p,...]`, `Ai[g]`, `Ak[g,p]`).
      columns, rows, slots: the grouped transpose of a `TransposedIndex`, integer operands `(H,)`, `(H, Q)` and
        `(H, Q)`: group `h` of column `columns[h]` holds the entries of rows `rows[h]` at flat slots `slots[h]`
        (`g * P + p`; -1 for padding).
    """

    values: str
    rows_index: str
    columns_index: str
    columns: Operand
    rows: Operand
    slots: Operand

    @property
    def operands(self) -> tuple[Operand, Operand, Operand]:
        return self.columns, self.rows, self.slots


@dataclasses.dataclass(frozen=True)
class Spec:
    """A checked indirect Einsum: the statement, its operands in primitive order, and every index extent.

    Attributes:
      statement: the parsed statement.
      operands: one per tensor name, in order of first appearance; `operands[0]` is the left-hand side.
      extents: `(variable, extent)` for every index variable, in order of first appearance.
      sorted_indices: 1-D index arrays whose values are known to be non-decreasing (a format's row indices).
        A left-hand side written through one of them is a sorted segment reduction.
      allow_tf32: float32 contractions may use TensorFloat-32 (faster on GPUs, ~1e-3 relative error).
      zero_lhs: the left-hand side operand is all zeros (jinsum made it: an omitted left-hand side, a format's
        product, a cotangent), so a kernel need not read it.
      column_order: the entries of the statement's format in column order, as three more operands (`arguments`),
        or None. Only the derivative rules read them.
      deterministic: bitwise-reproducible kernels, with no float atomics (`jinsum.deterministic`).
      winners: for a `max=` / `min=` statement, the primitive returns where each element's result came from
        instead of the result, which the left-hand side operand then holds (the derivative rules' first step): an
        int32 array of the left-hand side's shape, `WINNER_NONE` where no term reaches the result (the initial
        value stands), else `count - a` for the first assignment `a` (flat over `reduced_variables`, row-major)
        whose product equals the result, with `count` the number of assignments. The first is the largest, so
        kernels combine with a maximum, and zeros (a zero-filled output) mean none.
      by_columns: the statement is a derivative over a format's entries in column order (`_derive.by_columns`),
        written through the sorted column index: a column of a hub repeats thousands of times, which a kernel
        sums in registers and XLA's scatter adds atomically, one contended address at a time.
      epilogue: a traced element-wise function applied to every element of the result before it is stored,
        `value = epilogue(value, *position)` (`_lang._elementwise`), or None. The arrays it captures are the
        primitive's last operands (`epilogue_names`). Kernels apply it in registers where each output element
        has one writer; elsewhere, and under differentiation, it is an element-wise pass after the statement.
    """

    statement: Statement
    operands: tuple[Operand, ...]
    extents: tuple[tuple[str, int], ...]
    sorted_indices: frozenset[str] = frozenset()
    allow_tf32: bool = False
    zero_lhs: bool = False
    column_order: ColumnOrder | None = None
    deterministic: bool = False
    winners: bool = False
    by_columns: bool = False
    epilogue: Elementwise | None = None

    def __repr__(self) -> str:  # short: this is what a printed jaxpr shows for the primitive's parameter
        return f"Spec({str(self.statement)!r})"

    @functools.cached_property
    def extent(self) -> dict[str, int]:
        return dict(self.extents)

    @functools.cached_property
    def operand(self) -> dict[str, Operand]:
        return {o.name: o for o in self.operands}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.operands)

    @property
    def modes(self) -> dict:
        """The flags a statement derived from this one inherits (keywords of `make_spec`): its sorted index arrays,
        TensorFloat-32, deterministic mode. (Zeros on the left, a column order, winners and the rest are each
        derived statement's own.)"""
        return dict(sorted_indices=self.sorted_indices, allow_tf32=self.allow_tf32, deterministic=self.deterministic)

    @property
    def arguments(self) -> tuple[str, ...]:
        """The primitive's operands: the statement's (`names`), then those of `column_order`, then the arrays the
        epilogue captures (`epilogue_names`)."""
        order = () if self.column_order is None else tuple(o.name for o in self.column_order.operands)
        return self.names + order + self.epilogue_names

    @property
    def epilogue_names(self) -> tuple[str, ...]:
        """The names the epilogue's captured arrays go by among the primitive's operands (and kernel arguments)."""
        return epilogue_names(len(self.epilogue.captures) if self.epilogue else 0)

    @property
    def without_epilogue(self) -> Spec:
        """The statement alone: what the epilogue is applied to."""
        return dataclasses.replace(self, epilogue=None)

    @property
    def lhs(self) -> Operand:
        return self.operands[0]

    @functools.cached_property
    def index_tensors(self) -> frozenset[str]:
        return index_tensor_names(self.statement)

    @functools.cached_property
    def lhs_sorted_index(self) -> str | None:
        """The sorted index array through which the left-hand side is written, if that is its only indirection.

        Then the writes are a sorted segment reduction: consecutive assignments hit the same or later rows.
        """
        indirect = [i for i in self.statement.lhs.indices if isinstance(i, Access)]
        if len(indirect) != 1 or indirect[0].tensor not in self.sorted_indices:
            return None
        [var] = indirect[0].indices  # sorted index arrays are 1-D
        if isinstance(var, Access):
            return None
        return indirect[0].tensor

    @functools.cached_property
    def loop_variables(self) -> tuple[str, ...]:
        """Variables on the left-hand side (also inside its indirections): one output element per assignment."""
        return variables(self.statement.lhs)

    @functools.cached_property
    def summed_variables(self) -> tuple[str, ...]:
        """Variables only on the right: summed over (reduced by the statement's reduction)."""
        loop = set(self.loop_variables)
        return tuple(v for v in statement_variables(self.statement) if v not in loop)

    @functools.cached_property
    def reduced_variables(self) -> tuple[str, ...]:
        """Variables that do not name a left-hand side position directly: those inside its indirections and the
        summed ones. A reduction's terms for one output element differ in these (its `winners` are flat over them)."""
        plain = {i.name for i in self.statement.lhs.indices if isinstance(i, Var)}
        return tuple(v for v in statement_variables(self.statement) if v not in plain)

    @functools.cached_property
    def term_count(self) -> int:
        """The assignments of the reduced variables: how many terms may reach one output element."""
        return int(np.prod([self.extent[v] for v in self.reduced_variables], dtype=np.int64))

    @property
    def out_dtype(self) -> np.dtype:
        """The dtype of the primitive's result: the left-hand side's, or int32 for `winners`."""
        return np.dtype(np.int32) if self.winners else self.lhs.dtype


def epilogue_names(count: int) -> tuple[str, ...]:
    """The operand names of an epilogue's `count` captured arrays."""
    return tuple(f"epilogue{k}" for k in range(count))


def _fail(statement: Statement, message: str, node: Access | Var | None = None) -> ExpressionError:
    return ExpressionError(f"jinsum: {message}", statement.source, node.span if node is not None else None)


def _describe(operand: Operand) -> str:
    return f"{operand.name} (shape {operand.shape}, {operand.dtype})"


def check_operand_names(statement: Statement, given: Collection[str], *, may_omit: Collection[str] = (),
                        unused_ok: Collection[str] = ()) -> None:
    """That every tensor of the statement is given and every given name is one of them.

    `may_omit`: names the caller fills in itself (an omitted left-hand side); `unused_ok`: given names that need
    not appear (a format's parts beyond those the statement reads). An unused name is an error, not a warning:
    it is most often a typo (`b=` beside `B=`) whose array would be silently dropped.

    Raises:
      ExpressionError: naming the first missing tensor (caret under its first use) or the unused names, with the
        closest name on the other side as a suggestion.
    """
    names = tensor_names(statement)
    unused = sorted(set(given) - set(names) - set(unused_ok))
    for access in statement.accesses:
        for node in walk(access):
            if node.tensor not in given and node.tensor not in may_omit:
                hint = _closest(node.tensor, unused)
                raise _fail(statement, f"unknown operand '{node.tensor}': pass it by name, e.g. "
                            f"einsum(expr, {node.tensor}=...); got operands {sorted(given)}"
                            + (f" (did you mean to pass {hint}= as {node.tensor}=?)" if hint else ""), node)
    if unused:
        hints = [f"{name}= (did you mean {hint}=?)" if (hint := _closest(name, names)) else f"{name}="
                 for name in unused]
        raise _fail(statement, f"operand(s) {', '.join(hints)} do not appear in the expression, whose operands are "
                    f"{list(names)}; remove them or fix their names")


def _closest(name: str, candidates: Collection[str]) -> str | None:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    if not match and name.lower() in {c.lower() for c in candidates}:
        match = [c for c in candidates if c.lower() == name.lower()]
    return match[0] if match else None


WINNER_NONE = 0  # a `winners` element where no term reaches the result


@functools.lru_cache(maxsize=4096)
def check(statement: Statement, operands: tuple[Operand, ...], sorted_indices: frozenset[str] = frozenset(),
          allow_tf32: bool = False, zero_lhs: bool = False, column_order: ColumnOrder | None = None,
          deterministic: bool = False, winners: bool = False, by_columns: bool = False,
          epilogue: Elementwise | None = None) -> Spec:
    """Binds operands to a statement and validates everything that can be known before tracing.

    Args:
      statement: a parsed statement.
      operands: the arrays bound to the statement's tensor names, in any order.
      sorted_indices, allow_tf32, zero_lhs, column_order, deterministic, winners, by_columns, epilogue: see
        `Spec`.

    Raises:
      ExpressionError: an unknown or unused operand, a wrong rank, a non-integer index array, a non-floating value
        operand, an index variable with two extents, a repeated index in one access, the left-hand side
        tensor used on the right, or a `max=` / `min=` over independent factors.
    """
    by_name = {o.name: o for o in operands}
    check_operand_names(statement, by_name)
    names = tensor_names(statement)

    lhs = statement.lhs
    index_tensors = index_tensor_names(statement)
    value_tensors = {f.tensor for f in statement.factors}
    lhs_uses = [node for access in statement.accesses for node in walk(access) if node.tensor == lhs.tensor]
    if len(lhs_uses) > 1:
        raise _fail(statement, f"the left-hand side tensor '{lhs.tensor}' is used again in the expression; pass a "
                    "copy under another name", lhs_uses[1])

    for access in statement.accesses:
        for node in walk(access):
            operand = by_name[node.tensor]
            if len(node.indices) != len(operand.shape):
                raise _fail(statement, f"{_describe(operand)} has {len(operand.shape)} dimension(s) but "
                            f"{node} gives {len(node.indices)} index(es)", node)
            names_here = [i.name for i in node.indices if isinstance(i, Var)]
            for i in node.indices:
                if isinstance(i, Var) and names_here.count(i.name) > 1:
                    raise _fail(statement, f"index '{i.name}' appears twice in {node}: diagonals are not "
                                "supported (gather the diagonal first)", i)
            is_index = node.tensor in index_tensors
            if is_index and node.tensor in value_tensors | {lhs.tensor}:
                raise _fail(statement, f"'{node.tensor}' is used both as an index array and as a value", node)
            if is_index and not np.issubdtype(operand.dtype, np.integer):
                raise _fail(statement, f"index array {_describe(operand)} must have an integer dtype "
                            f"(cast it with .astype(jnp.int32))", node)
            if not is_index and operand.dtype not in VALUE_DTYPES:
                raise _fail(statement, f"value operand {_describe(operand)} must be float16, bfloat16, float32 or "
                            "float64", node)

    extents: dict[str, tuple[int, Access]] = {}
    for access in statement.accesses:
        for node in walk(access):
            shape = by_name[node.tensor].shape
            for dim, index in enumerate(node.indices):
                if not isinstance(index, Var):
                    continue
                if index.name not in extents:
                    extents[index.name] = (shape[dim], node)
                elif extents[index.name][0] != shape[dim]:
                    first, where = extents[index.name]
                    raise _fail(statement, f"index '{index.name}' has extent {first} in {where} "
                                f"({_describe(by_name[where.tensor])}) but {shape[dim]} in {node} "
                                f"({_describe(by_name[node.tensor])})", index)

    if statement.reduction != "sum":
        _check_extremal(statement)
    if winners and statement.reduction == "sum":
        raise ValueError(f"jinsum: winners are defined for max= and min= statements, not {statement}")
    ordered = tuple(by_name[n] for n in names)
    ordered_extents = tuple((v, extents[v][0]) for v in statement_variables(statement))
    # Only 1-D index arrays of this statement can be sorted; dropping the rest keeps equal Specs equal.
    sorted_indices = frozenset(n for n in sorted_indices if n in index_tensors and len(by_name[n].shape) == 1)
    spec = Spec(statement, ordered, ordered_extents, sorted_indices, bool(allow_tf32), bool(zero_lhs),
                _column_order(column_order, by_name, index_tensors), bool(deterministic), bool(winners),
                bool(by_columns), epilogue)
    if epilogue is not None:
        _check_epilogue(statement, spec, epilogue)
    if winners and spec.term_count >= 2**31:
        raise NotImplementedError(f"jinsum: the derivative of {statement} numbers its terms per output element "
                                  f"over {spec.reduced_variables} in int32; there are 2**31 or more")
    return spec


def _check_epilogue(statement: Statement, spec: Spec, epilogue: Elementwise) -> None:
    """An epilogue takes the value and one position per output dimension, and stands after a result, not a
    derivative rule's winners."""
    rank = len(statement.lhs.indices)
    taken = len(epilogue.value.in_avals) - len(epilogue.captures) - 1
    if epilogue.kind != "epilogue" or taken != rank:
        raise _fail(statement, f"the epilogue {epilogue.name} takes {taken} position(s) after the value, but the "
                    f"left-hand side {statement.lhs} has {rank} dimension(s); write it as "
                    f"epilogue(value, {', '.join(f'i{d}' for d in range(rank))})", statement.lhs)
    if spec.winners:
        raise ValueError(f"jinsum: the winners of {statement} take no epilogue")


def _check_extremal(statement: Statement) -> None:
    """A `max=` / `min=` takes the extreme of products over the summed variables' joint assignments. Two factors
    reduced over variables that no factor shares multiply independent choices: the extreme of such products is
    rarely what is meant (for `max=` over values of both signs it is not the product of the maxima), and it costs
    the product of the extents. Each factor's summed variables must therefore reach the others' through shared
    variables."""
    loop = set(variables(statement.lhs))
    groups: list[tuple[set[str], Access]] = []
    for factor in statement.factors:
        summed = set(variables(factor)) - loop
        if not summed:
            continue
        joined = [g for g in groups if g[0] & summed]
        for g in joined:
            groups.remove(g)
            summed |= g[0]
        groups.append((summed, factor if not joined else joined[0][1]))
    if len(groups) > 1:
        (first, where), (second, other) = groups[0], groups[1]
        op = "max=" if statement.reduction == "max" else "min="
        raise _fail(statement, f"{op} over independent factors: {where} is reduced over {sorted(first)} and {other} "
                    f"over {sorted(second)}, which no factor shares, so the statement would take the extreme of "
                    "every pairing of their terms; reduce each factor in its own statement, then combine", other)


def _column_order(order: ColumnOrder | None, by_name: dict, index_tensors) -> ColumnOrder | None:
    """`order` if the statement reads its format through the column index, else None (equal Specs stay equal)."""
    if order is None or order.columns_index not in index_tensors:
        return None
    clash = {o.name for o in order.operands} & set(by_name)
    shapes_fit = (len(order.columns.shape) == 1 and len(order.rows.shape) == 2 and order.rows.shape == order.slots.shape
                  and order.rows.shape[0] == order.columns.shape[0])
    integers = all(np.issubdtype(o.dtype, np.integer) for o in order.operands)
    if clash or not shapes_fit or not integers:
        raise ValueError(f"jinsum: a column order's operands must be integer arrays (H,), (H, Q), (H, Q) whose names "
                         f"are not the statement's, got {order.operands}")
    return order
