"""The attention primitives and all their rules, in one ordered section (as `_primitive` for single statements).

- `attention_p(Ai, Ak, Av, seed, Q, K, V[, KM]) -> (O, LSE)`: the fused chain (`Chain`), one generated kernel on
  CUDA (plus a combine for split rows), the unfused statements elsewhere.
- `attention_tangent_p(..., O, LSE, tQ, tK, tV, tSC...) -> (tO, tLSE)`: its JVP, linear in the tangents of the
  chain's differentiable operands (`Chain.differentiable`: Q, K, V and the floating arrays `score_mod`
  captures). Forward mode evaluates it by JAX's rules on the unfused chain; reverse mode never evaluates it but
  transposes it into
- `attention_backward_p(..., O, LSE, dO, dLSE) -> (dQ, dK, dV, dSC...)`: the FlashAttention-2 backward on CUDA
  (scores recomputed from the saved log-sum-exp, no stored probabilities), JAX's reverse mode of the unfused chain
  elsewhere.

Each primitive's static parameter is the chain's `route` (`_chain_route.ChainRoute`: the chain, and the plans of
its kernels, decided once when it is bound); the lowerings register themselves (`_lowering`), so this module
imports none. So `jax.grad` of attention saves `(Q, K, V, O, LSE)` and runs the generated backward kernels, and
`jax.jvp` works too. The pattern (`Ai`, `Ak`, `Av`, the key mask, the arrays `mask_mod` captures) has no tangent:
masks are piecewise constant. `vmap` over the values adds a batch variable to the chain (a grid axis of the
kernels, the batched chain routed anew); over the pattern, the seed or a captured array it runs the batch as a loop
(`lax.map`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from jinsum import _config
from jinsum._attention._chain_route import SCHEDULE, ChainRoute, route_chain, schedule
from jinsum._lang import statement_variables
from jinsum._lang._chain import Chain
from jinsum._rules import _derive, _primitive
from jinsum._rules._avals import varying

# Operands that describe the pattern (and the work lists derived from it): never differentiated, and batching
# them runs a loop (as batching a captured array does).
PATTERN = ("Ai", "Ak", "Av", "seed", "KM", *SCHEDULE)
BACKWARD_INPUTS = ("O", "LSE", "dO", "dLSE")


def _loops(name: str) -> bool:
    """Batching operand `name` runs the batch as a loop."""
    return name in PATTERN or name.startswith(("MC", "SC"))


def bind(chain: Chain, arrays: dict) -> tuple[jax.Array, jax.Array]:
    """`(O, LSE)`: the chain on `arrays` (by name, `chain.names`), routed here (`route_chain`: the plans of its
    kernels, a static parameter of the primitives from here on), with its route's work lists computed here too: on
    the host for a concrete pattern, and once for the forward and the backward."""
    if _config.check_indices.value:  # (here, not in the lowerings, where a checkify check cannot be)
        for spec in (chain.scores, chain.output):
            _primitive.check_index_arrays(spec, arrays)
    route = route_chain(chain)
    work = schedule(route, arrays)
    operands = [arrays[n] for n in chain.names] + [work[n] for n in SCHEDULE]
    return tuple(attention_p.bind(*operands, route=route))


attention_p = Primitive("jinsum_attention")
attention_p.multiple_results = True
attention_tangent_p = Primitive("jinsum_attention_tangent")
attention_tangent_p.multiple_results = True
attention_backward_p = Primitive("jinsum_attention_backward")
attention_backward_p.multiple_results = True

def _inputs(primitive: Primitive, chain: Chain) -> tuple[str, ...]:
    """The operands after the chain's own and its schedule."""
    if primitive is attention_tangent_p:
        return ("O", "LSE") + tuple(f"t{n}" for n in chain.differentiable)
    return BACKWARD_INPUTS if primitive is attention_backward_p else ()


def _outputs(primitive: Primitive, chain: Chain) -> tuple[str, ...]:
    return chain.differentiable if primitive is attention_backward_p else ("O", "LSE")


def _names(primitive: Primitive, chain: Chain) -> tuple[str, ...]:
    return chain.names + SCHEDULE + _inputs(primitive, chain)


def _aval(chain: Chain, name: str) -> jax.core.ShapedArray:
    source = {"dO": "O", "dLSE": "LSE"}.get(name, name[1:] if name.startswith("t") else name)
    operand = chain.operand[source]
    return jax.core.ShapedArray(operand.shape, operand.dtype)


# --- evaluation --------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=256)
def _compiled(primitive: Primitive, route: ChainRoute):
    return jax.jit(functools.partial(primitive.bind, route=route))


def _abstract_eval(primitive: Primitive):
    def rule(*avals, route: ChainRoute):
        chain = route.chain
        for aval, name in zip(avals, _names(primitive, chain)):
            if name in SCHEDULE:
                continue
            expected = _aval(chain, name)
            if aval.shape != expected.shape or aval.dtype != expected.dtype:
                raise TypeError(f"jinsum: {primitive.name} operand {name} is {aval.str_short()}, but {chain!r} was "
                                f"checked for {expected.str_short()}")
        return [varying(_aval(chain, name).shape, _aval(chain, name).dtype, avals)
                for name in _outputs(primitive, chain)]
    return rule


for _primitive_ in (attention_p, attention_tangent_p, attention_backward_p):
    _primitive_.def_impl(lambda *arrays, _p=_primitive_, route: _compiled(_p, route)(*arrays))
    _primitive_.def_abstract_eval(_abstract_eval(_primitive_))


# --- forward-mode differentiation -----------------------------------------------------------------------------
# Only the differentiable operands (Q, K, V, floating captures of score_mod) have tangents. The tangent of
# (O, LSE) is a separate primitive, linear in them, so that reverse mode transposes it into the backward kernels
# instead of differentiating through the forward.

def _jvp(primals, tangents, *, route: ChainRoute):
    chain = route.chain
    out, lse = attention_p.bind(*primals, route=route)
    named = dict(zip(chain.names, tangents))
    if all(type(named[n]) is ad.Zero for n in chain.differentiable):
        return (out, lse), (ad.Zero.from_primal_value(out), ad.Zero.from_primal_value(lse))
    linear = [ad.instantiate_zeros(named[n]) for n in chain.differentiable]
    return (out, lse), tuple(attention_tangent_p.bind(*primals, out, lse, *linear, route=route))


ad.primitive_jvps[attention_p] = _jvp


# --- transposition ----------------------------------------------------------------------------------------------
# The tangent primitive is linear in the tangents; everything else is a constant (residuals of the forward).

def _transpose_tangent(cotangents, *args, route: ChainRoute):
    chain = route.chain
    d_out, d_lse = cotangents
    if type(d_out) is ad.Zero and type(d_lse) is ad.Zero:
        return [ad.Zero(a.aval) if ad.is_undefined_primal(a) else None for a in args]
    constants = args[:len(chain.names) + len(SCHEDULE) + 2]
    d_out = ad.instantiate_zeros(d_out) if type(d_out) is not ad.Zero else jnp.zeros(_aval(chain, "O").shape,
                                                                                       _aval(chain, "O").dtype)
    d_lse = jnp.zeros(_aval(chain, "LSE").shape, _aval(chain, "LSE").dtype) if type(d_lse) is ad.Zero else d_lse
    grads = attention_backward_p.bind(*constants, d_out, d_lse, route=route)
    return [None] * len(constants) + [g if ad.is_undefined_primal(a) else None
                                      for g, a in zip(grads, args[len(constants):])]


ad.primitive_transposes[attention_tangent_p] = _transpose_tangent


# --- batching ---------------------------------------------------------------------------------------------------
# Batched values (Q, K, V and what shares their layout) get one more batch variable, at axis 0 of every value
# operand (unbatched ones are broadcast). A batched pattern or seed is a loop over the batch.

def _batcher(primitive: Primitive):
    def rule(args, dims, *, route: ChainRoute):
        chain = route.chain
        names = _names(primitive, chain)
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        args = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
        # Per-example gradients of unbatched captures are not a batch variable of the chain (the kernels would
        # sum them over the batch): the backward of a chain with captured gradients loops too.
        if any(d is not None for n, d in zip(names, dims) if _loops(n)) or (
                primitive is attention_backward_p and len(chain.differentiable) > 3):
            return _loop(primitive, route, args, dims)
        batched_chain = batch_chain(chain, size)
        args = [a if _loops(n) or d is not None else jnp.broadcast_to(a, (size, *a.shape))
                for a, n, d in zip(args, names, dims)]
        outs = primitive.bind(*args, route=route_chain(batched_chain))
        return outs, [0] * len(outs)
    return rule


def _loop(primitive: Primitive, route: ChainRoute, args, dims):
    batched = [k for k, d in enumerate(dims) if d is not None]

    def one(slices):
        full = list(args)
        for k, x in zip(batched, slices):
            full[k] = x
        return primitive.bind(*full, route=route)

    outs = jax.lax.map(one, [args[k] for k in batched])
    return outs, [0] * len(outs)


def batch_chain(chain: Chain, size: int) -> Chain:
    """The chain with a new batch variable of extent `size` in front of every value operand."""
    taken = set(statement_variables(chain.scores.statement)) | set(statement_variables(chain.output.statement))
    var = _derive.fresh_name("b", taken)

    def rebatch(spec, tensors):
        statement, _ = _derive.batch(spec.statement, {t: 0 for t in tensors}, 0, var=var)
        shapes = {o.name: jax.ShapeDtypeStruct(((size,) if o.name in tensors or o.name == spec.lhs.name else ())
                                               + o.shape, o.dtype) for o in spec.operands}
        return _primitive.make_spec(statement, shapes, **spec.modes, zero_lhs=spec.zero_lhs)

    roles = dataclasses.replace(chain.roles, batch=(var, *chain.roles.batch))
    return dataclasses.replace(chain, scores=rebatch(chain.scores, ("Q", "K")),
                               output=rebatch(chain.output, ("S", "V")), roles=roles).check()


for _primitive_ in (attention_p, attention_tangent_p, attention_backward_p):
    batching.primitive_batchers[_primitive_] = _batcher(_primitive_)
