"""What runs on a GPU: the generated Triton source of one statement, or of every kernel a computation lowers to."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator

import jax
import jax.numpy as jnp

from jinsum._attention import _chain_primitive
from jinsum._rules import _deterministic, _primitive
from jinsum._frontend import _einsum


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
    """The statements of `fn(*args)` as they reach a lowering, in order: in deterministic mode a `+=` through
    index arrays is replaced by the sorted segment reductions it is rewritten into."""
    for eqn in equations(fn, *args):
        if eqn.primitive is _primitive.jinsum_p:
            yield from _lowered(eqn)


def _lowered(eqn) -> list:
    spec = eqn.params["spec"]
    if not _deterministic.rewritten(spec):
        return [spec]
    found = []

    def record(derived, arrays):
        found.append(derived)
        return jnp.zeros(derived.lhs.shape, derived.lhs.dtype)

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    jax.eval_shape(lambda *a: _deterministic.evaluate(spec, dict(zip(spec.arguments, a)), record), *avals)
    return found


def triton_source(target: str | Callable, /, *args, config=None, sorted_indices: Collection[str] = (),
                  allow_tf32: bool = False, **named) -> str:
    """The Triton source that runs on a CUDA GPU. Needs no GPU.

    - `triton_source(expression, **operands)`: the kernel of one indirect Einsum, with `einsum`'s arguments
      (plus an optional `jinsum.kernels.KernelConfig`). Raises `ValueError` with the reason when the statement
      would stay on the XLA lowering. In deterministic mode, a scatter shows the kernels of the statements it is
      rewritten into.
    - `triton_source(fn, *args)`: every generated kernel that `fn(*args)` lowers to, in order (statements and
      fused attention chains; `jax.grad` of `fn` shows the backward kernels), each under a comment naming it.
    """
    # The code generator and the launchers' planning (imported here: only kernel inspection needs them)
    from jinsum import kernels  # noqa: PLC0415
    from jinsum._attention import _chain_triton  # noqa: PLC0415
    from jinsum._lowering import _triton  # noqa: PLC0415

    if callable(target):
        sources = []
        for eqn in equations(target, *args):
            if eqn.primitive is _primitive.jinsum_p:
                found = [(str(spec.statement), spec, _triton.plan_for(spec, config)) for spec in _lowered(eqn)]
            elif eqn.primitive in (_chain_primitive.attention_p, _chain_primitive.attention_backward_p):
                kinds = ("forward", "combine") if eqn.primitive is _chain_primitive.attention_p else ("dq", "dkdv")
                plans = _chain_triton.plans(eqn.params["chain"], kinds)
                found = [(repr(eqn.params["chain"]), None, plans)]
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
    if _deterministic.rewritten(spec):  # deterministic mode: the statements it is rewritten into
        return triton_source(lambda ops: _primitive.bind(statement, ops, **flags), arrays, config=config)
    plan = _triton.plan_for(spec, config)
    if isinstance(plan, kernels.Fallback):
        raise ValueError(f"jinsum: {statement} has no generated kernel: {plan.reason}")
    return f"# {statement}\n{_legend(spec)}{kernels.generate(plan)}"


def _legend(spec) -> str:
    """A comment naming what the kernel's canonical names stand for (`jinsum.kernels.canonical`)."""
    tensors = ", ".join(f"T{k} = {name}" for k, name in enumerate(spec.names))
    variables = ", ".join(f"i{k} = {v}" for k, (v, _) in enumerate(spec.extents))
    return f"# {tensors}; {variables}\n"
