"""A sparse mixture of experts (Switch, Mixtral) whose expert products are indirect Einsums over the routing.

Each token goes to `k` of `E` experts (`route_tokens`). The routing is a `GroupCOO` `A` `(experts, tokens)` whose
values are the combine weights; its groups hold tokens of one expert, in token order. The experts' MLP is then
statements over `A`'s entries, with no per-expert loop, no padding to a capacity and no dense dispatch tensor:

    up:      U[g,p,h] += X[Ak[g,p],c] * Wup[Ai[g],c,h]       each entry: its token's row by its expert's matrix
    gate:    G[g,p,h] += X[Ak[g,p],c] * Wgate[Ai[g],c,h]     (SwiGLU), then  H = silu(G) * U  element-wise
    down:    O[g,p,n] += H[g,p,h] * Wdown[Ai[g],h,n]
    combine: Y[Ak[g,p],n] += Av[g,p] * O[g,p,n]              weighted by the combine weight, summed per token

The activations live in grouped order, `(groups, group size, features)`: one row per routed (token, expert) pair,
those of an expert contiguous, which a GPU kernel reads as row tiles of one expert's matrix product (Tensor Core
plans; their derivatives too: `dX[Ak[g,p],c] += dU[g,p,h] * Wup[Ai[g],c,h]` adds each tile's rows into its tokens',
`dWup[Ai[g],c,h] += X[Ak[g,p],c] * dU[g,p,h]` reduces each expert's rows). The combine is a statement apart, not
a factor of the down projection: the combine weights' gradient is then `dAv[g,p] += O[g,p,n] * dY[Ak[g,p],n]`,
a row-wise product of the rows kept, where with `Av` inside the product it would be a three-factor sum that
recomputes the down projection outside Tensor Cores. A mixture of single matrices is the same pair of statements
(`routed_linear`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

import jinsum
from jinsum import _config
from jinsum.formats import GroupCOO

# Statements (the names are their operands'). `A=` binds the routing: Ai the expert of each group, Ak the token of
# each slot, Av its combine weight.
_GATHERED = "H[g,p,h] += X[Ak[g,p],c] * W[Ai[g],c,h]"
_GROUPED = "O[g,p,n] += H[g,p,h] * W[Ai[g],h,n]"
_COMBINE = "Y[Ak[g,p],n] += Av[g,p] * O[g,p,n]"

ACTIVATIONS: dict[str, Callable | None] = {
    "swiglu": None,  # silu(x W_gate) * (x W_up): the gate is a third matrix
    "gelu": lambda h: jax.nn.gelu(h, approximate=False),  # (torch's and Hugging Face's "gelu": the exact one)
    "relu": jax.nn.relu,
}


def routed_linear(x: jax.Array, combine: GroupCOO, w: jax.Array) -> jax.Array:
    """`y_t = sum_e A[e, t] x_t W_e`: each token's weighted sum of its experts' linear maps (the statement
    `Y[Ak[g,p],n] += Av[g,p] * X[Ak[g,p],c] * W[Ai[g],c,n]`, run as its product in grouped order and the combine:
    see the module's docstring).

    Args:
      x: `(tokens, c)`.
      combine: the routing `(num_experts, tokens)` (`route_tokens(...).combine`).
      w: `(num_experts, c, n)`.

    Returns:
      `(tokens, n)`, in the dtype of `x`, `w` and the weights promoted together.

    Example:
      >>> rng = np.random.default_rng(0)
      >>> x, w_router = rng.normal(size=(16, 32)).astype(np.float32), rng.normal(size=(32, 8)).astype(np.float32)
      >>> w = rng.normal(size=(8, 32, 48)).astype(np.float32)              # (experts, c, n)
      >>> jinsum.nn.routed_linear(x, jinsum.nn.route_tokens(x @ w_router, 2).combine, w).shape
      (16, 48)
    """
    dtype = _check_routed("routed_linear", x, combine, w)
    A = combine.astype(dtype)
    rows = gathered_product(A, x.astype(dtype), w.astype(dtype))
    return combined(A, rows, jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), dtype))


def gathered_product(A: GroupCOO, x: jax.Array, w: jax.Array, epilogue: Callable | None = None) -> jax.Array:
    """`(groups, group size, n)`: each entry's row of `x` (its column of `A`) by its group's matrix `w[Ai[g]]`,
    then `epilogue(value, g, p, n)` where given (`jinsum.einsum`'s: in the kernel's registers on GPUs).

    An entry of value 0 (group padding, a dropped pair) reads no row where `slot_columns` drops it: its product is
    0 (before the epilogue). Whatever multiplies it by its value (the combine) gets 0 and gives its value a 0
    gradient there, which a softmax's logits do not see (it scales their gradient by that 0)."""
    columns = slot_columns(A)
    return jinsum.einsum(_GATHERED, Ak=A.Ak if columns is None else columns, Ai=A.Ai, X=x, W=w,
                         sorted_indices=("Ai",), H=jax.ShapeDtypeStruct((*A.Ak.shape, w.shape[2]), x.dtype),
                         epilogue=epilogue)


def slot_columns(A: GroupCOO) -> jax.Array | None:
    """`A.Ak` with -1 (out of range: read as zeros, written nowhere) at the entries of value 0, or None where that
    -1 would be reported and padding keeps its column: outside `jit` (concrete indices are checked on the host)
    and under `jinsum.check_indices`. A product's input gradient then adds nothing for padding, a clear gain
    measured while padding sat at column 0 and queued its atomic additions on row 0 (the builders now spread
    padding's columns, which removes the queue but not the additions): benchmarks/README.md, "Mixtures of experts
    and grouped products (`moe.py`, `grouped_forms.py`, `hetero_linear.py`)"."""
    columns = _active_columns(A.Av, A.Ak)
    if _config.check_indices.value or not isinstance(columns, jax.core.Tracer):
        return None
    return columns


@jax.jit
def _active_columns(values: jax.Array, columns: jax.Array) -> jax.Array:
    """`columns` with -1 at the entries of value 0 (one compiled program: eagerly each operation compiles alone)."""
    return jnp.where(_nonzero(values), columns, -1)


def _nonzero(values: jax.Array) -> jax.Array:
    """`(G, P)`: whether each entry's value (of any trailing shape) is nonzero."""
    return (values != 0).reshape(*values.shape[:2], math.prod(values.shape[2:])).any(axis=-1)


def combined(A: GroupCOO, rows: jax.Array, start) -> jax.Array:
    """`start` (an array, or a `ShapeDtypeStruct` for zeros) plus each column's rows (grouped order) weighted by
    `A`'s values. Group padding (and capacity's dropped pairs, which are padding too) holds zeros or some row's
    products (`gathered_product`), but its value is 0: it adds nothing and gets no gradient."""
    return jinsum.einsum(_COMBINE, A=A, O=rows, Y=start)


def routed_mlp(x: jax.Array, combine: GroupCOO, w_up: jax.Array, w_down: jax.Array, *,
               w_gate: jax.Array | None = None, activation: str = "swiglu") -> jax.Array:
    """Every token through its experts' MLPs, weighted by the combine weights and summed.

    `y_t = sum_e A[e, t] f_e(x_t)` with `f_e(x) = (silu(x Wg_e) * (x Wu_e)) Wd_e` (SwiGLU, `w_gate` given) or
    `act(x Wu_e) Wd_e` (`activation` `"gelu"` or `"relu"`).

    Args:
      x: `(tokens, c)`.
      combine: the routing `(num_experts, tokens)` (`route_tokens(...).combine`).
      w_up, w_gate: `(num_experts, c, hidden)`; `w_gate` for SwiGLU only.
      w_down: `(num_experts, hidden, c_out)`.
      activation: `"swiglu"`, `"gelu"` (exact) or `"relu"`.

    Returns:
      `(tokens, c_out)`, in the dtype of the inputs promoted together (products accumulate in float32).

    Example:
      >>> rng = np.random.default_rng(0)
      >>> x, w_router = rng.normal(size=(16, 32)).astype(np.float32), rng.normal(size=(32, 8)).astype(np.float32)
      >>> w_up, w_gate, w_down = (rng.normal(size=s).astype(np.float32) for s in ((8, 32, 64),) * 2 + ((8, 64, 32),))
      >>> routing = jinsum.nn.route_tokens(x @ w_router, 2)
      >>> jinsum.nn.routed_mlp(x, routing.combine, w_up, w_down, w_gate=w_gate).shape
      (16, 32)
    """
    where = "routed_mlp"
    if activation not in ACTIVATIONS:
        raise ValueError(f"{where}: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if (activation == "swiglu") != (w_gate is not None):
        raise ValueError(f"{where}: activation {activation!r} " + ("needs w_gate (SwiGLU's third matrix)"
                         if w_gate is None else "takes no w_gate (only 'swiglu' has a gate)"))
    dtype = _check_routed(where, x, combine, w_up, *(() if w_gate is None else (w_gate,)))
    if w_down.ndim != 3 or w_down.shape[:2] != w_up.shape[::2]:
        raise ValueError(f"{where}: expected w_down of shape (num_experts, hidden, c_out) with (num_experts, hidden) "
                         f"= {w_up.shape[::2]} (from w_up), got {tuple(w_down.shape)}")
    A, x = combine.astype(dtype), x.astype(dtype)
    if w_gate is None:  # (groups, group size, hidden): every routed pair's token row by its expert's matrix
        hidden = ACTIVATIONS[activation](gathered_product(A, x, w_up.astype(dtype)))
    else:
        hidden = jax.nn.silu(gathered_product(A, x, w_gate.astype(dtype))) * gathered_product(A, x, w_up.astype(dtype))
    down = jinsum.einsum(_GROUPED, A=A, H=hidden, W=w_down.astype(dtype),
                         O=jax.ShapeDtypeStruct((*A.Ak.shape, w_down.shape[2]), dtype))
    return combined(A, down, jax.ShapeDtypeStruct((x.shape[0], w_down.shape[2]), dtype))


def _check_routed(where: str, x, combine, *weights) -> jnp.dtype:
    """Shapes of a routed product's operands; returns the computation's dtype."""
    if not isinstance(combine, GroupCOO):
        raise TypeError(f"{where}: expected the routing as a jinsum.GroupCOO (num_experts, tokens), got "
                        f"{type(combine).__name__}; build it with jinsum.nn route_tokens(logits, top_k).combine")
    if x.ndim != 2 or combine.shape[1] != x.shape[0]:
        raise ValueError(f"{where}: expected x of shape (tokens, features) with tokens = {combine.shape[1]} (the "
                         f"routing's columns), got {tuple(x.shape)}")
    for w in weights:
        if w.ndim != 3 or w.shape[:2] != (combine.shape[0], x.shape[1]):
            raise ValueError(f"{where}: expected expert weights of shape (num_experts, features, out) with "
                             f"(num_experts, features) = {(combine.shape[0], x.shape[1])}, got {tuple(w.shape)}")
    return jnp.result_type(x, combine.dtype, *weights)
