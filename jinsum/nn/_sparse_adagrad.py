"""Adagrad on the rows of an embedding table that a batch of bags touched (the sparse path of
`jinsum.nn.embedding_bag`): torch's `Adagrad` of an `EmbeddingBag(sparse=True)`, or DLRM's row-wise Adagrad.

An optimiser step, apart from the layer that computes the gradient it reads and from the bags (`jinsum.graphs.bags`)
that say which rows those are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jinsum.graphs import Bags


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
      (NumPy arrays are taken as JAX arrays.)
    """
    table, accumulator, grad = jnp.asarray(table), jnp.asarray(accumulator), jnp.asarray(grad)
    bags.expect_rows("jinsum.nn.sparse_adagrad", table)
    if jnp.shape(accumulator) not in ((bags.num_embeddings, table.shape[1]), (bags.num_embeddings,)):
        raise ValueError(f"jinsum.nn.sparse_adagrad: expected an accumulator of shape (num_embeddings, F) = "
                         f"{(bags.num_embeddings, table.shape[1])} (element-wise) or ({bags.num_embeddings},) "
                         f"(row-wise), got {jnp.shape(accumulator)}")
    rows = (bags.rows.shape[0], table.shape[1])
    if jnp.shape(grad) != rows:
        raise ValueError(f"jinsum.nn.sparse_adagrad: expected grad of shape (U, F) = {rows}, the gradient with "
                         f"respect to bags.take(table) (one row per entry of bags.rows), got {jnp.shape(grad)}")
    squares = grad**2 if accumulator.ndim == 2 else jnp.mean(grad**2, axis=1)
    accumulator = accumulator.at[bags.rows].add(squares.astype(accumulator.dtype), mode="drop")
    scale = jnp.sqrt(jnp.take(accumulator, bags.rows, axis=0, mode="fill", fill_value=0)) + eps
    scale = scale if accumulator.ndim == 2 else scale[:, None]
    return bags.scatter_add(table, -learning_rate * grad / scale), accumulator
