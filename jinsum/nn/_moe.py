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

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

import jinsum
from jinsum.formats import GroupCOO
from jinsum.nn._routing import route_tokens

# Statements (the names are their operands'). `A=` binds the routing: Ai the expert of each group, Ak the token of
# each slot, Av its combine weight.
_GATHERED = "H[g,p,h] += X[Ak[g,p],c] * W[Ai[g],c,h]"
_GROUPED = "O[g,p,n] += H[g,p,h] * W[Ai[g],h,n]"
_COMBINE = "Y[Ak[g,p],n] += Av[g,p] * O[g,p,n]"

# `nnx.Linear`'s kernel initialiser (LeCun normal) for a stack of expert matrices: fan-in is each matrix's own.
expert_kernel_init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))

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
      >>> y = routed_linear(x, route_tokens(x @ w_router, 2).combine, w)
    """
    dtype = _check_routed("routed_linear", x, combine, w)
    A = combine.astype(dtype)
    rows = gathered_product(A, x.astype(dtype), w.astype(dtype))
    return combined(A, rows, jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), dtype))


def gathered_product(A: GroupCOO, x: jax.Array, w: jax.Array) -> jax.Array:
    """`(groups, group size, n)`: each entry's row of `x` (its column of `A`) by its group's matrix `w[Ai[g]]`."""
    return jinsum.einsum(_GATHERED, A=A, X=x, W=w, H=jax.ShapeDtypeStruct((*A.Ak.shape, w.shape[2]), x.dtype))


def combined(A: GroupCOO, rows: jax.Array, start) -> jax.Array:
    """`start` (an array, or a `ShapeDtypeStruct` for zeros) plus each column's rows (grouped order) weighted by
    `A`'s values. Group padding (and capacity's dropped pairs, which are padding too) holds some row's products,
    but its value is 0: it adds nothing and gets no gradient."""
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
      >>> routing = route_tokens(x @ w_router, 2)
      >>> y = routed_mlp(x, routing.combine, w_up, w_down, w_gate=w_gate)
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


class MoE(nnx.Module):
    """A sparse mixture-of-experts MLP: a linear router sends each token to `top_k` of `num_experts` expert MLPs,
    whose outputs are summed with the combine weights (Mixtral's block; Switch's with `top_k=1, norm_topk=False`).

    Routing and losses as `route_tokens`; the experts as `routed_mlp`: indirect Einsums over the routing matrix,
    so the work is the `T * k` routed rows (and
    each expert's last group's padding) whatever the load, and no token is dropped unless `capacity_factor` asks.

    `y, aux_loss = moe(x)`: `x` `(tokens, in_features)` or `(batch, length, in_features)`, `y` of its shape, and
    `aux_loss = balance_coef * balance_loss + z_coef * z_loss`, a scalar to add to the training loss (NNX style:
    returned, not stored on the module). `moe(x, return_routing=True)` returns `y, aux_loss, routing` with the
    `Routing` (the unweighted losses, the dropped count, the experts and weights of each token) to log.

    Parameters: `router` (an `nnx.Linear(in_features, num_experts, use_bias=False)`), `w_gate` and `w_up`
    `(num_experts, in_features, hidden_features)` and `w_down` `(num_experts, hidden_features, in_features)`,
    initialised as `nnx.Linear`'s kernels (LeCun normal, fan-in scaled: each expert's matrix on its own inputs).
    `w_gate` is None unless `activation="swiglu"`.

    Example:
      >>> moe = jinsum.nn.MoE(512, 1024, num_experts=8, top_k=2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
      >>> y, aux_loss = moe(x)                                   # x (batch, length, 512) -> y (batch, length, 512)
      >>> loss = task_loss(y) + aux_loss
    """

    def __init__(self, in_features: int, hidden_features: int, num_experts: int, top_k: int, *,
                 activation: str = "swiglu", norm_topk: bool = True, capacity_factor: float | None = None,
                 balance_coef: float = 0.01, z_coef: float = 0.001, group_size: int | None = None, dtype=None,
                 param_dtype=jnp.float32, kernel_init=expert_kernel_init, rngs: nnx.Rngs):
        """Creates the parameters.

        Args:
          in_features: the tokens' features (also the output's).
          hidden_features: each expert's hidden width.
          num_experts: `E`.
          top_k: experts per token, `1 <= top_k <= E`.
          activation: `"swiglu"` (`silu(x W_gate) * (x W_up)`, three matrices), `"gelu"` (exact) or `"relu"`
            (`act(x W_up)`, two matrices).
          norm_topk: combine weights renormalised over the selected experts (Mixtral) or the full softmax's
            (Switch); see `route_tokens`.
          capacity_factor: None: dropless; else each expert keeps at most `ceil(capacity_factor * T * k / E)`
            tokens per call, the first in token order (`route_tokens`).
          balance_coef: the load balancing loss's weight; 0.01 is Switch's `alpha` (Fedus et al., 2021).
          z_coef: the router z-loss's weight; 0.001 is ST-MoE's `c_z` (Zoph et al., 2022).
          group_size: tokens per group of the routing matrix (a later kernel's row tile); None: the builder's rule.
          dtype: the experts' computation dtype (inputs, weights and combine weights are cast to it; products
            accumulate in float32); None: JAX's promotion of the input and the parameters. The router always runs
            in at least float32.
          param_dtype: the parameters' dtype.
          kernel_init: the experts' initialiser, for `(E, fan_in, fan_out)` arrays.
          rngs: draws the initial values.
        """
        where = "MoE"
        if activation not in ACTIVATIONS:
            raise ValueError(f"{where}: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(f"{where}: top_k must be an int in [1, num_experts = {num_experts}], got {top_k!r}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"{where}: capacity_factor must be positive (or None: no token dropped), got "
                             f"{capacity_factor!r}")
        self.in_features, self.hidden_features = in_features, hidden_features
        self.num_experts, self.top_k, self.activation = num_experts, top_k, activation
        self.norm_topk, self.capacity_factor, self.group_size = norm_topk, capacity_factor, group_size
        self.balance_coef, self.z_coef, self.dtype = balance_coef, z_coef, dtype
        self.router = nnx.Linear(in_features, num_experts, use_bias=False, param_dtype=param_dtype, rngs=rngs)
        up, down = (num_experts, in_features, hidden_features), (num_experts, hidden_features, in_features)
        self.w_gate = (nnx.Param(kernel_init(rngs.params(), up, param_dtype)) if activation == "swiglu" else None)
        self.w_up = nnx.Param(kernel_init(rngs.params(), up, param_dtype))
        self.w_down = nnx.Param(kernel_init(rngs.params(), down, param_dtype))

    def __call__(self, x: jax.Array, *, return_routing: bool = False):
        """`x` `(..., in_features)` -> `(y, aux_loss)`, or `(y, aux_loss, routing)` with `return_routing`."""
        if jnp.ndim(x) not in (2, 3) or jnp.shape(x)[-1] != self.in_features:
            raise ValueError(f"MoE: expected x of shape (tokens, {self.in_features}) or (batch, length, "
                             f"{self.in_features}) (in_features), got {jnp.shape(x)}")
        tokens = x.reshape(-1, self.in_features)
        # The router in at least float32 (Switch's selective precision), whatever the experts' dtype.
        logits = self.router(tokens.astype(jnp.promote_types(tokens.dtype, jnp.float32)))
        routing = route_tokens(logits, self.top_k, norm_topk=self.norm_topk, capacity_factor=self.capacity_factor,
                               group_size=self.group_size)
        weights = [w[...] for w in (self.w_up, self.w_down, *(() if self.w_gate is None else (self.w_gate,)))]
        dtype = self.dtype or jnp.result_type(x, *weights)
        y = routed_mlp(tokens.astype(dtype), routing.combine.astype(dtype), self.w_up[...].astype(dtype),
                       self.w_down[...].astype(dtype),
                       w_gate=None if self.w_gate is None else self.w_gate[...].astype(dtype),
                       activation=self.activation)
        aux_loss = self.balance_coef * routing.balance_loss + self.z_coef * routing.z_loss
        y = y.reshape(*x.shape[:-1], self.in_features)
        return (y, aux_loss, routing) if return_routing else (y, aux_loss)

