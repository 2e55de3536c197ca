"""Embedding bags (the inputs of torch's `nn.EmbeddingBag`, the sparse features of DLRM-style recommendation) as a
matrix built on the device for every batch: `bags`, traceable, so a jitted step that builds them compiles once.

The bags of a batch are a `GroupCOO` `A (B, num_embeddings)` with `A[b, id] = weight` (one stored entry per lookup,
so an id repeated in a bag counts each time), built inside `jit` with shapes fixed by the input's: a padded `(B, P)`
index is a fixed-fanout table (`GroupCOO.from_neighbors`: one group per bag, no sort), flat indices with offsets a
CSR index (`GroupCOO.from_csr`: the lookups are already in bag order, no sort). They carry their lookups in column
order (`with_transpose`, one sort of the lookups, left out by XLA when nothing is differentiated), so that the
gradient with respect to the table sums each row's lookups instead of adding them atomically. With `unique=True` they
index the distinct ids of the batch (`Bags.rows`, one more sort) instead of the table's, so that a step reads and
updates only the rows the batch touches (`Bags.take`, `Bags.scatter_add`): the sparse path of
`jinsum.nn.embedding_bag`, whose module tells when it pays.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jinsum import _config
from jinsum.formats import GroupCOO
from jinsum.formats._convert import as_jax_array, check_int


@dataclasses.dataclass(frozen=True)
class Bags:
    """The bags of a batch of lookups into a table of `num_embeddings` rows, built by `bags` (a pytree).

    Attributes:
      matrix: the `GroupCOO` `(B, K)` with `matrix[b, k] = weight` summed over the bag's lookups of column `k`
        (a per-sample weight, or 1); `K = num_embeddings` (columns: the table's ids), or `K = U` with `rows`.
      rows: None, or (bags built with `unique=True`) int `(U,)`, the distinct ids the batch looks up, sorted, then
        `num_embeddings` (padding) up to `U`, the number of lookups: column `k` of `matrix` is row `rows[k]` of the
        table, so the bags reduce `take(table)` `(U, F)`, and a gradient with respect to it is the table's, row by
        row (`scatter_add`).
      num_embeddings: the table's rows (static).
      weighted: whether per-sample weights were given (static; only mode "sum" takes them).
    """

    matrix: GroupCOO
    rows: jax.Array | None
    num_embeddings: int
    weighted: bool

    @property
    def num_bags(self) -> int:
        """`B`."""
        return self.matrix.shape[0]

    def take(self, table: jax.Array) -> jax.Array:
        """The rows of `table` `(num_embeddings, F)` that the bags read: `(U, F)`, zeros for the padding rows."""
        self.expect_rows("Bags.take", table)
        return jnp.take(table, self.rows, axis=0, mode="fill", fill_value=0)

    def scatter_add(self, table: jax.Array, update: jax.Array) -> jax.Array:
        """`table` `(num_embeddings, F)` with `update` `(U, F)` added to the rows the bags read (`table.at[rows].add`,
        padding dropped): a step of SGD on the touched rows is `bags.scatter_add(table, -learning_rate * grad)`."""
        self.expect_rows("Bags.scatter_add", table)
        if jnp.shape(update) != (self.rows.shape[0], table.shape[1]):
            raise ValueError(f"Bags.scatter_add: expected an update of shape (U, F) = "
                             f"{(self.rows.shape[0], table.shape[1])} (one row per entry of bags.rows), got "
                             f"{jnp.shape(update)}")
        return table.at[self.rows].add(update.astype(table.dtype), mode="drop")

    def expect_rows(self, where: str, table) -> None:
        """Raises a clear error unless these bags index the rows they touch (`unique=True`) of `table`."""
        if self.rows is None:
            raise ValueError(f"{where}: these bags index the table's ids directly; build them with "
                             "jinsum.graphs.bags(..., unique=True) to read and update only the rows they touch")
        if jnp.ndim(table) != 2 or jnp.shape(table)[0] != self.num_embeddings:
            raise ValueError(f"{where}: expected the table (num_embeddings, F) with num_embeddings = "
                             f"{self.num_embeddings}, got shape {jnp.shape(table)}")


jax.tree_util.register_dataclass(Bags, data_fields=["matrix", "rows"], meta_fields=["num_embeddings", "weighted"])


def bags(indices, offsets=None, per_sample_weights=None, *, num_embeddings: int, padding_idx: int | None = None,
         include_last_offset: bool = False, unique: bool = False, with_transpose: bool = True) -> Bags:
    """The bags of a batch of lookups in torch's reading (`torch.nn.EmbeddingBag`), traceable: shapes depend only on
    the inputs' shapes, so a jitted step that builds them compiles once for every batch.

    Args:
      indices: int, either `(L,)` with `offsets` (bag `b` is `indices[offsets[b]:offsets[b + 1]]`, the last bag
        running to the end), or `(B, P)` without (each row a bag). A negative id is padding (the last positions of
        a padded row or of a flat batch of static length), as is an id equal to `padding_idx`: padding takes no part
        in a bag, is not counted by the mean, and gets no gradient; a bag of padding only gives zeros.
      offsets: int `(B,)`, non-decreasing from 0; with `include_last_offset`, `(B + 1,)`, the last one the end of
        the last bag: lookups from it on are left out, so a flat batch of static length may end in anything (torch's
        CPU kernel runs the last bag to the end of the input instead; both agree where it ends there, as torch's
        documentation has it).
      per_sample_weights: floating, `indices`' shape: each lookup's row is scaled by its weight (mode "sum" only).
      num_embeddings: the table's rows `V`. Ids past it are out of range: a `ValueError` for concrete indices,
        padding under `jit` (a `checkify` error under `jinsum.check_indices`).
      padding_idx: an id that marks padding (negative: counted from `V`, as torch).
      include_last_offset: torch's `include_last_offset`.
      unique: index the distinct ids of the batch (`Bags.rows`) instead of the table's (the sparse path,
        `jinsum.nn.embedding_bag`'s module docstring); costs one more sort of the lookups.
      with_transpose: carry the lookups in column order (one sort, on the device), so that the gradient with
        respect to the table sums each row's lookups instead of adding them atomically; XLA leaves it out of a
        jitted function that does not differentiate.

    Example:
      >>> b = jinsum.graphs.bags(jnp.array([4, 1, 4, 7]), jnp.array([0, 3]), num_embeddings=10)   # {4, 1, 4}, {7}
      >>> table = jnp.arange(10.0)[:, None] * jnp.ones(3)          # (10, 3): row r holds r
      >>> print(jinsum.nn.embedding_bag(table, b, "sum"))          # table[4] * 2 + table[1], table[7]
      [[9. 9. 9.]
       [7. 7. 7.]]
    """
    where = "jinsum.graphs.bags"
    num_embeddings = check_int(where, "num_embeddings", num_embeddings, minimum=1)
    indices = as_jax_array(indices)
    if not jnp.issubdtype(indices.dtype, jnp.integer) or indices.ndim not in (1, 2):
        raise ValueError(f"{where}: indices must be an integer array, (L,) with offsets or (B, P) (each row a bag), "
                         f"got {indices.dtype}{list(indices.shape)}")
    if indices.ndim == 1:
        offsets = _check_offsets(where, offsets, indices.shape[0], include_last_offset)
    elif offsets is not None:
        raise ValueError(f"{where}: indices of shape {tuple(indices.shape)} are (B, P) bags, one per row, so offsets "
                         "must be None (offsets go with flat indices (L,))")
    if per_sample_weights is not None:
        per_sample_weights = as_jax_array(per_sample_weights)
        if per_sample_weights.shape != indices.shape or not jnp.issubdtype(per_sample_weights.dtype, jnp.floating):
            raise ValueError(f"{where}: per_sample_weights must be floating with the shape of indices "
                             f"{tuple(indices.shape)}, got {per_sample_weights.dtype}{list(per_sample_weights.shape)}")
    if padding_idx is not None:
        padding_idx = check_padding_idx(where, padding_idx, num_embeddings)
    if not isinstance(indices, jax.core.Tracer):
        out_of_range = np.argwhere(np.asarray(indices) >= num_embeddings)
        if out_of_range.size:
            position = tuple(int(i) for i in out_of_range[0])
            raise ValueError(f"{where}: indices[{', '.join(map(str, position))}] = {int(indices[position])} is out of "
                             f"range for a table of num_embeddings = {num_embeddings} rows; negative ids mark padding")
    elif _config.check_indices.value:
        checkify.check(jnp.all(indices < num_embeddings), f"{where}: indices holds an id past num_embeddings = "
                       f"{num_embeddings}; negative ids mark padding")
    rows, columns, indptr = _lookups(indices, offsets, num_embeddings=num_embeddings, padding_idx=padding_idx,
                                     unique=bool(unique), include_last_offset=bool(include_last_offset))
    num_columns = indices.size if unique else num_embeddings
    if indices.ndim == 2:
        matrix = GroupCOO.from_neighbors(columns, per_sample_weights, num_sources=num_columns,
                                         with_transpose=with_transpose)
    else:
        matrix = GroupCOO.from_csr(indptr, columns, per_sample_weights, num_columns=num_columns,
                                   with_transpose=with_transpose)
    return Bags(matrix, rows, num_embeddings, per_sample_weights is not None)


# One compiled program (static sizes and flags): eagerly each of its operations compiled alone for every new shape.
@functools.partial(jax.jit, static_argnames=("num_embeddings", "padding_idx", "unique", "include_last_offset"))
def _lookups(indices, offsets, *, num_embeddings: int, padding_idx: int | None, unique: bool,
             include_last_offset: bool):
    """`bags`' lookups as a matrix's index: ``(rows, columns, indptr)``, ``rows`` the distinct ids with ``unique``
    (else None), ``columns`` each lookup's column (-1: padding), and ``indptr`` the bags' starts and end for flat
    indices (else None)."""
    valid = (indices >= 0) & (indices < num_embeddings)
    if padding_idx is not None:
        valid &= indices != padding_idx
    rows, columns = None, indices
    if unique:
        # The distinct ids, sorted (one sort), each lookup's position among them; padding sorts last as id V.
        rows, columns = jnp.unique(jnp.where(valid, indices, num_embeddings).ravel(), size=indices.size,
                                   fill_value=num_embeddings, return_inverse=True)
        columns = columns.reshape(indices.shape)
    indptr = None
    if indices.ndim == 1:
        indptr = offsets if include_last_offset else jnp.append(offsets, indices.shape[0]).astype(offsets.dtype)
    return rows, jnp.where(valid, columns, -1), indptr


def _check_offsets(where: str, offsets, length: int, include_last_offset: bool) -> jax.Array:
    """`offsets` as a JAX array, after torch's checks where its values are concrete."""
    if offsets is None:
        raise ValueError(f"{where}: flat indices (L,) need offsets (B,), the start of each bag in them; or pass "
                         "indices of shape (B, P), one bag per row")
    offsets = as_jax_array(offsets)
    least = 1 if include_last_offset else 0  # (B = 0 bags: an empty batch)
    if offsets.ndim != 1 or not jnp.issubdtype(offsets.dtype, jnp.integer) or offsets.shape[0] < least:
        expected = "(B + 1,) with include_last_offset" if include_last_offset else "(B,)"
        raise ValueError(f"{where}: offsets must be an integer array {expected}, the start of each bag in the flat "
                         f"indices, got {offsets.dtype}{list(offsets.shape)}")
    if not isinstance(offsets, jax.core.Tracer):
        values = np.asarray(offsets)
        if values.size and (values[0] != 0 or (np.diff(values) < 0).any() or values[-1] > length):
            raise ValueError(f"{where}: offsets must start at 0 and not decrease, up to len(indices) = {length}, got "
                             f"{values.tolist() if values.size <= 10 else f'{values[:10].tolist()} ...'}")
    return offsets


def check_padding_idx(where: str, padding_idx, num_embeddings: int) -> int:
    """`padding_idx` in `[0, V)` (a negative one counts from the end, as torch)."""
    padding_idx = check_int(where, "padding_idx", padding_idx, minimum=-num_embeddings)
    if padding_idx >= num_embeddings:
        raise ValueError(f"{where}: padding_idx must be in [-num_embeddings, num_embeddings) = [{-num_embeddings}, "
                         f"{num_embeddings}), got {padding_idx}")
    return padding_idx % num_embeddings
