"""`jinsum.attention`: softmax attention over the stored entries of any pattern format, as one fused chain.

The pattern's format says what an entry is. A `GroupCOO` `(L, S)` stores single (query, key) pairs: graph
attention, one score per edge. A `BlockGroupCOO` `(L, S)` of `bm x bk` blocks stores tiles of pairs: block-sparse
attention, whose scores and weighted sums are Tensor Core tiles. Either way `attention` writes the chain's two
statements for that format (see `jinsum._lang._chain`), checks them, and binds one primitive.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jinsum import _config
from jinsum._attention import _chain_primitive
from jinsum._attention._block_mask import BlockMask
from jinsum._rules import _primitive
from jinsum._lang import _elementwise
from jinsum._lang import Access, Var, parse
from jinsum._lang._chain import Chain, Roles
from jinsum.formats import BlockGroupCOO, GroupCOO
from jinsum.formats._convert import as_jax_array, check_not_overflowed, is_concrete


def attention(q: jax.Array, k: jax.Array, v: jax.Array, pattern: GroupCOO | BlockGroupCOO | BlockMask, *,
              scale: float | None = None, score_mod: Callable | None = None, mask_mod: Callable | None = None,
              causal: bool = False, key_padding_mask: jax.Array | None = None, dropout: float = 0.0, seed=None,
              self_loops: bool = False, allow_tf32: bool | None = None, return_lse: bool = False):
    """Multi-head softmax attention of `q` over `k`, `v`, computed only at the stored entries of `pattern`.

    For query `i` and head `h`, `out[i, h] = sum_j softmax_j(s_ij) v[j, h]` over the keys `j` that `i` attends to,
    with `s_ij = score_mod(scale * q[i, h] . k[j, h], b, h, i, j)`. Query `i` attends to key `j` where the pattern
    stores `(i, j)` with a nonzero value and, if given, `mask_mod(b, h, i, j)` holds, `i >= j` (`causal`) and
    `key_padding_mask[b, j]`. A query that attends to nothing gets 0 (and its log-sum-exp is +inf). The whole
    chain (scores, transform, masks, online softmax, dropout, weighted sum) is one generated kernel on CUDA; its
    gradient is the FlashAttention-2 backward (scores recomputed from the saved log-sum-exp), also generated
    kernels.

    Args:
      q: `(L, H, D)` queries, or `(B, L, H, D)` with a batch axis.
      k: `(S, H_kv, D)` keys (`(B, S, H_kv, D)` with a batch axis). `H_kv` may divide `H` (grouped-query and
        multi-query attention): query head `h` reads key/value head `h // (H / H_kv)` in place, never repeated.
      v: `(S, H_kv, E)` values (`(B, S, H_kv, E)`). A key the mask leaves out of a row it is stored in (a masked
        element of a stored block, a padding key, a future key under `causal`) still enters the row's products,
        with a weight of 0, as in dense attention and FlashAttention's kernels: a NaN or inf in its value (or in a
        query or key there) makes the row NaN (IEEE: 0 * inf is NaN). Keep padded positions finite (zeros).
      pattern: a `BlockMask` (`jinsum.block_mask`: blocks from a `mask_mod`, built on the device; its `mask_mod`
        applies too, per batch element and head if it was built so; outside `jit`, one whose `overflow` flag is
        set is an error), a `BlockGroupCOO` (block-sparse attention)
        or a `GroupCOO` (graph attention) of shape `(L, S)`; a `GroupCOO` may carry one value per head,
        `(L, S, H)`. Shared by the batch. Outside `jit`, a format whose `overflow` flag is set (built for a
        capacity under `jit` and returned) is an error too.
      scale: multiplies `q . k`: a finite Python or NumPy number (compiled into the kernels); defaults to
        `1 / sqrt(D)`.
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
      allow_tf32: float32 products may use TensorFloat-32 on GPUs; None follows `jax.default_matmul_precision`
        (as `jinsum.einsum`).
      return_lse: also return the log-sum-exp of each query's scores, `(..., L, H)` in float32.

    Returns:
      `(..., L, H, E)` in the dtype of `q`, `k`, `v` (and the log-sum-exp, with `return_lse`). No queries, heads,
      batch elements or value features give an empty result, and no keys zeros; the head size `D` must be at
      least 1 (the scores would carry nothing, and the default scale is undefined).

    Example:
      >>> q = k = v = jnp.ones((256, 4, 16))                                   # (L, H, D)
      >>> pattern = jinsum.block_pattern(256, 64, local_blocks=1, global_blocks=1, random_blocks=1)
      >>> jinsum.attention(q, k, v, pattern, causal=True).shape
      (256, 4, 16)
      >>> adjacency = jinsum.graphs.adjacency(np.array([[0, 1, 2], [1, 2, 0]]), num_nodes=3)   # a graph's edges
      >>> x = jnp.ones((3, 1, 8))                                                # (N, H, D)
      >>> jinsum.attention(x, x, x, adjacency, score_mod=lambda s, b, h, i, j: jax.nn.leaky_relu(s, 0.2)).shape
      (3, 1, 8)
    """
    chain, arrays, unpad = build_chain(q, k, v, pattern, scale=scale, score_mod=score_mod, mask_mod=mask_mod,
                                       causal=causal, key_padding_mask=key_padding_mask, dropout=dropout, seed=seed,
                                       self_loops=self_loops, allow_tf32=allow_tf32)
    out, lse = unpad(_chain_primitive.bind(chain, arrays))
    return (out, lse) if return_lse else out


def build_chain(q, k, v, pattern, *, scale=None, score_mod=None, mask_mod=None, causal=False, key_padding_mask=None,
                dropout=0.0, seed=None, self_loops=False, allow_tf32=None):
    """The checked `Chain` of an `attention` call, its operands by name, and a function that turns the blocked
    `(..., rows, (bm,) H, ...)` results (an array or a tuple of them) back into `(..., L, H, ...)`."""
    _check_arguments(q, k, v, pattern, dropout, self_loops)
    scale = scale_value(scale, np.shape(q)[-1])
    allow_tf32 = _config.tf32_allowed(allow_tf32)
    q, k, v = as_jax_array(q), as_jax_array(k), as_jax_array(v)
    mods, outer = {}, None
    if isinstance(pattern, (GroupCOO, BlockGroupCOO)):  # built for a capacity under jit and returned, overflowed
        check_not_overflowed("jinsum.attention", pattern)
    if isinstance(pattern, BlockMask):
        if mask_mod is not None:
            raise ValueError("jinsum.attention: the block mask carries its mask_mod; build it with the whole mask "
                             "(jinsum.block_mask(lambda b, h, q, kv: a(...) & b(...), ...)) instead of passing another")
        if is_concrete(pattern.overflow) and pattern.overflow:
            raise ValueError(f"jinsum.attention: the block mask overflowed: more blocks attend than its capacity = "
                             f"{pattern.capacity} holds, and those past it were dropped (the mask was built under "
                             "jit); rebuild it with a larger capacity (jinsum.block_mask called outside jit names "
                             "the capacity needed)")
        mods["mask_mod"] = pattern.mask_mod
        mods.update({f"MC{i}": x for i, x in enumerate(pattern.captures)})
        if causal and pattern.laid_out:
            raise ValueError("jinsum.attention: causal=True with a block mask built per batch element or head: put "
                             "the causal rule into its mask_mod instead (... & (q_idx >= kv_idx)), so that the blocks "
                             "are classified with it")
        q, k, v, key_padding_mask, score_mod, pattern, outer = _lay_out(pattern, q, k, v, key_padding_mask, score_mod)
    if isinstance(pattern, BlockGroupCOO):
        pattern = _as_block_flags(pattern, causal=causal, mask_mod=mask_mod is not None)
    if mask_mod is not None and self_loops:
        raise ValueError("jinsum.attention: mask_mod and self_loops cannot be combined (a self loop would ignore the "
                         "mask); store the self loops in the pattern instead")
    for kind, fn, prefix in (("score_mod", score_mod, "SC"), ("mask_mod", mask_mod, "MC")):
        if fn is not None:
            mods[kind], captured = _elementwise.trace(fn, kind)
            mods.update({f"{prefix}{i}": x for i, x in enumerate(captured)})
    batched = q.ndim == 4
    batch = "b," if batched else ""
    lead = 1 if batched else 0
    length, keys = pattern.shape[:2]
    heads, kv_heads = q.shape[-2], k.shape[-2]
    group = heads // max(kv_heads, 1)  # grouped-query attention: query head h * group + r reads key/value head h
    r = ",r" if group > 1 else ""
    block = _is_block(pattern)
    if block:
        scores = f"S[{batch}g,m,k,p,h{r}] = Q[{batch}Ai[g],m,h{r},d] * K[{batch}Ak[g,p],k,h,d]"
        output = f"O[{batch}Ai[g],m,h{r},e] += S[{batch}g,m,k,p,h{r}] * V[{batch}Ak[g,p],k,h,e]"
        # One flag per block (a block mask), or the blocks' elements.
        mask = Access("Av", tuple(map(Var, "gp" if pattern.Av.ndim == 2 else "gmkp")))
        key_mask_indices = (*(Var("b"),) * batched, Access("Ak", (Var("g"), Var("p"))), Var("k"))
        roles = Roles(query_offset="m", key_offset="k")
    else:
        scores = f"S[{batch}g,p,h{r}] = Q[{batch}Ai[g],h{r},d] * K[{batch}Ak[g,p],h,d]"
        output = f"O[{batch}Ai[g],h{r},e] += S[{batch}g,p,h{r}] * V[{batch}Ak[g,p],h,e]"
        mask = Access("Av", tuple(map(Var, "gph"[:pattern.Av.ndim])))
        key_mask_indices = (*(Var("b"),) * batched, Access("Ak", (Var("g"), Var("p"))))
        roles = Roles()
    if group > 1 and not block and pattern.Av.ndim == 3:  # one value per query head: (G, P, H_kv, R)
        pattern = pattern.with_values(pattern.Av.reshape(*pattern.Av.shape[:2], kv_heads, group))
        mask = Access("Av", tuple(map(Var, "gphr")))
    unpad = (functools.partial(_unpadded, how=_Unpad(lead, heads, group, block, length, outer))
             if group > 1 or block or outer is not None else _identity)
    roles = dataclasses.replace(roles, batch=("b",) * batched, batch_index="b" if batched else None,
                                head_group="r" if group > 1 else None)
    dropout_seed = _seed(seed, dropout)
    if key_padding_mask is not None:
        key_padding_mask = _checked_key_mask(key_padding_mask, q, keys, lead)
    value_dtype = jnp.result_type(q, k, v)
    score_dtype = jnp.float64 if value_dtype == jnp.float64 else jnp.float32
    Q, K, V, KM = _operands(q, k, v, key_padding_mask, lead=lead, tile=pattern.block_shape if block else None,
                            kv_heads=kv_heads, group=group, dtype=value_dtype)
    arrays = {"Q": Q, "K": K, "V": V, "Ai": pattern.Ai, "Ak": pattern.Ak, "Av": pattern.Av, "seed": dropout_seed}
    arrays.update({n: x for n, x in mods.items() if n[:2] in ("SC", "MC")})
    extra = [_primitive.operand("Av", pattern.Av)]
    key_mask = None
    if key_padding_mask is not None:
        arrays["KM"] = KM
        key_mask = Access("KM", key_mask_indices)
        extra.append(_primitive.operand("KM", arrays["KM"]))

    groups, slots = pattern.Ak.shape
    tile = pattern.block_shape if block else ()
    s_struct = jax.ShapeDtypeStruct(q.shape[:lead] + (groups, *tile, slots, kv_heads) + ((group,) if r else ()),
                                    score_dtype)
    o_struct = jax.ShapeDtypeStruct(tuple(arrays["Q"].shape[:-1]) + (v.shape[-1],), value_dtype)
    flags = dict(sorted_indices=frozenset({"Ai"}), allow_tf32=allow_tf32, zero_lhs=True)
    scores_spec = _primitive.make_spec(parse(scores), {**arrays, "S": s_struct}, **flags)
    output_spec = _primitive.make_spec(parse(output), {**arrays, "S": s_struct, "O": o_struct}, **flags)
    chain = Chain(scores_spec, output_spec, mask, key_mask, tuple(extra), roles,
                  scale=scale,
                  score_mod=mods.get("score_mod"), mask_mod=mods.get("mask_mod"), causal=bool(causal),
                  dropout=float(dropout), self_loops=bool(self_loops), allow_tf32=bool(allow_tf32)).check()
    if isinstance(pattern, GroupCOO) and pattern.transposed is not None:
        arrays["transposed"] = pattern.transposed  # the keys' entries, for the schedule (not an operand)
    return chain, arrays, unpad


class _Blocks(NamedTuple):
    """A block pattern as the chain reads it: a `BlockGroupCOO`'s arrays, or a `BlockMask`'s with one flag per
    block as `Av`."""

    Ai: jax.Array
    Ak: jax.Array
    Av: jax.Array
    shape: tuple[int, int]
    block_shape: tuple[int, int]


class _Unpad(NamedTuple):
    """How the chain's results `(..., rows, (bm,) H_kv, (R,) ...)` go back to `(..., L, H, ...)` (static)."""

    lead: int  # 1 with a batch axis
    heads: int
    group: int  # query heads per key/value head
    block: bool  # rows in blocks of bm
    length: int  # the rows kept
    laid_out: _Outer | None  # a block mask's layout (`_lay_out`), or None


class _Outer(NamedTuple):
    """A laid-out block mask's rows `(B * (H *) rows, ...)` taken back to `(..., L, H, ...)` (`_lay_out`)."""

    size: int  # batch elements
    rows: int  # padded rows of each batch element (and head)
    length: int  # L
    batched: bool  # q had a batch axis
    heads: int | None  # the heads laid along the rows too


# Each one compiled program (eagerly, each of their operations compiled alone: several times slower for a new shape).
@functools.partial(jax.jit, static_argnames=("lead", "tile", "kv_heads", "group", "dtype"))
def _operands(q, k, v, key_mask, *, lead: int, tile: tuple[int, int] | None, kv_heads: int, group: int, dtype):
    """`Q`, `K` and `V` in `dtype` and the key mask (or None) as int8 `(B?, S)`, as the chain reads them: cut into
    zero-padded blocks of queries and of keys for a block pattern (`tile`: its block shape), and the query heads
    as `(H_kv, group)` for grouped-query attention."""
    if key_mask is not None:
        key_mask = jnp.broadcast_to(key_mask, (*q.shape[:lead], k.shape[lead])).astype(jnp.int8)
    if tile is not None:
        bm, bk = tile
        q, k, v = _blocks(q, lead, bm), _blocks(k, lead, bk), _blocks(v, lead, bk)
        key_mask = None if key_mask is None else _blocks(key_mask, lead, bk)
    if group > 1:
        q = q.reshape(*q.shape[:-2], kv_heads, group, q.shape[-1])
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), key_mask


@functools.partial(jax.jit, static_argnames="how")
def _unpadded(results, how: _Unpad):
    """The chain's results (an array or a pytree of them) as `(..., L, H, ...)`."""
    lead, head_axis = how.lead, how.lead + (2 if how.block else 1)

    def unpad(x):
        if how.group > 1:
            x = x.reshape(*x.shape[:head_axis], how.heads, *x.shape[head_axis + 2:])
        if how.block:
            rows = x.shape[lead] * x.shape[lead + 1]  # not -1: x may be empty (no heads, E = 0, a batch of 0)
            x = x.reshape(*x.shape[:lead], rows, *x.shape[lead + 2:])[(slice(None),) * lead + (slice(0, how.length),)]
        return x if how.laid_out is None else _outer(x, how.laid_out)
    return jax.tree.map(unpad, results)


def _outer(x, how: _Outer):
    """Laid-out rows back to `(..., L, H, ...)`: `(B * rows, H, ...)`, or `(B * H * rows, 1, ...)` with the heads."""
    size, rows, length = how.size, how.rows, how.length
    if how.heads is None:
        return x.reshape(size, rows, *x.shape[1:])[:, :length][0 if not how.batched else slice(None)]
    x = x.reshape(size, how.heads, rows, *x.shape[2:])[:, :, :length]
    x = jnp.moveaxis(x, 1, 2)
    return x if how.batched else x[0]


def _as_block_flags(pattern: BlockGroupCOO, *, causal: bool, mask_mod: bool) -> BlockGroupCOO | _Blocks:
    """A block pattern known on the host whose blocks hold no zero the causal rule does not mask anyway (as
    `jinsum.block_pattern`'s), as one flag per block, as a block mask is read: the kernels then never read its
    elements. (They would read them on a partial block only, but that read's 64-bit address tile costs registers,
    spilled in every iteration, full blocks included: DESIGN.md, "Attention masks as block flags".) Blocks without
    a nonzero element get flag 0; with `mask_mod`, no block is full (the kernels evaluate it on every block but
    empty ones)."""
    if not all(is_concrete(x) for x in (pattern.Ai, pattern.Ak, pattern.Av)):
        return pattern
    (bm, bk), nonzero = pattern.block_shape, np.asarray(pattern.Av) != 0  # (G, bm, bk, P), on the host
    holes = ~nonzero
    if causal:  # zeros above the diagonal are masked by the rule
        rows = np.asarray(pattern.Ai)[:, None, None, None] * bm + np.arange(bm)[None, :, None, None]
        cols = np.asarray(pattern.Ak)[:, None, None, :] * bk + np.arange(bk)[None, None, :, None]
        holes &= rows >= cols
    attends, full = nonzero.any(axis=(1, 2)), nonzero.all(axis=(1, 2))
    if (holes.any(axis=(1, 2)) & attends).any():
        return pattern
    flags = np.where(full & (not mask_mod), 2, np.where(attends, 1, 0)).astype(np.int8)
    return _Blocks(pattern.Ai, pattern.Ak, as_jax_array(flags), pattern.shape, pattern.block_shape)


def _is_block(pattern) -> bool:
    return isinstance(pattern, (BlockGroupCOO, _Blocks))


def _identity(x):
    return x


def _lay_out(mask: BlockMask, q, k, v, key_padding_mask, score_mod):
    """`q`, `k`, `v` (and the key mask, `score_mod` and the pattern) laid out as the block mask's rows are: the
    batch elements (and heads, when the mask depends on them) one after another along the sequence, each padded
    to whole blocks. Returns them and how the results are laid back out as `(..., L, H, ...)` (`_Outer`, or None
    where the mask lays out nothing)."""
    (length, keys), (bm, bk), (lb, sb) = mask.shape, mask.block, mask.grid
    pattern = _Blocks(mask.Ai, mask.Ak, mask.flags, mask.shape, mask.block)
    _check_mask_reads(mask, q)
    if not mask.laid_out:
        return q, k, v, key_padding_mask, score_mod, pattern, None
    batched = q.ndim == 4
    size, heads = (q.shape[0] if batched else 1), q.shape[-2]
    given = f"q of shape {tuple(q.shape)}" + ("" if batched else " (no batch axis: a batch of 1)")
    if mask.batch is not None and mask.batch != size:
        raise ValueError(f"jinsum.attention: the block mask holds one mask per batch element for a batch of "
                         f"{mask.batch} (jinsum.block_mask's batch=, or (B, L) document ids in "
                         f"jinsum.sequence_mask), but got {given}; pass q, k and v with a leading batch axis of "
                         f"{mask.batch}, or build the mask for a batch of {size}")
    if mask.batch is None and size > 1:
        raise ValueError(f"jinsum.attention: the block mask holds one mask per head (heads={mask.heads}) for a "
                         f"single batch element, but got {given}; build it with jinsum.block_mask(..., batch={size}, "
                         f"heads={mask.heads})")
    if mask.heads is not None and mask.heads != heads:
        raise ValueError(f"jinsum.attention: the block mask was built for heads={mask.heads}, but got {given} with "
                         f"{heads} heads; build it with heads={heads}")
    rows, cols = lb * bm, sb * bk
    if key_padding_mask is not None:
        key_padding_mask = as_jax_array(key_padding_mask)
    q, k, v, key_padding_mask, Ak = _laid_out(q, k, v, key_padding_mask, mask.Ai, mask.Ak, grid=mask.grid,
                                              padded=(rows, cols), keys=keys, heads=mask.heads)
    per_row = size * (mask.heads or 1) * rows
    pattern = pattern._replace(Ak=Ak, shape=(per_row, k.shape[0]))
    if score_mod is not None:
        score_mod = _in_layout(score_mod, rows, cols, mask.batch is not None, mask.heads)
    return q, k, v, key_padding_mask, score_mod, pattern, _Outer(size, rows, length, batched, mask.heads)


# One compiled program (eagerly, each of its operations compiled alone: several times slower for a new shape).
@functools.partial(jax.jit, static_argnames=("grid", "padded", "keys", "heads"))
def _laid_out(q, k, v, key_padding_mask, Ai, Ak, *, grid: tuple[int, int], padded: tuple[int, int], keys: int,
              heads: int | None):
    """`_lay_out`'s arrays: `q`, `k`, `v` and the key mask (or None) padded to `padded = (rows, cols)` positions
    per batch element, then the batch (and with `heads`, the heads) along the sequence; the slots' key block
    columns `Ak` moved to their batch element's (and key/value head's) keys."""
    (lb, sb), (rows, cols) = grid, padded
    batched = q.ndim == 4
    size, kv_heads = (q.shape[0] if batched else 1), k.shape[-2]
    pad = lambda x, n: jnp.pad(x, [(0, 0), (0, n - x.shape[1])] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    q, k, v = (x if batched else x[None] for x in (q, k, v))
    q, k, v = pad(q, rows), pad(k, cols), pad(v, cols)
    if key_padding_mask is not None:
        key_padding_mask = pad(jnp.broadcast_to(key_padding_mask, (size, keys)), cols)
    segment = Ai // lb  # the batch element (and head) of each block row
    if heads is None:  # the batch along the sequence; heads stay a grid axis
        q, k, v = (x.reshape(-1, *x.shape[2:]) for x in (q, k, v))
        key_column = segment * sb
    else:  # batch and heads along the sequence, one head
        group = heads // kv_heads
        q, k, v = (x.transpose(0, 2, 1, 3).reshape(-1, 1, x.shape[-1]) for x in (q, k, v))
        key_column = ((segment // heads) * kv_heads + (segment % heads) // group) * sb
        if key_padding_mask is not None:
            key_padding_mask = jnp.broadcast_to(key_padding_mask[:, None], (size, kv_heads, cols))
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.reshape(-1)
    return q, k, v, key_padding_mask, Ak + key_column[:, None].astype(Ak.dtype)


def _check_mask_reads(mask: BlockMask, q) -> None:
    """A block mask built once for every batch element (head) whose `mask_mod` reads `b` (`h`) would give every
    batch element (head) the blocks of element 0 (head 0): refused where there is more than one."""
    size, heads = q.shape[0] if q.ndim == 4 else 1, q.shape[-2]
    for argument, built, count, what, keyword in (("b", mask.batch, size, "batch element", "batch"),
                                                  ("h", mask.heads, heads, "head", "heads")):
        if argument in mask.reads and built is None and count > 1:
            raise ValueError(f"jinsum.attention: the block mask's mask_mod {mask.mask_mod.name} reads {argument} (the "
                             f"{what}), but the mask was built with {keyword}=None, one mask for every {what}, and "
                             f"q of shape {tuple(q.shape)} has {count} {what}s: each would get the blocks of "
                             f"{what} 0; build it with jinsum.block_mask(..., {keyword}={count}), or leave "
                             f"{argument} out of mask_mod")


def _in_layout(score_mod, rows: int, cols: int, by_batch: bool, heads: int | None):
    """`score_mod` seeing each batch element's (head's) own coordinates in a laid-out sequence."""
    def laid_out(s, b, h, q_idx, kv_idx):
        segment = q_idx // rows
        if heads is not None:
            h = segment % heads
            segment = segment // heads
        return score_mod(s, segment if by_batch else b, h, q_idx % rows, kv_idx % cols)
    laid_out.__name__ = getattr(score_mod, "__name__", "score_mod")
    return laid_out


def _check_arguments(q, k, v, pattern, dropout, self_loops) -> None:
    if not isinstance(pattern, (GroupCOO, BlockGroupCOO, BlockMask)):
        raise TypeError(f"jinsum.attention: expected the pattern as a jinsum.GroupCOO, jinsum.BlockGroupCOO or "
                        f"jinsum.BlockMask, got {type(pattern).__name__}; build one with jinsum.block_mask(mask_mod, "
                        "L, S, block), jinsum.block_pattern, jinsum.graphs.adjacency or BlockGroupCOO.from_dense(mask, "
                        "block_shape=...)")
    shapes = f"q {tuple(np.shape(q))}, k {tuple(np.shape(k))}, v {tuple(np.shape(v))}, pattern {pattern!r}"
    ndim = np.ndim(q)
    if ndim not in (3, 4) or np.ndim(k) != ndim or np.ndim(v) != ndim:
        raise ValueError(f"jinsum.attention: expected q (L, H, D), k (S, H, D), v (S, H, E), or all with a leading "
                         f"batch axis; got {shapes}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise TypeError(f"jinsum.attention: {name} must be float16, bfloat16, float32 or float64, got "
                            f"{jnp.result_type(x)}{list(np.shape(x))}; cast it, e.g. {name}.astype(jnp.bfloat16)")
    q_shape, k_shape, v_shape = np.shape(q), np.shape(k), np.shape(v)
    if k_shape[:-3] != q_shape[:-3] or v_shape[:-3] != q_shape[:-3]:
        raise ValueError(f"jinsum.attention: q, k and v must have the same batch size; got {shapes}")
    heads, kv_heads = q_shape[-2], k_shape[-2]
    divides = heads == kv_heads == 0 or (heads > 0 and kv_heads > 0 and heads % kv_heads == 0)
    if k_shape[-1] != q_shape[-1] or not divides or v_shape[-3:-1] != k_shape[-3:-1]:
        raise ValueError(f"jinsum.attention: q and k must agree in head size D and k's heads must divide q's "
                         f"(grouped-query attention: H_q a multiple of H_kv; no heads at all for an empty result), "
                         f"and k and v must agree in keys and heads (S, H_kv); got {shapes}")
    if q_shape[-1] == 0:
        raise ValueError(f"jinsum.attention: q and k have head size D = 0: every score q . k would be 0 and the "
                         f"default scale 1 / sqrt(D) is undefined; pass q and k with D >= 1; got {shapes}")
    if pattern.shape[:2] != (q_shape[-3], k_shape[-3]):
        raise ValueError(f"jinsum.attention: the pattern must be (L, S) = ({q_shape[-3]}, {k_shape[-3]}) for these "
                         f"queries and keys; got {shapes}")
    if isinstance(pattern, GroupCOO) and pattern.ndim == 3 and pattern.shape[2] != q_shape[-2]:
        raise ValueError(f"jinsum.attention: a GroupCOO pattern with per-head values must be (L, S, H) with H = "
                         f"{q_shape[-2]} heads; got {shapes}")
    if isinstance(pattern, GroupCOO) and pattern.ndim > 3:
        raise ValueError(f"jinsum.attention: a GroupCOO pattern is (L, S) or (L, S, H); got {shapes}")
    if isinstance(dropout, (bool, np.bool_)) or not isinstance(dropout, numbers.Real) or not 0 <= dropout < 1:
        raise ValueError(f"jinsum.attention: dropout must be in [0, 1), got {dropout!r}")
    if self_loops and (not isinstance(pattern, GroupCOO) or pattern.shape[0] != pattern.shape[1]):
        raise ValueError(f"jinsum.attention: self_loops needs a square GroupCOO pattern (graph attention over one "
                         f"set of nodes); got {pattern!r}")


def scale_value(scale, head_dim: int, where: str = "jinsum.attention") -> float:
    """`scale` as a Python float, compiled into the kernels: `1 / sqrt(D)` by default; errors name `where`."""
    if scale is None:
        return 1 / math.sqrt(head_dim)
    value = np.asarray(scale) if is_concrete(scale) else None
    if value is None or value.ndim or not (jnp.issubdtype(value.dtype, jnp.floating)
                                           or jnp.issubdtype(value.dtype, jnp.integer)):
        given = f"{type(scale).__name__} {scale!r}" if np.ndim(scale) == 0 else f"an array of shape {np.shape(scale)}"
        raise TypeError(f"{where}: scale must be a real Python or NumPy number (it is compiled into the "
                        f"kernels: not a traced array), or None for 1 / sqrt(D); got {given}")
    if not np.isfinite(value):
        raise ValueError(f"{where}: scale must be finite, got {scale!r}")
    return float(value)


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


def _checked_key_mask(mask, q, keys: int, lead: int) -> jax.Array:
    """`key_padding_mask` as a JAX array, checked: booleans `(B?, S)` or `(S,)`."""
    mask = as_jax_array(mask)
    expected = (*q.shape[:lead], keys)
    if mask.shape not in (expected, (keys,)) or mask.dtype != jnp.bool_:
        raise ValueError(f"jinsum.attention: key_padding_mask must be booleans of shape {expected} (or ({keys},) for "
                         f"every batch), True for the real keys; got {mask.dtype}{list(mask.shape)}")
    return mask
