"""`ChainPlan` -> Gluon source: the forward and the backward of a block attention chain in the Hopper form of the
tile core.

The kernel is `jinsum.kernels.hopper.attention_rows` (a producer warp loading key and value tiles by TMA, two
consumer warpgroups of 64 query rows in ping-pong, the softmax of one tile overlapped with the products of the
previous one) run over the forward's work items, with two functions written from the chain:

- `chain_scores`: the raw products of a tile to scores in units of log2(e): the scale, `score_mod` in registers,
  and where the block is not known full (its flag, or a key block out of range), the mask: `mask_mod` in registers
  (its captured arrays read once per row and column of the tile) and the causal rule. Over blocks narrower than a
  key tile (`ChainConfig.span`: a paged cache's pages) a tile holds several entries' blocks, each loaded by a TMA
  box of its own, and the function reads each column's block and flag;
- `chain_epilogue`: a whole row's output (through shared memory and TMA) and log-sum-exp, or a piece of a long
  row's running maximum, sum and accumulator for the combine kernel (the Triton form's, unchanged).

The backward over rows (`dq`) is `jinsum.kernels.hopper.attention_row_gradients` over the same work items, with
`chain_scores` again, `chain_row_stats` (the rows' log-sum-exp and `D = rowsum(dO * O)`) and
`chain_row_gradient_epilogue` (dQ, or a long row's pieces). The backward over keys (`dkdv`) is
`jinsum.kernels.hopper.attention_keys` (128 keys a program, the query tiles that attend to them streamed by TMA)
with the same functions transposed: `chain_key_scores` (keys along the rows), `chain_key_stats` and
`chain_key_epilogue` (dK and dV, or a long key's pieces). A score_mod's derivative is not in these forms: such a
chain's backward keeps the Triton form. The work items, flags and pieces are the Triton form's
(`_chain_route.schedule`), so the two forms are interchangeable kernel by kernel. Programs over rows run the work
items last first (rows that end later, causal attention's longest, start first), programs over keys in order (the
first keys, which every later row attends to, are the longest). Tensors are read through TMA descriptors made on
the device, one per program and tensor, from a row-major view whose rows are a block row's query rows (a block
column's keys) of one batch element and head: TMA fills loads past a view's last row with zeros and clips stores.
`hopper_fallback` says which chains have this form; the others keep the Triton form on every GPU.
"""

from __future__ import annotations

import numpy as np

from jinsum._lang import Var
from jinsum.kernels._chain_plan import (HOPPER_ROWS, LN2, LOG2E, ChainPlan, chain_inputs, chain_outputs, scratch_shapes,
                                        tiled_dims)
from jinsum.kernels._elementwise_source import Capture, elementwise_lines
from jinsum.kernels._plan import DESCRIPTOR_BYTES
from jinsum.kernels._source import offset

# The tensors read or written through a TMA descriptor, by kernel, and the descriptors a program makes: the
# forward's producer three and each consumer its output's (`hopper.attention_rows`); the backward's producer four
# and each consumer two (`hopper.attention_keys`).
DESCRIBED = {"forward": ("Q", "K", "V", "O"), "dq": ("Q", "K", "V", "dO", "dQ"),
             "dkdv": ("K", "V", "Q", "dO", "dK", "dV")}
DESCRIPTORS = {"forward": 5, "dq": 6, "dkdv": 8}
# What the backward's gradients are laid out as (`jinsum.kernels._chain_source`).
_SAME_LAYOUT = {"dO": "O", "Drow": "LSE", "dQ": "Q", "dK": "K", "dV": "V"}


def hopper_scratch(plan: ChainPlan) -> int:
    """Global scratch bytes a program needs: its TMA descriptors."""
    return DESCRIPTOR_BYTES * DESCRIPTORS[plan.kind]


def generate_hopper_chain(plan: ChainPlan) -> str:
    """The Python source of a module defining the Gluon kernel `jinsum_attention_<kind>_hopper`."""
    return _Writer(plan).module()


class _Writer:
    def __init__(self, plan: ChainPlan):
        self.plan, self.chain = plan, plan.chain
        self.inputs, self.outputs = chain_inputs(plan), chain_outputs(plan)
        self.shapes = {**{n: o.shape for n, o in self.chain.operand.items()}, **scratch_shapes(plan)}
        self.shapes.update({n: self.shapes[like] for n, like in _SAME_LAYOUT.items()})
        self.head = self.chain.operand["Q"].shape[-1]
        r = self.chain.roles
        # The grid's variables (batch, kv head, query head in its group) and the mods' coordinates.
        self.grid = [f"v_{v}" for v in plan.grid_vars]
        self.batch = [f"v_{v}" for v in r.batch]
        self.b = f"v_{r.batch_index}" if r.batch_index else "0"
        self.h = f"(v_{r.head} * {self.chain.group_size} + v_{r.head_group})" if r.head_group else f"v_{r.head}"
        self.captures = (*self.chain.mask_captures, *self.chain.score_captures)

    def pointer(self, name: str) -> str:
        return f"p_{name}" if name in self.inputs else f"o_{name}"

    def module(self) -> str:
        chain = self.chain
        lines = ["# Generated by jinsum from the attention chain below; see jinsum.kernels._chain_hopper.",
                 "import triton.language as tl", "from triton.experimental import gluon",
                 "from triton.experimental.gluon import language as gl",
                 "from triton.experimental.gluon.language.nvidia.hopper import tma",
                 "from jinsum.kernels.hopper import (attention_keys, attention_row_gradients, attention_rows, "
                 "columns_of,", "                                   rows_of, store_rows, store_tile)", "", ""]
        if self.plan.kind == "forward":
            parts = [self._scores(), self._epilogue(), self._descriptors(), self._kernel()]
        elif self.plan.kind == "dq":
            parts = [self._scores(), self._row_stats(), self._row_gradient_epilogue(), self._descriptors(),
                     self._kernel()]
        else:
            parts = [self._key_scores(), self._key_stats(), self._key_epilogue(), self._descriptors(),
                     self._key_kernel()]
        for part in parts:
            lines += part + ["", ""]
        return "\n".join(lines[:-2]) + f"\n# {chain!r}\n"

    def _context(self) -> str:
        """What the partitions receive beside the tiles (scalars and pointers only)."""
        kind = self.plan.kind
        first, order = ("k0", ["p_perm"]) if kind == "dkdv" else ("q0", ["p_Ak"])  # (over keys: the transposed order)
        own = {"forward": [self.pointer("LSE"), *(self.pointer(n) for n in ("part_m", "part_l", "part_acc"))],
               "dq": ["p_LSE", "p_Drow", "o_part_dq"], "dkdv": ["p_LSE", "p_Drow", "o_part_dk", "o_part_dv"]}[kind]
        names = [first, *self.grid, "p_flags", *order, *(self.pointer(c) for c in self.captures), "segment", "tile",
                 "part", "end", "glin", *own, *(self.pointer(n) for n in DESCRIBED[kind])]
        return ", ".join(names)

    def _scores(self) -> list[str]:
        chain, span = self.chain, self.plan.config.span
        body = [f"{self._context()} = context",
                f"s = s * {chain.scale * (LOG2E if chain.score_mod is None else 1.0)!r}",
                "q_idx = (q0 + rows_of(s, c))[:, None]"]
        if span > 1:  # a tile of `span` entries: each key's entry and flag (0 past the item's end; the schedule's
            # flags are 0 where a block is out of range), and where the scores need them, its block and key positions
            bk = chain.block[1]
            body += ["cols = columns_of(s)", f"at = entry + cols // {bk}", "inside = at < end",
                     "flag = tl.load(p_flags + at, mask=inside, other=0)"]
            positions = ["blocks = tl.load(p_Ak + at, mask=inside, other=0)",
                         f"kv_idx = (blocks * {bk} + cols % {bk})[None, :]"]
            if chain.score_mod is not None:
                body += positions
        else:
            body.append("kv_idx = (key + columns_of(s))[None, :]")
        coordinates = [self.b, self.h, "q_idx", "kv_idx"]
        if chain.score_mod is not None:
            lines, (value, *_), _ = elementwise_lines(chain.score_mod.value.jaxpr, ["s", *coordinates], "sm",
                                                      "tl.float32", self._capture_args(chain.score_captures))
            body += lines + [f"s = {value} * {LOG2E!r}"]
        if span > 1:  # (a full tile reads no positions: most of a prefill's)
            read = [] if chain.score_mod is not None or (chain.mask_mod is None and not chain.causal) else positions
            body += self._mask_rules(["if gl.min(flag, axis=0) != 2:  # a partial tile",
                                      *("    " + line for line in read), "    allowed = (flag != 0)[None, :]"])
        else:
            body += ["flag = tl.load(p_flags + entry)", *self._mask("col", chain.keys)]
        body.append("return s")
        return _function("chain_scores(s, c: gl.constexpr, key, entry, col, context)",
                         "Raw products -> scores in units of log2(e), -inf where masked.", body)

    def _mask(self, block: str, blocks: int) -> list[str]:
        """Where the block's `flag` says it is partial, or the other side's block index `block` is out of
        `[0, blocks)`: the scores `s` -inf where masked (the block's flag, `mask_mod` in registers at `q_idx`,
        `kv_idx`, the causal rule)."""
        return self._mask_rules([
            f"if (flag != 2) | ({block} < 0) | ({block} >= {blocks}):  # a partial block (or one out of range)",
            f"    allowed = (flag != 0) & ({block} >= 0) & ({block} < {blocks})"])

    def _mask_rules(self, body: list[str]) -> list[str]:
        """`body` (the branch of a partial tile and its `allowed`), then `mask_mod` and the causal rule in it."""
        chain = self.chain
        if chain.mask_mod is not None:
            lines, (value,), _ = elementwise_lines(chain.mask_mod.value.jaxpr, [self.b, self.h, "q_idx", "kv_idx"],
                                                   "mm", "tl.float32", self._capture_args(chain.mask_captures))
            body += ["    " + line for line in lines] + [f"    allowed = allowed & {value}"]
        if chain.causal:
            body.append("    allowed = allowed & (q_idx >= kv_idx)")
        return body + ['    s = tl.where(allowed, s, float("-inf"))']

    def _capture_args(self, names) -> tuple[Capture, ...]:
        return tuple(Capture(self.pointer(n), self.shapes[n]) for n in names)

    def _epilogue(self) -> list[str]:
        plan, chain, r = self.plan, self.chain, self.chain.roles
        bm = chain.block[0]
        positions = {**{v: f"v_{v}" for v in (*r.batch, r.head, r.head_group) if v},
                     "Ai[g]": "segment", r.query_offset: f"(tile * {HOPPER_ROWS} + rows)"}
        lse = offset(self.shapes["LSE"], [positions[str(i) if not isinstance(i, Var) else i.name]
                                          for i in chain.lse.indices])
        base = f"(part * {plan.grid_size} + glin) * {bm} + tile * {HOPPER_ROWS} + {{rows}}"
        value = self.head
        body = [f"{self._context()} = context",
                "if part < 0:  # the whole row: its output and log-sum-exp (natural)",
                "    store_rows(acc, l_i, q_tile, o_desc, o_row)",
                "    safe = tl.where(l_i > 0, l_i, 1.0)",
                f'    lse = tl.where(l_i > 0, (tl.where(m_i == float("-inf"), 0.0, m_i) + tl.log2(safe)) * {LN2!r}, '
                'float("inf"))',
                "    rows = c * 64 + gl.arange(0, 64, layout=m_i.type.layout)",
                f"    tl.store({self.pointer('LSE')} + {lse}, lse)",
                "else:  # a piece of a long row: (max, sum, accumulator) for the combine",
                f"    at = {base.format(rows='rows_of(acc, c)')}",
                f"    tl.store({self.pointer('part_acc')} + at[:, None] * {value} + columns_of(acc)[None, :], acc)",
                f"    at = {base.format(rows='c * 64 + gl.arange(0, 64, layout=m_i.type.layout)')}",
                f"    tl.store({self.pointer('part_m')} + at, m_i)",
                f"    tl.store({self.pointer('part_l')} + at, l_i)"]
        return _function("chain_epilogue(c: gl.constexpr, acc, m_i, l_i, q_tile, o_desc, o_row, context)",
                         "Consumer c's rows: stored, or kept for the combine.", body)

    def _descriptors(self) -> list[str]:
        """`chain_descriptor(name, context)`: the TMA descriptor of tensor `name` (`DESCRIBED`) over the view whose
        rows are the block rows' (columns') positions of this program's batch element and head."""
        chain, r = self.chain, self.chain.roles
        body = [f"{self._context()} = context", f"dtype: gl.constexpr = {self.pointer('Q')}.dtype.element_ty"]
        for k, name in enumerate(DESCRIBED[self.plan.kind]):
            like = _SAME_LAYOUT.get(name, name)
            shape = self.shapes[like]
            block_dim, offset_dim = tiled_dims(chain, like)
            # Over keys, a query view holds the group's heads side by side (the head in the group is not a grid
            # variable there: the producer picks the columns); stores take 64-column boxes.
            grouped = self.plan.kind == "dkdv" and like in ("Q", "O")
            positions = []
            for index in chain.accesses()[like].indices:
                var = index.name if isinstance(index, Var) else None
                fixed = (*r.batch, r.head) + ((r.head_group, ) if r.head_group and not grouped else ())
                positions.append(f"v_{var}" if var is not None and var in fixed else "0")
            count = shape[block_dim] * shape[offset_dim]
            stride = int(np.prod(shape[offset_dim + 1:], dtype=np.int64))
            rows = 64 if (like in ("Q", "O") or self.plan.kind == "dkdv") else self.plan.block_k
            box = min(rows, chain.block[1]) if like in ("K", "V") and self.plan.config.span > 1 else rows  # (a page)
            width = 64 if name in ("O", "dQ", "dK", "dV") else self.head
            columns = self.head * (self.chain.group_size if grouped and r.head_group else 1)
            body += [f"{'if' if k == 0 else 'elif'} name == {name!r}:",
                     f"    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([{rows}, {self.head}], dtype)",
                     f"    return tma.make_tensor_descriptor({self.pointer(name)} + {offset(shape, positions)}, "
                     f"shape=[{count}, {columns}], strides=[{stride}, 1], block_shape=[{box}, {width}], "
                     "layout=layout)"]
        return _function("chain_descriptor(name: gl.constexpr, context)",
                         "The TMA descriptor of tensor `name` for this program.", body)

    # --- the backward over rows ----------------------------------------------------------------------------------

    def _row_stats(self) -> list[str]:
        body = [f"{self._context()} = context", *self._stats("segment", f"tile * {HOPPER_ROWS} + c * 64 + rows")]
        return _function("chain_row_stats(c: gl.constexpr, rows, context)",
                         "The log-sum-exp (base 2) and D of consumer c's query rows.", body)

    def _stats(self, row: str, position: str, inside: str | None = None) -> list[str]:
        """Returns the log-sum-exp (base 2) and `D` of the query rows at `position` within block row `row` (of the
        head the context and `v_<head_group>` give); where `inside` fails, inf and 0 (no weight, no gradient)."""
        r = self.chain.roles
        positions = {**{v: f"v_{v}" for v in (*r.batch, r.head, r.head_group) if v}, "Ai[g]": row,
                     r.query_offset: f"({position})"}
        at = offset(self.shapes["LSE"], [positions[str(i) if not isinstance(i, Var) else i.name]
                                         for i in self.chain.lse.indices])
        masked = (f", mask={inside}, other=float(\"inf\")", f", mask={inside}, other=0.0") if inside else ("", "")
        return [f"at = {at}", f"lse = tl.load(p_LSE + at{masked[0]}) * {LOG2E!r}",
                f"drow = tl.load(p_Drow + at{masked[1]})", "return lse, drow"]

    def _row_gradient_epilogue(self) -> list[str]:
        chain = self.chain
        body = [f"{self._context()} = context",
                *self._store_or_keep([("dQ", chain.scale, "q_tile")], "q_row", chain.block[0], "row")]
        return _function("chain_row_gradient_epilogue(c: gl.constexpr, dq, q_tile, q_row, context)",
                         "Consumer c's rows: dQ (scaled) stored, or kept for the sum.", body)

    def _store_or_keep(self, tiles: list[tuple[str, float, str]], row: str, block: int, segment: str) -> list[str]:
        """Consumer c's gradient tiles `(name, factor, free shared memory)` (the tile's variable: `name` in lower
        case) times their factor: a whole segment's stored by TMA at `row`, a piece's partial sums kept in float32
        for the sum kernel (`part_<name>`: a slot of `block` rows per piece and grid assignment)."""
        values = [(name, name.lower(), f"{name.lower()} * {factor!r}" if factor != 1 else name.lower(), smem)
                  for name, factor, smem in tiles]
        base = (f"(part * {self.plan.grid_size} + glin) * {block} + tile * {HOPPER_ROWS} + "
                f"rows_of({values[0][1]}, c)")
        body = [f'{var}_desc = chain_descriptor("{name}", context)' for name, var, _, _ in values]
        body += [f"if part < 0:  # the whole {segment}"]
        body += [f"    store_tile({value}, {smem}, {var}_desc, {row})" for _, var, value, smem in values]
        body += [f"else:  # a piece of a long {segment}: its partial sums for the sum kernel",
                 f"    at = ({base})[:, None] * {self.head} + columns_of({values[0][1]})[None, :]"]
        return body + [f"    tl.store(o_part_{var} + at, {value})" for _, var, value, _ in values]

    # --- the backward over keys ----------------------------------------------------------------------------------

    def _head_in_group(self) -> list[str]:
        """Binds the query head in the group (a step's, `g`) where the chain has grouped heads."""
        group = self.chain.roles.head_group
        return [f"v_{group} = g"] if group else []

    def _key_scores(self) -> list[str]:
        chain = self.chain
        body = [f"{self._context()} = context", *self._head_in_group(), f"s = s * {chain.scale * LOG2E!r}",
                "kv_idx = (k0 + rows_of(s, c))[:, None]",
                f"q_idx = (row * {chain.block[0]} + offset + columns_of(s))[None, :]",
                "flag = tl.load(p_flags + tl.load(p_perm + j))", *self._mask("row", chain.rows), "return s"]
        return _function("chain_key_scores(s, c: gl.constexpr, g, j, row, offset, context)",
                         "Raw products (keys x queries) -> scores in units of log2(e), -inf where masked.", body)

    def _key_stats(self) -> list[str]:
        body = [f"{self._context()} = context", *self._head_in_group(),
                *self._stats("row", "offset + cols", f"(row >= 0) & (row < {self.chain.rows})")]
        return _function("chain_key_stats(g, row, offset, cols, context)",
                         "The log-sum-exp (base 2) and D of the query rows `row * BM + offset + cols` of head g.", body)

    def _key_epilogue(self) -> list[str]:
        chain = self.chain
        body = [f"{self._context()} = context", *self._store_or_keep(
            [("dK", chain.scale, "k_tile"), ("dV", 1, "v_tile")], "k_row", chain.block[1], "key")]
        return _function("chain_key_epilogue(c: gl.constexpr, dk, dv, k_tile, v_tile, k_row, context)",
                         "Consumer c's keys: dK (scaled) and dV stored, or kept for the sum.", body)

    def _key_kernel(self) -> list[str]:
        plan, chain = self.plan, self.chain
        bm, bk = chain.block
        tiles = bk // HOPPER_ROWS
        body = self._work_item(f"pid // {tiles}  # (the first keys first: causal attention's longest)", tiles, "keys")
        body += ["if segment >= 0:",
                 f"    k0 = segment * {bk} + tile * {HOPPER_ROWS}  # the program's first key position",
                 f"    per_head = (end - begin) * {bm // 64}  # steps of one query head",
                 f"    context = ({self._context()})",
                 f"    attention_keys(chain_descriptor, (p_key_rows, begin, per_head * {chain.group_size}, per_head), "
                 f"k0, context, chain_key_scores, chain_key_stats, chain_key_epilogue, p_Q.dtype.element_ty, {bm}, "
                 f"{self.head}, {plan.config.num_stages})"]
        return self._kernel_function(f"backward over keys, Hopper form; {HOPPER_ROWS} keys x 64 query rows a step",
                                     body)

    def _work_item(self, item: str, tiles: int, over: str) -> list[str]:
        """The kernel's first lines: the program's work item (`item`, from `pid`), its tile of the block (`tiles`
        of `HOPPER_ROWS` `over`: rows or keys), its grid variables, and the item's segment, entries and piece."""
        body = ["pid = tl.program_id(0)", f"item = {item}",
                f"tile = pid % {tiles}  # which {HOPPER_ROWS} {over} of the block",
                "glin = tl.program_id(1)  # the grid variables' flat index"]
        rest = "glin"
        for v in reversed(self.plan.grid_vars):
            extent = self.chain.output.extent[v]
            body.append(f"v_{v} = {rest} % {extent}")
            rest = f"({rest} // {extent})"
        return body + ["segment = tl.load(p_items + item * 5)  # a block row (column, over keys), or -1: no work",
                       "begin = tl.load(p_items + item * 5 + 1)  # its entries [begin, end)",
                       "end = tl.load(p_items + item * 5 + 2)",
                       "part = tl.load(p_items + item * 5 + 3)  # >= 0: one of several pieces of a long segment"]

    def _kernel_function(self, what: str, body: list[str]) -> list[str]:
        """The kernel `jinsum_attention_<kind>_hopper` with `body`, its docstring the chain and `what` it is."""
        plan = self.plan
        params = [f"p_{n}" for n in self.inputs] + [f"o_{n}" for n in self.outputs] + ["scratch"]
        return _function(f"jinsum_attention_{plan.kind}_hopper({', '.join(params)})",
                         f"{self.chain!r}\n\n    {what}, {plan.config.num_stages} stages; grid "
                         f"{', '.join(plan.grid_vars)}", body)

    def _kernel(self) -> list[str]:
        plan, chain = self.plan, self.chain
        bm, bk = chain.block
        width, span = plan.block_k, plan.config.span
        tiles = bm // HOPPER_ROWS
        body = self._work_item(f"{plan.items - 1} - pid // {tiles}  # the last work items first", tiles, "rows")
        body += ["if segment >= 0:",
                 f"    q0 = segment * {bm} + tile * {HOPPER_ROWS}  # the program's first query position",
                 f"    steps = (end - begin + {span - 1}) // {span}" if span > 1 else
                 f"    steps = (end - begin) * {bk // width}",
                 f"    context = ({self._context()})"]
        sizes = f"{max(1, bk // width)}, {bk}, {width}, {self.head}, {plan.config.num_stages}"
        if plan.kind == "forward":
            body.append(f"    attention_rows(chain_descriptor, (p_Ak, begin, steps, end - 1), q0, context, "
                        f"chain_scores, chain_epilogue, p_Q.dtype.element_ty, {sizes})")
        else:
            body.append(f"    attention_row_gradients(chain_descriptor, (p_Ak, begin, steps, end - 1), q0, context, "
                        f"chain_scores, chain_row_stats, chain_row_gradient_epilogue, p_Q.dtype.element_ty, {sizes})")
        what = "forward kernel" if plan.kind == "forward" else "backward over rows (dQ)"
        return self._kernel_function(f"{what}, Hopper form; {HOPPER_ROWS} rows x {width} keys a tile", body)


def _function(signature: str, doc: str, body: list[str]) -> list[str]:
    """A `@gluon.jit` function of the generated module: `def <signature>:`, its docstring `doc`, then `body`."""
    return ["@gluon.jit", f"def {signature}:", f'    """{doc}"""'] + ["    " + b for b in body]
