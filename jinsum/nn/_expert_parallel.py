"""Expert parallelism: a mixture of experts whose experts are split over a mesh axis, and whose tokens travel to
their experts' devices and back with `all_to_all` (GShard, Switch), inside one `jax.shard_map`.

The tokens are split over the same axis (data parallel). Each device routes its own tokens (`select_experts`; the
losses' statistics averaged over the axis, so they are the whole batch's), then, for every destination device, packs
the rows of the (token, expert) pairs bound there into a send buffer of a static `capacity` rows:

    send[d * capacity + place] = x[token]      place: the pair's rank among this device's pairs bound to device d

One `all_to_all` delivers each device the rows sent to it, which its local experts run as `routed_mlp` does (a
routing `GroupCOO` (local experts x received rows) built on the device, the grouped statements over it); a second
`all_to_all` returns the results to the devices the rows came from, where each token sums its pairs' results
weighted by its combine weights. Gradients run the same way back (`all_to_all` is its own transpose).

Static shapes need a capacity per destination: dropless (`capacity_factor=None`) reserves every pair a device
routes (`T_local * k` rows per destination, the worst case of all pairs bound to one device: memory `D` times the
dropless layer's); with a factor, `ceil(capacity_factor * T_local * k / D)` rows (the mean load times the factor),
and the pairs past it, in token order, are dropped and counted as `route_tokens` drops them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jinsum import _config
from jinsum.formats import GroupCOO
from jinsum.nn._moe import routed_mlp
from jinsum.nn._routing import (Routing, check_logits, check_routing, routed_group_size, routing_losses,
                                select_experts)


def destination_capacity(capacity_factor: float | None, local_tokens: int, top_k: int, devices: int) -> int:
    """Rows one device sends another at most: every pair it routes (`capacity_factor=None`), else
    `ceil(capacity_factor * local_tokens * top_k / devices)`, at most that."""
    pairs = local_tokens * top_k
    return pairs if capacity_factor is None else min(pairs, math.ceil(capacity_factor * pairs / devices))


def devices_along(where: str, mesh: Mesh, axis: str) -> int:
    """The number of devices along `mesh`'s `axis`; a `ValueError` naming the mesh's axes if it has none such."""
    if axis not in mesh.axis_names:
        raise ValueError(f"{where}: axis {axis!r} is not an axis of the mesh, whose axes are {mesh.axis_names}")
    return mesh.shape[axis]


def expert_parallel_mlp(x: jax.Array, logits: jax.Array, top_k: int, w_up: jax.Array, w_down: jax.Array, *,
                        mesh: Mesh, axis: str, w_gate: jax.Array | None = None, activation: str = "swiglu",
                        norm_topk: bool = True, capacity_factor: float | None = None) -> tuple[jax.Array, Routing]:
    """`routed_mlp(x, route_tokens(logits, top_k).combine, ...)` with the experts split over `mesh`'s `axis`.

    Args:
      x: `(tokens, c)`, split by tokens over `axis` (each device routes its own).
      logits: `(tokens, num_experts)`, the router's scores, split like `x`.
      top_k: experts per token.
      w_up, w_gate, w_down: `(num_experts, c, hidden)` (`w_gate` for SwiGLU only) and `(num_experts, hidden,
        c_out)`, split by experts over `axis`: device `i` holds experts `[i * E / D, (i + 1) * E / D)`.
      mesh, axis: the mesh and the axis the tokens and experts are split over (`D` devices along it).
      activation, norm_topk: as `routed_mlp` and `route_tokens`.
      capacity_factor: None (no pair dropped) or the rows each device sends another as a factor of the mean load
        (see the module's docstring).

    Returns:
      `(y, routing)`: `y` `(tokens, c_out)` split like `x`, and a `Routing` without `combine` (None: each device
      builds its own), with each token's `experts` and `weights` (0 where the pair was dropped), the whole batch's
      `balance_loss` and `z_loss`, and `dropped`, the pairs left out over all devices.

    Example:
      >>> rng = np.random.default_rng(0)
      >>> x, w_router = rng.normal(size=(16, 32)).astype(np.float32), rng.normal(size=(32, 8)).astype(np.float32)
      >>> w_up, w_gate, w_down = (rng.normal(size=s).astype(np.float32) for s in ((8, 32, 64),) * 2 + ((8, 64, 32),))
      >>> mesh = jax.make_mesh((jax.device_count(),), ("x",))     # 8 experts and 16 tokens split over the devices
      >>> mlp = jax.jit(lambda x, logits, w_up, w_down, w_gate: jinsum.nn.expert_parallel_mlp(
      ...     x, logits, 2, w_up, w_down, w_gate=w_gate, mesh=mesh, axis="x"))
      >>> y, routing = mlp(x, x @ w_router, w_up, w_down, w_gate)
      >>> y.shape, routing.experts.shape
      ((16, 32), (16, 2))
    """
    where = "expert_parallel_mlp"
    devices = devices_along(where, mesh, axis)
    logits = check_logits(where, logits)
    num_tokens, num_experts = logits.shape
    top_k = check_routing(where, num_experts, top_k, capacity_factor)
    if x.ndim != 2 or x.shape[0] != num_tokens:
        raise ValueError(f"{where}: expected x of shape (tokens, features) with tokens = {num_tokens} (the logits' "
                         f"rows), got {tuple(x.shape)}")
    if num_experts % devices or num_tokens % devices:
        raise ValueError(f"{where}: the {num_experts} experts and the {num_tokens} tokens must each split evenly "
                         f"over the {devices} devices of axis {axis!r}; pad the batch or change the mesh")
    capacity = destination_capacity(capacity_factor, num_tokens // devices, top_k, devices)
    local_experts = num_experts // devices
    weights_in = (w_up, w_down) + (() if w_gate is None else (w_gate,))

    def body(x, logits, w_up, w_down, *gate):
        experts, weights, _, statistics = select_experts(logits, top_k, norm_topk)
        balance_loss, z_loss = routing_losses(*jax.lax.pmean(statistics, axis))
        # Each pair's place among this device's pairs bound to the same device: a running count in (token, rank)
        # order, so a capacity keeps the earliest tokens.
        destination = (experts // local_experts).reshape(-1)
        place = jnp.take_along_axis(jnp.cumsum(jax.nn.one_hot(destination, devices, dtype=jnp.int32), axis=0) - 1,
                                    destination[:, None], axis=1)[:, 0]
        kept = place < capacity
        rows = devices * capacity
        slot = jnp.where(kept, destination * capacity + place, rows)  # (rows: past the buffer, dropped)
        token = jnp.arange(destination.size, dtype=jnp.int32) // top_k
        sent_token = jnp.full(rows, -1, jnp.int32).at[slot].set(token, mode="drop")
        sent = jnp.where(sent_token[:, None] >= 0, x[jnp.maximum(sent_token, 0)], 0)
        sent_expert = jnp.full(rows, -1, jnp.int32).at[slot].set(experts.reshape(-1) % local_experts, mode="drop")
        received = jax.lax.all_to_all(sent, axis, 0, 0, tiled=True)  # rows [j * capacity, ...): from device j
        expert = jax.lax.all_to_all(sent_expert, axis, 0, 0, tiled=True)
        combine = _local_routing(expert, local_experts, x.dtype)
        out = routed_mlp(received, combine, w_up, w_down, w_gate=gate[0] if gate else None, activation=activation)
        returned = jax.lax.all_to_all(out, axis, 0, 0, tiled=True)  # row `slot` of each pair: its result
        weights = jnp.where(kept.reshape(weights.shape), weights, 0)
        results = returned.at[slot].get(mode="fill", fill_value=0).reshape(*experts.shape, -1)
        y = jnp.einsum("tk,tkn->tn", weights.astype(results.dtype), results)
        dropped = jax.lax.psum(jnp.sum(~kept, dtype=jnp.int32), axis)
        return y, experts, weights, balance_loss, z_loss, dropped

    split = P(axis)
    sharded = jax.shard_map(body, mesh=mesh, in_specs=(split,) * (2 + len(weights_in)),
                            out_specs=(split, split, split, P(), P(), P()))
    # (split by the first axis wherever they live: a mesh of explicit axes takes no implicit resharding)
    inputs = [jax.reshard(a, NamedSharding(mesh, split)) for a in (x, logits, *weights_in)]
    y, experts, weights, balance_loss, z_loss, dropped = sharded(*inputs)
    return y, Routing(None, experts, weights, balance_loss, z_loss, dropped)


def _local_routing(expert: jax.Array, local_experts: int, dtype) -> GroupCOO:
    """The local experts on the rows received: `(local_experts, rows)`, one entry of value 1 per filled row.

    Most of the buffer is empty (dropless: `D` times the rows a device routes). Its empty rows (expert -1) go to
    one more expert past the last, with value 0, and so do the builder's padding groups (the last row's): a row
    out of the weights' range, so the grouped kernels skip those groups (no matrix selected, no product) and the
    weight gradient's programs, one per expert, never see them; the XLA lowering reads zeros there and drops the
    writes. Under `jinsum.check_indices` (which would report that row as out of range) the empty rows are left
    out instead, and the padding groups compute the last expert's products of zeros.
    """
    rows, filled = expert.shape[0], expert >= 0
    received = jnp.arange(rows, dtype=jnp.int32)
    if _config.check_indices.value:  # the empty rows left out (-1)
        edges, experts = jnp.stack([jnp.where(filled, received, -1), expert]), local_experts
    else:  # the empty rows on the expert past the last
        edges, experts = jnp.stack([received, jnp.where(filled, expert, local_experts)]), local_experts + 1
    built = GroupCOO.from_edge_index(edges, filled.astype(dtype), num_nodes=(rows, experts), capacity=rows,
                                     group_size=routed_group_size(rows, local_experts))
    return GroupCOO.from_validated(Ai=built.Ai, Ak=built.Ak, Av=built.Av, shape=(local_experts, rows),
                                   nnz=built.nnz)
