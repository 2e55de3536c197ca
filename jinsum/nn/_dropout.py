"""Attention dropout inside fused kernels, driven by a layer's `nnx.Dropout` (rate, train/eval switch, stream)."""

from __future__ import annotations

import jax
from flax import nnx


def dropout_seed(dropout: nnx.Dropout) -> tuple[float, jax.Array | None]:
    """`(rate, key)` for attention dropout inside a fused kernel: the rate of `dropout` while it is active (not in
    `eval()` mode), and a fresh key from its stream; `(0.0, None)` otherwise."""
    if dropout.deterministic or dropout.rate == 0:
        return 0.0, None
    return float(dropout.rate), dropout.rngs()
