"""The CUDA lowering of attention chains: the generated kernels through jax-triton, after a schedule of work lists.

Forward: `forward` (one program per work item and head) then `combine` (the pieces of long rows). Backward:
`D = rowsum(dO * O) - dLSE` in XLA, then `dq` over the rows and `dkdv` over the keys, whose entries come sorted by
key (the transposed pattern), each followed by a `*_sum` kernel that adds up the pieces of long rows (keys). The
same launches run in Triton's interpreter on CPU (`interpret_forward`, `interpret_backward`), which is how CI
checks every generated chain kernel.

The schedule (`schedule`: work items, block flags, the transposed order) depends on the pattern only. It is
computed before the primitive is bound, once for the forward and the backward: on the host with NumPy when the
pattern is concrete (a pattern closed over by a jitted function costs nothing per call), else as XLA ops in the
traced program (where layers sharing one adjacency share them): then the transposed order is the argsort of the
keys, unless the `GroupCOO` carries it (`GroupCOO.with_transpose`, built on the host by `jinsum.nn.adjacency`).
A segment (row or key) of `L` entries is `max(1, ceil(L / chunk))` work items.
"""

from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jinsum._attention import _chain_reference
from jinsum._lang._chain import Chain
from jinsum._lowering._triton import FallbackWarning, _jax_triton, count_below, from_torch, row_starts, to_torch
from jinsum.kernels import (ChainConfig, ChainPlan, Fallback, chain_config, chain_inputs, chain_outputs,
                            chain_sizes, generate_chain, load_kernel, make_chain_plan, scratch_shapes)

SCHEDULE = ("row_items", "row_combine", "flags", "perm", "key_rows", "key_items", "key_combine")
FORWARD, BACKWARD = ("forward", "combine"), ("dq", "dq_sum", "dkdv", "dkdv_sum")
_EMPTY = "an empty pattern"


def plans(chain: Chain, kinds, config: ChainConfig | None = None) -> dict[str, ChainPlan] | Fallback:
    """The plans of the chain's `kinds` of kernels (with `config`, else `chain_config()`), or the first
    `Fallback`."""
    config = config or chain_config()
    for switch in ("JINSUM_TRITON", "JINSUM_FUSE"):  # (JINSUM_FUSE=0: statements in kernels, chains unfused)
        if os.environ.get(switch, "1") == "0":
            return Fallback(f"{switch}=0")
    if chain.entries == 0 or chain.rows == 0 or chain.keys == 0:
        return Fallback(_EMPTY)
    found = {}
    for kind in kinds:
        plan = make_chain_plan(chain, kind, config)
        if isinstance(plan, Fallback):
            return plan
        found[kind] = plan
    try:  # a score_mod without a Triton translation shows up here
        for plan in found.values():
            generate_chain(plan)
    except NotImplementedError as error:
        return Fallback(str(error))
    return found


def _fallback(chain: Chain, plan: Fallback) -> None:
    if not plan.reason.endswith("=0") and plan.reason != _EMPTY:  # a switch, or no work: nothing to warn of
        warnings.warn(f"jinsum: {chain!r} runs unfused: {plan.reason}", FallbackWarning, stacklevel=3)


def forward(chain: Chain, arrays) -> list[jax.Array]:
    """`[O, LSE]` on CUDA arrays (the body of the attention primitive's cuda lowering)."""
    env = dict(zip(chain.names + SCHEDULE, arrays))
    found = plans(chain, FORWARD)
    if isinstance(found, Fallback):
        _fallback(chain, found)
        return list(_chain_reference.forward(chain, env))
    return run_forward(found, env, jnp, _triton_launch)


def backward(chain: Chain, arrays) -> list[jax.Array]:
    """`[dQ, dK, dV]` on CUDA arrays (the body of the backward primitive's cuda lowering)."""
    env = dict(zip(chain.names + SCHEDULE + ("O", "LSE", "dO", "dLSE"), arrays))
    found = plans(chain, BACKWARD)
    if isinstance(found, Fallback):
        _fallback(chain, found)
        return list(_chain_reference.backward(chain, env, (env["dO"], env["dLSE"])))
    return run_backward(found, env, jnp, _triton_launch)


# --- the schedule -------------------------------------------------------------------------------------------------

def schedule(chain: Chain, arrays: dict, config: ChainConfig | None = None) -> dict:
    """The chain's work lists (see the module docstring), on the host when the pattern's arrays are concrete.

    Empty arrays where no kernel would use them (the chain stays unfused, or only the reference lowering runs).
    """
    config = config or chain_config()
    rows, keys = make_chain_plan(chain, "forward", config), make_chain_plan(chain, "dkdv", config)
    empty = {"row_items": np.zeros((0, 5), np.int32), "row_combine": np.zeros((0, 3), np.int32),
             "flags": np.zeros((0,), np.int8), "perm": np.zeros((0,), np.int32),
             "key_rows": np.zeros((0,), np.int32),
             "key_items": np.zeros((0, 5), np.int32), "key_combine": np.zeros((0, 3), np.int32)}
    if isinstance(rows, Fallback) or isinstance(keys, Fallback) or 0 in (chain.entries, chain.rows, chain.keys):
        return empty
    pattern = {n: arrays[n] for n in ("Ai", "Ak", "Av")}
    if arrays.get("transposed") is not None:  # a GroupCOO's entries in column order, built on the host
        pattern["perm"], pattern["starts"] = arrays["transposed"].perm, arrays["transposed"].starts
    concrete = not any(isinstance(x, jax.core.Tracer) for x in pattern.values())
    xp = np if concrete else jnp
    pattern = {n: np.asarray(x) if concrete else x for n, x in pattern.items()}
    found = {"flags": block_flags(chain, pattern, xp) if rows.template == "dot" else empty["flags"]}
    found["row_items"], found["row_combine"] = row_items(rows, {**pattern, "flags": found["flags"]}, xp)
    if "perm" in pattern:
        # Its entries include stored self loops and entries masked per head, which the kernel masks itself.
        perm, starts = pattern["perm"].astype(xp.int32), pattern["starts"].astype(xp.int32)
    else:
        perm, starts = transposed_entries(keys, {**pattern, "flags": found["flags"]}, xp)
    found["perm"] = perm
    # Each transposed entry's row, so that the backward over keys reads it without a dependent gather.
    found["key_rows"] = pattern["Ai"][perm // chain.scores.extent[chain.roles.slot]].astype(xp.int32)
    found["key_items"], found["key_combine"] = work_items(starts, keys, xp)
    return found


def row_items(plan: ChainPlan, env: dict, xp):
    """Work items over the rows: each row's entries `[first group * P, end group * P)`, without the empty blocks
    after the last block that attends (a block mask built for a capacity pads its last row with them)."""
    slots = plan.chain.scores.extent[plan.chain.roles.slot]
    starts = row_starts(env["Ai"], plan.chain.rows, xp) * slots
    if plan.template == "dot":
        flags = env["flags"]
        used = xp.max(xp.where(flags != 0, xp.arange(flags.shape[0]) + 1, 0)) if flags.shape[0] else 0
        starts = xp.minimum(starts, used)
    return work_items(starts, plan, xp)


def work_items(starts, plan: ChainPlan, xp):
    """Cuts segments (`starts`: segment `s` covers units `[starts[s], starts[s + 1])`) into work items.

    Returns `items` `(plan.items, 5)`: segment (or -1: no work), begin, end, scratch slot of a piece of a long
    segment (or -1: the whole segment), piece number; and `combine` `(plan.split_segments, 3)`: each long segment
    (or -1) with its scratch slots `[first, last)`.
    """
    chunk, count = plan.config.chunk, plan.items
    segments = starts.shape[0] - 1
    pieces = xp.maximum(1, (starts[1:] - starts[:-1] + chunk - 1) // chunk)
    ends = xp.cumsum(pieces)
    item = xp.arange(count)
    segment = count_below(ends - 1, count, xp)  # the segment of each item: the ends at or below it
    valid = segment < segments
    segment = xp.minimum(segment, segments - 1)
    piece = item - (ends[segment] - pieces[segment])
    begin = starts[segment] + piece * chunk
    end = xp.minimum(begin + chunk, starts[segment + 1])
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
    """Per stored block: 2 if every element attends (no mask to read or evaluate), 1 if some may, 0 if none (int8).
    A pattern of block flags (`Av[g,p]`, from `jinsum.block_mask`) gives them; a pattern of elements, its values
    (and then, with a `mask_mod`, no block is full without evaluating it)."""
    if env["Av"].ndim == 2:
        any_, all_ = env["Av"] != 0, env["Av"] == 2
    else:
        nonzero = env["Av"] != 0
        any_, all_ = nonzero.any(axis=(1, 2)), nonzero.all(axis=(1, 2))
        if chain.mask_mod is not None:
            all_ = all_ & False
    if chain.causal:  # blocks wholly below the diagonal stay full; wholly above it, empty
        bm, bk = chain.block
        first_query, first_key = env["Ai"][:, None] * bm, env["Ak"] * bk
        all_ = all_ & (first_key + bk - 1 <= first_query)
        any_ = any_ & (first_key <= first_query + bm - 1)
    return xp.where(all_, 2, xp.where(any_, 1, 0)).astype(xp.int8).reshape(-1)


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


# --- the launches ---------------------------------------------------------------------------------------------------

def run_forward(found: dict[str, ChainPlan], env: dict, xp, launch) -> list:
    plan = found["forward"]
    chain = plan.chain
    shapes, stats = scratch_shapes(plan), chain.operand["LSE"].dtype
    inputs = {**env, "items": env["row_items"]}
    out = launch(plan, inputs, {"O": _struct(chain, "O"), "LSE": _struct(chain, "LSE"),
                                **{name: (shapes[name], stats) for name in ("part_m", "part_l", "part_acc")}})
    merged = launch(found["combine"], {**out, "combine": env["row_combine"]},
                    {"O": _struct(chain, "O"), "LSE": _struct(chain, "LSE")}, aliases={"O": "O", "LSE": "LSE"})
    return [merged["O"], merged["LSE"]]


def run_backward(found: dict[str, ChainPlan], env: dict, xp, launch) -> list:
    chain = found["dq"].chain
    stats = chain.operand["LSE"].dtype
    drow = (env["dO"].astype(stats) * env["O"].astype(stats)).sum(-1) - env["dLSE"]
    inputs = {**env, "Drow": drow.astype(stats)}
    grads = {}
    dq_in_dkdv = found["dkdv"].dq_in_dkdv
    # The gradients of captured arrays are added atomically in float32 by the kernel computing dQ.
    captured = {f"d{n}": (chain.operand[n].shape, np.dtype(np.float32)) for n in chain.differentiable[3:]}
    kernels = (("dkdv", "key_items", "key_combine", ("dK", "dV")),)
    if not dq_in_dkdv:
        kernels = (("dq", "row_items", "row_combine", ("dQ",)),) + kernels
    for kernel, items, combine, outputs in kernels:
        plan = found[kernel]
        shapes = scratch_shapes(plan)
        structs = {g: _struct(chain, g[1]) for g in outputs}
        parts = {f"part_{g.lower()}": (shapes[f"part_{g.lower()}"], stats) for g in outputs}
        extra = {"dQ": (chain.operand["Q"].shape, stats)} if kernel == "dkdv" and dq_in_dkdv else {}
        if plan.computes_dq:
            extra.update(captured)
        out = launch(plan, {**inputs, "items": env[items]}, {**structs, **parts, **extra}, zeroed=tuple(extra))
        grads.update(launch(found[f"{kernel}_sum"], {**out, "combine": env[combine]}, structs,
                            aliases={g: g for g in outputs}))
        for name in extra:
            grads[name] = out[name].astype(chain.operand[name[1:]].dtype)
    return [grads[f"d{n}"] for n in chain.differentiable]


def _struct(chain: Chain, name: str) -> tuple[tuple[int, ...], np.dtype]:
    return chain.operand[name].shape, chain.operand[name].dtype


# --- the two launchers --------------------------------------------------------------------------------------------

def _triton_launch(plan: ChainPlan, inputs: dict, outputs: dict, *, zeroed=(), aliases=None) -> dict:
    names_in, names_out = chain_inputs(plan), chain_outputs(plan)
    results = _jax_triton().triton_call(
        *(inputs[n] for n in names_in),
        *chain_sizes(plan).values(),
        kernel=load_kernel(generate_chain(plan)),
        out_shape=[jax.ShapeDtypeStruct(*outputs[n]) for n in names_out],
        grid=plan.grid_shape,
        input_output_aliases={names_in.index(i): names_out.index(o) for i, o in (aliases or {}).items()},
        zeroed_outputs=tuple(names_out.index(n) for n in zeroed),
        num_warps=plan.config.num_warps,
        num_stages=plan.config.num_stages,
        name=f"jinsum_attention_{plan.kind}",
    )
    return dict(zip(names_out, results))


def _interpret_launch(plan: ChainPlan, inputs: dict, outputs: dict, *, zeroed=(), aliases=None) -> dict:
    names_in, names_out = chain_inputs(plan), chain_outputs(plan)
    ins = [to_torch(np.asarray(inputs[n])) for n in names_in]
    aliased = {o: names_in.index(i) for i, o in (aliases or {}).items()}
    outs = []
    for name in names_out:
        shape, dtype = outputs[name]
        if name in aliased:
            ins[aliased[name]] = ins[aliased[name]].clone()
            outs.append(ins[aliased[name]])
        else:
            buffer = to_torch(np.zeros(shape, dtype))
            outs.append(buffer if name in zeroed else buffer.fill_(float("nan")) if buffer.is_floating_point()
                        else buffer.fill_(-7))  # unwritten elements must show
    load_kernel(generate_chain(plan))[plan.grid_shape](*ins, *chain_sizes(plan).values(), *outs,
                                                       num_warps=plan.config.num_warps)
    return {n: from_torch(t) for n, t in zip(names_out, outs)}


def interpret_forward(chain: Chain, arrays: dict, config: ChainConfig = ChainConfig()) -> list[np.ndarray]:
    """The fused forward kernels in Triton's interpreter (tests; needs `TRITON_INTERPRET=1` and torch)."""
    return _interpret(chain, arrays, config, FORWARD, run_forward)


def interpret_backward(chain: Chain, arrays: dict, config: ChainConfig = ChainConfig()) -> list[np.ndarray]:
    """The fused backward kernels in Triton's interpreter; `arrays` also holds `O`, `LSE`, `dO` and `dLSE`."""
    return _interpret(chain, arrays, config, BACKWARD, run_backward)


def _interpret(chain, arrays, config, kinds, run):
    found = plans(chain, kinds, config)
    if isinstance(found, Fallback):
        raise ValueError(f"jinsum: no fused kernels for {chain!r}: {found.reason}")
    env = {n: a if n == "transposed" else np.asarray(a) for n, a in arrays.items()}
    return run(found, {**env, **schedule(chain, env, config)}, np, _interpret_launch)
