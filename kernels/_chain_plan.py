"""Checked `Chain` -> `ChainPlan`: the kernels of a fused attention chain, their tiles and their work lists.

Four kernels per chain, one plan each (`kind`):

- `forward`: one program per work item (a row, or a piece of a long row) and per grid assignment (batch, head).
  It walks the row's stored entries once: scores, `score_mod`, masks, an online softmax (running maximum and sum
  in float32, the accumulator rescaled when the maximum grows), dropout, the weighted sum of the values. A row in
  one piece is finished in place (output and log-sum-exp); a long row is cut into pieces of `chunk` entries (a
  BigBird global row attends to every block) whose partial (max, sum, accumulator) go to a scratch buffer, and
- `combine` merges the pieces of each long row.
- `dq`: the backward over rows (FlashAttention-2): scores recomputed, weights `exp(s - LSE)` from the saved
  log-sum-exp, `dS = P * (dP - D)` with `D = rowsum(dO * O)`, `dQ += dS K`.
- `dkdv`: the backward over keys, through the pattern transposed (entries sorted by key, a permutation the
  launcher computes): `dV += P^T dO`, `dK += dS^T Q`.
Pieces of a long row (key) in the backward also leave partial gradients in scratch, which `dq_sum` and `dkdv_sum`
add up: every output element is written once, in its own dtype (no zero fill, no float32 buffer, no atomics).

Two templates, as for single statements: **dot** for block patterns (every product a Tensor Core `tl.dot` on
`bm x D`, `D x bk` and `bm x bk` tiles; the pattern's blocks classified by the launcher as full, partial or empty,
so that a full block never reads its mask; heads are programs), and **lanes** for element patterns (a program owns
a row, or a key, with all its heads: each iteration gathers the key and value rows of `entries` stored entries as
a `heads x entries x features` tile, every head's row read at once; scores are sums along the features). The
heads play the part the block's query rows play in the dot template: the running statistics are per head.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jinsum._lang._ast import Var
from jinsum._lang._chain import Chain
from jinsum.kernels._plan import INT32_LIMIT, Fallback, _pow2

# The softmax runs in base 2 (FlashAttention's habit: exp2 is the hardware's instruction): scores, running
# maxima and partial results are in units of log2(e); the stored log-sum-exp is natural.
LOG2E, LN2 = 1.4426950408889634, 0.6931471805599453
KINDS = ("forward", "combine", "dq", "dq_sum", "dkdv", "dkdv_sum")
SUMS = ("combine", "dq_sum", "dkdv_sum")  # kernels over the long segments only, merging their pieces
# Programs (work items times grid assignments) a chain's kernel should have to fill a GPU: about 8 per SM of an
# H100 or H200 (132 SMs). Fewer, and long rows are cut into more pieces (`default_chain_config`).
FILL = 1024
# Widest head and value sizes a program keeps in registers.
MAX_WIDTH = 256


@dataclasses.dataclass(frozen=True)
class ChainConfig:
    """Launch and tiling parameters of a chain's kernels. Zero means "choose" (see `default_chain_config`)."""

    block_m: int = 0  # dot template: query rows and key columns per tile (a block is cut into such tiles)
    block_k: int = 0
    entries: int = 0  # lanes template: stored entries gathered per iteration
    chunk: int = 0  # stored entries (blocks) per work item: longer rows and keys are split into pieces
    # Dot forward over blocks narrower than a key tile (the pages of a paged cache): a key tile gathers the keys of
    # `span` consecutive stored entries of the row (`block_k = span * block width`). 1: a tile within one block.
    span: int = 0
    num_warps: int = 0
    num_stages: int = 0
    # Dot template: read the tiles of Q, K, V, dO through TMA descriptors (Hopper; `chain_config` sets it there)
    # where their layout allows, rather than by pointers: asynchronous copies into shared memory that Triton
    # pipelines and feeds to wgmma.
    descriptors: bool = False
    # The kernels in the Hopper form of the tile core where the chain has one (`hopper_fallback`): warp-specialised
    # Gluon programs for sm_90 (`chain_config` sets it there; `jinsum.kernels._chain_hopper`).
    hopper: bool = False


@dataclasses.dataclass(frozen=True)
class ChainPlan:
    """One kernel of a chain. For the dot template, a program owns `block_m` query rows (forward, dq, combine)
    or `block_k` key columns (dkdv) of one block, and walks the other side of each of its entries in tiles: so a
    block of 128 x 128 runs as 128 x 64 tiles forward, and 32-row tiles in the backward (FlashAttention-2's
    shapes), without spilling the accumulators."""

    chain: Chain
    kind: str  # one of KINDS
    template: str  # "dot" (block patterns) or "lanes" (element patterns)
    block_d: int  # head size and value size, padded to powers of two
    block_e: int
    block_h: int  # lanes template: heads, padded to a power of two
    config: ChainConfig

    @property
    def block_m(self) -> int:
        return self.config.block_m

    @property
    def block_k(self) -> int:
        return self.config.block_k

    @property
    def own_axis(self) -> str:
        """The tile axis a program's statistics and results run along: the block's query rows `m` (its key
        columns `k` for dkdv), or the heads `h` (lanes template)."""
        if self.template == "lanes":
            return "h"
        return "k" if self.kind.startswith("dkdv") else "m"

    def tiles(self, axis: str) -> int:
        """Tiles per block along `axis` ("m" or "k"); 1 for the lanes template."""
        if self.template != "dot":
            return 1
        size, block = (self.chain.block[0], self.block_m) if axis == "m" else (self.chain.block[1], self.block_k)
        return -(-size // block)

    @property
    def dq_in_dkdv(self) -> bool:
        """The dkdv kernel also adds each entry's `dS K` into dQ atomically, and no dq kernel runs: for entries
        with narrow heads (GAT's scores are rank 2), a few atomics per entry cost less than gathering the values
        again over the rows (FlashAttention-2's own dQ scheme). Not in deterministic mode: those adds are
        float atomics."""
        return self.template == "lanes" and self.block_d <= 4 and not self.chain.output.deterministic

    @property
    def computes_dq(self) -> bool:
        """This kernel computes dQ: `dq`, or `dkdv` when it adds dQ atomically."""
        return self.kind == "dq" or (self.kind == "dkdv" and self.dq_in_dkdv)

    @property
    def grid_vars(self) -> tuple[str, ...]:
        """The variables decoded from `program_id(1)`: batch and head (dot), batch only (lanes: heads are a tile
        axis). With grouped-query attention the query head in its group is one too, except over the keys: a dkdv
        program walks the group's query heads itself, so that it sums their dK and dV in registers."""
        if self.template != "dot":
            return self.chain.roles.batch
        if self.kind.startswith("dkdv"):
            return tuple(v for v in self.chain.grid if v != self.chain.roles.head_group)
        return self.chain.grid

    @property
    def grid_size(self) -> int:
        """Programs along axis 1: one per assignment of `grid_vars`."""
        extent = self.chain.output.extent
        return int(np.prod([extent[v] for v in self.grid_vars], dtype=np.int64))

    @property
    def segments(self) -> int:
        """Rows (forward, combine, dq) or keys (dkdv) that the work items cover."""
        return self.chain.keys if self.kind.startswith("dkdv") else self.chain.rows

    @property
    def items(self) -> int:
        """Work items: at most one per segment plus one per `chunk` entries (see `work_items`)."""
        return self.segments + self.chain.entries // self.config.chunk

    @property
    def parts(self) -> int:
        """Scratch slots for the pieces of long rows: pieces of segments longer than `chunk` number fewer than
        `2 * entries / chunk`."""
        return max(1, 2 * self.chain.entries // self.config.chunk)

    @property
    def split_segments(self) -> int:
        """At most this many segments are longer than `chunk`."""
        return max(1, self.chain.entries // (self.config.chunk + 1))

    @property
    def grid_shape(self) -> tuple[int, int]:
        programs = self.split_segments if self.kind in SUMS else self.items * self.tiles(self.own_axis)
        return programs, self.grid_size


# --- the kernels' operands (every form of a kernel takes the same) -------------------------------------------

def chain_inputs(plan: ChainPlan) -> tuple[str, ...]:
    """The kernel's array inputs, in order (its outputs, `chain_outputs`, follow)."""
    chain, kind = plan.chain, plan.kind
    pattern = ("Av", "seed", "Q", "K", "V") + (("KM",) if chain.key_mask is not None else ()) \
        + (("flags",) if plan.template == "dot" else ()) + chain.mask_captures + chain.score_captures
    return {"forward": ("Ak", *pattern, "items"),
            "combine": ("O", "LSE", "combine", "part_m", "part_l", "part_acc"),
            "dq": ("Ak", *pattern, "items", "LSE", "Drow", "dO"),
            "dq_sum": ("dQ", "combine", "part_dq"),
            "dkdv": (*pattern, "perm", "key_rows", "items", "LSE", "Drow", "dO"),
            "dkdv_sum": ("dK", "dV", "combine", "part_dk", "part_dv")}[kind]


def chain_sizes(plan: ChainPlan) -> dict[str, int]:
    """The sizes a main kernel takes as runtime arguments, after its inputs: the numbers of rows and keys (bounds
    of the range checks) and of stored entries (dropout's counters). A pattern of another size with the same
    heads and widths runs the same compiled kernels; strides and tiles stay in the source (and the Hopper form
    keeps the sizes there too: its descriptors' shapes)."""
    chain = plan.chain
    if plan.kind in SUMS or plan.config.hopper:
        return {}
    return {"rows": int(chain.rows), "keys": int(chain.keys), "entries": int(chain.entries)}


def chain_outputs(plan: ChainPlan) -> tuple[str, ...]:
    """The kernel's outputs, in order. The kernel that computes dQ also adds the gradients of the arrays
    `score_mod` captures (`dSC0`, ... in float32, zeroed by the launcher) at each read's index."""
    captures = tuple(f"d{n}" for n in plan.chain.differentiable[3:]) if plan.computes_dq else ()
    dq = ("dQ",) if plan.kind == "dkdv" and plan.dq_in_dkdv else ()
    return {"forward": ("O", "LSE", "part_m", "part_l", "part_acc"), "combine": ("O", "LSE"),
            "dq": ("dQ", "part_dq", *captures), "dq_sum": ("dQ",),
            "dkdv": ("dK", "dV", "part_dk", "part_dv", *dq, *captures), "dkdv_sum": ("dK", "dV")}[plan.kind]


def scratch_shapes(plan: ChainPlan) -> dict[str, tuple[int, ...]]:
    """Shapes of the launcher's arrays that are not the chain's operands: work lists and partial results (one slot
    per piece of a long segment and grid assignment, along the kernel's own axis)."""
    chain = plan.chain
    head, value = chain.operand["Q"].shape[-1], chain.operand["V"].shape[-1]
    if plan.template == "dot":
        rows, cols = chain.block
    else:
        rows = cols = chain.output.extent[chain.roles.head]
    slots = (plan.parts, plan.grid_size)
    batch = chain.operand["KM"].shape[:-2] if chain.key_mask is not None and plan.template == "dot" else ()
    return {"items": (plan.items, 5), "combine": (plan.split_segments, 3), "flags": (*batch, chain.entries),
            "perm": (chain.entries,), "part_m": (*slots, rows), "part_l": (*slots, rows),
            "part_acc": (*slots, rows, value), "part_dq": (*slots, rows, head), "part_dk": (*slots, cols, head),
            "part_dv": (*slots, cols, value)}


def make_chain_plan(chain: Chain, kind: str, config: ChainConfig = ChainConfig()) -> ChainPlan | Fallback:
    """The plan of one of the chain's kernels, or a `Fallback` saying why the chain stays unfused."""
    if kind not in KINDS:
        raise ValueError(f"jinsum: unknown chain kernel {kind!r}; expected one of {KINDS}")
    if kind in SUMS:  # whole blocks (its programs are few); the work lists (chunk) are those of the main kernel
        main = make_chain_plan(chain, {"combine": "forward", "dq_sum": "dq", "dkdv_sum": "dkdv"}[kind], config)
        if isinstance(main, Fallback):
            return main
        config = ChainConfig(chunk=main.config.chunk)
    operand = chain.operand
    head_dim, value_dim = operand["Q"].shape[-1], operand["V"].shape[-1]
    if max(head_dim, value_dim) > MAX_WIDTH:
        return Fallback(f"heads of {head_dim} / values of {value_dim} exceed the fused kernels' {MAX_WIDTH} lanes")
    block = chain.block
    if block and operand["Q"].dtype == np.float64:
        return Fallback("float64 block attention (Tensor Cores take 16- and 32-bit operands)")
    heads = chain.output.extent[chain.roles.head]
    if kind in ("dq", "dkdv") and chain.output.deterministic and len(chain.differentiable) > 3:
        return Fallback("deterministic mode: the gradients of arrays score_mod captures are added atomically")
    if chain.roles.head_group and not block:
        return Fallback("grouped-query graph attention (the lanes template keeps every head of a row)")
    if block:
        plan = ChainPlan(chain, kind, "dot", _pow2(head_dim, 16, MAX_WIDTH), _pow2(value_dim, 16, MAX_WIDTH), 1,
                         config)
    else:
        if heads * max(head_dim, value_dim) > 4 * MAX_WIDTH:
            return Fallback(f"{heads} heads of {head_dim} / {value_dim} exceed the fused kernels' registers")
        plan = ChainPlan(chain, kind, "lanes", _pow2(head_dim, 1, MAX_WIDTH), _pow2(value_dim, 1, MAX_WIDTH),
                         _pow2(heads, 1, 1 << 10), config)
    hopper = config.hopper and kind in HOPPER_KINDS
    plan = dataclasses.replace(plan, config=default_chain_config(dataclasses.replace(
        plan, config=dataclasses.replace(config, hopper=False))))
    if hopper and hopper_fallback(plan) is None:
        if kind == "forward":  # 128 query rows a program, key tiles of 128 (or 64; or `span` narrower blocks)
            rows, width = HOPPER_ROWS, 128 if block[1] % 128 == 0 else 64 if block[1] % 64 == 0 else plan.block_k
            stages = _hopper_stages(2 * 64 * head_dim * 2, 2 * width * head_dim * 2)
        elif kind == "dq":  # 128 query rows a program (and their dO), key tiles of 64: dS beside dQ in registers
            rows, width = HOPPER_ROWS, 64
            stages = _hopper_stages(2 * 2 * 64 * head_dim * 2, 2 * width * head_dim * 2)
        else:  # 128 keys a program, query tiles of 64
            rows, width = 64, HOPPER_ROWS
            stages = _hopper_stages(2 * 2 * 64 * head_dim * 2, 2 * 64 * head_dim * 2)
        plan = dataclasses.replace(plan, config=dataclasses.replace(
            plan.config, hopper=True, block_m=rows, block_k=width, num_warps=4, num_stages=stages))
    if plan.grid_size > 65535:
        return Fallback(f"{plan.grid_size} (batch x head) programs exceed CUDA's 65535 along the grid's axis 1")
    if plan.items > INT32_LIMIT:
        return Fallback(f"{plan.items} work items exceed CUDA's launch limits")
    return plan


def default_chain_config(plan: ChainPlan) -> ChainConfig:
    """Fills the zero fields of the plan's config with defaults for its template and kind."""
    config, changes = plan.config, {}
    if plan.template == "dot":
        # Tiles (rows x columns, warps, stages) per kind and head size, the fastest of those timed with the
        # configuration forced (DESIGN.md, "Launch defaults").
        (bm, bk), kind = plan.chain.block, plan.kind
        wide = plan.block_d > 64
        rows, cols, warps, stages = {
            "forward": (128, 64, 4, 2) if wide else (64, 64, 4, 2),
            "dq": (128, 32, 8, 3) if wide else (64, 64, 4, 2),
            "dkdv": (64, 64, 4, 2 if wide else 3)}.get(kind, (256, 256, 4, 2))
        changes["block_m"] = config.block_m or _pow2(bm, 16, rows)
        changes["span"] = config.span or _span(plan, cols)
        changes["block_k"] = (changes["span"] * bk if changes["span"] > 1 else
                              config.block_k or _pow2(bk, 16, cols))
        # Rows (keys) longer than `chunk` blocks are cut into pieces, so that a few long ones (BigBird's global
        # rows) do not hold back the launch; each piece costs its partial results in scratch and a merge. Pieces
        # of at least twice the mean segment: rows of causal attention run whole (DESIGN.md, "The kernels' forms
        # and when each is chosen").
        # Where the programs are fewer than `FILL` (decoding a few long sequences over a paged cache), rows are cut
        # finer, down to 16 blocks, so that their pieces fill the GPU (flash-decoding).
        mean = plan.chain.entries / max(1, plan.segments)
        chunk = _pow2(math.ceil(2 * mean), 16, 1 << 12)
        programs = plan.segments * plan.grid_size
        if programs < FILL:
            chunk = min(chunk, _pow2(math.ceil(plan.chain.entries * plan.grid_size / FILL), 16, 1 << 12))
        changes["chunk"] = config.chunk or chunk
        if changes["span"] > 1:  # gathered key tiles: 8 warps for 128 rows (at 4 they spill), 3 stages for fewer
            #                        (decoding; DESIGN.md, "Paged attention is the attention chain over the pages")
            warps, stages = (8, 2) if changes["block_m"] >= 128 else (4, 3)
        changes["num_warps"] = config.num_warps or warps
        changes["num_stages"] = config.num_stages or stages
    else:  # tiles of heads x entries x features of about 4096 elements, two warps: many programs in flight hide
        #    the latency of the gathers. The dkdv kernel also reduces along the features (dP) and adds to dQ: 8
        #    entries and one warp (DESIGN.md, "Launch defaults").
        width = plan.block_h * max(plan.block_d, plan.block_e)
        dkdv = plan.kind.startswith("dkdv")
        changes["entries"] = config.entries or (8 if dkdv else _pow2(4096 // width, 8, 128))
        changes["chunk"] = config.chunk or 8 * changes["entries"]
        changes["num_warps"] = config.num_warps or (1 if dkdv else max(1, min(2, changes["entries"] * width // 2048)))
        changes["num_stages"] = config.num_stages or 1
        changes["block_m"] = changes["block_k"] = 1
    return dataclasses.replace(config, **changes)


def _span(plan: ChainPlan, cols: int) -> int:
    """Stored entries per key tile of a dot forward: enough blocks to fill a tile of `cols` keys where blocks are
    narrower (a paged cache's pages of 16 keys: tiles of 16 keep the Tensor Cores and the loads short), 1
    elsewhere. Blocks of a power of two, without dropout (counted per block element), a key padding mask, self
    loops or a mask per element (read per block)."""
    chain, bk = plan.chain, plan.chain.block[1]
    if (plan.kind != "forward" or bk >= cols or bk & (bk - 1) or chain.dropout or chain.key_mask is not None
            or chain.self_loops or len(chain.mask.indices) > 2):
        return 1
    return cols // bk


# --- the Hopper form ----------------------------------------------------------------------------------------------

HOPPER_ROWS = 128  # query rows (keys over keys) per program: two consumer warpgroups of 64 (`jinsum.kernels.hopper`)
# The kernels with a Hopper form (`attention_rows`, `attention_row_gradients`, `attention_keys`).
HOPPER_KINDS = ("forward", "dq", "dkdv")
# Head sizes the Hopper form takes. At 128 it runs the forward and the backward faster than the Triton form; at 64
# it is slower (its 64-row consumer tiles leave the Tensor Cores idle there), forward and backward (DESIGN.md, "The
# Hopper form", "The Hopper form of the backward").
HOPPER_HEADS = (128,)
HOPPER_DTYPES = ("float16", "bfloat16")


def hopper_fallback(plan: ChainPlan) -> str | None:
    """Why the kernel of `plan` has no Hopper form (a sentence), or None: it has one."""
    chain = plan.chain
    if plan.kind not in HOPPER_KINDS or plan.template != "dot":
        return (f"the Hopper form covers the forward and the backward of block patterns, not a "
                f"{plan.template} {plan.kind} kernel")
    head, value, dtype = chain.operand["Q"].shape[-1], chain.operand["V"].shape[-1], chain.operand["Q"].dtype
    if dtype.name not in HOPPER_DTYPES or {chain.operand[n].dtype for n in ("K", "V")} != {dtype}:
        return f"{dtype} attention (the Hopper form takes float16 and bfloat16)"
    if head != value or head not in HOPPER_HEADS:
        return f"heads of {head} and values of {value} (the Hopper form takes equal sizes of {HOPPER_HEADS})"
    bm, bk = chain.block
    if plan.kind in ("forward", "dq") and (bm % HOPPER_ROWS or (bk * max(1, plan.config.span)) % 64):
        return (f"blocks of {bm} x {bk} (the Hopper form takes multiples of {HOPPER_ROWS} x 64, or key tiles of 64 "
                "blocks narrower)")
    if plan.kind == "dkdv" and (bm % 64 or bk % HOPPER_ROWS):
        return f"blocks of {bm} x {bk} (the Hopper form of the backward takes multiples of 64 x {HOPPER_ROWS})"
    for what, present in (("dropout", chain.dropout), ("a key padding mask", chain.key_mask is not None),
                          ("a mask per element", len(chain.mask.indices) > 2),
                          ("a score_mod in the backward", plan.kind != "forward" and chain.score_mod is not None)):
        if present:
            return f"{what} (not in the Hopper form)"
    if any(tiled_dims(chain, name) is None for name in ("Q", "K", "V", "O", "LSE")):
        return "operands laid out otherwise than (batch, block, offset, heads, features)"
    return None


def tiled_dims(chain: Chain, name: str) -> tuple[int, int] | None:
    """`(block dimension, offset dimension)` of the chain's tensor `name` if its access is `[*batch, block index,
    offset, heads..., feature]` (`LSE`: without the feature), else None: the rows of a block row (column) of one
    batch element and head are then one strided view, as a TMA descriptor reads them."""
    r = chain.roles
    access = chain.accesses()[name]
    query = name in ("Q", "O", "LSE")
    heads = [r.head] + ([r.head_group] if query and r.head_group else [])
    feature = [] if name == "LSE" else [r.contract if name in ("Q", "K") else r.feature]
    block = "Ai[g]" if query else "Ak[g,p]"
    expected = [*r.batch, block, r.query_offset if query else r.key_offset, *heads, *feature]
    if [i.name if isinstance(i, Var) else str(i) for i in access.indices] != expected:
        return None
    return len(r.batch), len(r.batch) + 1


def _hopper_stages(fixed: int, stage: int) -> int:
    """Stages of the streamed tiles (`stage` bytes each) that fit beside the program's own tiles (`fixed` bytes: the
    forward's query tiles, the backward's keys and values) in 200 KiB (of 227), 2 to 4."""
    return max(2, min(4, (200 * 1024 - fixed) // stage))
