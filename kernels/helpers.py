"""`@triton.jit` helpers shared by every generated kernel (imported by name into the generated modules)."""

import triton
import triton.language as tl


@triton.jit
def in_range(index, bound):
    """An index read from an index array addresses a dimension of size `bound`: 0 <= index < bound."""
    return (index >= 0) & (index < bound)


@triton.jit
def update(pointer, value, mask):
    """`*pointer += value` for elements this program alone writes: load, add in the accumulator's type, store."""
    old = tl.load(pointer, mask=mask, other=0.0)
    tl.store(pointer, (old.to(value.dtype) + value).to(pointer.dtype.element_ty), mask=mask)


@triton.jit
def atomic_update(pointer, value, mask):
    """`*pointer += value` where other programs may write the same elements."""
    tl.atomic_add(pointer, value.to(pointer.dtype.element_ty), mask=mask, sem="relaxed")


@triton.jit
def segment_store(pointer, value, mask, shared):
    """Writes a row's sum into a zero-filled output: atomically if the row continues in a neighbouring window."""
    if shared:
        atomic_update(pointer, value, mask)
    else:
        tl.store(pointer, value.to(pointer.dtype.element_ty), mask=mask)


@triton.jit
def segment_update(pointer, value, mask, shared):
    """Writes a row's sum: atomically if the row continues in a neighbouring program's window."""
    if shared:
        atomic_update(pointer, value, mask)
    else:
        update(pointer, value, mask)


@triton.jit
def segment_sum(row_a, value_a, row_b, value_b):
    """The combining function of a segmented sum along sorted rows (`tl.associative_scan`): each element of the
    scan holds the sum of its run of equal rows up to it."""
    return row_b, value_b + tl.where(row_a == row_b, value_a, 0.0)
