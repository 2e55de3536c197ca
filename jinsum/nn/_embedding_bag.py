"""Embedding bags (torch's `nn.EmbeddingBag`, the sparse features of DLRM-style recommendation): each bag's rows of a
table reduced by sum, mean or max, as one indirect Einsum over a bag matrix built on the device for every batch.

The bags of a batch are a `GroupCOO` `A (B, num_embeddings)` with `A[b, id] = weight` (one stored entry per lookup,
so an id repeated in a bag counts each time), built inside `jit` with shapes fixed by the input's: a padded `(B, P)`
index is a fixed-fanout table (`GroupCOO.from_neighbors`: one group per bag, no sort), flat indices with offsets a
CSR index (`GroupCOO.from_csr`: the lookups are already in bag order, no sort). Then

    sum:  C[Ai[g],n] += Av[g,p] * T[Ak[g,p],n]      (the SpMM `A @ table`)
    mean: the same over each bag's count of lookups  (`D[Ai[g]] += Av[g,p]`)
    max:  C[Ai[g],n] max= T[Ak[g,p],n]              (`aggregate_extreme`; padding takes no part)

Gradients. With respect to the table the SpMM's transpose rule gives the dense gradient `(num_embeddings, F)`; the
bags carry their lookups in column order (`with_transpose`, one sort of the lookups, left out by XLA when nothing is
differentiated), so it runs as the forward's gather-and-sum kernel over the ids instead of an atomic addition per
lookup, which serialises on the hot ids of a power-law distribution. The sparse path differentiates with respect to
the rows a batch touches only: `bags(..., unique=True)` numbers the distinct ids of the batch (one more sort) and
indexes them instead, so the gradient is `(U, F)`, `U` the number of lookups (a static bound; the rows past the
distinct ones are padding), and an optimiser updates those rows in place:

    bags = jinsum.nn.bags(ids, offsets, num_embeddings=V, unique=True)       # inside the jitted step
    rows = bags.take(table)                                                  # (U, F): table[bags.rows]
    grad = jax.grad(lambda rows: loss(jinsum.nn.embedding_bag(rows, bags, "sum")))(rows)
    table = bags.scatter_add(table, -learning_rate * grad)                   # SGD on the touched rows
    table, accumulator = jinsum.nn.sparse_adagrad(table, accumulator, bags, grad, learning_rate)   # or Adagrad

It costs a step O(U F) instead of O(num_embeddings F): the dense gradient writes the whole table, and a dense
optimiser reads and writes it and its state again. The dense path is the better choice when a batch touches a large
part of the table (a small vocabulary: the sort and the gather of the touched rows then cost more than they save),
and for optimisers whose update of a row does not vanish with its gradient (momentum, Adam, weight decay: on the
sparse path untouched rows keep their value and their state, the "lazy" update of torch's `SparseAdam`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn.linear import default_embed_init
from jax.experimental import checkify

import jinsum
from jinsum.formats import GroupCOO
from jinsum.formats._convert import as_jax_array, check_int
from jinsum.nn._graph import aggregate, aggregate_extreme, row_sums

_MODES = ("sum", "mean", "max")


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
                             "jinsum.nn.bags(..., unique=True) to read and update only the rows they touch")
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
      unique: index the distinct ids of the batch (`Bags.rows`) instead of the table's (the sparse path, module
        docstring); costs one more sort of the lookups.
      with_transpose: carry the lookups in column order (one sort, on the device), so that the gradient with
        respect to the table sums each row's lookups instead of adding them atomically; XLA leaves it out of a
        jitted function that does not differentiate.

    Example:
      >>> b = jinsum.nn.bags(jnp.array([4, 1, 4, 7]), jnp.array([0, 3]), num_embeddings=10)   # {4, 1, 4}, {7}
      >>> jinsum.nn.embedding_bag(table, b, "sum")                # (2, F): table[4] * 2 + table[1], table[7]
    """
    where = "jinsum.nn.bags"
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
    valid = (indices >= 0) & (indices < num_embeddings)
    if padding_idx is not None:
        valid &= indices != _padding_idx(where, padding_idx, num_embeddings)
    if not isinstance(indices, jax.core.Tracer):
        out_of_range = np.argwhere(np.asarray(indices) >= num_embeddings)
        if out_of_range.size:
            position = tuple(int(i) for i in out_of_range[0])
            raise ValueError(f"{where}: indices[{', '.join(map(str, position))}] = {int(indices[position])} is out of "
                             f"range for a table of num_embeddings = {num_embeddings} rows; negative ids mark padding")
    elif jinsum.check_indices.value:
        checkify.check(jnp.all(indices < num_embeddings), f"{where}: indices holds an id past num_embeddings = "
                       f"{num_embeddings}; negative ids mark padding")
    rows, columns, num_columns = None, indices, num_embeddings
    if unique:
        # The distinct ids, sorted (one sort), each lookup's position among them; padding sorts last as id V.
        rows, columns = jnp.unique(jnp.where(valid, indices, num_embeddings).ravel(), size=indices.size,
                                   fill_value=num_embeddings, return_inverse=True)
        columns, num_columns = columns.reshape(indices.shape), indices.size
    columns = jnp.where(valid, columns, -1)
    if indices.ndim == 2:
        matrix = GroupCOO.from_neighbors(columns, per_sample_weights, num_sources=num_columns,
                                         with_transpose=with_transpose)
    else:
        indptr = offsets if include_last_offset else jnp.append(offsets, indices.shape[0]).astype(offsets.dtype)
        matrix = GroupCOO.from_csr(indptr, columns, per_sample_weights, num_columns=num_columns,
                                   with_transpose=with_transpose)
    return Bags(matrix, rows, num_embeddings, per_sample_weights is not None)


def _check_offsets(where: str, offsets, length: int, include_last_offset: bool) -> jax.Array:
    """`offsets` as a JAX array, after torch's checks where its values are concrete."""
    if offsets is None:
        raise ValueError(f"{where}: flat indices (L,) need offsets (B,), the start of each bag in them; or pass "
                         "indices of shape (B, P), one bag per row")
    offsets = as_jax_array(offsets)
    least = 2 if include_last_offset else 1
    if offsets.ndim != 1 or not jnp.issubdtype(offsets.dtype, jnp.integer) or offsets.shape[0] < least:
        expected = "(B + 1,) with include_last_offset" if include_last_offset else "(B,)"
        raise ValueError(f"{where}: offsets must be an integer array {expected}, the start of each bag in the flat "
                         f"indices, got {offsets.dtype}{list(offsets.shape)}")
    if not isinstance(offsets, jax.core.Tracer):
        values = np.asarray(offsets)
        if values[0] != 0 or (np.diff(values) < 0).any() or values[-1] > length:
            raise ValueError(f"{where}: offsets must start at 0 and not decrease, up to len(indices) = {length}, got "
                             f"{values.tolist() if values.size <= 10 else f'{values[:10].tolist()} ...'}")
    return offsets


def _padding_idx(where: str, padding_idx, num_embeddings: int) -> int:
    """`padding_idx` in `[0, V)` (a negative one counts from the end, as torch)."""
    padding_idx = check_int(where, "padding_idx", padding_idx, minimum=-num_embeddings)
    if padding_idx >= num_embeddings:
        raise ValueError(f"{where}: padding_idx must be in [-num_embeddings, num_embeddings) = [{-num_embeddings}, "
                         f"{num_embeddings}), got {padding_idx}")
    return padding_idx % num_embeddings


def _check_mode(where: str, mode: str, weighted: bool) -> None:
    if mode not in _MODES:
        raise ValueError(f"{where}: mode must be one of {_MODES}, got {mode!r}")
    if weighted and mode != "sum":
        raise NotImplementedError(
            f"{where}: per_sample_weights was not None. per_sample_weights is only supported for mode='sum' (got "
            f"mode='{mode}'), as in torch; a weighted mean is mode='sum' with the weights divided by each bag's total")


def embedding_bag(table: jax.Array, bags: Bags, mode: str = "mean") -> jax.Array:
    """Each bag's rows of `table` reduced by `mode`: `(B, F)`.

    Args:
      table: `(num_embeddings, F)`; for bags built with `unique=True`, the rows they read, `bags.take(table)`
        `(U, F)`, so that a gradient with respect to it holds the touched rows only.
      bags: from `jinsum.nn.bags`.
      mode: "sum" (weighted by the per-sample weights, if any), "mean" (over the bag's lookups that are not
        padding) or "max" (elementwise; the gradient goes to each element's first maximal lookup). A bag without
        lookups gives zeros in every mode, as in torch.
    """
    where = "jinsum.nn.embedding_bag"
    _check_mode(where, mode, bags.weighted)
    table = jnp.asarray(table)
    columns = bags.matrix.shape[1]
    if table.ndim != 2 or table.shape[0] != columns:
        read = (f"the U = {columns} rows that bags built with unique=True read (pass bags.take(table))"
                if bags.rows is not None else f"num_embeddings = {columns} rows")
        raise ValueError(f"{where}: expected a table (rows, F) of {read}, got shape {tuple(table.shape)}")
    if mode == "sum":
        return aggregate(bags.matrix, table)
    # The weights are 1 (lookups) and 0 (padding) here: their row sums count each bag's lookups.
    counts = row_sums(bags.matrix, jnp.float32)[:, None]
    if mode == "mean":
        return (aggregate(bags.matrix, table) / jnp.maximum(counts, 1)).astype(table.dtype)
    return jnp.where(counts > 0, aggregate_extreme(bags.matrix, table, "max", empty=None), 0).astype(table.dtype)


def sparse_adagrad(table: jax.Array, accumulator: jax.Array, bags: Bags, grad: jax.Array, learning_rate,
                   *, eps: float = 1e-10) -> tuple[jax.Array, jax.Array]:
    """One Adagrad step on the rows a batch touched: `(table, accumulator)` updated at `bags.rows` only.

    `accumulator` `(num_embeddings, F)` is torch's `Adagrad` (element-wise, as with `EmbeddingBag(sparse=True)`):
    `acc += g^2; row -= lr g / (sqrt(acc) + eps)`. `(num_embeddings,)` is the row-wise Adagrad of DLRM (FBGEMM's
    `rowwise_adagrad`): one sum per row of the mean of `g^2` over the features, a table's worth of state less. A
    row's update vanishes with its gradient, so this equals the dense step on the whole table.

    Args:
      table: `(num_embeddings, F)`; accumulator: its state, zeros at first (torch's `initial_accumulator_value`).
      bags: built with `unique=True`; grad: `(U, F)`, the gradient with respect to `bags.take(table)`.
    """
    bags.expect_rows("jinsum.nn.sparse_adagrad", table)
    if jnp.shape(accumulator) not in ((bags.num_embeddings, table.shape[1]), (bags.num_embeddings,)):
        raise ValueError(f"jinsum.nn.sparse_adagrad: expected an accumulator of shape (num_embeddings, F) = "
                         f"{(bags.num_embeddings, table.shape[1])} (element-wise) or ({bags.num_embeddings},) "
                         f"(row-wise), got {jnp.shape(accumulator)}")
    squares = grad**2 if accumulator.ndim == 2 else jnp.mean(grad**2, axis=1)
    accumulator = accumulator.at[bags.rows].add(squares.astype(accumulator.dtype), mode="drop")
    scale = jnp.sqrt(jnp.take(accumulator, bags.rows, axis=0, mode="fill", fill_value=0)) + eps
    scale = scale if accumulator.ndim == 2 else scale[:, None]
    return bags.scatter_add(table, -learning_rate * grad / scale), accumulator


class EmbeddingBag(nnx.Module):
    """torch's `nn.EmbeddingBag` as a Flax NNX layer: `out[b] = reduce over the lookups of bag b of
    weight * embedding[id]`, `(B, features)`, the bags built on the device at every call (`jinsum.nn.bags`).

    The table is the `embedding` parameter `(num_embeddings, features)`, initialised as `nnx.Embed`'s (variance
    scaling, unit variance per row), with `padding_idx`'s row zero, as torch's. Calling the layer differentiates
    the whole table (the dense gradient); for the sparse path build compact bags with `bags(..., unique=True)` and
    pass their rows' values explicitly (module docstring).

    Example:
      >>> emb = jinsum.nn.EmbeddingBag(1000, 64, mode="sum", rngs=nnx.Rngs(0))
      >>> out = emb(ids, offsets)                                           # (B, 64); or emb(ids_2d) with (B, P)
      >>> b = emb.bags(ids, offsets, unique=True)                           # the sparse path, in the jitted step:
      >>> rows = b.take(emb.embedding[...])                                 # (U, 64)
      >>> grad = jax.grad(lambda rows: loss(emb(b, rows=rows)))(rows)       # (U, 64)
      >>> emb.embedding[...] = b.scatter_add(emb.embedding[...], -0.1 * grad)
    """

    def __init__(self, num_embeddings: int, features: int, *, mode: str = "mean", padding_idx: int | None = None,
                 include_last_offset: bool = False, dtype=None, param_dtype=jnp.float32,
                 embedding_init=default_embed_init, rngs: nnx.Rngs):
        """Creates the table.

        Args:
          num_embeddings, features: the table's shape.
          mode: "sum", "mean" (torch's default) or "max".
          padding_idx, include_last_offset: as for `jinsum.nn.bags` (torch's).
          dtype: of the computation (default: the table's); param_dtype: of the table.
          embedding_init: the table's initializer (`nnx.Embed`'s default).
          rngs: initialises the table.
        """
        _check_mode("EmbeddingBag", mode, False)
        table = embedding_init(rngs.params(), (num_embeddings, features), param_dtype)
        if padding_idx is not None:
            padding_idx = _padding_idx("EmbeddingBag", padding_idx, num_embeddings)
            table = table.at[padding_idx].set(0)
        self.embedding = nnx.Param(table)
        self.num_embeddings, self.features, self.mode = num_embeddings, features, mode
        self.padding_idx, self.include_last_offset = padding_idx, include_last_offset
        self.dtype = dtype or param_dtype

    def bags(self, indices, offsets=None, per_sample_weights=None, *, unique: bool = False) -> Bags:
        """`jinsum.nn.bags` with this layer's table size, `padding_idx` and `include_last_offset`."""
        return bags(indices, offsets, per_sample_weights, num_embeddings=self.num_embeddings,
                    padding_idx=self.padding_idx, include_last_offset=self.include_last_offset, unique=unique)

    def __call__(self, indices, offsets=None, per_sample_weights=None, *, rows: jax.Array | None = None) -> jax.Array:
        """`(B, features)` in `dtype`.

        Args:
          indices, offsets, per_sample_weights: a batch in torch's reading (`jinsum.nn.bags`); or `indices` bags
            built already (`self.bags(...)`), without the other two.
          rows: for bags built with `unique=True`, the values of the rows they read `(U, features)`
            (`bags.take(self.embedding[...])`, passed as an argument of the differentiated function: the sparse
            path); None reads them from the table.
        """
        if isinstance(indices, Bags):
            if offsets is not None or per_sample_weights is not None:
                raise ValueError("EmbeddingBag: bags built already carry their offsets and weights; pass them to "
                                 "EmbeddingBag.bags instead")
            batch = indices
        else:
            _check_mode("EmbeddingBag", self.mode, per_sample_weights is not None)
            batch = self.bags(indices, offsets, per_sample_weights)
        if rows is not None and batch.rows is None:
            raise ValueError("EmbeddingBag: rows= goes with bags built with unique=True (self.bags(..., unique=True)); "
                             "these index the whole table")
        table = self.embedding[...]
        if batch.rows is not None and rows is None:
            rows = batch.take(table)
        return embedding_bag(jnp.asarray(table if rows is None else rows, self.dtype), batch, self.mode)
