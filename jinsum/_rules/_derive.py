"""Statement -> Statement rewrites behind the primitive's rules: tangent terms, transposes, masks, batching.

The family of indirect Einsums is closed under what JAX needs (see DESIGN.md):
- a JVP term is the statement with one factor replaced by its tangent;
- the transpose with respect to a factor swaps that factor with the left-hand side:
  `C[Ai[g],n] += Av[g,p] * B[Ak[g,p],n]` gives `dB[Ak[g,p],n] += Av[g,p] * ct[Ai[g],n]`;
- vmap adds an index variable to the batched operands and to the output;
- a transpose that scatters into a format's columns can run over its entries in column order instead
  (`by_columns`), so that each column is written once;
- any scatter through an unsorted index array can run over its entries sorted by target (`sorted_scatter`, the
  deterministic mode's form), so that each target is written once;
- the tangent of a `max=` / `min=` is its tangent statement read at each output element's winning term
  (`at_winners`): a gather, hence an indirect Einsum whose transpose scatters to the winners.
These are pure functions on syntax; the primitive binds their results with arrays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

from jinsum._lang import (Access, ColumnOrder, Statement, Var, map_accesses, map_statement, statement_variables,
                          tensor_names, variables, walk)


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


@dataclasses.dataclass(frozen=True)
class AtEntries:
    """An operand of a `by_columns` statement: `source` read at the entries in column order, through their flat
    slots `g * P + p` when it has the slot axis (`slot_axis`: `source` with that axis moved next to the group
    axis, `.reshape(G * P, ...)[slots]`), else through their groups (`source[slots // P]`); zero at padding."""

    name: str
    source: str
    slot_axis: int | None


def by_columns(statement: Statement, order: ColumnOrder) -> tuple[Statement, tuple[AtEntries, ...]] | None:
    """A transpose that scatters into the format's columns, over its entries in column order instead.

    `dB[Ak[g,p],n] += Av[g,p] * C[Ai[g],n]` becomes `dB[A_columns[h],n] += Av_t[h,q] * C[A_rows[h,q],n]`: the
    entries in groups of one column each (`h`, slot `q`), so the left-hand side is a sorted segment reduction (rows
    accumulated in registers), the forward SpMM's form, instead of an atomic addition per entry. The order's
    columns and rows replace `Ak[g,p]` and `Ai[g]`; every other operand that `g` and `p` address is read at the
    entries (`AtEntries`, gathered by the caller).

    Returns None where it does not apply: the left-hand side is not written through `Ak[g,p]`; `g` or `p` is used
    other than as an access's leading indices; or the format's values are not a factor (the order lists the
    entries whose value was nonzero when it was built, so the others must contribute nothing). And where it does
    not pay: a factor read through the rows, `Ai[g]`, contracted with one read through the columns, `Ak[g,p]`,
    over a summed variable (`W[Ai[g],c,n]` and `dY[Ak[g,p],n]` in `dX[Ak[g,p],c] += Av[g,p] * dY[Ak[g,p],n] *
    W[Ai[g],c,n]`, a mixture of experts' input gradient: a matrix per row times the rows of its entries). In
    column order each entry of a column would read another matrix, never a Tensor Core tile; in group order the
    route contracts a group's rows with its matrix on Tensor Cores (`_lowering._route.contracted_first`).
    """
    through = [i for i in statement.lhs.indices if isinstance(i, Access) and i.tensor == order.columns_index]
    if len(through) != 1 or not all(isinstance(i, Var) for i in through[0].indices):
        return None
    group, slot = (i.name for i in through[0].indices)
    if not any(f.tensor == order.values and f.indices[:1] == (Var(group),) and Var(slot) in f.indices
               for f in statement.factors):
        return None
    def summed_through(index: str) -> set[str]:  # the summed variables of the factors read through `index`
        return {i.name for f in statement.factors if any(n.tensor == index for n in walk(f) if n is not f)
                for i in f.indices if isinstance(i, Var) and i.name not in written}

    written = set(variables(statement.lhs))
    if summed_through(order.rows_index) & summed_through(order.columns_index):
        return None
    taken_variables = set(statement_variables(statement))
    group_var = Var(fresh_name("h", taken_variables))
    slot_var = Var(fresh_name("q", taken_variables | {group_var.name}))
    taken = set(tensor_names(statement)) | {o.name for o in order.operands}
    gathers: dict[tuple[str, int | None], AtEntries] = {}

    def at_entries(node: Access) -> Access:
        names = [i.name if isinstance(i, Var) else None for i in node.indices]
        if node.tensor == order.columns_index and names == [group, slot]:
            return Access(order.columns.name, (group_var,))
        if node.tensor == order.rows_index and names == [group]:
            return Access(order.rows.name, (group_var, slot_var))
        if group not in names and slot not in names:
            return node
        # Addressed by the group first, and by the slot at most once anywhere (a block's slot axis comes last).
        slot_axis = names.index(slot) if slot in names else None
        rest = [i for d, i in enumerate(node.indices) if d not in (0, slot_axis)]
        if names[0] != group or names.count(slot) > 1 or {group, slot} & {i.name for i in rest if isinstance(i, Var)}:
            raise _NotByColumns
        key = (node.tensor, slot_axis)
        if key not in gathers:
            gathers[key] = AtEntries(fresh_name(f"{node.tensor}_t", taken), node.tensor, slot_axis)
            taken.add(gathers[key].name)
        return Access(gathers[key].name, (group_var, slot_var, *rest))

    try:
        rewritten = map_statement(statement, at_entries)
    except _NotByColumns:
        return None
    return dataclasses.replace(rewritten, source=""), tuple(gathers.values())


class _NotByColumns(Exception):
    """`by_columns` does not apply (raised from inside the rewrite, caught by it)."""


@dataclasses.dataclass(frozen=True)
class SortedScatter:
    """The operands a `sorted_scatter` statement adds: the values of the left-hand side's index access `target`
    (over its `variables`, flattened) in stably sorted order, as `sorted_index`, and for each of those variables
    the value it took at each sorted entry (`coordinates`: array names, in the order of `variables`)."""

    target: Access
    variables: tuple[str, ...]
    sorted_index: str
    coordinates: tuple[str, ...]


def sorted_scatter(statement: Statement) -> tuple[Statement, SortedScatter] | None:
    """A `+=` through an index array, over its entries sorted by target (already sorted ones too: the caller then
    needs no sort, and the entries' coordinates are positions).

    `O[R[e],f] += X[C[e],c] * W[T[e],c,f]` becomes `O[R_sorted[h],f] += X[C[e_at[h]],c] * W[T[e_at[h]],c,f]`,
    where `R_sorted` holds `R`'s values in sorted order and `e_at` the entry each came from: the left-hand side is
    then a sorted segment reduction (each target written by one program, its terms added in the entries' order)
    instead of one atomic addition per entry. A multi-dimensional index (`dB[Ak[g,p],n]`) is flattened, a nested
    one (`dB[Col[e_at[h]],n]`, the transpose of a sorted scatter) evaluated at its variables first.

    Returns None where it does not apply: `=`, no or several indirections on the left, or a variable of the index
    used elsewhere on the left (a batch axis: the targets would need a composite sort key).
    """
    through = [i for i in statement.lhs.indices if isinstance(i, Access)]
    if not statement.accumulate or len(through) != 1:
        return None
    [target] = through
    scattered = tuple(dict.fromkeys(variables(target)))
    if any(isinstance(i, Var) and i.name in scattered for i in statement.lhs.indices):
        return None
    entry = Var(fresh_name("h", set(statement_variables(statement))))
    taken = set(tensor_names(statement))
    names = []
    for base in (f"{target.tensor}_sorted", *(f"{v}_at" for v in scattered)):
        names.append(fresh_name(base, taken))
        taken.add(names[-1])
    sorted_index, *coordinates = names
    at_entry = {v: Access(name, (entry,)) for v, name in zip(scattered, coordinates)}

    def read_at_entries(node: Access) -> Access:
        indices = tuple(at_entry[i.name] if isinstance(i, Var) and i.name in at_entry else i for i in node.indices)
        return dataclasses.replace(node, indices=indices, span=None)

    lhs = dataclasses.replace(statement.lhs, indices=tuple(
        Access(sorted_index, (entry,)) if i is target else i for i in statement.lhs.indices))
    rewritten = dataclasses.replace(map_statement(statement, read_at_entries), lhs=lhs, source="")
    return rewritten, SortedScatter(target, scattered, sorted_index, tuple(coordinates))


def in_pieces(statement: Statement, pieces: str, piece_of: str, piece_rows: str) -> tuple[Statement, Statement]:
    """A sorted segment reduction's long rows in two: their entries summed per piece, then the pieces per row.

    `C[R[h],n] += Av[g_at[h],p] * B[Ak[g_at[h],p],n]` gives `pieces[piece_of[h],n] += Av[g_at[h],p] *
    B[Ak[g_at[h],p],n]` (`piece_of` sorted, numbering the pieces) and `C[piece_rows[q],n] += pieces[q,n]`
    (`piece_rows` sorted, each piece's row).
    """
    lhs = statement.lhs
    [through] = [i for i in lhs.indices if isinstance(i, Access)]  # the sorted row index, `R[h]`
    piece = Var(fresh_name("q", set(statement_variables(statement))))
    per_piece = dataclasses.replace(statement, lhs=Access(pieces, tuple(
        Access(piece_of, through.indices) if i is through else i for i in lhs.indices)), source="")
    per_row = Statement(dataclasses.replace(lhs, indices=tuple(
        Access(piece_rows, (piece,)) if i is through else i for i in lhs.indices), span=None), True,
        (Access(pieces, tuple(piece if i is through else i for i in lhs.indices)),))
    return per_piece, per_row


def contracted_first(statement: Statement, pair: tuple[int, int], name: str) -> tuple[Statement, Statement] | None:
    """A sum of three or more factors with two of them contracted first, as an intermediate `name`.

    `Y[Ak[g,p],n] += Av[g,p] * X[Ak[g,p],c] * W[Ai[g],c,n]` with the pair `(1, 2)` gives `T[g,p,n] += X[Ak[g,p],c]
    * W[Ai[g],c,n]` (the variables summed only inside the pair, `c`, are summed there) and `Y[Ak[g,p],n] += Av[g,p]
    * T[g,p,n]`; with the pair `(0, 1)`, `T[g,p,c] += Av[g,p] * X[Ak[g,p],c]` (element-wise: nothing is summed
    inside the pair) and `Y[Ak[g,p],n] += W[Ai[g],c,n] * T[g,p,c]`. The intermediate is indexed by the pair's
    variables that the left-hand side or another factor read, directly: those inside the statement's index arrays
    first, in order of first appearance there, then the others in the pair's order. None where the pair's product
    sums to one number (no variable of the pair is read outside it): an access has one index per dimension, and a
    0-d intermediate is no statement of the language.
    """
    first, second = (statement.factors[k] for k in pair)
    pair_variables = list(dict.fromkeys((*variables(first), *variables(second))))
    others = [f for k, f in enumerate(statement.factors) if k not in pair]
    outside = set(variables(statement.lhs)).union(*(variables(f) for f in others))
    # The entries' variables (those inside index arrays: groups, slots) first, the features' after, so that the
    # intermediate is laid out as the rows of its entries (`T[g,p,c]`), as the operands of grouped products are.
    structure = list(dict.fromkeys(v.name for access in (statement.lhs, *statement.factors) for node in walk(access)
                                   if node is not access for v in node.indices if isinstance(v, Var)))
    kept = sorted((v for v in pair_variables if v in outside),
                  key=lambda v: (structure.index(v) if v in structure else len(structure), pair_variables.index(v)))
    if not kept:
        return None
    intermediate = Access(name, tuple(Var(v) for v in kept))
    return (Statement(intermediate, True, (first, second)),
            dataclasses.replace(statement, factors=(*others, intermediate), source=""))


def contracted_at_index(statement: Statement, pair: tuple[int, int], name: str) -> tuple[Statement, Statement] | None:
    """Two factors that read the entries only through one index array, multiplied first over that index's range.

    `H[Ai[g],o] += Av[g,p] * X[Ak[g,p],c] * W[c,o]` with the pair `(1, 2)` gives `T[j,o] += X[j,c] * W[c,o]` (one
    row of `X W` per row of `X`: a dense product) and `H[Ai[g],o] += Av[g,p] * T[Ak[g,p],o]` (an SpMM): `A (X W)`,
    where `contracted_first` would multiply each entry's row. Applies where one factor of the pair reads exactly one
    index access, at one of its dimensions, whose variables index nothing else in the pair. None elsewhere.
    """
    first, second = (statement.factors[k] for k in pair)
    others = [f for k, f in enumerate(statement.factors) if k not in pair]
    outside = set(variables(statement.lhs)).union(*(variables(f) for f in others))
    for factor, other in ((first, second), (second, first)):
        through = [d for d, i in enumerate(factor.indices) if isinstance(i, Access)]
        if len(through) != 1 or not all(isinstance(i, Var) for i in factor.indices[through[0]].indices):
            continue
        position = through[0]
        index = factor.indices[position]
        entry_variables = set(variables(index))
        plain = {i.name for i in factor.indices if isinstance(i, Var)}
        if entry_variables & (plain | set(variables(other))):
            continue
        row = Var(fresh_name("j", set(statement_variables(statement))))
        at_rows = dataclasses.replace(factor, indices=tuple(row if d == position else i
                                                            for d, i in enumerate(factor.indices)), span=None)
        rest_variables = [v for v in dict.fromkeys((*variables(at_rows), *variables(other)))
                          if v != row.name and v in outside]
        multiplied = (at_rows, other) if factor is first else (other, at_rows)
        return (Statement(Access(name, (row, *map(Var, rest_variables))), True, multiplied),
                dataclasses.replace(statement, factors=(*others, Access(name, (index, *map(Var, rest_variables)))),
                                    source=""))
    return None


def contracted_into_rows(statement: Statement, pair: tuple[int, int], name: str) -> tuple[Statement, Statement] | None:
    """Two factors summed over the entries first, into the rows the left-hand side writes them to.

    `H[Ai[g],o] += Av[g,p] * X[Ak[g,p],c] * W[c,o]` with the pair `(0, 1)` gives `T[Ai[g],c] += Av[g,p] *
    X[Ak[g,p],c]` (an SpMM) and `H[i,o] += W[c,o] * T[i,c]` (a dense product): `(A X) W`. Applies to a `+=` whose
    left-hand side has exactly one index array, its variables read by the pair and by no other factor, and whose
    other variables of the pair's entries are summed inside the pair. None elsewhere.
    """
    if not statement.accumulate:
        return None
    through = [d for d, i in enumerate(statement.lhs.indices) if isinstance(i, Access)]
    if len(through) != 1:
        return None
    position = through[0]
    index = statement.lhs.indices[position]
    if not all(isinstance(i, Var) for i in index.indices):
        return None
    pair_factors = [statement.factors[k] for k in pair]
    others = [f for k, f in enumerate(statement.factors) if k not in pair]
    entry_variables = set(variables(index))
    read_elsewhere = set().union(*(variables(f) for f in others)) | {
        i.name for d, i in enumerate(statement.lhs.indices) if d != position and isinstance(i, Var)}
    pair_variables = list(dict.fromkeys(v for f in pair_factors for v in variables(f)))
    if entry_variables & read_elsewhere or not entry_variables <= set(pair_variables):
        return None
    kept = [v for v in pair_variables if v in read_elsewhere]
    row = Var(fresh_name("i", set(statement_variables(statement))))
    lhs = dataclasses.replace(statement.lhs, indices=tuple(row if d == position else i
                                                           for d, i in enumerate(statement.lhs.indices)), span=None)
    return (Statement(Access(name, (index, *map(Var, kept))), True, tuple(pair_factors)),
            dataclasses.replace(statement, lhs=lhs, factors=(*others, Access(name, (row, *map(Var, kept)))),
                                source=""))


def gathered_first(statement: Statement, factor: int, name: str) -> tuple[Statement, Statement]:
    """A factor read through an index array, gathered first into an intermediate in the order of its entries.

    `dW[Ai[g],c,h] += X[Ak[g,p],c] * dH[g,p,h]` with the factor `0` gives `T[g,p,c] += X[Ak[g,p],c]` (each entry's
    row, once) and `dW[Ai[g],c,h] += T[g,p,c] * dH[g,p,h]`. The intermediate is indexed by the index access's
    variables (nested ones too: `X[S[Ak[g,p]],c]` gives `T[g,p,c]`), then the factor's own, in order of first
    appearance.
    """
    node = statement.factors[factor]
    kept = list(dict.fromkeys(v for i in node.indices if isinstance(i, Access) for v in variables(i)))
    kept += [i.name for i in node.indices if isinstance(i, Var) and i.name not in kept]
    intermediate = Access(name, tuple(map(Var, kept)))
    factors = tuple(intermediate if k == factor else f for k, f in enumerate(statement.factors))
    return Statement(intermediate, True, (node,)), dataclasses.replace(statement, factors=factors, source="")


def scattered_after(statement: Statement, name: str) -> tuple[Statement, Statement]:
    """A sum written through an index array, its products stored first into an intermediate, one row per entry.

    `dX[Ak[g,p],c] += dH[g,p,h] * W[Ai[g],c,h]` gives `T[g,p,c] += dH[g,p,h] * W[Ai[g],c,h]` and
    `dX[Ak[g,p],c] += T[g,p,c]`. The intermediate is indexed by the index access's variables, then the left-hand
    side's own, in order of first appearance.
    """
    lhs = statement.lhs
    kept = list(dict.fromkeys(v for i in lhs.indices if isinstance(i, Access) for v in variables(i)))
    kept += [i.name for i in lhs.indices if isinstance(i, Var) and i.name not in kept]
    intermediate = Access(name, tuple(map(Var, kept)))
    return (dataclasses.replace(statement, lhs=intermediate, source=""),
            dataclasses.replace(statement, factors=(intermediate,), source=""))


def at_winners(statement: Statement, coordinates: Mapping[str, str], tangent: str, factor: int) -> Statement:
    """The tangent term of the `factor`-th factor of a `max=` / `min=`, read at each output element's winner.

    `C[Ai[g],n] max= Av[g,p] * B[Ak[g,p],n]` with winners `(g, p) = (W_g[t,n], W_p[t,n])` gives, for the factor `B`,
    `dC[t,n] += Av[W_g[t,n],W_p[t,n]] * dB[Ak[W_g[t,n],W_p[t,n]],n]`: the left-hand side addressed by plain
    variables (an indirection's position gets a fresh one), and every reduced variable (see
    `Spec.reduced_variables`) replaced by its coordinate array (`coordinates`: variable -> array name, each of the
    left-hand side's shape). The factor reads `tangent` instead. The statement is linear in `tangent`: its
    transpose scatters the output cotangent to the winners.
    """
    taken = set(statement_variables(statement))
    lhs_vars = []
    for index in statement.lhs.indices:
        if isinstance(index, Var):
            lhs_vars.append(index)
        else:
            lhs_vars.append(Var(fresh_name("t", taken)))
            taken.add(lhs_vars[-1].name)
    lhs_vars = tuple(lhs_vars)
    at = {v: Access(name, lhs_vars) for v, name in coordinates.items()}

    def read_at_winners(node: Access) -> Access:
        return dataclasses.replace(node, span=None, indices=tuple(
            at[i.name] if isinstance(i, Var) and i.name in at else i for i in node.indices))

    factors = [map_accesses(f, read_at_winners) for f in statement.factors]
    factors[factor] = dataclasses.replace(factors[factor], tensor=tangent)
    return Statement(Access(statement.lhs.tensor, lhs_vars), True, tuple(factors))


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
