"""Embedding bags (torch's `nn.EmbeddingBag`, the sparse features of DLRM-style recommendation): each bag's rows of a
table reduced by sum, mean or max, as one indirect Einsum over the bag matrix `A (B, num_embeddings)`,
`A[b, id] = weight`, that `jinsum.graphs.bags` builds on the device for every batch:

    sum:  C[Ai[g],n] += Av[g,p] * T[Ak[g,p],n]      (the SpMM `A @ table`)
    mean: the same over each bag's count of lookups  (`D[Ai[g]] += Av[g,p]`)
    max:  C[Ai[g],n] max= T[Ak[g,p],n]              (`aggregate_extreme`; padding takes no part)

Gradients. With respect to the table the SpMM's transpose rule gives the dense gradient `(num_embeddings, F)`; the
bags carry their lookups in column order, so it runs as the forward's gather-and-sum kernel over the ids instead of
an atomic addition per lookup, which serialises on the hot ids of a power-law distribution. The sparse path
differentiates with respect to the rows a batch touches only: bags built with `unique=True` index the distinct ids
of the batch instead, so the gradient is `(U, F)`, `U` the number of lookups (a static bound; the rows past the
distinct ones are padding), and an optimiser updates those rows in place:

    bags = jinsum.graphs.bags(ids, offsets, num_embeddings=V, unique=True)   # inside the jitted step
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

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.linear import default_embed_init

from jinsum.graphs import Bags, bags
from jinsum.graphs._bags import check_padding_idx
from jinsum.nn._dtypes import check_dtypes, compute_dtype
from jinsum.nn._graph import aggregate, aggregate_extreme, floating_features, row_sums
from jinsum.nn._sizes import layer_sizes

_MODES = ("sum", "mean", "max")


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
        `(U, F)`, so that a gradient with respect to it holds the touched rows only. An integer table is cast to
        the default float, as the graph layers cast integer features.
      bags: from `jinsum.graphs.bags`.
      mode: "sum" (weighted by the per-sample weights, if any), "mean" (over the bag's lookups that are not
        padding) or "max" (elementwise; the gradient goes to each element's first maximal lookup). A bag without
        lookups gives zeros in every mode, as in torch.
    """
    where = "jinsum.nn.embedding_bag"
    _check_mode(where, mode, bags.weighted)
    table = floating_features(table)
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


class EmbeddingBag(nnx.Module):
    """torch's `nn.EmbeddingBag` as a Flax NNX layer: `out[b] = reduce over the lookups of bag b of
    weight * embedding[id]`, `(B, features)`, the bags built on the device at every call (`jinsum.graphs.bags`).

    The table is the `embedding` parameter `(num_embeddings, features)`, initialised as `nnx.Embed`'s (variance
    scaling, unit variance per row), with `padding_idx`'s row zero, as torch's. Calling the layer differentiates
    the whole table (the dense gradient); for the sparse path build compact bags with `bags(..., unique=True)` and
    pass their rows' values explicitly (module docstring).

    Example:
      >>> emb = jinsum.nn.EmbeddingBag(1000, 64, mode="sum", rngs=nnx.Rngs(0))
      >>> ids, offsets = jnp.array([4, 1, 4, 7]), jnp.array([0, 3])          # bags {4, 1, 4} and {7}
      >>> emb(ids, offsets).shape                                            # (B, 64); or emb(ids_2d) with (B, P)
      (2, 64)
      >>> b = emb.bags(ids, offsets, unique=True)                           # the sparse path, in the jitted step:
      >>> rows = b.take(emb.embedding[...])                                 # (U, 64)
      >>> loss = lambda out: (out ** 2).sum()
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
          padding_idx, include_last_offset: as for `jinsum.graphs.bags` (torch's).
          dtype: the computation's dtype (the table's rows, or `rows`, are cast to it, as `nnx.Embed` casts
            them; the sums accumulate as their statements do, in float32 for bfloat16); None: JAX's promotion of
            the table and `rows` (`jinsum.nn._dtypes`), `param_dtype` for rows taken from the table.
          param_dtype: the table's dtype.
          embedding_init: the table's initializer (`nnx.Embed`'s default).
          rngs: initialises the table.
        """
        _check_mode("EmbeddingBag", mode, False)
        check_dtypes("EmbeddingBag", dtype, param_dtype)
        num_embeddings, features = layer_sizes("EmbeddingBag", num_embeddings=num_embeddings, features=features)
        table = embedding_init(rngs.params(), (num_embeddings, features), param_dtype)
        if padding_idx is not None:
            padding_idx = check_padding_idx("EmbeddingBag", padding_idx, num_embeddings)
            table = table.at[padding_idx].set(0)
        self.embedding = nnx.Param(table)
        self.num_embeddings, self.features, self.mode = num_embeddings, features, mode
        self.padding_idx, self.include_last_offset = padding_idx, include_last_offset
        self.dtype = dtype

    def bags(self, indices, offsets=None, per_sample_weights=None, *, unique: bool = False) -> Bags:
        """`jinsum.graphs.bags` with this layer's table size, `padding_idx` and `include_last_offset`."""
        return bags(indices, offsets, per_sample_weights, num_embeddings=self.num_embeddings,
                    padding_idx=self.padding_idx, include_last_offset=self.include_last_offset, unique=unique)

    def __call__(self, indices, offsets=None, per_sample_weights=None, *, rows: jax.Array | None = None) -> jax.Array:
        """`(B, features)` in `dtype` (None: the table's, promoted with `rows`').

        Args:
          indices, offsets, per_sample_weights: a batch in torch's reading (`jinsum.graphs.bags`); or `indices` bags
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
        values = table if rows is None else rows  # (rows: the table's, passed to be differentiated)
        return embedding_bag(jnp.asarray(values, compute_dtype(self.dtype, values, table)), batch, self.mode)
