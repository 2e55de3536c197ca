"""The primitive's lowerings: the XLA one everywhere (`_xla`, the reference), generated Triton kernels on CUDA
(`_triton`, launched by `_launch` as XLA kernel nodes, compiled through jax-triton with the compiled kernels kept on
disk by `_kernel_cache`). What runs for a statement is its `route` (`_route`): a kernel, XLA's lowering, or a split of
the statement (deterministic mode's rewrite into sorted segment reductions, `jinsum._rules._deterministic`; an
epilogue after the statement), whose parts are routed again.

Enters: a `Spec` and its operands at lowering time. Leaves: XLA operations, or a kernel plan handed to the code
generator `jinsum.kernels` (plan -> Triton source), whose kernel it launches. Next stage: `jinsum.kernels`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.interpreters import mlir

from jinsum._lang import Spec
from jinsum._lowering import _triton, _xla
from jinsum._lowering._route import Route, follow
from jinsum._rules._primitive import jinsum_p


def _lowering(evaluate: Callable[[Route, Sequence[jax.Array]], jax.Array], kernels: bool):
    """A lowering rule that follows each statement's route (`kernels`: the platform launches generated kernels):
    `evaluate(route, arrays)`, the platform's evaluation of a whole statement (a kernel or XLA's lowering), or the
    split the route says, whose parts are routed again. (The arrays are the statement's operands, `spec.names`; a
    column order's come after them, then the epilogue's captures.)"""

    def rule(*arrays: jax.Array, spec: Spec) -> jax.Array:
        return follow(spec, arrays, evaluate, kernels=kernels)

    return mlir.lower_fun(rule, multiple_results=False)


def _on_xla(widen_halves: bool):
    def evaluate(found: Route, arrays) -> jax.Array:
        return _xla.evaluate(*arrays, spec=found.spec, widen_halves=widen_halves)
    return evaluate


mlir.register_lowering(jinsum_p, _lowering(_on_xla(widen_halves=False), kernels=False))
mlir.register_lowering(jinsum_p, _lowering(_on_xla(widen_halves=True), kernels=False), platform="cpu")
mlir.register_lowering(jinsum_p, _lowering(_triton.evaluate, kernels=True), platform="cuda")
