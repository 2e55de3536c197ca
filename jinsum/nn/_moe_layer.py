"""`MoE`: a mixture-of-experts MLP layer (Flax NNX) over `route_tokens` and `routed_mlp`, or with its experts split
over a mesh axis, `expert_parallel_mlp`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jinsum.formats._convert import check_int
from jinsum.nn._dtypes import check_dtypes, compute_dtype
from jinsum.nn._expert_parallel import devices_along, expert_parallel_mlp
from jinsum.nn._moe import ACTIVATIONS, routed_mlp
from jinsum.nn._routing import check_routing, route_tokens

# `nnx.Linear`'s kernel initialiser (LeCun normal) for a stack of expert matrices: fan-in is each matrix's own.
expert_kernel_init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))


class MoE(nnx.Module):
    """A sparse mixture-of-experts MLP: a linear router sends each token to `top_k` of `num_experts` expert MLPs,
    whose outputs are summed with the combine weights (Mixtral's block; Switch's with `top_k=1, norm_topk=False`).

    Routing and losses as `route_tokens`; the experts as `routed_mlp`: indirect Einsums over the routing matrix,
    so the work is the `T * k` routed rows (and each expert's last group's padding) whatever the load, and no token
    is dropped unless `capacity_factor` asks. With `mesh` and `axis`, the experts are split over that mesh axis
    and the tokens too (`expert_parallel_mlp`: each device routes its own tokens and sends each row to its expert's
    device and back with `all_to_all`; `capacity_factor` then bounds the rows one device sends another).

    `y, aux_loss = moe(x)`: `x` `(tokens, in_features)` or `(batch, length, in_features)`, `y` of its shape, and
    `aux_loss = balance_coef * balance_loss + z_coef * z_loss`, a scalar to add to the training loss (NNX style:
    returned, not stored on the module). `moe(x, return_routing=True)` returns `y, aux_loss, routing` with the
    `Routing` (the unweighted losses, the dropped count, the experts and weights of each token) to log.

    Parameters: `router` (an `nnx.Linear(in_features, num_experts, use_bias=False)`), `w_gate` and `w_up`
    `(num_experts, in_features, hidden_features)` and `w_down` `(num_experts, hidden_features, in_features)`,
    initialised as `nnx.Linear`'s kernels (LeCun normal, fan-in scaled: each expert's matrix on its own inputs).
    `w_gate` is None unless `activation="swiglu"`.

    Example:
      >>> moe = jinsum.nn.MoE(32, 64, num_experts=8, top_k=2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
      >>> x = jnp.ones((2, 8, 32))                               # (batch, length, in_features)
      >>> y, aux_loss = nnx.jit(lambda moe, x: moe(x))(moe, x)
      >>> y.shape, y.dtype, aux_loss.shape
      ((2, 8, 32), dtype(bfloat16), ())
      >>> loss = jnp.mean(y.astype(jnp.float32) ** 2) + aux_loss   # the task's loss plus the routing losses
      >>> mesh = jax.make_mesh((jax.device_count(),), ("x",))    # experts and tokens split over the devices
      >>> moe = jinsum.nn.MoE(32, 64, num_experts=8, top_k=2, mesh=mesh, axis="x", rngs=nnx.Rngs(0))
      >>> y, aux_loss = nnx.jit(lambda moe, x: moe(x))(moe, jnp.ones((16, 32)))   # (tokens, in_features)
      >>> y.shape
      (16, 32)
    """

    def __init__(self, in_features: int, hidden_features: int, num_experts: int, top_k: int, *,
                 activation: str = "swiglu", norm_topk: bool = True, capacity_factor: float | None = None,
                 balance_coef: float = 0.01, z_coef: float = 0.001, group_size: int | None = None, dtype=None,
                 param_dtype=jnp.float32, kernel_init=expert_kernel_init, mesh: Mesh | None = None,
                 axis: str | None = None, rngs: nnx.Rngs):
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
          dtype: the experts' computation dtype (inputs, weights and combine weights are cast to it, as
            `nnx.Linear` casts them; products accumulate as their statements do, in float32 for bfloat16); None:
            JAX's promotion of the input and the parameters (`jinsum.nn._dtypes`). The router always runs in at
            least float32.
          param_dtype: the parameters' dtype.
          kernel_init: the experts' initialiser, for `(E, fan_in, fan_out)` arrays.
          mesh, axis: split the experts and the tokens over this axis of this mesh (both or neither; the experts
            and each call's tokens must divide evenly); `group_size` is then each device's rule.
          rngs: draws the initial values.
        """
        where = "MoE"
        if activation not in ACTIVATIONS:
            raise ValueError(f"{where}: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        in_features = check_int(where, "in_features", in_features, minimum=1)
        hidden_features = check_int(where, "hidden_features", hidden_features, minimum=1)
        check_routing(where, num_experts, top_k, capacity_factor)
        check_dtypes(where, dtype, param_dtype)
        self.in_features, self.hidden_features = in_features, hidden_features
        self.num_experts, self.top_k, self.activation = num_experts, top_k, activation
        if (mesh is None) != (axis is None):
            raise ValueError(f"{where}: give both mesh and axis (expert parallelism) or neither, got mesh={mesh!r}, "
                             f"axis={axis!r}")
        if mesh is not None and num_experts % (devices := devices_along(where, mesh, axis)):
            raise ValueError(f"{where}: the {num_experts} experts must split evenly over the {devices} devices of "
                             f"axis {axis!r}; change num_experts or the mesh")
        self.norm_topk, self.capacity_factor, self.group_size = norm_topk, capacity_factor, group_size
        self.mesh, self.axis = mesh, axis
        self.balance_coef, self.z_coef, self.dtype = balance_coef, z_coef, dtype
        self.router = nnx.Linear(in_features, num_experts, use_bias=False, param_dtype=param_dtype, rngs=rngs)
        up, down = (num_experts, in_features, hidden_features), (num_experts, hidden_features, in_features)

        def experts(shape):
            value = kernel_init(rngs.params(), shape, param_dtype)
            # Each device holds its own experts' weights from the start: weights placed elsewhere would be split
            # again at every call (half of a Mixtral-like forward on two GPUs was such copies).
            return nnx.Param(value if mesh is None else jax.device_put(value, NamedSharding(mesh, P(axis))))

        self.w_gate = experts(up) if activation == "swiglu" else None
        self.w_up, self.w_down = experts(up), experts(down)

    def __call__(self, x: jax.Array, *, return_routing: bool = False):
        """`x` `(..., in_features)` -> `(y, aux_loss)`, or `(y, aux_loss, routing)` with `return_routing`."""
        if jnp.ndim(x) not in (2, 3) or jnp.shape(x)[-1] != self.in_features:
            raise ValueError(f"MoE: expected x of shape (tokens, {self.in_features}) or (batch, length, "
                             f"{self.in_features}) (in_features), got {jnp.shape(x)}")
        tokens = x.reshape(-1, self.in_features)
        # The router in at least float32 (Switch's selective precision), whatever the experts' dtype.
        tokens_router = tokens.astype(jnp.promote_types(tokens.dtype, jnp.float32))
        if self.mesh is None:
            logits = self.router(tokens_router)
        else:  # each device's tokens by the whole router: its gradient, summed over the tokens, adds the devices'
            # parts (outside `shard_map`, a mesh of explicit axes cannot tell that sum's sharding and raises)
            split = P(self.axis)
            logits = jax.shard_map(lambda t, w: t @ w, mesh=self.mesh, in_specs=(split, P()), out_specs=split)(
                jax.reshard(tokens_router, NamedSharding(self.mesh, split)), self.router.kernel[...])
        weights = [w[...] for w in (self.w_up, self.w_down, *(() if self.w_gate is None else (self.w_gate,)))]
        dtype = compute_dtype(self.dtype, x, *weights)
        w_up, w_down = self.w_up[...].astype(dtype), self.w_down[...].astype(dtype)
        w_gate = None if self.w_gate is None else self.w_gate[...].astype(dtype)
        if self.mesh is not None:
            y, routing = expert_parallel_mlp(tokens.astype(dtype), logits, self.top_k, w_up, w_down, w_gate=w_gate,
                                             activation=self.activation, norm_topk=self.norm_topk,
                                             capacity_factor=self.capacity_factor, mesh=self.mesh, axis=self.axis)
        else:
            routing = route_tokens(logits, self.top_k, norm_topk=self.norm_topk,
                                   capacity_factor=self.capacity_factor, group_size=self.group_size)
            y = routed_mlp(tokens.astype(dtype), routing.combine.astype(dtype), w_up, w_down, w_gate=w_gate,
                           activation=self.activation)
        aux_loss = self.balance_coef * routing.balance_loss + self.z_coef * routing.z_loss
        if self.mesh is not None and jnp.ndim(x) == 3:  # (tokens come back split over the axis, which a batch
            y = jax.reshard(y, NamedSharding(self.mesh, P()))  # and length need not divide: gathered, as x was)
        y = y.reshape(*x.shape[:-1], self.in_features)
        return (y, aux_loss, routing) if return_routing else (y, aux_loss)

