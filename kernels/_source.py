"""`KernelPlan` -> Triton source text: one `@triton.jit` kernel per plan, readable on its own.

The kernel is a loop nest. Level 0 is the program: its grid variables are decoded from `program_id(0)` and its
tiles (the lanes, or the m/n tiles of a dot plan) from `program_id(1)`. Level 1 walks the window variable; then
come the write loops (parallel variables looped inside, each iteration a write), then the summed variables,
innermost the k tiles of a dot plan (or the lane tiles of a summed lane variable). Every access is loaded once,
at the outermost level where all its variables are bound, so index and value loads are hoisted out of the loops
they do not depend on. Indirect indices are range-checked (`in_range`): an out-of-range read gives 0 and an
out-of-range write is dropped, as in the XLA lowering. In a `max=` / `min=` a term that reads out of range is the
reduction's identity instead: it takes no part.
"""

from __future__ import annotations

import numpy as np

from jinsum._lang import Access, Var, variables
from jinsum.kernels._elementwise_source import Capture, elementwise_lines
from jinsum.kernels._grouped_hopper import generate_grouped_hopper, grouped_scratch
from jinsum.kernels._plan import DESCRIPTOR_BYTES, INT32_LIMIT, UNROLL_LIMIT, KernelPlan
from jinsum.kernels._tiles import View, box_load, dot_precision, make_descriptor

_TRITON_DTYPES = {"float16": "tl.float16", "bfloat16": "tl.bfloat16", "float32": "tl.float32",
                  "float64": "tl.float64"}
_REDUCTIONS = {"sum": "SUM", "max": "MAX", "min": "MIN"}  # the helpers' compile-time constants
_IDENTITIES = {"max": 'float("-inf")', "min": 'float("inf")'}
# Elements of partial sums that the fixup kernel of a carried split schedule reads at once (windows x lanes): a hub
# row of a power-law graph runs through thousands of windows, and one window at a time, or more windows over more
# warps (most of them idle in other rows' programs), were slower (DESIGN.md, "Launch defaults").
FIXUP_TILE = 2048


MAX_BOX = 256  # TMA's largest box side, in elements


def generate(plan: KernelPlan) -> str:
    """The Python source of a module defining the kernel `kernel_name(plan)` for `plan`: its Hopper form where the
    plan has it (`jinsum.kernels._grouped_hopper`), else its Triton form."""
    if plan.config.hopper:
        return generate_grouped_hopper(plan, kernel_name(plan), kernel_inputs(plan))
    return _Writer(plan).module()


def kernel_name(plan: KernelPlan) -> str:
    """`jinsum_<template>_<write>`, what a profile shows; kernels that make TMA descriptors end in `_tma` (their
    launch differs: `jinsum._lowering._launch` refuses one name launched both ways), Hopper forms in `_hopper`."""
    return f"jinsum_{plan.template}_{plan.write}" + ("_hopper" if plan.config.hopper else
                                                     "_tma" if described(plan) else "")


def kernel_scratch(plan: KernelPlan) -> int:
    """Global scratch bytes a program of the kernel needs (its TMA descriptors), for the launcher."""
    return grouped_scratch(plan) if plan.config.hopper else DESCRIPTOR_BYTES * len(described(plan))


def described(plan: KernelPlan) -> dict[str, View]:
    """The dot factors (by role, "a" / "b") the kernel reads through TMA descriptors (with
    `KernelConfig.descriptors`): those whose tile is exactly one box of a row-major view, i.e.

    - the two tile variables index the operand directly, once each, the later one at its last dimension of more
      than one element (so it has stride 1);
    - a tile never crosses its variable's extent where the box past it would read a neighbour's elements instead
      of zeros: where the extent is not a whole number of tiles, the row axis must be the view's first (only
      dimensions of size 1 before it) and the column axis the whole width (none of size > 1 between them); TMA
      fills the rest of a box past the view's own edges with zeros, as the masked pointer load;
    - rows of a multiple of 16 bytes, columns of the box at least 16 bytes (and every column offset a multiple of
      16 bytes), box sides of at most `MAX_BOX` elements, and 1 to 2^31 - 2 rows.

    An index out of its range moves the box past the last row (zeros, as the masked pointer load)."""
    if not (plan.config.descriptors and plan.template == "dot"):
        return {}
    spec, dot, config = plan.spec, plan.dot, plan.config
    blocks = {dot.m: (config.block_m, "BLOCK_M"), dot.n: (config.block_n, "BLOCK_N"),
              dot.k: (config.block_k, "BLOCK_K")}
    found = {}
    for role, factor, tile in (("a", dot.a, (dot.m, dot.k)), ("b", dot.b, (dot.k, dot.n))):
        node = spec.statement.factors[factor]
        operand = spec.operand[node.tensor]
        shape, itemsize = tuple(int(s) for s in operand.shape), np.dtype(operand.dtype).itemsize
        dims = [d for d, i in enumerate(node.indices) if isinstance(i, Var) and i.name in tile]
        if len(dims) != 2 or {node.indices[d].name for d in dims} != set(tile):
            continue
        row_dim, column_dim = dims
        if any(shape[d] != 1 for d in range(column_dim + 1, len(shape))):
            continue  # (the column axis is not contiguous)
        row_var, column_var = node.indices[row_dim].name, node.indices[column_dim].name
        width = int(np.prod(shape[row_dim + 1:], dtype=np.int64))
        rows = int(np.prod(shape[:row_dim + 1], dtype=np.int64))
        (row_block, row_name), (column_block, column_name) = blocks[row_var], blocks[column_var]
        strides = np.cumprod((1,) + shape[:0:-1])[::-1]
        aligned = all(shape[d] == 1 or int(strides[d]) * itemsize % 16 == 0 for d in range(row_dim + 1, column_dim))
        if not (aligned and width * itemsize % 16 == 0 and column_block * itemsize >= 16
                and max(row_block, column_block) <= MAX_BOX and 0 < rows < INT32_LIMIT and width < INT32_LIMIT):
            continue
        if shape[row_dim] % row_block and rows != shape[row_dim]:
            continue  # the box past the row axis's extent would read the next rows of the view
        if shape[column_dim] % column_block and width != shape[column_dim]:
            continue  # the box past the column axis's extent would read the next columns of the view
        rows_text = str(rows)
        if node.indices and isinstance(node.indices[0], Access):  # the leading dimension is a runtime size
            rest = rows // shape[0]
            rows_text = f"rows_{node.tensor}" + (f" * {rest}" if rest != 1 else "")
        found[role] = View((row_var, column_var), row_dim, rows_text, width, (row_name, column_name))
    return found


def kernel_inputs(plan: KernelPlan) -> tuple[str, ...]:
    """The operands passed to the kernel, in order: the statement's, then the arrays a fused epilogue captures.
    Then come the row pointers (`plan.row_pointers`: entry r is the first group of row r, entry `row_count` the
    number of groups) and the output."""
    names = plan.spec.names
    names = names if plan.reads_lhs or plan.spec.winners else names[1:]  # (winners read the result they locate)
    return names + (plan.spec.epilogue_names if plan.fuses_epilogue else ())


def offset(shape: tuple[int, ...], positions: list[str]) -> str:
    """The element offset `sum(position[d] * stride[d])` in a row-major array of `shape`, as Triton source;
    computed in 64 bits when the array has more elements than int32 can address."""
    wide = int(np.prod(shape, dtype=np.int64)) > INT32_LIMIT
    strides = np.cumprod((1,) + tuple(shape)[:0:-1])[::-1]
    terms = []
    for position, stride in zip(positions, strides):
        position = f"{position}.to(tl.int64)" if wide else position
        terms.append(position if stride == 1 else f"{position} * {stride}")
    return " + ".join(terms)


class _Writer:
    def __init__(self, plan: KernelPlan):
        self.plan = plan
        self.spec = plan.spec
        self.lines: list[str] = []
        self.depth = 1
        self.loaded: dict[tuple[str, str], str] = {}
        self.masks: dict[tuple[str, str], str] = {}  # where each load reads in range ("" where it always does)
        self.helpers: set[str] = set()
        # Values are multiplied and accumulated in float32, float64 for float64 results (winners: those located).
        self.acc_type = _TRITON_DTYPES[str(plan.acc_dtype)]
        self.tiled = {*plan.tile_vars, self.inner_tile} - {None}
        self.lhs_role = "out"
        self.described = described(plan)  # dot factors read through TMA descriptors, by role
        self.starts: dict[str, str] = {}  # dot plans: each tile variable's first position in the current tile
        self.level = self._levels()

    # --- structure --------------------------------------------------------------------------------------------

    def _levels(self) -> dict[str, int]:
        plan, level = self.plan, {}
        for v in plan.grid:
            level[v] = 0
        for v in plan.tile_vars:
            level[v] = 0
        if plan.window and not plan.tiled_window:
            level[plan.window] = 1
        for depth, v in enumerate(plan.write_loops + plan.loops):
            level[v] = 2 + depth
        if self.inner_tile:
            level[self.inner_tile] = 2 + len(plan.write_loops + plan.loops)
        return level

    @property
    def inner_tile(self) -> str | None:
        """The tiled variable looped innermost: the k of a dot plan, or a summed lane variable wider than a block."""
        plan = self.plan
        if plan.template == "dot":
            return plan.dot.k
        if plan.lanes in self.spec.summed_variables and self.spec.extent[plan.lanes] > plan.config.block:
            return plan.lanes
        return None

    def emit(self, line: str) -> None:
        self.lines.append("    " * self.depth + line)

    def module(self) -> str:
        body = self._kernel()
        if self.plan.carries:
            body += ["", ""] + self._fixup_kernel()
        helpers = ", ".join(sorted(self.helpers))
        header = ["# Generated by jinsum from the statement below; see jinsum.kernels.", "import triton",
                  "import triton.language as tl"]
        if helpers:
            header.append(f"from jinsum.kernels.helpers import {helpers}")
        return "\n".join(header + ["", ""] + body) + "\n"

    def _kernel(self) -> list[str]:
        plan, spec = self.plan, self.spec
        params = [f"p_{n}" for n in kernel_inputs(plan)] + ["p_row_starts"] * plan.row_pointers + [*plan.sizes]
        params += ["p_out", "p_partials"] if plan.carries else ["p_out"]
        if self.described:
            params.append("scratch")  # global scratch for the descriptors (jinsum._lowering._launch)
        params += ["BLOCK_ROWS: tl.constexpr", "BLOCK: tl.constexpr"] if plan.template == "lanes" else \
            ["BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr", "BLOCK_K: tl.constexpr"]
        params += ["WINDOW: tl.constexpr", "NUM_STAGES: tl.constexpr"]
        self._prologue()
        if plan.write == "segmented":
            self._segmented_body()
        else:
            self._plain_body()
        config = plan.config
        doc = [f'"""{spec.statement}', "",
               f"template {plan.template}; tiles {', '.join(plan.tile_vars)}; grid {', '.join(plan.grid) or '-'}; "
               f"window {plan.window or '-'}; write loops {', '.join(plan.write_loops) or '-'}; "
               f"loops {', '.join(plan.loops) or '-'}; write {plan.write}"
               + (f" ({config.schedule} schedule)" if plan.write == "segmented" else "")
               + (f"; {plan.dot.k} in {config.k_chunks} chunks" if plan.template == "dot" and config.k_chunks > 1
                  else ""),
               '"""']
        name = kernel_name(plan)  # what a profile shows
        return ["@triton.jit", f"def {name}({', '.join(params)}):"] + ["    " + d for d in doc] + self.lines

    def _prologue(self) -> None:
        plan, extent = self.plan, self.spec.extent
        self.emit("always = tl.program_id(0) >= 0  # the mask of writes that need none")
        self.emit("pid = tl.program_id(0)")
        rest = "pid"
        tile_pid = "tl.program_id(1)"
        if plan.window_in_k:
            # The grid in the other order: a row's tiles run one after another (programs start program_id(0)
            # fastest), so the programs running at once read one row's (an expert's) operands, which stay in L2,
            # rather than the same tile of every row.
            self.emit("launched = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)")
            self.emit("pid = launched // tl.num_programs(1)")
            self.emit("tile_pid = launched % tl.num_programs(1)")
            tile_pid = "tile_pid"
        if plan.row_programs:
            self.emit("row = pid % programs")
            self.emit("begin = tl.load(p_row_starts + row)")
            self.emit("end = tl.load(p_row_starts + row + 1)")
            rest = "(pid // programs)"
        elif plan.window:
            self.emit("start = (pid % programs) * WINDOW")
            self.emit(f"stop = tl.minimum(start + WINDOW, size_{plan.window})")
            rest = "(pid // programs)"
        for v in reversed(plan.grid):
            self.emit(f"v_{v} = {rest} % {extent[v]}")
            rest = f"({rest} // {extent[v]})"
        if plan.template == "dot":
            m, n = plan.dot.m, plan.dot.n
            tiles_n = -(-extent[n] // plan.config.block_n)
            tile = tile_pid
            if plan.config.k_chunks > 1:  # chunks of the reduction: the slow axis, tiles within
                tiles = -(-extent[m] // plan.config.block_m) * tiles_n
                self.emit(f"k_start = ({tile_pid} // {tiles}) * {plan.k_chunk}")
                tile = f"({tile_pid} % {tiles})"
            self.starts[m], self.starts[n] = f"({tile} // {tiles_n}) * BLOCK_M", f"({tile} % {tiles_n}) * BLOCK_N"
            self.emit(f"v_{m} = {self.starts[m]} + tl.arange(0, BLOCK_M)")
            self.emit(f"v_{n} = {self.starts[n]} + tl.arange(0, BLOCK_N)")
            for v in (m, n):
                self.emit(f"m_{v} = v_{v} < {extent[v]}")
            self._describe()
        else:
            t = plan.lanes
            lane_tiles = -(-extent[t] // plan.config.block) if t in self.spec.loop_variables else 1
            if plan.tiled_window:
                self.emit(f"v_{plan.rows} = start + tl.arange(0, BLOCK_ROWS)  # the window, as the tile's rows")
                self.emit(f"m_{plan.rows} = v_{plan.rows} < stop")
                if plan.write == "segmented":  # rows outside the left-hand side (padding) load nothing
                    in_range = self._row_in_range(self._window_rows(f"v_{plan.rows}", f"m_{plan.rows}"))
                    self.emit(f"m_{plan.rows} &= {in_range}")
            elif plan.rows:
                r = plan.rows
                self.emit(f"v_{r} = (tl.program_id(1) // {lane_tiles}) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)")
                self.emit(f"m_{r} = v_{r} < {extent[r]}")
            if self.inner_tile is None:
                self.emit(f"v_{t} = (tl.program_id(1) % {lane_tiles}) * BLOCK + tl.arange(0, BLOCK)")
                self.emit(f"m_{t} = v_{t} < {extent[t]}")
        self._emit_loads(0)

    def _acc_init(self) -> str:
        plan = self.plan
        shape = "[BLOCK_M, BLOCK_N]" if plan.template == "dot" else "[BLOCK_ROWS, BLOCK]" if plan.rows else "[BLOCK]"
        if self.spec.winners:
            return f"acc = tl.zeros({shape}, dtype=tl.int32)"
        if plan.reduction != "sum":
            return f"acc = tl.full({shape}, {_IDENTITIES[plan.reduction]}, dtype={self.acc_type})"
        return f"acc = tl.zeros({shape}, dtype={self.acc_type})"

    @property
    def reduction(self) -> str:
        """The helpers' constant for the plan's reduction (imported into the kernel's module)."""
        name = _REDUCTIONS[self.plan.reduction]
        self.helpers.add(name)
        return name

    def _plain_body(self) -> None:
        """One accumulator per assignment of the window variable (or per program), written after its loops."""
        plan = self.plan
        window_loop = plan.window and not plan.tiled_window
        if window_loop:
            self.emit(f"for v_{plan.window} in tl.range(start, stop, num_stages=NUM_STAGES):")
            self.depth += 1
            self._emit_loads(1)
        for v in plan.write_loops:
            self._open_loop(v)
        self.emit(self._acc_init())
        guard = self._selected_in_range() if window_loop else None
        if guard:  # the group selects no matrix: its products are zeros, computed by no one
            self.emit(f"if {guard}:")
            self.depth += 1
        self._inner_loops()
        if guard and plan.write in ("set", "update"):
            self.depth -= 1  # (its zeros are still stored)
        pointer, mask = self._lhs_pointer()
        value = self._written_value()
        if plan.write in ("set", "update"):
            self._write_alone(pointer, value, mask)
        else:
            self.helpers.add("atomic_update")
            for factor in self._scalar_factors():  # (`tl.where`: the interpreter cannot `&` a float comparison)
                mask = f"tl.where({factor} != 0, {mask}, False)"
            self.emit(f"atomic_update({pointer}, {value}, {mask}, {self.reduction})")
            self.depth -= bool(guard)  # (adding zeros: skipped)
        self.depth -= len(plan.write_loops) + bool(window_loop)

    def _selected_in_range(self) -> str | None:
        """Dot plans: where a dot factor is a matrix selected per group through an index already loaded (`W[Ai[g],
        c,h]`), the condition that every such index is in range. Out of range (a group padded past the last
        matrix: expert parallelism's), the factor reads zeros, so the group's k loop need not run."""
        if self.plan.template != "dot":
            return None
        factors, checks = self.spec.statement.factors, []
        for role, k in (("a", self.plan.dot.a), ("b", self.plan.dot.b)):
            node = factors[k]
            for d, index in enumerate(node.indices):
                key = self._key(index, role) if isinstance(index, Access) else None
                if key and key[1] == "scalar" and key in self.loaded:
                    bound = f"rows_{node.tensor}" if d == 0 else self.spec.operand[node.tensor].shape[d]
                    checks.append(f"in_range({self.loaded[key]}, {bound})")
        return " & ".join(dict.fromkeys(checks)) or None

    def _scalar_factors(self) -> list[str]:
        """The loaded factors that are one value per written row (constant along the lanes and the sums). An
        atomic update is skipped where one is zero: it would add zeros (NaN or inf in another factor aside), and
        group padding (value 0, column 0) would otherwise send every padded slot's atomics to one row,
        serialising them (DESIGN.md, "Transposes"). (Not in a `max=` / `min=`, where a zero term counts.)"""
        plan, spec, scalars = self.plan, self.spec, []
        if plan.reduction != "sum":
            return scalars
        if plan.template == "dot" or plan.lanes in spec.summed_variables:  # (a written tile reduced over the lanes
            return scalars  # has lost the axis those factors broadcast along)
        for k, factor in enumerate(spec.statement.factors):
            if not set(variables(factor)) & {plan.lanes, self.inner_tile, *spec.summed_variables}:
                scalars.append(self.loaded[self._key(factor, self._role(k))])
        return scalars

    def _segmented_body(self) -> None:
        """Runs of equal rows (the window variable's sorted index) accumulate in registers and are written once."""
        plan = self.plan
        if plan.tiled_window:
            self._segmented_tile()
            return
        g, size = plan.window, f"size_{plan.window}"
        rows = f"p_{self.spec.lhs_sorted_index}"
        schedule = plan.config.schedule
        if schedule == "rows":
            # The program's groups are exactly its row's: one accumulator, no branch in the loop, one write.
            self.emit(self._acc_init())
            if plan.window_in_k:  # positions g * extent(k) + k: the k loop walks them (`_inner_loops`)
                self.emit(f"v_{g} = 0")
                self._inner_loops()
            else:
                self.emit(f"for v_{g} in tl.range(begin, end, num_stages=NUM_STAGES):")
                self.depth += 1
                self._emit_loads(1)
                self._inner_loops()
                self.depth -= 1
            if plan.covers_output or plan.fuses_epilogue:  # empty rows store their zeros (or epilogue) too
                self._flush(None)
                return
            self.emit("if begin < end:")
            self.depth += 1
            self._flush(None)
            self.depth -= 1
            return
        if schedule == "split" and plan.window_in_k:
            self._rows_of_the_window()
            return
        if schedule == "split":
            # Rows at the window's edges may continue in the neighbouring windows: those are added atomically
            # (or carried, `KernelPlan.carries`).
            for line in self._window_edges():
                self.emit(line)
            if plan.carries:  # the empty rows before this window's first row are this program's to store
                self._store_empty_rows("earlier + 1", "first_row")
            begin, end = "start", "stop"
        else:
            # This program owns the rows that start in its window: it skips the tail of a row begun earlier and
            # runs past the window's end to finish its last row. No two programs write one row: no atomics.
            self.emit("begin = start")
            self.emit("if start > 0:")
            self.emit(f"    earlier = tl.load({rows} + start - 1)")
            self.emit(f"    while (begin < stop) & (tl.load({rows} + begin, mask=begin < stop, other=-1) == earlier):")
            self.emit("        begin += 1")
            self.emit("end = stop")
            self.emit("if begin < stop:")
            self.emit(f"    last = tl.load({rows} + stop - 1)")
            self.emit(f"    while tl.load({rows} + end, mask=end < {size}, other=-1) == last:")
            self.emit("        end += 1")
            self.emit("else:")
            self.emit("    end = begin")
            begin, end = "begin", "end"
        self.emit(f"row = tl.load({rows} + {begin}, mask={begin} < {size}, other=0)")
        self.emit(self._acc_init())
        self.emit(f"for v_{g} in tl.range({begin}, {end}, num_stages=NUM_STAGES):")
        self.depth += 1
        self._emit_loads(1)
        sorted_row = self.loaded[self._key(self._sorted_node(), self.lhs_role)]
        self.emit(f"if {sorted_row} != row:")
        self.depth += 1
        self._flush("(row == first_row) & shares_first" if schedule == "split" else None)
        if plan.carries:
            self._store_empty_rows("row + 1", sorted_row)
        self.emit(self._acc_init())
        self.emit(f"row = {sorted_row}")
        self.depth -= 1
        # A row outside the left-hand side is dropped: its terms are not computed (deterministic mode pads its
        # lists of rows with such rows, `jinsum._rules._deterministic`).
        self.emit(f"if {self._row_in_range()}:")
        self.depth += 1
        self._inner_loops()
        self.depth -= 2
        if schedule == "split":
            self._flush("((row == first_row) & shares_first) | ((row == last_row) & shares_last)")
            if plan.carries:  # the last window stores the empty rows after the last group's
                self.emit(f"if stop == {size}:")
                self.depth += 1
                self._store_empty_rows("row + 1")
                self.depth -= 1
        else:
            self.emit(f"if {begin} < {end}:")
            self.depth += 1
            self._flush(None)
            self.depth -= 1

    def _rows_of_the_window(self) -> None:
        """A window of groups walking its rows' positions (`window_in_k`, `split` schedule): each row's part of the
        window is one pipelined reduction, added atomically (the row may go on in the neighbouring windows). Rows
        outside the left-hand side are not computed."""
        rows = f"p_{self.spec.lhs_sorted_index}"
        self.emit(f"first_row = tl.maximum(tl.load({rows} + start), 0)")
        self.emit(f"last_row = tl.minimum(tl.load({rows} + stop - 1), {self.plan.row_count - 1})")
        self.emit("for row in tl.range(first_row, last_row + 1):")
        self.depth += 1
        self.emit("begin = tl.maximum(tl.load(p_row_starts + row), start)")
        self.emit("end = tl.minimum(tl.load(p_row_starts + row + 1), stop)")
        self.emit(self._acc_init())
        self.emit(f"v_{self.plan.window} = 0")
        self._inner_loops()
        self.emit("if begin < end:")
        self.depth += 1
        self._flush("always")
        self.depth -= 2

    def _flush(self, shared: str | None) -> None:
        """Writes the accumulator to row `row`: atomically where `shared` (an expression) holds, else alone."""
        pointer, mask = self._lhs_pointer(row="row")
        value = self._written_value()
        if shared is None:
            self._write_alone(pointer, value, mask, row="row")
        elif self.plan.carries:  # slot 0: the row continues from the previous window; 1: into the next
            lanes = self.plan.lanes
            self.emit(f"if {shared}:")
            self.emit("    slot = tl.where((row == first_row) & shares_first, 0, 1)")
            width = self.spec.extent[lanes]
            self.emit(f"    tl.store(p_partials + (pid * 2 + slot).to(tl.int64) * {width} + v_{lanes}, {value}, "
                      f"mask=m_{lanes})")
            self.emit("else:")
            self.depth += 1
            self._write_alone(pointer, value, mask, row="row")
            self.depth -= 1
        else:
            helper = "segment_store" if self.plan.zeroes_output else "segment_update"
            self.helpers.add(helper)
            self.emit(f"{helper}({pointer}, {value}, {mask}, {shared}, {self.reduction})")

    def _window_edges(self) -> list[str]:
        """The lines giving a `split` window's first and last rows and whether its neighbours share them."""
        rows, size = f"p_{self.spec.lhs_sorted_index}", f"size_{self.plan.window}"
        return [f"first_row = tl.load({rows} + start)",
                f"last_row = tl.load({rows} + stop - 1)",
                f"earlier = tl.load({rows} + start - 1, mask=start > 0, other=-1)  # the previous window's last row",
                "shares_first = earlier == first_row",
                f"shares_last = tl.load({rows} + stop, mask=stop < {size}, other=-1) == last_row"]

    def _store_empty_rows(self, first: str, end: str | None = None) -> None:
        """Zeros into the rows `first` up to `end` (exclusive; no further than the output's rows), which no group
        addresses (`carries`: the output is not zero-filled)."""
        bound = f"rows_{self.spec.lhs.name}"
        self.emit(f"for empty in range({first}, {f'tl.minimum({end}, {bound})' if end else bound}):")
        self.depth += 1
        pointer, mask = self._lhs_pointer(row="empty")
        self.emit(f"tl.store({pointer}, tl.zeros([BLOCK], p_out.dtype.element_ty), mask={mask})")
        self.depth -= 1

    def _fixup_kernel(self) -> list[str]:
        """The second kernel of a carried split schedule (`KernelPlan.carries`): the program of each window whose
        last row continues into the next window, and starts in this one, adds that row's partial sums, its own and
        those of the windows it runs through (`FIXUP_TILE` elements at a time, in a fixed order: the same result in
        every run), and stores the row."""
        plan, spec = self.plan, self.spec
        lanes, g, out = plan.lanes, plan.window, spec.lhs.name
        rows, size, width = f"p_{spec.lhs_sorted_index}", f"size_{g}", spec.extent[lanes]
        chain = max(1, FIXUP_TILE // plan.config.block)
        params = [rows, "p_partials", f"p_{out}", *plan.fixup_sizes, "p_out", "BLOCK_ROWS: tl.constexpr",
                  "BLOCK: tl.constexpr", "WINDOW: tl.constexpr", "NUM_STAGES: tl.constexpr"]
        body = [
            '"""Adds up the partial sums of the rows that windows share (see the kernel above) and stores them."""',
            "pid = tl.program_id(0)",
            f"v_{lanes} = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)",
            f"m_{lanes} = v_{lanes} < {width}",
            "start = pid * WINDOW",
            f"stop = tl.minimum(start + WINDOW, {size})",
            *self._window_edges(),
            "row = last_row",
            f"if shares_last & ((first_row != row) | ~shares_first) & (row >= 0) & (row < rows_{out}):",
            f"    acc = tl.load(p_partials + (pid * 2 + 1).to(tl.int64) * {width} + v_{lanes}, mask=m_{lanes}, "
            "other=0.0)",
            "    q = pid + 1",
            "    more = q < programs",
            f"    while more:  # the next {chain} windows: those that start in the row hold their part in slot 0",
            f"        w = q + tl.arange(0, {chain})",
            f"        inside = (w < programs) & (tl.load({rows} + w * WINDOW, mask=w < programs, other=-1) == row)",
            f"        part = tl.load(p_partials + (w * 2).to(tl.int64)[:, None] * {width} + v_{lanes}[None, :], "
            f"mask=inside[:, None] & m_{lanes}[None, :], other=0.0)",
            "        acc += tl.sum(part, axis=0)",
            f"        more = tl.sum(inside.to(tl.int32), axis=0) == {chain}",
            f"        q += {chain}",
            f"    tl.store(p_out + {offset(spec.lhs.shape, ['row', f'v_{lanes}'])}, acc.to(p_out.dtype.element_ty), "
            f"mask=m_{lanes})",
        ]
        return ["@triton.jit", f"def jinsum_{plan.template}_fixup({', '.join(params)}):"] + ["    " + b for b in body]

    def _write_alone(self, pointer: str, value: str, mask: str, row: str | None = None) -> None:
        """Writes elements that no other program writes: `=` and `+=` into zeros store, `+=` loads, adds, stores.
        A fused epilogue is applied to the whole value (`row`: a segmented write's current row) before the store."""
        stores = self.plan.write == "set" or self.plan.zeroes_output
        if self.plan.fuses_epilogue:
            if not stores:  # the left-hand side's value takes part: combine it first
                self.helpers.add("combine")
                self.emit(f"total = combine(tl.load({pointer}, mask={mask}, other=0.0).to({self.acc_type}), {value}, "
                          f"{self.reduction})")
                value = "total"
            value, stores = self._epilogue(value, row), True
        if stores:
            self.emit(f"tl.store({pointer}, {value}.to(p_out.dtype.element_ty), mask={mask})")
        else:
            self.helpers.add("update")
            self.emit(f"update({pointer}, {value}, {mask}, {self.reduction})")

    def _epilogue(self, value: str, row: str | None) -> str:
        """`epilogue(value, *position)` in registers (`kernels._elementwise_source`), the position of each output
        dimension broadcast like the written tile. Returns the variable holding the result."""
        spec = self.spec
        epilogue = spec.epilogue
        positions = []
        for index in spec.statement.lhs.indices:
            if isinstance(index, Access):  # the row of a segmented write, or a loaded index
                positions.append(row if row is not None else self.loaded[self._key(index, self.lhs_role)])
            elif index.name in self.tiled:
                positions.append(self._tile_axis(self.lhs_role, index.name))
            else:
                positions.append(f"v_{index.name}")
        captures = tuple(Capture(f"p_{name}", c.shape) for name, c in zip(spec.epilogue_names, epilogue.captures))
        jaxpr = epilogue.wide if self.acc_type == "tl.float64" and epilogue.wide is not None else epilogue.value
        lines, (out,), _ = elementwise_lines(jaxpr.jaxpr, [value, *positions], "e", self.acc_type, captures)
        for line in lines:
            self.emit(line)
        self.emit(f"epilogue = ({out}) + tl.zeros_like({value})  # (a constant or a row's value: the tile's shape)")
        return "epilogue"

    def _segmented_tile(self) -> None:
        """The window's groups as the tile's rows (deterministic `tile` schedule): the tile's products, then a
        segmented scan along its rows, so each run's last row holds the run's sum (in a fixed order). A run is
        written by the program its first group belongs to: at its end within the window, or, for the window's last
        run, after this program has summed its continuation tile by tile. (The plan's lanes are parallel: `acc` is
        `[BLOCK_ROWS, BLOCK]`.)"""
        g, size = self.plan.window, f"size_{self.plan.window}"
        before = dict(self.loaded)  # (the tile's loads: again for each continuation tile)
        self.emit(self._acc_init())
        self._inner_loops()
        row = self.loaded[self._key(self._sorted_node(), self.lhs_role)]  # `[BLOCK_ROWS, 1]`
        self.helpers.add("segment_sum")
        self.emit(f"_, total = tl.associative_scan((tl.broadcast_to({row}, acc.shape), acc), 0, segment_sum)")
        self.emit(f"earlier = {self._window_rows('start - 1', 'start > 0')}")
        self.emit(f"following = {self._window_rows(f'v_{g} + 1', f'v_{g} + 1 < {size}')}[:, None]")
        self.emit(f"last = {self._window_rows('stop - 1')}")
        self.emit(f"continues = (last != earlier) & ({self._window_rows('stop', f'stop < {size}')} == last)")
        pointer, mask = self._lhs_pointer()
        self._write_alone(pointer, "total", f"{mask} & m_{g}[:, None] & ({row} != earlier) & ({row} != following)")
        self.emit("if continues:")
        self.depth += 1
        self.emit(f"tail = tl.sum(tl.where((v_{g} == stop - 1)[:, None], total, 0.0), axis=0)")
        self.emit("next_start = stop")
        self.emit(f"while {self._window_rows('next_start', f'next_start < {size}')} == last:")
        self.depth += 1
        self.emit(f"v_{g} = next_start + tl.arange(0, BLOCK_ROWS)")
        self.emit(f"m_{g} = v_{g} < {size}")
        self.emit(f"m_{g} &= {self._window_rows(f'v_{g}', f'm_{g}')} == last")
        self.loaded = {k: v for k, v in before.items() if k[1] == "scalar"}
        self._emit_loads(0)
        self.emit(self._acc_init())
        self._inner_loops()
        self.emit("tail += tl.sum(acc, axis=0)")
        self.emit("next_start += BLOCK_ROWS")
        self.depth -= 1
        self.loaded = before
        pointer, mask = self._lhs_pointer(row="last")
        self._write_alone(pointer, "tail[None, :]", mask)
        self.depth -= 1

    def _window_rows(self, position: str, mask: str | None = None) -> str:
        """The sorted index (the rows) at `position` of the window variable, -1 where `mask` is false."""
        rows = f"p_{self.spec.lhs_sorted_index}"
        return f"tl.load({rows} + {position}, mask={mask}, other=-1)" if mask else f"tl.load({rows} + {position})"

    def _row_in_range(self, row: str = "row") -> str:
        """Whether `row` (the current row of a segmented write, or rows) addresses the left-hand side."""
        lhs = self.spec.statement.lhs
        position = next(d for d, i in enumerate(lhs.indices) if isinstance(i, Access))
        self.helpers.add("in_range")
        bound = f"rows_{lhs.tensor}" if position == 0 else self.spec.lhs.shape[position]
        return f"in_range({row}, {bound})"

    def _sorted_node(self) -> Access:
        return next(i for i in self.spec.statement.lhs.indices if isinstance(i, Access))

    def _inner_loops(self) -> None:
        """The summed loops (and the innermost tile loop), with the accumulation at the bottom."""
        plan, extent = self.plan, self.spec.extent
        for v in plan.loops:
            self._open_loop(v)
        opened = len(plan.loops)
        inner = self.inner_tile
        if inner:
            block = "BLOCK_K" if plan.template == "dot" else "BLOCK"
            span, stop = f"0, {extent[inner]}", extent[inner]
            if plan.template == "dot" and plan.config.k_chunks > 1:
                span = f"k_start, tl.minimum(k_start + {plan.k_chunk}, {extent[inner]})"
            if plan.template == "dot" and plan.window_in_k:
                stop = f"end * {extent[inner]}"
                span = f"begin * {extent[inner]}, {stop}"
            self.emit(f"for t_{inner} in tl.range({span}, {block}, num_stages=NUM_STAGES):")
            self.starts[inner] = f"t_{inner}"
            self.depth += 1
            opened += 1
            self.emit(f"v_{inner} = t_{inner} + tl.arange(0, {block})")
            self.emit(f"m_{inner} = v_{inner} < {stop}")
            self._emit_loads(self.level[inner])
        self._accumulate()
        self.depth -= opened

    def _open_loop(self, v: str) -> None:
        """`for v_<v>` over the whole extent (unrolled when short), then the loads that it binds."""
        extent = self.spec.extent[v]
        if extent <= UNROLL_LIMIT:
            self.emit(f"for v_{v} in tl.static_range({extent}):")
        else:
            self.emit(f"for v_{v} in tl.range(0, {extent}):")
        self.depth += 1
        self._emit_loads(self.level[v])

    def _accumulate(self) -> None:
        plan = self.plan
        if plan.template == "dot":
            a = self.loaded[self._key(self.spec.statement.factors[plan.dot.a], "a")]
            b = self.loaded[self._key(self.spec.statement.factors[plan.dot.b], "b")]
            precision = dot_precision(self._value_type("a") == "tl.float32", self.spec.allow_tf32)
            self.emit(f"acc = tl.dot({a}, {b}, acc{precision})")
            return
        keys = [self._key(f, self._role(k)) for k, f in enumerate(self.spec.statement.factors)]
        product = " * ".join(self.loaded[key] for key in keys)
        if plan.reduction == "sum":
            self.emit(f"acc += {product}")
            return
        self.helpers.add("combine")
        if self.spec.winners:  # terms equal to the result (as rounded to its dtype) give their rank
            keys.append(self._key(self.spec.statement.lhs, "lanes"))
        reads = " & ".join(f"({self.masks[key]})" for key in keys if self.masks[key])
        if not self.spec.winners:
            self.emit(f"acc = combine(acc, {f'tl.where({reads}, {product}, acc)' if reads else product}, "
                      f"{self.reduction})")
            return
        result_type = _TRITON_DTYPES[str(self.spec.lhs.dtype)]
        rounded = product if result_type == self.acc_type else f"({product}).to({result_type}).to({self.acc_type})"
        wins = f"({rounded} == {self.loaded[keys[-1]]})" + (f" & {reads}" if reads else "")
        self.emit(f"acc = combine(acc, tl.where({wins}, {self._rank()}, 0), {self.reduction})")

    def _rank(self) -> str:
        """`count - a` for the assignment `a` of the reduced variables (flat, row-major; see `Spec.winners`)."""
        spec, terms, stride = self.spec, [], 1
        for v in reversed(spec.reduced_variables):
            position = self._tile_axis("lanes", v) if v in self.tiled else f"v_{v}"
            terms.append(position if stride == 1 else f"{position} * {stride}")
            stride *= spec.extent[v]
        return f"{spec.term_count} - ({' + '.join(reversed(terms))})" if terms else "1"  # (one term per element)

    def _written_value(self) -> str:
        """The accumulator reduced over a summed lane variable (the last axis)."""
        plan = self.plan
        if plan.template == "lanes" and plan.lanes in self.spec.summed_variables:
            reduce = {"sum": "tl.sum", "max": "tl.max", "min": "tl.min"}[plan.reduction]
            return f"{reduce}(acc, axis={1 if plan.rows else 0})"
        return "acc"

    # --- accesses ---------------------------------------------------------------------------------------------

    def _role(self, factor: int) -> str:
        """How tile variables broadcast in a factor's address: the dot operands `a` and `b`, or the lanes."""
        plan = self.plan
        if plan.template == "dot":
            return "a" if factor == plan.dot.a else "b"
        return "lanes"

    def _tile_axis(self, role: str, var: str) -> str:
        """The expression of tile variable `var` in an access of `role` (broadcast to the tile's rank)."""
        plan = self.plan
        if plan.template == "dot":
            dot = plan.dot
            rows = {"a": (dot.m, dot.k), "b": (dot.k, dot.n), "out": (dot.m, dot.n)}[role]
            return f"v_{var}[:, None]" if var == rows[0] else f"v_{var}[None, :]"
        written = [v for v in plan.tile_vars if v in self.spec.loop_variables]
        if plan.rows is None or (role == "out" and len(written) == 1):
            return f"v_{var}"  # one axis: the lanes, or what is left of the tile after the lane sum
        return f"v_{var}[:, None]" if var == plan.rows else f"v_{var}[None, :]"

    def _key(self, node: Access, role: str) -> tuple[str, str]:
        """Loads are shared between accesses of the same text, unless tile variables broadcast differently."""
        return str(node), role if set(variables(node)) & self.tiled else "scalar"

    def _node_level(self, node: Access) -> int:
        return max((self.level[v] for v in variables(node)), default=0)

    def _emit_loads(self, level: int) -> None:
        """Loads every access whose innermost variable lives at `level`, index arrays before what they index."""
        statement = self.spec.statement
        for k, factor in enumerate(statement.factors):
            self._load_at(factor, self._role(k), level)
        if self.spec.winners:  # the result, compared with each term (so broadcast like the terms)
            self._load_at(statement.lhs, "lanes", level)
        for index in statement.lhs.indices:
            if isinstance(index, Access) and not self.plan.row_pointers:  # their programs know their row
                self._load_at(index, self.lhs_role, level)

    def _load_at(self, node: Access, role: str, level: int) -> None:
        for index in node.indices:
            if isinstance(index, Access):
                self._load_at(index, role, level)
        if self._node_level(node) == level and self._key(node, role) not in self.loaded:
            self._load(node, role)

    def _address(self, node: Access, role: str) -> tuple[str, str]:
        """`(pointer expression, mask expression)` of `node` for an access of `role`."""
        shape = self.spec.operand[node.tensor].shape
        positions, masks = [], []
        for d, index in enumerate(node.indices):
            if isinstance(index, Var):
                value = self._tile_axis(role, index.name) if index.name in self.tiled else f"v_{index.name}"
                if index.name in self.tiled:
                    masks.append(self._tile_axis(role, index.name).replace("v_", "m_", 1))
            else:
                value = self.loaded[self._key(index, role)]
                masks.append(f"in_range({value}, {f'rows_{node.tensor}' if d == 0 else shape[d]})")
                self.helpers.add("in_range")
            positions.append(value)
        return f"p_{node.tensor} + {offset(shape, positions)}", " & ".join(masks)

    def _describe(self) -> None:
        """Makes the kernel's TMA descriptors (once per program, before any loop or branch)."""
        factors = self.spec.statement.factors
        for role, view in self.described.items():
            tensor = factors[self.plan.dot.a if role == "a" else self.plan.dot.b].tensor
            self.emit(make_descriptor(role, f"p_{tensor}", view))

    def _box(self, node: Access, role: str) -> tuple[str, str]:
        """`(load, mask)`: the load of dot factor `node`'s tile from its descriptor (`_tiles.box_load`) and where
        the pointer load would read (its range checks)."""
        view, shape = self.described[role], tuple(int(s) for s in self.spec.operand[node.tensor].shape)
        positions, checks = [], []
        for d, index in enumerate(node.indices):
            if isinstance(index, Var):
                positions.append(self.starts[index.name] if index.name in view.axes else f"v_{index.name}")
            else:
                positions.append(self.loaded[self._key(index, role)])
                checks.append(f"in_range({positions[-1]}, {f'rows_{node.tensor}' if d == 0 else shape[d]})")
                self.helpers.add("in_range")
        tile = (self.plan.dot.m, self.plan.dot.k) if role == "a" else (self.plan.dot.k, self.plan.dot.n)
        return box_load(role, view, shape, positions, checks, tile != view.axes), " & ".join(checks)

    def _load(self, node: Access, role: str) -> None:
        name = f"x{len(self.loaded)}"
        self.loaded[self._key(node, role)] = name
        factors = self.spec.statement.factors
        if role in self.described and node == factors[self.plan.dot.a if role == "a" else self.plan.dot.b]:
            load, self.masks[self._key(node, role)] = self._box(node, role)
            self.emit(f"{name} = {load}.to({self._value_type(role)})  # {node}, through a TMA descriptor")
            return
        pointer, mask = self._address(node, role)
        self.masks[self._key(node, role)] = mask
        is_index = node.tensor in self.spec.index_tensors
        if mask:
            other = "-1" if is_index else "0.0"
            load = f"tl.load({pointer}, mask={mask}, other={other})"
        else:
            load = f"tl.load({pointer})"
        if not is_index:
            load += f".to({self._value_type(role)})"
        self.emit(f"{name} = {load}  # {node}")

    def _value_type(self, role: str) -> str:
        """Values enter the accumulation in float32 (float64 for float64 outputs); `tl.dot` operands keep their
        16-bit type when both share it, so the product runs on Tensor Cores."""
        if role in ("a", "b"):
            factors = self.spec.statement.factors
            dtypes = {str(self.spec.operand[factors[k].tensor].dtype) for k in (self.plan.dot.a, self.plan.dot.b)}
            if len(dtypes) == 1 and dtypes <= {"float16", "bfloat16"}:
                return _TRITON_DTYPES[dtypes.pop()]
            return "tl.float32"
        return self.acc_type

    def _lhs_pointer(self, row: str | None = None) -> tuple[str, str]:
        """The output pointer and mask; `row` (a segmented write's current row) stands for the sorted index."""
        lhs = self.spec.statement.lhs
        if row is None:
            pointer, mask = self._address(lhs, self.lhs_role)
        else:
            key = self._key(self._sorted_node(), self.lhs_role)
            loaded, self.loaded[key] = self.loaded.get(key), row
            pointer, mask = self._address(lhs, self.lhs_role)
            if loaded is None:
                del self.loaded[key]
            else:
                self.loaded[key] = loaded
        return pointer.replace(f"p_{lhs.tensor} +", "p_out +", 1), mask or "always"
