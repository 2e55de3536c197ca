"""A linear layer with one weight per type of row (PyG's `HeteroLinear`): `out[i] = x[i] W[t_i] + b[t_i]`.

The rows are grouped by type on the device (one stable sort of the type vector, as PyG's `index_sort`), into a
`GroupCOO` `A` of shape `(num_types, N)` with `A[t, i] = 1` where row `i` has type `t`, and the product is a
statement over the typed weights,

    Y[Ak[g,p],o] += Av[g,p] * X[Ak[g,p],c] * W[Ai[g],c,o]

run as a mixture of experts runs it (`jinsum.nn._moe`): the rows' products in grouped order (each group's type's
bias added in the same kernel), then each stored into its row, which has no other. Each group holds up to `P` rows
of one type, so a group's rows are one tile of one weight matrix (a segment matmul: Tensor Core plans on GPUs, a
batched product in XLA's lowering), and the weight's gradient sums each type's rows before one write. The notation
also accepts the type vector directly, `Y[i,o] += X[i,c] * W[T[i],c,o]`, but XLA's lowering of that gathers a whole
weight matrix per row (an `(N, in, out)` array) and its weight gradient scatters `N` such matrices into `num_types`;
on a CPU at N = 8192, 64 x 64, 8 types it ran 13x slower forward than the grouped statement. The format is built
without its entries in column order: with them, the input's gradient would run over the entries one by one,
gathering a weight matrix per row again (12x slower there).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import checkify

import jinsum
from jinsum import _config
from jinsum.formats import GroupCOO
from jinsum.formats._build import row_lengths
from jinsum.nn._dtypes import check_dtypes, compute_dtype
from jinsum.nn._moe import combined, gathered_product, slot_columns
from jinsum.nn._routing import routed_group_size

_WHERE = "HeteroLinear"


def pyg_weight_init(key, shape, dtype=jnp.float32):
    """PyG's default weight initialisation (`kaiming_uniform` with `a = sqrt(5)` and `fan = in_features`):
    `U(-1/sqrt(in), 1/sqrt(in))` for a `(num_types, in, out)` weight, each type drawn as its own matrix."""
    init = nnx.initializers.variance_scaling(1 / 3, "fan_in", "uniform", in_axis=-2, out_axis=-1, batch_axis=(0,))
    return init(key, shape, dtype)


def _pyg_bias_init(in_features: int):
    """PyG's default bias initialisation, `U(-1/sqrt(in), 1/sqrt(in))`: its bound is the weight's fan-in, which the
    bias's shape does not carry."""
    bound = 1 / np.sqrt(in_features)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


class HeteroLinear(nnx.Module):
    """`out[i] = x[i] @ weight[type_vec[i]] + bias[type_vec[i]]`: a separate linear map per type (PyG's
    `torch_geometric.nn.HeteroLinear`, and its parameter layout: `weight` `(num_types, in_features, out_features)`,
    `bias` `(num_types, out_features)`).

    Rows of any type order may come in: they are grouped by type inside the call, so a jitted step compiles once
    for every type vector of the same length. Types with no rows cost nothing.

    Example:
      >>> lin = jinsum.nn.HeteroLinear(16, 32, num_types=3, rngs=nnx.Rngs(0))
      >>> x, type_vec = jnp.ones((5, 16)), jnp.array([2, 0, 2, 1, 0])   # x (N, 16), type_vec int (N,) in [0, 3)
      >>> nnx.jit(lambda lin, x, type_vec: lin(x, type_vec))(lin, x, type_vec).shape
      (5, 32)
    """

    def __init__(self, in_features: int, out_features: int, num_types: int, *, bias: bool = True, dtype=None,
                 param_dtype=jnp.float32, weight_init=pyg_weight_init, bias_init=None, rngs: nnx.Rngs):
        """Creates the parameters.

        Args:
          in_features, out_features: the sizes of `x`'s last axis and of the output's.
          num_types: `T`, the number of types (and of weight matrices).
          bias: add a learned bias per type.
          dtype: the computation's dtype (inputs and parameters are cast to it, as `nnx.Linear` casts them;
            products accumulate as their statements do, in float32 for bfloat16); None: JAX's promotion of the
            input and the parameters (`jinsum.nn._dtypes`).
          param_dtype: the parameters' dtype.
          weight_init: initialiser of the `(T, in, out)` weight. The default is PyG's (`U(+-1/sqrt(in))`); PyG's
            `weight_initializer="glorot"` is `nnx.initializers.glorot_uniform(in_axis=-2, out_axis=-1,
            batch_axis=(0,))`.
          bias_init: initialiser of the `(T, out)` bias; None is PyG's default, `U(+-1/sqrt(in))` (PyG's
            `bias_initializer="zeros"` is `nnx.initializers.zeros_init()`).
          rngs: draws the initial values.
        """
        for name, value in (("in_features", in_features), ("out_features", out_features), ("num_types", num_types)):
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{_WHERE}: {name} must be a positive int, got {value!r}")
        self.in_features, self.out_features, self.num_types = int(in_features), int(out_features), int(num_types)
        check_dtypes(_WHERE, dtype, param_dtype)
        self.dtype = dtype
        self.weight = nnx.Param(weight_init(rngs.params(), (num_types, in_features, out_features), param_dtype))
        if bias_init is None:
            bias_init = _pyg_bias_init(in_features)
        self.bias = nnx.Param(bias_init(rngs.params(), (num_types, out_features), param_dtype)) if bias else None

    def __call__(self, x: jax.Array, type_vec: jax.Array) -> jax.Array:
        """`x` `(N, in_features)`, `type_vec` int `(N,)` with values in `[0, num_types)` -> `(N, out_features)`.

        A type out of range is a `ValueError` when `type_vec` is concrete. Under `jit` its row reads no weight and
        no bias (the row is 0), as jinsum's out-of-range reads give 0; under `jinsum.check_indices` it is a
        `checkify` error.
        """
        x, type_vec = jnp.asarray(x), jnp.asarray(type_vec)
        self._check_inputs(x, type_vec)
        weight, bias = jnp.asarray(self.weight[...]), None if self.bias is None else jnp.asarray(self.bias[...])
        dtype = compute_dtype(self.dtype, x, weight, bias)
        A = rows_by_type(type_vec, self.num_types).astype(dtype)
        epilogue = None
        if bias is not None:  # each group's type's bias, added to its rows' products in the product's kernel
            # (float32 at least: its gradient sums every row of a type, which in bfloat16 loses every digit)
            group_bias = bias.astype(jnp.promote_types(bias.dtype, jnp.float32))[A.Ai]

            def epilogue(value, g, p, o):
                return value + group_bias[g, o]
        # `Y[Ak[g,p],o] += Av[g,p] * X[Ak[g,p],c] * W[Ai[g],c,o]` as MoE runs it: the rows' products in grouped order
        # (a Tensor Core plan on GPUs), then each into its row. A row has one slot: under `jit` the slots are stored
        # into their rows (padding, column -1, nowhere), not added (atomically, into float32, cast after: a large
        # share of the forward; benchmarks/README.md, "Mixtures of experts and grouped products (`moe.py`,
        # `grouped_forms.py`, `hetero_linear.py`)"); elsewhere padding keeps its column and is added with its
        # value, 0. Rows of no type (out of range) stay 0.
        products = gathered_product(A, x.astype(dtype), weight.astype(dtype), epilogue=epilogue)
        out = jax.ShapeDtypeStruct((x.shape[0], self.out_features), dtype)
        columns = slot_columns(A)
        if columns is None:
            return combined(A, products, out)
        return jinsum.einsum("Y[K[g,p],o] = H[g,p,o]", K=columns, H=products, Y=out)

    def _check_inputs(self, x: jax.Array, type_vec: jax.Array) -> None:
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"{_WHERE}: expected x of shape (N, in_features = {self.in_features}), got "
                             f"{tuple(x.shape)}")
        if type_vec.shape != (x.shape[0],) or not jnp.issubdtype(type_vec.dtype, jnp.integer):
            raise ValueError(f"{_WHERE}: expected type_vec an integer array of shape (N,) = ({x.shape[0]},), one "
                             f"type per row of x {tuple(x.shape)}, got {type_vec.dtype}{list(type_vec.shape)}")
        if not isinstance(type_vec, jax.core.Tracer):
            values = np.asarray(type_vec)
            bad = np.flatnonzero((values < 0) | (values >= self.num_types))
            if bad.size:
                raise ValueError(f"{_WHERE}: type_vec[{bad[0]}] = {values[bad[0]]} is out of range for num_types = "
                                 f"{self.num_types}; every type must lie in [0, {self.num_types})")
        elif _config.check_indices.value:
            checkify.check(jnp.all((type_vec >= 0) & (type_vec < self.num_types)),
                           f"{_WHERE}: type_vec holds a type outside [0, num_types = {self.num_types})")


def rows_by_type(type_vec: jax.Array, num_types: int) -> GroupCOO:
    """`A` `(num_types, N)` with `A[t, i] = 1` where `type_vec[i] == t`, traceable: its shapes depend only on `N`
    and `num_types`. Rows whose type is out of range are in no group."""
    starts, order = _rows_in_type_order(type_vec, num_types)
    # No column order: the input's gradient then runs over the groups as the forward does (module docstring).
    # Groups of the grouped product's row tile where the padding stays small (`routed_group_size`, as MoE's).
    return GroupCOO.from_csr(starts, order, num_columns=type_vec.shape[0], with_transpose=False,
                             group_size=routed_group_size(type_vec.shape[0], num_types))


@partial(jax.jit, static_argnums=1)
def _rows_in_type_order(type_vec: jax.Array, num_types: int) -> tuple[jax.Array, jax.Array]:
    """`rows_by_type`'s CSR index, one compiled program (eagerly each operation would compile on its own): each
    type's first position `(num_types + 1,)` and the rows by type, int32 `(N,)`, out-of-range types last."""
    valid = (type_vec >= 0) & (type_vec < num_types)
    key = jnp.where(valid, type_vec, num_types)  # out-of-range types sort last, past the last type's rows
    order = jnp.argsort(key, stable=True)  # stable: a type's rows stay in order, for locality
    counts = row_lengths(jnp, key[order], num_types)  # (of the sorted keys: a histogram's atomics would queue)
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts[:num_types], dtype=jnp.int32)])
    return starts, order.astype(jnp.int32)
