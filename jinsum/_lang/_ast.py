"""The indirect-Einsum syntax tree: immutable, hashable, printable back to canonical text.

An index position is either an index variable (`Var`) or another access (`Access`): an indirection through an
index array. Source spans ride along for error messages but take no part in equality or hashing, so two parses of
equivalent text (spaces aside) are the same key for every cache downstream.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True)
class Span:
    """Character offsets [start, end) of a node in the source text."""

    start: int
    end: int


def _span_field():
    return dataclasses.field(default=None, compare=False, hash=False, repr=False)


@dataclasses.dataclass(frozen=True)
class Var:
    """An index variable, e.g. `g` in `Ai[g]`."""

    name: str
    span: Span | None = _span_field()

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class Access:
    """`tensor[i1, i2, ...]`: one element of a tensor, addressed by index variables or nested accesses."""

    tensor: str
    indices: tuple[Index, ...]
    span: Span | None = _span_field()

    def __str__(self) -> str:
        return f"{self.tensor}[{','.join(map(str, self.indices))}]"


Index = Var | Access


REDUCTIONS = {"sum": "+=", "max": "max=", "min": "min="}  # a reduction's name -> its operator


@dataclasses.dataclass(frozen=True)
class Statement:
    """`lhs (= | += | max= | min=) factor * factor * ...`.

    Attributes:
        lhs: the access written to.
        accumulate: True for the reductions (`+=`, `max=`, `min=`: each target combines its initial value with every
          term that reaches it), False for `=` (targets are set).
        factors: the accesses multiplied on the right.
        source: the text this was parsed from (for error messages); empty for derived statements.
        reduction: how an accumulating statement combines: "sum" (`+=`), "max" or "min". It reduces the summed
          variables (those only on the right) too: the right-hand side is one product per assignment of all the
          variables, and `max=` takes the largest of them, never a maximum of sums.
    """

    lhs: Access
    accumulate: bool
    factors: tuple[Access, ...]
    source: str = dataclasses.field(default="", compare=False, hash=False, repr=False)
    reduction: str = "sum"

    def __str__(self) -> str:
        op = REDUCTIONS[self.reduction] if self.accumulate else "="
        return f"{self.lhs} {op} {' * '.join(map(str, self.factors))}"

    @property
    def accesses(self) -> tuple[Access, ...]:
        """The top-level accesses: the left-hand side first, then the factors."""
        return (self.lhs, *self.factors)


# ---------------------------------------------------------------------------------------------------------------
# Traversals shared by the checker, the derivation rules and both lowerings.


def walk(access: Access) -> Iterator[Access]:
    """Every access in `access`'s tree, outermost first, depth-first left to right."""
    yield access
    for index in access.indices:
        if isinstance(index, Access):
            yield from walk(index)


def variables(access: Access) -> tuple[str, ...]:
    """The distinct index variables anywhere in `access`'s tree, in textual order of first appearance."""
    seen: dict[str, None] = {}

    def visit(node: Access) -> None:
        for index in node.indices:
            if isinstance(index, Var):
                seen.setdefault(index.name)
            else:
                visit(index)

    visit(access)
    return tuple(seen)


def statement_variables(statement: Statement) -> tuple[str, ...]:
    """All index variables of a statement, in order of first appearance (left-hand side first)."""
    seen: dict[str, None] = {}
    for access in statement.accesses:
        for name in variables(access):
            seen.setdefault(name)
    return tuple(seen)


def tensor_names(statement: Statement) -> tuple[str, ...]:
    """Every tensor named in the statement, in order of first appearance (left-hand side first)."""
    seen: dict[str, None] = {}
    for access in statement.accesses:
        for node in walk(access):
            seen.setdefault(node.tensor)
    return tuple(seen)


def index_tensor_names(statement: Statement) -> frozenset[str]:
    """The tensors used as index arrays (inside an index position) somewhere in the statement."""
    return frozenset(
            index.tensor
            for access in statement.accesses
            for node in walk(access)
            for index in node.indices
            if isinstance(index, Access)
    )


def map_accesses(access: Access, fn) -> Access:
    """Rebuilds `access` bottom-up, applying `fn(node) -> Access` to every access in the tree."""
    indices = tuple(map_accesses(i, fn) if isinstance(i, Access) else i for i in access.indices)
    return fn(dataclasses.replace(access, indices=indices))


def map_statement(statement: Statement, fn) -> Statement:
    """Applies `map_accesses(., fn)` to every top-level access of a statement."""
    return dataclasses.replace(
            statement,
            lhs=map_accesses(statement.lhs, fn),
            factors=tuple(map_accesses(f, fn) for f in statement.factors),
    )
