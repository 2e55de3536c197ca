"""What both grouped formats share: their pytree reconstruction, copies with fields replaced, and the properties
read off their arrays.

`A @ B` is a method of the formats that runs the products of `jinsum._frontend._format_rewrite`, which registers them
in `PRODUCTS` when jinsum is imported: the formats sit below the einsum machinery and do not import it (as the
primitive does not import its lowerings, which register themselves on it).
"""

from __future__ import annotations

from collections.abc import Callable

# `"matmul"` and `"rmatmul"`: `f(format, dense)`, registered by `jinsum._frontend._format_rewrite`.
PRODUCTS: dict[str, Callable] = {}


class GroupedFormat:
    """Base of GroupCOO and BlockGroupCOO: `Ai` (G,), `Ak` (G, P), `Av` (G, ...), a static shape and nnz."""

    __slots__ = ()
    __array_ufunc__ = None  # NumPy then defers `ndarray @ A` to `A.__rmatmul__` instead of converting `A`

    def __matmul__(self, other):
        """`A @ x`, `A @ B` for a dense vector or matrix: the format's SpMV / SpMM (`jinsum.einsum("ik,kn->in", A,
        B)`), differentiable, batched and lowered like any statement."""
        return PRODUCTS["matmul"](self, other)

    def __rmatmul__(self, other):
        """`x @ A`, `B @ A` for a dense vector or matrix (`jinsum.einsum("mk,ki->mi", B, A)`)."""
        return PRODUCTS["rmatmul"](self, other)

    @classmethod
    def tree_unflatten(cls, aux, children):
        # No validation: the leaves may be tracers, or placeholders such as object() inside JAX transforms.
        obj = object.__new__(cls)
        obj._set(*children, *aux)
        return obj

    def _replace(self, **fields):
        """This matrix with some of its fields replaced, named as :meth:`from_validated` takes them; not checked."""
        # The slots are those fields, the private ones (`_shape`, `_nnz`, ...) behind an underscore.
        current = {name.removeprefix("_"): getattr(self, name) for name in self.__slots__}
        return self.from_validated(**{**current, **fields})

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
