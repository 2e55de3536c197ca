"""`@triton.jit` helpers shared by every generated kernel (imported by name into the generated modules).

Writes take the statement's reduction as a compile-time constant: `SUM` (`+=`), `MAX` (`max=`, and the winners of
`max=` and `min=`) or `MIN` (`min=`).
"""

import triton
import triton.language as tl

SUM = tl.constexpr(0)
MAX = tl.constexpr(1)
MIN = tl.constexpr(2)


@triton.jit
def in_range(index, bound):
    """An index read from an index array addresses a dimension of size `bound`: 0 <= index < bound."""
    return (index >= 0) & (index < bound)


@triton.jit
def combine(a, b, REDUCTION: tl.constexpr):
    """`a + b`, or the larger or smaller of the two, NaN winning (as in XLA); also on integers."""
    if REDUCTION == MAX:
        return tl.where((a > b) | (a != a), a, b)
    elif REDUCTION == MIN:
        return tl.where((a < b) | (a != a), a, b)
    else:
        return a + b


@triton.jit
def update(pointer, value, mask, REDUCTION: tl.constexpr):
    """`*pointer (+)= value` for elements this program alone writes: load, combine in the accumulator's type,
    store."""
    old = tl.load(pointer, mask=mask)
    tl.store(pointer, combine(old.to(value.dtype), value, REDUCTION).to(pointer.dtype.element_ty), mask=mask)


@triton.jit
def atomic_update(pointer, value, mask, REDUCTION: tl.constexpr):
    """`*pointer (+)= value` where other programs may write the same elements (a maximum or minimum of floats
    through their integer bits: exact, in any order)."""
    value = value.to(pointer.dtype.element_ty)
    if REDUCTION == MAX:
        tl.atomic_max(pointer, value, mask=mask, sem="relaxed")
    elif REDUCTION == MIN:
        tl.atomic_min(pointer, value, mask=mask, sem="relaxed")
    else:
        tl.atomic_add(pointer, value, mask=mask, sem="relaxed")


@triton.jit
def segment_store(pointer, value, mask, shared, REDUCTION: tl.constexpr):
    """Writes a row's result into an output filled with the reduction's identity: atomically if the row continues
    in a neighbouring window."""
    if shared:
        atomic_update(pointer, value, mask, REDUCTION)
    else:
        tl.store(pointer, value.to(pointer.dtype.element_ty), mask=mask)


@triton.jit
def segment_update(pointer, value, mask, shared, REDUCTION: tl.constexpr):
    """Writes a row's result: atomically if the row continues in a neighbouring program's window."""
    if shared:
        atomic_update(pointer, value, mask, REDUCTION)
    else:
        update(pointer, value, mask, REDUCTION)


@triton.jit
def segment_sum(row_a, value_a, row_b, value_b):
    """The combining function of a segmented sum along sorted rows (`tl.associative_scan`): each element of the
    scan holds the sum of its run of equal rows up to it."""
    return row_b, value_b + tl.where(row_a == row_b, value_a, 0.0)
