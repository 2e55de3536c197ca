"""What both grouped formats share: their pytree reconstruction, properties read off their arrays, and `@`."""

from __future__ import annotations

import numpy as np


class GroupedFormat:
    """Base of GroupCOO and BlockGroupCOO: `Ai` (G,), `Ak` (G, P), `Av` (G, ...), a static shape and nnz."""

    __slots__ = ()
    __array_ufunc__ = None  # NumPy then defers `ndarray @ A` to `A.__rmatmul__` instead of converting `A`

    @classmethod
    def tree_unflatten(cls, aux, children):
        # No validation: the leaves may be tracers, or placeholders such as object() inside JAX transforms.
        obj = object.__new__(cls)
        obj._set(*children, *aux)
        return obj

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape: ``(M, K)``, then any dense value dimensions."""
        return self._shape

    @property
    def dtype(self):
        """The dtype of the values ``Av``."""
        return self.Av.dtype

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def nnz(self) -> int:
        """Stored entries (blocks, for a block format), excluding group padding; explicit zeros count."""
        return self._nnz

    @property
    def group_size(self) -> int:
        """``P``, the slots per group."""
        return self.Ak.shape[1]

    @property
    def num_groups(self) -> int:
        """``G``."""
        return self.Ak.shape[0]

    @property
    def index_dtype(self):
        """The dtype of ``Ai`` and ``Ak``."""
        return self.Ai.dtype

    def __matmul__(self, other):
        """`A @ x`, `A @ B` for a dense vector or matrix: the format's SpMV / SpMM."""
        return _einsum({1: "ik,k->i", 2: "ik,kn->in"}, self, other, (self, other))

    def __rmatmul__(self, other):
        """`x @ A`, `B @ A` for a dense vector or matrix."""
        return _einsum({1: "k,ki->i", 2: "mk,ki->mi"}, self, other, (other, self))


def _einsum(subscripts: dict[int, str], sparse, dense, operands):
    from jinsum._einsum import einsum  # noqa: PLC0415 (jinsum._einsum imports the formats)

    ndim = np.ndim(dense)
    if sparse.ndim != 2 or ndim not in subscripts:
        raise ValueError(f"jinsum: @ takes a 2-D sparse matrix and a 1-D or 2-D dense operand, got "
                         f"{type(sparse).__name__} of shape {sparse.shape} and an operand of shape {np.shape(dense)}; "
                         "use jinsum.einsum with explicit subscripts for other products")
    return einsum(subscripts[ndim], *operands)
