"""What runs for an attention chain on CUDA, decided once when the chain is bound: its `ChainRoute` (the plans of
its generated kernels, or why it runs unfused), and the work lists those kernels read (`schedule`).

Forward: `forward` (one program per work item and head) then `combine` (the pieces of long rows). Backward: `dq`
over the rows and `dkdv` over the keys, whose entries come sorted by key (the transposed pattern), each followed by
a `*_sum` kernel that adds up the pieces of long rows (keys). The route is a static parameter of the attention
primitives, so their CUDA lowering (`_chain_triton`) and `jinsum.triton_source` read the plans it holds instead of
planning again.

The schedule (work items, block flags, the transposed order) depends on the pattern (and a block is full only where
the key padding mask, if any, holds every key of the block in every batch element). It is computed before
the primitive is bound, once for the forward and the backward: on the host with NumPy when the pattern is concrete
(a pattern closed over by a jitted function costs nothing per call), else as XLA ops in the traced program (where
layers sharing one adjacency share them): then the transposed order is the argsort of the keys, unless the
`GroupCOO` carries it (`GroupCOO.with_transpose`, built on the host by `jinsum.graphs.adjacency`). A segment (row or
key) of `L` entries is `max(1, ceil(L / chunk))` work items.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jinsum import _config
from jinsum._lang._chain import Chain
from jinsum.formats._row_starts import count_below, row_starts
from jinsum.kernels import ChainConfig, ChainPlan, Fallback, chain_config, generate_chain, make_chain_plan

SCHEDULE = ("row_items", "row_combine", "flags", "perm", "key_rows", "key_items", "key_combine")
FORWARD, BACKWARD = ("forward", "combine"), ("dq", "dq_sum", "dkdv", "dkdv_sum")
EMPTY = "an empty pattern"
# Settings that route every chain to its unfused statements, by the reason their fallback gives (a choice, which
# does not warn). (`jinsum.triton`'s reason is also the statements' route's: this module imports no lowering.)
SWITCHES = (("jinsum.triton is off", _config.triton), ("jinsum.fuse is off", _config.fuse))
SWITCHED_OFF = tuple(reason for reason, _ in SWITCHES)


@dataclasses.dataclass(frozen=True)
class ChainRoute:
    """What runs for `chain` on CUDA: the plans of the forward kernels and of the backward kernels (`FORWARD`,
    `BACKWARD`, in that order), or for either the `Fallback` that keeps it unfused."""

    chain: Chain
    forward: tuple[ChainPlan, ...] | Fallback
    backward: tuple[ChainPlan, ...] | Fallback

    def __repr__(self) -> str:  # short: a printed jaxpr shows it (each plan holds the chain again)
        found = [f"{k} fused" if not isinstance(p, Fallback) else f"{k} unfused: {p.reason}"
                 for k, p in (("forward", self.forward), ("backward", self.backward))]
        return f"ChainRoute({self.chain!r}, {', '.join(found)})"

    def plans(self, kinds: tuple[str, ...]) -> dict[str, ChainPlan] | Fallback:
        """The plans of the `FORWARD` or the `BACKWARD` kernels by kind, or their `Fallback`."""
        found = self.forward if kinds == FORWARD else self.backward
        return found if isinstance(found, Fallback) else dict(zip(kinds, found))

    def plan(self, kind: str) -> ChainPlan | None:
        """The plan of the kernel `kind`, if that kernel runs."""
        plans = self.plans(FORWARD if kind in FORWARD else BACKWARD)
        return None if isinstance(plans, Fallback) else plans[kind]


def route_chain(chain: Chain, config: ChainConfig | None = None) -> ChainRoute:
    """The route of `chain` with `config` (else `chain_config()`: a forced one, or the defaults)."""
    switched = tuple(reason for reason, setting in SWITCHES if not setting.value)
    return _route(chain, config or chain_config(), switched)


@functools.lru_cache(maxsize=256)
def _route(chain: Chain, config: ChainConfig, switched: tuple[str, ...]) -> ChainRoute:
    return ChainRoute(chain, _plans(chain, FORWARD, config, switched), _plans(chain, BACKWARD, config, switched))


def _plans(chain: Chain, kinds, config: ChainConfig, switched) -> tuple[ChainPlan, ...] | Fallback:
    """The plans of the chain's `kinds` of kernels, or the first `Fallback`."""
    if switched:
        return Fallback(switched[0])
    if chain.entries == 0 or chain.rows == 0 or chain.keys == 0:
        return Fallback(EMPTY)
    found = []
    for kind in kinds:
        plan = make_chain_plan(chain, kind, config)
        if isinstance(plan, Fallback):
            return plan
        found.append(plan)
    try:  # a score_mod without a Triton translation shows up here (and, routed on any platform, a chain that
        #    only ever runs unfused must not fail on its kernels' source: the CUDA lowering warns of the fallback)
        for plan in found:
            generate_chain(plan)
    except Exception as error:  # noqa: BLE001
        return Fallback(str(error) if isinstance(error, NotImplementedError) else
                        f"the code generator failed: {type(error).__name__}: {error}")
    return tuple(found)


# --- the schedule -------------------------------------------------------------------------------------------------

def schedule(route: ChainRoute, arrays: dict) -> dict:
    """The work lists of the route's kernels (see the module docstring), on the host when the pattern's arrays are
    concrete. Empty arrays where no kernel uses them (the chain runs unfused)."""
    chain = route.chain
    rows, keys = route.plan("forward"), route.plan("dkdv")
    found = {"row_items": np.zeros((0, 5), np.int32), "row_combine": np.zeros((0, 3), np.int32),
             "flags": np.zeros((0,), np.int8), "perm": np.zeros((0,), np.int32), "key_rows": np.zeros((0,), np.int32),
             "key_items": np.zeros((0, 5), np.int32), "key_combine": np.zeros((0, 3), np.int32)}
    if rows is None and keys is None:
        return found
    pattern = {n: arrays[n] for n in ("Ai", "Ak", "Av")}
    if arrays.get("transposed") is not None:  # a GroupCOO's entries in column order, built on the host
        pattern["perm"], pattern["starts"] = arrays["transposed"].perm, arrays["transposed"].starts
    concrete = not any(isinstance(x, jax.core.Tracer) for x in pattern.values())
    xp = np if concrete else jnp
    pattern = {n: np.asarray(x) if concrete else x for n, x in pattern.items()}
    if (rows or keys).template == "dot":
        found["flags"] = block_flags(chain, pattern, xp)
    pattern["flags"] = found["flags"]
    if chain.key_mask is not None and (rows or keys).template == "dot":
        found["flags"] = _per_batch_element(found["flags"], arrays["KM"], pattern["Ak"])
    if rows is not None:
        found["row_items"], found["row_combine"] = row_items(rows, pattern, xp)
    if keys is not None:
        if "perm" in pattern:
            # Its entries include stored self loops and entries masked per head, which the kernel masks itself.
            perm, starts = pattern["perm"].astype(xp.int32), pattern["starts"].astype(xp.int32)
        else:
            perm, starts = transposed_entries(keys, pattern, xp)
        found["perm"] = perm
        # Each transposed entry's row, so that the backward over keys reads it without a dependent gather.
        found["key_rows"] = pattern["Ai"][perm // chain.scores.extent[chain.roles.slot]].astype(xp.int32)
        found["key_items"], found["key_combine"] = work_items(starts[:-1], starts[1:], keys, xp)
    return found


def row_items(plan: ChainPlan, env: dict, xp):
    """Work items over the rows: each row's entries `[first group * P, end group * P)`, and for block patterns
    only those from its first block that attends to its last (a block mask built for a capacity pads rows with
    empty blocks; a paged cache's rows hold every page of the table, of which causal rows see the first ones)."""
    slots = plan.chain.scores.extent[plan.chain.roles.slot]
    starts = row_starts(env["Ai"], plan.chain.rows, xp) * slots
    begins, ends = starts[:-1], starts[1:]
    if plan.template == "dot":
        # Blocks that attend before each entry (`seen`), and where that count first reaches each value.
        seen = xp.concatenate([xp.zeros(1, xp.int32), xp.cumsum(env["flags"] != 0, dtype=xp.int32)])
        reaches = count_below(seen, seen.shape[0] + 1, xp)
        some = seen[ends] > seen[begins]
        begins, ends = (xp.where(some, reaches[seen[begins] + 1] - 1, begins),
                        xp.where(some, reaches[seen[ends]], begins))
    return work_items(begins, ends, plan, xp)


def work_items(begins, ends, plan: ChainPlan, xp):
    """Cuts segments (segment `s` covers units `[begins[s], ends[s])`) into work items.

    Returns `items` `(plan.items, 5)`: segment (or -1: no work), begin, end, scratch slot of a piece of a long
    segment (or -1: the whole segment), piece number; and `combine` `(plan.split_segments, 3)`: each long segment
    (or -1) with its scratch slots `[first, last)`.
    """
    chunk, count = plan.config.chunk, plan.items
    segments = begins.shape[0]
    pieces = xp.maximum(1, (ends - begins + chunk - 1) // chunk)
    after = xp.cumsum(pieces)  # items up to each segment's last
    item = xp.arange(count)
    segment = count_below(after - 1, count, xp)  # the segment of each item: the ends at or below it
    valid = segment < segments
    segment = xp.minimum(segment, segments - 1)
    piece = item - (after[segment] - pieces[segment])
    begin = begins[segment] + piece * chunk
    end = xp.minimum(begin + chunk, ends[segment])
    split = valid & (pieces[segment] > 1)
    part = xp.where(split, xp.cumsum(split) - 1, -1)
    items = xp.stack([xp.where(valid, segment, -1), begin, end, part, piece], axis=1).astype(xp.int32)

    long = pieces > 1
    last = xp.cumsum(xp.where(long, pieces, 0))
    which = _first_true(long, plan.split_segments, xp)
    safe = xp.maximum(which, 0)
    combine = xp.stack([which, last[safe] - pieces[safe], last[safe]], axis=1).astype(xp.int32)
    return items, combine


def _first_true(mask, size: int, xp):
    """The indices of the first `size` true entries of `mask`, padded with -1."""
    if xp is np:
        found = np.flatnonzero(mask)[:size]
        return np.concatenate([found, np.full(size - len(found), -1, found.dtype)])
    return jnp.nonzero(mask, size=size, fill_value=-1)[0]


def block_flags(chain: Chain, env: dict, xp):
    """Per stored block: 2 if every element attends (no mask to read or evaluate), 1 if some may, 0 if none or if
    its block is out of range (int8).
    A pattern of block flags (`Av[g,p]`, from `jinsum.block_mask`) gives them; a pattern of elements, its values
    (and then, with a `mask_mod`, no block is full without evaluating it)."""
    if env["Av"].ndim == 2:
        any_, all_ = env["Av"] != 0, env["Av"] == 2
    else:
        nonzero = env["Av"] != 0
        any_, all_ = nonzero.any(axis=(1, 2)), nonzero.all(axis=(1, 2))
        if chain.mask_mod is not None:
            all_ = all_ & False
    inside = (env["Ak"] >= 0) & (env["Ak"] < chain.keys)  # (a block out of range attends nowhere: never read)
    any_, all_ = any_ & inside, all_ & inside
    if chain.causal:  # blocks wholly below the diagonal stay full; wholly above it, empty
        bm, bk = chain.block
        first_query, first_key = env["Ai"][:, None] * bm, env["Ak"] * bk
        all_ = all_ & (first_key + bk - 1 <= first_query)
        any_ = any_ & (first_key <= first_query + bm - 1)
    return xp.where(all_, 2, xp.where(any_, 1, 0)).astype(xp.int8).reshape(-1)


def _per_batch_element(flags, key_mask, Ak):
    """`flags` for each batch element of the key padding mask (`(B?, key blocks, bk)`), `(B?, entries)`: a block
    whose keys are all valid keeps its flag, one with some is partial (the kernels read the mask there), one with
    none attends nowhere."""
    concrete = not any(isinstance(x, jax.core.Tracer) for x in (flags, key_mask, Ak))
    xp = np if concrete else jnp
    valid = (np.asarray(key_mask) if concrete else key_mask) != 0
    every, some = valid.all(axis=-1), valid.any(axis=-1)  # (B?, key blocks)
    blocks = xp.asarray(Ak).reshape(-1)
    inside = (blocks >= 0) & (blocks < valid.shape[-2])
    at = xp.clip(blocks, 0, valid.shape[-2] - 1)
    every, some = every[..., at] & inside, some[..., at] & inside
    return xp.where(some, xp.where(every, flags, xp.minimum(flags, 1)), 0).astype(xp.int8)


def transposed_entries(plan: ChainPlan, env: dict, xp):
    """The pattern transposed: the entries that attend somewhere, sorted by key (stable), and each key's
    `[start, end)` in that order. Entries that attend nowhere (padding, masked self loops) sort last."""
    chain = plan.chain
    slots = chain.scores.extent[chain.roles.slot]
    if plan.template == "dot":
        active = env["flags"] != 0
    else:
        nonzero = env["Av"] != 0
        active = (nonzero.any(axis=2) if nonzero.ndim == 3 else nonzero).reshape(-1)
    keys = env["Ak"].reshape(-1)
    if chain.self_loops:
        active = active & (keys != xp.repeat(env["Ai"], slots))
    key = xp.where(active, keys, chain.keys).astype(xp.int32)
    perm = xp.argsort(key, kind="stable") if xp is np else jnp.argsort(key, stable=True)
    return perm.astype(xp.int32), count_below(key[perm], chain.keys + 1, xp)
