"""Top-k routing of tokens to experts, on the device: the routing of a mixture of experts as a sparse matrix.

A router's logits `(tokens, experts)` pick each token's `k` most probable experts. The pairs `(expert, token)`
with their combine weights are a `GroupCOO` of shape `(experts, tokens)`, built inside `jit` by the formats' device
builder (`GroupCOO.from_edge_index(..., capacity=)`), so the expert layers are indirect Einsums over it:

    Y[Ak[g,p],n] += Av[g,p] * X[Ak[g,p],c] * W[Ai[g],c,n]      (each token's weighted sum of its experts' X W_e)

Its rows are the experts and each group holds tokens of one expert, so a group is a row tile of one expert's
matrix product (`jinsum.nn.MoE`). `routed_linear` and `routed_mlp` run such statements as their products in
grouped order and a combine (`jinsum.nn._moe`), whose derivatives are each a Tensor Core product or a pass over
the rows. Written as one statement, the CUDA route splits it and its derivatives the same way
(`jinsum._lowering._route.contracted_first`), while XLA's lowering gathers a weight matrix per group. The same
call returns the two auxiliary losses of sparse mixtures: Switch's load balancing loss and ST-MoE's router z-loss.
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jinsum.formats import GroupCOO
from jinsum.formats._convert import check_int


class Routing(NamedTuple):
    """Where each token goes and the router's auxiliary losses (a pytree: it passes through `jit` and `grad`).

    Attributes:
      combine: the `GroupCOO` `(num_experts, tokens)` whose entry `[e, t]` is token `t`'s combine weight at expert
        `e`, one entry per kept (token, expert) pair; its static `nnz` (a capacity) bounds the entries. None
        under expert parallelism (`expert_parallel_mlp`), where each device builds its own.
      experts: int32 `(tokens, k)`, each token's `k` distinct experts, most probable first.
      weights: `(tokens, k)`, their combine weights; 0 where capacity dropped the pair.
      balance_loss: Switch's load balancing loss, `E * sum_e f_e * P_e` (see `route_tokens`); `k` when the load
        and the probabilities are uniform, 0 for no tokens.
      z_loss: ST-MoE's router z-loss, `mean_t logsumexp(logits_t)^2`; 0 for no tokens.
      dropped: int32 scalar, the (token, expert) pairs left out by the capacity (0 without one).
    """

    combine: GroupCOO | None
    experts: jax.Array
    weights: jax.Array
    balance_loss: jax.Array
    z_loss: jax.Array
    dropped: jax.Array


# Groups of the routing matrix are the expert kernels' row tiles: 128 rows where a product is wide enough
# (`jinsum.kernels._plan.default_config`), smaller ones where padding each expert's last group would cost more.
ROW_TILES = (128, 64, 32, 16)


def routed_group_size(capacity: int, num_experts: int) -> int | None:
    """The largest row tile whose worst-case padding (every expert's last group nearly empty: `(P - 1) E` slots)
    is at most an eighth of the capacity; None (the builder's rule) where none is."""
    return next((p for p in ROW_TILES if 8 * (p - 1) * num_experts <= capacity), None)


def expert_capacity(capacity_factor: float, num_tokens: int, top_k: int, num_experts: int) -> int:
    """The most tokens one expert keeps: `ceil(capacity_factor * tokens * k / E)` (Switch's capacity, with `k`
    assignments per token), at most every token."""
    return min(num_tokens, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def check_logits(where: str, logits) -> jax.Array:
    """`logits` as a floating `(tokens, num_experts)` array, else a `ValueError` from `where`."""
    logits = jnp.asarray(logits)
    if logits.ndim != 2 or not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"{where}: expected floating logits of shape (tokens, num_experts), got "
                         f"{logits.dtype}{list(logits.shape)}; flatten a batch's leading axes into tokens first")
    return logits


def check_routing(where: str, num_experts, top_k, capacity_factor) -> int:
    """That `num_experts` is a positive int, `top_k` an int in `[1, num_experts]` (any integer, NumPy's too) and
    `capacity_factor` None or positive, else a `TypeError` or `ValueError` naming the argument. Returns `top_k` as a
    Python int."""
    check_int(where, "num_experts", num_experts, minimum=1)
    top_k = check_int(where, "top_k", top_k, minimum=1)
    if top_k > num_experts:
        raise ValueError(f"{where}: top_k must be an int in [1, num_experts = {num_experts}], got {top_k}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"{where}: capacity_factor must be positive (or None: nothing dropped), got "
                         f"{capacity_factor!r}")
    return top_k


def select_experts(logits: jax.Array, top_k: int, norm_topk: bool):
    """Each token's `top_k` experts and combine weights (see `route_tokens`), computed in at least float32.

    Returns `(experts, weights, selected, statistics)`: int32 and float `(T, k)`, the int32 `(T, E)` indicator of
    the selected experts, and the per-expert means `routing_losses` reads, `(fraction f_e, mean probability P_e,
    mean squared logsumexp)` (averages over these tokens: devices that route their own tokens average them over
    the mesh first)."""
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    probabilities = jax.nn.softmax(logits, axis=-1)
    top_logits, experts = jax.lax.top_k(logits, top_k)  # distinct experts, most probable first
    experts = experts.astype(jnp.int32)
    if norm_topk:
        weights = jax.nn.softmax(top_logits, axis=-1)  # = the selected probabilities over their sum
    else:
        weights = jnp.take_along_axis(probabilities, experts, axis=-1)
    selected = jax.nn.one_hot(experts, logits.shape[-1], dtype=jnp.int32).sum(axis=1)  # (T, E), 0 or 1
    # Means over the tokens, each 0 where there are none (an empty shard, a last batch: no load to balance).
    tokens = max(logits.shape[0], 1)
    fraction = selected.sum(axis=0).astype(logits.dtype) / tokens  # f_e: sums to k
    squared_lse = jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2) / tokens
    return experts, weights, selected, (fraction, probabilities.sum(axis=0) / tokens, squared_lse)


def routing_losses(fraction: jax.Array, mean_probability: jax.Array, squared_lse: jax.Array):
    """`(balance_loss, z_loss)` from `select_experts`' statistics (Switch's and ST-MoE's, see `route_tokens`)."""
    return fraction.shape[-1] * jnp.sum(fraction * mean_probability), squared_lse


def route_tokens(logits: jax.Array, top_k: int, *, norm_topk: bool = True, capacity_factor: float | None = None,
                 group_size: int | None = None) -> Routing:
    """Routes each token to its `top_k` most probable experts and builds the routing matrix, traceable (`jit`,
    `grad` with respect to `logits`; shapes depend only on the logits' shape and the arguments).

    Combine weights: with `norm_topk` a softmax over the selected `k` logits (Mixtral; they sum to 1), without it
    the full softmax's probabilities of the selected experts (Switch). The routing is computed in at least
    float32 (Switch's selective precision: bfloat16 logits would round close probabilities together).

    Losses, both unweighted:

    * balance (Switch, eq. 4, read for top-k as Mixtral's / Hugging Face's `load_balancing_loss_func`):
      `E * sum_e f_e * P_e` with `f_e` the fraction of tokens whose top-k includes `e` (so `sum_e f_e = k`: the
      loss is `k`, not 1, at a uniform load) and `P_e` the mean over tokens of the full softmax's probability of
      `e`. `f_e` counts the assignments before any capacity drops them, as Switch does; only `P_e` carries a
      gradient.
    * z (ST-MoE, eq. 5): `mean_t logsumexp(logits_t)^2`, which keeps the logits small.

    With `capacity_factor`, expert `e` keeps at most `expert_capacity(capacity_factor, T, k, E) = ceil(
    capacity_factor * T * k / E)` of the tokens routed to it, the first ones in token order (Switch's priority,
    whatever rank `e` has among the token's `k`), and drops the rest: such a pair is not an entry of `combine`,
    its weight is 0 (the other experts' weights of that token are not renormalised: a residual connection carries
    what is missing, as in Switch), and `dropped` counts it. Without one, no pair is dropped (the matrix holds
    all `T * k` pairs).

    Args:
      logits: floating `(tokens, num_experts)`, the router's scores.
      top_k: experts per token, `1 <= top_k <= num_experts`.
      norm_topk: renormalise the weights over the selected experts (Mixtral) or keep the full softmax's (Switch).
      capacity_factor: None (dropless), or a positive factor of the mean load `T * k / E`.
      group_size: slots per group of `combine` (tokens of one expert per group: the expert kernels' row tile);
        None: `routed_group_size` (128 for large batches), else the device builder's rule for the capacity
        (`jinsum.formats.capacity_group_size`).

    Returns:
      A `Routing`.

    Example:
      >>> rng = np.random.default_rng(0)
      >>> x, router_weight = rng.normal(size=(16, 32)).astype(np.float32), rng.normal(size=(32, 8)).astype(np.float32)
      >>> routing = jax.jit(jinsum.nn.route_tokens, static_argnums=1)(x @ router_weight, 2)     # logits (T, E)
      >>> routing.combine.shape                                  # (E, T)
      (8, 16)
      >>> w = rng.normal(size=(8, 32, 48)).astype(np.float32)    # one (32, 48) matrix per expert
      >>> y = jinsum.nn.routed_linear(x, routing.combine, w)     # y_t = sum_e A[e, t] x_t W_e
      >>> loss = jnp.mean(y ** 2) + 0.01 * routing.balance_loss + 0.001 * routing.z_loss
    """
    logits = check_logits("route_tokens", logits)
    num_tokens, num_experts = logits.shape
    top_k = check_routing("route_tokens", num_experts, top_k, capacity_factor)
    capacity = num_tokens * top_k
    if capacity_factor is None:
        per_expert = None
    else:
        per_expert = expert_capacity(capacity_factor, num_tokens, top_k, num_experts)
        capacity = min(capacity, num_experts * per_expert)
    edges, values, experts, weights, balance_loss, z_loss, dropped = _routed_pairs(logits, top_k, norm_topk,
                                                                                   per_expert)
    if group_size is None:
        group_size = routed_group_size(capacity, num_experts)
    else:
        group_size = check_int("route_tokens", "group_size (or None for automatic)", group_size, minimum=1)
    combine = GroupCOO.from_edge_index(edges, values, num_nodes=(num_tokens, num_experts),
                                       capacity=capacity, group_size=group_size)
    return Routing(combine, experts, weights, balance_loss, z_loss, dropped)


@partial(jax.jit, static_argnums=(1, 2, 3))
def _routed_pairs(logits: jax.Array, top_k: int, norm_topk: bool, per_expert: int | None):
    """`route_tokens`' arrays before the builder, one compiled program (eagerly each operation would compile on its
    own): the `(2, T * k)` edges from tokens to experts (a dropped pair's token -1, padding) and their values, the
    experts and their weights `(T, k)` (0 where dropped), the two losses and the dropped count. `per_expert`: the
    capacity per expert, or None (dropless)."""
    experts, weights, selected, statistics = select_experts(logits, top_k, norm_topk)
    balance_loss, z_loss = routing_losses(*statistics)
    tokens = jnp.broadcast_to(jnp.arange(logits.shape[0], dtype=jnp.int32)[:, None], experts.shape)
    if per_expert is None:
        dropped = jnp.zeros((), jnp.int32)
    else:
        # Each pair's place among its expert's tokens, in token order: a running count down the token axis.
        place = jnp.cumsum(selected, axis=0) - 1
        kept = jnp.take_along_axis(place, experts, axis=-1) < per_expert
        dropped = jnp.sum(~kept, dtype=jnp.int32)
        weights = jnp.where(kept, weights, 0)
        tokens = jnp.where(kept, tokens, -1)  # a negative index is padding for the builder: not an entry
    # A[expert, token] = weight: edges from tokens (sources) to experts (destinations). The pairs are distinct,
    # so the builder's sum of duplicates never adds two of them, and no more than the capacity exist (no overflow).
    edges = jnp.stack([tokens.reshape(-1), experts.reshape(-1)])
    return edges, weights.reshape(-1), experts, weights, balance_loss, z_loss, dropped
