"""`jinsum.attention`: softmax attention over the stored entries of any pattern format, as one fused chain.

The pattern's format says what an entry is. A `GroupCOO` `(L, S)` stores single (query, key) pairs: graph
attention, one score per edge. A `BlockGroupCOO` `(L, S)` of `bm x bk` blocks stores tiles of pairs: block-sparse
attention, whose scores and weighted sums are Tensor Core tiles. Either way `attention` writes the chain's two
statements for that format (see `jinsum._lang._chain`), checks them, and binds one primitive.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jinsum._attention import _chain_primitive
from jinsum._rules import _primitive
from jinsum._lang import _elementwise
from jinsum._lang import Access, Var, parse
from jinsum._lang._chain import Chain, Roles
from jinsum.formats import BlockGroupCOO, GroupCOO


def attention(q: jax.Array, k: jax.Array, v: jax.Array, pattern: GroupCOO | BlockGroupCOO, *,
              scale: float | None = None, score_mod: Callable | None = None, mask_mod: Callable | None = None,
              causal: bool = False, key_padding_mask: jax.Array | None = None, dropout: float = 0.0, seed=None,
              self_loops: bool = False, allow_tf32: bool = False, return_lse: bool = False):
    """Multi-head softmax attention of `q` over `k`, `v`, computed only at the stored entries of `pattern`.

    For query `i` and head `h`, `out[i, h] = sum_j softmax_j(s_ij) v[j, h]` over the keys `j` that `i` attends to,
    with `s_ij = score_mod(scale * q[i, h] . k[j, h], b, h, i, j)`. Query `i` attends to key `j` where the pattern
    stores `(i, j)` with a nonzero value and, if given, `mask_mod(b, h, i, j)` holds, `i >= j` (`causal`) and
    `key_padding_mask[b, j]`. A query that attends to nothing gets 0 (and its log-sum-exp is +inf). The whole chain (scores, transform, masks,
    online softmax, dropout, weighted sum) is one generated kernel on CUDA; its gradient is the FlashAttention-2
    backward (scores recomputed from the saved log-sum-exp), also generated kernels.

    Args:
      q: `(L, H, D)` queries, or `(B, L, H, D)` with a batch axis.
      k: `(S, H, D)` keys (`(B, S, H, D)` with a batch axis).
      v: `(S, H, E)` values (`(B, S, H, E)`).
      pattern: a `BlockGroupCOO` (block-sparse attention) or a `GroupCOO` (graph attention) of shape `(L, S)`; a
        `GroupCOO` may carry one value per head, `(L, S, H)`. Shared by the batch.
      scale: multiplies `q . k`; defaults to `1 / sqrt(D)`.
      score_mod: `f(score, b, h, q_idx, kv_idx) -> score` on scalars (FlexAttention's `score_mod`): a soft cap,
        a LeakyReLU, a positional bias. Traced once and compiled into the kernels. It may close over Python
        numbers and over arrays read with integer scalar indices (ALiBi slopes `slopes[h]`, a relative-position
        bias `bias[h, q_idx - kv_idx + S - 1]`); captured floating arrays get gradients, as `q`, `k` and `v` do.
      mask_mod: `f(b, h, q_idx, kv_idx) -> bool` on scalars (FlexAttention's `mask_mod`): where attention is
        allowed inside the pattern's blocks, evaluated in registers (a block pattern's elements are then never
        read). It may close over arrays, e.g. document ids `doc[q_idx] == doc[kv_idx]`; new values of the same
        shape reuse the compiled kernels. `jinsum.block_mask` builds a pattern from the same function.
      causal: query `i` attends to keys `j <= i` only.
      key_padding_mask: booleans `(S,)` or `(B, S)`, True for the real keys.
      dropout: rate at which attention weights are dropped (training); the kept ones are scaled by
        `1 / (1 - dropout)`. Needs `seed`.
      seed: an int, an int32 scalar array or a `jax.random.key`: which weights dropout drops. The forward and
        the backward draw the same ones from it; the same seed gives the same mask on every lowering.
      self_loops: graph attention: every node `i` also attends to itself, and stored self loops are ignored
        (needs `L == S`, a `GroupCOO`).
      allow_tf32: float32 products may use TensorFloat-32 on GPUs.
      return_lse: also return the log-sum-exp of each query's scores, `(..., L, H)` in float32.

    Returns:
      `(..., L, H, E)` in the dtype of `q`, `k`, `v` (and the log-sum-exp, with `return_lse`).

    Example:
      >>> pattern = jinsum.nn.block_pattern(4096, 128, local_blocks=1, global_blocks=1, random_blocks=2)
      >>> out = jinsum.attention(q, k, v, pattern, causal=True)            # q, k, v: (4096, 16, 64)
      >>> out = jinsum.attention(x, y, h, adjacency, score_mod=lambda s, b, h, i, j: jax.nn.leaky_relu(s, 0.2))
    """
    chain, arrays, unpad = build_chain(q, k, v, pattern, scale=scale, score_mod=score_mod, mask_mod=mask_mod,
                                       causal=causal, key_padding_mask=key_padding_mask, dropout=dropout, seed=seed,
                                       self_loops=self_loops, allow_tf32=allow_tf32)
    out, lse = _chain_primitive.bind(chain, arrays)
    out, lse = unpad(out), unpad(lse)
    return (out, lse) if return_lse else out


def build_chain(q, k, v, pattern, *, scale=None, score_mod=None, mask_mod=None, causal=False, key_padding_mask=None,
                dropout=0.0, seed=None, self_loops=False, allow_tf32=False):
    """The checked `Chain` of an `attention` call, its operands by name, and a function that turns the blocked
    `(..., rows, (bm,) H, ...)` results back into `(..., L, H, ...)`."""
    _check_arguments(q, k, v, pattern, dropout, self_loops)
    if mask_mod is not None and self_loops:
        raise ValueError("jinsum.attention: mask_mod and self_loops cannot be combined (a self loop would ignore the "
                         "mask); store the self loops in the pattern instead")
    mods = {}
    for kind, fn, prefix in (("score_mod", score_mod, "SC"), ("mask_mod", mask_mod, "MC")):
        if fn is not None:
            mods[kind], captured = _elementwise.trace(fn, kind)
            mods.update({f"{prefix}{i}": x for i, x in enumerate(captured)})
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    batched = q.ndim == 4
    batch = "b," if batched else ""
    lead = 1 if batched else 0
    (length, keys), head_dim = pattern.shape[:2], q.shape[-1]
    if isinstance(pattern, BlockGroupCOO):
        bm, bk = pattern.block_shape
        arrays = {"Q": _blocks(q, lead, bm), "K": _blocks(k, lead, bk), "V": _blocks(v, lead, bk)}
        scores = f"S[{batch}g,m,k,p,h] = Q[{batch}Ai[g],m,h,d] * K[{batch}Ak[g,p],k,h,d]"
        output = f"O[{batch}Ai[g],m,h,e] += S[{batch}g,m,k,p,h] * V[{batch}Ak[g,p],k,h,e]"
        mask = Access("Av", tuple(map(Var, "gmkp")))
        key_mask_indices = (*(Var("b"),) * batched, Access("Ak", (Var("g"), Var("p"))), Var("k"))
        roles = Roles(query_offset="m", key_offset="k")

        def unpad(x):  # (..., rows, bm, H, ...) -> (..., L, H, ...)
            return x.reshape(*x.shape[:lead], -1, *x.shape[lead + 2:])[(slice(None),) * lead + (slice(0, length),)]
    else:
        arrays = {"Q": q, "K": k, "V": v}
        scores = f"S[{batch}g,p,h] = Q[{batch}Ai[g],h,d] * K[{batch}Ak[g,p],h,d]"
        output = f"O[{batch}Ai[g],h,e] += S[{batch}g,p,h] * V[{batch}Ak[g,p],h,e]"
        mask = Access("Av", tuple(map(Var, "gph"[:pattern.Av.ndim])))
        key_mask_indices = (*(Var("b"),) * batched, Access("Ak", (Var("g"), Var("p"))))
        roles = Roles()

        def unpad(x):
            return x
    roles = dataclasses.replace(roles, batch=("b",) * batched, batch_index="b" if batched else None)
    arrays.update(Ai=pattern.Ai, Ak=pattern.Ak, Av=pattern.Av, seed=_seed(seed, dropout))
    arrays.update({n: x for n, x in mods.items() if n[:2] in ("SC", "MC")})
    extra = [_primitive.operand("Av", pattern.Av)]
    key_mask = None
    if key_padding_mask is not None:
        arrays["KM"] = _key_mask(key_padding_mask, q, keys, lead, pattern)
        key_mask = Access("KM", key_mask_indices)
        extra.append(_primitive.operand("KM", arrays["KM"]))

    value_dtype = jnp.result_type(q, k, v)
    score_dtype = jnp.float64 if value_dtype == jnp.float64 else jnp.float32
    for name in ("Q", "K", "V"):
        arrays[name] = arrays[name].astype(value_dtype)
    groups, slots, heads = pattern.Ak.shape + (q.shape[-2],)
    tile = pattern.block_shape if isinstance(pattern, BlockGroupCOO) else ()
    s_struct = jax.ShapeDtypeStruct(q.shape[:lead] + (groups, *tile, slots, heads), score_dtype)
    o_struct = jax.ShapeDtypeStruct(tuple(arrays["Q"].shape[:-1]) + (v.shape[-1],), value_dtype)
    flags = dict(sorted_indices=frozenset({"Ai"}), allow_tf32=allow_tf32, zero_lhs=True)
    scores_spec = _primitive.make_spec(parse(scores), {**arrays, "S": s_struct}, **flags)
    output_spec = _primitive.make_spec(parse(output), {**arrays, "S": s_struct, "O": o_struct}, **flags)
    chain = Chain(scores_spec, output_spec, mask, key_mask, tuple(extra), roles,
                  scale=float(1 / math.sqrt(head_dim) if scale is None else scale),
                  score_mod=mods.get("score_mod"), mask_mod=mods.get("mask_mod"), causal=bool(causal),
                  dropout=float(dropout), self_loops=bool(self_loops), allow_tf32=bool(allow_tf32)).check()
    if isinstance(pattern, GroupCOO) and pattern.transposed is not None:
        arrays["transposed"] = pattern.transposed  # the keys' entries, for the schedule (not an operand)
    return chain, arrays, unpad


def _check_arguments(q, k, v, pattern, dropout, self_loops) -> None:
    if not isinstance(pattern, (GroupCOO, BlockGroupCOO)):
        raise TypeError(f"jinsum.attention: expected the pattern as a jinsum.GroupCOO or jinsum.BlockGroupCOO, got "
                        f"{type(pattern).__name__}; build one outside jit (e.g. jinsum.nn.block_pattern, "
                        "jinsum.nn.adjacency or BlockGroupCOO.from_dense(mask, block_shape=...))")
    shapes = f"q {tuple(np.shape(q))}, k {tuple(np.shape(k))}, v {tuple(np.shape(v))}, pattern {pattern!r}"
    ndim = np.ndim(q)
    if ndim not in (3, 4) or np.ndim(k) != ndim or np.ndim(v) != ndim:
        raise ValueError(f"jinsum.attention: expected q (L, H, D), k (S, H, D), v (S, H, E), or all with a leading "
                         f"batch axis; got {shapes}")
    q_shape, k_shape, v_shape = np.shape(q), np.shape(k), np.shape(v)
    if k_shape[:-3] != q_shape[:-3] or v_shape[:-3] != q_shape[:-3]:
        raise ValueError(f"jinsum.attention: q, k and v must have the same batch size; got {shapes}")
    if k_shape[-2:] != q_shape[-2:] or v_shape[-3:-1] != k_shape[-3:-1]:
        raise ValueError(f"jinsum.attention: q and k must agree in heads and head size (H, D), and k and v in keys "
                         f"and heads (S, H); got {shapes}")
    if pattern.shape[:2] != (q_shape[-3], k_shape[-3]):
        raise ValueError(f"jinsum.attention: the pattern must be (L, S) = ({q_shape[-3]}, {k_shape[-3]}) for these "
                         f"queries and keys; got {shapes}")
    if isinstance(pattern, GroupCOO) and pattern.ndim == 3 and pattern.shape[2] != q_shape[-2]:
        raise ValueError(f"jinsum.attention: a GroupCOO pattern with per-head values must be (L, S, H) with H = "
                         f"{q_shape[-2]} heads; got {shapes}")
    if isinstance(pattern, GroupCOO) and pattern.ndim > 3:
        raise ValueError(f"jinsum.attention: a GroupCOO pattern is (L, S) or (L, S, H); got {shapes}")
    if not 0 <= dropout < 1:
        raise ValueError(f"jinsum.attention: dropout must be in [0, 1), got {dropout}")
    if self_loops and (isinstance(pattern, BlockGroupCOO) or pattern.shape[0] != pattern.shape[1]):
        raise ValueError(f"jinsum.attention: self_loops needs a square GroupCOO pattern (graph attention over one "
                         f"set of nodes); got {pattern!r}")


def _blocks(x: jax.Array, axis: int, block: int) -> jax.Array:
    """Cuts axis `axis` of `x` into zero-padded blocks: `(..., T, ...)` -> `(..., ceil(T / block), block, ...)`."""
    count = -(-x.shape[axis] // block)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, count * block - x.shape[axis])
    return jnp.pad(x, pad).reshape(*x.shape[:axis], count, block, *x.shape[axis + 1:])


def _seed(seed, dropout: float) -> jax.Array:
    """The dropout seed as a non-negative int32 scalar (0 when there is no dropout)."""
    if not dropout:
        return jnp.zeros((), jnp.int32)
    if seed is None:
        raise ValueError("jinsum.attention: dropout needs a seed: pass seed= an int, an int32 scalar or a "
                         "jax.random.key (a new one for every training step)")
    seed = jnp.asarray(seed) if not isinstance(seed, jax.Array) else seed
    if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
        return jax.random.randint(seed, (), 0, 2**31 - 1, jnp.int32)
    if seed.shape != () or not jnp.issubdtype(seed.dtype, jnp.integer):
        raise ValueError(f"jinsum.attention: seed must be an integer scalar or a jax.random.key, got "
                         f"{seed.dtype}{list(seed.shape)}")
    return (seed.astype(jnp.int32) & 0x7FFFFFFF).astype(jnp.int32)


def _key_mask(mask, q, keys: int, lead: int, pattern) -> jax.Array:
    """`key_padding_mask` as int8 `(B?, S)`, cut into blocks of keys for a block pattern."""
    mask = jnp.asarray(mask)
    expected = (*q.shape[:lead], keys)
    if mask.shape not in (expected, (keys,)) or mask.dtype != jnp.bool_:
        raise ValueError(f"jinsum.attention: key_padding_mask must be booleans of shape {expected} (or ({keys},) for "
                         f"every batch), True for the real keys; got {mask.dtype}{list(mask.shape)}")
    mask = jnp.broadcast_to(mask, expected).astype(jnp.int8)
    if isinstance(pattern, BlockGroupCOO):
        mask = _blocks(mask, lead, pattern.block_shape[1])
    return mask
