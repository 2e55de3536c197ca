"""The attention primitives' lowerings: the unfused chain of `jinsum_p` statements everywhere (`_chain_reference`),
and on CUDA the generated kernels of each chain's route (`_chain_triton`). Registered on import, as the statement
primitive's are (`jinsum._lowering`): the primitives (`_chain_primitive`) import no lowering."""

from __future__ import annotations

from jax.interpreters import mlir

from jinsum._attention import _chain_reference, _chain_triton
from jinsum._attention._chain_primitive import _names, attention_backward_p, attention_p, attention_tangent_p
from jinsum._attention._chain_route import ChainRoute


def _forward_reference(route: ChainRoute, arrays):
    return _chain_reference.forward(route.chain, dict(zip(route.chain.names, arrays)))


def _tangent_reference(route: ChainRoute, arrays):
    chain = route.chain
    env = dict(zip(_names(attention_tangent_p, chain), arrays))
    return _chain_reference.tangent(chain, env, tuple(env[f"t{n}"] for n in chain.differentiable))


def _backward_reference(route: ChainRoute, arrays):
    chain = route.chain
    env = dict(zip(_names(attention_backward_p, chain), arrays))
    return _chain_reference.backward(chain, env, (env["dO"], env["dLSE"]))


def _rule(evaluate):
    def rule(*arrays, route: ChainRoute):
        return evaluate(route, arrays)
    return mlir.lower_fun(rule, multiple_results=True)


for _primitive, _reference, _kernels in [(attention_p, _forward_reference, _chain_triton.forward),
                                          (attention_tangent_p, _tangent_reference, None),
                                          (attention_backward_p, _backward_reference, _chain_triton.backward)]:
    mlir.register_lowering(_primitive, _rule(_reference))
    if _kernels is not None:
        mlir.register_lowering(_primitive, _rule(_kernels), platform="cuda")
