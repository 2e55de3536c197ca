"""Block-sparse multi-head attention: `jinsum.attention` over a block pattern, and BigBird-style patterns.

The attention pattern is a `jinsum.BlockGroupCOO` of shape `(L, S)` (queries x keys) whose stored `bm x bk`
blocks are the ones computed; inside them, an element attends iff the pattern's value there is nonzero. So
`block_pattern` makes BigBird/Longformer layouts with whole blocks of ones, and causal masking is either a
lower-triangular diagonal block in the pattern or the `causal` rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp
from flax import nnx

import jinsum
from jinsum._attention import block_mask as block_mask  # re-exported: jinsum.nn.block_mask
from jinsum.formats import BlockGroupCOO
from jinsum.nn._dropout import dropout_seed


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


def block_sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, pattern: BlockGroupCOO, *,
                           scale: float | None = None, causal: bool = False, key_padding_mask: jax.Array | None = None,
                           score_mod=None, dropout: float = 0.0, seed=None) -> jax.Array:
    """Multi-head attention `softmax(q k^T * scale) v` computed only where `pattern` allows it.

    `jinsum.attention` over a block pattern: on CUDA one generated kernel walks each query block's stored key
    blocks with Tensor Core tiles and an online softmax (FlashAttention's), and the gradient is the
    FlashAttention-2 backward; elsewhere the same chain runs as unfused statements. An element attends iff the
    pattern's value there is nonzero (blocks whose values are all nonzero are never read element by element),
    and, with `causal`, iff its key position is not after its query position. A query with nothing to attend to
    gets 0. `L` and `S` need not be multiples of the block shape.

    Args:
      q: `(L, H, D)` queries, or `(B, L, H, D)` with a batch axis.
      k: `(S, H, D)` keys (`(B, S, H, D)`).
      v: `(S, H, Dv)` values (`(B, S, H, Dv)`).
      pattern: a `BlockGroupCOO` of shape `(L, S)`, shared by the batch; e.g. from `block_pattern`.
      scale: multiplies the scores; defaults to `1 / sqrt(D)`.
      causal: query position `t` attends to key positions `<= t` only.
      key_padding_mask: booleans `(S,)` or `(B, S)`, True for the real keys.
      score_mod: `f(score, b, h, q_idx, kv_idx) -> score` (see `jinsum.attention`): soft caps, positional biases.
      dropout, seed: attention dropout at rate `dropout`, drawn from `seed` (an int or a `jax.random.key`).

    Returns:
      `(L, H, Dv)` (`(B, L, H, Dv)`).

    Example:
      >>> pattern = jinsum.nn.block_pattern(256, 32, local_blocks=1, causal=True)
      >>> out = jinsum.nn.block_sparse_attention(q, k, v, pattern, causal=True)   # q, k, v: (256, heads, 64)
    """
    if not isinstance(pattern, BlockGroupCOO):
        raise TypeError(f"block_sparse_attention: expected the pattern as a jinsum.BlockGroupCOO, got "
                        f"{type(pattern).__name__}; build one with jinsum.nn.block_pattern or "
                        "jinsum.BlockGroupCOO.from_dense(mask, block_shape=...) outside jit")
    return jinsum.attention(q, k, v, pattern, scale=scale, causal=causal, key_padding_mask=key_padding_mask,
                            score_mod=score_mod, dropout=dropout, seed=seed)


class BlockSparseAttention(nnx.Module):
    """Multi-head self-attention over a block-sparse pattern: projections around `block_sparse_attention`.

    `x` is projected to queries, keys and values (`num_heads` heads of `head_dim`), attends through the
    pattern (one fused kernel on CUDA), and the concatenated heads are projected to `out_features`.

    Shapes: `x` `(L, in_features)` or `(B, L, in_features)`, `pattern` a `BlockGroupCOO` `(L, L)` ->
    `(L, out_features)` (`(B, L, out_features)`).

    Example:
      >>> pattern = jinsum.nn.block_pattern(512, 64, local_blocks=1, global_blocks=1)   # once, on the host
      >>> attn = jinsum.nn.BlockSparseAttention(128, num_heads=4, causal=True, rngs=nnx.Rngs(0))
      >>> y = attn(x, pattern)                                       # x: (8, 512, 128) -> (8, 512, 128)
    """

    def __init__(self, in_features: int, num_heads: int, *, head_dim: int | None = None,
                 out_features: int | None = None, causal: bool = False, dropout: float = 0.0, use_bias: bool = True,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        """Creates the parameters.

        Args:
          in_features: the embedding size of the input.
          num_heads: `H`.
          head_dim: size of each head's queries, keys and values; defaults to `in_features // num_heads`.
          out_features: size of the output; defaults to `in_features`.
          causal: position `t` attends to positions `<= t` only.
          dropout: dropout rate on the attention weights while the module is not in `eval()` mode (draws from
            the `dropout` stream of `rngs`, else its default stream).
          use_bias: the projections have biases.
          param_dtype: dtype of the parameters; the computation follows JAX's promotion of input and parameters.
          rngs: initialises the projections and seeds the dropout.
        """
        head_dim = in_features // num_heads if head_dim is None else head_dim
        if head_dim < 1:
            raise ValueError(f"BlockSparseAttention: head_dim must be >= 1, got {head_dim} (in_features = "
                             f"{in_features}, num_heads = {num_heads}); pass head_dim explicitly")
        self.num_heads, self.head_dim, self.causal = num_heads, head_dim, causal
        self.qkv = nnx.Linear(in_features, 3 * num_heads * head_dim, use_bias=use_bias, param_dtype=param_dtype,
                              rngs=rngs)
        self.out = nnx.Linear(num_heads * head_dim, out_features or in_features, use_bias=use_bias,
                              param_dtype=param_dtype, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array, pattern: BlockGroupCOO, *, key_padding_mask: jax.Array | None = None
                 ) -> jax.Array:
        """`x` `(..., L, in_features)`, `pattern` `(L, L)`, `key_padding_mask` `(..., L)` booleans (True: a real
        position) -> `(..., L, out_features)`."""
        if x.ndim not in (2, 3):
            raise ValueError(f"BlockSparseAttention: expected x (L, in_features) or (B, L, in_features), got "
                             f"{x.shape}")
        q, k, v = jnp.split(self.qkv(x).reshape(*x.shape[:-1], 3 * self.num_heads, self.head_dim), 3, axis=-2)
        rate, seed = dropout_seed(self.dropout)
        out = block_sparse_attention(q, k, v, pattern, causal=self.causal, key_padding_mask=key_padding_mask,
                                     dropout=rate, seed=seed)
        return self.out(out.reshape(*x.shape[:-1], -1))
