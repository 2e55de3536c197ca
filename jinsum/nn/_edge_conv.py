"""Edge convolution (Wang et al., 2019, "Dynamic Graph CNN"): a maximum of edge messages over each node's in-edges."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

import jinsum
from jinsum.formats import GroupCOO
from jinsum.nn._dtypes import check_dtypes, compute_dtype, promote
from jinsum.nn._graph import aggregate_extreme, expect_adjacency
from jinsum.nn._sizes import layer_sizes
from jinsum.shard import Partitioned, per_part


class EdgeConv(nnx.Module):
    """`out_i = max_{j -> i} h([x_i, x_j - x_i])` (PyG's `EdgeConv` with `aggr="max"`); 0 for nodes without in-edges.

    With the default `h`, a linear layer `W [x_i, x_j - x_i] + b = (W_1 - W_2) x_i + b + W_2 x_j`, the maximum over
    `j` only involves `W_2 x_j`: the layer is two dense products and one max aggregation over the adjacency,
    `C[Ai[g],n] max= H[Ak[g,p],n]`, with no per-edge work at all. Any other `h` (an MLP, given as `nn`) runs per
    stored edge: the endpoints' features gathered into `(G, P, F)` slots, `h` on them, and the maximum over each
    row's slots, `C[Ai[g],n] max= M[g,p,n]` (group padding left out). Either way the gradient goes to each output
    element's first maximal edge. Edge values are ignored.

    Shapes: `x` `(N, in_features)`, `A` `(N, N)` with `A[dst, src] != 0` for each edge -> `(N, out_features)`.
    `A` may be a `jinsum.shard` partition, `x` then laid out by it.

    Example:
      >>> edge_index, x = np.array([[0, 1, 2, 3], [1, 2, 3, 0]]), jnp.ones((4, 16))   # a ring of 4 nodes
      >>> A = jinsum.graphs.adjacency(edge_index, num_nodes=4)
      >>> conv = jinsum.nn.EdgeConv(16, 32, rngs=nnx.Rngs(0))         # h = Linear(32 -> 32)
      >>> conv(x, A).shape
      (4, 32)
      >>> rngs = nnx.Rngs(1)
      >>> mlp = nnx.Sequential(nnx.Linear(32, 64, rngs=rngs), nnx.relu, nnx.Linear(64, 32, rngs=rngs))
      >>> jinsum.nn.EdgeConv(16, 32, nn=mlp, rngs=rngs)(x, A).shape   # per-edge messages
      (4, 32)
    """

    def __init__(self, in_features: int, out_features: int, *, nn: Callable[[jax.Array], jax.Array] | None = None,
                 use_bias: bool = True, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        """Creates the parameters.

        Args:
          in_features: feature size `F` of the input.
          out_features: feature size of the output (of `nn`'s output, if given).
          nn: the message function `h`, from `(..., 2 F)` to `(..., out_features)`; defaults to a linear layer. A
            given `nn` computes by its own `dtype` (build it with the layer's for one dtype throughout).
          use_bias: the default linear layer's bias (ignored with `nn`).
          dtype: the computation's dtype (features and the default layer's weights are cast to it, as
            `nnx.Linear` casts them; with `nn`, its input and its messages); None: JAX's promotion of the input
            and the parameters (`jinsum.nn._dtypes`; with `nn`, the input's dtype and `nn`'s messages as they
            come).
          param_dtype: the default layer's parameters' dtype.
          rngs: initialises the default layer.
        """
        self.in_features, self.out_features = layer_sizes("EdgeConv", in_features=in_features,
                                                          out_features=out_features)
        if nn is not None and not callable(nn):
            raise TypeError(f"EdgeConv: nn must be callable (a module such as nnx.Sequential), got {type(nn).__name__}")
        check_dtypes("EdgeConv", dtype, param_dtype)
        self.nn = nn if nn is not None else nnx.Linear(2 * self.in_features, self.out_features, use_bias=use_bias,
                                                       dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.linear, self.dtype = nn is None, dtype

    def __call__(self, x: jax.Array, A: GroupCOO) -> jax.Array:
        """`x` `(N, in_features)`, `A` a `GroupCOO` `(N, N)` -> `(N, out_features)`."""
        expect_adjacency("EdgeConv", A, x, in_features=self.in_features)
        if self.linear:
            kernel = self.nn.kernel[...]
            dtype = compute_dtype(self.dtype, x, kernel)
            x = jnp.asarray(x, dtype)
            center, neighbor = kernel[: self.in_features], kernel[self.in_features:]
            root = x @ (center - neighbor).astype(dtype)  # (the difference in the parameters' precision)
            if self.nn.bias is not None:
                root = root + self.nn.bias[...].astype(dtype)
            largest = aggregate_extreme(A, x @ neighbor.astype(dtype), empty=None)
            return jnp.where(largest == -jnp.inf, 0, root + largest)
        (x,) = promote(self.dtype, x)
        if isinstance(A, Partitioned):  # each device over its parts, `nn`'s parameters replicated
            graphdef, state = nnx.split(self.nn)

            def on_part(part, x_dst, x_src, state, out=None):
                return largest_message(part, x_dst, x_src, nnx.merge(graphdef, state), out, dtype=self.dtype)

            out = per_part(on_part, A, rows=(x,), columns=(x,), replicated=(state,))
        else:
            out = largest_message(A, x, x, self.nn, dtype=self.dtype)
        return jnp.where(out == -jnp.inf, 0, out)


def largest_message(A: GroupCOO, x_dst: jax.Array, x_src: jax.Array, nn, out: jax.Array | None = None, *,
                    dtype=None) -> jax.Array:
    """`max_{j -> i} nn([x_i, x_j - x_i])` over the stored entries of `A` (rows `x_dst`, columns `x_src`), -inf where
    a row has none; with `out`, its elements take part too. `dtype`: the messages' (as `edge_messages`)."""
    messages = edge_messages(A, x_dst, x_src, nn, padding=-jnp.inf, dtype=dtype)  # group padding takes no part
    if out is None:
        out = jax.ShapeDtypeStruct((x_dst.shape[0], messages.shape[-1]), messages.dtype)
    return jinsum.einsum("C[Ai[g],n] max= M[g,p,n]", A=A, M=messages, C=out)


def edge_messages(A: GroupCOO, x_dst: jax.Array, x_src: jax.Array, nn, padding: float, dtype=None) -> jax.Array:
    """EdgeConv's messages `nn([x_i, x_j - x_i])` `(G, P, F')` in the slots of `A`'s stored entries `(g, p)` (row
    `i = Ai[g]` of `x_dst`, column `j = Ak[g, p]` of `x_src`), `padding` in group padding's slots; cast to `dtype`
    where given (the layer's: `nn` computes by its own), as they come from `nn` where None."""
    G, P = A.Ak.shape
    center = jnp.broadcast_to(x_dst[A.Ai][:, None, :], (G, P, x_dst.shape[1]))
    neighbor = jinsum.einsum("M[g,p,n] = X[Ak[g,p],n]", M=jax.ShapeDtypeStruct((G, P, x_src.shape[1]), x_src.dtype),
                             X=x_src, A=A)
    messages = nn(jnp.concatenate([center, neighbor - center], axis=-1))
    if dtype is not None:
        messages = messages.astype(dtype)
    return jnp.where((A.Av != 0)[:, :, None], messages, padding)
