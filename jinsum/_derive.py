"""Statement -> Statement rewrites behind the primitive's rules: tangent terms, transposes, masks, batching.

The family of indirect Einsums is closed under what JAX needs (see DESIGN.md):
- a JVP term is the statement with one factor replaced by its tangent;
- the transpose with respect to a factor swaps that factor with the left-hand side:
  `C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]` gives `dB[Ak[g,p],n] += Av[g,p] * ct[Ai[g],n]`;
- vmap adds an index variable to the batched operands and to the output.
These are pure functions on syntax; the primitive binds their results with arrays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

from jinsum._lang import Access, Statement, Var, map_statement, statement_variables, variables


def fresh_name(base: str, taken: Collection[str]) -> str:
    """`base`, or `base_1`, `base_2`, ... : the first that is not in `taken`."""
    name, counter = base, 0
    while name in taken:
        counter += 1
        name = f"{base}_{counter}"
    return name


def replace_factor(statement: Statement, factor: int, tensor: str, *, accumulate: bool) -> Statement:
    """The statement with the `factor`-th factor reading `tensor` instead (a JVP term reads a tangent there)."""
    factors = list(statement.factors)
    factors[factor] = dataclasses.replace(factors[factor], tensor=tensor)
    return dataclasses.replace(statement, factors=tuple(factors), accumulate=accumulate, source="")


def transpose(statement: Statement, factor: int) -> Statement:
    """The cotangent of the `factor`-th factor: `F[...] += (other factors) * C[lhs indices]`.

    Names stay: `F` is bound to zeros of the factor's shape and `C` (the left-hand side's name) to the output
    cotangent. The factor's tensor must occur once (the statement is linear in it). The result always
    accumulates: a factor element feeds every output element whose assignment reads it.
    """
    others = statement.factors[:factor] + statement.factors[factor + 1:]
    return Statement(statement.factors[factor], True, (*others, statement.lhs))


def unwritten_mask(statement: Statement, zeros: str) -> Statement:
    """`C[lhs indices] = zeros[loop variables]`: for `=`, what flows back to the initial left-hand side `C`.

    Elements that the statement overwrites do not depend on their initial value, so their cotangent is zeroed.
    """
    loop = tuple(Var(v) for v in variables(statement.lhs))
    return Statement(statement.lhs, False, (Access(zeros, loop),))


def overwrites_everything(statement: Statement) -> bool:
    """True when `=` sets every element of the left-hand side (its indices are distinct plain variables)."""
    return not statement.accumulate and all(isinstance(i, Var) for i in statement.lhs.indices)


def batch(statement: Statement, batched: Mapping[str, int], lhs_axis: int, var: str | None = None
          ) -> tuple[Statement, str]:
    """Adds a fresh index variable for a vmapped axis.

    Args:
      batched: tensor name -> the axis that carries the batch, for every batched operand.
      lhs_axis: where the batch axis goes in the left-hand side (every output is batched).
      var: the new variable's name (one that the statement does not use); a fresh `b...` by default.

    Returns:
      The statement with the new variable inserted at those axes in every access of those tensors, and the name of
      the new variable.
    """
    var = Var(var or fresh_name("b", statement_variables(statement)))
    axes = {**batched, statement.lhs.tensor: lhs_axis}

    def insert(access: Access) -> Access:
        if access.tensor not in axes:
            return access
        indices = list(access.indices)
        indices.insert(axes[access.tensor], var)
        return dataclasses.replace(access, indices=tuple(indices))

    return dataclasses.replace(map_statement(statement, insert), source=""), var.name
