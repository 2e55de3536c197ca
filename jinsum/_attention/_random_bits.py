"""Counter-based dropout masks that the XLA lowering and the generated kernels draw identically.

Each attention weight has a counter (`offset`, see `dropout_offsets`) and the call a seed; the weight is kept
iff the top 24 bits of Philox4x32-10 (`tl.randint(seed, offset)` in Triton, reimplemented here in `jax.numpy`)
are at least `Chain.dropout_threshold`, `round(rate * 2**24)`. Nothing is stored between the forward and the
backward: both draw the same bits again. Counters are taken modulo 2**32, so a chain of more than 2**32 weights
reuses streams.
"""

from __future__ import annotations

import jax.numpy as jnp

_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85


def keep(seed: jnp.ndarray, offsets: jnp.ndarray, threshold: int) -> jnp.ndarray:
    """Booleans shaped like `offsets` (uint32 counters): which weights survive, those whose top 24 bits are at
    least `threshold` (`Chain.dropout_threshold`)."""
    bits = _philox(seed.astype(jnp.uint32), offsets.astype(jnp.uint32))
    return (bits >> 8).astype(jnp.int32) >= threshold


def _umulhi(a, b):
    """The high 32 bits of the 64-bit product of two uint32 arrays, in 16-bit limbs (no 64-bit types needed)."""
    a_lo, a_hi, b_lo, b_hi = a & 0xFFFF, a >> 16, b & 0xFFFF, b >> 16
    cross = ((a_lo * b_lo) >> 16) + ((a_hi * b_lo) & 0xFFFF) + a_lo * b_hi
    return a_hi * b_hi + ((a_hi * b_lo) >> 16) + (cross >> 16)


def _philox(seed, counter):
    """Triton's `randint(seed, counter)` for a non-negative int32 seed and uint32 counters: Philox4x32, 10 rounds,
    key (seed, 0), counter (counter, 0, 0, 0); the first output word."""
    u32 = jnp.uint32
    c0, c1, c2, c3 = counter, jnp.zeros_like(counter), jnp.zeros_like(counter), jnp.zeros_like(counter)
    k0, k1 = jnp.broadcast_to(seed, counter.shape), jnp.zeros_like(counter)
    for _ in range(10):
        c0, c1, c2, c3 = (_umulhi(u32(_ROUND_B), c2) ^ c1 ^ k0, u32(_ROUND_B) * c2,
                          _umulhi(u32(_ROUND_A), c0) ^ c3 ^ k1, u32(_ROUND_A) * c0)
        k0, k1 = k0 + u32(_KEY_A), k1 + u32(_KEY_B)
    return c0
