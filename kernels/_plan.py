"""Checked `Spec` -> `KernelPlan`: which variables are tiles, which are parallel over the grid, which are looped,
and how the left-hand side is written.

Two templates cover the class:

- **dot**: two factors that, for fixed scalar variables, multiply as matrices (`m,k x k,n` with the output on
  `m,n`, every side >= 16 and addressed directly): tiles of the three, contracted with `tl.dot` (Tensor Cores).
  Block-sparse SpMM, block SDDMM and their transposes take this path.
- **lanes**: everything else. One variable is vectorised across the program's lanes (the one most factors read
  contiguously); every other variable is a scalar, either parallel (grid) or looped inside. Each lane keeps its
  own float32 accumulator, so nothing is reduced across threads except when the lane variable is itself summed.
  Then (SDDMM: `S[g,p] = X[Ai[g],d] * Y[Ak[g,p],d]`) the output's contiguous variable becomes a second, row tile
  (`p`), so one program gathers a whole `p x d` tile, reduces it over `d` and stores `p` outputs at once.

Parallel (grid) variables are the left-hand side's; summed ones are loops. The innermost grid variable is walked in
windows of `window` consecutive values per program, so short work items share a program. Short parallel variables
that some factor does not read (the `p` of `dB[Ak[g,p],n] += Av[g,p] * C[Ai[g],n]`, a transpose) are looped inside
the program instead (`write_loops`): each iteration writes its own outputs, and the loads they do not depend on
(the row `C[Ai[g],:]`) are made once, not once per program.

Write modes:
- `set` (`=`): store; a target written twice is undefined by the language anyway.
- `update` (`+=`, the left-hand side addressed by plain variables): each element has one writer, load-add-store.
- `segmented` (`+=` through a sorted index array of the window variable, a format's rows): consecutive equal rows
  accumulate in registers and are written once. Three schedules (`KernelConfig.schedule`):
  `split`: windows of `window` groups; rows that continue into a neighbouring window are added atomically
  (balanced even with hub rows; the default for lanes plans). `owned`: a program finishes every row that starts
  in its window (no atomics). `rows`: one program per row, its groups found through row pointers computed by the
  launcher (no atomics and no branch in the loop; the default for dot plans).
- `atomic` (`+=` through other indirections): `tl.atomic_add`.

`max=` and `min=` take the same plans with another combining operation: accumulators start at the reduction's
identity, terms that read out of range are replaced by it, and writes shared between programs use `tl.atomic_max`
/ `tl.atomic_min` (exact, hence reproducible: deterministic mode changes nothing for them). There is no dot plan
for them (Tensor Cores only add). Their `winners` (`Spec.winners`) are such a plan too, over the same terms: an
int32 maximum of `count - assignment` over the terms equal to the result, into a zero-filled output.

The `tile` schedule (lanes plans without a row tile) makes the window variable the row axis of the tile instead of
a loop: the window's values are gathered at once, so short work items (rows of a few nonzeros, narrow features)
have all their loads in flight instead of one dependent chain per item. Writes through index arrays are then
atomic, a segmented write included (rows repeat within the tile); in deterministic mode a segmented write instead
sums the tile's runs of equal rows in the program (a segmented scan) and writes each row that starts in the window
once, finishing the last one past the window's end (`owned`, tile by tile).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jinsum._lang import Access, Spec, Var, map_statement, variables, walk

# The Tensor Core product of float32 factors where TensorFloat-32 is not allowed: three TF32 products of each
# factor's high and low parts (near float32's error), not "ieee", which Triton runs on CUDA cores, tens of times
# slower than TF32 in attention (DESIGN.md, "Float32 follows JAX's precision").
PRECISE_FLOAT32 = "tf32x3"
DESCRIPTOR_BYTES = 128  # a TMA descriptor in Triton's global scratch (the statements' and the attention chains')
# Operand element counts at or above this need 64-bit offsets.
INT32_LIMIT = 2**31 - 1
# Lanes plans this narrow (lanes per program) take the `tile` schedule by default, and their row tile (if any)
# is replaced by the window when it would have this few rows.
TILE_LANES = 64
SHORT_ROWS = 4
# In deterministic mode a segmented write takes the `tile` schedule only this narrow: the scan along the tile's rows
# costs more than it saves on wider tiles: the tile wins at 16 and 32 features and loses at 40 and 64
# (benchmarks/README.md, "Deterministic mode (`jinsum.deterministic`)").
SCAN_LANES = 32
# Parallel lanes (an SpMM's features) wider than this are split across programs, one warp each: faster on power-law
# and uniform graphs alike. The tiles are the slow grid axis, so programs running at once gather from one feature
# slice of the dense operand (better L2 reuse). 64-wide slices are faster still where the gathers have no locality
# but slower on power-law graphs, whose hubs stay cached anyway and which then read the index once per slice:
# `jinsum.autotune` decides (DESIGN.md, "Hub rows and wide features"; benchmarks/README.md, "Results: NVIDIA H100
# 80GB HBM3 (jax 0.11.2, triton 3.6.0, jax-triton 0.3.1, torch 2.11)").
WIDE_LANES = 128
# Loops this short are unrolled (`tl.static_range`), so all their loads are in flight at once.
UNROLL_LIMIT = 16
# At most this many copies of the innermost body once write loops are unrolled too.
UNROLLED_BODIES = 64
# A dot plan updating a plain left-hand side whose reduction (the k of its product) is at least twice this long cuts
# it into chunks of this many terms: each chunk's programs add their partial products atomically, and the chunk is
# the slow grid axis, so the programs running at once read one chunk of both operands, which stays in L2. A
# SparseLinear's value gradient, whose windows of blocks each summed the whole batch reading mostly from HBM, got
# several times faster so (DESIGN.md, "Dot plans").
K_CHUNK = 1024
# ... unless the output has this many elements or more: then its tiles alone fill the GPU, and the chunks' float32
# atomics (and the cast after them) cost more than the reuse saves (a Mixtral-like grouped product took twice as
# long in chunks: DESIGN.md, "Dot plans").
CHUNK_ELEMENTS = 1 << 22
# A weight gradient walking its rows' positions (`KernelPlan.window_in_k`) with fewer row programs than this (rows x
# output tiles) takes windows of groups instead, about this many (twice the 132 SMs of the GPUs it was tuned on):
# a few row programs leave the GPU idle behind the longest type's (HeteroLinear's weight gradient, an order of
# magnitude: benchmarks/README.md, "Mixtures of experts and grouped products (`moe.py`, `grouped_forms.py`,
# `hetero_linear.py`)").
SPLIT_ROW_PROGRAMS = 264
# The Hopper form's group sizes (one consumer warpgroup's 64 rows of wgmma, or both consumers' 128), and the shared
# memory its ring and output tiles may take (227 KiB a program, less Triton's barriers and a margin).
HOPPER_GROUP_ROWS = (64, 128)
HOPPER_SHARED_MEMORY = 225 * 1024


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch and tiling parameters. Zero means "choose from the plan" (see `default_config`)."""

    block: int = 0  # lanes per program (lanes template)
    block_rows: int = 0  # rows of the lanes tile, when it has a row variable
    window: int = 0  # consecutive values of the window variable per program
    schedule: str = ""  # segmented writes: "split", "owned" or "rows"; "tile" (see above; ignored by plans
    #                     that have a row tile already)
    block_m: int = 0  # dot template tiles
    block_n: int = 0
    block_k: int = 0
    num_warps: int = 0
    num_stages: int = 0  # software pipelining depth of the window loop
    k_chunks: int = 0  # dot plans that update a plain left-hand side: the reduction cut into this many chunks
    # Dot plans: read the tiles of the two factors through TMA descriptors (Hopper) where their layout allows
    # (`kernels._source.described`), rather than by pointers: asynchronous copies into shared memory that Triton
    # pipelines and feeds to wgmma. Off by default (slower on SparseLinear's 32 x 32 blocks); `autotune` tries it.
    descriptors: bool = False
    # The Hopper form of the tile core (`jinsum.kernels.hopper`, Gluon, sm_90) for the plans that have one
    # (`grouped_hopper_fallback`): a grouped product's persistent warp-specialised programs, at most `programs`
    # (the GPU's SMs). The route sets both on sm_90; plans without the form keep the Triton one.
    hopper: bool = False
    programs: int = 0


@dataclasses.dataclass(frozen=True)
class DotRoles:
    """The matrix product inside a dot plan: `a[m,k] x b[k,n] -> out[m,n]` for fixed scalar variables."""

    a: int  # factor positions
    b: int
    m: str
    n: str
    k: str


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    spec: Spec
    template: str  # "lanes" or "dot"
    lanes: str | None  # lanes template: the vectorised variable
    rows: str | None  # lanes template: an output variable tiled along a second axis, or None
    dot: DotRoles | None  # dot template: the matrix product
    grid: tuple[str, ...]  # scalar parallel variables, flattened over program_id(0), outermost first
    window: str | None  # the innermost parallel variable, walked in windows
    write_loops: tuple[str, ...]  # parallel scalar variables looped inside, a write per iteration
    loops: tuple[str, ...]  # summed scalar variables, looped inside, outermost first
    write: str  # "set", "update", "segmented" or "atomic"
    config: KernelConfig
    out_dtype: np.dtype  # the buffer the kernel writes (float32 when 16-bit results need atomics)

    @property
    def starts_from_lhs(self) -> bool:
        """The result builds on the left-hand side's values (a reduction, or `=` that leaves elements unwritten).
        Winners build on zeros; the left-hand side is an input of theirs (the result they locate)."""
        statement = self.spec.statement
        return self.spec.winners or statement.accumulate or not all(isinstance(i, Var) for i in statement.lhs.indices)

    @property
    def reads_lhs(self) -> bool:
        """The kernel reads the left-hand side (the launcher aliases it to the output)."""
        return self.starts_from_lhs and not (self.spec.zero_lhs or self.spec.winners)

    @property
    def zeroes_output(self) -> bool:
        """The result builds on a left-hand side known to be zeros: the launcher zero-fills the output instead,
        and elements with one writer are stored, not read, added and stored."""
        return self.starts_from_lhs and (self.spec.zero_lhs or self.spec.winners)

    @property
    def adds_atomically(self) -> bool:
        """Some outputs are float-added by several programs (`tl.atomic_add`): the order, hence the rounding, varies
        from run to run. (Atomic maxima and minima are exact.)"""
        return _writes_atomically(self.write, self.config) and self.reduction == "sum" and not self.carries

    @property
    def acc_dtype(self) -> np.dtype:
        """What values are multiplied and accumulated in: float32, float64 for float64 results."""
        return np.dtype(np.float64 if np.float64 in (self.out_dtype, self.spec.lhs.dtype) else np.float32)

    @property
    def carries(self) -> bool:
        """The `split` schedule into zeros, its shared rows carried instead of added atomically: each program stores
        its partial sums of the (at most two) rows it shares with its neighbours into a scratch array, and a second
        kernel (`jinsum_lanes_fixup`) adds each shared row's partials in a fixed order and stores the row; the first
        kernel stores every other row, the empty ones as zeros. So nothing zero-fills the output first, no atomics
        run (the result is the same in every run), and a 16-bit output is written in its dtype, not in float32 and
        cast after. For sums (`+=`) with one row index and one lane variable on the left (SpMM's `C[Ai[g],n]`),
        outside grids and row tiles, with 16-bit results or in deterministic mode: for float32 results the zero
        fill and the atomics cost no more than carrying (the first kernel's stores of the empty rows cost what the
        fill saves; DESIGN.md, "Carry shared rows")."""
        return (_carriable(self.spec, self.lanes, self.rows, self.write, self.grid, self.write_loops)
                and self.template == "lanes" and self.config.schedule == "split"
                and (self.spec.deterministic or np.dtype(self.spec.lhs.dtype).itemsize < 4))

    @property
    def reduction(self) -> str:
        """How terms combine in the kernel: "sum", "max" or "min" (winners: the maximum of their ranks)."""
        return "max" if self.spec.winners else self.spec.statement.reduction

    @property
    def fuses_epilogue(self) -> bool:
        """The statement's epilogue is applied in the kernel: every output element has one writer, which sees
        its whole value (a plain left-hand side, set or updated; or a program per row of a segmented write, empty
        rows included: the `rows` schedule, the default of dot plans). Elsewhere (atomic writes, rows shared
        between windows) the lowering applies it after. The schedule is not changed to fuse it: row programs for
        lanes plans leave a hub row to one program, which made an SpMM with its epilogue fused that way several
        times slower than the `split` kernel and XLA's pass after it (DESIGN.md, "Fuse only where the plan already
        has one writer per element")."""
        if self.spec.epilogue is None:
            return False
        plain = all(isinstance(i, Var) for i in self.spec.statement.lhs.indices)
        return (self.write in ("set", "update") and plain) or self.row_programs

    @property
    def covers_output(self) -> bool:
        """Row programs into zeros write every element of the output once: a program per row (empty rows too, which
        store zeros) and the output's other axes parallel variables; so do carried windows (`carries`), and plans
        updating a plain left-hand side (every element one program's, stored whole: a grouped product in grouped
        order). The launcher then leaves the output unfilled (a zero fill is a measurable share of a block SpMM's
        time: DESIGN.md, "Dot plans")."""
        one_writer = self.row_programs or self.carries or (self.write == "update" and not self.spec.winners)
        return one_writer and self.zeroes_output  # (a segmented write: one indirection)

    @functools.cached_property
    def tile_vars(self) -> tuple[str, ...]:
        if self.template == "dot":
            return (self.dot.m, self.dot.n)
        return (self.rows, self.lanes) if self.rows else (self.lanes,)

    @property
    def tiled_window(self) -> bool:
        """The window variable is the tile's row axis (the `tile` schedule), not a loop."""
        return self.window is not None and self.window == self.rows

    @property
    def row_programs(self) -> bool:
        """One program per output row, through row pointers (the `rows` schedule of a segmented write)."""
        return self.write == "segmented" and self.config.schedule == "rows"

    @property
    def row_pointers(self) -> bool:
        """The kernel reads the row starts of the sorted index (`p_row_starts`): row programs, and windows that walk
        their rows' positions as one reduction (`window_in_k` under the `split` schedule)."""
        return self.row_programs or self.window_in_k

    @functools.cached_property
    def row_count(self) -> int:
        """The size of the left-hand side dimension that the sorted index addresses."""
        position = next(d for d, i in enumerate(self.spec.statement.lhs.indices) if isinstance(i, Access))
        return self.spec.lhs.shape[position]

    @functools.cached_property
    def windows(self) -> int:
        """Programs along the window variable: one per window of `window` values, or one per row."""
        if self.row_programs:
            return self.row_count
        return -(-self.spec.extent[self.window] // self.config.window) if self.window else 1

    @property
    def fixup_sizes(self) -> dict[str, int]:
        """The runtime sizes of the fixup kernel (`carries`): programs, groups and the output's rows."""
        names = ("programs", f"size_{self.window}", f"rows_{self.spec.lhs.name}")
        return {name: self.sizes[name] for name in names}

    @functools.cached_property
    def sizes(self) -> dict[str, int]:
        """The sizes the kernel takes as runtime arguments, by parameter name, in order: `programs` along the
        window variable, the window variable's extent (`size_<var>`: a pattern's number of groups), and the
        leading dimension of every array that an index array addresses (`rows_<array>`, the bound of its range
        check). So a pattern with another number of groups, or operands with another number of rows, reuse the
        compiled kernel: these only bound loops and masks (strides never involve a leading dimension). Tiles,
        strides and feature widths stay in the source, where they make vector loads and unrolled loops (a width
        passed at run time made narrow SpMMs measurably slower: DESIGN.md, "Kernel identity")."""
        sizes = {}
        if self.window or self.row_programs:
            sizes["programs"] = self.windows
        if self.window:
            sizes[f"size_{self.window}"] = self.spec.extent[self.window]
        statement = self.spec.statement
        for node in (n for access in statement.accesses for n in walk(access)):
            if node.indices and isinstance(node.indices[0], Access):
                sizes[f"rows_{node.tensor}"] = self.spec.operand[node.tensor].shape[0]
        return {name: int(size) for name, size in sizes.items()}  # (Python ints: jax-triton's scalar arguments)

    @functools.cached_property
    def window_in_k(self) -> bool:
        """A dot plan's row program walks its groups and each group's k as one loop over `groups x extent(k)`
        positions: wherever the window variable or k indexes an access, k indexes the dimension right after the
        window variable's (so a position is `g * extent(k) + k`), and nothing else reads the window variable.
        A grouped product's weight gradient (`dW[Ai[g],c,h] += X[Ak[g,p],c] * dH[g,p,h]`): each expert's rows are
        one long pipelined reduction instead of a loop over groups of one or two k tiles each. A program per row
        (the `rows` schedule), or, where rows are few (`SPLIT_ROW_PROGRAMS`), a window of groups whose rows' parts
        are each one such reduction, added atomically (the `split` schedule)."""
        if not (self.template == "dot" and self.write == "segmented" and self.config.schedule in ("rows", "split")):
            return False
        g, k = self.window, self.dot.k
        sorted_node = next(i for i in self.spec.statement.lhs.indices if isinstance(i, Access))
        for access in (*self.spec.statement.factors, self.spec.statement.lhs):
            for node in walk(access):
                if node is sorted_node:
                    continue
                names = [i.name if isinstance(i, Var) else None for i in node.indices]
                if (g in names or k in names) and not (
                        names.count(g) == names.count(k) == 1 and names.index(k) == names.index(g) + 1):
                    return False
        return True

    @property
    def k_chunk(self) -> int:
        """Dot plans: terms of the reduction per chunk (whole `block_k` tiles; the last chunk may be shorter)."""
        k, tile = self.spec.extent[self.dot.k], self.config.block_k
        return _ceil(_ceil(k, self.config.k_chunks), tile) * tile

    @property
    def grid_shape(self) -> tuple[int, int]:
        """(programs over the grid variables and windows, programs over output tiles); the Hopper form's
        persistent programs walk every (group, column tile) on one axis."""
        extent = self.spec.extent
        if self.config.hopper:  # (a grouped sum's items: a row's tiles of m and n; a product's: a group's of n)
            rows = self.row_count * extent[self.dot.m] // 128 if self.write == "segmented" else extent[self.window]
            items = rows * _ceil(extent[self.dot.n], self.config.block_n)
            return min(items, self.config.programs or items), 1
        programs = self.windows * int(np.prod([extent[v] for v in self.grid], dtype=np.int64))
        if self.template == "dot":
            tiles = _ceil(extent[self.dot.m], self.config.block_m) * _ceil(extent[self.dot.n], self.config.block_n)
            tiles *= self.config.k_chunks
        else:
            tiles = _ceil(extent[self.rows], self.config.block_rows) if self.rows and not self.tiled_window else 1
            if self.lanes in self.spec.loop_variables:
                tiles *= _ceil(extent[self.lanes], self.config.block)
        return int(programs), int(tiles)


@dataclasses.dataclass(frozen=True)
class Fallback:
    """The statement stays on the XLA lowering, for `reason`."""

    reason: str


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(x: int, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, 1 << max(0, int(x) - 1).bit_length())))


def canonical(spec: Spec) -> Spec:
    """`spec` with its tensors renamed `T0, T1, ...` (the output first) and its index variables `i0, i1, ...`, in
    order of first appearance: statements that differ in names only (a forward SpMM and its transpose over the
    entries in column order; the same layer applied twice) generate one source, hence share one compiled kernel.
    The lowerings plan this form; the column order, which only the derivative rules read, is dropped."""
    tensors = {name: f"T{k}" for k, name in enumerate(spec.names)}
    names = {v: f"i{k}" for k, (v, _) in enumerate(spec.extents)}

    def rename(node: Access) -> Access:
        indices = tuple(Var(names[i.name]) if isinstance(i, Var) else i for i in node.indices)
        return Access(tensors[node.tensor], indices)

    return dataclasses.replace(
        spec, statement=dataclasses.replace(map_statement(spec.statement, rename), source=""),
        operands=tuple(dataclasses.replace(o, name=tensors[o.name]) for o in spec.operands),
        extents=tuple((names[v], e) for v, e in spec.extents),
        sorted_indices=frozenset(tensors[n] for n in spec.sorted_indices), column_order=None)


def make_plan(spec: Spec, config: KernelConfig = KernelConfig()) -> KernelPlan | Fallback:
    """The kernel plan for `spec`, or a `Fallback` saying why it stays on XLA."""
    statement = spec.statement
    dot = _dot_roles(spec)
    lanes = None if dot else _lane_variable(spec)
    rows = None if dot else _row_variable(spec, lanes)
    narrow = not dot and _lanes_block(spec, lanes, config) <= TILE_LANES
    if rows and narrow and spec.extent[rows] <= SHORT_ROWS and config.schedule in ("", "tile"):
        rows = None  # a tile of a few rows: tile the window instead (SDDMM over groups of 2: rows g, not p)
    tiles = (dot.m, dot.n) if dot else tuple(v for v in (rows, lanes) if v)
    scalar_loop = [v for v in spec.loop_variables if v not in tiles]
    loops = tuple(v for v in spec.summed_variables if v not in tiles and not (dot and v == dot.k))

    segment = spec.lhs_sorted_index
    segment_var = None
    summing = statement.reduction == "sum"
    if segment is not None and statement.accumulate:
        [var] = next(n for n in walk(statement.lhs) if n.tensor == segment).indices
        if var.name not in tiles:
            segment_var = var.name
    if segment_var is not None:
        window = segment_var
        write = "segmented"
    else:
        window = max(scalar_loop, key=lambda v: spec.extent[v], default=None)
        if not statement.accumulate:
            write = "set"
        elif all(isinstance(i, Var) for i in statement.lhs.indices):
            write = "update"
        else:
            write = "atomic"
    # Deterministic sums of a tile's rows per row: a segmented scan (extrema are exact in any order: atomics).
    scanned = spec.deterministic and write == "segmented" and summing
    if not config.schedule and narrow and not (scanned and _lanes_block(spec, lanes, config) > SCAN_LANES):
        config = dataclasses.replace(config, schedule="tile")  # narrow rows: more of them in flight at once
    if config.schedule == "tile":
        if dot or rows is not None or window is None:
            config = dataclasses.replace(config, schedule="")  # no row axis left for the window: loop it
        elif not scanned:
            rows = window  # the window's values are the tile's rows
            write = "atomic" if write == "segmented" else write
        elif lanes in spec.loop_variables:
            rows = window  # deterministic: the tile's runs of equal rows are summed inside the program
        else:
            config = dataclasses.replace(config, schedule="owned")
    if spec.winners and config.schedule == "rows":
        config = dataclasses.replace(config, schedule="owned")  # (they read the result at each term's row)
    parallel = [v for v in scalar_loop if v != window]
    # Unrolled inside the program when that saves loads; not for segmented writes, whose accumulator is per row.
    # The unrolled body (write loops x short summed loops) stays small, or Triton's compile time explodes.
    bodies = int(np.prod([spec.extent[v] for v in loops if spec.extent[v] <= UNROLL_LIMIT], dtype=np.int64))
    write_loops = []
    for v in parallel:
        if (write != "segmented" and spec.extent[v] <= UNROLL_LIMIT and bodies * spec.extent[v] <= UNROLLED_BODIES
                and any(v not in variables(f) for f in statement.factors)):
            write_loops.append(v)
            bodies *= spec.extent[v]
    write_loops = tuple(write_loops)
    grid = tuple(v for v in parallel if v not in write_loops)
    if (spec.deterministic and summing and write == "segmented" and (config.schedule == "split"
                                                                      or not (dot or config.schedule))
            and (dot or not _carriable(spec, lanes, rows, write, grid, write_loops))):
        config = dataclasses.replace(config, schedule="owned")  # every row written by one program: no atomics

    if config.hopper:
        hopper = dataclasses.replace(config, schedule="rows" if write == "segmented" else "")
        plan = KernelPlan(spec, "dot", None, None, dot, tuple(grid), window, write_loops, loops, write, hopper,
                          np.dtype(spec.lhs.dtype)) if dot else None
        if plan is not None and not grouped_hopper_fallback(plan):
            return dataclasses.replace(plan, config=_hopper_config(spec, dot, hopper, write == "segmented"))
        config = dataclasses.replace(config, hopper=False, programs=0)  # (the Triton form: a program per tile)
    given, config = config, default_config(spec, dot, tiles, config)
    chunks = 1
    if dot and write == "update" and summing and not spec.deterministic and spec.epilogue is None:
        elements = spec.extent[dot.m] * spec.extent[dot.n] * int(np.prod(
            [spec.extent[v] for v in (*grid, window) if v], dtype=np.int64))
        long = spec.extent[dot.k] >= 2 * K_CHUNK and elements < CHUNK_ELEMENTS
        chunks = config.k_chunks or (_ceil(spec.extent[dot.k], K_CHUNK) if long else 1)
    config = dataclasses.replace(config, k_chunks=chunks)
    if chunks > 1:
        write = "atomic"  # (several programs add into each output tile)
        # A chunk is work enough for a program: one output tile each, all in flight (the SparseLinear value
        # gradient above is fastest so: benchmarks/README.md, "Sparse weights (`benchmarks/sparse_linear.py`)").
        config = dataclasses.replace(config, window=given.window or 1)
    plan = KernelPlan(spec, "dot" if dot else "lanes", lanes, rows, dot, grid, window, write_loops, loops, write,
                      config, np.dtype(np.int32) if spec.winners else np.dtype(spec.lhs.dtype))
    if (plan.window_in_k and not given.schedule and summing and not spec.deterministic
            and plan.row_count * plan.grid_shape[1] < SPLIT_ROW_PROGRAMS):
        # Few rows (16 types' weight gradients): a program per row and tile would leave most of the GPU idle while
        # the longest row runs; windows of groups spread the rows' lengths over about `SPLIT_ROW_PROGRAMS`.
        groups = _ceil(spec.extent[window] * plan.grid_shape[1], SPLIT_ROW_PROGRAMS)
        config = dataclasses.replace(config, schedule="split", window=given.window or groups)
        plan = dataclasses.replace(plan, config=config)
    if _writes_atomically(write, config) and not plan.carries and plan.out_dtype.itemsize < 4 and not spec.winners:
        # 16-bit atomics lose precision and are slow; the launcher casts back
        plan = dataclasses.replace(plan, out_dtype=np.dtype(np.float32))
    programs, tile_programs = plan.grid_shape
    if programs > INT32_LIMIT or tile_programs > 65535:
        return Fallback(f"the grid ({programs} x {tile_programs} programs) exceeds CUDA's launch limits")
    return plan


def grouped_hopper_fallback(plan: KernelPlan) -> str:
    """Why `plan` has no Hopper form ("" if it has one). The forms, in 16-bit floats:

    - a grouped product: a dot plan whose groups are tiles of its output's rows, each times its group's matrix,
      into zeros, `H[g,p,n] += X[Ak[g,p],k] * W[Ai[g],k,n]` (the rows gathered) or `H[g,p,n] += X[g,p,k] *
      W[Ai[g],k,n]` (in grouped order), the matrices stored either way round (`W[Ai[g],n,k]`: an input gradient's
      products), an epilogue or none: a mixture of experts' projections and HeteroLinear;
    - a grouped sum: each row's product of its groups' rows, `dW[Ai[g],m,n] += X[g,k,m] * dH[g,k,n]` into zeros
      (`Ai` sorted, the rows in grouped order: a weight gradient after `gathered_first`), m in tiles of 128.
    """
    spec, dot = plan.spec, plan.dot
    statement = spec.statement
    if plan.template != "dot":
        return "no Tensor Core product"
    summed = plan.write == "segmented"
    if not (plan.write in ("update", "segmented") and spec.zero_lhs and statement.reduction == "sum"
            and not spec.winners and not plan.grid and not plan.write_loops and not plan.loops
            and len(statement.factors) == 2 and not (summed and spec.epilogue is not None)):
        return "not a grouped product or sum into zeros"
    g, m, n, k = plan.window, dot.m, dot.n, dot.k
    a, b = statement.factors[dot.a], statement.factors[dot.b]
    lhs = statement.lhs.indices
    if summed:
        form = (_named(a.indices) == [g, k, m] and _named(b.indices) == [g, k, n] and _through(lhs[0], g)
                and _named(lhs[1:]) == [m, n])
    else:
        gathered = len(a.indices) == 2 and _through(a.indices[0], g, m) and _named(a.indices[1:]) == [k]
        form = ((gathered or _named(a.indices) == [g, m, k]) and len(b.indices) == 3 and _through(b.indices[0], g)
                and _named(b.indices[1:]) in ([k, n], [n, k]) and _named(lhs) == [g, m, n])
    if not form:
        return ("not a grouped product (H[g,p,n] += X[Ak[g,p],k] * W[Ai[g],k,n], or W[Ai[g],n,k]) or sum "
                "(dW[Ai[g],m,n] += X[g,p,m] * dH[g,p,n])")
    dtypes = {str(spec.operand[t].dtype) for t in (a.tensor, b.tensor, spec.lhs.name)}
    if len(dtypes) != 1 or not dtypes <= {"bfloat16", "float16"}:
        return f"{'/'.join(sorted(dtypes))} products (the Hopper form multiplies 16-bit floats)"
    extent = spec.extent
    rows, reduction = (k, m) if summed else (m, k)
    if summed and (extent[k] % 64 or extent[m] % 128):
        return f"groups of {extent[k]} rows into {extent[m]} (the Hopper form's are multiples of 64 into 128)"
    if not summed and extent[m] not in HOPPER_GROUP_ROWS:
        return f"groups of {extent[m]} rows (the Hopper form's are {' or '.join(map(str, HOPPER_GROUP_ROWS))})"
    if not summed and extent[k] % 64:
        return f"a reduction of {extent[k]} (the Hopper form's is a multiple of 64)"
    if extent[n] % 8:
        return f"{extent[n]} columns (the Hopper form's are a multiple of 8: 16-byte rows for TMA)"
    largest = max(int(np.prod(spec.operand[t].shape, dtype=np.int64)) for t in (a.tensor, b.tensor, spec.lhs.name))
    if largest > INT32_LIMIT or extent[g] * extent[rows] * max(extent[reduction], extent[n]) > INT32_LIMIT:
        return "operands past 32-bit element offsets"
    return ""


def _named(indices) -> list[str | None]:
    """The variables of plain indices, None for the others."""
    return [i.name if isinstance(i, Var) else None for i in indices]


def _through(index, *names: str) -> bool:
    """`index` reads an index array at plain variables `names` (`Ak[g,p]`)."""
    return isinstance(index, Access) and _named(index.indices) == list(names)


def _hopper_config(spec: Spec, dot: DotRoles, config: KernelConfig, summed: bool) -> KernelConfig:
    """The Hopper form's tiles: a group's rows (a grouped sum: 128 of m) by up to 256 columns, k tiles of 64, and as
    many stages as fit in shared memory with the two consumers' output tiles."""
    rows = 128 if summed else spec.extent[dot.m]
    columns = spec.extent[dot.n]
    block_n = config.block_n or (64 if columns <= 64 else 128 if columns <= 128 else 256)
    stage, outputs = (rows + block_n) * 64 * 2, 2 * 64 * block_n * 2
    stages = config.num_stages or min(5, (HOPPER_SHARED_MEMORY - outputs) // stage)
    return dataclasses.replace(config, block_m=rows, block_n=block_n, block_k=64, num_warps=4, num_stages=stages,
                               window=1, k_chunks=1)


def _carriable(spec: Spec, lanes: str | None, rows: str | None, write: str, grid: tuple[str, ...],
               write_loops: tuple[str, ...]) -> bool:
    """Whether a `split` schedule of this shape can carry its shared rows (`KernelPlan.carries`)."""
    lhs = spec.statement.lhs.indices
    return (write == "segmented" and spec.zero_lhs and spec.statement.reduction == "sum" and not spec.winners
            and not grid and not write_loops and rows is None and len(lhs) == 2 and isinstance(lhs[0], Access)
            and isinstance(lhs[1], Var) and lhs[1].name == lanes)


def _writes_atomically(write: str, config: KernelConfig) -> bool:
    return write == "atomic" or (write == "segmented" and config.schedule == "split")


def default_config(spec: Spec, dot: DotRoles | None, tiles: tuple[str, ...], config: KernelConfig) -> KernelConfig:
    """Fills the zero fields of `config`: a default that is good on Hopper for the plan's shape."""
    extent = spec.extent
    changes = {}
    # Chosen by timing the kernels with the configuration forced (DESIGN.md, "Launch defaults"):
    # - gathers: one warp per 128 lanes, windows of 8, no software pipelining;
    # - narrow gathers (<= TILE_LANES lanes): a tile of 16 gathered rows, <= 4 warps (about twice as fast for SpMM and
    #   SDDMM at 32 features; at F=128 the loop is as fast or faster);
    # - tl.dot plans: one program per row and n tile (the `rows` schedule: no atomics, so 16-bit outputs stay
    #   16-bit, and no search for the row's end in the loop), two pipeline stages, n tiles of 256 over 32-row blocks
    #   (faster than `owned` windows of 8 groups with 128-wide tiles, most at 20% density: DESIGN.md, "Dot plans").
    #   A row's blocks are one program's work under either schedule, so a long row costs the same.
    changes["schedule"] = config.schedule or ("rows" if dot else "split")
    # - products of wide tiles (m and n at least 128: grouped matmuls, a weight gradient's features) take 128 x 256
    #   tiles over 8 warps and three stages, as dense GEMMs on Hopper do (the fastest of the hand-written variants
    #   of a Mixtral-like expert matmul, level with torch._grouped_mm: DESIGN.md, "Mixtures of experts").
    if dot:
        wide = min(extent[dot.m], extent[dot.n]) >= 128
        changes["block_m"] = config.block_m or _pow2(extent[dot.m], 16, 128 if wide else 64)
        changes["block_n"] = config.block_n or _pow2(
            extent[dot.n], 16, 256 if changes["block_m"] <= 32 or changes["block_m"] >= 128 else 128)
        # k tiles of the same bytes whatever the factors' width: three stages of 128 x 256 tiles with k 64 take 288
        # KiB of shared memory in float32, past the 227 KiB a Hopper program may have (the launch fails).
        width = max(spec.operand[spec.statement.factors[f].tensor].dtype.itemsize for f in (dot.a, dot.b))
        changes["block_k"] = config.block_k or _pow2(extent[dot.k], 16, max(16, 128 // width))
        changes["num_warps"] = config.num_warps or (8 if changes["block_m"] * changes["block_n"] >= 128 * 256 else 4)
        changes["window"] = config.window or (1 if wide else 8)
        changes["num_stages"] = config.num_stages or (3 if changes["block_m"] >= 128 else 2)
    else:
        block = _lanes_block(spec, tiles[-1], config)
        changes["block"] = block
        changes["window"] = config.window or (16 if config.schedule == "tile" else 8)
        if config.schedule == "tile":  # rows past the window's end are masked off
            changes["block_rows"] = _pow2(changes["window"], 1, 1 << 16)
        else:
            changes["block_rows"] = config.block_rows or (_pow2(extent[tiles[0]], 1, 32) if len(tiles) == 2 else 1)
        # One warp holds 32 lanes x 4 contiguous elements (16-byte loads); more lanes, more warps (at most 4 for
        # a tile of gathered rows).
        if config.schedule == "tile":
            changes["num_warps"] = config.num_warps or max(1, min(4, block * changes["block_rows"] // 128))
        else:
            changes["num_warps"] = config.num_warps or max(1, min(8, block // 128))
        changes["num_stages"] = config.num_stages or 1
    return dataclasses.replace(config, **changes)


def _lanes_block(spec: Spec, lanes: str, config: KernelConfig) -> int:
    """Lanes per program: the configured block, else the lane variable's extent rounded up to a power of 2, at
    most 256 for a summed lane variable (looped inside in tiles) and at most WIDE_LANES for a parallel one (split
    across programs)."""
    widest = 256 if lanes in spec.summed_variables else WIDE_LANES
    return config.block or _pow2(spec.extent[lanes], 1, widest)


def _lane_variable(spec: Spec) -> str:
    """The variable most top-level accesses read contiguously (last position), the left-hand side breaking ties.
    In deterministic mode not the variable of a sorted segment write, if there is another: entries vectorised
    across lanes would be added atomically."""
    statement = spec.statement
    candidates = list(spec.extent)
    summing = statement.accumulate and statement.reduction == "sum"
    if spec.deterministic and spec.lhs_sorted_index is not None and summing:
        [segment] = next(i for i in statement.lhs.indices if isinstance(i, Access)).indices
        candidates = [v for v in candidates if v != segment.name] or candidates

    def last(access: Access) -> str | None:
        index = access.indices[-1]
        return index.name if isinstance(index, Var) else None

    def score(v: str) -> tuple[int, int, int]:
        reads = sum(last(f) == v for f in statement.factors)
        return (2 * reads + (last(statement.lhs) == v), spec.extent[v], -list(spec.extent).index(v))

    return max(candidates, key=score)


def _row_variable(spec: Spec, lanes: str) -> str | None:
    """For a summed lane variable: the output's last (contiguous) plain variable, tiled as rows, if it is read by
    some factor (so a program gathers several rows at once) and is not the only parallel variable."""
    if lanes in spec.loop_variables:
        return None
    last = spec.statement.lhs.indices[-1]
    if not isinstance(last, Var) or len(spec.loop_variables) < 2:
        return None
    if not any(last.name in variables(f) for f in spec.statement.factors):
        return None
    return last.name


def _dot_roles(spec: Spec) -> DotRoles | None:
    """`a[m,k] x b[k,n] -> out[m,n]` if the statement has that shape with sides >= 16, else None."""
    statement = spec.statement
    if len(statement.factors) != 2 or any(spec.operand[f.tensor].dtype == np.float64 for f in statement.factors):
        return None
    if statement.reduction != "sum" or spec.winners:  # (tl.dot only adds)
        return None

    def direct(access: Access) -> set[str]:
        return {i.name for i in access.indices if isinstance(i, Var)}

    def reached(access: Access) -> set[str]:
        return {v.name for node in walk(access) for v in node.indices if isinstance(v, Var)}

    # Tile variables address the output directly, or (a scatter, written atomically) through an index array of an
    # output that has no sorted one (`dX[Ak[g,p],c] += dH[g,p,h] * W[Ai[g],c,h]`, a grouped product's input
    # gradient: a tile of one group's rows, each added to its token's row). A factor's row (column) variable may
    # reach it through an index array: its rows are gathered (`H[g,p,h] += X[Ak[g,p],c] * W[Ai[g],c,h]`, a tile of
    # one group's rows), if no index array of the other factor holds it. The contraction `k` addresses both factors
    # directly; failing that, either through an index array: the tiles are gathered along k (the weight gradient
    # `dW[Ai[g],c,h] += X[Ak[g,p],c] * dH[g,p,h]`, a reduction over each group's rows).
    inside_indices = {v.name for access in statement.accesses for node in walk(access) if node is not access
                      for v in node.indices if isinstance(v, Var)}
    through_lhs = {v for node in walk(statement.lhs) if node is not statement.lhs for v in reached(node)}
    out = direct(statement.lhs) - through_lhs
    if spec.lhs_sorted_index is None and statement.accumulate:
        out |= through_lhs
    for a, b in ((0, 1), (1, 0)):
        da = direct(statement.factors[a]) - inside_indices
        db = direct(statement.factors[b]) - inside_indices
        ms = sorted((reached(statement.factors[a]) & out) - reached(statement.factors[b]),
                    key=lambda v: -spec.extent[v])
        ns = sorted((reached(statement.factors[b]) & out) - reached(statement.factors[a]),
                    key=lambda v: -spec.extent[v])
        direct_ks = sorted((da & db) - set(spec.loop_variables), key=lambda v: -spec.extent[v])
        gathered_ks = sorted((reached(statement.factors[a]) & reached(statement.factors[b]))
                             - set(spec.loop_variables) - set(direct_ks), key=lambda v: -spec.extent[v])
        for ks in (direct_ks, gathered_ks):
            for m in ms:
                for n in ns:
                    for k in ks:
                        if min(spec.extent[m], spec.extent[n], spec.extent[k]) >= 16:
                            if spec.lhs_sorted_index is None and _lhs_position(statement, n) < _lhs_position(
                                    statement, m):  # the tile's rows along the output's: contiguous atomics
                                return DotRoles(b, a, n, m, k)
                            return DotRoles(a, b, m, n, k)
    return None


def _lhs_position(statement, var: str) -> int:
    """The first dimension of the left-hand side that `var` addresses, directly or through an index array."""
    for d, index in enumerate(statement.lhs.indices):
        if isinstance(index, Var) and index.name == var:
            return d
        if isinstance(index, Access) and var in {v.name for node in walk(index) for v in node.indices
                                                 if isinstance(v, Var)}:
            return d
    raise AssertionError(f"{var} is not on the left-hand side")

