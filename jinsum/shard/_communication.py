"""How many bytes a device receives per call of a function, read off its traced program."""

from __future__ import annotations

from collections import Counter

import jax
import numpy as np


def _nbytes(var) -> int:
    return var.aval.size * var.aval.dtype.itemsize


def _received(eqn, axis_sizes: dict) -> int | None:
    """Bytes one device receives in a collective of the traced program (None: not a collective); `axis_sizes`:
    the devices along each axis of the enclosing `shard_map`'s mesh."""
    name = eqn.primitive.name
    if name == "ppermute":
        return sum(map(_nbytes, eqn.invars))
    if name == "all_gather":  # every block but its own
        return sum(map(_nbytes, eqn.outvars)) - sum(map(_nbytes, eqn.invars))
    if name in ("reduce_scatter", "psum_scatter"):  # the others' pieces of its block
        return sum(map(_nbytes, eqn.invars)) - sum(map(_nbytes, eqn.outvars))
    if name == "all_to_all":  # all pieces but its own
        names = eqn.params["axis_name"]
        size = int(np.prod([axis_sizes[a] for a in (names if isinstance(names, tuple) else (names,))]))
        return sum(map(_nbytes, eqn.invars)) * (size - 1) // size
    if name in ("psum", "psum_invariant", "all_reduce"):
        return sum(map(_nbytes, eqn.invars))
    return None


def _subjaxprs(value):
    if isinstance(value, jax.extend.core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jax.extend.core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _subjaxprs(item)


def communication(fn, *args) -> dict[str, int]:
    """Bytes each device receives per call of `fn(*args)`, by collective (`ppermute`, `all_gather`, ...), from
    the collectives written in the program: those of `jinsum.shard`'s exchanges and their transposes in a
    gradient. Collectives XLA's partitioner adds on its own (the all-reduce of a replicated weight's gradient, of
    a loss) are not in the program and not counted.

    Example:
      >>> edge_index = np.array([[0, 1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 0]])   # a ring of 8 nodes
      >>> mesh = jax.make_mesh((jax.device_count(),), ("x",))
      >>> P = jinsum.shard.partition(jinsum.graphs.adjacency(edge_index, 8), mesh)
      >>> x = P.shard_rows(jnp.ones((8, 4)))
      >>> jinsum.shard.communication(lambda x: P @ x, x)    # on 2 devices or more: one row of 4 float32 each
      {'ppermute': 16}
      >>> jinsum.shard.communication(jax.grad(lambda x: (P @ x).sum()), x)   # the forward's and its transpose's
      {'ppermute': 32}
    """
    if not callable(fn):
        raise TypeError(f"jinsum.shard.communication: fn must be callable (called as fn(*args)), got "
                        f"{type(fn).__name__}")
    totals: Counter = Counter()

    def walk(jaxpr, axis_sizes):
        for eqn in jaxpr.eqns:
            received = _received(eqn, axis_sizes)
            if received is not None:
                totals[eqn.primitive.name] += received
            mesh = eqn.params.get("mesh")  # (a shard_map: the axes its body's collectives run over)
            inner = {**axis_sizes, **dict(mesh.shape)} if mesh is not None else axis_sizes
            for value in eqn.params.values():
                for sub in _subjaxprs(value):
                    walk(sub, inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr, {})
    return dict(totals)
