"""The rows a device sends in one piece of the halo exchange, gathered so that reverse mode adds the cotangents of
every piece into one array.

Each piece sends some of the device's rows, `x[send[start:start + count]]`. Gathered with a `jnp.take` per piece,
reverse mode gives each piece its own array of the device's rows, filled with zeros, to scatter its cotangents into,
and XLA adds those arrays after (it folds at most one of them into the sum). Each of them, the size of the device's
features, is written, scattered into and read again beside the last transfer: a training step pays for them in time
and memory (DESIGN.md, "Several devices", has the numbers).

Here each piece's gather also passes `x` on, and the next piece gathers from what it passed: `rows, x = send_rows(x,
...)`, piece after piece. Transposed, the cotangent of the `x` passed on (every later piece's, added up) is the
array this piece's cotangents are scatter-added into, in place, and that sum flows back to the piece before. The
chain also keeps each piece's gather where the caller puts it (after a barrier), so no two pieces' send buffers need
to live at once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jinsum._rules._avals import varying

send_rows_p = Primitive("jinsum_shard_send_rows")
send_rows_p.multiple_results = True


def send_rows(x: jax.Array, send: jax.Array, start: int, count: int) -> tuple[jax.Array, jax.Array]:
    """`(x[send[start:start + count]], x)`: the rows of `x` (its first axis) that a piece sends, and `x` for the next
    piece to gather from. `send[start:start + count]` are sorted row indices in bounds."""
    return send_rows_p.bind(x, send, start=int(start), count=int(count))


def _send_rows(x, send, *, start, count):
    x = jnp.asarray(x)
    return x.at[send[start:start + count]].get(indices_are_sorted=True, mode="promise_in_bounds"), x


def _abstract_eval(x, send, *, start, count):
    return varying((count, *x.shape[1:]), x.dtype, (x, send)), x


send_rows_p.def_impl(jax.jit(_send_rows, static_argnames=("start", "count")))
send_rows_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(send_rows_p, mlir.lower_fun(_send_rows, multiple_results=True))


# --- differentiation: linear in `x` ------------------------------------------------------------------------------

def _jvp(primals, tangents, *, start, count):
    x, send = primals
    out = send_rows_p.bind(x, send, start=start, count=count)
    if type(tangents[0]) is ad.Zero:
        return out, [ad.Zero.from_primal_value(o) for o in out]
    return out, send_rows_p.bind(tangents[0], send, start=start, count=count)


def _transpose(cts, x, send, *, start, count):
    assert ad.is_undefined_primal(x) and not ad.is_undefined_primal(send)
    rows, passed = cts
    if type(rows) is ad.Zero:
        return passed, None
    if type(passed) is ad.Zero:  # (the last piece: zeros like the cotangent, varying over the same mesh axes)
        passed = jnp.zeros_like(rows, shape=x.aval.shape)
    return passed.at[send[start:start + count]].add(rows, indices_are_sorted=True, mode="promise_in_bounds"), None


ad.primitive_jvps[send_rows_p] = _jvp
ad.primitive_transposes[send_rows_p] = _transpose


# --- vmap ----------------------------------------------------------------------------------------------------------

def _batch(args, dims, *, start, count):
    x, send = args
    x_dim, send_dim = dims
    if send_dim is None:  # (the indices the same for every member): rows stay first, the batch axis goes second
        return send_rows_p.bind(jnp.moveaxis(x, x_dim, 1), send, start=start, count=count), (1, 1)
    out = jax.vmap(lambda x, send: _send_rows(x, send, start=start, count=count), in_axes=(x_dim, send_dim))(x, send)
    return out, (0, 0)


batching.primitive_batchers[send_rows_p] = _batch
