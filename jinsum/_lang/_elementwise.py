"""A user's element-wise function, traced once to a jaxpr over scalars: the one home of that tracing.

A chain or a statement holds the traced function (so this lives with the notation); the XLA lowering applies it to
arrays and the code generator writes it into kernels as register math (`jinsum.kernels._elementwise_source`).
Three kinds, two of them FlexAttention's:

- `score_mod(score, b, h, q_idx, kv_idx) -> score`: the float32 score and the int32 batch index, head, query
  position and key position;
- `mask_mod(b, h, q_idx, kv_idx) -> bool`: whether query `q_idx` attends to key `kv_idx`;
- `epilogue(value, *position) -> value`: a statement's result at one output element (float32, float64 for float64
  outputs) and the element's position, one int32 per dimension of the output (`C[Ai[g],n]`: `(value, row, n)`),
  applied to every element before it is stored (bias, activation, residual, scaling).

All are written with `jax.numpy` on scalars. They may close over Python numbers and concrete scalars (compiled in as
literals) and over arrays, concrete or traced (document ids, sequence lengths, ALiBi slopes, a bias table, a traced
window size), read with integer scalar indices (`doc[q_idx]`, `bias[h, q_idx - kv_idx]`, `lengths[0]`). Such arrays
are *captures*: they become operands of the attention primitive (traced, batched and, for floating ones read by a
`score_mod`, differentiated like the others), and a kernel reads them with one load per index vector, in registers.
Only the captures' shapes and dtypes are part of a traced function's identity, so new document ids (new values of
the same shape) reuse every compiled kernel.

For the kernels, a `score_mod` is also traced as `(value, slope, partials...)`: its derivative with respect to the
score, and with respect to each read of a floating capture (the backward adds `dL/dvalue * partial` into that
capture's gradient at the read's index). The derivatives come from `jax.jvp` of the user's function with the
reads held fixed, so custom derivative rules are kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

# The coordinates after the score, in order: batch index, head, query position, key position.
COORDINATES = ("b", "h", "q_idx", "kv_idx")
KINDS = {"score_mod": ("score", *COORDINATES), "mask_mod": COORDINATES, "epilogue": ("value",)}
_RETURNS = {"score_mod": "one floating-point score", "mask_mod": "one boolean", "epilogue": "one floating-point value"}


def arguments_of(kind: str, rank: int = 0) -> tuple[str, ...]:
    """The scalar arguments of a `kind` function: an epilogue's value is followed by one position per output
    dimension (`rank` of them)."""
    if kind == "epilogue":
        return ("value", *(f"i{d}" for d in range(rank)))
    return KINDS[kind]


_CALLS = ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "remat", "checkpoint")


@dataclasses.dataclass(frozen=True)
class Elementwise:
    """A traced `score_mod`, `mask_mod` or `epilogue`. Equal transforms (same jaxpr, same constants, captures of
    the same shapes) compare and hash equal, so a jitted layer that builds a new lambda on every call hits every cache.

    Attributes:
      kind: "score_mod", "mask_mod" or "epilogue".
      name: the function's name (for messages and reprs).
      text: the printed jaxprs: the identity of the transform.
      captures: the shape and dtype of each captured array, in operand order.
      fn: the user's function: what the XLA lowering applies when nothing is captured (traced afresh where it is
        applied, so that inside `shard_map` JAX marks its values' varying axes).
      value: `(*captures, *arguments) -> output` (a closed jaxpr, the score in float32): what the XLA lowering
        applies.
      kernel: `(*captures, *arguments) -> (output, slope, *partials)` for a `score_mod` (`partials` one per read of
        a floating capture, in the order the function reads); `value` for the others (an epilogue is
        differentiated outside the kernels, by the primitive's rules).
      wide: `value` with a float64 score or value (traced when 64-bit types are on), else None.
    """

    kind: str
    name: str
    text: str
    captures: tuple[jax.ShapeDtypeStruct, ...]
    fn: Callable = dataclasses.field(compare=False, hash=False, repr=False)
    value: jax.extend.core.ClosedJaxpr = dataclasses.field(compare=False, hash=False, repr=False)
    kernel: jax.extend.core.ClosedJaxpr = dataclasses.field(compare=False, hash=False, repr=False)
    wide: jax.extend.core.ClosedJaxpr | None = dataclasses.field(compare=False, hash=False, repr=False)

    @property
    def differentiable(self) -> tuple[int, ...]:
        """The captures that get a gradient: floating ones read by a `score_mod`."""
        if self.kind != "score_mod":
            return ()
        return tuple(i for i, c in enumerate(self.captures) if jnp.issubdtype(c.dtype, jnp.floating))

    def __call__(self, captures, *arguments: jax.Array) -> jax.Array:
        """Applies the function to arrays of any shape (the arguments broadcast), the captures as given."""
        shape = jnp.broadcast_shapes(*(jnp.shape(a) for a in arguments))
        flat = [jnp.broadcast_to(a, shape).reshape(-1) for a in arguments]
        if not self.captures:  # the user's function, traced afresh here (inside shard_map: with its varying axes)
            return jax.vmap(self.fn)(*flat).reshape(shape)
        closed = self.wide if self.wide is not None and flat[0].dtype == jnp.float64 else self.value
        if self.kind == "score_mod":
            flat[0] = flat[0].astype(closed.in_avals[len(self.captures)].dtype)
        out = jax.vmap(lambda *a: jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *captures, *a)[0])(*flat)
        return out.reshape(shape)


def on_grid(elementwise: Elementwise, captures, value: jax.Array) -> jax.Array:
    """An epilogue applied to every element of `value` (the positions are its indices), equation by equation on
    arrays rather than mapped over elements, so that what XLA and reverse mode see is what a user would write with
    broadcasting: a read whose indices are the positions themselves (`bias[n]`, `scale[row]`, `h[row, n]`) is the
    captured array broadcast (its gradient a sum, never a scatter), and other reads gather at indices computed on
    the host from the positions (static: they depend on the shape only). Values keep unit axes where they do not
    vary (`bias[n]` stays `(1, F)`)."""
    closed = elementwise.wide if elementwise.wide is not None and value.dtype == jnp.float64 else elementwise.value
    shape, count = value.shape, len(elementwise.captures)
    positions = [np.arange(n, dtype=np.int32).reshape([-1 if k == d else 1 for k in range(len(shape))])
                 for d, n in enumerate(shape)]
    # A scalar capture is a value on the grid (a unit array); the others are read.
    held = [jnp.reshape(c, [1] * len(shape)) if np.shape(c) == () else c for c in captures]
    operands = [*held, value.astype(closed.in_avals[count].dtype), *positions]
    arrays = {k for k in range(count) if np.shape(captures[k]) != ()}
    return _grid_run(closed.jaxpr, closed.consts, operands, arrays, shape)[0]


def _grid_run(jaxpr, consts, operands, arrays: set[int], shape) -> list:
    """Evaluates `jaxpr` on grid values (`on_grid`); `arrays`: the operands that are captured arrays, read."""
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, operands))
    captures = {var: x for k, (var, x) in enumerate(zip(jaxpr.invars, operands)) if k in arrays}

    def read(atom):
        return atom.val if hasattr(atom, "val") else env[atom]

    for eqn in jaxpr.eqns:
        args = [read(a) for a in eqn.invars]
        name = eqn.primitive.name
        source = None if hasattr(eqn.invars[0], "val") else captures.get(eqn.invars[0])
        if name == "dynamic_slice" and source is not None:
            outs = [_grid_read(source, args[1:], shape)]
        elif name == "slice" and source is not None:  # a read at constant indices: one element, broadcast
            outs = [jnp.reshape(source[tuple(eqn.params["start_indices"])], [1] * len(shape))]
        elif name in ("squeeze", "reshape", "broadcast_in_dim") and eqn.outvars[0].aval.size == 1:
            outs = [args[0]]  # (a read's one element, already on the grid)
        elif name in _CALLS and name != "custom_jvp_call":
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            held = {k for k, a in enumerate(eqn.invars) if not hasattr(a, "val") and a in captures}
            outs = _grid_run(getattr(inner, "jaxpr", inner), getattr(inner, "consts", ()), args, held, shape)
        elif all(isinstance(a, (np.ndarray, np.generic, int, float, bool)) for a in args):
            with jax.ensure_compile_time_eval():  # positions and literals only: computed now, on the host
                outs = [np.asarray(o) for o in _bind_broadcast(eqn, args)]
        else:
            outs = _bind_broadcast(eqn, args)
        for var, x in zip(eqn.outvars, outs):
            env[var] = x
    return [read(a) for a in jaxpr.outvars]


def _bind_broadcast(eqn, args):
    """`eqn`'s primitive on arguments broadcast to one shape (element-wise primitives want equal shapes); a custom
    derivative rule (`custom_jvp_call`) is kept by mapping it over the elements."""
    common = jnp.broadcast_shapes(*(np.shape(a) for a in args))
    args = [jnp.broadcast_to(jnp.asarray(a, dtype=v.aval.dtype), common) for a, v in zip(args, eqn.invars)]
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = params if isinstance(params, tuple) else ((), params)
    if eqn.primitive.name == "custom_jvp_call":
        flat = [a.reshape(-1) for a in args]
        outs = jax.vmap(lambda *a: eqn.primitive.bind(*subfuns, *a, **params))(*flat)
        return [o.reshape(common) for o in outs]
    outs = eqn.primitive.bind(*subfuns, *args, **params)
    return outs if eqn.primitive.multiple_results else [outs]


def _grid_read(source, indices, shape):
    """`source[indices]` (one index per dimension, clamped as `dynamic_slice` clamps) with a unit axis per
    trailing dimension, as a grid value: a broadcast of `source` where the indices are the positions, else a
    gather (at host-computed indices where they are static)."""
    rank = len(shape)
    if all(isinstance(i, np.ndarray) for i in indices):
        clamped = [np.clip(i, 0, n - 1) for i, n in zip(indices, source.shape)]
        axes = [_position_axis(i, shape) for i in clamped]
        if all(a is not None for a in axes) and len(set(axes)) == len(axes) and all(
                source.shape[k] == shape[a] for k, a in enumerate(axes)):
            order = sorted(range(len(axes)), key=lambda k: axes[k])
            moved = jnp.transpose(source, order)
            return jnp.reshape(moved, [shape[d] if d in axes else 1 for d in range(rank)])
        indices = clamped
    else:
        indices = [jnp.clip(i, 0, n - 1) for i, n in zip(indices, source.shape)]
    common = jnp.broadcast_shapes(*(np.shape(i) for i in indices))
    gathered = source[tuple(jnp.broadcast_to(i, common) for i in indices)]
    return jnp.reshape(gathered, common) if common else jnp.reshape(gathered, [1] * rank)


def _position_axis(index: np.ndarray, shape) -> int | None:
    """The grid axis `d` if `index` is the positions along it (`arange(shape[d])` on that axis), else None."""
    for d, n in enumerate(shape):
        iota = np.arange(n).reshape([-1 if k == d else 1 for k in range(len(shape))])
        if np.ndim(index) == len(shape) and np.shape(index)[d] == n and np.array_equal(
                index, np.broadcast_to(iota, np.broadcast_shapes(np.shape(index), iota.shape))):
            return d
    return None


def trace(fn: Callable, kind: str, where: str = "jinsum.attention",
          rank: int = 0) -> tuple[Elementwise, tuple[jax.Array, ...]]:
    """Traces `fn` as a `kind` ("score_mod", "mask_mod", or "epilogue" of an output with `rank` dimensions) on
    scalars. Returns the traced function and the arrays it captures (operands for the primitive, in the order of
    `Elementwise.captures`); raises a clear error for what cannot be fused."""
    arguments = arguments_of(kind, rank)
    signature = f"({', '.join(arguments)})"
    if not callable(fn):
        raise TypeError(f"{where}: {kind} must be a function {signature} -> {_RETURNS[kind]}, got "
                        f"{type(fn).__name__}")
    name = getattr(fn, "__name__", type(fn).__name__)
    value, captured = _trace_value(fn, kind, name, where, jnp.float32, arguments)
    specs = tuple(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in captured)
    _check_elementwise(value.jaxpr, len(specs), kind, name, where)
    scalars = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in value.in_avals[len(specs):]]
    if kind == "score_mod":
        kernel = jax.make_jaxpr(_with_derivatives(value, specs))(*specs, *scalars)
    else:  # (an epilogue is differentiated by the primitive's rules, outside the kernels)
        kernel = None
    wide = _trace_value(fn, kind, name, where, jnp.float64, arguments)[0] if kind != "mask_mod" and _x64() else None
    text = f"{kind} {[(s.shape, str(s.dtype)) for s in specs]}\n{value}"
    return Elementwise(kind, name, text, specs, fn, value, kernel or value, wide), captured


def arguments_read(traced: Elementwise) -> frozenset[str]:
    """The scalar arguments (`"b"`, `"h"`, ...) that the function's result depends on, through its equations:
    an argument it never uses, or uses only for values the result does not depend on, is not read. (Structural:
    `h * 0` reads `h`.)"""
    jaxpr, count = traced.value.jaxpr, len(traced.captures)
    names = arguments_of(traced.kind, len(jaxpr.invars) - count - 1)
    depends = {var: {name} for var, name in zip(jaxpr.invars[count:], names)}

    def of(atoms):
        return set().union(*(depends.get(a, set()) for a in atoms if not hasattr(a, "val")))

    for eqn in jaxpr.eqns:  # (a call's results depend on all its operands: conservative)
        for var in eqn.outvars:
            depends[var] = of(eqn.invars)
    return frozenset(of(jaxpr.outvars))


def _trace_value(fn, kind: str, name: str, where: str, score_dtype, arguments: tuple[str, ...]):
    """`(*captures, *arguments) -> output` as a closed jaxpr whose score (or value) is `score_dtype`, and the
    captures."""
    scalars = [jax.ShapeDtypeStruct((), score_dtype if a in ("score", "value") else jnp.int32) for a in arguments]
    wrong = []  # (what a function returned of the wrong kind: reported below, not as a signature error)

    def output(*a):
        out = fn(*a)
        if not _returns_right_kind(out, kind):
            wrong.append(f"{jnp.result_type(out)}{list(jnp.shape(out))}")
            return jnp.zeros((), jnp.bool_ if kind == "mask_mod" else score_dtype)
        return jnp.asarray(out, None if kind == "mask_mod" else score_dtype)

    try:
        closed = jax.make_jaxpr(output)(*scalars)
    except TypeError as error:
        hint = ("; it indexes a NumPy array with a traced position: close over jnp.asarray(...) instead"
                if isinstance(error, jax.errors.TracerArrayConversionError) else "")
        raise TypeError(f"{where}: {kind} {name} must take ({', '.join(arguments)}) scalars and return "
                        f"{_RETURNS[kind]}{hint}: {error}") from error
    if wrong:
        raise TypeError(f"{where}: {kind} {name} must return {_RETURNS[kind]} per call"
                        f"{' (True: attend)' if kind == 'mask_mod' else ''}, got {wrong[0]}")
    # Constants that are concrete scalars are compiled in; every other one is a capture.
    inline = [not isinstance(c, jax.core.Tracer) and np.shape(c) == () for c in closed.consts]
    captured = tuple(jnp.asarray(c) for c, keep in zip(closed.consts, inline) if not keep)
    consts = [np.asarray(c).item() for c, keep in zip(closed.consts, inline) if keep]
    specs = [jax.ShapeDtypeStruct(c.shape, c.dtype) for c in captured]

    def original(*operands):  # (*captures, *arguments) -> output, constants in place
        values, it_c, it_k = [], iter(operands[:len(specs)]), iter(consts)
        for keep in inline:
            values.append(next(it_k) if keep else next(it_c))
        return jax.core.eval_jaxpr(closed.jaxpr, values, *operands[len(specs):])[0]

    return jax.make_jaxpr(original)(*specs, *scalars), captured


def _with_derivatives(value, specs):
    """`(*captures, score, b, h, q, kv) -> (output, d output / d score, d output / d read...)`, one partial for each
    read of a floating capture, in the order the function reads."""
    count = len(specs)
    floating = [jnp.issubdtype(s.dtype, jnp.floating) for s in specs]

    def fn(*operands):
        captures, (score, *coordinates) = operands[:count], operands[count:]
        reads = []
        _evaluate(value.jaxpr, value.consts, operands, count, lambda c, load: reads.append((c, load())) or reads[-1][1])

        def substituted(s, *read_values):
            it = iter(read_values)
            return _evaluate(value.jaxpr, value.consts, (*captures, s, *coordinates), count,
                             lambda c, load: next(it))[0]

        values = [x for _, x in reads]
        out, slope = jax.jvp(lambda s: substituted(s, *values), (score,), (jnp.ones_like(score),))
        partials = []
        for k, (c, x) in enumerate(reads):
            if floating[c]:
                def at(r, k=k):
                    return substituted(score, *values[:k], r, *values[k + 1:])
                partials.append(jax.jvp(at, (x,), (jnp.ones_like(x),))[1].astype(jnp.float32))
        return (out, slope, *partials)
    return fn


def _evaluate(jaxpr, consts, operands, count: int, on_read):
    """Evaluates `jaxpr` on `operands` (the first `count` of them captures) by binding its equations, as
    `jax.core.eval_jaxpr` does, except that every read of a capture (a `dynamic_slice`) is
    `on_read(capture, load) -> value`, `load()` performing it. Calls that receive a capture are inlined so that
    their reads are seen."""
    env = {}
    capture_of = {}

    def read(atom):
        return atom.val if hasattr(atom, "val") else env[atom]

    for var, x in zip(jaxpr.constvars, consts):
        env[var] = x
    for i, (var, x) in enumerate(zip(jaxpr.invars, operands)):
        env[var] = x
        if i < count and np.shape(x) == ():  # a scalar capture is read once, first, and then used as a value
            env[var] = on_read(i, lambda x=x: x)
        elif i < count:
            capture_of[var] = i
    return _run(jaxpr, env, capture_of, read, on_read)


def _run(jaxpr, env, capture_of, read, on_read):
    for eqn in jaxpr.eqns:
        args = [read(a) for a in eqn.invars]
        holds = [capture_of.get(a) if not hasattr(a, "val") else None for a in eqn.invars]
        if eqn.primitive.name == "dynamic_slice" and holds[0] is not None:
            outs = [on_read(holds[0], lambda: jax.lax.dynamic_slice(args[0], args[1:], eqn.params["slice_sizes"]))]
        elif eqn.primitive.name == "slice" and holds[0] is not None:  # a read at constant indices
            outs = [on_read(holds[0], lambda: jax.lax.slice(args[0], eqn.params["start_indices"],
                                                            eqn.params["limit_indices"]))]
        elif eqn.primitive.name in _CALLS and any(h is not None for h in holds):
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            inner_jaxpr = getattr(inner, "jaxpr", inner)
            inner_env = dict(zip(inner_jaxpr.constvars, getattr(inner, "consts", ())))
            inner_env.update(zip(inner_jaxpr.invars, args))
            inner_captures = {v: h for v, h in zip(inner_jaxpr.invars, holds) if h is not None}
            outs = _run(inner_jaxpr, inner_env, inner_captures,
                        lambda a: a.val if hasattr(a, "val") else inner_env[a], on_read)
        else:
            params = eqn.primitive.get_bind_params(eqn.params)
            subfuns, params = params if isinstance(params, tuple) else ((), params)
            outs = eqn.primitive.bind(*subfuns, *args, **params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        for var, x in zip(eqn.outvars, outs):
            env[var] = x
    return [read(a) for a in jaxpr.outvars]


def _check_elementwise(jaxpr, count: int, kind: str, name: str, where: str) -> None:
    """Every value is a scalar, except reads of a capture (one element, by scalar indices) and their squeeze. A
    scalar capture (a traced window size) is a value like any other."""
    _check_equations(jaxpr, {v for v in jaxpr.invars[:count] if v.aval.shape}, f"{where}: {kind} {name}")


def _check_equations(jaxpr, captures: set, what: str) -> None:
    reads = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("dynamic_slice", "slice") and _holds(eqn.invars[0], captures):
            if eqn.outvars[0].aval.size != 1:
                raise TypeError(f"{what} reads a slice of a captured array; read one element at a time with "
                                "integer scalar indices, e.g. doc[q_idx] or bias[h, q_idx - kv_idx]")
            reads.update(eqn.outvars)
            continue
        if eqn.primitive.name in _CALLS:
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            inner = getattr(inner, "jaxpr", inner)
            passed = {v for v, a in zip(inner.invars, eqn.invars) if not hasattr(a, "val") and a in captures}
            _check_equations(inner, passed, what)
            continue
        for var in eqn.invars:
            if _holds(var, captures):
                raise TypeError(f"{what} uses a captured array in {eqn.primitive.name}; read it one element at a "
                                "time with integer scalar indices (doc[q_idx], bias[h, q_idx - kv_idx]) and compute "
                                "on the scalars")
        if eqn.primitive.name in ("squeeze", "reshape") and _holds(eqn.invars[0], reads):
            continue
        for var in eqn.outvars:
            if var.aval.shape:
                raise TypeError(f"{what} computes an array ({eqn.primitive.name} -> {var.aval.str_short()}); it "
                                "must be elementwise on its scalar arguments, reading captured arrays one element "
                                "at a time")


def _holds(atom, variables: set) -> bool:
    return not hasattr(atom, "val") and atom in variables


def _x64() -> bool:
    """64-bit types are on (globally or in this thread)."""
    return jax.dtypes.canonicalize_dtype(jnp.float64) == jnp.float64


def _returns_right_kind(out, kind: str) -> bool:
    """A mask_mod returns one boolean; the others one floating-point number."""
    if jnp.shape(out) != ():
        return False
    if kind == "mask_mod":
        return jnp.result_type(out) == jnp.bool_
    return jnp.issubdtype(jnp.result_type(out), jnp.floating)
