"""Output avals of jinsum's primitives, varying over the mesh axes their operands vary over.

Inside `jax.shard_map` (with its default `check_vma=True`) every aval records the manual mesh axes along which its
value differs between devices. A primitive's output differs wherever an operand does; an output without that mark
would be taken as the same on every device, and reverse mode would then refuse the cotangents it is given
("Expected cotangent type float32[8,3]{V:x} but got float32[8,3]").

JAX keeps the mark in a private field whose name changed (`vma` up to 0.9, `manual_axis_type.varying` from 0.10),
so the output is derived from an operand's aval with `update`, which copies the field whichever it is.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec


def _varying_axes(aval) -> frozenset:
    if hasattr(aval, "vma"):
        return aval.vma
    return getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())


def varying(shape, dtype, avals) -> jax.core.ShapedArray:
    """`ShapedArray(shape, dtype)`, varying over the manual axes of the operand in `avals` that varies over the
    most (none outside `shard_map`)."""
    like = max(avals, key=lambda aval: len(_varying_axes(aval)), default=None)
    if like is None or not _varying_axes(like):
        return jax.core.ShapedArray(shape, dtype)
    sharding = like.sharding.update(spec=PartitionSpec(*[None] * len(shape)))
    return like.update(shape=tuple(shape), dtype=dtype, weak_type=False, sharding=sharding)
