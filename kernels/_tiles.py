"""Tensor Core tiles, for both Triton writers (statements, `_source`; attention chains, `_chain_source`): the
precision of a product's `tl.dot`, and tiles read through TMA descriptors (an operand seen as a row-major view,
its descriptor made once per program, each tile one box). Which operands qualify for descriptors is each writer's
planner's business (`_source.described`, `_chain_source.described`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jinsum.kernels._plan import PRECISE_FLOAT32


def dot_precision(float32: bool, allow_tf32: bool) -> str:
    """`tl.dot`'s precision argument (", input_precision=...", or nothing): float32 factors multiply in TensorFloat-32
    where allowed, else in `PRECISE_FLOAT32`; 16-bit factors always on Tensor Cores as they are."""
    if not float32:
        return ""
    return f', input_precision="{"tf32" if allow_tf32 else PRECISE_FLOAT32}"'


@dataclasses.dataclass(frozen=True)
class View:
    """An operand read through a TMA descriptor, seen as a row-major matrix of `rows x width` (`rows` as Triton
    source: a leading dimension may be a runtime size) whose rows run along tile axis `axes[0]` (dimension `dim` of
    the operand) and whose columns are the elements after it, `axes[1]` the last of them. A tile is one box of
    `box` (Triton source: constants or constexpr names), at the row of its indices up to `dim` and the column of
    those after it."""

    axes: tuple[str, str]
    dim: int
    rows: str
    width: int
    box: tuple[str, str]


def make_descriptor(name: str, pointer: str, view: View) -> str:
    """The line making descriptor `d_<name>` of `view` over the operand at `pointer` (once per program, before any
    loop or branch: its global scratch is the program's)."""
    return (f"d_{name} = tl.make_tensor_descriptor({pointer}, shape=[{view.rows}, {view.width}], "
            f"strides=[{view.width}, 1], block_shape=[{view.box[0]}, {view.box[1]}])")


def box_load(name: str, view: View, shape: Sequence[int], positions: Sequence[str], checks: Sequence[str],
             transposed: bool) -> str:
    """The load of a tile from descriptor `d_<name>`: the box at the row and column of the tile's first element
    (`positions`: Triton source of each operand dimension's index there), transposed where the tile's rows are the
    view's columns. Where a range check of an index read fails (`checks`), the box moves past the view's last row:
    TMA fills it with zeros, as the masked pointer load would."""
    strides = np.cumprod((1,) + tuple(shape)[:0:-1])[::-1]
    row, column = [], []
    for dim, position in enumerate(positions):
        if position == "0" or shape[dim] == 1:
            continue  # (0 wherever it is in range)
        stride = int(strides[dim]) // view.width if dim <= view.dim else int(strides[dim])
        (row if dim <= view.dim else column).append(position if stride == 1 else f"({position}) * {stride}")
    row_at = " + ".join(row) or "0"
    if checks:
        row_at = f"tl.where({' & '.join(checks)}, {row_at}, {view.rows})"
    load = f"d_{name}.load([{row_at}, {' + '.join(column) or '0'}])"
    return f"tl.trans({load})" if transposed else load
