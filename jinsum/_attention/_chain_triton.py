"""The CUDA lowering of attention chains: the kernels of the chain's route (`_chain_route`), launched by the one
launcher (`jinsum._lowering._launch`) as XLA kernel nodes, after the work lists the route's schedule holds.

Backward: `D = rowsum(dO * O) - dLSE` in XLA, then `dq` over the rows and `dkdv` over the keys, each followed by a
`*_sum` kernel that adds up the pieces of long rows (keys). The same launches run in Triton's interpreter on CPU
(`interpret_forward`, `interpret_backward`), which is how CI checks every generated chain kernel.
"""

from __future__ import annotations

import warnings

import jax
import numpy as np

from jinsum._attention import _chain_reference
from jinsum._attention._chain_route import (BACKWARD, EMPTY, FORWARD, SCHEDULE, SWITCHED_OFF, ChainRoute, route_chain,
                                             schedule)
from jinsum._lang._chain import Chain
from jinsum._lowering import _launch
from jinsum._lowering._triton import FallbackWarning
from jinsum.kernels import (ChainConfig, ChainPlan, Fallback, chain_inputs, chain_kernel_name, chain_outputs,
                            chain_scratch, chain_sizes, generate_chain, load_kernel, scratch_shapes)


def _fallback(chain: Chain, plan: Fallback) -> None:
    if plan.reason not in (*SWITCHED_OFF, EMPTY):  # a setting, or no work: nothing to warn of
        warnings.warn(f"jinsum: {chain!r} runs unfused: {plan.reason}", FallbackWarning, stacklevel=3)


def forward(route: ChainRoute, arrays) -> list[jax.Array]:
    """`[O, LSE]` on CUDA arrays (the body of the attention primitive's cuda lowering)."""
    chain = route.chain
    env = dict(zip(chain.names + SCHEDULE, arrays))
    found = route.plans(FORWARD)
    if isinstance(found, Fallback):
        _fallback(chain, found)
        return list(_chain_reference.forward(chain, env))
    return run_forward(found, env, _launch.XLA_KERNEL)


def backward(route: ChainRoute, arrays) -> list[jax.Array]:
    """`[dQ, dK, dV]` on CUDA arrays (the body of the backward primitive's cuda lowering)."""
    chain = route.chain
    env = dict(zip(chain.names + SCHEDULE + ("O", "LSE", "dO", "dLSE"), arrays))
    found = route.plans(BACKWARD)
    if isinstance(found, Fallback):
        _fallback(chain, found)
        return list(_chain_reference.backward(chain, env, (env["dO"], env["dLSE"])))
    return run_backward(found, env, _launch.XLA_KERNEL)


# --- the launches ---------------------------------------------------------------------------------------------------

def run_forward(found: dict[str, ChainPlan], env: dict, launcher: _launch.Launcher) -> list:
    plan = found["forward"]
    chain = plan.chain
    shapes, stats = scratch_shapes(plan), chain.operand["LSE"].dtype
    inputs = {**env, "items": env["row_items"]}
    out = _launch_kernel(launcher, plan, inputs, {"O": _struct(chain, "O"), "LSE": _struct(chain, "LSE"),
                                **{name: (shapes[name], stats) for name in ("part_m", "part_l", "part_acc")}})
    merged = _launch_kernel(launcher, found["combine"], {**out, "combine": env["row_combine"]},
                            {"O": _struct(chain, "O"), "LSE": _struct(chain, "LSE")}, aliases={"O": "O", "LSE": "LSE"})
    return [merged["O"], merged["LSE"]]


def run_backward(found: dict[str, ChainPlan], env: dict, launcher: _launch.Launcher) -> list:
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
        out = _launch_kernel(launcher, plan, {**inputs, "items": env[items]}, {**structs, **parts, **extra},
                             zeroed=tuple(extra))
        grads.update(_launch_kernel(launcher, found[f"{kernel}_sum"], {**out, "combine": env[combine]}, structs,
                                    aliases={g: g for g in outputs}))
        for name in extra:
            grads[name] = out[name].astype(chain.operand[name[1:]].dtype)
    return [grads[f"d{n}"] for n in chain.differentiable]


def _struct(chain: Chain, name: str) -> tuple[tuple[int, ...], np.dtype]:
    return chain.operand[name].shape, chain.operand[name].dtype


def _launch_kernel(launcher: _launch.Launcher, plan: ChainPlan, inputs: dict, outputs: dict, *, zeroed=(),
                   aliases=None) -> dict:
    """The kernel of `plan` on `inputs` (by name), into `outputs` (name -> (shape, dtype)), `zeroed` ones
    zero-filled and `aliases` (input -> output) updated in place: the outputs by name."""
    names_in, names_out = chain_inputs(plan), chain_outputs(plan)
    results = launcher.call(
        load_kernel(generate_chain(plan)),
        *(inputs[n] for n in names_in),
        *chain_sizes(plan).values(),
        out_shape=[jax.ShapeDtypeStruct(*outputs[n]) for n in names_out],
        grid=plan.grid_shape,
        input_output_aliases={names_in.index(i): names_out.index(o) for i, o in (aliases or {}).items()},
        zeroed_outputs=tuple(names_out.index(n) for n in zeroed),
        num_warps=plan.config.num_warps,
        num_stages=plan.config.num_stages,
        name=chain_kernel_name(plan),
        global_scratch=chain_scratch(plan),
    )
    return dict(zip(names_out, results))


def interpret_forward(chain: Chain, arrays: dict, config: ChainConfig = ChainConfig()) -> list[np.ndarray]:
    """The fused forward kernels in Triton's interpreter (tests; needs `TRITON_INTERPRET=1` and torch)."""
    return _interpret(chain, arrays, config, FORWARD, run_forward)


def interpret_backward(chain: Chain, arrays: dict, config: ChainConfig = ChainConfig()) -> list[np.ndarray]:
    """The fused backward kernels in Triton's interpreter; `arrays` also holds `O`, `LSE`, `dO` and `dLSE`."""
    return _interpret(chain, arrays, config, BACKWARD, run_backward)


def _interpret(chain, arrays, config, kinds, run):
    route = route_chain(chain, config)
    found = route.plans(kinds)
    if isinstance(found, Fallback):
        raise ValueError(f"jinsum: no fused kernels for {chain!r}: {found.reason}")
    env = {n: a if n == "transposed" else np.asarray(a) for n, a in arrays.items()}
    return [np.asarray(x) for x in run(found, {**env, **schedule(route, env)}, _launch.INTERPRETER)]
