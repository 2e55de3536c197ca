"""Block-sparse multi-head attention: block SDDMM scores, softmax over stored blocks, block SpMM.

The attention pattern is a `jinsum.BlockGroupCOO` of shape `(L, S)` (queries x keys) whose stored `bm x bk`
blocks are the ones computed; inside them, an element attends iff the pattern's value there is nonzero. So
`block_pattern` makes BigBird/Longformer layouts with whole blocks of ones, and causal masking is a
lower-triangular diagonal block.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp
from flax import nnx

import jinsum
from jinsum.formats import BlockGroupCOO


def block_pattern(seq_len: int, block: int, *, local_blocks: int = 1, global_blocks: int = 0,
                  random_blocks: int = 0, seed: int = 0, causal: bool = False) -> BlockGroupCOO:
    """A BigBird/Longformer-style `(seq_len, seq_len)` attention pattern of `block x block` blocks (host side).

    Block `(i, j)` (query block row `i`, key block column `j`) is stored when

    - `|i - j| <= local_blocks` (a band: the diagonal block and `local_blocks` neighbours on each side), or
    - `i < global_blocks` or `j < global_blocks` (global block rows attend everywhere, and are attended by all),
    - or it is one of `random_blocks` blocks drawn per block row among those not stored yet (seeded by `seed`).

    With `causal`, blocks above the diagonal are dropped (also before the random draw) and the diagonal
    blocks are lower triangular, so position `t` attends to positions `<= t` only. Stored values are 1 where
    attention is allowed and 0 elsewhere; each group holds one block (`group_size` 1).

    Args:
      seq_len: `L`, a multiple of `block`.
      block: the block size (square blocks).
      local_blocks, global_blocks, random_blocks: as above; non-negative.
      seed: seeds the random blocks.
      causal: mask out attention to later positions.

    Returns:
      A float32 `BlockGroupCOO` of shape `(L, L)` and block shape `(block, block)`.

    Example:
      >>> pattern = jinsum.nn.block_pattern(1024, 64, local_blocks=1, global_blocks=1, random_blocks=2)
      >>> pattern.nnz                          # stored blocks, out of 16 * 16
    """
    if block < 1 or seq_len < 1 or seq_len % block:
        raise ValueError(f"block_pattern: expected a positive seq_len that is a multiple of a positive block, got "
                         f"seq_len = {seq_len}, block = {block}; pad the sequence to a multiple of the block")
    if min(local_blocks, global_blocks, random_blocks) < 0:
        raise ValueError(f"block_pattern: local_blocks, global_blocks and random_blocks must be >= 0, got "
                         f"{local_blocks}, {global_blocks}, {random_blocks}")
    n = seq_len // block
    i, j = np.indices((n, n))
    allowed = j <= i if causal else np.ones((n, n), bool)
    stored = ((np.abs(i - j) <= local_blocks) | (i < global_blocks) | (j < global_blocks)) & allowed
    rng = np.random.default_rng(seed)
    for row in range(n):
        candidates = np.flatnonzero(allowed[row] & ~stored[row])
        stored[row, rng.choice(candidates, min(random_blocks, len(candidates)), replace=False)] = True
    rows, cols = np.nonzero(stored)  # row-major: block rows in order, block columns increasing
    blocks = np.ones((len(rows), block, block), np.float32)
    if causal:
        blocks[rows == cols] = np.tril(np.ones((block, block), np.float32))
    indptr = np.concatenate([[0], np.cumsum(stored.sum(axis=1))])
    bsr = sp.bsr_matrix((blocks, cols, indptr), shape=(seq_len, seq_len), blocksize=(block, block))
    return BlockGroupCOO.from_scipy(bsr, block_shape=(block, block), group_size=1)


def _to_blocks(x: jax.Array, block: int) -> jax.Array:
    """`(T, H, D)` -> `(ceil(T / block), block, H, D)`, zero-padded."""
    blocks = -(-x.shape[0] // block)
    return jnp.pad(x, [(0, blocks * block - x.shape[0])] + [(0, 0)] * (x.ndim - 1)).reshape(blocks, block,
                                                                                             *x.shape[1:])


def block_sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, pattern: BlockGroupCOO, *,
                           scale: float | None = None) -> jax.Array:
    """Multi-head attention `softmax(q k^T * scale) v` computed only where `pattern` allows it.

    With the pattern's block rows `Ai`, block columns `Ak` and `Q`, `K`, `V` cut into blocks of rows
    (`(L/bm, bm, H, D)` etc.), three indirect Einsums do the sparse work:

    - scores, a block SDDMM per head: `S[g,m,k,p,h] = Q[Ai[g],m,h,d] * K[Ak[g,p],k,h,d]`;
    - softmax over each query's stored blocks: the row maximum is a `jax.ops.segment_max` over `Ai` of each
      group's maximum, and the normaliser the sorted segment sum `Z[Ai[g],m,h] += P[g,m,k,p,h]`;
    - output, a block SpMM per head: `O[Ai[g],m,h,d] += P[g,m,k,p,h] * V[Ak[g,p],k,h,d]`, divided by `Z`.

    An element attends iff the pattern's value there is nonzero (padding blocks are all zero). A query with
    nothing to attend to gets 0. `L` and `S` need not be multiples of the block shape.

    Args:
      q: `(L, H, D)` queries.
      k: `(S, H, D)` keys.
      v: `(S, H, Dv)` values.
      pattern: a `BlockGroupCOO` of shape `(L, S)`; e.g. from `block_pattern`.
      scale: multiplies the scores; defaults to `1 / sqrt(D)`.

    Returns:
      `(L, H, Dv)`. Batch with `jax.vmap` (the pattern broadcast, `in_axes=(0, 0, 0, None)`).

    Example:
      >>> pattern = jinsum.nn.block_pattern(256, 32, local_blocks=1, causal=True)
      >>> out = jinsum.nn.block_sparse_attention(q, k, v, pattern)   # q, k, v: (256, heads, 64)
    """
    if not isinstance(pattern, BlockGroupCOO):
        raise TypeError(f"block_sparse_attention: expected the pattern as a jinsum.BlockGroupCOO, got "
                        f"{type(pattern).__name__}; build one with jinsum.nn.block_pattern or "
                        "jinsum.BlockGroupCOO.from_dense(mask, block_shape=...) outside jit")
    if (q.ndim != 3 or k.shape != (k.shape[0], *q.shape[1:]) or v.ndim != 3 or v.shape[:2] != k.shape[:2]
            or pattern.shape != (q.shape[0], k.shape[0])):
        raise ValueError(f"block_sparse_attention: expected q (L, H, D), k (S, H, D), v (S, H, Dv) and a pattern of "
                         f"shape (L, S), got q {q.shape}, k {k.shape}, v {v.shape}, pattern {pattern.shape}")
    (bm, bk), length = pattern.block_shape, q.shape[0]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    Q, K, V = _to_blocks(q * scale, bm), _to_blocks(k, bk), _to_blocks(v, bk)
    scores = jinsum.einsum("S[g,m,k,p,h] = Q[Ai[g],m,h,d] * K[Ak[g,p],k,h,d]", A=pattern, Q=Q, K=K)
    allowed = (pattern.Av != 0)[..., None]

    # The shift only keeps exp() in range; it cancels in the softmax, so it carries no gradient.
    group_max = jnp.max(jnp.where(allowed, scores, -jnp.inf), axis=(2, 3))
    row_max = jax.ops.segment_max(group_max, pattern.Ai, num_segments=Q.shape[0], indices_are_sorted=True)
    shift = jax.lax.stop_gradient(row_max)[pattern.Ai][:, :, None, None]
    # Masking the exponent (not its result) keeps masked elements at exactly 0 with zero gradient.
    weights = jnp.exp(jnp.where(allowed, scores - shift, -jnp.inf))
    heads = q.shape[1]
    totals = jinsum.einsum("Z[Ai[g],m,h] += P[g,m,k,p,h]", A=pattern, P=weights,
                           Z=jax.ShapeDtypeStruct((Q.shape[0], bm, heads), weights.dtype))
    out = jinsum.einsum("O[Ai[g],m,h,d] += P[g,m,k,p,h] * V[Ak[g,p],k,h,d]", A=pattern, P=weights, V=V,
                        O=jax.ShapeDtypeStruct((Q.shape[0], bm, heads, v.shape[-1]), jnp.result_type(weights, V)))
    out = out / jnp.where(totals > 0, totals, 1)[..., None]
    return out.reshape(-1, heads, v.shape[-1])[:length]


class BlockSparseAttention(nnx.Module):
    """Multi-head self-attention over a block-sparse pattern: projections around `block_sparse_attention`.

    `x` is projected to queries, keys and values (`num_heads` heads of `head_dim`), attends through the
    pattern, and the concatenated heads are projected to `out_features`.

    Shapes: `x` `(L, in_features)`, `pattern` a `BlockGroupCOO` `(L, L)` -> `(L, out_features)`. Batch with
    `nnx.vmap` (the module and pattern broadcast).

    Example:
      >>> pattern = jinsum.nn.block_pattern(512, 64, local_blocks=1, global_blocks=1)   # once, on the host
      >>> attn = jinsum.nn.BlockSparseAttention(128, num_heads=4, rngs=nnx.Rngs(0))
      >>> y = attn(x, pattern)                                       # x: (512, 128) -> (512, 128)
    """

    def __init__(self, in_features: int, num_heads: int, *, head_dim: int | None = None,
                 out_features: int | None = None, use_bias: bool = True, param_dtype=jnp.float32, rngs: nnx.Rngs):
        """Creates the parameters.

        Args:
          in_features: the embedding size of the input.
          num_heads: `H`.
          head_dim: size of each head's queries, keys and values; defaults to `in_features // num_heads`.
          out_features: size of the output; defaults to `in_features`.
          use_bias: the projections have biases.
          param_dtype: dtype of the parameters; the computation follows JAX's promotion of input and parameters.
          rngs: initialises the projections.
        """
        head_dim = in_features // num_heads if head_dim is None else head_dim
        if head_dim < 1:
            raise ValueError(f"BlockSparseAttention: head_dim must be >= 1, got {head_dim} (in_features = "
                             f"{in_features}, num_heads = {num_heads}); pass head_dim explicitly")
        self.num_heads, self.head_dim = num_heads, head_dim
        self.qkv = nnx.Linear(in_features, 3 * num_heads * head_dim, use_bias=use_bias, param_dtype=param_dtype,
                              rngs=rngs)
        self.out = nnx.Linear(num_heads * head_dim, out_features or in_features, use_bias=use_bias,
                              param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array, pattern: BlockGroupCOO) -> jax.Array:
        """`x` `(L, in_features)`, `pattern` a `BlockGroupCOO` `(L, L)` -> `(L, out_features)`."""
        q, k, v = jnp.split(self.qkv(x).reshape(x.shape[0], 3 * self.num_heads, self.head_dim), 3, axis=1)
        return self.out(block_sparse_attention(q, k, v, pattern).reshape(x.shape[0], -1))
