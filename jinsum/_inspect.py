"""What runs on a GPU: the generated Triton source of one statement, or of every kernel a computation lowers to."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator

import jax
import jax.numpy as jnp

from jinsum import _config
from jinsum._attention import _chain_primitive, _chain_route
from jinsum._frontend import _einsum
from jinsum._lowering._route import TRITON_OFF, follow, route
from jinsum._rules import _primitive


def equations(fn: Callable, *args) -> Iterator:
    """Every equation of `fn(*args)`'s jaxpr, including those inside nested jaxprs (jit, grad, vmap, ...)."""

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    if hasattr(sub, "eqns"):
                        yield from visit(sub)
                    elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                        yield from visit(sub.jaxpr)

    yield from visit(jax.make_jaxpr(fn)(*args).jaxpr)


def kernel_specs(fn: Callable, *args) -> Iterator:
    """The statements of `fn(*args)` as they reach a lowering on the default device, in order: split as their
    routes say (in deterministic mode a `+=` through index arrays replaced by the sorted segment reductions it is
    rewritten into; a statement whose epilogue runs after it without the epilogue)."""
    kernels = jax.default_backend() == "gpu"
    for eqn in equations(fn, *args):
        if eqn.primitive is _primitive.jinsum_p:
            for found in _routes(eqn.params["spec"], [v.aval for v in eqn.invars], kernels):
                yield found.spec


def _routes(spec, avals, kernels: bool = True, config=None) -> list:
    """The routes of the whole statements that run for `spec` (operands of shapes `avals`), in order."""
    found = []

    def record(whole, arrays):
        found.append(whole)
        return jnp.zeros(whole.spec.lhs.shape, whole.spec.lhs.dtype)

    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    jax.eval_shape(lambda *a: follow(spec, a, record, kernels=kernels, config=config), *structs)
    return found


def triton_source(target: str | Callable, /, *args, config=None, sorted_indices: Collection[str] = (),
                  allow_tf32: bool | None = None, **named) -> str:
    """The Triton source that runs on a CUDA GPU: what the routes of the statements (`jinsum._lowering._route`) and
    of the attention chains (`jinsum._attention._chain_route`) launch. Needs no GPU.

    - `triton_source(expression, **operands)`: the kernel of one indirect Einsum, with `einsum`'s arguments
      (plus an optional `jinsum.kernels.KernelConfig`). Raises `ValueError` with the reason when the statement
      runs on the XLA lowering (too small for a kernel to pay, `jinsum.small_terms`, or no kernel for it). In
      deterministic mode, a scatter shows the kernels of the statements it is rewritten into; a product of three
      factors split in two (`contracted_first`), the kernels of both.
    - `triton_source(fn, *args)`: every generated kernel that `fn(*args)` lowers to, in order (statements and
      fused attention chains; `jax.grad` of `fn` shows the backward kernels), each under a comment naming it, and a
      comment for each statement that runs on XLA, with the reason.
    """
    from jinsum import kernels  # noqa: PLC0415 (the code generator: only kernel inspection needs it here)

    if callable(target):
        sources = []
        for eqn in equations(target, *args):
            if eqn.primitive is _primitive.jinsum_p:
                avals = [v.aval for v in eqn.invars]
                found = [(str(r.spec.statement), r.spec, r.plan or kernels.Fallback(r.reason))
                         for r in _routes(eqn.params["spec"], avals, config=config)]
            elif eqn.primitive in (_chain_primitive.attention_p, _chain_primitive.attention_backward_p):
                chain_route = eqn.params["route"]
                forward = eqn.primitive is _chain_primitive.attention_p
                plans = chain_route.plans(_chain_route.FORWARD if forward else _chain_route.BACKWARD)
                if not (forward or isinstance(plans, kernels.Fallback)):  # (the sums of pieces left unshown)
                    plans = {kind: plans[kind] for kind in ("dq", "dkdv")}
                found = [(repr(chain_route.chain), None, plans)]
            else:
                continue
            for name, spec, plans in found:
                if isinstance(plans, kernels.Fallback):
                    sources.append(f"# {name}: no generated kernel ({plans.reason}); it runs on XLA\n")
                    continue
                for kind, plan in ({"statement": plans} if spec else plans).items():
                    source = (_legend(spec) + kernels.generate(plan) if spec else kernels.generate_chain(plan))
                    sources.append(f"# ---- {kind}: {name}\n{source}")
        return "\n".join(sources)
    statement, arrays, flags = _einsum.prepare(target, named, sorted_indices=sorted_indices, allow_tf32=allow_tf32)
    spec = _primitive.make_spec(statement, arrays, **flags)
    found = route(spec, config=config)
    if found.rewritten or found.pairwise:  # the statements it is rewritten or split into (see `_routes`)
        return triton_source(lambda ops: _primitive.bind(statement, ops, **flags), arrays, config=config)
    if not found.kernel:
        raise ValueError(f"jinsum.triton_source: {statement} has no generated kernel: {_why(spec, found.reason)}")
    return f"# {statement}\n{_legend(spec)}{kernels.generate(found.plan)}"


def _why(spec, reason: str) -> str:
    """Why a statement runs on XLA's lowering, and how to see its kernel anyway where a setting is the reason."""
    if reason == "small":
        terms = math.prod(spec.extent.values())
        extents = " x ".join(f"{v}={n}" for v, n in spec.extents)
        return (f"on CUDA it runs on XLA's lowering, since its {terms:,} terms ({extents}) are fewer than "
                f"jinsum.small_terms = {_config.small_terms.value:,}, below which a launch costs more than the kernel "
                "saves. Call triton_source under `with jinsum.small_terms(0):` to see the kernel it would get "
                "(and run it that way to launch it).")
    if reason == TRITON_OFF:
        return f"{reason}; call triton_source under `with jinsum.triton(True):` to see its kernel."
    return reason


def _legend(spec) -> str:
    """A comment naming what the kernel's canonical names stand for (`jinsum.kernels.canonical`)."""
    tensors = ", ".join(f"T{k} = {name}" for k, name in enumerate(spec.names))
    variables = ", ".join(f"i{k} = {v}" for k, (v, _) in enumerate(spec.extents))
    return f"# {tensors}; {variables}\n"
