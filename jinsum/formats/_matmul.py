"""`@` for the sparse formats, rewritten by `jinsum.einsum` into the format's indirect Einsum."""

from __future__ import annotations

import numpy as np


class SparseMatmul:
    """Mixin: `A @ x`, `A @ B`, `x @ A` and `B @ A` for a sparse 2-D `A` and dense vectors or matrices."""

    __slots__ = ()
    __array_ufunc__ = None  # NumPy then defers `ndarray @ A` to `A.__rmatmul__` instead of converting `A`

    def __matmul__(self, other):
        return _einsum({1: "ik,k->i", 2: "ik,kn->in"}, self, other, (self, other))

    def __rmatmul__(self, other):
        return _einsum({1: "k,ki->i", 2: "mk,ki->mi"}, self, other, (other, self))


def _einsum(subscripts: dict[int, str], sparse, dense, operands):
    from jinsum._einsum import einsum  # noqa: PLC0415 (jinsum._einsum imports the formats)

    ndim = np.ndim(dense)
    if sparse.ndim != 2 or ndim not in subscripts:
        raise ValueError(f"jinsum: @ takes a 2-D sparse matrix and a 1-D or 2-D dense operand, got "
                         f"{type(sparse).__name__} of shape {sparse.shape} and an operand of shape {np.shape(dense)}; "
                         "use jinsum.einsum with explicit subscripts for other products")
    return einsum(subscripts[ndim], *operands)
