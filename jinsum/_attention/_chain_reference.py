"""The unfused evaluation of an attention chain: the reference lowering (every platform) and the fallback on CUDA.

Each statement of the chain is one jinsum statement, and what lies between them is plain XLA: the scores
`S[...] = Q[...] * K[...]` (an SDDMM, materialised), the scale, `score_mod` and the masks elementwise, the row
maximum `LSE[...] max= S[...]`, the weights `exp(S - max)`, their row sums a `segment_sum`, and the output the SpMM
`O[...] += P[...] * V[...]` divided by the row sums. On CUDA the two statements still get their generated
kernels; only the fusion is missing. `score_mod` and `mask_mod` are applied to whole arrays of coordinates (with
their captured arrays). Its derivatives are JAX's own (`jax.vjp` / `jax.jvp` of `forward`, with respect to the
chain's differentiable operands), so this module is also the reference that the fused kernels' backward is tested
against.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jinsum._attention import _random_bits
from jinsum._rules import _primitive
from jinsum._lang import Access, Statement, Var
from jinsum._lang._chain import Chain


def forward(chain: Chain, arrays: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """`(O, LSE)` of the chain on `arrays` (by name, see `Chain.names`)."""
    r, scores = chain.roles, chain.scores
    precision = jnp.float64 if chain.operand["Q"].dtype == np.float64 else jnp.float32
    s_shape = scores.lhs.shape
    # (Its index arrays were checked when the chain was bound: this runs inside lowerings, where a check cannot be.)
    S = _primitive.bind(scores.statement, {**arrays, "S": jnp.zeros(s_shape, precision)}, **chain.output.modes,
                        zero_lhs=True, check_indices=False)
    axes = tuple(i.name for i in scores.statement.lhs.indices)
    at = _Coordinates(chain, arrays, axes)
    row, col = at.read(Access("Ai", (Var(r.group),))), at.read(Access("Ak", (Var(r.group), Var(r.slot))))
    q_idx, kv_idx = row, col
    if chain.block:
        (bm, bk) = chain.block
        q_idx, kv_idx = row * bm + at.var(r.query_offset), col * bk + at.var(r.key_offset)
    head = at.head()
    S = _transform(chain, arrays, S * chain.scale, at.batch_index(), head, q_idx, kv_idx)
    allowed = at.read(chain.mask) != 0
    if chain.mask_mod is not None:
        allowed &= chain.mask_mod([arrays[n] for n in chain.mask_captures], at.batch_index(), head, q_idx, kv_idx)
    if chain.causal:
        allowed &= q_idx >= kv_idx
    if chain.key_mask is not None:
        allowed &= at.read(chain.key_mask) != 0
    if chain.self_loops:
        allowed &= col != row
    allowed = jnp.broadcast_to(allowed, s_shape)

    lse_shape = chain.operand["LSE"].shape
    segment = jnp.broadcast_to(at.flat_index(chain.lse, lse_shape), s_shape).reshape(-1)
    rows = math.prod(lse_shape)
    # The shift only keeps exp() in range; it cancels, so it carries no gradient (and the maximum needs no winners).
    row_max = _primitive.bind(Statement(chain.lse, True, (Access("S", scores.statement.lhs.indices),), reduction="max"),
                              {**arrays, "S": jax.lax.stop_gradient(jnp.where(allowed, S, -jnp.inf)),
                               "LSE": jnp.full(lse_shape, -jnp.inf, precision)},
                              sorted_indices=frozenset({"Ai"}), deterministic=chain.output.deterministic,
                              check_indices=False)
    if chain.self_loops:
        self_scores = _self_scores(chain, arrays, lse_shape)
        row_max = jnp.maximum(row_max, self_scores)
    shift = jax.lax.stop_gradient(jnp.where(jnp.isneginf(row_max), 0, row_max))
    # Masking the exponent (not its result) keeps masked weights at exactly 0 with zero gradient.
    weights = jnp.exp(jnp.where(allowed, S - shift.reshape(-1)[segment].reshape(s_shape), -jnp.inf))
    totals = jax.ops.segment_sum(weights.reshape(-1), segment, rows).reshape(lse_shape)
    if chain.dropout:
        weights = weights * _kept(chain, arrays, at.dropout_offsets(chain))
    out = _primitive.bind(chain.output.statement,
                          {**arrays, "S": weights, "O": jnp.zeros(chain.output.lhs.shape, precision)},
                          **chain.output.modes, zero_lhs=True, check_indices=False)
    if chain.self_loops:
        self_weights = jnp.exp(self_scores - shift)
        totals = totals + self_weights
        if chain.dropout:
            self_weights = self_weights * _kept(chain, arrays, _self_offsets(chain, lse_shape))
        out = out + self_weights[..., None] * arrays["V"]
    safe = jnp.where(totals > 0, totals, 1)
    out = out / safe[..., None]
    lse = jnp.where(totals > 0, shift + jnp.log(safe), jnp.inf)
    return out.astype(chain.output.lhs.dtype), lse.astype(chain.operand["LSE"].dtype)


def tangent(chain: Chain, arrays: dict, tangents: tuple) -> tuple[jax.Array, jax.Array]:
    """`(dO, dLSE)` for the tangents of `chain.differentiable`: forward-mode, by JAX's rules on `forward`."""
    names = chain.differentiable
    return jax.jvp(lambda *x: forward(chain, {**arrays, **dict(zip(names, x))}),
                   tuple(arrays[n] for n in names), tuple(tangents))[1]


def backward(chain: Chain, arrays: dict, cotangents: tuple) -> tuple[jax.Array, ...]:
    """The gradients of `chain.differentiable` (`dQ`, `dK`, `dV`, captures) for cotangents `(dO, dLSE)`:
    reverse-mode, by JAX's rules on `forward`."""
    names = chain.differentiable
    _, pullback = jax.vjp(lambda *x: forward(chain, {**arrays, **dict(zip(names, x))}),
                          *(arrays[n] for n in names))
    return pullback(cotangents)


def _transform(chain: Chain, arrays: dict, scores, b, h, q_idx, kv_idx):
    if chain.score_mod is None:
        return scores
    captures = [arrays[n] for n in chain.score_captures]
    return chain.score_mod(captures, scores, b, h, q_idx, kv_idx).astype(scores.dtype)


def _self_scores(chain: Chain, arrays: dict, lse_shape) -> jax.Array:
    """The score of every row with itself (self loops): `sum_d Q[..., i, h, d] * K[..., i, h, d]`, transformed."""
    r = chain.roles
    precision = jnp.float64 if chain.operand["Q"].dtype == np.float64 else jnp.float32
    raw = jnp.sum(arrays["Q"].astype(precision) * arrays["K"].astype(precision), axis=-1) * chain.scale
    index = jax.lax.broadcasted_iota(jnp.int32, lse_shape, len(r.batch))
    b = (jax.lax.broadcasted_iota(jnp.int32, lse_shape, r.batch.index(r.batch_index))
         if r.batch_index else jnp.zeros((), jnp.int32))
    return _transform(chain, arrays, raw, b, jax.lax.broadcasted_iota(jnp.int32, lse_shape, len(lse_shape) - 1), index,
                      index)


def _kept(chain: Chain, arrays: dict, offsets) -> jax.Array:
    keep = _random_bits.keep(arrays["seed"], offsets, chain.dropout_threshold)
    return jnp.where(keep, 1 / (1 - chain.dropout), 0.0)


def _self_offsets(chain: Chain, lse_shape) -> jax.Array:
    """Dropout counters of the self-loop weights: entries `G * P + i` after the stored ones."""
    grid = _grid_index(chain, lse_shape, [d for d in range(len(lse_shape)) if d != len(chain.roles.batch)])
    index = jax.lax.broadcasted_iota(jnp.uint32, lse_shape, len(chain.roles.batch))
    return grid * _entry_count(chain) + chain.entries + index


def _entry_count(chain: Chain) -> int:
    return chain.entries + (chain.rows if chain.self_loops else 0)


def _grid_index(chain: Chain, shape, axes) -> jax.Array:
    """The flat index over the chain's grid variables (batch..., head), from iotas along `axes` of `shape`."""
    index = jnp.zeros((), jnp.uint32)
    for axis in axes:
        index = index * np.uint32(shape[axis]) + jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
    return index


class _Coordinates:
    """Index arrays that broadcast against the scores `S` (whose axes are the variables `axes`)."""

    def __init__(self, chain: Chain, arrays: dict, axes: tuple[str, ...]):
        self.chain, self.arrays, self.axes = chain, arrays, axes
        self.shape = chain.scores.lhs.shape

    def var(self, name: str) -> jax.Array:
        shape = [1] * len(self.axes)
        shape[self.axes.index(name)] = self.shape[self.axes.index(name)]
        return jax.lax.broadcasted_iota(jnp.int32, shape, self.axes.index(name))

    def head(self) -> jax.Array:
        """The query head `score_mod` and `mask_mod` see: `h`, or `h * R + r` with grouped-query attention."""
        r = self.chain.roles
        if r.head_group is None:
            return self.var(r.head)
        return self.var(r.head) * self.chain.group_size + self.var(r.head_group)

    def batch_index(self) -> jax.Array:
        name = self.chain.roles.batch_index
        return self.var(name) if name else jnp.zeros((), jnp.int32)

    def read(self, access: Access) -> jax.Array:
        index = tuple(self.var(i.name) if isinstance(i, Var) else self.read(i) for i in access.indices)
        array = self.arrays[access.tensor]
        fill = -1 if jnp.issubdtype(array.dtype, jnp.integer) else 0
        return array.at[index].get(mode="fill", fill_value=fill)

    def flat_index(self, access: Access, shape) -> jax.Array:
        """The row-major position in an array of `shape` that `access` addresses at each score."""
        flat = jnp.zeros((), jnp.int32)
        for size, i in zip(shape, access.indices):
            flat = flat * size + (self.var(i.name) if isinstance(i, Var) else self.read(i))
        return flat

    def dropout_offsets(self, chain: Chain) -> jax.Array:
        """Each weight's dropout counter: ((grid index) * entries + g * P + p) * bm * bk + m * bk + k."""
        r = chain.roles
        grid = jnp.zeros((), jnp.uint32)
        for v in chain.grid:
            grid = grid * np.uint32(self.shape[self.axes.index(v)]) + self.var(v).astype(jnp.uint32)
        entry = (self.var(r.group) * self.shape[self.axes.index(r.slot)] + self.var(r.slot)).astype(jnp.uint32)
        offset = grid * np.uint32(_entry_count(chain)) + entry
        if chain.block:
            bm, bk = chain.block
            offset = (offset * np.uint32(bm * bk) + self.var(r.query_offset).astype(jnp.uint32) * np.uint32(bk)
                      + self.var(r.key_offset).astype(jnp.uint32))
        return offset
