"""The primitive's lowerings: the XLA one everywhere (`_xla`, the reference), a generated Triton kernel on CUDA
(`_triton`, launched through jax-triton, with compiled kernels kept on disk by `_kernel_cache`); in deterministic
mode a `+=` through index arrays is first rewritten into sorted segment reductions (`jinsum._rules._deterministic`),
each evaluated by the same platform's lowering.

Enters: a `Spec` and its operands at lowering time. Leaves: XLA operations, or a kernel plan handed to the code
generator `jinsum.kernels` (plan -> Triton source), whose kernel it launches. Next stage: `jinsum.kernels`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax.interpreters import mlir

from jinsum._rules import _deterministic
from jinsum._lowering import _triton, _xla
from jinsum._lang import Spec
from jinsum._rules._primitive import apply_epilogue, jinsum_p, split_epilogue


def _lowering(evaluate: Callable[..., jax.Array], fuses_epilogue: Callable[[Spec], bool],
              adds_in_order: Callable[[Spec], bool] = lambda spec: False):
    """A lowering rule running `evaluate(*arrays, spec=spec)`, or deterministic mode's rewrite of the statement
    where `adds_in_order(spec)` (the platform's evaluation adding each element's terms in a fixed order) does not
    hold. (Both read the statement's operands, `spec.names`; a column order's come after them.) An epilogue that
    `fuses_epilogue(spec)` does not take into the statement's kernel is an element-wise pass after it."""

    def rewrite(spec: Spec) -> bool:
        return _deterministic.rewritten(spec) and not adds_in_order(spec)

    def rule(*arrays: jax.Array, spec: Spec) -> jax.Array:
        if spec.epilogue is not None and (rewrite(spec) or not fuses_epilogue(spec)):
            statement_arrays, captures = split_epilogue(arrays, spec)
            return apply_epilogue(spec, rule(*statement_arrays, spec=spec.without_epilogue), captures)
        if rewrite(spec):
            return _deterministic.evaluate(spec, dict(zip(spec.arguments, arrays)),
                                           lambda s, a: evaluate(*(a[n] for n in s.arguments), spec=s))
        return evaluate(*arrays, spec=spec)

    return mlir.lower_fun(rule, multiple_results=False)


mlir.register_lowering(jinsum_p, _lowering(_xla.evaluate, lambda spec: False))
mlir.register_lowering(jinsum_p, _lowering(functools.partial(_xla.evaluate, widen_halves=True), lambda spec: False),
                       platform="cpu")
mlir.register_lowering(jinsum_p, _lowering(_triton.evaluate, _triton.fuses_epilogue, _triton.adds_in_order),
                       platform="cuda")
