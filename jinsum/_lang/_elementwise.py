"""A user's element-wise function, traced once to a jaxpr over scalars: the one home of that tracing.

A statement or chain holds the traced function (so this lives with the notation); the XLA lowering applies it
to arrays and the code generator writes it into kernels as register math (`jinsum.kernels._elementwise_source`).
Today's one kind is attention's `score_mod` (FlexAttention's), below.

`score_mod(score, b, h, q_idx, kv_idx) -> score` is written with `jax.numpy` on scalars: the float32 score and
the int32 batch index, head, query position and key position. It is traced to a jaxpr over those scalars, and
that jaxpr is what jinsum keeps: the XLA lowering applies the function to whole arrays, and the code generator
translates the jaxpr into Triton expressions (`jinsum.kernels._elementwise_source`). The derivative with respect to
the score, which the backward kernels need, is the jaxpr of `jax.jvp` of the same function.

A transform may close over Python numbers and concrete scalars (they become literals). It may not close over
arrays or traced values (a learned parameter inside `jit`): those would have to be kernel operands with their own
gradient, which jinsum does not offer; fold such parameters into the queries or keys instead.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

# The transform's arguments after the score, in order: batch index, head, query position, key position.
COORDINATES = ("b", "h", "q_idx", "kv_idx")


@dataclasses.dataclass(frozen=True)
class ScoreMod:
    """A traced `score_mod`. Equal transforms (same jaxpr, same constants) compare and hash equal, so a jitted
    layer that builds a new lambda on every call still hits every cache."""

    name: str
    text: str  # the printed jaxpr of value and derivative: the identity of the transform
    fn: Callable = dataclasses.field(compare=False, hash=False, repr=False)
    value_and_slope: jax.extend.core.ClosedJaxpr = dataclasses.field(compare=False, hash=False, repr=False)

    def __call__(self, score: jax.Array, *coordinates: jax.Array) -> jax.Array:
        """Applies the transform to arrays of any shape (the coordinates broadcast against `score`)."""
        shape = jnp.broadcast_shapes(score.shape, *(c.shape for c in coordinates))
        flat = [jnp.broadcast_to(x, shape).reshape(-1) for x in (score, *coordinates)]
        return jax.vmap(self.fn)(*flat).reshape(shape)


def trace_score_mod(fn: Callable) -> ScoreMod:
    """Traces `fn(score, b, h, q_idx, kv_idx)` on scalars; raises a clear error for what cannot be fused."""
    if not callable(fn):
        raise TypeError(f"jinsum.attention: score_mod must be a function (score, b, h, q_idx, kv_idx) -> score, got "
                        f"{type(fn).__name__}")
    name = getattr(fn, "__name__", type(fn).__name__)
    scalars = (jax.ShapeDtypeStruct((), jnp.float32),) + (jax.ShapeDtypeStruct((), jnp.int32),) * len(COORDINATES)

    def value_and_slope(score, *coordinates):
        return jax.jvp(lambda s: _checked_output(fn(s, *coordinates), name), (score,), (jnp.ones_like(score),))

    try:
        closed = jax.make_jaxpr(value_and_slope)(*scalars)
    except TypeError as error:
        raise TypeError(f"jinsum.attention: score_mod {name} must take (score, b, h, q_idx, kv_idx) scalars and "
                        f"return one float score: {error}") from error
    for const in closed.consts:
        if isinstance(const, jax.core.Tracer) or np.size(const) != 1:
            what = "a traced value" if isinstance(const, jax.core.Tracer) else f"an array of shape {np.shape(const)}"
            raise TypeError(f"jinsum.attention: score_mod {name} closes over {what}; it may only close over Python "
                            "numbers and concrete scalars (they are compiled into the kernel). Fold learned "
                            "parameters into the queries or keys instead")
    if closed.consts:  # concrete scalars: inline them, so that their values are part of the identity
        closed = _inline_consts(closed)
    for eqn in _equations(closed.jaxpr):
        for var in eqn.outvars:
            if var.aval.shape:
                raise TypeError(f"jinsum.attention: score_mod {name} computes an array ({eqn.primitive.name} -> "
                                f"{var.aval.str_short()}); it must be elementwise on its scalar arguments (no "
                                "arrays, tables or indexing)")
    return ScoreMod(name, str(closed), fn, closed)


def _equations(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs nested in it (jit, custom_jvp calls)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                yield from _equations(inner)


def _checked_output(out, name: str):
    if jnp.shape(out) != () or not jnp.issubdtype(jnp.result_type(out), jnp.floating):
        raise TypeError(f"jinsum.attention: score_mod {name} must return one floating-point score per call, got "
                        f"{jnp.result_type(out)}{list(jnp.shape(out))}")
    return jnp.asarray(out, jnp.float32)


def _inline_consts(closed):
    """Retraces a closed jaxpr whose constants are concrete scalars so that they appear as literals."""
    values = [np.asarray(c).item() for c in closed.consts]
    return jax.make_jaxpr(functools.partial(jax.core.eval_jaxpr, closed.jaxpr, values))(
        *(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars))
