"""Block-sparse multi-head attention as a Flax layer: projections around `jinsum.attention`, for training and for
serving over a paged cache.

The attention pattern is either a `jinsum.BlockMask` (`jinsum.block_mask` / `jinsum.sequence_mask`: the blocks a
`mask_mod` allows, built inside `jit` from data such as document ids; inside partial blocks the `mask_mod` decides,
in registers) or a `jinsum.BlockGroupCOO` of shape `(L, S)` (queries x keys) whose stored `bm x bk` blocks are the
ones computed (`jinsum.block_pattern`'s BigBird/Longformer layouts); causal masking is either a lower-triangular
diagonal block in the pattern or the `causal` rule.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jinsum._attention import BlockMask
from jinsum._attention import attention, sequence_mask
from jinsum.formats import BlockGroupCOO
from jinsum.formats._convert import as_jax_array, check_int
from jinsum.nn._dropout import dropout_seed
from jinsum.nn._dtypes import check_dtypes
from jinsum.nn._paged_kv_cache import PagedKVCache
from jinsum.nn._sizes import layer_sizes


class BlockSparseAttention(nnx.Module):
    """Multi-head self-attention over a block-sparse pattern: projections around `jinsum.attention`.

    `x` is projected to queries (`num_heads` heads of `head_dim`) and keys and values (`num_kv_heads` heads:
    grouped-query attention when fewer), attends through the pattern (one fused kernel on CUDA), and the
    concatenated heads are projected to `out_features`. The pattern is given (a `BlockGroupCOO` from
    `block_pattern`, a `BlockMask`), or built on the device at each call from the module's `causal` and `window`
    and the call's `document_ids` (`sequence_mask`): packed documents never attend to each other, and new
    document boundaries compile nothing.

    Shapes: `x` `(L, in_features)` or `(B, L, in_features)` -> `(L, out_features)` (`(B, L, out_features)`).
    Serving: `generate` runs the same projections over a `PagedKVCache`, for new tokens of many sequences at once.

    Example:
      >>> attn = jinsum.nn.BlockSparseAttention(32, num_heads=4, num_kv_heads=2, causal=True, window=64, block=32,
      ...                                       rngs=nnx.Rngs(0))
      >>> x = jnp.ones((2, 128, 32))                                     # (B, L, in_features)
      >>> doc = jnp.repeat(jnp.arange(4), 64).reshape(2, 128)           # (B, L): two documents per row
      >>> nnx.jit(lambda attn, x, doc: attn(x, document_ids=doc))(attn, x, doc).shape
      (2, 128, 32)
      >>> pattern = jinsum.block_pattern(128, 32, local_blocks=1, global_blocks=1)   # or a fixed pattern
      >>> nnx.jit(lambda attn, x: attn(x, pattern))(attn, x).shape
      (2, 128, 32)
    """

    def __init__(self, in_features: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, out_features: int | None = None, causal: bool = False,
                 window: int | None = None, block: int = 128, dropout: float = 0.0, use_bias: bool = True,
                 dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        """Creates the parameters.

        Args:
          in_features: the embedding size of the input.
          num_heads: `H`, query heads.
          num_kv_heads: key and value heads, dividing `H` (grouped-query attention; 1: multi-query); defaults
            to `H`.
          head_dim: size of each head's queries, keys and values; defaults to `in_features // num_heads`.
          out_features: size of the output; defaults to `in_features`.
          causal: position `t` attends to positions `<= t` only.
          window: a sliding window: position `t` attends to fewer than `window` positions away (before it, when
            causal); None for none. Used when a call builds its own mask.
          block: block size of the masks a call builds.
          dropout: dropout rate on the attention weights while the module is not in `eval()` mode (draws from
            the `dropout` stream of `rngs`, else its default stream).
          use_bias: the projections have biases.
          dtype: the computation's dtype (the input and the projections' weights are cast to it, as
            `nnx.Linear` casts them; the attention accumulates as its statements do, in float32 for bfloat16);
            None: JAX's promotion of the input and the parameters (`jinsum.nn._dtypes`).
          param_dtype: the parameters' dtype.
          rngs: initialises the projections and seeds the dropout.
        """
        where = "BlockSparseAttention"  # every argument checked here, not at the first call
        check_dtypes(where, dtype, param_dtype)
        in_features, num_heads, block = layer_sizes(where, in_features=in_features, num_heads=num_heads, block=block)
        optional = dict(num_kv_heads=num_kv_heads, head_dim=head_dim, out_features=out_features, window=window)
        num_kv_heads, head_dim, out_features, window = (
            None if value is None else check_int(where, f"{name} (or None)", value, minimum=1)
            for name, value in optional.items())
        if head_dim is None and in_features < num_heads:
            raise ValueError(f"{where}: head_dim must be >= 1, got in_features // num_heads = {in_features} // "
                             f"{num_heads} = 0; pass head_dim explicitly")
        head_dim = in_features // num_heads if head_dim is None else head_dim
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"{where}: num_kv_heads must divide num_heads = {num_heads}, got {num_kv_heads}")
        if isinstance(dropout, (bool, np.bool_)) or not isinstance(dropout, numbers.Real) or not 0 <= dropout < 1:
            raise ValueError(f"{where}: dropout must be in [0, 1), got {dropout!r}")
        self.in_features, self.num_heads = in_features, num_heads
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.causal, self.window, self.block = causal, window, block
        self.qkv = nnx.Linear(in_features, (num_heads + 2 * num_kv_heads) * head_dim, use_bias=use_bias,
                              dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.out = nnx.Linear(num_heads * head_dim, in_features if out_features is None else out_features,
                              use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array, pattern: BlockGroupCOO | BlockMask | None = None, *,
                 key_padding_mask: jax.Array | None = None, document_ids: jax.Array | None = None) -> jax.Array:
        """`x` `(..., L, in_features)`; `pattern` `(L, L)` or None (build one from `causal`, `window` and
        `document_ids`, `(L,)` or `(..., L)` integers); `key_padding_mask` `(..., L)` booleans (True: a real
        position) -> `(..., L, out_features)`."""
        shape, width = np.shape(x), self.in_features
        if len(shape) not in (2, 3) or shape[-1] != width:
            raise ValueError(f"BlockSparseAttention: expected x (L, {width}) or (B, L, {width}) (in_features = "
                             f"{width}), got {shape}")
        length = shape[-2]
        docs = None if document_ids is None else as_jax_array(document_ids)
        if docs is not None and docs.shape not in ((length,), shape[:-1]):
            expected = " or ".join(dict.fromkeys(map(str, ((length,), shape[:-1]))))
            raise ValueError(f"BlockSparseAttention: document_ids must be {expected} for x of shape {shape}, got "
                             f"{docs.shape}")
        if pattern is not None and not isinstance(pattern, (BlockGroupCOO, BlockMask)):
            raise TypeError("BlockSparseAttention: expected the pattern as a jinsum.BlockMask or jinsum.BlockGroupCOO, "
                            f"got {type(pattern).__name__}; build one with jinsum.block_mask(mask_mod, L, S, block), "
                            "jinsum.sequence_mask or jinsum.block_pattern (a graph's GroupCOO goes to jinsum.attention "
                            "or jinsum.nn.GATConv)")
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv(x).reshape(*shape[:-1], heads + 2 * kv_heads, self.head_dim)
        q, k, v = jnp.split(qkv, [heads, heads + kv_heads], axis=-2)
        mask_mod = None
        if pattern is None and length:
            pattern = sequence_mask(length, self.block, document_ids=docs, causal=self.causal, window=self.window)
        elif pattern is not None and docs is not None:
            if isinstance(pattern, BlockMask):
                raise ValueError("BlockSparseAttention: a BlockMask carries its own mask; build it with the document "
                                 "ids (jinsum.sequence_mask) instead of passing document_ids too")
            if docs.ndim == 1:
                mask_mod = lambda b, h, q, kv: docs[q] == docs[kv]  # noqa: E731
            else:  # one row of ids per batch element: the chain's `b` is x's batch axis
                mask_mod = lambda b, h, q, kv: docs[b, q] == docs[b, kv]  # noqa: E731
        if pattern is None:  # no positions (L = 0): nothing attends, and there is no mask to build
            out = jnp.zeros_like(q)
        else:
            rate, seed = dropout_seed(self.dropout)
            out = attention(q, k, v, pattern, causal=self.causal and not isinstance(pattern, BlockMask),
                            key_padding_mask=key_padding_mask, mask_mod=mask_mod, dropout=rate, seed=seed)
        return self.out(out.reshape(*shape[:-1], heads * self.head_dim))

    def generate(self, x: jax.Array, cache: PagedKVCache, sequence_ids: jax.Array,
                 query_starts: jax.Array | None = None) -> tuple[jax.Array, PagedKVCache]:
        """Serving: the new tokens of several sequences, their keys and values appended to `cache` and their
        queries attending over each sequence's cached tokens (`jinsum.paged_attention`, with the module's
        `causal` and `window`), with the parameters `__call__` trains: a prompt (prefill), a piece of one after a
        cached prefix, or a token per sequence (decoding), in one call.

        Args:
          x: `(T, in_features)` the new tokens of the sequences, packed end to end.
          cache: this layer's `PagedKVCache` (`num_kv_heads` heads of `head_dim`).
          sequence_ids: `(n,)` each sequence's slot in the cache (negative: a padding entry).
          query_starts: `(n + 1,)` offsets of each sequence's tokens in `x`; None: one token each.

        Returns `(y (T, out_features), cache)` with the tokens appended.
        """
        shape, width = np.shape(x), self.in_features
        if len(shape) != 2 or shape[-1] != width:
            raise ValueError(f"BlockSparseAttention.generate: expected x (T, {width}), the new tokens packed end to "
                             f"end (in_features = {width}), got {shape}")
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv(x).reshape(shape[0], heads + 2 * kv_heads, self.head_dim)
        q, k, v = jnp.split(qkv, [heads, heads + kv_heads], axis=-2)
        cache = cache.append(k, v, query_starts, sequence_ids)
        out = cache.attend(q, sequence_ids, query_starts, causal=self.causal, window=self.window)
        return self.out(out.reshape(shape[0], heads * self.head_dim)), cache
