"""`ChainPlan` -> Triton source: the kernels of a fused attention chain, each readable on its own.

Every tensor of the chain is addressed from its access in the chain's statements (`Q[b,Ai[g],m,h,d]` etc.) by
`offset`, the same address arithmetic as single-statement kernels: the writer binds each index variable and
each index access to a Triton expression and a tile axis, and a load or store lays the access out along the axes
it asks for. Tile axes: `m`, `k` (query and key offsets in a block: dot template), `h` (heads) and `j` (a tile of
stored entries: lanes template), `d` (head features) and `e` (value features). Scores are `[m, k]` or `[h, j]`
tiles; the first axis is the one whose softmax statistics a program keeps (see `ChainPlan.own_axis`). The grid
variables are decoded from `program_id(1)`, the work item from `program_id(0)` (see `_chain_plan`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import numpy as np

from jinsum._lang import Access, Var
from jinsum.kernels._chain_hopper import generate_hopper_chain, hopper_scratch
from jinsum.kernels._chain_plan import (LN2, LOG2E, SUMS, ChainPlan, chain_inputs, chain_outputs, chain_sizes,
                                        scratch_shapes)
from jinsum.kernels._elementwise_source import Capture, elementwise_lines
from jinsum.kernels._plan import DESCRIPTOR_BYTES, INT32_LIMIT
from jinsum.kernels._source import offset
from jinsum.kernels._tiles import View, box_load, dot_precision, make_descriptor

_SAME_LAYOUT = {"dO": "O", "Drow": "LSE", "dQ": "Q", "dK": "K", "dV": "V"}
_INF, _NEG_INF = 'float("inf")', 'float("-inf")'


_DESCRIBED = {"forward": {"Q": ("m", "d"), "K": ("k", "d"), "V": ("k", "e")},
              "dq": {"Q": ("m", "d"), "dO": ("m", "e"), "K": ("k", "d"), "V": ("k", "e")},
              "dkdv": {"K": ("k", "d"), "V": ("k", "e"), "Q": ("m", "d"), "dO": ("m", "e")}}


@functools.lru_cache(maxsize=512)
def described(plan: ChainPlan) -> dict[str, View]:
    """The Tensor Core operands a kernel reads through TMA descriptors (with `ChainConfig.descriptors`): those
    whose tile is whole boxes of a row-major view. A tile must cover its block's rows and the feature axis in
    whole tiles (no edge masks: a box past them would read a neighbour's elements, not zeros), and TMA wants rows
    of a multiple of 16 bytes."""
    if not (plan.config.descriptors and plan.template == "dot") or plan.kind not in _DESCRIBED:
        return {}
    chain, found = plan.chain, {}
    roles = {chain.roles.query_offset: "m", chain.roles.key_offset: "k", chain.roles.contract: "d",
             chain.roles.feature: "e"}
    blocks = {"m": (plan.block_m, chain.block[0]), "k": (plan.block_k, chain.block[1])}
    for name, (axis, feature) in _DESCRIBED[plan.kind].items():
        operand = chain.operand[_SAME_LAYOUT.get(name, name)]
        shape, itemsize = tuple(operand.shape), np.dtype(operand.dtype).itemsize
        access = chain.accesses()[_SAME_LAYOUT.get(name, name)]
        tiled = [roles.get(i.name) if isinstance(i, Var) else None for i in access.indices]
        if tiled.count(axis) != 1 or tiled[-1] != feature or sum(a is not None for a in tiled) != 2:
            continue
        dim = tiled.index(axis)
        (block, size), width = blocks[axis], int(np.prod(shape[dim + 1:], dtype=np.int64))
        rows = int(np.prod(shape, dtype=np.int64)) // width
        box = (block, plan.block_d if feature == "d" else plan.block_e)
        if size % block or shape[-1] != box[1] or (width * itemsize) % 16 or rows >= INT32_LIMIT:
            continue
        found[name] = View((axis, feature), dim, str(rows), width, tuple(map(str, box)))
    return found


def chain_kernel_name(plan: ChainPlan) -> str:
    """What a profile shows (kernels with descriptors have their own name: their launch differs)."""
    if plan.config.hopper:
        return f"jinsum_attention_{plan.kind}_hopper"
    return f"jinsum_attention_{plan.kind}" + ("_tma" if described(plan) else "")


def chain_scratch(plan: ChainPlan) -> int:
    """Global scratch bytes a program of the kernel needs (its TMA descriptors), for the launcher."""
    return hopper_scratch(plan) if plan.config.hopper else DESCRIPTOR_BYTES * len(described(plan))


@functools.lru_cache(maxsize=512)
def generate_chain(plan: ChainPlan) -> str:
    """The Python source of a module defining the kernel `chain_kernel_name(plan)` for one kernel of a chain, in
    Triton or, in the Hopper form, Gluon (cached: the lowering validates a plan by generating it, then launches
    it)."""
    return generate_hopper_chain(plan) if plan.config.hopper else _Writer(plan).module()


@dataclasses.dataclass(frozen=True)
class _Bound:
    """An index variable or index access as the kernel has it: an expression, the tile axis it runs along (None:
    a scalar), and the extent to range-check it against (None: known to be in range)."""

    expression: str
    axis: str | None = None
    check: int | None = None


class _Writer:
    def __init__(self, plan: ChainPlan):
        self.plan, self.chain = plan, plan.chain
        self.lines: list[str] = []
        self.depth = 1
        self.helpers: set[str] = set()
        self.env: dict[str, _Bound] = {}
        self.axis_masks: dict[str, str] = {}
        self.starts: dict[str, str] = {}  # each tile axis's first position
        self.described = described(plan)
        self.dot = plan.template == "dot"
        self.span = plan.config.span if self.dot else 1  # stored entries per key tile (`ChainConfig.span`)
        self.own = plan.own_axis
        self.score_axes = ("m", "k") if self.dot else ("h", "j")
        self.acc_type = "tl.float64" if self.chain.operand["Q"].dtype == np.float64 else "tl.float32"
        self.inputs, self.outputs = chain_inputs(plan), chain_outputs(plan)
        self.accesses = self.chain.accesses()
        self.shapes = {**{n: o.shape for n, o in self.chain.operand.items()}, **scratch_shapes(plan),
                       **{n: self.chain.operand[s].shape for n, s in _SAME_LAYOUT.items()}}

    # --- text --------------------------------------------------------------------------------------------------

    def emit(self, line: str) -> None:
        self.lines.append("    " * self.depth + line)

    @contextlib.contextmanager
    def indented(self, header: str):
        self.emit(header)
        self.depth += 1
        yield
        self.depth -= 1

    def module(self) -> str:
        body = self._kernel()
        header = ["# Generated by jinsum from the attention chain below; see jinsum.kernels.", "import triton",
                  "import triton.language as tl"]
        if self.helpers:
            header.append(f"from jinsum.kernels.helpers import {', '.join(sorted(self.helpers))}")
        return "\n".join(header + ["", ""] + body) + "\n"

    def _kernel(self) -> list[str]:
        plan, chain = self.plan, self.chain
        params = [f"p_{n}" for n in self.inputs] + [*chain_sizes(plan)] + [f"o_{n}" for n in self.outputs]
        if self.described:
            params.append("scratch")  # global scratch for the descriptors (jinsum._lowering._launch)
        self._prologue()
        getattr(self, f"_{plan.kind}")()
        config = plan.config
        tiles = (f"m {plan.block_m}, k {plan.block_k} ({self.own} tiles are programs)" if self.dot else
                 f"h {plan.block_h}, entries {config.entries}") + f", d {plan.block_d}, e {plan.block_e}"
        doc = [f'"""{chain!r}', "", f"{plan.kind} kernel; template {plan.template}; tiles {tiles}; grid "
               f"{', '.join(plan.grid_vars) or '-'}; pieces of {config.chunk} entries", '"""']
        name = chain_kernel_name(plan)
        return ["@triton.jit", f"def {name}({', '.join(params)}):"] + ["    " + d for d in doc] + self.lines

    # --- addressing --------------------------------------------------------------------------------------------

    def pointer(self, name: str) -> str:
        return f"p_{name}" if name in self.inputs else f"o_{name}"

    def access(self, name: str) -> Access:
        return dataclasses.replace(self.accesses[_SAME_LAYOUT.get(name, name)], tensor=name)

    @staticmethod
    def spread(expression: str, axis: str | None, axes: tuple[str, ...]) -> str:
        """`expression` (running along `axis`) broadcast into a tile whose axes are `axes`."""
        if axis is None or len(axes) == 1:
            return expression
        return f"{expression}[{', '.join(':' if a == axis else 'None' for a in axes)}]"

    def address(self, name: str, axes: tuple[str, ...], covered: bool = False) -> tuple[str, str | None]:
        """`(pointer, mask)` of tensor `name` (by its access in the chain) as a tile with axes `axes`. The mask
        holds the tile's edges and the range checks of index values; with `covered`, only those along the
        feature axes `d`, `e` (the caller's attention mask covers the rest)."""
        access, shape = self.access(name), self.shapes[name]
        positions, masks = [], [self.spread(self.axis_masks[a], a, axes) for a in axes
                                if (not covered or a in ("d", "e")) and self.axis_masks[a]]
        for index in access.indices:
            bound = self.env[index.name if isinstance(index, Var) else str(index)]
            if bound.axis is not None and bound.axis not in axes:
                raise AssertionError(f"{index} runs along {bound.axis}, not in the tile {axes} of {name}")
            positions.append(self.spread(bound.expression, bound.axis, axes))
            if bound.check is not None and not covered:
                self.helpers.add("in_range")
                masks.append(f"in_range({positions[-1]}, {bound.check})")
        return f"{self.pointer(name)} + {offset(shape, positions)}", " & ".join(dict.fromkeys(masks)) or None

    def load(self, name: str, axes: tuple[str, ...], *, mask: str | None = None, native: bool = False,
             into: str | None = None) -> str:
        """Loads `name` as a tile with `axes` into `into` (default `x_<name>`); values are converted to the
        accumulation type unless `native` (Tensor Core operands keep 16-bit types). A `mask` (an attention mask,
        spread over the tile) replaces the edges and range checks of every axis but the features."""
        if native and name in self.described:
            load = self._box(name, axes)
        else:
            pointer, address_mask = self.address(name, axes, covered=mask is not None)
            masks = " & ".join(m for m in (address_mask, mask) if m)
            load = f"tl.load({pointer}, mask={masks}, other=0.0)" if masks else f"tl.load({pointer})"
        if not native and name not in ("Av", "KM", "flags"):
            load += f".to({self.acc_type})"
        if name == "LSE":
            load += f" * {LOG2E!r}"  # in base 2, as the scores
        variable = into or f"x_{name}"
        self.emit(f"{variable} = {load}")
        return variable

    def describe(self) -> None:
        """Makes the kernel's TMA descriptors (once per program, before any branch)."""
        for name, view in self.described.items():
            self.emit(make_descriptor(name, self.pointer(name), view))

    def _box(self, name: str, axes: tuple[str, ...]) -> str:
        """The load of `name`'s tile from its descriptor (`_tiles.box_load`)."""
        view, access = self.described[name], self.access(name)
        positions, checks = [], []
        for index in access.indices:
            bound = self.env[index.name if isinstance(index, Var) else str(index)]
            positions.append(self.starts[bound.axis] if bound.axis else bound.expression)
            if bound.check is not None:
                self.helpers.add("in_range")
                checks.append(f"in_range({bound.expression}, {bound.check})")
        return box_load(name, view, self.shapes[name], positions, checks, axes != view.axes)

    def store(self, name: str, axes: tuple[str, ...], value: str) -> None:
        """Stores a tile in the output's dtype."""
        pointer, mask = self.address(name, axes)
        self.emit(f"tl.store({pointer}, ({value}).to({self.pointer(name)}.dtype.element_ty), mask={mask})")

    # --- structure shared by the kernels -----------------------------------------------------------------------

    def _prologue(self) -> None:
        chain, plan = self.chain, self.plan
        extent = chain.output.extent
        own_tiles = plan.tiles(self.own)
        if own_tiles > 1:
            self.emit(f"item = tl.program_id(0) // {own_tiles}")
            self.emit(f"tile = tl.program_id(0) % {own_tiles}  # which {self.own} tile of the block")
        else:
            self.emit("item = tl.program_id(0)")
        self.emit("glin = tl.program_id(1)  # the grid variables' flat index")
        rest = "glin"
        for v in reversed(plan.grid_vars):
            self.emit(f"v_{v} = {rest} % {extent[v]}")
            rest = f"({rest} // {extent[v]})"
            self.env[v] = _Bound(f"v_{v}")
        self._axis("d", "0", plan.block_d, chain.operand["Q"].shape[-1])
        self._axis("e", "0", plan.block_e, chain.operand["V"].shape[-1])
        r = chain.roles
        if self.dot:
            start = f"tile * {self._block(self.own)}" if own_tiles > 1 else "0"
            self._axis(self.own, start, self._block(self.own), self._size(self.own))
            inner = self._inner_axis
            if plan.tiles(inner) == 1:  # one tile per block: set up once
                self._axis(inner, "0", self._block(inner), self._size(inner))
        else:
            self._axis("h", "0", plan.block_h, extent[r.head])
        roles = {r.query_offset: "m", r.key_offset: "k", r.contract: "d", r.feature: "e"}
        if not self.dot:
            roles[r.head] = "h"
        for var, axis in roles.items():
            if var is not None:
                self.env[var] = _Bound(f"v_{axis}", axis)
        if self.span > 1:  # a key's offset in its block (the tile holds `span` blocks)
            self.emit(f"v_o = v_k % {chain.block[1]}")
            self.env[r.key_offset] = _Bound("v_o", "k")
        if plan.kind not in SUMS:
            if chain.dropout:
                self.emit("seed = tl.load(p_seed)")
            self.emit("segment = tl.load(p_items + item * 5)  # a row (a key for dkdv), or -1: no work")
            self.emit("begin = tl.load(p_items + item * 5 + 1)  # its entries [begin, end)")
            self.emit("end = tl.load(p_items + item * 5 + 2)")
            self.emit("part = tl.load(p_items + item * 5 + 3)  # >= 0: one of several pieces of a long row")
            self.emit("piece = tl.load(p_items + item * 5 + 4)")

    @property
    def _inner_axis(self) -> str:
        """The block axis a dot program walks in tiles for each of its entries (the other side of `own`)."""
        return "m" if self.own == "k" else "k"

    def _block(self, axis: str) -> int:
        return {"m": self.plan.block_m, "k": self.plan.block_k, "h": self.plan.block_h}[axis]

    def _size(self, axis: str) -> int:
        if axis == "h":
            return self.chain.output.extent[self.chain.roles.head]
        if axis == "k" and self.span > 1:  # a tile of whole blocks
            return self.plan.block_k
        return self.chain.block[0 if axis == "m" else 1]

    def _axis(self, axis: str, start: str, block: int, size: int | str) -> None:
        """`v_<axis>`: a tile of `block` positions from `start`, masked to `size`. In the dot template, tiles that
        cut the size into whole pieces need no mask: loads and stores along them go unpredicated. The lanes
        template keeps its masks: its gathers ran slower unpredicated (DESIGN.md, "A masking change for one
        template can slow another")."""
        self.starts[axis] = start
        self.emit(f"v_{axis} = {'' if start == '0' else start + ' + '}tl.arange(0, {block})")
        self.emit(f"mk_{axis} = v_{axis} < {size}")
        whole = self.dot and isinstance(size, int) and size % block == 0
        self.axis_masks[axis] = None if whole else f"mk_{axis}"

    def _entries_loop(self):
        """The loop over the item's entries: one per iteration (dot; times the tiles of the other block axis, as
        one flat loop so that it pipelines) or a tile of `entries` (lanes)."""
        plan = self.plan
        stages = plan.config.num_stages
        if not self.dot:
            return self.indented(f"for j in tl.range(begin, end, {plan.config.entries}, num_stages={stages}):")
        tiles = plan.tiles(self._inner_axis)
        if self.span > 1:
            return self.indented(f"for j in tl.range(begin, end, {self.span}, num_stages={stages}):")
        if tiles == 1:
            return self.indented(f"for j in tl.range(begin, end, num_stages={stages}):")
        return self.indented(f"for step in tl.range(begin * {tiles}, end * {tiles}, num_stages={stages}):")

    def _bind_entries(self, own: _Bound, *, by_key: bool = False) -> tuple[str, tuple[str, str], str]:
        """Inside the entries loop: the entry (or tile of entries, axis `j`) of this iteration, its group `g` and
        slot `p`, the other side's index (a row's keys; a key's rows when the entries come `by_key`, in the
        transposed order), the query and key positions and the attention mask. `own` is the program's row (key).
        Returns (entry, positions, allowed)."""
        permutation = "p_perm" if by_key else None
        r, slots = self.chain.roles, self.chain.scores.extent[self.chain.roles.slot]
        if self.span > 1:
            return self._bind_span(own, r, slots)
        if self.dot:
            tiles = self.plan.tiles(self._inner_axis)
            if tiles > 1:
                inner = self._inner_axis
                self.emit(f"j = step // {tiles}")
                self._axis(inner, f"(step % {tiles}) * {self._block(inner)}", self._block(inner), self._size(inner))
            self.emit(f"entry = tl.load({permutation} + j)" if permutation else "entry = j")
            axis = None
        else:
            self._axis("j", "j", self.plan.config.entries, "end")
            self.emit(f"entry = tl.load({permutation} + v_j, mask=mk_j, other=0)" if permutation else "entry = v_j")
            axis = "j"
        self.emit(f"v_g = entry // {slots}" if slots > 1 else "v_g = entry")
        self.emit(f"v_p = entry % {slots}" if slots > 1 else "v_p = 0")
        self.env[r.group], self.env[r.slot] = _Bound("v_g", axis), _Bound("v_p", axis)
        if by_key:
            row, col = self._gather("Ai[g]", "row", "p_key_rows", "rows"), own
        else:
            row, col = own, self._gather("Ak[g,p]", "col", "p_Ak", "keys")
        positions = self._positions(row, col)
        if self.dot:  # masked after the scores, and only where a block is partial (`_mask_scores`)
            batch = self.shapes["flags"][:-1]  # (flags per batch element: see `_chain_route.schedule`)
            element = f"{self.env[self.chain.roles.batch_index].expression} * entries + " if batch else ""
            self.emit(f"flag = tl.load(p_flags + {element}entry)")
            self._mask_args = (row, col, positions, "flag")
            return "entry", positions, None
        return "entry", positions, self._allowed(row, col, positions)

    def _bind_span(self, own: _Bound, r, slots: int) -> tuple[str, tuple[str, str], str]:
        """`_bind_entries` for a key tile of `span` stored entries `[j, j + span)` (forward): each key's entry,
        block and flag along `k`. An entry past the item's end, or whose block is out of range, has flag 0: its
        keys are neither read nor attended to."""
        self.emit(f"entry = j + v_k // {self.chain.block[1]}")
        self.emit("inside = entry < end")
        self.emit(f"v_g = entry // {slots}" if slots > 1 else "v_g = entry")
        self.emit(f"v_p = entry % {slots}" if slots > 1 else "v_p = 0")
        self.env[r.group], self.env[r.slot] = _Bound("v_g", "k"), _Bound("v_p", "k")
        self.emit("col = tl.load(p_Ak + entry, mask=inside, other=0)")
        self.env["Ak[g,p]"] = col = _Bound("col", "k")
        self.emit("flag = tl.load(p_flags + entry, mask=inside, other=0)")
        self.helpers.add("in_range")
        self.emit("flag = tl.where(in_range(col, keys), flag, 0)")
        positions = self._positions(own, col)
        self._mask_args = (own, col, positions, "flag")
        return "entry", positions, None

    def _gather(self, access: str, name: str, source: str, extent: str) -> _Bound:
        """`name` = the index `access` (`Ak[g,p]`: a key, `Ai[g]`: a row) of the current entry (tile of
        entries), read from `source` at the loop position (`p_Ak` in entry order, `p_key_rows` in key order)."""
        if self.dot:
            self.emit(f"{name} = tl.load({source} + j)")
            bound = _Bound(name, None, extent)
        else:
            self.emit(f"{name} = tl.load({source} + v_j, mask=mk_j, other=-1)")
            bound = _Bound(name, "j", extent)
        self.env[access] = bound
        return bound

    def _positions(self, row: _Bound, col: _Bound) -> tuple[str, str]:
        """The query and key positions (`q_idx`, `kv_idx`), as expressions that broadcast over the scores."""
        if self.dot:
            bm, bk = self.chain.block
            self.emit(f"qpos = {row.expression} * {bm} + v_m")
            self.emit(f"kpos = {col.expression} * {bk} + {'v_o' if self.span > 1 else 'v_k'}")
            return "qpos[:, None]", "kpos[None, :]"
        return (self.spread(row.expression, row.axis, self.score_axes),
                self.spread(col.expression, col.axis, self.score_axes))

    def _scores(self, q: str, k: str, positions: tuple[str, str], *, slope: bool, q_axes: tuple[str, ...],
                k_axes: tuple[str, ...]) -> str:
        """`s = score_mod(scale * q . k) * log2(e)` as a `score_axes` tile (and the derivative `ds_ds` of
        `score_mod`); `q_axes` and `k_axes` are the tiles' axes."""
        if self.dot:
            self.emit(f"s = tl.dot({q}, tl.trans({k}){self._precision()}) * {self._score_scale!r}")
        else:  # lanes: multiply along the features, a tile [h, j, d] (or [h, 1, d] for a row with itself)
            qs = self._to_scores(q, q_axes, "d")
            ks = self._to_scores(k, k_axes, "d")
            self.emit(f"s = tl.sum({qs} * {ks}, 2) * {self._score_scale!r}")
        self._transform(*positions, slope=slope)
        return "s"

    def _to_scores(self, tile: str, axes: tuple[str, ...], feature: str) -> str:
        """A lanes tile with `axes` among (h, j, feature) as a 3-D [h, j, feature] tile."""
        full = ("h", "j", feature)
        missing = [a for a in full if a not in axes]
        return tile if not missing else f"{tile}[{', '.join('None' if a in missing else ':' for a in full)}]"

    @property
    def _score_scale(self) -> float:
        """What multiplies `q . k`: the scale, and log2(e) too when no `score_mod` stands between them."""
        return self.chain.scale * (LOG2E if self.chain.score_mod is None else 1.0)

    def _transform(self, q_idx: str, kv_idx: str, *, slope: bool) -> None:
        """`s = score_mod(s, b, h, q_idx, kv_idx) * log2(e)`, and `ds_ds` the derivative of `score_mod` when
        `slope` (with the partials of its reads of floating captures, kept for `_capture_gradients`)."""
        mod = self.chain.score_mod
        if mod is None:
            if slope:
                self.emit("ds_ds = 1.0")
            return
        captures = self._captures(self.chain.score_captures)
        lines, (value, derivative, *partials), reads = elementwise_lines(
            mod.kernel.jaxpr, ["s", *self._coordinates(q_idx, kv_idx)], "sm", self.acc_type, captures)
        for line in lines:
            self.emit(line)
        self.emit(f"s = {value} * {LOG2E!r}")
        if slope:
            self.emit(f"ds_ds = {derivative}")
        floating = mod.differentiable
        self.score_reads = [(read, partial) for read, partial in
                            zip([r for r in reads if r.capture in floating], partials)]

    def _captures(self, names: tuple[str, ...]) -> tuple[Capture, ...]:
        return tuple(Capture(self.pointer(n), self.shapes[n]) for n in names)

    def _coordinates(self, q_idx: str, kv_idx: str) -> list[str]:
        """`b, h, q_idx, kv_idx` as `score_mod` and `mask_mod` see them, broadcasting over the scores."""
        r = self.chain.roles
        b = f"v_{r.batch_index}" if r.batch_index else "0"
        head = f"v_{r.head}" if self.dot else self.spread("v_h", "h", self.score_axes)
        if r.head_group:
            head = f"({head} * {self.chain.group_size} + v_{r.head_group})"
        return [b, head, q_idx, kv_idx]

    def _capture_gradients(self, w: str, dp: str, drow: str, allowed: str | None, positions: tuple[str, str]) -> None:
        """Adds `dL/d score_mod = P * (dP - D)` times each read's partial into the captured array's gradient at
        the read's index: summed first over the score axes the index does not vary along (a per-head slope is one
        atomic add per tile, a per-query value one per row)."""
        if not self.plan.computes_dq or not getattr(self, "score_reads", None):
            return
        value = f"{w} * ({dp} - {drow})"
        self.emit(f"dmod = {f'tl.where({allowed}, {value}, 0.0)' if allowed else value}")
        varies = self._varying_axes(positions)
        for read, partial in self.score_reads:
            axes = set().union(*(varies[i] for i in read.depends if i in varies))
            grad = f"dmod * {partial}"
            if not axes:
                grad = f"tl.sum({grad})"
            else:
                for position, axis in enumerate(self.score_axes):
                    if axis not in axes:
                        grad = f"tl.sum({grad}, {position}, keep_dims=True)"
            name = f"dSC{read.capture}"
            self.emit(f"tl.atomic_add({self.pointer(name)} + {read.index}, {grad})")

    def _varying_axes(self, positions: tuple[str, str]) -> dict[int, set[str]]:
        """For the element-wise function's inputs (score, b, h, q_idx, kv_idx): the score axes each varies
        along."""
        if self.dot:
            return {0: {"m", "k"}, 3: {"m"}, 4: {"k"}}
        varies = {0: {"h", "j"}, 2: {"h"}}
        for i, position in zip((3, 4), positions):
            if "[" in position:  # a tile of entries (spread along j); a scalar row or key otherwise
                varies[i] = {"j"}
        return varies

    def _precision(self) -> str:
        return dot_precision(self.chain.operand["Q"].dtype == np.float32, self.chain.allow_tf32)

    def _allowed(self, row: _Bound, col: _Bound, positions: tuple[str, str]) -> str:
        """The attention mask of the current scores (lanes template): tile edges, the pattern's values, the
        causal rule, the key mask and self-loop exclusion. Returns its variable."""
        chain, axes = self.chain, self.score_axes
        self.emit(f"allowed = {' & '.join(self._edges(row, col) or ['True'])}")
        self._read_mask(axes)
        self._mask_rules(positions)
        if chain.key_mask is not None:  # (one key for all the tile: a scalar)
            pointer, mask = self.address("KM", () if col.axis is None else axes)
            keys = f"tl.load({pointer}, mask={mask}, other=0)" if mask else f"tl.load({pointer})"
            self.emit(f"allowed = allowed & ({keys} != 0)")
        if chain.self_loops:
            self.emit(f"allowed = allowed & ({positions[0]} != {positions[1]})")
        return "allowed"

    def _edges(self, row: _Bound, col: _Bound) -> list[str]:
        """The masks of the scores' tile edges and of the range checks of the entry's row and key."""
        axes = self.score_axes
        parts = [self.spread(self.axis_masks[a], a, axes) for a in axes if self.axis_masks[a]]
        for bound in (row, col):
            if bound.check is not None:
                self.helpers.add("in_range")
                parts.append(f"in_range({self.spread(bound.expression, bound.axis, axes)}, {bound.check})")
        return parts

    def _mask_scores(self) -> None:
        """Dot template, after the scores: the launcher classified each block (2: every element attends; 1:
        partial; 0: none; for each batch element, with a key padding mask), so a full block in range is not
        masked at all (FlexAttention's full blocks); a partial one sets its masked scores to -inf: its stored
        elements or `mask_mod` (in registers), the key padding mask, the causal rule and the tile's edges."""
        row, col, positions, flag = self._mask_args
        edges = self._edges(row, col)
        checks = [e for e in edges if e.startswith("in_range")]
        if self.span > 1:  # (a flag per key: `_bind_span`)
            branch, attends = f"tl.min({flag}, 0) != 2", f"({flag} != 0)[None, :]"
        else:
            branch, attends = " | ".join([f"({flag} != 2)"] + [f"~{c}" for c in checks]), f"({flag} != 0)"
        with self.indented(f"if {branch}:  # a partial block (or one out of range): its elements' mask"):
            self.emit(f"allowed = {' & '.join(edges + [attends])}")
            if self._element_mask:
                self._read_mask(self.score_axes)
            if self.chain.key_mask is not None:  # (a full block's keys are valid: see `_chain_route.schedule`)
                pointer, mask = self.address("KM", self.score_axes)
                keys = f"tl.load({pointer}, mask={mask}, other=0)" if mask else f"tl.load({pointer})"
                self.emit(f"allowed = allowed & ({keys} != 0)")
            self._mask_rules(positions)
            self.emit(f"s = tl.where(allowed, s, {_NEG_INF})")
        outside = [e for e in edges if e not in checks]  # tiles that overhang their block
        if outside:
            self.emit(f"s = tl.where({' & '.join(outside)}, s, {_NEG_INF})")

    def _weights(self, allowed: str | None, lse: str) -> None:
        """`w = exp2(s - LSE)`, the recomputed weights (masked scores are -inf in the dot template)."""
        if self.dot:
            self._mask_scores()
            self.emit(f"w = tl.exp2(s - {lse})")
        else:
            self.emit(f"w = tl.where({allowed}, tl.exp2(s - {lse}), 0.0)")

    @property
    def _valid(self) -> str | None:
        """Dot template, after the weights `w`: where a gradient may be nonzero. Masked scores are -inf and their
        weights 0; only a `score_mod`'s derivative, which may be NaN at a masked score, needs the select."""
        return "w > 0" if self.chain.score_mod is not None else None

    @property
    def _element_mask(self) -> bool:
        """The pattern stores a mask per element (`Av[g,m,k,p]`), not one flag per block (`Av[g,p]`)."""
        return not self.dot or len(self.chain.mask.indices) > 2

    def _read_mask(self, axes: tuple[str, ...]) -> None:
        pointer, _ = self.address("Av", axes)
        self.emit(f"allowed = allowed & (tl.load({pointer}, mask=allowed, other=0) != 0)")

    def _mask_rules(self, positions: tuple[str, str]) -> None:
        """`mask_mod` (in registers: its captured arrays read once per row and per column of the tile) and the
        causal rule."""
        chain = self.chain
        if chain.mask_mod is not None:
            lines, (value,), _ = elementwise_lines(chain.mask_mod.kernel.jaxpr, self._coordinates(*positions), "mm",
                                                   self.acc_type, self._captures(chain.mask_captures))
            for line in lines:
                self.emit(line)
            self.emit(f"allowed = allowed & {value}")
        if chain.causal:
            self.emit(f"allowed = allowed & ({positions[0]} >= {positions[1]})")

    def _keep(self, entry: str) -> str:
        """`z`: the dropout factor of each weight (0 or 1 / (1 - rate)), drawn from (seed, counter)."""
        chain = self.chain
        entries = "(entries + rows)" if chain.self_loops else "entries"  # (a self loop's counter follows them)
        if self.dot:
            bm, bk = chain.block
            glin = "glin"
            if chain.roles.head_group and self.plan.kind == "dkdv":  # the forward's grid index, which has r
                glin = f"(glin * {chain.group_size} + v_{chain.roles.head_group})"
            counter = f"(({glin}.to(tl.int64) * {entries} + {entry}) * {bm * bk} + v_m[:, None] * {bk} + v_k[None, :])"
        else:  # the grid index runs over (batch..., head): heads are a tile axis here
            heads = chain.output.extent[chain.roles.head]
            counter = f"((glin.to(tl.int64) * {heads} + v_h[:, None]) * {entries} + {entry})"
        self.emit(f"bits = tl.randint(seed, {counter}.to(tl.uint32))")
        self.emit(f"z = tl.where((bits >> 8).to(tl.int32) >= {chain.dropout_threshold}, "
                  f"{1 / (1 - chain.dropout)!r}, 0.0)")
        return "z"

    def _weighted(self, w: str, tile: str, axes: tuple[str, ...]) -> str:
        """`sum_inner w[own, inner] * tile[inner, feature]`: `[own, feature]` (`tile` for lanes is [h, j, f])."""
        if self.dot:
            return f"tl.dot({w}.to({tile}.dtype), {tile}{self._precision()})"
        return f"tl.sum({w}[:, :, None] * {self._to_scores(tile, axes, axes[-1])}, 1)"

    def _online_softmax(self, allowed: str | None, value: str, value_axes: tuple[str, ...], entry: str) -> None:
        """One step of the online softmax over the scores `s` (masked by `allowed`), accumulating `value`."""
        if allowed is not None:
            self.emit(f"s = tl.where({allowed}, s, {_NEG_INF})")
        self.emit("m_new = tl.maximum(m_i, tl.max(s, 1))")
        self.emit(f"m_use = tl.where(m_new == {_NEG_INF}, 0.0, m_new)  # masked so far: no shift")
        self.emit("alpha = tl.exp2(m_i - m_use)")
        self.emit("w = tl.exp2(s - m_use[:, None])")
        self.emit("l_i = l_i * alpha + tl.sum(w, 1)")
        if self.chain.dropout:
            self.emit(f"w = w * {self._keep(entry)}")
        self.emit(f"acc = acc * alpha[:, None] + {self._weighted('w', value, value_axes)}")
        self.emit("m_i = m_new")

    def _row_statistics(self) -> None:
        block = self._block(self.own)
        self.emit(f"m_i = tl.full([{block}], {_NEG_INF}, {self.acc_type})  # running maximum (base 2)")
        self.emit(f"l_i = tl.zeros([{block}], {self.acc_type})  # running sum of exp2(s - m_i)")
        self.emit(f"acc = tl.zeros([{block}, {self.plan.block_e}], {self.acc_type})")

    def _finish(self) -> None:
        """Stores the normalised output and the log-sum-exp (natural) of the program's row."""
        own = self.own
        self.emit("safe = tl.where(l_i > 0, l_i, 1.0)")
        self.emit(f"lse = tl.where(l_i > 0, (tl.where(m_i == {_NEG_INF}, 0.0, m_i) + tl.log2(safe)) * {LN2!r}, "
                  f"{_INF})")
        self.store("O", (own, "e"), "acc / safe[:, None]")
        self.store("LSE", (own,), "lse")

    def _part_pointer(self, name: str, slot: str = "part") -> tuple[str, str]:
        """`(pointer, mask)` of the scratch tile of a piece's partial result for `name` (`O`: the forward's
        accumulator; `m`, `l`: its statistics), along the kernel's own axis."""
        own = self.own
        base = f"({slot} * {self.plan.grid_size} + glin) * {self._size(own)} + v_{own}"
        if name in ("m", "l"):
            return f"{self.pointer('part_' + name)} + {base}", f"mk_{own}"
        width = "e" if name in ("O", "dV") else "d"
        size = self.chain.operand["V" if width == "e" else "Q"].shape[-1]
        part = "part_acc" if name == "O" else f"part_{name.lower()}"
        return (f"{self.pointer(part)} + ({base})[:, None] * {size} + v_{width}[None, :]",
                f"mk_{own}[:, None] & mk_{width}[None, :]")

    def _keep_piece(self, name: str, value: str) -> None:
        pointer, mask = self._part_pointer(name)
        self.emit(f"tl.store({pointer}, {value}, mask={mask})")

    def _store_or_keep(self, name: str, axes: tuple[str, ...], value: str) -> None:
        """Stores a gradient tile of a whole segment; a piece of a long segment keeps it in scratch instead."""
        with self.indented("if part < 0:"):
            self.store(name, axes, value)
        with self.indented("else:  # a piece of a long segment: its sum kernel adds the pieces up"):
            self._keep_piece(name, value)

    def _ds(self, w: str, dp: str, drow: str, allowed: str | None, positions: tuple[str, str]) -> None:
        """`ds = P * (dP - D) * score_mod'(s) * scale` (`dP` already times dropout's factor), and the gradients
        of the arrays `score_mod` captures."""
        ds = f"{w} * ({dp} - {drow}) * ds_ds"
        self.emit(f"ds = {f'tl.where({allowed}, {ds}, 0.0)' if allowed else ds} * {self.chain.scale!r}")
        self._capture_gradients(w, dp, drow, allowed, positions)

    # --- the kernels -------------------------------------------------------------------------------------------
    # Tile axes of each tensor, by template: the program's side (own) and the walked side (inner).

    def _side(self, *names: str) -> dict[str, tuple[str, ...]]:
        dot = {"Q": ("m", "d"), "K": ("k", "d"), "V": ("k", "e"), "Vt": ("e", "k"), "O": ("m", "e"),
               "dO": ("m", "e"), "LSE": ("m",), "Drow": ("m",), "dQ": ("m", "d"), "dK": ("k", "d"),
               "dV": ("k", "e")}
        rows = self.plan.kind != "dkdv"  # the program owns a row (its queries) rather than a key
        lanes = {"Q": ("h", "d") if rows else ("h", "j", "d"), "K": ("h", "j", "d") if rows else ("h", "d"),
                 "V": ("h", "j", "e") if rows else ("h", "e"), "O": ("h", "e"),
                 "dO": ("h", "e") if rows else ("h", "j", "e"), "LSE": ("h",) if rows else ("h", "j"),
                 "Drow": ("h",) if rows else ("h", "j"), "dQ": ("h", "d"), "dK": ("h", "d"), "dV": ("h", "e")}
        table = dot if self.dot else lanes
        return {n: table[n] for n in names}

    def _forward(self) -> None:
        chain, axes = self.chain, self._side("Q", "K", "V")
        self.describe()
        row = _Bound("segment")
        self.env["Ai[g]"] = row
        with self.indented("if segment >= 0:"):
            q = self.load("Q", axes["Q"], native=self.dot)
            self._row_statistics()
            if chain.self_loops:
                with self.indented("if piece == 0:  # the row attends to itself first"):
                    self.env["Ak[g,p]"] = row
                    k, v = self.load("K", ("h", "d")), self.load("V", ("h", "e"))
                    self._scores(q, k, ("segment", "segment"), slope=False, q_axes=("h", "d"), k_axes=("h", "d"))
                    self._online_softmax(None, v, ("h", "e"), "entries + segment")
            with self._entries_loop():
                entry, positions, allowed = self._bind_entries(row)
                mask = "(flag != 0)[:, None]" if self.span > 1 else None if self.dot else "allowed[:, :, None]"
                k = self.load("K", axes["K"], native=self.dot, mask=mask)
                v = self.load("V", axes["V"], native=self.dot, mask=mask)
                self._scores(q, k, positions, slope=False, q_axes=axes["Q"], k_axes=axes["K"])
                if self.dot:
                    self._mask_scores()
                self._online_softmax(allowed, v, axes["V"], entry if self.dot else "entry[None, :]")
            with self.indented("if part < 0:  # the whole row: finish it"):
                self._finish()
            with self.indented("else:  # a piece of a long row: keep (max, sum, accumulator) for the combine"):
                for name, value in (("m", "m_i"), ("l", "l_i"), ("O", "acc")):
                    self._keep_piece(name, value)

    def _combine(self) -> None:
        """Merges the pieces of each long row: their (max, sum, accumulator) as one more online softmax."""
        self.env["Ai[g]"] = _Bound("segment")
        self._segment_of_sum()
        with self.indented("if segment >= 0:"):
            self._row_statistics()
            with self.indented("for part in tl.range(first, last):"):
                (m, m_mask), (total, _), (acc, acc_mask) = (self._part_pointer(n) for n in ("m", "l", "O"))
                self.emit(f"m_c = tl.load({m}, mask={m_mask}, other={_NEG_INF})")
                self.emit(f"l_c = tl.load({total}, mask={m_mask}, other=0.0)")
                self.emit(f"acc_c = tl.load({acc}, mask={acc_mask}, other=0.0)")
                self.emit("m_new = tl.maximum(m_i, m_c)")
                self.emit(f"m_use = tl.where(m_new == {_NEG_INF}, 0.0, m_new)")
                self.emit("alpha = tl.exp2(m_i - m_use)")
                self.emit("beta = tl.exp2(m_c - m_use)")
                self.emit("l_i = l_i * alpha + l_c * beta")
                self.emit("acc = acc * alpha[:, None] + acc_c * beta[:, None]")
                self.emit("m_i = m_new")
            self._finish()

    def _segment_of_sum(self) -> None:
        self.emit("segment = tl.load(p_combine + item * 3)  # a segment cut into pieces, or -1")
        self.emit("first = tl.load(p_combine + item * 3 + 1)  # its pieces' scratch slots [first, last)")
        self.emit("last = tl.load(p_combine + item * 3 + 2)")

    def _dq(self) -> None:
        chain = self.chain
        axes = self._side("Q", "K", "V", "dO", "LSE", "Drow", "dQ")
        self.describe()
        row = _Bound("segment")
        self.env["Ai[g]"] = row
        with self.indented("if segment >= 0:"):
            q = self.load("Q", axes["Q"], native=self.dot)
            do = self.load("dO", axes["dO"], native=self.dot)
            lse, drow = self.load("LSE", axes["LSE"]), self.load("Drow", axes["Drow"])
            block = self._block(self.own)
            self.emit(f"dq = tl.zeros([{block}, {self.plan.block_d}], {self.acc_type})")
            if chain.self_loops:
                with self.indented("if piece == 0:  # the row's weight on itself"):
                    self.env["Ak[g,p]"] = row
                    k, v = self.load("K", ("h", "d")), self.load("V", ("h", "e"))
                    self._scores(q, k, ("segment", "segment"), slope=True, q_axes=("h", "d"), k_axes=("h", "d"))
                    self.emit(f"w = tl.exp2(s - {lse}[:, None])")
                    self.emit(f"dp = tl.sum({do} * {v}, 1)[:, None]")
                    self._dropout_on("dp", "entries + segment")
                    self._ds("w", "dp", f"{drow}[:, None]", None, ("segment", "segment"))
                    self.emit(f"dq += tl.sum(ds[:, :, None] * {k}[:, None, :], 1)")
            with self._entries_loop():
                entry, positions, allowed = self._bind_entries(row)
                if self.dot:
                    k = self.load("K", axes["K"], native=True)
                    vt = self.load("V", self._side("Vt")["Vt"], native=True)
                    dp = f"tl.dot({do}, {vt}{self._precision()})"
                else:
                    k = self.load("K", axes["K"], mask="allowed[:, :, None]")
                    v = self.load("V", axes["V"], mask="allowed[:, :, None]")
                    dp = f"tl.sum({do}[:, None, :] * {v}, 2)"
                self._scores(q, k, positions, slope=True, q_axes=axes["Q"], k_axes=axes["K"])
                self._weights(allowed, f"{lse}[:, None]")
                allowed = self._valid if self.dot else allowed
                self.emit(f"dp = {dp}")
                self._dropout_on("dp", entry if self.dot else "entry[None, :]")
                self._ds("w", "dp", f"{drow}[:, None]", allowed, positions)
                update = (f"tl.dot(ds.to({k}.dtype), {k}{self._precision()})" if self.dot else
                          f"tl.sum(ds[:, :, None] * {k}, 1)")
                self.emit(f"dq += {update}")
            self._store_or_keep("dQ", axes["dQ"], "dq")

    def _dropout_on(self, dp: str, entry: str) -> None:
        """Dropout's factor on `dP` (the weights it scaled forward): `dP = z * dO . V`."""
        if self.chain.dropout:
            self.emit(f"{dp} = {dp} * {self._keep(entry)}")

    def _dkdv(self) -> None:
        chain = self.chain
        axes = self._side("Q", "K", "V", "dO", "LSE", "Drow", "dK", "dV")
        self.describe()
        col = _Bound("segment")
        self.env["Ak[g,p]"] = col
        with self.indented("if segment >= 0:"):
            k = self.load("K", axes["K"], native=self.dot)
            v = self.load("V", axes["V"], native=self.dot)
            block = self._block(self.own)
            self.emit(f"dk = tl.zeros([{block}, {self.plan.block_d}], {self.acc_type})")
            self.emit(f"dv = tl.zeros([{block}, {self.plan.block_e}], {self.acc_type})")
            if chain.self_loops:
                with self.indented("if piece == 0:  # the key's own row attends to it"):
                    self.env["Ai[g]"] = col
                    q, do = self.load("Q", ("h", "d")), self.load("dO", ("h", "e"))
                    lse, drow = self.load("LSE", ("h",)), self.load("Drow", ("h",))
                    self._scores(q, k, ("segment", "segment"), slope=True, q_axes=("h", "d"), k_axes=("h", "d"))
                    self.emit(f"w = tl.exp2(s - {lse}[:, None])")
                    self.emit(f"dp = tl.sum({do} * {v}, 1)[:, None]")
                    self._weights_and_scores_gradient("entries + segment", f"{drow}[:, None]", None,
                                                      ("segment", "segment"))
                    self.emit(f"dv += tl.sum(wz[:, :, None] * {do}[:, None, :], 1)")
                    self.emit(f"dk += tl.sum(ds[:, :, None] * {q}[:, None, :], 1)")
                    self._add_to_dq(f"ds * {k}", ("h", "d"), None)
            group = chain.roles.head_group
            with self.indented(f"for v_{group} in range(0, {chain.group_size}):  # the query heads of the group"
                               ) if group else contextlib.nullcontext(), self._entries_loop():
                if group:
                    self.env[group] = _Bound(f"v_{group}")
                entry, positions, allowed = self._bind_entries(col, by_key=True)
                if self.dot:
                    q, do = self.load("Q", axes["Q"], native=True), self.load("dO", axes["dO"], native=True)
                    lse, drow = self.load("LSE", axes["LSE"]), self.load("Drow", axes["Drow"])
                    lse, drow = f"{lse}[:, None]", f"{drow}[:, None]"
                    dp = f"tl.dot({do}, tl.trans({v}){self._precision()})"
                else:
                    q = self.load("Q", axes["Q"], mask="allowed[:, :, None]")
                    do = self.load("dO", axes["dO"], mask="allowed[:, :, None]")
                    lse = self.load("LSE", axes["LSE"], mask="allowed")
                    drow = self.load("Drow", axes["Drow"], mask="allowed")
                    dp = f"tl.sum({do} * {v}[:, None, :], 2)"
                self._scores(q, k, positions, slope=True, q_axes=axes["Q"], k_axes=axes["K"])
                self._weights(allowed, lse)
                allowed = self._valid if self.dot else allowed
                self.emit(f"dp = {dp}")
                self._weights_and_scores_gradient(entry if self.dot else "entry[None, :]", drow, allowed, positions)
                if self.dot:
                    self.emit(f"dv += tl.dot(tl.trans(wz.to({do}.dtype)), {do}{self._precision()})")
                    self.emit(f"dk += tl.dot(tl.trans(ds.to({q}.dtype)), {q}{self._precision()})")
                else:
                    self.emit(f"dv += tl.sum(wz[:, :, None] * {do}, 1)")
                    self.emit(f"dk += tl.sum(ds[:, :, None] * {q}, 1)")
                    self._add_to_dq(f"ds[:, :, None] * {k}[:, None, :]", ("h", "j", "d"), "allowed[:, :, None]")
            self._store_or_keep("dK", axes["dK"], "dk")
            self._store_or_keep("dV", axes["dV"], "dv")

    def _add_to_dq(self, value: str, axes: tuple[str, ...], mask: str | None) -> None:
        """`dQ[row] += dS K` (`value`) for the entries of this tile, atomically (see `ChainPlan.dq_in_dkdv`)."""
        if not self.plan.dq_in_dkdv:
            return
        pointer, address_mask = self.address("dQ", axes, covered=mask is not None)
        self.helpers.update(("atomic_update", "SUM"))
        masks = " & ".join(m for m in (address_mask, mask) if m) or "None"
        self.emit(f"atomic_update({pointer}, {value}, {masks}, SUM)")

    def _weights_and_scores_gradient(self, entry: str, drow: str, allowed: str | None,
                                     positions: tuple[str, str]) -> None:
        """`wz` (the weights after dropout, for dV) and `ds` (for dK), from `w` and `dp`."""
        if self.chain.dropout:
            z = self._keep(entry)
            self.emit(f"wz = w * {z}")
            self.emit(f"dp = dp * {z}")
        else:
            self.emit("wz = w")
        self._ds("w", "dp", drow, allowed, positions)

    def _dq_sum(self) -> None:
        self._sum(("dQ",))

    def _dkdv_sum(self) -> None:
        self._sum(("dK", "dV"))

    def _sum(self, names: tuple[str, ...]) -> None:
        """Adds up the partial gradients of each long segment's pieces and stores them."""
        own = self.own
        self.env["Ak[g,p]" if self.plan.kind.startswith("dkdv") else "Ai[g]"] = _Bound("segment")
        self._segment_of_sum()
        with self.indented("if segment >= 0:"):
            for n in names:
                width = self.plan.block_e if n == "dV" else self.plan.block_d
                self.emit(f"sum_{n} = tl.zeros([{self._block(own)}, {width}], {self.acc_type})")
            with self.indented("for part in tl.range(first, last):"):
                for n in names:
                    pointer, mask = self._part_pointer(n)
                    self.emit(f"sum_{n} += tl.load({pointer}, mask={mask}, other=0.0)")
            for n in names:
                self.store(n, (own, "e" if n == "dV" else "d"), f"sum_{n}")
