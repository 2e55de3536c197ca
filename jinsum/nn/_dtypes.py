"""The layers' one dtype policy: Flax's, as `nnx.Linear` applies it, so that every layer of `jinsum.nn` reads
`dtype=` and `param_dtype=` the same way.

- `param_dtype` (default float32) is the dtype the parameters are created and stored in;
- `dtype` is the computation's: features, weights and the sparse values (edge weights, adjacency values) are cast
  to it before the layer's products, whose accumulation is the statements' own (float32 for bfloat16 operands);
- `dtype=None` computes in JAX's promotion (`jnp.result_type`) of the inputs and the parameters: bfloat16
  features with float32 parameters compute (and return) float32, as `nnx.Linear(..., dtype=None)` does; bfloat16
  features with bfloat16 parameters, bfloat16;
- integer (or boolean) features are cast to the float of that promotion (with no floating operand, float32), as
  `nnx.Linear` casts them.

Layers that wrap modules of their own (`GINConv`'s `mlp`, `DynamicEdgeConv`'s `nn`, ...) apply `dtype` to their own
arithmetic; the wrapped modules compute by their own `dtype`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax.nnx.nn.dtypes import canonicalize_dtype


def check_dtypes(where: str, dtype=None, param_dtype=jnp.float32) -> None:
    """Raises a clear error at construction unless `dtype` is None or a floating (inexact) dtype and `param_dtype`
    is a floating dtype: a later call would otherwise fail inside a product, far from the argument."""
    for name, value in (("dtype", dtype), ("param_dtype", param_dtype)):
        if value is None and name == "dtype":
            continue
        try:  # (None is no dtype here, though NumPy reads it as float64)
            got = None if value is None else jnp.dtype(value)
        except TypeError:
            got = None
        if got is None or not jnp.issubdtype(got, jnp.inexact):
            allowed = " or None (JAX's promotion of the inputs and parameters)" if name == "dtype" else ""
            raise TypeError(f"{where}: {name} must be a floating dtype such as jnp.float32 or jnp.bfloat16{allowed}, "
                            f"got {value!r}" + ("" if got is None else f" ({got.name})"))


def compute_dtype(dtype, *arrays) -> jnp.dtype:
    """The dtype a layer computes in: `dtype` where given, else JAX's promotion of `arrays` (the inputs and the
    parameters; None entries and Python scalars, weakly typed, take part as `jnp.result_type` has them), made
    floating (integers promote with float32). Flax's `canonicalize_dtype(..., inexact=True)`."""
    return jnp.dtype(canonicalize_dtype(*arrays, dtype=dtype, inexact=True))


def promote(dtype, *arrays) -> tuple[jax.Array, ...]:
    """`arrays` cast to `compute_dtype(dtype, *arrays)` (None entries stay None): Flax's `promote_dtype`, as
    `nnx.Linear` applies it to its input, kernel and bias."""
    to = compute_dtype(dtype, *arrays)
    return tuple(None if a is None else jnp.asarray(a, to) for a in arrays)
